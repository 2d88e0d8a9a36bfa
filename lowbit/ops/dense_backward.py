"""lowbit.ops.dense_backward_fp8: the backward of a per-tensor FP8 dense layer as one op
(lowbit_dense_backward_fp8, csrc/dense/dense_backward.h) that keeps dy's two FP8 copies inside
its dk output until the wgrad overwrites them, so the step holds no separate buffers for them:

    dy (m, n) -> rowwise + colwise FP8 copies (scale dy_scale), amax, dbias (optional)
    dx (m, k) = gemm(dy rowwise, k_row)     k_row (k, n): the kernel's saved rowwise copy
    dk (k, n) = gemm(x_col, dy colwise)     x_col (k, m): x's saved colwise copy

Values: those of lowbit_quantize_fp8 and of lowbit_gemm with split accumulation (on the CPU
bit for bit the unfused ops'; on CUDA the wgrad runs as S column slices, each a cuBLASLt GEMM
of its own). `dense_backward_plan` says whether a placement exists for the sizes (through
the C++ planner, MakeDenseBwdPlan) and how much scratch it needs: one colwise slice of dy
(n / S x m bytes), on CUDA behind the 32 MiB cuBLASLt workspace (the lowering adds the
scratch as the custom call's last result, as lowbit.ops.gemm does its workspace).
Single-device only: the op has no partitioning rule, and lowbit.dense uses it only without a
MeshResource (vmap maps it).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching, mlir

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive

__all__ = ["dense_backward_fp8", "dense_backward_plan"]

# lowbit::DType codes of the FP8 dtypes (csrc/common/dtype.h), the q_dtype attribute.
_DTYPE_CODES = {jnp.dtype(jnp.float8_e4m3fn): 4, jnp.dtype(jnp.float8_e5m2): 5}


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
              dk_dtype, dbias):
    del dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, q_dtype
    (m, n), k = dy.shape, x_col.shape[0]
    return (
        jax.core.ShapedArray((m, k), dx_dtype),
        jax.core.ShapedArray((k, n), dk_dtype),
        jax.core.ShapedArray((n,) if dbias else (0,), dy.dtype),
        jax.core.ShapedArray((1,), jnp.float32),
    )


# (dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv) ->
# (dx, dk, dbias | (0,), amax (1,)); the custom call's fifth result, the scratch (u8), is
# added by the lowering rules below.
dense_backward_fp8_p = ffi_primitive(
    "lowbit_dense_backward_fp8",
    "lowbit_dense_backward_fp8",
    _abstract,
    multiple_results=True,
    attrs=("q_dtype",),
)
_ffi_lowering = jax.ffi.ffi_lowering("lowbit_dense_backward_fp8")


def _lowering(ctx, *args, platform, q_dtype, dx_dtype, dk_dtype, dbias):
    _ffi.require_platform("lowbit_dense_backward_fp8", platform)
    dy, x_col = ctx.avals_in[:2]
    (m, n), k = dy.shape, x_col.shape[0]
    plan = dense_backward_plan(m, n, k, dk_dtype, dx_dtype, dbias, cuda=platform == "cuda")
    if plan is None:
        raise ValueError(f"lowbit.ops.dense_backward_fp8: dy {dy.shape}, x_col {x_col.shape}: no placement of "
                         "dy's copies fits dk (csrc/dense/dense_backward.h)")
    scratch = jax.core.ShapedArray((plan[1],), jnp.uint8)
    return _ffi_lowering(ctx.replace(avals_out=[*ctx.avals_out, scratch]), *args, q_dtype=q_dtype)[:4]


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
                       dx_dtype, dk_dtype, compute_dbias: bool):
    """(dx (m, k), dk (k, n), dbias (n,) in dy's dtype or None, dy's amax (1,)) from dy (m, n)
    f32/f16/bf16, x_col (k, m) and k_row (k, n) FP8 and the four f32 (1,) scales; dy's copies
    are `q_dtype`. Raises ValueError when no placement fits (dense_backward_plan)."""
    (m, n), k = dy.shape, x_col.shape[0]
    if dense_backward_plan(m, n, k, dk_dtype, dx_dtype, compute_dbias) is None:
        raise ValueError(f"lowbit.ops.dense_backward_fp8: dy {dy.shape}, x_col {x_col.shape}: no placement of "
                         "dy's copies fits dk (csrc/dense/dense_backward.h)")
    q_dtype = jnp.dtype(q_dtype)
    if q_dtype not in _DTYPE_CODES:
        raise ValueError(f"lowbit.ops.dense_backward_fp8: q_dtype: expected float8_e4m3fn or float8_e5m2, got {q_dtype}")
    dx, dk, dbias, amax = dense_backward_fp8_p.bind(
        dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv,
        q_dtype=np.int32(_DTYPE_CODES[q_dtype]), dx_dtype=jnp.dtype(dx_dtype), dk_dtype=jnp.dtype(dk_dtype),
        dbias=compute_dbias)
    return dx, dk, (dbias if compute_dbias else None), amax
