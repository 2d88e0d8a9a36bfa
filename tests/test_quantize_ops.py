"""lowbit.ops.quantize_fp8 / dequantize_fp8: bit for bit against a few-line jnp reference
(every layout, input dtype, FP8 format, odd and empty shapes, special values, several
scales), dbias within a stated tolerance, the dequantize round-trip error bound, jit,
vmap, sharding over virtual CPU devices and bad input; the CUDA kernels against the CPU
handlers are in tests/test_quantize_ops_cuda.py, the reference in quantize_reference.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from quantize_reference import (DTYPES, FP8, SCALES, SHAPES, assert_amax_equal, assert_dbias_close, assert_fp8_equal,
                                check_all, dtype_ids, quantize_ref)

import lowbit
from lowbit.ops import dequantize_fp8, quantize_fp8


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


@pytest.mark.cpu_reference  # the CPU handler's results (the CUDA one takes a workspace too: test_quantize_workspace.py)
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
