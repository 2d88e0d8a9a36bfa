"""Shared by the TE-port tests (test_cpp_extensions*.py, test_scaled_tensor_factory.py): two
pytrees of arrays (ScaledTensors, NoScaleTensors, tuples of them) are the same bit for bit."""

from __future__ import annotations

import jax
import numpy as np


def assert_same_bits(a, b):
    """Same pytree structure (types, static metadata) and bit-identical leaves."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        la, lb = np.asarray(la), np.asarray(lb)
        assert la.dtype == lb.dtype and la.shape == lb.shape
        assert la.tobytes() == lb.tobytes()
