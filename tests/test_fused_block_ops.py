"""lowbit.ops.act_quantize_block (activation + block quantization in one pass) and its use by
lowbit.activation with block-scaling quantizers: the codes and scales equal the block
quantizers (lowbit.ops.quantize_fp8_block 1x128 / quantize_mxfp8) applied to the fp32
activation, bit for bit, (1) against a numpy activation where that is exact (linear, relu,
squared_relu and their gated forms: one IEEE product at most), (2) against lowbit's own fp32
activation (act_forward on the f32 input, every act type); dequantized close to a jnp
activation; odd shapes with partial tiles, zeros, all-zero blocks, inf/NaN, near-max; jit,
vmap, bad input; the CUDA kernels against the CPU handlers (bit for bit, `gpu` marker).

The exact reference is numpy, not jnp: XLA:CPU flushes subnormals (FTZ/DAZ); numpy's fp32
arithmetic is plain IEEE, as the kernels' is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, rel_err, run_on

import lowbit
from lowbit.ops.activation import act_forward
from lowbit.ops.fused_block import act_quantize_block
from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8

F32 = np.float32
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

TYPES = [("gelu", False), ("silu", False), ("relu", False), ("quick_gelu", False),
         ("squared_relu", False), ("linear", False), ("gelu", True), ("silu", True),
         ("relu", True), ("quick_gelu", True), ("squared_relu", True), ("clamped_silu", True)]
EXACT = [t for t in TYPES if t[0] in ("linear", "relu", "squared_relu")]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
# (kind, out_dtype, pow2_scales)
MODES = [("fp8_block", jnp.float8_e4m3fn, False), ("fp8_block", jnp.float8_e5m2, True),
         ("mxfp8", jnp.float8_e4m3fn, False), ("mxfp8", jnp.float8_e5m2, False)]


def ids(v):
    return np.dtype(v).name if isinstance(v, type) else str(v)


def make_x(rng, lead, h, gated, dtype, scale=3.0):
    """Random values with inf/NaN/zeros/near-max planted, one all-zero row and one all-zero
    128-column (or 32-column) block of activation inputs (so all-zero tiles and blocks)."""
    shape = (*lead, 2, h) if gated else (*lead, h)
    x = np.asarray(random_with_specials(rng, shape, dtype, scale)).astype(F32)
    flat = x.reshape(-1, *shape[len(lead):])
    if flat.shape[0] > 2:
        flat[1] = 0
        flat[: min(64, flat.shape[0]), ..., : min(128, h)] = 0
    return flat.reshape(shape).astype(dtype)


def act_np(x, act_type, gated):
    """fp32 activation in numpy for the exact types (NaN canonical, as the kernels)."""
    x = np.asarray(x).astype(F32)
    a, g = (x[..., 0, :], x[..., 1, :]) if gated else (x, None)
    with np.errstate(all="ignore"):
        r = np.where(np.isnan(a), a, np.where(a > 0, a, F32(0))).astype(F32)
        y = {"linear": a, "relu": r, "squared_relu": (r * r).astype(F32)}[act_type]
        if gated:
            y = (y * g).astype(F32)
    return np.where(np.isnan(y), F32(np.nan), y).astype(F32)


def quantize(y, kind, out_dtype, pow2, rowwise=True, colwise=True):
    """The existing block quantizer of the activation y (lead + (H,)), rows = its lead dims."""
    axis = y.ndim - 1
    if kind == "mxfp8":
        return quantize_mxfp8(y, out_dtype=out_dtype, rowwise=rowwise, colwise=colwise, flatten_axis=axis)
    return quantize_fp8_block(y, out_dtype=out_dtype, pow2_scales=pow2, rowwise=rowwise, colwise=colwise,
                              flatten_axis=axis)


def fused(x, act, gated, kind, out_dtype, pow2, rowwise=True, colwise=True):
    return act_quantize_block(x, act, gated=gated, mxfp8=kind == "mxfp8", out_dtype=out_dtype,
                              pow2_scales=pow2, rowwise=rowwise, colwise=colwise)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_same(got, want, msg=""):
    for name in ("rowwise", "rowwise_scale", "colwise", "colwise_scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if b is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape)
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{msg} {name}")


SHAPES = [((3, 37), 300), ((130,), 128), ((1,), 7), ((257,), 64)]


@pytest.mark.parametrize("mode", MODES, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("act,gated", EXACT, ids=ids)
def test_equals_quantizer_of_numpy_activation(act, gated, dtype, mode, rng):
    for lead, h in SHAPES:
        x = make_x(rng, lead, h, gated, dtype)
        got = jax.jit(lambda v: fused(v, act, gated, *mode))(x)
        assert_same(got, quantize(act_np(x, act, gated), *mode), f"{lead} {h}")


@pytest.mark.parametrize("mode", MODES, ids=ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("act,gated", TYPES, ids=ids)
def test_equals_quantizer_of_fp32_act_forward(act, gated, dtype, mode, rng):
    # act_forward of the f32 input (exact: f16/bf16 -> f32) returns the fp32 activation itself.
    for lead, h in SHAPES[:2]:
        x = make_x(rng, lead, h, gated, dtype)
        y32 = act_forward(jnp.asarray(x).astype(jnp.float32), act, gated=gated).y
        assert_same(fused(x, act, gated, *mode), quantize(y32, *mode), f"{lead} {h}")


@pytest.mark.parametrize("kind", ["fp8_block", "mxfp8"])
@pytest.mark.parametrize("act,gated", [("gelu", False), ("silu", True), ("clamped_silu", True)], ids=ids)
def test_dequantized_close_to_jnp_activation(act, gated, kind, rng):
    x = (rng.standard_normal((70, 2, 300) if gated else (70, 300)) * 3).astype(F32)
    xa, g = (x[:, 0], x[:, 1]) if gated else (x, None)
    with jax.default_matmul_precision("highest"):
        sig = jax.nn.sigmoid
        if act == "gelu":
            y = jax.nn.gelu(xa, approximate=True)
        elif act == "silu":
            y = xa * sig(xa) * g
        else:
            c = jnp.minimum(xa, 7.0)
            y = c * sig(1.702 * c) * (jnp.clip(g, -7.0, 7.0) + 1)
    out = fused(x, act, gated, kind, jnp.float8_e4m3fn, False)
    from lowbit.ops.quantize_block import dequantize_fp8_block, dequantize_mxfp8
    if kind == "mxfp8":
        dq = dequantize_mxfp8(out.rowwise, out.rowwise_scale, out_dtype=jnp.float32)
        dqc = dequantize_mxfp8(out.colwise, out.colwise_scale, colwise=True, out_dtype=jnp.float32)
    else:
        dq = dequantize_fp8_block(out.rowwise, out.rowwise_scale, out_dtype=jnp.float32)
        dqc = dequantize_fp8_block(out.colwise, out.colwise_scale, out_dtype=jnp.float32).T
    assert rel_err(dq, y) < 0.04 and rel_err(dqc, y) < 0.04  # E4M3: 2^-4 relative step


def test_copies_requested_alone_and_3d_lead(rng):
    x = make_x(rng, (2, 5, 3), 200, True, ml_dtypes.bfloat16)
    for mode in MODES:
        both = fused(x, "silu", True, *mode)
        assert both.rowwise.shape == (2, 5, 3, 200)
        assert both.colwise.shape == ((200, 2, 5, 3) if mode[0] == "fp8_block" else (2, 5, 3, 200))
        row = fused(x, "silu", True, *mode, colwise=False)
        col = fused(x, "silu", True, *mode, rowwise=False)
        assert row.colwise is None and col.rowwise is None
        np.testing.assert_array_equal(bits(row.rowwise), bits(both.rowwise))
        np.testing.assert_array_equal(bits(col.colwise_scale), bits(both.colwise_scale))


def test_vmap_quantizes_each_element_alone(rng):
    x = make_x(rng, (3, 40), 160, False, F32)
    f = lambda v: fused(v, "gelu", False, "fp8_block", jnp.float8_e4m3fn, False)  # noqa: E731
    out = jax.vmap(f)(x)
    for i in range(3):
        assert_same(jax.tree.map(lambda a: a[i], out), f(x[i]))


def test_public_activation_with_block_quantizers(rng, monkeypatch):
    """With LOWBIT_FUSED_BLOCK=1, lowbit.quantized_activation takes the fused op; by default
    (the faster path on an H100) the block quantizer of the activation in x's dtype."""
    from lowbit.quantize.quantizer import BlockScaleQuantizer
    from lowbit.quantize.scaling_modes import ScalingMode
    x = make_x(rng, (4, 33), 256, True, ml_dtypes.bfloat16)
    for mode, kind in ((ScalingMode.FP8_BLOCK_1x128, "fp8_block"), (ScalingMode.MXFP8_1D_SCALING, "mxfp8")):
        q = BlockScaleQuantizer(mode=mode, q_dtype=jnp.float8_e4m3fn)
        monkeypatch.delenv("LOWBIT_FUSED_BLOCK", raising=False)
        t = jax.jit(lambda v: lowbit.quantized_activation(v, ("silu", "linear"), q))(x)
        y16 = act_forward(jnp.asarray(x), "silu", gated=True).y
        want16 = quantize(np.asarray(y16), kind, jnp.float8_e4m3fn, False)
        np.testing.assert_array_equal(bits(t.rowwise_tensor.data), bits(want16.rowwise))
        np.testing.assert_array_equal(bits(t.colwise_tensor.scale_inv), bits(want16.colwise_scale))
        monkeypatch.setenv("LOWBIT_FUSED_BLOCK", "1")
        t = jax.jit(lambda v: lowbit.quantized_activation(v, ("silu", "linear"), q))(x)
        want = fused(x, "silu", True, kind, jnp.float8_e4m3fn, False)
        np.testing.assert_array_equal(bits(t.rowwise_tensor.data), bits(want.rowwise))
        np.testing.assert_array_equal(bits(t.colwise_tensor.scale_inv), bits(want.colwise_scale))
        y32 = np.asarray(act_forward(jnp.asarray(x).astype(jnp.float32), "silu", gated=True).y)
        dq = np.asarray(t.dequantize().astype(jnp.float32))
        # Blocks (rowwise: 128 or 32 values of a row) holding a planted inf/NaN are left out:
        # their amax is not finite, so their scale is 1 and a finite near-max value in them
        # saturates to the format's max (a CI seed had 5.5e37 coded as 448: rel_err 1.0), and
        # an MXFP8 NaN block is all NaN. The bit-exact asserts above check those blocks.
        block = 128 if kind == "fp8_block" else 32
        clean = np.isfinite(y32).reshape(-1, y32.shape[-1] // block, block).all(-1)
        ok = np.repeat(clean, block, axis=-1).reshape(y32.shape) & np.isfinite(dq)
        # x has planted near-max values: the other values of such a block are coded under its
        # scale and lose relative precision, a long tail: over 8000 seeds (both formats)
        # median 0.022, 99.9th percentile 0.058, maximum 0.081. A wrong scale or layout gives O(1).
        assert ok.mean() > 0.9 and rel_err(dq[ok], y32[ok]) < 0.12


def test_bad_input():
    x = np.ones((4, 8), F32)
    with pytest.raises(ValueError, match="act_quantize_block: act_type"):
        act_quantize_block(x, "tanh")
    with pytest.raises(ValueError, match="act_quantize_block: x: gated"):
        act_quantize_block(x, "gelu", gated=True)
    with pytest.raises(TypeError, match="act_quantize_block: x"):
        act_quantize_block(np.ones((4, 8), np.int32), "gelu")
    with pytest.raises(TypeError, match="act_quantize_block: out_dtype"):
        act_quantize_block(x, "gelu", out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="act_quantize_block: rowwise/colwise"):
        act_quantize_block(x, "gelu", rowwise=False, colwise=False)
    with pytest.raises(ValueError, match="act_quantize_block: pow2_scales"):
        act_quantize_block(x, "gelu", mxfp8=True, pow2_scales=True)
    with pytest.raises(ValueError, match="act_quantize_block: limit"):
        act_quantize_block(np.ones((4, 2, 8), F32), "clamped_silu", gated=True, limit=-1.0)


# ---------------------------------------------------------------- CUDA == CPU

GPU_SHAPES = [((4099,), 1000), ((64,), 8192), ((1,), 7), ((300,), 129), ((200,), 136), ((2, 65), 77)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("act,gated", TYPES, ids=ids)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_cuda_equals_cpu(shape, act, gated, dtype, rng, cpu, gpu):
    lead, h = shape
    x = make_x(rng, lead, h, gated, dtype, 4.0)
    for i, (mode, (rowwise, colwise)) in enumerate(zip(MODES * 2, [(True, True)] * 4 + [(True, False), (False, True)] * 2)):
        f = lambda v: fused(v, act, gated, *mode, rowwise=rowwise, colwise=colwise)  # noqa: E731
        assert_same(run_on(gpu, f, x), run_on(cpu, f, x), f"{mode} {rowwise} {colwise}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=ids)
def test_cuda_near_max_and_every_bf16_input_equals_cpu(mode, rng, cpu, gpu):
    # Every bf16 bit pattern as activation input (and gate), and values near the fp32 /
    # fp8 limits, through the hardware-cvt and the codec paths.
    every = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256)
    gate = rng.permutation(every.reshape(-1)).reshape(256, 256)
    near = (rng.standard_normal((256, 384)) * 3e38).astype(F32)
    cases = [(every, "linear", False), (every, "gelu", False), (np.stack([every, gate], 1), "silu", True),
             (np.stack([every, gate], 1), "clamped_silu", True), (near, "squared_relu", False), (near, "relu", False)]
    for x, act, gated in cases:
        f = lambda v: fused(v, act, gated, *mode)  # noqa: E731
        assert_same(run_on(gpu, f, x), run_on(cpu, f, x), f"{act} {gated}")


# ---------------------------------------------------------------- norm + block quantization

from lowbit.ops.fused_block import norm_quantize_block, norm_stats  # noqa: E402
from lowbit.ops.norm import norm_forward  # noqa: E402

NORMS = [("layernorm", False), ("layernorm", True), ("rmsnorm", False), ("rmsnorm", True)]


def norm_inputs(rng, lead, h, dtype, gamma_f32, ln):
    x = make_x(rng, lead, h, False, dtype)
    gdt = F32 if gamma_f32 else dtype
    gamma = (rng.standard_normal(h) * 0.5 + 1).astype(gdt)
    beta = rng.standard_normal(h).astype(gdt) if ln else None
    return x, gamma, beta


def canonical(y):
    y = np.asarray(y, F32)
    return np.where(np.isnan(y), F32(np.nan), y).astype(F32)


def norm_fused(x, gamma, beta, mu, rsigma, norm, zc, kind, out_dtype, pow2, rowwise=True, colwise=True):
    return norm_quantize_block(x, gamma, beta, mu, rsigma, norm_type=norm, zero_centered_gamma=zc,
                               mxfp8=kind == "mxfp8", out_dtype=out_dtype, pow2_scales=pow2, rowwise=rowwise,
                               colwise=colwise)


def norm_np(x, gamma, beta, mu, rsigma, zc):
    """csrc/norm/norm_math.h's fp32 y from given statistics in numpy (plain IEEE fp32, every
    operation rounded): ((x - mu) * rsigma) * w (+ beta), w = gamma or 1 + gamma."""
    f = lambda a: np.asarray(a).astype(F32)  # noqa: E731
    w = (F32(1) + f(gamma)).astype(F32) if zc else f(gamma)
    mu = F32(0) if mu is None else f(mu)[..., None]
    with np.errstate(all="ignore"):
        y = (((f(x) - mu).astype(F32) * f(rsigma)[..., None]).astype(F32) * w).astype(F32)
        return y if beta is None else (y + f(beta)).astype(F32)


@pytest.mark.parametrize("mode", MODES, ids=ids)
@pytest.mark.parametrize("gamma_f32", [True, False], ids=["gamma_f32", "gamma_x"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("norm,zc", NORMS, ids=ids)
def test_norm_equals_quantizer_of_norm_forward_fp32(norm, zc, dtype, gamma_f32, mode, rng):
    # With norm_forward's statistics, v is the fp32 y of norm_math.h's formula (of the
    # exactly upcast inputs), NaN canonical: the fused copies are the block quantizer's of that
    # y. On the CPU that y is also norm_forward's on the upcast inputs (same statistics: one
    # computation); CUDA's f32 and 16-bit norm kernels reduce in different orders, so their
    # statistics may differ by an ulp and only the formula is compared there.
    ln = norm == "layernorm"
    for lead, h in SHAPES[:3]:
        x, gamma, beta = norm_inputs(rng, lead, h, dtype, gamma_f32, ln)
        stats = norm_forward(x, gamma, beta, norm_type=norm, zero_centered_gamma=zc)
        y32 = norm_np(x, gamma, beta, stats.mu, stats.rsigma, zc)
        if jax.default_backend() == "cpu":
            f32 = lambda a: None if a is None else jnp.asarray(a).astype(jnp.float32)  # noqa: E731
            fwd = norm_forward(f32(x), f32(gamma), f32(beta), norm_type=norm, zero_centered_gamma=zc).y
            np.testing.assert_array_equal(canonical(fwd).view(np.uint32), canonical(y32).view(np.uint32))
        got = norm_fused(x, gamma, beta, stats.mu, stats.rsigma, norm, zc, *mode)
        assert_same(got, quantize(canonical(y32), *mode), f"{lead} {h}")


def test_norm_stats_equal_norm_forward(rng):
    for norm in ("layernorm", "rmsnorm"):
        x, gamma, beta = norm_inputs(rng, (5, 33), 200, ml_dtypes.bfloat16, True, norm == "layernorm")
        mu, rs = jax.jit(lambda a, g, b: norm_stats(a, g, b, norm_type=norm, epsilon=1e-5))(x, gamma, beta)
        out = norm_forward(x, gamma, beta, norm_type=norm, epsilon=1e-5)
        np.testing.assert_array_equal(bits(rs), bits(out.rsigma))
        assert (mu is None) == (norm == "rmsnorm")
        if mu is not None:
            np.testing.assert_array_equal(bits(mu), bits(out.mu))


@pytest.mark.parametrize("kind", ["fp8_block", "mxfp8"])
def test_norm_dequantized_close_to_jnp_layernorm(kind, rng):
    x = (rng.standard_normal((70, 300)) * 3 + 1).astype(F32)
    gamma, beta = (rng.standard_normal(300) * 0.5 + 1).astype(F32), rng.standard_normal(300).astype(F32)
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * gamma + beta
    st = norm_forward(x, gamma, beta)
    out = norm_fused(x, gamma, beta, st.mu, st.rsigma, "layernorm", False, kind, jnp.float8_e4m3fn, False)
    from lowbit.ops.quantize_block import dequantize_fp8_block, dequantize_mxfp8
    if kind == "mxfp8":
        dq = dequantize_mxfp8(out.colwise, out.colwise_scale, colwise=True, out_dtype=jnp.float32)
    else:
        dq = dequantize_fp8_block(out.colwise, out.colwise_scale, out_dtype=jnp.float32).T
    assert rel_err(dq, y) < 0.04


def test_fused_block_flag_rejects_other_values(monkeypatch):
    from lowbit.ops.fused_block import fused_block_enabled
    monkeypatch.setenv("LOWBIT_FUSED_BLOCK", "yes")
    with pytest.raises(ValueError, match="LOWBIT_FUSED_BLOCK"):
        fused_block_enabled()
    monkeypatch.setenv("LOWBIT_FUSED_BLOCK", "0")
    assert not fused_block_enabled()


def test_layernorm_dense_block_recipes_quantize_the_fp32_norm(rng, monkeypatch):
    """layernorm_dense's fused block path with return_layernorm_output (the statistics launch
    with y): ln is norm_forward's y bit for bit, the copies norm_quantize_block makes from
    those statistics are the block quantizer's of the fp32 norm output (NaN canonical), and
    the output is within FP8 error of ln @ w. (LOWBIT_FUSED_BLOCK=1: the fused path is off by
    default.)"""
    monkeypatch.setenv("LOWBIT_FUSED_BLOCK", "1")
    from lowbit.quantize import QuantizerFactory
    from lowbit.recipe import Float8BlockScaling, MXFP8BlockScaling
    x = (rng.standard_normal((2, 40, 256)) * 2).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((256, 136)) / 16).astype(ml_dtypes.bfloat16)
    gamma, beta = (rng.standard_normal(256) * 0.5 + 1).astype(F32), rng.standard_normal(256).astype(F32)
    for recipe in (Float8BlockScaling, MXFP8BlockScaling):
        qs = QuantizerFactory.create_set(recipe())
        y, ln = jax.jit(lambda a, k: lowbit.layernorm_dense(a, k, gamma, beta, quantizer_set=qs,
                                                             return_layernorm_output=True))(x, w)
        st = norm_forward(x, gamma, beta)
        np.testing.assert_array_equal(bits(ln), bits(st.y))
        xq = norm_fused(x, gamma, beta, st.mu, st.rsigma, "layernorm", False,
                        "mxfp8" if recipe is MXFP8BlockScaling else "fp8_block", qs.x.q_dtype, qs.x.use_power_2_scales
                        and recipe is not MXFP8BlockScaling)
        q32 = quantize(canonical(norm_forward(jnp.asarray(x, jnp.float32), gamma, beta).y),
                       "mxfp8" if recipe is MXFP8BlockScaling else "fp8_block", qs.x.q_dtype,
                       qs.x.use_power_2_scales and recipe is not MXFP8BlockScaling)
        assert_same(xq, q32)
        assert rel_err(np.asarray(y, F32), np.asarray(st.y, F32) @ np.asarray(w, F32)) < 0.05


def test_norm_bad_input(rng):
    x, g, b = np.ones((4, 8), F32), np.ones(8, F32), np.zeros(8, F32)
    mu, rs = np.zeros(4, F32), np.ones(4, F32)
    with pytest.raises(ValueError, match="norm_quantize_block: norm_type"):
        norm_quantize_block(x, g, b, mu, rs, norm_type="batchnorm")
    with pytest.raises(ValueError, match="norm_quantize_block: gamma"):
        norm_quantize_block(x, np.ones(7, F32), b, mu, rs)
    with pytest.raises(ValueError, match="norm_quantize_block: beta/mu"):
        norm_quantize_block(x, g, None, mu, rs)
    with pytest.raises(ValueError, match="norm_quantize_block: beta/mu"):
        norm_quantize_block(x, g, b, mu, rs, norm_type="rmsnorm")
    with pytest.raises(ValueError, match="norm_quantize_block: rsigma"):
        norm_quantize_block(x, g, b, mu, np.ones(5, F32))
    with pytest.raises(ValueError, match="norm_quantize_block: mu"):
        norm_quantize_block(x, g, b, mu.astype(np.float16), rs)
    with pytest.raises(TypeError, match="norm_quantize_block: x"):
        norm_quantize_block(x.astype(np.int32), g, b, mu, rs)
    with pytest.raises(ValueError, match="norm_quantize_block: rowwise/colwise"):
        norm_quantize_block(x, g, b, mu, rs, rowwise=False)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma_f32", [True, False], ids=["gamma_f32", "gamma_x"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("norm,zc", NORMS, ids=ids)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_norm_cuda_equals_cpu(shape, norm, zc, dtype, gamma_f32, rng, cpu, gpu):
    # The same statistics (the CPU's) go to both backends: the fused kernel is exact given them.
    lead, h = shape
    ln = norm == "layernorm"
    x, gamma, beta = norm_inputs(rng, lead, h, dtype, gamma_f32, ln)
    st = run_on(cpu, lambda a, g, b: norm_forward(a, g, b, norm_type=norm, zero_centered_gamma=zc), x, gamma, beta)
    for mode, (rowwise, colwise) in zip(MODES * 2, [(True, True)] * 4 + [(True, False), (False, True)] * 2):
        def f(a, g, b, m, r):
            return norm_fused(a, g, b, m, r, norm, zc, *mode, rowwise=rowwise, colwise=colwise)
        args = (x, gamma, beta, st.mu, st.rsigma)
        assert_same(run_on(gpu, f, *args), run_on(cpu, f, *args), f"{mode} {rowwise} {colwise}")


@pytest.mark.gpu
def test_norm_stats_cuda_equal_cuda_norm_forward(rng, gpu):
    for norm in ("layernorm", "rmsnorm"):
        x, gamma, beta = norm_inputs(rng, (4099,), 1000, ml_dtypes.bfloat16, True, norm == "layernorm")
        mu, rs = run_on(gpu, lambda a, g, b: norm_stats(a, g, b, norm_type=norm), x, gamma, beta)
        out = run_on(gpu, lambda a, g, b: norm_forward(a, g, b, norm_type=norm), x, gamma, beta)
        np.testing.assert_array_equal(bits(rs), bits(out.rsigma))
        if mu is not None:
            np.testing.assert_array_equal(bits(mu), bits(out.mu))


# ---------------------------------------------------------------- sharding

@pytest.mark.parametrize("kind", ["fp8_block", "mxfp8"])
def test_row_sharded_equals_unsharded_without_gathers(kind, rng):
    """x's first dim sharded over 4 devices (clean: 256 rows per shard) stays sharded: no
    all-gather, the copies and scales equal the single-device ones; an unclean split (rows
    per shard not whole tiles) is gathered, still exact."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    mode = (kind, jnp.float8_e4m3fn, False)
    x = make_x(rng, (4, 256), 160, True, ml_dtypes.bfloat16)
    gamma, beta = (rng.standard_normal(160) + 1).astype(F32), rng.standard_normal(160).astype(F32)
    st = norm_forward(x[:, :, 0], gamma, beta)
    fns = [(lambda v: fused(v, "silu", True, *mode), (x,)),
           (lambda v, m, r: norm_fused(v, gamma, beta, m, r, "layernorm", False, *mode), (x[:, :, 0], st.mu, st.rsigma))]
    for fn, args in fns:
        want = jax.jit(fn)(*args)
        sharded = [jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in args]
        got = jax.jit(fn)(*sharded)
        assert_same(got, want)
        text = jax.jit(fn).lower(*sharded).compile().as_text()
        assert "all-gather" not in text
    x2 = make_x(rng, (4, 6), 160, False, ml_dtypes.bfloat16)  # 6 rows per shard: gathered, exact
    f2 = lambda v: fused(v, "gelu", False, *mode)  # noqa: E731
    assert_same(jax.jit(f2)(jax.device_put(x2, NamedSharding(mesh, P("dp")))), jax.jit(f2)(x2))
