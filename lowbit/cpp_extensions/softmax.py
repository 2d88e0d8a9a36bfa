"""lowbit.cpp_extensions.softmax: TE's import path
(transformer_engine.jax.cpp_extensions.softmax) over lowbit's fused softmax.

No numerics live here. Softmax is over the last axis of scale_factor * logits, logits being
(..., heads, q_seqlen, k_seqlen) as in TE's kernels (the leading dims fold into one batch dim;
the masked forward needs at least one). Outputs have logits' (dz's) dtype and shape.
- scaled_softmax_fwd(logits, scale_factor), scaled_masked_softmax_fwd(logits, mask,
  scale_factor), scaled_upper_triang_masked_softmax_fwd(logits, scale_factor):
  lowbit.ops.softmax_forward with fusion_type "scaled", "scaled_masked",
  "scaled_upper_triang" (fp32 math). mask is (..., 1, q, k), its leading dims folding to 1 or
  to logits' batch; TE's convention: an entry equal to 1 (True) masks the logit out, any other
  value keeps it; a masked logit becomes -10000 (not -inf), and a row whose max is then
  -10000 (fully masked) gives zeros. Causal: key index > query index masked, output exactly 0.
- scaled_softmax_bwd(dz, softmax_out, logits, scale_factor), scaled_masked_softmax_bwd(dz,
  softmax_out, logits, mask, scale_factor), scaled_upper_triang_masked_softmax_bwd(dz,
  softmax_out, logits, scale_factor): lowbit.ops.softmax_backward, dx = scale_factor * (y * dz
  - y * sum(y * dz)) from y = softmax_out. logits and mask are TE's signature and unused, as
  in TE's kernel path (the mask is implied by softmax_out's zeros).
- jax_scaled_softmax, jax_scaled_masked_softmax, jax_scaled_upper_triang_masked_softmax and
  jax_general_softmax (public in TE's module, not in its __all__): TE's pure-JAX path, here
  lowbit.ops.softmax.softmax_reference, the same fp32 math in jnp, differentiable by JAX
  autodiff. jax_scaled_masked_softmax takes any mask broadcastable to logits (or None), with
  TE's test `mask != 1` for "kept".
- is_softmax_kernel_available: TE's shape/dtype rule for its CUDA kernels, in pure Python.

Scale: TE's forward kernels take scale_factor in the logits' dtype (f16/bf16: rounded before
the fp32 math), its backward in fp32; the shims hand lowbit's ops the same values. The jax_*
functions round it to the logits' dtype too, as TE's `scale_factor * logits` does.

Differences from TE, all other documented TE behaviour kept:
- The fused functions always run lowbit's op (TE's functions fall back to its jax_* path when
  NVTE_JAX_CUSTOM_CALLS disables the primitive; lowbit has no such switch).
- They accept more than TE's kernels: f32 logits, bool or int8 masks (TE: uint8), q_seqlen 1,
  k_seqlen > 16384 (lowbit's exact jnp fallback), q_seqlen != k_seqlen for the causal softmax
  (top-left aligned, as TE's jax_scaled_upper_triang_masked_softmax; TE's kernel asserts
  equality), and the shapes TE's kernels reject. is_softmax_kernel_available still answers
  TE's rule, so ported code takes TE's branches. It also takes the strings lowbit.softmax
  takes for the fusion type and "vanilla" for AttnSoftmaxType.VANILLA_SOFTMAX.
- A mask whose leading dims fold to neither 1 nor logits' batch is an error (TE's abstract
  compares that size with itself and its kernel then reads the wrong rows).
- jax_*: fp32 math, rounded once to the logits' dtype (TE computes in the logits' dtype, so
  f16/bf16 results differ by a few units in the last place); f32, f16 and bf16 logits only.
  Masked logits become -10000, as in TE's kernel, where TE's jax path drops them: the results
  agree unless a row's largest unmasked scaled logit is below about -9896 (where
  exp(-10000 - max) stops underflowing to 0 in fp32).
- softmax_offset (TE's off-by-one and learnable softmax), jax_general_softmax's offset, and
  its initial other than -inf: NotImplementedError naming the function and the argument;
  lowbit has the vanilla softmax only.
"""

from __future__ import annotations

import math
import operator

