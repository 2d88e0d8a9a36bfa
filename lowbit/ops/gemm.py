"""lowbit.ops.gemm: out = (a_scale_inv * a) @ (b_scale_inv * b)^T + bias through lowbit_gemm.

Layout: a is (..., K) (leading dims flattened into M), b is (N, K), out is (..., N): both
operands K-major, the one layout the C++ op takes (csrc/gemm/gemm.h); callers with other
layouts transpose first. Types: a and b both FP8 (not both E5M2), both bf16 or both f16;
out bf16, f16 or f32 (with 16-bit inputs: the input type or f32); bias (N,) in the out type.
Accumulation is fp32; the CPU handler sums each dot product in increasing k order (exact
products), the CUDA handler is cuBLASLt (`use_split_accumulator=False` selects Hopper's
faster, less precise FP8 accumulation).

FP8 on cuBLASLt needs K and N to be multiples of 16: the CUDA lowering zero-pads K and N
(zero terms leave every sum unchanged) and slices the result; the CPU handler takes any shape.

Workspace: the lowbit_gemm custom call has a second result, a u8 workspace that XLA's buffer
assignment plans like any temp (XLA's FFI scratch allocator hands out nothing in jax 0.11):
GEMM_WORKSPACE_BYTES on CUDA, 0 bytes on the CPU. It exists only in the lowering rules
(`_lower_with_workspace`): gemm_p itself has one result, so abstract evaluation, batching
and partitioning never see it; it is never sharded (each device's custom call gets its own).

Sharding (Shardy rule + custom_partitioning): leading dims of a sharded -> each device
multiplies its rows (data parallel); N sharded (b's rows, column-parallel TP) -> out's last
dim and bias sharded alike; K sharded in both operands (row-parallel TP) -> each device
computes its partial product in fp32, a psum over the K axes sums them, then bias is added
once and the sum is rounded to out_dtype. No other collective is inserted by the op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive

OP = "lowbit.ops.gemm"
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_DIM_MULTIPLE = 16  # kFp8DimMultiple in csrc/gemm/gemm.h
GEMM_WORKSPACE_BYTES = (32 << 20) + 256  # kGemmWorkspaceBytes in csrc/gemm/gemm.h


def _abstract(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator):
    del a_scale_inv, b_scale_inv, bias, use_split_accumulator
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), out_dtype)


# a (M, K), b (N, K), a_scale_inv (1,), b_scale_inv (1,), bias (N,) or (0,) -> (M, N).
# The custom call's second result (the workspace) is added by the lowering rules below.
gemm_p = ffi_primitive("lowbit_gemm", "lowbit_gemm", _abstract, attrs=("use_split_accumulator",))
_ffi_lowering = jax.ffi.ffi_lowering("lowbit_gemm")


def _lower_with_workspace(ctx, a, b, a_scale_inv, b_scale_inv, bias, *, workspace_bytes,
                          use_split_accumulator):
    """Emits lowbit_gemm with results (out, workspace u8[workspace_bytes]); returns out."""
    (out_aval,) = ctx.avals_out
    workspace = jax.core.ShapedArray((workspace_bytes,), jnp.uint8)
    out, _ = _ffi_lowering(ctx.replace(avals_out=[out_aval, workspace]), a, b, a_scale_inv,
                           b_scale_inv, bias, use_split_accumulator=use_split_accumulator)
    return [out]


def _cpu_lowering(ctx, *args, out_dtype, use_split_accumulator):
    del out_dtype
    _ffi.require_platform("lowbit_gemm", "cpu")
    return _lower_with_workspace(ctx, *args, workspace_bytes=0,
                                 use_split_accumulator=use_split_accumulator)


mlir.register_lowering(gemm_p, _cpu_lowering, platform="cpu")


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def gemm_padded(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator):
    """gemm_p with K and N zero-padded to multiples of 16 and the result sliced back."""
    (m, k), n = a.shape, b.shape[0]
    kp, np_ = _round_up(k, FP8_DIM_MULTIPLE), _round_up(n, FP8_DIM_MULTIPLE)
    a = jnp.pad(a, ((0, 0), (0, kp - k)))
    b = jnp.pad(b, ((0, np_ - n), (0, kp - k)))
    if bias.shape[0]:
        bias = jnp.pad(bias, (0, np_ - n))
    out = gemm_p.bind(a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dtype,
                      use_split_accumulator=use_split_accumulator)
    return out[:m, :n]


def _cuda_lowering(ctx, a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator):
    a_aval, b_aval = ctx.avals_in[0], ctx.avals_in[1]
    k, n = a_aval.shape[1], b_aval.shape[0]
    if a_aval.dtype in FP8 and (k % FP8_DIM_MULTIPLE or n % FP8_DIM_MULTIPLE):
        padded = functools.partial(gemm_padded, out_dtype=out_dtype,
                                   use_split_accumulator=use_split_accumulator)
        return mlir.lower_fun(padded, multiple_results=False)(ctx, a, b, a_scale_inv, b_scale_inv, bias)
    _ffi.require_platform("lowbit_gemm", "cuda")
    m = ctx.avals_out[0].shape[0]
    workspace_bytes = GEMM_WORKSPACE_BYTES if m and n else 0  # the handler returns early on empty
    return _lower_with_workspace(ctx, a, b, a_scale_inv, b_scale_inv, bias,
                                 workspace_bytes=workspace_bytes,
                                 use_split_accumulator=use_split_accumulator)


mlir.register_lowering(gemm_p, _cuda_lowering, platform="cuda")


def _gemm_2d(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_split_accumulator):
    """a (..., K) -> (..., N) through one gemm_p call on a flattened to (M, K)."""
    lead = a.shape[:-1]
    out = gemm_p.bind(a.reshape(-1, a.shape[-1]), b, a_scale_inv, b_scale_inv, bias,
                      out_dtype=out_dtype, use_split_accumulator=np.bool_(use_split_accumulator))
    return out.reshape(*lead, b.shape[0])


def _gemm_p_batch(args, dims, *, out_dtype, use_split_accumulator):
    a, b, sa, sb, bias = args
    da, *rest = dims
    if all(d is None for d in rest):  # only a batched: fold the batch into M
        a = jnp.moveaxis(a, da, 0)
        return _gemm_2d(a, b, sa, sb, bias, out_dtype, use_split_accumulator), 0
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
    out = jax.lax.map(
        lambda xs: gemm_p.bind(*xs, out_dtype=out_dtype, use_split_accumulator=use_split_accumulator),
        tuple(args))
    return out, 0


batching.primitive_batchers[gemm_p] = _gemm_p_batch


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _padded_spec(sharding, ndim: int) -> list:
    spec = list(sharding.spec) if isinstance(sharding, NamedSharding) else []
    return spec + [None] * (ndim - len(spec))


@functools.lru_cache(maxsize=None)
def _make_gemm(out_dtype: np.dtype, use_split_accumulator: bool, has_bias: bool):
    """The partitioned, vmappable gemm for one static configuration; args (a, b, sa, sb[, bias])."""

    def local(a, b, sa, sb, *bias):
        bias_arr = bias[0] if has_bias else jnp.zeros((0,), out_dtype)
        return _gemm_2d(a, b, sa, sb, bias_arr, out_dtype, use_split_accumulator)

    def local_k_sharded(k_axes):
        def lower(a, b, sa, sb, *bias):
            empty = jnp.zeros((0,), jnp.float32)
            acc = _gemm_2d(a, b, sa, sb, empty, jnp.dtype(jnp.float32), use_split_accumulator)
            acc = jax.lax.psum(acc, k_axes)
            if has_bias:
                acc = acc + bias[0].astype(jnp.float32)
            return acc.astype(out_dtype)
        return lower

    partitioned = custom_partitioning(local)

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        a_ndim = len(arg_shapes[0].shape)
        a_spec = _padded_spec(arg_shapes[0].sharding, a_ndim)
        b_spec = _padded_spec(arg_shapes[1].sharding, 2)
        m_axes = [_spec_axes(e) for e in a_spec[:-1]]
        used = {ax for axes in m_axes for ax in axes}
        n_axes = tuple(ax for ax in _spec_axes(b_spec[0]) if ax not in used)
        n_axes = n_axes if len(n_axes) == len(_spec_axes(b_spec[0])) else ()
        used |= set(n_axes)
        ka, kb = _spec_axes(a_spec[-1]), _spec_axes(b_spec[1])
        k_axes = ka or kb
        if (ka and kb and ka != kb) or any(ax in used for ax in k_axes):
            k_axes = ()
        ns = lambda *entries: NamedSharding(mesh, PartitionSpec(*entries))
        arg_shardings = [
            ns(*[_entry(axes) for axes in m_axes], _entry(k_axes)),
            ns(_entry(n_axes), _entry(k_axes)),
            ns(None),
            ns(None),
        ]
        if has_bias:
            arg_shardings.append(ns(_entry(n_axes)))
        out_sharding = ns(*[_entry(axes) for axes in m_axes], _entry(n_axes))
        lower = local_k_sharded(k_axes) if k_axes else local
        return mesh, lower, out_sharding, tuple(arg_shardings)

    def rule(mesh, value_types, result_types):
        del mesh, result_types
        m = [f"m{i}" for i in range(len(value_types[0].shape) - 1)]
        operands = [" ".join(m + ["k"]), "n k", "sa", "sb"] + (["n"] if has_bias else [])
        return (f"{', '.join(operands)} -> {' '.join(m + ['n'])}",
                {"reduction_factors": ("k",), "need_replication_factors": ("sa", "sb")})

    partitioned.def_partition(partition=partition, sharding_rule=rule)

    # custom_partitioning has no batching rule: under vmap, a batched `a` alone folds into
    # M (still partitioned); anything else maps over the batch.
    @jax.custom_batching.custom_vmap
    def gemm_fn(*args):
        return partitioned(*args)

    @gemm_fn.def_vmap
    def gemm_vmap(axis_size, in_batched, *args):
        if in_batched[0] and not any(in_batched[1:]):
            return gemm_fn(*args), True
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip(args, in_batched)]
        return jax.lax.map(lambda xs: gemm_fn(*xs), tuple(args)), True

    return gemm_fn


def _scale_arg(name: str, x):
    if x is None:
        return jnp.ones((1,), jnp.float32)
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"{OP}: {name}: expected float32, got {x.dtype}")
    if x.size != 1:
        raise ValueError(f"{OP}: {name}: expected one value (shape () or (1,)), got shape {x.shape}")
    return x.reshape(1)


def gemm(a, b, a_scale_inv=None, b_scale_inv=None, bias=None, *, out_dtype=jnp.bfloat16,
         use_split_accumulator: bool = True) -> jax.Array:
    """(a_scale_inv * a) @ (b_scale_inv * b)^T + bias for a (..., K), b (N, K) -> (..., N).

    Scale-invs default to 1 and apply to every input type. `use_split_accumulator` matters
    for FP8 on the GPU only (False: cuBLASLt fast accumulation).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 1:
        raise ValueError(f"{OP}: a: expected shape (..., K), got a scalar")
    if b.ndim != 2:
        raise ValueError(f"{OP}: b: expected shape (N, K), got {b.shape}")
    if b.shape[1] != a.shape[-1]:
        raise ValueError(f"{OP}: b: expected (N, {a.shape[-1]}) to match a {a.shape}, got {b.shape}")
    if a.dtype in FP8 or b.dtype in FP8:
        if a.dtype not in FP8 or b.dtype not in FP8:
            raise TypeError(f"{OP}: b: expected both operands FP8 or neither, got {a.dtype} and {b.dtype}")
        if a.dtype == b.dtype == jnp.float8_e5m2:
            raise TypeError(f"{OP}: b: float8_e5m2 x float8_e5m2 has no FP8 GEMM; use float8_e4m3fn for one")
    elif a.dtype not in HALF or b.dtype != a.dtype:
        raise TypeError(f"{OP}: b: expected a and b both FP8, both bfloat16 or both float16, "
                        f"got {a.dtype} and {b.dtype}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT:
        raise TypeError(f"{OP}: out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if a.dtype in HALF and out_dtype not in (a.dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"{OP}: out_dtype: with {a.dtype} operands expected {a.dtype} or float32, got {out_dtype}")
    sa, sb = _scale_arg("a_scale_inv", a_scale_inv), _scale_arg("b_scale_inv", b_scale_inv)
    n = b.shape[0]
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"{OP}: bias: expected shape ({n},), got {bias.shape}")
        if bias.dtype != out_dtype:
            raise TypeError(f"{OP}: bias: expected out_dtype {out_dtype}, got {bias.dtype}")
    if a.shape[-1] == 0 or a.size == 0 or n == 0:  # nothing to multiply: out is bias (or 0)
        base = jnp.zeros((n,), out_dtype) if bias is None else bias
        return jnp.broadcast_to(base, (*a.shape[:-1], n))
    fn = _make_gemm(out_dtype, bool(use_split_accumulator), bias is not None)
    return fn(a, b, sa, sb, *([bias] if bias is not None else []))


def gemm_reference(a, b, a_scale_inv=1.0, b_scale_inv=1.0, bias=None, *, out_dtype=jnp.bfloat16):
    """The jnp reference: dequantize to fp32, a HIGHEST-precision dot, bias, round."""
    acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    acc = acc * (jnp.float32(a_scale_inv) * jnp.float32(b_scale_inv))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)
