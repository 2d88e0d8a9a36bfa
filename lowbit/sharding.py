"""lowbit.sharding: which mesh axes carry which parallelism, and logical axis names -> mesh axes.

lowbit shards with JAX's own SPMD partitioner (Shardy): every op is a custom_partitioning
primitive whose rule follows the shardings of its inputs (lowbit/ops/*.py: GEMM DP /
column- and row-parallel TP with a psum over the contracting axes in the GEMM's output
dtype, as XLA and TransformerEngine do, or in fp32 with LOWBIT_GEMM_PSUM=fp32, FSDP kernels
gathered in FP8, norms keep the hidden dim whole and psum dgamma/dbeta). `MeshResource`
only names the axes for the logical-axis table below (`logical_axis_rules()`,
`extend_logical_axis_rules(rules)`, usable with `flax.linen.logical_axis_rules`), as in
TransformerEngine:

    mesh = jax.make_mesh((2, 2), ("dp", "tp"))
    with lowbit.sharding.global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        with nn.logical_axis_rules(lowbit.sharding.logical_axis_rules()): ...

`global_shard_guard(r)` and `lowbit.autocast(mesh_resource=r)` set the same global value
(lowbit.quantize.helper.mesh_resource_guard); `global_mesh_resource()` reads it (an empty
MeshResource outside any guard, where TE asserts that one is set).

TE's own logical names (BATCH_AXES = "nvte_batch", ...) map through TE's table,
`get_sharding_map_logic_axis_to_mesh_axis()`: under a mesh, batch on fsdp when the fsdp axis
has more than one device (else dp), heads / hidden_tp / w_tp on tpsp when that axis has more
than one device (else tp). `extend_logical_axis_rules(rules)` is TE's: `rules` plus that table,
nothing else. `logical_axis_rules()` is lowbit's fuller table: Flax / T5X names ("batch",
"embed", "mlp", ...) as well, TE's names as TE's table maps them.

Amax reduction scope (every device must cast with the same scale):
  - DelayedScaling: the amax of each tensor is the max over every device that holds a
    piece of it: the quantize / norm / activation ops pmax their local amax over the mesh
    axes that shard their input, and a replicated input has the same amax on each replica,
    so under a sharded jit the reduced amax, the amax history and the next scale are
    identical on every device of every mesh axis (dp, fsdp, tp, tpsp, cp; pp is never
    reduced over: pipeline stages hold different layers, each with its own state). The
    state is replicated and equals the unsharded run's state bit for bit.
  - Float8CurrentScaling: the tensor's own global amax, i.e. a pmax over the axes that
    shard that tensor (lowbit.ops.amax), computed before the cast; no other axes.
Inside shard_map (manual axes) nothing is reduced for you: pmax the amax over the manual
axes yourself before `Quantizer.update`.

Logical sharding hints of the functions (TE's argument names): `layernorm_dense`'s
layernorm_input_axes and kernel_axes and `layernorm_mlp`'s norm_input_axes, kernel_1_axes
and kernel_2_axes constrain x and the kernels (`logical_constraint`: flax's
with_logical_constraint under the current logical axis rules; a no-op without a mesh). Their
dot_input_axes / dot_1_input_axes / dot_2_input_axes name tensors that exist only inside the
fused ops (the norm's and the activation's quantized copies): these are accepted and not
applied; those copies take their sharding from x's through the ops' partitioning rules.

TE's mesh queries and constraint wrappers (is_mesh_available, get_mesh_axis_size,
with_sharding_constraint_by_logical_axes, ...) are here by TE's names: lowbit/sharding_mesh.py.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from lowbit.quantize.helper import get_global_mesh_resource, mesh_resource_guard
from lowbit.sharding_mesh import (all_reduce_max_along_all_axes_except_PP,  # noqa: F401 (TE's names)
                                  all_reduce_sum_along_dp_fsdp, all_reduce_sum_along_dp_fsdp_tpsp,
                                  dp_or_fsdp_axis_size, get_all_mesh_axes, get_mesh_axis_rank,
                                  get_mesh_axis_rank_host, get_mesh_axis_size, get_num_devices_in_mesh,
                                  get_padded_spec, is_mesh_available, lax_paral_op, num_of_devices,
                                  tpsp_axis_size, with_sharding_constraint,
                                  with_sharding_constraint_by_logical_axes)
from lowbit.sharding_mesh import _current_mesh

__all__ = [
    "logical_constraint",
    "MeshResource",
    "global_shard_guard",
    "global_mesh_resource",
    "logical_axis_rules",
    "extend_logical_axis_rules",
    "get_sharding_map_logic_axis_to_mesh_axis",
    "BATCH_AXES", "SEQLEN_AXES", "SEQLEN_TP_AXES", "SEQLEN_CP_AXES", "HEAD_AXES",
    "HIDDEN_AXES", "HIDDEN_TP_AXES", "JOINED_AXES", "W_NO_SHARD_AXES", "W_FSDP_AXES",
    "W_TP_AXES", "W_JOINED_AXES",
    # TE's mesh queries and constraint wrappers (lowbit/sharding_mesh.py)
    "is_mesh_available", "get_all_mesh_axes", "num_of_devices", "get_num_devices_in_mesh",
    "get_mesh_axis_size", "get_mesh_axis_rank", "with_sharding_constraint",
    "with_sharding_constraint_by_logical_axes", "get_padded_spec", "lax_paral_op",
    "all_reduce_sum_along_dp_fsdp", "all_reduce_sum_along_dp_fsdp_tpsp",
    "all_reduce_max_along_all_axes_except_PP", "tpsp_axis_size", "dp_or_fsdp_axis_size",
    "get_mesh_axis_rank_host",
]

AxisName = str | tuple[str, ...] | None

# TE's own logical names (transformer_engine.jax.sharding).
BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Mesh axis names per kind of parallelism (None: not used). dp shards the batch; tp
    the heads / mlp dims of the weights; tpsp the sequence outside TP regions (sequence
    parallelism, usually the tp axis); fsdp the weights' embed dim (and the batch); pp
    pipeline stages; cp the sequence (context parallelism)."""

    dp_resource: str | None = None
    tp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None
    pp_resource: str | None = None
    cp_resource: str | None = None

    def amax_reduction_axes(self) -> tuple[str, ...]:
        """The axes a delayed-scaling amax is reduced over: all named axes but pp."""
        names = (self.dp_resource, self.fsdp_resource, self.tp_resource, self.tpsp_resource,
                 self.cp_resource)
        return tuple(dict.fromkeys(n for n in names if n is not None))


