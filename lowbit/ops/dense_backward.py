"""lowbit.ops.dense_backward_fp8: the backward of a per-tensor FP8 dense layer as one op
(lowbit_dense_backward_fp8, csrc/dense/dense_backward.h) that keeps dy's two FP8 copies inside
its dk output until the wgrad overwrites them, so the step holds no separate buffers for them:

    dy (m, n) -> rowwise + colwise FP8 copies (scale dy_scale), amax, dbias (optional)
    dx (m, k) = gemm(dy rowwise, k_row)     k_row (k, n): the kernel's saved rowwise copy
    dk (k, n) = gemm(x_col, dy colwise)     x_col (k, m): x's saved colwise copy

Values: those of lowbit_quantize_fp8 and of lowbit_gemm, each GEMM with split accumulation
unless dgrad_split / wgrad_split say fast (lowbit.dense passes its quantizer set's
GemmAccumulation); on the CPU bit for bit the unfused ops'; on CUDA the wgrad runs as S column
slices, each a cuBLASLt GEMM of its own. `dense_backward_plan` says whether a placement exists
for the sizes (through the C++ planner, MakeDenseBwdPlan) and how much scratch it needs: one colwise slice of dy
(n / S x m bytes), on CUDA behind the 32 MiB cuBLASLt workspace (the lowering adds the
scratch as the custom call's last result, as lowbit.ops.gemm does its workspace).

Sharding (`dense_backward_fp8_sharded`, custom_partitioning + Shardy rule): factors m (dy's
rows, x_col's columns), n (dy's and k_row's columns) and k (x_col's and k_row's rows), each
mesh axis on one of them (m first, then n, then k; the operands are resharded to agree).
Every device runs the op on its blocks, then
  dx (m, k): psum over n's axes (the dgrad contracts n),
  dk (k, n): psum over m's axes (the wgrad contracts m),
  dbias (n,): computed in fp32 and psum'ed over m's axes, then rounded to dy's dtype,
  amax: max over m's and n's axes,
the GEMM psums in their output dtype, as lowbit.ops.gemm's default (LOWBIT_GEMM_PSUM=out)
does, so that the values equal the unfused sharded ops' (quantize_fp8, two gemm calls).
Where no placement fits a device's blocks, that device runs those unfused ops' primitives
instead (the same values). vmap maps the unpartitioned op.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from lowbit import _ffi
from lowbit.ops import gemm as gemm_mod
from lowbit.ops._primitive import ffi_primitive, vmap_body
from lowbit.ops._sharding import axes_entry, mesh_axes, named_shardings, pmax_nonnegative, spec_entries
from lowbit.ops.amax import check_high_precision
from lowbit.ops.quantize import FP8_DTYPES, quantize_fp8_p

__all__ = ["dense_backward_fp8", "dense_backward_fp8_sharded", "dense_backward_plan"]

# lowbit::DType codes of the FP8 dtypes (csrc/common/dtype.h), the q_dtype attribute.
_DTYPE_CODES = {jnp.dtype(jnp.float8_e4m3fn): 4, jnp.dtype(jnp.float8_e5m2): 5}


def _q_code(q_dtype) -> int:
    """The q_dtype attribute of an FP8 dtype, or a ValueError naming the argument."""
    q_dtype = jnp.dtype(q_dtype)
    if q_dtype not in _DTYPE_CODES:
        raise ValueError(f"lowbit.ops.dense_backward_fp8: q_dtype: expected float8_e4m3fn or float8_e5m2, got {q_dtype}")
    return _DTYPE_CODES[q_dtype]


@lru_cache(maxsize=None)
def dense_backward_plan(m: int, n: int, k: int, dk_dtype, dx_dtype, dbias: bool,
                        cuda: bool = True) -> tuple[int, int] | None:
    """(slices S, scratch bytes on CUDA, or on the CPU with cuda=False) of the placement for
    dy (m, n), dk (k, n), dx (m, k), or None when none fits (lowbit.dense then runs the
    unfused ops)."""
    fn = _ffi.cpu_library().LowbitDenseBackwardPlan
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                          ctypes.POINTER(ctypes.c_int64)]
    slices, scratch = ctypes.c_int32(0), ctypes.c_int64(0)
    rc = fn(m, n, k, jnp.dtype(dk_dtype).itemsize, jnp.dtype(dx_dtype).itemsize, int(dbias), int(cuda),
            ctypes.byref(slices), ctypes.byref(scratch))
    return (int(slices.value), int(scratch.value)) if rc == 0 else None


def _abstract(dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, *, q_dtype, dx_dtype,
              dk_dtype, dbias, dbias_dtype=None, dgrad_algo=0, wgrad_algo=0, dgrad_split=True,
              wgrad_split=True, dgrad_algo_or_first=False, wgrad_algo_or_first=False):
    del dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, q_dtype, dgrad_algo, wgrad_algo, dgrad_split, wgrad_split
    del dgrad_algo_or_first, wgrad_algo_or_first
    (m, n), k = dy.shape, x_col.shape[0]
    return (
        jax.core.ShapedArray((m, k), dx_dtype),
        jax.core.ShapedArray((k, n), dk_dtype),
        jax.core.ShapedArray((n,) if dbias else (0,), dbias_dtype or dy.dtype),
        jax.core.ShapedArray((1,), jnp.float32),
    )


# (dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv) ->
# (dx, dk, dbias | (0,), amax (1,)); dbias in dy's dtype or, with dbias_dtype=f32, in fp32 (the
# FFI handler takes either from the result's type); the custom call's fifth result, the
# scratch (u8), is added by the lowering rules below.
dense_backward_fp8_p = ffi_primitive(
    "lowbit_dense_backward_fp8",
    "lowbit_dense_backward_fp8",
    _abstract,
    multiple_results=True,
    attrs=("q_dtype", "dgrad_algo", "wgrad_algo", "dgrad_split", "wgrad_split", "dgrad_algo_or_first",
           "wgrad_algo_or_first"),
)
_ffi_lowering = jax.ffi.ffi_lowering("lowbit_dense_backward_fp8")


def _lowering(ctx, *args, platform, q_dtype, dx_dtype, dk_dtype, dbias, dbias_dtype=None, dgrad_algo=0,
              wgrad_algo=0, dgrad_split=True, wgrad_split=True, dgrad_algo_or_first=False,
              wgrad_algo_or_first=False):
    _ffi.require_platform("lowbit_dense_backward_fp8", platform)
    dy, x_col = ctx.avals_in[:2]
    (m, n), k = dy.shape, x_col.shape[0]
    plan = dense_backward_plan(m, n, k, dk_dtype, dx_dtype, dbias, cuda=platform == "cuda")
    if plan is None:
        raise ValueError(f"lowbit.ops.dense_backward_fp8: dy {dy.shape}, x_col {x_col.shape}: no placement of "
                         "dy's copies fits dk (csrc/dense/dense_backward.h)")
    scratch = jax.core.ShapedArray((plan[1],), jnp.uint8)
    return _ffi_lowering(ctx.replace(avals_out=[*ctx.avals_out, scratch]), *args, q_dtype=q_dtype,
                         dgrad_algo=np.int32(dgrad_algo), wgrad_algo=np.int32(wgrad_algo),
                         dgrad_split=bool(dgrad_split), wgrad_split=bool(wgrad_split),
                         dgrad_algo_or_first=bool(dgrad_algo_or_first),
                         wgrad_algo_or_first=bool(wgrad_algo_or_first))[:4]


def _gemm_attrs(q_dtype, x_dtype, dx_dtype, dk_dtype, dgrad_split: bool, wgrad_split: bool,
                fused: bool = True) -> dict:
    """The dgrad's and the wgrad's accumulation and cuBLASLt heuristic indices: LOWBIT_GEMM_ALGO
    or DEFAULT_ALGO, by accumulation and output dtype as the unfused ops' GEMMs resolve them,
    except the fused op's GEMMs at split accumulation, which have kinds of their own:
    fused_dgrad (dy's rowwise copy at dk's row pitch, batched over its segments: cuBLASLt
    ranks its algorithms apart from the standalone dgrad's) and fused_wgrad (dy's colwise
    slices, each launch writing dk's columns at dk's pitch). An index from DEFAULT_ALGO (not
    the user's) falls back to cuBLASLt's first choice on a problem with no such entry
    (*_algo_or_first)."""
    tensor = gemm_mod.GemmScaleMode.TENSOR
    dgrad_kind = ("fused_dgrad" if dgrad_split and fused
                  else gemm_mod.algo_kind(q_dtype, tensor, dgrad_split, dx_dtype))
    wgrad_kind = ("fused_wgrad" if wgrad_split and fused
                  else gemm_mod.algo_kind(x_dtype, tensor, wgrad_split, dk_dtype))
    dgrad_algo, dgrad_first = gemm_mod.kind_algo(dgrad_kind)
    wgrad_algo, wgrad_first = gemm_mod.kind_algo(wgrad_kind)
    return dict(dgrad_algo=np.int32(dgrad_algo), wgrad_algo=np.int32(wgrad_algo),
                dgrad_split=bool(dgrad_split), wgrad_split=bool(wgrad_split),
                dgrad_algo_or_first=dgrad_first, wgrad_algo_or_first=wgrad_first)


for _platform in ("cpu", "cuda"):
    mlir.register_lowering(dense_backward_fp8_p, partial(_lowering, platform=_platform), platform=_platform)


def _batch(args, dims, **params):
    # One call per batch element (each has its own amax and dbias).
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    front = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    outs = jax.lax.map(lambda xs: tuple(dense_backward_fp8_p.bind(*xs, **params)), tuple(front))
    return list(outs), [0] * len(outs)


batching.primitive_batchers[dense_backward_fp8_p] = _batch


def dense_backward_fp8(dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, *, q_dtype,
                       dx_dtype, dk_dtype, compute_dbias: bool, dgrad_split: bool = True,
                       wgrad_split: bool = True):
    """(dx (m, k), dk (k, n), dbias (n,) in dy's dtype or None, dy's amax (1,)) from dy (m, n)
    f32/f16/bf16, x_col (k, m) and k_row (k, n) FP8 and the four f32 (1,) scales; dy's copies
    are `q_dtype`; dgrad_split / wgrad_split: each GEMM's accumulation (lowbit.ops.gemm's
    use_split_accumulator). Raises ValueError when no placement fits (dense_backward_plan)."""
    op = "lowbit.ops.dense_backward_fp8"
    dy, x_col, k_row = jnp.asarray(dy), jnp.asarray(x_col), jnp.asarray(k_row)
    for arg, a in (("dy", dy), ("x_col", x_col), ("k_row", k_row)):
        if a.ndim != 2:
            raise ValueError(f"{op}: {arg}: expected a 2-D array, got shape {tuple(a.shape)}")
    check_high_precision(op, "dy", dy)
    for arg, a in (("x_col", x_col), ("k_row", k_row)):
        if a.dtype not in FP8_DTYPES:
            raise TypeError(f"{op}: {arg}: expected float8_e4m3fn or float8_e5m2, got {a.dtype}")
    (m, n), k = dy.shape, x_col.shape[0]
    if x_col.shape != (k, m) or k_row.shape != (k, n):
        raise ValueError(f"{op}: x_col, k_row: expected shapes (k, {m}) and (k, {n}) with one k for dy "
                         f"{tuple(dy.shape)}, got {tuple(x_col.shape)} and {tuple(k_row.shape)}")
    if dense_backward_plan(m, n, k, dk_dtype, dx_dtype, compute_dbias) is None:
        raise ValueError(f"lowbit.ops.dense_backward_fp8: dy {dy.shape}, x_col {x_col.shape}: no placement of "
                         "dy's copies fits dk (csrc/dense/dense_backward.h)")
    dx, dk, dbias, amax = dense_backward_fp8_p.bind(
        dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv,
        q_dtype=np.int32(_q_code(q_dtype)), dx_dtype=jnp.dtype(dx_dtype), dk_dtype=jnp.dtype(dk_dtype),
        dbias=compute_dbias, **_gemm_attrs(q_dtype, x_col.dtype, dx_dtype, dk_dtype, dgrad_split, wgrad_split))
    return dx, dk, (dbias if compute_dbias else None), amax


_FP8_OF_CODE = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def _local(dy, x_col, k_row, s, si, xs, ks, *, q_code, dx_dtype, dk_dtype, dbias, dbias_dtype,
           dgrad_split=True, wgrad_split=True, allow_fused=True):
    """The op on one device's (or the whole) operands: the fused primitive where a placement
    fits (and allow_fused), else the unfused ops' primitives (quantize_fp8_p, then the dgrad
    and wgrad gemm_p calls with the same accumulation), which give the same values."""
    (m, n), k = dy.shape, x_col.shape[0]
    q_dtype = _FP8_OF_CODE[q_code]
    fits = allow_fused and dense_backward_plan(m, n, k, dk_dtype, dx_dtype, dbias) is not None
    algos = _gemm_attrs(q_dtype, x_col.dtype, dx_dtype, dk_dtype, dgrad_split, wgrad_split, fused=fits)
    if fits:
        return tuple(dense_backward_fp8_p.bind(dy, x_col, k_row, s, si, xs, ks, q_dtype=np.int32(q_code),
                                               dx_dtype=dx_dtype, dk_dtype=dk_dtype, dbias=dbias,
                                               dbias_dtype=dbias_dtype, **algos))
    row, col, amax, db = quantize_fp8_p.bind(dy, s, flatten_axis=np.int32(1), out_dtype=q_dtype, rowwise=True,
                                             colwise=True, dbias_dtype=dbias_dtype if dbias else None)
    dx = gemm_mod._gemm_2d(row, k_row, si, ks, jnp.zeros((0,), dx_dtype), dx_dtype, dgrad_split,
                           algo=int(algos["dgrad_algo"]), algo_or_first=bool(algos["dgrad_algo_or_first"]))
    dk = gemm_mod._gemm_2d(x_col, col, xs, si, jnp.zeros((0,), dk_dtype), dk_dtype, wgrad_split,
                           algo=int(algos["wgrad_algo"]), algo_or_first=bool(algos["wgrad_algo_or_first"]))
    return dx, dk, db, amax


@lru_cache(maxsize=None)
def _sharded_fn(q_code: int, dx_dtype, dk_dtype, dbias: bool, dgrad_split: bool = True, wgrad_split: bool = True,
                tp_only: bool = False):
    """The partitioned, vmappable op for one configuration (see the module docstring)."""
    splits = dict(dgrad_split=dgrad_split, wgrad_split=wgrad_split)

    def local(dy, x_col, k_row, s, si, xs, ks):
        return _local(dy, x_col, k_row, s, si, xs, ks, q_code=q_code, dx_dtype=dx_dtype, dk_dtype=dk_dtype,
                      dbias=dbias, dbias_dtype=dy.dtype if dbias else None, **splits)

    def partition(mesh, arg_shapes, result_shape):
        dy_spec, xc_spec = spec_entries(arg_shapes[0].sharding, 2), spec_entries(arg_shapes[1].sharding, 2)
        m_axes = mesh_axes(dy_spec[:1])
        n_axes = tuple(ax for ax in mesh_axes(dy_spec[1:]) if ax not in m_axes)
        k_axes = tuple(ax for ax in mesh_axes(xc_spec[:1]) if ax not in m_axes + n_axes)
        m_e, n_e, k_e = axes_entry(m_axes), axes_entry(n_axes), axes_entry(k_axes)
        # tp_only: the fused primitive only where an axis of more than one device shards n or k
        # (a tp axis of size 1 is data parallelism alone: see dense_backward_fp8_sharded).
        allow_fused = not tp_only or any(mesh.shape[ax] > 1 for ax in n_axes + k_axes)

        def lower(dy, x_col, k_row, s, si, xs, ks):
            dbias_dtype = (jnp.dtype(jnp.float32) if m_axes else dy.dtype) if dbias else None
            dx, dk, db, amax = _local(dy, x_col, k_row, s, si, xs, ks, q_code=q_code, dx_dtype=dx_dtype,
                                      dk_dtype=dk_dtype, dbias=dbias, dbias_dtype=dbias_dtype,
                                      allow_fused=allow_fused, **splits)
            if n_axes:
                dx = jax.lax.psum(dx, n_axes)
            if m_axes:
                dk = jax.lax.psum(dk, m_axes)
                if dbias:
                    db = jax.lax.psum(db, m_axes).astype(dy.dtype)
            if m_axes or n_axes:
                amax = pmax_nonnegative(amax, m_axes + n_axes)
            return dx, dk, db, amax

        ns = lambda *entries: NamedSharding(mesh, PartitionSpec(*entries))  # noqa: E731
        args = (ns(m_e, n_e), ns(k_e, m_e), ns(k_e, n_e), ns(None), ns(None), ns(None), ns(None))
        results = (ns(m_e, k_e), ns(k_e, n_e), ns(n_e) if dbias else ns(None), ns(None))
        return mesh, lower, results, args

    def rule(mesh, value_types, result_types):
        del mesh, value_types, result_types
        return ("m n, k m, k n, s0, s1, s2, s3 -> m k, k n, " + ("n" if dbias else "z") + ", a",
                {"need_replication_factors": ("s0", "s1", "s2", "s3")})

    partitioned = custom_partitioning(local)
    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def fn(*args):
        return partitioned(*args)

    fn.def_vmap(vmap_body(local))
    return fn


def dense_backward_fp8_sharded(dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, *, q_dtype,
                               dx_dtype, dk_dtype, compute_dbias: bool, dgrad_split: bool = True,
                               wgrad_split: bool = True, tp_only: bool = False):
    """dense_backward_fp8 (same arguments and results) for operands sharded over a mesh (the
    module docstring's rule): each device runs the op on its blocks, or, where no placement
    fits them, the unfused ops' primitives with the same values. tp_only: the unfused
    primitives also where no mesh axis of more than one device shards n or k (decided when the
    mesh is known, at partitioning), as lowbit.dense's default does for data parallelism."""
    fn = _sharded_fn(_q_code(q_dtype), jnp.dtype(dx_dtype), jnp.dtype(dk_dtype), bool(compute_dbias),
                     bool(dgrad_split), bool(wgrad_split), bool(tp_only))
    dx, dk, dbias, amax = fn(dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv)
    return dx, dk, (dbias if compute_dbias else None), amax
