"""lowbit.cpp_extensions.normalization: TE's import path
(transformer_engine.jax.cpp_extensions.normalization) over lowbit's own norm ops.

No numerics live here. The forward functions run lowbit.ops.norm_forward, or with a
quantizer lowbit.layernorm.norm_quantize (delayed scaling: the FP8 copies written by the norm
kernel itself; other quantizers: the norm, then quantizer.quantize); the backward functions
run lowbit.ops.norm_backward. x is (..., hidden), normalized over its last axis; mu and rsigma
are float32 x.shape[:-1] (mu is None for rmsnorm); the output is a NoScaleTensor of x's dtype
and shape (its amax None) as in TE 2.12, or the ScaledTensor of the copies the quantizer's q_layout names (a ScaledTensor2x, rowwise +
colwise, for ROWWISE_COLWISE, which QuantizerFactory makes; else that one ScaledTensor1x).

Differences from TE, all documented TE behaviour kept otherwise:
- lowbit quantizers are immutable: feed the output's amax to quantizer.update() for the next
  step's delayed scale (TE updates its quantizer object in place).
- Argument order is that of TE's documented signatures, normalization_fwd(x, gamma, beta,
  norm_type, zero_centered_gamma, epsilon, quantizer) and layernorm_bwd(dz, x, mu, rsigma,
  gamma, zero_centered_gamma, epsilon); TE's source puts norm_type after epsilon and beta
  after gamma. Pass those by keyword (beta=...) when porting a positional call; the
  bool check on zero_centered_gamma and the norm_type check catch the other order.
- rmsnorm takes zero_centered_gamma too (TE's normalization_* assert it off); beta is
  ignored for rmsnorm, as TE ignores it. The backward's epsilon and beta are accepted for
  TE's signatures and unused: the backward reads mu and rsigma.
- A single-copy layout (ROWWISE or COLWISE) returns that copy of norm_quantize's two.
- The forwards take TE 2.12's amax_scope, transpose_batch_sequence and
  output_amax_when_no_scaling as lowbit.cpp_extensions._common.check_te_keywords says.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from lowbit.cpp_extensions._common import check_flag, check_te_keywords, named_errors, unwrap
from lowbit.layernorm import NORM_TYPES, NormConfig, norm_quantize
from lowbit.ops.norm import canonical_norm_type, norm_backward, norm_forward
from lowbit.quantize.quantizer import check_quantizer
from lowbit.quantize.tensor import NoScaleTensor

__all__ = [
    "layernorm_fwd",
    "layernorm_bwd",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "normalization_fwd",
    "normalization_bwd",
]

_OP = "lowbit.cpp_extensions.{}"
_POSITIONAL_BETA = " (TE's source order puts beta after gamma: pass it as beta=...)"
_POSITIONAL_NORM_TYPE = (" (TE's source order puts norm_type after epsilon: pass it as "
                         "norm_type=...)")


def _norm_type(op: str, norm_type) -> str:
    """TE's spelling rule: lowercased, stripped, '-' and '_' removed ("LayerNorm", "rms_norm")."""
    name = canonical_norm_type(norm_type)
    if name in NORM_TYPES:
        return name
    hint = "" if isinstance(norm_type, str) else _POSITIONAL_NORM_TYPE
    raise ValueError(f"{op}: norm_type: expected 'layernorm' or 'rmsnorm' (any case; '-' and '_' "
                     f"ignored), got {norm_type!r}{hint}")


def _epsilon(op: str, epsilon) -> float:
    try:
        eps = float(epsilon)
    except (TypeError, ValueError):
        eps = math.nan
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: epsilon: expected a finite float >= 0, got {epsilon!r}")
    return eps


def _forward(op, x, gamma, beta, norm_type, zero_centered_gamma, epsilon, quantizer):
    """(output, mu, rsigma) of the canonical `norm_type`; see the module docstring."""
    cfg = NormConfig(norm_type, check_flag(op, "zero_centered_gamma", zero_centered_gamma),
                     _epsilon(op, epsilon))
    if quantizer is not None:
        check_quantizer(op, quantizer)
    x, gamma = jnp.asarray(unwrap(x)), jnp.asarray(gamma)
    beta = None if norm_type == "rmsnorm" or beta is None else jnp.asarray(beta)
    with named_errors(op):
        if quantizer is None:
            out = norm_forward(x, gamma, beta, epsilon=cfg.epsilon, **cfg.kwargs())
            return NoScaleTensor(out.y), out.mu, out.rsigma
        both, _, mu, rsigma = norm_quantize(x, gamma, beta, cfg, quantizer, False)
    layout = quantizer.q_layout
    if layout.has_rowwise and layout.has_colwise:
        return both, mu, rsigma
    return both.get_tensor(colwise=layout.has_colwise), mu, rsigma


