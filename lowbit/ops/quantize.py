"""lowbit.ops.quantize_fp8 / dequantize_fp8: FP8 per-tensor quantization through lowbit's
FFI ops (one fused pass: cast, transpose, amax, dbias).

Numerics (DESIGN.md §4), bit for bit on CPU and CUDA:
  q = cast_rne(clip(float32(x) * scale, -max, max)) in E4M3 (max 448) or E5M2 (57344);
  NaN stays NaN. x (rank >= 1) is viewed as rows x cols with rows = prod(shape[:f]),
  f = flatten_axis; `rowwise` has x's shape, `colwise` is the transpose of that view,
  shape[f:] + shape[:f]; amax = max|x| (NaN beats inf; 0 for an empty x); dbias = the
  column sums of x, shape[f:], accumulated in fp32 and rounded once to x's dtype.
dequantize_fp8: round_to(out_dtype)(decode(q) * scale_inv).

Works under jit, vmap (semantics of vmap of the unbatched function: each batch element
gets its own amax and dbias; done as a loop over the batch) and a sharded jit (Shardy
custom partitioning): x may be sharded on any dims; rowwise keeps x's sharding, colwise
gets the permuted sharding, amax is pmax'ed over every mesh axis that shards x, and dbias
is psum'ed over the axes that shard the row dims. The sharded dbias is summed in fp32
(each shard returns fp32 column sums) and rounded to x's dtype once, so it differs from
the unsharded one only by fp32 summation order.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.ops._primitive import ffi_primitive, vmap_body
from lowbit.ops._sharding import mesh_axes, named_shardings, pmax_nonnegative, spec_entries
from lowbit.ops.amax import check_high_precision

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_quantize_args(op: str, x, out_dtype, rowwise: bool, colwise: bool, flatten_axis: int):
    """The argument checks of every quantizer: x, out_dtype, a copy asked for, flatten_axis;
    returns x as an array, out_dtype as a dtype and flatten_axis made non-negative."""
    x = jnp.asarray(x)
    check_high_precision(op, "x", x)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: out_dtype: expected float8_e4m3fn or float8_e5m2, got {out_dtype}")
    return x, out_dtype, check_copies_and_axis(op, x, rowwise, colwise, flatten_axis)


def check_copies_and_axis(op: str, x: jax.Array, rowwise: bool, colwise: bool, flatten_axis: int) -> int:
    """The layout checks of every quantizer (FP8, block, NVFP4): a copy asked for, x of rank
    >= 1, flatten_axis an axis of x; returns flatten_axis made non-negative."""
    if not (rowwise or colwise):
        raise ValueError(f"{op}: rowwise, colwise: expected at least one of them to be True")
    if x.ndim == 0:
        raise ValueError(f"{op}: x: expected rank >= 1, got a scalar")
    if not -x.ndim <= flatten_axis < x.ndim:
        raise ValueError(f"{op}: flatten_axis: expected an axis of x {x.shape}, got {flatten_axis}")
    return flatten_axis % x.ndim


class Fp8Quantized(NamedTuple):
    rowwise: jax.Array | None  # fp8, x's shape
    colwise: jax.Array | None  # fp8, shape[f:] + shape[:f]
    amax: jax.Array  # f32 scalar, max |x|
    dbias: jax.Array | None  # x's dtype, shape[f:]


def colwise_shape(shape, flatten_axis: int) -> tuple[int, ...]:
    return tuple(shape[flatten_axis:]) + tuple(shape[:flatten_axis])


def _quantize_abstract(x, scale, *, flatten_axis, out_dtype, rowwise, colwise, dbias_dtype):
    fa = int(flatten_axis)
    empty = jax.core.ShapedArray((0,), out_dtype)
    return (
        jax.core.ShapedArray(x.shape, out_dtype) if rowwise else empty,
        jax.core.ShapedArray(colwise_shape(x.shape, fa), out_dtype) if colwise else empty,
        jax.core.ShapedArray((1,), jnp.float32),
        jax.core.ShapedArray(x.shape[fa:], dbias_dtype)
        if dbias_dtype is not None
        else jax.core.ShapedArray((0,), x.dtype),
    )


def dbias_workspace_bytes(rows: int, cols: int, dbias: bool, tile_rows: int) -> int:
    """The CUDA dbias workspace of a rows x cols pass (csrc: QuantizeFp8WorkspaceBytes,
    BlockDbiasWorkspaceBytes, ActBackwardWorkspaceBytes): one fp32 row of column sums per
    `tile_rows` rows, when dbias is computed (the handlers check the size)."""
    if not dbias or rows == 0 or cols == 0:
        return 0
    return -(-rows // tile_rows) * cols * 4


def flat_dbias_workspace_bytes(shape, flatten_axis: int, dbias: bool, tile_rows: int) -> int:
    """dbias_workspace_bytes of x's rows x cols view at flatten_axis."""
    return dbias_workspace_bytes(math.prod(shape[:flatten_axis]), math.prod(shape[flatten_axis:]), dbias, tile_rows)


