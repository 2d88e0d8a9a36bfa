"""lowbit.ops.quantize_grouped_block: block quantization (MXFP8, FP8 block 1x128 / 128x128) of
G tensors stacked along x's first dim (the token-sorted activations of an MoE layer), each
with its own blocks, through lowbit's FFI op (csrc/quantize/quantize_grouped_block.h).

Groups. x has rank >= 2 and is viewed as rows x cols at flatten_axis (>= 1). `group_sizes`
(int32 (G,), 1 <= G <= 1024, read on the device: new sizes need no recompile) counts entries
of x's first dim; group g is x[start_g : start_g + group_sizes[g]] after the groups before
it. Given concrete sizes, negative ones or a sum above x.shape[0] are a ValueError; under jit
they cannot be checked and are clipped as in quantize_grouped_fp8 (negative -> 0, groups cut
at x's end). Entries after the last group are the tail.

Group-bound copies start their blocks at the group's first row, so group g's codes and
scales equal, bit for bit, lowbit.ops.quantize_mxfp8 / quantize_fp8_block of x[start_g:end_g]
alone; `grouped_block_slice` cuts them out. They are the colwise copy (every kind) and, for
128x128 tiles, the rowwise one too. The rowwise copy of MXFP8 and FP8 1x128 does not depend on the
groups (blocks lie within a row): it is the ungrouped quantizer's of the whole x, tail
included, in its layouts (a rowwise-only call is that op itself).

Packed layout of the group-bound copies (R x C: x's flat view; n_g: group g's rows):
  data, nothing padded or moved: MXFP8 colwise in x's shape (group g = its rows); FP8 block
    colwise transposed, shape[f:] + shape[:f] (group g = columns [start_g, end_g) of its
    C x R view); 128x128 rowwise in x's shape. Tail codes are 0.
  scales: per group the ungrouped op's scale array of that group (padding included), the
    groups back to back along one dim, then zeros:
    MXFP8 colwise: (roundup(ceil(R/32), 4) + 4G, roundup(C, 128)) e8m0; group g = rows
      [S_g, S_g + roundup(ceil(n_g/32), 4)), S_g the sum of those counts before g;
    FP8 1x128 colwise: (ceil(R/128) + G, roundup(C, 4)) f32; group g = rows
      [T_g, T_g + ceil(n_g/128)); 128x128 rowwise: (ceil(R/128) + G, roundup(ceil(C/128), 4)),
      the same rows;
    FP8 128x128 colwise: (ceil(C/128), roundup(ceil(R/128), 4) + 4G); group g = columns
      [U_g, U_g + roundup(ceil(n_g/128), 4)).
`grouped_block_offsets` gives start/end rows and S, T, U from the sizes. A GEMM that reads a
group in place needs its data start aligned as the GEMM requires (FP8: 16 bytes, i.e. sizes
that are multiples of 16 rows); the op itself takes any sizes (unaligned FP8-block groups
cost some byte stores in the transposed copy).

Works under jit and vmap (a loop over the batch). Under a sharded jit the grouped op is not
partitioned: XLA gathers x to each device.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.quantize import check_quantize_args
from lowbit.ops.quantize_block import (E8M0, BlockQuantized, _looped_batcher, flat_view, fp8_block_scale_shape,
                                       mxfp8_scale_shape, quantize_fp8_block, quantize_mxfp8, transposed_shape)
from lowbit.ops.quantize_grouped import _check_group_sizes as check_group_sizes

__all__ = ["quantize_grouped_block", "grouped_block_offsets", "grouped_block_slice", "grouped_block_scale_shapes"]

KINDS = {("mxfp8", False): 0, ("fp8_block", False): 1, ("fp8_block", True): 2}  # GroupedBlockKind


def _cdiv(a, b):
    return -(-a // b)


def _roundup(a, b):
    return _cdiv(a, b) * b


def grouped_block_scale_shapes(rows: int, cols: int, groups: int, kind: int):
    """(rowwise, colwise) scale shapes of the grouped op for an R x C view (module doc)."""
    if kind == 0:
        return mxfp8_scale_shape(rows, cols, False), (_roundup(_cdiv(rows, 32), 4) + 4 * groups, _roundup(cols, 128))
    if kind == 1:
        return fp8_block_scale_shape(rows, cols, False), (_cdiv(rows, 128) + groups, _roundup(cols, 4))
    return ((_cdiv(rows, 128) + groups, _roundup(_cdiv(cols, 128), 4)),
            (_cdiv(cols, 128), _roundup(_cdiv(rows, 128), 4) + 4 * groups))


def _abstract(x, group_sizes, *, flatten_axis, kind, pow2_scales, out_dtype, rowwise, colwise):
    del pow2_scales
    f, kind = int(flatten_axis), int(kind)
    r, c = flat_view(x.shape, f)
    row_scale, col_scale = grouped_block_scale_shapes(r, c, group_sizes.shape[0], kind)
    scale_dtype = E8M0 if kind == 0 else jnp.float32
    col_shape = x.shape if kind == 0 else transposed_shape(x.shape, f)
    empty = lambda dt: jax.core.ShapedArray((0,), dt)  # noqa: E731
    return (
        jax.core.ShapedArray(x.shape, out_dtype) if rowwise else empty(out_dtype),
        jax.core.ShapedArray(row_scale, scale_dtype) if rowwise else empty(scale_dtype),
        jax.core.ShapedArray(col_shape, out_dtype) if colwise else empty(out_dtype),
        jax.core.ShapedArray(col_scale, scale_dtype) if colwise else empty(scale_dtype),
    )


# (x, group_sizes s32 (G,)) -> (rowwise, rowwise_scale, colwise, colwise_scale), each or (0,).
quantize_grouped_block_p = ffi_primitive(
    "lowbit_quantize_grouped_block", "lowbit_quantize_grouped_block", _abstract,
    multiple_results=True, attrs=("flatten_axis", "kind", "pow2_scales"),
    # csrc: QuantizeGroupedBlockWorkspaceBytes, the CUDA handler's group table (G + 1 entries)
    cuda_workspace=lambda avals_in, **_: (avals_in[1].shape[0] + 1) * 5 * 4,
)


# One primitive call per batch element: every element has its own groups.
_looped_batcher(quantize_grouped_block_p)


@lru_cache(maxsize=None)
def _grouped_fn(flatten_axis: int, out_dtype, kind: int, pow2: bool, rowwise: bool, colwise: bool):
    def fn(x, group_sizes):
        return tuple(quantize_grouped_block_p.bind(
            x, group_sizes, flatten_axis=np.int32(flatten_axis), kind=np.int32(kind), pow2_scales=np.bool_(pow2),
            out_dtype=out_dtype, rowwise=rowwise, colwise=colwise))

    return fn


def _check_group_sizes(op: str, group_sizes, first_dim: int) -> jax.Array:
    """quantize_grouped_fp8's check, and for concrete sizes also their range (traced sizes are
    clipped as documented)."""
    checked = check_group_sizes(op, group_sizes)
    if not isinstance(group_sizes, jax.core.Tracer):
        arr = np.asarray(checked)
        if (arr < 0).any() or int(arr.astype(np.int64).sum()) > first_dim:
            raise ValueError(f"{op}: group_sizes: expected non-negative sizes summing to at most x.shape[0] = "
                             f"{first_dim}, got {arr.tolist() if arr.size <= 16 else 'sum ' + str(arr.sum())}")
    return checked


def quantize_grouped_block(
    x,
    group_sizes,
    *,
    scaling_mode: str = "mxfp8",
    out_dtype=jnp.float8_e4m3fn,
    tile_2d: bool = False,
    pow2_scales: bool = False,
    rowwise: bool = True,
    colwise: bool = False,
    flatten_axis: int = -1,
) -> BlockQuantized:
    """Grouped block quantization (see the module docstring): scaling_mode "mxfp8"
    (lowbit.ops.quantize_mxfp8 per group) or "fp8_block" (quantize_fp8_block per group,
    1x128 tiles, or 128x128 with tile_2d). Returns the copies and scales in the packed layout;
    `grouped_block_slice` cuts out one group's."""
    op = "lowbit.ops.quantize_grouped_block"
    if scaling_mode not in ("mxfp8", "fp8_block"):
        raise ValueError(f"{op}: scaling_mode: expected 'mxfp8' or 'fp8_block', got {scaling_mode!r}")
    if scaling_mode == "mxfp8" and (tile_2d or pow2_scales):
        raise ValueError(f"{op}: tile_2d, pow2_scales: apply to scaling_mode='fp8_block' only")
    x, out_dtype, axis = check_quantize_args(op, x, out_dtype, rowwise, colwise, flatten_axis)
    if x.ndim < 2 or axis < 1:
        raise ValueError(f"{op}: x, flatten_axis: expected rank >= 2 and flatten_axis >= 1 (groups are "
                         f"stacked along the first dim), got shape {x.shape} and flatten_axis {flatten_axis}")
    group_sizes = _check_group_sizes(op, group_sizes, x.shape[0])
    kind = KINDS[(scaling_mode, bool(tile_2d))]
    if rowwise and not colwise and kind != 2:  # nothing depends on the groups
        if kind == 0:
            return quantize_mxfp8(x, out_dtype=out_dtype, rowwise=True, colwise=False, flatten_axis=axis)
        return quantize_fp8_block(x, out_dtype=out_dtype, pow2_scales=pow2_scales, rowwise=True, colwise=False,
                                  flatten_axis=axis)
    r, rs, c, cs = _grouped_fn(axis, out_dtype, kind, bool(pow2_scales), bool(rowwise), bool(colwise))(x, group_sizes)
    return BlockQuantized(r if rowwise else None, rs if rowwise else None, c if colwise else None,
                          cs if colwise else None)