import jax.numpy as jnp
import numpy as np

from lowbit.cpp_extensions._common import named_errors
from lowbit.ops.softmax import (CUDA_MAX_K, FUSION_TYPES, softmax_backward, softmax_forward,
                                softmax_reference)
from lowbit.softmax import AttnSoftmaxType, SoftmaxFusionType

__all__ = [
    "scaled_softmax_fwd",
    "scaled_softmax_bwd",
    "scaled_masked_softmax_fwd",
    "scaled_masked_softmax_bwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "scaled_upper_triang_masked_softmax_bwd",
    "is_softmax_kernel_available",
    "jax_scaled_softmax",
    "jax_scaled_masked_softmax",
    "jax_scaled_upper_triang_masked_softmax",
]

_OP = "lowbit.cpp_extensions.{}"
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_HALF = _FLOATS[1:]
_KERNEL_MASK_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.bool_), jnp.dtype(jnp.int8))


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"an array of shape {tuple(shape)}" if shape is not None else repr(value)


def _check_float(op: str, name: str, a):
    if a.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name}: expected float32, float16 or bfloat16, got {a.dtype}")


def _no_offset(op: str, name: str, offset):
    if offset is not None:
        raise NotImplementedError(f"{op}: {name}: lowbit has the vanilla softmax only (no "
                                  f"off-by-one or learnable offset); pass None, got "
                                  f"{_describe(offset)}")


def _static_scale(op: str, scale_factor) -> float:
    try:
        return float(scale_factor)
    except (TypeError, ValueError):  # a tracer's ConcretizationTypeError is a TypeError
        raise TypeError(f"{op}: scale_factor: expected a static float, as TE's kernels take "
                        f"it, got {_describe(scale_factor)}") from None


def _as_4d(op: str, name: str, a, min_ndim: int):
    """a as (batch, heads, q, k): TE's kernels fold the dims before the last three."""
    if a.ndim < min_ndim:
        lead = "batch..., " if min_ndim == 4 else "..., "
        raise ValueError(f"{op}: {name}: expected shape ({lead}heads, q_seqlen, k_seqlen), "
                         f"at least {min_ndim} dims, got {a.shape}")
    return a if a.ndim == 4 else a.reshape(math.prod(a.shape[:-3]), *a.shape[-3:])


def _kernel_mask(op: str, mask, x):
    """mask as (1 or batch, 1, q, k) for lowbit's op, x being the (..., heads, q, k) logits."""
    if mask is None:
        raise ValueError(f"{op}: mask: the masked softmax needs a mask, got None")
    m = jnp.asarray(mask)
    if m.dtype not in _KERNEL_MASK_DTYPES:
        raise TypeError(f"{op}: mask: expected uint8 (TE's), bool or int8, got {m.dtype}")
    batch, (q, k) = math.prod(x.shape[:-3]), x.shape[-2:]
    mask_batch = math.prod(m.shape[:-3])
    if m.ndim < 4 or m.shape[-3:] != (1, q, k) or mask_batch not in (1, batch):
        raise ValueError(f"{op}: mask: expected shape (..., 1, {q}, {k}) whose leading dims "
                         f"multiply to 1 or to logits' batch {batch} (logits {x.shape}), got "
                         f"{m.shape}")
    return m.reshape(mask_batch, 1, q, k)


def _forward(name, logits, mask, scale_factor, fusion):
    op = _OP.format(name)
    x = jnp.asarray(logits)
    _check_float(op, "logits", x)
    x4 = _as_4d(op, "logits", x, 4 if fusion == "scaled_masked" else 3)
    if fusion == "scaled_masked":
        mask = _kernel_mask(op, mask, x)
    scale = _static_scale(op, scale_factor)
    if x.dtype in _HALF:  # TE's forward kernels take the scale as an input_t
        scale = float(np.asarray(scale, x.dtype))
    with named_errors(op):
        return softmax_forward(x4, mask, scale, fusion).reshape(x.shape)


