"""lowbit.cpp_extensions.activation, TE's import path for act_lu / dact_lu /
quantize_dact_dbias: TE calls run with only their imports changed and give lowbit's own results.

Checked, for every activation lowbit has (the six single ones, the five gated pairs, clamped
swiglu with non-default ActivationParams), fp32 and bf16, x of odd shape (3, 37, ACT_DIM, 160):
- without a quantizer: NoScaleTensors (amax None) whose data equal lowbit.ops.act_forward's /
  act_backward's bit for bit, and dbias equal to lowbit.cpp_extensions.quantize_dbias's row
  sums of dx bit for bit; against the jnp reference below (TE's own formulas, fp32) y and dx
  agree within rtol 1e-5 (fp32: the kernels' sigmoid and gelu differ from XLA's by a few fp32
  ulps) or 2**-7 (bf16: one rounding of the output, plus those ulps) and atol 1e-5 * max|ref|
  (XLA's tanh saturates: jnp's gelu gradient is exactly 0 below x ~ -4.8, the kernels' ~1e-6
  there), and dbias within the same rtol times |ref| + the sum of |dx| over the rows (the
  bf16 sum is of rounded dx);
- with the quantizers of DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling and
  Float8BlockScaling (x for act_lu, dgrad for the backward): every leaf of the ScaledTensor
  (data, scales, amax) and dbias equal what lowbit's own path makes (lowbit.quantized_activation;
  lowbit.layernorm_mlp's backward: act_backward fused with the delayed scale, else
  act_backward then quantizer.quantize) bit for bit, and both dequantized copies are within
  half an FP8 ulp (2**-4 E4M3, 2**-3 E5M2) plus bf16's dequantize rounding and an underflow
  floor of max|ref| * 2**-11 of the unquantized result;
- single-copy layouts, jit, NoScaleTensor inputs, TE's extra keywords, ActivationParams, and
  bad input (the message names the entry point and the argument).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from pytree_bits import assert_same_bits

import lowbit
from lowbit.cpp_extensions.activation import (ActivationParams, ClampedSwigluParams, act_lu,
                                              dact_lu, quantize_dact_dbias)
from lowbit.cpp_extensions.amax import AmaxScope
from lowbit.cpp_extensions.quantization import quantize_dbias
from lowbit.layernorm import fused_2x
from lowbit.ops.activation import act_backward, act_forward
from lowbit.quantize import (DelayedScaleQuantizer, NoScaleTensor, QuantizeLayout,
                             QuantizerFactory, ScaledTensor1x, ScaledTensor2x)
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                           MXFP8BlockScaling)


def te_act_ref(x, activation_type, limit=7.0, alpha=1.702):
    """TE's activation in fp32: the product over i of activation_type[i] of x[..., i, :]."""
    clamp_a = lambda v: jnp.minimum(v, limit)  # noqa: E731
    fns = {"gelu": lambda v: jax.nn.gelu(v, approximate=True), "silu": jax.nn.silu,
           "relu": jax.nn.relu, "quick_gelu": lambda v: v * jax.nn.sigmoid(1.702 * v),
           "squared_relu": lambda v: jax.nn.relu(v) ** 2, "linear": lambda v: v,
           "clamped_silu": lambda v: clamp_a(v) * jax.nn.sigmoid(alpha * clamp_a(v)),
           "clamped_linear": lambda v: jnp.clip(v, -limit, limit) + 1}
    x = jnp.asarray(x, jnp.float32)
    y = fns[activation_type[0]](x[..., 0, :])
    for i, name in enumerate(activation_type[1:], 1):
        y = y * fns[name](x[..., i, :])
    return y


def te_dact_ref(dz, x, activation_type, limit=7.0, alpha=1.702):
    """(dx, dbias) in fp32: jax.vjp of te_act_ref, and dx's sums over its rows."""
    _, vjp = jax.vjp(lambda v: te_act_ref(v, activation_type, limit, alpha),
                     jnp.asarray(x, jnp.float32))
    (dx,) = vjp(jnp.asarray(dz, jnp.float32))
    return dx, dx.sum(axis=tuple(range(dx.ndim - 2)))


# clamped swiglu at a limit no bf16 value equals (2.3 is not one), so that no x sits on the
# clamp, where jnp.clip's gradient splits; alpha off its default
CLAMPED_PARAMS = ActivationParams.create(("clamped_silu", "clamped_linear"), limit=2.3, alpha=1.5)
ACTS = [("gelu",), ("silu",), ("relu",), ("quick_gelu",), ("squared_relu",), ("linear",),
        ("gelu", "linear"), ("silu", "linear"), ("relu", "linear"), ("quick_gelu", "linear"),
        ("squared_relu", "linear"), ("clamped_silu", "clamped_linear")]
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(),
           "mxfp8": MXFP8BlockScaling(), "block": Float8BlockScaling()}
