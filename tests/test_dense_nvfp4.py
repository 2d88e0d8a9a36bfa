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


# ---------------------------------------------------------------- the packed GEMM path
#
# dense's NVFP4 GEMMs, the wgrad of the RHT copies included (x's and dy's colwise copies
# share one sign vector), go through lowbit.ops.gemm_nvfp4.nvfp4_gemm (lowbit_gemm_nvfp4, cuBLASLt
# on 10.x) on the stored values. Off 10.x nvfp4_gemm lowers to the jnp emulation
# (nvfp4_emulation_lowering), which must give the bits of `_stored_values_gemm` below (the
# stored E2M1 codes times their e4m3 scales times the global scale_inv, an fp32 HIGHEST dot:
# the RHT copies NOT transformed back). Before the packed path every GEMM was
# emulated_nvfp4_gemm on the dequantized copies, the transform undone (`_old_nvfp4_gemm`):
# the C++ handler's k-order sums equal it within fp32 rounding (for the RHT wgrad because
# T^T T = I with one sign vector).

import importlib  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

from jax.interpreters import mlir  # noqa: E402

dense_mod = importlib.import_module("lowbit.dense")
gemm_mod = importlib.import_module("lowbit.ops.gemm")
nvfp4_mod = importlib.import_module("lowbit.ops.gemm_nvfp4")
ffi_mod = importlib.import_module("lowbit._ffi")

