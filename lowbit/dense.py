"""lowbit.dense: a quantized GEMM layer, y = x . kernel (+ bias), with its own backward.

Dataflow (tensor scaling; every GEMM in the "TN" form lowbit.ops.gemm takes, both
operands K-major), with x viewed as (M, K) and the kernel as (K, N):

    forward   x  -> rowwise (M,K) + colwise (K,M)      kernel -> rowwise (K,N) + colwise (N,K)
              y  = gemm(x.rowwise, kernel.colwise) + bias                     (M,N)
    backward  dy -> rowwise (M,N) + colwise (N,M), dbias fused into that quantize
              dx = gemm(dy.rowwise, kernel.rowwise)                           (M,K)
              dw = gemm(x.colwise,  dy.colwise)                               (K,N)

Only the FP8 copies the backward needs (x.colwise, kernel.rowwise) are saved, not the
high-precision inputs. The quantizer set is a differentiable argument whose "gradient" is
the set updated with this step's amaxes (the overwrite-with-gradient convention of Flax's
FP8 ops): with DelayedScaling, step t casts with the scale made at step t-1.

Block scaling (Float8BlockScaling, MXFP8BlockScaling): the same dataflow, each copy quantized
from the high-precision tensor (x, kernel, dy) by the block quantizers, and the GEMMs run in
lowbit.ops.gemm's block scale modes: FP8 block x (1x128) . kernel (128x128) forward, dy (1x128)
. kernel (128x128) for dgrad, x^T (1x128) . dy^T (1x128) for wgrad, all K-major as stored
(the colwise copies are already transposed); MXFP8's colwise copies keep x's layout with
their blocks down the columns, so their data and scales are transposed into the K-major
operand (`gemm_operand`). Which GEMMs have a hardware path is lowbit.ops.gemm's business
(cuBLASLt on Hopper for FP8 block; an exact emulation with a notice elsewhere).

NVFP4 (NVFP4BlockScaling): the same dataflow with NVFP4 copies (packed 2-D, colwise copies
K-major), multiplied by lowbit.ops.gemm_nvfp4.nvfp4_gemm on their stored data, e4m3 scales (16x16
weight tiles are stored per row, so they need nothing) and global scale_invs: cuBLASLt on
compute capability 10.x, the exact emulation elsewhere (on other GPUs a dequantize-and-fp32-dot
in jnp; the C++ reference's k-order sums on the CPU). All three GEMMs, the wgrad of the RHT
copies included: the RHT T = D H D / 4 runs along the wgrad's contraction dim (tokens) in
16-blocks, x' = T x and dy' = T' dy, so x'^T dy' = x^T T^T T' dy is x^T dy exactly when the two
sign matrices D, D' are equal (T^T T = I). with_sr_key gives the x and dgrad quantizers of
one call ONE RHT sign key, fold_in(key, RHT_KEY_TAG), and their own SR keys (x fold_in(key,
0), kernel 1, dgrad 2; the quantizer derives signs from fold_in(rht_key, 0), SR words from
fold_in(key, 1)); without a key both are the plain Hadamard transform (signs all +). So the
packed product of the two transformed copies is the wgrad up to their quantization, as on
Blackwell hardware. emulated_nvfp4_gemm (dequantize, transform undone, fp32 dot) is left only
for a GEMM with exactly one transformed operand, which only a hand-built quantizer set mixing
use_rht makes (`nvfp4_packed_gemm_ok`).

Accumulation: as the quantizer set's `accumulation` says (GemmAccumulation, from the recipe's
fp8_gemm_* MMParams): by default the forward GEMM uses the fast FP8 accumulation, the two
backward GEMMs the split (more precise) one, as TransformerEngine does by default (block-scaled
GEMMs have only the split one, whatever the set says). With an empty quantizer set (no
recipe) dense is a plain `lax.dot_general`.
`forward_gemm` and `backward_gemms` are the pieces layernorm_dense and layernorm_mlp reuse.

Memory (tensor scaling): dense's backward is one op, lowbit.ops.dense_backward_fp8,
that quantizes dy and runs both GEMMs with dy's two FP8 copies placed inside dk's buffer until
the wgrad (in column slices) overwrites them, so the step keeps no buffers for them (2 m n
bytes unfused; csrc/dense/dense_backward.h). Same values as the unfused ops (bit for bit on the
CPU). On one device it applies where a placement fits the sizes (dense_backward_plan);
LOWBIT_DENSE_BACKWARD=unfused (read at trace time) turns it off. Under a MeshResource that
names a tp axis the sharded op runs (dense_backward_fp8_sharded: each device places its own
blocks, or runs the unfused primitives where they have no placement, or where the tp axis has
one device); under one without (pure DP) the unfused ops run unless
LOWBIT_DENSE_BACKWARD=fused_sharded; neither with FSDP,
sequence parallelism or LOWBIT_GEMM_PSUM=fp32 (fused_backward says why, with the numbers).
Memory (Float8BlockScaling, f32 kernel, one device): dy's colwise copy is made in bands of
tokens after the dgrad, each band feeding one wgrad launch that adds into dk in place
(lowbit.dense_block_backward), so only one band of it is alive; LOWBIT_DENSE_BACKWARD=unfused
turns that off too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowbit.dense_block_backward import applies as block_backward_applies
from lowbit.dense_block_backward import banded_block_backward
from lowbit.ops.dense_backward import dense_backward_fp8, dense_backward_fp8_sharded, dense_backward_plan
from lowbit.ops.gemm import GemmScaleMode, gemm, psum_in_fp32
from lowbit.ops.gemm_nvfp4 import emulated_nvfp4_gemm, nvfp4_gemm
from lowbit.quantize.helper import get_global_mesh_resource
from lowbit.quantize.quantizer import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    GemmAccumulation,
    NVFP4Quantizer,
    QuantizerSet,
    noop_quantizer_set,
)
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x, colwise_permutation
from lowbit.sharding import check_batch_first, logical_constraint

# Names under which the GEMM outputs are visible to remat policies (checkpoint_policies.py).
GEMM_CHECKPOINT_NAME = "lowbit_gemm"

__all__ = ["dense", "GEMM_CHECKPOINT_NAME", "RHT_KEY_TAG", "with_sr_key"]


def _normalize_dims(op: str, arg: str, dims: Sequence[int], ndim: int) -> tuple[int, ...]:
    if isinstance(dims, (int, np.integer)) or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise ValueError(f"{op}: contracting_dims: expected ((x dims), (kernel dims)), tuples of ints; "
                         f"{arg}'s are {dims!r}")
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(f"{op}: contracting_dims: {arg} dim {d} is out of range for rank {ndim}")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: contracting_dims: {arg} dims {tuple(dims)} repeat")
    return tuple(out)


def _canonical(x, kernel, contracting_dims):
    """Transposes x so its contracting dims come last and the kernel so they come first (the
    NN form), returning the two arrays and the number of contracting dims."""
    op = "lowbit.dense"
    if not isinstance(contracting_dims, (tuple, list)) or len(contracting_dims) != 2:
        raise ValueError(f"{op}: contracting_dims: expected ((x dims), (kernel dims)), got {contracting_dims}")
    xc = _normalize_dims(op, "x", contracting_dims[0], x.ndim)
    kc = _normalize_dims(op, "kernel", contracting_dims[1], kernel.ndim)
    if len(xc) != len(kc) or not xc:
        raise ValueError(f"{op}: contracting_dims: x and kernel must contract as many dims, got {contracting_dims}")
    for a, b in zip(xc, kc):
        if x.shape[a] != kernel.shape[b]:
            raise ValueError(
                f"{op}: contracting_dims: x dim {a} ({x.shape[a]}) != kernel dim {b} ({kernel.shape[b]})"
            )
    x_free = tuple(d for d in range(x.ndim) if d not in xc)
    k_free = tuple(d for d in range(kernel.ndim) if d not in kc)
    if x_free + xc != tuple(range(x.ndim)):
        x = jnp.transpose(x, x_free + xc)
    if kc + k_free != tuple(range(kernel.ndim)):
        kernel = jnp.transpose(kernel, kc + k_free)
    return x, kernel, len(xc)


def as_2d(a, n_lead: int):
    """a viewed as (prod of its first n_lead dims, prod of the rest)."""
    return a.reshape(math.prod(a.shape[:n_lead]), math.prod(a.shape[n_lead:]))


def sequence_parallel() -> bool:
    """True when the global MeshResource names a tpsp axis (sequence parallelism): the
    GEMMs whose a operand is tokens then gather its sequence dim first (lowbit.ops.gemm)."""
    return getattr(get_global_mesh_resource(), "tpsp_resource", None) is not None


def quantize_2x(quantizer, a, n_lead: int = 1) -> ScaledTensor2x:
    """Rowwise (a's shape) and colwise (a's dims from n_lead on, then the first n_lead)
    copies. Nothing is flattened, so each dim keeps its own sharding."""
    tensor, _ = quantizer.quantize(a, is_rowwise=True, is_colwise=True, flatten_axis=n_lead)
    return tensor


_GEMM_SCALE_MODES = {
    ScalingMode.FP8_BLOCK_1x128: GemmScaleMode.BLOCK_1x128,
    ScalingMode.FP8_BLOCK_128x128: GemmScaleMode.BLOCK_128x128,
    ScalingMode.MXFP8_1D_SCALING: GemmScaleMode.MXFP8,
}


def gemm_operand(t: ScaledTensor1x):
    """(data, scale_inv, GemmScaleMode) of a quantized copy as a K-major GEMM operand: an
    MXFP8 colwise copy (x's layout, blocks down the columns) is transposed, data and scales
    (its colwise scale layout transposed is exactly the rowwise layout of the transpose)."""
    mode = _GEMM_SCALE_MODES.get(t.scaling_mode, GemmScaleMode.TENSOR)
    if mode == GemmScaleMode.MXFP8 and t.is_colwise:
        data = jnp.transpose(t.data, colwise_permutation(t.data.ndim, t.flatten_axis))
        return data, t.scale_inv.T, mode
    return t.data, t.scale_inv, mode


def _nvfp4_operand(t: ScaledTensor1x):
    """An NVFP4 copy dequantized to fp32 (RHT undone) as a K-major operand of
    emulated_nvfp4_gemm (a colwise copy transposed)."""
    values = t.dequantize(jnp.float32)
    if t.is_colwise:
        values = jnp.transpose(values, colwise_permutation(values.ndim, t.flatten_axis))
    return values


def _nvfp4_dims(t: ScaledTensor1x) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(free dims, contracted dims) of an NVFP4 copy as stored: its packed 2-D data is (prod
    of the first, ceil(prod of the second / 2)), K-major (a colwise copy is x^T)."""
    shape, f = tuple(t.shape), t.flatten_axis
    return (shape[f:], shape[:f]) if t.is_colwise else (shape[:f], shape[f:])


def nvfp4_packed_gemm_ok(a: ScaledTensor1x, b: ScaledTensor1x, contracting_ndim: int) -> bool:
    """Whether lowbit.ops.gemm_nvfp4.nvfp4_gemm can multiply the two stored copies as they are: both
    RHT-transformed or neither (nvfp4_gemm multiplies stored values: with the same transform
    on both operands' K they multiply to the product, T^T T = I; with it on one only they do
    not), and each stored copy's columns exactly the contracted dims. Only colwise copies are
    transformed, so two transformed operands are the wgrad's x and dy copies, whose sign
    vectors are one by construction: every entry point (dense, layernorm_dense,
    layernorm_mlp) passes its sets through with_sr_key, which gives the x and dgrad
    quantizers the same rht_key. One transformed operand comes only from a hand-built set
    mixing use_rht (e.g. a kernel quantizer with use_rht): emulated_nvfp4_gemm then."""
    if (a.rht_sign_bits is None) != (b.rht_sign_bits is None):
        return False
    (_, ka), (_, kb) = _nvfp4_dims(a), _nvfp4_dims(b)
    return len(ka) == len(kb) == contracting_ndim and ka == kb


def _nvfp4_gemm(a: ScaledTensor1x, b: ScaledTensor1x, bias, out_dtype, contracting_ndim):
    """An NVFP4 GEMM of two stored copies: lowbit.ops.gemm_nvfp4.nvfp4_gemm on their packed data,
    scales and global scale_invs (cuBLASLt on compute capability 10.x; elsewhere the exact
    emulation, which gives emulated_nvfp4_gemm's bits: the same dequantized operands and
    fp32 dot, on the CPU summed in k order by the C++ reference), the (M, N) result reshaped
    to (M..., N...); the wgrad of RHT copies (one sign vector) as well. A GEMM with one
    transformed operand goes through emulated_nvfp4_gemm with the transform undone
    (nvfp4_packed_gemm_ok says when)."""
    if not nvfp4_packed_gemm_ok(a, b, contracting_ndim):
        return emulated_nvfp4_gemm(_nvfp4_operand(a), _nvfp4_operand(b), bias, out_dtype=out_dtype,
                                   contracting_ndim=contracting_ndim)
    (a_free, k_dims), (b_free, _) = _nvfp4_dims(a), _nvfp4_dims(b)
    out = nvfp4_gemm(a.data, b.data, a.scale_inv, b.scale_inv, a.global_scale_inv, b.global_scale_inv,
                     None if bias is None else bias.reshape(-1), k=math.prod(k_dims), out_dtype=out_dtype)
    return out.reshape(*a_free, *b_free)


def _gemm(a: ScaledTensor1x, b: ScaledTensor1x, bias, out_dtype, contracting_ndim, split,
          tokens_in_a=True):
    if a.scaling_mode.is_nvfp4:
        out = _nvfp4_gemm(a, b, bias, out_dtype, contracting_ndim)
        return checkpoint_name(out, GEMM_CHECKPOINT_NAME)
    a_data, a_scale, a_mode = gemm_operand(a)
    b_data, b_scale, b_mode = gemm_operand(b)
    out = gemm(a_data, b_data, a_scale, b_scale, bias, out_dtype=out_dtype,
               use_split_accumulator=split, contracting_ndim=contracting_ndim,
               sequence_parallel=tokens_in_a and sequence_parallel(),
               a_scale_mode=a_mode, b_scale_mode=b_mode)
    return checkpoint_name(out, GEMM_CHECKPOINT_NAME)


def forward_gemm(xq: ScaledTensor2x, kq: ScaledTensor2x, bias, out_dtype, n_contract: int = 1,
                 accumulation: GemmAccumulation = GemmAccumulation()):
    """y (M..., N...) = x (M..., K...) . kernel (K..., N...) + bias (N...), from their
    quantized copies (x's rowwise, the kernel's colwise (N..., K...)), accumulated as
    accumulation.fprop says."""
    return _gemm(xq.rowwise_tensor, kq.colwise_tensor, bias, out_dtype, n_contract, accumulation.fprop)


def dgrad_wgrad(dyq: ScaledTensor2x, x_col: ScaledTensor1x, k_row: ScaledTensor1x, x_dtype, k_dtype,
                n_lead: int = 1, accumulation: GemmAccumulation = GemmAccumulation()):
    """dx (M..., K...) = dy . kernel^T and dw (K..., N...) = x^T . dy from the quantized
    dy (M..., N...) (n_lead M dims), x's colwise copy (K..., M...) and the kernel's rowwise
    copy (K..., N...), accumulated as accumulation.dgrad and .wgrad say."""
    n_out = len(dyq.rowwise_tensor.shape) - n_lead
    dx = _gemm(dyq.rowwise_tensor, k_row, None, x_dtype, n_out, accumulation.dgrad)
    dw = _gemm(x_col, dyq.colwise_tensor, None, k_dtype, n_lead, accumulation.wgrad, tokens_in_a=False)
    if not _mesh_axes():
        # Tied, so that whatever consumes dx waits for dw: the wgrad's operands (x's saved
        # colwise copy, dy's colwise copy) are freed before the backward goes on. Left free,
        # XLA runs the wgrads (off the critical path) last, and their FP8 operands stay live
        # through the rest of the backward: in the seed layer, through the attention's
        # backward, its peak (+0.25 GiB). Not under a MeshResource with axes: there the tie
        # keeps XLA from combining the wgrads' data-parallel all-reduces (tests/test_sharding.py
        # counts them).
        dx, dw = jax.lax.optimization_barrier((dx, dw))
    return dx, dw


def _mesh_axes() -> tuple[str, ...]:
    """The axes the global MeshResource names (empty without one)."""
    resource = get_global_mesh_resource()
    return () if resource is None else resource.amax_reduction_axes()


def backward_gemms(dy, x_col: ScaledTensor1x, k_row: ScaledTensor1x, dgrad_quantizer,
                   has_bias: bool, x_dtype, k_dtype, n_lead: int = 1,
                   accumulation: GemmAccumulation = GemmAccumulation()):
    """dx (M..., K...), dw (K..., N...), dbias (N...) or None, and dy's amax, from dy
    (M..., N...) with n_lead M dims; dbias comes out of dy's quantize pass."""
    dyq, dbias = dgrad_quantizer.quantize(
        dy, is_rowwise=True, is_colwise=True, flatten_axis=n_lead, compute_dbias=has_bias
    )
    dx, dw = dgrad_wgrad(dyq, x_col, k_row, x_dtype, k_dtype, n_lead, accumulation)
    return dx, dw, dbias, dyq.amax


def require_quantizer_set(op: str, quantizer_set, arg: str = "quantizer_set") -> None:
    """A TypeError naming `op` unless quantizer_set is a QuantizerSet."""
    if not isinstance(quantizer_set, QuantizerSet):
        raise TypeError(f"{op}: {arg}: expected a lowbit QuantizerSet (QuantizerFactory.create_set), "
                        f"got {type(quantizer_set).__name__}")


def check_quantizer_set(op: str, quantizer_set: QuantizerSet) -> bool:
    """True when the set quantizes; False for an empty set; an error for a partial one or one
    that mixes scaling families (per-tensor, block, NVFP4), which no GEMM takes."""
    require_quantizer_set(op, quantizer_set)
    quantizers = (quantizer_set.x, quantizer_set.kernel, quantizer_set.dgrad)
    if all(q is None for q in quantizers):
        return False
    if any(q is None for q in quantizers):
        raise ValueError(f"{op}: quantizer_set: give quantizers for x, kernel and dgrad, or none")
    if len({q.scaling_mode.is_nvfp4 for q in quantizers}) != 1:
        raise ValueError(f"{op}: quantizer_set: NVFP4 quantizers pair only with NVFP4 quantizers")
    if len({_scaling_family(q.scaling_mode) for q in quantizers}) != 1:
        raise ValueError(f"{op}: quantizer_set: the three quantizers must share a scaling family (per-tensor, "
                         "MXFP8 or FP8 block, whose 1x128 and 128x128 modes mix), got "
                         + ", ".join(q.scaling_mode.name for q in quantizers))
    return True


def _scaling_family(mode: ScalingMode) -> str:
    """The GEMMs' operand families: per-tensor (delayed or current), MXFP8, FP8 block (1x128
    and 128x128 pair with each other), NVFP4."""
    if mode.is_tensor_scaling():
        return "tensor"
    if mode.is_nvfp4:
        return "nvfp4"
    return "mxfp8" if mode == ScalingMode.MXFP8_1D_SCALING else "fp8_block"


# fold_in tag of the RHT sign key of one GEMM's quantizer set (0, 1, 2 are the SR keys).
RHT_KEY_TAG = 3


def with_sr_key(quantizer_set: QuantizerSet, key) -> QuantizerSet:
    """The set with `key` given to its NVFP4 quantizers: SR keys of their own (x: fold_in(key,
    0), kernel 1, dgrad 2) and one RHT sign key for all three, fold_in(key, RHT_KEY_TAG);
    then (also for key None) the kernel and dgrad quantizers take the x quantizer's rht_key,
    so that the wgrad's two RHT copies share one sign vector whatever keys a hand-built set
    carried (signs all + when x's is None). Sets of other quantizers come back unchanged."""
    if not isinstance(quantizer_set.x, NVFP4Quantizer):
        return quantizer_set
    if key is not None:
        rht_key = jax.random.fold_in(key, RHT_KEY_TAG)
        quantizer_set = quantizer_set._replace(**{
            field: q.with_key(jax.random.fold_in(key, i), rht_key=rht_key) if isinstance(q, NVFP4Quantizer) else q
            for i, (field, q) in enumerate(zip(QuantizerSet._fields, quantizer_set.quantizers))})
    shared = quantizer_set.x.rht_key
    return quantizer_set._replace(**{
        field: dataclasses.replace(q, rht_key=shared)
        if isinstance(q, NVFP4Quantizer) and q.rht_key is not shared else q
        for field, q in zip(QuantizerSet._fields, quantizer_set.quantizers)})


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    contracting_dims=((1,), (0,)),
    quantizer_set: QuantizerSet = noop_quantizer_set,
    sr_key=None,
    *,
    input_axes=None,
    kernel_axes=None,
    output_axes=None,
    transpose_batch_sequence: bool = False,
) -> jax.Array:
    """x . kernel over `contracting_dims` (+ bias over the kernel's free dims), quantized by
    `quantizer_set` (see the module docstring). The output has x's free dims then the
    kernel's free dims, in x's dtype. sr_key: the PRNG key of NVFP4's stochastic rounding
    (a stream per quantizer) and of the RHT sign vector x's and dy's colwise copies share
    (with_sr_key). TE's keywords: input_axes, kernel_axes, output_axes: logical sharding
    constraints (axis names, one per dim) on x, kernel and the output, as
    lowbit.sharding.logical_constraint applies them; transpose_batch_sequence: False only."""
    check_batch_first("lowbit.dense", transpose_batch_sequence)
    require_quantizer_set("lowbit.dense", quantizer_set)
    quantizer_set = with_sr_key(quantizer_set, sr_key)
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if input_axes or kernel_axes or output_axes:
        x, kernel = logical_constraint(x, input_axes), logical_constraint(kernel, kernel_axes)
        y = dense(x, kernel, bias, contracting_dims, quantizer_set)
        return logical_constraint(y, output_axes)
    bias = None if bias is None else jnp.asarray(bias)
    x, kernel, n_contract = _canonical(x, kernel, contracting_dims)
    out_free = kernel.shape[n_contract:]
    if bias is not None and tuple(bias.shape) != tuple(out_free):
        raise ValueError(f"lowbit.dense: bias: expected shape {tuple(out_free)}, got {tuple(bias.shape)}")
    quantized = check_quantizer_set("lowbit.dense", quantizer_set)
    if quantized and (x.ndim == n_contract or kernel.ndim == n_contract):
        arg, shape = ("x", x.shape) if x.ndim == n_contract else ("kernel", kernel.shape)
        raise ValueError(f"lowbit.dense: {arg}: a quantized dense needs a free (not contracted) dim "
                         f"on both operands; {arg} of shape {tuple(shape)} has none (add one of size 1)")
    if not quantized:
        dims = ((tuple(range(x.ndim - n_contract, x.ndim)), tuple(range(n_contract))), ((), ()))
        y = jax.lax.dot_general(x, kernel, dims).astype(x.dtype)
        return y if bias is None else y + bias.astype(y.dtype)
    if bias is not None:
        bias = bias.astype(x.dtype)
    static = _Static(n_contract, tuple(x.shape), tuple(kernel.shape), jnp.dtype(x.dtype),
                     jnp.dtype(kernel.dtype), bias is not None)
    return _dense(x, kernel, bias, quantizer_set, static)


