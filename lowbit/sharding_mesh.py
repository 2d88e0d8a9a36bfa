"""The mesh queries and sharding-constraint wrappers of TE's `transformer_engine.jax.sharding`,
by TE's names, for code that calls them (lowbit.sharding re-exports every one):

    is_mesh_available()                      a mesh is in effect (`with mesh:` or jax.set_mesh)
    get_all_mesh_axes()                      its axis names (() without a mesh)
    num_of_devices()                         len(jax.devices())
    get_num_devices_in_mesh(mesh=None)       devices in `mesh` (the current one; 1 without)
    get_mesh_axis_size(axis, mesh=None)      size of `axis` (1 for None)
    get_mesh_axis_rank(axis, mesh=None)      jax.lax.axis_index(axis) under `mesh` (0 without)
    with_sharding_constraint(x, pspec)       jax.lax.with_sharding_constraint, but a no-op
                                             without a mesh or pspec, and blind to the axes a
                                             shard_map made manual (a spec left with no axis
                                             is a no-op)
    with_sharding_constraint_by_logical_axes(x, names)
                                             flax's with_logical_constraint under the current
                                             flax.linen.logical_axis_rules (a dim whose name
                                             has no rule stays unsharded); without any rules,
                                             lowbit's table (lowbit.sharding.logical_axis_rules,
                                             from the global MeshResource) stands in, as TE's
                                             own table does there. names None or () : no-op.
    get_padded_spec(spec, ndim)              spec padded with None to ndim entries
    lax_paral_op(x, op, mesh_resource, mesh) op(x, axis) (jax.lax.psum, pmax, ...) over the
                                             named axis inside shard_map; x when it is None
    all_reduce_sum_along_dp_fsdp(x, mesh), all_reduce_sum_along_dp_fsdp_tpsp(x, mesh)
                                             psums over the global MeshResource's dp and fsdp
                                             (and tpsp) axes, inside shard_map
    all_reduce_max_along_all_axes_except_PP(x, mesh)
                                             pmax over every axis of mesh but the global
                                             MeshResource's pp axis
    tpsp_axis_size(), dp_or_fsdp_axis_size() sizes of the global MeshResource's axes (1: unset)
    get_mesh_axis_rank_host(axis, mesh)      the index along axis of this process's first device
                                             (of the mesh's platform)

Errors name the function and the argument (an axis the mesh lacks, a spec longer than x's
rank, a names list of another length than x's rank), where TE asserts.
"""

from __future__ import annotations

import math

import jax
import numpy as np

__all__ = [
    "is_mesh_available",
    "get_all_mesh_axes",
    "num_of_devices",
    "get_num_devices_in_mesh",
    "get_mesh_axis_size",
    "get_mesh_axis_rank",
    "with_sharding_constraint",
    "with_sharding_constraint_by_logical_axes",
    "get_padded_spec",
    "lax_paral_op",
    "all_reduce_sum_along_dp_fsdp",
    "all_reduce_sum_along_dp_fsdp_tpsp",
    "all_reduce_max_along_all_axes_except_PP",
    "tpsp_axis_size",
    "dp_or_fsdp_axis_size",
    "get_mesh_axis_rank_host",
]


def _current_mesh():
    """The mesh in effect: JAX's legacy `with mesh:` context, else jax.set_mesh's (abstract
    inside a trace); an empty mesh without either."""
    from jax._src import mesh as mesh_lib  # `with mesh:` has no public getter

    physical = mesh_lib.thread_resources.env.physical_mesh
    if physical is not None and not physical.empty:
        return physical
    return jax.sharding.get_abstract_mesh()


def is_mesh_available() -> bool:
    return not _current_mesh().empty


def get_all_mesh_axes() -> tuple[str, ...]:
    return tuple(_current_mesh().axis_names)


def num_of_devices() -> int:
    return len(jax.devices())


def get_num_devices_in_mesh(mesh=None) -> int:
    mesh = _current_mesh() if mesh is None else mesh
    return 1 if mesh.empty else math.prod(mesh.shape.values())


def _check_axis(op: str, axis, mesh) -> None:
    if axis not in mesh.shape:
        raise ValueError(f"lowbit.sharding.{op}: axis: {axis!r} is not an axis of the mesh "
                         f"{dict(mesh.shape)}")


