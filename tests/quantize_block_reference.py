"""Shared by tests/test_quantize_block_ops.py and tests/test_quantize_block_ops_cuda.py: the
numpy references of lowbit.ops.quantize_fp8_block / quantize_mxfp8 (both copies and their
scales, and dbias in the summation order of csrc/quantize/block_dbias.h), the bit-exact
comparisons, the test data (with_block_specials: special values, all-zero, subnormal and
near-max blocks) and the quantizers as functions of x (_quantize, _quantize_with_dbias).

The references are numpy, not jnp: XLA:CPU flushes subnormals (FTZ/DAZ), and the MXFP8 factor
2^(127 - e) is an fp32 subnormal for e > 253; numpy's fp32 arithmetic is plain IEEE, as the
kernels' is."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from conftest import random_with_specials

from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8

F32 = np.float32


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
    or tiny values and one of near-max values, each spanning whole 128-blocks where it fits.
    Where the zero region would be the whole input (one partial tile), it is the first half of
    the columns only, so that every shape keeps random values to quantize."""
    x = random_with_specials(rng, shape, dtype).astype(F32)
    x2 = x.reshape(shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else x.reshape(1, -1)
    info = ml_dtypes.finfo(dtype)
    r, c = x2.shape
    zero_cols = min(c, 128) if (r > 130 or c > 128) else c // 2
    x2[: min(r, 130), :zero_cols] = 0.0  # all-zero 1x128 tiles, 32-blocks and columns
    if c > 128:
        x2[: min(r, 40), 128 : min(c, 256)] = float(info.smallest_subnormal) * rng.integers(-3, 4, (min(r, 40), min(c, 256) - 128))
    if r > 2:
        x2[-1, :] = float(info.max) * rng.uniform(-1, 1, c)
    if x2.size:
        normal = np.isfinite(x2) & (np.abs(x2) >= float(info.tiny))
        assert np.count_nonzero(normal) >= max(1, min(x2.size // 4, 64)), "test data must not be (nearly) all zero"
    return x2.reshape(shape).astype(dtype)


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
ids = lambda d: np.dtype(d).name  # noqa: E731


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
