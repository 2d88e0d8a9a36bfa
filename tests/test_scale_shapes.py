"""ScalingMode.get_scale_shape / get_scale_shape_2x, their grouped forms and
Quantizer.get_scale_shapes: TE 2.12's scale shapes, each expected value worked out by hand
from TE's formulas (lowbit/quantize/scale_shapes.py states them):

  block modes: nx = F / bx, ny = L / by for data viewed as F x L at flatten_axis, padded to
  multiples of (128, 4) when is_padded; each group of dims keeps its inner dims (its last
  divided by the block) and its first dim takes the rest; a "T" colwise copy (NVFP4) is the
  rowwise formula of the transposed shape.

Then the link to lowbit's own arrays: the padded TE shape flattened at flatten_axis is the
shape of the scale_inv lowbit's quantizers emit (MXFP8, NVFP4), and the FP8 block modes
(lowbit's, not TE's) return those arrays' shapes directly.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from lowbit.quantize import NVFP4Quantizer, QuantizeLayout, QuantizerFactory, ScalingMode

MX, NV1, NV2 = ScalingMode.MXFP8_1D_SCALING, ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING
B1, B2 = ScalingMode.FP8_BLOCK_1x128, ScalingMode.FP8_BLOCK_128x128

# (mode, data_shape, flatten_axis, is_padded, broadcast, rowwise, colwise), by hand:
CASES_2X = [
    # MXFP8 (1x32 rowwise, 32x1 colwise, both "N"):
    # (256, 512): rows 256 -> 256; 512/32 = 16 -> 16 | colwise 256/32 = 8 -> 8; 512 -> 512.
    (MX, (256, 512), -1, True, False, (256, 16), (8, 512)),
    # (160, 96): 160 -> 256; 96/32 = 3 -> 4 | 160/32 = 5 -> 8; 96 -> 128. Unpadded (160, 3), (5, 96).
    (MX, (160, 96), -1, True, False, (256, 4), (8, 128)),
    (MX, (160, 96), -1, False, False, (160, 3), (5, 96)),
    # (2, 64, 96): F = 128 -> 128 = 2 x 64; 96/32 = 3 -> 4 | 128/32 = 4 -> 4 = 2 x (64/32); 96 -> 128.
    (MX, (2, 64, 96), -1, True, False, (2, 64, 4), (2, 2, 128)),
    (MX, (2, 64, 96), 2, False, False, (2, 64, 3), (2, 2, 96)),
    # NVFP4 1D (1x16, colwise transposed "T"):
    # (256, 128): 256 -> 256; 128/16 = 8 | x^T (128, 256): 128 -> 128; 256/16 = 16.
    (NV1, (256, 128), -1, True, False, (256, 8), (128, 16)),
    # (4, 32, 64): F = 128 = 4 x 32; 64/16 = 4 | x^T (64, 4, 32) at 1: 64 -> 128; 128/16 = 8 = 4 x (32/16).
    (NV1, (4, 32, 64), -1, True, False, (4, 32, 4), (128, 4, 2)),
    (NV1, (4, 32, 64), -1, False, False, (4, 32, 4), (64, 4, 2)),
    # (2, 48, 32) unpadded: (2, 48, 2) | x^T (32, 2, 48): 32; 96/16 = 6 = 2 x (48/16).
    (NV1, (2, 48, 32), -1, False, False, (2, 48, 2), (32, 2, 3)),
    # flatten_axis 1 of (32, 4, 16): F = 32 -> 128; 64/16 = 4 = 4 x (16/16) | x^T (4, 16, 32) at
    # 3 - 1 = 2: F = 64 -> 128 = 128/16 x 16 (first dim 8); 32/16 = 2 -> 4.
    (NV1, (32, 4, 16), 1, True, False, (128, 4, 1), (8, 16, 4)),
    # NVFP4 2D (16x16 tiles): (256, 128): 256/16 = 16 -> 128; 8 | x^T: 128/16 = 8 -> 128; 16.
    (NV2, (256, 128), -1, True, False, (128, 8), (128, 16)),
    (NV2, (256, 128), -1, False, False, (16, 8), (8, 16)),
    # broadcast to 1x16: the NVFP4 1D shapes.
    (NV2, (256, 128), -1, True, True, (256, 8), (128, 16)),
    (NV2, (32, 48), -1, False, True, (32, 3), (48, 2)),
    (NV2, (32, 48), -1, True, False, (128, 4), (128, 4)),
    # Tensor scaling and NO_SCALING: one scale, none.
    (ScalingMode.DELAYED_TENSOR_SCALING, (3, 5, 7), -1, True, False, (1,), (1,)),
    (ScalingMode.CURRENT_TENSOR_SCALING, (0, 16), -1, True, False, (0,), (0,)),
    (ScalingMode.NO_SCALING, (64, 64), -1, False, False, (0,), (0,)),
    # lowbit's FP8 block modes: its arrays (ceil(C/128), roundup(R, 4)) / (ceil(R/128),
    # roundup(ceil(C/128), 4)) of each stored copy, the colwise one being x^T.
    (B1, (301, 200), -1, True, False, (2, 304), (3, 200)),
    (B1, (301, 200), -1, False, False, (2, 301), (3, 200)),
    (B1, (2, 150, 200), -1, True, False, (2, 300), (3, 200)),
    (B2, (300, 200), -1, True, False, (3, 4), (2, 4)),
    (B2, (300, 200), -1, False, False, (3, 2), (2, 3)),
    (B2, (300, 200), -1, True, True, (2, 300), (3, 200)),
]


@pytest.mark.parametrize("mode, shape, axis, padded, broadcast, rowwise, colwise", CASES_2X,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_scale_shape_2x(mode, shape, axis, padded, broadcast, rowwise, colwise):
    got = mode.get_scale_shape_2x(shape, is_padded=padded, flatten_axis=axis,
                                  broadcast_2d_scale_shape_to_1d=broadcast)
    assert got == (rowwise, colwise)
    # TE's positional order, and get_scale_shape with each copy's layout gives the same.
    assert mode.get_scale_shape_2x(shape, padded, axis, broadcast) == got
    layout = mode.get_data_layout()
    t_shape = tuple(shape[axis:]) + tuple(shape[:axis]) if layout[1] == "T" else shape
    assert mode.get_scale_shape(shape, layout[0], False, padded, axis, broadcast) == rowwise
    assert mode.get_scale_shape(t_shape, data_layout=layout[1], is_colwise=True, is_padded=padded,
                                flatten_axis=axis, broadcast_2d_scale_shape_to_1d=broadcast) == colwise


def test_scale_shape_defaults():
    # TE's defaults: rowwise, "N", padded, flatten_axis -1, no broadcast.
    assert MX.get_scale_shape((100, 64)) == (128, 4)  # 100 -> 128; 64/32 = 2 -> 4
    assert NV2.get_scale_shape((16, 16)) == (128, 4)  # 1 tile -> (128, 4)
    assert ScalingMode.CURRENT_TENSOR_SCALING.get_scale_shape(()) == (1,)  # a scalar: 1 element
    # The padded count must split over a group's dims: (4, 8, 64) gives 32 rows -> 128 = 16 x 8.
    assert MX.get_scale_shape((4, 8, 64)) == (16, 8, 4)


@pytest.mark.parametrize("mode, shape, kwargs, what", [
    # TE asserts in each of these; lowbit says which argument.
    (MX, (2, 3, 64), {}, "do not split over the dims"),  # 6 rows -> 128, not a multiple of 3
    (MX, (4, 8, 64), dict(is_colwise=True), "not a multiple of the 32 x 1 blocks"),  # 8 % 32
    (MX, (64, 48), {}, "not a multiple of the 1 x 32 blocks"),  # 48 % 32
    (NV1, (64, 64), dict(is_colwise=True), "data_layout: expected 'T'"),  # colwise copy is x^T
    (NV1, (64, 64), dict(data_layout="T"), "data_layout: expected 'N'"),
    (MX, (64, 64), dict(flatten_axis=2), "flatten_axis: 2 is out of bounds"),
    (MX, (64,), {}, "flatten_axis: -1 is out of bounds"),  # 1-D: no 2-D view
    (B1, (64, 64), dict(flatten_axis=0), "flatten_axis: 0 is out of bounds"),
])
def test_scale_shape_refusals(mode, shape, kwargs, what):
    with pytest.raises(ValueError, match=f"get_scale_shape: .*{what}"):
        mode.get_scale_shape(shape, **kwargs)


def _flat(shape, axis):
    axis %= len(shape)
    return math.prod(shape[:axis]), math.prod(shape[axis:])


@pytest.mark.parametrize("shape, axis", [((256, 96), -1), ((2, 64, 96), -1), ((64, 32, 64), 1)])
@pytest.mark.parametrize("mode", [MX, NV1, NV2, B1, B2], ids=lambda m: m.name)
def test_lowbit_scale_arrays_are_te_shapes_flattened(mode, shape, axis):
    x = jnp.ones(shape, jnp.bfloat16)
    if mode.is_nvfp4:
        quantizer = NVFP4Quantizer(mode=mode)
    else:
        quantizer = QuantizerFactory.create(mode, jnp.float8_e4m3fn)
    both, _ = quantizer.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=axis)
    have = (both.rowwise_tensor.scale_inv.shape, both.colwise_tensor.scale_inv.shape)
    rowwise, colwise = mode.get_scale_shape_2x(shape, flatten_axis=axis,
                                               broadcast_2d_scale_shape_to_1d=mode == NV2)
    if mode in (B1, B2):  # lowbit's modes: its arrays' shapes as they are
        assert have == (rowwise, colwise)
        return
    n = len(shape)
    colwise_axis = (n - axis % n) if mode.get_data_layout()[1] == "T" else axis
    assert have == (_flat(rowwise, axis), _flat(colwise, colwise_axis))


# get_grouped_scale_shape(_2x), by hand from TE's formula: nx = F / bx, ny = L / by (blocks
# swapped for colwise, no transpose); padded: nx = (G - 1) * ax + roundup(nx - G + 1, ax),
# ny = roundup(ny, ay), (ax, ay) = (128, 4) rowwise, (4, 128) colwise; the shape is (nx * ny,).
# (mode, data_shape, n_groups, flatten_axis, is_padded, rowwise, colwise):
GROUPED_CASES = [
    # MXFP8 (256, 512), G 4: rows 256 -> 3*128 + roundup(253, 128) = 640; 16 -> 16: 10240 |
    # 256/32 = 8 -> 3*4 + roundup(5, 4) = 20; 512 -> 512: 10240. Unpadded 256*16, 8*512.
    (MX, (256, 512), 4, -1, True, (10240,), (10240,)),
    (MX, (256, 512), 4, -1, False, (4096,), (4096,)),
    # MXFP8 (3, 64, 96), G 3: F 192 -> 2*128 + roundup(190, 128) = 512; 96/32 = 3 -> 4: 2048 |
    # 192/32 = 6 -> 2*4 + roundup(4, 4) = 12; 96 -> 128: 1536. Unpadded 192*3, 6*96.
    (MX, (3, 64, 96), 3, -1, True, (2048,), (1536,)),
    (MX, (3, 64, 96), 3, -1, False, (576,), (576,)),
    # MXFP8 (32, 4, 64) at 1 (and -2), G 2: F 32 -> 128 + roundup(31, 128) = 256; 256/32 = 8: 2048 |
    # 32/32 = 1 -> 4 + roundup(0, 4) = 4; 256 -> 256: 1024. Unpadded 32*8, 1*256.
    (MX, (32, 4, 64), 2, 1, True, (2048,), (1024,)),
    (MX, (32, 4, 64), 2, -2, True, (2048,), (1024,)),
    (MX, (32, 4, 64), 2, 1, False, (256,), (256,)),
    # One group is the ungrouped padded size: (160, 96) -> (256, 4) and (8, 128).
    (MX, (160, 96), 1, -1, True, (1024,), (1024,)),
    # NVFP4 1D (128, 48), G 2: 128 -> 128 + roundup(127, 128) = 256; 48/16 = 3 -> 4: 1024 |
    # 128/16 = 8 -> 4 + roundup(7, 4) = 12; 48 -> 128: 1536. Unpadded 128*3, 8*48.
    (NV1, (128, 48), 2, -1, True, (1024,), (1536,)),
    (NV1, (128, 48), 2, -1, False, (384,), (384,)),
    # NVFP4 2D (64, 32), G 2: 64/16 = 4 -> 128 + roundup(3, 128) = 256; 2 -> 4: 1024 |
    # 4 -> 4 + roundup(3, 4) = 8; 2 -> 128: 1024. Unpadded 4*2 both.
    (NV2, (64, 32), 2, -1, True, (1024,), (1024,)),
    (NV2, (64, 32), 2, -1, False, (8,), (8,)),
    # More groups than block rows: NVFP4 2D (32, 16), G 4: 2 -> 3*128 + roundup(-1, 128) = 384;
    # 1 -> 4: 1536 | 2 -> 3*4 + roundup(-1, 4) = 12; 1 -> 128: 1536.
    (NV2, (32, 16), 4, -1, True, (1536,), (1536,)),
    # One scale per group for tensor scaling, as for NO_SCALING.
    (ScalingMode.DELAYED_TENSOR_SCALING, (3, 5, 7), 5, -1, True, (5,), (5,)),
    (ScalingMode.CURRENT_TENSOR_SCALING, (64, 64), 2, -1, False, (2,), (2,)),
    (ScalingMode.NO_SCALING, (64, 64), 3, -1, True, (3,), (3,)),
]


@pytest.mark.parametrize("mode, shape, groups, axis, padded, rowwise, colwise", GROUPED_CASES,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_grouped_scale_shape(mode, shape, groups, axis, padded, rowwise, colwise):
    got = mode.get_grouped_scale_shape_2x(shape, groups, 0, is_padded=padded, flatten_axis=axis)
    assert got == (rowwise, colwise)
    assert mode.get_grouped_scale_shape_2x(shape, groups, 0, padded, axis) == got  # TE's order
    assert mode.get_grouped_scale_shape(shape, groups, 0, False, padded, axis) == rowwise
    assert mode.get_grouped_scale_shape(shape, groups, group_axis=1, is_colwise=True, is_padded=padded,
                                        flatten_axis=axis) == colwise


@pytest.mark.parametrize("mode, shape, kwargs, what", [
    # TE asserts in each of these; lowbit says which argument.
    (MX, (64, 48), {}, "data_shape: .*not a multiple of the 1 x 32 blocks"),  # 48 % 32
    (MX, (16, 64), dict(is_colwise=True), "data_shape: .*not a multiple of the 32 x 1 blocks"),
    (NV2, (64, 24), {}, "data_shape: .*not a multiple of the 16 x 16 blocks"),
    (MX, (32, 4, 64), dict(flatten_axis=3), "flatten_axis: 3 is out of bounds"),  # not modulo ndim
    (MX, (32, 4, 64), dict(flatten_axis=-4), "flatten_axis: -4 is out of bounds"),
    (MX, (32, 64), dict(flatten_axis=0), "flatten_axis: 0 is out of bounds"),
    (MX, (32, 64), dict(n_groups=2.0), "n_groups: expected a Python int"),
    (ScalingMode.DELAYED_TENSOR_SCALING, (32, 64), dict(n_groups=(1, 2)), "n_groups: expected"),
])
def test_grouped_scale_shape_refusals(mode, shape, kwargs, what):
    args = dict(n_groups=2, group_axis=0, is_colwise=False) | kwargs
    with pytest.raises(ValueError, match=f"get_grouped_scale_shape: {what}"):
        mode.get_grouped_scale_shape(shape, **args)


@pytest.mark.parametrize("mode", [B1, B2], ids=lambda m: m.name)
def test_grouped_scale_shape_fp8_block_modes_refused(mode):
    with pytest.raises(NotImplementedError, match=f"{mode.name} is lowbit's mode"):
        mode.get_grouped_scale_shape_2x((256, 256), 2, 0)


@pytest.mark.parametrize("quantizer, shape, kwargs, rowwise, colwise", [
    # TE's Quantizer.get_scale_shapes is scaling_mode.get_scale_shape_2x(shape, is_padded,
    # flatten_axis): the shapes worked out in CASES_2X above, both whatever q_layout is.
    (QuantizerFactory.create(MX, jnp.float8_e4m3fn), (160, 96), {}, (256, 4), (8, 128)),
    (QuantizerFactory.create(MX, jnp.float8_e4m3fn, q_layout=QuantizeLayout.ROWWISE), (160, 96),
     dict(is_padded=False), (160, 3), (5, 96)),
    (QuantizerFactory.create(MX, jnp.float8_e4m3fn), (2, 64, 96), dict(flatten_axis=2),
     (2, 64, 4), (2, 2, 128)),
    # NVFP4 2D: the 16x16 tiles, not broadcast to 1x16 (TE passes no broadcast flag).
    (NVFP4Quantizer(mode=NV2), (256, 128), {}, (128, 8), (128, 16)),
    (NVFP4Quantizer(mode=NV1), (32, 4, 16), dict(flatten_axis=1), (128, 4, 1), (8, 16, 4)),
    # Other keywords (TE's grouped quantizer's group_sizes) are dropped, as TE's base class does.
    (NVFP4Quantizer(mode=NV1), (4, 32, 64), dict(is_padded=False, group_sizes=4), (4, 32, 4), (64, 4, 2)),
    (QuantizerFactory.create(ScalingMode.DELAYED_TENSOR_SCALING, jnp.float8_e4m3fn,
                             q_layout=QuantizeLayout.COLWISE), (3, 5, 7), {}, (1,), (1,)),
    (QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e5m2), (0, 16), {}, (0,), (0,)),
    # lowbit's FP8 block modes: their arrays' shapes (CASES_2X).
    (QuantizerFactory.create(B1, jnp.float8_e4m3fn), (301, 200), {}, (2, 304), (3, 200)),
], ids=lambda v: type(v).__name__ if hasattr(v, "quantize") else str(v))
def test_quantizer_get_scale_shapes(quantizer, shape, kwargs, rowwise, colwise):
    assert quantizer.get_scale_shapes(shape, **kwargs) == (rowwise, colwise)


def test_quantizer_get_scale_shapes_positional_and_refusal():
    quantizer = QuantizerFactory.create(MX, jnp.float8_e4m3fn)
    assert quantizer.get_scale_shapes((160, 96), False, -1) == ((160, 3), (5, 96))  # TE's order
    with pytest.raises(ValueError, match="get_scale_shape: .*flatten_axis: 0 is out of bounds"):
        quantizer.get_scale_shapes((64, 64), flatten_axis=0)


@pytest.mark.parametrize("quantizer, dtype", [
    # TE's Quantizer.get_scale_dtype is scaling_mode.get_scale_dtype(): e8m0 for MXFP8, e4m3 for
    # NVFP4's block scales, fp32 for the tensor and FP8 block modes.
    (QuantizerFactory.create(MX, jnp.float8_e4m3fn), jnp.float8_e8m0fnu),
    (NVFP4Quantizer(mode=NV1), jnp.float8_e4m3fn),
    (QuantizerFactory.create(ScalingMode.DELAYED_TENSOR_SCALING, jnp.float8_e4m3fn), jnp.float32),
    (QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e5m2), jnp.float32),
    (QuantizerFactory.create(B2, jnp.float8_e4m3fn), jnp.float32),
], ids=lambda v: getattr(v, "__name__", type(v).__name__))
def test_quantizer_get_scale_dtype(quantizer, dtype):
    assert jnp.dtype(quantizer.get_scale_dtype()) == jnp.dtype(dtype)
