"""lowbit.dense, layernorm_dense and layernorm_mlp with the block recipes (Float8BlockScaling,
MXFP8BlockScaling), under jit and grad: (1) forward and both backward GEMMs equal the products
of the quantizers' own dequantized copies (x . w, dy . w^T, x^T . dy) within fp32 summation
error, which pins every operand layout; (2) close to the unquantized model within the FP8
error stated below; (3) NVFP4 gradients need a key."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import cuda_gemm_calls

import lowbit
from lowbit.quantize import QuantizerFactory, ScalingMode
from lowbit.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from conftest import rel_err

RECIPES = [Float8BlockScaling, MXFP8BlockScaling]
U = 2.0**-24



def deq(t):
    return np.asarray(t.dequantize(), np.float64)


def assert_product(got, a, b):
    """got == a @ b within fp32 summation error (2*K*u*sum|p|) plus one fp32 rounding; on a
    GPU backend also the FP8 tensor cores' inner accumulation inside each 128-long block
    (about 14 bits: 4*sqrt(128)*2^-14*sum|p|, as tests/gemm_block_reference.py's block_tolerance),
    where the GEMM runs on cuBLASLt instead of the exact emulation."""
    exact = a @ b
    gamma = 2 * a.shape[1] * U + (0.0 if jax.default_backend() == "cpu" else 4 * np.sqrt(128) * 2.0**-14)
    bound = gamma * (np.abs(a) @ np.abs(b)) + U * np.abs(exact) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


@pytest.fixture
def data(rng):
    m, k, n = 70, 300, 136  # partial tiles in every dim
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = (rng.normal(size=(k, n)) / np.sqrt(k)).astype(np.float32)
    bias = rng.normal(size=(n,)).astype(np.float32)
    dy = rng.normal(size=(m, n)).astype(np.float32)
    return x, w, bias, dy


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_dense_gemms_are_products_of_the_dequantized_copies(recipe, data):
    x, w, bias, dy = data
    qs = QuantizerFactory.create_set(recipe())

    @jax.jit
    def fwd_bwd(x, w, bias, dy):
        y, vjp = jax.vjp(lambda x, w, b: lowbit.dense(x, w, b, quantizer_set=qs), x, w, bias)
        return y, *vjp(dy)

    y, dx, dw, dbias = fwd_bwd(x, w, bias, dy)
    both = dict(is_rowwise=True, is_colwise=True, flatten_axis=1)
    xq, _ = qs.x.quantize(x, **both)
    wq, _ = qs.kernel.quantize(w, **both)
    dyq, _ = qs.dgrad.quantize(dy, **both)
    assert_product(np.asarray(y) - bias, deq(xq.rowwise_tensor), deq(wq.colwise_tensor))
    assert_product(dx, deq(dyq.rowwise_tensor), deq(wq.rowwise_tensor).T)
    assert_product(dw, deq(xq.colwise_tensor).T, deq(dyq.colwise_tensor))
    # dbias: an fp32 sum of dy over the tokens, in any order.
    bound = 2 * dy.shape[0] * U * np.abs(dy).sum(0)
    assert np.all(np.abs(np.asarray(dbias, np.float64) - dy.astype(np.float64).sum(0)) <= bound)


# FP8 error allowed against the unquantized model, relative Frobenius: E4M3 rounds each value
# to within 2^-4 relative (uniform rounding error: RMS ~ 2^-4/sqrt(3) ~ 3.6%); a product of
# two rounded operands adds them in quadrature, ~5% RMS. E5M2 (the gradient) doubles its
# share: ~8%. Block scaling only makes the error smaller (no value is flushed to zero by a
# tensor-wide scale). Bounds: 8% forward, 12% for dx and dw.
FWD_TOL, BWD_TOL = 0.08, 0.12


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_dense_close_to_unquantized_under_jit_and_grad(recipe, data):
    x, w, bias, dy = data
    qs = QuantizerFactory.create_set(recipe())

    def loss(x, w, b, quantizer_set):
        return jnp.sum(lowbit.dense(x, w, b, quantizer_set=quantizer_set) * dy)

    grads_q = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, bias, qs)
    grads_ref = jax.grad(lambda x, w, b: jnp.sum((x @ w + b) * dy), argnums=(0, 1, 2))(x, w, bias)
    y_q = jax.jit(lambda x, w, b: lowbit.dense(x, w, b, quantizer_set=qs))(x, w, bias)
    assert rel_err(y_q, x @ w + bias) < FWD_TOL
    assert rel_err(grads_q[0], grads_ref[0]) < BWD_TOL
    assert rel_err(grads_q[1], grads_ref[1]) < BWD_TOL
    np.testing.assert_allclose(grads_q[2], grads_ref[2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_dense_multi_dim_and_bf16(recipe, rng):
    """Batched tokens, a 2-D kernel output, bf16 inputs and outputs."""
    x = jnp.asarray(rng.normal(size=(2, 33, 160)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(160, 3, 48)) / np.sqrt(160), jnp.bfloat16)
    qs = QuantizerFactory.create_set(recipe())
    f = jax.jit(lambda x, w: lowbit.dense(x, w, contracting_dims=((2,), (0,)), quantizer_set=qs))
    y = f(x, w)
    assert y.shape == (2, 33, 3, 48) and y.dtype == jnp.bfloat16
    ref = jnp.einsum("bsk,knh->bsnh", x.astype(jnp.float32), w.astype(jnp.float32))
    assert rel_err(y, ref) < FWD_TOL
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))(x, w)
    g_ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum("bsk,knh->bsnh", x, w) ** 2), argnums=(0, 1))(
        x.astype(jnp.float32), w.astype(jnp.float32))
    assert rel_err(g[0], g_ref[0]) < BWD_TOL and rel_err(g[1], g_ref[1]) < BWD_TOL


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_layernorm_dense_and_mlp_run_with_block_recipes(recipe, rng):
    h, f = 128, 256
    x = jnp.asarray(rng.normal(size=(2, 24, h)), jnp.float32)
    gamma = jnp.asarray(1 + 0.3 * rng.normal(size=(h,)), jnp.float32)  # not 1 and 0: a path that
    beta = jnp.asarray(0.3 * rng.normal(size=(h,)), jnp.float32)         # dropped them would pass
    wi = jnp.asarray(rng.normal(size=(h, f)) / np.sqrt(h), jnp.float32)
    wo = jnp.asarray(rng.normal(size=(f, h)) / np.sqrt(f), jnp.float32)
    qs = QuantizerFactory.create_set(recipe())
    qs2 = QuantizerFactory.create_set(recipe(), n_quantizer_sets=2)

    def ln(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * gamma + beta

    y = jax.jit(lambda x, w: lowbit.layernorm_dense(x, w, gamma, beta, quantizer_set=qs))(x, wi)
    assert rel_err(y, ln(x) @ wi) < FWD_TOL
    mlp = lambda x, wi, wo: lowbit.layernorm_mlp(x, gamma, beta, (wi, wo), quantizer_sets=qs2,  # noqa: E731
                                                 activation_type=("gelu",))
    out = jax.jit(mlp)(x, wi, wo)
    ref = jax.nn.gelu(ln(x) @ wi, approximate=False) @ wo
    assert rel_err(out, ref) < 2 * FWD_TOL  # two quantized GEMMs in a row
    g = jax.jit(jax.grad(lambda x, wi, wo: jnp.sum(mlp(x, wi, wo) ** 2), argnums=(0, 1, 2)))(x, wi, wo)
    g_ref = jax.grad(lambda x, wi, wo: jnp.sum((jax.nn.gelu(ln(x) @ wi, approximate=False) @ wo) ** 2),
                     argnums=(0, 1, 2))(x, wi, wo)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 2 * BWD_TOL


# The CUDA programs (lowered for compute capability 9.0 without a GPU): every FP8 block GEMM
# of the forward and backward is one cuBLASLt call, modes (a, b): forward x 1x128 . kernel
# 128x128, dgrad dy 1x128 . kernel 128x128, wgrad x^T 1x128 . dy^T 1x128.
FWD, DGRAD, WGRAD = (1, 2), (1, 2), (1, 1)


def _ln_model_inputs():
    rng = np.random.default_rng(11)
    h, f = 128, 200
    x = jnp.asarray(rng.normal(size=(2, 9, h)), jnp.bfloat16)
    wi = jnp.asarray(rng.normal(size=(h, f)) / np.sqrt(h), jnp.bfloat16)
    wo = jnp.asarray(rng.normal(size=(f, h)) / np.sqrt(f), jnp.bfloat16)
    return x, wi, wo, jnp.ones((h,), jnp.bfloat16), jnp.zeros((h,), jnp.bfloat16)


def _grad_program(fn, n_args):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), argnums=tuple(range(n_args)))


def test_cuda_lowering_of_block_dense_fwd_and_bwd(data, monkeypatch):
    x, w, bias, _ = data
    qs = QuantizerFactory.create_set(Float8BlockScaling())
    dense = lambda x, w, b: lowbit.dense(x, w, b, quantizer_set=qs)  # noqa: E731
    calls = cuda_gemm_calls(monkeypatch, dense, x, w, bias)
    assert [(c.a_scale_mode, c.b_scale_mode) for c in calls] == [FWD]
    assert calls[0].operand_types[:2] == ["80x304xf8E4M3FN", "144x304xf8E4M3FN"]  # 70, 136, 300 padded
    calls = cuda_gemm_calls(monkeypatch, _grad_program(dense, 3), x, w, bias)
    assert sorted((c.a_scale_mode, c.b_scale_mode) for c in calls) == sorted([FWD, DGRAD, WGRAD])
    # Block scaling has no fast accumulation (lowbit.ops.gemm): the forward's False is dropped.
    assert all(c.use_split_accumulator for c in calls)


def test_cuda_lowering_of_block_layernorm_dense_and_mlp(monkeypatch):
    x, wi, wo, gamma, beta = _ln_model_inputs()
    qs = QuantizerFactory.create_set(Float8BlockScaling())
    qs2 = QuantizerFactory.create_set(Float8BlockScaling(), n_quantizer_sets=2)
    ln_dense = lambda x, w: lowbit.layernorm_dense(x, w, gamma, beta, quantizer_set=qs)  # noqa: E731
    mlp = lambda x, wi, wo: lowbit.layernorm_mlp(x, gamma, beta, (wi, wo), quantizer_sets=qs2,  # noqa: E731
                                                 activation_type=("gelu",))
    modes = lambda calls: sorted((c.a_scale_mode, c.b_scale_mode) for c in calls)  # noqa: E731
    assert modes(cuda_gemm_calls(monkeypatch, ln_dense, x, wi)) == [FWD]
    assert modes(cuda_gemm_calls(monkeypatch, _grad_program(ln_dense, 2), x, wi)) == sorted([FWD, DGRAD, WGRAD])
    assert modes(cuda_gemm_calls(monkeypatch, mlp, x, wi, wo)) == [FWD, FWD]
    assert modes(cuda_gemm_calls(monkeypatch, _grad_program(mlp, 3), x, wi, wo)) == sorted(
        [FWD, DGRAD, WGRAD] * 2)


def test_cuda_lowering_of_mxfp8_dense_is_the_emulation(data, monkeypatch):
    """MXFP8 has no Hopper GEMM: the CUDA program lowers, with no lowbit_gemm in it."""
    x, w, bias, _ = data
    qs = QuantizerFactory.create_set(MXFP8BlockScaling())
    dense = lambda x, w, b: lowbit.dense(x, w, b, quantizer_set=qs)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        assert cuda_gemm_calls(monkeypatch, _grad_program(dense, 3), x, w, bias) == []


def test_nvfp4_dense_needs_a_key_for_its_gradients():
    """NVFP4 runs (tests/test_dense_nvfp4.py); its SR gradient quantizer refuses to run keyless."""
    qs = QuantizerFactory.create_set(NVFP4BlockScaling())
    with pytest.raises(ValueError, match="stochastic rounding needs a PRNG key"):
        jax.grad(lambda x: jnp.sum(lowbit.dense(x, jnp.ones((32, 32)), quantizer_set=qs)))(jnp.ones((4, 32)))


# TE's Float8BlockScaling tile choices (x, w, grad block_scaling_dim: 1 = 1x128, 2 = 128x128):
# the four TE accepts, and (2, 2, 1), which TE refuses and lowbit runs with its forward GEMM
# (2-D by 2-D) emulated.
BLOCK_DIMS = [(1, 2, 1), (1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1)]


def _block_recipe(dims):
    x, w, g = dims
    return Float8BlockScaling(x_block_scaling_dim=x, w_block_scaling_dim=w, grad_block_scaling_dim=g)


@pytest.mark.parametrize("dims", BLOCK_DIMS, ids=str)
def test_dense_block_dims_are_products_of_the_dequantized_copies(dims, data):
    """Every tile choice: each operand's copies are in the tiles the recipe names, and the
    three GEMMs equal the products of those copies (each is read in its own tiles)."""
    x, w, bias, dy = data
    qs = QuantizerFactory.create_set(_block_recipe(dims))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice for 2-D by 2-D
        y, vjp = jax.vjp(jax.jit(lambda x, w, b: lowbit.dense(x, w, b, quantizer_set=qs)), x, w, bias)
        dx, dw, _ = vjp(dy)
    both = dict(is_rowwise=True, is_colwise=True, flatten_axis=1)
    xq, _ = qs.x.quantize(x, **both)
    wq, _ = qs.kernel.quantize(w, **both)
    dyq, _ = qs.dgrad.quantize(dy, **both)
    tiles = {1: ScalingMode.FP8_BLOCK_1x128, 2: ScalingMode.FP8_BLOCK_128x128}
    for t, dim in ((xq, dims[0]), (wq, dims[1]), (dyq, dims[2])):
        assert t.rowwise_tensor.scaling_mode == t.colwise_tensor.scaling_mode == tiles[dim]
    assert_product(np.asarray(y) - bias, deq(xq.rowwise_tensor), deq(wq.colwise_tensor))
    assert_product(dx, deq(dyq.rowwise_tensor), deq(wq.rowwise_tensor).T)
    assert_product(dw, deq(xq.colwise_tensor).T, deq(dyq.colwise_tensor))


@pytest.mark.parametrize("dims", BLOCK_DIMS, ids=str)
def test_cuda_lowering_of_block_dims(dims, data, monkeypatch):
    """Each GEMM's (a, b) scale modes follow the tiles: forward (x, w), dgrad (grad, w),
    wgrad (x, grad); a 2-D by 2-D pair is no cuBLASLt call (the exact emulation)."""
    x, w, bias, _ = data
    qs = QuantizerFactory.create_set(_block_recipe(dims))
    dense = lambda x, w, b: lowbit.dense(x, w, b, quantizer_set=qs)  # noqa: E731
    xd, wd, gd = dims
    want = [p for p in ((xd, wd), (gd, wd), (xd, gd)) if p != (2, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = cuda_gemm_calls(monkeypatch, _grad_program(dense, 3), x, w, bias)
    assert sorted((c.a_scale_mode, c.b_scale_mode) for c in calls) == sorted(want)


def test_te_blockwise_example_ports():
    """TransformerEngine's Float8BlockScaling example for JAX (its docs' blockwise-scaling
    page), imports changed, at a smaller size: the recipe's TE fields, autocast and
    DenseGeneral. Its gradients are those of lowbit.dense with the same recipe's quantizer set
    (bit for bit: the module adds nothing), and close to the unquantized layer's."""
    import lowbit as te
    from lowbit.flax import DenseGeneral
    from lowbit.recipe import Format

    recipe = Float8BlockScaling(
        fp8_format=Format.E4M3,
        x_block_scaling_dim=1,
        w_block_scaling_dim=2,
        grad_block_scaling_dim=1,
    )
    key = jax.random.PRNGKey(0)
    with te.autocast(enabled=True, recipe=recipe):
        layer = DenseGeneral(features=256)
        x = jax.random.normal(key, (4, 32, 160), dtype=jnp.bfloat16)
        params = layer.init(key, x)
        params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(3), p.shape), params)

        def loss_fn(params):
            output = layer.apply(params, x)
            return output.sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
    from flax.core.meta import unbox

    params, grads = unbox(params), unbox(grads)  # the modules' params carry their logical axes
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    qs = QuantizerFactory.create_set(recipe)
    want = jax.grad(lambda k, b: lowbit.dense(x, k, b, contracting_dims=((2,), (0,)),
                                              quantizer_set=qs).sum(), argnums=(0, 1))(kernel, bias)
    for got, w in zip((grads["params"]["kernel"], grads["params"]["bias"]), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    ref = jax.grad(lambda k, b: (x.astype(jnp.float32) @ k + b).sum(), argnums=(0, 1))(kernel, bias)
    assert rel_err(grads["params"]["kernel"], ref[0]) < BWD_TOL
    np.testing.assert_allclose(grads["params"]["bias"], ref[1], rtol=1e-6)
    assert np.isfinite(float(loss))
