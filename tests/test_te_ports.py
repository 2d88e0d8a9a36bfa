"""TransformerEngine code ports to lowbit by changing its imports: the module defaults of TE's
source (LayerNormMLP, LayerNormDenseGeneral), wrap_function_in_te_state_module's calling
convention, TE's fields and keywords taken at their defaults (or an error naming them), norm
type spellings, and TE's top-level names. Seed 000's usage example runs as written."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax.core.meta import unbox

import lowbit
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8CurrentScaling


def _x(shape=(2, 12, 64), seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def test_seed_000_usage_example_runs_with_imports_changed():
    # Seed 000's example, imports changed (transformer_engine.jax -> lowbit); before TE's
    # defaults its apply asked for a "dropout" RNG (intermediate_dropout_rate was 0.1).
    from lowbit.flax.module import LayerNormMLP
    from lowbit.quantize import autocast
    from lowbit.sharding import MeshResource

    class MyTransformerBlock(nn.Module):
        hidden_dim: int = 64
        mlp_dim: int = 128

        @nn.compact
        def __call__(self, x):
            # Fused LayerNorm + MLP with FP8 quantization
            x = LayerNormMLP(
                intermediate_dim=self.mlp_dim,
                activations=("gelu",),
            )(x)
            return x

    model, input_data = MyTransformerBlock(), _x()
    fp8_recipe, mesh_resource = DelayedScaling(), MeshResource()
    with autocast(enabled=True, recipe=fp8_recipe, mesh_resource=mesh_resource):
        params = model.init(jax.random.PRNGKey(1), input_data)
        output = model.apply(params, input_data)
    out, ln_out = output
    assert out.shape == input_data.shape and ln_out is None
    # The quantized block against the same parameters unquantized (FP8: a few percent).
    ref, _ = model.apply(params, input_data)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 0.08
    assert not np.array_equal(np.asarray(out), np.asarray(ref))  # quantization did happen


def test_module_defaults_are_te_s():
    from lowbit.flax.module import LayerNormDenseGeneral, LayerNormMLP

    mlp = LayerNormMLP()
    assert mlp.activations == ("gelu",) and mlp.intermediate_dropout_rate == 0.0
    assert not mlp.return_layernorm_output and not LayerNormDenseGeneral(8).return_layernorm_output
    x = _x()
    for module in (LayerNormDenseGeneral(16), LayerNormMLP(32)):
        v = module.init(jax.random.PRNGKey(0), x)
        y, ln = module.apply(v, x)
        assert ln is None and y.shape[:-1] == x.shape[:-1]
    # gelu is the default: the same as asking for it.
    v = LayerNormMLP(32).init(jax.random.PRNGKey(0), x)
    np.testing.assert_array_equal(LayerNormMLP(32).apply(v, x)[0],
                                  LayerNormMLP(32, activations=("gelu",)).apply(v, x)[0])
    assert not np.allclose(LayerNormMLP(32).apply(v, x)[0],
                           LayerNormMLP(32, activations=("relu",)).apply(v, x)[0])


def test_wrap_function_in_te_state_module_uses_te_s_calling_convention():
    from lowbit.flax.module import wrap_function_in_te_state_module

    recipe = DelayedScaling(amax_history_len=4)

    def my_dense(generate_quantizer_set, x, kernel):  # TE's convention: the generator first
        return lowbit.dense(x, kernel, contracting_dims=((1,), (0,)),
                            quantizer_set=generate_quantizer_set())

    def two_gemms(generate_quantizer_set, x, k1, k2):
        h = lowbit.dense(x, k1, quantizer_set=generate_quantizer_set("_0"))
        return lowbit.dense(h, k2, quantizer_set=generate_quantizer_set("_1"))

    cls = wrap_function_in_te_state_module(my_dense, recipe, "my_dense")
    assert cls.__name__ == "TEWrapper_my_dense"
    x = _x((24, 48))
    kernel = jax.random.normal(jax.random.PRNGKey(2), (48, 40)) / 7
    v = cls().init(jax.random.PRNGKey(0), x, kernel)
    state = v[lowbit.NVTE_FP8_COLLECTION_NAME]
    assert set(state) == {f"{t}_{s}" for t in ("x", "kernel", "grad") for s in ("scale", "amax_history")}
    assert state["x_amax_history"].shape == (4,)
    y = cls().apply(v, x, kernel)
    want = lowbit.dense(x, kernel, quantizer_set=QuantizerFactory.create_set(recipe))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    k2 = jax.random.normal(jax.random.PRNGKey(3), (40, 8)) / 6
    v2 = wrap_function_in_te_state_module(two_gemms, recipe)().init(jax.random.PRNGKey(0), x, kernel, k2)
    assert {n for n in v2["_overwrite_with_gradient"] if n.endswith("_scale")} == {
        f"{t}_{i}_scale" for t in ("x", "kernel", "grad") for i in (0, 1)}
    # lowbit's own form keeps passing the set as a keyword.
    own = lowbit.flax.wrap_function_in_state_module(
        lambda x, k, quantizer_set: lowbit.dense(x, k, quantizer_set=quantizer_set), recipe, "mine")
    assert own.__name__ == "Wrapper_mine"
    np.testing.assert_array_equal(np.asarray(own().apply(own().init(jax.random.PRNGKey(0), x, kernel), x, kernel)),
                                  np.asarray(want))


@pytest.mark.parametrize("make, field", [
    (lambda m: m.DenseGeneral(8, transpose_batch_sequence=True), "transpose_batch_sequence"),
    (lambda m: m.DenseGeneral(8, quantization_checkpoint_name="q"), "quantization_checkpoint_name"),
    (lambda m: m.LayerNormDenseGeneral(8, transpose_batch_sequence=True), "transpose_batch_sequence"),
    (lambda m: m.LayerNormMLP(16, quantization_checkpoint_name="q"), "quantization_checkpoint_name"),
    (lambda m: m.LayerNormMLP(16, activation_params={"limit": 5.0}), "activation_params"),
    (lambda m: m.LayerNormMLP(16, activation_params={"beta": 1.0}), "activation_params"),
])
def test_te_fields_at_other_values_name_the_field(make, field):
    from lowbit.flax import module as m

    x = _x()
    with pytest.raises(ValueError, match=f"lowbit.flax.[A-Za-z]+: {field}: expected"):
        make(m).init(jax.random.PRNGKey(0), x)


def test_te_fields_at_their_defaults_change_nothing():
    from lowbit.flax import module as m

    x = _x()
    for plain, spelled in (
        (m.DenseGeneral(8), m.DenseGeneral(8, transpose_batch_sequence=False, quantization_checkpoint_name=None)),
        (m.LayerNormMLP(16, activations=("clamped_silu", "clamped_linear")),
         m.LayerNormMLP(16, activations=("clamped_silu", "clamped_linear"),
                        activation_params={"limit": 7.0, "alpha": 1.702})),
    ):
        v = plain.init(jax.random.PRNGKey(0), x)
        np.testing.assert_array_equal(np.asarray(jax.tree.leaves(plain.apply(v, x))[0]),
                                      np.asarray(jax.tree.leaves(spelled.apply(v, x))[0]))
    logits = _x((2, 2, 8, 8))
    from lowbit.softmax import AttnSoftmaxType

    np.testing.assert_array_equal(m.Softmax(softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX).apply({}, logits),
                                  m.Softmax().apply({}, logits))
    with pytest.raises(ValueError, match="lowbit.flax.Softmax: softmax_type: expected"):
        m.Softmax(softmax_type=AttnSoftmaxType.OFF_BY_ONE_SOFTMAX).apply({}, logits)


def test_layer_norm_mlp_runs_te_s_clamped_swiglu():
    """("clamped_silu", "clamped_linear") (GPT-OSS's clamped swiglu) in the module, as TE's
    LayerNormMLP takes it: min(a, 7) * sigmoid(1.702 * min(a, 7)) * (clip(g, -7, 7) + 1)."""
    from lowbit.flax.module import LayerNormMLP

    x = _x()
    m = LayerNormMLP(32, activations=("clamped_silu", "clamped_linear"))
    v = unbox(m.init(jax.random.PRNGKey(1), x))
    v["params"]["scale"] = 8 * v["params"]["scale"]  # large enough that the clamps bite
    y, _ = m.apply(v, x)
    p = v["params"]
    mu = x.mean(-1, keepdims=True)
    ln = (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * p["scale"] + p["ln_bias"]
    h = jnp.einsum("bsh,hnf->bsnf", ln, p["wi_kernel"])
    a, g = jnp.minimum(h[..., 0, :], 7.0), jnp.clip(h[..., 1, :], -7.0, 7.0) + 1
    assert float(jnp.max(h[..., 1, :])) > 7.0  # the clamp is exercised
    ref = (a * jax.nn.sigmoid(1.702 * a) * g) @ p["wo_kernel"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_functions_take_te_s_keywords():
    x, k = _x((4, 6, 32)), jax.random.normal(jax.random.PRNGKey(4), (32, 16)) / 6
    g, b = 1 + 0.1 * _x((32,), 5), 0.1 * _x((32,), 6)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    plain = lowbit.dense(x, k, contracting_dims=((2,), (0,)), quantizer_set=qs)
    hinted = lowbit.dense(x, k, contracting_dims=((2,), (0,)), quantizer_set=qs, input_axes=None,
                          kernel_axes=None, output_axes=None, transpose_batch_sequence=False)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(hinted))
    for call, op in (
        (lambda: lowbit.dense(x, k, contracting_dims=((2,), (0,)), transpose_batch_sequence=True), "dense"),
        (lambda: lowbit.layernorm_dense(x, k, g, b, transpose_batch_sequence=True), "layernorm_dense"),
        (lambda: lowbit.layernorm_mlp(x, g, b, (k, k.T), transpose_batch_sequence=True), "layernorm_mlp"),
        (lambda: lowbit.layernorm_mlp(x, g, b, (k, k.T), activation_params={"alpha": 2.0}), "layernorm_mlp"),
    ):
        with pytest.raises(ValueError, match=f"lowbit.{op}: (transpose_batch_sequence|activation_params): expected"):
            call()


def test_dense_axes_hints_are_sharding_constraints():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from lowbit.sharding import MeshResource, global_shard_guard, logical_axis_rules

    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "tp"))
    x, k = _x((4, 6, 32)), jax.random.normal(jax.random.PRNGKey(4), (32, 16)) / 6
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    hints = dict(input_axes=("batch", None, None), kernel_axes=(None, "mlp"), output_axes=("batch", None, "mlp"))
    f = lambda x, k, **kw: lowbit.dense(x, k, contracting_dims=((2,), (0,)), quantizer_set=qs, **kw)  # noqa: E731
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")), \
            nn.logical_axis_rules(logical_axis_rules()), jax.set_mesh(mesh):
        assert str(jax.make_jaxpr(lambda x, k: f(x, k, **hints))(x, k)).count("sharding_constraint") == 3
        assert "sharding_constraint" not in str(jax.make_jaxpr(f)(x, k))
        y = jax.jit(lambda x, k: f(x, k, **hints))(x, k)
    assert y.sharding.spec == P("dp", None, "tp")
    # The reference on the CPU as the mesh is (under a GPU default backend, gpu_check.sh's suite
    # stage, the unsharded call would run cuBLASLt's GEMM instead of the CPU's).
    with jax.default_device(jax.devices("cpu")[0]):
        ref = f(x, k)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spelling, canonical", [("LayerNorm", "layernorm"), ("layer_norm", "layernorm"),
                                                 ("RMSNorm", "rmsnorm"), ("rms_norm", "rmsnorm")])
def test_norm_type_spellings(spelling, canonical):
    from lowbit.flax.module import LayerNorm

    x, g = _x(), 1 + 0.1 * _x((64,), 1)
    b = 0.1 * _x((64,), 2) if canonical == "layernorm" else None
    np.testing.assert_array_equal(np.asarray(lowbit.layernorm(x, g, b, spelling)),
                                  np.asarray(lowbit.layernorm(x, g, b, canonical)))
    v = LayerNorm(layernorm_type=spelling).init(jax.random.PRNGKey(0), x)
    assert ("ln_bias" in v["params"]) == (canonical == "layernorm")
    np.testing.assert_array_equal(np.asarray(LayerNorm(layernorm_type=spelling).apply(v, x)),
                                  np.asarray(LayerNorm(layernorm_type=canonical).apply(v, x)))
    with pytest.raises(ValueError, match="norm_type: expected"):
        lowbit.layernorm(x, g, b, "batchnorm")


def test_te_top_level_names():
    from lowbit.sharding import MeshResource
    from lowbit.softmax import SoftmaxFusionType, SoftmaxType

    assert lowbit.MeshResource is MeshResource and SoftmaxFusionType is SoftmaxType
    assert lowbit.NVTE_FP8_COLLECTION_NAME == lowbit.flax.OVERWRITE_WITH_GRADIENT
    original = {"params": {"w": 1}, "_overwrite_with_gradient": {"s": 2}}
    new = {"_overwrite_with_gradient": {"s": 3}, "extra": {"e": 4}}
    merged = lowbit.update_collections(new, original)
    assert merged == {"params": {"w": 1}, "_overwrite_with_gradient": {"s": 3}, "extra": {"e": 4}}
    assert original["_overwrite_with_gradient"] == {"s": 2}  # not modified in place
    frozen = lowbit.update_collections(new, flax.core.freeze(original))
    assert isinstance(frozen, flax.core.FrozenDict) and frozen["_overwrite_with_gradient"]["s"] == 3
    with pytest.raises(TypeError, match="lowbit.update_collections: new: expected a dict"):
        lowbit.update_collections([("a", 1)], original)


def test_te_flax_package_names():
    # TE's flax package exports extend_logical_axis_rules (lowbit.sharding's, the same
    # function: the rules plus TE's table, which needs a mesh); TE's attention and
    # transformer layers are not ported, and asking for one says so and names what to build
    # the layer from, unlike a plain missing attribute.
    import lowbit.flax as te_flax
    from lowbit.sharding import MeshResource, extend_logical_axis_rules

    assert te_flax.extend_logical_axis_rules is extend_logical_axis_rules
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("data",))
    with lowbit.autocast(enabled=False, mesh_resource=MeshResource(dp_resource="data")):
        assert te_flax.extend_logical_axis_rules((("my_embed", None),)) == (("my_embed", None),)
        with jax.set_mesh(mesh):
            rules = dict(te_flax.extend_logical_axis_rules((("my_embed", None),)))
    assert rules["my_embed"] is None and rules["nvte_batch"] == "data" and "batch" not in rules
    for name in ("DotProductAttention", "MultiHeadAttention", "RelativePositionBiases",
                 "TransformerLayer", "TransformerLayerType"):
        with pytest.raises(AttributeError, match=f"{name}.*not part of lowbit.*LayerNormDenseGeneral"):
            getattr(te_flax, name)
    with pytest.raises(AttributeError, match=r"has no attribute 'NoSuchModule'$"):
        te_flax.NoSuchModule
    # TE's module file's type names, for annotations in ported code.
    from lowbit.flax.module import Array, DType, Initializer, PRNGKey, PrecisionLike, Shape  # noqa: F401

    assert Array is jax.Array and Shape == tuple[int, ...]


@pytest.mark.parametrize("q_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("margin", [0, 2.0])
def test_compute_scale_from_amax_is_te_s_formula(q_dtype, margin):
    from lowbit.quantize import compute_scale_from_amax

    rng = np.random.default_rng(7)
    amaxes = np.concatenate([rng.uniform(1e-3, 1e3, 6), rng.uniform(1e-30, 1e-20, 2),
                             [0.0, -1.0, np.inf, np.nan, 1e-40, 448.0, 57344.0]]).astype(np.float32)
    old = np.array([0.37], np.float32)
    fp8_max = np.float32(jnp.finfo(q_dtype).max)
    for a in amaxes:
        # TE's few lines, with DESIGN §4's clamp of an infinite quotient to FLT_MAX.
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            sf = (fp8_max / a) / np.float32(2.0 ** margin)
        want = old if not (a > 0 and np.isfinite(a)) else np.minimum(sf, np.finfo(np.float32).max)
        got = np.asarray(compute_scale_from_amax(jnp.array([a]), q_dtype, margin, jnp.asarray(old)))
        assert got.shape == (1,) and got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(want, np.float32).reshape(1), err_msg=str(a))
    assert float(compute_scale_from_amax(0.0, q_dtype, margin)[0]) == 1.0  # default scale 1
    with pytest.raises(TypeError, match="compute_scale_from_amax: q_dtype"):
        compute_scale_from_amax(1.0, jnp.bfloat16, 0)
    with pytest.raises(ValueError, match="compute_scale_from_amax: amax: expected one value"):
        compute_scale_from_amax(jnp.ones(2), q_dtype, 0)


def test_canonicalize_norm_type():
    from lowbit.layernorm import canonicalize_norm_type

    for spelling, want in (("LayerNorm", "layernorm"), ("layer_norm", "layernorm"),
                           (" RMS-Norm ", "rmsnorm"), ("rmsnorm", "rmsnorm")):
        assert canonicalize_norm_type(spelling) == want
    with pytest.raises(ValueError, match="canonicalize_norm_type: x: .*'batchnorm'"):
        canonicalize_norm_type("batchnorm")


def test_create_set_takes_te_s_positional_count():
    sets = QuantizerFactory.create_set(2, fp8_recipe=Float8CurrentScaling())
    assert isinstance(sets, tuple) and len(sets) == 2 and all(s.x is not None for s in sets)
    with pytest.raises(ValueError, match="n_quantizer_sets: given twice"):
        QuantizerFactory.create_set(2, n_quantizer_sets=3, fp8_recipe=Float8CurrentScaling())


def test_training_state_round_trip_through_update_collections():
    """TE's loop shape: the delayed-scaling state's "gradient" merged back with update_collections
    changes the state from step to step."""
    from lowbit.flax.module import DenseGeneral

    model = DenseGeneral(16, quantization_recipe=DelayedScaling(amax_history_len=3))
    x = _x()
    v = unbox(model.init(jax.random.PRNGKey(0), x))
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)
    name = lowbit.NVTE_FP8_COLLECTION_NAME
    v2 = lowbit.update_collections({name: grads[name]}, v)
    assert v2["params"] is v["params"]
    assert not np.array_equal(np.asarray(v2[name]["x_amax_history"]), np.asarray(v[name]["x_amax_history"]))
    assert float(v2[name]["x_amax_history"][-1]) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=1e-6)
    assert float(v2[name]["x_scale"][0]) != float(v[name]["x_scale"][0])


def _native_modes_expected():
    """Which modes run natively here, from the devices themselves (an independent statement of
    lowbit.quantize.support's gates: per-tensor FP8 from sm_89, FP8 blocks on 9.0, MXFP8/NVFP4
    on 10.x, all only where lowbit's CUDA library is loaded)."""
    from lowbit import _ffi
    from lowbit.quantize import ScalingMode as M

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus or not _ffi.info()["cuda_registered"]:
        return set(), 0
    major, minor = (int(v) for v in str(gpus[0].compute_capability).split("."))
    modes = set()
    if (major, minor) >= (8, 9):
        modes |= {M.DELAYED_TENSOR_SCALING, M.CURRENT_TENSOR_SCALING}
    if (major, minor) == (9, 0):
        modes |= {M.FP8_BLOCK_1x128, M.FP8_BLOCK_128x128}
    if major == 10:
        modes |= {M.MXFP8_1D_SCALING, M.NVFP4_1D_SCALING, M.NVFP4_2D_SCALING}
    return modes, major * 10 + minor


def test_te_support_queries():
    from lowbit.quantize import (ScalingMode, get_device_compute_capability, get_supported_quantization_recipes,
                                 get_supported_scaling_modes, helper, is_fp8_available, is_scaling_mode_supported)

    want, cc = _native_modes_expected()
    assert get_device_compute_capability() == cc
    assert set(get_supported_scaling_modes()) == want
    assert is_scaling_mode_supported(ScalingMode.NO_SCALING) == (True, "")
    for mode in ScalingMode:
        if mode == ScalingMode.NO_SCALING:
            continue
        ok, why = helper.is_scaling_mode_supported(mode)  # TE's `helper.` spelling too
        assert ok == (mode in want) and (why == "") == ok
        if not ok:
            assert "emulat" in why or "CUDA library" in why
    assert is_fp8_available() == is_scaling_mode_supported(ScalingMode.DELAYED_TENSOR_SCALING)
    from lowbit.quantize import is_fp8_gemm_with_all_layouts_supported
    assert is_fp8_gemm_with_all_layouts_supported() == (100 <= cc < 120)  # False on the CPU and Hopper
    names = {type(r).__name__ for r in get_supported_quantization_recipes()}
    by_mode = {"DelayedScaling": ScalingMode.DELAYED_TENSOR_SCALING,
               "Float8CurrentScaling": ScalingMode.CURRENT_TENSOR_SCALING,
               "Float8BlockScaling": ScalingMode.FP8_BLOCK_1x128,
               "MXFP8BlockScaling": ScalingMode.MXFP8_1D_SCALING,
               "NVFP4BlockScaling": ScalingMode.NVFP4_1D_SCALING}
    assert names == {n for n, m in by_mode.items() if m in want}
    with pytest.raises(TypeError, match="scaling_mode: expected a lowbit.quantize.ScalingMode"):
        is_scaling_mode_supported("delayed")


def test_te_quantize_names():
    from lowbit.quantize import QuantizeLayout, ScalingMode, get_global_quantize_recipe
    from lowbit.quantize import update_collections as quantize_update_collections

    assert quantize_update_collections is lowbit.update_collections
    with lowbit.autocast(enabled=True, recipe=Float8CurrentScaling()):
        assert get_global_quantize_recipe() == Float8CurrentScaling()
    assert get_global_quantize_recipe() is None
    pair = QuantizerFactory.create(n_quantizers=2, scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING,
                                   q_dtype=jnp.float8_e4m3fn, q_layout=QuantizeLayout.ROWWISE, margin=0.0)
    assert len(pair) == 2 and all(q.margin == 0 and type(q.margin) is int for q in pair)
    single = QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn)
    assert single.q_dtype == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="QuantizerFactory.create: n_quantizers: expected an int >= 1"):
        QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn, n_quantizers=0)
    with pytest.raises(ValueError, match="margin: expected a whole number"):
        QuantizerFactory.create(ScalingMode.DELAYED_TENSOR_SCALING, jnp.float8_e4m3fn, margin=0.5)