class _Static(NamedTuple):
    """Hashable facts the backward needs besides the residual arrays."""

    n_contract: int
    x_shape: tuple[int, ...]
    kernel_shape: tuple[int, ...]
    x_dtype: jnp.dtype
    kernel_dtype: jnp.dtype
    has_bias: bool


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dense(x, kernel, bias, quantizer_set, static):
    y, _ = _dense_fwd(x, kernel, bias, quantizer_set, static)
    return y


def _dense_fwd(x, kernel, bias, quantizer_set, static):
    n_lead = x.ndim - static.n_contract
    xq = quantize_2x(quantizer_set.x, x, n_lead)                         # (M..., K...)
    kq = quantize_2x(quantizer_set.kernel, kernel, static.n_contract)    # (K..., N...)
    y = forward_gemm(xq, kq, bias, x.dtype, static.n_contract, quantizer_set.accumulation)  # (M..., N...)
    return y, (xq.colwise_tensor, kq.rowwise_tensor, quantizer_set, xq.amax, kq.amax)


# LOWBIT_DENSE_BACKWARD: "fused" (default: the fused op on one device and under a
# MeshResource naming a tp axis; the unfused ops under one without: see fused_backward),
# "fused_sharded" (the fused op under any MeshResource) or "unfused".
DENSE_BACKWARD_ENV = "LOWBIT_DENSE_BACKWARD"
DENSE_BACKWARD_MODES = ("fused", "fused_sharded", "unfused")


