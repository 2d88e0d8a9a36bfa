"""lowbit.ops: per-tensor FP8 scales computed by lowbit's FFI ops with explicit IEEE fp32
operations, so the CPU and CUDA backends give the same bits (XLA's fp32 division on the
GPU is not correctly rounded: a jnp `fp8_max / amax` differs by an ulp between backends).

  compute_scale(amax, fp8_max, use_power_2_scales) -> (scale, scale_inv), elementwise:
      current scaling, the rules of lowbit/quantize/delayed.py (amax 0 / negative / inf /
      NaN -> 1, an infinite quotient -> FLT_MAX, power of two keeps sign and exponent).
  scale_inverse(scale) -> 1 / scale, elementwise.
  update_delayed_scaling(history (L,), scale (1,), new_amax (1,), fp8_max, margin, algo)
      -> (new_history (L,), new_scale (1,), scale_inv (1,)): one delayed-scaling step.

A NaN result of a division is the quiet NaN with the sign of the NaN operand (positive for
0/0, inf/inf) on both backends. The inputs pass through `lax.stop_gradient` (scales are
constants to autodiff); jit, scan and vmap work (the delayed update batches as a lax.map).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from lowbit.ops._primitive import ffi_primitive

__all__ = ["compute_scale", "scale_inverse", "update_delayed_scaling"]


def _elementwise_abstract(x, **_):
    return jax.core.ShapedArray(x.shape, jnp.float32), jax.core.ShapedArray(x.shape, jnp.float32)


compute_scale_p = ffi_primitive(
    "lowbit_compute_scale", "lowbit_compute_scale", _elementwise_abstract,
    multiple_results=True, attrs=("fp8_max", "use_power_2_scales"),
)

scale_inverse_p = ffi_primitive(
    "lowbit_scale_inverse", "lowbit_scale_inverse",
    lambda x: jax.core.ShapedArray(x.shape, jnp.float32),
)


def _delayed_abstract(history, scale, new_amax, **_):
    f32 = jnp.float32
    return (jax.core.ShapedArray(history.shape, f32), jax.core.ShapedArray((1,), f32),
            jax.core.ShapedArray((1,), f32))


update_delayed_p = ffi_primitive(
    "lowbit_update_delayed_scaling", "lowbit_update_delayed_scaling", _delayed_abstract,
    multiple_results=True, attrs=("fp8_max", "margin", "most_recent"),
)


# Elementwise ops: a batched operand is just more elements.
def _compute_batch(args, dims, **params):
    (x,), (d,) = args, dims
    return compute_scale_p.bind(x, **params), (d, d)


def _inverse_batch(args, dims):
    (x,), (d,) = args, dims
    return scale_inverse_p.bind(x), d


def _delayed_batch(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [
        jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    outs = jax.lax.map(lambda t: tuple(update_delayed_p.bind(*t, **params)), tuple(args))
    return list(outs), [0, 0, 0]


batching.primitive_batchers[compute_scale_p] = _compute_batch
batching.primitive_batchers[scale_inverse_p] = _inverse_batch
batching.primitive_batchers[update_delayed_p] = _delayed_batch


def _f32(op: str, arg: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        if not jnp.issubdtype(x.dtype, jnp.floating) and not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{op}: {arg}: expected a float32 array, got {x.dtype}")
        x = x.astype(jnp.float32)
    return jax.lax.stop_gradient(x)


def check_fp8_max(op: str, fp8_max) -> None:
    """fp8_max: the format's largest finite value, a finite positive number."""
    if (isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float, np.integer, np.floating))
            or not np.isfinite(fp8_max) or fp8_max <= 0):
        raise ValueError(f"{op}: fp8_max: expected a finite positive number, got {fp8_max!r}")


MAX_OP_MARGIN = 2**31 - 1  # an int32 attribute; from 128 on 2**margin is infinite (defined: scale.h)


def check_margin(op: str, margin) -> int:
    """margin as an int in [0, 2**31) (the recipe allows [0, MAX_MARGIN]): an int, or a float
    with no fraction (TE's quantizers default to margin=0.0); a fraction would otherwise be
    truncated."""
    whole = isinstance(margin, (float, np.floating)) and float(margin).is_integer()
    if (isinstance(margin, bool) or not (isinstance(margin, (int, np.integer)) or whole)
            or not 0 <= margin <= MAX_OP_MARGIN):
        raise ValueError(f"{op}: margin: expected a whole number in [0, 2**31), got {margin!r}")
    return int(margin)


def compute_scale(amax, *, fp8_max: float, use_power_2_scales: bool = False):
    """Current scaling: (scale, scale_inv), each of amax's shape, float32."""
    check_fp8_max("lowbit.ops.compute_scale", fp8_max)
    amax = _f32("lowbit.ops.compute_scale", "amax", amax)
    if amax.size == 0:
        return amax, amax
    scale, scale_inv = compute_scale_p.bind(
        amax, fp8_max=np.float32(fp8_max), use_power_2_scales=np.bool_(use_power_2_scales))
    return scale, scale_inv


def scale_inverse(scale) -> jax.Array:
    """1 / scale in IEEE fp32 (round to nearest even), scale's shape."""
    scale = _f32("lowbit.ops.scale_inverse", "scale", scale)
    if scale.size == 0:
        return scale
    return scale_inverse_p.bind(scale)


def update_delayed_scaling(amax_history, scale, new_amax, *, fp8_max: float, margin: int = 0,
                           most_recent: bool = False):
    """One delayed-scaling step (lowbit/quantize/delayed.py documents the rule):
    (new_history (L,), new_scale (1,), scale_inv (1,))."""
    op = "lowbit.ops.update_delayed_scaling"
    check_fp8_max(op, fp8_max)
    margin = check_margin(op, margin)
    history = _f32(op, "amax_history", amax_history)
    scale = _f32(op, "scale", scale)
    new_amax = _f32(op, "new_amax", new_amax)
    if history.ndim != 1 or history.shape[0] < 1:
        raise ValueError(f"{op}: amax_history: expected shape (L,) with L >= 1, got {history.shape}")
    if scale.size != 1 or new_amax.size != 1:
        raise ValueError(f"{op}: scale and new_amax: expected one value each, got shapes "
                         f"{scale.shape} and {new_amax.shape}")
    h, s, inv = update_delayed_p.bind(
        history, scale.reshape(1), new_amax.reshape(1), fp8_max=np.float32(fp8_max),
        margin=np.int32(margin), most_recent=np.bool_(most_recent))
    return h, s, inv