def test_te_scaling_mode_and_layout_queries():
    from lowbit.quantize import QuantizeLayout as L
    from lowbit.quantize import ScalingMode as M

    assert [m for m in M if m.is_tensor_scaling()] == [M.DELAYED_TENSOR_SCALING, M.CURRENT_TENSOR_SCALING]
    assert {m for m in M if m.is_1d_block_scaling()} == {M.MXFP8_1D_SCALING, M.FP8_BLOCK_1x128,
                                                          M.NVFP4_1D_SCALING, M.NVFP4_2D_SCALING}
    assert [m for m in M if m.is_nvfp4_scaling] == [M.NVFP4_1D_SCALING, M.NVFP4_2D_SCALING]
    assert [m for m in M if m.is_mxfp8_scaling] == [M.MXFP8_1D_SCALING]
    assert M.DELAYED_TENSOR_SCALING.get_compatible_q_dtypes() == {jnp.float8_e4m3fn, jnp.float8_e5m2}
    assert M.NVFP4_1D_SCALING.get_compatible_q_dtypes() == {jnp.float4_e2m1fn}
    assert [(lay.is_rowwise_colwise, lay.is_rowwise_only, lay.is_colwise_only) for lay in
            (L.ROWWISE_COLWISE, L.ROWWISE, L.COLWISE)] == [(True, False, False), (False, True, False),
                                                          (False, False, True)]