def _dense_backward_mode() -> str:
    value = os.environ.get(DENSE_BACKWARD_ENV, "") or "fused"
    if value not in DENSE_BACKWARD_MODES:
        raise ValueError(f"lowbit.dense: {DENSE_BACKWARD_ENV}={value!r}: expected one of "
                         + ", ".join(repr(m) for m in DENSE_BACKWARD_MODES))
    return value


def fused_backward(dy, x_col: ScaledTensor1x, k_row: ScaledTensor1x, dgrad_quantizer, static: _Static,
                   accumulation: GemmAccumulation = GemmAccumulation()):
    """(dx, dw, dbias or None, dy's amax) from lowbit.ops.dense_backward_fp8, or None where it
    does not apply (another recipe, no placement for the sizes on one device,
    LOWBIT_DENSE_BACKWARD=unfused, sequence parallelism; under a MeshResource with axes but
    no tp axis unless LOWBIT_DENSE_BACKWARD=fused_sharded; under any MeshResource with FSDP
    or LOWBIT_GEMM_PSUM=fp32): then the unfused ops run. Under a MeshResource with axes, the
    sharded op (dense_backward_fp8_sharded: its devices fall back to the unfused primitives
    where their blocks have no placement).

    Why the default depends on tp (4 H200s, seed Dense, bench/bench_dense_multi.py,
    2026-11-27): with DP=2/TP=2 the fused op ran as fast as the separate ops (1.584x vs
    1.591x over bf16) at bf16's peak memory per device (2.031 GiB, the separate ops 2.219);
    with DP=2 alone it ran 8% slower (1.705x vs 1.856x): its whole-size wgrad all-reduce over
    dp starts after the op, where the separate ops let XLA overlap it with the dgrad. A tp
    axis of one device is DP alone: the sharded op (tp_only) runs the separate ops' primitives
    there, decided at partitioning, where the mesh's sizes are known (the MeshResource names
    axes only)."""
    sharded, mode = bool(_mesh_axes()), _dense_backward_mode()
    if mode == "unfused" or sequence_parallel():
        return None
    if sharded:
        resource = get_global_mesh_resource()
        if mode == "fused" and resource.tp_resource is None:
            return None
        if resource.fsdp_resource is not None or psum_in_fp32():
            return None
    if not isinstance(dgrad_quantizer, (DelayedScaleQuantizer, CurrentScaleQuantizer)):
        return None
    if not all(t.scaling_mode.is_tensor_scaling() for t in (x_col, k_row)):
        return None
    n_lead = len(static.x_shape) - static.n_contract
    m, k = math.prod(static.x_shape[:n_lead]), math.prod(static.x_shape[n_lead:])
    n = math.prod(static.kernel_shape[static.n_contract:])
    if not sharded and dense_backward_plan(m, n, k, static.kernel_dtype, static.x_dtype, static.has_bias) is None:
        return None
    dy2 = dy.reshape(m, n)
    scale, scale_inv = dgrad_quantizer.scale_and_inverse(dy2)
    kwargs = dict(q_dtype=dgrad_quantizer.q_dtype, dx_dtype=static.x_dtype, dk_dtype=static.kernel_dtype,
                  compute_dbias=static.has_bias, dgrad_split=accumulation.dgrad, wgrad_split=accumulation.wgrad)
    if sharded:  # the default mode: fused only where the tp axis has more than one device
        kwargs["tp_only"] = mode == "fused"
    dx, dw, dbias, amax = (dense_backward_fp8_sharded if sharded else dense_backward_fp8)(
        jax.lax.stop_gradient(dy2), x_col.data.reshape(k, m), k_row.data.reshape(k, n), scale, scale_inv,
        x_col.scale_inv, k_row.scale_inv, **kwargs)
    dx = checkpoint_name(dx.reshape(static.x_shape), GEMM_CHECKPOINT_NAME)
    dw = checkpoint_name(dw.reshape(static.kernel_shape), GEMM_CHECKPOINT_NAME)
    if dbias is not None:
        dbias = dbias.reshape(static.kernel_shape[static.n_contract:])
    return dx, dw, dbias, amax