RECIPES = {
    "full": NVFP4BlockScaling(),  # RHT, SR, 2-D weight tiles: all three packed
    "sr_no_rht": NVFP4BlockScaling(disable_rht=True),  # all three packed, SR on dy
    "plain": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                               disable_2d_quantization=True),
}
PROBLEMS = {  # x shape, kernel shape, contracting dims
    "3d": ((2, 21, 48), (48, 40), ((2,), (0,))),
    "2k2n": ((3, 4, 16, 8), (16, 8, 5, 6), ((2, 3), (0, 1))),  # two contracted, two N dims
    "odd": ((33, 70), (70, 17), ((1,), (0,))),  # odd K: a partial 16-block, odd packed nibble
}


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def stored_values(t):
    """A copy's stored (rows, K) values in fp32, (e2m1 * e4m3) * global_scale_inv, an RHT
    copy left transformed."""
    rows, k = t.data.shape[0], math.prod(dense_mod._nvfp4_dims(t)[1])
    codes = jnp.stack([t.data & 15, t.data >> 4], axis=-1).reshape(rows, -1)[:, :k].astype(jnp.int32)
    scales = jnp.repeat(t.scale_inv.astype(jnp.float32)[:rows, :-(-k // 16)], 16, axis=1)[:, :k]
    return jnp.asarray(_E2M1)[codes] * scales * t.global_scale_inv.reshape(())


def _stored_values_gemm(a, b, bias, out_dtype, contracting_ndim):
    """The jnp reference of dense's packed NVFP4 GEMM: stored values, fp32 HIGHEST dot, bias in fp32."""
    acc = jnp.dot(stored_values(a), stored_values(b).T, precision="highest", preferred_element_type=jnp.float32)
    if bias is not None:
        acc = acc + bias.reshape(-1).astype(jnp.float32)
    (a_free, _), (b_free, _) = dense_mod._nvfp4_dims(a), dense_mod._nvfp4_dims(b)
    return acc.astype(out_dtype).reshape(*a_free, *b_free)


def _old_nvfp4_gemm(a, b, bias, out_dtype, contracting_ndim):
    """dense's NVFP4 GEMM before the packed path (every GEMM dequantized and emulated)."""
    return nvfp4_mod.emulated_nvfp4_gemm(dense_mod._nvfp4_operand(a), dense_mod._nvfp4_operand(b), bias,
                                        out_dtype=out_dtype, contracting_ndim=contracting_ndim)


def _fwd_bwd(recipe, problem, seed=0):
    """y and (dx, dw, dbias) of dense under `recipe`, jitted afresh (a new trace each call)."""
    xs, ks, dims = PROBLEMS[problem]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
    kern = jnp.asarray(rng.standard_normal(ks) / 5, jnp.float32)
    n_free = ks[len(dims[1]):]
    b = jnp.asarray(rng.standard_normal(n_free), jnp.float32)
    ct = jnp.asarray(rng.standard_normal(xs[:len(xs) - len(dims[0])] + n_free), jnp.float32)
    qs = QuantizerFactory.create_set(RECIPES[recipe])
    key = jax.random.PRNGKey(11)

    def run(x, kern, b):
        y, vjp = jax.vjp(lambda x, k, b: dense(x, k, b, dims, qs, sr_key=key), x, kern, b)
        return y, vjp(ct)

    return jax.tree.map(np.asarray, jax.jit(run)(x, kern, b))


@pytest.fixture
def jnp_emulation():
    """gemm_nvfp4_p lowered on the CPU as the CUDA lowering does off 10.x (Hopper)."""
    mlir.register_lowering(nvfp4_mod.gemm_nvfp4_p, nvfp4_mod.nvfp4_emulation_lowering, platform="cpu")
    yield
    mlir.register_lowering(nvfp4_mod.gemm_nvfp4_p, nvfp4_mod._nvfp4_cpu_lowering, platform="cpu")


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_packed_path_gives_the_stored_values_bits_where_nvfp4_gemm_emulates(recipe, problem, monkeypatch,
                                                                            jnp_emulation):
    """y, dx, dw, dbias bit for bit those of _stored_values_gemm (for copies without RHT, the
    old path's bits: nothing to undo)."""
    new = _fwd_bwd(recipe, problem)
    with monkeypatch.context() as mp:
        mp.setattr(dense_mod, "_nvfp4_gemm", _stored_values_gemm)
        ref = _fwd_bwd(recipe, problem)
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
        assert np.abs(want).max() > 0
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("recipe", ["full", "plain"])
def test_packed_path_on_the_cpu_handler_is_the_old_path_reordered(recipe, problem, monkeypatch):
    """The C++ handler sums in k order, XLA's dot in its own: equal within fp32 reordering
    (K terms of at most |a||b| each, so K * 2^-23 of the largest output bounds it loosely, K the
    longest contraction of the three GEMMs, at least 100; measured at most 3.7 * 2^-23);
    the full recipe's wgrad also within the old path's fp32 rounding of T (T^T T = I)."""
    new = _fwd_bwd(recipe, problem, seed=1)
    with monkeypatch.context() as mp:
        mp.setattr(dense_mod, "_nvfp4_gemm", _old_nvfp4_gemm)
        old = _fwd_bwd(recipe, problem, seed=1)
    x_shape, k_shape, (x_dims, k_dims) = PROBLEMS[problem]
    k_len = int(np.prod([x_shape[d] for d in x_dims]))                     # forward's contraction
    m_len = int(np.prod(x_shape)) // k_len                                 # wgrad's
    n_len = int(np.prod(k_shape)) // int(np.prod([k_shape[d] for d in k_dims]))  # dgrad's
    terms = max(k_len, m_len, n_len, 100)  # the longest of the three GEMMs' sums, at least 100
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        assert np.abs(want).max() > 0
        assert np.all(np.abs(got - want) <= terms * 2.0**-23 * np.abs(want).max())


def _nvfp4_calls(monkeypatch, recipe, capability):
    """The lowbit_gemm_nvfp4 custom calls in dense's fwd + bwd lowered for CUDA on `capability`."""
    monkeypatch.setattr(gemm_mod, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(ffi_mod, "require_platform", lambda op, platform: None)
    x, k, b = _problem()
    qs = QuantizerFactory.create_set(RECIPES[recipe])
    loss = lambda x, k, b: jnp.sum(dense(x, k, b, ((2,), (0,)), qs, sr_key=jax.random.PRNGKey(0)) ** 2)  # noqa: E731
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = f.trace(x, k, b).lower(lowering_platforms=("cuda",)).as_text()
    return len(re.findall(r"custom_call @lowbit_gemm_nvfp4\(", text))


@pytest.mark.parametrize("recipe,calls", [("full", 3), ("sr_no_rht", 3), ("plain", 3)])
def test_sm100_lowering_runs_the_gemms_on_cublaslt(recipe, calls, monkeypatch):
    """On 10.x: fwd, dgrad and wgrad (RHT or not) are lowbit_gemm_nvfp4 calls; off it none."""
    assert _nvfp4_calls(monkeypatch, recipe, "10.0") == calls
    assert _nvfp4_calls(monkeypatch, recipe, "9.0") == 0


def test_jaxpr_holds_gemm_nvfp4():
    x, k, b = _problem()
    qs = QuantizerFactory.create_set(RECIPES["full"])
    loss = lambda x, k, b: jnp.sum(dense(x, k, b, ((2,), (0,)), qs, sr_key=jax.random.PRNGKey(0)) ** 2)  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, k, b))
    assert text.count("gemm_nvfp4[") == 3, text.count("gemm_nvfp4[")  # fwd, dgrad, wgrad


@pytest.mark.parametrize("recipe", ["full", "plain"])
def test_dense_under_vmap_and_on_a_mesh(recipe, rng):
    """vmap over dense equals the per-element calls, and fwd + bwd with x rows-, kernel N- or
    K-sharded on 2 devices equal the single-device bits (the NVFP4 quantizer gathers its
    input, so every GEMM sees replicated copies here)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    x = jnp.asarray(rng.standard_normal((2, 32, 128)), jnp.float32)
    kern = jnp.asarray(rng.standard_normal((128, 64)) / 11, jnp.float32)
    b = jnp.asarray(rng.standard_normal(64), jnp.float32)
    qs, key = QuantizerFactory.create_set(RECIPES[recipe]), jax.random.PRNGKey(3)
    one = lambda x: dense(x, kern, b, ((1,), (0,)), qs, sr_key=key)  # noqa: E731
    loop = np.stack([np.asarray(jax.jit(one)(x[i])) for i in range(2)])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(one))(x)), loop)
    f = jax.jit(jax.value_and_grad(lambda x, k: jnp.sum(jnp.sin(dense(x, k, b, ((2,), (0,)), qs, sr_key=key))),
                                   argnums=(0, 1)))
    cpu = jax.devices("cpu")
    with jax.default_device(cpu[0]):  # the mesh is of CPU devices: the reference too
        want = jax.tree.leaves(f(x, kern))
    mesh = Mesh(np.array(cpu[:2]), ("d",))
    for xs, ks in ((P("d"), P()), (P(), P(None, "d")), (P(None, None, "d"), P("d", None))):
        got = jax.tree.leaves(f(jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(kern, NamedSharding(mesh, ks))))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