LEAD, K = (3, 37), 160


def params_of(activation_type):
    return CLAMPED_PARAMS if activation_type[0] == "clamped_silu" else None


def limit_alpha(activation_type):
    p = params_of(activation_type)
    return (7.0, 1.702) if p is None else (p.clamped_swiglu.limit, p.clamped_swiglu.alpha)


def make(rng, activation_type, dtype, lead=LEAD):
    x = jnp.asarray(rng.standard_normal((*lead, len(activation_type), K)) * 2 + 0.3, dtype)
    dz = jnp.asarray(rng.standard_normal((*lead, K)), dtype)
    return x, dz


def op_args(x, activation_type):
    """x as lowbit's ops take it, and their act_type / gated / limit / alpha keywords."""
    act_type, gated = activation_type[0], len(activation_type) == 2
    limit, alpha = limit_alpha(activation_type)
    x_op = x if gated else x[..., 0, :]
    return x_op, act_type, dict(gated=gated, limit=limit, alpha=alpha)


def quantizer(recipe, which, amax=None):
    """The recipe's `which` quantizer ("x" or "dgrad"); a delayed one after a step with `amax`
    (the tensor's own: its scale fits and is not 1)."""
    q = getattr(QuantizerFactory.create_set(RECIPES[recipe]), which)
    if isinstance(q, DelayedScaleQuantizer):
        return q.update(jnp.reshape(amax, (1,)).astype(jnp.float32))
    return q




def f32(a):
    return np.asarray(a, np.float32)


def assert_close(got, ref, dtype, scale=None):
    """got (dtype) within the module docstring's tolerance of the fp32 ref; `scale`: what
    the rtol multiplies (default |ref|)."""
    got, ref = f32(got), f32(ref)
    rtol = 1e-5 if dtype == np.float32 else 2**-7
    scale = np.abs(ref) if scale is None else scale
    tol = rtol * scale + 1e-5 * np.abs(ref).max()
    assert got.shape == ref.shape
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, worst {np.abs(got - ref).max()}"


def assert_dequantized_close(tensor, ref):
    """Both copies of a ScaledTensor (or the one) dequantize to ref within the FP8 format's
    half ulp (module docstring)."""
    copies = ([tensor.rowwise_tensor, tensor.colwise_tensor] if isinstance(tensor, ScaledTensor2x)
              else [tensor])
    ref = f32(ref)
    for copy in copies:
        half_ulp = 2.0 ** -(jnp.finfo(copy.data.dtype).nmant + 1)
        rtol = half_ulp + (2**-8 if copy.dq_dtype == jnp.bfloat16 else 0)
        got = f32(copy.dequantize())
        assert got.shape == ref.shape
        bad = np.abs(got - ref) > rtol * np.abs(ref) + 2**-11 * np.abs(ref).max()
        assert not bad.any(), f"{bad.sum()} values off, worst {np.abs(got - ref).max()}"


# ---------------------------------------------------------------- no quantizer


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("activation_type", ACTS, ids=lambda t: "-".join(t))
def test_unquantized_equal_lowbit_ops_and_reference(activation_type, dtype, rng):
    x, dz = make(rng, activation_type, dtype)
    params = params_of(activation_type)
    x_op, act_type, kw = op_args(x, activation_type)

    out = act_lu(x, activation_type, act_params=params)
    assert isinstance(out, NoScaleTensor) and out.amax is None
    assert out.data.shape == (*LEAD, K) and out.data.dtype == dtype
    assert_same_bits(out.data, act_forward(x_op, act_type, **kw).y)
    assert_close(out.data, te_act_ref(x, activation_type, *limit_alpha(activation_type)), dtype)

    dx, dbias = quantize_dact_dbias(dz, x, activation_type, act_params=params)
    assert isinstance(dx, NoScaleTensor) and dx.amax is None
    assert dx.data.shape == x.shape and dx.data.dtype == dtype
    assert_same_bits(dx.data, act_backward(dz, x_op, act_type, **kw).dx.reshape(x.shape))
    assert dbias.shape == (len(activation_type), K) and dbias.dtype == dtype
    assert_same_bits(dbias, quantize_dbias(dx, None, flatten_axis=-2)[1])
    ref_dx, ref_dbias = te_dact_ref(dz, x, activation_type, *limit_alpha(activation_type))
    assert_close(dx.data, ref_dx, dtype)
    row_abs = np.abs(f32(ref_dx)).sum(axis=(0, 1))
    assert_close(dbias, ref_dbias, dtype, scale=np.abs(f32(ref_dbias)) + row_abs)

    none = dact_lu(dz, x, activation_type, act_params=params)
    assert isinstance(none, NoScaleTensor)
    assert_same_bits(none, dx)
    assert quantize_dact_dbias(dz, x, activation_type, False, act_params=params)[1] is None