def _banded_block_backward_applies(x_col, k_row, dgrad_quantizer, static: _Static, n_lead: int) -> bool:
    """Whether the Float8BlockScaling backward runs with dy's colwise copy in bands
    (lowbit.dense_block_backward: the step's peak at most bf16's): one device, no sequence
    parallelism, LOWBIT_DENSE_BACKWARD not "unfused", and what `applies` asks of the set."""
    if _dense_backward_mode() == "unfused" or _mesh_axes() or sequence_parallel():
        return False
    return block_backward_applies(dgrad_quantizer, x_col, k_row, static.kernel_dtype,
                                  math.prod(static.x_shape[:n_lead]))


def _dense_bwd(static, residuals, dy):
    x_col, k_row, quantizer_set, x_amax, k_amax = residuals
    n_lead = len(static.x_shape) - static.n_contract
    fused = fused_backward(dy, x_col, k_row, quantizer_set.dgrad, static, quantizer_set.accumulation)
    if fused is not None:
        dx, dw, dbias, dy_amax = fused
    elif _banded_block_backward_applies(x_col, k_row, quantizer_set.dgrad, static, n_lead):
        dx, dw, dbias = banded_block_backward(
            dy, x_col, k_row, quantizer_set.dgrad, static.has_bias, static.x_dtype, static.x_shape,
            static.kernel_shape, n_lead, GEMM_CHECKPOINT_NAME)
        dy_amax = None  # block scales: no amax
    else:
        dx, dw, dbias, dy_amax = backward_gemms(
            dy, x_col, k_row, quantizer_set.dgrad, static.has_bias, static.x_dtype,
            static.kernel_dtype, n_lead, quantizer_set.accumulation,
        )
    new_set = quantizer_set._replace(
        x=quantizer_set.x.update(x_amax),
        kernel=quantizer_set.kernel.update(k_amax),
        dgrad=quantizer_set.dgrad.update(dy_amax),
    )
    return dx, dw, dbias, new_set


_dense.defvjp(_dense_fwd, _dense_bwd)
