"""lowbit.ops.gemm_scales: the scale arrays lowbit's block-scaled GEMMs take, for lowbit.ops.gemm.

- scale_shape: a rows x K operand's scale_inv shape per GemmScaleMode (csrc/gemm/gemm.h has
  the layouts) and gemm_workspace_bytes, the CUDA custom call's workspace (MXFP8 adds its
  swizzled scales);
- swizzle_scales: cuBLASLt's 128 x 4 tile order of a one-byte scale matrix, as an op over the
  C++ swizzle (CPU reference or CUDA kernel, csrc/gemm/scale_swizzle.h) with its jnp
  reference and inverse beside it;
- dequantize_operand / emulated_gemm: the exact jnp emulation of a block-scaled GEMM
  (dequantize to fp32, HIGHEST fp32 dot), used where no GEMM hardware runs a mode.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.gemm_config import _E8M0, GEMM_WORKSPACE_BYTES, OP, GemmScaleMode


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def gemm_workspace_bytes(a_mode: GemmScaleMode, m: int, n: int, k: int) -> int:
    """GemmWorkspaceBytes in csrc/gemm/gemm.h: the CUDA custom call's workspace."""
    if a_mode != GemmScaleMode.MXFP8:
        return GEMM_WORKSPACE_BYTES
    padded = lambda rows: _round_up(math.prod(scale_shape(a_mode, rows, k)), 256)  # noqa: E731
    return GEMM_WORKSPACE_BYTES + padded(m) + padded(n)


def swizzle_scales_jnp(scale, valid_rows=None, valid_cols=None):
    """The jnp reference of csrc/gemm/scale_swizzle.h: a (R, C) one-byte scale matrix (R % 128
    == 0, C % 4 == 0) -> its R * C entries in cuBLASLt's 128 x 4 tile order, the entries at
    rows >= valid_rows or cols >= valid_cols zeroed."""
    r, c = scale.shape
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint8) if scale.dtype != jnp.uint8 else scale
    vr = r if valid_rows is None else valid_rows
    vc = c if valid_cols is None else valid_cols
    keep = (jnp.arange(r)[:, None] < vr) & (jnp.arange(c)[None, :] < vc)
    bits = jnp.where(keep, bits, jnp.uint8(0))
    # (row tile, row // 32 within it, row % 32, col tile, col % 4) -> tiles, then row % 32,
    # then row // 32, then col % 4.
    tiles = bits.reshape(r // 128, 4, 32, c // 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1)
    return tiles if scale.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(tiles, scale.dtype)


def unswizzle_scales_jnp(swizzled, rows: int, cols: int):
    """The inverse of swizzle_scales_jnp (with nothing zeroed): R * C bytes -> (R, C)."""
    t = swizzled.reshape(rows // 128, cols // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return t.reshape(rows, cols)


def _swizzle_abstract(scale, *, valid_rows, valid_cols):
    del valid_rows, valid_cols
    return jax.core.ShapedArray((math.prod(scale.shape),), scale.dtype)


swizzle_scales_p = ffi_primitive("lowbit_gemm_swizzle_scales", "lowbit_gemm_swizzle_scales",
                                 _swizzle_abstract, attrs=("valid_rows", "valid_cols"))


def swizzle_scales(scale, valid_rows=None, valid_cols=None):
    """The C++ scale swizzle (CPU reference or CUDA kernel, scale_swizzle.h) as an op: what
    the sm_100 MXFP8 GEMM applies inside its launcher, exposed so that the kernel can be
    tested on any GPU. scale: (R, C) uint8 / float8_e8m0fnu / float8_e4m3fn."""
    scale = jnp.asarray(scale)
    if scale.ndim != 2 or scale.shape[0] % 128 or scale.shape[1] % 4:
        raise ValueError(f"{OP}: scale: expected a (multiple of 128, multiple of 4) matrix, got {scale.shape}")
    if scale.dtype not in (jnp.dtype(jnp.uint8), _E8M0, jnp.dtype(jnp.float8_e4m3fn)):
        raise TypeError(f"{OP}: scale: expected uint8, float8_e8m0fnu or float8_e4m3fn, got {scale.dtype}")
    r, c = scale.shape
    return swizzle_scales_p.bind(scale, valid_rows=np.int64(r if valid_rows is None else valid_rows),
                                 valid_cols=np.int64(c if valid_cols is None else valid_cols))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(mode: GemmScaleMode, rows: int, k: int) -> tuple[int, ...]:
    """The scale_inv shape of a rows x k operand in `mode` ((1,) for TENSOR)."""
    if mode == GemmScaleMode.BLOCK_1x128:
        return (_cdiv(k, 128), _round_up(rows, 4))
    if mode == GemmScaleMode.BLOCK_128x128:
        return (_cdiv(rows, 128), _round_up(_cdiv(k, 128), 4))
    if mode == GemmScaleMode.MXFP8:
        return (_round_up(rows, 128), _round_up(_cdiv(k, 32), 4))
    return (1,)


def dequantize_operand(data, scale, mode: GemmScaleMode):
    """fp32 data (rows, K) times its block scales (the emulation's operand)."""
    rows, k = data.shape
    values = data.astype(jnp.float32)
    if mode == GemmScaleMode.BLOCK_1x128:
        s = jnp.repeat(scale[:, :rows].T, 128, axis=1)[:, :k]
    elif mode == GemmScaleMode.BLOCK_128x128:
        s = jnp.repeat(jnp.repeat(scale[:_cdiv(rows, 128), :_cdiv(k, 128)], 128, axis=0), 128, axis=1)
        s = s[:rows, :k]
    elif mode == GemmScaleMode.MXFP8:
        e = jax.lax.bitcast_convert_type(scale[:rows, :_cdiv(k, 32)], jnp.uint8).astype(jnp.int32)
        s = jnp.where(e == 255, jnp.float32(jnp.nan), jnp.ldexp(jnp.float32(1), e - 127))
        s = jnp.repeat(s, 32, axis=1)[:, :k]
    else:
        s = scale.reshape(())
    return values * s


def emulated_gemm(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, a_scale_mode, b_scale_mode):
    """The block-scaled GEMM emulated in jnp: dequantize both operands to fp32, a HIGHEST
    precision fp32 dot, + bias in fp32, rounded to out_dtype (the CPU handler's formula; only
    the summation order differs)."""
    a32 = dequantize_operand(a, a_scale_inv, GemmScaleMode(int(a_scale_mode)))
    b32 = dequantize_operand(b, b_scale_inv, GemmScaleMode(int(b_scale_mode)))
    acc = jnp.dot(a32, b32.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if bias.shape[0]:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)
