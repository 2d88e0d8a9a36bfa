"""lowbit.ops.quantize_fp8_block / quantize_mxfp8 and their dequantize ops: bit for bit against
a few-line numpy reference (every layout, input dtype, FP8 format, 1x128 and 128x128 tiles,
fp32 and power-of-two scales, odd shapes with partial tiles, inf/NaN/zeros/near-max values,
all-zero and subnormal blocks), the scale layouts and their zero padding, dequantize and its
round-trip error bound, dbias (bit for bit against a numpy reference of the summation order of
csrc/quantize/block_dbias.h, and close to a float64 sum), jit, vmap, sharding over virtual CPU
devices, bad input, and the CUDA kernels against the CPU handlers (bit for bit, dbias included,
and run-to-run identical; `gpu` marker).

The references are numpy, not jnp: XLA:CPU flushes subnormals (FTZ/DAZ), and the MXFP8 factor
2^(127 - e) is an fp32 subnormal for e > 253; numpy's fp32 arithmetic is plain IEEE, as the
kernels' is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit
from lowbit.ops.quantize_block import (
    dequantize_fp8_block,
    dequantize_mxfp8,
    quantize_fp8_block,
    quantize_fp8_block_p,
    quantize_mxfp8,
    quantize_mxfp8_p,
)

F32 = np.float32
# numpy warns on the inf/NaN the special values produce; they are the point of the test.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _tiles(q, tr, tc):
    """q (R x C) zero-padded and viewed as (R/tr, C/tc, tr*tc) tiles."""
    r, c = q.shape
    p = np.zeros((-(-r // tr) * tr, -(-c // tc) * tc), F32)
    p[:r, :c] = q
    return p.reshape(p.shape[0] // tr, tr, p.shape[1] // tc, tc).transpose(0, 2, 1, 3).reshape(
        p.shape[0] // tr, p.shape[1] // tc, tr * tc)


def _expand(grid, tr, tc, shape):
    return np.repeat(np.repeat(grid, tr, 0), tc, 1)[: shape[0], : shape[1]]


def _pad(a, shape):
    out = np.zeros(shape, a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _cast(v, fp8):
    fmax = F32(ml_dtypes.finfo(fp8).max)
    return np.clip(v, -fmax, fmax).astype(fp8)


def fp8_block_copy_ref(q, fp8, tile_2d, pow2):
    """(codes, scale_inv) of one stored copy q (R x C, fp32): per tile scale = max / amax."""
    tr = 128 if tile_2d else 1
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        amax = np.max(np.abs(_tiles(q, tr, 128)), axis=-1)
        scale = F32(ml_dtypes.finfo(fp8).max) / amax
        scale = np.where(np.isfinite(amax) & (amax > 0), scale, F32(1))
        scale = np.where(np.isinf(scale), np.finfo(F32).max, scale).astype(F32)
        if pow2:
            scale = (scale.view(np.uint32) & np.uint32(0xFF800000)).view(F32)
        codes = _cast(q * _expand(scale, tr, 128, q.shape), fp8)
        inv = (F32(1) / scale).astype(F32)
    r, c = q.shape
    if tile_2d:
        return codes, _pad(inv, (-(-r // 128), -(-(-(-c // 128)) // 4) * 4))
    return codes, _pad(inv.T, (-(-c // 128), -(-r // 4) * 4))


def quantize_fp8_block_ref(x, fp8, tile_2d, pow2, flatten_axis=-1):
    f = flatten_axis % x.ndim
    x2 = np.asarray(x, F32).reshape(int(np.prod(x.shape[:f])), int(np.prod(x.shape[f:])))
    row, row_s = fp8_block_copy_ref(x2, fp8, tile_2d, pow2)
    col, col_s = fp8_block_copy_ref(np.ascontiguousarray(x2.T), fp8, tile_2d, pow2)
    return row.reshape(x.shape), row_s, col.reshape(x.shape[f:] + x.shape[:f]), col_s


def mxfp8_copy_ref(x2, fp8, colwise):
    """(codes, E8M0 scales) of one MXFP8 copy of x2 (R x C, fp32)."""
    tr, tc = (32, 1) if colwise else (1, 32)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (np.max(np.abs(_tiles(x2, tr, tc)), axis=-1) / F32(ml_dtypes.finfo(fp8).max)).astype(F32)
    bits = s.view(np.uint32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    e = np.where(np.isnan(s), 255, np.minimum(e, 254)).astype(np.uint8)
    factor = np.where(e == 255, np.nan, np.ldexp(F32(1), 127 - e.astype(np.int32))).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = _cast(x2 * _expand(factor, tr, tc, x2.shape), fp8)
    r, c = x2.shape
    shape = (-(-(-(-r // 32)) // 4) * 4, -(-c // 128) * 128) if colwise else (-(-r // 128) * 128, -(-(-(-c // 32)) // 4) * 4)
    return codes, _pad(e, shape).view(ml_dtypes.float8_e8m0fnu)


def quantize_mxfp8_ref(x, fp8, flatten_axis=-1):
    f = flatten_axis % x.ndim
    x2 = np.asarray(x, F32).reshape(int(np.prod(x.shape[:f])), int(np.prod(x.shape[f:])))
    row, row_s = mxfp8_copy_ref(x2, fp8, False)
    col, col_s = mxfp8_copy_ref(x2, fp8, True)
    return row.reshape(x.shape), row_s, col.reshape(x.shape), col_s


def dbias_ref(x, kind, flatten_axis=-1):
    """dbias in the order of csrc/quantize/block_dbias.h: tiles of H rows (128; MXFP8 64),
    lane g of a tile sums rows g, g + S, ... (S = 32 / itemsize), the tile sums its lanes in
    order, then workspace rows t = y, y + 8, ... are summed per y and the 8 sums in order;
    every sum one fp32 add at a time from +0; a NaN result is the canonical quiet NaN."""
    f = flatten_axis % x.ndim
    rows, cols = int(np.prod(x.shape[:f])), int(np.prod(x.shape[f:]))
    height, lanes = (64 if kind == "mxfp8" else 128), 32 // np.dtype(x.dtype).itemsize
    tiles = -(-rows // height)
    v = np.zeros((tiles * height, cols), F32)
    v[:rows] = np.asarray(x, F32).reshape(rows, cols)

    def ordered(terms):  # ((0 + terms[0]) + terms[1]) + ...
        total = np.zeros(terms.shape[1:], F32)
        for t in terms:
            total = total + t
        return total

    lane = ordered(v.reshape(tiles, height // lanes, lanes, cols).transpose(1, 0, 2, 3))  # [t, g, c]
    tile = ordered(lane.transpose(1, 0, 2))  # [t, c]
    padded = np.zeros((-(-tiles // 8) * 8, cols), F32)
    padded[:tiles] = tile
    total = ordered(ordered(padded.reshape(-1, 8, cols)))
    total[np.isnan(total)] = F32(np.nan)
    return total.astype(x.dtype).reshape(x.shape[f:])


def assert_dbias_near_exact_sum(got, x, flatten_axis=-1):
    """Where the float64 sum is finite: |got - sum| <= rows * 2^-24 * sum|x| (fp32 summation)
    plus one ulp of the output dtype."""
    f = flatten_axis % x.ndim
    x2 = np.asarray(x, np.float64).reshape(int(np.prod(x.shape[:f])), int(np.prod(x.shape[f:])))
    exact, mag = x2.sum(0), np.abs(x2).sum(0)
    g = np.asarray(got, np.float64).reshape(-1)
    ok = np.isfinite(mag) & (mag < float(ml_dtypes.finfo(x.dtype).max))
    ulp = np.abs(exact) * float(ml_dtypes.finfo(x.dtype).eps) + float(ml_dtypes.finfo(x.dtype).smallest_subnormal)
    bound = x2.shape[0] * 2.0**-24 * mag + ulp
    assert np.all(np.abs(g - exact)[ok] <= bound[ok]), np.max((np.abs(g - exact) - bound)[ok])


def assert_fp8_equal(got, want):
    """Same NaN positions, same bits everywhere else (NaN signs are checked CPU vs CUDA);
    for fp8 codes and for dequantized floats alike."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    gnan, wnan = np.isnan(got.astype(F32)), np.isnan(want.astype(F32))
    np.testing.assert_array_equal(gnan, wnan)
    bits = np.dtype(f"u{got.dtype.itemsize}")
    np.testing.assert_array_equal(got.view(bits)[~gnan], want.view(bits)[~wnan])


