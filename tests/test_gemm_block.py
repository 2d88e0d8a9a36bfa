"""lowbit.ops.gemm with block scale modes (FP8 1x128 / 128x128, MXFP8): the CPU handler's
exact emulation against a numpy reference written from gemm.h's formula (bit for bit on small
shapes, and within fp32 error of a float64 product on larger ones), scale layouts (padding
entries are never read), bad input, the one-time notice, the CUDA lowering's choice between
cuBLASLt and the emulation (FP8 block on 9.0, MXFP8 on 10.x only), and on the GPU cuBLASLt's
block-scaled GEMMs against the CPU emulation within a stated tolerance."""

from __future__ import annotations

import importlib
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from cuda_lowering import cuda_gemm_calls

import lowbit

gemm_mod = importlib.import_module("lowbit.ops.gemm")
Mode = gemm_mod.GemmScaleMode
E4M3, E5M2, E8M0 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu
BF16, F32 = jnp.bfloat16, jnp.float32
PAIRS = [(Mode.BLOCK_1x128, Mode.BLOCK_128x128), (Mode.BLOCK_128x128, Mode.BLOCK_1x128),
         (Mode.BLOCK_1x128, Mode.BLOCK_1x128), (Mode.BLOCK_128x128, Mode.BLOCK_128x128),
         (Mode.MXFP8, Mode.MXFP8)]
PAIR_IDS = [f"{a.name}-{b.name}" for a, b in PAIRS]


def cdiv(a, b):
    return -(-a // b)


def scale_dims(mode, rows, k):
    """gemm.h's table, written out again."""
    return {Mode.BLOCK_1x128: (cdiv(k, 128), cdiv(rows, 4) * 4),
            Mode.BLOCK_128x128: (cdiv(rows, 128), cdiv(cdiv(k, 128), 4) * 4),
            Mode.MXFP8: (cdiv(rows, 128) * 128, cdiv(cdiv(k, 32), 4) * 4)}[mode]


def element_scales(mode, scale, rows, k):
    """The fp32 scale of every element (rows, k) of an operand, by indexing the scale array."""
    r, c = np.arange(rows)[:, None], np.arange(k)[None, :]
    s = np.asarray(scale)
    if mode == Mode.BLOCK_1x128:
        return s[c // 128, r]
    if mode == Mode.BLOCK_128x128:
        return s[r // 128, c // 128]
    e = s.view(np.uint8)[r, c // 32].astype(np.int32)
    return np.where(e == 255, np.float32(np.nan), np.ldexp(np.float32(1), e - 127)).astype(np.float32)


def dequantized(x, mode, scale):
    return np.asarray(x).astype(np.float32) * element_scales(mode, scale, *x.shape)


def sequential_ref(a, b, a_mode, sa, b_mode, sb, bias, out_dtype):
    """gemm.h's emulation: fl(decode * s) per operand, products rounded to fp32, summed in
    increasing k (cumsum is sequential) from an accumulator of +0 as the C++ loop (cumsum
    starts from the first product: + 0 turns an all -0 sum into +0), + bias in fp32, rounded
    to out_dtype."""
    a32, b32 = dequantized(a, a_mode, sa), dequantized(b, b_mode, sb)
    acc = np.float32(0) + np.cumsum(a32[:, None, :] * b32[None, :, :], axis=-1, dtype=np.float32)[..., -1]
    if bias is not None:
        acc = acc + np.asarray(bias).astype(np.float32)
    return acc.astype(out_dtype)


def random_fp8(rng, shape, dtype):
    """Finite FP8 values of every magnitude (random bytes, NaN codes replaced by 1)."""
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    x = bits.view(ml_dtypes.float8_e4m3fn if dtype == E4M3 else ml_dtypes.float8_e5m2)
    return np.where(np.isfinite(x.astype(np.float32)), x, np.ones_like(x))


def random_scale(rng, mode, rows, k, pad_value=np.nan):
    """A scale array of the mode's shape with random values in its used entries and
    `pad_value` in the padding (which must never be read)."""
    d0, d1 = scale_dims(mode, rows, k)
    used = {Mode.BLOCK_1x128: (cdiv(k, 128), rows), Mode.BLOCK_128x128: (cdiv(rows, 128), cdiv(k, 128)),
            Mode.MXFP8: (rows, cdiv(k, 32))}[mode]
    if mode == Mode.MXFP8:
        s = np.full((d0, d1), 255 if np.isnan(pad_value) else 127, np.uint8)
        s[:used[0], :used[1]] = rng.integers(110, 140, size=used, dtype=np.uint8)
        return s.view(ml_dtypes.float8_e8m0fnu)
    s = np.full((d0, d1), pad_value, np.float32)
    s[:used[0], :used[1]] = np.exp2(rng.uniform(-12, 4, size=used)).astype(np.float32)
    return s


def operands(rng, m, n, k, a_mode, b_mode, a_dtype=E4M3, b_dtype=E4M3):
    a, b = random_fp8(rng, (m, k), a_dtype), random_fp8(rng, (n, k), b_dtype)
    return a, b, random_scale(rng, a_mode, m, k), random_scale(rng, b_mode, n, k)


def call(a, b, sa, sb, a_mode, b_mode, bias=None, out_dtype=F32):
    return lowbit.ops.gemm(a, b, sa, sb, bias, out_dtype=out_dtype, a_scale_mode=a_mode,
                           b_scale_mode=b_mode)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# ---------------------------------------------------------------- CPU emulation


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 7, 200), (130, 3, 257), (4, 129, 384)], ids=str)
def test_cpu_emulation_is_the_documented_formula(a_mode, b_mode, m, n, k, rng):
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, E4M3, E5M2)
    got = np.asarray(jax.jit(call, static_argnums=(4, 5))(a, b, sa, sb, a_mode, b_mode))
    np.testing.assert_array_equal(got, sequential_ref(a, b, a_mode, sa, b_mode, sb, None, np.float32))
    assert np.isfinite(got).all()  # the NaN padding of the scale arrays was never read


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
def test_cpu_emulation_bias_and_rounding(a_mode, b_mode, out_dtype, rng):
    m, n, k = 9, 40, 300
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    got = np.asarray(call(a, b, sa, sb, a_mode, b_mode, bias, out_dtype)).astype(np.float32)
    want = sequential_ref(a, b, a_mode, sa, b_mode, sb, bias, out_dtype).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
