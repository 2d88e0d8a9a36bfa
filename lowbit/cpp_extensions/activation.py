"""lowbit.cpp_extensions.activation: TE's import path
(transformer_engine.jax.cpp_extensions.activation) over lowbit's fused activation ops.

No numerics live here. act_lu runs lowbit.ops.act_forward, or with a quantizer
lowbit.quantized_activation (delayed scaling: the FP8 copies written by the activation kernel
itself; other quantizers: the activation, then quantizer.quantize). dact_lu and
quantize_dact_dbias run lowbit.ops.act_backward, quantized as lowbit's own backward
(lowbit.layernorm_mlp) quantizes the activation's gradient: a DelayedScaleQuantizer in the
act_backward pass (its stored scale on the fp32 dx; dbias from the same pass), any other
quantizer by its quantize() of dx in x's dtype (dbias from that pass).

activation_type is TE's tuple: (name,) or (name, "linear") with name one of gelu, silu,
relu, quick_gelu, squared_relu, linear, or ("clamped_silu", "clamped_linear") (clamped
swiglu; lowbit.activation lists them). x is (..., ACT_DIM, K) with ACT_DIM =
len(activation_type); act_lu's output and dz are (..., K); dx has x's shape; dbias is
(ACT_DIM, K) in x's dtype. ActivationParams / ClampedSwigluParams are TE's (same fields,
defaults and create()); only clamped swiglu reads them. Without a quantizer the outputs are
NoScaleTensors (amax None) and dbias the fp32 sums of dx over its rows x.shape[:-2] in x's
dtype, as TE 2.12 returns them. With one, the ScaledTensor2x (rowwise + colwise) for
ROWWISE_COLWISE, which QuantizerFactory makes, else the one ScaledTensor1x; the dx copies
split x's shape at flatten_axis -2 (rows x.shape[:-2], columns (ACT_DIM, K)), as in TE.

Differences from TE, all documented TE behaviour kept otherwise:
- lowbit quantizers are immutable: feed the output's amax to quantizer.update() for the next
  step's delayed scale (TE updates its quantizer object in place).
- Quantizers other than delayed scaling quantize the activation / dx after its rounding to
  x's dtype (lowbit's unfused path; LOWBIT_FUSED_BLOCK=1 fuses act_lu's MXFP8 and FP8 1x128
  block copies, from the fp32 activation: lowbit.activation), dbias summing that dx, and
  current scaling takes its scale from that rounded tensor's amax. TE's fused kernels (MXFP8
  among them) quantize the fp32 values, and its current scaling takes the amax its activation
  kernel reports: for bf16/f16 x a code or dbias may differ by that rounding; for fp32 x
  nothing does.
- amax_scope (None or an AmaxScope), transpose_batch_sequence and output_amax_when_no_scaling
  (False only) as lowbit.cpp_extensions._common.check_te_keywords says: lowbit's one amax
  rule for every scope (lowbit.cpp_extensions.amax).
- activation_type: the named tuples (a list is taken as its tuple), not callables: TE looks
  the tuple up in its enum first, so it takes only the names too, and fails on a bare
  string as this does.
- Where TE asserts, these raise a ValueError or TypeError naming the entry point and the
  argument.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowbit.activation import CLAMPED_SWIGLU_DEFAULTS, parse_activation_type, quantized_activation
from lowbit.cpp_extensions._common import check_flag, check_te_keywords, named_errors, unwrap
from lowbit.cpp_extensions.quantization import row_sums
from lowbit.layernorm import fused_2x
from lowbit.ops.activation import act_backward, act_forward
from lowbit.quantize.quantizer import DelayedScaleQuantizer, check_quantizer
from lowbit.quantize.tensor import NoScaleTensor

__all__ = ["ActivationParams", "ClampedSwigluParams", "act_lu", "dact_lu", "quantize_dact_dbias"]

_OP = "lowbit.cpp_extensions.{}"
_CLAMPED = {("clamped_silu", "clamped_linear"), ("clamped_silu",), ("clamped_linear",)}


@dataclasses.dataclass(frozen=True)
class ClampedSwigluParams:
    """GPT-OSS clamped swiglu's parameters (TE's): the clamp `limit` and the sigmoid's `alpha`
    (lowbit.ops.act_forward's module docstring has the formula). Frozen: hashable, so a jit
    static."""

    limit: float = CLAMPED_SWIGLU_DEFAULTS["limit"]
    alpha: float = CLAMPED_SWIGLU_DEFAULTS["alpha"]


@dataclasses.dataclass(frozen=True)
class ActivationParams:
    """TE's parameters of the activations: only clamped swiglu has any."""

    clamped_swiglu: ClampedSwigluParams = ClampedSwigluParams()

    @staticmethod
    def create(activation_type, **kwargs) -> ActivationParams:
        """Clamped swiglu's (ClampedSwigluParams(**kwargs)) for ("clamped_silu",
        "clamped_linear") or either name alone; the defaults for any other activation, whose
        kwargs are ignored, as in TE."""
        key = (activation_type,) if isinstance(activation_type, str) else tuple(activation_type)
        if key in _CLAMPED:
            return ActivationParams(ClampedSwigluParams(**kwargs))
        return ActivationParams()


class _Act(NamedTuple):
    """One call's parsed arguments: x (..., ACT_DIM, K), x_op (x as lowbit's ops take it:
    (..., K) for a single activation), and the ops' act_type, gated, limit and alpha."""

    x: jax.Array
    x_op: jax.Array
    act_type: str
    gated: bool
    limit: float
    alpha: float

    @property
    def kwargs(self):
        return dict(gated=self.gated, limit=self.limit, alpha=self.alpha)


def _parse(op, x, activation_type, act_params) -> _Act:
    if isinstance(activation_type, str) or not isinstance(activation_type, (tuple, list)):
        raise ValueError(f"{op}: activation_type: expected a tuple of names such as ('gelu',) "
                         f"or ('silu', 'linear'), got {activation_type!r}")
    act_type, gated = parse_activation_type(op, activation_type)
    limit, alpha = _limit_alpha(op, act_type, act_params)
    act_dim = len(activation_type)
    x = jnp.asarray(unwrap(x))
    if x.ndim < 2 or x.shape[-2] != act_dim:
        raise ValueError(f"{op}: x: expected shape (..., {act_dim}, K) for activation_type "
                         f"{tuple(activation_type)!r} (ACT_DIM = len(activation_type)), got "
                         f"{x.shape}")
    x_op = x if gated else x.reshape(*x.shape[:-2], x.shape[-1])
    return _Act(x, x_op, act_type, gated, limit, alpha)


def _limit_alpha(op, act_type, act_params) -> tuple[float, float]:
    """Clamped swiglu's (limit, alpha) from an ActivationParams (TE's or lowbit's: anything
    with .clamped_swiglu.limit and .alpha); the defaults for every other activation, which
    TE's kernels run without parameters."""
    if act_params is None:
        return CLAMPED_SWIGLU_DEFAULTS["limit"], CLAMPED_SWIGLU_DEFAULTS["alpha"]
    params = getattr(act_params, "clamped_swiglu", None)
    if not (hasattr(params, "limit") and hasattr(params, "alpha")):
        raise TypeError(f"{op}: act_params: expected None or an ActivationParams (a "
                        f"ClampedSwigluParams goes in ActivationParams(clamped_swiglu=...)), "
                        f"got {act_params!r}")
    if act_type != "clamped_silu":
        return CLAMPED_SWIGLU_DEFAULTS["limit"], CLAMPED_SWIGLU_DEFAULTS["alpha"]
    try:
        return float(params.limit), float(params.alpha)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: act_params: expected clamped_swiglu.limit and .alpha to be "
                        f"numbers, got {params!r}") from None