def assert_bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def with_block_specials(rng, shape, dtype):
    """random_with_specials plus, in the 2-D view, an all-zero region, a region of subnormal
    or tiny values and one of near-max values, each spanning whole 128-blocks where it fits."""
    x = random_with_specials(rng, shape, dtype).astype(F32)
    x2 = x.reshape(shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else x.reshape(1, -1)
    info = ml_dtypes.finfo(dtype)
    r, c = x2.shape
    x2[: min(r, 130), : min(c, 128)] = 0.0  # all-zero 1x128 tiles, 32-blocks and columns
    if c > 128:
        x2[: min(r, 40), 128 : min(c, 256)] = float(info.smallest_subnormal) * rng.integers(-3, 4, (min(r, 40), min(c, 256) - 128))
    if r > 2:
        x2[-1, :] = float(info.max) * rng.uniform(-1, 1, c)
    return x2.reshape(shape).astype(dtype)


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
SHAPES = [((1, 1), -1), ((3, 200), -1), ((130, 129), -1), ((257, 300), -1), ((2, 3, 129), 1),
          ((2, 3, 129), 2), ((11,), -1), ((64, 256), -1), ((0, 5), -1)]
ids = lambda d: np.dtype(d).name  # noqa: E731


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", SHAPES, ids=str)
@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x128", "128x128"])
def test_fp8_block_equals_reference(shape, axis, tile_2d, dtype, rng):
    x = with_block_specials(rng, shape, dtype)
    for i, pow2 in enumerate([False, True]):
        fp8 = FP8[i]
        got = quantize_fp8_block(x, out_dtype=fp8, tile_2d=tile_2d, pow2_scales=pow2, rowwise=True,
                                 colwise=True, flatten_axis=axis)
        want = quantize_fp8_block_ref(x, fp8, tile_2d, pow2, axis)
        assert_fp8_equal(got.rowwise, want[0])
        assert_bits_equal(got.rowwise_scale, want[1])
        assert_fp8_equal(got.colwise, want[2])
        assert_bits_equal(got.colwise_scale, want[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", SHAPES, ids=str)
def test_mxfp8_equals_reference(shape, axis, dtype, rng):
    x = with_block_specials(rng, shape, dtype)
    for fp8 in FP8:
        got = quantize_mxfp8(x, out_dtype=fp8, rowwise=True, colwise=True, flatten_axis=axis)
        want = quantize_mxfp8_ref(x, fp8, axis)
        assert_fp8_equal(got.rowwise, want[0])
        assert_bits_equal(got.rowwise_scale, want[1])
        assert_fp8_equal(got.colwise, want[2])
        assert_bits_equal(got.colwise_scale, want[3])


def _quantize(kind, rowwise, colwise, axis=-1, fp8=jnp.float8_e4m3fn, pow2=False, compute_dbias=False):
    """The block quantizer of `kind` ("1x128", "128x128" or "mxfp8") as a function of x."""
    def f(v):
        if kind == "mxfp8":
            return quantize_mxfp8(v, out_dtype=fp8, rowwise=rowwise, colwise=colwise, flatten_axis=axis,
                                  compute_dbias=compute_dbias)
        return quantize_fp8_block(v, out_dtype=fp8, tile_2d=kind == "128x128", pow2_scales=pow2, rowwise=rowwise,
                                  colwise=colwise, flatten_axis=axis, compute_dbias=compute_dbias)
    return f


def _quantize_with_dbias(kind, rowwise, colwise, axis, fp8=jnp.float8_e4m3fn, pow2=False):
    return _quantize(kind, rowwise, colwise, axis, fp8, pow2, compute_dbias=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", SHAPES + [((300, 3, 257), 1), ((1100, 131), -1)], ids=str)
@pytest.mark.parametrize("kind", ["1x128", "128x128", "mxfp8"])
def test_dbias_equals_reference(shape, axis, kind, dtype, rng):
    x = with_block_specials(rng, shape, dtype)
    both = jax.jit(_quantize_with_dbias(kind, True, True, axis))(x)
    assert both.dbias.dtype == x.dtype and both.dbias.shape == x.shape[axis % len(shape):]
    assert_bits_equal(both.dbias, dbias_ref(x, kind, axis))
    # The copies are those of the call without dbias; one copy alone gives the same dbias.
    for a, b in zip(both[:4], (quantize_mxfp8(x, rowwise=True, colwise=True, flatten_axis=axis) if kind == "mxfp8" else
                               quantize_fp8_block(x, tile_2d=kind == "128x128", rowwise=True, colwise=True,
                                                  flatten_axis=axis))[:4]):
        assert_bits_equal(a, b)
    for rowwise, colwise in ((True, False), (False, True)):
        assert_bits_equal(_quantize_with_dbias(kind, rowwise, colwise, axis)(x).dbias, both.dbias)
    finite = np.where(np.isfinite(np.asarray(x, F32)), x, 0).astype(dtype)
    got = _quantize_with_dbias(kind, True, True, axis)(finite).dbias
    assert_bits_equal(got, dbias_ref(finite, kind, axis))
    assert_dbias_near_exact_sum(got, finite, axis)


def test_dbias_order_is_not_row_order():
    # f32 column: 2^24 then 1.0 in rows 1 and 9 (lane 1 of the first tile): the lane adds
    # 1 + 1 first, so dbias = 2^24 + 2, where a row-order sum rounds each 1.0 away.
    x = np.zeros((1200, 2), F32)
    x[0], x[1], x[9] = 2.0**24, 1.0, 1.0
    for kind in ("1x128", "mxfp8"):
        got = np.asarray(_quantize_with_dbias(kind, True, True, -1)(x).dbias)
        np.testing.assert_array_equal(got, [2.0**24 + 2] * 2)
        assert_bits_equal(got, dbias_ref(x, kind))


def test_single_copies_match_both(rng):
    x = with_block_specials(rng, (200, 300), ml_dtypes.bfloat16)
    both = quantize_fp8_block(x, rowwise=True, colwise=True)
    row, col = quantize_fp8_block(x), quantize_fp8_block(x, rowwise=False, colwise=True)
    assert row.colwise is None and col.rowwise is None
    assert_bits_equal(row.rowwise, both.rowwise)
    assert_bits_equal(col.colwise_scale, both.colwise_scale)
    mboth, mcol = quantize_mxfp8(x, rowwise=True, colwise=True), quantize_mxfp8(x, rowwise=False, colwise=True)
    assert_bits_equal(mcol.colwise, mboth.colwise)
    assert_bits_equal(mcol.colwise_scale, mboth.colwise_scale)


def test_scale_rules_on_chosen_values():
    # One 1x128 tile per row: amax 448 -> scale 1; amax 3 -> 448/3 (pow2: 128); all zero -> 1;
    # NaN -> 1 with the NaN kept; inf -> 1, inf saturating to 448.
    x = np.zeros((5, 128), F32)
    x[0, 7], x[1, 3], x[3, 0], x[3, 1], x[4, 9], x[4, 10] = 448, -3, np.nan, 5, np.inf, 2
    out = quantize_fp8_block(x)
    np.testing.assert_array_equal(out.rowwise_scale[0, :5], F32([1, 3 / F32(448), 1, 1, 1]))
    assert np.all(np.asarray(out.rowwise_scale[0, 5:]) == 0) and out.rowwise_scale.shape == (1, 8)
    assert float(out.rowwise[1, 3].astype(F32)) == -448 and np.isnan(float(out.rowwise[3, 0].astype(F32)))
    assert float(out.rowwise[4, 9].astype(F32)) == 448 and float(out.rowwise[4, 10].astype(F32)) == 2
    pow2 = quantize_fp8_block(x, pow2_scales=True)
    assert float(pow2.rowwise_scale[0, 1]) == 1 / 128 and float(pow2.rowwise[1, 3].astype(F32)) == -384
    # MXFP8: amax 448 -> e = 127 (2^0); 449 -> 128 (rounded up); 0 -> 0; NaN -> 0xFF.
    m = np.zeros((1, 128), F32)
    m[0, 0], m[0, 32], m[0, 96] = 448, 449, np.nan
    bytes_ = np.asarray(quantize_mxfp8(m).rowwise_scale).view(np.uint8)
    np.testing.assert_array_equal(bytes_[0, :4], [127, 128, 0, 255])
    assert bytes_.shape == (128, 4) and not bytes_[1:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x128", "128x128"])
def test_fp8_block_dequantize(tile_2d, dtype, rng):
    x = with_block_specials(rng, (257, 300), dtype)
    for fp8 in FP8:
        q = quantize_fp8_block(x, out_dtype=fp8, tile_2d=tile_2d, rowwise=True, colwise=True)
        for data, scale, xs in ((q.rowwise, q.rowwise_scale, x), (q.colwise, q.colwise_scale, x.T)):
            got = dequantize_fp8_block(data, scale, tile_2d=tile_2d, out_dtype=dtype)
            tr = 128 if tile_2d else 1
            grid = np.asarray(scale)[: -(-data.shape[0] // 128)] if tile_2d else np.asarray(scale)[:, : data.shape[0]].T
            scale_inv = _expand(grid, tr, 128, data.shape)
            want = (np.asarray(data).astype(F32) * scale_inv).astype(dtype)
            assert_fp8_equal(got, want)
            exact = dequantize_fp8_block(data, scale, tile_2d=tile_2d, out_dtype=F32)
            check_error_bound(xs, exact, scale_inv, fp8)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_mxfp8_dequantize(dtype, rng):
    x = with_block_specials(rng, (257, 300), dtype)
    for fp8 in FP8:
        q = quantize_mxfp8(x, out_dtype=fp8, rowwise=True, colwise=True)
        for cw, data, scale in ((False, q.rowwise, q.rowwise_scale), (True, q.colwise, q.colwise_scale)):
            got = dequantize_mxfp8(data, scale, colwise=cw, out_dtype=dtype)
            tr, tc = (32, 1) if cw else (1, 32)
            grid = np.asarray(scale).astype(F32)[: -(-257 // tr), : -(-300 // tc)]
            scale_inv = _expand(grid, tr, tc, data.shape)
            want = (np.asarray(data).astype(F32) * scale_inv).astype(dtype)
            assert_fp8_equal(got, want)
            check_error_bound(x, dequantize_mxfp8(data, scale, colwise=cw, out_dtype=F32), scale_inv, fp8)


def check_error_bound(x, deq, scale_inv, fp8):
    """dequantize(quantize(x)) within round-to-nearest of the format: |deq - x| <= 2^-(m+1)|x|
    + half the subnormal quantum times the block's scale_inv, wherever x is finite and was not
    saturated (|x| <= max * scale_inv; a block holding inf has scale 1); 2^-20 |x| covers the
    rounding of scale_inv = 1/scale."""
    x, deq = np.asarray(x, np.float64), np.asarray(deq, np.float64)
    info = ml_dtypes.finfo(fp8)
    sinv = np.asarray(scale_inv, np.float64)
    ok = np.isfinite(x) & np.isfinite(deq) & (np.abs(x) <= float(info.max) * sinv * (1 - 2.0**-20))
    assert ok.mean() > 0.9
    bound = (2.0 ** -(info.nmant + 1) + 2.0**-20) * np.abs(x) + 0.5 * float(info.smallest_subnormal) * sinv
    assert np.all(np.abs(deq - x)[ok] <= bound[ok]), float(np.max((np.abs(deq - x) - bound)[ok]))


def test_jit_and_vmap(rng):
    x = with_block_specials(rng, (3, 130, 257), ml_dtypes.bfloat16)
    f = jax.jit(jax.vmap(lambda v: quantize_fp8_block(v, rowwise=True, colwise=True)))
    got = f(x)
    g = jax.vmap(lambda v: quantize_mxfp8(v, rowwise=True, colwise=True))
    mgot = g(x)
    for b in range(3):
        want = quantize_fp8_block_ref(x[b], jnp.float8_e4m3fn, False, False)
        assert_fp8_equal(got.rowwise[b], want[0])
        assert_bits_equal(got.colwise_scale[b], want[3])
        mwant = quantize_mxfp8_ref(x[b], jnp.float8_e4m3fn)
        assert_fp8_equal(mgot.colwise[b], mwant[2])
        assert_bits_equal(mgot.rowwise_scale[b], mwant[1])
    d = jax.vmap(lambda q, s: dequantize_fp8_block(q, s, out_dtype=F32))(got.rowwise, got.rowwise_scale)
    assert d.shape == x.shape
    for kind in ("1x128", "mxfp8"):
        dgot = jax.jit(jax.vmap(_quantize_with_dbias(kind, True, True, -1)))(x)
        for b in range(3):
            assert_bits_equal(dgot.dbias[b], dbias_ref(x[b], kind))


SHARDINGS = [  # (shape, flatten_axis, spec, stays sharded)
    ((512, 256), -1, P("a", None), True),
    ((4, 256, 384), 2, P("a", None, None), True),
    ((512, 256), -1, P(None, "a"), False),  # columns: gathered
    ((8, 12, 256), 2, P("a", None, None), False),  # 48 local rows: not whole tiles
]


@pytest.mark.parametrize("shape,axis,spec,sharded", SHARDINGS, ids=str)
@pytest.mark.parametrize("kind", ["1x128", "128x128", "mxfp8"])
def test_sharded_equals_unsharded(shape, axis, spec, sharded, kind, rng):
    mesh = jax.make_mesh((2,), ("a",), devices=jax.devices("cpu")[:2])
    x = with_block_specials(rng, shape, ml_dtypes.bfloat16)

    f = _quantize_with_dbias(kind, True, True, axis)
    cpu0 = jax.devices("cpu")[0]
    with jax.default_device(cpu0):
        want = jax.jit(f)(jax.device_put(x, cpu0))
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    got = jax.jit(f)(xs)
    for g, w in zip(got[:4], want[:4]):
        assert_bits_equal(g, w)
    # dbias: the shards' fp32 sums psum'ed when the rows stay sharded (another fp32 order).
    finite = np.where(np.isfinite(np.asarray(x, F32)), x, 0).astype(x.dtype)
    dbias = jax.jit(f)(jax.device_put(finite, NamedSharding(mesh, spec))).dbias
    assert dbias.shape == want.dbias.shape and dbias.dtype == want.dbias.dtype
    assert_dbias_near_exact_sum(dbias, finite, axis)
    if not (sharded and spec[0] is not None):
        assert_bits_equal(got.dbias, want.dbias)
    if sharded and not (kind == "128x128" and np.prod(shape[:axis % len(shape)]) // 2 % 512):
        assert not got.rowwise.sharding.is_fully_replicated


def test_bad_inputs():
    x = jnp.ones((4, 8), jnp.float32)
    for fn, op in ((quantize_fp8_block, "quantize_fp8_block"), (quantize_mxfp8, "quantize_mxfp8")):
        with pytest.raises(TypeError, match=rf"lowbit.ops.{op}: x: expected float32, float16 or bfloat16"):
            fn(jnp.arange(8).reshape(2, 4))
        with pytest.raises(TypeError, match=rf"lowbit.ops.{op}: out_dtype: expected float8_e4m3fn"):
            fn(x, out_dtype=jnp.float8_e4m3fnuz)
        with pytest.raises(ValueError, match=rf"lowbit.ops.{op}: flatten_axis"):
            fn(x, flatten_axis=2)
        with pytest.raises(ValueError, match=rf"lowbit.ops.{op}: rowwise, colwise"):
            fn(x, rowwise=False, colwise=False)
        with pytest.raises(ValueError, match=rf"lowbit.ops.{op}: x: expected rank >= 1"):
            fn(jnp.float32(1.0))
    q = quantize_fp8_block(x)
    with pytest.raises(ValueError, match=r"lowbit.ops.dequantize_fp8_block: scale: expected shape \(1, 4\)"):
        dequantize_fp8_block(q.rowwise, q.rowwise_scale[:, :2])
    with pytest.raises(TypeError, match=r"lowbit.ops.dequantize_fp8_block: data: expected float8"):
        dequantize_fp8_block(x, q.rowwise_scale)
    with pytest.raises(TypeError, match=r"lowbit.ops.dequantize_mxfp8: scale: expected float8_e8m0fnu"):
        dequantize_mxfp8(q.rowwise, q.rowwise_scale)
    m = quantize_mxfp8(x)
    with pytest.raises(ValueError, match=r"lowbit.ops.dequantize_mxfp8: scale: expected shape \(4, 128\)"):
        dequantize_mxfp8(m.rowwise, m.rowwise_scale, colwise=True)
    with pytest.raises(TypeError, match=r"lowbit.ops.dequantize_mxfp8: out_dtype"):
        dequantize_mxfp8(m.rowwise, m.rowwise_scale, out_dtype=jnp.int8)


def test_handler_validation():
    lowbit._ffi.load()
    x = jnp.ones((4, 300), jnp.bfloat16)
    e4, f32, e8 = jnp.float8_e4m3fn, jnp.float32, jnp.float8_e8m0fnu
    sd = jax.ShapeDtypeStruct
    attrs = dict(flatten_axis=np.int32(1), tile_2d=np.bool_(False), pow2_scales=np.bool_(False))
    good = [sd((4, 300), e4), sd((3, 4), f32), sd((300, 4), e4), sd((1, 300), f32), sd((0,), jnp.bfloat16)]
    call = lambda res, xa=x, **kw: jax.block_until_ready(  # noqa: E731
        jax.ffi.ffi_call("lowbit_quantize_fp8_block", res)(xa, **{**attrs, **kw}))
    call(good)  # sanity: the well-formed calls run (dbias not requested, f32, x's dtype)
    call(good[:4] + [sd((300,), f32)])
    call(good[:4] + [sd((300,), jnp.bfloat16)])
    cases = [
        ((good[:1] + [sd((3, 8), f32)] + good[2:],), {}, r"lowbit_quantize_fp8_block: rowwise_scale_inv: expected f32 of shape \(3, 4\)"),
        ((good[:3] + [sd((1, 300), e8)] + good[4:],), {}, r"lowbit_quantize_fp8_block: colwise_scale_inv: expected f32"),
        ((good[:2] + [sd((0,), e4), sd((1, 300), f32)] + good[4:],), {}, r"lowbit_quantize_fp8_block: colwise_scale_inv: expected an empty result"),
        ((good[:4] + [sd((4,), jnp.bfloat16)],), {}, r"lowbit_quantize_fp8_block: dbias: expected bf16 or f32 of shape \(300,\)"),
        ((good[:4] + [sd((300,), jnp.float16)],), {}, r"lowbit_quantize_fp8_block: dbias: expected bf16 or f32"),
        ((good[:2] + [sd((300, 4), jnp.float8_e5m2)] + good[3:],), {}, r"colwise: expected the rowwise dtype"),
        ((good,), dict(flatten_axis=np.int32(2)), r"lowbit_quantize_fp8_block: flatten_axis: expected a value in \[0, 1\]"),
        ((good,), dict(xa=x.astype(jnp.int32)), r"lowbit_quantize_fp8_block: x: expected f32, f16 or bf16"),
    ]
    for (res,), kw, msg in cases:
        with pytest.raises(Exception, match=msg):
            call(res, **kw)
    mgood = [sd((4, 300), e4), sd((128, 12), e8), sd((4, 300), e4), sd((4, 384), e8), sd((0,), jnp.bfloat16)]
    mcall = lambda res: jax.block_until_ready(  # noqa: E731
        jax.ffi.ffi_call("lowbit_quantize_mxfp8", res)(x, flatten_axis=np.int32(1)))
    mcall(mgood)
    with pytest.raises(Exception, match=r"lowbit_quantize_mxfp8: colwise_scale: expected f8e8m0fnu of shape \(4, 384\)"):
        mcall(mgood[:3] + [sd((4, 300), e8)] + mgood[4:])
    with pytest.raises(Exception, match=r"lowbit_quantize_mxfp8: dbias: expected bf16 or f32 of shape \(300,\)"):
        mcall(mgood[:4] + [sd((300, 1), f32)])
    with pytest.raises(Exception, match=r"lowbit_dequantize_mxfp8: out: expected f32, f16 or bf16 of shape \(4, 300\)"):
        jax.block_until_ready(jax.ffi.ffi_call("lowbit_dequantize_mxfp8", sd((4, 30), f32))(
            jnp.ones((4, 300), e4), jnp.ones((128, 12), e8), flatten_axis=np.int32(1), colwise=np.bool_(False)))


# ---------------------------------------------------------------- CUDA vs CPU

GPU_SHAPES = [((4096, 3072), -1), ((4097, 3001), -1), ((2048, 128), -1), ((100, 2048), -1),
              ((1, 65536), -1), ((65536, 1), -1), ((3, 5, 129), 1), ((2, 7, 64, 96), 2), ((33, 3000), -1)]


def _bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", GPU_SHAPES, ids=str)
def test_cuda_equals_cpu(shape, axis, dtype, rng, cpu, gpu):
    x = with_block_specials(rng, shape, dtype)
    configs = [("1x128", True, True), ("1x128", True, False), ("1x128", False, True),
               ("128x128", True, True), ("128x128", False, True), ("mxfp8", True, True),
               ("mxfp8", True, False), ("mxfp8", False, True)]
    for i, (kind, rowwise, colwise) in enumerate(configs):
        f = _quantize(kind, rowwise, colwise, axis, FP8[i % 2], bool(i % 3 == 0))
        g, c = run_on(gpu, f, x), run_on(cpu, f, x)
        for a, b in zip(g, c):
            assert (a is None) == (b is None)
            if b is not None:
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{kind} {rowwise} {colwise}")


@pytest.mark.gpu
@pytest.mark.parametrize("staged", ["1", "0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", [(4100, 3080), (8192, 4096), (257, 640), (1, 65536)], ids=str)
def test_cuda_staged_and_unstaged_tiles_equal_cpu(shape, dtype, staged, rng, cpu, gpu, monkeypatch):
    # LOWBIT_BLOCK_TILE_STAGED: the plain tile kernels' staged form (the next tile's loads in
    # flight through shared memory, the default) and the unstaged one, on vectorizable shapes
    # with partial tiles in both dims and several tiles per block, with dbias and without.
    monkeypatch.setenv("LOWBIT_BLOCK_TILE_STAGED", staged)
    x = with_block_specials(rng, shape, dtype)
    configs = [("1x128", True, True), ("1x128", False, True), ("128x128", True, True), ("mxfp8", True, True),
               ("mxfp8", False, True)]
    for i, (kind, rowwise, colwise) in enumerate(configs):
        for f in (_quantize_with_dbias(kind, rowwise, colwise, -1, FP8[i % 2], bool(i % 2 == 0)),
                  _quantize(kind, rowwise, colwise, -1, FP8[(i + 1) % 2], bool(i % 2 == 1))):
            for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{kind} {rowwise} {colwise}")


@pytest.mark.gpu
def test_cuda_bad_staging_knob_is_an_error(gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_BLOCK_TILE_STAGED", "yes")
    x = jnp.ones((256, 256), jnp.bfloat16)
    for f in (lambda v: quantize_fp8_block(v, rowwise=True, colwise=True),
              lambda v: quantize_mxfp8(v, rowwise=True, colwise=True)):
        with pytest.raises(Exception, match=r"LOWBIT_BLOCK_TILE_STAGED=\"yes\": expected 0 or 1"):
            run_on(gpu, f, x)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=ids)
def test_cuda_every_input_bit_pattern_equals_cpu(fp8, rng, cpu, gpu):
    # Hardware cvt where no NaN can occur, the formats.h codec elsewhere: every 16-bit input
    # and random fp32 bit patterns (ties, subnormals, saturation, NaN signs) must match.
    inputs = [np.arange(1 << 16, dtype=np.uint16).view(d).reshape(256, 256) for d in (np.float16, ml_dtypes.bfloat16)]
    inputs.append(rng.integers(0, 1 << 32, (512, 1024), dtype=np.uint32).view(F32))
    inputs.append(np.where(np.isfinite(inputs[-1]), inputs[-1], F32(1)))
    inputs.append((rng.standard_normal((384, 640)) * 1e-3).astype(F32))
    for x in inputs:
        for fn in (lambda v: quantize_fp8_block(v, out_dtype=fp8, rowwise=True, colwise=True),
                   lambda v: quantize_fp8_block(v, out_dtype=fp8, tile_2d=True, pow2_scales=True, rowwise=True, colwise=True),
                   lambda v: quantize_mxfp8(v, out_dtype=fp8, rowwise=True, colwise=True)):
            for a, b in zip(run_on(gpu, fn, x), run_on(cpu, fn, x)):
                assert (a is None) == (b is None)  # fields not asked for (dbias)
                if a is not None:
                    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_misaligned_equals_cpu(dtype, rng, cpu, gpu):
    x = with_block_specials(rng, (513, 1030), dtype)

    def f(v):  # a slice starting one element in, odd cols: the unvectorized paths
        w = v.reshape(-1)[1 : 1 + 511 * 1033].reshape(511, 1033)
        return (quantize_fp8_block(w, rowwise=True, colwise=True),
                quantize_fp8_block(w, tile_2d=True, rowwise=True, colwise=True),
                quantize_mxfp8(w, rowwise=True, colwise=True))

    for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=ids)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=ids)
def test_cuda_dequantize_equals_cpu(fp8, out_dtype, rng, cpu, gpu):
    codes = np.tile(np.arange(256, dtype=np.uint8), 257 * 3).view(fp8).reshape(257, 768)
    s_block = (rng.standard_normal((6, 260)) * 1e3).astype(F32)  # 1x128 scale_inv of 257 x 768
    s_block[0, :4] = [0.0, -np.inf, np.nan, 1e-40]
    s_2d = (rng.standard_normal((3, 8)) * 1e-3).astype(F32)
    s_mx = rng.integers(0, 256, (384, 24), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    s_mx_col = rng.integers(0, 256, (12, 768), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    fns = [(lambda d, s: dequantize_fp8_block(d, s, out_dtype=out_dtype), s_block),
           (lambda d, s: dequantize_fp8_block(d, s, tile_2d=True, out_dtype=out_dtype), s_2d),
           (lambda d, s: dequantize_mxfp8(d, s, out_dtype=out_dtype), s_mx),
           (lambda d, s: dequantize_mxfp8(d, s, colwise=True, out_dtype=out_dtype), s_mx_col)]
    for fn, s in fns:
        np.testing.assert_array_equal(_bits(run_on(gpu, fn, codes, s)), _bits(run_on(cpu, fn, codes, s)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", GPU_SHAPES + [((8, 2048, 1024), 2)], ids=str)
def test_cuda_dbias_equals_cpu(shape, axis, dtype, rng, cpu, gpu):
    # dbias bit for bit (the fixed order of block_dbias.h on both backends; NaN canonical) and
    # identical on two GPU runs; the copies and scales bit for bit as without dbias.
    x = with_block_specials(rng, shape, dtype)
    configs = [("1x128", True, True), ("1x128", True, False), ("1x128", False, True),
               ("128x128", True, True), ("mxfp8", True, True), ("mxfp8", True, False), ("mxfp8", False, True)]
    for i, (kind, rowwise, colwise) in enumerate(configs):
        f = _quantize_with_dbias(kind, rowwise, colwise, axis, FP8[i % 2], bool(i % 3 == 0))
        g, g2, c = run_on(gpu, f, x), run_on(gpu, f, x), run_on(cpu, f, x)
        for a, a2, b in zip(g, g2, c):
            assert (a is None) == (b is None)
            if b is not None:
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{kind} {rowwise} {colwise}")
                np.testing.assert_array_equal(_bits(a), _bits(a2), err_msg=f"rerun {kind} {rowwise} {colwise}")
    # Integers: exact in any order, so equal to numpy's sum as well.
    ints = rng.integers(-8, 9, shape).astype(dtype)
    for kind in ("1x128", "mxfp8"):
        got = run_on(gpu, _quantize_with_dbias(kind, True, True, axis), ints).dbias
        want = np.asarray(ints, np.float64).reshape(int(np.prod(shape[:axis % len(shape)])), -1).sum(0)
        np.testing.assert_array_equal(np.asarray(got, np.float64).reshape(-1), np.asarray(want.astype(dtype), np.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_dbias_of_empty_x_is_zero(dtype, rng, cpu, gpu):
    # No rows: dbias (cols values, in x's dtype and in f32) is the only output, zeroed by the
    # launchers' preamble (dbias_finalize.cuh: PrepareDbias); all bits 0, as on the CPU. A
    # first call on real data leaves nonzero bytes in freed device memory for the outputs
    # to reuse, so a dbias left unwritten would show.
    x = with_block_specials(rng, (300, 1033), dtype)
    run_on(gpu, _quantize_with_dbias("mxfp8", True, True, -1), x)
    e4 = jnp.float8_e4m3fn

    def f(v):
        outs = []
        for shape, axis in (((0, 1033), 1), ((2, 0, 1033), 2)):
            e = v[:0].reshape(shape)
            for kind in ("1x128", "128x128", "mxfp8"):
                outs.append(_quantize_with_dbias(kind, True, True, axis)(e).dbias)
            block = quantize_fp8_block_p.bind(e, flatten_axis=np.int32(axis), tile_2d=np.bool_(False),
                                              pow2_scales=np.bool_(False), out_dtype=e4, rowwise=True,
                                              colwise=True, dbias_dtype=jnp.dtype(jnp.float32))
            mx = quantize_mxfp8_p.bind(e, flatten_axis=np.int32(axis), out_dtype=e4, rowwise=True, colwise=True,
                                       dbias_dtype=jnp.dtype(jnp.float32))
            outs += [block[4], mx[4]]
        return outs

    got, want = run_on(gpu, f, x), run_on(cpu, f, x)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == (1033,) and a.dtype == b.dtype, i
        assert a.dtype == (dtype if i % 5 < 3 else np.float32), i
        np.testing.assert_array_equal(_bits(a), np.zeros_like(_bits(a)), err_msg=str(i))
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=str(i))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_dbias_f32_and_misaligned_equal_cpu(dtype, rng, cpu, gpu):
    # The f32 dbias result (what the sharded rule asks for) through the handler, and the
    # unvectorized paths (a slice starting one element in, odd cols).
    lowbit._ffi.load()
    x = with_block_specials(rng, (1537, 1033), dtype)  # holds the 1535 x 1033 slice one element in
    sd, e4, f32 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn, jnp.float32
    r, c = x.shape

    def f(v):
        w = v.reshape(-1)[1 : 1 + 1535 * 1033].reshape(1535, 1033)
        block = jax.ffi.ffi_call("lowbit_quantize_fp8_block", [sd((r, c), e4), sd((9, r + 3), f32), sd((0,), e4),
                                                               sd((0,), f32), sd((c,), f32)])(
            v, flatten_axis=np.int32(1), tile_2d=np.bool_(False), pow2_scales=np.bool_(False))
        mx = jax.ffi.ffi_call("lowbit_quantize_mxfp8", [sd((0,), e4), sd((0,), jnp.float8_e8m0fnu), sd((r, c), e4),
                                                        sd((52, 1152), jnp.float8_e8m0fnu), sd((c,), f32)])(
            v, flatten_axis=np.int32(1))
        return (block, mx, _quantize_with_dbias("1x128", True, True, -1)(w),
                _quantize_with_dbias("mxfp8", True, True, -1)(w))

    for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
        np.testing.assert_array_equal(_bits(a), _bits(b))