# ---------------------------------------------------------------- quantizers


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear"),
                                             ("clamped_silu", "clamped_linear")],
                         ids=lambda t: "-".join(t))
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_equal_lowbit_path(recipe, activation_type, dtype, rng):
    x, dz = make(rng, activation_type, dtype)
    params = params_of(activation_type)
    x_op, act_type, kw = op_args(x, activation_type)
    y = act_lu(x, activation_type, act_params=params).data
    ref_dx, _ = quantize_dact_dbias(dz, x, activation_type, act_params=params)
    ref_dx = ref_dx.data
    row_abs = np.abs(f32(ref_dx)).sum(axis=(0, 1))
    ref_dbias = f32(ref_dx).sum(axis=(0, 1))

    xq = quantizer(recipe, "x", jnp.max(jnp.abs(y)))
    out = act_lu(x, activation_type, xq, params)
    assert isinstance(out, ScaledTensor2x) and out.shape == (*LEAD, K)
    assert_same_bits(out, lowbit.quantized_activation(x_op, activation_type, xq,
                                                      ClampedSwigluParams(kw["limit"], kw["alpha"])))
    assert_dequantized_close(out, y)

    gq = quantizer(recipe, "dgrad", jnp.max(jnp.abs(ref_dx)))
    dx, dbias = quantize_dact_dbias(dz, x, activation_type, True, gq, params)
    assert isinstance(dx, ScaledTensor2x) and dx.shape == x.shape
    if recipe == "delayed":  # lowbit.layernorm_mlp's fused backward (flattened copies here)
        g = act_backward(dz, x_op, act_type, **kw, quant_scale=gq.scale, quant_dtype=gq.q_dtype,
                         rowwise=True, colwise=True, compute_dbias=True)
        want = (fused_2x(gq, g.q_rowwise.reshape(x.shape),
                         g.q_colwise.reshape(*x.shape[-2:], *LEAD), g.amax, dtype, len(LEAD)),
                g.dbias.reshape(x.shape[-2:]))
    else:
        g = act_backward(dz, x_op, act_type, **kw)
        want = gq.quantize(g.dx.reshape(x.shape), is_rowwise=True, is_colwise=True,
                           flatten_axis=len(LEAD), compute_dbias=True)
    assert_same_bits((dx, dbias), want)
    assert dbias.shape == (len(activation_type), K) and dbias.dtype == dtype
    assert_dequantized_close(dx, ref_dx)
    assert_close(dbias, ref_dbias, dtype, scale=np.abs(ref_dbias) + row_abs)
    # dact_lu: the same copies, no dbias computed
    assert_same_bits(dact_lu(dz, x, activation_type, gq, params), dx)
    no_dbias = quantize_dact_dbias(dz, x, activation_type, False, gq, params)
    assert no_dbias[1] is None
    assert_same_bits(no_dbias[0], dx)


@pytest.mark.parametrize("layout", [QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE])
@pytest.mark.parametrize("mode", [ScalingMode.DELAYED_TENSOR_SCALING,
                                  ScalingMode.CURRENT_TENSOR_SCALING, ScalingMode.MXFP8_1D_SCALING])
@pytest.mark.parametrize("activation_type", [("silu",), ("gelu", "linear")], ids="-".join)
def test_single_copy_layout_returns_that_copy(activation_type, mode, layout, rng):
    x, dz = make(rng, activation_type, np.float32, lead=(2, 33))
    colwise = layout == QuantizeLayout.COLWISE
    one = QuantizerFactory.create(mode, jnp.float8_e4m3fn, q_layout=layout)
    two = QuantizerFactory.create(mode, jnp.float8_e4m3fn)
    if mode == ScalingMode.DELAYED_TENSOR_SCALING:
        one, two = (q.update(jnp.array([3.0], jnp.float32)) for q in (one, two))

    out = act_lu(x, activation_type, one)
    assert isinstance(out, ScaledTensor1x) and out.is_colwise == colwise
    assert_same_bits(out, act_lu(x, activation_type, two).get_tensor(colwise=colwise))
    dx, dbias = quantize_dact_dbias(dz, x, activation_type, True, one)
    assert isinstance(dx, ScaledTensor1x) and dx.is_colwise == colwise
    want_dx, want_dbias = quantize_dact_dbias(dz, x, activation_type, True, two)
    assert_same_bits((dx, dbias), (want_dx.get_tensor(colwise=colwise), want_dbias))


