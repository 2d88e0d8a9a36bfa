"""lowbit.ops.act_forward / act_backward: activations with a fused FP8 quantization of the
output, and the fused dact + dbias + quantize of the gradient, through lowbit's FFI ops.

act_type (csrc/activation/activation_math.h: ActType): "linear" (identity), "gelu" (tanh
approximation 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))), "silu" (x sigmoid(x)),
"relu", "quick_gelu" (x sigmoid(1.702 x)), "squared_relu" (relu(x)^2) and, gated only,
"clamped_silu" (GPT-OSS / TE clamped_swiglu: a = min(x_a, limit), g = clamp(x_g, -limit,
limit) + 1, y = a sigmoid(alpha a) * g; gradients pass where x_a <= limit and |x_g| <= limit).
Gated forms take x of shape (..., 2, H), TE's layout: y = act(x[..., 0, :]) * x[..., 1, :].
All math is fp32; sigmoid is lowbit's own, from FMAs only (common/fp32_math.h: exp within 1
ulp, sigmoid within 3 ulp), so the CPU and CUDA kernels agree bit for bit; a jnp reference
differs by a few fp32 ulps.

bias (optional, both ops): x's trailing shape ((H,), or (2, H) when gated) and dtype, added
to every row of x inside the kernel before the activation: x_b = float32(x) + float32(bias),
one IEEE fp32 add (denormals kept) of the widened values, not rounded back to x's dtype.
Every output (y / dx, the quantized copies, amax, dbias) is then the op's on x_b: for fp32 x
bit for bit act_forward(x + bias) / act_backward(dz, x + bias) (XLA's f32 add is the same
single add), and dbias is d/d x_b, which is also the bias's gradient. For bf16/f16 x it is
the op on the unrounded fp32 sum, which no x of that dtype may equal. The bias costs no
pass over memory of its own (the CUDA kernel keeps a column tile's values in shared memory).

Quantized outputs (with quant_scale): encode_rne(clip(v * scale)) of the fp32 v (y or dx).
Forward: q_rowwise (..., H), q_colwise (H, rows). Backward, on dx's 2-D view (rows, C) with
C = H, or 2H when gated ([d x_a | d x_g]): q_rowwise (rows, C), q_colwise (C, rows). amax =
max |v| as f32 (1,) (NaN wins). dbias = column sums of dx over the rows, (C,), x's dtype.

Sharding (custom_partitioning + Shardy rule): leading (row) dims and H pass through; the 2
axis of a gated input stays whole; amax is pmax'ed over every mesh axis that shards the
input, dbias psum'ed over the axes that shard the rows; a bias is sharded as x's trailing
dims. The 2-D views of the quantized
outputs split cleanly only where just the first leading dim (and, gated backward, no H) is
sharded, so other shardings are gathered; with keep_dims=True (layernorm_mlp uses it)
nothing is flattened (q_colwise (H, ...) or (2, H, ...), the handler takes both layouts) and
every dim keeps its sharding. vmap: the batch is mapped with
lax.map (each element keeps its own amax and scale).
"""

from __future__ import annotations

import functools
import math
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
from lowbit.ops.quantize import dbias_workspace_bytes

ACT_TYPES = {"linear": 0, "gelu": 1, "silu": 2, "relu": 3, "quick_gelu": 4, "squared_relu": 5,
             "clamped_silu": 6}
QUANT_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_FWD = "lowbit.ops.act_forward"
_BWD = "lowbit.ops.act_backward"


class ActForwardOut(NamedTuple):
    y: jax.Array | None          # x's dtype, (..., H) (None with return_y=False)
    q_rowwise: jax.Array | None  # fp8, (..., H)
    q_colwise: jax.Array | None  # fp8, (H, rows)
    amax: jax.Array | None       # f32 (1,): max |y| (None without quant_scale)


class ActBackwardOut(NamedTuple):
    dx: jax.Array | None         # x's dtype and shape
    q_rowwise: jax.Array | None  # fp8, (rows, C)
    q_colwise: jax.Array | None  # fp8, (C, rows)
    amax: jax.Array | None       # f32 (1,): max |dx|
    dbias: jax.Array | None      # x's dtype, (C,): C = H, or 2H when gated


