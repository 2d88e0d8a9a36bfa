"""Shared by tests/test_norm_ops.py and tests/test_norm_ops_cuda.py: the jnp reference of
lowbit.ops.norm_forward (norm_ref), the test data (make, args_for), and the tolerances of
the row statistics, of y and of the FP8 codes (stat_rtol, assert_y_close,
assert_codes_close; tests/test_norm_ops.py's docstring derives them)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np


def norm_ref(x, gamma, beta, norm_type, zero_centered=False, eps=1e-6):
    """fp32 y, mu, rsigma of the jnp reference."""
    xf = x.astype(jnp.float32)
    w = gamma.astype(jnp.float32) + (1.0 if zero_centered else 0.0)
    if norm_type == "layernorm":
        mu = jnp.mean(xf, -1)
        rs = 1.0 / jnp.sqrt(jnp.mean(jnp.square(xf - mu[..., None]), -1) + eps)
        return (xf - mu[..., None]) * rs[..., None] * w + beta.astype(jnp.float32), mu, rs
    rs = 1.0 / jnp.sqrt(jnp.mean(jnp.square(xf), -1) + eps)
    return xf * rs[..., None] * w, None, rs


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
ULP = {np.dtype(np.float32): 2.0**-23, np.dtype(np.float16): 2.0**-10,
       np.dtype(ml_dtypes.bfloat16): 2.0**-7}
NORMS = ["layernorm", "rmsnorm"]


def make(rng, shape, dtype, gamma_dtype=np.float32, offset=0.5):
    x = (rng.standard_normal(shape) * 2 + offset).astype(dtype)
    h = shape[-1]
    gamma = (1 + 0.3 * rng.standard_normal(h)).astype(gamma_dtype)
    beta = (0.2 * rng.standard_normal(h)).astype(gamma_dtype)
    return x, gamma, beta


def args_for(norm_type, beta):
    return beta if norm_type == "layernorm" else None


def stat_rtol(hidden):
    """Relative tolerance of fp32 row statistics summed in different orders."""
    return 2e-6 + 2.4e-7 * np.sqrt(hidden)


def assert_y_close(y, ref_y, dtype):
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref_y, np.float32)
    if np.dtype(dtype) == np.float32:
        rtol = 2 * stat_rtol(ref.shape[-1])
        np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    else:
        # one ulp of the dtype, plus the fp32 y's own error (near zero: that of mu)
        tol = ULP[np.dtype(dtype)] * np.abs(ref) + 2 * stat_rtol(ref.shape[-1]) * np.abs(ref).max()
        assert np.all(np.abs(y - ref) <= tol), float(np.max(np.abs(y - ref) / tol))


def code_distance(a, b):
    """|a - b| in codes for fp8 arrays (sign-magnitude order)."""
    def ordered(q):
        u = q.view(np.uint8).astype(np.int32)
        return np.where(u & 0x80, -(u & 0x7F), u & 0x7F)
    return np.abs(ordered(np.asarray(a)) - ordered(np.asarray(b)))


def assert_codes_close(a, b):
    """FP8 codes of two implementations whose row statistics differ by rounding: at most one
    code apart, in at most 0.1% of the codes, or 2 codes in a small array (a value within
    the statistics' rounding of a code boundary flips; in 600 codes one flip is 0.17%)."""
    d = code_distance(a, b)
    assert d.max() <= 1 and (d > 0).sum() <= max(2, 1e-3 * d.size), ((d > 0).sum(), d.size)
