"""Shared by tests/test_quantize_grouped.py and tests/test_quantize_grouped_block.py: the FP8
formats and input dtypes the grouped quantizers are tested over, and the bit-for-bit
comparison of two runs' outputs (the CUDA kernel against the CPU handler)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np


FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
dtype_ids = lambda d: np.dtype(d).name  # noqa: E731


def _assert_same(a, b):
    for ga, cb in zip(a, b):
        if ga is None:
            assert cb is None
            continue
        np.testing.assert_array_equal(np.asarray(ga).view(np.uint8), np.asarray(cb).view(np.uint8))
