"""Shared by tests/test_activation_ops.py and tests/test_activation_bias.py: the jnp reference
of the activations (act_ref, q_ref), FP8 code comparisons, the activation / dtype / shape cases,
random inputs and the tolerance of a CUDA dbias against the CPU one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

K0, K1 = np.float32(0.7978845608028654), np.float32(0.044715)


def act_ref(x, act_type, gated=False, limit=7.0, alpha=1.702):
    """fp32 y of the activation (x (..., H) or gated (..., 2, H))."""
    x = jnp.asarray(x).astype(jnp.float32)
    a, g = (x[..., 0, :], x[..., 1, :]) if gated else (x, None)
    sig = jax.nn.sigmoid
    if act_type == "gelu":
        y = a * sig(2 * K0 * (a * (1.0 + K1 * a * a)))  # = 0.5 a (1 + tanh(u)), stable
    elif act_type == "silu":
        y = a * sig(a)
    elif act_type == "relu":
        y = jnp.maximum(a, 0.0)
    elif act_type == "quick_gelu":
        y = a * sig(np.float32(1.702) * a)
    elif act_type == "squared_relu":
        y = jnp.maximum(a, 0.0) ** 2
    elif act_type == "clamped_silu":
        # NaN stays NaN, as in lowbit's kernels (a bare where would map it to the limit)
        c = jnp.where(a <= limit, a, jnp.where(jnp.isnan(a), a, np.float32(limit)))
        y = c * sig(np.float32(alpha) * c)
        lim = np.float32(limit)  # TE: the gradient passes at |g| == limit
        g = jnp.where(g > lim, lim, jnp.where(g < -lim, -lim, g)) + 1.0
    else:
        y = a
    return y * g if gated else y


def q_ref(y, scale, dtype):
    return (y * scale).clip(-float(jnp.finfo(dtype).max), float(jnp.finfo(dtype).max)).astype(dtype)


def code_index(q):
    c = np.asarray(q).view(np.uint8).astype(np.int32)
    return np.where(c & 0x80, -(c & 0x7F), c & 0x7F)


def assert_codes_close(got, want, exact=False):
    d = np.abs(code_index(got) - code_index(want))
    assert d.max(initial=0) <= (0 if exact else 1), f"{(d > 0).sum()} codes differ, max {d.max()}"


EXACT = {"linear", "relu", "squared_relu"}
TYPES = [("gelu", False), ("silu", False), ("relu", False), ("quick_gelu", False),
         ("squared_relu", False), ("linear", False), ("gelu", True), ("silu", True),
         ("relu", True), ("quick_gelu", True), ("squared_relu", True), ("clamped_silu", True)]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
SHAPES = [(1, 1), (3, 7), (257, 128), (2, 3, 1000)]


def make_x(rng, shape, gated, dtype, scale=3.0):
    full = (*shape[:-1], 2, shape[-1]) if gated else shape
    return (rng.standard_normal(full) * scale).astype(dtype)


def assert_y_close(got, want_f32, dtype, exact, gate=None):
    """Exact activations bit for bit; the others within rtol max(2e-6, eps) and an absolute
    1e-6 + eps/1000, which covers their small outputs (gelu's 1 + tanh cancels for x << 0:
    lowbit's tanh and XLA's differ by ~1e-5 relative there). A gated output is act(a) * g: its
    absolute error is the activation's times |g|, so `gate` (g per element) scales the
    absolute tolerance by max(1, |g|) (a planted g near fp32's max lifted one such output to
    -3.5e22, 4e-6 relative off: seed 2487279485)."""
    got = np.asarray(got, np.float32)
    want = np.asarray(jnp.asarray(want_f32).astype(dtype), np.float32)
    if exact:
        np.testing.assert_array_equal(got, want)
        return
    eps = float(jnp.finfo(dtype).eps)
    atol = 1e-6 + eps * 1e-3
    if gate is not None:
        atol = atol * np.maximum(1.0, np.abs(np.asarray(gate, np.float64)))
    err, bound = np.abs(got.astype(np.float64) - want), atol + max(2e-6, eps) * np.abs(want.astype(np.float64))
    bad = ~(err <= bound)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} off; worst at {np.argwhere(bad)[0]}: got "
                           f"{got[bad][0]!r}, want {want[bad][0]!r}, bound {np.broadcast_to(bound, got.shape)[bad][0]!r}")


def assert_dbias_close(a, b, rows: int, dtype):
    """dbias of the CUDA kernel (a) against the CPU reference (b): fp32 sums of `rows` values
    in another order, so NaN columns agree exactly and finite ones within the order's error."""
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    fin = np.isfinite(a) & np.isfinite(b)
    eps = float(jnp.finfo(dtype).eps)
    tol = 1e-4 * np.sqrt(rows) * (1 + np.abs(b[fin]))
    assert np.all(np.abs(a[fin] - b[fin]) <= tol + 2 * eps * np.abs(b[fin]))
