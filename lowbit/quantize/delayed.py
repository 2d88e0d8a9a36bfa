"""Per-tensor scale formulas (DESIGN §4), computed by lowbit's scale FFI ops
(lowbit/ops/scale.py, csrc/scale/) with explicit IEEE fp32 operations, so that the CPU
and CUDA backends give the same bits (XLA's fp32 division on the GPU is not correctly
rounded). The tests keep the few-line jnp/numpy versions of these rules as references.

Delayed scaling, history h of length L (`update_delayed_scaling`):
  1. h[0] = new_amax (the caller has already reduced it over the devices);
  2. a = max(h) ("max") or h[0] ("most_recent");
  3. scale = (max_fp8 / a) / 2**margin; an infinite result (tiny a) is clamped to
     FLT_MAX; the old scale is kept when a <= 0 or a is not finite;
  4. h = roll(h, -1); h[0] = 0.
Step 4 moves the new amax to h[L-1] and zeroes the oldest entry, so the next step's amax
lands in a fresh h[0] and max(h) always covers the L most recent amaxes. Step t casts with
the scale made at step t-1. A NaN or inf amax stays in the history, so with "max" it holds
the scale where it is for L steps.

Current scaling (`compute_scale`): scale = max_fp8 / amax of the tensor itself, with
  - amax 0, inf or NaN -> scale 1 (with inf in x the finite values still cast sensibly and
    the infinities saturate to +-max_fp8; NaN stays NaN whatever the scale);
  - an infinite quotient (tiny or denormal amax) -> FLT_MAX, as for delayed scaling;
  - use_power_2_scales: the scale's mantissa bits are cleared (sign and exponent kept),
    rounding it down to a power of two, so x * scale still cannot exceed max_fp8;
    FLT_MAX becomes 2**127.
scale_inv = 1 / scale, correctly rounded (also by the op).
"""

from __future__ import annotations

import jax
import numpy as np

from lowbit.ops import scale as scale_ops
from lowbit.ops.quantize import FP8_DTYPES
from lowbit.recipe import AMAX_COMPUTE_ALGOS

__all__ = [
    "update_delayed_scaling",
    "update_delayed_scaling_with_inverse",
    "compute_scale",
    "compute_scale_and_inverse",
    "scale_inverse",
    "compute_scale_from_amax",
    "FLT_MAX",
]

FLT_MAX = float(np.finfo(np.float32).max)


def update_delayed_scaling_with_inverse(
    amax_history,
    scale,
    new_amax,
    *,
    fp8_max: float,
    margin: int = 0,
    amax_compute_algo: str = "max",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One delayed-scaling step: (history (L,), scale (1,), new_amax scalar or (1,)) ->
    (new history, new scale (1,), 1 / new scale (1,)), as in this module's preamble."""
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"update_delayed_scaling: amax_compute_algo: expected one of {AMAX_COMPUTE_ALGOS}, "
            f"got {amax_compute_algo!r}"
        )
    amax_history = np.asarray(amax_history) if isinstance(amax_history, (list, tuple)) else amax_history
    history_shape = np.shape(amax_history)
    new_amax_size = int(np.prod(np.shape(new_amax)))
    if len(history_shape) != 1 or new_amax_size != 1:
        raise ValueError(
            "update_delayed_scaling: expected amax_history of shape (L,) and one new_amax, got "
            f"{history_shape} and {np.shape(new_amax)}"
        )
    return scale_ops.update_delayed_scaling(
        amax_history, scale, new_amax, fp8_max=fp8_max, margin=margin,
        most_recent=amax_compute_algo == "most_recent",
    )


def update_delayed_scaling(
    amax_history,
    scale,
    new_amax,
    *,
    fp8_max: float,
    margin: int = 0,
    amax_compute_algo: str = "max",
) -> tuple[jax.Array, jax.Array]:
    """One delayed-scaling step: (history (L,), scale (1,), new_amax scalar or (1,)) ->
    (new history, new scale), as in this module's preamble."""
    history, new_scale, _ = update_delayed_scaling_with_inverse(
        amax_history, scale, new_amax, fp8_max=fp8_max, margin=margin,
        amax_compute_algo=amax_compute_algo,
    )
    return history, new_scale


def compute_scale_and_inverse(amax, *, fp8_max: float, use_power_2_scales: bool = False):
    """Current scaling: (scale, 1 / scale), each of amax's shape, by this module's rules."""
    return scale_ops.compute_scale(amax, fp8_max=fp8_max, use_power_2_scales=use_power_2_scales)


def compute_scale(amax, *, fp8_max: float, use_power_2_scales: bool = False) -> jax.Array:
    """Current scaling: max_fp8 / amax with the rules of this module's preamble."""
    return compute_scale_and_inverse(
        amax, fp8_max=fp8_max, use_power_2_scales=use_power_2_scales)[0]


def compute_scale_from_amax(amax, q_dtype, margin=0.0, scale=None) -> jax.Array:
    """TE's name (transformer_engine.jax.quantize): scale = (max(q_dtype) / amax) / 2**margin as
    a (1,) float32, `scale` (default 1) kept where amax <= 0 or is not finite, an infinite
    quotient clamped to FLT_MAX (the delayed rule of this module's preamble, for one amax).
    q_dtype is an FP8 dtype (jnp.float8_e4m3fn or jnp.float8_e5m2); margin a whole number."""
    op = "lowbit.quantize.compute_scale_from_amax"
    try:
        dtype = np.dtype(q_dtype)
    except TypeError:
        dtype = None
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: q_dtype: expected float8_e4m3fn or float8_e5m2, got {q_dtype!r}")
    if np.size(amax) != 1:
        raise ValueError(f"{op}: amax: expected one value, got shape {np.shape(amax)}")
    fp8_max = float(jax.numpy.finfo(dtype).max)
    if scale is None:
        scale = np.ones((1,), np.float32)
    amax = jax.numpy.reshape(jax.numpy.asarray(amax, jax.numpy.float32), (1,))
    _, new_scale, _ = scale_ops.update_delayed_scaling(amax, scale, amax, fp8_max=fp8_max,
                                                       margin=margin)
    return new_scale


def scale_inverse(scale) -> jax.Array:
    """1 / scale, correctly rounded fp32 on every backend."""
    return scale_ops.scale_inverse(scale)
