"""Shared by tests/test_quantize_grouped.py, tests/test_quantize_grouped_block.py and
tests/test_quantize_grouped_nvfp4.py: the FP8 formats and input dtypes the grouped quantizers
are tested over, the bit-for-bit comparison of two runs' outputs (the CUDA kernel against the
CPU handler), and the shapes and group sizes the CUDA kernels are checked on."""

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


def cuda_cases(rng):
    """(x shape, flatten_axis, sizes): groups ending mid-tile and mid-block, odd sizes, 1024
    groups, rows % 8 != 0 (the colwise byte stores), odd cols (element loads), cols % 64 != 0,
    a tail, rank 3, more than one CTA column."""
    many = rng.integers(0, 5, 1024).astype(np.int32)
    return [
        ((1000, 264), -1, [1, 0, 300, 5, 129, 255, 0, 1]),
        ((517, 131), -1, [7, 1, 1, 200, 0, 17]),
        ((256, 128), -1, [256]),
        ((300, 8), -1, [100, 0, 150]),
        ((2048, 96), -1, list(many)),
        ((40, 6, 72), 2, [3, 0, 1, 30]),
        ((8, 2048), -1, [0, 3, 0, 4]),
    ]
