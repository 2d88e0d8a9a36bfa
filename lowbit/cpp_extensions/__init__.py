"""lowbit.cpp_extensions: TE's import path transformer_engine.jax.cpp_extensions, so that
code calling TE's norm and quantize entry points directly ports by changing its imports.

A thin shim over lowbit's own ops (lowbit.ops.norm_forward / norm_backward,
lowbit.layernorm.norm_quantize, the lowbit.quantize quantizers): no numerics live here.
normalization.py and quantization.py say where they differ from TE.
"""

from lowbit.cpp_extensions.gemm import (
    CollectiveOp,
    CollectiveOpSet,
    gemm,
    gemm_uses_jax_dot,
    get_non_contracting_dims,
    noop_collective_op_set,
    sanitize_dims,
    transpose_dims,
)
from lowbit.cpp_extensions.normalization import (
    layernorm_bwd,
    layernorm_fwd,
    normalization_bwd,
    normalization_fwd,
    rmsnorm_bwd,
    rmsnorm_fwd,
)
from lowbit.cpp_extensions.quantization import dequantize, quantize, quantize_dbias

__all__ = [
    "CollectiveOp",
    "CollectiveOpSet",
    "dequantize",
    "gemm",
    "gemm_uses_jax_dot",
    "get_non_contracting_dims",
    "noop_collective_op_set",
    "sanitize_dims",
    "transpose_dims",
    "layernorm_bwd",
    "layernorm_fwd",
    "normalization_bwd",
    "normalization_fwd",
    "quantize",
    "quantize_dbias",
    "rmsnorm_bwd",
    "rmsnorm_fwd",
]
