"""lowbit.ops.act_quantize_block / norm_quantize_block: an activation, or a normalization from
its row statistics, block-quantized in the same pass (FP8 block 1x128, Float8BlockScaling's
activation tiles, or MXFP8), through lowbit's FFI ops lowbit_act_quantize_block /
lowbit_norm_quantize_block (csrc/fused_block/fused_block.h).

x is (..., H), or (..., 2, H) when gated (lowbit.ops.act_forward's act types and layout);
v = act(x) (gated: act(x[..., 0, :]) * gate(x[..., 1, :])) is computed in fp32 and
quantized directly, never rounded to x's dtype first: the codes and scales equal
quantize_fp8_block(v, tile_2d=False) / quantize_mxfp8(v) of the fp32 v, with v's lead dims
as the rows (flatten_axis = len(lead)). Copies (BlockQuantized, as lowbit.ops.quantize_block):
FP8 block: rowwise lead + (H,), colwise (H,) + lead (transposed), f32 scale_inv;
MXFP8: both lead + (H,), E8M0 scales. Only the quantized copies are written (act_forward
gives the high-precision activation).

norm_quantize_block: x (..., H) with gamma (H,) (f32 or x's dtype), beta (LayerNorm, like gamma)
and the statistics norm_forward returns for x (mu for LayerNorm, rsigma; f32 x.shape[:-1]);
v = (x - mu) * rsigma * w (+ beta), w = gamma or 1 + gamma, in fp32 with norm_forward's own
elementwise formula (csrc/norm/norm_math.h), NaN canonical; so with norm_forward's statistics
v is bit for bit norm_forward's fp32 y. Copies as above with lead = x.shape[:-1].

jit: yes. vmap: a loop over the batch (each element quantized on its own, as
lowbit.ops.quantize_block). Sharding: no partitioning rule yet, so sharded operands are
gathered (exact, not parallel).
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.activation import ACT_TYPES
from lowbit.ops.amax import check_high_precision
from lowbit.ops.quantize import FP8_DTYPES
from lowbit.ops.quantize_block import (E8M0, BlockQuantized, _looped_batcher, _pack, fp8_block_scale_shape,
                                       mxfp8_scale_shape)

_OP = "lowbit.ops.act_quantize_block"


def _empty(dtype):
    return jax.core.ShapedArray((0,), dtype)


def _abstract(x, *, act_type, gated, limit, alpha, mxfp8, pow2_scales, out_dtype, rowwise, colwise):
    del act_type, limit, alpha, pow2_scales
    lead = x.shape[:-2] if gated else x.shape[:-1]
    h = x.shape[-1]
    rows, out = math.prod(lead), (*lead, h)
    if mxfp8:
        shapes = (out, mxfp8_scale_shape(rows, h, False), out, mxfp8_scale_shape(rows, h, True))
        scale_dtype = E8M0
    else:
        shapes = (out, fp8_block_scale_shape(rows, h, False), (h, *lead), fp8_block_scale_shape(h, rows, False))
        scale_dtype = jnp.float32
    wants = (rowwise, rowwise, colwise, colwise)
    dtypes = (out_dtype, scale_dtype, out_dtype, scale_dtype)
    return tuple(jax.core.ShapedArray(s, d) if w else _empty(d) for s, d, w in zip(shapes, dtypes, wants))


# x -> (rowwise | (0,), rowwise_scale | (0,), colwise | (0,), colwise_scale | (0,)).
act_quantize_block_p = ffi_primitive(
    "lowbit_act_quantize_block", "lowbit_act_quantize_block", _abstract, multiple_results=True,
    attrs=("act_type", "gated", "limit", "alpha", "mxfp8", "pow2_scales"),
)
_looped_batcher(act_quantize_block_p)


@lru_cache(maxsize=None)
def _params(act_type: int, gated: bool, limit: float, alpha: float, mxfp8: bool, pow2_scales: bool,
            out_dtype, rowwise: bool, colwise: bool):
    return dict(act_type=np.int32(act_type), gated=np.bool_(gated), limit=np.float32(limit),
                alpha=np.float32(alpha), mxfp8=np.bool_(mxfp8), pow2_scales=np.bool_(pow2_scales),
                out_dtype=out_dtype, rowwise=rowwise, colwise=colwise)


def act_quantize_block(x, act_type: str, *, gated: bool = False, limit: float = 7.0, alpha: float = 1.702,
                       mxfp8: bool = False, out_dtype=jnp.float8_e4m3fn, pow2_scales: bool = False,
                       rowwise: bool = True, colwise: bool = False) -> BlockQuantized:
    """Block-quantized copies of act(x) (see the module doc): FP8 block 1x128 tiles
    (pow2_scales: power-of-two scales), or MXFP8 with mxfp8=True."""
    x = jnp.asarray(x)
    if act_type not in ACT_TYPES:
        raise ValueError(f"{_OP}: act_type: expected one of {sorted(ACT_TYPES)}, got {act_type!r}")
    if act_type == "clamped_silu" and not gated:
        raise ValueError(f"{_OP}: act_type: 'clamped_silu' (clamped swiglu) needs gated=True")
    check_high_precision(_OP, "x", x)
    if gated and (x.ndim < 2 or x.shape[-2] != 2):
        raise ValueError(f"{_OP}: x: gated activations take shape (..., 2, H), got {x.shape}")
    if not gated and x.ndim < 1:
        raise ValueError(f"{_OP}: x: expected at least one dimension (H), got a scalar")
    if not (np.isfinite(limit) and limit >= 0):
        raise ValueError(f"{_OP}: limit: expected a finite value >= 0, got {limit}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FP8_DTYPES:
        raise TypeError(f"{_OP}: out_dtype: expected float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if not (rowwise or colwise):
        raise ValueError(f"{_OP}: rowwise/colwise: neither copy requested")
    if mxfp8 and pow2_scales:
        raise ValueError(f"{_OP}: pow2_scales: MXFP8 scales are powers of two already; pass False")
    params = _params(ACT_TYPES[act_type], bool(gated), float(limit), float(alpha), bool(mxfp8),
                     bool(pow2_scales), out_dtype, bool(rowwise), bool(colwise))
    outs = act_quantize_block_p.bind(x, **params)
    return _pack(tuple(outs[:2]) * bool(rowwise) + tuple(outs[2:]) * bool(colwise), bool(rowwise), bool(colwise))


_NORM_OP = "lowbit.ops.norm_quantize_block"
_NORM_TYPES = {"layernorm": 0, "rmsnorm": 1}


def _norm_abstract(x, gamma, beta, mu, rsigma, *, norm_type, zero_centered_gamma, mxfp8, pow2_scales, out_dtype,
                   rowwise, colwise):
    del gamma, beta, mu, rsigma, norm_type, zero_centered_gamma
    return _abstract(x, act_type=None, gated=False, limit=None, alpha=None, mxfp8=mxfp8, pow2_scales=pow2_scales,
                     out_dtype=out_dtype, rowwise=rowwise, colwise=colwise)


# (x, gamma, beta | (0,), mu | (0,), rsigma) -> (rowwise, rowwise_scale, colwise, colwise_scale).
norm_quantize_block_p = ffi_primitive(
    "lowbit_norm_quantize_block", "lowbit_norm_quantize_block", _norm_abstract, multiple_results=True,
    attrs=("norm_type", "zero_centered_gamma", "mxfp8", "pow2_scales"),
)
_looped_batcher(norm_quantize_block_p)


def norm_quantize_block(x, gamma, beta, mu, rsigma, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                        mxfp8: bool = False, out_dtype=jnp.float8_e4m3fn, pow2_scales: bool = False,
                        rowwise: bool = True, colwise: bool = False) -> BlockQuantized:
    """Block-quantized copies of the normalization of x from its statistics (see the module
    doc): FP8 block 1x128 tiles, or MXFP8 with mxfp8=True. RMSNorm takes beta=None, mu=None."""
    x, gamma, rsigma = jnp.asarray(x), jnp.asarray(gamma), jnp.asarray(rsigma)
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"{_NORM_OP}: norm_type: expected one of {sorted(_NORM_TYPES)}, got {norm_type!r}")
    check_high_precision(_NORM_OP, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{_NORM_OP}: x: expected at least one dimension (H), got a scalar")
    h, lead = x.shape[-1], x.shape[:-1]
    if gamma.shape != (h,) or gamma.dtype not in (jnp.dtype(jnp.float32), x.dtype):
        raise ValueError(f"{_NORM_OP}: gamma: expected float32 or {x.dtype} of shape ({h},), got {gamma.dtype} "
                         f"{gamma.shape}")
    ln = norm_type == "layernorm"
    if ln:
        if beta is None or mu is None:
            raise ValueError(f"{_NORM_OP}: beta/mu: layernorm needs both")
        beta, mu = jnp.asarray(beta), jnp.asarray(mu)
        if beta.shape != gamma.shape or beta.dtype != gamma.dtype:
            raise ValueError(f"{_NORM_OP}: beta: expected gamma's {gamma.dtype} {gamma.shape}, got {beta.dtype} "
                             f"{beta.shape}")
    elif beta is not None or mu is not None:
        raise ValueError(f"{_NORM_OP}: beta/mu: rmsnorm takes neither (pass None)")
    for name, v in (("mu", mu), ("rsigma", rsigma)):
        if v is not None and (v.shape != lead or v.dtype != jnp.float32):
            raise ValueError(f"{_NORM_OP}: {name}: expected float32 of shape {lead}, got {v.dtype} {v.shape}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FP8_DTYPES:
        raise TypeError(f"{_NORM_OP}: out_dtype: expected float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if not (rowwise or colwise):
        raise ValueError(f"{_NORM_OP}: rowwise/colwise: neither copy requested")
    if mxfp8 and pow2_scales:
        raise ValueError(f"{_NORM_OP}: pow2_scales: MXFP8 scales are powers of two already; pass False")
    empty = jnp.zeros((0,), jnp.float32)
    outs = norm_quantize_block_p.bind(
        x, gamma, beta if ln else jnp.zeros((0,), gamma.dtype), mu if ln else empty, rsigma,
        norm_type=np.int32(_NORM_TYPES[norm_type]), zero_centered_gamma=np.bool_(zero_centered_gamma),
        mxfp8=np.bool_(mxfp8), pow2_scales=np.bool_(pow2_scales), out_dtype=out_dtype, rowwise=bool(rowwise),
        colwise=bool(colwise))
    return _pack(tuple(outs[:2]) * bool(rowwise) + tuple(outs[2:]) * bool(colwise), bool(rowwise), bool(colwise))
