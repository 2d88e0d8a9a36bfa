"""lowbit.activation: TE's `activation(x, activation_type, quantizer)` with a custom_vjp over
lowbit's fused activation ops (lowbit.ops.act_forward / act_backward).

activation_type is TE's tuple: ("gelu",), ("silu",), ("relu",), ("quick_gelu",),
("squared_relu",), ("linear",); gated (second name "linear"): ("gelu", "linear") = geglu,
("silu", "linear") = swiglu, ("relu", "linear") = reglu, ("quick_gelu", "linear") = qgeglu,
("squared_relu", "linear") = sreglu; ("clamped_silu", "clamped_linear") = GPT-OSS clamped
swiglu (act_params: anything with .limit and .alpha, default 7.0 and 1.702, like TE's
ClampedSwigluParams). x is (..., len(activation_type), H) as in TE, or (..., H) for a
single activation; the result is (..., H) in x's dtype.

quantizer: None returns the high-precision activation. A quantizer returns the activation as
that quantizer codes it, dequantized back to x's dtype, as TE's activation does: its gradient
is the unquantized activation's (the quantize passes gradients straight through; the
quantizer gets none). quantized_activation() returns the ScaledTensor itself (forward only:
x's gradient is cut there; the fused MLP functions own that dataflow). The quantized copy
comes from: a DelayedScaleQuantizer, the fused kernel (its stored scale, quantizing the fp32
activation directly); a BlockScaleQuantizer of MXFP8 or FP8 block 1x128 tiles, the fused
activation + block quantization of the fp32 activation (lowbit.ops.act_quantize_block:
block_quantized()) only with LOWBIT_FUSED_BLOCK=1 (off by default: slower than the unfused
pair on an H100, see lowbit/ops/fused_block.py); any other quantizer, and those by default,
its own quantize() of the activation in x's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp

from lowbit.ops.activation import act_backward, act_forward
from lowbit.ops.fused_block import act_quantize_block, fused_block_enabled
from lowbit.quantize.quantizer import check_quantizer, no_gradient

_NAMES = ("gelu", "silu", "relu", "quick_gelu", "squared_relu", "linear")


def parse_activation_type(op: str, activation_type) -> tuple[str, bool]:
    """TE's activation tuple -> (act_type of lowbit.ops.act_forward, gated)."""
    t = tuple(activation_type) if not isinstance(activation_type, str) else (activation_type,)
    if t == ("clamped_silu", "clamped_linear"):
        return "clamped_silu", True
    if len(t) == 1 and t[0] in _NAMES:
        return t[0], False
    if len(t) == 2 and t[0] in _NAMES and t[1] == "linear":
        return t[0], True
    raise ValueError(f"{op}: activation_type: expected one of (name,) or (name, 'linear') with "
                     f"name in {_NAMES}, or ('clamped_silu', 'clamped_linear'); got {activation_type!r}")


# TE's ClampedSwigluParams defaults: the clamped swiglu that the fused MLP paths run
# (lowbit.layernorm_mlp, the LayerNormMLP modules); activation() takes other values.
CLAMPED_SWIGLU_DEFAULTS = {"limit": 7.0, "alpha": 1.702}


def check_activation_params(op: str, activation_params) -> None:
    """TE's `activation_params` of layernorm_mlp / LayerNormMLP (a dict for
    ActivationParams.create): None, or clamped swiglu's at TE's defaults; anything else is an
    error naming op (lowbit's fused MLP kernels run those defaults only)."""
    if activation_params is None:
        return
    ok = (isinstance(activation_params, Mapping)  # a module field arrives as a FrozenDict
          and set(activation_params) <= set(CLAMPED_SWIGLU_DEFAULTS))
    if ok:
        try:
            ok = all(float(v) == CLAMPED_SWIGLU_DEFAULTS[k] for k, v in activation_params.items())
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(f"{op}: activation_params: expected None or clamped swiglu's defaults "
                         f"{CLAMPED_SWIGLU_DEFAULTS} (other values: lowbit.activation(act_params=...)), "
                         f"got {activation_params!r}")


def _params(act_params):
    if act_params is None:
        return 7.0, 1.702
    if not (hasattr(act_params, "limit") and hasattr(act_params, "alpha")):
        raise TypeError(f"lowbit.activation: act_params: expected an object with .limit and .alpha "
                        f"(clamped swiglu's), got {act_params!r}")
    return float(act_params.limit), float(act_params.alpha)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _act(x, act_type, gated, limit, alpha):
    return act_forward(x, act_type, gated=gated, limit=limit, alpha=alpha).y


def _act_fwd(x, act_type, gated, limit, alpha):
    return _act(x, act_type, gated, limit, alpha), x


def _act_bwd(act_type, gated, limit, alpha, x, dz):
    return (act_backward(dz, x, act_type, gated=gated, limit=limit, alpha=alpha).dx,)


_act.defvjp(_act_fwd, _act_bwd)


def activation(x, activation_type=("gelu",), quantizer=None, act_params=None):
    """act(x) (gated: act(x[..., 0, :]) * x[..., 1, :]) over the last axis, in x's dtype; with a
    quantizer, its quantized values (see the module doc)."""
    op = "lowbit.activation"
    x, act_type, gated, limit, alpha = _prepare(op, x, activation_type, act_params)
    if quantizer is None:
        return _act(x, act_type, gated, limit, alpha)
    check_quantizer(op, quantizer)
    return _act_dequantized(x, quantizer, act_type, gated, limit, alpha)


