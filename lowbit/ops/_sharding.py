"""Pieces every op's custom_partitioning rule uses: a sharding's spec padded to the rank,
the mesh axes a spec (or part of it) shards over, and the cross-shard max of an amax."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def spec_entries(sharding, ndim: int) -> tuple:
    """The sharding's PartitionSpec entries, padded with None (or cut) to `ndim`."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return spec[:ndim]


def mesh_axes(entries) -> tuple[str, ...]:
    """Every mesh axis named in these PartitionSpec entries, in order."""
    out: list[str] = []
    for e in entries:
        if e is not None:
            out.extend(e if isinstance(e, tuple) else (e,))
    return tuple(out)


def pmax_nonnegative(v, axes):
    """Max over mesh `axes` of non-negative floats (amaxes), comparing their bit patterns so
    that NaN beats inf as in the kernels (a float pmax may drop NaN)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.pmax(bits, axes), jnp.float32)
