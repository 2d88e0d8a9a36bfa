"""lowbit.cpp_extensions.amax: TE's AmaxScope (transformer_engine.jax.cpp_extensions.amax), so
that ported calls spelling out `amax_scope=AmaxScope.LOCAL` (or TPSP, FSDP) import it.

In TE the scope picks the mesh axes over which a current-scaling amax is all-reduced (none,
the tensor-sequence axis, the FSDP axis). lowbit's amax has one rule instead, whatever the
scope: under jit a sharded tensor's amax is reduced over every mesh axis that shards it, so
each device quantizes with one scale per tensor (lowbit.sharding). On one device, and where
only the scope's axes shard the tensor, that is TE's amax; a tensor that TE would quantize
with per-shard (LOCAL) amaxes gets the global one here.
"""

from __future__ import annotations

import enum

__all__ = ["AmaxScope"]


class AmaxScope(enum.Enum):
    """TE's amax scopes (module docstring: lowbit reduces the same way for each)."""

    LOCAL = 1
    TPSP = 2
    FSDP = 3
