"""lowbit.ops.act_forward / act_backward and lowbit.activation: values and gradients against
a jnp reference, the fused quantization, dbias, jit, vmap, sharding over virtual CPU
devices, bad input, and the CUDA kernels against the CPU ones.

Tolerances: lowbit computes exp with its own fp32 routine (csrc/common/fp32_math.h), the
reference with XLA's, so transcendental activations differ by a few fp32 ulps (rtol 2e-6
plus a small atol near zero crossings); outputs rounded to f16/bf16 then differ by at most
one unit in the last place, and FP8 codes by at most one code (a value next to a rounding
tie). Activations without exp (linear, relu, squared_relu) match bit for bit. CPU and CUDA
run the same formulas and match bit for bit, except dbias (summation order).
"""

from __future__ import annotations

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit

from activation_reference import (DTYPES, EXACT, SHAPES, TYPES, act_ref, assert_codes_close,
                                 assert_dbias_close, assert_y_close, make_x, q_ref)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,gated", TYPES, ids=lambda v: str(v))
def test_forward_matches_reference(act, gated, dtype, shape, rng):
    x = make_x(rng, shape, gated, dtype)
    scale = np.float32(4.0)
    out = jax.jit(lambda v, s: lowbit.ops.act_forward(v, act, gated=gated, quant_scale=s,
                                                      rowwise=True, colwise=True))(x, scale)
    want = act_ref(x, act, gated)
    exact = act in EXACT
    assert out.y.dtype == x.dtype and out.y.shape == shape
    assert_y_close(out.y, want, dtype, exact)
    assert out.q_rowwise.shape == shape and out.q_rowwise.dtype == jnp.float8_e4m3fn
    assert_codes_close(out.q_rowwise, q_ref(want, scale, jnp.float8_e4m3fn), exact)
    rows = int(np.prod(shape[:-1]))
    assert out.q_colwise.shape == (shape[-1], rows)
    np.testing.assert_array_equal(np.asarray(out.q_colwise).view(np.uint8),
                                  np.asarray(out.q_rowwise).reshape(rows, -1).T.view(np.uint8))
    # amax = max |y|: within y's own tolerance of the reference's (a lone large negative x:
    # the tanh reference's gelu underflows to 0 where x sigmoid(2u) gives ~1e-38).
    np.testing.assert_allclose(float(out.amax[0]), float(jnp.max(jnp.abs(want))),
                               rtol=0 if exact else 4e-6, atol=0 if exact else 1e-6)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,gated", TYPES, ids=lambda v: str(v))
def test_forward_special_values_match_reference(act, gated, dtype, rng):
    """inf, -inf, NaN, signed zeros, near-max and large values planted among normal ones: y and
    its FP8 codes against the jnp reference (NaN where it has NaN, its infinities, the rest
    within the tolerances above; codes saturate). Subnormal inputs are left out: XLA's CPU
    flushes them to zero in the reference, where lowbit keeps them
    (test_subnormals_kept_and_nan_canonical)."""
    x = make_x(rng, (37, 64), gated, dtype)
    flat = x.reshape(-1)
    big = float(ml_dtypes.finfo(dtype).max)
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, big, -big, 0.999 * big, 100.0, -100.0, 20.0, -20.0],
                        np.float32)
    flat[rng.choice(flat.size, 3 * specials.size, replace=False)] = np.tile(specials, 3).astype(dtype)
    scale = np.float32(4.0)
    out = jax.jit(lambda v, s: lowbit.ops.act_forward(v, act, gated=gated, quant_scale=s, rowwise=True))(x, scale)
    want = np.asarray(act_ref(x, act, gated), np.float32)
    y = np.asarray(out.y, np.float32)
    want_y = np.asarray(jnp.asarray(want).astype(dtype), np.float32)
    nan = np.isnan(want_y)
    assert nan.any()  # the specials reach the output
    np.testing.assert_array_equal(np.isnan(y), nan)
    inf = np.isinf(want_y)
    np.testing.assert_array_equal(y[inf], want_y[inf])
    fin = np.isfinite(want_y)
    gate = np.asarray(x, np.float32)[..., 1, :][fin] if gated else None
    assert_y_close(y[fin], want[fin], dtype, act in EXACT, gate)
    q, q_want = np.asarray(out.q_rowwise), np.asarray(q_ref(jnp.asarray(want), scale, jnp.float8_e4m3fn))
    q_nan = np.isnan(q_want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(q.astype(np.float32)), q_nan)
    assert_codes_close(q[~q_nan], q_want[~q_nan], act in EXACT)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,gated", TYPES, ids=lambda v: str(v))