def _backward(name, dz, softmax_out, scale_factor, fusion):
    op = _OP.format(name)
    dz, y = jnp.asarray(dz), jnp.asarray(softmax_out)
    _check_float(op, "dz", dz)
    if y.dtype != dz.dtype:
        raise TypeError(f"{op}: softmax_out: expected dz's dtype {dz.dtype}, got {y.dtype}")
    if y.shape != dz.shape:
        raise ValueError(f"{op}: softmax_out: expected dz's shape {dz.shape}, got {y.shape}")
    dz4 = _as_4d(op, "dz", dz, 3)
    scale = _static_scale(op, scale_factor)
    with named_errors(op):
        return softmax_backward(dz4, y.reshape(dz4.shape), scale, fusion).reshape(dz.shape)


def scaled_softmax_fwd(logits, scale_factor):
    """softmax(scale_factor * logits) over the last axis, in logits' dtype."""
    return _forward("scaled_softmax_fwd", logits, None, scale_factor, "scaled")


def scaled_softmax_bwd(dz, softmax_out, logits, scale_factor):
    """The logits gradient of scaled_softmax_fwd from its output (logits: unused)."""
    del logits  # TE's signature; its kernel reads softmax_out
    return _backward("scaled_softmax_bwd", dz, softmax_out, scale_factor, "scaled")


def scaled_masked_softmax_fwd(logits, mask, scale_factor):
    """scaled_softmax_fwd with the logits where mask == 1 masked out (fully masked rows: 0)."""
    return _forward("scaled_masked_softmax_fwd", logits, mask, scale_factor, "scaled_masked")


def scaled_masked_softmax_bwd(dz, softmax_out, logits, mask, scale_factor):
    """The logits gradient of scaled_masked_softmax_fwd from its output (logits, mask: unused)."""
    del logits, mask  # TE's signature; its kernel reads softmax_out
    return _backward("scaled_masked_softmax_bwd", dz, softmax_out, scale_factor, "scaled_masked")


def scaled_upper_triang_masked_softmax_fwd(logits, scale_factor):
    """Causal scaled_softmax_fwd: key index > query index masked out."""
    return _forward("scaled_upper_triang_masked_softmax_fwd", logits, None, scale_factor,
                    "scaled_upper_triang")


def scaled_upper_triang_masked_softmax_bwd(dz, softmax_out, logits, scale_factor):
    """The logits gradient of scaled_upper_triang_masked_softmax_fwd from its output."""
    del logits  # TE's signature; its kernel reads softmax_out
    return _backward("scaled_upper_triang_masked_softmax_bwd", dz, softmax_out, scale_factor,
                     "scaled_upper_triang")


# ---------------------------------------------------------------- TE's pure-JAX path

def _reference(name, logits, mask, scale_factor, fusion, softmax_offset):
    op = _OP.format(name)
    _no_offset(op, "softmax_offset", softmax_offset)
    x = jnp.asarray(logits)
    _check_float(op, "logits", x)
    if x.ndim < (2 if fusion == "scaled_upper_triang" else 1):
        raise ValueError(f"{op}: logits: expected at least "
                         f"{2 if fusion == 'scaled_upper_triang' else 1} dims, got {x.shape}")
    if mask is not None:
        m = jnp.asarray(mask)
        try:
            fits = np.broadcast_shapes(m.shape, x.shape) == x.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"{op}: mask: expected a shape broadcastable to logits' {x.shape}, "
                             f"got {m.shape}")
        mask, fusion = m == 1, "scaled_masked"  # TE: where=mask != 1
    scale = jnp.asarray(scale_factor, x.dtype)  # as TE's `scale_factor * logits` rounds it
    with named_errors(op):
        return softmax_reference(x, mask, scale, fusion)


def jax_scaled_softmax(logits, scale_factor, softmax_offset=None):
    """softmax(scale_factor * logits) over the last axis, in jnp."""
    return _reference("jax_scaled_softmax", logits, None, scale_factor, "scaled", softmax_offset)


def jax_scaled_masked_softmax(logits, mask, scale_factor, softmax_offset=None):
    """jax_scaled_softmax with the logits where mask == 1 masked out (mask None: none)."""
    return _reference("jax_scaled_masked_softmax", logits, mask, scale_factor, "scaled",
                      softmax_offset)


def jax_scaled_upper_triang_masked_softmax(logits, scale_factor, softmax_offset=None):
    """Causal jax_scaled_softmax: key index > query index masked out."""
    return _reference("jax_scaled_upper_triang_masked_softmax", logits, None, scale_factor,
                      "scaled_upper_triang", softmax_offset)


