"""Shared by tests/test_quantize_ops.py, tests/test_quantize_ops_cuda.py and
tests/test_quantize_grouped.py: the few-line jnp reference of the per-tensor FP8 quantize,
the test inputs' dtypes, formats and shapes, and the comparisons (FP8 codes and amax bit for
bit, dbias within the summation-order tolerance that assert_dbias_close states)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

def quantize_ref(x, scale, out_dtype, flatten_axis=-1):
    """(rowwise, colwise, amax, dbias) in plain jnp; amax in numpy, because XLA:CPU's max
    reduction drops NaN on large inputs (jax 0.11.2: jnp.max of 5000 ones and one NaN is 1)."""
    f = flatten_axis % x.ndim
    fmax = float(jnp.finfo(out_dtype).max)
    q = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(out_dtype)
    colwise = jnp.transpose(q, tuple(range(f, x.ndim)) + tuple(range(f)))
    amax = np.max(np.abs(np.asarray(x, np.float32)), initial=0.0)
    dbias = jnp.sum(x.astype(jnp.float32), axis=tuple(range(f))).astype(x.dtype)
    return q, colwise, amax, dbias


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
SCALES = [1.0, 0.01, 1e4, 0.125]
# (shape, flatten_axis)
SHAPES = [((1, 1), -1), ((1, 7), -1), ((7, 1), -1), ((33, 65), -1), ((3, 5, 129), 1),
          ((3, 5, 129), 2), ((257, 1031), -1), ((11,), -1)]
dtype_ids = lambda d: np.dtype(d).name  # noqa: E731


def assert_fp8_equal(got, want):
    """Same NaN positions, same bits everywhere else."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    gnan, wnan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(gnan, wnan)
    np.testing.assert_array_equal(got.view(np.uint8)[~gnan], want.view(np.uint8)[~wnan])


def assert_amax_equal(got, want):
    got, want = float(got), float(want)
    assert (np.isnan(got) and np.isnan(want)) or got == want, (got, want)


def assert_dbias_close(got, want, x, flatten_axis, accum_eps=2.0**-24):
    """dbias tolerance: one ulp of the output dtype (two fp32 sums rounded to it may land
    on neighbours) plus the fp32 accumulation bound rows * 2^-24 * sum|x| per column.
    Overflow depends on the order too: a column may be +-inf on one side and finite on the
    other only where its positive (negative) values sum to the output dtype's max within
    that tolerance, so that some order of partial sums, or the rounding to the output
    dtype, reaches +inf (-inf); NaN against a number, or +inf against -inf, only where both
    can (inf - inf)."""
    got64, want64 = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    assert got.dtype == want.dtype and got.shape == want.shape
    f = flatten_axis % x.ndim
    x64 = np.asarray(x).astype(np.float64)
    x64 = np.where(np.isfinite(x64), x64, 0.0)
    axes = tuple(range(f))
    rows = int(np.prod(x.shape[:f]))
    bound = rows * accum_eps * np.sum(np.abs(x64), axis=axes)
    info = ml_dtypes.finfo(got.dtype)
    near = lambda v: float(info.eps) * np.abs(v) + bound + float(info.smallest_subnormal)  # noqa: E731
    reaches = lambda v: v + near(v) >= float(info.max)  # noqa: E731
    pos_inf_ok = reaches(np.sum(np.maximum(x64, 0.0), axis=axes))
    neg_inf_ok = reaches(-np.sum(np.minimum(x64, 0.0), axis=axes))

    def agree_or_overflow(a, b):
        """a is NaN or inf where b is not: allowed only where overflow can make it so."""
        odd = (np.isnan(a) & ~np.isnan(b)) | (np.isinf(a) & np.isfinite(b))
        ok = np.where(np.isnan(a), pos_inf_ok & neg_inf_ok, np.where(a > 0, pos_inf_ok, neg_inf_ok))
        bad = odd & ~ok
        assert not bad.any(), (np.flatnonzero(bad), got64[bad], want64[bad])

    agree_or_overflow(got64, want64)
    agree_or_overflow(want64, got64)
    flipped = np.isinf(got64) & np.isinf(want64) & (got64 != want64)
    assert not (flipped & ~(pos_inf_ok & neg_inf_ok)).any(), (got64[flipped], want64[flipped])
    finite = np.isfinite(want64) & np.isfinite(got64)
    assert np.all(np.abs(got64[finite] - want64[finite]) <= near(want64)[finite])


def check_all(out, ref, x, flatten_axis, rowwise=True, colwise=True, dbias=True):
    if rowwise:
        assert_fp8_equal(out.rowwise, ref[0])
    else:
        assert out.rowwise is None
    if colwise:
        assert_fp8_equal(out.colwise, ref[1])
    else:
        assert out.colwise is None
    assert out.amax.shape == () and out.amax.dtype == jnp.float32
    assert_amax_equal(out.amax, ref[2])
    if dbias:
        assert_dbias_close(out.dbias, ref[3], x, flatten_axis)
    else:
        assert out.dbias is None