class _Cfg(NamedTuple):
    """Static configuration of one call (hashable: a custom_partitioning static)."""

    act_type: int
    gated: bool
    limit: float
    alpha: float
    q_dtype: str | None  # None: no quantization
    out: bool            # y / dx wanted
    rowwise: bool
    colwise: bool
    dbias: bool          # backward only
    keep_dims: bool = False  # quantized copies unflattened: x's dims (rowwise), tail + lead (colwise)
    bias: bool = False       # a bias operand (else an empty (0,) array in its place)

    def params(self, backward: bool):
        p = dict(act_type=np.int32(self.act_type), gated=np.bool_(self.gated),
                 limit=np.float32(self.limit), alpha=np.float32(self.alpha), cfg=self)
        if backward:
            p["compute_dbias"] = np.bool_(self.dbias)
        return p


def _empty(dtype=jnp.float32):
    return jax.core.ShapedArray((0,), dtype)


def _lead(x, cfg):
    return x.shape[:-2] if cfg.gated else x.shape[:-1]


def _outputs(cfg, lead, tail, dtype, backward):
    """Abstract (out, q_rowwise, q_colwise, amax) for an output of shape lead + tail:
    q_colwise is (C, rows); backward q_rowwise is (rows, C) (C = prod(tail))."""
    q = jnp.dtype(cfg.q_dtype) if cfg.q_dtype else None
    shape, rows, cols = (*lead, *tail), math.prod(lead), math.prod(tail)
    row_shape = (rows, cols) if backward and not cfg.keep_dims else shape
    col_shape = (*tail, *lead) if cfg.keep_dims else (cols, rows)
    return [
        jax.core.ShapedArray(shape, dtype) if cfg.out else _empty(dtype),
        jax.core.ShapedArray(row_shape, q) if q is not None and cfg.rowwise else _empty(jnp.uint8),
        jax.core.ShapedArray(col_shape, q) if q is not None and cfg.colwise
        else _empty(jnp.uint8),
        jax.core.ShapedArray((1,), jnp.float32),
    ]


def _fwd_abstract(x, bias, scale, *, act_type, gated, limit, alpha, cfg):
    del bias, scale, act_type, gated, limit, alpha
    return tuple(_outputs(cfg, _lead(x, cfg), x.shape[-1:], x.dtype, False))


# CUDA tile rows (csrc/activation/activation.h: kActTileRows).
_TILE_ROWS = 64


def _workspace_bytes(rows, cols, dbias):
    """activation.h: ActBackwardWorkspaceBytes, the 64-row tiles' partial column sums."""
    return dbias_workspace_bytes(rows, cols, dbias, _TILE_ROWS)


def _bwd_abstract(dz, x, bias, scale, *, act_type, gated, limit, alpha, compute_dbias, cfg):
    """(dx, q_rowwise, q_colwise, amax, dbias, workspace): the last is a u8 scratch result
    for the CUDA dbias partials (XLA-allocated; dropped by _bwd_local)."""
    del dz, bias, scale, act_type, gated, limit, alpha, compute_dbias
    tail = x.shape[-2:] if cfg.gated else x.shape[-1:]
    dbias = jax.core.ShapedArray((math.prod(tail),), x.dtype) if cfg.dbias else _empty(x.dtype)
    ws = _workspace_bytes(math.prod(_lead(x, cfg)), math.prod(tail), cfg.dbias)
    workspace = jax.core.ShapedArray((ws,), jnp.uint8)
    return tuple(_outputs(cfg, _lead(x, cfg), tail, x.dtype, True) + [dbias, workspace])


_ATTRS = ("act_type", "gated", "limit", "alpha")
act_fwd_p = ffi_primitive("lowbit_act_forward", "lowbit_act_forward", _fwd_abstract,
                          multiple_results=True, attrs=_ATTRS)
act_bwd_p = ffi_primitive("lowbit_act_backward", "lowbit_act_backward", _bwd_abstract,
                          multiple_results=True, attrs=_ATTRS + ("compute_dbias",))


# ---------------------------------------------------------------- vmap

