"""lowbit.ops.norm_forward / norm_backward: LayerNorm and RMSNorm through lowbit's FFI ops,
with an optional fused FP8 (per-tensor scale) quantization of the output.

x is normalized over its last dimension (hidden, 1..16384); the leading dimensions are
rows. All math is fp32 (csrc/norm/norm.h): mu = mean(x), rsigma = 1/sqrt(var + eps) (RMSNorm:
rsigma = 1/sqrt(mean(x^2) + eps)), y = (x - mu) * rsigma * w + beta with w = gamma or
1 + gamma. The quantized copies are encode_rne(clip(y * scale)) of the fp32 y: q_rowwise in
x's shape, q_colwise transposed to (hidden, *rows); amax = max |y| (fp32, NaN wins).

Sharding (custom_partitioning + Shardy rule): row dimensions pass through; the hidden
dimension must stay whole (gathered when sharded). amax is pmax'ed, dgamma/dbeta psum'ed
over the mesh axes that shard the rows. vmap: an unbatched gamma/beta/scale lets the batch
join the rows (one kernel call); otherwise, and whenever a per-example amax or dgamma is
needed, the batch is mapped with lax.map.

Backward workspace: the CUDA backward needs norm_backward_workspace_bytes(x.dtype, rows,
hidden) bytes of device scratch (fp32 dgamma/dbeta partials). XLA's FFI ScratchAllocator
allocates only at run time, outside XLA's compile-time memory plan (csrc/ffi/gemm_ffi.cc), so,
like XLA's own cuBLAS calls, the lowering of norm_bwd_p adds
one u8 result of that size to the custom call and drops it; the primitive, its batching
and its sharding never see it. The lowering runs on the per-device (partitioned) shapes, so
the workspace is per device. The size is the same on CPU (the CPU handler checks it equals
C++'s NormBackwardWorkspaceBytes, csrc/norm/norm_plan.h, and does not touch it), which
keeps the two formulas in step through the CPU suite.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive, vmap_body
from lowbit.ops._sharding import mesh_axes, named_shardings, pmax_nonnegative, spec_entries
from lowbit.ops.amax import check_high_precision

MAX_HIDDEN = 16384
NORM_TYPES = {"layernorm": 0, "rmsnorm": 1}
QUANT_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_FWD = "lowbit.ops.norm_forward"
_BWD = "lowbit.ops.norm_backward"


class NormForwardOut(NamedTuple):
    y: jax.Array | None  # x's dtype and shape (None with return_y=False)
    mu: jax.Array | None  # f32 x.shape[:-1] (None for RMSNorm)
    rsigma: jax.Array  # f32 x.shape[:-1]
    q_rowwise: jax.Array | None  # fp8, x's shape
    q_colwise: jax.Array | None  # fp8, (hidden, *x.shape[:-1])
    amax: jax.Array | None  # f32 (1,): max |y|


class _Fwd(NamedTuple):
    """Static configuration of one forward call (hashable: a custom_partitioning static)."""

    norm_type: int
    zero_centered_gamma: bool
    epsilon: float
    q_dtype: str | None  # None: no quantization
    return_y: bool
    rowwise: bool
    colwise: bool

    def params(self):
        return dict(norm_type=np.int32(self.norm_type),
                    zero_centered_gamma=np.bool_(self.zero_centered_gamma),
                    epsilon=np.float32(self.epsilon), cfg=self)


class _Bwd(NamedTuple):
    norm_type: int
    zero_centered_gamma: bool

    def params(self):
        return dict(norm_type=np.int32(self.norm_type),
                    zero_centered_gamma=np.bool_(self.zero_centered_gamma), cfg=self)


def _empty(dtype=jnp.float32):
    return jax.core.ShapedArray((0,), dtype)


def _fwd_abstract(x, gamma, beta, scale, *, norm_type, zero_centered_gamma, epsilon, cfg):
    del gamma, beta, scale, zero_centered_gamma, epsilon
    rows = x.shape[:-1]
    q = jnp.dtype(cfg.q_dtype) if cfg.q_dtype else None
    return (
        jax.core.ShapedArray(x.shape, x.dtype) if cfg.return_y else _empty(x.dtype),
        jax.core.ShapedArray(rows, jnp.float32) if norm_type == 0 else _empty(),
        jax.core.ShapedArray(rows, jnp.float32),
        jax.core.ShapedArray(x.shape, q) if q is not None and cfg.rowwise else _empty(jnp.uint8),
        jax.core.ShapedArray((x.shape[-1], *rows), q) if q is not None and cfg.colwise
        else _empty(jnp.uint8),
        jax.core.ShapedArray((1,), jnp.float32) if q is not None else _empty(),
    )


def _bwd_abstract(dz, x, mu, rsigma, gamma, *, norm_type, zero_centered_gamma, cfg):
    del dz, mu, rsigma, zero_centered_gamma, cfg
    return (
        jax.core.ShapedArray(x.shape, x.dtype),
        jax.core.ShapedArray(gamma.shape, gamma.dtype),
        jax.core.ShapedArray(gamma.shape, gamma.dtype) if norm_type == 0 else _empty(gamma.dtype),
    )


_ATTRS = ("norm_type", "zero_centered_gamma", "epsilon")
norm_fwd_p = ffi_primitive("lowbit_norm_forward", "lowbit_norm_forward", _fwd_abstract,
                           multiple_results=True, attrs=_ATTRS)
norm_bwd_p = ffi_primitive("lowbit_norm_backward", "lowbit_norm_backward", _bwd_abstract,
                           multiple_results=True, attrs=_ATTRS[:2])


# ---------------------------------------------------------------- backward workspace
# Mirrors csrc/norm/norm_plan.h (ChooseRowGeometry, NormBwdRowGroups, NormBwdMaxParts,
# NormBackwardWorkspaceBytes); change both together (the CPU handler checks equality).

_BWD_BLOCK_THREADS = 1024  # kNormBwdBlockThreads
_BWD_MAX_BLOCKS = 512  # kNormBwdMaxBlocks


def _threads_per_row(hidden: int, elem_bytes: int, aligned: bool) -> int:
    """ChooseRowGeometry(...).threads_per_row."""
    vec = 16 // elem_bytes
    v = vec if aligned and hidden % vec == 0 else 1
    chunks = -(-hidden // v)
    tpr = 0
    for items in (4, 8, 16):
        if items < v:
            continue
        tpr = (-(-chunks // (items // v)) + 31) // 32 * 32
        if tpr <= 1024:
            break
    return tpr


def norm_backward_workspace_bytes(x_dtype, rows: int, hidden: int) -> int:
    """Bytes of device workspace of the CUDA backward for x (rows x hidden) of `x_dtype`:
    fp32 [2][parts][hidden], parts = min(row tiles, 512 blocks) (one partial row per
    block), the larger of the vectorized and the scalar plan. 0 for an empty or unsupported
    shape."""
    dtype = jnp.dtype(x_dtype)
    if rows <= 0 or not 1 <= hidden <= MAX_HIDDEN or dtype not in (
            jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return 0
    parts = 0
    for aligned in (False, True):
        tpr = _threads_per_row(hidden, dtype.itemsize, aligned)
        groups = 1  # NormBwdRowGroups: <= 8 groups when a group needs a named barrier
        while groups * 2 * tpr <= _BWD_BLOCK_THREADS and (tpr == 32 or groups * 2 <= 8):
            groups *= 2
        tiles = -(-rows // groups)
        parts = max(parts, min(tiles, _BWD_MAX_BLOCKS))
    return 2 * parts * hidden * 4


_bwd_ffi_lowering = jax.ffi.ffi_lowering("lowbit_norm_backward")


def _bwd_lowering(ctx, *args, platform, norm_type, zero_centered_gamma, cfg):
    """Custom call with one more (u8 workspace) result than the primitive; drops it."""
    del cfg
    _ffi.require_platform("lowbit_norm_backward", platform)
    x = ctx.avals_in[1]
    hidden = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    ws = jax.core.ShapedArray((norm_backward_workspace_bytes(x.dtype, rows, hidden),), jnp.uint8)
    outs = _bwd_ffi_lowering(ctx.replace(avals_out=(*ctx.avals_out, ws)), *args,
                             norm_type=norm_type, zero_centered_gamma=zero_centered_gamma)
    assert len(outs) == len(ctx.avals_out) + 1
    return outs[:-1]


for _platform in ("cpu", "cuda"):  # replaces ffi_primitive's generic lowering
    mlir.register_lowering(norm_bwd_p, functools.partial(_bwd_lowering, platform=_platform),
                           platform=_platform)


# ---------------------------------------------------------------- vmap

def _map_batch(prim, args, dims, params):
    """Fallback: one primitive call per batch element (lax.map); outputs batched at 0."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batched = [d is not None for d in dims]
    moved = [jnp.moveaxis(a, d, 0) if b else a for a, d, b in zip(args, dims, batched)]

    def one(slices):
        it = iter(slices)
        full = [next(it) if b else a for a, b in zip(moved, batched)]
        return tuple(prim.bind(*full, **params))

    outs = jax.lax.map(one, [a for a, b in zip(moved, batched) if b])
    assert all(o.shape[0] == size for o in outs)
    return list(outs), [0] * len(outs)


