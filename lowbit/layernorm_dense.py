"""lowbit.layernorm_dense: norm -> quantize -> GEMM (+ bias) in one custom_vjp.

Forward: the norm writes its output already quantized (rowwise for the GEMM, the transposed
colwise copy for the weight gradient; one pass with delayed scaling, see
layernorm.norm_quantize), the kernel is quantized as in dense, and
y = gemm(ln.rowwise, kernel.colwise) + bias. Backward: dgrad and wgrad GEMMs as in dense,
then lowbit's norm backward turns d(ln) into dx, dgamma and dbeta. Saved for the backward:
x, mu, rsigma (the norm needs them) and the FP8 copies ln.colwise and kernel.rowwise.
`return_layernorm_output=True` also returns the norm's output in x's dtype (its gradient
is added to the GEMM's before the norm backward).
Block recipes (Float8BlockScaling 1x128, MXFP8BlockScaling): by default the norm writes its
output in x's dtype and the block quantizer follows; with LOWBIT_FUSED_BLOCK=1 (off by
default: slower on an H100, see lowbit/ops/fused_block.py) norm_block_quantized: a
statistics launch of the norm forward (mu, rsigma; y only with return_layernorm_output),
then lowbit.ops.norm_quantize_block block-quantizes the fp32 norm output computed from them
in one pass over x (norm_forward's own elementwise formula, so the codes are those of the
block quantizer applied to norm_forward's fp32 y), then the block-scaled GEMMs of dense; the
backward is unchanged. NVFP4 (NVFP4BlockScaling) writes the norm output in x's dtype and its
quantizer follows (unfused), with dense's NVFP4 GEMMs; its key comes in as `sr_key`
(or already in the set, lowbit.dense.with_sr_key).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowbit.dense import (backward_gemms, check_quantizer_set, dense, forward_gemm, quantize_2x,
                          require_quantizer_set, with_sr_key)
from lowbit.layernorm import NormConfig, layernorm, norm_quantize
from lowbit.ops.fused_block import fused_block_enabled, norm_quantize_block, norm_stats
from lowbit.ops.norm import canonical_norm_type, norm_backward, norm_forward
from lowbit.quantize.quantizer import QuantizerSet, noop_quantizer_set
from lowbit.sharding import check_batch_first, logical_constraint

__all__ = ["layernorm_dense", "norm_block_quantized"]


class _Static(NamedTuple):
    cfg: NormConfig
    x_shape: tuple[int, ...]
    kernel_shape: tuple[int, ...]
    kernel_dtype: jnp.dtype
    has_bias: bool
    return_ln: bool


def layernorm_dense(
    x: jax.Array,
    kernel: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    bias: jax.Array | None = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    layernorm_input_axes=None,
    dot_input_axes=None,
    kernel_axes=None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    return_layernorm_output: bool = False,
    sr_key=None,
    *,
    transpose_batch_sequence: bool = False,
):
    """norm(x) . kernel (+ bias): x (..., H), kernel (H, N...), output (..., N...) in x's
    dtype; with return_layernorm_output, (output, norm(x)). sr_key: the PRNG key of NVFP4's
    stochastic rounding and RHT signs, given to the set as lowbit.dense does (with_sr_key: SR
    streams per quantizer, one sign vector for ln's and dy's colwise copies).
    layernorm_input_axes, kernel_axes: logical sharding constraints on x and kernel;
    dot_input_axes: accepted, not applied (lowbit.sharding says why); transpose_batch_sequence
    (TE's keyword): False only."""
    del dot_input_axes  # names the norm's quantized copies, inside the fused op
    op = "lowbit.layernorm_dense"
    check_batch_first(op, transpose_batch_sequence)
    require_quantizer_set(op, quantizer_set)
    quantizer_set = with_sr_key(quantizer_set, sr_key)
    x, kernel, gamma = jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(gamma)
    beta = None if beta is None else jnp.asarray(beta)
    bias = None if bias is None else jnp.asarray(bias)
    x, kernel = logical_constraint(x, layernorm_input_axes), logical_constraint(kernel, kernel_axes)
    cfg = NormConfig(canonical_norm_type(norm_type), bool(zero_centered_gamma), float(epsilon))
    cfg.check(op, x, gamma, beta)
    if kernel.ndim == 0 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: kernel: expected first dim {x.shape[-1]} (x's hidden), got {kernel.shape}")
    out_free = kernel.shape[1:]
    if bias is not None and tuple(bias.shape) != tuple(out_free):
        raise ValueError(f"{op}: bias: expected shape {tuple(out_free)}, got {tuple(bias.shape)}")
    quantized = check_quantizer_set(op, quantizer_set)
    if quantized and kernel.ndim == 1:
        raise ValueError(f"{op}: kernel: a quantized layernorm_dense needs an output dim; kernel of shape "
                         f"{tuple(kernel.shape)} has none (add one of size 1)")
    if not quantized:
        ln = layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
        y = dense(ln, kernel, bias, contracting_dims=((x.ndim - 1,), (0,)))
        return (y, ln) if return_layernorm_output else y
    bias = None if bias is None else bias.astype(x.dtype)
    static = _Static(cfg, tuple(x.shape), tuple(kernel.shape), jnp.dtype(kernel.dtype),
                     bias is not None, bool(return_layernorm_output))
    y, ln = _layernorm_dense(x, kernel, gamma, beta, bias, quantizer_set, static)
    return (y, ln) if return_layernorm_output else y


def norm_block_quantized(x, gamma, beta, cfg: NormConfig, quantizer, want_y: bool):
    """norm_quantize (lowbit.layernorm) for a BlockScaleQuantizer of MXFP8 or FP8 block 1x128
    tiles, fused: (ScaledTensor2x of rowwise (M..., H) + colwise copies, y in x's dtype or
    None, mu, rsigma); None for any other quantizer."""
    from lowbit.quantize.quantizer import BlockScaleQuantizer
    from lowbit.quantize.scaling_modes import ScalingMode
    from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x

    modes = (ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_BLOCK_1x128)
    if not isinstance(quantizer, BlockScaleQuantizer) or quantizer.mode not in modes:
        return None
    if not fused_block_enabled():
        return None
    ln = cfg.norm_type == "layernorm"
    if want_y:
        stats = norm_forward(x, gamma, beta, epsilon=cfg.epsilon, **cfg.kwargs())
        y, mu, rsigma = stats.y, stats.mu, stats.rsigma
    else:
        y = None
        mu, rsigma = norm_stats(x, gamma, beta, epsilon=cfg.epsilon, **cfg.kwargs())
    mxfp8 = quantizer.mode == ScalingMode.MXFP8_1D_SCALING
    q = norm_quantize_block(x, gamma, beta if ln else None, mu, rsigma,
                            mxfp8=mxfp8, out_dtype=quantizer.q_dtype,
                            pow2_scales=quantizer.use_power_2_scales and not mxfp8,  # MXFP8: unused
                            rowwise=True, colwise=True, **cfg.kwargs())

    def one(data, scale, is_colwise):
        return ScaledTensor1x(data=data, scale_inv=scale, amax=None, scaling_mode=quantizer.mode,
                              dq_dtype=x.dtype, is_colwise=is_colwise, flatten_axis=x.ndim - 1)

    xq = ScaledTensor2x(one(q.rowwise, q.rowwise_scale, False), one(q.colwise, q.colwise_scale, True))
    return xq, y, mu, rsigma


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _layernorm_dense(x, kernel, gamma, beta, bias, quantizer_set, static):
    return _fwd(x, kernel, gamma, beta, bias, quantizer_set, static)[0]


def _fwd(x, kernel, gamma, beta, bias, quantizer_set, static):
    # No flattening: every dim keeps its sharding (tokens, hidden, the kernel's out dims).
    fused = norm_block_quantized(x, gamma, beta, static.cfg, quantizer_set.x, static.return_ln)
    if fused is None:
        fused = norm_quantize(x, gamma, beta, static.cfg, quantizer_set.x, static.return_ln)
    xq, ln, mu, rsigma = fused
    kq = quantize_2x(quantizer_set.kernel, kernel, 1)
    y = forward_gemm(xq, kq, bias, x.dtype, 1, quantizer_set.accumulation)
    ln = ln if static.return_ln else None
    residuals = (x, mu, rsigma, gamma, xq.colwise_tensor, kq.rowwise_tensor, quantizer_set,
                 xq.amax, kq.amax)
    return (y, ln), residuals


def _bwd(static, residuals, cotangents):
    dy, dln_out = cotangents
    x, mu, rsigma, gamma, ln_col, k_row, quantizer_set, x_amax, k_amax = residuals
    dln, dw, dbias, dy_amax = backward_gemms(
        dy, ln_col, k_row, quantizer_set.dgrad, static.has_bias, x.dtype, static.kernel_dtype,
        len(static.x_shape) - 1, quantizer_set.accumulation,
    )
    if static.return_ln:
        dln = dln + dln_out.astype(dln.dtype)
    dx, dgamma, dbeta = norm_backward(dln, x, mu, rsigma, gamma, **static.cfg.kwargs())
    new_set = quantizer_set._replace(
        x=quantizer_set.x.update(x_amax),
        kernel=quantizer_set.kernel.update(k_amax),
        dgrad=quantizer_set.dgrad.update(dy_amax),
    )
    dbeta = dbeta if static.cfg.norm_type == "layernorm" else None
    return dx, dw, dgamma, dbeta, (dbias if static.has_bias else None), new_set


_layernorm_dense.defvjp(_fwd, _bwd)