def _map_batch(prim, args, dims, params):
    """One primitive call per batch element (lax.map); outputs batched at 0."""
    batched = [d is not None for d in dims]
    moved = [jnp.moveaxis(a, d, 0) if b else a for a, d, b in zip(args, dims, batched)]

    def one(slices):
        it = iter(slices)
        return tuple(prim.bind(*[next(it) if b else a for a, b in zip(moved, batched)], **params))

    outs = jax.lax.map(one, [a for a, b in zip(moved, batched) if b])
    return list(outs), [0] * len(outs)


batching.primitive_batchers[act_fwd_p] = lambda args, dims, **params: _map_batch(
    act_fwd_p, args, dims, params)
batching.primitive_batchers[act_bwd_p] = lambda args, dims, **params: _map_batch(
    act_bwd_p, args, dims, params)


# ---------------------------------------------------------------- sharding

def _fmt(tensors):
    return ", ".join(" ".join(t) for t in tensors)


def _rule_parts(cfg, nlead, backward):
    """Factor lists: b* rows, t the gated 2 axis (kept whole), h the hidden dim. The 2-D
    quantized outputs use the compound factor (b0 b1 ...) for their rows (keep_dims: each
    dim its own factor)."""
    b = [f"b{i}" for i in range(nlead)]
    rows = ["(" + " ".join(b) + ")"] if nlead > 1 and not cfg.keep_dims else b
    x = b + (["t", "h"] if cfg.gated else ["h"])
    tail = ["t", "h"] if cfg.gated and backward else ["h"]
    cols = tail if cfg.keep_dims else (["(t h)"] if cfg.gated and backward else ["h"])
    empty = iter(f"e{i}" for i in range(8))
    one = lambda: [next(empty)]  # noqa: E731  a (0,) or (1,) tensor: its own factor
    q = cfg.q_dtype is not None
    if not rows:
        rows = one()
    results = [b + tail if cfg.out else one(),
               (rows + cols if backward else b + tail) if q and cfg.rowwise else one(),
               cols + rows if q and cfg.colwise else one(), one()]
    bias = (["t", "h"] if cfg.gated else ["h"]) if cfg.bias else one()
    if backward:
        results.append(cols if cfg.dbias else one())
        operands = [b + ["h"], x, bias, one()]
    else:
        operands = [x, bias, one()]
    kinds = {"need_replication_factors": ("t",)} if cfg.gated else {}
    return f"{_fmt(operands)} -> {_fmt(results)}", kinds


def _partition(cfg, backward, mesh, arg_shapes):
    x_shape = arg_shapes[1 if backward else 0]
    entries = list(spec_entries(x_shape.sharding, x_shape.ndim))
    if cfg.gated:
        entries[-2] = None
    nlead = x_shape.ndim - (2 if cfg.gated else 1)
    q = cfg.q_dtype is not None
    if q and (cfg.colwise or backward) and nlead > 1 and not cfg.keep_dims:
        # A flattened row dim is split in contiguous blocks only if just the first lead dim
        # is sharded: the others are gathered.
        entries[1:nlead] = [None] * (nlead - 1)
    if backward and cfg.gated and (q or cfg.dbias) and not cfg.keep_dims:
        entries[-1] = None  # the (2, H) columns of a gated dx flatten contiguously only whole
    lead, h = entries[:nlead], entries[-1]
    all_axes, row_axes = mesh_axes(entries), mesh_axes(lead)
    rows = lead[0] if nlead else None
    ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    tail = [None, h] if cfg.gated and backward else [h]
    cols = None if cfg.gated and backward else h
    x_sh, out_sh = ns(*entries), ns(*lead, *tail)
    if cfg.keep_dims:
        row_sh, col_sh, dbias_sh = out_sh, ns(*tail, *lead), ns(*tail)
    else:
        row_sh = ns(rows, cols) if backward else out_sh
        col_sh, dbias_sh = ns(cols, rows), ns(cols)
    outs = [out_sh if cfg.out else ns(None), row_sh if q and cfg.rowwise else ns(None),
            col_sh if q and cfg.colwise else ns(None), ns(None)]
    bias_sh = ns(*entries[nlead:]) if cfg.bias else ns(None)  # x's trailing dims
    if backward:
        outs.append(dbias_sh if cfg.dbias else ns(None))
        args = (ns(*lead, h), x_sh, bias_sh, ns(None))
    else:
        args = (x_sh, bias_sh, ns(None))

    def lower(*operands):
        prim = act_bwd_p if backward else act_fwd_p
        out = list(prim.bind(*operands, **cfg.params(backward)))[:5 if backward else 4]
        if backward:
            out[4] = _dbias_shape(out[4], operands[1], cfg)
        if all_axes:
            out[3] = pmax_nonnegative(out[3], all_axes)
        if backward and cfg.dbias and row_axes:
            out[4] = jax.lax.psum(out[4], row_axes)
        return tuple(out)

    return mesh, lower, tuple(outs), args


