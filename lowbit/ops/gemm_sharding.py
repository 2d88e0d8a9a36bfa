"""lowbit.ops.gemm_sharding: how a sharded lowbit GEMM runs, shared by lowbit.ops.gemm and
lowbit.ops.gemm_nvfp4 (their custom_partitioning rules call these).

- plan_sharding: the mesh axes of a's rows, b's rows and K from the operands' and result's
  specs, and which K axes are reduce-scattered onto an output dim instead of psum'ed;
- _block_specs / _scale_sharding: what a block-scaled GEMM can run sharded (whole tiles,
  unpadded scale dims) and its scale arrays' shardings;
- _sum_k_partials: the tail of a K-sharded GEMM (collectives, bias, rounding);
- gather_rows: sequence parallelism's row all-gather as an op Shardy can see;
- _vmappable: a partitioned GEMM under vmap.

Sharding (Shardy rule + custom_partitioning): leading dims of a sharded -> each device
multiplies its rows (data parallel); N sharded (b's rows, column-parallel TP) -> out's last dim
and bias sharded alike; K sharded in both operands (row-parallel TP) -> each device computes its
partial product, a psum (or a reduce-scatter) over the K axes sums them, then bias is added once
in fp32 and the sum is rounded to out_dtype. The partial products are rounded to out_dtype and
summed in it (as XLA's sharded dot and TransformerEngine do), or kept in fp32 and rounded once
with LOWBIT_GEMM_PSUM=fp32 (gemm_config.PSUM_ENV). No other collective is inserted by the op.

Block modes: the same rule, with the scale arrays sharded with their data, when (a) only the
first row dim and the first contracted dim of an operand are sharded (a shard's flattened rows /
K are then one contiguous slice) and (b) each shard holds whole tiles and the scale dim it
splits has no padding (_sharding.clean_split): rows of a 1x128 operand with R % 4 == 0; rows of
a 128x128 operand in whole 128-row tiles; MXFP8 rows with R % 128 == 0; K in whole 128-blocks
(32 for MXFP8) with, for 128x128, ceil(K/128) % 4 == 0 and, for MXFP8, ceil(K/32) % 4 == 0. Each
shard re-pads its scale slices to its own layout (fit_scale). A sharded dim failing (a) or (b)
is gathered, its scales with it: exact, not parallel. No clean rule exists where the global
scale dim is padded (R % 4 != 0 for 1x128 rows, ceil(K/128) % 4 != 0 for 128x128 K, R % 128 != 0
or ceil(K/32) % 4 != 0 for MXFP8): the padding sits at the end of the global dim, so equal
slices of it do not line up with equal slices of the data; nor where a shard would split a tile.
The Shardy rule ties the first row and contracted dims to their scale dims by a shared major
factor (tiled_group_rule), so that propagation shards the scales with their data.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.ops._sharding import COLS, ROWS, SCALE_DIMS, clean_split, named_shardings, spec_entries
from lowbit.ops.gemm_config import GemmScaleMode
def _sum_k_partials(acc, psum_axes, scatter, bias, out_dtype):
    """The tail of a K-sharded GEMM (tensor / block and NVFP4 alike): this shard's partial
    product `acc` (in _reduce_dtype) reduce-scattered over `scatter`'s (axis, dim) pairs and
    psum'ed over `psum_axes`, then the bias (a tuple of none or one) added in fp32 and the sum
    rounded to out_dtype."""
    for axis, dim in scatter:
        acc = jax.lax.psum_scatter(acc, axis, scatter_dimension=dim, tiled=True)
    if psum_axes:
        acc = jax.lax.psum(acc, psum_axes)
    if bias:
        acc = acc.astype(jnp.float32) + bias[0].astype(jnp.float32)
    return acc.astype(out_dtype)


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def plan_sharding(mesh_shape: dict, a_spec, b_spec, out_spec, out_shape, k_ndim: int):
    """The per-dim mesh axes one sharded gemm runs with, from its operands' and result's specs
    (lists of per-dim axis tuples). Returns (m, n, k, scatter): m / n / k the axes of a's rows,
    b's rows and the contracted dims (a's and b's alike), and scatter a list of (axis, output
    dim) pairs: the partial sums over that k axis are reduce-scattered onto that output dim
    (the rest of the k axes are psum'ed).

    Conflicts, each axis sharding at most one factor: an axis on both a's rows and b's rows
    stays where the propagated result sharding has it (Shardy decided; any other choice costs
    a reshard after the GEMM) and, when the result has it on neither, drops from b's rows (b
    gathered, as FSDP does; sequence parallelism gathers a first, see gather_rows); a
    contracted dim whose axis is taken by a row dim,
    or sharded differently in a and b, is gathered. A k axis is scattered onto an output dim
    whose result sharding asks for it (row-parallel TP feeding sequence-parallel tokens,
    FSDP weight gradients), when that dim splits evenly."""
    m_nd = len(a_spec) - k_ndim
    m = [tuple(e) for e in a_spec[:m_nd]]
    n = [tuple(e) for e in b_spec[:len(b_spec) - k_ndim]]
    m_axes = {ax for e in m for ax in e}
    out_n = {ax for e in out_spec[m_nd:] for ax in e}
    for i, e in enumerate(n):
        clash = [ax for ax in e if ax in m_axes]
        if clash and all(ax in out_n for ax in clash):
            m = [tuple(ax for ax in me if ax not in clash) for me in m]
            m_axes -= set(clash)
        elif clash:
            n[i] = ()
    used = m_axes | {ax for e in n for ax in e}
    k = []
    for ka, kb in zip(a_spec[m_nd:], b_spec[len(b_spec) - k_ndim:]):
        ka, kb = tuple(ka), tuple(kb)
        axes = ka if (ka == kb or not kb) else (kb if not ka else ())
        if any(ax in used for ax in axes):
            axes = ()
        used |= set(axes)
        k.append(axes)
    scatter = []
    out = m + n
    for ax in (ax for e in k for ax in e):
        for d, want in enumerate(out_spec):
            have = out[d]
            if ax in want and ax not in have and tuple(want[:len(have) + 1]) == have + (ax,):
                size = math.prod(mesh_shape[x] for x in have + (ax,))
                if out_shape[d] % size == 0:
                    out[d] = have + (ax,)
                    scatter.append((ax, d))
                    break
    return m, n, k, scatter


def _gather_rows_partition(mesh, arg_shapes, result_shape):
    del result_shape
    (x,) = arg_shapes
    spec = spec_entries(x.sharding, len(x.shape))
    sharding = NamedSharding(mesh, PartitionSpec(spec[0], *[None] * (len(spec) - 1)))
    return mesh, lambda a: a, sharding, (sharding,)


@functools.lru_cache(maxsize=None)
def _make_gather_rows(n_rows: int, n_rest: int):
    """Identity on x (rows..., rest...) whose Shardy rule and partition replicate every row
    dim but the first: the row all-gather of sequence parallelism, visible to propagation so
    that the GEMM after it keeps its weight's column sharding."""
    gather = custom_partitioning(lambda a: a)
    rows = [f"r{i}" for i in range(n_rows)]
    dims = " ".join(rows + [f"c{i}" for i in range(n_rest)])
    gather.def_partition(
        partition=named_shardings(_gather_rows_partition),
        sharding_rule=lambda mesh, vt, rt: (f"{dims} -> {dims}",
                                            {"need_replication_factors": tuple(rows[1:])}))
    return gather


