"""lowbit.flax Linen modules against plain-Flax equivalents with the same parameters.

No recipe: lowbit's modules compute what nn.LayerNorm / nn.RMSNorm / nn.DenseGeneral /
nn.gelu compose to, up to fp32 rounding (the norm runs in lowbit's C++ reference: 1e-5).
With a recipe the GEMM operands are FP8 (E4M3 rounding: 2^-4 relative per operand); we
allow 8% of the output's norm (relative Frobenius error), after one delayed-scaling update
for DelayedScaling (its first step casts with scale 1). Small shapes: the file runs in
seconds on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import lowbit
from lowbit.flax import OVERWRITE_WITH_GRADIENT
from lowbit.flax.module import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP, Softmax
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling
from conftest import rel_err

FP8_TOL = 0.08
B, T, H, F = 2, 8, 32, 64
OWG = OVERWRITE_WITH_GRADIENT



def x_in(seed=0, shape=(B, T, H)):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def init(module, x, **kw):
    rngs = {"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)}
    return nn.meta.unbox(jax.jit(functools.partial(module.init, **kw))(rngs, x))


def shapes(module, x, **kw):
    """Parameter shapes, from an abstract init (nothing runs)."""
    rngs = {"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)}
    abstract = nn.meta.unbox(jax.eval_shape(functools.partial(module.init, **kw), rngs, x))
    return jax.tree.map(lambda a: a.shape, abstract["params"])


def run(module, variables, x, **kw):
    """module.apply under jit (one compile instead of one per op: faster on the CPU)."""
    return jax.jit(functools.partial(module.apply, **kw))(variables, x)


def output(out):
    return out[0] if isinstance(out, tuple) else out


def one_update(module, variables, x, **kw):
    """Variables after one training step's overwrite-with-gradient of the quantizer state."""
    grads = jax.jit(jax.grad(lambda v: jnp.sum(output(module.apply(v, x, **kw)) ** 2)))(variables)
    return {**variables, OWG: grads[OWG]}


class RefMLP(nn.Module):
    """Plain Flax: LayerNorm -> DenseGeneral (H, n_act, F) -> activations -> DenseGeneral."""

    ffn: int
    acts: tuple
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        ln = nn.LayerNorm(epsilon=1e-6, name="ln")(x)
        h = nn.DenseGeneral((len(self.acts), self.ffn), use_bias=self.use_bias, name="wi")(ln)
        fns = {"gelu": nn.gelu, "silu": nn.silu, "relu": nn.relu, "linear": lambda v: v}
        a = fns[self.acts[0]](h[..., 0, :])
        for i, name in enumerate(self.acts[1:], 1):
            a = a * fns[name](h[..., i, :])
        return nn.Dense(x.shape[-1], use_bias=self.use_bias, name="wo")(a)


def mlp_ref_params(p, use_bias=True):
    ref = {"ln": {"scale": p["scale"], "bias": p["ln_bias"]},
           "wi": {"kernel": p["wi_kernel"]}, "wo": {"kernel": p["wo_kernel"]}}
    if use_bias:
        ref["wi"]["bias"], ref["wo"]["bias"] = p["wi_bias"], p["wo_bias"]
    return {"params": ref}