def _fwd_local(x, bias, scale, cfg):
    return tuple(act_fwd_p.bind(x, bias, scale, **cfg.params(False)))


def _dbias_shape(dbias, x, cfg):
    """keep_dims: the gated dbias (2H,) as (2, H)."""
    return dbias.reshape(x.shape[-2:]) if cfg.keep_dims and cfg.gated and cfg.dbias else dbias


def _bwd_local(dz, x, bias, scale, cfg):
    out = list(act_bwd_p.bind(dz, x, bias, scale, **cfg.params(True)))[:5]  # without the workspace
    out[4] = _dbias_shape(out[4], x, cfg)
    return tuple(out)


_fwd_partitioned = custom_partitioning(_fwd_local, static_argnums=(3,))
_fwd_partitioned.def_partition(
    partition=named_shardings(lambda cfg, mesh, arg_shapes, result_shape: _partition(cfg, False, mesh, arg_shapes)),
    sharding_rule=lambda cfg, mesh, vt, rt: _rule_parts(
        cfg, len(vt[0].shape) - (2 if cfg.gated else 1), False))
_bwd_partitioned = custom_partitioning(_bwd_local, static_argnums=(4,))
_bwd_partitioned.def_partition(
    partition=named_shardings(lambda cfg, mesh, arg_shapes, result_shape: _partition(cfg, True, mesh, arg_shapes)),
    sharding_rule=lambda cfg, mesh, vt, rt: _rule_parts(cfg, len(vt[0].shape) - 1, True))


# custom_partitioning has no batching rule: under vmap the primitives' own rules run.
@functools.cache
def _op(cfg: _Cfg, backward: bool):
    partitioned, local = (_bwd_partitioned, _bwd_local) if backward else (_fwd_partitioned, _fwd_local)

    @jax.custom_batching.custom_vmap
    def op(*args):
        return partitioned(*args, cfg)

    op.def_vmap(vmap_body(lambda *a: local(*a, cfg)))

    return op


# ---------------------------------------------------------------- public API

def check_act_args(op, x, act_type, gated, limit):
    """The checks every activation op makes of its input and activation arguments."""
    if act_type not in ACT_TYPES:
        raise ValueError(f"{op}: act_type: expected one of {sorted(ACT_TYPES)}, got {act_type!r}")
    if act_type == "clamped_silu" and not gated:
        raise ValueError(f"{op}: act_type: 'clamped_silu' (clamped swiglu) needs gated=True")
    check_high_precision(op, "x", x)
    if gated and (x.ndim < 2 or x.shape[-2] != 2):
        raise ValueError(f"{op}: x: gated activations take shape (..., 2, H), got {x.shape}")
    if not gated and x.ndim < 1:
        raise ValueError(f"{op}: x: expected at least one dimension (H), got a scalar")
    if not (np.isfinite(limit) and limit >= 0):
        raise ValueError(f"{op}: limit: expected a finite value >= 0, got {limit}")


def _config(op, x, act_type, gated, limit, alpha, quant_scale, quant_dtype, rowwise, colwise,
            out, dbias=False, keep_dims=False, bias=None):
    check_act_args(op, x, act_type, gated, limit)
    q_dtype = None
    if quant_scale is not None:
        if jnp.dtype(quant_dtype) not in QUANT_DTYPES:
            raise TypeError(f"{op}: quant_dtype: expected float8_e4m3fn or float8_e5m2, got "
                            f"{quant_dtype}")
        if not (rowwise or colwise):
            raise ValueError(f"{op}: rowwise/colwise: quant_scale given but no copy requested")
        q_dtype = jnp.dtype(quant_dtype).name
    return _Cfg(ACT_TYPES[act_type], bool(gated), float(limit), float(alpha), q_dtype, bool(out),
                bool(rowwise), bool(colwise), bool(dbias), bool(keep_dims), bias is not None)


