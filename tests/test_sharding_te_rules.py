"""TE's logical-axis table on 8 virtual CPU devices (conftest): get_sharding_map_logic_axis_to_
mesh_axis, extend_logical_axis_rules, and TE's names in lowbit.sharding.logical_axis_rules.

Reference: TE 2.12's table (transformer_engine/jax/sharding.py), written out per case below:
  nvte_batch                          fsdp if the fsdp axis has > 1 device, else dp
  nvte_head, nvte_hidden_tp, nvte_w_tp  tpsp if the tpsp axis has > 1 device, else tp
  nvte_seqlen_tp tpsp, nvte_seqlen_cp cp, nvte_w_fsdp fsdp, the other five None;
  {} without a mesh or inside a shard_map over every mesh axis.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import Mesh, PartitionSpec as P

from lowbit.sharding import (MeshResource, extend_logical_axis_rules, get_sharding_map_logic_axis_to_mesh_axis,
                             global_shard_guard, logical_axis_rules)

NONE_NAMES = ("nvte_seqlen", "nvte_hidden", "nvte_joined", "nvte_w_no_shard", "nvte_w_joined")


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape), names)


def table(batch=None, seqlen_tp=None, seqlen_cp=None, tp=None, w_fsdp=None):
    """TE's table in its key order, from the values each case works out."""
    return {"nvte_batch": batch, "nvte_seqlen": None, "nvte_seqlen_tp": seqlen_tp, "nvte_seqlen_cp": seqlen_cp,
            "nvte_head": tp, "nvte_hidden": None, "nvte_hidden_tp": tp, "nvte_joined": None,
            "nvte_w_no_shard": None, "nvte_w_fsdp": w_fsdp, "nvte_w_tp": tp, "nvte_w_joined": None}


DP_TP = ((2, 2), ("dp", "tp"))
DP_FSDP_TP = ((2, 2, 2), ("dp", "fsdp", "tp"))
FSDP1 = ((4, 1, 2), ("dp", "fsdp", "tp"))  # an fsdp axis of one device

CASES = [
    # plain DP + TP: batch on dp (no fsdp), the TP names on tp.
    (DP_TP, MeshResource(dp_resource="dp", tp_resource="tp"), table(batch="dp", tp="tp")),
    # sequence parallel only (tpsp on a 2-device axis, no tp): TE puts the TP names on tpsp.
    (DP_TP, MeshResource(dp_resource="dp", tpsp_resource="tp"), table(batch="dp", seqlen_tp="tp", tp="tp")),
    # FSDP on the dp axis: batch and the weights' fsdp dim on it.
    (DP_TP, MeshResource(dp_resource="dp", fsdp_resource="dp", tp_resource="tp"),
     table(batch="dp", tp="tp", w_fsdp="dp")),
    # dp and fsdp on separate axes: TE's batch is fsdp alone.
    (DP_FSDP_TP, MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp", cp_resource="dp"),
     table(batch="fsdp", seqlen_cp="dp", tp="tp", w_fsdp="fsdp")),
    # an fsdp axis of one device does not count: batch on dp; tpsp on 2 devices wins over tp None.
    (FSDP1, MeshResource(dp_resource="dp", fsdp_resource="fsdp", tpsp_resource="tp"),
     table(batch="dp", seqlen_tp="tp", tp="tp", w_fsdp="fsdp")),
    # tpsp on a one-device axis does not count either: the TP names stay on tp.
    (FSDP1, MeshResource(tp_resource="tp", tpsp_resource="fsdp"), table(seqlen_tp="fsdp", tp="tp")),
    # no MeshResource set: every name unsharded (TE asserts one is set).
    (DP_TP, MeshResource(), table()),
]


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
@pytest.mark.parametrize("mesh_shape, resource, want", CASES)
def test_te_table_under_a_mesh(mesh_shape, resource, want):
    mesh = mesh_of(*mesh_shape)
    with global_shard_guard(resource):
        assert get_sharding_map_logic_axis_to_mesh_axis() == {}  # no mesh yet
        for enter in (lambda: jax.set_mesh(mesh), lambda: mesh):
            with enter():
                got = get_sharding_map_logic_axis_to_mesh_axis()
                assert got == want and list(got) == list(want)
                # lowbit's fuller table carries TE's names the same way, after the Flax names.
                rules = logical_axis_rules()
                assert dict(rules[-len(want):]) == want and rules[0][0] == "batch"


