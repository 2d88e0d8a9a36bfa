"""lowbit.quantize: quantizers and ScaledTensors against a numpy reference of the whole
current-scaling flow (bit for bit), delayed vs current, round-trip error, the transposed
colwise copy, dbias, jit / grad / scan / vmap, QuantizerFactory and the placeholders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import warnings

import numpy as np
import pytest

import lowbit
from lowbit.quantize import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DataFamily,
    DelayedScaleQuantizer,
    NVFP4Quantizer,
    QuantizeLayout,
    QuantizerFactory,
    QuantizerSet,
    ScaledTensor1x,
    ScaledTensor2x,
    ScalingMode,
)
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

FLT_MAX = np.float32(np.finfo(np.float32).max)


def cast_ref(x, scale, q_dtype):
    """q = cast_rne(clip(x_f32 * scale, +-max)) in numpy / ml_dtypes."""
    fp8_max = np.float32(ml_dtypes.finfo(q_dtype).max)
    return np.clip(np.asarray(x, np.float32) * np.float32(scale), -fp8_max, fp8_max).astype(q_dtype)


def current_ref(x, q_dtype, pow2=False):
    """The full current-scaling flow: (data, scale_inv, amax)."""
    amax = np.max(np.abs(np.asarray(x, np.float32)), initial=np.float32(0))
    with np.errstate(all="ignore"):
        scale = np.float32(ml_dtypes.finfo(q_dtype).max) / amax
    scale = FLT_MAX if np.isinf(scale) else scale
    scale = scale if (amax > 0 and np.isfinite(amax)) else np.float32(1)
    if pow2:
        scale = (np.array(scale).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return cast_ref(x, scale, q_dtype), np.float32(1) / np.float32(scale), np.float32(amax)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def assert_bits(got, want):
    np.testing.assert_array_equal(bits(got), bits(np.asarray(want, np.asarray(got).dtype)))


DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
Q_DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2]
SHAPES_AXES = [((32, 48), -1), ((4, 6, 40), -1), ((4, 6, 40), 1), ((3, 5, 7, 8), 2), ((96,), -1)]


def test_scaling_modes():
    assert ScalingMode.DELAYED_TENSOR_SCALING.is_tensor_scaling()
    assert ScalingMode.CURRENT_TENSOR_SCALING.block_shape is None
    assert ScalingMode.MXFP8_1D_SCALING.block_shape == (1, 32)
    assert ScalingMode.MXFP8_1D_SCALING.scale_dtype == jnp.float8_e8m0fnu
    assert ScalingMode.FP8_BLOCK_128x128.block_shape == (128, 128)
    assert ScalingMode.FP8_BLOCK_1x128.scale_dtype == jnp.float32
    assert ScalingMode.NVFP4_2D_SCALING.block_shape == (16, 16)
    assert ScalingMode.NVFP4_1D_SCALING.data_family == DataFamily.FP4
    assert ScalingMode.NVFP4_1D_SCALING.scale_dtype == jnp.float8_e4m3fn
    assert ScalingMode.NO_SCALING.data_family == DataFamily.HIGH_PRECISION
    assert [m.is_block_scaling for m in ScalingMode] == [False] * 3 + [True] * 5
    assert QuantizeLayout.of(True, True) == QuantizeLayout.ROWWISE_COLWISE
    assert QuantizeLayout.COLWISE.has_colwise and not QuantizeLayout.COLWISE.has_rowwise
    with pytest.raises(ValueError):
        QuantizeLayout.of(False, False)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, axis", SHAPES_AXES, ids=str)
def test_current_scaling_matches_the_reference_bit_for_bit(shape, axis, dtype, q_dtype, pow2, rng):
    x = (rng.standard_normal(shape) * 7).astype(dtype)
    quantizer = CurrentScaleQuantizer(q_dtype=q_dtype, use_power_2_scales=pow2)
    tensor, dbias = jax.jit(
        lambda x: quantizer.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=axis)
    )(x)
    assert isinstance(tensor, ScaledTensor2x) and dbias is None
    data, scale_inv, amax = current_ref(x, q_dtype, pow2)
    row, col = tensor.rowwise_tensor, tensor.colwise_tensor
    assert row.data.dtype == jnp.dtype(q_dtype) and row.scale_inv.shape == (1,)
    assert_bits(row.data, data)
    assert_bits(row.scale_inv, [scale_inv])
    assert_bits(row.amax, [amax])
    ax = axis % len(shape)
    assert_bits(col.data, np.transpose(data, (*range(ax, len(shape)), *range(ax))))
    assert (row.data_layout, col.data_layout) == ("N", "T")
    assert row.shape == col.shape == tensor.shape == shape
    assert row.dq_dtype == col.dq_dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_current_scaling_special_values(q_dtype, rng):
    x = (rng.standard_normal((16, 32)) * 3).astype(np.float32)
    x[1, 2], x[5, 6] = np.inf, -1e-3
    quantizer = CurrentScaleQuantizer(q_dtype=q_dtype)
    tensor, _ = quantizer.quantize(x)
    data, scale_inv, _ = current_ref(x, q_dtype)
    assert float(tensor.scale_inv[0]) == 1.0 == scale_inv  # inf amax -> scale 1
    assert_bits(tensor.data, data)
    x[7, 7] = np.nan
    tensor, _ = quantizer.quantize(x)
    assert float(tensor.scale_inv[0]) == 1.0 and np.isnan(float(tensor.amax[0]))
    assert np.isnan(np.asarray(tensor.data, np.float32)[7, 7])
    zeros, _ = quantizer.quantize(np.zeros((4, 8), np.float32))
    assert float(zeros.scale_inv[0]) == 1.0 and not np.asarray(zeros.data, np.float32).any()


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_delayed_casts_with_its_stored_scale(q_dtype, rng):
    x = (rng.standard_normal((24, 64)) * 5).astype(ml_dtypes.bfloat16)
    scale = np.float32(3.7)
    quantizer = DelayedScaleQuantizer(q_dtype=q_dtype, scale=jnp.full((1,), scale),
                                      amax_history=jnp.zeros(8))
    tensor, _ = jax.jit(lambda q, x: q.quantize(x, is_rowwise=False, is_colwise=True))(quantizer, x)
    assert isinstance(tensor, ScaledTensor1x) and tensor.is_colwise
    assert_bits(tensor.data, cast_ref(x, scale, q_dtype).T)
    assert_bits(tensor.scale_inv, [np.float32(1) / scale])
    assert float(tensor.amax[0]) == float(np.max(np.abs(np.asarray(x, np.float32))))


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_current_and_delayed_agree_when_their_scales_do(q_dtype, rng):
    x = (rng.standard_normal((33, 40)) * 11).astype(np.float32)
    current, _ = CurrentScaleQuantizer(q_dtype=q_dtype).quantize(x, is_colwise=True)
    # One update with this tensor's amax gives the delayed quantizer the current scale.
    delayed = DelayedScaleQuantizer.create(q_dtype, amax_history_len=4).update(current.amax)
    fp8_max = np.float32(ml_dtypes.finfo(q_dtype).max)
    assert_bits(delayed.scale, fp8_max / np.asarray(current.amax))
    delayed_tensor, _ = delayed.quantize(x, is_colwise=True)
    for colwise in (False, True):
        a, b = current.get_tensor(colwise), delayed_tensor.get_tensor(colwise)
        assert_bits(a.data, b.data)
        assert_bits(a.scale_inv, b.scale_inv)
    assert delayed_tensor.rowwise_tensor.scaling_mode == ScalingMode.DELAYED_TENSOR_SCALING


@pytest.mark.parametrize(
    "q_dtype, rel", [(jnp.float8_e4m3fn, 2.0**-4), (jnp.float8_e5m2, 2.0**-3)],
    ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape, axis", SHAPES_AXES, ids=str)
def test_round_trip_error(shape, axis, q_dtype, rel, rng):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    tensor, _ = CurrentScaleQuantizer(q_dtype=q_dtype).quantize(
        x, is_colwise=True, flatten_axis=axis)
    scale = 1 / float(tensor.rowwise_tensor.scale_inv[0])
    # Half a step of the format: relative for normals, absolute (in x units) below them.
    finfo = ml_dtypes.finfo(q_dtype)
    bound = rel * np.abs(x) + float(finfo.smallest_subnormal) / 2 / scale
    for colwise in (False, True):
        back = np.asarray(tensor.get_tensor(colwise).dequantize())
        assert back.shape == shape and back.dtype == np.float32
        assert np.all(np.abs(back - x) <= bound)
    np.testing.assert_array_equal(tensor.dequantize(), tensor.colwise_tensor.dequantize())


@pytest.mark.parametrize("dq_dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_formula(dq_dtype, rng):
    x = (rng.standard_normal((8, 16)) * 3).astype(np.float32)
    tensor, _ = CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn).quantize(x, dq_dtype=dq_dtype)
    want = (np.asarray(tensor.data, np.float32) * np.asarray(tensor.scale_inv)).astype(dq_dtype)
    assert_bits(tensor.dequantize(), want)
    from lowbit.ops.quantize import dequantize_fp8

    assert_bits(tensor.dequantize(), dequantize_fp8(tensor.data, tensor.scale_inv, dq_dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, axis", [((32, 48), -1), ((4, 6, 40), 1), ((4, 6, 40), 2)], ids=str)
def test_dbias(shape, axis, dtype, rng):
    x = rng.standard_normal(shape).astype(dtype)
    quantizer = QuantizerFactory.create_set(Float8CurrentScaling()).dgrad
    tensor, dbias = quantizer.quantize(x, flatten_axis=axis, compute_dbias=True)
    ax = axis % len(shape)
    want = np.sum(np.asarray(x, np.float32), axis=tuple(range(ax)))
    assert dbias.shape == shape[ax:] and dbias.dtype == np.dtype(dtype)
    np.testing.assert_allclose(np.asarray(dbias, np.float32), want, rtol=1e-2, atol=1e-2)
    assert tensor.data.dtype == jnp.float8_e5m2


def test_scaled_tensor_is_a_pytree_with_static_metadata(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    tensor, _ = CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn).quantize(x, is_colwise=True)
    leaves = jax.tree.leaves(tensor)
    assert len(leaves) == 6  # data, scale_inv, amax for each copy
    back = jax.jit(lambda t: t)(tensor)
    assert isinstance(back, ScaledTensor2x) and back.colwise_tensor.flatten_axis == 1
    np.testing.assert_array_equal(jax.jit(lambda t: t.dequantize())(tensor), tensor.dequantize())


def test_grad_through_quantize_is_zero(rng):
    """Quantization is piecewise constant: jax.grad traces and gives zero (documented in
    lowbit/quantize/quantizer.py), for the input and for the quantizer state."""
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def loss(x, q):
        tensor, _ = q.quantize(x, is_colwise=True)
        return jnp.sum(tensor.dequantize() ** 2) + jnp.sum(tensor.colwise_tensor.dequantize())

    for q in (CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn),
              DelayedScaleQuantizer.create(jnp.float8_e4m3fn, amax_history_len=4)):
        dx, dq = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, q)
        assert not np.asarray(dx).any()
        assert type(dq) is type(q)
        assert all(not np.asarray(leaf).any() for leaf in jax.tree.leaves(dq))


def test_scan_carries_a_delayed_quantizer(rng):
    """Step t casts with the scale made at step t-1 from the amax history."""
    peaks = np.array([2.0, 8.0, 1.0, 0.5, 0.25, 4.0], np.float32)
    xs = rng.uniform(-0.1, 0.1, (len(peaks), 16, 32)).astype(np.float32)
    xs[:, 0, 0] = peaks
    history_len = 3

    def step(q, x):
        tensor, _ = q.quantize(x, is_colwise=True)
        return q.update(tensor.amax), (q.scale[0], tensor.rowwise_tensor.data)

    q0 = DelayedScaleQuantizer.create(jnp.float8_e4m3fn, amax_history_len=history_len)
    q_last, (scales_used, data) = jax.jit(lambda q, xs: jax.lax.scan(step, q, xs))(q0, xs)
    want = [np.float32(1)] + [np.float32(448) / peaks[max(0, t - history_len + 1): t + 1].max()
                              for t in range(len(peaks))]
    assert_bits(scales_used, want[:-1])
    assert_bits(q_last.scale, want[-1:])
    for t in range(len(peaks)):
        assert_bits(data[t], cast_ref(xs[t], want[t], jnp.float8_e4m3fn))
    np.testing.assert_array_equal(q_last.amax_history, [0.0, 0.25, 4.0])


def test_vmap(rng):
    magnitudes = np.array([1, 10, 100])[:, None, None]
    xs = (rng.standard_normal((3, 8, 16)) * magnitudes).astype(np.float32)
    quantizer = CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn)
    tensors, _ = jax.vmap(lambda x: quantizer.quantize(x, is_colwise=True))(xs)
    for i in range(3):
        data, scale_inv, _ = current_ref(xs[i], jnp.float8_e4m3fn)
        assert_bits(tensors.rowwise_tensor.data[i], data)
        assert_bits(tensors.colwise_tensor.data[i], data.T)
        assert_bits(tensors.rowwise_tensor.scale_inv[i], [scale_inv])
    fresh = lambda _: DelayedScaleQuantizer.create(jnp.float8_e4m3fn, amax_history_len=2)  # noqa: E731
    delayed = jax.vmap(fresh)(jnp.arange(3))
    updated = jax.vmap(lambda q, a: q.update(a))(delayed, jnp.array([1.0, 2.0, 4.0]))
    np.testing.assert_array_equal(updated.scale[:, 0], [448.0, 224.0, 112.0])
    tensors, _ = jax.vmap(lambda q, x: q.quantize(x))(updated, xs)
    for i in range(3):
        assert_bits(tensors.data[i], cast_ref(xs[i], updated.scale[i, 0], jnp.float8_e4m3fn))


def test_bad_input(rng):
    quantizer = CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="x: expected float32"):
        quantizer.quantize(x.astype(np.int32))
    with pytest.raises(ValueError, match="flatten_axis"):
        quantizer.quantize(x, flatten_axis=2)
    with pytest.raises(ValueError, match="rowwise and colwise"):
        quantizer.quantize(x, is_rowwise=False)
    with pytest.raises(ValueError, match="q_dtype"):
        CurrentScaleQuantizer(q_dtype=jnp.float32)
    with pytest.raises(ValueError, match="q_dtype"):
        NVFP4Quantizer(q_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaleQuantizer.create(jnp.float8_e4m3fn, amax_compute_algo="mean")


@pytest.mark.parametrize(
    "recipe, cls, modes, dtypes",
    [
        (DelayedScaling(amax_history_len=16, margin=2), DelayedScaleQuantizer,
         ["DELAYED_TENSOR_SCALING"] * 3, ["float8_e4m3fn"] * 2 + ["float8_e5m2"]),
        (Float8CurrentScaling(fp8_format=Format.E4M3), CurrentScaleQuantizer,
         ["CURRENT_TENSOR_SCALING"] * 3, ["float8_e4m3fn"] * 3),
        (MXFP8BlockScaling(), BlockScaleQuantizer, ["MXFP8_1D_SCALING"] * 3, ["float8_e4m3fn"] * 3),
        (Float8BlockScaling(), BlockScaleQuantizer,
         ["FP8_BLOCK_1x128", "FP8_BLOCK_128x128", "FP8_BLOCK_1x128"], ["float8_e4m3fn"] * 3),
        (NVFP4BlockScaling(), NVFP4Quantizer,
         ["NVFP4_1D_SCALING", "NVFP4_2D_SCALING", "NVFP4_1D_SCALING"], ["float4_e2m1fn"] * 3),
        (NVFP4BlockScaling(disable_2d_quantization=True), NVFP4Quantizer,
         ["NVFP4_1D_SCALING"] * 3, ["float4_e2m1fn"] * 3),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, list) else None,
)
def test_factory(recipe, cls, modes, dtypes):
    qset = QuantizerFactory.create_set(recipe)
    assert isinstance(qset, QuantizerSet)
    assert all(type(q) is cls for q in qset.quantizers)
    assert [q.scaling_mode.name for q in qset.quantizers] == modes
    assert [q.q_dtype.name for q in qset.quantizers] == dtypes
    assert all(q.q_layout == QuantizeLayout.ROWWISE_COLWISE for q in qset.quantizers)
    if isinstance(recipe, DelayedScaling):
        assert qset.x.amax_history.shape == (16,) and qset.x.margin == 2
        assert qset.x.scale.shape == (1,) and float(qset.x.scale[0]) == 1.0
    if isinstance(recipe, NVFP4BlockScaling):
        assert qset.dgrad.stochastic_rounding and qset.x.use_rht and not qset.kernel.use_rht
    jax.jit(lambda s: s)(qset)


def test_factory_without_a_recipe_and_under_autocast():
    assert QuantizerFactory.create_set() == QuantizerSet(None, None, None)
    with lowbit.autocast(enabled=True, recipe=Float8CurrentScaling()):
        assert isinstance(QuantizerFactory.create_set().x, CurrentScaleQuantizer)
        with lowbit.autocast(enabled=False):
            assert QuantizerFactory.create_set() == QuantizerSet()
        assert isinstance(QuantizerFactory.create_set(DelayedScaling()).x, DelayedScaleQuantizer)
    sets = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), n_quantizer_sets=2)
    assert len(sets) == 2 and sets[0].x is not sets[1].x
    with pytest.raises(ValueError, match="not both"):
        QuantizerFactory.create_set(DelayedScaling(), fp8_recipe=DelayedScaling())
    with pytest.raises(NotImplementedError, match="grouped"):
        QuantizerFactory.create_set(DelayedScaling(), n_groups=4)
    assert QuantizerFactory.create(ScalingMode.NO_SCALING, jnp.float8_e4m3fn) is None


def test_nvfp4_quantizers_quantize_and_sr_needs_a_key():
    """NVFP4 quantizers work (tests/test_quantize_nvfp4.py has the numerics); SR without a key
    is an error, not silently RNE."""
    x = jnp.linspace(-3, 3, 32 * 128, dtype=jnp.float32).reshape(32, 128)
    qs = QuantizerFactory.create_set(NVFP4BlockScaling())
    for q in (qs.x, qs.kernel):
        t, _ = q.quantize(x, is_colwise=True)
        np.testing.assert_allclose(np.asarray(t.dequantize()), np.asarray(x), atol=0.5)
    with pytest.raises(ValueError, match="stochastic rounding needs a PRNG key"):
        qs.dgrad.quantize(x)
    t, _ = qs.dgrad.with_key(jax.random.PRNGKey(0)).quantize(x)
    assert t.shape == x.shape


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling(),
                                    Float8BlockScaling(use_f32_scales=True),
                                    Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)],
                         ids=str)
def test_block_quantizers_build_scaled_tensors(recipe, rng):
    # The factory's block quantizers return ScaledTensor2x of the lowbit.ops.quantize_block
    # outputs (checked bit for bit against numpy in test_quantize_block_ops.py); here: the
    # pytree plumbing, the layouts, dequantize() of both copies and jit.
    from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8

    x = (rng.standard_normal((3, 70, 260)) * 5).astype(ml_dtypes.bfloat16)
    for q in QuantizerFactory.create_set(recipe).quantizers:
        t, dbias = jax.jit(lambda v, q=q: q.quantize(v, is_rowwise=True, is_colwise=True, flatten_axis=2,
                                                     compute_dbias=True))(x)
        assert isinstance(t, ScaledTensor2x) and t.amax is None and t.shape == x.shape
        row, col = t.get_tensor(False), t.get_tensor(True)
        assert row.scaling_mode == q.scaling_mode and col.is_colwise
        if q.scaling_mode == ScalingMode.MXFP8_1D_SCALING:
            want = quantize_mxfp8(x, out_dtype=q.q_dtype, rowwise=True, colwise=True, flatten_axis=2)
            assert col.data_layout == "N" and col.data.shape == x.shape
        else:
            want = quantize_fp8_block(x, out_dtype=q.q_dtype, tile_2d=q.scaling_mode == ScalingMode.FP8_BLOCK_128x128,
                                      pow2_scales=q.use_power_2_scales, rowwise=True, colwise=True, flatten_axis=2)
            assert col.data_layout == "T" and col.data.shape == (260, 3, 70) and col.shape == x.shape
        for got, w in ((row.data, want.rowwise), (row.scale_inv, want.rowwise_scale),
                       (col.data, want.colwise), (col.scale_inv, want.colwise_scale)):
            np.testing.assert_array_equal(bits(got), bits(w))
        info = ml_dtypes.finfo(q.q_dtype)
        for copy in (row, col):
            deq = np.asarray(copy.dequantize(), np.float32)
            assert deq.shape == x.shape and copy.dequantize().dtype == x.dtype
            xf = np.asarray(x, np.float32)
            tol = 2.0 ** -(info.nmant + 1) * np.abs(xf) + 2.0**-8 * np.abs(xf) + 1e-3 * np.max(np.abs(xf))
            assert np.all(np.abs(deq - xf) <= tol)
        np.testing.assert_array_equal(bits(dbias), bits(np.asarray(x, np.float32).sum(axis=(0, 1)).astype(x.dtype)))


@pytest.mark.parametrize("recipe,bound", [(MXFP8BlockScaling(), 0.08), (Float8BlockScaling(), 0.08),
                                          (NVFP4BlockScaling(), 0.25)], ids=lambda v: type(v).__name__)
def test_block_recipes_run_dense_and_nvfp4(recipe, bound, rng):
    """The block recipes' sets run dense outside jit, close to the unquantized product: E4M3
    data gives a relative error of 0.035-0.042 at this shape, NVFP4's E2M1 0.146-0.156 (seeds
    0-2); a GEMM that read k's K axis reversed gives 1.4-1.5."""
    from lowbit.dense import dense

    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(256, 24)) / 16, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notices
        y = dense(x, k, quantizer_set=QuantizerFactory.create_set(recipe))
    assert y.shape == (4, 24) and y.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float32) @ np.asarray(k, np.float32)
    err = np.linalg.norm(np.asarray(y, np.float32) - ref) / np.linalg.norm(ref)
    assert err < bound, err


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_cuda_quantizers_equal_cpu(pow2, rng, cpu, gpu):
    # Scales and scale_inv come from lowbit's scale ops (not XLA's division), so the CUDA
    # and CPU backends agree bit for bit: data, scale_inv, amax and the delayed state.
    from conftest import run_on

    x = (rng.standard_normal((96, 130)) * 37).astype(np.float32)

    def step(v):
        t, _ = CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn, use_power_2_scales=pow2).quantize(
            v, is_colwise=True)
        q = DelayedScaleQuantizer.create(jnp.float8_e5m2, amax_history_len=4, margin=1)
        q = q.update(t.amax).update(t.amax * 3)
        d, _ = q.quantize(v, is_colwise=True)
        return t, d, q.scale, q.amax_history

    a, b = run_on(gpu, step, x), run_on(cpu, step, x)
    jax.tree.map(lambda p, q: np.testing.assert_array_equal(bits(p), bits(q)), a, b)


@pytest.mark.parametrize("quantizer", [CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn),
                                       DelayedScaleQuantizer.create(jnp.float8_e4m3fn, amax_history_len=4)],
                         ids=["current", "delayed"])
def test_integer_dq_dtype_is_refused(quantizer):
    """dq_dtype is what dequantize() returns: an integer dtype would truncate the values."""
    with pytest.raises(TypeError, match="Quantizer.quantize: dq_dtype: expected float32, float16 or bfloat16"):
        quantizer.quantize(jnp.ones((4, 16), jnp.float32), dq_dtype=jnp.int32)
