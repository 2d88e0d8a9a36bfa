"""lowbit.ops.quantize_fp8_block / quantize_mxfp8 and their dequantize ops: block-scaled FP8
quantization through lowbit's FFI ops, one pass producing the rowwise and/or colwise copy
and its scales, each copy quantized from x itself.

x (rank >= 1) is viewed as R x C, R = prod(shape[:f]), f = flatten_axis. Numerics and the
scale layouts are those of csrc/quantize/quantize_block.h and quantize_mxfp8.h, in short:

FP8 block (Float8BlockScaling; Hopper's cuBLASLt block-scaled GEMM):
  tiles of 1x128 (activations, gradients) or 128x128 (weights) of the stored copy; per tile
  scale = fp8_max / amax (amax 0, inf or NaN -> 1; inf -> FLT_MAX; pow2_scales: rounded
  down to a power of two), q = cast_rne(clip(x * scale)), scale_inv = 1 / scale (fp32).
  rowwise: x's shape; colwise: the transpose shape[f:] + shape[:f] (both K-major).
  scale_inv of a stored R' x C' copy: 1x128 -> (ceil(C'/128), roundup(R', 4)), entry [j, r];
  128x128 -> (ceil(R'/128), roundup(ceil(C'/128), 4)), entry [i, j]; padding entries 0.
MXFP8: blocks of 32 along the rows (rowwise) or down the columns (colwise), both copies in
  x's shape; E8M0 byte e = the biased exponent of amax / fp8_max rounded up (NaN -> 0xFF),
  q = cast_rne(clip(x * 2^(127 - e))); scales row-major, padded to 128 x 4 tiles:
  rowwise (roundup(R, 128), roundup(ceil(C/32), 4)), colwise (roundup(ceil(R/32), 4),
  roundup(C, 128)); padding bytes 0.
Tiles and blocks at the edges are partial (as if x were zero-padded); data is never padded.
compute_dbias: also the column sums of x (shape[f:], x's dtype), computed in the kernel's
  pass over x: fp32 sums in the fixed order of csrc/quantize/block_dbias.h (per tile row of
  128 (FP8 block) or 64 (MXFP8) rows, then a finalize over the tile rows), rounded once to
  x's dtype; deterministic and the same bits on CPU and CUDA, it differs from
  jnp.sum(x.astype(f32), rows) only by fp32 summation order.

jit: yes. vmap: each batch element is quantized on its own (a loop over the batch, as the
scales of a 3-D view would otherwise mix elements). Sharded jit (Shardy custom partitioning):
the first dim of R (x's dim 0) and the first dim of C (x's dim flatten_axis) may stay
sharded, each when every shard holds whole tiles along it and every scale dim it splits is
unpadded (lowbit.ops._sharding.clean_split; e.g. 1x128: R % 4 == 0 for the rowwise scales,
whole 128-row tiles for the colwise ones; 128x128: whole 128-tiles and a 128-block count
that is a multiple of 4 on the K side); the scales are then sharded with their data (each
shard's kernel output cut to its slice of the unpadded dim). Any other sharded dim is
gathered first (exact, just not parallel). dbias is sharded like x's dims from flatten_axis
on; with R's first dim sharded, each shard returns its fp32 column sums, psum'ed over those
mesh axes and rounded to x's dtype once (so it differs from the unsharded dbias only by fp32
summation order). The dequantize ops are not partitioned.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.ops._primitive import ffi_primitive, vmap_body
from lowbit.ops._sharding import (SCALE_DIMS, clean_split, compound_sizes, fit_scale, mesh_axes, named_shardings,
                                  spec_entries, tiled_group_rule, transposed_layout)
from lowbit.ops.amax import check_high_precision
from lowbit.ops.quantize import FP8_DTYPES, check_quantize_args, flat_dbias_workspace_bytes
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
FP8_BLOCK_LEN = 128
MXFP8_BLOCK_LEN = 32


class BlockQuantized(NamedTuple):
    rowwise: jax.Array | None  # fp8, x's shape
    rowwise_scale: jax.Array | None  # 2-D: fp32 scale_inv (FP8 block) or e8m0 bytes (MXFP8)
    colwise: jax.Array | None  # fp8: transposed (FP8 block) or x's shape (MXFP8)
    colwise_scale: jax.Array | None
    dbias: jax.Array | None = None  # x's dtype, shape[f:] (compute_dbias=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _roundup(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def flat_view(shape, flatten_axis: int) -> tuple[int, int]:
    return int(np.prod(shape[:flatten_axis], dtype=np.int64)), int(np.prod(shape[flatten_axis:], dtype=np.int64))


def fp8_block_scale_shape(rows: int, cols: int, tile_2d: bool) -> tuple[int, int]:
    """scale_inv shape of a stored rows x cols FP8-block copy."""
    if tile_2d:
        return _cdiv(rows, FP8_BLOCK_LEN), _roundup(_cdiv(cols, FP8_BLOCK_LEN), 4)
    return _cdiv(cols, FP8_BLOCK_LEN), _roundup(rows, 4)


def mxfp8_scale_shape(rows: int, cols: int, colwise: bool) -> tuple[int, int]:
    """E8M0 scale shape of an MXFP8 copy of a rows x cols tensor."""
    if colwise:
        return _roundup(_cdiv(rows, MXFP8_BLOCK_LEN), 4), _roundup(cols, 128)
    return _roundup(rows, 128), _roundup(_cdiv(cols, MXFP8_BLOCK_LEN), 4)


def transposed_shape(shape, flatten_axis: int) -> tuple[int, ...]:
    return tuple(shape[flatten_axis:]) + tuple(shape[:flatten_axis])


def _empty(dtype):
    return jax.core.ShapedArray((0,), dtype)


def _dbias_abstract(x, flatten_axis, dbias_dtype):
    if dbias_dtype is None:
        return _empty(x.dtype)
    return jax.core.ShapedArray(tuple(x.shape[int(flatten_axis):]), dbias_dtype)


def _block_abstract(x, *, flatten_axis, tile_2d, pow2_scales, out_dtype, rowwise, colwise, dbias_dtype=None):
    del pow2_scales
    f = int(flatten_axis)
    r, c = flat_view(x.shape, f)
    return (
        jax.core.ShapedArray(x.shape, out_dtype) if rowwise else _empty(out_dtype),
        jax.core.ShapedArray(fp8_block_scale_shape(r, c, tile_2d), jnp.float32) if rowwise else _empty(jnp.float32),
        jax.core.ShapedArray(transposed_shape(x.shape, f), out_dtype) if colwise else _empty(out_dtype),
        jax.core.ShapedArray(fp8_block_scale_shape(c, r, tile_2d), jnp.float32) if colwise else _empty(jnp.float32),
        _dbias_abstract(x, f, dbias_dtype),
    )


def _mx_abstract(x, *, flatten_axis, out_dtype, rowwise, colwise, dbias_dtype=None):
    r, c = flat_view(x.shape, int(flatten_axis))
    return (
        jax.core.ShapedArray(x.shape, out_dtype) if rowwise else _empty(out_dtype),
        jax.core.ShapedArray(mxfp8_scale_shape(r, c, False), E8M0) if rowwise else _empty(E8M0),
        jax.core.ShapedArray(x.shape, out_dtype) if colwise else _empty(out_dtype),
        jax.core.ShapedArray(mxfp8_scale_shape(r, c, True), E8M0) if colwise else _empty(E8M0),
        _dbias_abstract(x, flatten_axis, dbias_dtype),
    )


# csrc/quantize/block_dbias.h: kFp8BlockDbiasTileRows, kMxfp8DbiasTileRows.
_FP8_BLOCK_DBIAS_TILE_ROWS, _MXFP8_DBIAS_TILE_ROWS = 128, 64


def _workspace(tile_rows):
    def bytes_(avals_in, *, flatten_axis, dbias_dtype=None, **_):
        return flat_dbias_workspace_bytes(avals_in[0].shape, int(flatten_axis), dbias_dtype is not None, tile_rows)
    return bytes_


# x -> (rowwise | (0,), rowwise_scale_inv | (0,), colwise | (0,), colwise_scale_inv | (0,),
#       dbias (shape[f:], dbias_dtype) | (0,)); on CUDA the custom call's workspace result
#       too (dropped).
quantize_fp8_block_p = ffi_primitive(
    "lowbit_quantize_fp8_block", "lowbit_quantize_fp8_block", _block_abstract,
    multiple_results=True, attrs=("flatten_axis", "tile_2d", "pow2_scales"),
    cuda_workspace=_workspace(_FP8_BLOCK_DBIAS_TILE_ROWS),
)
# (data, scale_inv) -> out, data's shape.
dequantize_fp8_block_p = ffi_primitive(
    "lowbit_dequantize_fp8_block", "lowbit_dequantize_fp8_block",
    lambda data, scale_inv, *, flatten_axis, tile_2d, out_dtype: jax.core.ShapedArray(data.shape, out_dtype),
    attrs=("flatten_axis", "tile_2d"),
)
# x -> (rowwise | (0,), rowwise_scale | (0,), colwise | (0,), colwise_scale | (0,), dbias | (0,)).
quantize_mxfp8_p = ffi_primitive(
    "lowbit_quantize_mxfp8", "lowbit_quantize_mxfp8", _mx_abstract,
    multiple_results=True, attrs=("flatten_axis",), cuda_workspace=_workspace(_MXFP8_DBIAS_TILE_ROWS),
)
# (data, scale) -> out, data's shape.
dequantize_mxfp8_p = ffi_primitive(
    "lowbit_dequantize_mxfp8", "lowbit_dequantize_mxfp8",
    lambda data, scale, *, flatten_axis, colwise, out_dtype: jax.core.ShapedArray(data.shape, out_dtype),
    attrs=("flatten_axis", "colwise"),
)


def _to_front(x, d, size):
    if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, d, 0)


def _looped_batcher(prim):
    """vmap rule: one primitive call per batch element (the batch dim moved to the front;
    flatten_axis refers to the unbatched operand, so it stays as is)."""

    def batch(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        args = tuple(_to_front(a, d, size) for a, d in zip(args, dims))
        outs = jax.lax.map(lambda xs: prim.bind(*xs, **params), args)
        if prim.multiple_results:
            return list(outs), [0] * len(outs)
        return outs, 0

    batching.primitive_batchers[prim] = batch


for _p in (quantize_fp8_block_p, dequantize_fp8_block_p, quantize_mxfp8_p, dequantize_mxfp8_p):
    _looped_batcher(_p)


def _copy_layout(kind: str, tile_2d: bool, colwise: bool):
    """(group, tile, pad) of the copy's scale dims 0 and 1 in x's R x C terms (SCALE_DIMS; an
    FP8 block colwise copy is stored transposed, so its rows are x's C)."""
    if kind == "mxfp8":
        return SCALE_DIMS["mxfp8_colwise" if colwise else "mxfp8"]
    layout = SCALE_DIMS["128x128" if tile_2d else "1x128"]
    return transposed_layout(layout) if colwise else layout


@lru_cache(maxsize=None)
def _quantize_fn(kind: str, flatten_axis: int, out_dtype, rowwise: bool, colwise: bool,
                 tile_2d: bool = False, pow2_scales: bool = False, dbias: bool = False):
    """x -> tuple of the requested (data, scale) pairs (then dbias), partitioned and batchable."""

    def call(x, dbias_dtype):
        if kind == "mxfp8":
            outs = quantize_mxfp8_p.bind(x, flatten_axis=np.int32(flatten_axis), out_dtype=out_dtype,
                                         rowwise=rowwise, colwise=colwise, dbias_dtype=dbias_dtype)
        else:
            outs = quantize_fp8_block_p.bind(
                x, flatten_axis=np.int32(flatten_axis), tile_2d=np.bool_(tile_2d),
                pow2_scales=np.bool_(pow2_scales), out_dtype=out_dtype, rowwise=rowwise, colwise=colwise,
                dbias_dtype=dbias_dtype)
        return tuple(outs[:2]) * rowwise + tuple(outs[2:4]) * colwise + tuple(outs[4:]) * dbias

    def local(x):
        return call(x, x.dtype if dbias else None)

    copies = [False] * rowwise + [True] * colwise  # is_colwise of each returned pair
    layouts = [_copy_layout(kind, tile_2d, cw) for cw in copies]

    def partition(mesh, arg_shapes, result_shape):
        shape = arg_shapes[0].shape
        ndim = len(shape)
        spec = spec_entries(arg_shapes[0].sharding, ndim)
        extents = flat_view(shape, flatten_axis)
        firsts = (0, flatten_axis)  # the first dim of R and of C: the only ones kept sharded
        keep = []
        for group, first in enumerate(firsts):
            axes = mesh_axes((spec[first],)) if first < ndim else ()
            shards = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64)) if axes else 1
            ok = all(clean_split(extents[group], shards, t, p)
                     for layout in layouts for g, t, p in layout if g == group)
            keep.append(spec[first] if ok and axes else None)
        x_spec = [None] * ndim
        x_spec[0] = keep[0]
        if flatten_axis < ndim:
            x_spec[flatten_axis] = keep[1]
        named = lambda *s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
        results, scale_shapes = [], []
        for cw, layout in zip(copies, layouts):
            if cw and kind != "mxfp8":  # the transposed copy: x's dims from flatten_axis on first
                results.append(named(*(x_spec[flatten_axis:] + x_spec[:flatten_axis])))
            else:
                results.append(named(*x_spec))
            results.append(named(*[keep[g] for g, _, _ in layout]))
        # Each shard's kernel writes its own padded layout; a sharded scale dim keeps the
        # shard's slice of the global (unpadded) dim: the padding is cut off.
        global_scales = [r.shape for r in list(result_shape)[1:2 * len(copies):2]]
        for i, layout in enumerate(layouts):
            local_shape = []
            for d, (g, _, _) in enumerate(layout):
                axes = mesh_axes((keep[g],))
                shards = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64)) if axes else 1
                local_shape.append(global_scales[i][d] // shards)
            scale_shapes.append(tuple(local_shape))

        row_axes = mesh_axes((keep[0],))  # the row dims' mesh axes: dbias is summed over them
        if dbias:
            results.append(named(*x_spec[flatten_axis:]))

        def lower(x):
            fp32_dbias = dbias and bool(row_axes)
            outs = list(call(x, jnp.dtype(jnp.float32)) if fp32_dbias else local(x))
            for i, want in enumerate(scale_shapes):
                outs[2 * i + 1] = fit_scale(outs[2 * i + 1], want)
            if fp32_dbias:
                outs[-1] = jax.lax.psum(outs[-1], row_axes).astype(x.dtype)
            return tuple(outs)
        return mesh, lower, tuple(results), (named(*x_spec),)

    def rule(mesh, value_types, result_types):
        shape = value_types[0].shape
        dims = [f"d{i}" for i in range(len(shape))]
        extents = flat_view(shape, flatten_axis)
        sizes, scale_exprs = {}, [[None, None] for _ in copies]
        for group, first in enumerate((0, flatten_axis)):
            if first >= len(shape):
                continue
            tiles = [(t, p) for layout in layouts for g, t, p in layout if g == group]
            expr, ties, got = tiled_group_rule(dims[first], shape[first], extents[group], tiles)
            sizes.update(got)
            dims[first] = expr
            ties = iter(ties)
            for i, layout in enumerate(layouts):
                for d, (g, _, _) in enumerate(layout):
                    if g == group:
                        scale_exprs[i][d] = next(ties)
        transposed = " ".join(dims[flatten_axis:] + dims[:flatten_axis])
        out = []
        for i, cw in enumerate(copies):
            out.append(transposed if cw and kind != "mxfp8" else " ".join(dims))
            # Scale dims not tied to x's (padded, or tiles split across x's dims) get
            # factors of their own.
            out.append(" ".join(e if e is not None else f"s{i}_{d}" for d, e in enumerate(scale_exprs[i])))
        if dbias:
            out.append(" ".join(dims[flatten_axis:]))
        text = f"{' '.join(dims)} -> {', '.join(out)}"
        return text, compound_sizes([text], sizes)

    partitioned = custom_partitioning(local)
    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def fn(x):
        return partitioned(x)

    fn.def_vmap(vmap_body(local))

    return fn


def _pack(outs, rowwise: bool, colwise: bool, dbias: bool = False) -> BlockQuantized:
    outs = list(outs)
    row = (outs.pop(0), outs.pop(0)) if rowwise else (None, None)
    col = (outs.pop(0), outs.pop(0)) if colwise else (None, None)
    return BlockQuantized(row[0], row[1], col[0], col[1], outs.pop(0) if dbias else None)


def quantize_fp8_block(x, *, out_dtype=jnp.float8_e4m3fn, tile_2d: bool = False,
                       pow2_scales: bool = False, rowwise: bool = True, colwise: bool = False,
                       flatten_axis: int = -1, compute_dbias: bool = False) -> BlockQuantized:
    """FP8 block quantization, 1x128 tiles (tile_2d=False) or 128x128, and optionally dbias
    (see the module doc)."""
    x, out_dtype, axis = check_quantize_args("lowbit.ops.quantize_fp8_block", x, out_dtype,
                                              rowwise, colwise, flatten_axis)
    fn = _quantize_fn("fp8_block", axis, out_dtype, bool(rowwise), bool(colwise), bool(tile_2d),
                      bool(pow2_scales), bool(compute_dbias))
    return _pack(fn(x), rowwise, colwise, bool(compute_dbias))


def quantize_mxfp8(x, *, out_dtype=jnp.float8_e4m3fn, rowwise: bool = True, colwise: bool = False,
                   flatten_axis: int = -1, compute_dbias: bool = False) -> BlockQuantized:
    """MXFP8 quantization, 32-value blocks with E8M0 scales, and optionally dbias (see the
    module doc)."""
    x, out_dtype, axis = check_quantize_args("lowbit.ops.quantize_mxfp8", x, out_dtype,
                                              rowwise, colwise, flatten_axis)
    fn = _quantize_fn("mxfp8", axis, out_dtype, bool(rowwise), bool(colwise), dbias=bool(compute_dbias))
    return _pack(fn(x), rowwise, colwise, bool(compute_dbias))


def _check_dequantize_args(op: str, data, scale, scale_dtype, out_dtype, flatten_axis: int):
    data, scale = jnp.asarray(data), jnp.asarray(scale)
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: data: expected float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if data.ndim == 0:
        raise ValueError(f"{op}: data: expected rank >= 1, got a scalar")
    if not -data.ndim <= flatten_axis < data.ndim:
        raise ValueError(f"{op}: flatten_axis: expected an axis of data {data.shape}, got {flatten_axis}")
    if scale.dtype != scale_dtype:
        raise TypeError(f"{op}: scale: expected {jnp.dtype(scale_dtype).name}, got {scale.dtype}")
    out_dtype = jnp.dtype(out_dtype)
    check_high_precision(op, "out_dtype", out_dtype)
    return data, scale, out_dtype, flatten_axis % data.ndim


def _check_scale_shape(op: str, scale, want) -> None:
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"{op}: scale: expected shape {tuple(want)}, got {tuple(scale.shape)}")


