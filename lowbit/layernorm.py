"""lowbit.layernorm: LayerNorm / RMSNorm with their own backward, and the fused
norm + quantize that layernorm_dense and layernorm_mlp feed their first GEMM with.

`layernorm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)` returns the normalized
tensor in x's dtype; its VJP runs lowbit's norm backward (dx, dgamma, dbeta). With a
quantizer it returns the normalized tensor as that quantizer codes it, dequantized back to
x's dtype and shape, as TE's layernorm does: the same backward (the quantize passes the
gradient straight through; the quantizer gets none). quantized_layernorm() returns the
quantized output itself (a ScaledTensor with the rowwise and the transposed colwise copy,
x's leading dims kept; forward only, x's gradient cut there: layernorm_dense and
layernorm_mlp own the backward of the quantized path).

norm_quantize(): with a delayed-scaling quantizer (its scale is known before the pass) the
norm kernel writes the FP8 copies and the amax in the same pass as y; with current scaling
the scale needs the output's amax first, so the norm writes y and the quantize op follows.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowbit.ops.norm import canonical_norm_type, norm_backward, norm_forward
from lowbit.quantize.delayed import scale_inverse
from lowbit.quantize.quantizer import DelayedScaleQuantizer, check_quantizer, no_gradient
from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x

NORM_TYPES = ("layernorm", "rmsnorm")

__all__ = ["layernorm", "quantized_layernorm", "NormConfig", "norm_quantize", "fused_2x",
           "canonicalize_norm_type"]


def canonicalize_norm_type(x) -> str:
    """TE's name: "LayerNorm", "layer_norm", "RMSNorm", ... -> "layernorm" / "rmsnorm"; anything
    else is a ValueError naming it (TE asserts)."""
    canonical = canonical_norm_type(x)
    if canonical not in NORM_TYPES:
        raise ValueError(f"lowbit.layernorm.canonicalize_norm_type: x: expected a spelling of "
                         f"{NORM_TYPES}, got {x!r}")
    return canonical


class NormConfig(NamedTuple):
    norm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6

    def check(self, op: str, x, gamma, beta) -> None:
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"{op}: norm_type: expected one of {NORM_TYPES}, got {self.norm_type!r}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{op}: x: expected a float dtype, got {x.dtype}")
        if x.ndim == 0 or x.shape[-1] == 0:
            raise ValueError(f"{op}: x: expected (..., hidden) with hidden >= 1, got shape {tuple(x.shape)}")
        hidden = x.shape[-1]
        if tuple(gamma.shape) != (hidden,):
            raise ValueError(f"{op}: gamma: expected shape ({hidden},), got {tuple(gamma.shape)}")
        if self.norm_type == "rmsnorm" and beta is not None:
            raise ValueError(f"{op}: beta: RMSNorm has no beta, got one of shape {tuple(beta.shape)}")
        if self.norm_type == "layernorm":
            if beta is None:
                raise ValueError(f"{op}: beta: LayerNorm needs beta of shape ({hidden},)")
            if tuple(beta.shape) != (hidden,):
                raise ValueError(f"{op}: beta: expected shape ({hidden},), got {tuple(beta.shape)}")

    def kwargs(self) -> dict:
        return dict(norm_type=self.norm_type, zero_centered_gamma=self.zero_centered_gamma)


def fused_2x(quantizer, rowwise, colwise, amax, dq_dtype, flatten_axis: int = 1) -> ScaledTensor2x:
    """The ScaledTensor2x of copies a fused kernel wrote with `quantizer`'s (delayed) scale
    (rowwise: the tensor's shape; colwise: its dims from flatten_axis on, then the rest)."""
    scale_inv = scale_inverse(quantizer.scale).reshape(1)  # correctly rounded on every backend
    amax = amax.reshape(1)

    def one(data, colwise_copy):
        return ScaledTensor1x(data=data, scale_inv=scale_inv, amax=amax,
                              scaling_mode=quantizer.scaling_mode, dq_dtype=jnp.dtype(dq_dtype),
                              is_colwise=colwise_copy, flatten_axis=flatten_axis)

    return ScaledTensor2x(one(rowwise, False), one(colwise, True))


def norm_quantize(x2d, gamma, beta, cfg: NormConfig, quantizer, want_y: bool):
    """Norm of x (M..., H) quantized by `quantizer` into rowwise (M..., H) + colwise (H, M...)
    copies. Returns (ScaledTensor2x, y in x's dtype or None, mu, rsigma)."""
    flatten_axis = x2d.ndim - 1
    if isinstance(quantizer, DelayedScaleQuantizer):
        scale = quantizer.scale.reshape(1)
        out = norm_forward(x2d, gamma, beta, epsilon=cfg.epsilon, quant_scale=scale,
                           quant_dtype=quantizer.q_dtype, rowwise=True, colwise=True,
                           return_y=want_y, **cfg.kwargs())
        xq = fused_2x(quantizer, out.q_rowwise, out.q_colwise, out.amax, x2d.dtype, flatten_axis)
        return xq, (out.y if want_y else None), out.mu, out.rsigma
    out = norm_forward(x2d, gamma, beta, epsilon=cfg.epsilon, **cfg.kwargs())
    xq, _ = quantizer.quantize(out.y, is_rowwise=True, is_colwise=True, flatten_axis=flatten_axis)
    return xq, out.y, out.mu, out.rsigma


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizer=None,
):
    """Normalizes x over its last dim, in x's dtype; with a quantizer, its quantized values
    (see the module docstring)."""
    op = "lowbit.layernorm"
    x, gamma, beta, cfg = _prepare(op, x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    if quantizer is None:
        return _layernorm(x, gamma, beta, cfg)
    check_quantizer(op, quantizer)
    return _layernorm_dequantized(x, gamma, beta, quantizer, cfg)


def quantized_layernorm(x, gamma, beta=None, norm_type: str = "layernorm",
                        zero_centered_gamma: bool = False, epsilon: float = 1e-6, quantizer=None):
    """The ScaledTensor2x (rowwise + transposed colwise copy) of layernorm(x) as `quantizer`
    codes it; forward only (see the module docstring)."""
    op = "lowbit.quantized_layernorm"
    x, gamma, beta, cfg = _prepare(op, x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    check_quantizer(op, quantizer)
    x, gamma, beta = jax.lax.stop_gradient((x, gamma, beta))
    return norm_quantize(x, gamma, beta, cfg, quantizer, False)[0]


def _prepare(op, x, gamma, beta, norm_type, zero_centered_gamma, epsilon):
    x, gamma = jnp.asarray(x), jnp.asarray(gamma)
    beta = None if beta is None else jnp.asarray(beta)
    cfg = NormConfig(canonical_norm_type(norm_type), bool(zero_centered_gamma), float(epsilon))
    cfg.check(op, x, gamma, beta)
    return x, gamma, beta, cfg


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _layernorm_dequantized(x, gamma, beta, quantizer, cfg):
    return _layernorm_dequantized_fwd(x, gamma, beta, quantizer, cfg)[0]


def _layernorm_dequantized_fwd(x, gamma, beta, quantizer, cfg):
    x2d = x.reshape(-1, x.shape[-1])
    xq, _, mu, rsigma = norm_quantize(x2d, gamma, beta, cfg, quantizer, False)
    return xq.dequantize().reshape(x.shape), ((x2d, mu, rsigma, gamma), quantizer)


def _layernorm_dequantized_bwd(cfg, residuals, dy):
    norm_residuals, quantizer = residuals
    return (*_layernorm_bwd(cfg, norm_residuals, dy), no_gradient(quantizer))


_layernorm_dequantized.defvjp(_layernorm_dequantized_fwd, _layernorm_dequantized_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layernorm(x, gamma, beta, cfg):
    return _layernorm_fwd(x, gamma, beta, cfg)[0]


def _layernorm_fwd(x, gamma, beta, cfg):
    x2d = x.reshape(-1, x.shape[-1])
    out = norm_forward(x2d, gamma, beta, epsilon=cfg.epsilon, **cfg.kwargs())
    return out.y.reshape(x.shape), (x2d, out.mu, out.rsigma, gamma)


def _layernorm_bwd(cfg, residuals, dy):
    x2d, mu, rsigma, gamma = residuals
    dx, dgamma, dbeta = norm_backward(dy.reshape(x2d.shape), x2d, mu, rsigma, gamma, **cfg.kwargs())
    return dx.reshape(dy.shape), dgamma, (dbeta if cfg.norm_type == "layernorm" else None)


_layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)