def jax_general_softmax(x, axis=-1, where=None, initial=-jnp.inf, offset=None):
    """softmax of x over `axis` where `where` is true (elsewhere 0), in jnp."""
    op = _OP.format("jax_general_softmax")
    _no_offset(op, "offset", offset)
    try:
        default_initial = float(initial) == -math.inf
    except (TypeError, ValueError):
        default_initial = False
    if not default_initial:
        raise NotImplementedError(f"{op}: initial: only TE's default -inf is supported, got "
                                  f"{_describe(initial)}")
    x = jnp.asarray(x)
    _check_float(op, "x", x)
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op}: axis: expected an int in [{-x.ndim}, {x.ndim}), got {axis!r}")
    mask = None
    if where is not None:
        w = jnp.asarray(where)
        try:
            w = jnp.broadcast_to(w, x.shape)
        except ValueError:
            raise ValueError(f"{op}: where: expected a shape broadcastable to x's {x.shape}, "
                             f"got {w.shape}") from None
        mask = jnp.moveaxis(jnp.logical_not(w), axis, -1)
    with named_errors(op):
        y = softmax_reference(jnp.moveaxis(x, axis, -1), mask, 1.0,
                              "scaled" if mask is None else "scaled_masked")
    return jnp.moveaxis(y, -1, axis)


# ---------------------------------------------------------------- TE's kernel rule

# TE's softmax kernels: 128 threads a block; a warp of min(next_pow2(k), 32) threads does
# 2 rows when next_pow2(k) <= 128, else 1 (TE's SoftmaxPrimitive.get_batch_per_block).
_THREADS_PER_BLOCK, _THREADS_PER_WARP = 128, 32


def _rows_per_block(k_seqlen: int) -> int:
    pow2 = 1 << (k_seqlen - 1).bit_length()
    warp_size = min(pow2, _THREADS_PER_WARP)
    return (_THREADS_PER_BLOCK // warp_size) * (2 if pow2 <= 128 else 1)


def _fusion_name(op: str, softmax_fusion_type) -> str:
    name = softmax_fusion_type
    if isinstance(name, SoftmaxFusionType):
        name = name.value
    if name == "scaled_upper_triang_masked":  # TE's enum value
        name = "scaled_upper_triang"
    if not isinstance(name, str) or name not in FUSION_TYPES:
        raise NotImplementedError(f"{op}: softmax_fusion_type: expected a lowbit "
                                  f"SoftmaxFusionType or one of {list(FUSION_TYPES)}, got "
                                  f"{softmax_fusion_type!r}")
    return name


def is_softmax_kernel_available(softmax_fusion_type, softmax_type, batch, heads, q_seqlen,
                                k_seqlen, dtype) -> bool:
    """TE's rule for its fused kernels: vanilla softmax, f16/bf16, 16 <= k_seqlen <= 16384,
    q_seqlen and batch * heads multiples of 4, and q_seqlen (causal: batch * heads, and
    q_seqlen == k_seqlen) a multiple of the rows a CUDA block does. lowbit's ops run every
    shape; this tells ported code which branch TE would take."""
    op = _OP.format("is_softmax_kernel_available")
    if softmax_type not in (AttnSoftmaxType.VANILLA_SOFTMAX, "vanilla"):
        return False
    fusion = _fusion_name(op, softmax_fusion_type)
    sizes = {}
    for arg, value in (("batch", batch), ("heads", heads), ("q_seqlen", q_seqlen),
                       ("k_seqlen", k_seqlen)):
        try:
            sizes[arg] = operator.index(value)
        except TypeError:
            raise TypeError(f"{op}: {arg}: expected an int, got {value!r}") from None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{op}: dtype: expected a dtype, got {dtype!r}") from None
    attn_batches, q, k = sizes["batch"] * sizes["heads"], sizes["q_seqlen"], sizes["k_seqlen"]
    if (dtype not in _HALF or not 16 <= k <= CUDA_MAX_K or q % 4 != 0
            or attn_batches % 4 != 0):
        return False
    if fusion == "scaled_upper_triang":
        return k == q and attn_batches % _rows_per_block(k) == 0
    return q % _rows_per_block(k) == 0