def test_backward_matches_vjp(act, gated, dtype, rng):
    shape = (37, 129)
    x = make_x(rng, shape, gated, dtype)
    dz = rng.standard_normal(shape).astype(dtype)
    scale = np.float32(2.0)
    out = jax.jit(lambda d, v, s: lowbit.ops.act_backward(
        d, v, act, gated=gated, quant_scale=s, colwise=True, compute_dbias=True))(dz, x, scale)
    _, vjp = jax.vjp(lambda v: act_ref(v, act, gated), jnp.asarray(x, jnp.float32))
    (want,) = vjp(jnp.asarray(dz, jnp.float32))
    exact = act in EXACT and dtype == np.float32
    assert out.dx.shape == x.shape and out.dx.dtype == x.dtype
    assert_y_close(out.dx, want, dtype, exact)
    cols = 2 * shape[-1] if gated else shape[-1]
    want2d = want.reshape(shape[0], cols)
    assert out.q_rowwise.shape == (shape[0], cols) and out.q_rowwise.dtype == jnp.float8_e5m2
    assert_codes_close(out.q_rowwise, q_ref(want2d, scale, jnp.float8_e5m2), exact)
    np.testing.assert_array_equal(np.asarray(out.q_colwise).view(np.uint8),
                                  np.asarray(out.q_rowwise).T.view(np.uint8))
    np.testing.assert_allclose(float(out.amax[0]), float(jnp.max(jnp.abs(want))), rtol=1e-5)
    assert out.dbias.shape == (cols,)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(out.dbias, np.float32).reshape(-1),
                               np.asarray(jnp.sum(want2d, axis=0)), rtol=max(eps, 1e-5), atol=1e-4)


def test_clamped_swiglu_limit_alpha(rng):
    x = (rng.standard_normal((16, 2, 33)) * 6).astype(np.float32)
    out = lowbit.ops.act_forward(x, "clamped_silu", gated=True, limit=3.0, alpha=1.0)
    np.testing.assert_allclose(out.y, act_ref(x, "clamped_silu", True, 3.0, 1.0), rtol=2e-6, atol=1e-6)
    dz = np.ones((16, 33), np.float32)
    dx = lowbit.ops.act_backward(dz, x, "clamped_silu", gated=True, limit=3.0, alpha=1.0).dx
    assert np.all(np.asarray(dx)[:, 0][x[:, 0] > 3.0] == 0)
    assert np.all(np.asarray(dx)[:, 1][np.abs(x[:, 1]) > 3.0] == 0)


TE_TYPES = [("gelu",), ("silu",), ("relu",), ("quick_gelu",), ("squared_relu",), ("linear",),
            ("gelu", "linear"), ("silu", "linear"), ("relu", "linear"), ("quick_gelu", "linear"),
            ("squared_relu", "linear"), ("clamped_silu", "clamped_linear")]


@pytest.mark.parametrize("activation_type", TE_TYPES, ids=str)
def test_public_activation_grads(activation_type, rng):
    gated = len(activation_type) == 2
    x = make_x(rng, (5, 24), gated, np.float32, 1.5)
    # Away from the relu kinks by more than check_grads' finite-difference step (eps = 1e-2
    # times a standard normal per element, under 0.05 here): nearer ones make the numeric
    # derivative straddle the kink. Its default eps, 1e-4, is too short for fp32: outputs
    # up to ~30 (clamped_silu) lose ~30 * 2^-24 / 1e-4 per element to rounding, and one
    # seed in several hundred put the projection past 2e-2.
    x = np.where(np.abs(x) < 0.25, np.sign(x) * 0.25 + (x == 0) * 0.25, x).astype(np.float32)
    f = lambda v: lowbit.activation(v, activation_type)  # noqa: E731
    act = "clamped_silu" if activation_type[0] == "clamped_silu" else activation_type[0]
    np.testing.assert_allclose(jax.jit(f)(x), act_ref(x, act, gated), rtol=2e-6, atol=1e-6)
    jax.test_util.check_grads(f, (x,), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)
    g = jax.grad(lambda v: jnp.sum(f(v) * jnp.arange(24.0)))(x)
    g_ref = jax.grad(lambda v: jnp.sum(act_ref(v, act, gated) * jnp.arange(24.0)))(x)
    np.testing.assert_allclose(g, g_ref, rtol=3e-5, atol=3e-5)


