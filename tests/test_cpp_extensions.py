"""lowbit.cpp_extensions, TE's import path for its norm and quantize entry points: the seed
documents' usage code runs with only its imports changed and gives lowbit's own results.

Checked: the seed 003 example (normalization_fwd / normalization_bwd) and the seed 004 line
(quantize) run as written for layernorm and rmsnorm, without a quantizer and with the x
quantizer of each recipe, on odd shapes; the output, mu, rsigma and every leaf of the quantized
tensor (data, scales, amax) equal lowbit.ops.norm_forward's / lowbit.layernorm.norm_quantize's /
quantizer.quantize's bit for bit, and dx, dgamma, dbeta equal lowbit.ops.norm_backward's bit
for bit. Against jax.vjp of the jnp reference below (fp32 x) dx, dgamma and dbeta agree within
rtol 1e-4 and atol 1e-5 * max|ref| (tests/test_norm_ops.py's backward tolerance: both sides
compute in fp32 and sum in different orders). Also: the per-norm functions with the seed's
signatures, single-copy quantizer layouts, jit, TE's norm_type spellings, and bad input (the
message names the entry point and the argument).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from pytree_bits import assert_same_bits

from lowbit.cpp_extensions import (AmaxScope, dequantize, layernorm_bwd, layernorm_fwd, normalization_bwd,
                                   normalization_fwd, quantize, quantize_dbias, rmsnorm_bwd,
                                   rmsnorm_fwd)
from lowbit.layernorm import NormConfig, norm_quantize
from lowbit.ops.norm import norm_backward, norm_forward
from lowbit.quantize import (NoScaleTensor, QuantizeLayout, QuantizerFactory, ScaledTensor1x,
                             ScaledTensor2x)
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                           MXFP8BlockScaling, NVFP4BlockScaling)


def norm_ref(x, gamma, beta, norm_type, zero_centered_gamma=False, eps=1e-5):
    x = x.astype(jnp.float32)
    w = gamma + (1.0 if zero_centered_gamma else 0.0)
    if norm_type == "layernorm":
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + beta
    return x * jax.lax.rsqrt((x**2).mean(-1, keepdims=True) + eps) * w


# The seed documents' usage code, verbatim but for `transformer_engine.jax` -> `lowbit`.
SEED_003 = '''
from lowbit.cpp_extensions.normalization import normalization_fwd, normalization_bwd

# Forward pass with LayerNorm + FP8 quantization
output, mu, rsigma = normalization_fwd(
    x, gamma, beta, norm_type="layernorm",
    zero_centered_gamma=False, epsilon=1e-5,
    quantizer=fp8_quantizer
)

# Backward pass
dx, dgamma, dbeta = normalization_bwd(
    norm_type="layernorm", dz=grad_output, x=x, mu=mu, rsigma=rsigma,
    gamma=gamma, zero_centered_gamma=False, epsilon=1e-5
)
'''
SEED_004 = '''
from lowbit.cpp_extensions.quantization import quantize
quantized = quantize(tensor, fp8_quantizer)
'''

NORMS = ["layernorm", "rmsnorm"]
RECIPES = {
    "none": None,
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "block": Float8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
SHAPE = (3, 37, 160)


def make(rng, shape=SHAPE, dtype=np.float32):
    x = jnp.asarray(rng.standard_normal(shape) * 2 + 0.5, dtype)
    gamma = jnp.asarray(1 + 0.3 * rng.standard_normal(shape[-1]), jnp.float32)
    beta = jnp.asarray(0.2 * rng.standard_normal(shape[-1]), jnp.float32)
    return x, gamma, beta


def x_quantizer(recipe):
    """The recipe's x quantizer; a delayed one after a step, so that its scale is not 1."""
    if recipe is None:
        return None
    q = QuantizerFactory.create_set(recipe).x
    return q.update(jnp.array([5.0], jnp.float32)) if isinstance(recipe, DelayedScaling) else q




def run_seed(code, norm_type="layernorm", **names):
    """Runs a seed snippet (its "layernorm" replaced by `norm_type`) on `names`; its namespace."""
    namespace = dict(names)
    exec(compile(code.replace('"layernorm"', f'"{norm_type}"'), "seed", "exec"), namespace)
    return namespace


