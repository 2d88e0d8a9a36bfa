"""lowbit.ops.softmax_forward / softmax_backward: TE's fused scaled softmax through lowbit's
FFI ops, over the last dim of (batch, heads, q, k) logits, fp32 math, output in the input dtype.

fusion_type: "scaled" softmax(scale * x); "scaled_masked" with a mask broadcastable as
(batch or 1, 1, q, k) of bool/int8/uint8 where a value of 1 (True) masks the logit out: TE
sets it to -10000.0 (not -inf), and a row whose max is exactly -10000 (fully masked) gives
zeros, as TE's kernel does; "scaled_upper_triang" (causal): key index > query index masked,
those outputs exactly 0. Backward: dx = scale * (y * dy - y * sum(y * dy)) from the forward
output y.

Limits: inputs f16/bf16 (f32 too); the CUDA kernel takes k <= 16384 (csrc/softmax/softmax.h).
Beyond that, on every backend, an exact jnp fallback with the same fp32 math (softmax_reference)
is used instead of the FFI op.

Sharding (custom_partitioning + Shardy rule): batch, heads and q pass through (the mask's
batch and q follow the logits'); k must stay whole. vmap: extra batch dims fold into `batch`
when the mask is not batched; otherwise lax.map.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.ops._primitive import ffi_primitive, vmap_body
from lowbit.ops._sharding import named_shardings, spec_entries

FUSION_TYPES = {"scaled": 0, "scaled_masked": 1, "scaled_upper_triang": 2}
CUDA_MAX_K = 16384
MASK_VALUE = -10000.0
_FWD = "lowbit.ops.softmax_forward"
_BWD = "lowbit.ops.softmax_backward"
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


class _Cfg(NamedTuple):
    fusion_type: int
    scale: float

    def params(self):
        return dict(fusion_type=np.int32(self.fusion_type), scale=np.float32(self.scale))


def _fwd_abstract(x, mask, *, fusion_type, scale):
    del mask, fusion_type, scale
    return jax.core.ShapedArray(x.shape, x.dtype)


def _bwd_abstract(dy, y, *, fusion_type, scale):
    del y, fusion_type, scale
    return jax.core.ShapedArray(dy.shape, dy.dtype)


softmax_fwd_p = ffi_primitive("lowbit_softmax_forward", "lowbit_softmax_forward", _fwd_abstract,
                              attrs=("fusion_type", "scale"))
softmax_bwd_p = ffi_primitive("lowbit_softmax_backward", "lowbit_softmax_backward", _bwd_abstract,
                              attrs=("fusion_type", "scale"))


def _fold(a, d):
    """Moves batch dim d to the front and folds it into the first (batch) dim."""
    a = jnp.moveaxis(a, d, 0)
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _fwd_batch(args, dims, **params):
    (x, mask), (dx, dm) = args, dims
    nm = None  # jax marks an unbatched operand with None
    if dx is not nm and dm is nm:
        n = x.shape[dx]
        if mask.ndim == 4 and mask.shape[0] != 1:  # folded batch i * B + b reads mask[b]
            mask = jnp.tile(mask, (n, 1, 1, 1))
        out = softmax_fwd_p.bind(_fold(x, dx), mask, **params)
        return out.reshape(n, out.shape[0] // n, *out.shape[1:]), 0
    size = x.shape[dx] if dx is not nm else mask.shape[dm]
    x = jnp.moveaxis(x, dx, 0) if dx is not nm else jnp.broadcast_to(x, (size, *x.shape))
    mask = jnp.moveaxis(mask, dm, 0) if dm is not nm else jnp.broadcast_to(mask, (size, *mask.shape))
    return jax.lax.map(lambda a: softmax_fwd_p.bind(*a, **params), (x, mask)), 0


def _bwd_batch(args, dims, **params):
    (dy, y), (ddy, dyy) = args, dims
    nm = None  # jax marks an unbatched operand with None
    size = dy.shape[ddy] if ddy is not nm else y.shape[dyy]
    dy = _fold(dy, ddy) if ddy is not nm else jnp.concatenate([dy] * size)
    y = _fold(y, dyy) if dyy is not nm else jnp.concatenate([y] * size)
    out = softmax_bwd_p.bind(dy, y, **params)
    return out.reshape(size, out.shape[0] // size, *out.shape[1:]), 0


batching.primitive_batchers[softmax_fwd_p] = _fwd_batch
batching.primitive_batchers[softmax_bwd_p] = _bwd_batch


# ---------------------------------------------------------------- sharding

def _fwd_local(x, mask, cfg):
    return softmax_fwd_p.bind(x, mask, **cfg.params())


def _bwd_local(dy, y, cfg):
    return softmax_bwd_p.bind(dy, y, **cfg.params())


def _fwd_partition(cfg, mesh, arg_shapes, result_shape):
    x_shape, mask_shape = arg_shapes
    b, h, q, _ = spec_entries(x_shape.sharding, 4)
    ns = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    x_sh = ns(b, h, q, None)
    if mask_shape.ndim == 4:
        mask_sh = ns(b if mask_shape.shape[0] == x_shape.shape[0] else None, None, q, None)
    else:
        mask_sh = ns(None)
    return mesh, lambda x, mask: _fwd_local(x, mask, cfg), x_sh, (x_sh, mask_sh)


def _fwd_rule(cfg, mesh, value_types, result_types):
    x_t, m_t = value_types
    if len(m_t.shape) == 4:
        mb = "b" if m_t.shape[0] == x_t.shape[0] and x_t.shape[0] != 1 else "mb"
        mask = f"{mb} mh q k"
    else:
        mask = "e"
    return f"b h q k, {mask} -> b h q k", {"need_replication_factors": ("k",)}


def _bwd_partition(cfg, mesh, arg_shapes, result_shape):
    b, h, q, _ = spec_entries(arg_shapes[0].sharding, 4)
    x_sh = NamedSharding(mesh, PartitionSpec(b, h, q, None))
    return mesh, lambda dy, y: _bwd_local(dy, y, cfg), x_sh, (x_sh, x_sh)


_fwd_partitioned = custom_partitioning(_fwd_local, static_argnums=(2,))
_fwd_partitioned.def_partition(partition=named_shardings(_fwd_partition), sharding_rule=_fwd_rule)
_bwd_partitioned = custom_partitioning(_bwd_local, static_argnums=(2,))
_bwd_partitioned.def_partition(
    partition=named_shardings(_bwd_partition),
    sharding_rule=lambda cfg, mesh, vt, rt: ("b h q k, b h q k -> b h q k",
                                             {"need_replication_factors": ("k",)}))


@functools.cache
def _op(cfg: _Cfg, backward: bool):
    partitioned, local = (_bwd_partitioned, _bwd_local) if backward else (_fwd_partitioned, _fwd_local)

    @jax.custom_batching.custom_vmap
    def op(a, b):
        return partitioned(a, b, cfg)

    op.def_vmap(vmap_body(lambda u, v: local(u, v, cfg)))

    return op


# ---------------------------------------------------------------- public API

def softmax_reference(logits, mask=None, scale_factor=1.0, fusion_type="scaled"):
    """The same fp32 math in jnp (the fallback beyond the CUDA limits, and the tests' reference)."""
    z = logits.astype(jnp.float32) * jnp.float32(scale_factor)
    if fusion_type == "scaled_masked":
        z = jnp.where(jnp.asarray(mask).astype(jnp.int32) == 1, jnp.float32(MASK_VALUE), z)
    elif fusion_type == "scaled_upper_triang":
        q, k = z.shape[-2:]
        z = jnp.where(jnp.arange(k)[None, :] > jnp.arange(q)[:, None], -jnp.inf, z)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    y = e / jnp.sum(e, axis=-1, keepdims=True)
    if fusion_type == "scaled_masked":
        y = jnp.where(m == MASK_VALUE, 0.0, y)
    return y.astype(logits.dtype)


def softmax_backward_reference(dy, y, scale_factor=1.0):
    g = y.astype(jnp.float32) * dy.astype(jnp.float32)
    s = jnp.sum(g, axis=-1, keepdims=True)
    return (jnp.float32(scale_factor) * (g - y.astype(jnp.float32) * s)).astype(dy.dtype)


def _check(op, arg, x, fusion_type):
    if fusion_type not in FUSION_TYPES:
        raise ValueError(f"{op}: fusion_type: expected one of {list(FUSION_TYPES)}, got "
                         f"{fusion_type!r}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: {arg}: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim != 4:
        raise ValueError(f"{op}: {arg}: expected shape (batch, heads, q, k), got {x.shape}")


def softmax_forward(logits, mask=None, scale_factor=1.0, fusion_type="scaled"):
    """TE's fused softmax of scale_factor * logits over the last dim (see the module doc)."""
    x = jnp.asarray(logits)
    _check(_FWD, "logits", x, fusion_type)
    bsz, _, q, k = x.shape
    if fusion_type == "scaled_masked":
        if mask is None:
            raise ValueError(f"{_FWD}: mask: scaled_masked needs a mask")
        mask = jnp.asarray(mask)
        if mask.dtype not in (jnp.dtype(jnp.bool_), jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
            raise TypeError(f"{_FWD}: mask: expected bool, int8 or uint8, got {mask.dtype}")
        if mask.ndim != 4 or mask.shape[0] not in (1, bsz) or mask.shape[1:] != (1, q, k):
            raise ValueError(f"{_FWD}: mask: expected shape ({bsz} or 1, 1, {q}, {k}), got "
                             f"{mask.shape}")
    else:
        if mask is not None:
            raise ValueError(f"{_FWD}: mask: only fusion_type='scaled_masked' takes a mask")
        mask = jnp.zeros((0,), jnp.uint8)
    if k > CUDA_MAX_K:
        return softmax_reference(x, mask, scale_factor, fusion_type)
    return _op(_Cfg(FUSION_TYPES[fusion_type], float(scale_factor)), False)(x, mask)


def softmax_backward(dy, y, scale_factor=1.0, fusion_type="scaled"):
    """dx = scale * (y * dy - y * sum(y * dy)) from the forward output y (masks are implied by
    y's zeros)."""
    dy, y = jnp.asarray(dy), jnp.asarray(y)
    _check(_BWD, "dy", dy, fusion_type)
    if y.shape != dy.shape or y.dtype != dy.dtype:
        raise ValueError(f"{_BWD}: y: expected dy's {dy.dtype} {dy.shape}, got {y.dtype} {y.shape}")
    if dy.shape[-1] > CUDA_MAX_K:
        return softmax_backward_reference(dy, y, scale_factor)
    return _op(_Cfg(FUSION_TYPES[fusion_type], float(scale_factor)), True)(dy, y)
