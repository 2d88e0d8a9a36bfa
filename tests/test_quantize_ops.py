"""lowbit.ops.quantize_fp8 / dequantize_fp8: bit for bit against a few-line jnp reference
(every layout, input dtype, FP8 format, odd and empty shapes, special values, several
scales), dbias within a stated tolerance, the dequantize round-trip error bound, jit,
vmap, sharding over virtual CPU devices, bad input, and the CUDA kernels against the CPU
handlers (bit for bit; dbias within fp32 summation-order tolerance)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit
from lowbit.ops import dequantize_fp8, quantize_fp8


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


def test_dbias_tolerance_takes_inf_and_nan_only_where_a_sum_can_overflow():
    """The helper above: +-inf against +-max (a sum that rounded or overflowed either way) is
    accepted, and so are inf and NaN where partial sums can overflow; inf against a value
    far from the max, of the other sign, or NaN where only one side can overflow, is not."""
    bf16 = ml_dtypes.bfloat16
    big = float(ml_dtypes.finfo(bf16).max)
    x = np.array([[big / 2, 1.0], [big / 2, 2.0]], bf16)
    want = np.array([big, 3.0], bf16)
    assert_dbias_close(np.array([np.inf, 3.0], bf16), want, x, -1)
    assert_dbias_close(want, np.array([np.inf, 3.0], bf16), x, -1)
    for got in ([-np.inf, 3.0], [big, np.inf], [big, 4.0], [np.nan, 3.0], [big, np.nan]):
        with pytest.raises(AssertionError):
            assert_dbias_close(np.array(got, bf16), want, x, -1)
    # fp32 partial sums: 0.75 max + 0.75 max overflows before -0.75 max comes in, in some order
    m = float(np.finfo(np.float32).max)
    x = np.array([[0.75 * m], [0.75 * m], [-0.75 * m]], np.float32)
    want = np.array([0.75 * m], np.float32)
    assert_dbias_close(np.array([np.inf], np.float32), want, x, -1)
    for got in ([-np.inf], [np.nan]):
        with pytest.raises(AssertionError):
            assert_dbias_close(np.array(got, np.float32), want, x, -1)
    x = np.array([[m], [m], [-m], [-m]], np.float32)
    assert_dbias_close(np.array([np.nan], np.float32), np.array([0.0], np.float32), x, -1)
    assert_dbias_close(np.array([-np.inf], np.float32), np.array([np.inf], np.float32), x, -1)
    with pytest.raises(AssertionError):
        assert_dbias_close(np.array([-np.inf, -np.inf], bf16), np.array([np.inf, np.inf], bf16),
                           np.array([[big / 2, 1.0], [big / 2, 2.0]], bf16), -1)


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


@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=dtype_ids)
def test_every_16bit_input_matches_reference(dtype, fp8):
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype).reshape(256, 256)
    f = jax.jit(lambda v, s: quantize_fp8(v, s, out_dtype=fp8, rowwise=True, colwise=True))
    for scale in SCALES + [2.0**-20, 3.0e30]:
        s = jnp.float32(scale)
        out = f(x, s)
        ref = quantize_ref(jnp.asarray(x), s, fp8)
        check_all(out, ref, x, -1, dbias=False)


@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("shape,axis", SHAPES, ids=str)
def test_matches_reference(shape, axis, dtype, fp8, rng):
    f = jax.jit(lambda v, s: quantize_fp8(v, s, out_dtype=fp8, rowwise=True, colwise=True,
                                          flatten_axis=axis, compute_dbias=True))
    for scale in SCALES:
        x = random_with_specials(rng, shape, dtype, scale=3.0 / scale)
        s = jnp.asarray([scale], jnp.float32)
        check_all(f(x, s), quantize_ref(jnp.asarray(x), s, fp8, axis), x, axis)


@pytest.mark.parametrize("layout", ["rowwise", "colwise", "both"])
@pytest.mark.parametrize("dbias", [False, True], ids=["", "dbias"])
@pytest.mark.parametrize("shape,axis", [((33, 65), -1), ((3, 5, 129), 1), ((2, 3, 4, 40), 2)], ids=str)
def test_layouts(layout, dbias, shape, axis, rng):
    rowwise, colwise = layout in ("rowwise", "both"), layout in ("colwise", "both")
    for dtype in DTYPES:
        x = random_with_specials(rng, shape, dtype)
        out = quantize_fp8(x, jnp.float32(0.5), out_dtype=jnp.float8_e5m2, rowwise=rowwise,
                           colwise=colwise, flatten_axis=axis, compute_dbias=dbias)
        ref = quantize_ref(jnp.asarray(x), jnp.float32(0.5), jnp.float8_e5m2, axis)
        check_all(out, ref, x, axis, rowwise, colwise, dbias)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (2, 0, 3)], ids=str)
def test_empty(shape):
    x = np.zeros(shape, ml_dtypes.bfloat16)
    out = jax.jit(lambda v: quantize_fp8(v, jnp.float32(2.0), rowwise=True, colwise=True,
                                         compute_dbias=True))(x)
    assert float(out.amax) == 0.0
    assert out.rowwise.shape == shape and out.colwise.shape == shape[-1:] + shape[:-1]
    assert out.dbias.shape == shape[-1:] and out.dbias.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out.dbias, np.float32), 0.0)


@pytest.mark.parametrize("fp8,bound,tiny", [(jnp.float8_e4m3fn, 2.0**-4, 2.0**-6),
                                            (jnp.float8_e5m2, 2.0**-3, 2.0**-14)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16], ids=dtype_ids)
def test_dequantize_roundtrip(fp8, bound, tiny, out_dtype, rng):
    # Relative error <= half an ulp of the format (2^-4 E4M3, 2^-3 E5M2) where |x * scale|
    # is in the normal range, absolute <= half the smallest subnormal / scale below it;
    # bf16 output adds one more rounding: 2^-8 of the dequantized value (<= (1 + bound)|x|).
    fmax = float(jnp.finfo(fp8).max)
    extra = 0.0 if out_dtype == np.float32 else 2.0**-8
    for scale in SCALES:
        x = (rng.standard_normal((65, 129)) * rng.choice([1e-3, 1.0, 30.0]) / scale).astype(np.float32)
        q = quantize_fp8(x, jnp.float32(scale), out_dtype=fp8).rowwise
        y = np.asarray(dequantize_fp8(q, jnp.float32(1.0 / scale), out_dtype), np.float64)
        scaled = np.abs(x.astype(np.float64) * scale)
        normal = (scaled >= tiny) & (scaled <= fmax)
        err = np.abs(y - x)
        assert np.all(err[normal] <= (bound + extra * (1 + bound)) * np.abs(x[normal]) * (1 + 1e-6))
        sub = scaled < tiny
        half_subnormal = float(jnp.finfo(fp8).smallest_subnormal) / 2 / scale
        assert np.all(err[sub] <= (half_subnormal + extra * tiny / scale) * (1 + 1e-6))
        ref = (q.astype(jnp.float32) * jnp.float32(1.0 / scale)).astype(out_dtype)
        np.testing.assert_array_equal(np.asarray(dequantize_fp8(q, jnp.float32(1.0 / scale), out_dtype)),
                                      np.asarray(ref))


def test_jit_and_vmap(rng):
    x = random_with_specials(rng, (4, 33, 65), ml_dtypes.bfloat16)
    scales = jnp.asarray([1.0, 0.5, 4.0, 0.01], jnp.float32)

    def q(v, s):
        return quantize_fp8(v, s, rowwise=True, colwise=True, compute_dbias=True)

    for s_axis, s in ((None, jnp.float32(0.5)), (0, scales)):
        got = jax.jit(jax.vmap(q, in_axes=(0, s_axis)))(x, s)
        for b in range(x.shape[0]):
            sb = s if s_axis is None else s[b]
            check_all(jax.tree.map(lambda a: a[b], got), quantize_ref(jnp.asarray(x[b]), sb, jnp.float8_e4m3fn),
                      x[b], -1)
    nested = jax.jit(jax.vmap(jax.vmap(lambda v: q(v, jnp.float32(1.0)))))(x.reshape(2, 2, 33, 65))
    assert nested.colwise.shape == (2, 2, 65, 33) and nested.amax.shape == (2, 2)
    deq = jax.vmap(lambda d, s: dequantize_fp8(d, s, jnp.float32))(got.rowwise, 1.0 / scales)
    for b in range(4):
        np.testing.assert_array_equal(np.asarray(deq[b]), np.asarray(got.rowwise[b], np.float32) / scales[b])


SHARDINGS = [((64, 96), -1, P("a", "b")), ((64, 96), -1, P("a", None)), ((64, 96), -1, P(None, "b")),
             ((64, 96), -1, P(("a", "b"), None)), ((8, 12, 96), 2, P("a", "b", None)),
             ((8, 12, 96), 1, P(None, "a", "b")), ((8, 12, 96), 1, P("a", None, "b")), ((64, 96), -1, P())]


@pytest.mark.parametrize("shape,axis,spec", SHARDINGS, ids=str)
def test_sharded_equals_unsharded(shape, axis, spec, rng):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x = random_with_specials(rng, shape, ml_dtypes.bfloat16)
    x[(0,) * (len(shape) - 1) + (5,)] = -1000.0

    def f(v):
        return quantize_fp8(v, jnp.float32(0.25), rowwise=True, colwise=True, flatten_axis=axis,
                            compute_dbias=True)

    # The unsharded reference runs on a CPU device too (not the default device, which may be
    # a GPU): the comparison is sharded vs unsharded, not CPU vs CUDA.
    cpu0 = jax.devices("cpu")[0]
    with jax.default_device(cpu0):
        want = jax.jit(f)(jax.device_put(x, cpu0))
        want_deq = dequantize_fp8(want.rowwise, jnp.float32(4.0))
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    fs = jax.jit(f)
    got = fs(xs)
    assert_fp8_equal(got.rowwise, want.rowwise)
    assert_fp8_equal(got.colwise, want.colwise)
    assert_amax_equal(got.amax, want.amax)
    # Sharded dbias: per-shard fp32 sums psum'ed in fp32, rounded once: within fp32 order.
    assert_dbias_close(got.dbias, want.dbias, x, axis)
    assert got.rowwise.sharding.is_equivalent_to(xs.sharding, len(shape))
    hlo = fs.lower(xs).compile().as_text()
    assert "lowbit_quantize_fp8" in hlo and "all-gather" not in hlo
    deq = jax.jit(lambda d: dequantize_fp8(d, jnp.float32(4.0)))(got.rowwise)
    np.testing.assert_array_equal(np.asarray(deq).view(np.uint16), np.asarray(want_deq).view(np.uint16))


@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    axis_seed=st.integers(0, 10),
    dtype=st.sampled_from(DTYPES),
    fp8=st.sampled_from(FP8),
    layout=st.sampled_from([(True, False), (False, True), (True, True)]),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=25, deadline=None)
def test_random_shapes(shape, axis_seed, dtype, fp8, layout, seed):
    rng = np.random.default_rng(seed)
    axis = axis_seed % len(shape)
    x = random_with_specials(rng, tuple(shape), dtype)
    out = quantize_fp8(x, jnp.float32(2.0), out_dtype=fp8, rowwise=layout[0], colwise=layout[1],
                       flatten_axis=axis, compute_dbias=True)
    check_all(out, quantize_ref(jnp.asarray(x), jnp.float32(2.0), fp8, axis), x, axis, *layout)


def test_bad_inputs():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"lowbit.ops.quantize_fp8: x: expected float32, float16 or bfloat16, got int32"):
        quantize_fp8(jnp.arange(8).reshape(2, 4), jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"lowbit.ops.quantize_fp8: out_dtype: expected float8_e4m3fn or float8_e5m2"):
        quantize_fp8(x, jnp.float32(1.0), out_dtype=jnp.float8_e4m3fnuz)
    with pytest.raises(ValueError, match=r"lowbit.ops.quantize_fp8: flatten_axis"):
        quantize_fp8(x, jnp.float32(1.0), flatten_axis=2)
    with pytest.raises(ValueError, match=r"lowbit.ops.quantize_fp8: scale: expected float32 of shape \(\) or \(1,\)"):
        quantize_fp8(x, jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"lowbit.ops.quantize_fp8: scale"):
        quantize_fp8(x, jnp.float16(1.0))
    with pytest.raises(ValueError, match=r"lowbit.ops.quantize_fp8: rowwise, colwise"):
        quantize_fp8(x, jnp.float32(1.0), rowwise=False, colwise=False)
    with pytest.raises(ValueError, match=r"lowbit.ops.quantize_fp8: x: expected rank >= 1"):
        quantize_fp8(jnp.float32(1.0), jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"lowbit.ops.dequantize_fp8: data: expected float8_e4m3fn"):
        dequantize_fp8(x, jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"lowbit.ops.dequantize_fp8: out_dtype"):
        dequantize_fp8(x.astype(jnp.float8_e5m2), jnp.float32(1.0), jnp.int8)


def _ffi_quantize(x, scale, results, flatten_axis=1):
    return jax.ffi.ffi_call("lowbit_quantize_fp8", results)(x, scale, flatten_axis=np.int32(flatten_axis))


def test_handler_validation():
    lowbit._ffi.load()
    x = jnp.ones((4, 8), jnp.bfloat16)
    e4, f32 = jnp.float8_e4m3fn, jnp.float32
    sd = jax.ShapeDtypeStruct
    good = [sd((4, 8), e4), sd((8, 4), e4), sd((1,), f32), sd((8,), jnp.bfloat16)]
    _ffi_quantize(x, jnp.ones((1,), f32), good)  # sanity: the well-formed call runs
    cases = [
        ((x, jnp.ones((2,), f32), good, 1), r"lowbit_quantize_fp8: scale: expected f32 of shape \(1,\), got f32 of shape \(2,\)"),
        ((x, jnp.ones((1,), f32), good, 2), r"lowbit_quantize_fp8: flatten_axis: expected a value in \[0, 1\]"),
        ((x, jnp.ones((1,), f32), [good[0], sd((4, 8), e4)] + good[2:], 1), r"lowbit_quantize_fp8: colwise: expected"),
        ((x, jnp.ones((1,), f32), [good[0], sd((8, 4), jnp.float8_e5m2)] + good[2:], 1),
         r"lowbit_quantize_fp8: colwise: expected the rowwise dtype"),
        ((x, jnp.ones((1,), f32), good[:3] + [sd((8,), jnp.float16)], 1), r"lowbit_quantize_fp8: dbias: expected bf16 or f32"),
        ((x.astype(jnp.int32), jnp.ones((1,), f32), good, 1), r"lowbit_quantize_fp8: x: expected f32, f16 or bf16"),
        ((x, jnp.ones((1,), f32), [sd((0,), e4), sd((0,), e4)] + good[2:], 1), r"lowbit_quantize_fp8: rowwise: neither"),
    ]
    for (xa, scale, results, fa), msg in cases:
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(_ffi_quantize(xa, scale, results, fa))
    with pytest.raises(Exception, match=r"lowbit_dequantize_fp8: out: expected f32, f16 or bf16 of shape \(4, 8\)"):
        jax.block_until_ready(jax.ffi.ffi_call("lowbit_dequantize_fp8", sd((8, 4), f32))(
            x.astype(e4), jnp.ones((1,), f32)))


# ---------------------------------------------------------------- CUDA vs CPU

GPU_SHAPES = [((4097, 3001), -1), ((1024, 2048), -1), ((2048, 128), -1), ((100, 2048), -1),
              ((1, 65536), -1), ((65536, 1), -1), ((3, 5, 129), 1), ((2, 7, 64, 96), 2), ((16, 3000), -1),
              # More tiles than an H100 holds blocks (default 256 x 128 tiles: 384 tiles, 132
              # blocks), so blocks loop and the copy of the next tile overlaps this one:
              # 16-byte stores everywhere; rows and
              # cols = 8 (mod 16): 8-byte stores; = 4 (mod 8): 4-byte stores (and the
              # element-load path for 16-bit x).
              ((12288, 1024), -1), ((8200, 1032), -1), ((8196, 1028), -1)]
# Each kernel path: flat rowwise; tiled colwise only; tiled everything; tiled rowwise+dbias.
GPU_CONFIGS = [(True, False, False), (False, True, False), (True, True, True), (True, False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("shape,axis", GPU_SHAPES, ids=str)
def test_cuda_equals_cpu(shape, axis, dtype, rng, cpu, gpu):
    x = random_with_specials(rng, shape, dtype)
    for i, (rowwise, colwise, dbias) in enumerate(GPU_CONFIGS):
        fp8 = FP8[i % 2]

        def f(v, s):
            return quantize_fp8(v, s, out_dtype=fp8, rowwise=rowwise, colwise=colwise,
                                flatten_axis=axis, compute_dbias=dbias)

        s = np.float32(0.37)
        g, c = run_on(gpu, f, x, s), run_on(cpu, f, x, s)
        for name in ("rowwise", "colwise"):
            if getattr(c, name) is not None:
                np.testing.assert_array_equal(getattr(g, name).view(np.uint8), getattr(c, name).view(np.uint8))
        np.testing.assert_array_equal(g.amax.view(np.uint32), c.amax.view(np.uint32))
        if dbias:
            # The kernel sums 64-row tiles, then the tiles; the reference sums rows in order.
            assert_dbias_close(g.dbias, c.dbias, x, axis)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
def test_cuda_every_input_bit_pattern_equals_cpu(fp8, rng, cpu, gpu):
    # The kernel encodes with the hardware cvt where no NaN can occur and with the
    # formats.h codec otherwise: every 16-bit input, random fp32 bit patterns (ties,
    # subnormal outputs, saturation) and non-finite or zero scales must match the CPU bit
    # for bit, NaN signs included (MulNanDefined fixes them: a GPU multiply drops them).
    inputs = [np.arange(1 << 16, dtype=np.uint16).view(d).reshape(256, 256)
              for d in (np.float16, ml_dtypes.bfloat16)]
    inputs.append(rng.integers(0, 1 << 32, (512, 1024), dtype=np.uint32).view(np.float32))
    finite = np.where(np.isfinite(inputs[-1]), inputs[-1], np.float32(1.0))
    inputs.append(finite.astype(np.float32))
    for x in inputs:
        for scale in (1.0, 2.0**-7, 2.0**10, 0.37, 3.0e30, 0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan):
            f = lambda v, s: quantize_fp8(v, s, out_dtype=fp8, rowwise=True, colwise=True)  # noqa: E731
            g = lambda v, s: quantize_fp8(v, s, out_dtype=fp8)  # noqa: E731
            for fn in (f, g):
                a, b = run_on(gpu, fn, x, np.float32(scale)), run_on(cpu, fn, x, np.float32(scale))
                np.testing.assert_array_equal(a.rowwise.view(np.uint8), b.rowwise.view(np.uint8))
                if b.colwise is not None:
                    np.testing.assert_array_equal(a.colwise.view(np.uint8), b.colwise.view(np.uint8))
                np.testing.assert_array_equal(a.amax.view(np.uint32), b.amax.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_cuda_misaligned_and_special(dtype, rng, cpu, gpu):
    x = random_with_specials(rng, (513, 1030), dtype)

    def f(v):  # a slice starting one element in, and odd cols: the unvectorized paths
        w = v.reshape(-1)[1:1 + 511 * 1033].reshape(511, 1033)
        return quantize_fp8(w, jnp.float32(3.0), rowwise=True, colwise=True, compute_dbias=True)

    def g(v):
        return quantize_fp8(v.reshape(-1)[3:], jnp.float32(3.0))  # flat rowwise, odd length

    for fn in (f, g):
        a, b = run_on(gpu, fn, x), run_on(cpu, fn, x)
        np.testing.assert_array_equal(a.rowwise.view(np.uint8), b.rowwise.view(np.uint8))
        if b.colwise is not None:
            np.testing.assert_array_equal(a.colwise.view(np.uint8), b.colwise.view(np.uint8))
        np.testing.assert_array_equal(a.amax.view(np.uint32), b.amax.view(np.uint32))
    empty = lambda v: quantize_fp8(v[:0], jnp.float32(1.0), colwise=True, compute_dbias=True)  # noqa: E731
    e = run_on(gpu, empty, x)
    assert float(e.amax) == 0.0 and np.all(e.dbias.astype(np.float32) == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_ids)
def test_cuda_dequantize_equals_cpu(fp8, out_dtype, cpu, gpu):
    codes = np.tile(np.arange(256, dtype=np.uint8), 4099).view(fp8)  # every code, odd length
    # NaN codes keep their sign and give the canonical quiet NaN of out's dtype on both.
    for scale_inv in (1.0, 3.7e-3, 1e5, 0.0, -np.inf, -np.nan):
        f = lambda d: dequantize_fp8(d, jnp.float32(scale_inv), out_dtype)  # noqa: E731
        a, b = run_on(gpu, f, codes), run_on(cpu, f, codes)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        a, b = run_on(gpu, f, codes[5:]), run_on(cpu, f, codes[5:])
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.gpu
def test_cuda_vmap_equals_cpu(rng, cpu, gpu):
    x = random_with_specials(rng, (3, 129, 257), ml_dtypes.bfloat16)
    f = jax.vmap(lambda v: quantize_fp8(v, jnp.float32(2.0), rowwise=True, colwise=True, compute_dbias=True))
    a, b = run_on(gpu, f, x), run_on(cpu, f, x)
    np.testing.assert_array_equal(a.rowwise.view(np.uint8), b.rowwise.view(np.uint8))
    np.testing.assert_array_equal(a.colwise.view(np.uint8), b.colwise.view(np.uint8))
    np.testing.assert_array_equal(a.amax.view(np.uint32), b.amax.view(np.uint32))


# Every tile variant of the CUDA tiled kernel (LOWBIT_QUANTIZE_TILE_VARIANT, quantize.h;
# the launcher reads it on every call, and run_on compiles afresh) against the CPU. Shapes
# with more tiles than the GPU holds blocks (4160 x 2056: 1105 tiles of 64 rows, 561 of
# 128, 289 of 256), so blocks loop through the pipeline; rows = 4 (mod 8) (4-byte colwise stores,
# partial 128-row tiles); cols = 4 (mod 8) (element loads for 16-bit x); unaligned odd
# shapes; one row (1-byte colwise stores).
TILE_VARIANTS = ["r64s2", "r64s3", "r128s2", "r64s2b16", "r64s3b1", "r128s2b3", "r256s2", "r256s2b2"]
VARIANT_SHAPES = [((4160, 2056), -1), ((4100, 1028), -1), ((513, 3001), -1), ((2, 7, 64, 96), 2),
                  ((1, 4100), -1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("variant", TILE_VARIANTS)
def test_cuda_tile_variants_equal_cpu(variant, dtype, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_TILE_VARIANT", variant)
    for shape, axis in VARIANT_SHAPES:
        x = random_with_specials(rng, shape, dtype)
        for i, (rowwise, colwise, dbias) in enumerate(GPU_CONFIGS[1:]):  # the tiled kernel's
            def f(v, s):
                return quantize_fp8(v, s, out_dtype=FP8[i % 2], rowwise=rowwise, colwise=colwise,
                                    flatten_axis=axis, compute_dbias=dbias)

            s = np.float32(0.37)
            g, c = run_on(gpu, f, x, s), run_on(cpu, f, x, s)
            for name in ("rowwise", "colwise"):
                if getattr(c, name) is not None:
                    np.testing.assert_array_equal(getattr(g, name).view(np.uint8), getattr(c, name).view(np.uint8),
                                                  err_msg=f"{name} {shape}")
            np.testing.assert_array_equal(g.amax.view(np.uint32), c.amax.view(np.uint32))
            if dbias:
                assert_dbias_close(g.dbias, c.dbias, x, axis)


# The rowwise-only kernels (LOWBIT_QUANTIZE_ROWWISE_KERNEL, quantize.h) against the CPU:
# steps of one or two 16-byte chunks (n not a multiple of 16: the scalar tail), and the
# tiled kernel without its colwise copy.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("kernel", ["chunks1", "chunks2", "tiled"])
def test_cuda_rowwise_kernels_equal_cpu(kernel, dtype, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_ROWWISE_KERNEL", kernel)
    for shape in ((4097, 3001), (12288, 1024), (1, 65541), (3, 5, 129)):
        x = random_with_specials(rng, shape, dtype)
        for fp8 in FP8:
            def f(v, s):
                return quantize_fp8(v, s, out_dtype=fp8, rowwise=True, colwise=False)

            s = np.float32(0.37)
            g, c = run_on(gpu, f, x, s), run_on(cpu, f, x, s)
            np.testing.assert_array_equal(g.rowwise.view(np.uint8), c.rowwise.view(np.uint8), err_msg=f"{shape}")
            np.testing.assert_array_equal(g.amax.view(np.uint32), c.amax.view(np.uint32))


@pytest.mark.gpu
def test_cuda_bad_rowwise_kernel(gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_ROWWISE_KERNEL", "chunks4")
    with pytest.raises(Exception, match=r"lowbit_quantize_fp8: LOWBIT_QUANTIZE_ROWWISE_KERNEL=\"chunks4"):
        run_on(gpu, lambda v: quantize_fp8(v, jnp.float32(1.0), colwise=False), jnp.ones((64, 128), jnp.bfloat16))


@pytest.mark.gpu
def test_cuda_bad_tile_variant(gpu, monkeypatch):
    x = jnp.ones((64, 128), jnp.bfloat16)
    for bad in ("r32s2", "r128s3", "r256s3", "r512s2", "r64s2b0", "r64s2x", "fast", "r64s2p1"):
        monkeypatch.setenv("LOWBIT_QUANTIZE_TILE_VARIANT", bad)
        with pytest.raises(Exception, match=r"lowbit_quantize_fp8: LOWBIT_QUANTIZE_TILE_VARIANT=\"" + bad):
            run_on(gpu, lambda v: quantize_fp8(v, jnp.float32(1.0), colwise=True), x)
