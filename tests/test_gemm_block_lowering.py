"""lowbit.ops.gemm with block scale modes lowered for CUDA on a machine without a GPU (the
Python side of the CUDA path, tested in CPU CI): wrongly shaped scales or bias refused in the
handler's words, the choice between cuBLASLt and the emulation (FP8 block on 9.0, MXFP8 on
10.x only), one lowbit_gemm call with its operands padded and its scale shapes and workspace
as the handler checks them, vmap, the per-tensor FP8 path's padding, and the CUDA wrapper's
padding run through the CPU handler (bit for bit the documented formula)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import cuda_gemm_calls
from gemm_block_reference import (BF16, E4M3, E5M2, F32, PAIR_IDS, PAIRS, Mode, call, cdiv, gemm_mod,
                                  operands, random_fp8, scale_dims, sequential_ref)

import lowbit


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
