"""lowbit.cpp_extensions: TE's import path transformer_engine.jax.cpp_extensions, so that
code calling TE's entry points directly ports by changing its imports: norm, quantize,
activation, softmax and GEMM (not TE's attention, grouped or collective GEMM).

A thin shim over lowbit's own ops (lowbit.ops.norm_forward / norm_backward,
lowbit.layernorm.norm_quantize, the lowbit.quantize quantizers, lowbit.ops.act_forward /
act_backward, lowbit.ops.softmax_forward / softmax_backward, lowbit.ops.gemm): no numerics
live here. Without a quantizer the entry points return NoScaleTensors, as TE 2.12's do. Each
module (normalization.py, quantization.py, activation.py, softmax.py, gemm.py, amax.py) says
where it differs from TE.
"""

from lowbit.cpp_extensions.activation import (
    ActivationParams,
    ClampedSwigluParams,
    act_lu,
    dact_lu,
    quantize_dact_dbias,
)
from lowbit.cpp_extensions.amax import AmaxScope
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
from lowbit.cpp_extensions.softmax import (
    is_softmax_kernel_available,
    jax_scaled_masked_softmax,
    jax_scaled_softmax,
    jax_scaled_upper_triang_masked_softmax,
    scaled_masked_softmax_bwd,
    scaled_masked_softmax_fwd,
    scaled_softmax_bwd,
    scaled_softmax_fwd,
    scaled_upper_triang_masked_softmax_bwd,
    scaled_upper_triang_masked_softmax_fwd,
)

__all__ = [
    "ActivationParams",
    "AmaxScope",
    "ClampedSwigluParams",
    "CollectiveOp",
    "CollectiveOpSet",
    "act_lu",
    "dact_lu",
    "dequantize",
    "gemm",
    "gemm_uses_jax_dot",
    "get_non_contracting_dims",
    "is_softmax_kernel_available",
    "jax_scaled_masked_softmax",
    "jax_scaled_softmax",
    "jax_scaled_upper_triang_masked_softmax",
    "layernorm_bwd",
    "layernorm_fwd",
    "noop_collective_op_set",
    "normalization_bwd",
    "normalization_fwd",
    "quantize",
    "quantize_dact_dbias",
    "quantize_dbias",
    "rmsnorm_bwd",
    "rmsnorm_fwd",
    "sanitize_dims",
    "scaled_masked_softmax_bwd",
    "scaled_masked_softmax_fwd",
    "scaled_softmax_bwd",
    "scaled_softmax_fwd",
    "scaled_upper_triang_masked_softmax_bwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "transpose_dims",
]