# ---------------------------------------------------------------- jit, inputs, keywords


@pytest.mark.parametrize("recipe", [None, "delayed", "mxfp8"])
def test_jit(recipe, rng):
    activation_type = ("silu", "linear")
    x, dz = make(rng, activation_type, np.float32)
    xq = gq = None
    if recipe is not None:
        xq, gq = quantizer(recipe, "x", 4.0), quantizer(recipe, "dgrad", 2.0)

    def step(x, dz, xq, gq):
        return (act_lu(x, activation_type, xq),
                quantize_dact_dbias(dz, x, activation_type, True, gq),
                dact_lu(dz, x, activation_type, gq))

    assert_same_bits(jax.jit(step)(x, dz, xq, gq), step(x, dz, xq, gq))


def test_no_scale_tensor_inputs(rng):
    """TE's way to chain them: act_lu's NoScaleTensor output is the next call's input, and a
    NoScaleTensor dz is read as its data."""
    activation_type = ("gelu",)
    x, dz = make(rng, activation_type, ml_dtypes.bfloat16)
    assert_same_bits(act_lu(NoScaleTensor(x), activation_type), act_lu(x, activation_type))
    gq = quantizer("current", "dgrad")
    for q in (None, gq):
        assert_same_bits(quantize_dact_dbias(NoScaleTensor(dz), x, activation_type, True, q),
                         quantize_dact_dbias(dz, x, activation_type, True, q))
        assert_same_bits(dact_lu(NoScaleTensor(dz), NoScaleTensor(x), activation_type, q),
                         dact_lu(dz, x, activation_type, q))
    y = act_lu(x, activation_type)  # (..., K): a dz of x's activation
    assert_same_bits(dact_lu(y, x, activation_type), dact_lu(y.data, x, activation_type))


def test_te_keywords(rng):
    activation_type = ("squared_relu", "linear")
    x, dz = make(rng, activation_type, np.float32)
    q = quantizer("delayed", "x", 8.0)
    same = dict(amax_scope=AmaxScope.LOCAL, transpose_batch_sequence=True,
                output_amax_when_no_scaling=False)
    assert_same_bits(act_lu(x, activation_type, q, **same), act_lu(x, activation_type, q))
    assert_same_bits(quantize_dact_dbias(dz, x, activation_type, True, None, None, **same),
                     quantize_dact_dbias(dz, x, activation_type))
    assert_same_bits(dact_lu(dz, x, activation_type, amax_scope=None, **{
        k: v for k, v in same.items() if k != "amax_scope"}), dact_lu(dz, x, activation_type))

    for name in ("act_lu", "dact_lu", "quantize_dact_dbias"):
        call = {"act_lu": lambda **kw: act_lu(x, activation_type, **kw),
                "dact_lu": lambda **kw: dact_lu(dz, x, activation_type, **kw),
                "quantize_dact_dbias": lambda **kw: quantize_dact_dbias(dz, x, activation_type, **kw)}[name]
        op = f"lowbit.cpp_extensions.{name}"
        for scope in AmaxScope:  # lowbit's one amax rule for every scope (cpp_extensions.amax)
            assert_same_bits(call(amax_scope=scope), call())
        with pytest.raises(TypeError, match=rf"{op}: amax_scope: expected None or a lowbit.cpp_extensions.AmaxScope"):
            call(amax_scope="local")
        with pytest.raises(ValueError, match=rf"{op}: output_amax_when_no_scaling: expected False"):
            call(output_amax_when_no_scaling=True)
        with pytest.raises(TypeError, match=rf"{op}: transpose_batch_sequence: expected a bool"):
            call(transpose_batch_sequence="yes")


