"""Scaling modes and quantize layouts: what a quantized tensor's scales look like.

A tensor of any rank is viewed as 2-D: rows = prod(shape[:flatten_axis]), columns =
prod(shape[flatten_axis:]) (the contracting dim of x in `x @ kernel`). `block_shape` is
the (rows, columns) extent one scale covers in that view: None for tensor scaling (one
fp32 scale for the whole tensor) and for NO_SCALING.

A layout names the copies a quantizer makes: ROWWISE (the tensor as is), COLWISE (the
copy the other GEMM operand needs: for tensor scaling, the transposed tensor) or both.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp

from lowbit.quantize import scale_shapes

__all__ = ["ScalingMode", "QuantizeLayout", "DataFamily"]


class DataFamily(enum.Enum):
    """The element format of quantized data."""

    HIGH_PRECISION = "high_precision"  # not quantized
    FP8 = "fp8"  # float8_e4m3fn or float8_e5m2
    FP4 = "fp4"  # float4_e2m1fn


class ScalingMode(enum.Enum):
    NO_SCALING = "no_scaling"
    DELAYED_TENSOR_SCALING = "delayed_tensor_scaling"
    CURRENT_TENSOR_SCALING = "current_tensor_scaling"
    MXFP8_1D_SCALING = "mxfp8_1d_scaling"
    FP8_BLOCK_1x128 = "fp8_block_1x128"
    FP8_BLOCK_128x128 = "fp8_block_128x128"
    NVFP4_1D_SCALING = "nvfp4_1d_scaling"
    NVFP4_2D_SCALING = "nvfp4_2d_scaling"

    def is_tensor_scaling(self) -> bool:
        """One fp32 scale per tensor (delayed or current). A method, as in TE."""
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    def is_1d_block_scaling(self) -> bool:
        """Scales per run of values along one dim as the GEMM reads them (TE's method): MXFP8,
        NVFP4 (its 16x16 weight tiles are stored as 1-D scales too, as in TE) and FP8 1x128."""
        return self in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_BLOCK_1x128) or self.is_nvfp4

    @property
    def is_nvfp4_scaling(self) -> bool:  # TE's name
        return self.is_nvfp4

    @property
    def is_mxfp8_scaling(self) -> bool:  # TE's name
        return self == ScalingMode.MXFP8_1D_SCALING

    def get_compatible_q_dtypes(self) -> set:
        """TE's query: the dtypes this mode's data may have (data_dtypes, as a set)."""
        return set(self.data_dtypes)

    @property
    def is_block_scaling(self) -> bool:
        return self.block_shape is not None

    @property
    def is_nvfp4(self) -> bool:
        return self in (ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING)

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """(rows, columns) covered by one scale in the 2-D view; None for one scale per tensor."""
        return _BLOCK_SHAPE.get(self)

    @property
    def scale_dtype(self):
        """dtype of the stored scales (scale_inv); None for NO_SCALING."""
        return _SCALE_DTYPE.get(self)

    @property
    def data_family(self) -> DataFamily:
        if self == ScalingMode.NO_SCALING:
            return DataFamily.HIGH_PRECISION
        return DataFamily.FP4 if self.is_nvfp4 else DataFamily.FP8

    @property
    def data_dtypes(self) -> tuple:
        """The quantized dtypes this mode accepts."""
        return _DATA_DTYPES[self.data_family]

    @property
    def colwise_is_transposed(self) -> bool:
        """True when the colwise copy is stored transposed (tensor scaling and FP8 block
        scaling: Hopper's FP8 GEMMs take both operands K-major), False when it keeps the
        input's shape (MXFP8: Blackwell reads either major-ness). NVFP4's colwise copy is
        transposed too (its 16-value blocks run along the wgrad GEMM's K)."""
        return self.is_tensor_scaling() or self.is_nvfp4 or self in (ScalingMode.FP8_BLOCK_1x128,
                                                                   ScalingMode.FP8_BLOCK_128x128)

    @property
    def is_colwise_transposed(self) -> bool:  # TE's name
        return self.colwise_is_transposed

    def get_scale_dtype(self):
        """TE's query: the scales' dtype (fp32 for NO_SCALING, TE's placeholder)."""
        return self.scale_dtype if self.scale_dtype is not None else jnp.float32

    def get_data_layout(self) -> str:
        """TE's query: the rowwise then the colwise copy's stored layout, "N" or "T"."""
        return "NT" if self.colwise_is_transposed else "NN"

    def get_scale_shape(self, data_shape, data_layout="N", is_colwise=False, is_padded=True,
                        flatten_axis=-1, broadcast_2d_scale_shape_to_1d=False) -> tuple[int, ...]:
        """TE's query: the scale shape TE 2.12 gives a copy of `data_shape` (a colwise "T" copy
        given transposed, flatten_axis counted in x's layout). lowbit's own scale arrays are
        2-D: for MXFP8 / NVFP4 the padded shape flattened at flatten_axis (NVFP4_2D with
        broadcast_2d_scale_shape_to_1d=True); FP8_BLOCK_* (not in TE) return lowbit's arrays'
        shapes. TE's asserts are ValueErrors. lowbit/quantize/scale_shapes.py has the formulas."""
        return scale_shapes.scale_shape(self, data_shape, data_layout, is_colwise, is_padded, flatten_axis,
                                        broadcast_2d_scale_shape_to_1d)

    def get_scale_shape_2x(self, data_shape, is_padded=True, flatten_axis=-1,
                           broadcast_2d_scale_shape_to_1d=False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """TE's query: (rowwise, colwise) scale shapes of x's two copies (get_scale_shape's)."""
        return scale_shapes.scale_shape_2x(self, data_shape, is_padded, flatten_axis,
                                           broadcast_2d_scale_shape_to_1d)

    def get_grouped_scale_shape(self, data_shape, n_groups, group_axis, is_colwise, is_padded=True,
                                flatten_axis=-1) -> tuple[int]:
        """TE's query: the 1-D shape of one buffer holding the scales of n_groups groups split
        along the rows (padded: the most any split can need). lowbit's grouped quantizers keep
        one scale array per group instead; FP8_BLOCK_* (not in TE) raise NotImplementedError.
        TE's asserts are ValueErrors. lowbit/quantize/scale_shapes.py has the formulas."""
        return scale_shapes.grouped_scale_shape(self, data_shape, n_groups, group_axis, is_colwise,
                                                is_padded, flatten_axis)

    def get_grouped_scale_shape_2x(self, data_shape, n_groups, group_axis, is_padded=True,
                                   flatten_axis=-1) -> tuple[tuple[int], tuple[int]]:
        """TE's query: (rowwise, colwise) get_grouped_scale_shape."""
        return scale_shapes.grouped_scale_shape_2x(self, data_shape, n_groups, group_axis, is_padded,
                                                   flatten_axis)

    def get_quantize_layout(self, usage) -> "QuantizeLayout":
        """TE's query: the copy a GEMM takes for a lowbit.quantize.TensorUsage. lowbit's GEMMs
        are K-major on every device, so LHS / RHS_TRANS take the rowwise copy, LHS_TRANS / RHS
        the colwise one; NO_SCALING the rowwise (the array itself)."""
        from lowbit.quantize.tensor import TensorUsage

        if not isinstance(usage, TensorUsage):
            raise TypeError(f"ScalingMode.get_quantize_layout: usage: expected a TensorUsage, got {usage!r}")
        if self == ScalingMode.NO_SCALING or not usage.takes_colwise:
            return QuantizeLayout.ROWWISE
        return QuantizeLayout.COLWISE


_BLOCK_SHAPE = {
    ScalingMode.MXFP8_1D_SCALING: (1, 32),
    ScalingMode.FP8_BLOCK_1x128: (1, 128),
    ScalingMode.FP8_BLOCK_128x128: (128, 128),
    ScalingMode.NVFP4_1D_SCALING: (1, 16),
    ScalingMode.NVFP4_2D_SCALING: (16, 16),
}
_SCALE_DTYPE = {
    ScalingMode.DELAYED_TENSOR_SCALING: jnp.float32,
    ScalingMode.CURRENT_TENSOR_SCALING: jnp.float32,
    ScalingMode.MXFP8_1D_SCALING: jnp.float8_e8m0fnu,
    ScalingMode.FP8_BLOCK_1x128: jnp.float32,
    ScalingMode.FP8_BLOCK_128x128: jnp.float32,
    ScalingMode.NVFP4_1D_SCALING: jnp.float8_e4m3fn,
    ScalingMode.NVFP4_2D_SCALING: jnp.float8_e4m3fn,
}
_DATA_DTYPES = {
    DataFamily.HIGH_PRECISION: (jnp.float32, jnp.float16, jnp.bfloat16),
    DataFamily.FP8: (jnp.float8_e4m3fn, jnp.float8_e5m2),
    DataFamily.FP4: (jnp.float4_e2m1fn,),
}


class QuantizeLayout(enum.Enum):
    ROWWISE = "rowwise"
    COLWISE = "colwise"
    ROWWISE_COLWISE = "rowwise_colwise"

    @property
    def has_rowwise(self) -> bool:
        return self != QuantizeLayout.COLWISE

    @property
    def has_colwise(self) -> bool:
        return self != QuantizeLayout.ROWWISE

    @property
    def is_rowwise_colwise(self) -> bool:  # TE's names for the three layouts
        return self == QuantizeLayout.ROWWISE_COLWISE

    @property
    def is_rowwise_only(self) -> bool:
        return self == QuantizeLayout.ROWWISE

    @property
    def is_colwise_only(self) -> bool:
        return self == QuantizeLayout.COLWISE

    @classmethod
    def of(cls, rowwise: bool, colwise: bool) -> QuantizeLayout:
        if rowwise and colwise:
            return cls.ROWWISE_COLWISE
        if rowwise:
            return cls.ROWWISE
        if colwise:
            return cls.COLWISE
        raise ValueError("QuantizeLayout: at least one of rowwise and colwise must be set")
