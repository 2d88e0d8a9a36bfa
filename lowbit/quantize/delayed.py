"""Per-tensor scale formulas (DESIGN §4), as pure jnp functions of fp32 arrays.

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.recipe import AMAX_COMPUTE_ALGOS

__all__ = ["update_delayed_scaling", "compute_scale", "delayed_scale", "FLT_MAX"]

FLT_MAX = float(np.finfo(np.float32).max)
SIGN_AND_EXPONENT_BITS = np.uint32(0xFF800000)
POSITIVE_INFINITY_BITS = np.uint32(0x7F800000)  # above it: NaN and every negative number


def _clamp_infinite(scale: jax.Array) -> jax.Array:
    return jnp.where(jnp.isinf(scale), jnp.float32(FLT_MAX), scale)


def _usable_amax(amax: jax.Array) -> jax.Array:
    """amax > 0 and finite, tested on the bits: XLA:CPU flushes denormals to zero in float
    comparisons (not always: it depends on fusion), integer comparisons are exact. Any
    denormal amax makes max_fp8 / amax overflow, so it always gives FLT_MAX."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
    return (bits != 0) & (bits < POSITIVE_INFINITY_BITS)


def delayed_scale(amax, previous_scale, *, fp8_max: float, margin: int = 0) -> jax.Array:
    """(fp8_max / amax) / 2**margin, clamped to FLT_MAX; previous_scale where amax <= 0 or
    is not finite. Shapes broadcast; fp32 throughout."""
    amax = jnp.asarray(amax, jnp.float32)
    previous_scale = jnp.asarray(previous_scale, jnp.float32)
    scale = jnp.float32(fp8_max) / amax / jnp.float32(2.0**margin)
    return jnp.where(_usable_amax(amax), _clamp_infinite(scale), previous_scale)


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
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"update_delayed_scaling: amax_compute_algo: expected one of {AMAX_COMPUTE_ALGOS}, "
            f"got {amax_compute_algo!r}"
        )
    amax_history = jnp.asarray(amax_history, jnp.float32)
    new_amax = jnp.asarray(new_amax, jnp.float32)
    if amax_history.ndim != 1 or new_amax.size != 1:
        raise ValueError(
            "update_delayed_scaling: expected amax_history of shape (L,) and one new_amax, got "
            f"{amax_history.shape} and {new_amax.shape}"
        )
    history = amax_history.at[0].set(new_amax.reshape(()))
    amax = jnp.max(history) if amax_compute_algo == "max" else history[0]
    new_scale = delayed_scale(amax, scale, fp8_max=fp8_max, margin=margin)
    history = jnp.roll(history, -1).at[0].set(0.0)
    return history, new_scale


def compute_scale(amax, *, fp8_max: float, use_power_2_scales: bool = False) -> jax.Array:
    """Current scaling: max_fp8 / amax with the rules of this module's preamble."""
    amax = jnp.asarray(amax, jnp.float32)
    scale = _clamp_infinite(jnp.float32(fp8_max) / amax)
    scale = jnp.where(_usable_amax(amax), scale, jnp.float32(1.0))
    if use_power_2_scales:
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & SIGN_AND_EXPONENT_BITS
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return scale