def test_cpu_emulation_close_to_float64_product(a_mode, b_mode, rng):
    """Larger shape: within fp32 summation error (2*K*u*sum|p|) of the exact product."""
    m, n, k = 160, 136, 1100
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode)
    a64, b64 = dequantized(a, a_mode, sa).astype(np.float64), dequantized(b, b_mode, sb).astype(np.float64)
    exact = a64 @ b64.T
    bound = 2 * k * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T) + 1e-30
    got = np.asarray(call(a, b, sa, sb, a_mode, b_mode)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.cpu_reference
def test_cpu_emulation_of_quantized_tensors_matches_dequantized_product(rng):
    """End to end with the block quantizers: x (1x128) . w (128x128) is the product of the
    dequantized copies."""
    x = rng.normal(size=(70, 300)).astype(np.float32)
    w = rng.normal(size=(50, 300)).astype(np.float32)
    xq = lowbit.ops.quantize_fp8_block(x, tile_2d=False)
    wq = lowbit.ops.quantize_fp8_block(w, tile_2d=True)
    got = call(xq.rowwise, wq.rowwise, xq.rowwise_scale, wq.rowwise_scale, Mode.BLOCK_1x128,
               Mode.BLOCK_128x128)
    xd = lowbit.ops.dequantize_fp8_block(xq.rowwise, xq.rowwise_scale, tile_2d=False, out_dtype=F32)
    wd = lowbit.ops.dequantize_fp8_block(wq.rowwise, wq.rowwise_scale, tile_2d=True, out_dtype=F32)
    want = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64).T
    bound = 2 * 300 * 2.0**-24 * (np.abs(np.asarray(xd, np.float64)) @ np.abs(np.asarray(wd, np.float64)).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)
    mq_x = lowbit.ops.quantize_mxfp8(x)
    mq_w = lowbit.ops.quantize_mxfp8(w)
    got = call(mq_x.rowwise, mq_w.rowwise, mq_x.rowwise_scale, mq_w.rowwise_scale, Mode.MXFP8, Mode.MXFP8)
    xd = np.asarray(lowbit.ops.dequantize_mxfp8(mq_x.rowwise, mq_x.rowwise_scale, out_dtype=F32), np.float64)
    wd = np.asarray(lowbit.ops.dequantize_mxfp8(mq_w.rowwise, mq_w.rowwise_scale, out_dtype=F32), np.float64)
    assert np.all(np.abs(np.asarray(got, np.float64) - xd @ wd.T) <= 2 * 300 * 2.0**-24 * (np.abs(xd) @ np.abs(wd).T))