def _bias_arg(op, x, gated, bias):
    """The bias operand: x's trailing shape and dtype, or an empty (0,) array for none."""
    if bias is None:
        return jnp.zeros((0,), x.dtype)
    bias = jnp.asarray(bias)
    want = x.shape[-2:] if gated else x.shape[-1:]
    if bias.shape != want or bias.dtype != x.dtype:
        raise ValueError(f"{op}: bias: expected {x.dtype} of shape {want} (x's dtype and trailing "
                         f"dims), got {bias.dtype} {bias.shape}")
    return bias


def _scale_arg(op, quant_scale):
    if quant_scale is None:
        return jnp.ones((1,), jnp.float32)
    s = jnp.asarray(quant_scale)
    if s.dtype != jnp.float32 or s.size != 1:
        raise TypeError(f"{op}: quant_scale: expected a float32 scalar or (1,), got {s.dtype} "
                        f"{s.shape}")
    return jax.lax.stop_gradient(s.reshape(1))


def act_forward(x, act_type: str, *, gated=False, limit=7.0, alpha=1.702, quant_scale=None,
                quant_dtype=jnp.float8_e4m3fn, rowwise=True, colwise=False,
                return_y=True, keep_dims=False, bias=None) -> ActForwardOut:
    """y = act(x) (gated: act(x[..., 0, :]) * gate(x[..., 1, :])), optionally fused with an
    FP8 quantization of the fp32 y with `quant_scale` (q_rowwise if `rowwise`, q_colwise
    (H, rows) if `colwise`, (H, ...) with keep_dims, and amax; fields not asked for are None).
    bias: (H,) or, gated, (2, H) in x's dtype, added to x in fp32 first (the module docstring)."""
    x = jnp.asarray(x)
    cfg = _config(_FWD, x, act_type, gated, limit, alpha, quant_scale, quant_dtype, rowwise,
                  colwise, return_y, keep_dims=keep_dims, bias=bias)
    b = _bias_arg(_FWD, x, gated, bias)
    y, qr, qc, amax = _op(cfg, False)(x, b, _scale_arg(_FWD, quant_scale))
    q = cfg.q_dtype is not None
    return ActForwardOut(y if cfg.out else None, qr if q and cfg.rowwise else None,
                         qc if q and cfg.colwise else None, amax if q else None)


def act_backward(dz, x, act_type: str, *, gated=False, limit=7.0, alpha=1.702, quant_scale=None,
                 quant_dtype=jnp.float8_e5m2, rowwise=True, colwise=False, compute_dbias=False,
                 return_dx=True, keep_dims=False, bias=None) -> ActBackwardOut:
    """dx = dz * d act(x) / dx (gated: the gradients of both halves, x's shape), fused with
    dbias (column sums of dx over the rows) and an optional FP8 quantization of the fp32 dx
    (q_rowwise (rows, C), q_colwise (C, rows)); fields not asked for are None.
    keep_dims: nothing flattened, so sharded dims stay sharded: q_rowwise in x's shape,
    q_colwise x's trailing dims ((H,) or (2, H)) then its leading ones, dbias (H,) or (2, H).
    bias: the forward's, added to x in fp32 first: the gradients are those at x + bias."""
    x, dz = jnp.asarray(x), jnp.asarray(dz)
    cfg = _config(_BWD, x, act_type, gated, limit, alpha, quant_scale, quant_dtype, rowwise,
                  colwise, return_dx, compute_dbias, keep_dims, bias)
    b = _bias_arg(_BWD, x, gated, bias)
    want = (*_lead(x, cfg), x.shape[-1])
    if dz.shape != want or dz.dtype != x.dtype:
        raise ValueError(f"{_BWD}: dz: expected {x.dtype} of shape {want}, got {dz.dtype} "
                         f"{dz.shape}")
    dx, qr, qc, amax, dbias = _op(cfg, True)(dz, x, b, _scale_arg(_BWD, quant_scale))
    q = cfg.q_dtype is not None
    return ActBackwardOut(dx if cfg.out else None, qr if q and cfg.rowwise else None,
                          qc if q and cfg.colwise else None, amax if q else None,
                          dbias if cfg.dbias else None)
