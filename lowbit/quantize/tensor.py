"""ScaledTensor pytrees: quantized data with the scales that dequantize it.

`ScaledTensor1x` is one copy of a tensor `x` (logical shape `S`, `flatten_axis` f >= 0
splitting S into rows S[:f] and columns S[f:]):
  - rowwise: `data.shape == S`;
  - colwise, tensor scaling: the TRANSPOSED tensor, `data.shape == S[f:] + S[:f]` (Hopper
    FP8 GEMMs take both operands K-major); `dequantize()` transposes back to S;
  - colwise, FP8 block scaling: transposed as well (Hopper's block-scaled GEMM is K-major);
  - colwise, MXFP8: `data.shape == S` (the scales run down the columns);
  - NVFP4 (NVFP4Tensor1x): packed 2-D data, the colwise copy transposed (K-major), with a
    global scale and the logical shape beside it.
`x ~= data * scale_inv` elementwise: scale_inv has shape (1,) for tensor scaling; for block
scaling it is the 2-D scale array of the stored copy in the GEMM-ready layouts of
lowbit.ops.quantize_block (fp32 scale_inv per 1x128 / 128x128 tile, E8M0 bytes per 32
values for MXFP8), padding included.
`amax` (shape (1,), fp32) is max|x| of the high-precision input when the quantizer
computed it (delayed scaling feeds it to `Quantizer.update`), else None.

`ScaledTensor2x` holds a rowwise and a colwise copy of the same tensor. `get_tensor(usage)`
picks the copy a GEMM takes for a `TensorUsage` (TE's names): the operand's contracting dims
must be K-major, so LHS (contracting its trailing dims) and RHS_TRANS take the rowwise copy,
LHS_TRANS and RHS (contracting their leading dims) the colwise one, for every scaling mode
(lowbit's GEMMs are always TN, as TE's on Hopper).

`NoScaleTensor` is TE's wrapper of a high-precision array (data, and its amax or None): what
TE's cpp_extensions return where no quantizer was given, so ported code that reads `.data`
works; `dequantize()` is the data itself.

Leaves are data, scale_inv and amax; scaling_mode, dq_dtype, is_colwise and flatten_axis
are static pytree metadata, so ScaledTensors pass through jit, scan, vmap and grad.

`dequantize()` is plain jnp for tensor scaling (`(data_f32 * scale_inv).astype(dq_dtype)`),
so XLA fuses it into its consumer; it is the same formula as
`lowbit.ops.quantize.dequantize_fp8`. Block-scaled copies dequantize through
`lowbit.ops.dequantize_fp8_block` / `dequantize_mxfp8` (the same formula per tile).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.quantize.scaling_modes import ScalingMode

__all__ = ["NoScaleTensor", "ScaledTensor", "ScaledTensor1x", "ScaledTensor2x", "NVFP4Tensor1x",
           "TensorUsage", "colwise_permutation"]


class TensorUsage(enum.Enum):
    """How a GEMM C = A . B takes an operand (TE's enum): LHS is A in its normal form
    (contracting its trailing dims), LHS_TRANS A transposed (contracting its leading dims),
    RHS is B normal (contracting its leading dims), RHS_TRANS B transposed (its trailing)."""

    LHS = 0
    LHS_TRANS = 1
    RHS = 2
    RHS_TRANS = 3

    @property
    def takes_colwise(self) -> bool:
        """Whether the usage contracts the leading dims, which only the colwise copy holds
        K-major."""
        return self in (TensorUsage.LHS_TRANS, TensorUsage.RHS)


def _check_usage(usage) -> TensorUsage:
    if not isinstance(usage, TensorUsage):
        raise TypeError(f"get_tensor: usage: expected a lowbit.quantize.TensorUsage, got {usage!r}")
    return usage

BLOCK_DEQUANTIZE_PENDING = (
    "{mode}: dequantize of block-scaled tensors lands with issue Quantization II"
)


def colwise_permutation(ndim: int, flatten_axis: int) -> tuple[int, ...]:
    """The transpose that makes the colwise copy of a tensor-scaled tensor."""
    return (*range(flatten_axis, ndim), *range(flatten_axis))


def rowwise_permutation(ndim: int, flatten_axis: int) -> tuple[int, ...]:
    """The transpose that takes a colwise copy back to the logical layout."""
    colwise_leading = ndim - flatten_axis
    return (*range(colwise_leading, ndim), *range(colwise_leading))


class ScaledTensor:
    """Base class of quantized tensors."""

    def dequantize(self) -> jax.Array:
        raise NotImplementedError


# eq=False: fields hold arrays, which have no truth value; identity hashing is enough.
@dataclasses.dataclass(frozen=True, eq=False)
class ScaledTensor1x(ScaledTensor):
    data: jax.Array
    scale_inv: jax.Array
    amax: jax.Array | None
    scaling_mode: ScalingMode
    dq_dtype: np.dtype
    is_colwise: bool
    flatten_axis: int

    @property
    def data_layout(self) -> str:
        """"T" when the data is stored transposed (colwise copy under tensor scaling), else "N"."""
        return "T" if self.is_colwise and self.scaling_mode.colwise_is_transposed else "N"

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: that of the tensor that was quantized."""
        if self.data_layout == "T":
            permutation = rowwise_permutation(self.ndim, self.flatten_axis)
            return tuple(self.data.shape[i] for i in permutation)
        return tuple(self.data.shape)

    def get_tensor(self, usage: TensorUsage) -> "ScaledTensor1x":
        """This copy, if it is the one `usage` needs (module doc); else a ValueError."""
        if _check_usage(usage).takes_colwise != self.is_colwise:
            have = "colwise" if self.is_colwise else "rowwise"
            raise ValueError(f"get_tensor: usage: {usage} needs the "
                             f"{'colwise' if usage.takes_colwise else 'rowwise'} copy; this "
                             f"ScaledTensor1x is the {have} one")
        return self

    def dequantize(self) -> jax.Array:
        """data * scale_inv in the logical layout, as dq_dtype."""
        mode = self.scaling_mode
        if mode == ScalingMode.NO_SCALING:
            values = self.data.astype(self.dq_dtype)
        elif mode.is_tensor_scaling():
            values = (self.data.astype(jnp.float32) * self.scale_inv).astype(self.dq_dtype)
        elif mode in (ScalingMode.FP8_BLOCK_1x128, ScalingMode.FP8_BLOCK_128x128):
            from lowbit.ops.quantize_block import dequantize_fp8_block

            stored_axis = self.ndim - self.flatten_axis if self.is_colwise else self.flatten_axis
            values = dequantize_fp8_block(self.data, self.scale_inv,
                                          tile_2d=mode == ScalingMode.FP8_BLOCK_128x128,
                                          flatten_axis=stored_axis, out_dtype=self.dq_dtype)
        elif mode == ScalingMode.MXFP8_1D_SCALING:
            from lowbit.ops.quantize_block import dequantize_mxfp8

            values = dequantize_mxfp8(self.data, self.scale_inv, colwise=self.is_colwise,
                                      flatten_axis=self.flatten_axis, out_dtype=self.dq_dtype)
        else:
            raise NotImplementedError(BLOCK_DEQUANTIZE_PENDING.format(mode=mode.name))
        if self.data_layout == "T":
            values = jnp.transpose(values, rowwise_permutation(self.ndim, self.flatten_axis))
        return values


@dataclasses.dataclass(frozen=True, eq=False)
class ScaledTensor2x(ScaledTensor):
    rowwise_tensor: ScaledTensor1x
    colwise_tensor: ScaledTensor1x

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rowwise_tensor.shape

    @property
    def amax(self) -> jax.Array | None:
        return self.rowwise_tensor.amax

    @property
    def ndim(self) -> int:
        return self.rowwise_tensor.ndim

    def get_tensor(self, usage: TensorUsage | bool | None = None, *, colwise: bool | None = None
                   ) -> ScaledTensor1x:
        """The copy a GEMM takes for `usage` (a TensorUsage, as in TE: module doc), or
        lowbit's spelling get_tensor(colwise=True / False)."""
        if isinstance(usage, (bool, np.bool_)) and colwise is None:
            usage, colwise = None, bool(usage)
        if (usage is None) == (colwise is None):
            raise TypeError("ScaledTensor2x.get_tensor: pass a TensorUsage or colwise=, not both "
                            f"or neither (got usage={usage!r}, colwise={colwise!r})")
        if usage is not None:
            colwise = _check_usage(usage).takes_colwise
        return self.colwise_tensor if colwise else self.rowwise_tensor

    def get_rowwise_tensor(self) -> ScaledTensor1x:
        return self.rowwise_tensor

    def get_colwise_tensor(self) -> ScaledTensor1x:
        return self.colwise_tensor

    def dequantize(self) -> jax.Array:
        return self.rowwise_tensor.dequantize()


jax.tree_util.register_dataclass(
    ScaledTensor1x,
    data_fields=["data", "scale_inv", "amax"],
    meta_fields=["scaling_mode", "dq_dtype", "is_colwise", "flatten_axis"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4Tensor1x(ScaledTensor1x):
    """One NVFP4 copy: `data` packed E2M1 (uint8, 2-D: rowwise (R, ceil(C/2)), colwise the
    transpose (C, ceil(R/2))), `scale_inv` the E4M3 block scales, `global_scale_inv` (1,) f32,
    `rht_sign_bits` (1,) uint32 when the copy went through the RHT (else None), and the
    logical shape (lowbit.ops.quantize_nvfp4 has the layouts)."""

    global_scale_inv: jax.Array | None = None
    rht_sign_bits: jax.Array | None = None
    logical_shape: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.logical_shape)

    @property
    def ndim(self) -> int:
        return len(self.logical_shape)

    def dequantize(self, dtype=None) -> jax.Array:
        """(e2m1 * e4m3 scale) * global_scale_inv (RHT undone) in the logical layout."""
        from lowbit.ops.quantize_nvfp4 import dequantize_nvfp4

        shape, f = tuple(self.logical_shape), self.flatten_axis
        rows, cols = int(np.prod(shape[:f], dtype=np.int64)), int(np.prod(shape[f:], dtype=np.int64))
        values = dequantize_nvfp4(self.data, self.scale_inv, self.global_scale_inv,
                                  cols=rows if self.is_colwise else cols,
                                  rht_sign_bits=self.rht_sign_bits, out_dtype=jnp.float32)
        if self.is_colwise:
            values = values.T
        return values.reshape(shape).astype(self.dq_dtype if dtype is None else dtype)


jax.tree_util.register_dataclass(
    NVFP4Tensor1x,
    data_fields=["data", "scale_inv", "amax", "global_scale_inv", "rht_sign_bits"],
    meta_fields=["scaling_mode", "dq_dtype", "is_colwise", "flatten_axis", "logical_shape"],
)
jax.tree_util.register_dataclass(
    ScaledTensor2x, data_fields=["rowwise_tensor", "colwise_tensor"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True, eq=False)
class NoScaleTensor:
    """A high-precision array in TE's tensor interface (module doc): `data`, and `amax` (its
    max |data|, (1,) f32) where the op that made it computed one, else None."""

    data: jax.Array
    amax: jax.Array | None = None
    # No check of the fields' types: JAX rebuilds pytrees with other leaves (vmap's in_axes,
    # tree.map's results, eval_shape's ShapeDtypeStructs).

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    def dequantize(self) -> jax.Array:
        """The data itself: nothing to undo."""
        return self.data

    def get_tensor(self, usage: TensorUsage) -> "NoScaleTensor":
        """Itself, for every usage (a high-precision GEMM operand takes any layout)."""
        _check_usage(usage)
        return self

    def apply_sharding_constraint_by_logical_axes(self, logical_axis_names) -> "NoScaleTensor":
        """The data under lowbit.sharding.with_sharding_constraint_by_logical_axes."""
        from lowbit.sharding_mesh import with_sharding_constraint_by_logical_axes

        if not logical_axis_names:
            return self
        return NoScaleTensor(with_sharding_constraint_by_logical_axes(self.data, logical_axis_names), self.amax)

    def checkpoint(self, quantizer) -> "NoScaleTensor":
        """Itself; a quantizer is an error (there is nothing quantized to checkpoint), as in TE."""
        if quantizer is not None:
            raise ValueError("NoScaleTensor.checkpoint: quantizer: expected None (a NoScaleTensor "
                             f"holds no quantized data), got {type(quantizer).__name__}")
        return self


jax.tree_util.register_dataclass(NoScaleTensor, data_fields=["data", "amax"], meta_fields=[])