def test_nan_scale_propagates(rng):
    a, b, sa, sb = operands(rng, 3, 4, 64, Mode.MXFP8, Mode.MXFP8)
    sa = np.array(sa)
    sa.view(np.uint8)[1, 0] = 255  # NaN block of row 1
    got = np.asarray(call(a, b, sa, sb, Mode.MXFP8, Mode.MXFP8))
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def assert_is_the_product(got, a, b, a_mode, sa, b_mode, sb):
    """got (f32) is the block-scaled product: the emulation's bits where the default backend
    is the CPU, else (cuBLASLt or the wgmma kernel) within block_tolerance of them."""
    want = sequential_ref(a, b, a_mode, sa, b_mode, sb, None, np.float32)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = block_tolerance(a, b, a_mode, sa, b_mode, sb, F32)
        assert np.all(np.abs(got.astype(np.float64) - want) <= tol)


def test_multi_dim_operands_use_the_flattened_views(rng):
    m, n, k = 6, 10, 130
    a, b, sa, sb = operands(rng, m, n, k, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    got = lowbit.ops.gemm(a.reshape(2, 3, k), b.reshape(2, 5, k).reshape(10, k), sa, sb, out_dtype=F32,
                          a_scale_mode=Mode.BLOCK_1x128, b_scale_mode=Mode.BLOCK_128x128)
    assert_is_the_product(np.asarray(got).reshape(m, n), a, b, Mode.BLOCK_1x128, sa, Mode.BLOCK_128x128, sb)


def test_vmap_maps_over_the_batch(rng):
    ops = [operands(rng, 5, 6, 140, Mode.BLOCK_1x128, Mode.BLOCK_1x128) for _ in range(3)]
    a, b, sa, sb = (np.stack(x) for x in zip(*ops))
    f = jax.vmap(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128))
    got = np.asarray(f(a, b, sa, sb))
    for i in range(3):
        assert_is_the_product(got[i], a[i], b[i], Mode.BLOCK_1x128, sa[i], Mode.BLOCK_1x128, sb[i])


@pytest.mark.cpu_reference
def test_emulation_notice_is_given_once(rng):
    gemm_mod._NOTICED.clear()
    a, b, sa, sb = operands(rng, 3, 3, 33, Mode.BLOCK_1x128, Mode.BLOCK_1x128)
    with pytest.warns(UserWarning, match="exact emulation"):
        jax.jit(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128))(a, b, sa, sb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128) + 1)(a, b, sa, sb)


# ---------------------------------------------------------------- bad input