def quantized_activation(x, activation_type, quantizer, act_params=None):
    """The ScaledTensor of activation(x) as `quantizer` codes it (forward only; module doc)."""
    op = "lowbit.quantized_activation"
    x, act_type, gated, limit, alpha = _prepare(op, x, activation_type, act_params)
    check_quantizer(op, quantizer)
    return _quantized(jax.lax.stop_gradient(x), act_type, gated, limit, alpha, quantizer)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _act_dequantized(x, quantizer, act_type, gated, limit, alpha):
    return _quantized(x, act_type, gated, limit, alpha, quantizer).dequantize()


def _act_dequantized_fwd(x, quantizer, act_type, gated, limit, alpha):
    return _act_dequantized(x, quantizer, act_type, gated, limit, alpha), (x, quantizer)


def _act_dequantized_bwd(act_type, gated, limit, alpha, residuals, dz):
    x, quantizer = residuals
    dx = act_backward(dz, x, act_type, gated=gated, limit=limit, alpha=alpha).dx
    return dx, no_gradient(quantizer)


_act_dequantized.defvjp(_act_dequantized_fwd, _act_dequantized_bwd)


def _prepare(op, x, activation_type, act_params):
    act_type, gated = parse_activation_type(op, activation_type)
    x = jnp.asarray(x)
    n = 2 if gated else 1
    if not gated and x.ndim >= 2 and x.shape[-2] == 1:
        x = x.reshape(*x.shape[:-2], x.shape[-1])
    if gated and (x.ndim < 2 or x.shape[-2] != n):
        raise ValueError(f"{op}: x: expected shape (..., {n}, H) for {activation_type!r}, got {x.shape}")
    limit, alpha = _params(act_params)
    return x, act_type, gated, limit, alpha


def _quantized(x, act_type, gated, limit, alpha, quantizer):
    """The ScaledTensor of the activation of x (no gradient rule: callers own that)."""
    from lowbit.quantize.delayed import scale_inverse
    from lowbit.quantize.quantizer import DelayedScaleQuantizer
    from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x

    layout = quantizer.q_layout
    fused = block_quantized(x, act_type, gated, limit, alpha, quantizer, layout.has_rowwise, layout.has_colwise)
    if fused is not None:
        return fused
    if not isinstance(quantizer, DelayedScaleQuantizer):
        y = act_forward(x, act_type, gated=gated, limit=limit, alpha=alpha).y
        return quantizer.quantize(y, is_rowwise=layout.has_rowwise, is_colwise=layout.has_colwise)[0]
    scale = quantizer.scale.reshape(1)
    out = act_forward(x, act_type, gated=gated, limit=limit, alpha=alpha, quant_scale=scale,
                      quant_dtype=quantizer.q_dtype, rowwise=layout.has_rowwise,
                      colwise=layout.has_colwise, return_y=False)
    scale_inv = scale_inverse(scale).reshape(1)  # correctly rounded on every backend
    lead = x.shape[:-2] if gated else x.shape[:-1]
    fa = len(lead)

    def one(data, colwise):
        if colwise:  # (H, rows) -> the tensor-scaling colwise layout (H, *lead)
            data = data.reshape(x.shape[-1], *lead)
        return ScaledTensor1x(data=data, scale_inv=scale_inv, amax=out.amax,
                              scaling_mode=quantizer.scaling_mode, dq_dtype=x.dtype,
                              is_colwise=colwise, flatten_axis=fa)

    if layout.has_rowwise and layout.has_colwise:
        return ScaledTensor2x(one(out.q_rowwise, False), one(out.q_colwise, True))
    return one(out.q_colwise, True) if layout.has_colwise else one(out.q_rowwise, False)


def block_quantizes(quantizer) -> bool:
    """Whether block_quantized fuses the activation with this quantizer (else it gives None)."""
    from lowbit.quantize.quantizer import BlockScaleQuantizer
    from lowbit.quantize.scaling_modes import ScalingMode

    modes = (ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_BLOCK_1x128)
    return (isinstance(quantizer, BlockScaleQuantizer) and quantizer.mode in modes
            and fused_block_enabled())


def block_quantized(x, act_type, gated, limit, alpha, quantizer, rowwise: bool, colwise: bool):
    """The activation of x quantized by a BlockScaleQuantizer of MXFP8 or FP8 block 1x128
    tiles in one fused pass (the fp32 activation quantized directly), as the ScaledTensor
    quantizer.quantize() of the activation would be (flatten_axis: the activation's lead
    dims); None for any other quantizer (the caller quantizes the activation itself)."""
    from lowbit.quantize.scaling_modes import ScalingMode
    from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x

    if not block_quantizes(quantizer):
        return None
    mxfp8 = quantizer.mode == ScalingMode.MXFP8_1D_SCALING
    out = act_quantize_block(x, act_type, gated=gated, limit=limit, alpha=alpha, mxfp8=mxfp8,
                             out_dtype=quantizer.q_dtype,
                             pow2_scales=quantizer.use_power_2_scales and not mxfp8,  # MXFP8: unused
                             rowwise=rowwise, colwise=colwise)
    axis = x.ndim - (2 if gated else 1)

    def one(data, scale, is_colwise):
        return ScaledTensor1x(data=data, scale_inv=scale, amax=None, scaling_mode=quantizer.mode,
                              dq_dtype=x.dtype, is_colwise=is_colwise, flatten_axis=axis)

    if rowwise and colwise:
        return ScaledTensor2x(one(out.rowwise, out.rowwise_scale, False), one(out.colwise, out.colwise_scale, True))
    return one(out.colwise, out.colwise_scale, True) if colwise else one(out.rowwise, out.rowwise_scale, False)
