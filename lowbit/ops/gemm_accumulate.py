"""lowbit.ops.gemm_accumulate: c + (a_scale_inv * a) @ (b_scale_inv * b)^T written over c,
through lowbit_gemm_accumulate (csrc/gemm/gemm.h, "Accumulation into out"; cuBLASLt's beta = 1).

It is how a GEMM split along K adds its parts without a second (M, N) buffer: the custom
call's c operand is aliased to its output, so XLA runs it in c's buffer (lowbit.dense's
Float8BlockScaling backward runs its wgrad so, one launch per band of tokens).

Operands as lowbit.ops.gemm's 2-D form: a (M, K) and b (N, K) FP8 (not both E5M2), per-tensor
((1,) f32 scale_invs) or FP8 block / MXFP8 scale modes (the 2-D arrays of gemm's docstring); c
(M, N) bf16, f16 or f32, which is also the output's dtype. No bias. Values: y = the GEMM's fp32
result (as lowbit_gemm computes it, before its rounding to the output type), then
out = fl(y + c) rounded to c's dtype: on the CPU exactly that (the reference's sums); on CUDA
cuBLASLt's epilogue where the custom call applies (FP8 operands, N a multiple of 16, and for
block modes also M, with a cuBLASLt path for the mode pair on this device; K is zero-padded to
16 where needed), else the same formula through lowbit.ops.gemm with an f32 output and an f32
add (a separate (M, N) f32 buffer then). Single device: no sharding rule (under jit with
sharded operands XLA replicates the call); vmap maps it with lax.map.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.gemm import _check_scale_modes, gemm_p
from lowbit.ops.gemm_args import _scale_arg
from lowbit.ops.gemm_config import (FP8, FP8_DIM_MULTIPLE, MXFP8_K_MULTIPLE, OUT, GemmScaleMode, _checked_algo,
                                    _cublaslt_block_ready, algo_kind, block_on_cublaslt, kind_algo)
from lowbit.ops.gemm_scales import gemm_workspace_bytes

__all__ = ["gemm_accumulate"]

OP = "lowbit.ops.gemm_accumulate"
_gemm_module = importlib.import_module("lowbit.ops.gemm")  # its _cuda_capability, read per lowering
_ATTRS = ("use_split_accumulator", "a_scale_mode", "b_scale_mode", "algo", "algo_or_first")


def _abstract(a, b, a_scale_inv, b_scale_inv, c, **params):
    del a, b, a_scale_inv, b_scale_inv, params
    return jax.core.ShapedArray(c.shape, c.dtype)


gemm_accumulate_p = ffi_primitive("lowbit_gemm_accumulate", "lowbit_gemm_accumulate", _abstract, attrs=_ATTRS)
# c (operand 4) is the output's buffer; the workspace is the call's second result.
_ffi_lowering = jax.ffi.ffi_lowering("lowbit_gemm_accumulate", operand_output_aliases={4: 0})


def _attrs(params):
    return dict(use_split_accumulator=bool(params["use_split_accumulator"]),
                a_scale_mode=np.int32(params["a_scale_mode"]), b_scale_mode=np.int32(params["b_scale_mode"]),
                algo=np.int32(params["algo"]), algo_or_first=bool(params["algo_or_first"]))


def _emit(ctx, args, workspace_bytes, params):
    (out_aval,) = ctx.avals_out
    workspace = jax.core.ShapedArray((workspace_bytes,), jnp.uint8)
    out, _ = _ffi_lowering(ctx.replace(avals_out=[out_aval, workspace]), *args, **_attrs(params))
    return [out]


def _cpu_lowering(ctx, *args, **params):
    _ffi.require_platform("lowbit_gemm_accumulate", "cpu")
    return _emit(ctx, args, 0, params)


def _separate(a, b, sa, sb, c, **params):
    """The op's formula through lowbit_gemm (an f32 output; its CUDA lowering pads or emulates
    what cuBLASLt does not take as it is) and an f32 add; with K = 0 the GEMM is +0 (the CUDA
    handler takes no empty K)."""
    if a.shape[1] == 0:
        return (jnp.zeros(c.shape, jnp.float32) + c.astype(jnp.float32)).astype(c.dtype)
    y = gemm_p.bind(a, b, sa, sb, jnp.zeros((0,), jnp.float32), out_dtype=jnp.dtype(jnp.float32), **_attrs(params))
    return (y + c.astype(jnp.float32)).astype(c.dtype)


def _padded_k(a, b, sa, sb, c, **params):
    """The custom call on a and b zero-padded along K to a multiple of 16 (zero terms leave
    every sum unchanged; a 16-padding adds no 128-block, so the block scale arrays stay)."""
    pad = (-a.shape[1]) % FP8_DIM_MULTIPLE
    a, b = jnp.pad(a, ((0, 0), (0, pad))), jnp.pad(b, ((0, 0), (0, pad)))
    return gemm_accumulate_p.bind(a, b, sa, sb, c, **params)


def _cuda_lowering(ctx, a, b, sa, sb, c, **params):
    """The custom call where cuBLASLt takes the problem as it is; K padded to 16 where only K
    is off (_padded_k, which comes back here); else the separate GEMM and add (_separate)."""
    (m, k), n = ctx.avals_in[0].shape, ctx.avals_in[1].shape[0]
    modes = (GemmScaleMode(int(params["a_scale_mode"])), GemmScaleMode(int(params["b_scale_mode"])))
    mxfp8 = modes[0] == GemmScaleMode.MXFP8
    if modes[0] == GemmScaleMode.TENSOR:
        ready = n % FP8_DIM_MULTIPLE == 0
    else:
        ready = (block_on_cublaslt(modes, _gemm_module._cuda_capability())
                 and _cublaslt_block_ready(m, n, FP8_DIM_MULTIPLE, 0, mxfp8, ctx.avals_in[4].dtype))
    if not ready or not (m and n and k) or (mxfp8 and k % MXFP8_K_MULTIPLE):
        return mlir.lower_fun(functools.partial(_separate, **params), multiple_results=False)(ctx, a, b, sa, sb, c)
    if k % FP8_DIM_MULTIPLE:
        return mlir.lower_fun(functools.partial(_padded_k, **params), multiple_results=False)(ctx, a, b, sa, sb, c)
    _ffi.require_platform("lowbit_gemm_accumulate", "cuda")
    return _emit(ctx, (a, b, sa, sb, c), gemm_workspace_bytes(modes[0], m, n, k), params)


mlir.register_lowering(gemm_accumulate_p, _cpu_lowering, platform="cpu")
mlir.register_lowering(gemm_accumulate_p, _cuda_lowering, platform="cuda")


def _batch(args, dims, **params):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
    return jax.lax.map(lambda xs: gemm_accumulate_p.bind(*xs, **params), tuple(args)), 0


batching.primitive_batchers[gemm_accumulate_p] = _batch


def gemm_accumulate(c, a, b, a_scale_inv=None, b_scale_inv=None, *, use_split_accumulator: bool = True,
                    a_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR,
                    b_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR, algo: int | None = None) -> jax.Array:
    """c + (a_scale_inv * a) @ (b_scale_inv * b)^T in c's dtype, for FP8 a (M, K), b (N, K) and
    c (M, N) (see the module docstring for the values). Under jit, when c is not used
    afterwards, XLA writes the result over c's buffer. `algo`: as lowbit.ops.gemm's."""
    a, b, c = jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{OP}: b: expected a (M, K) and b (N, K), got {a.shape} and {b.shape}")
    if a.dtype not in FP8 or b.dtype not in FP8:
        raise TypeError(f"{OP}: a: expected FP8 operands, got {a.dtype} and {b.dtype}")
    if a.dtype == b.dtype == jnp.float8_e5m2:
        raise TypeError(f"{OP}: b: float8_e5m2 x float8_e5m2 has no FP8 GEMM; quantize one operand to float8_e4m3fn")
    if c.shape != (a.shape[0], b.shape[0]) or c.dtype not in OUT:
        raise ValueError(f"{OP}: c: expected ({a.shape[0]}, {b.shape[0]}) bf16, f16 or f32, got {c.shape} {c.dtype}")
    try:  # lowbit.ops.gemm's checks, named after this op
        a_mode, b_mode = _check_scale_modes(a_scale_mode, b_scale_mode, a.dtype)
        sa = _scale_arg("a_scale_inv", a_scale_inv, a_mode, a.shape[0], a.shape[1])
        sb = _scale_arg("b_scale_inv", b_scale_inv, b_mode, b.shape[0], b.shape[1])
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("lowbit.ops.gemm:", f"{OP}:", 1)) from None
    split = True if a_mode != GemmScaleMode.TENSOR else bool(use_split_accumulator)
    algo, or_first = (_checked_algo(OP, algo) if algo is not None
                      else kind_algo(algo_kind(a.dtype, a_mode, split, c.dtype)))
    return gemm_accumulate_p.bind(a, b, sa, sb, c, use_split_accumulator=split, a_scale_mode=int(a_mode),
                                  b_scale_mode=int(b_mode), algo=int(algo), algo_or_first=bool(or_first))