def _cases():
    """(lowbit module, plain-Flax module, params -> plain-Flax variables)."""
    return {
        "dense": (DenseGeneral(16, use_bias=True, bias_init=nn.initializers.normal(1.0)),
                  nn.DenseGeneral(16), lambda p: {"params": p}),
        "dense_2axes": (DenseGeneral((4, 4), axis=(-2, -1)), nn.DenseGeneral((4, 4), axis=(-2, -1)),
                        lambda p: {"params": p}),
        "layernorm": (LayerNorm(bias_init=nn.initializers.normal(1.0)),
                      nn.LayerNorm(epsilon=1e-6),
                      lambda p: {"params": {"scale": p["scale"], "bias": p["ln_bias"]}}),
        "rmsnorm": (LayerNorm(layernorm_type="rmsnorm", scale_init=nn.initializers.normal(1.0)),
                    nn.RMSNorm(epsilon=1e-6), lambda p: {"params": p}),
        "ln_dense": (LayerNormDenseGeneral(24, use_bias=True, return_layernorm_output=False),
                     nn.Sequential([nn.LayerNorm(epsilon=1e-6), nn.DenseGeneral(24)]),
                     lambda p: {"params": {"layers_0": {"scale": p["scale"], "bias": p["ln_bias"]},
                                           "layers_1": {"kernel": p["kernel"], "bias": p["bias"]}}}),
        "mlp_fused": (LayerNormMLP(F, activations=("gelu", "linear"), use_bias=True,
                                   return_layernorm_output=False, intermediate_dropout_rate=0.0),
                      RefMLP(F, ("gelu", "linear")), mlp_ref_params),
        "mlp_composed": (LayerNormMLP(F, activations=("silu",), use_bias=True),
                         RefMLP(F, ("silu",)), mlp_ref_params),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_no_recipe_matches_plain_flax(name):
    module, ref, to_ref = CASES[name]
    x = x_in(shape=(B, T, 2, H // 2)) if name == "dense_2axes" else x_in()
    kw = {"deterministic": True} if name.startswith("mlp") else {}
    v = init(module, x, **kw)
    y = output(run(module, v, x, **kw))
    y_ref = ref.apply(to_ref(v["params"]), x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["dense", "rmsnorm", "ln_dense", "mlp_fused", "mlp_composed"])
def test_no_recipe_gradients_match_plain_flax(name):
    module, ref, to_ref = CASES[name]
    x = x_in()
    kw = {"deterministic": True} if name.startswith("mlp") else {}
    v = init(module, x, **kw)
    ct = x_in(7, output(run(module, v, x, **kw)).shape)
    loss = lambda p, x: jnp.sum(output(module.apply({"params": p}, x, **kw)) * ct)  # noqa: E731
    loss_ref = lambda p, x: jnp.sum(ref.apply(to_ref(p), x) * ct)  # noqa: E731
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(v["params"], x)
    g_ref = jax.grad(loss_ref, argnums=(0, 1))(v["params"], x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
@pytest.mark.parametrize("name", ["dense", "ln_dense", "mlp_fused", "mlp_composed"])
def test_recipe_within_fp8_tolerance(name, recipe):
    module, ref, to_ref = CASES[name]
    module = module.clone(quantization_recipe=recipe)
    x = x_in()
    kw = {"deterministic": True} if name.startswith("mlp") else {}
    v = init(module, x, **kw)
    if isinstance(recipe, DelayedScaling):
        assert OWG in v
        v = one_update(module, v, x, **kw)
    y = output(run(module, v, x, **kw))
    assert rel_err(y, ref.apply(to_ref(v["params"]), x)) < FP8_TOL


def test_autocast_recipe_and_explicit_recipe_agree():
    module = DenseGeneral(16)
    x = x_in()
    v = init(module, x)
    with lowbit.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y_auto = run(module, v, x)
    y_explicit = run(module.clone(quantization_recipe=Float8CurrentScaling()), v, x)
    np.testing.assert_array_equal(y_auto, y_explicit)
    assert rel_err(y_auto, run(module, v, x)) > 0  # quantized inside the block only


def test_nvfp4_forward_runs_through_dense_general():
    """The forward needs no key (no SR in x and kernel); the backward's key from "sr_rng" is
    tested in tests/test_dense_nvfp4.py and tests/test_layernorm_nvfp4.py."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time NVFP4 emulation notice
        init(DenseGeneral(16, quantization_recipe=NVFP4BlockScaling()), x_in())


@pytest.mark.parametrize("recipe", [Float8BlockScaling, MXFP8BlockScaling], ids=lambda r: r.__name__)
def test_block_recipes_run_through_dense_general(recipe):
    """The block recipes are stateless: no _overwrite_with_gradient variables, and the output
    is within FP8 error (8% relative) of the unquantized module with the same parameters."""
    x = x_in()
    v = init(DenseGeneral(16, quantization_recipe=recipe()), x)
    assert OVERWRITE_WITH_GRADIENT not in v
    y = run(DenseGeneral(16, quantization_recipe=recipe()), v, x)
    assert rel_err(y, run(DenseGeneral(16), v, x)) < 0.08


def test_delayed_state_updates_step_to_step():
    recipe = DelayedScaling(amax_history_len=4)
    module = DenseGeneral(16, quantization_recipe=recipe)
    x = x_in()
    v = init(module, x)
    state = v[OWG]
    np.testing.assert_array_equal(state["x_scale"], [1.0])
    np.testing.assert_array_equal(state["x_amax_history"], np.zeros(4))
    v1 = one_update(module, v, x)
    amax = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(v1[OWG]["x_amax_history"], [0, 0, 0, amax], rtol=1e-6)
    np.testing.assert_allclose(v1[OWG]["x_scale"], [448.0 / amax], rtol=1e-6)
    kernel_amax = float(jnp.max(jnp.abs(v["params"]["kernel"])))
    np.testing.assert_allclose(v1[OWG]["kernel_scale"], [448.0 / kernel_amax], rtol=1e-6)
    assert float(v1[OWG]["grad_scale"][0]) != 1.0
    v2 = one_update(module, v1, 2 * x)
    np.testing.assert_allclose(v2[OWG]["x_amax_history"], [0, 0, amax, 2 * amax], rtol=1e-6)
    np.testing.assert_allclose(v2[OWG]["x_scale"], [448.0 / (2 * amax)], rtol=1e-6)


def test_mlp_state_names_per_gemm():
    module = LayerNormMLP(F, return_layernorm_output=False, intermediate_dropout_rate=0.0,
                          quantization_recipe=DelayedScaling(amax_history_len=8))
    rngs = {"params": jax.random.PRNGKey(1)}
    state = jax.eval_shape(module.init, rngs, x_in())[OWG]
    assert sorted(state) == sorted(f"{q}_{i}_{s}" for q in ("x", "kernel", "grad") for i in (0, 1)
                                   for s in ("scale", "amax_history"))
    assert state["grad_1_amax_history"].shape == (8,)


def test_te_parameter_names_and_shapes():
    x = x_in()
    mlp = LayerNormMLP(F, activations=("gelu", "linear"), use_bias=True,
                       enable_low_rank_adaptation=True, low_rank_adaptation_dim=4)
    assert shapes(mlp, x, deterministic=True) == {"scale": (H,), "ln_bias": (H,), "wi_kernel": (H, 2, F), "wo_kernel": (F, H),
                      "wi_bias": (2, F), "wo_bias": (H,), "wi_lora_a_kernel": (H, 2, 4),
                      "wi_lora_b_kernel": (2, 4, F), "wo_lora_a_kernel": (F, 4),
                      "wo_lora_b_kernel": (4, H)}
    dense = DenseGeneral((3, 8), enable_low_rank_adaptation=True, low_rank_adaptation_dim=4)
    assert shapes(dense, x) == {"kernel": (H, 3, 8), "bias": (3, 8), "lora_a_kernel": (H, 3, 4),
                      "lora_b_kernel": (3, 4, 8)}
    ln_dense = LayerNormDenseGeneral(8, layernorm_type="rmsnorm")
    assert shapes(ln_dense, x) == {"scale": (H,), "kernel": (H, 8)}


@pytest.mark.parametrize("module", [
    DenseGeneral(16, enable_low_rank_adaptation=True, low_rank_adaptation_dim=4),
    LayerNormDenseGeneral(16, enable_low_rank_adaptation=True, low_rank_adaptation_dim=4),
    LayerNormMLP(F, enable_low_rank_adaptation=True, low_rank_adaptation_dim=4,
                 intermediate_dropout_rate=0.0),
], ids=["dense", "ln_dense", "mlp"])
def test_lora(module):
    x = x_in()
    v = init(module, x)
    base = module.clone(enable_low_rank_adaptation=False)
    base_params = {k: p for k, p in v["params"].items() if "lora" not in k}
    y0 = output(run(base, {"params": base_params}, x))
    np.testing.assert_allclose(output(run(module, v, x)), y0, rtol=1e-6, atol=1e-6)
    if isinstance(module, DenseGeneral):  # TE's formula with a non-zero adapter
        alpha = 2.0
        a = v["params"]["lora_a_kernel"]
        b = x_in(3, v["params"]["lora_b_kernel"].shape)
        p = {**v["params"], "lora_b_kernel": b}
        y = run(module.clone(low_rank_adaptation_alpha=alpha), {"params": p}, x)
        np.testing.assert_allclose(y, y0 + (x @ a @ b) * alpha / 4, rtol=1e-5, atol=1e-5)


def test_layernorm_dense_outputs_and_depth_scaling():
    module = LayerNormDenseGeneral(16, depth_scaling=4.0, return_layernorm_output=True)
    x = x_in()
    v = init(module, x)
    y, ln = run(module, v, x)
    np.testing.assert_allclose(ln, nn.LayerNorm(epsilon=1e-6).apply(
        {"params": {"scale": v["params"]["scale"], "bias": v["params"]["ln_bias"]}}, x), atol=1e-5)
    np.testing.assert_allclose(y, ln @ v["params"]["kernel"] / 4.0, rtol=1e-5, atol=1e-5)


def test_mlp_dropout_composed_path():
    module = LayerNormMLP(F, intermediate_dropout_rate=0.5, return_layernorm_output=False,
                          quantization_recipe=Float8CurrentScaling())
    x = x_in()
    v = init(module, x, deterministic=True)
    apply = jax.jit(lambda v, x, key: module.apply(v, x, rngs={"dropout": key})[0])
    drop = lambda seed: apply(v, x, jax.random.PRNGKey(seed))  # noqa: E731
    y_det = run(module, v, x, deterministic=True)[0]
    assert not np.allclose(drop(0), drop(1))
    assert not np.allclose(drop(0), y_det)
    np.testing.assert_array_equal(drop(0), drop(0))


@pytest.mark.parametrize("fusion", ["scaled", "scaled_masked", "scaled_upper_triang"])
def test_softmax(fusion):
    logits = x_in(0, (2, 2, 8, 8))
    bias = x_in(1, (1, 2, 8, 8))
    causal = jnp.triu(jnp.ones((8, 8), jnp.uint8), 1)[None, None]
    mask = None if fusion == "scaled_upper_triang" else jnp.broadcast_to(causal, (2, 1, 8, 8))
    y = Softmax(scale_factor=0.5, softmax_fusion_type=fusion).apply({}, logits, mask, bias)
    ref = jax.nn.softmax(jnp.where(causal > 0, -jnp.inf, 0.5 * (logits + bias)), axis=-1)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_logical_axis_rules_shard_params():
    module = LayerNormMLP(F, intermediate_dropout_rate=0.0, return_layernorm_output=False)
    x = x_in()
    abstract = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x))
    specs = nn.get_partition_spec(abstract)["params"]
    assert specs["wi_kernel"] == jax.sharding.PartitionSpec("embed", "act", "mlp")
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("model",))
    rules = (("embed", None), ("act", None), ("mlp", "model"))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        v = jax.jit(lambda: module.init(jax.random.PRNGKey(0), x), out_shardings=shardings)()
        y = jax.jit(lambda v, x: module.apply(v, x)[0])(v, x)
    wi = v["params"]["wi_kernel"].value
    assert wi.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert wi.addressable_shards[0].data.shape == (H, 1, F // 2)
    np.testing.assert_allclose(y, run(module, nn.meta.unbox(v), x)[0], rtol=1e-5, atol=1e-5)


def test_orbax_checkpoint_roundtrip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    module = LayerNormMLP(F, intermediate_dropout_rate=0.0, return_layernorm_output=False,
                          quantization_recipe=DelayedScaling(amax_history_len=4))
    x = x_in()
    v = one_update(module, init(module, x), x)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step1", v)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "step1", jax.tree.map(ocp.utils.to_shape_dtype_struct, v))
    jax.tree.map(np.testing.assert_array_equal, restored, v)
    assert float(restored[OWG]["x_0_scale"][0]) != 1.0
    np.testing.assert_array_equal(run(module, restored, x)[0], run(module, v, x)[0])


def test_bad_configuration_names_the_module_and_field():
    x = jnp.ones((2, 3, 8), jnp.float32)
    with pytest.raises(ValueError, match="lowbit.flax.DenseGeneral: axis: axis 5 is out of range for an input of rank 3"):
        DenseGeneral(4, axis=5).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="lowbit.flax.DenseGeneral: features: expected positive ints"):
        DenseGeneral(-1).init(jax.random.PRNGKey(0), x)
    y, _ = DenseGeneral(4, axis=-1).init_with_output(jax.random.PRNGKey(0), x)
    assert y.shape == (2, 3, 4)
    with pytest.raises(ValueError, match="lowbit.flax.LayerNormMLP: activations: 'foo' is neither"):
        LayerNormMLP(16, activations=("foo",)).init(jax.random.PRNGKey(0), x)
    import lowbit.flax.nnx as lnnx
    from flax import nnx
    with pytest.raises(ValueError, match="lowbit.flax.nnx.DenseGeneral: features: expected positive ints"):
        lnnx.DenseGeneral(8, 0, rngs=nnx.Rngs(0))


def test_activation_params_need_limit_and_alpha():
    x = jnp.ones((4, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="lowbit.activation: act_params: expected an object with .limit and .alpha"):
        lowbit.activation(x, ("clamped_silu", "clamped_linear"), act_params=3)
