"""lowbit.cpp_extensions.gemm: TE's import path (transformer_engine.jax.cpp_extensions.gemm)
over lowbit's GEMM op.

gemm(lhs, rhs, contracting_dims, lhs_quantizer, rhs_quantizer, ...) is TE's: out = lhs . rhs
over the contracting dims, shaped (lhs's other dims..., rhs's other dims...), in lhs's dtype
(a quantized lhs: its dq_dtype). Each operand is a plain array (a NoScaleTensor's data), a
ScaledTensor, or an array quantized here by its quantizer (or quantizer_set.x / .kernel)
into the one copy the GEMM takes, as TE does: the copy whose stored layout has the
contracting dims last (lowbit's GEMMs are K-major, "TN", on every device). A ScaledTensor2x
gives that copy (get_tensor with TensorUsage LHS / LHS_TRANS / RHS / RHS_TRANS); a
ScaledTensor1x must be it. The quantized GEMM is the one `lowbit.dense` runs
(lowbit.ops.gemm: cuBLASLt, or the exact emulation with a notice); two plain bf16 or f16
operands go through the same op unquantized, two plain f32 operands through XLA's dot at
Precision.HIGHEST (lowbit's op has no f32 operands; TE's cuBLAS call is an fp32 GEMM too).

use_split_accumulator=None (TE's default) takes the global recipe's fp8_gemm_fprop (fast
accumulation unless the recipe says otherwise; TE 2.12 reads its FP8_2X_ACC_FPROP, False,
for every call); it matters for per-tensor FP8 on a GPU only.

Differences from TE, all else as TE's code does it:
- fuse_gelu and grad (the GeLU and bias-gradient epilogues, which TE warns are deprecated)
  and any collective_op but CollectiveOp.NONE raise an error naming them.
- Each operand's contracting dims must be consecutive and its leading or its trailing dims
  (TE asserts the first; in the middle its output order would follow the stored copy).
- A delayed-scaling quantizer given to gemm quantizes with its stored scale, but its amax is
  lost: lowbit's quantizers are immutable and gemm returns the product only, where TE updates
  the quantizer object in place. gemm warns (UserWarning) when given one; to keep a delayed
  scale moving, quantize the operand with lowbit.cpp_extensions.quantize first, pass the
  ScaledTensor, and feed its amax to quantizer.update().
- As in TE, bias is added only with fuse_bias=True (grad False), and gelu_input is read only
  with fuse_gelu; transpose_batch_sequence only matters to TE's collective GEMMs, so it is
  accepted and changes nothing here.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lowbit.cpp_extensions._common import check_flag, named_errors, unwrap
from lowbit.quantize.quantizer import DelayedScaleQuantizer, check_quantizer
from lowbit.quantize.tensor import ScaledTensor, ScaledTensor1x, ScaledTensor2x, TensorUsage

__all__ = [
    "CollectiveOp",
    "CollectiveOpSet",
    "gemm",
    "gemm_uses_jax_dot",
    "get_non_contracting_dims",
    "noop_collective_op_set",
    "sanitize_dims",
    "transpose_dims",
]

_OP = "lowbit.cpp_extensions.gemm"
_KWARGS = ("bias", "gelu_input", "fuse_bias", "fuse_gelu", "grad", "use_split_accumulator",
           "quantizer_set")


class CollectiveOp(enum.Enum):
    """TE's collective-GEMM kinds; lowbit's gemm takes NONE only (its sharded GEMMs overlap
    their collectives through XLA: lowbit.sharding)."""

    NONE = 0
    ALL_GATHER = 1
    REDUCE_SCATTER = 2

    @property
    def is_all_gather(self) -> bool:
        return self == CollectiveOp.ALL_GATHER

    @property
    def is_reduce_scatter(self) -> bool:
        return self == CollectiveOp.REDUCE_SCATTER

    @property
    def is_none(self) -> bool:
        return self == CollectiveOp.NONE


@dataclass(frozen=True)
class CollectiveOpSet:
    """The forward's and the backward's CollectiveOp (TE's pairing: all-gather forward,
    reduce-scatter backward, and the reverse)."""

    forward: CollectiveOp
    backward: CollectiveOp

    @staticmethod
    def create(forward_collective_op: CollectiveOp) -> "CollectiveOpSet":
        backward = {CollectiveOp.ALL_GATHER: CollectiveOp.REDUCE_SCATTER,
                    CollectiveOp.REDUCE_SCATTER: CollectiveOp.ALL_GATHER}.get(forward_collective_op,
                                                                                CollectiveOp.NONE)
        return CollectiveOpSet(forward=forward_collective_op, backward=backward)


noop_collective_op_set = CollectiveOpSet.create(CollectiveOp.NONE)


def sanitize_dims(ndim: int, dims) -> tuple[int, ...]:
    """dims (an int or a sequence; None entries dropped) with negative ones made absolute."""
    dims = tuple(dims) if isinstance(dims, Iterable) else (dims,)
    return tuple(ndim + d if d < 0 else d for d in dims if d is not None)


def get_non_contracting_dims(ndim: int, contracting_dims) -> tuple[int, ...]:
    """The dims of an ndim-array that `contracting_dims` does not name, in order."""
    contracting = sanitize_dims(ndim, contracting_dims)
    return tuple(d for d in range(ndim) if d not in contracting)


def transpose_dims(ndim: int, dims_to_transpose, flatten_axis: int = -1) -> tuple[int, ...]:
    """Where dims_to_transpose land in a copy stored transposed at flatten_axis (dims from the
    split on, then the rest), by TE's formula: a positive flatten_axis f splits at ndim - f, a
    negative one is used as it is (so -1 moves every dim one place on)."""
    dims = tuple(dims_to_transpose)
    if not dims:
        return dims
    axis = ndim - flatten_axis if flatten_axis > 0 else flatten_axis
    order = (*range(axis, ndim), *range(axis))
    return tuple(order.index(d) for d in dims)


def gemm_uses_jax_dot() -> bool:
    """False: gemm always runs lowbit's GEMM op (XLA's dot only for two plain f32 operands)."""
    return False


def _layout(name: str, ndim: int, dims) -> tuple[tuple[int, ...], bool]:
    """(sorted absolute contracting dims, whether they are the leading ones) of one operand."""
    cd = sanitize_dims(ndim, dims)
    if not cd or len(set(cd)) != len(cd) or not all(0 <= d < ndim for d in cd):
        raise ValueError(f"{_OP}: contracting_dims: {name}'s {tuple(dims)} are not distinct dims "
                         f"of its {ndim}")
    cd = tuple(sorted(cd))
    if list(cd) != list(range(cd[0], cd[-1] + 1)):
        raise ValueError(f"{_OP}: contracting_dims: {name}'s {cd} are not consecutive")
    if len(cd) == ndim:
        raise ValueError(f"{_OP}: contracting_dims: {name}'s {cd} leave it no free dim")
    if cd[0] != 0 and cd[-1] != ndim - 1:
        raise ValueError(f"{_OP}: contracting_dims: {name}'s {cd} must be its leading or its "
                         f"trailing dims (of {ndim})")
    return cd, cd[0] == 0


def _quantized_operand(name, t, quantizer, cd, usage):
    """The stored copy (a ScaledTensor1x with the contracting dims last) of operand `t`."""
    colwise = usage.takes_colwise
    flatten_axis = max(cd) + 1 if colwise else min(cd)
    if not isinstance(t, ScaledTensor):
        check_quantizer(_OP, quantizer)
        if isinstance(quantizer, DelayedScaleQuantizer):
            warnings.warn(f"{_OP}: {name}'s delayed-scaling quantizer: its amax is not returned, so "
                          f"its scale will not move (TE updates the quantizer in place; see the "
                          f"module docstring)", stacklevel=3)
        with named_errors(_OP):
            t, _ = quantizer.quantize(t, is_rowwise=not colwise, is_colwise=colwise, flatten_axis=flatten_axis)
    if isinstance(t, ScaledTensor2x):
        t = t.get_tensor(usage)
    if not isinstance(t, ScaledTensor1x):
        raise TypeError(f"{_OP}: {name}: expected an array, a ScaledTensor1x or a ScaledTensor2x, "
                        f"got {type(t).__name__}")
    with named_errors(f"{_OP}: {name}"):
        t.get_tensor(usage)
    if t.flatten_axis != flatten_axis:
        raise ValueError(f"{_OP}: {name}: a copy split at flatten_axis {t.flatten_axis} does not "
                         f"contract dims {cd}: quantize it with flatten_axis={flatten_axis}")
    return t


def _split(use_split_accumulator) -> bool:
    if use_split_accumulator is not None:
        return check_flag(_OP, "use_split_accumulator", use_split_accumulator)
    from lowbit.quantize.helper import get_global_recipe

    fprop = getattr(get_global_recipe(), "fp8_gemm_fprop", None)
    return bool(fprop.use_split_accumulator) if fprop is not None else False


def gemm(lhs, rhs, contracting_dims=((-1,), (0,)), lhs_quantizer=None, rhs_quantizer=None,
         transpose_batch_sequence=False, collective_op=CollectiveOp.NONE, **kwargs):
    """lhs . rhs over contracting_dims, (lhs free dims..., rhs free dims...), lhs's dtype;
    operands quantized by their quantizers where given (module docstring)."""
    unknown = sorted(set(kwargs) - set(_KWARGS))
    if unknown:
        raise TypeError(f"{_OP}: unexpected keyword {unknown[0]!r} (takes {', '.join(_KWARGS)})")
    check_flag(_OP, "transpose_batch_sequence", transpose_batch_sequence)
    if collective_op != CollectiveOp.NONE:
        raise ValueError(f"{_OP}: collective_op: only CollectiveOp.NONE (lowbit has no collective "
                         f"GEMM; its sharded GEMMs leave the collectives to XLA), got {collective_op!r}")
    fuse_bias = check_flag(_OP, "fuse_bias", kwargs.get("fuse_bias", False))
    for flag in ("fuse_gelu", "grad"):
        if check_flag(_OP, flag, kwargs.get(flag, False)):
            raise ValueError(f"{_OP}: {flag}: only False (lowbit's GEMM has no GeLU or bias-gradient "
                             f"epilogue; TE deprecates them)")
    quantizer_set = kwargs.get("quantizer_set")
    if quantizer_set is not None and (lhs_quantizer is None or rhs_quantizer is None):
        lhs_quantizer, rhs_quantizer = quantizer_set.x, quantizer_set.kernel
    lhs, rhs = unwrap(lhs), unwrap(rhs)
    if not isinstance(contracting_dims, (tuple, list)) or len(contracting_dims) != 2:
        raise ValueError(f"{_OP}: contracting_dims: expected (lhs dims, rhs dims), got {contracting_dims!r}")
    lhs_nd = len(lhs.shape) if isinstance(lhs, ScaledTensor) else jnp.ndim(lhs)
    rhs_nd = len(rhs.shape) if isinstance(rhs, ScaledTensor) else jnp.ndim(rhs)
    lcd, lhs_leading = _layout("lhs", lhs_nd, contracting_dims[0])
    rcd, rhs_leading = _layout("rhs", rhs_nd, contracting_dims[1])
    lshape, rshape = tuple(lhs.shape), tuple(rhs.shape)
    if [lshape[d] for d in lcd] != [rshape[d] for d in rcd]:
        raise ValueError(f"{_OP}: contracting_dims: lhs {lshape} at {lcd} and rhs {rshape} at {rcd} "
                         f"contract different sizes")
    r_free = tuple(rshape[d] for d in range(rhs_nd) if d not in rcd)

    quantized = [isinstance(lhs, ScaledTensor) or lhs_quantizer is not None,
                 isinstance(rhs, ScaledTensor) or rhs_quantizer is not None]
    if quantized[0] != quantized[1]:
        name = "rhs_quantizer" if quantized[0] else "lhs_quantizer"
        raise ValueError(f"{_OP}: {name}: a quantized GEMM needs both operands quantized or a "
                         f"quantizer for each (as in TE)")
    out_dtype = lhs.dq_dtype if isinstance(lhs, ScaledTensor1x) else (
        lhs.rowwise_tensor.dq_dtype if isinstance(lhs, ScaledTensor2x) else jnp.asarray(lhs).dtype)
    bias = kwargs.get("bias") if fuse_bias else None
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != r_free or bias.dtype != out_dtype:
            raise ValueError(f"{_OP}: bias: expected shape {r_free} and dtype {jnp.dtype(out_dtype)} "
                             f"(rhs's free dims, the output's dtype), got {bias.shape} {bias.dtype}")

    if quantized[0]:
        from lowbit.dense import _gemm

        a = _quantized_operand("lhs", lhs, lhs_quantizer,
                               lcd, TensorUsage.LHS_TRANS if lhs_leading else TensorUsage.LHS)
        b = _quantized_operand("rhs", rhs, rhs_quantizer,
                               rcd, TensorUsage.RHS if rhs_leading else TensorUsage.RHS_TRANS)
        with named_errors(_OP):
            return _gemm(a, b, bias, out_dtype, len(lcd), _split(kwargs.get("use_split_accumulator")),
                         tokens_in_a=False)

    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{_OP}: rhs: unquantized operands need one dtype, got {lhs.dtype} and {rhs.dtype}")
    if lhs.dtype == jnp.float32:
        out = jax.lax.dot_general(lhs, rhs, ((lcd, rcd), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)
        return out if bias is None else out + bias
    from lowbit.ops.gemm import gemm as lowbit_gemm

    k = len(lcd)
    a = jnp.moveaxis(lhs, lcd, range(lhs.ndim - k, lhs.ndim)) if lhs_leading else lhs
    b = rhs if not rhs_leading else jnp.moveaxis(rhs, rcd, range(rhs.ndim - k, rhs.ndim))
    with named_errors(_OP):
        return lowbit_gemm(a, b, bias=bias, out_dtype=lhs.dtype, contracting_ndim=k,
                           use_split_accumulator=_split(kwargs.get("use_split_accumulator")))