def _backward(op, dz, x, mu, rsigma, gamma, norm_type, zero_centered_gamma, hint=""):
    zero_centered_gamma = check_flag(op, "zero_centered_gamma", zero_centered_gamma, hint)
    with named_errors(op):
        return norm_backward(unwrap(dz), unwrap(x), mu, rsigma, gamma, norm_type=norm_type,
                             zero_centered_gamma=zero_centered_gamma)


def layernorm_fwd(x, gamma, beta, zero_centered_gamma=False, epsilon=1e-6, quantizer=None,
                  amax_scope=None, transpose_batch_sequence=False, output_amax_when_no_scaling=False):
    """LayerNorm of x: (output, mu, rsigma); output quantized when a quantizer is given."""
    op = _OP.format("layernorm_fwd")
    check_te_keywords(op, amax_scope, transpose_batch_sequence, output_amax_when_no_scaling)
    return _forward(op, x, gamma, beta, "layernorm",
                    zero_centered_gamma, epsilon, quantizer)


def rmsnorm_fwd(x, gamma, zero_centered_gamma=False, epsilon=1e-6, quantizer=None,
                amax_scope=None, transpose_batch_sequence=False, output_amax_when_no_scaling=False):
    """RMSNorm of x: (output, rsigma); output quantized when a quantizer is given."""
    op = _OP.format("rmsnorm_fwd")
    check_te_keywords(op, amax_scope, transpose_batch_sequence, output_amax_when_no_scaling)
    output, _, rsigma = _forward(op, x, gamma, None, "rmsnorm",
                                 zero_centered_gamma, epsilon, quantizer)
    return output, rsigma


def normalization_fwd(x, gamma, beta, norm_type, zero_centered_gamma=False, epsilon=1e-6,
                      quantizer=None, amax_scope=None, transpose_batch_sequence=False):
    """(output, mu, rsigma) of `norm_type` ('layernorm' or 'rmsnorm'; mu None for rmsnorm)."""
    op = _OP.format("normalization_fwd")
    check_te_keywords(op, amax_scope, transpose_batch_sequence)
    return _forward(op, x, gamma, beta, _norm_type(op, norm_type), zero_centered_gamma, epsilon,
                    quantizer)


def layernorm_bwd(dz, x, mu, rsigma, gamma, zero_centered_gamma=False, epsilon=1e-6, *,
                  beta=None):
    """(dx, dgamma, dbeta) of LayerNorm, dz being the gradient of its output."""
    del epsilon, beta  # TE's signature; the backward reads mu and rsigma
    return _backward(_OP.format("layernorm_bwd"), dz, x, mu, rsigma, gamma, "layernorm",
                     zero_centered_gamma, _POSITIONAL_BETA)


def rmsnorm_bwd(dz, x, rsigma, gamma, zero_centered_gamma=False, epsilon=1e-6):
    """(dx, dgamma) of RMSNorm, dz being the gradient of its output."""
    del epsilon
    dx, dgamma, _ = _backward(_OP.format("rmsnorm_bwd"), dz, x, None, rsigma, gamma, "rmsnorm",
                              zero_centered_gamma)
    return dx, dgamma


def normalization_bwd(norm_type, dz, x, mu, rsigma, gamma, zero_centered_gamma=False,
                      epsilon=1e-6, *, beta=None):
    """(dx, dgamma, dbeta) of `norm_type`; dbeta is None for rmsnorm (mu may be None there)."""
    del epsilon, beta  # TE's signature; the backward reads mu and rsigma
    op = _OP.format("normalization_bwd")
    kind = _norm_type(op, norm_type)
    return _backward(op, dz, x, mu if kind == "layernorm" else None, rsigma, gamma, kind,
                     zero_centered_gamma)