# csrc/quantize/quantize.h: kQuantizeTileRows, the per-tensor kernel's tile height.
_TILE_ROWS = 64


def _quantize_workspace(avals_in, *, flatten_axis, dbias_dtype, **_):
    return flat_dbias_workspace_bytes(avals_in[0].shape, int(flatten_axis), dbias_dtype is not None, _TILE_ROWS)


# (x, scale (1,)) -> (rowwise | (0,), colwise | (0,), amax (1,), dbias | (0,)); on CUDA the
# custom call's workspace result too (dropped).
quantize_fp8_p = ffi_primitive(
    "lowbit_quantize_fp8",
    "lowbit_quantize_fp8",
    _quantize_abstract,
    multiple_results=True,
    attrs=("flatten_axis",),
    cuda_workspace=_quantize_workspace,
)

# (data fp8, scale_inv (1,)) -> out, data's shape.
dequantize_fp8_p = ffi_primitive(
    "lowbit_dequantize_fp8",
    "lowbit_dequantize_fp8",
    lambda data, scale_inv, *, out_dtype: jax.core.ShapedArray(data.shape, out_dtype),
)


def _to_front(x, d, size):
    if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, d, 0)


def _batch_size(args, dims):
    return next(a.shape[d] for a, d in zip(args, dims) if d is not None)


def _quantize_batch(args, dims, **params):
    # One primitive call per batch element: amax and dbias are per element.
    size = _batch_size(args, dims)
    x, scale = (_to_front(a, d, size) for a, d in zip(args, dims))
    outs = jax.lax.map(lambda xs: tuple(quantize_fp8_p.bind(*xs, **params)), (x, scale))
    return list(outs), [0] * len(outs)


def _dequantize_batch(args, dims, **params):
    (data, scale_inv), (dd, ds) = args, dims
    if ds is None:  # elementwise: the batched tensor is just a bigger tensor
        return dequantize_fp8_p.bind(data, scale_inv, **params), dd
    size = _batch_size(args, dims)
    data, scale_inv = _to_front(data, dd, size), _to_front(scale_inv, ds, size)
    return jax.lax.map(lambda xs: dequantize_fp8_p.bind(*xs, **params), (data, scale_inv)), 0


batching.primitive_batchers[quantize_fp8_p] = _quantize_batch
batching.primitive_batchers[dequantize_fp8_p] = _dequantize_batch


@lru_cache(maxsize=None)
def _quantize_fn(flatten_axis: int, out_dtype, rowwise: bool, colwise: bool, dbias: bool):
    """The (x, scale) -> tuple-of-requested-outputs function for one configuration:
    (rowwise?, colwise?, amax scalar, dbias?), partitioned and batchable."""

    def call(x, scale, dbias_dtype):
        r, c, a, d = quantize_fp8_p.bind(
            x, scale, flatten_axis=np.int32(flatten_axis), out_dtype=out_dtype,
            rowwise=rowwise, colwise=colwise, dbias_dtype=dbias_dtype,
        )
        return tuple([r] * rowwise + [c] * colwise + [a[0]] + [d] * dbias)

    def local(x, scale):
        return call(x, scale, x.dtype if dbias else None)

    def partition(mesh, arg_shapes, result_shape):
        ndim = len(arg_shapes[0].shape)
        spec = spec_entries(arg_shapes[0].sharding, ndim)
        all_axes = mesh_axes(spec)
        row_axes = mesh_axes(spec[:flatten_axis])
        col_spec = spec[flatten_axis:]

        def lower(x, scale):
            dtype = x.dtype
            fp32_dbias = dbias and bool(row_axes)
            outs = list(call(x, scale, jnp.dtype(jnp.float32)) if fp32_dbias else local(x, scale))
            amax_at = int(rowwise) + int(colwise)
            if all_axes:
                outs[amax_at] = pmax_nonnegative(outs[amax_at], all_axes)
            if fp32_dbias:
                outs[-1] = jax.lax.psum(outs[-1], row_axes).astype(dtype)
            return tuple(outs)

        named = lambda *s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
        results = (
            [named(*spec)] * rowwise
            + [named(*col_spec, *spec[:flatten_axis])] * colwise
            + [named()]
            + [named(*col_spec)] * dbias
        )
        return mesh, lower, tuple(results), (named(*spec), named(None))

    def rule(mesh, value_types, result_types):
        dims = [f"d{i}" for i in range(len(value_types[0].shape))]
        rows, cols = dims[:flatten_axis], dims[flatten_axis:]
        results = (
            [" ".join(dims)] * rowwise
            + [" ".join(cols + rows)] * colwise
            + [""]
            + [" ".join(cols)] * dbias
        )
        return f"{' '.join(dims)}, scale -> {', '.join(results)}", {}

    partitioned = custom_partitioning(local)
    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)

    # custom_partitioning has no batching rule: under vmap, go through the primitive's.
    @jax.custom_batching.custom_vmap
    def fn(x, scale):
        return partitioned(x, scale)

    fn.def_vmap(vmap_body(local))

    return fn