# ---------------------------------------------------------------- seed 003


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_seed_003_equals_lowbit_ops(recipe, norm_type, dtype, rng):
    x, gamma, beta = make(rng, dtype=dtype)
    grad_output = jnp.asarray(rng.standard_normal(SHAPE), dtype)
    quantizer = x_quantizer(RECIPES[recipe])
    ns = run_seed(SEED_003, norm_type, x=x, gamma=gamma, beta=beta, grad_output=grad_output,
                  fp8_quantizer=quantizer)

    beta_arg = beta if norm_type == "layernorm" else None  # TE ignores beta for rmsnorm
    ref = norm_forward(x, gamma, beta_arg, norm_type=norm_type, epsilon=1e-5)
    if quantizer is None:  # TE 2.12 wraps the unquantized output
        assert isinstance(ns["output"], NoScaleTensor) and ns["output"].amax is None
        assert_same_bits(ns["output"].data, ref.y)
    else:
        cfg = NormConfig(norm_type, False, 1e-5)
        ref_q, _, q_mu, q_rsigma = norm_quantize(x, gamma, beta_arg, cfg, quantizer, False)
        assert isinstance(ns["output"], ScaledTensor2x) and ns["output"].shape == SHAPE
        assert_same_bits(ns["output"], ref_q)
        assert_same_bits((q_mu, q_rsigma), (ref.mu, ref.rsigma))
    assert_same_bits(ns["rsigma"], ref.rsigma)
    assert_same_bits(ns["mu"], ref.mu)  # None for rmsnorm

    ref_dx, ref_dgamma, ref_dbeta = norm_backward(grad_output, x, ref.mu, ref.rsigma, gamma,
                                                  norm_type=norm_type)
    assert_same_bits((ns["dx"], ns["dgamma"], ns["dbeta"]), (ref_dx, ref_dgamma, ref_dbeta))
    assert (ns["dbeta"] is None) == (norm_type == "rmsnorm")


@pytest.mark.parametrize("norm_type", NORMS)
def test_seed_003_gradients_match_jax_grad(norm_type, rng):
    x, gamma, beta = make(rng)
    grad_output = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
    ns = run_seed(SEED_003, norm_type, x=x, gamma=gamma, beta=beta, grad_output=grad_output,
                  fp8_quantizer=None)
    y, vjp = jax.vjp(lambda x, g, b: norm_ref(x, g, b, norm_type), x, gamma, beta)
    np.testing.assert_allclose(ns["output"].data, y, rtol=1e-5, atol=1e-5 * np.abs(y).max())
    refs = vjp(grad_output)
    names = ["dx", "dgamma", "dbeta"] if norm_type == "layernorm" else ["dx", "dgamma"]
    for name, ref in zip(names, refs):
        ref = np.asarray(ref)
        np.testing.assert_allclose(ns[name], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=name)


# ---------------------------------------------------------------- the per-norm functions