def _fwd_batch(args, dims, **params):
    x, *rest = args
    dx, *rest_dims = dims
    cfg = params["cfg"]
    if dx is None or cfg.q_dtype is not None or any(
            d is not None for d in rest_dims):
        return _map_batch(norm_fwd_p, args, dims, params)
    outs = norm_fwd_p.bind(jnp.moveaxis(x, dx, 0), *rest, **params)
    out_dims = [0 if cfg.return_y else None, 0 if cfg.norm_type == 0 else None, 0, None, None, None]
    return outs, out_dims


def _bwd_batch(args, dims, **params):
    return _map_batch(norm_bwd_p, args, dims, params)


batching.primitive_batchers[norm_fwd_p] = _fwd_batch
batching.primitive_batchers[norm_bwd_p] = _bwd_batch


# ---------------------------------------------------------------- sharding

def _rule(operands, results, **kinds):
    """Shardy rule text from per-tensor factor lists; "h" (hidden) needs replication."""
    def fmt(tensors):
        return ", ".join(" ".join(t) for t in tensors)
    return f"{fmt(operands)} -> {fmt(results)}", {"need_replication_factors": ("h",), **kinds}


def _fwd_local(x, gamma, beta, scale, cfg):
    return tuple(norm_fwd_p.bind(x, gamma, beta, scale, **cfg.params()))


