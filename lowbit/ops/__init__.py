"""lowbit.ops: JAX primitives over lowbit's FFI targets, one module per op family."""

from lowbit.ops.activation import ActBackwardOut, ActForwardOut, act_backward, act_forward
from lowbit.ops.amax import amax
from lowbit.ops.dense_backward import dense_backward_fp8, dense_backward_fp8_sharded, dense_backward_plan
from lowbit.ops.formats import decode, encode
from lowbit.ops.gemm import GemmScaleMode, gemm
from lowbit.ops.norm import NormForwardOut, norm_backward, norm_forward
from lowbit.ops.softmax import softmax_backward, softmax_forward
from lowbit.ops.quantize import Fp8Quantized, dequantize_fp8, quantize_fp8
from lowbit.ops.quantize_block import BlockQuantized, dequantize_fp8_block, dequantize_mxfp8, quantize_fp8_block, quantize_mxfp8
from lowbit.ops.quantize_grouped import GroupedFp8Quantized, quantize_grouped_fp8
from lowbit.ops.quantize_grouped_block import grouped_block_offsets, grouped_block_slice, quantize_grouped_block
# The function takes the name of its module here, as gemm does (the module stays importable:
# `from lowbit.ops.quantize_nvfp4 import ...`, importlib.import_module).
from lowbit.ops.quantize_nvfp4 import Nvfp4Quantized, dequantize_nvfp4, quantize_nvfp4
from lowbit.ops.quantize_grouped_nvfp4 import grouped_nvfp4_offsets, grouped_nvfp4_slice, quantize_grouped_nvfp4
from lowbit.ops.scale import compute_scale, scale_inverse, update_delayed_scaling

__all__ = ["ActBackwardOut", "ActForwardOut", "act_backward", "act_forward", "softmax_backward", "softmax_forward", "amax", "dense_backward_fp8", "dense_backward_fp8_sharded", "dense_backward_plan", "decode", "encode", "gemm", "GemmScaleMode", "NormForwardOut", "norm_backward", "norm_forward", "Fp8Quantized", "BlockQuantized", "dequantize_fp8_block", "dequantize_mxfp8", "quantize_fp8_block", "quantize_mxfp8", "dequantize_fp8", "quantize_fp8", "compute_scale", "scale_inverse", "update_delayed_scaling", "GroupedFp8Quantized", "quantize_grouped_block", "quantize_grouped_fp8", "grouped_block_offsets", "grouped_block_slice", "Nvfp4Quantized", "dequantize_nvfp4", "quantize_nvfp4", "grouped_nvfp4_offsets", "grouped_nvfp4_slice", "quantize_grouped_nvfp4"]