@pytest.mark.parametrize("recipe", ["none", "delayed", "mxfp8"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_and_rmsnorm_functions_equal_normalization(recipe, zero_centered_gamma, rng):
    """layernorm_fwd/bwd and rmsnorm_fwd/bwd, called positionally with the seed's signatures."""
    x, gamma, beta = make(rng)
    dz = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
    q = x_quantizer(RECIPES[recipe])
    zc, eps = zero_centered_gamma, 1e-3

    out, mu, rsigma = layernorm_fwd(x, gamma, beta, zc, eps, q)
    assert_same_bits((out, mu, rsigma), normalization_fwd(x, gamma, beta, "layernorm", zc, eps, q))
    assert_same_bits(layernorm_bwd(dz, x, mu, rsigma, gamma, zc, eps),
                     norm_backward(dz, x, mu, rsigma, gamma, zero_centered_gamma=zc))
    assert_same_bits(layernorm_bwd(dz, x, mu, rsigma, gamma, zc, eps, beta=beta),
                     normalization_bwd("layernorm", dz, x, mu, rsigma, gamma, zc, eps, beta=beta))

    out, rsigma = rmsnorm_fwd(x, gamma, zc, eps, q)
    assert_same_bits((out, None, rsigma), normalization_fwd(x, gamma, None, "rmsnorm", zc, eps, q))
    dx, dgamma = rmsnorm_bwd(dz, x, rsigma, gamma, zc, eps)
    assert_same_bits((dx, dgamma, None),
                     norm_backward(dz, x, None, rsigma, gamma, norm_type="rmsnorm",
                                   zero_centered_gamma=zc))


@pytest.mark.parametrize("layout", [QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE])
@pytest.mark.parametrize("mode", [ScalingMode.DELAYED_TENSOR_SCALING,
                                  ScalingMode.CURRENT_TENSOR_SCALING, ScalingMode.MXFP8_1D_SCALING])
def test_single_copy_layout_returns_that_copy(layout, mode, rng):
    x, gamma, beta = make(rng)
    q = QuantizerFactory.create(mode, jnp.float8_e4m3fn, q_layout=layout)
    out, _, _ = normalization_fwd(x, gamma, beta, "layernorm", quantizer=q)
    both = norm_quantize(x, gamma, beta, NormConfig("layernorm"), q, False)[0]
    assert isinstance(out, ScaledTensor1x) and out.is_colwise == (layout == QuantizeLayout.COLWISE)
    assert_same_bits(out, both.get_tensor(colwise=layout == QuantizeLayout.COLWISE))


def test_jit(rng):
    x, gamma, beta = make(rng)
    dz = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
    q = x_quantizer(DelayedScaling())

    def step(x, gamma, beta, dz, q):
        out, mu, rsigma = normalization_fwd(x, gamma, beta, "layernorm", False, 1e-5, q)
        return out, normalization_bwd("layernorm", dz, x, mu, rsigma, gamma)

    assert_same_bits(jax.jit(step)(x, gamma, beta, dz, q), step(x, gamma, beta, dz, q))


# ---------------------------------------------------------------- seed 004


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "none"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_seed_004_equals_quantizer(recipe, dtype, rng):
    tensor = jnp.asarray(rng.standard_normal(SHAPE) * 3, dtype)
    q = x_quantizer(RECIPES[recipe])
    quantized = run_seed(SEED_004, tensor=tensor, fp8_quantizer=q)["quantized"]
    assert isinstance(quantized, ScaledTensor2x) and quantized.shape == SHAPE
    assert_same_bits(quantized, q.quantize(tensor, is_rowwise=True, is_colwise=True)[0])
    assert_same_bits(dequantize(quantized), quantized.dequantize())
    if recipe in ("delayed", "current"):  # max|tensor|: what quantizer.update() takes
        np.testing.assert_array_equal(quantized.amax, jnp.max(jnp.abs(tensor)).astype(jnp.float32))


def test_quantize_layouts_flatten_axis_dbias_and_none(rng):
    tensor = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
    row = QuantizerFactory.create(ScalingMode.CURRENT_TENSOR_SCALING, jnp.float8_e4m3fn,
                                  q_layout=QuantizeLayout.ROWWISE)
    out = quantize(tensor, row, flatten_axis=1)
    assert isinstance(out, ScaledTensor1x) and not out.is_colwise and out.flatten_axis == 1
    assert_same_bits(out, row.quantize(tensor, flatten_axis=1)[0])

    q = x_quantizer(Float8CurrentScaling())
    got = quantize_dbias(tensor, q)
    assert_same_bits(got, q.quantize(tensor, is_colwise=True, compute_dbias=True))
    assert got[1].shape == (SHAPE[-1],)
    assert quantize_dbias(tensor, q, is_dbias=False)[1] is None
    none = quantize(tensor, None)  # TE 2.12: a NoScaleTensor, and a NoScaleTensor passes through
    assert isinstance(none, NoScaleTensor) and none.data is tensor and none.amax is None
    assert quantize(none, None) is none
    assert dequantize(none) is tensor
    # TE's fp32 row sums, in x's dtype; fp32 sums in another order: within 1e-5 relative (the
    # 111-term sums' rounding), bf16 within one bf16 rounding (2**-8 relative) of that
    got, dbias = quantize_dbias(none, None, flatten_axis=2)
    assert got.data is tensor and dbias.dtype == jnp.float32 and dbias.shape == SHAPE[2:]
    ref = np.asarray(tensor, np.float64).sum(axis=(0, 1))
    np.testing.assert_allclose(dbias, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    half = tensor.astype(jnp.bfloat16)
    dbias = quantize_dbias(half, None, flatten_axis=1)[1]
    assert dbias.dtype == jnp.bfloat16 and dbias.shape == SHAPE[1:]
    ref = np.asarray(half, np.float64).sum(axis=0)
    np.testing.assert_allclose(np.asarray(dbias, np.float32), ref, rtol=2**-8, atol=1e-5 * np.abs(ref).max())
    assert quantize_dbias(tensor, None, is_dbias=False)[1] is None
    # NoScaleTensor input quantizes its data
    assert_same_bits(quantize(NoScaleTensor(tensor), q), quantize(tensor, q))


# ---------------------------------------------------------------- spellings and bad input


@pytest.mark.parametrize("spelling,norm_type", [
    ("LayerNorm", "layernorm"), (" layer_norm ", "layernorm"), ("Layer-Norm", "layernorm"),
    ("RMSNorm", "rmsnorm"), ("rms_norm", "rmsnorm"), ("rmsnorm", "rmsnorm"),
])
def test_norm_type_spellings(spelling, norm_type, rng):
    x, gamma, beta = make(rng)
    got = normalization_fwd(x, gamma, beta, spelling)
    assert_same_bits(got, normalization_fwd(x, gamma, beta, norm_type))
    _, mu, rsigma = got
    assert_same_bits(normalization_bwd(spelling, x, x, mu, rsigma, gamma),
                     normalization_bwd(norm_type, x, x, mu, rsigma, gamma))


def test_bad_input_names_the_function_and_argument(rng):
    x, gamma, beta = make(rng)
    _, mu, rsigma = normalization_fwd(x, gamma, beta, "layernorm")
    fwd, bwd = "lowbit.cpp_extensions.normalization_fwd", "lowbit.cpp_extensions.normalization_bwd"
    cases = [
        (ValueError, rf"{fwd}: norm_type: .*got 'batchnorm'",
         lambda: normalization_fwd(x, gamma, beta, "batchnorm")),
        # TE's source order (x, gamma, beta, zero_centered_gamma, epsilon, norm_type, quantizer)
        (ValueError, rf"{fwd}: norm_type: .*got False.*norm_type=",
         lambda: normalization_fwd(x, gamma, beta, False, 1e-5, "layernorm", None)),
        (ValueError, rf"{fwd}: lowbit.ops.norm_forward: gamma: expected shape \(160,\)",
         lambda: normalization_fwd(x, gamma[:-1], beta, "layernorm")),
        (ValueError, rf"{fwd}: lowbit.ops.norm_forward: beta: layernorm needs beta",
         lambda: normalization_fwd(x, gamma, None, "layernorm")),
        (ValueError, rf"{fwd}: epsilon: .*got -1.0",
         lambda: normalization_fwd(x, gamma, beta, "layernorm", epsilon=-1.0)),
        (TypeError, rf"{fwd}: quantizer: expected a lowbit.quantize Quantizer",
         lambda: normalization_fwd(x, gamma, beta, "layernorm", quantizer="fp8")),
        (ValueError, rf"{bwd}: norm_type: .*got 'groupnorm'",
         lambda: normalization_bwd("groupnorm", x, x, mu, rsigma, gamma)),
        (ValueError, rf"{bwd}: lowbit.ops.norm_backward: mu: layernorm needs mu",
         lambda: normalization_bwd("layernorm", x, x, None, rsigma, gamma)),
        (ValueError, rf"{bwd}: lowbit.ops.norm_backward: dz: expected x's shape",
         lambda: normalization_bwd("layernorm", x[:, :5], x, mu, rsigma, gamma)),
        # TE's source order of layernorm_bwd (..., gamma, beta, zero_centered_gamma, epsilon)
        (TypeError, r"lowbit.cpp_extensions.layernorm_bwd: zero_centered_gamma: expected a bool, "
                    r"got an array of shape \(160,\).*beta=",
         lambda: layernorm_bwd(x, x, mu, rsigma, gamma, beta, False)),
        (TypeError, r"lowbit.cpp_extensions.quantize: quantizer: expected a lowbit.quantize",
         lambda: quantize(x, "fp8")),
        (ValueError, r"lowbit.cpp_extensions.quantize: DelayedScaleQuantizer.quantize: "
                     r"flatten_axis: expected an axis of x",
         lambda: quantize(x, x_quantizer(DelayedScaling()), flatten_axis=3)),
        (TypeError, r"lowbit.cpp_extensions.dequantize: x: expected a lowbit.quantize ScaledTensor",
         lambda: dequantize(x)),
    ]
    for error, pattern, call in cases:
        with pytest.raises(error, match=pattern):
            call()


def test_te_2_12_keywords(rng):
    """amax_scope (every AmaxScope: lowbit's one amax rule), transpose_batch_sequence and
    output_amax_when_no_scaling=False change nothing; other values raise naming them."""
    x, gamma, beta = make(rng)
    q = x_quantizer(Float8CurrentScaling())
    calls = {
        "quantize": lambda **kw: quantize(x, q, **kw),
        "quantize_dbias": lambda **kw: quantize_dbias(x, q, **kw),
        "layernorm_fwd": lambda **kw: layernorm_fwd(x, gamma, beta, False, 1e-5, q, **kw),
        "rmsnorm_fwd": lambda **kw: rmsnorm_fwd(x, gamma, False, 1e-5, q, **kw),
        "normalization_fwd": lambda **kw: normalization_fwd(x, gamma, beta, "layernorm", False, 1e-5, q, **kw),
    }
    for name, call in calls.items():
        ref = call()
        for scope in AmaxScope:
            assert_same_bits(call(amax_scope=scope, transpose_batch_sequence=True), ref)
        with pytest.raises(TypeError, match=f"lowbit.cpp_extensions.{name}: amax_scope: expected None"):
            call(amax_scope="TPSP")
        with pytest.raises(TypeError, match=f"lowbit.cpp_extensions.{name}: transpose_batch_sequence"):
            call(transpose_batch_sequence=None)
        if name in ("layernorm_fwd", "rmsnorm_fwd"):
            assert_same_bits(call(output_amax_when_no_scaling=False), ref)
            with pytest.raises(ValueError, match=f"{name}: output_amax_when_no_scaling: expected False"):
                call(output_amax_when_no_scaling=True)