def _fwd_partition(cfg, mesh, arg_shapes, result_shape):
    x_shape = arg_shapes[0]
    rows = spec_entries(x_shape.sharding, x_shape.ndim)[:-1]
    row_axes = mesh_axes(rows)
    ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    x_sh = ns(*rows, None)
    args = (x_sh, ns(None), ns(None), ns(None))
    outs = [x_sh if cfg.return_y else ns(None), ns(*rows) if cfg.norm_type == 0 else ns(None),
            ns(*rows), x_sh if cfg.q_dtype and cfg.rowwise else ns(None),
            ns(None, *rows) if cfg.q_dtype and cfg.colwise else ns(None), ns(None)]

    def lower(x, gamma, beta, scale):
        out = list(_fwd_local(x, gamma, beta, scale, cfg))
        if cfg.q_dtype is not None and row_axes:
            out[5] = pmax_nonnegative(out[5], row_axes)
        return tuple(out)

    return mesh, lower, tuple(outs), args


def _fwd_rule(cfg, mesh, value_types, result_types):
    del mesh, result_types
    n = len(value_types[0].shape)
    b = [f"b{i}" for i in range(n - 1)]
    empty = iter(f"e{i}" for i in range(8))
    one = lambda: [next(empty)]  # noqa: E731  a (0,) or (1,) tensor: its own factor
    q = cfg.q_dtype is not None
    return _rule(
        [b + ["h"], ["h"], ["h"] if cfg.norm_type == 0 else one(), one()],
        [b + ["h"] if cfg.return_y else one(), b if cfg.norm_type == 0 else one(), b,
         b + ["h"] if q and cfg.rowwise else one(), ["h"] + b if q and cfg.colwise else one(),
         one()])


_fwd_partitioned = custom_partitioning(_fwd_local, static_argnums=(4,))
_fwd_partitioned.def_partition(partition=named_shardings(_fwd_partition), sharding_rule=_fwd_rule)


def _bwd_local(dz, x, mu, rsigma, gamma, cfg):
    return tuple(norm_bwd_p.bind(dz, x, mu, rsigma, gamma, **cfg.params()))