def act_lu(x, activation_type, quantizer=None, act_params=None, amax_scope=None,
           transpose_batch_sequence=False, output_amax_when_no_scaling=False):
    """The activation of x (..., ACT_DIM, K): (..., K) in x's dtype as a NoScaleTensor, or the
    ScaledTensor of it that `quantizer` makes (module doc)."""
    op = _OP.format("act_lu")
    check_te_keywords(op, amax_scope, transpose_batch_sequence, output_amax_when_no_scaling)
    act = _parse(op, x, activation_type, act_params)
    if quantizer is None:
        with named_errors(op):
            return NoScaleTensor(act_forward(act.x_op, act.act_type, **act.kwargs).y)
    check_quantizer(op, quantizer)
    with named_errors(op):
        return quantized_activation(act.x_op, activation_type, quantizer,
                                    ClampedSwigluParams(act.limit, act.alpha))


def quantize_dact_dbias(dz, x, activation_type=("gelu",), is_dbias=True, quantizer=None,
                        act_params=None, amax_scope=None, transpose_batch_sequence=False,
                        output_amax_when_no_scaling=False):
    """(dx: the gradient of act_lu at x given dz (..., K), x's shape, a NoScaleTensor or the
    ScaledTensor `quantizer` makes; dbias: the sums of dx over its rows, (ACT_DIM, K) in x's
    dtype, or None when is_dbias is False)."""
    op = _OP.format("quantize_dact_dbias")
    check_te_keywords(op, amax_scope, transpose_batch_sequence, output_amax_when_no_scaling)
    return _dact(op, dz, x, activation_type, check_flag(op, "is_dbias", is_dbias), quantizer,
                 act_params)


