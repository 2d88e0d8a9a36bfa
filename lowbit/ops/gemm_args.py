"""lowbit.ops.gemm_args: the argument checks of lowbit.ops.gemm, each error naming the op and
the argument: operand shapes and dtypes, the output dtype and bias, the scale_invs per
GemmScaleMode; and the C++ handler's own shape checks (csrc/ffi/gemm_ffi.cc) for a gemm_p bound
directly, made before the CUDA lowering pads or emulates it.
"""

from __future__ import annotations

import jax.numpy as jnp

from lowbit.ops.gemm_config import _E8M0, FP8, HALF, OP, OUT, GemmScaleMode
from lowbit.ops.gemm_scales import scale_shape


def check_operands(a, b, contracting_ndim, out_dtype, bias):
    """gemm()'s operand, out_dtype and bias checks; returns (k_ndim, k_shape, n_shape, out_dtype,
    bias as an array or None)."""
    kd = int(contracting_ndim)
    if kd < 1:
        raise ValueError(f"{OP}: contracting_ndim: expected >= 1, got {contracting_ndim}")
    if a.ndim < kd:
        raise ValueError(f"{OP}: a: expected shape (..., K) with {kd} contracted dims, got {a.shape}")
    if b.ndim < kd + 1:
        raise ValueError(f"{OP}: b: expected shape (N, K) (N..., then {kd} contracted dims), got {b.shape}")
    k_shape, n_shape = a.shape[a.ndim - kd:], b.shape[:b.ndim - kd]
    if b.shape[b.ndim - kd:] != k_shape:
        want = "(N, " + ", ".join(map(str, k_shape)) + ")"
        raise ValueError(f"{OP}: b: expected {want} to match a {a.shape}, got {b.shape}")
    if a.dtype in FP8 or b.dtype in FP8:
        if a.dtype not in FP8 or b.dtype not in FP8:
            raise TypeError(f"{OP}: b: expected both operands FP8 or neither, got {a.dtype} and {b.dtype}")
        if a.dtype == b.dtype == jnp.float8_e5m2:
            raise TypeError(f"{OP}: b: float8_e5m2 x float8_e5m2 has no FP8 GEMM; use float8_e4m3fn for one")
    elif a.dtype not in HALF or b.dtype != a.dtype:
        raise TypeError(f"{OP}: b: expected a and b both FP8, both bfloat16 or both float16, "
                        f"got {a.dtype} and {b.dtype}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT:
        raise TypeError(f"{OP}: out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if a.dtype in HALF and out_dtype not in (a.dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"{OP}: out_dtype: with {a.dtype} operands expected {a.dtype} or float32, got {out_dtype}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != n_shape:
            raise ValueError(f"{OP}: bias: expected shape {n_shape}, got {bias.shape}")
        if bias.dtype != out_dtype:
            raise TypeError(f"{OP}: bias: expected out_dtype {out_dtype}, got {bias.dtype}")
    return kd, k_shape, n_shape, out_dtype, bias


def _scale_arg(name: str, x, mode: GemmScaleMode = GemmScaleMode.TENSOR, rows: int = 1, k: int = 1):
    if mode != GemmScaleMode.TENSOR:
        if x is None:
            raise ValueError(f"{OP}: {name}: scale mode {mode.name} needs its scale array")
        x = jnp.asarray(x)
        want_dtype = _E8M0 if mode == GemmScaleMode.MXFP8 else jnp.dtype(jnp.float32)
        if x.dtype != want_dtype:
            raise TypeError(f"{OP}: {name}: expected {want_dtype} for scale mode {mode.name}, got {x.dtype}")
        want = scale_shape(mode, rows, k)
        if tuple(x.shape) != want:
            raise ValueError(f"{OP}: {name}: expected shape {want} for scale mode {mode.name} of a "
                             f"{rows} x {k} operand, got {tuple(x.shape)}")
        return x
    if x is None:
        return jnp.ones((1,), jnp.float32)
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"{OP}: {name}: expected float32, got {x.dtype}")
    if x.size != 1:
        raise ValueError(f"{OP}: {name}: expected one value (shape () or (1,)), got shape {x.shape}")
    return x.reshape(1)


def _check_scale_modes(a_mode, b_mode, a_dtype):
    for name, mode in (("a_scale_mode", a_mode), ("b_scale_mode", b_mode)):
        try:
            GemmScaleMode(mode)
        except ValueError:
            raise ValueError(f"{OP}: {name}: expected a GemmScaleMode, got {mode!r}") from None
    a_mode, b_mode = GemmScaleMode(a_mode), GemmScaleMode(b_mode)
    if (a_mode == GemmScaleMode.TENSOR) != (b_mode == GemmScaleMode.TENSOR):
        raise ValueError(f"{OP}: b_scale_mode: expected block scales on both operands or neither, "
                         f"got {a_mode.name} and {b_mode.name}")
    if (a_mode == GemmScaleMode.MXFP8) != (b_mode == GemmScaleMode.MXFP8):
        raise ValueError(f"{OP}: b_scale_mode: MXFP8 scales pair only with MXFP8 scales, "
                         f"got {a_mode.name} and {b_mode.name}")
    if a_mode != GemmScaleMode.TENSOR and a_dtype not in FP8:
        raise TypeError(f"{OP}: a: block scale modes need FP8 operands, got {a_dtype}")
    return a_mode, b_mode



def _shape_text(shape) -> str:
    """A shape as the C++ handlers print it: (2, 4), (7,), ()."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_bound_shapes(avals, modes) -> None:
    """The C++ handler's scale and bias shape checks (csrc/ffi/gemm_ffi.cc), made before the
    CUDA lowering pads or emulates: a gemm_p bound directly with a wrongly shaped block scale
    array would otherwise be padded into a valid-looking one (its missing rows scaled by 0),
    and a (1,) bias broadcast over N where it is added in fp32 after the GEMM, instead of
    refused. gemm() checks the same in its own words first (_scale_arg)."""
    (m, k), n = avals[0].shape, avals[1].shape[0]
    bias = tuple(avals[4].shape)
    if len(bias) != 1 or bias[0] not in (0, n):
        raise ValueError(f"lowbit_gemm: bias: expected shape ({n},) or (0,), got {_shape_text(bias)}")
    for name, aval, mode, rows in (("a_scale_inv", avals[2], modes[0], m),
                                   ("b_scale_inv", avals[3], modes[1], n)):
        if mode == GemmScaleMode.TENSOR:
            continue
        want = scale_shape(mode, rows, k)
        if tuple(aval.shape) != want:
            raise ValueError(f"lowbit_gemm: {name}: expected shape ({want[0]}, {want[1]}) for scale "
                             f"mode {mode.name.lower()} of a {rows} x {k} operand, got {_shape_text(aval.shape)}")