def test_te_table_refusals_and_shard_map():
    mesh = mesh_of(*DP_TP)
    with jax.set_mesh(mesh):
        # tp and tpsp both on axes of more than one device (TE's assert).
        for r in (MeshResource(tp_resource="tp", tpsp_resource="tp"),
                  MeshResource(tp_resource="dp", tpsp_resource="tp")):
            with global_shard_guard(r), pytest.raises(ValueError, match="cannot both be enabled"):
                get_sharding_map_logic_axis_to_mesh_axis()
        with global_shard_guard(MeshResource(fsdp_resource="nope")):
            with pytest.raises(ValueError, match="'nope' is not an axis of the mesh"):
                get_sharding_map_logic_axis_to_mesh_axis()
        with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
            seen = {}

            def record(key):
                def body(v):
                    seen[key] = get_sharding_map_logic_axis_to_mesh_axis()
                    return v
                return body

            x = np.zeros((4, 4), np.float32)
            # every mesh axis manual: {}; some manual: the whole table, as in TE.
            jax.shard_map(record("all"), mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))(x)
            jax.shard_map(record("dp"), mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})(x)
    assert seen["all"] == {}
    assert seen["dp"] == table(batch="dp", tp="tp")


def test_logical_axis_rules_te_names_without_a_mesh():
    # Built before the mesh is entered: every named axis counts as more than one device.
    r = MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp", tpsp_resource="sp")
    rules = dict(logical_axis_rules(r))
    assert rules["nvte_batch"] == "fsdp" and rules["nvte_head"] == rules["nvte_w_tp"] == "sp"
    assert rules["nvte_seqlen_tp"] == "sp" and rules["nvte_w_fsdp"] == "fsdp"
    assert all(rules[name] is None for name in NONE_NAMES)
    assert rules["batch"] == ("dp", "fsdp") and rules["mlp"] == "tp"  # lowbit's Flax names keep theirs


def test_extend_logical_axis_rules_is_tes():
    mine = (("mine", "dp"), ("embed", None))
    # Without a mesh TE's table is empty: the rules come back as given.
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        assert extend_logical_axis_rules(mine) == mine
        assert extend_logical_axis_rules(()) == ()
    want = table(batch="dp", tp="tp")
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")), jax.set_mesh(mesh_of(*DP_TP)):
        # the given rules first, then TE's names only (no lowbit Flax names such as "mlp").
        assert extend_logical_axis_rules(mine) == mine + tuple(want.items())
        # a TE name given as TE maps it stays where it is and is not added twice.
        given = (("nvte_head", "tp"), ("mine", "dp"))
        ext = extend_logical_axis_rules(given)
        assert ext[:2] == given and len(ext) == 2 + 11 and ext.count(("nvte_head", "tp")) == 1
        with nn.logical_axis_rules(extend_logical_axis_rules(())):
            assert nn.logical_to_mesh_axes(("nvte_batch", "nvte_hidden", "nvte_w_tp")) == P("dp", None, "tp")
        # TE's refusals: another mapping (also where TE maps to None), a name given twice.
        for bad in ((("nvte_batch", "tp"),), (("nvte_hidden", "tp"),),
                    (("nvte_head", "tp"), ("nvte_head", "tp"))):
            with pytest.raises(ValueError, match=f"rules: '{bad[0][0]}' maps to .* TE's rules map it"):
                extend_logical_axis_rules(bad)
        for bad in ((("a",),), ((1, "dp"),), (("a", ("dp", "tp")),)):
            with pytest.raises(ValueError, match="extend_logical_axis_rules: rules:"):
                extend_logical_axis_rules(bad)
