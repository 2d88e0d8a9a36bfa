"""lowbit.ops.quantize_grouped_nvfp4: NVFP4 quantization of G tensors stacked along x's first
dim (the token-sorted activations of an MoE layer), each quantized as its own NVFP4 tensor,
through lowbit's FFI op (csrc/quantize/quantize_grouped_nvfp4.h).

Groups. x has rank >= 2 and is viewed as rows x cols at flatten_axis (>= 1). `group_sizes`
(int32 (G,), 1 <= G <= 1024, read on the device: new sizes need no recompile) counts entries
of x's first dim; group g is x[start_g : start_g + group_sizes[g]] after the groups before it.
Given concrete sizes, negative ones or a sum above x.shape[0] are a ValueError; under jit they
cannot be checked and are clipped as in quantize_grouped_fp8 (negative -> 0, groups cut at
x's end). Entries after the last group are the tail: code 0, no scales.

Every copy is group-bound: group g's rowwise and colwise data, E4M3 block scales and
global_scale_inv equal, bit for bit, lowbit.ops.quantize_nvfp4 of x[start_g:end_g] alone with
the same options (its own global scale S per copy; 16x16 tiles, RHT 16-groups and colwise
blocks start at the group's first row, a partial last RHT group left as is; stochastic
rounding with the group's rows of `random`, which is uint32 of x's shape; the same RHT sign
bits). An empty group has global_scale_inv 1, as quantize_nvfp4 of an empty tensor.
`grouped_nvfp4_slice` cuts a group's copies out.

Layout (R x C: x's flat view; n_g: group g's rows): every array holds the groups' ungrouped
arrays back to back, then zeros, so a group's copy is quantize_nvfp4's, in place, with its own
leading dims (a GEMM reads it at an offset; the colwise copy of a group is not a column range
of one shared matrix, whose row pitch would depend on the other groups and miss the 16-byte
multiple cuBLASLt's FP4 operands need):
  rowwise: uint8 (R, ceil(C/2)), x's rows; group g = rows [start_g, end_g); tail 0.
  rowwise_scale: e4m3 (128 * floor((R + 127 M) / 128), roundup(ceil(C/16), 4)), M = min(G, R);
    group g = rows [P_g, P_g + roundup(n_g, 128)), P_g = sum_{h<g} roundup(n_h, 128).
  colwise: uint8 (C * floor((R + M) / 2),) flat; group g = the (C, ceil(n_g/2)) matrix at byte
    C * B_g, B_g = sum_{h<g} ceil(n_h/2).
  colwise_scale: e4m3 (roundup(C, 128) * 4 * floor((R + 63 M) / 64),) flat; group g = the
    (roundup(C, 128), roundup(ceil(n_g/16), 4)) matrix at byte roundup(C, 128) * Q_g,
    Q_g = sum_{h<g} roundup(ceil(n_h/16), 4).
  rowwise / colwise_global_scale_inv: f32 (G,).
The sizes bound the sums for any group sizes (sum_g ceil(n_g/b) <= floor((R + (b-1) M)/b));
for G = 1 they are quantize_nvfp4's. `grouped_nvfp4_offsets` gives start, end, P, B, Q. Every
scale slot starts 16-byte aligned; a data slot does when its byte offset (start_g * ceil(C/2),
C * B_g) is a multiple of 16, e.g. for C % 32 == 0 or sizes that are multiples of 32 rows.

Backends: the C++ reference (QuantizeNvfp4Ref per group) on the CPU, CUDA kernels on a GPU
(quantize_grouped_nvfp4.cu: a per-group amax pass, then quantize_nvfp4's tile code per group),
the same bits. Works under jit and vmap (a loop over the batch). Under a sharded jit the op is
not partitioned: XLA gathers x to each device.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.amax import check_high_precision
from lowbit.ops.quantize import check_copies_and_axis
from lowbit.ops.quantize_block import _looped_batcher
from lowbit.ops.quantize_grouped_block import _check_group_sizes
from lowbit.ops.quantize_nvfp4 import E4M3, Nvfp4Quantized, check_sr_rht_args, flat_view, scale_shape

__all__ = ["quantize_grouped_nvfp4", "grouped_nvfp4_offsets", "grouped_nvfp4_slice", "grouped_nvfp4_shapes"]

OP = "lowbit.ops.quantize_grouped_nvfp4"


def _cdiv(a, b):
    return -(-a // b)


def _bound(rows: int, groups: int, block: int) -> int:
    """floor((rows + (block - 1) min(G, rows)) / block) >= sum_g ceil(n_g / block)."""
    return (rows + (block - 1) * min(groups, rows)) // block


def grouped_nvfp4_shapes(rows: int, cols: int, groups: int):
    """(rowwise, rowwise_scale, colwise, colwise_scale) shapes for an R x C view (module doc)."""
    return ((rows, _cdiv(cols, 2)), (128 * _bound(rows, groups, 128), _cdiv(_cdiv(cols, 16), 4) * 4),
            (cols * _bound(rows, groups, 2),), (_cdiv(cols, 128) * 128 * 4 * _bound(rows, groups, 64),))


def _abstract(x, group_sizes, random, rht_sign_bits, *, flatten_axis, tile_2d, rht, rowwise, colwise):
    del random, rht_sign_bits, tile_2d, rht
    r, c = flat_view(x.shape, int(flatten_axis))
    G = group_sizes.shape[0]
    data, scale, cdata, cscale = grouped_nvfp4_shapes(r, c, G)
    empty = [jax.core.ShapedArray((0,), t) for t in (jnp.uint8, E4M3, jnp.float32)]

    def copy(d, s):
        return [jax.core.ShapedArray(d, jnp.uint8), jax.core.ShapedArray(s, E4M3),
                jax.core.ShapedArray((G,), jnp.float32)]

    return tuple((copy(data, scale) if rowwise else empty) + (copy(cdata, cscale) if colwise else empty))


# (x, group_sizes s32 (G,), random u32 | (0,), rht_sign_bits u32 (1,)) ->
# (rowwise, rowwise_scale, rowwise_global_scale_inv, colwise, colwise_scale, colwise_global_scale_inv).
quantize_grouped_nvfp4_p = ffi_primitive(
    "lowbit_quantize_grouped_nvfp4", "lowbit_quantize_grouped_nvfp4", _abstract,
    multiple_results=True, attrs=("flatten_axis", "tile_2d", "rht"),
    # csrc: QuantizeGroupedNvfp4WorkspaceBytes, the CUDA handler's group table (G + 1 entries
    # of six int32) and two u32 amax slots per group
    cuda_workspace=lambda avals_in, **_: (avals_in[1].shape[0] + 1) * 6 * 4 + 2 * avals_in[1].shape[0] * 4,
)

# One primitive call per batch element: every element has its own groups.
_looped_batcher(quantize_grouped_nvfp4_p)


@lru_cache(maxsize=None)
def _grouped_fn(flatten_axis: int, tile_2d: bool, rht: bool, rowwise: bool, colwise: bool):
    def fn(x, group_sizes, random, sign_bits):
        return tuple(quantize_grouped_nvfp4_p.bind(
            x, group_sizes, random, sign_bits, flatten_axis=np.int32(flatten_axis), tile_2d=np.bool_(tile_2d),
            rht=np.bool_(rht), rowwise=rowwise, colwise=colwise))

    return fn


def quantize_grouped_nvfp4(x, group_sizes, *, random=None, rht_sign_bits=None, tile_2d: bool = False,
                           rowwise: bool = True, colwise: bool = False, flatten_axis: int = -1) -> Nvfp4Quantized:
    """Quantizes each group of x's first dim as its own NVFP4 tensor (see the module doc).
    `random`: uint32 of x's shape for stochastic rounding (quantize_nvfp4.sr_random_bits), None
    for RNE; `rht_sign_bits`: uint32 (1,) applies the RHT to the colwise copies, None for none.
    Returns the packed layout as an Nvfp4Quantized (global scales (G,)); `grouped_nvfp4_slice`
    cuts one group's out."""
    x = jnp.asarray(x)
    check_high_precision(OP, "x", x)
    axis = check_copies_and_axis(OP, x, rowwise, colwise, flatten_axis)
    if x.ndim < 2 or axis < 1:
        raise ValueError(f"{OP}: x, flatten_axis: expected rank >= 2 and flatten_axis >= 1 (groups are "
                         f"stacked along the first dim), got shape {x.shape} and flatten_axis {flatten_axis}")
    group_sizes = _check_group_sizes(OP, group_sizes, x.shape[0])
    random, sign_bits, rht = check_sr_rht_args(OP, x, random, rht_sign_bits)
    outs = _grouped_fn(axis, bool(tile_2d), rht, bool(rowwise), bool(colwise))(x, group_sizes, random, sign_bits)
    row = list(outs[:3]) if rowwise else [None] * 3
    col = list(outs[3:]) if colwise else [None] * 3
    return Nvfp4Quantized(*row, *col)