def test_public_activation_te_layout_and_quantizer(rng):
    x = rng.standard_normal((4, 1, 16)).astype(np.float32)
    np.testing.assert_allclose(lowbit.activation(x, ("gelu",)), act_ref(x[:, 0], "gelu"), rtol=2e-6)
    from lowbit.quantize.quantizer import DelayedScaleQuantizer

    q = DelayedScaleQuantizer(q_dtype=jnp.float8_e4m3fn)
    t = lowbit.quantized_activation(x, ("gelu",), q)
    np.testing.assert_allclose(np.asarray(t.dequantize(), np.float32), act_ref(x[:, 0], "gelu"),
                               rtol=0.07, atol=1e-2)
    with pytest.raises(TypeError, match="lowbit.activation: quantizer"):
        lowbit.activation(x, ("gelu",), quantizer=object())
    with pytest.raises(TypeError, match="lowbit.quantized_activation: quantizer"):
        lowbit.quantized_activation(x, ("gelu",), None)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "geglu"])
@pytest.mark.parametrize("kind", ["delayed", "current", "mxfp8"])
def test_public_activation_with_quantizer_is_te_fake_quant(kind, gated, rng):
    """With a quantizer, lowbit.activation returns the quantized activation dequantized to x's
    dtype and shape (TE's activation): the values of quantized_activation's ScaledTensor,
    those of the quantizer applied to the activation (current scaling and MXFP8: the same
    bits; delayed scaling codes the fp32 activation in its fused kernel, so within one FP8
    step of it), and the unquantized activation's gradient (straight through the quantize);
    the quantizer's own cotangent is zero."""
    from lowbit.quantize.quantizer import BlockScaleQuantizer, CurrentScaleQuantizer, DelayedScaleQuantizer
    from lowbit.quantize.scaling_modes import ScalingMode

    acts = ("gelu", "linear") if gated else ("gelu",)
    x = jnp.asarray(rng.standard_normal((3, 5, 2 if gated else 1, 64)) * 2, jnp.bfloat16)
    q = {"delayed": DelayedScaleQuantizer(q_dtype=jnp.float8_e4m3fn, scale=jnp.full((1,), 4.0, jnp.float32)),
         "current": CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn),
         "mxfp8": BlockScaleQuantizer(mode=ScalingMode.MXFP8_1D_SCALING, q_dtype=jnp.float8_e4m3fn)}[kind]
    y = jax.jit(lambda v, qq: lowbit.activation(v, acts, qq))(x, q)
    plain = lowbit.activation(x, acts)
    assert y.shape == plain.shape == (3, 5, 64) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits_of(y), bits_of(lowbit.quantized_activation(x, acts, q).dequantize()))
    if kind != "delayed":
        want = q.quantize(plain, is_rowwise=True, is_colwise=False)[0].dequantize()
        np.testing.assert_array_equal(bits_of(y), bits_of(want))
    else:  # fp32 activation coded at scale 4 (max 112: no clipping): half an E4M3 step (2^-4 relative) + bf16 rounding
        a = np.asarray(plain, np.float32)
        assert np.all(np.abs(np.asarray(y, np.float32) - a) <= np.abs(a) * (2.0**-4 + 2.0**-8) + 2.0**-9 / 4 + 1e-6)
        assert np.any(np.asarray(y) != np.asarray(plain))  # it is quantized
    w = jnp.asarray(rng.standard_normal((64,)), jnp.float32)
    loss = lambda v, qq: jnp.sum(lowbit.activation(v, acts, qq).astype(jnp.float32) * w)  # noqa: E731
    dx, dq = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, q)
    dx0 = jax.grad(lambda v: jnp.sum(plain_fn(v, acts).astype(jnp.float32) * w))(x)
    np.testing.assert_array_equal(bits_of(dx), bits_of(dx0))
    assert np.any(np.asarray(dx, np.float32) != 0)
    for leaf in jax.tree.leaves(dq):
        assert not np.any(np.asarray(leaf))


