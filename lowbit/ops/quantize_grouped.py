"""lowbit.ops.quantize_grouped_fp8: FP8 per-tensor quantization of G tensors stacked along
x's first dim (the token-sorted activations of an MoE layer), each with its own scale and
amax, in one pass over x, through lowbit's FFI op (csrc/quantize/quantize_grouped.h).

Layout. x has rank >= 2 and is viewed as rows x cols at flatten_axis (>= 1): rows =
prod(shape[:f]), cols = prod(shape[f:]). `group_sizes` (int32 (G,), 1 <= G <= 1024, values
read on the device, so they may change from call to call without recompiling) counts
entries of x's first dim: group g is the block of x[start_g : start_g + group_sizes[g]],
after the groups before it. Negative sizes count as 0 and groups running past x's first
dim are cut at its end. Entries after the last group (sum(group_sizes) < shape[0]) are
padding: their codes are 0 in both copies and they count in no amax.
  rowwise: x's shape, each group encoded with its own scale;
  colwise: shape[f:] + shape[:f], the transpose of the rows x cols view: group g's colwise
           copy is the column range [rows_before_g, rows_before_g + rows_of_g) of it;
  amax, scale, scale_inv: float32 (G,), per group (scale = the scale the group used).

Scaling. Delayed: `scale` (float32 (G,)) is used as given. Current (`scale=None`): each
group's scale comes from its own amax with the rule of lowbit.ops.compute_scale
(fp8_max / amax; amax 0, inf or NaN -> 1; an infinite quotient -> FLT_MAX; optional power
of two). Per element the numerics are those of lowbit.ops.quantize_fp8 with the group's
scale, bit for bit on CPU and CUDA: a group equals quantize_fp8 of its rows.

Works under jit and vmap (each batch element gets its own groups; done as a loop over the
batch). Under a sharded jit the op is not partitioned: XLA gathers x to each device.

The block formats (MXFP8, FP8 block) are grouped by lowbit.ops.quantize_grouped_block
(lowbit/ops/quantize_grouped_block.py), NVFP4 by lowbit.ops.quantize_grouped_nvfp4
(lowbit/ops/quantize_grouped_nvfp4.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.quantize import check_quantize_args, colwise_shape
from lowbit.ops.quantize_block import _looped_batcher

__all__ = ["GroupedFp8Quantized", "quantize_grouped_fp8", "MAX_GROUPS"]

MAX_GROUPS = 1024  # kMaxQuantizeGroups in csrc/quantize/quantize_grouped.h


class GroupedFp8Quantized(NamedTuple):
    rowwise: jax.Array | None  # fp8, x's shape
    colwise: jax.Array | None  # fp8, shape[f:] + shape[:f]
    amax: jax.Array  # f32 (G,)
    scale: jax.Array  # f32 (G,), the scale each group was encoded with
    scale_inv: jax.Array  # f32 (G,), 1 / scale


def _abstract(x, group_sizes, scale, *, flatten_axis, current_scaling, use_power_2_scales, out_dtype,
              rowwise, colwise):
    del scale, current_scaling, use_power_2_scales
    empty = jax.core.ShapedArray((0,), out_dtype)
    per_group = jax.core.ShapedArray(group_sizes.shape, jnp.float32)
    return (
        jax.core.ShapedArray(x.shape, out_dtype) if rowwise else empty,
        jax.core.ShapedArray(colwise_shape(x.shape, int(flatten_axis)), out_dtype) if colwise else empty,
        per_group,
        per_group,
        per_group,
    )


# (x, group_sizes s32 (G,), scale f32 (G,) | (0,)) -> (rowwise | (0,), colwise | (0,), amax, scale, scale_inv).
quantize_grouped_fp8_p = ffi_primitive(
    "lowbit_quantize_grouped_fp8",
    "lowbit_quantize_grouped_fp8",
    _abstract,
    multiple_results=True,
    attrs=("flatten_axis", "current_scaling", "use_power_2_scales"),
    # csrc: QuantizeGroupedFp8WorkspaceBytes, the CUDA handler's group end rows (int32 each)
    cuda_workspace=lambda avals_in, **_: 4 * avals_in[1].shape[0],
)


# One primitive call per batch element: every element has its own groups.
_looped_batcher(quantize_grouped_fp8_p)


@lru_cache(maxsize=None)
def _grouped_fn(flatten_axis: int, out_dtype, rowwise: bool, colwise: bool, current: bool, pow2: bool):
    def fn(x, group_sizes, scale):
        r, c, a, s, si = quantize_grouped_fp8_p.bind(
            x, group_sizes, scale, flatten_axis=np.int32(flatten_axis), current_scaling=np.bool_(current),
            use_power_2_scales=np.bool_(pow2), out_dtype=out_dtype, rowwise=rowwise, colwise=colwise,
        )
        return r, c, a, s, si

    return fn


def _check_group_sizes(op: str, group_sizes) -> jax.Array:
    """group_sizes as an int32 (G,) array, 1 <= G <= MAX_GROUPS, or a ValueError naming op."""
    given_dtype = getattr(group_sizes, "dtype", None)  # checked before jnp.asarray narrows int64
    group_sizes = jnp.asarray(group_sizes)
    if ((given_dtype is not None and given_dtype != jnp.int32) or group_sizes.dtype != jnp.int32
            or group_sizes.ndim != 1 or not 1 <= group_sizes.shape[0] <= MAX_GROUPS):
        raise ValueError(f"{op}: group_sizes: expected int32 of shape (G,) with 1 <= G <= {MAX_GROUPS}, "
                         f"got {given_dtype or group_sizes.dtype}{group_sizes.shape}")
    return group_sizes


def quantize_grouped_fp8(
    x,
    group_sizes,
    scale=None,
    *,
    out_dtype=jnp.float8_e4m3fn,
    rowwise: bool = True,
    colwise: bool = True,
    flatten_axis: int = -1,
    use_power_2_scales: bool = False,
) -> GroupedFp8Quantized:
    """Quantizes each group of x's first dim as its own FP8 tensor (see the module
    docstring): `scale` (float32 (G,)) for delayed scaling, None for current scaling."""
    op = "lowbit.ops.quantize_grouped_fp8"
    x, out_dtype, axis = check_quantize_args(op, x, out_dtype, rowwise, colwise, flatten_axis)
    if x.ndim < 2 or axis < 1:
        raise ValueError(f"{op}: x, flatten_axis: expected rank >= 2 and flatten_axis >= 1 (groups are "
                         f"stacked along the first dim), got shape {x.shape} and flatten_axis {flatten_axis}")
    group_sizes = _check_group_sizes(op, group_sizes)
    groups = group_sizes.shape[0]
    current = scale is None
    if current:
        scale = jnp.zeros((0,), jnp.float32)
    else:
        scale = jnp.asarray(scale)
        if scale.dtype != jnp.float32 or scale.shape != (groups,):
            raise ValueError(f"{op}: scale: expected float32 of shape ({groups},) (one per group) or None "
                             f"(current scaling), got {scale.dtype}{scale.shape}")
    if use_power_2_scales and not current:
        raise ValueError(f"{op}: use_power_2_scales: applies to current scaling only (scale=None)")
    r, c, a, s, si = _grouped_fn(axis, out_dtype, bool(rowwise), bool(colwise), current, bool(use_power_2_scales))(
        x, group_sizes, jax.lax.stop_gradient(scale))
    return GroupedFp8Quantized(
        rowwise=r if rowwise else None,
        colwise=c if colwise else None,
        amax=a,
        scale=s,
        scale_inv=si,
    )

