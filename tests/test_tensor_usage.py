"""TE's tensor interface on lowbit's quantized tensors: TensorUsage picks the copy a GEMM
takes (LHS / RHS_TRANS the rowwise copy, LHS_TRANS / RHS the colwise one, for every scaling
mode), ScaledTensor1x.get_tensor refuses the wrong usage, and NoScaleTensor wraps a
high-precision array as TE 2.12's cpp_extensions return it (pytree, jit, dequantize is the
data, get_tensor is itself, checkpoint takes no quantizer, sharding by logical axes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.quantize import (NoScaleTensor, QuantizerFactory, ScaledTensor2x, ScalingMode,
                             TensorUsage)

MODES = [ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING,
         ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_BLOCK_1x128]
ROWWISE_USAGES = [TensorUsage.LHS, TensorUsage.RHS_TRANS]
COLWISE_USAGES = [TensorUsage.LHS_TRANS, TensorUsage.RHS]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_get_tensor_by_usage(mode, rng):
    x = jnp.asarray(rng.standard_normal((64, 160)), jnp.bfloat16)
    both, _ = QuantizerFactory.create(mode, jnp.float8_e4m3fn).quantize(x, is_rowwise=True, is_colwise=True)
    assert isinstance(both, ScaledTensor2x) and both.ndim == 2
    for usage in ROWWISE_USAGES:
        assert both.get_tensor(usage) is both.rowwise_tensor
        assert both.rowwise_tensor.get_tensor(usage) is both.rowwise_tensor
        with pytest.raises(ValueError, match=f"get_tensor: usage: {usage}.*rowwise copy"):
            both.colwise_tensor.get_tensor(usage)
    for usage in COLWISE_USAGES:
        assert both.get_tensor(usage) is both.colwise_tensor
        assert both.colwise_tensor.get_tensor(usage) is both.colwise_tensor
        with pytest.raises(ValueError, match=f"get_tensor: usage: {usage}.*colwise copy"):
            both.rowwise_tensor.get_tensor(usage)
    # lowbit's own spelling still works, positionally too; TE's accessors
    assert both.get_tensor(colwise=True) is both.colwise_tensor
    assert both.get_tensor(False) is both.rowwise_tensor
    assert both.get_rowwise_tensor() is both.rowwise_tensor
    assert both.get_colwise_tensor() is both.colwise_tensor


def test_get_tensor_bad_arguments(rng):
    x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
    both, _ = QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn).quantize(
        x, is_rowwise=True, is_colwise=True)
    with pytest.raises(TypeError, match="get_tensor: usage: expected a lowbit.quantize.TensorUsage"):
        both.get_tensor("LHS")
    with pytest.raises(TypeError, match="not both or neither"):
        both.get_tensor(TensorUsage.LHS, colwise=True)
    with pytest.raises(TypeError, match="not both or neither"):
        both.get_tensor()
    with pytest.raises(TypeError, match="get_tensor: usage"):
        both.rowwise_tensor.get_tensor(0)


def test_no_scale_tensor(rng):
    data = jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16)
    amax = jnp.max(jnp.abs(data)).astype(jnp.float32).reshape(1)
    t = NoScaleTensor(data, amax)
    assert (t.ndim, t.shape, t.dtype) == (2, (5, 7), jnp.bfloat16)
    assert t.dequantize() is data
    for usage in TensorUsage:
        assert t.get_tensor(usage) is t
    assert t.checkpoint(None) is t
    with pytest.raises(ValueError, match="NoScaleTensor.checkpoint: quantizer: expected None"):
        t.checkpoint(QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn))
    assert t.apply_sharding_constraint_by_logical_axes(()) is t
    # JAX rebuilds the pytree with other leaves: vmap's in_axes, tree.map, eval_shape
    ndims = jax.tree.map(lambda leaf: leaf.ndim, t)
    assert isinstance(ndims, NoScaleTensor) and (ndims.data, ndims.amax) == (2, 1)
    shapes = jax.eval_shape(lambda t: NoScaleTensor(t.data * 2, t.amax), t)
    assert shapes.data.shape == (5, 7) and shapes.amax.shape == (1,)
    batched = jax.vmap(lambda t: t.data.sum(), in_axes=(NoScaleTensor(0, None),))(t)
    assert batched.shape == (5,)

    # a pytree: leaves data and amax (None is an empty subtree), through jit and grad
    leaves = jax.tree.leaves(t)
    assert len(leaves) == 2 and leaves[0] is data and leaves[1] is amax
    assert jax.tree.leaves(NoScaleTensor(data)) == [data]
    doubled = jax.jit(lambda t: NoScaleTensor(t.data * 2, t.amax))(t)
    assert isinstance(doubled, NoScaleTensor)
    np.testing.assert_array_equal(np.asarray(doubled.data, np.float32), 2 * np.asarray(data, np.float32))
    grad = jax.grad(lambda t: jnp.sum(t.data.astype(jnp.float32) ** 2))(NoScaleTensor(data.astype(jnp.float32)))
    np.testing.assert_allclose(grad.data, 2 * np.asarray(data, np.float32), rtol=1e-6)


def test_no_scale_tensor_sharding_by_logical_axes(rng):
    """apply_sharding_constraint_by_logical_axes constrains the data, keeps the amax."""
    from lowbit.sharding import MeshResource, global_shard_guard

    devices = np.array(jax.devices()[:1])
    mesh = jax.sharding.Mesh(devices, ("data",))
    data = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    amax = jnp.ones((1,), jnp.float32)
    f = jax.jit(lambda t: t.apply_sharding_constraint_by_logical_axes(("batch", "embed")))
    with mesh, global_shard_guard(MeshResource(dp_resource="data")):
        out = f(NoScaleTensor(data, amax))
        lowered = f.lower(NoScaleTensor(data, amax)).as_text()
    assert "sharding_constraint" in lowered and '"data"' in lowered, lowered
    assert isinstance(out, NoScaleTensor)
    np.testing.assert_array_equal(out.data, data)
    np.testing.assert_array_equal(out.amax, amax)
    with pytest.raises(ValueError, match="logical_axis_names: expected one name"):
        NoScaleTensor(data).apply_sharding_constraint_by_logical_axes(("batch",))


@pytest.mark.parametrize("mode", list(ScalingMode), ids=lambda m: m.name)
def test_scaling_mode_te_queries(mode):
    """TE's ScalingMode queries: get_quantize_layout agrees with get_tensor's choice,
    get_data_layout with the stored copies, get_scale_dtype with scale_dtype."""
    from lowbit.quantize import QuantizeLayout

    assert mode.is_colwise_transposed == mode.colwise_is_transposed
    assert mode.get_data_layout() == ("NT" if mode.colwise_is_transposed else "NN")
    assert mode.get_scale_dtype() == (mode.scale_dtype or jnp.float32)
    for usage in TensorUsage:
        want = (QuantizeLayout.COLWISE if usage.takes_colwise and mode != ScalingMode.NO_SCALING
                else QuantizeLayout.ROWWISE)
        assert mode.get_quantize_layout(usage) == want
    with pytest.raises(TypeError, match="get_quantize_layout: usage"):
        mode.get_quantize_layout("LHS")