def test_recipes_take_te_positional_order_and_nvfp4_fields():
    """TE 2.12's field order (DelayedScaling: margin, fp8_format, amax_history_len,
    amax_compute_algo, scaling_factor_compute_algo, reduce_amax, fp8_dpa, fp8_mha;
    Float8CurrentScaling: use_power_2_scales first), lowbit's fp8_gemm_* by keyword only on
    DelayedScaling; NVFP4BlockScaling's fp4_format / fp8_format fields and fp4_quant_* QParams;
    Recipe.custom() False."""
    from lowbit.recipe import (DelayedScaling, Float8CurrentScaling, Format, MMParams,
                               NVFP4BlockScaling, QParams)

    r = DelayedScaling(2, Format.E4M3, 16, "most_recent", None, True, False, False)
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (2, Format.E4M3, 16, "most_recent")
    with pytest.raises(TypeError, match="positional"):
        DelayedScaling(0, Format.HYBRID, 16, "max", None, True, False, False, MMParams(False))
    assert not DelayedScaling(fp8_gemm_dgrad=MMParams(False)).fp8_gemm_dgrad.use_split_accumulator
    assert Float8CurrentScaling(True).use_power_2_scales and Float8CurrentScaling(True).fp8_format is Format.HYBRID
    assert Float8CurrentScaling(True).fp8_quant_fwd_inp.power_2_scale

    n = NVFP4BlockScaling(fp4_format=Format.E2M1, fp8_format=Format.E4M3)
    assert n == NVFP4BlockScaling() and hash(n) == hash(NVFP4BlockScaling())
    assert n.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert n.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    assert n.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True, stochastic_rounding=True)
    off = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    assert off.fp4_quant_fwd_inp == off.fp4_quant_fwd_weight == off.fp4_quant_bwd_grad == QParams()
    with pytest.raises(ValueError, match="NVFP4BlockScaling: fp4_format"):
        NVFP4BlockScaling(fp4_format=Format.E4M3)
    with pytest.raises(ValueError, match="NVFP4BlockScaling: fp8_format"):
        NVFP4BlockScaling(fp8_format=Format.HYBRID)
    assert not any(r.custom() for r in (DelayedScaling(), Float8CurrentScaling(), n))


