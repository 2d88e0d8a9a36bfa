"""lowbit.layernorm_mlp: norm -> GEMM1 (+bias) -> activation -> GEMM2 (+bias), one custom_vjp.

Forward, with x viewed as (M, H), wi as (H, n_act*F) and wo as (F, H):
    ln  = norm(x), quantized (rowwise + colwise) in the norm's pass      (delayed scaling)
    h   = gemm(ln, wi) + wi_bias                                          checkpoint "ffn1"
    a   = act(h) (gated: act(h[:, 0]) * h[:, 1]), quantized in the act's pass
    With fp32 h (fp32 x), except on the fused block path (LOWBIT_FUSED_BLOCK=1, below):
    h = gemm(ln, wi) without the bias, checkpoint "ffn1" on that pre-bias h, and the
    activation kernels add wi_bias in their own pass, forward and backward: the same single
    fp32 add the GEMM's f32 bias was (an XLA add after the custom call), so the same bits,
    without XLA's separate read + write of h. bf16/f16 h keeps the bias in the GEMM's
    epilogue, which rounds once: an add after that rounding would change the numerics.
    out = gemm(a, wo) + wo_bias                                           checkpoint "ffn2"
Backward:
    da          = dgrad of GEMM2; dwo and dwo_bias from dy's quantize pass
    dh          = dact(da, h) with dwi_bias and the quantization in the same pass
    dln, dwi    = dgrad / wgrad of GEMM1
    dx, dgamma, dbeta = norm backward
With current scaling the fused kernels write the high-precision output and the quantize op
follows (the scale needs that output's amax first). The block recipes (Float8BlockScaling,
MXFP8BlockScaling) write ln and `a` in x's dtype and their block quantizers follow; with
LOWBIT_FUSED_BLOCK=1 they block-quantize ln and `a` in one pass each over their inputs
instead, from the fp32 values: ln through layernorm_dense.norm_block_quantized (the norm's
statistics launch, then lowbit.ops.norm_quantize_block), `a` through
lowbit.activation.block_quantized (lowbit.ops.act_quantize_block); that path is off by
default because it measured slower on an H100 (lowbit/ops/fused_block.py). Either way the
block-scaled GEMMs of dense follow. NVFP4 takes the unfused path for both (output in x's dtype, then its
quantizer), with dense's NVFP4 GEMMs (its key: `sr_key`, see layernorm_mlp). The
backward is the same for every recipe. Saved
for the backward: x, mu, rsigma, h (high precision, the activation's backward needs it;
pre-bias when the activation adds the bias, which is then saved too) and
the quantized copies ln.colwise, wi.rowwise, a.colwise and wo.rowwise. `ffn1_ckpt_name` /
`ffn2_ckpt_name` name h and out for remat policies.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowbit.activation import block_quantized, block_quantizes, check_activation_params, parse_activation_type
from lowbit.dense import (backward_gemms, check_quantizer_set, dense, dgrad_wgrad, forward_gemm, quantize_2x,
                          require_quantizer_set, with_sr_key)
from lowbit.layernorm import NormConfig, fused_2x, layernorm, norm_quantize
from lowbit.layernorm_dense import norm_block_quantized
from lowbit.ops.activation import act_backward, act_forward
from lowbit.ops.norm import canonical_norm_type, norm_backward
from lowbit.quantize.quantizer import DelayedScaleQuantizer, noop_quantizer_set
from lowbit.sharding import check_batch_first, logical_constraint

__all__ = ["layernorm_mlp"]


class _Static(NamedTuple):
    cfg: NormConfig
    act_type: str
    gated: bool
    x_shape: tuple[int, ...]
    wi_shape: tuple[int, ...]
    wo_shape: tuple[int, ...]
    wi_dtype: jnp.dtype
    wo_dtype: jnp.dtype
    wi_bias_shape: tuple[int, ...] | None
    has_wo_bias: bool
    ffn1_ckpt_name: str
    ffn2_ckpt_name: str


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernels: Sequence[jax.Array],
    biases: Sequence[jax.Array | None] = (None, None),
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    norm_input_axes=None,
    dot_1_input_axes=None,
    dot_2_input_axes=None,
    kernel_1_axes=None,
    kernel_2_axes=None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[str] = ("gelu",),
    quantizer_sets=(noop_quantizer_set, noop_quantizer_set),
    sr_key=None,
    *,
    activation_params: dict | None = None,
    transpose_batch_sequence: bool = False,
) -> jax.Array:
    """The MLP block of a transformer layer: x (..., H), kernels (wi (H, n_act, F) or (H, F),
    wo (F, H)), biases (wi_bias (n_act, F) or (F,), wo_bias (H,); None for none). sr_key: the
    PRNG key of NVFP4's stochastic rounding and RHT signs; GEMM i's set gets
    with_sr_key(quantizer_sets[i], fold_in(sr_key, i)) (lowbit.dense.with_sr_key): SR streams
    per quantizer, one RHT sign vector per GEMM, shared by the copies its wgrad multiplies.
    norm_input_axes, kernel_1_axes, kernel_2_axes: logical sharding constraints on x, wi and
    wo; dot_1_input_axes, dot_2_input_axes: accepted, not applied (lowbit.sharding says why).
    TE's keywords: activation_params None or clamped swiglu's defaults (limit 7.0, alpha
    1.702, what the fused kernels run), transpose_batch_sequence False only."""
    del dot_1_input_axes, dot_2_input_axes  # name the fused ops' quantized copies
    op = "lowbit.layernorm_mlp"
    check_batch_first(op, transpose_batch_sequence)
    check_activation_params(op, activation_params)
    for arg, value in (("kernels", kernels), ("biases", biases), ("quantizer_sets", quantizer_sets)):
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"{op}: {arg}: expected a pair (one per GEMM), got {type(value).__name__}"
                             + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else ""))
    for i, qs in enumerate(quantizer_sets):
        require_quantizer_set(op, qs, f"quantizer_sets[{i}]")
    biases = tuple(None if b is None else jnp.asarray(b) for b in biases)
    beta = None if beta is None else jnp.asarray(beta)
    x, gamma = logical_constraint(jnp.asarray(x), norm_input_axes), jnp.asarray(gamma)
    cfg = NormConfig(canonical_norm_type(norm_type), bool(zero_centered_gamma), float(epsilon))
    cfg.check(op, x, gamma, beta)
    act_type, gated = parse_activation_type(op, activation_type)
    wi = logical_constraint(jnp.asarray(kernels[0]), kernel_1_axes)
    wo = logical_constraint(jnp.asarray(kernels[1]), kernel_2_axes)
    wi_bias, wo_bias = biases
    hidden = x.shape[-1]
    n_act = 2 if gated else 1
    if wi.shape[0] != hidden or wi.size % (hidden * n_act):
        raise ValueError(f"{op}: kernels[0]: expected (H={hidden}, {n_act}, F), got {wi.shape}")
    ffn = wi.size // (hidden * n_act)
    if tuple(wo.shape) != (ffn, hidden):
        raise ValueError(f"{op}: kernels[1]: expected ({ffn}, {hidden}), got {tuple(wo.shape)}")
    # (n_act, F) as TE's module makes it, or flat; a (F, n_act) bias would be read transposed.
    if wi_bias is not None and tuple(jnp.shape(wi_bias)) not in ((n_act, ffn), (n_act * ffn,)):
        raise ValueError(f"{op}: biases[0]: expected shape ({n_act}, {ffn}) or ({n_act * ffn},), got "
                         f"{tuple(jnp.shape(wi_bias))}")
    if wo_bias is not None and tuple(wo_bias.shape) != (hidden,):
        raise ValueError(f"{op}: biases[1]: expected shape ({hidden},), got {tuple(wo_bias.shape)}")
    # Also without a key: with_sr_key ties each set's RHT signs (x's and dy's colwise copies).
    qs1, qs2 = (with_sr_key(qs, None if sr_key is None else jax.random.fold_in(sr_key, i))
                for i, qs in enumerate(quantizer_sets))
    quantized = check_quantizer_set(op, qs1)
    if quantized != check_quantizer_set(op, qs2):
        raise ValueError(f"{op}: quantizer_sets: quantize both GEMMs or neither")
    if not quantized:
        return _unquantized(x, gamma, beta, wi, wo, wi_bias, wo_bias, cfg, activation_type,
                            ffn1_ckpt_name, ffn2_ckpt_name)
    static = _Static(cfg, act_type, gated, tuple(x.shape), tuple(wi.shape), tuple(wo.shape),
                     jnp.dtype(wi.dtype), jnp.dtype(wo.dtype),
                     None if wi_bias is None else tuple(wi_bias.shape),
                     wo_bias is not None, ffn1_ckpt_name, ffn2_ckpt_name)
    cast = lambda b: None if b is None else jnp.asarray(b).astype(x.dtype)  # noqa: E731
    return _layernorm_mlp(x, gamma, beta, wi, wo, cast(wi_bias), cast(wo_bias), qs1, qs2, static)


def _unquantized(x, gamma, beta, wi, wo, wi_bias, wo_bias, cfg, activation_type, name1, name2):
    from lowbit.activation import activation

    ln = layernorm(x, gamma, beta, *cfg)
    n_act = len(activation_type)
    wi3 = wi.reshape(x.shape[-1], n_act, -1)
    h = dense(ln, wi3, None if wi_bias is None else wi_bias.reshape(n_act, -1),
              contracting_dims=((x.ndim - 1,), (0,)))
    h = checkpoint_name(h, name1)
    a = activation(h if n_act > 1 else h.reshape(*h.shape[:-2], -1), activation_type)
    out = dense(a, wo, wo_bias, contracting_dims=((a.ndim - 1,), (0,)))
    return checkpoint_name(out, name2)


@partial(jax.custom_vjp, nondiff_argnums=(9,))
def _layernorm_mlp(x, gamma, beta, wi, wo, wi_bias, wo_bias, qs1, qs2, static):
    return _fwd(x, gamma, beta, wi, wo, wi_bias, wo_bias, qs1, qs2, static)[0]


# The activation kernels take wi_bias where h is fp32 (the module docstring); False: the GEMM
# adds it (the previous formula, kept for the tests that check both give the same bits).
BIAS_IN_ACTIVATION = True


def _bias_in_activation(wi_bias, h_dtype, act_quantizer) -> bool:
    return (BIAS_IN_ACTIVATION and wi_bias is not None and jnp.dtype(h_dtype) == jnp.float32
            and not block_quantizes(act_quantizer))


def _fwd(x, gamma, beta, wi, wo, wi_bias, wo_bias, qs1, qs2, static):
    # Nothing is flattened: tokens keep their (batch, seq) dims and the gated kernel its
    # (H, 2, F) layout, so every dim keeps its sharding (no gather of a TP-sharded F).
    n_lead = x.ndim - 1
    hidden = x.shape[-1]
    fused = norm_block_quantized(x, gamma, beta, static.cfg, qs1.x, False)          # block recipes
    lnq, _, mu, rsigma = fused if fused is not None else norm_quantize(x, gamma, beta, static.cfg, qs1.x, False)
    wi = wi.reshape(hidden, 2, -1) if static.gated else wi.reshape(hidden, -1)      # (H, [2,] F)
    wiq = quantize_2x(qs1.kernel, wi, 1)
    wi_bias = None if wi_bias is None else wi_bias.reshape(wi.shape[1:])
    act_bias = wi_bias if _bias_in_activation(wi_bias, x.dtype, qs2.x) else None
    h = forward_gemm(lnq, wiq, None if act_bias is not None else wi_bias, x.dtype,   # (M..., [2,] F)
                     1, qs1.accumulation)
    h = checkpoint_name(h, static.ffn1_ckpt_name)
    if isinstance(qs2.x, DelayedScaleQuantizer):
        a = act_forward(h, static.act_type, gated=static.gated, quant_scale=qs2.x.scale.reshape(1),
                        quant_dtype=qs2.x.q_dtype, rowwise=True, colwise=True, return_y=False,
                        keep_dims=True, bias=act_bias)
        aq = fused_2x(qs2.x, a.q_rowwise, a.q_colwise, a.amax, x.dtype, n_lead)
    else:
        # Block recipes: fused (None for the others); act_forward's default limit / alpha.
        aq = block_quantized(h, static.act_type, static.gated, 7.0, 1.702, qs2.x, True, True)
        if aq is None:
            a = act_forward(h, static.act_type, gated=static.gated, bias=act_bias)
            aq = quantize_2x(qs2.x, a.y, n_lead)                                     # (M..., F)
    woq = quantize_2x(qs2.kernel, wo, 1)
    out = forward_gemm(aq, woq, wo_bias, x.dtype, 1, qs2.accumulation)              # (M..., H)
    out = checkpoint_name(out, static.ffn2_ckpt_name)
    residuals = (x, mu, rsigma, gamma, lnq.colwise_tensor, wiq.rowwise_tensor, h, act_bias,
                 aq.colwise_tensor, woq.rowwise_tensor, qs1, qs2,
                 (lnq.amax, wiq.amax, aq.amax, woq.amax))
    return out, residuals


def _bwd(static, residuals, dy):
    (x, mu, rsigma, gamma, ln_col, wi_row, h, act_bias, a_col, wo_row, qs1, qs2, amaxes) = residuals
    ln_amax, wi_amax, a_amax, wo_amax = amaxes
    n_lead = x.ndim - 1
    has_wi_bias = static.wi_bias_shape is not None
    da, dwo, dwo_bias, dy_amax = backward_gemms(
        dy, a_col, wo_row, qs2.dgrad, static.has_wo_bias, x.dtype, static.wo_dtype, n_lead,
        qs2.accumulation)
    if isinstance(qs1.dgrad, DelayedScaleQuantizer):
        g = act_backward(da, h, static.act_type, gated=static.gated,
                         quant_scale=qs1.dgrad.scale.reshape(1), quant_dtype=qs1.dgrad.q_dtype,
                         rowwise=True, colwise=True, compute_dbias=has_wi_bias, keep_dims=True,
                         return_dx=False, bias=act_bias)  # only the FP8 copies are used: no dx
        dhq = fused_2x(qs1.dgrad, g.q_rowwise, g.q_colwise, g.amax, x.dtype, n_lead)
        dwi_bias, dh_amax = g.dbias, g.amax
    else:
        g = act_backward(da, h, static.act_type, gated=static.gated, bias=act_bias)
        dhq, dwi_bias = qs1.dgrad.quantize(g.dx, is_rowwise=True, is_colwise=True,
                                           flatten_axis=n_lead, compute_dbias=has_wi_bias)
        dh_amax = dhq.amax
    dln, dwi = dgrad_wgrad(dhq, ln_col, wi_row, x.dtype, static.wi_dtype, n_lead, qs1.accumulation)
    dx, dgamma, dbeta = norm_backward(dln, x, mu, rsigma, gamma, **static.cfg.kwargs())
    new_qs1 = qs1._replace(x=qs1.x.update(ln_amax), kernel=qs1.kernel.update(wi_amax),
                           dgrad=qs1.dgrad.update(dh_amax))
    new_qs2 = qs2._replace(x=qs2.x.update(a_amax), kernel=qs2.kernel.update(wo_amax),
                           dgrad=qs2.dgrad.update(dy_amax))
    if has_wi_bias:
        dwi_bias = dwi_bias.reshape(static.wi_bias_shape)
    dbeta = dbeta if static.cfg.norm_type == "layernorm" else None
    return (dx, dgamma, dbeta, dwi.reshape(static.wi_shape), dwo,
            dwi_bias, dwo_bias if static.has_wo_bias else None, new_qs1, new_qs2)


_layernorm_mlp.defvjp(_fwd, _bwd)
