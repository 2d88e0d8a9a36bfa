"""lowbit.ops.act_quantize_block / norm_quantize_block: an activation, or a normalization from
its row statistics, block-quantized in the same pass (FP8 block 1x128, Float8BlockScaling's
activation tiles, or MXFP8), through lowbit's FFI ops lowbit_act_quantize_block /
lowbit_norm_quantize_block (csrc/fused_block/fused_block.h).

x is (..., H), or (..., 2, H) when gated (lowbit.ops.act_forward's act types and layout);
v = act(x) (gated: act(x[..., 0, :]) * gate(x[..., 1, :])) is computed in fp32 and
quantized directly, never rounded to x's dtype first: the codes and scales equal
quantize_fp8_block(v, tile_2d=False) / quantize_mxfp8(v) of the fp32 v, with v's lead dims
as the rows (flatten_axis = len(lead)). Copies (BlockQuantized, as lowbit.ops.quantize_block):
FP8 block: rowwise lead + (H,), colwise (H,) + lead (transposed), f32 scale_inv;
MXFP8: both lead + (H,), E8M0 scales. Only the quantized copies are written (act_forward
gives the high-precision activation).

norm_quantize_block: x (..., H) with gamma (H,) (f32 or x's dtype), beta (LayerNorm, like gamma)
and the statistics norm_forward returns for x (mu for LayerNorm, rsigma; f32 x.shape[:-1]);
v = (x - mu) * rsigma * w (+ beta), w = gamma or 1 + gamma, in fp32 with norm_forward's own
elementwise formula (csrc/norm/norm_math.h), NaN canonical; so with norm_forward's statistics
v is bit for bit norm_forward's fp32 y. Copies as above with lead = x.shape[:-1].
norm_stats: those statistics alone, from a launch of the norm forward with no output but
mu / rsigma (norm_forward itself refuses return_y=False without a quantized output, so this
binds its op directly; same kernel, same sharding rules).

jit: yes. vmap: a loop over the batch (each element quantized on its own, as
lowbit.ops.quantize_block). Sharded jit (Shardy custom partitioning): x's first dim (the
first row dim: tokens under DP / FSDP / SP) stays sharded when every shard holds whole tiles
along the rows and every scale dim that tiles the rows is unpadded
(lowbit.ops._sharding.clean_split: 1x128: R % 4 == 0 per shard for the rowwise scales, whole
128-row tiles for the colwise ones; MXFP8: whole 128-row groups), the scales then sharded
with their data (mu / rsigma with x's rows); every other sharded dim, H included, is
gathered (exact, not parallel).

Off by default in the layer functions: lowbit.activation, layernorm_dense and layernorm_mlp
take this fused path only with LOWBIT_FUSED_BLOCK=1 (fused_block_enabled). On an H100
(16384 x 8192 bf16, bench/results/fused_block_*, kernel time, fused vs the activation / norm
kernel followed by the block quantizer, 2026-11-27: gelu+MXFP8 452 vs 511 us, gelu+FP8 1x128
613 vs 502, layernorm+MXFP8 561 vs 479, layernorm+FP8 1x128 599 vs 468 (the norm rows include
the statistics pass); the day before, with gamma / beta read per element and 2 MXFP8 blocks
an SM: 534, 602, 807 and 786) only gelu+MXFP8 is faster, and MXFP8 has no GEMM on Hopper, so
the default keeps the unfused path. The two paths differ in numerics: the fused one
quantizes the fp32 result, the unfused one the result rounded to x's dtype.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache


def fused_block_enabled() -> bool:
    """LOWBIT_FUSED_BLOCK: "1" routes the layer functions' MXFP8 / FP8 1x128 quantization of
    norm and activation outputs through the fused ops of this module; "0" or unset keeps the
    unfused path (see the preamble for why it is the default). Read at trace time."""
    value = os.environ.get("LOWBIT_FUSED_BLOCK", "0")
    if value not in ("0", "1"):
        raise ValueError(f"lowbit: LOWBIT_FUSED_BLOCK: expected 0 or 1, got {value!r}")
    return value == "1"

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.ops._primitive import ffi_primitive, vmap_body
from lowbit.ops._sharding import (ROWS, SCALE_DIMS, clean_split, compound_sizes, mesh_axes, named_shardings,
                                  spec_entries, tiled_group_rule, transposed_layout)
from lowbit.ops.activation import ACT_TYPES, check_act_args
from lowbit.ops.amax import check_high_precision
from lowbit.ops.quantize import FP8_DTYPES
from lowbit.ops.quantize_block import (E8M0, BlockQuantized, _looped_batcher, _pack, fp8_block_scale_shape,
                                       mxfp8_scale_shape)

_OP = "lowbit.ops.act_quantize_block"


def _empty(dtype):
    return jax.core.ShapedArray((0,), dtype)


def _abstract(x, *, act_type, gated, limit, alpha, mxfp8, pow2_scales, out_dtype, rowwise, colwise):
    del act_type, limit, alpha, pow2_scales
    lead = x.shape[:-2] if gated else x.shape[:-1]
    h = x.shape[-1]
    rows, out = math.prod(lead), (*lead, h)
    if mxfp8:
        shapes = (out, mxfp8_scale_shape(rows, h, False), out, mxfp8_scale_shape(rows, h, True))
        scale_dtype = E8M0
    else:
        shapes = (out, fp8_block_scale_shape(rows, h, False), (h, *lead), fp8_block_scale_shape(h, rows, False))
        scale_dtype = jnp.float32
    wants = (rowwise, rowwise, colwise, colwise)
    dtypes = (out_dtype, scale_dtype, out_dtype, scale_dtype)
    return tuple(jax.core.ShapedArray(s, d) if w else _empty(d) for s, d, w in zip(shapes, dtypes, wants))


# x -> (rowwise | (0,), rowwise_scale | (0,), colwise | (0,), colwise_scale | (0,)).
act_quantize_block_p = ffi_primitive(
    "lowbit_act_quantize_block", "lowbit_act_quantize_block", _abstract, multiple_results=True,
    attrs=("act_type", "gated", "limit", "alpha", "mxfp8", "pow2_scales"),
)
_looped_batcher(act_quantize_block_p)


@lru_cache(maxsize=None)
def _params(act_type: int, gated: bool, limit: float, alpha: float, mxfp8: bool, pow2_scales: bool,
            out_dtype, rowwise: bool, colwise: bool):
    return dict(act_type=np.int32(act_type), gated=np.bool_(gated), limit=np.float32(limit),
                alpha=np.float32(alpha), mxfp8=np.bool_(mxfp8), pow2_scales=np.bool_(pow2_scales),
                out_dtype=out_dtype, rowwise=rowwise, colwise=colwise)


def _copy_layouts(mxfp8: bool, rowwise: bool, colwise: bool):
    """(is_colwise, (group, tile, pad) of scale dims 0 and 1 in the result's R x C terms) of each
    requested copy (an FP8 block colwise copy is stored transposed)."""
    out = []
    if rowwise:
        out.append((False, SCALE_DIMS["mxfp8" if mxfp8 else "1x128"]))
    if colwise:
        out.append((True, SCALE_DIMS["mxfp8_colwise"] if mxfp8 else transposed_layout(SCALE_DIMS["1x128"])))
    return out


@lru_cache(maxsize=None)
def _partitioned(kind: str, params: tuple, n_lead: int, mxfp8: bool, rowwise: bool, colwise: bool):
    """The op on (x,) ("act") or (x, gamma, beta, mu, rsigma) ("norm") -> the requested
    (data, scale) pairs, with its Shardy partitioning (see the module doc)."""
    prim = act_quantize_block_p if kind == "act" else norm_quantize_block_p
    kw = dict(params)

    def local(*operands):
        outs = prim.bind(*operands, **kw)
        return tuple(outs[:2]) * rowwise + tuple(outs[2:]) * colwise

    copies = _copy_layouts(mxfp8, rowwise, colwise)
    if n_lead == 0:  # one row: nothing to keep sharded
        return local

    def keep_rows(mesh, x_shape, x_sharding):
        """The spec entry of x's dim 0 if it may stay sharded, else None."""
        entry = spec_entries(x_sharding, len(x_shape))[0]
        axes = mesh_axes((entry,))
        if not axes:
            return None
        shards = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
        rows = math.prod(x_shape[:n_lead])
        ok = all(clean_split(rows, shards, t, p) for _, layout in copies for g, t, p in layout if g == ROWS)
        return entry if ok else None

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        x = arg_shapes[0]
        keep = keep_rows(mesh, x.shape, x.sharding)
        named = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
        lead = [keep] + [None] * (n_lead - 1)
        args = [named(*lead, *[None] * (x.ndim - n_lead))]
        if kind == "norm":
            mu_sh = named(*lead) if tuple(arg_shapes[3].shape) == tuple(x.shape[:n_lead]) else named(None)
            args += [named(None), named(None), mu_sh, named(*lead)]
        results = []
        for is_col, layout in copies:
            if is_col and not mxfp8:  # (H, lead...)
                results.append(named(None, *lead))
            else:
                results.append(named(*lead, None))
            results.append(named(*[keep if g == ROWS else None for g, _, _ in layout]))
        return mesh, local, tuple(results), tuple(args)

    def rule(mesh, value_types, result_types):
        del mesh, result_types
        shape = value_types[0].shape
        dims = [f"d{i}" for i in range(len(shape))]
        sizes = {}
        scale_exprs = [[None, None] for _ in copies]
        rows = math.prod(shape[:n_lead])
        tiles = [(t, p) for _, layout in copies for g, t, p in layout if g == ROWS]
        expr, ties, got = tiled_group_rule(dims[0], shape[0], rows, tiles)
        sizes.update(got)
        dims[0] = expr
        ties = iter(ties)
        for i, (_, layout) in enumerate(copies):
            for d, (g, _, _) in enumerate(layout):
                if g == ROWS:
                    scale_exprs[i][d] = next(ties)
        lead, h = dims[:n_lead], dims[-1]
        out = []
        for i, (is_col, _) in enumerate(copies):
            out.append(" ".join([h] + lead) if is_col and not mxfp8 else " ".join(lead + [h]))
            out.append(" ".join(e if e is not None else f"s{i}_{d}" for d, e in enumerate(scale_exprs[i])))
        operands = [" ".join(dims)]
        if kind == "norm":
            mu_ok = tuple(value_types[3].shape) == tuple(shape[:n_lead])
            operands += [h, h if tuple(value_types[2].shape) == (shape[-1],) else "e0",
                         " ".join(lead) if mu_ok else "e1", " ".join(lead)]
        text = f"{', '.join(operands)} -> {', '.join(out)}"
        return text, compound_sizes([text], sizes)

    partitioned = custom_partitioning(local)
    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def fn(*operands):
        return partitioned(*operands)

    fn.def_vmap(vmap_body(local))

    return fn


def act_quantize_block(x, act_type: str, *, gated: bool = False, limit: float = 7.0, alpha: float = 1.702,
                       mxfp8: bool = False, out_dtype=jnp.float8_e4m3fn, pow2_scales: bool = False,
                       rowwise: bool = True, colwise: bool = False) -> BlockQuantized:
    """Block-quantized copies of act(x) (see the module doc): FP8 block 1x128 tiles
    (pow2_scales: power-of-two scales), or MXFP8 with mxfp8=True."""
    x = jnp.asarray(x)
    check_act_args(_OP, x, act_type, gated, limit)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FP8_DTYPES:
        raise TypeError(f"{_OP}: out_dtype: expected float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if not (rowwise or colwise):
        raise ValueError(f"{_OP}: rowwise/colwise: neither copy requested")
    if mxfp8 and pow2_scales:
        raise ValueError(f"{_OP}: pow2_scales: MXFP8 scales are powers of two already; pass False")
    params = _params(ACT_TYPES[act_type], bool(gated), float(limit), float(alpha), bool(mxfp8),
                     bool(pow2_scales), out_dtype, bool(rowwise), bool(colwise))
    n_lead = x.ndim - (2 if gated else 1)
    fn = _partitioned("act", tuple(sorted(params.items(), key=lambda kv: kv[0])), n_lead, bool(mxfp8),
                      bool(rowwise), bool(colwise))
    return _pack(fn(x), bool(rowwise), bool(colwise))


_NORM_OP = "lowbit.ops.norm_quantize_block"
_NORM_TYPES = {"layernorm": 0, "rmsnorm": 1}


def _norm_abstract(x, gamma, beta, mu, rsigma, *, norm_type, zero_centered_gamma, mxfp8, pow2_scales, out_dtype,
                   rowwise, colwise):
    del gamma, beta, mu, rsigma, norm_type, zero_centered_gamma
    return _abstract(x, act_type=None, gated=False, limit=None, alpha=None, mxfp8=mxfp8, pow2_scales=pow2_scales,
                     out_dtype=out_dtype, rowwise=rowwise, colwise=colwise)


# (x, gamma, beta | (0,), mu | (0,), rsigma) -> (rowwise, rowwise_scale, colwise, colwise_scale).
norm_quantize_block_p = ffi_primitive(
    "lowbit_norm_quantize_block", "lowbit_norm_quantize_block", _norm_abstract, multiple_results=True,
    attrs=("norm_type", "zero_centered_gamma", "mxfp8", "pow2_scales"),
)
_looped_batcher(norm_quantize_block_p)


def norm_quantize_block(x, gamma, beta, mu, rsigma, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                        mxfp8: bool = False, out_dtype=jnp.float8_e4m3fn, pow2_scales: bool = False,
                        rowwise: bool = True, colwise: bool = False) -> BlockQuantized:
    """Block-quantized copies of the normalization of x from its statistics (see the module
    doc): FP8 block 1x128 tiles, or MXFP8 with mxfp8=True. RMSNorm takes beta=None, mu=None."""
    x, gamma, rsigma = jnp.asarray(x), jnp.asarray(gamma), jnp.asarray(rsigma)
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"{_NORM_OP}: norm_type: expected one of {sorted(_NORM_TYPES)}, got {norm_type!r}")
    check_high_precision(_NORM_OP, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{_NORM_OP}: x: expected at least one dimension (H), got a scalar")
    h, lead = x.shape[-1], x.shape[:-1]
    if gamma.shape != (h,) or gamma.dtype not in (jnp.dtype(jnp.float32), x.dtype):
        raise ValueError(f"{_NORM_OP}: gamma: expected float32 or {x.dtype} of shape ({h},), got {gamma.dtype} "
                         f"{gamma.shape}")
    ln = norm_type == "layernorm"
    if ln:
        if beta is None or mu is None:
            raise ValueError(f"{_NORM_OP}: beta/mu: layernorm needs both")
        beta, mu = jnp.asarray(beta), jnp.asarray(mu)
        if beta.shape != gamma.shape or beta.dtype != gamma.dtype:
            raise ValueError(f"{_NORM_OP}: beta: expected gamma's {gamma.dtype} {gamma.shape}, got {beta.dtype} "
                             f"{beta.shape}")
    elif beta is not None or mu is not None:
        raise ValueError(f"{_NORM_OP}: beta/mu: rmsnorm takes neither (pass None)")
    for name, v in (("mu", mu), ("rsigma", rsigma)):
        if v is not None and (v.shape != lead or v.dtype != jnp.float32):
            raise ValueError(f"{_NORM_OP}: {name}: expected float32 of shape {lead}, got {v.dtype} {v.shape}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FP8_DTYPES:
        raise TypeError(f"{_NORM_OP}: out_dtype: expected float8_e4m3fn or float8_e5m2, got {out_dtype}")
    if not (rowwise or colwise):
        raise ValueError(f"{_NORM_OP}: rowwise/colwise: neither copy requested")
    if mxfp8 and pow2_scales:
        raise ValueError(f"{_NORM_OP}: pow2_scales: MXFP8 scales are powers of two already; pass False")
    empty = jnp.zeros((0,), jnp.float32)
    params = dict(norm_type=np.int32(_NORM_TYPES[norm_type]), zero_centered_gamma=np.bool_(zero_centered_gamma),
                  mxfp8=np.bool_(mxfp8), pow2_scales=np.bool_(pow2_scales), out_dtype=out_dtype,
                  rowwise=bool(rowwise), colwise=bool(colwise))
    fn = _partitioned("norm", tuple(sorted(params.items(), key=lambda kv: kv[0])), x.ndim - 1, bool(mxfp8),
                      bool(rowwise), bool(colwise))
    outs = fn(x, gamma, beta if ln else jnp.zeros((0,), gamma.dtype), mu if ln else empty, rsigma)
    return _pack(outs, bool(rowwise), bool(colwise))


def norm_stats(x, gamma, beta, *, norm_type: str = "layernorm", zero_centered_gamma: bool = False,
               epsilon: float = 1e-6):
    """(mu or None for RMSNorm, rsigma) of x: the norm forward writing neither y nor codes."""
    from lowbit.ops import norm as _norm

    kind = _NORM_TYPES.get(norm_type)
    if kind is None:
        raise ValueError(f"lowbit.ops.norm_stats: norm_type: expected one of {sorted(_NORM_TYPES)}, got {norm_type!r}")
    x, gamma = jnp.asarray(x), jnp.asarray(gamma)
    eps = float(epsilon)
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"lowbit.ops.norm_stats: epsilon: expected a finite value >= 0, got {epsilon}")
    # The public checks of x, gamma and beta (norm_forward's): run them on the full call's
    # arguments without tracing anything heavier than their shapes.
    jax.eval_shape(lambda a, g, b: _norm.norm_forward(a, g, b, norm_type=norm_type, epsilon=eps,
                                                      zero_centered_gamma=zero_centered_gamma), x, gamma, beta)
    beta = jnp.asarray(beta) if kind == 0 else jnp.zeros((0,), gamma.dtype)
    cfg = _norm._Fwd(kind, bool(zero_centered_gamma), eps, None, False, True, False)
    _, mu, rsigma, _, _, _ = _norm._fwd_op(cfg)(x, gamma, beta, jnp.zeros((0,), jnp.float32))
    return (mu if kind == 0 else None), rsigma
