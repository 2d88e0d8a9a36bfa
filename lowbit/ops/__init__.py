"""lowbit.ops: JAX primitives over lowbit's FFI targets, one module per op family."""

from lowbit.ops.amax import amax
from lowbit.ops.formats import decode, encode
from lowbit.ops.norm import NormForwardOut, norm_backward, norm_forward
from lowbit.ops.gemm import gemm
from lowbit.ops.quantize import Fp8Quantized, dequantize_fp8, quantize_fp8

__all__ = ["amax", "decode", "encode", "NormForwardOut", "norm_backward", "norm_forward", "gemm", "Fp8Quantized", "dequantize_fp8", "quantize_fp8"]