def test_layernorm_mlp_wi_kernel_follows_te_key_chain():
    """TE's kernel_1_init draws each activation's kernel from `key, init_key = split(key)` in
    turn: the same seed gives TE's initial wi_kernel (the stacked slices are those draws)."""
    from lowbit.flax._common import stacked_init

    init = jax.nn.initializers.lecun_normal()
    key = jax.random.PRNGKey(11)
    got = stacked_init(init, 2, axis=-2)(key, (64, 128), jnp.float32)
    k1, first = jax.random.split(key)
    _, second = jax.random.split(k1)
    np.testing.assert_array_equal(got[:, 0, :], init(first, (64, 128), jnp.float32))
    np.testing.assert_array_equal(got[:, 1, :], init(second, (64, 128), jnp.float32))


def test_functional_names_are_their_modules_too(rng):
    """TE's `te.dense.dense(...)` form (transformer_engine.jax.dense is a module) and lowbit's
    `lowbit.dense(...)` both work, and `import lowbit.dense as m` gives the module."""
    import importlib

    import lowbit as te

    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    np.testing.assert_array_equal(te.dense.dense(x, k), te.dense(x, k))
    module = importlib.import_module("lowbit.dense")
    assert module is te.dense and module.dense(x, k).shape == (4, 16)
    assert te.layernorm.canonicalize_norm_type("RMSNorm") == "rmsnorm"
    assert te.softmax.SoftmaxType is not None and te.layernorm_mlp.layernorm_mlp is not None
    for name in ("activation", "layernorm", "layernorm_dense", "layernorm_mlp", "softmax"):
        assert callable(getattr(te, name)) and callable(getattr(getattr(te, name), name))
    grad = jax.grad(lambda k: te.dense(x, k).astype(jnp.float32).sum())(k)
    np.testing.assert_array_equal(grad, jax.grad(lambda k: te.dense.dense(x, k).astype(jnp.float32).sum())(k))


