"""TE's scale-shape queries, ScalingMode.get_scale_shape / get_scale_shape_2x: the shapes
TransformerEngine 2.12's JAX ScalingMode returns (transformer_engine/jax/quantize/
scaling_modes.py), which ported code uses to size scale buffers.

TE's formulas, for data viewed as F x L (F = prod(shape[:flatten_axis]), L the rest):
  NO_SCALING: (0,). Tensor scaling: (1,), (0,) for an empty tensor.
  Block modes (MXFP8 1x32 "NN", NVFP4 1x16 and 16x16 "NT"): blocks (bx, by) of the copy
  as stored (rowwise (1, b) or (16, 16); MXFP8 colwise (32, 1); a "T" colwise copy is given
  transposed, with flatten_axis still counted in x's layout, and is the rowwise formula of
  that shape); nx = F / bx and ny = L / by, padded when is_padded to multiples of 128 and 4
  (cuBLAS's 128 x 4 scale tiles); the result keeps the data's rank: each group of dims
  keeps its inner dims (the last one divided by the block), its first dim takes the rest of
  the padded count. broadcast_2d_scale_shape_to_1d: 16x16 tiles counted as 1x16 blocks.
  TE asserts where a dim or a padded count does not divide; here that is a ValueError naming
  the method and the argument.

lowbit's own scale arrays are 2-D (lowbit.ops.quantize_block, quantize_nvfp4): for MXFP8 and
NVFP4 the padded TE shape flattened at flatten_axis (prod of each group) is exactly the
array's shape, with NVFP4_2D's tiles broadcast to 1x16 rows (broadcast_2d_scale_shape_to_1d
=True), as TE's quantizer stores them too; lowbit's kernels also take dims that are not
multiples of the block (partial edge blocks), where TE's formula refuses. FP8_BLOCK_1x128 /
128x128 are lowbit's (TE JAX has no such mode): their shapes are lowbit's own 2-D arrays,
fp8_block_scale_shape of the stored copy (colwise: the transpose, layout "T"), unpadded
without the padding to 4; 128x128 broadcast to 1-D is the 1x128 layout.

TE's grouped queries, get_grouped_scale_shape / get_grouped_scale_shape_2x, size one flat
buffer for the scales of G groups split along F (group_axis is not read, as in TE):
  NO_SCALING and tensor scaling: (G,). n_groups must be a Python int.
  MXFP8 / NVFP4: blocks (bx, by) = the mode's block (swapped for the colwise copy, with no
  "T" transpose and no 2-D-to-1-D broadcast); flatten_axis in [-ndim, ndim) and > 0 once
  made non-negative (not taken modulo ndim, unlike get_scale_shape); nx = F / bx, ny = L / by;
  when is_padded, nx = (G - 1) * ax + roundup(nx - G + 1, ax) (the worst case: G - 1 groups of
  one block row, each padded to a whole tile) and ny = roundup(ny, ay), (ax, ay) = (128, 4)
  (swapped for the colwise copy); the result is (nx * ny,).
lowbit keeps no such buffers: its grouped quantizers (lowbit.ops.quantize_grouped*) return one
scale array per group, so these shapes only size buffers in ported TE code. FP8_BLOCK_* (not
in TE) have no grouped shape here (NotImplementedError).
"""

from __future__ import annotations

import math

_TE_ALIGNMENT = (128, 4)  # TE's _block_alignment: cuBLAS's 128 x 4 scale-factor tiles


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _fail(what: str, method: str = "get_scale_shape"):
    raise ValueError(f"lowbit.quantize.ScalingMode.{method}: {what}")


def _normalized_axis(data_shape: tuple[int, ...], flatten_axis: int) -> int:
    ndim = len(data_shape)
    axis = (ndim + flatten_axis) % ndim if ndim else 0
    if not 0 < axis < ndim:
        _fail(f"flatten_axis: {flatten_axis} is out of bounds for data_shape {data_shape}")
    return axis


def _check_layout(mode, data_layout: str, is_colwise: bool) -> None:
    want = mode.get_data_layout()[1 if is_colwise else 0]
    if data_layout != want:
        _fail(f"data_layout: expected {want!r} for the {'colwise' if is_colwise else 'rowwise'} "
              f"copy of {mode.name}, got {data_layout!r}")


