"""lowbit.cpp_extensions.quantization: TE's import path
(transformer_engine.jax.cpp_extensions.quantization) over lowbit's quantizers.

quantize(x, quantizer) is quantizer.quantize(x) making the copies the quantizer's q_layout
names: a ScaledTensor2x (rowwise + colwise) for ROWWISE_COLWISE, which QuantizerFactory
makes, else one ScaledTensor1x; the copies' layouts are those of lowbit.quantize.tensor
(the colwise copy of tensor and FP8-block scaling transposed). flatten_axis splits x into
rows x[:flatten_axis] and columns x[flatten_axis:] as in TE. quantize_dbias adds the bias
gradient (the sums of x over its rows, from the quantize kernel's pass). dequantize is the
ScaledTensor's own dequantize() (a ScaledTensor2x dequantizes its rowwise copy).

lowbit quantizers are immutable: feed the tensor's amax to quantizer.update() for the next
step's delayed scale (TE updates its quantizer object in place). With quantizer=None,
quantize returns x wrapped in a NoScaleTensor (x itself if it is one) and quantize_dbias
that and the fp32 sums of x over its rows in x's dtype, as TE 2.12 does. Every function
takes a NoScaleTensor wherever TE's takes one (its data is the input), and TE 2.12's
amax_scope and transpose_batch_sequence keywords (lowbit.cpp_extensions._common.
check_te_keywords: lowbit's one amax rule for every scope).
"""

from __future__ import annotations

from lowbit.cpp_extensions._common import check_flag, check_te_keywords, named_errors, unwrap
from lowbit.quantize.quantizer import check_quantizer
from lowbit.quantize.quantizer import row_sums as quantizer_row_sums
from lowbit.quantize.tensor import NoScaleTensor, ScaledTensor

__all__ = ["quantize", "quantize_dbias", "dequantize"]


def row_sums(op, x, flatten_axis, dtype=None):
    """lowbit.quantize.quantizer.row_sums of x split at flatten_axis (TE's bias gradient where
    no kernel computes it), the split checked and named for `op`."""
    axis = flatten_axis + x.ndim if flatten_axis < 0 else flatten_axis
    if not 0 < axis < x.ndim:
        raise ValueError(f"{op}: flatten_axis: expected -{x.ndim} < flatten_axis < {x.ndim} "
                         f"(rows and columns both non-empty) for shape {x.shape}, got {flatten_axis}")
    return quantizer_row_sums(x, axis, dtype)


def _quantize(op, x, quantizer, flatten_axis, compute_dbias):
    x = unwrap(x)
    if quantizer is None:
        return NoScaleTensor(x), (row_sums(op, x, flatten_axis) if compute_dbias else None)
    check_quantizer(op, quantizer)
    layout = quantizer.q_layout
    with named_errors(op):
        return quantizer.quantize(x, is_rowwise=layout.has_rowwise, is_colwise=layout.has_colwise,
                                  flatten_axis=flatten_axis, compute_dbias=compute_dbias)


def quantize(x, quantizer, flatten_axis=-1, amax_scope=None, transpose_batch_sequence=False):
    """The ScaledTensor of x as `quantizer` codes it (a NoScaleTensor of x when quantizer is
    None). amax_scope, transpose_batch_sequence: TE's (_common.check_te_keywords)."""
    check_te_keywords("lowbit.cpp_extensions.quantize", amax_scope, transpose_batch_sequence)
    if quantizer is None:
        return x if isinstance(x, NoScaleTensor) else NoScaleTensor(x)
    return _quantize("lowbit.cpp_extensions.quantize", x, quantizer, flatten_axis, False)[0]


def quantize_dbias(dz, quantizer, is_dbias=True, flatten_axis=-1, amax_scope=None,
                   transpose_batch_sequence=False):
    """(ScaledTensor of dz (a NoScaleTensor when quantizer is None), dbias: the sums of dz over
    its rows in dz's dtype, or None when is_dbias is False)."""
    op = "lowbit.cpp_extensions.quantize_dbias"
    check_te_keywords(op, amax_scope, transpose_batch_sequence)
    is_dbias = check_flag(op, "is_dbias", is_dbias)
    return _quantize(op, dz, quantizer, flatten_axis, is_dbias)


def dequantize(x):
    """x's values in its dq_dtype and logical shape (a ScaledTensor2x: its rowwise copy; a
    NoScaleTensor: its data)."""
    if not isinstance(x, (ScaledTensor, NoScaleTensor)):
        raise TypeError(f"lowbit.cpp_extensions.dequantize: x: expected a lowbit.quantize "
                        f"ScaledTensor or NoScaleTensor, got {type(x).__name__}")
    with named_errors("lowbit.cpp_extensions.dequantize"):
        return x.dequantize()