def grouped_block_offsets(group_sizes, shape, flatten_axis: int = -1) -> dict[str, np.ndarray]:
    """Host-side offsets of every group for concrete sizes: rows "start" and "end" of x's
    flat view (clipped as the op clips), and the scale offsets "S" (MXFP8 colwise rows),
    "T" (FP8 1x128 colwise / 128x128 rowwise rows) and "U" (128x128 colwise columns)."""
    f = flatten_axis % len(shape)
    unit, rows = int(np.prod(shape[1:f], dtype=np.int64)), int(np.prod(shape[:f], dtype=np.int64))
    sizes = np.minimum(np.maximum(np.asarray(group_sizes, np.int64), 0) * unit, rows)
    ends = np.minimum(np.cumsum(sizes), rows)
    starts = np.concatenate([[0], ends[:-1]])
    n = ends - starts
    excl = lambda v: np.concatenate([[0], np.cumsum(v)[:-1]])  # noqa: E731
    return {"start": starts, "end": ends, "unit": unit,
            "S": excl(_roundup(_cdiv(n, 32), 4)), "T": excl(_cdiv(n, 128)), "U": excl(_roundup(_cdiv(n, 128), 4))}


def _bits(a):
    """numpy view of an array's bytes (fp8 / e8m0 slicing in XLA may rewrite NaN payloads)."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def grouped_block_slice(q: BlockQuantized, group_sizes, g: int, *, shape, scaling_mode: str = "mxfp8",
                tile_2d: bool = False, flatten_axis: int = -1) -> BlockQuantized:
    """Group g's copies out of quantize_grouped_block's result `q` (for x of `shape`), as numpy
    arrays laid out exactly as quantize_mxfp8 / quantize_fp8_block of x[start_g:end_g] returns
    them (fp8 and e8m0 as uint8 views; the rowwise scales of MXFP8 / 1x128 are re-padded)."""
    shape = tuple(shape)
    f = flatten_axis % len(shape)
    o = grouped_block_offsets(group_sizes, shape, f)
    s, e = int(o["start"][g]), int(o["end"][g])
    n = e - s
    rows, cols = flat_view(shape, f)
    g_shape = (n // o["unit"],) + shape[1:]
    kind = KINDS[(scaling_mode, bool(tile_2d))]
    out = [None] * 4
    if q.rowwise is not None:
        out[0] = _bits(q.rowwise).reshape(rows, cols)[s:e].reshape(g_shape)
        rs = _bits(q.rowwise_scale)
        if kind == 0:
            want = np.zeros(mxfp8_scale_shape(n, cols, False), rs.dtype)
            want[:n] = rs[s:e]
        elif kind == 1:
            want = np.zeros(fp8_block_scale_shape(n, cols, False), rs.dtype)
            want[:, :n] = rs[:, s:e]
        else:
            t = int(o["T"][g])
            want = rs[t:t + _cdiv(n, 128)]
        out[1] = want
    if q.colwise is not None:
        cw, cs = _bits(q.colwise), _bits(q.colwise_scale)
        if kind == 0:
            out[2] = cw.reshape(rows, cols)[s:e].reshape(g_shape)
            out[3] = cs[int(o["S"][g]):int(o["S"][g]) + _roundup(_cdiv(n, 32), 4)]
        else:
            out[2] = cw.reshape(cols, rows)[:, s:e].reshape(transposed_shape(g_shape, f))
            if kind == 1:
                out[3] = cs[int(o["T"][g]):int(o["T"][g]) + _cdiv(n, 128)]
            else:
                out[3] = cs[:, int(o["U"][g]):int(o["U"][g]) + _roundup(_cdiv(n, 128), 4)]
    return BlockQuantized(*out)
