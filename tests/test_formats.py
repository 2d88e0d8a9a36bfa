"""The codecs of csrc/common/formats.h (through lowbit.ops.encode/decode) against ml_dtypes.

Round to nearest even with saturation must equal ml_dtypes' conversion of the clipped
value, bit for bit, for all 65,536 bf16 patterns and a dense fp32 sweep that includes
every exact tie; decoding must equal ml_dtypes for every code. Stochastic rounding must
pick only the two neighbours and be unbiased within the bound derived in
test_stochastic_rounding_is_unbiased.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowbit

NARROW = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
}


def all_bf16_as_f32() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def dense_f32_sweep(rng) -> np.ndarray:
    """Random fp32 bit patterns plus, for every narrow format, each representable value,
    the exact midpoints between neighbours (ties) and the floats just beside them."""
    parts = [rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    for dtype in NARROW.values():
        codes = np.arange(1 << ml_dtypes.finfo(dtype).bits, dtype=np.uint8)
        if ml_dtypes.finfo(dtype).bits == 4:
            table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        else:
            table = codes.view(dtype).astype(np.float32)
            table = np.unique(table[np.isfinite(table) & (table >= 0)])
        mids = (table[:-1] + table[1:]) / 2
        pts = np.concatenate([table, mids, np.nextafter(mids, np.inf, dtype=np.float32),
                              np.nextafter(mids, -np.inf, dtype=np.float32), table * 1.5])
        parts += [pts.astype(np.float32), -pts.astype(np.float32)]
    return np.concatenate(parts)


def ml_encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """ml_dtypes' conversion after clipping to the finite range (NaN kept)."""
    dtype = NARROW[fmt]
    mx = float(ml_dtypes.finfo(dtype).max)
    clipped = np.where(np.isnan(x), x, np.clip(x, -mx, mx)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN casts
        codes = clipped.astype(dtype).view(np.uint8).astype(np.uint16)
    if fmt == "e2m1":
        codes = codes & 0xF
    return codes


def check_encode(x: np.ndarray, fmt: str):
    got = np.asarray(lowbit.ops.encode(jnp.asarray(x), fmt))
    want = ml_encode(x, fmt)
    finite = ~np.isnan(x)
    if fmt == "e2m1":  # E2M1 has no NaN: lowbit encodes NaN as the signed max (documented)
        nan_codes = got[~finite]
        assert np.all((nan_codes & 7) == 7)
    else:
        # NaN must stay NaN in the format (payloads are not compared).
        back = np.asarray(lowbit.ops.decode(jnp.asarray(got[~finite]), fmt))
        assert np.all(np.isnan(back))
    bad = np.nonzero(got[finite] != want[finite])[0]
    assert bad.size == 0, (
        f"{fmt}: {bad.size} mismatches, first x={x[finite][bad[:5]]} "
        f"got={got[finite][bad[:5]]} want={want[finite][bad[:5]]}"
    )


@pytest.mark.parametrize("fmt", sorted(NARROW))
def test_encode_every_bf16_pattern(fmt):
    check_encode(all_bf16_as_f32(), fmt)


@pytest.mark.parametrize("fmt", sorted(NARROW))
def test_encode_dense_f32_sweep(fmt, rng):
    check_encode(dense_f32_sweep(rng), fmt)


@pytest.mark.parametrize("fmt", sorted(NARROW))
def test_decode_every_code(fmt):
    dtype = NARROW[fmt]
    n = 16 if fmt == "e2m1" else 256
    codes = np.arange(n, dtype=np.uint16)
    got = np.asarray(lowbit.ops.decode(jnp.asarray(codes), fmt))
    want = codes.astype(np.uint8).view(dtype).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # treats NaN == NaN


def test_e8m0_matches_ml_dtypes(rng):
    x = np.concatenate([all_bf16_as_f32(), dense_f32_sweep(rng), np.array([2.0**-127, 2.0**-128], np.float32)])
    got = np.asarray(lowbit.ops.encode(jnp.asarray(x), "e8m0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # x <= 0 and NaN give NaN
        want = x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"x={x[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"
    codes = np.arange(256, dtype=np.uint16)
    dec = np.asarray(lowbit.ops.decode(jnp.asarray(codes), "e8m0"))
    np.testing.assert_array_equal(dec, codes.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_e8m0_round_up_rule(rng):
    """MXFP8 scale rule: 2^e >= s with e minimal (e from the fp32 exponent, +1 when the
    mantissa is non-zero); NaN -> 0xFF."""
    s = np.abs(rng.standard_normal(10000).astype(np.float32)) * np.float32(2.0) ** rng.integers(-60, 60, 10000)
    s = np.concatenate([s.astype(np.float32), np.float32([1.0, 2.0, 0.5, np.nan])])
    got = np.asarray(lowbit.ops.encode(jnp.asarray(s), "e8m0_round_up")).astype(np.int64)
    bits = s.view(np.uint32)
    want = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    want = np.where(np.isnan(s), 0xFF, want)
    np.testing.assert_array_equal(got, want)
    fin = ~np.isnan(s)
    assert np.all(2.0 ** (got[fin] - 127.0) >= s[fin])


@pytest.mark.parametrize("fmt,dtype", [("bf16", ml_dtypes.bfloat16), ("f16", np.float16)])
def test_high_precision_codecs(fmt, dtype, rng):
    x = np.concatenate([dense_f32_sweep(rng), all_bf16_as_f32()])
    got = np.asarray(lowbit.ops.encode(jnp.asarray(x), fmt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow to inf is expected
        want = x.astype(dtype).view(np.uint16)
    fin = ~np.isnan(x)
    np.testing.assert_array_equal(got[fin], want[fin])
    codes = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    dec = np.asarray(lowbit.ops.decode(jnp.asarray(codes), fmt))
    np.testing.assert_array_equal(dec, codes.view(dtype).astype(np.float32))


def neighbours(x: np.ndarray, fmt: str):
    """The representable values just below and above |x| (as signed values)."""
    dtype = NARROW[fmt]
    if fmt == "e2m1":
        table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    else:
        t = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
        table = np.unique(t[np.isfinite(t) & (t >= 0)])
    a = np.abs(x)
    hi_idx = np.searchsorted(table, a, side="left")
    lo = table[np.maximum(np.where(table[np.minimum(hi_idx, table.size - 1)] == a, hi_idx, hi_idx - 1), 0)]
    hi = table[np.minimum(hi_idx, table.size - 1)]
    return np.sign(x) * lo, np.sign(x) * hi


@pytest.mark.parametrize("fmt", sorted(NARROW))
def test_stochastic_rounding_picks_neighbours(fmt, rng):
    mx = float(ml_dtypes.finfo(NARROW[fmt]).max)
    x = (rng.uniform(-mx, mx, 50000) * rng.choice([1, 1e-2, 1e-4], 50000)).astype(np.float32)
    words = rng.integers(0, 1 << 32, x.size, dtype=np.uint64).astype(np.uint32)
    got = np.asarray(lowbit.ops.decode(lowbit.ops.encode(jnp.asarray(x), fmt, jnp.asarray(words)), fmt))
    lo, hi = neighbours(x, fmt)
    assert np.all((got == lo) | (got == hi))


@pytest.mark.parametrize("fmt", sorted(NARROW))
def test_stochastic_rounding_is_unbiased(fmt, rng):
    """Each value is rounded N times with fresh words. One rounding is lo + q*B with
    B ~ Bernoulli(p), p = (|x|-lo)/q, so the mean of N has standard deviation
    q*sqrt(p(1-p)/N) <= q/(2*sqrt(N)); the rule's own bias is below q*2^-32 for these
    magnitudes. We allow 6 standard deviations: |mean - x| <= 3q/sqrt(N) + q*2^-32."""
    n = 20000
    mx = float(ml_dtypes.finfo(NARROW[fmt]).max)
    values = rng.uniform(-mx / 2, mx / 2, 6).astype(np.float32)
    values = np.concatenate([values, np.float32([values[0] * 1e-3, 1.3 * 2.0**-8])])
    for v in values:
        x = np.full(n, v, np.float32)
        words = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        got = np.asarray(lowbit.ops.decode(lowbit.ops.encode(jnp.asarray(x), fmt, jnp.asarray(words)), fmt))
        lo, hi = neighbours(np.float32([v]), fmt)
        q = float(abs(hi[0] - lo[0]))
        if q == 0:
            assert np.all(got == v)
            continue
        bound = 3 * q / np.sqrt(n) + q * 2.0**-32
        assert abs(got.astype(np.float64).mean() - float(v)) <= bound, (fmt, v, got.mean(), bound)


def test_encode_rejects_bad_arguments():
    with pytest.raises(ValueError, match="lowbit.ops.encode: fmt"):
        lowbit.ops.encode(jnp.ones(3), "e3m4")
    with pytest.raises(TypeError, match="lowbit.ops.encode: x"):
        lowbit.ops.encode(jnp.ones(3, jnp.bfloat16), "e4m3")
    with pytest.raises(ValueError, match="random"):
        lowbit.ops.encode(jnp.ones(3), "e8m0", jnp.zeros(3, jnp.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e8m0", "e8m0_round_up", "bf16", "f16"])
def test_device_codecs_equal_host(fmt, rng, cpu, gpu):
    from conftest import run_on

    x = dense_f32_sweep(rng)
    enc = lambda v: lowbit.ops.encode(v, fmt)
    np.testing.assert_array_equal(run_on(gpu, enc, x), run_on(cpu, enc, x))
    if fmt in ("e4m3", "e5m2", "e2m1"):
        words = rng.integers(0, 1 << 32, x.size, dtype=np.uint64).astype(np.uint32)
        enc_sr = lambda v, w: lowbit.ops.encode(v, fmt, w)
        np.testing.assert_array_equal(run_on(gpu, enc_sr, x, words), run_on(cpu, enc_sr, x, words))
    n = 16 if fmt == "e2m1" else (1 << 16 if fmt in ("bf16", "f16") else 256)
    codes = np.arange(n, dtype=np.uint32).astype(np.uint16)
    dec = lambda c: lowbit.ops.decode(c, fmt if fmt != "e8m0_round_up" else "e8m0")
    np.testing.assert_array_equal(run_on(gpu, dec, codes), run_on(cpu, dec, codes))
