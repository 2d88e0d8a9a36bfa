"""lowbit.ops.quantize_fp8_block / quantize_mxfp8 and their dequantize ops: bit for bit against
a few-line numpy reference (tests/quantize_block_reference.py; every layout, input dtype, FP8
format, 1x128 and 128x128 tiles, fp32 and power-of-two scales, odd shapes with partial tiles,
inf/NaN/zeros/near-max values, all-zero and subnormal blocks), the scale layouts and their
zero padding, dequantize and its round-trip error bound, dbias (bit for bit against a numpy
reference of the summation order of csrc/quantize/block_dbias.h, and close to a float64 sum),
jit, vmap, sharding over virtual CPU devices, bad input (tests/test_quantize_block_ops_cuda.py
compares the CUDA kernels with the CPU handlers on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from quantize_block_reference import (DTYPES, F32, FP8, _expand, _quantize_with_dbias, assert_bits_equal,
                                      assert_dbias_near_exact_sum, assert_fp8_equal, dbias_ref, ids,
                                      quantize_fp8_block_ref, quantize_mxfp8_ref, with_block_specials)

import lowbit
from lowbit.ops.quantize_block import dequantize_fp8_block, dequantize_mxfp8, quantize_fp8_block, quantize_mxfp8

# numpy warns on the inf/NaN the special values produce; they are the point of the test.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SHAPES = [((1, 1), -1), ((3, 200), -1), ((130, 129), -1), ((257, 300), -1), ((2, 3, 129), 1),
          ((2, 3, 129), 2), ((11,), -1), ((64, 256), -1), ((0, 5), -1)]


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


@pytest.mark.cpu_reference  # the CPU handlers' results (the CUDA ones take a workspace too: test_quantize_workspace.py)
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
