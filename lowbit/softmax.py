"""lowbit.softmax: TE's `softmax(logits, mask, scale_factor, softmax_fusion_type)` with a
custom_vjp over lowbit's fused softmax ops (lowbit.ops.softmax_forward / softmax_backward).

softmax_fusion_type: SoftmaxType.SCALED, SCALED_MASKED or SCALED_UPPER_TRIANG_MASKED (TE's
names; `SoftmaxFusionType` is the same enum under TE 2.x's name), or the strings "scaled", "scaled_masked", "scaled_upper_triang". Semantics, mask
convention (1 = masked out, logit -> -10000) and limits: lowbit/ops/softmax.py. The backward
uses the forward output only: dx = scale * (y * dy - y * sum(y * dy)); the mask gets no
gradient. A mask with any other fusion type is an error (TE's function ignores it there).
"""

from __future__ import annotations

import enum
from functools import partial

import jax
import jax.numpy as jnp

from lowbit.ops.softmax import softmax_backward, softmax_forward


class SoftmaxType(enum.Enum):
    SCALED = "scaled"
    SCALED_MASKED = "scaled_masked"
    SCALED_UPPER_TRIANG_MASKED = "scaled_upper_triang"


# TE 2.x's name for the same enum (its Softmax module's softmax_fusion_type field).
SoftmaxFusionType = SoftmaxType


class AttnSoftmaxType(enum.Enum):
    """TE's softmax variants (its Softmax module's `softmax_type`): lowbit runs the vanilla
    softmax only; the others are an error where they are asked for (lowbit.flax.Softmax)."""

    VANILLA_SOFTMAX = "vanilla"
    OFF_BY_ONE_SOFTMAX = "off_by_one"
    LEARNABLE_SOFTMAX = "learnable"


def _fusion_name(t) -> str:
    if isinstance(t, enum.Enum):
        t = SoftmaxType[t.name].value if t.name in SoftmaxType.__members__ else t.value
    if t == "scaled_upper_triang_masked":
        t = "scaled_upper_triang"
    if t not in ("scaled", "scaled_masked", "scaled_upper_triang"):
        raise ValueError(f"lowbit.softmax: softmax_fusion_type: expected a SoftmaxType or one of "
                         f"'scaled', 'scaled_masked', 'scaled_upper_triang', got {t!r}")
    return t


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _softmax(logits, mask, scale_factor, fusion):
    return softmax_forward(logits, mask, scale_factor, fusion)


def _fwd(logits, mask, scale_factor, fusion):
    y = softmax_forward(logits, mask, scale_factor, fusion)
    return y, y


def _bwd(scale_factor, fusion, y, dy):
    return softmax_backward(dy, y, scale_factor, fusion), None


_softmax.defvjp(_fwd, _bwd)


def softmax(logits, mask=None, scale_factor=1.0, softmax_fusion_type=SoftmaxType.SCALED):
    """Fused scaled (masked / causal) softmax over the last axis of (batch, heads, q, k)."""
    fusion = _fusion_name(softmax_fusion_type)
    if mask is not None and fusion != "scaled_masked":  # TE's function drops it: a silent no-op
        raise ValueError(f"lowbit.softmax: mask: only softmax_fusion_type SCALED_MASKED applies a mask, "
                         f"and {fusion!r} would ignore it; pass mask=None or use SCALED_MASKED")
    return _softmax(jnp.asarray(logits), mask, float(scale_factor), fusion)