def gather_rows(a, n_rows: int):
    """a with its row dims (the first n_rows) after the first gathered (sequence parallelism:
    (batch, seq@tp, ...) -> (batch, seq, ...) before a column-parallel GEMM)."""
    if n_rows < 2:
        return a
    return _make_gather_rows(n_rows, a.ndim - n_rows)(a)


_LAYOUT = {GemmScaleMode.BLOCK_1x128: "1x128", GemmScaleMode.BLOCK_128x128: "128x128",
           GemmScaleMode.MXFP8: "mxfp8"}


def _block_clean(mesh_shape: dict, axes, extent: int, group: int, modes) -> bool:
    """True when sharding an operand group (ROWS or COLS = K) of `extent` over `axes` keeps
    whole tiles and unpadded scale dims in every one of `modes` (clean_split)."""
    shards = math.prod(mesh_shape[ax] for ax in axes)
    return all(clean_split(extent, shards, t, p)
               for mode in modes for g, t, p in SCALE_DIMS[_LAYOUT[mode]] if g == group)


def _block_specs(mesh_shape: dict, a_spec, b_spec, a_shape, b_shape, k_ndim: int, a_mode, b_mode):
    """a's and b's specs cut to what a block-scaled GEMM can run sharded: only the first
    row dim and the first contracted dim of each keep their axes (the flattened shard is
    then one contiguous slice), and only where clean_split holds for the scale layouts."""
    def cut(spec, shape, mode):
        rows = len(shape) - k_ndim
        out = [() for _ in spec]
        if rows and _block_clean(mesh_shape, spec[0], math.prod(shape[:rows]), ROWS, (mode,)):
            out[0] = spec[0]
        out[rows] = spec[rows]
        return out
    a, b = cut(a_spec, a_shape, a_mode), cut(b_spec, b_shape, b_mode)
    ka, kb = len(a_shape) - k_ndim, len(b_shape) - k_ndim
    k = math.prod(a_shape[ka:])
    for spec, at in ((a, ka), (b, kb)):
        if not _block_clean(mesh_shape, spec[at], k, COLS, (a_mode, b_mode)):
            spec[at] = ()
    return a, b


def _scale_sharding(mode, row_axes, k_axes):
    """The scale array's per-dim axes for an operand whose rows / K are sharded so."""
    return [row_axes if g == ROWS else k_axes for g, _, _ in SCALE_DIMS[_LAYOUT[mode]]]


def _vmappable(partitioned, fold_a_batch: bool):
    """A partitioned GEMM under a custom_vmap rule (custom_partitioning has no batching rule):
    with fold_a_batch, a batched `a` alone folds into M (still partitioned); anything else
    runs once per batch element (lax.map), the unbatched operands broadcast along the batch
    (custom_vmap puts batched ones at axis 0)."""
    @jax.custom_batching.custom_vmap
    def fn(*args):
        return partitioned(*args)

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        if fold_a_batch and in_batched[0] and not any(in_batched[1:]):
            return fn(*args), True
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip(args, in_batched)]
        return jax.lax.map(lambda xs: fn(*xs), tuple(args)), True

    return fn