def grouped_nvfp4_offsets(group_sizes, shape, flatten_axis: int = -1) -> dict[str, np.ndarray]:
    """Host-side offsets of every group for concrete sizes (clipped as the op clips): rows
    "start", "end" and "n" of x's flat view, and P (rowwise scale rows), B and Q (colwise data
    and scale offsets in bytes per row of the stored copy: group g's colwise data starts at byte
    C * B[g], its colwise scales at byte roundup(C, 128) * Q[g])."""
    shape = tuple(shape)
    f = flatten_axis % len(shape)
    unit, rows = int(np.prod(shape[1:f], dtype=np.int64)), int(np.prod(shape[:f], dtype=np.int64))
    sizes = np.minimum(np.maximum(np.asarray(group_sizes, np.int64), 0) * unit, rows)
    ends = np.minimum(np.cumsum(sizes), rows)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    n = ends - starts
    excl = lambda v: np.concatenate([[0], np.cumsum(v)[:-1]]).astype(np.int64)  # noqa: E731
    return {"start": starts, "end": ends, "n": n, "unit": unit, "P": excl(_cdiv(n, 128) * 128),
            "B": excl(_cdiv(n, 2)), "Q": excl(_cdiv(_cdiv(n, 16), 4) * 4)}


def grouped_nvfp4_slice(q: Nvfp4Quantized, group_sizes, g: int, *, shape, flatten_axis: int = -1) -> Nvfp4Quantized:
    """Group g's copies out of quantize_grouped_nvfp4's result `q` (for x of `shape`), as numpy
    arrays laid out exactly as quantize_nvfp4 of x[start_g:end_g] returns them (data uint8,
    scales e4m3, global_scale_inv f32 (1,))."""
    shape = tuple(shape)
    f = flatten_axis % len(shape)
    o = grouped_nvfp4_offsets(group_sizes, shape, f)
    s, n = int(o["start"][g]), int(o["n"][g])
    _, cols = flat_view(shape, f)
    out = [None] * 6
    if q.rowwise is not None:
        sr, sc = scale_shape(n, cols)
        out[0] = np.asarray(q.rowwise)[s:s + n]
        out[1] = np.asarray(q.rowwise_scale)[int(o["P"][g]):int(o["P"][g]) + sr].reshape(sr, sc)
        out[2] = np.asarray(q.rowwise_global_scale_inv)[g:g + 1]
    if q.colwise is not None:
        b, qg, sr, sc = int(o["B"][g]), int(o["Q"][g]), *scale_shape(cols, n)
        out[3] = np.asarray(q.colwise)[cols * b:cols * (b + _cdiv(n, 2))].reshape(cols, _cdiv(n, 2))
        out[4] = np.asarray(q.colwise_scale)[sr * qg:sr * (qg + sc)].reshape(sr, sc)
        out[5] = np.asarray(q.colwise_global_scale_inv)[g:g + 1]
    return Nvfp4Quantized(*out)