def check_batch_first(op: str, transpose_batch_sequence) -> None:
    """TE's `transpose_batch_sequence` (sequence-first inputs): False only, lowbit's dense,
    layernorm_dense, layernorm_mlp and modules take batch-first inputs; True is an error
    naming op, not a silent no-op."""
    if transpose_batch_sequence is not False:
        raise ValueError(f"{op}: transpose_batch_sequence: expected False (lowbit takes batch-first "
                         f"inputs), got {transpose_batch_sequence!r}")


def logical_constraint(x, axes):
    """x under a logical sharding constraint when `axes` (logical axis names, one per dim) is
    given: flax.linen.with_logical_constraint, i.e. the current logical axis rules and mesh
    (a no-op outside a mesh); x itself when axes is None or empty."""
    if not axes:
        return x
    from flax import linen as nn

    return nn.with_logical_constraint(x, tuple(axes))


def global_shard_guard(resource: MeshResource):
    """Context manager: `resource` is the global MeshResource inside the block."""
    if not isinstance(resource, MeshResource):
        raise TypeError(f"lowbit.sharding.global_shard_guard: resource: expected a MeshResource, "
                        f"got {resource!r}")
    return mesh_resource_guard(resource)


def global_mesh_resource() -> MeshResource:
    """The active MeshResource (all None outside any guard)."""
    resource = get_global_mesh_resource()
    return resource if isinstance(resource, MeshResource) else MeshResource()


def _batch_axes(r: MeshResource) -> AxisName:
    axes = tuple(dict.fromkeys(a for a in (r.dp_resource, r.fsdp_resource) if a is not None))
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _te_axis_table(r: MeshResource, enabled) -> dict[str, AxisName]:
    """TE's table for its logical names; enabled(axis): the named axis has more than one device."""
    tp = r.tpsp_resource if enabled(r.tpsp_resource) else r.tp_resource
    return {
        BATCH_AXES: r.fsdp_resource if enabled(r.fsdp_resource) else r.dp_resource,
        SEQLEN_AXES: None,
        SEQLEN_TP_AXES: r.tpsp_resource,
        SEQLEN_CP_AXES: r.cp_resource,
        HEAD_AXES: tp,
        HIDDEN_AXES: None,
        HIDDEN_TP_AXES: tp,
        JOINED_AXES: None,
        W_NO_SHARD_AXES: None,
        W_FSDP_AXES: r.fsdp_resource,
        W_TP_AXES: tp,
        W_JOINED_AXES: None,
    }