def _bwd_partition(cfg, mesh, arg_shapes, result_shape):
    x_shape = arg_shapes[1]
    rows = spec_entries(x_shape.sharding, x_shape.ndim)[:-1]
    row_axes = mesh_axes(rows)
    ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    x_sh = ns(*rows, None)
    mu_sh = ns(*rows) if cfg.norm_type == 0 else ns(None)
    args = (x_sh, x_sh, mu_sh, ns(*rows), ns(None))

    def lower(dz, x, mu, rsigma, gamma):
        dx, dgamma, dbeta = _bwd_local(dz, x, mu, rsigma, gamma, cfg)
        if row_axes:
            dgamma = jax.lax.psum(dgamma, row_axes)
            if cfg.norm_type == 0:
                dbeta = jax.lax.psum(dbeta, row_axes)
        return dx, dgamma, dbeta

    return mesh, lower, (x_sh, ns(None), ns(None)), args


def _bwd_rule(cfg, mesh, value_types, result_types):
    del mesh, result_types
    n = len(value_types[1].shape)
    b = [f"b{i}" for i in range(n - 1)]
    ln = cfg.norm_type == 0
    return _rule([b + ["h"], b + ["h"], b if ln else ["e0"], b, ["h"]],
                 [b + ["h"], ["h"], ["h"] if ln else ["e1"]])


_bwd_partitioned = custom_partitioning(_bwd_local, static_argnums=(5,))
_bwd_partitioned.def_partition(partition=named_shardings(_bwd_partition), sharding_rule=_bwd_rule)


# custom_partitioning has no batching rule: under vmap the primitives' own rules run.
@functools.cache
def _fwd_op(cfg: _Fwd):
    @jax.custom_batching.custom_vmap
    def op(x, gamma, beta, scale):
        return _fwd_partitioned(x, gamma, beta, scale, cfg)

    op.def_vmap(vmap_body(lambda *a: _fwd_local(*a, cfg)))

    return op


@functools.cache
def _bwd_op(cfg: _Bwd):
    @jax.custom_batching.custom_vmap
    def op(dz, x, mu, rsigma, gamma):
        return _bwd_partitioned(dz, x, mu, rsigma, gamma, cfg)

    op.def_vmap(vmap_body(lambda *a: _bwd_local(*a, cfg)))

    return op


# ---------------------------------------------------------------- public API

def canonical_norm_type(norm_type):
    """TE's spellings of a norm type: "LayerNorm", "layer_norm", "RMSNorm", "rms_norm" ...
    become "layernorm" / "rmsnorm" (lowercased, stripped, without "-" and "_"); anything
    else is returned unchanged for the caller's check to name."""
    if isinstance(norm_type, str):
        return norm_type.lower().strip().replace("-", "").replace("_", "")
    return norm_type


def _norm_type(op: str, norm_type) -> int:
    norm_type = canonical_norm_type(norm_type)
    if norm_type not in NORM_TYPES:
        raise ValueError(f"{op}: norm_type: expected 'layernorm' or 'rmsnorm', got {norm_type!r}")
    return NORM_TYPES[norm_type]


def _check_x_gamma(op: str, x, gamma) -> None:
    check_high_precision(op, "x", x)
    if x.ndim == 0:
        raise ValueError(f"{op}: x: expected at least one dimension (hidden), got a scalar")
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"{op}: x: hidden size {hidden} is outside the supported range "
                         f"1..{MAX_HIDDEN}")
    if gamma.shape != (hidden,):
        raise ValueError(f"{op}: gamma: expected shape ({hidden},), got {gamma.shape}")
    if gamma.dtype not in (jnp.dtype(jnp.float32), x.dtype):
        raise TypeError(f"{op}: gamma: expected float32 or x's dtype {x.dtype}, got {gamma.dtype}")


