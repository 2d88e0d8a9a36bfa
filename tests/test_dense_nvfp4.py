"""NVFP4 through lowbit.dense: forward and backward within a stated tolerance of the
unquantized model, the SR key path (sr_key) and its errors, and the quantizer's ScaledTensors.

Tolerance: NVFP4 rounds each value to 1 of 8 magnitudes per 16-value block (relative error
up to 1/12 of the block amax at the top binade, E4M3 scales add 2^-4); on Gaussian data a
GEMM of two such operands lands within ~10% in relative Frobenius norm; we assert 0.2."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.dense import dense
from lowbit.quantize import NVFP4Quantizer, QuantizerFactory, ScaledTensor2x, ScalingMode
from lowbit.recipe import NVFP4BlockScaling
from conftest import rel_err

warnings.filterwarnings("ignore", message="lowbit.ops.gemm: NVFP4")



def _problem(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 21, 48)), jnp.float32)  # M = 42: odd groups of 16
    k = jnp.asarray(rng.standard_normal((48, 40)) / 7, jnp.float32)
    b = jnp.asarray(rng.standard_normal(40), jnp.float32)
    return x, k, b


@pytest.mark.parametrize("recipe", [NVFP4BlockScaling(), NVFP4BlockScaling(disable_rht=True,
                         disable_stochastic_rounding=True, disable_2d_quantization=True)],
                         ids=["full", "plain"])
def test_dense_fwd_bwd_close_to_unquantized(recipe):
    tol = 0.2 if recipe.disable_stochastic_rounding else 0.3  # SR: up to 2x the RNE variance
    x, k, b = _problem()
    qs = QuantizerFactory.create_set(recipe)
    key = jax.random.PRNGKey(4)
    loss = lambda x, k, b: jnp.sum(jnp.sin(dense(x, k, b, contracting_dims=((2,), (0,)), quantizer_set=qs,  # noqa: E731
                                                 sr_key=key)))
    ref = lambda x, k, b: jnp.sum(jnp.sin(jnp.einsum("bmk,kn->bmn", x, k, precision="highest") + b))  # noqa: E731
    y = dense(x, k, b, contracting_dims=((2,), (0,)), quantizer_set=qs, sr_key=key)
    assert rel_err(y, jnp.einsum("bmk,kn->bmn", x, k, precision="highest") + b) < 0.2
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, k, b)
    want = jax.grad(ref, argnums=(0, 1, 2))(x, k, b)
    for g, w in zip(got, want):
        assert 0 < rel_err(g, w) < tol


def test_sr_key_changes_gradients_and_is_required():
    x, k, b = _problem(1)
    qs = QuantizerFactory.create_set(NVFP4BlockScaling())
    grad = jax.jit(jax.grad(lambda x, key: jnp.sum(dense(x, k, b, ((2,), (0,)), qs, sr_key=key) ** 2)))
    g0, g0_again, g1 = grad(x, jax.random.PRNGKey(0)), grad(x, jax.random.PRNGKey(0)), grad(x, jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g0_again))
    assert not np.array_equal(np.asarray(g0), np.asarray(g1))
    with pytest.raises(ValueError, match="stochastic rounding needs a PRNG key"):
        jax.grad(lambda x: jnp.sum(dense(x, k, b, ((2,), (0,)), qs)))(x)


def test_quantizer_makes_scaled_tensors_that_dequantize():
    x, _, _ = _problem(2)
    q = NVFP4Quantizer(mode=ScalingMode.NVFP4_2D_SCALING, use_rht=True, key=jax.random.PRNGKey(0))
    t, dbias = q.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=2, compute_dbias=True)
    assert isinstance(t, ScaledTensor2x) and t.shape == x.shape
    assert t.rowwise_tensor.data.dtype == jnp.uint8 and t.colwise_tensor.data.shape == (48, 21)
    for part in (t.rowwise_tensor, t.colwise_tensor):
        assert part.dequantize().shape == x.shape and rel_err(part.dequantize(), x) < 0.15
    np.testing.assert_allclose(np.asarray(dbias), np.asarray(x.sum(axis=(0, 1))), rtol=1e-5, atol=1e-5)
    jax.jit(lambda t: t.dequantize())(t)  # a pytree through jit


def test_flax_dense_general_takes_its_key_from_the_sr_rng_stream():
    from flax import linen as nn

    from lowbit.flax import DenseGeneral

    x, _, _ = _problem(3)
    layer = DenseGeneral(24, quantization_recipe=NVFP4BlockScaling())
    variables = nn.meta.unbox(layer.init(jax.random.PRNGKey(0), x))

    def loss(v, key):
        return jnp.sum(layer.apply(v, x, rngs={"sr_rng": key}) ** 2)

    grad = jax.jit(jax.grad(loss))
    g0, g1 = grad(variables, jax.random.PRNGKey(1)), grad(variables, jax.random.PRNGKey(2))
    k0, k1 = g0["params"]["kernel"], g1["params"]["kernel"]
    assert not np.array_equal(np.asarray(k0), np.asarray(k1))  # the stream drives SR
    np.testing.assert_array_equal(np.asarray(k0), np.asarray(grad(variables, jax.random.PRNGKey(1))["params"]["kernel"]))
    with pytest.raises(ValueError, match="sr_rng"):
        jax.grad(lambda v: jnp.sum(layer.apply(v, x) ** 2))(variables)