def plain_fn(v, acts):
    return lowbit.activation(v, acts)


def bits_of(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def test_no_quantization_and_outputs_off(rng):
    x = make_x(rng, (9, 40), True, ml_dtypes.bfloat16)
    out = lowbit.ops.act_forward(x, "silu", gated=True)
    assert out.q_rowwise is None and out.q_colwise is None and out.amax is None
    q = lowbit.ops.act_forward(x, "silu", gated=True, quant_scale=np.float32(1), rowwise=False,
                               colwise=True, return_y=False)
    assert q.y is None and q.q_rowwise is None and q.q_colwise.shape == (40, 9)
    b = lowbit.ops.act_backward(np.ones((9, 40), ml_dtypes.bfloat16), x, "silu", gated=True,
                                compute_dbias=True, return_dx=False)
    assert b.dx is None and b.dbias.shape == (80,)


def test_vmap_keeps_per_example_amax(rng):
    x = make_x(rng, (3, 5, 64), False, np.float32)
    x[1] *= 10
    f = lambda v: lowbit.ops.act_forward(v, "gelu", quant_scale=np.float32(1.0), colwise=True)  # noqa: E731
    out = jax.jit(jax.vmap(f))(x)
    for i in range(3):
        one = f(x[i])
        np.testing.assert_array_equal(out.y[i], one.y)
        np.testing.assert_array_equal(out.amax[i], one.amax)
        np.testing.assert_array_equal(np.asarray(out.q_colwise[i]).view(np.uint8),
                                      np.asarray(one.q_colwise).view(np.uint8))
    gb = jax.vmap(lambda d, v: lowbit.ops.act_backward(d, v, "silu", compute_dbias=True).dbias)(x, x)
    for i in range(3):
        np.testing.assert_array_equal(gb[i], lowbit.ops.act_backward(x[i], x[i], "silu", compute_dbias=True).dbias)
    gv = jax.vmap(jax.grad(lambda v: jnp.sum(lowbit.activation(v, ("silu",)))))(x)
    np.testing.assert_allclose(gv, jax.grad(lambda v: jnp.sum(act_ref(v, "silu")))(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("spec", [P("a", "b"), P("a", None), P(None, "b"), P(("a", "b"), None)], ids=str)
def test_sharded_equals_unsharded(gated, spec, rng):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x = make_x(rng, (16, 64), gated, np.float32)
    dz = rng.standard_normal((16, 64)).astype(np.float32)
    xspec = P(spec[0], None, spec[1]) if gated else spec
    xs = jax.device_put(x, NamedSharding(mesh, xspec))
    dzs = jax.device_put(dz, NamedSharding(mesh, spec))
    s = np.float32(8.0)

    def f(d, v):
        fw = lowbit.ops.act_forward(v, "silu", gated=gated, quant_scale=s, colwise=True)
        bw = lowbit.ops.act_backward(d, v, "silu", gated=gated, quant_scale=s, colwise=True,
                                     compute_dbias=True)
        return fw, bw

    with jax.default_device(jax.devices("cpu")[0]):  # the reference on the CPU too (not a GPU)
        want = f(dz, x)
    got = jax.jit(f)(dzs, xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if g.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
        elif g.shape == (128,) or g.shape == (64,):  # dbias: partial sums in another order
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(g, w)
    assert "lowbit_act_forward" in jax.jit(f).lower(dzs, xs).compile().as_text()


def test_bad_input():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="lowbit.ops.act_forward: act_type"):
        lowbit.ops.act_forward(x, "tanh")
    with pytest.raises(ValueError, match="act_type: 'clamped_silu'"):
        lowbit.ops.act_forward(x, "clamped_silu")
    with pytest.raises(ValueError, match=r"act_forward: x: gated activations take shape \(\.\.\., 2, H\)"):
        lowbit.ops.act_forward(x, "gelu", gated=True)
    with pytest.raises(TypeError, match="act_forward: x: expected float32, float16 or bfloat16"):
        lowbit.ops.act_forward(np.ones((4, 8), np.int32), "gelu")
    with pytest.raises(TypeError, match="act_forward: quant_dtype"):
        lowbit.ops.act_forward(x, "gelu", quant_scale=np.float32(1), quant_dtype=jnp.int8)
    with pytest.raises(ValueError, match="lowbit.ops.act_backward: dz: expected float32 of shape"):
        lowbit.ops.act_backward(np.ones((4, 7), np.float32), x, "gelu")
    with pytest.raises(TypeError, match="act_backward: quant_scale"):
        lowbit.ops.act_backward(x, x, "gelu", quant_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="lowbit.activation: activation_type"):
        lowbit.activation(x, ("gelu", "gelu"))


# (dtype, LOWBIT_ACT_VARIANT): 64- / 128- / 256-row tiles for every dtype; for fp32 also the
# chunk-row kernels (activation.cu: 7 / 8 = 2 chunk rows with 256- / 128-row tiles, 9 = 4
# with 256; other dtypes run 7-9 as 6 / 5 / 6).
DTYPE_VARIANTS = [(d, v) for d in DTYPES for v in ("0", "5", "6")] + [(np.float32, v) for v in ("7", "8", "9")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,variant", DTYPE_VARIANTS, ids=lambda v: f"v{v}" if isinstance(v, str) else np.dtype(v).name)
@pytest.mark.parametrize("act,gated", TYPES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", [(4099, 1000), (64, 8192), (1, 7), (300, 129), (200, 136), (37, 100)], ids=str)
def test_cuda_equals_cpu(shape, act, gated, dtype, variant, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_ACT_VARIANT", variant)  # activation.cu: tile height, chunk rows
    x = make_x(rng, shape, gated, dtype, 4.0)
    flat = x.reshape(-1)
    special = [np.inf, -np.inf, np.nan, 0, 500, -500]
    if dtype == np.float32:
        special += [3e38, -3e38, -np.nan]  # near the fp32 maximum; a NaN with its sign set
    n = min(len(special), flat.size)
    flat[rng.choice(flat.size, n, replace=False)] = special[:n]
    dz = rng.standard_normal(shape).astype(dtype)
    s = np.float32(16.0)

    def f(d, v):
        fw = lowbit.ops.act_forward(v, act, gated=gated, quant_scale=s, colwise=True)
        bw = lowbit.ops.act_backward(d, v, act, gated=gated, quant_scale=s, colwise=True,
                                     compute_dbias=True)
        return fw, bw

    g, c = run_on(gpu, f, dz, x), run_on(cpu, f, dz, x)
    for name in ("y", "q_rowwise", "q_colwise", "amax"):
        a, b = getattr(g[0], name), getattr(c[0], name)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"forward {name}")
    for name in ("dx", "q_rowwise", "q_colwise", "amax"):
        a, b = getattr(g[1], name), getattr(c[1], name)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"backward {name}")
    assert_dbias_close(g[1].dbias.astype(np.float32), c[1].dbias.astype(np.float32), shape[0], dtype)


@pytest.mark.gpu
def test_cuda_unaligned_and_3d(rng, cpu, gpu):
    x = rng.standard_normal((3, 101, 2, 77)).astype(ml_dtypes.bfloat16)
    f = lambda v: lowbit.ops.act_forward(v[1:], "gelu", gated=True, quant_scale=np.float32(2), colwise=True)  # noqa: E731
    for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,variant", [(ml_dtypes.bfloat16, v) for v in ("0", "5", "6")]
                         + [(np.float32, v) for v in ("6", "7", "8", "9")],
                         ids=lambda v: f"v{v}" if isinstance(v, str) else np.dtype(v).name)
@pytest.mark.parametrize("act,gated", [("silu", True), ("gelu", False)], ids=str)
def test_cuda_dbias_deterministic(variant, dtype, act, gated, rng, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_ACT_VARIANT", variant)
    x = make_x(rng, (8192, 512), gated, dtype, 1.0)
    dz = rng.standard_normal((8192, 512)).astype(dtype)
    f = lambda d, v: lowbit.ops.act_backward(d, v, act, gated=gated, compute_dbias=True).dbias  # noqa: E731
    a, b = run_on(gpu, f, dz, x), run_on(gpu, f, dz, x)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_subnormals_kept_and_nan_canonical():
    # As the CUDA kernels: IEEE subnormals even under XLA's CPU FTZ/DAZ, NaN = 0x7FC00000.
    x = np.array([[1e-39, -np.nan, np.nan, -88.0]], np.float32)
    y = np.asarray(lowbit.ops.act_forward(x, "relu").y)
    assert y[0, 0] == np.float32(1e-39)
    assert y[0, 1:3].view(np.uint32).tolist() == [0x7FC00000, 0x7FC00000]
    s = np.asarray(lowbit.ops.act_forward(x, "silu").y)
    assert s[0, 3] != 0  # sigmoid(-88) ~ 6e-39 is subnormal; -88 times it is not


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act,gated", [("gelu", False), ("silu", True)], ids=str)
def test_cuda_variants_equal_cpu(act, gated, dtype, rng, cpu, gpu, monkeypatch):
    # LOWBIT_ACT_VARIANT 0-9 (activation.cu: grid size, cross-tile prefetch, tile height,
    # fp32 chunk rows). 70001 x 264 is 3 tile columns by 1094 / 547 / 274 tile rows of 64 /
    # 128 / 256 rows (822 tiles of 256 rows), more than any variant's grid has blocks, so
    # blocks loop over several tiles (the prefetch of the next tile), with partial tiles in
    # both dimensions (70001 = 273 x 256 + 113: a last pass of 2 or 4 chunk rows is partly
    # in range).
    x = make_x(rng, (70001, 264), gated, dtype, 4.0)
    x.reshape(-1)[[5, 77777, 123456]] = [np.nan, np.inf, -np.inf]
    dz = rng.standard_normal((70001, 264)).astype(dtype)

    def f(d, v):
        fw = lowbit.ops.act_forward(v, act, gated=gated, quant_scale=np.float32(8), colwise=True)
        bw = lowbit.ops.act_backward(d, v, act, gated=gated, quant_scale=np.float32(8), colwise=True,
                                     compute_dbias=True)
        return fw, bw

    want = run_on(cpu, f, dz, x)
    dbias0 = {}  # per tile height: the dbias summation order (the same for any chunk rows)
    for variant in "0123456789":
        monkeypatch.setenv("LOWBIT_ACT_VARIANT", variant)  # read by the launcher at every call
        got = run_on(gpu, f, dz, x)
        for name in ("y", "q_rowwise", "q_colwise", "amax"):
            np.testing.assert_array_equal(getattr(got[0], name).view(np.uint8), getattr(want[0], name).view(np.uint8),
                                          err_msg=f"variant {variant} forward {name}")
        for name in ("dx", "q_rowwise", "q_colwise", "amax"):
            np.testing.assert_array_equal(getattr(got[1], name).view(np.uint8), getattr(want[1], name).view(np.uint8),
                                          err_msg=f"variant {variant} backward {name}")
        a, b = got[1].dbias.astype(np.float32), want[1].dbias.astype(np.float32)  # summation order
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        fin = np.isfinite(a) & np.isfinite(b)
        assert np.all(np.abs(a[fin] - b[fin]) <= 1e-4 * np.sqrt(70001) * (1 + np.abs(b[fin])))
        height = {"5": 128, "8": 128, "6": 256, "7": 256, "9": 256}.get(variant, 64)
        height = 128 if gated and height == 256 else height  # the gated backward's tallest
        dbias0.setdefault(height, got[1].dbias)  # every variant of a tile height: the same bits
        np.testing.assert_array_equal(got[1].dbias.view(np.uint8), dbias0[height].view(np.uint8),
                                      err_msg=f"variant {variant} dbias")
    monkeypatch.setenv("LOWBIT_ACT_VARIANT", "x")
    with pytest.raises(Exception, match="LOWBIT_ACT_VARIANT: expected 0 to 9"):
        run_on(gpu, f, dz, x)