def get_sharding_map_logic_axis_to_mesh_axis() -> dict[str, AxisName]:
    """TE's map from its logical names (BATCH_AXES, ...) to the global MeshResource's mesh
    axes, under the current mesh: {} without a mesh or inside a shard_map over every mesh
    axis. As in TE, tp and tpsp may not both have more than one device, and an axis the
    MeshResource names for tp, tpsp or fsdp must be in the mesh (ValueErrors here, where TE
    asserts); an unset MeshResource is an empty one (TE asserts one is set)."""
    mesh = _current_mesh()
    if mesh.empty:
        return {}
    if sorted(jax.sharding.get_abstract_mesh().manual_axes) == sorted(mesh.axis_names):
        return {}
    r = global_mesh_resource()
    if get_mesh_axis_size(r.tp_resource) > 1 and get_mesh_axis_size(r.tpsp_resource) > 1:
        raise ValueError(f"lowbit.sharding.get_sharding_map_logic_axis_to_mesh_axis: the global "
                         f"MeshResource: tensor parallelism and tensor sequence parallelism cannot "
                         f"both be enabled, got tp_resource={r.tp_resource!r} and "
                         f"tpsp_resource={r.tpsp_resource!r}")
    return _te_axis_table(r, lambda axis: get_mesh_axis_size(axis) > 1)


def _named_axis_enabled(axis) -> bool:
    """For lowbit's table: a named axis counts as more than one device unless the current
    mesh has it at size 1 (the table may be built before the mesh is entered)."""
    if axis is None:
        return False
    mesh = _current_mesh()
    return mesh.empty or axis not in mesh.shape or mesh.shape[axis] > 1


def logical_axis_rules(resource: MeshResource | None = None) -> tuple[tuple[str, AxisName], ...]:
    """(logical name, mesh axes) pairs for `flax.linen.logical_axis_rules`, from `resource`
    (default: the global one): Flax / T5X names, then TE's names as TE's table maps them
    (get_sharding_map_logic_axis_to_mesh_axis; a named axis the current mesh lacks, or any
    named axis without a mesh, counts as having more than one device). Flax gives each tensor
    dim the first rule whose mesh axes are still free in that tensor, so a weight's "embed"
    takes fsdp while an activation whose "batch" already uses the fsdp axis keeps its hidden
    dim whole."""
    r = global_mesh_resource() if resource is None else resource
    tp = r.tp_resource
    flax_rules = (
        # Flax / T5X-style names (TE's module defaults use these)
        ("batch", _batch_axes(r)),
        ("length", r.cp_resource),
        ("embed", r.fsdp_resource),
        ("mlp", tp),
        ("heads", tp),
        ("kv", None),
        ("joined_kv", tp),
        ("act", None),
        ("qkv_dim", None),
        ("vocab", tp),
        ("norm", None),
    )
    return flax_rules + tuple(_te_axis_table(r, _named_axis_enabled).items())


def extend_logical_axis_rules(rules: Sequence[tuple[str, str | None]]) -> tuple[tuple[str, AxisName], ...]:
    """TE's: `rules` followed by TE's table (get_sharding_map_logic_axis_to_mesh_axis, so
    nothing without a mesh) for the names `rules` leaves out. Each rule maps a name to one
    mesh axis name or None; a TE name given in `rules` must be given once, mapped as TE's
    table maps it. ValueErrors here where TE asserts. lowbit's Flax-name rules are not added
    (as in TE): logical_axis_rules() has them."""
    op = "lowbit.sharding.extend_logical_axis_rules"
    given: dict[str, list] = {}
    for item in rules:
        if len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"{op}: rules: expected (axis_name, mesh_axis_name) pairs, got {item!r}")
        if not (item[1] is None or isinstance(item[1], str)):
            raise ValueError(f"{op}: rules: the mesh axis of {item[0]!r} must be a str or None, "
                             f"got {item[1]!r}")
        given.setdefault(item[0], []).append(item[1])
    extended = list(rules)
    for name, axes in get_sharding_map_logic_axis_to_mesh_axis().items():
        if name not in given:
            extended.append((name, axes))
        elif given[name] != [axes]:
            raise ValueError(f"{op}: rules: {name!r} maps to {given[name]}, but TE's rules map it "
                             f"to {axes!r}")
    return tuple(extended)
