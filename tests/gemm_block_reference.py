"""Shared by tests/test_gemm_block_emulation.py, tests/test_gemm_block_lowering.py and
tests/test_gemm_block_cuda.py: lowbit.ops.gemm's block scale modes (FP8 1x128 / 128x128,
MXFP8) and their pairs, a numpy reference written from gemm.h's formula (scale layouts,
dequantized operands, the sequential emulation), random operands with the scale arrays'
padding set to values that must never be read, and the tolerance of a block-scaled GEMM
against the emulation (block_tolerance). The tests take conftest's `rng`: fresh data every run."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np

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


# cuBLASLt's block-scaled kernel multiplies fp32 partial sums of 128 products by the two
# scales per K block and adds the blocks in fp32; the emulation rounds every scaled product
# and adds them one at a time. Both are fp32 sums of the same terms, so they differ by at
# most 2*K*u*sum|p| plus the FP8 tensor cores' inner accumulation (about 14 bits inside a
# 128-long block: DeepSeek-V3 report 3.3.2), modelled as 4*sqrt(128)*2^-14*sum|p|, and one
# rounding of the out dtype, where two fp32 results that close may land an ulp of the output
# apart: at most eps_out times the output's magnitude, the bias included (with a bias the
# output can be far larger than the product: a product's magnitude alone once let one bf16
# ulp of 1.05 fail on the GPU).
def block_tolerance(a, b, a_mode, sa, b_mode, sb, out_dtype, bias=None):
    a64 = dequantized(a, a_mode, sa).astype(np.float64)
    b64 = dequantized(b, b_mode, sb).astype(np.float64)
    abs_dot = np.abs(a64) @ np.abs(b64).T
    k = a.shape[1]
    eps_out = float(ml_dtypes.finfo(out_dtype).eps)
    gamma = 4 * k * 2.0**-24 + 4 * np.sqrt(128) * 2.0**-14
    dot = a64 @ b64.T
    out = dot if bias is None else dot + np.asarray(bias, np.float64)
    magnitude = np.maximum(np.abs(dot), np.abs(out))
    return gamma * abs_dot + eps_out * magnitude + float(ml_dtypes.finfo(out_dtype).tiny)