def test_activation_params(rng):
    clamped = ("clamped_silu", "clamped_linear")
    p = ActivationParams.create(clamped, limit=3.0, alpha=1.0)
    assert p == ActivationParams(ClampedSwigluParams(3.0, 1.0)) and hash(p) == hash(
        ActivationParams(ClampedSwigluParams(3.0, 1.0)))
    assert ActivationParams.create("clamped_silu", limit=3.0).clamped_swiglu.limit == 3.0
    assert ActivationParams.create(("gelu",), limit=3.0) == ActivationParams()  # TE ignores them
    assert ActivationParams().clamped_swiglu == ClampedSwigluParams(7.0, 1.702)

    x, dz = make(rng, clamped, np.float32)
    # the parameters reach the kernel: lowbit.activation with the same limit / alpha, and
    # not the defaults (x runs past |3|)
    got = act_lu(x, clamped, act_params=p).data
    assert_same_bits(got, lowbit.activation(x, clamped, act_params=ClampedSwigluParams(3.0, 1.0)))
    assert not np.array_equal(f32(got), f32(act_lu(x, clamped).data))
    assert_same_bits(act_lu(x, clamped, act_params=ActivationParams()), act_lu(x, clamped))
    assert_same_bits(act_lu(x, clamped).data, lowbit.activation(x, clamped))
    # jit with the params as a static (hashable) argument
    fn = jax.jit(lambda x, dz, p: dact_lu(dz, x, clamped, act_params=p), static_argnums=2)
    assert_same_bits(fn(x, dz, p), dact_lu(dz, x, clamped, act_params=p))
    # other activations take no parameters, as in TE: odd ones change nothing
    odd = ActivationParams(ClampedSwigluParams(-1.0, 0.0))
    x1, dz1 = make(rng, ("quick_gelu",), np.float32)
    assert_same_bits(act_lu(x1, ("quick_gelu",), act_params=odd), act_lu(x1, ("quick_gelu",)))
    assert_same_bits(quantize_dact_dbias(dz1, x1, ("quick_gelu",), act_params=odd),
                     quantize_dact_dbias(dz1, x1, ("quick_gelu",)))


def test_bad_input_names_the_function_and_argument(rng):
    x1, dz = make(rng, ("gelu",), np.float32)
    x2, _ = make(rng, ("silu", "linear"), np.float32)
    fwd, bwd = "lowbit.cpp_extensions.act_lu", "lowbit.cpp_extensions.quantize_dact_dbias"
    dact = "lowbit.cpp_extensions.dact_lu"
    clamped = ("clamped_silu", "clamped_linear")
    cases = [
        (ValueError, rf"{fwd}: x: expected shape \(\.\.\., 2, K\) .*got \(3, 37, 1, 160\)",
         lambda: act_lu(x1, ("silu", "linear"))),
        (ValueError, rf"{fwd}: x: expected shape \(\.\.\., 1, K\) .*got \(3, 37, 2, 160\)",
         lambda: act_lu(x2, ("silu",))),
        (ValueError, rf"{bwd}: x: expected shape \(\.\.\., 2, K\)",
         lambda: quantize_dact_dbias(dz, x1, ("gelu", "linear"))),
        (ValueError, rf"{dact}: x: expected shape \(\.\.\., 1, K\)",
         lambda: dact_lu(dz, x2, ("relu",))),
        (ValueError, rf"{fwd}: activation_type: .*got \('gelu2',\)", lambda: act_lu(x1, ("gelu2",))),
        (ValueError, rf"{bwd}: activation_type: .*got \('linear', 'gelu'\)",
         lambda: quantize_dact_dbias(dz, x2, ("linear", "gelu"))),
        (ValueError, rf"{fwd}: activation_type: expected a tuple of names .*got 'gelu'",
         lambda: act_lu(x1, "gelu")),
        (ValueError, rf"{bwd}: lowbit.ops.act_backward: dz: expected float32 of shape \(3, 37, 160\)",
         lambda: quantize_dact_dbias(dz[:, :5], x1, ("gelu",))),
        (ValueError, rf"{dact}: lowbit.ops.act_backward: dz: expected float32",
         lambda: dact_lu(dz.astype(jnp.bfloat16), x1, ("gelu",))),
        (TypeError, rf"{fwd}: quantizer: expected a lowbit.quantize Quantizer",
         lambda: act_lu(x1, ("gelu",), "fp8")),
        (TypeError, rf"{bwd}: quantizer: expected a lowbit.quantize Quantizer",
         lambda: quantize_dact_dbias(dz, x1, ("gelu",), True, "fp8")),
        (TypeError, rf"{fwd}: act_params: expected None or an ActivationParams",
         lambda: act_lu(x2, clamped, act_params=ClampedSwigluParams())),
        (ValueError, rf"{fwd}: lowbit.ops.act_forward: limit: expected a finite value >= 0",
         lambda: act_lu(x2, clamped, act_params=ActivationParams(ClampedSwigluParams(-1.0)))),
        (TypeError, rf"{bwd}: is_dbias: expected a bool", lambda: quantize_dact_dbias(dz, x1, ("gelu",), 1)),
    ]
    for error, pattern, call in cases:
        with pytest.raises(error, match=pattern):
            call()
