"""lowbit.activation: TE's `activation(x, activation_type, quantizer)` with a custom_vjp over
lowbit's fused activation ops (lowbit.ops.act_forward / act_backward).

activation_type is TE's tuple: ("gelu",), ("silu",), ("relu",), ("quick_gelu",),
("squared_relu",), ("linear",); gated (second name "linear"): ("gelu", "linear") = geglu,
("silu", "linear") = swiglu, ("relu", "linear") = reglu, ("quick_gelu", "linear") = qgeglu,
("squared_relu", "linear") = sreglu; ("clamped_silu", "clamped_linear") = GPT-OSS clamped
swiglu (act_params: anything with .limit and .alpha, default 7.0 and 1.702, like TE's
ClampedSwigluParams). x is (..., len(activation_type), H) as in TE, or (..., H) for a
single activation; the result is (..., H) in x's dtype.

quantizer: None returns the high-precision activation (differentiable). A quantizer returns
the ScaledTensor of the activation instead: a DelayedScaleQuantizer through the fused kernel
(its stored scale, quantizing the fp32 activation directly); a BlockScaleQuantizer of MXFP8
or FP8 block 1x128 tiles through the fused activation + block quantization of the fp32
activation (lowbit.ops.act_quantize_block: block_quantized()) only with
LOWBIT_FUSED_BLOCK=1 (off by default: slower than the unfused pair on an H100, see
lowbit/ops/fused_block.py); any other quantizer, and those by default, through its own
quantize() of the activation in x's dtype. Quantized outputs
carry no gradient (the fused MLP functions own that dataflow).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from lowbit.ops.activation import act_backward, act_forward
from lowbit.ops.fused_block import act_quantize_block, fused_block_enabled

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


def _params(act_params):
    if act_params is None:
        return 7.0, 1.702
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
    """act(x) (gated: act(x[..., 0, :]) * x[..., 1, :]) over the last axis; see the module doc."""
    op = "lowbit.activation"
    act_type, gated = parse_activation_type(op, activation_type)
    x = jnp.asarray(x)
    n = 2 if gated else 1
    if not gated and x.ndim >= 2 and x.shape[-2] == 1:
        x = x.reshape(*x.shape[:-2], x.shape[-1])
    if gated and (x.ndim < 2 or x.shape[-2] != n):
        raise ValueError(f"{op}: x: expected shape (..., {n}, H) for {activation_type!r}, got {x.shape}")
    limit, alpha = _params(act_params)
    if quantizer is None:
        return _act(x, act_type, gated, limit, alpha)
    return _quantized(op, x, act_type, gated, limit, alpha, quantizer)


def _quantized(op, x, act_type, gated, limit, alpha, quantizer):
    from lowbit.quantize.delayed import scale_inverse
    from lowbit.quantize.quantizer import DelayedScaleQuantizer, Quantizer
    from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x

    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"{op}: quantizer: expected a lowbit.quantize Quantizer or None, got "
                        f"{type(quantizer).__name__}")
    x = jax.lax.stop_gradient(x)
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