def test_bad_scale_input_names_the_argument(rng):
    a, b, sa, sb = operands(rng, 5, 7, 200, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(ValueError, match=r"lowbit.ops.gemm: b_scale_inv: expected shape \(1, 4\)"):
        call(a, b, sa, sb[:, :2], Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(TypeError, match=r"a_scale_inv: expected float32"):
        call(a, b, sa.astype(np.float16), sb, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(ValueError, match=r"b_scale_mode: expected block scales on both operands"):
        call(a, b, sa, None, Mode.BLOCK_1x128, Mode.TENSOR)
    with pytest.raises(ValueError, match=r"MXFP8 scales pair only with MXFP8"):
        call(a, b, sa, sb, Mode.BLOCK_1x128, Mode.MXFP8)
    with pytest.raises(ValueError, match=r"a_scale_inv: scale mode BLOCK_1x128 needs its scale array"):
        call(a, b, None, sb, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(TypeError, match=r"a: block scale modes need FP8 operands"):
        call(a.astype(BF16), b.astype(BF16), sa, sb, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(ValueError, match=r"a_scale_mode: expected a GemmScaleMode"):
        call(a, b, sa, sb, 7, Mode.BLOCK_128x128)


def test_handler_checks_scale_shapes(rng):
    """The C++ handler validates too (a caller binding gemm_p directly)."""
    a, b, sa, sb = operands(rng, 5, 7, 200, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    f = jax.jit(lambda a, b, sa, sb: gemm_mod.gemm_p.bind(
        a, b, sa, sb, jnp.zeros((0,), F32), out_dtype=jnp.dtype(F32), use_split_accumulator=np.bool_(True),
        a_scale_mode=np.int32(1), b_scale_mode=np.int32(2)))
    with pytest.raises(Exception, match=r"lowbit_gemm: a_scale_inv: expected shape \(2, 8\) for scale mode "
                                        r"block_1x128 of a 5 x 200 operand, got \(2, 4\)"):
        jax.block_until_ready(f(a, b, sa[:, :4], sb))


@pytest.mark.parametrize("which", ["a", "b", "bias"])
@pytest.mark.parametrize("capability", ["9.0", "8.9"], ids=["cublaslt", "emulated"])
def test_cuda_lowering_refuses_wrong_shapes(which, capability, rng, monkeypatch):
    """A gemm_p bound directly with a wrongly shaped block scale array or bias is refused by the
    CUDA lowering, in the C++ handler's words, before its padding could turn the scales into
    valid-looking ones or the fp32 bias add (f32 out) broadcast a (1,) bias over N."""
    a, b, sa, sb = operands(rng, 5, 7, 200, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    bias = np.zeros((0,), np.float32)
    if which == "a":
        sa, want = sa[:, :4], (r"a_scale_inv: expected shape \(2, 8\) for scale mode block_1x128 of a 5 x 200 "
                               r"operand, got \(2, 4\)")
    elif which == "b":
        sb, want = np.concatenate([sb, sb]), (r"b_scale_inv: expected shape \(1, 4\) for scale mode "
                                              r"block_128x128 of a 7 x 200 operand, got \(2, 4\)")
    else:
        bias, want = np.ones((1,), np.float32), r"bias: expected shape \(7,\) or \(0,\), got \(1,\)"
    f = lambda a, b, sa, sb, bias: gemm_mod.gemm_p.bind(  # noqa: E731
        a, b, sa, sb, bias, out_dtype=jnp.dtype(F32), use_split_accumulator=np.bool_(True),
        a_scale_mode=np.int32(1), b_scale_mode=np.int32(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        with pytest.raises(ValueError, match="lowbit_gemm: " + want):
            cuda_gemm_calls(monkeypatch, f, a, b, sa, sb, bias, capability=capability)
    with warnings.catch_warnings():  # the same call, correctly shaped, lowers
        warnings.simplefilter("ignore")
        a, b, sa, sb = operands(rng, 5, 7, 200, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
        cuda_gemm_calls(monkeypatch, f, a, b, sa, sb, np.ones((7,), np.float32), capability=capability)


# ------------------------------------------- the CUDA path's Python side (CPU CI)

def round16(x):
    return cdiv(x, 16) * 16


def f8_name(dtype):
    return {E4M3: "f8E4M3FN", E5M2: "f8E5M2"}[dtype]


CUDA_SHAPES = [(7, 17, 200), (1, 16, 128), (128, 256, 512), (130, 33, 1000)]


@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("m,n,k", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype,with_bias", [(BF16, True), (F32, True), (BF16, False)], ids=str)
def test_cuda_lowering_emits_one_padded_cublaslt_call(a_mode, b_mode, m, n, k, out_dtype, with_bias,
                                                      rng, monkeypatch):
    """Lowered for CUDA on compute capability 9.0 (no GPU needed): exactly one lowbit_gemm,
    its operands zero-padded to multiples of 16 in the order (a, b, sa, sb, bias) with the
    scale shapes the handler checks for the padded operands, the bias in the call (padded to
    N) for a 16-bit output (cuBLASLt's epilogue) and none for an fp32 one (added afterwards in
    fp32), and the modes as attributes."""
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, E4M3, E5M2)
    bias = rng.normal(size=(n,)).astype(out_dtype) if with_bias else None
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, a_mode, b_mode, bias, out_dtype)  # noqa: E731
    (c,) = cuda_gemm_calls(monkeypatch, f, a, b, sa, sb, bias)
    mp, np_, kp = round16(m), round16(n), round16(k)
    dims = lambda *d: "x".join(map(str, d))  # noqa: E731
    out = "f32" if out_dtype == F32 else "bf16"  # the empty bias has the out type
    bias_len = np_ if with_bias and out_dtype != F32 else 0
    assert c.operand_types == [f"{dims(mp, kp)}x{f8_name(E4M3)}", f"{dims(np_, kp)}x{f8_name(E5M2)}",
                               dims(*scale_dims(a_mode, mp, kp)) + "xf32",
                               dims(*scale_dims(b_mode, np_, kp)) + "xf32", f"{bias_len}x{out}"]
    assert c.result_types == [f"{dims(mp, np_)}x{out}", f"{gemm_mod.GEMM_WORKSPACE_BYTES}xui8"]
    assert (c.a_scale_mode, c.b_scale_mode) == (int(a_mode), int(b_mode))


def test_cuda_lowering_under_vmap(rng, monkeypatch):
    """vmap over a block-scaled GEMM lowers for CUDA too (one padded call inside the map)."""
    ops = [operands(rng, 5, 6, 140, Mode.BLOCK_1x128, Mode.BLOCK_1x128) for _ in range(3)]
    a, b, sa, sb = (np.stack(x) for x in zip(*ops))
    f = jax.vmap(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128))
    (c,) = cuda_gemm_calls(monkeypatch, f, a, b, sa, sb)
    assert c.operand_types[:3] == ["16x144xf8E4M3FN", "16x144xf8E4M3FN", "2x16xf32"]


@pytest.mark.parametrize("a_mode,b_mode,capability", [
    (Mode.BLOCK_128x128, Mode.BLOCK_128x128, "9.0"), (Mode.MXFP8, Mode.MXFP8, "9.0"),
    (Mode.MXFP8, Mode.MXFP8, "8.9"), (Mode.MXFP8, Mode.MXFP8, "12.0"), (Mode.MXFP8, Mode.MXFP8, "11.0"),
    (Mode.MXFP8, Mode.MXFP8, "1.0"), (Mode.MXFP8, Mode.MXFP8, ""),
    (Mode.BLOCK_1x128, Mode.BLOCK_128x128, "8.9"), (Mode.BLOCK_1x128, Mode.BLOCK_1x128, "10.0")], ids=str)
def test_cuda_lowering_emulates_pairs_without_cublaslt_path(a_mode, b_mode, capability, rng, monkeypatch):
    a, b, sa, sb = operands(rng, 33, 40, 300, a_mode, b_mode)
    f = lambda *x: call(*x, a_mode, b_mode)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        assert cuda_gemm_calls(monkeypatch, f, a, b, sa, sb, capability=capability) == []


@pytest.mark.parametrize("capability", ["10.0", "10.3"])
@pytest.mark.parametrize("m,n,k", CUDA_SHAPES + [(256, 128, 4096)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=str)
def test_cuda_lowering_mxfp8_on_sm100_emits_one_padded_cublaslt_call(capability, m, n, k, with_bias, rng,
                                                                    monkeypatch):
    """The sm_100 gate: on compute capability 10.x MXFP8 lowers to exactly one lowbit_gemm,
    M and N padded to 16 and K to 128, the e8m0 scale arrays in their unchanged shapes, no
    bias (added afterwards in fp32), and the workspace grown by the two swizzled scale
    arrays (each rounded up to 256 bytes)."""
    a, b, sa, sb = operands(rng, m, n, k, Mode.MXFP8, Mode.MXFP8, E4M3, E5M2)
    bias = rng.normal(size=(n,)).astype(BF16) if with_bias else None
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, Mode.MXFP8, Mode.MXFP8, bias, BF16)  # noqa: E731
    (c,) = cuda_gemm_calls(monkeypatch, f, a, b, sa, sb, bias, capability=capability)
    mp, np_, kp = round16(m), round16(n), cdiv(k, 128) * 128
    dims = lambda *d: "x".join(map(str, d))  # noqa: E731
    out = "f32" if with_bias else "bf16"
    assert scale_dims(Mode.MXFP8, mp, kp) == sa.shape and scale_dims(Mode.MXFP8, np_, kp) == sb.shape
    assert c.operand_types == [f"{dims(mp, kp)}xf8E4M3FN", f"{dims(np_, kp)}xf8E5M2",
                               dims(*sa.shape) + "xf8E8M0FNU", dims(*sb.shape) + "xf8E8M0FNU", f"0x{out}"]
    swizzled = sum(cdiv(d0 * d1, 256) * 256 for d0, d1 in (sa.shape, sb.shape))
    assert c.result_types == [f"{dims(mp, np_)}x{out}", f"{gemm_mod.GEMM_WORKSPACE_BYTES + swizzled}xui8"]
    assert gemm_mod.gemm_workspace_bytes(Mode.MXFP8, mp, np_, kp) == gemm_mod.GEMM_WORKSPACE_BYTES + swizzled
    assert (c.a_scale_mode, c.b_scale_mode) == (int(Mode.MXFP8), int(Mode.MXFP8))


def test_sm100_gate_is_exact():
    """MXFP8 goes to cuBLASLt on 10.x only; the Hopper block pairs on 9.0 only."""
    mx = (Mode.MXFP8, Mode.MXFP8)
    for cap, want in [("10.0", True), ("10.3", True), ("9.0", False), ("12.0", False), ("1.0", False),
                      ("100.0", False), ("", False), ("8.9", False), ("11.0", False)]:
        assert gemm_mod.block_on_cublaslt(mx, cap) == want, cap
    pair = (Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    assert [gemm_mod.block_on_cublaslt(pair, c) for c in ("9.0", "10.0", "8.9")] == [True, False, False]


def test_cuda_tensor_scaled_fp8_lowering_pads_k_and_n(rng, monkeypatch):
    """The per-tensor FP8 path through the same lowering rule: K and N padded, M kept."""
    a = random_fp8(rng, (7, 200), E4M3)
    b = random_fp8(rng, (17, 200), E4M3)
    one = np.ones((1,), np.float32)
    f = lambda a, b: lowbit.ops.gemm(a, b, one, one, out_dtype=BF16)  # noqa: E731
    (c,) = cuda_gemm_calls(monkeypatch, f, a, b)
    assert c.operand_types == ["7x208xf8E4M3FN", "32x208xf8E4M3FN", "1xf32", "1xf32", "0xbf16"]
    assert (c.a_scale_mode, c.b_scale_mode) == (0, 0)


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:3] + PAIRS[4:], ids=PAIR_IDS[:3] + PAIR_IDS[4:])
@pytest.mark.parametrize("m,n,k", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=str)
def test_cuda_wrapper_padding_on_cpu_handler_is_exact(a_mode, b_mode, m, n, k, with_bias, rng):
    """The CUDA lowering's wrapper (_block_gemm_cuda: zero padding of M, N, K (K to 128 for
    MXFP8, its NaN scale padding zeroed) and of the 1x128 scale rows, the bf16 bias padded into
    the call (FP8 block) or split off and added in fp32 (MXFP8)) run through the CPU handler
    equals the documented formula bit for bit: the padding adds only zero terms and is sliced
    off."""
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, E4M3, E5M2)
    bias = rng.normal(size=(n,)).astype(BF16) if with_bias else np.zeros((0,), BF16)
    f = jax.jit(lambda a, b, sa, sb, bias: gemm_mod._block_gemm_cuda(
        a, b, sa, sb, bias, out_dtype=jnp.dtype(BF16), use_split_accumulator=np.bool_(True),
        a_scale_mode=np.int32(a_mode), b_scale_mode=np.int32(b_mode)))
    got = np.asarray(f(a, b, sa, sb, bias)).astype(np.float32)
    want = sequential_ref(a, b, a_mode, sa, b_mode, sb, bias if with_bias else None, BF16)
    np.testing.assert_array_equal(got, want.astype(np.float32))


# ---------------------------------------------------------------- cuBLASLt (GPU)

# cuBLASLt's block-scaled kernel multiplies fp32 partial sums of 128 products by the two
# scales per K block and adds the blocks in fp32; the emulation rounds every scaled product
# and adds them one at a time. Both are fp32 sums of the same terms, so they differ by at
# most 2*K*u*sum|p| plus the FP8 tensor cores' inner accumulation (about 14 bits inside a
# 128-long block: DeepSeek-V3 report 3.3.2), modelled as 4*sqrt(128)*2^-14*sum|p|, and one
# rounding of the out dtype.
def block_tolerance(a, b, a_mode, sa, b_mode, sb, out_dtype):
    a64 = dequantized(a, a_mode, sa).astype(np.float64)
    b64 = dequantized(b, b_mode, sb).astype(np.float64)
    abs_dot = np.abs(a64) @ np.abs(b64).T
    k = a.shape[1]
    eps_out = float(ml_dtypes.finfo(out_dtype).eps)
    gamma = 4 * k * 2.0**-24 + 4 * np.sqrt(128) * 2.0**-14
    return gamma * abs_dot + eps_out * np.abs(a64 @ b64.T) + float(ml_dtypes.finfo(out_dtype).tiny)


GPU_SHAPES = [(128, 256, 512), (1, 16, 128), (7, 17, 200), (130, 33, 1000), (256, 384, 4096),
              (300, 400, 2000), (520, 1040, 4096)]
# LOWBIT_BLOCK_GEMM: cuBLASLt's block scaling (the default) or lowbit's own wgmma kernel
# (csrc/gemm/block_gemm_sm90.h); both follow the same per-block order and tolerance.
BLOCK_PATHS = ["cublaslt", "wgmma"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", BLOCK_PATHS)
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("types", [(E4M3, E5M2), (E5M2, E4M3), (E4M3, E4M3)], ids=["e4m3-e5m2", "e5m2-e4m3", "e4m3-e4m3"])
def test_cuda_block_gemm_matches_cpu_emulation(a_mode, b_mode, m, n, k, out_dtype, types, path, rng, cpu,
                                               gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", path)
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, *types)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, a_mode, b_mode, bias, out_dtype)  # noqa: E731
    g = np.asarray(run_on(gpu, f, a, b, sa, sb, bias), np.float64)
    c = np.asarray(run_on(cpu, f, a, b, sa, sb, bias), np.float64)
    tol = block_tolerance(a, b, a_mode, sa, b_mode, sb, out_dtype)
    assert np.all(np.abs(g - c) <= tol), np.max(np.abs(g - c) / tol)
    # A wrong scale layout would be off by factors of 2^16 (the scales span 2^-12..2^4).
    assert np.linalg.norm(g - c) <= 2.0**-6 * np.linalg.norm(c) + 1e-30


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["1", "3", "n1", "n5", "n1024"])
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("m,n,k", [(520, 1040, 4096), (300, 400, 2000)], ids=str)
def test_cuda_block_gemm_raster_order_changes_no_bit(a_mode, b_mode, m, n, k, group, rng, gpu, monkeypatch):
    """LOWBIT_BLOCK_GEMM_GROUP (benchmark-only) reorders the wgmma kernel's tiles, never their
    arithmetic: every order gives the default order's bits."""
    if capability_of(gpu) != "9.0":
        pytest.skip("the wgmma kernel is Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "wgmma")
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, E4M3, E4M3)
    bias = rng.normal(size=(n,)).astype(BF16)
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, a_mode, b_mode, bias, BF16)  # noqa: E731
    monkeypatch.delenv("LOWBIT_BLOCK_GEMM_GROUP", raising=False)
    default = np.asarray(run_on(gpu, f, a, b, sa, sb, bias))
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM_GROUP", group)
    reordered = np.asarray(run_on(gpu, f, a, b, sa, sb, bias))
    np.testing.assert_array_equal(reordered.view(np.uint16), default.view(np.uint16))
    assert np.any(default != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["0", "x3", "n", "4a", "2000"])
def test_cuda_block_gemm_bad_raster_group_names_the_variable(value, rng, gpu, monkeypatch):
    if capability_of(gpu) != "9.0":
        pytest.skip("the wgmma kernel is Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "wgmma")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM_GROUP", value)
    a, b, sa, sb = operands(rng, 256, 256, 512, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(Exception, match="LOWBIT_BLOCK_GEMM_GROUP"):
        np.asarray(run_on(gpu, lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_128x128), a, b, sa, sb))


@pytest.mark.gpu
@pytest.mark.parametrize("path,kernel", [("wgmma", "BlockGemmKernel"), ("cublaslt", "nvjet")])
def test_cuda_block_gemm_path_runs_its_kernel(path, kernel, rng, gpu, monkeypatch, tmp_path):
    """LOWBIT_BLOCK_GEMM picks the kernel that runs on Hopper: the profiler's kernel names show
    lowbit's BlockGemmKernel for "wgmma" and cuBLASLt's (not lowbit's) for the default."""
    import glob
    import gzip

    if capability_of(gpu) != "9.0":
        pytest.skip("the block GEMM paths are Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", path)
    a, b, sa, sb = operands(rng, 256, 256, 1024, Mode.BLOCK_1x128, Mode.BLOCK_1x128)
    args = jax.device_put((a, b, sa, sb), gpu)
    f = jax.jit(lambda a, b, sa, sb: call(a, b, sa, sb, Mode.BLOCK_1x128, Mode.BLOCK_1x128))
    jax.block_until_ready(f(*args))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        jax.block_until_ready(f(*args))
    trace = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    assert trace
    text = "".join(gzip.open(t, "rt").read() for t in trace)
    assert ("BlockGemmKernel" in text) == (path == "wgmma")
    assert kernel in text


@pytest.mark.gpu
def test_cuda_block_gemm_runs_cublaslt_on_hopper(rng, gpu):
    """On compute capability 9.0 the program holds lowbit_gemm (no emulation); elsewhere the
    documented emulation runs."""
    a, b, sa, sb = operands(rng, 64, 128, 256, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    args = jax.device_put((a, b, sa, sb), gpu)
    hlo = jax.jit(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_128x128)).lower(*args).compile().as_text()
    assert ("lowbit_gemm" in hlo) == (getattr(gpu, "compute_capability", "") == "9.0")


def capability_of(device) -> str:
    return str(getattr(device, "compute_capability", ""))


@pytest.mark.gpu
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[3:], ids=PAIR_IDS[3:])
def test_cuda_pairs_without_cublaslt_path_are_emulated(a_mode, b_mode, rng, cpu, gpu):
    """128x128 x 128x128 anywhere and MXFP8 off compute capability 10.x (the sm_100 gate, so
    on an H100 too): the jnp emulation, and no lowbit_gemm in the program."""
    if a_mode == Mode.MXFP8 and gemm_mod.mxfp8_on_cublaslt(capability_of(gpu)):
        pytest.skip("MXFP8 runs on cuBLASLt here: test_cuda_mxfp8_matches_cpu_emulation")
    a, b, sa, sb = operands(rng, 33, 40, 300, a_mode, b_mode)
    args = jax.device_put((a, b, sa, sb), gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        hlo = jax.jit(lambda *x: call(*x, a_mode, b_mode)).lower(*args).compile().as_text()
    assert "lowbit_gemm" not in hlo
    f = lambda *x: call(*x, a_mode, b_mode)  # noqa: E731
    g = np.asarray(run_on(gpu, f, a, b, sa, sb), np.float64)
    c = np.asarray(run_on(cpu, f, a, b, sa, sb), np.float64)
    a64, b64 = dequantized(a, a_mode, sa).astype(np.float64), dequantized(b, b_mode, sb).astype(np.float64)
    assert np.all(np.abs(g - c) <= 8 * 300 * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES + [(300, 200, 1056)], ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
def test_cuda_mxfp8_matches_cpu_emulation(m, n, k, out_dtype, rng, cpu, gpu):
    """MXFP8 on the GPU against the CPU emulation: on 10.x through cuBLASLt (swizzled scales,
    NaN codes in the scale padding, which the padding of K must not let through), within the
    block tolerance; elsewhere the emulation. The program holds lowbit_gemm exactly on 10.x."""
    a, b, sa, sb = operands(rng, m, n, k, Mode.MXFP8, Mode.MXFP8, E4M3, E5M2)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, Mode.MXFP8, Mode.MXFP8, bias, out_dtype)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        g = np.asarray(run_on(gpu, f, a, b, sa, sb, bias), np.float64)
        args = jax.device_put((a, b, sa, sb, bias), gpu)
        hlo = jax.jit(f).lower(*args).compile().as_text()
    c = np.asarray(run_on(cpu, f, a, b, sa, sb, bias), np.float64)
    assert ("lowbit_gemm" in hlo) == gemm_mod.mxfp8_on_cublaslt(capability_of(gpu))
    tol = block_tolerance(a, b, Mode.MXFP8, sa, Mode.MXFP8, sb, out_dtype)
    assert np.all(np.abs(g - c) <= tol), np.max(np.abs(g - c) / tol)
    # A wrongly swizzled scale is off by factors up to 2^30 (the exponents span 110..139).
    assert np.linalg.norm(g - c) <= 2.0**-6 * np.linalg.norm(c) + 1e-30