def test_quantizer_factory_takes_te_signatures():
    """TE's create_set(scaling_mode=, fwd_dtype=, bwd_dtype=, is_2x2x=) (its noop set's own
    spelling) and create(n_quantizers, scaling_mode, q_dtype, q_layout) positionally, beside
    lowbit's forms; TE arguments lowbit has no use for raise naming them."""
    from lowbit.quantize import CurrentScaleQuantizer, DelayedScaleQuantizer, QuantizeLayout, ScalingMode

    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    qs = QuantizerFactory.create_set(scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING, fwd_dtype=e4m3,
                                     bwd_dtype=e5m2, is_2x2x=True, amax_history_len=8)
    assert all(isinstance(q, DelayedScaleQuantizer) for q in qs.quantizers)
    assert (qs.x.q_dtype, qs.kernel.q_dtype, qs.dgrad.q_dtype) == (e4m3, e4m3, e5m2)
    assert qs.x.amax_history.shape == (8,) and qs.x.q_layout == QuantizeLayout.ROWWISE_COLWISE
    one = QuantizerFactory.create_set(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, fwd_dtype=e4m3,
                                      bwd_dtype=e5m2, is_2x2x=False)
    assert one.x.q_layout == QuantizeLayout.ROWWISE and isinstance(one.dgrad, CurrentScaleQuantizer)
    assert QuantizerFactory.create_set(scaling_mode=ScalingMode.NO_SCALING, is_2x2x=False).quantizers == (None,) * 3
    assert len(QuantizerFactory.create_set(3, fp8_recipe=Float8CurrentScaling())) == 3

    q = QuantizerFactory.create(1, ScalingMode.CURRENT_TENSOR_SCALING, e4m3, QuantizeLayout.ROWWISE)
    assert isinstance(q, CurrentScaleQuantizer) and q.q_layout == QuantizeLayout.ROWWISE
    lowbit_form = QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, e4m3)
    assert isinstance(lowbit_form, CurrentScaleQuantizer) and lowbit_form.q_layout == QuantizeLayout.ROWWISE_COLWISE
    assert len(QuantizerFactory.create(2, ScalingMode.CURRENT_TENSOR_SCALING, e4m3)) == 2

    op = "QuantizerFactory.create_set"
    cases = [
        (ValueError, f"{op}: quantize_meta_set: only None",
         lambda: QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), quantize_meta_set=object())),
        (ValueError, f"{op}: checkpoint_name: only None", lambda: QuantizerFactory.create_set(checkpoint_name="q")),
        (ValueError, f"{op}: scaling_mode / fwd_dtype / bwd_dtype: not with a recipe",
         lambda: QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), scaling_mode=ScalingMode.NO_SCALING)),
        (ValueError, f"{op}: bwd_dtype: required", lambda: QuantizerFactory.create_set(
            scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, fwd_dtype=e4m3)),
        (TypeError, f"{op}: unexpected keyword 'flatten'", lambda: QuantizerFactory.create_set(flatten=1)),
        (TypeError, "QuantizerFactory.create: scaling_mode: given both",
         lambda: QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, e4m3,
                                         scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING)),
        (ValueError, "QuantizerFactory.create: checkpoint_name: only None",
         lambda: QuantizerFactory.create(1, ScalingMode.CURRENT_TENSOR_SCALING, e4m3, None, None, "q")),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()
