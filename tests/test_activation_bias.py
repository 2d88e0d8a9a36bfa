"""The optional bias of lowbit.ops.act_forward / act_backward, and layernorm_mlp's use of it.

Reference: the op with a bias is the op without one on x_b = float32(x) + float32(bias), one
IEEE fp32 add (numpy's, denormals kept) of the widened values. For fp32 x that is the op on
x + bias, bit for bit in every output (y / dx, q_rowwise, q_colwise, amax, dbias); for
bf16/f16 x it is the fp32 op on the unrounded sum, its y / dx / dbias rounded once to x's
dtype and its codes and amax unchanged. The CUDA kernels (tests marked gpu) equal the CPU
reference bit for bit, dbias but for its summation order (test_activation_ops.py).
layernorm_mlp with fp32 h gives the bits of the previous formula (the GEMM adds the bias,
then the activation) and hands the bias to the activation kernels.
"""

from __future__ import annotations

import importlib

import jax
import jax.extend  # noqa: F401  (jaxprs_in_params)
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from jax.sharding import NamedSharding, PartitionSpec as P
from activation_reference import DTYPES, TYPES, act_ref, assert_dbias_close, make_x
from quantize_reference import assert_dbias_close as assert_quantize_dbias_close

import lowbit
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8CurrentScaling

lmlp = importlib.import_module("lowbit.layernorm_mlp")  # the module (lowbit.layernorm_mlp is the function)


def make_bias(rng, x, gated, scale=1.0):
    shape = x.shape[-2:] if gated else x.shape[-1:]
    return (rng.standard_normal(shape) * scale).astype(x.dtype)


def widened_sum(x, bias):
    """float32(x) + float32(bias), broadcast over the rows: numpy's IEEE fp32 add."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32) + np.asarray(bias, np.float32)


def put_specials(rng, x, bias):
    """inf, NaN, zeros (both signs) and near-max values in x and in the bias (in place)."""
    big = float(np.finfo(np.float32).max if x.dtype == np.float32 else
                (65000.0 if x.dtype == np.float16 else 3.0e38))
    for arr, vals in ((x, [np.inf, -np.inf, np.nan, 0.0, -0.0, big, -big, 500.0]),
                      (bias, [np.nan, np.inf, -0.0, 0.0, big, -big])):
        flat = arr.reshape(-1)
        n = min(len(vals), flat.size)
        flat[rng.choice(flat.size, n, replace=False)] = np.asarray(vals[:n]).astype(arr.dtype)


def fwd_bwd(act, gated, scale, colwise, rowwise=True, quant=True, bias_given=True):
    s = np.float32(scale) if quant else None

    def f(dz, x, bias):
        b = bias if bias_given else None
        fw = lowbit.ops.act_forward(x, act, gated=gated, quant_scale=s, rowwise=rowwise,
                                    colwise=colwise, bias=b)
        bw = lowbit.ops.act_backward(dz, x, act, gated=gated, quant_scale=s, rowwise=rowwise,
                                     colwise=colwise, compute_dbias=True, bias=b)
        return fw, bw
    return f


def bits(a):
    return None if a is None else np.asarray(a).view(np.uint8)


def assert_same(got, want, what):
    for name in got._fields:
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), f"{what} {name}"
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {name}"
            np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{what} {name}")


def rounded(out, dtype):
    """The fp32 op's outputs as the dtype op gives them: y / dx / dbias rounded once."""
    with np.errstate(over="ignore"):
        return out._replace(**{k: np.asarray(getattr(out, k)).astype(dtype)
                               for k in ("y", "dx", "dbias") if k in out._fields
                               and getattr(out, k) is not None})


