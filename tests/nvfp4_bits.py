"""Shared by tests/test_quantize_nvfp4_cuda.py and tests/test_quantize_grouped_nvfp4.py: the
six arrays of an Nvfp4Quantized compared bit for bit (the CUDA kernel against the CPU
handler, a group against the ungrouped op)."""

from __future__ import annotations

import numpy as np

NAMES = ("rowwise", "rowwise_scale", "rowwise_global_scale_inv", "colwise", "colwise_scale",
         "colwise_global_scale_inv")


def bits(a):
    """a's bytes (None stays None)."""
    return None if a is None else np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def assert_same(got, want, what=""):
    """Each of the six arrays: absent in both, or the same shape and bytes (the first differing
    byte positions in the message)."""
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None, f"{what}: {name}"
            continue
        g, w = bits(g), bits(w)
        assert g.shape == w.shape, f"{what}: {name} shape {g.shape} vs {w.shape}"
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{what}: {name} differs at {len(bad)} bytes, first {bad[:3].tolist()}"