def dequantize_fp8_block(data, scale_inv, *, tile_2d: bool = False, flatten_axis: int = -1,
                         out_dtype=jnp.bfloat16) -> jax.Array:
    """decode(data) * scale_inv[tile], rounded to out_dtype. `data` is one stored copy (a
    colwise copy is the transposed tensor: pass its own flatten_axis, ndim - f)."""
    op = "lowbit.ops.dequantize_fp8_block"
    data, scale_inv, out_dtype, axis = _check_dequantize_args(op, data, scale_inv, jnp.float32,
                                                              out_dtype, flatten_axis)
    _check_scale_shape(op, scale_inv, fp8_block_scale_shape(*flat_view(data.shape, axis), bool(tile_2d)))
    return dequantize_fp8_block_p.bind(data, scale_inv, flatten_axis=np.int32(axis),
                                       tile_2d=np.bool_(tile_2d), out_dtype=out_dtype)


def dequantize_mxfp8(data, scale, *, colwise: bool = False, flatten_axis: int = -1,
                     out_dtype=jnp.bfloat16) -> jax.Array:
    """decode(data) * 2^(e - 127) of its block, rounded to out_dtype; colwise: the blocks run
    down the columns (a colwise copy)."""
    op = "lowbit.ops.dequantize_mxfp8"
    data, scale, out_dtype, axis = _check_dequantize_args(op, data, scale, E8M0, out_dtype, flatten_axis)
    _check_scale_shape(op, scale, mxfp8_scale_shape(*flat_view(data.shape, axis), bool(colwise)))
    return dequantize_mxfp8_p.bind(data, scale, flatten_axis=np.int32(axis), colwise=np.bool_(colwise),
                                   out_dtype=out_dtype)