def dact_lu(dz, x, activation_type, quantizer=None, act_params=None, amax_scope=None,
            transpose_batch_sequence=False, output_amax_when_no_scaling=False):
    """quantize_dact_dbias's dx alone (no dbias computed)."""
    op = _OP.format("dact_lu")
    check_te_keywords(op, amax_scope, transpose_batch_sequence, output_amax_when_no_scaling)
    return _dact(op, dz, x, activation_type, False, quantizer, act_params)[0]


def _dact(op, dz, x, activation_type, is_dbias, quantizer, act_params):
    act = _parse(op, x, activation_type, act_params)
    x, dz = act.x, jnp.asarray(unwrap(dz))
    if quantizer is None:
        with named_errors(op):
            dx = act_backward(dz, act.x_op, act.act_type, **act.kwargs).dx.reshape(x.shape)
        return NoScaleTensor(dx), (row_sums(op, dx, -2) if is_dbias else None)
    check_quantizer(op, quantizer)
    layout, rows = quantizer.q_layout, x.ndim - 2
    with named_errors(op):
        if not isinstance(quantizer, DelayedScaleQuantizer):
            dx = act_backward(dz, act.x_op, act.act_type, **act.kwargs).dx.reshape(x.shape)
            return quantizer.quantize(dx, is_rowwise=layout.has_rowwise,
                                      is_colwise=layout.has_colwise, flatten_axis=rows,
                                      compute_dbias=is_dbias)
        # keep_dims: q_rowwise x_op's shape, q_colwise x_op's trailing dims then its leading
        # ones, dbias x_op's trailing dims; reshaped to x's (a single activation: (1, K)).
        g = act_backward(dz, act.x_op, act.act_type, **act.kwargs,
                         quant_scale=quantizer.scale.reshape(1), quant_dtype=quantizer.q_dtype,
                         rowwise=layout.has_rowwise, colwise=layout.has_colwise,
                         compute_dbias=is_dbias, keep_dims=True, return_dx=False)
    rowwise = None if g.q_rowwise is None else g.q_rowwise.reshape(x.shape)
    colwise = None if g.q_colwise is None else g.q_colwise.reshape(*x.shape[-2:], *x.shape[:-2])
    both = fused_2x(quantizer, rowwise, colwise, g.amax, x.dtype, rows)  # a copy not made: None
    out = both if layout.is_rowwise_colwise else both.get_tensor(colwise=layout.has_colwise)
    return out, (g.dbias.reshape(x.shape[-2:]) if is_dbias else None)