SHAPES = [(1, 1), (3, 7), (2, 3, 129), (257, 136)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,gated", TYPES, ids=str)
def test_bias_is_the_widened_sum(act, gated, dtype, shape, rng):
    x = make_x(rng, shape, gated, dtype)
    bias = make_bias(rng, x, gated, 2.0)
    put_specials(rng, x, bias)
    dz = rng.standard_normal(shape).astype(dtype)
    xb = widened_sum(x, bias)
    f = jax.jit(fwd_bwd(act, gated, 8.0, colwise=True))
    got = f(dz, x, bias)
    want = jax.jit(fwd_bwd(act, gated, 8.0, colwise=True, bias_given=False))(
        dz.astype(np.float32), xb, xb)  # the fp32 op on the sum (its 3rd operand unused)
    if dtype != np.float32 and jax.default_backend() != "cpu":
        # The CUDA kernels of bf16/f16 and of fp32 sum dbias's tiles in different orders: the
        # dtype op's dbias is the fp32 sum rounded once to the dtype, within the reordering.
        # Overflow depends on the order too (the planted near-max values): a column may be inf
        # on one side and finite, or NaN (inf - inf), on the other only where its terms can sum
        # past the dtype's max (quantize_reference.assert_dbias_close; the terms are the fp32
        # op's dx, which its dbias sums).
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.asarray(want[1].dbias, np.float32).astype(dtype)
        terms = np.asarray(want[1].dx, np.float32).reshape(-1, w.shape[-1])
        assert_quantize_dbias_close(np.asarray(got[1].dbias), w, terms, 1)
        got = (got[0], got[1]._replace(dbias=None))
        want = (want[0], want[1]._replace(dbias=None))
    for g, w, what in zip(got, want, ("forward", "backward")):
        assert_same(g, rounded(w, dtype) if dtype != np.float32 else w, what)


@pytest.mark.parametrize("rowwise,colwise,quant", [(True, False, True), (False, True, True),
                                                  (True, True, False)], ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_bias_quantization_choices(rowwise, colwise, quant, gated, rng):
    x = make_x(rng, (2, 5, 77), gated, np.float32)
    bias = make_bias(rng, x, gated)
    dz = rng.standard_normal((2, 5, 77)).astype(np.float32)
    kw = dict(rowwise=rowwise, colwise=colwise, quant=quant)
    got = jax.jit(fwd_bwd("silu", gated, 2.0, **kw))(dz, x, bias)
    want = jax.jit(fwd_bwd("silu", gated, 2.0, bias_given=False, **kw))(dz, widened_sum(x, bias), x)
    for g, w, what in zip(got, want, ("forward", "backward")):
        assert_same(g, w, what)


@pytest.mark.parametrize("act,gated", [("gelu", False), ("clamped_silu", True), ("relu", True)], ids=str)
def test_bias_against_jnp_reference(act, gated, rng):
    # The few-line jnp reference of test_activation_ops on x + bias (within its tolerance).
    x = make_x(rng, (33, 65), gated, np.float32)
    bias = make_bias(rng, x, gated)
    y = lowbit.ops.act_forward(x, act, gated=gated, bias=bias).y
    np.testing.assert_allclose(y, act_ref(x + bias, act, gated), rtol=2e-6, atol=1e-6)
    dz = rng.standard_normal((33, 65)).astype(np.float32)
    out = lowbit.ops.act_backward(dz, x, act, gated=gated, bias=bias, compute_dbias=True,
                                  keep_dims=True)
    _, vjp = jax.vjp(lambda v: act_ref(v, act, gated), jnp.asarray(x + bias))
    (want,) = vjp(jnp.asarray(dz))
    np.testing.assert_allclose(out.dx, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.dbias, np.sum(want, axis=0), rtol=1e-4, atol=1e-4)


def test_bias_keep_dims_and_vmap(rng):
    x = make_x(rng, (3, 4, 40), True, ml_dtypes.bfloat16)  # (3, 4, 2, 40)
    bias = make_bias(rng, x, True)
    dz = rng.standard_normal((3, 4, 40)).astype(ml_dtypes.bfloat16)
    s = np.float32(4.0)
    f = lambda d, v, b: (  # noqa: E731
        lowbit.ops.act_forward(v, "silu", gated=True, quant_scale=s, colwise=True, keep_dims=True, bias=b),
        lowbit.ops.act_backward(d, v, "silu", gated=True, quant_scale=s, colwise=True,
                                compute_dbias=True, keep_dims=True, bias=b))
    got = jax.jit(f)(dz, x, bias)
    assert got[1].dbias.shape == (2, 40) and got[0].q_colwise.shape == (40, 3, 4)
    # vmap over the rows' first dim, the bias shared, then a batched bias.
    mapped = jax.jit(jax.vmap(f, in_axes=(0, 0, None)))(dz, x, bias)
    for i in range(3):
        one = f(dz[i], x[i], bias)
        for g, w in zip(jax.tree.leaves(mapped), jax.tree.leaves(one)):
            np.testing.assert_array_equal(bits(g[i]), bits(w))
    biases = np.stack([bias, bias * 2, -bias])
    mapped = jax.jit(jax.vmap(f, in_axes=(None, None, 0)))(dz[0], x[0], biases)
    for i in range(3):
        one = f(dz[0], x[0], biases[i])
        for g, w in zip(jax.tree.leaves(mapped), jax.tree.leaves(one)):
            np.testing.assert_array_equal(bits(g[i]), bits(w))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("spec", [P("a", "b"), P(None, "b"), P(("a", "b"), None)], ids=str)
@pytest.mark.parametrize("keep_dims", [False, True])
def test_bias_sharded_equals_unsharded(gated, spec, keep_dims, rng):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x = make_x(rng, (16, 64), gated, np.float32)
    bias = make_bias(rng, x, gated)
    dz = rng.standard_normal((16, 64)).astype(np.float32)
    xspec = P(spec[0], None, spec[1]) if gated else spec
    bspec = P(None, spec[1]) if gated else P(spec[1])
    xs = jax.device_put(x, NamedSharding(mesh, xspec))
    bs = jax.device_put(bias, NamedSharding(mesh, bspec))
    dzs = jax.device_put(dz, NamedSharding(mesh, spec))
    s = np.float32(8.0)

    def f(d, v, b):
        fw = lowbit.ops.act_forward(v, "silu", gated=gated, quant_scale=s, colwise=True,
                                    keep_dims=keep_dims, bias=b)
        bw = lowbit.ops.act_backward(d, v, "silu", gated=gated, quant_scale=s, colwise=True,
                                     compute_dbias=True, keep_dims=keep_dims, bias=b)
        return fw, bw

    with jax.default_device(jax.devices("cpu")[0]):
        want = f(dz, x, bias)
    got = jax.jit(f)(dzs, xs, bs)
    for name, g, w in zip(("y", "qr", "qc", "amax", "dx", "qr", "qc", "amax", "dbias"),
                          jax.tree.leaves(got), jax.tree.leaves(want)):
        if name == "dbias":  # partial sums in another order
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)


def test_bias_bad_input():
    x = np.ones((4, 8), np.float32)
    xg = np.ones((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"lowbit.ops.act_forward: bias: expected float32 of shape \(8,\)"):
        lowbit.ops.act_forward(x, "gelu", bias=np.ones(7, np.float32))
    with pytest.raises(ValueError, match="lowbit.ops.act_forward: bias: expected float32"):
        lowbit.ops.act_forward(x, "gelu", bias=np.ones(8, ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"lowbit.ops.act_backward: bias: expected float32 of shape \(2, 8\)"):
        lowbit.ops.act_backward(x, xg, "gelu", gated=True, bias=np.ones(16, np.float32))
    with pytest.raises(ValueError, match="lowbit.ops.act_backward: bias"):
        lowbit.ops.act_backward(x, x, "gelu", bias=np.ones((1, 8), np.float32))


# ---------------------------------------------------------------- layernorm_mlp


def _mlp_params(rng, n_act, dtype=np.float32, h=64, f=96):
    x = jnp.asarray(rng.standard_normal((2, 24, h)) * 2 + 0.5, dtype)
    gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(h), dtype)
    beta = jnp.asarray(0.1 * rng.standard_normal(h), dtype)
    wi = jnp.asarray(rng.standard_normal((h, n_act, f)) / np.sqrt(h), dtype)
    wo = jnp.asarray(rng.standard_normal((f, h)) / np.sqrt(f), dtype)
    bi = jnp.asarray(0.5 * rng.standard_normal((n_act, f)), dtype)
    bo = jnp.asarray(0.1 * rng.standard_normal(h), dtype)
    return x, gamma, beta, wi, wo, bi, bo


def _mlp(activation_type):
    def f(args, qsets):
        x, gamma, beta, wi, wo, bi, bo = args
        return lowbit.layernorm_mlp(x, gamma, beta, (wi, wo), (bi, bo), "layernorm",
                                    activation_type=activation_type, quantizer_sets=qsets)
    return f


def _value_and_grads(f, args, qsets, dy):
    y, vjp = jax.vjp(f, args, qsets)
    return y, vjp(dy)


@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")], ids=str)
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_layernorm_mlp_bias_in_activation_same_bits(activation_type, recipe, rng, monkeypatch):
    args = _mlp_params(rng, len(activation_type))
    qsets = QuantizerFactory.create_set(recipe, n_quantizer_sets=2)
    dy = jnp.asarray(rng.standard_normal(args[0].shape), jnp.float32)
    f = _mlp(activation_type)
    if isinstance(recipe, DelayedScaling):  # a step first: amax-derived scales, not 1
        qsets = jax.jit(lambda a, q: _value_and_grads(f, a, q, dy)[1][1])(args, qsets)
    new = jax.jit(lambda a, q: _value_and_grads(f, a, q, dy))(args, qsets)
    monkeypatch.setattr(lmlp, "BIAS_IN_ACTIVATION", False)  # the GEMM adds the bias
    old = jax.jit(lambda a, q: _value_and_grads(f, a, q, dy))(args, qsets)
    leaves_new, leaves_old = jax.tree.leaves(new), jax.tree.leaves(old)
    assert len(leaves_new) == len(leaves_old)
    for i, (a, b) in enumerate(zip(leaves_new, leaves_old)):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i}")


def _act_bias_operands(f, args, qsets, dy):
    """The bias operands (shapes) of the activation primitives in jit(vjp(f))'s jaxpr."""
    jaxpr = jax.make_jaxpr(lambda a, q: _value_and_grads(f, a, q, dy))(args, qsets)
    found = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name in ("lowbit_act_forward", "lowbit_act_backward"):
                bias = eqn.invars[1 if eqn.primitive.name == "lowbit_act_forward" else 2]  # after x
                found.append((eqn.primitive.name, tuple(bias.aval.shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("dtype,bias_in_act", [(np.float32, True), (jnp.bfloat16, False)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")], ids=str)
def test_layernorm_mlp_passes_bias_to_activation(dtype, bias_in_act, activation_type, rng):
    n_act = len(activation_type)
    args = _mlp_params(rng, n_act, dtype)
    qsets = QuantizerFactory.create_set(DelayedScaling(amax_history_len=4), n_quantizer_sets=2)
    dy = jnp.ones(args[0].shape, dtype)
    found = _act_bias_operands(_mlp(activation_type), args, qsets, dy)
    assert sorted(name for name, _ in found) == ["lowbit_act_backward", "lowbit_act_forward"]
    want = ((2, 96) if n_act == 2 else (96,)) if bias_in_act else (0,)
    assert all(shape == want for _, shape in found), found


# ---------------------------------------------------------------- CUDA == CPU

DTYPE_VARIANTS = [(d, v) for d in DTYPES for v in ("0", "5", "6")] + [(np.float32, v) for v in ("7", "8", "9")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,variant", DTYPE_VARIANTS,
                         ids=lambda v: f"v{v}" if isinstance(v, str) else np.dtype(v).name)
@pytest.mark.parametrize("act,gated", TYPES, ids=str)
@pytest.mark.parametrize("shape", [(4099, 1000), (1, 7), (300, 129), (200, 136), (37, 100)], ids=str)
def test_cuda_bias_equals_cpu(shape, act, gated, dtype, variant, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_ACT_VARIANT", variant)
    x = make_x(rng, shape, gated, dtype, 4.0)
    bias = make_bias(rng, x, gated, 2.0)
    put_specials(rng, x, bias)
    dz = rng.standard_normal(shape).astype(dtype)
    f = fwd_bwd(act, gated, 16.0, colwise=True)
    g, c = run_on(gpu, f, dz, x, bias), run_on(cpu, f, dz, x, bias)
    for name in ("y", "q_rowwise", "q_colwise", "amax"):
        np.testing.assert_array_equal(bits(getattr(g[0], name)), bits(getattr(c[0], name)),
                                      err_msg=f"forward {name}")
    for name in ("dx", "q_rowwise", "q_colwise", "amax"):
        np.testing.assert_array_equal(bits(getattr(g[1], name)), bits(getattr(c[1], name)),
                                      err_msg=f"backward {name}")
    a, b = g[1].dbias.astype(np.float32), c[1].dbias.astype(np.float32)  # summation order
    # Where the column's finite |dx| add up past fp32's max, whether a partial sum overflows
    # (and then meets an opposite inf: NaN) depends on the order: compare only the others.
    dx = c[1].dx.astype(np.float64).reshape(shape[0], -1)
    safe = np.sum(np.where(np.isfinite(dx), np.abs(dx), 0.0), axis=0) < float(np.finfo(np.float32).max)
    assert safe.mean() > 0.5  # the specials leave most columns comparable
    assert_dbias_close(a.reshape(-1)[safe], b.reshape(-1)[safe], shape[0], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,gated", [("gelu", False), ("silu", True)], ids=str)
@pytest.mark.parametrize("return_out", [True, False], ids=["out", "no_out"])
def test_cuda_bias_all_variants_equal_cpu(act, gated, dtype, return_out, rng, cpu, gpu, monkeypatch):
    # Every LOWBIT_ACT_VARIANT (and the defaults, unset) on a tall shape whose blocks loop
    # over several tiles (the bias tile's double buffer), partial in both dimensions, with
    # and without y / dx (layernorm_mlp's calls write none).
    x = make_x(rng, (70001, 264), gated, dtype, 4.0)
    bias = make_bias(rng, x, gated, 2.0)
    x.reshape(-1)[[5, 77777, 123456]] = [np.nan, np.inf, -np.inf]
    dz = rng.standard_normal((70001, 264)).astype(dtype)
    s = np.float32(8)

    def f(d, v, b):
        fw = lowbit.ops.act_forward(v, act, gated=gated, quant_scale=s, colwise=True, bias=b,
                                    return_y=return_out)
        bw = lowbit.ops.act_backward(d, v, act, gated=gated, quant_scale=s, colwise=True,
                                     compute_dbias=True, bias=b, return_dx=return_out)
        return fw, bw

    want = run_on(cpu, f, dz, x, bias)
    for variant in ["", *"0123456789"]:
        monkeypatch.setenv("LOWBIT_ACT_VARIANT", variant)
        got = run_on(gpu, f, dz, x, bias)
        for k, names in enumerate((("y", "q_rowwise", "q_colwise", "amax"), ("dx", "q_rowwise", "q_colwise", "amax"))):
            for name in names:
                a, b = getattr(got[k], name), getattr(want[k], name)
                if b is not None:
                    np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"variant {variant!r} {k} {name}")
        a, b = got[1].dbias.astype(np.float32), want[1].dbias.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        fin = np.isfinite(a) & np.isfinite(b)
        assert np.all(np.abs(a[fin] - b[fin]) <= 1e-4 * np.sqrt(70001) * (1 + np.abs(b[fin])))


@pytest.mark.gpu
@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")], ids=str)
def test_cuda_layernorm_mlp_bias_in_activation_same_bits(activation_type, rng, gpu, monkeypatch):
    # On the GPU the previous formula's bias add is XLA's f32 add on the cuBLASLt output.
    args = _mlp_params(rng, len(activation_type), h=256, f=512)
    qsets = QuantizerFactory.create_set(DelayedScaling(amax_history_len=4), n_quantizer_sets=2)
    dy = jnp.asarray(rng.standard_normal(args[0].shape), jnp.float32)
    f = _mlp(activation_type)
    step = lambda a, q: _value_and_grads(f, a, q, dy)  # noqa: E731
    new = run_on(gpu, step, args, qsets)
    monkeypatch.setattr(lmlp, "BIAS_IN_ACTIVATION", False)
    old = run_on(gpu, step, args, qsets)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(new), jax.tree.leaves(old))):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i}")