def get_mesh_axis_size(axis, mesh=None) -> int:
    if axis is None:
        return 1
    mesh = _current_mesh() if mesh is None else mesh
    _check_axis("get_mesh_axis_size", axis, mesh)
    return mesh.shape[axis]


def get_mesh_axis_rank(axis: str, mesh=None):
    """This shard's index along `axis` (a traced value: call it inside shard_map over `mesh`);
    0 when mesh is None, as TE's."""
    if mesh is None:
        return 0
    _check_axis("get_mesh_axis_rank", axis, mesh)
    return jax.lax.axis_index(axis)


def _drop_manual(entry, manual):
    if isinstance(entry, tuple):
        kept = tuple(a for a in entry if a not in manual)
        return kept or None
    return None if entry in manual else entry


def with_sharding_constraint(x, pspec):
    if pspec is None:
        return x
    mesh = _current_mesh()
    if mesh.empty:
        return x
    if len(pspec) > x.ndim:
        raise ValueError(f"lowbit.sharding.with_sharding_constraint: pspec: {pspec} has more entries "
                         f"than x has dims ({x.shape})")
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    entries = tuple(_drop_manual(e, manual) for e in pspec)
    if all(e is None for e in entries):
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*entries))


def with_sharding_constraint_by_logical_axes(x, logical_axis_names):
    if not logical_axis_names:
        return x
    names = tuple(logical_axis_names)
    if len(names) != x.ndim:
        raise ValueError(f"lowbit.sharding.with_sharding_constraint_by_logical_axes: "
                         f"logical_axis_names: expected one name (or None) per dim of x {x.shape}, "
                         f"got {names}")
    from flax import linen as nn

    if nn.get_logical_axis_rules():
        return nn.with_logical_constraint(x, names, fallback=nn.spmd.RulesFallback.AXIS_IS_UNSHARDED)
    from lowbit.sharding import logical_axis_rules

    spec = nn.logical_to_mesh_axes(names, logical_axis_rules())
    return with_sharding_constraint(x, spec)


def get_padded_spec(spec, ndim: int) -> tuple:
    if spec is None:
        return (None,) * ndim
    spec = tuple(spec)
    if len(spec) > ndim:
        raise ValueError(f"lowbit.sharding.get_padded_spec: spec: {spec} has more than ndim={ndim} entries")
    return spec + (None,) * (ndim - len(spec))


def lax_paral_op(x, ops, mesh_resource, mesh, **kwargs):
    if mesh_resource is None:
        return x
    _check_axis("lax_paral_op", mesh_resource, mesh)
    return ops(x, mesh_resource, **kwargs)


def _resource():
    from lowbit.sharding import global_mesh_resource  # lowbit.sharding imports this module

    return global_mesh_resource()


def all_reduce_sum_along_dp_fsdp(x, mesh):
    r = _resource()
    x = lax_paral_op(x, jax.lax.psum, r.dp_resource, mesh)
    return lax_paral_op(x, jax.lax.psum, r.fsdp_resource, mesh)


def all_reduce_sum_along_dp_fsdp_tpsp(x, mesh):
    x = lax_paral_op(x, jax.lax.psum, _resource().tpsp_resource, mesh)
    return all_reduce_sum_along_dp_fsdp(x, mesh)


def all_reduce_max_along_all_axes_except_PP(x, mesh):  # noqa: N802 (TE's name)
    pp = _resource().pp_resource
    for axis in mesh.axis_names:
        if axis != pp:
            x = jax.lax.pmax(x, axis)
    return x


def tpsp_axis_size() -> int:
    return get_mesh_axis_size(_resource().tpsp_resource)


def dp_or_fsdp_axis_size() -> int:
    r = _resource()
    dp = get_mesh_axis_size(r.dp_resource)
    return dp if dp > 1 else get_mesh_axis_size(r.fsdp_resource)


def get_mesh_axis_rank_host(axis, mesh) -> int:
    _check_axis("get_mesh_axis_rank_host", axis, mesh)
    # This process's first device of the mesh's platform (a CPU mesh on a GPU machine too).
    device = jax.local_devices(backend=mesh.devices.flat[0].platform)[0]
    where = np.argwhere(mesh.devices == device)
    if where.size == 0:
        raise ValueError(f"lowbit.sharding.get_mesh_axis_rank_host: mesh: this host's device {device} "
                         f"is not in the mesh")
    return int(where[0][mesh.axis_names.index(axis)])