def norm_forward(x, gamma, beta=None, *, norm_type="layernorm", zero_centered_gamma=False,
                 epsilon=1e-6, quant_scale=None, quant_dtype=jnp.float8_e4m3fn, rowwise=True,
                 colwise=False, return_y=True) -> NormForwardOut:
    """LayerNorm/RMSNorm of x over its last axis, optionally fused with an FP8 quantization.

    With `quant_scale` (an f32 scalar or (1,)), q_rowwise (if `rowwise`) and q_colwise (if
    `colwise`, transposed to (hidden, *rows)) hold encode_rne(clip(y * scale)) in
    `quant_dtype` and amax = max |y|; otherwise those fields are None."""
    kind = _norm_type(_FWD, norm_type)
    x, gamma = jnp.asarray(x), jnp.asarray(gamma)
    _check_x_gamma(_FWD, x, gamma)
    if kind == 1 and beta is not None:
        raise ValueError(f"{_FWD}: beta: rmsnorm takes no beta (pass beta=None)")
    if kind == 0:
        if beta is None:
            raise ValueError(f"{_FWD}: beta: layernorm needs beta of shape {gamma.shape}")
        beta = jnp.asarray(beta)
        if beta.shape != gamma.shape or beta.dtype != gamma.dtype:
            raise ValueError(f"{_FWD}: beta: expected gamma's shape {gamma.shape} and dtype "
                             f"{gamma.dtype}, got {beta.shape} {beta.dtype}")
    else:
        beta = jnp.zeros((0,), gamma.dtype)
    eps = float(epsilon)
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"{_FWD}: epsilon: expected a finite value >= 0, got {epsilon}")
    q_dtype = None
    if quant_scale is not None:
        if jnp.dtype(quant_dtype) not in QUANT_DTYPES:
            raise TypeError(f"{_FWD}: quant_dtype: expected float8_e4m3fn or float8_e5m2, "
                            f"got {jnp.dtype(quant_dtype)}")
        if not (rowwise or colwise):
            raise ValueError(f"{_FWD}: rowwise, colwise: quant_scale given but no quantized "
                             "output requested")
        quant_scale = jnp.asarray(quant_scale)
        if quant_scale.size != 1 or quant_scale.dtype != jnp.float32:
            raise ValueError(f"{_FWD}: quant_scale: expected one float32 value, got "
                             f"{quant_scale.shape} {quant_scale.dtype}")
        scale = quant_scale.reshape(1)
        q_dtype = jnp.dtype(quant_dtype).name
    else:
        scale = jnp.zeros((0,), jnp.float32)
    if q_dtype is None and not return_y:
        raise ValueError(f"{_FWD}: return_y: False needs a quantized output (quant_scale)")
    cfg = _Fwd(kind, bool(zero_centered_gamma), eps, q_dtype, bool(return_y), bool(rowwise),
               bool(colwise))
    y, mu, rsigma, q_row, q_col, amax = _fwd_op(cfg)(x, gamma, beta, scale)
    q = q_dtype is not None
    return NormForwardOut(
        y=y if return_y else None,
        mu=mu if kind == 0 else None,
        rsigma=rsigma,
        q_rowwise=q_row if q and rowwise else None,
        q_colwise=q_col if q and colwise else None,
        amax=amax if q else None,
    )


def norm_backward(dz, x, mu, rsigma, gamma, *, norm_type="layernorm",
                  zero_centered_gamma=False):
    """(dx, dgamma, dbeta) of norm_forward's y; dbeta is None for RMSNorm (mu may be None)."""
    kind = _norm_type(_BWD, norm_type)
    dz, x, gamma, rsigma = (jnp.asarray(a) for a in (dz, x, gamma, rsigma))
    _check_x_gamma(_BWD, x, gamma)
    if dz.shape != x.shape or dz.dtype != x.dtype:
        raise ValueError(f"{_BWD}: dz: expected x's shape {x.shape} and dtype {x.dtype}, got "
                         f"{dz.shape} {dz.dtype}")
    rows = x.shape[:-1]
    if rsigma.shape != rows or rsigma.dtype != jnp.float32:
        raise ValueError(f"{_BWD}: rsigma: expected float32 {rows}, got {rsigma.shape} "
                         f"{rsigma.dtype}")
    if kind == 0:
        if mu is None:
            raise ValueError(f"{_BWD}: mu: layernorm needs mu")
        mu = jnp.asarray(mu)
        if mu.shape != rows or mu.dtype != jnp.float32:
            raise ValueError(f"{_BWD}: mu: expected float32 {rows}, got {mu.shape} {mu.dtype}")
    else:
        mu = jnp.zeros((0,), jnp.float32)
    dx, dgamma, dbeta = _bwd_op(_Bwd(kind, bool(zero_centered_gamma)))(dz, x, mu, rsigma, gamma)
    return dx, dgamma, dbeta if kind == 0 else None