def _scale_arg(op: str, name: str, scale) -> jax.Array:
    scale = jnp.asarray(scale)
    if scale.dtype != jnp.float32 or scale.shape not in ((), (1,)):
        raise ValueError(f"{op}: {name}: expected float32 of shape () or (1,), got {scale.dtype}{scale.shape}")
    return scale.reshape(1)


def quantize_fp8(
    x,
    scale,
    *,
    out_dtype=jnp.float8_e4m3fn,
    rowwise: bool = True,
    colwise: bool = False,
    flatten_axis: int = -1,
    compute_dbias: bool = False,
) -> Fp8Quantized:
    """Quantizes x to FP8 with one per-tensor `scale` (see the module docstring)."""
    op = "lowbit.ops.quantize_fp8"
    x, out_dtype, axis = check_quantize_args(op, x, out_dtype, rowwise, colwise, flatten_axis)
    scale = _scale_arg(op, "scale", scale)
    outs = list(_quantize_fn(axis, out_dtype, bool(rowwise), bool(colwise), bool(compute_dbias))(x, scale))
    return Fp8Quantized(
        rowwise=outs.pop(0) if rowwise else None,
        colwise=outs.pop(0) if colwise else None,
        amax=outs.pop(0),
        dbias=outs.pop(0) if compute_dbias else None,
    )


@lru_cache(maxsize=None)
def _dequantize_fn(out_dtype):
    def local(data, scale_inv):
        return dequantize_fp8_p.bind(data, scale_inv, out_dtype=out_dtype)

    def partition(mesh, arg_shapes, result_shape):
        sharding = arg_shapes[0].sharding
        return mesh, local, sharding, (sharding, NamedSharding(mesh, PartitionSpec(None)))

    def rule(mesh, value_types, result_types):
        dims = " ".join(f"d{i}" for i in range(len(value_types[0].shape)))
        return f"{dims}, scale -> {dims}", {}

    partitioned = custom_partitioning(local)
    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def fn(data, scale_inv):
        return partitioned(data, scale_inv)

    fn.def_vmap(vmap_body(local))

    return fn


def dequantize_fp8(data, scale_inv, out_dtype=jnp.bfloat16) -> jax.Array:
    """decode(data) * scale_inv, rounded to out_dtype (float32, float16 or bfloat16)."""
    op = "lowbit.ops.dequantize_fp8"
    data = jnp.asarray(data)
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: data: expected float8_e4m3fn or float8_e5m2, got {data.dtype}")
    out_dtype = jnp.dtype(out_dtype)
    check_high_precision(op, "out_dtype", out_dtype)
    scale_inv = _scale_arg(op, "scale_inv", scale_inv)
    if data.ndim == 0:
        return _dequantize_fn(out_dtype)(data.reshape(1), scale_inv).reshape(())
    return _dequantize_fn(out_dtype)(data, scale_inv)


def quantize_fp8_reference(x, scale, out_dtype=jnp.float8_e4m3fn, flatten_axis: int = -1):
    """The few-line jnp reference the tests compare against: (rowwise, colwise, amax, dbias)."""
    f = flatten_axis % x.ndim
    fmax = float(jnp.finfo(out_dtype).max)
    q = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(out_dtype)
    perm = tuple(range(f, x.ndim)) + tuple(range(f))
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0)
    dbias = jnp.sum(x.astype(jnp.float32), axis=tuple(range(f))).astype(x.dtype)
    return q, jnp.transpose(q, perm), amax, dbias
