"""Shared by tests/test_softmax_ops.py and tests/test_cpp_extensions_softmax.py: the softmax
tests' tolerance per dtype and their random logits and masks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def tol(dtype):
    eps = float(jnp.finfo(dtype).eps)
    return dict(rtol=max(eps, 4e-6), atol=max(eps / 8, 1e-7))


def make(rng, shape, dtype, fusion, mask_batch=None, te_mask=False):
    """(logits, mask or None): a mask only for "scaled_masked", (mask_batch or batch, 1, q, k)
    with row 0 of the first batch fully masked. te_mask: TE's uint8 mask, where 1 masks out and
    any other value (here 0 or 2) keeps, with row 1 kept by 2s; else a bool mask (True masks)."""
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    if fusion != "scaled_masked":
        return x, None
    b, _, q, k = shape
    mask_shape = (mask_batch or b, 1, q, k)
    if te_mask:
        mask = rng.choice(np.array([0, 1, 2], np.uint8), mask_shape, p=[.5, .3, .2])
        mask[0, 0, 0, :] = 1
        mask[0, 0, 1, :] = 2
    else:
        mask = rng.random(mask_shape) < 0.3
        mask[0, 0, 0, :] = True
    return x, mask
