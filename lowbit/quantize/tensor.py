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

`ScaledTensor2x` holds a rowwise and a colwise copy of the same tensor.

Leaves are data, scale_inv and amax; scaling_mode, dq_dtype, is_colwise and flatten_axis
are static pytree metadata, so ScaledTensors pass through jit, scan, vmap and grad.

`dequantize()` is plain jnp for tensor scaling (`(data_f32 * scale_inv).astype(dq_dtype)`),
so XLA fuses it into its consumer; it is the same formula as
`lowbit.ops.quantize.dequantize_fp8`. Block-scaled copies dequantize through
`lowbit.ops.dequantize_fp8_block` / `dequantize_mxfp8` (the same formula per tile).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.quantize.scaling_modes import ScalingMode

__all__ = ["ScaledTensor", "ScaledTensor1x", "ScaledTensor2x", "NVFP4Tensor1x", "colwise_permutation"]

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

    def get_tensor(self, colwise: bool) -> ScaledTensor1x:
        return self.colwise_tensor if colwise else self.rowwise_tensor

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