def _group_shape(dims: tuple[int, ...], n_blocks: int, block: int) -> tuple[int, ...]:
    """TE's _apply_scale_shape_correction: one group of dims' scale dims, its inner dims kept
    (the last divided by the block), its first dim the rest of n_blocks."""
    if len(dims) <= 1:
        return (n_blocks,)
    if dims[-1] % block:
        _fail(f"data_shape: dim {dims[-1]} is not a multiple of the block {block}")
    inner = (dims[-1] // block,)
    for mid in reversed(dims[1:-1]):
        inner = (mid,) + inner
    if n_blocks % math.prod(inner):
        _fail(f"data_shape: {n_blocks} scale rows/columns do not split over the dims {dims} "
              f"(TE's formula needs them to)")
    return (n_blocks // math.prod(inner),) + inner


def _blocks_and_alignment(mode, data_shape, axis: int, is_colwise: bool, is_padded: bool,
                          method: str = "get_scale_shape") -> tuple[int, int, int, int]:
    """(block_x, block_y, align_x, align_y) of TE's block-scaled formulas: the mode's block
    and TE's scale alignment (1, 1 unpadded), swapped for a colwise copy; the data's dims on
    each side of `axis` must be multiples of the block."""
    block_x, block_y = mode.block_shape
    align_x, align_y = _TE_ALIGNMENT if is_padded else (1, 1)
    if is_colwise:
        block_x, block_y, align_x, align_y = block_y, block_x, align_y, align_x
    if data_shape[axis - 1] % block_x or data_shape[-1] % block_y:
        _fail(f"data_shape: {data_shape} (flatten_axis {axis}) is not a multiple of the "
              f"{block_x} x {block_y} blocks", method)
    return block_x, block_y, align_x, align_y


def te_block_scale_shape(mode, data_shape, data_layout, is_colwise, is_padded, flatten_axis,
                         broadcast_2d_scale_shape_to_1d) -> tuple[int, ...]:
    """TE's BlockScalingModeMetadataImpl.get_scale_shape for MXFP8 / NVFP4 modes."""
    axis = _normalized_axis(data_shape, flatten_axis)
    _check_layout(mode, data_layout, is_colwise)
    if is_colwise and data_layout == "T":
        is_colwise = False  # the stored transpose is scaled rowwise
        axis = len(data_shape) - axis
    block_x, block_y, align_x, align_y = _blocks_and_alignment(mode, data_shape, axis, is_colwise, is_padded)
    if broadcast_2d_scale_shape_to_1d and block_x > 1 and block_y > 1:
        block_x = 1
    first, last = math.prod(data_shape[:axis]), math.prod(data_shape[axis:])
    if first % block_x or last % block_y:
        _fail(f"data_shape: {data_shape} viewed as {first} x {last} is not a multiple of the "
              f"{block_x} x {block_y} blocks")
    n_x = _round_up(first // block_x, align_x)
    n_y = _round_up(last // block_y, align_y)
    return _group_shape(data_shape[:axis], n_x, block_x) + _group_shape(data_shape[axis:], n_y, block_y)


def fp8_block_scale_shape(mode, data_shape, data_layout, is_colwise, is_padded, flatten_axis,
                          broadcast_2d_scale_shape_to_1d) -> tuple[int, int]:
    """lowbit's FP8 block modes: the 2-D scale_inv array of the stored copy (see above)."""
    from lowbit.ops.quantize_block import FP8_BLOCK_LEN
    from lowbit.ops.quantize_block import fp8_block_scale_shape as stored_shape

    axis = _normalized_axis(data_shape, flatten_axis)
    _check_layout(mode, data_layout, is_colwise)
    if is_colwise:
        axis = len(data_shape) - axis  # data_shape is the transposed copy
    rows, cols = math.prod(data_shape[:axis]), math.prod(data_shape[axis:])
    tile_2d = mode.block_shape == (FP8_BLOCK_LEN, FP8_BLOCK_LEN) and not broadcast_2d_scale_shape_to_1d
    if is_padded:
        return stored_shape(rows, cols, tile_2d)
    if tile_2d:
        return _cdiv(rows, FP8_BLOCK_LEN), _cdiv(cols, FP8_BLOCK_LEN)
    return _cdiv(cols, FP8_BLOCK_LEN), rows


def scale_shape(mode, data_shape, data_layout="N", is_colwise=False, is_padded=True, flatten_axis=-1,
                broadcast_2d_scale_shape_to_1d=False) -> tuple[int, ...]:
    """ScalingMode.get_scale_shape (the module docstring has the formulas)."""
    data_shape = tuple(int(d) for d in data_shape)
    if mode.scale_dtype is None:  # NO_SCALING
        return (0,)
    if mode.is_tensor_scaling():
        return (0,) if math.prod(data_shape) == 0 else (1,)
    args = (mode, data_shape, data_layout, is_colwise, is_padded, flatten_axis, broadcast_2d_scale_shape_to_1d)
    if mode.is_nvfp4 or mode.is_mxfp8_scaling:
        return te_block_scale_shape(*args)
    return fp8_block_scale_shape(*args)


def scale_shape_2x(mode, data_shape, is_padded=True, flatten_axis=-1, broadcast_2d_scale_shape_to_1d=False):
    """ScalingMode.get_scale_shape_2x: (rowwise, colwise) scale shapes; a "T" colwise copy's
    shape is data_shape[flatten_axis:] + data_shape[:flatten_axis], as in TE."""
    data_shape = tuple(int(d) for d in data_shape)
    rowwise_layout, colwise_layout = mode.get_data_layout()
    rowwise = scale_shape(mode, data_shape, rowwise_layout, False, is_padded, flatten_axis,
                          broadcast_2d_scale_shape_to_1d)
    colwise_shape = data_shape
    if colwise_layout == "T":
        colwise_shape = data_shape[flatten_axis:] + data_shape[:flatten_axis]
    colwise = scale_shape(mode, colwise_shape, colwise_layout, True, is_padded, flatten_axis,
                          broadcast_2d_scale_shape_to_1d)
    return rowwise, colwise


def grouped_scale_shape(mode, data_shape, n_groups, group_axis, is_colwise, is_padded=True,
                        flatten_axis=-1) -> tuple[int]:
    """ScalingMode.get_grouped_scale_shape (the module docstring has the formula)."""
    del group_axis  # TE does not read it either
    method = "get_grouped_scale_shape"
    if not isinstance(n_groups, int):
        _fail(f"n_groups: expected a Python int (TE asserts one), got {n_groups!r}", method)
    if mode.scale_dtype is None or mode.is_tensor_scaling():
        return (n_groups,)
    if not (mode.is_nvfp4 or mode.is_mxfp8_scaling):
        raise NotImplementedError(f"lowbit.quantize.ScalingMode.{method}: {mode.name} is lowbit's "
                                  f"mode (not TE's) and has no grouped scale buffer")
    data_shape = tuple(int(d) for d in data_shape)
    ndim = len(data_shape)
    axis = flatten_axis + ndim if flatten_axis < 0 else flatten_axis
    if not 0 < axis < ndim:
        _fail(f"flatten_axis: {flatten_axis} is out of bounds for data_shape {data_shape}", method)
    block_x, block_y, align_x, align_y = _blocks_and_alignment(mode, data_shape, axis, is_colwise, is_padded,
                                                               method)
    n_x = math.prod(data_shape[:axis]) // block_x
    n_y = math.prod(data_shape[axis:]) // block_y
    if is_padded:
        n_x = (n_groups - 1) * align_x + _round_up(n_x - n_groups + 1, align_x)
        n_y = _round_up(n_y, align_y)
    return (n_x * n_y,)


def grouped_scale_shape_2x(mode, data_shape, n_groups, group_axis, is_padded=True, flatten_axis=-1):
    """ScalingMode.get_grouped_scale_shape_2x: (rowwise, colwise) grouped scale shapes."""
    return (grouped_scale_shape(mode, data_shape, n_groups, group_axis, False, is_padded, flatten_axis),
            grouped_scale_shape(mode, data_shape, n_groups, group_axis, True, is_padded, flatten_axis))
