"""lowbit.ops.amax: the absolute maximum of a tensor, as fp32, through lowbit's FFI op.

Semantics: max(|x|) over every element; NaN anywhere gives NaN (NaN beats inf); an empty
tensor gives 0. Works under jit and vmap (per batch element), and under a sharded jit:
each device reduces its shard and the results are combined with a max over the mesh axes
that shard x, so every device holds the global amax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops._sharding import mesh_axes, named_shardings, partition_spec, pmax_nonnegative

HIGH_PRECISION = (jnp.float32, jnp.float16, jnp.bfloat16)


def check_high_precision(op: str, arg: str, x) -> None:
    """A TypeError naming op and arg unless x (an array, or a dtype) is float32, float16 or
    bfloat16."""
    dtype = jnp.dtype(getattr(x, "dtype", x))
    if dtype not in [jnp.dtype(t) for t in HIGH_PRECISION]:
        raise TypeError(f"{op}: {arg}: expected float32, float16 or bfloat16, got {dtype}")


def _abstract(x, *, rows):
    return jax.core.ShapedArray((rows,), jnp.float32)


# x (any shape, viewed as `rows` equal contiguous segments) -> (rows,): each one's amax.
amax_rows_p = ffi_primitive("lowbit_amax", "lowbit_amax", _abstract)


def _amax_rows_batch(args, dims, *, rows):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    batch = x.shape[0]
    out = amax_rows_p.bind(x, rows=batch * rows)
    return out.reshape(batch, rows), 0


batching.primitive_batchers[amax_rows_p] = _amax_rows_batch


def _amax_local(x):
    return amax_rows_p.bind(x, rows=1)[0]


_amax_partitioned = custom_partitioning(_amax_local)


def _partition(mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    axes = mesh_axes(partition_spec(sharding))

    def lower(x):
        local = _amax_local(x)
        return pmax_nonnegative(local, axes) if axes else local

    return mesh, lower, NamedSharding(mesh, PartitionSpec()), (sharding,)


def _rule(mesh, value_types, result_types):
    factors = [f"d{i}" for i in range(len(value_types[0].shape))]
    return f"{' '.join(factors)} -> ", {"reduction_factors": tuple(factors)}


_amax_partitioned.def_partition(partition=named_shardings(_partition), sharding_rule=_rule)


# custom_partitioning has no batching rule: under vmap, amax reduces each batch element
# through the primitive's own batching rule instead (unpartitioned).
@jax.custom_batching.custom_vmap
def _amax(x):
    return _amax_partitioned(x)


@_amax.def_vmap
def _amax_vmap(axis_size, in_batched, x):
    del in_batched
    return amax_rows_p.bind(x, rows=axis_size), True


def amax(x: jax.Array) -> jax.Array:
    """max(|x|) as a float32 scalar (NaN if x holds NaN; 0 if x is empty)."""
    x = jnp.asarray(x)
    check_high_precision("lowbit.ops.amax", "x", x)
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    return _amax(x)


def amax_reference(x) -> np.ndarray:
    """The jnp reference the tests compare against."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0)
