"""lowbit.quantize: scaling modes, ScaledTensor pytrees, quantizers, autocast (pure Python).

The kernels live in lowbit.ops; this package decides which to call with which scales and
carries the quantized tensors and the quantizer state as pytrees.
"""

from lowbit.quantize.delayed import compute_scale, compute_scale_from_amax, update_delayed_scaling
from lowbit.quantize.factory import ScaledTensorFactory
from lowbit.quantize.helper import (
    NVTE_FP8_COLLECTION_NAME,
    QuantizerFactory,
    autocast,
    fp8_autocast,
    get_global_mesh_resource,
    get_global_quantize_recipe,
    get_global_recipe,
    is_quantization_enabled,
    update_collections,
)
from lowbit.quantize.quantizer import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    GemmAccumulation,
    NVFP4Quantizer,
    Quantizer,
    QuantizerSet,
    noop_quantizer_set,
)
from lowbit.quantize.scaling_modes import DataFamily, QuantizeLayout, ScalingMode
from lowbit.quantize.support import (
    get_device_compute_capability,
    get_supported_quantization_recipes,
    get_supported_scaling_modes,
    is_fp8_available,
    is_fp8_gemm_with_all_layouts_supported,
    is_scaling_mode_supported,
)
from lowbit.quantize.tensor import NoScaleTensor, ScaledTensor, ScaledTensor1x, ScaledTensor2x, TensorUsage

__all__ = [
    "NVTE_FP8_COLLECTION_NAME",
    "BlockScaleQuantizer",
    "CurrentScaleQuantizer",
    "DataFamily",
    "DelayedScaleQuantizer",
    "GemmAccumulation",
    "NVFP4Quantizer",
    "NoScaleTensor",
    "QuantizeLayout",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "ScaledTensor",
    "ScaledTensor1x",
    "ScaledTensor2x",
    "ScaledTensorFactory",
    "ScalingMode",
    "TensorUsage",
    "autocast",
    "compute_scale",
    "compute_scale_from_amax",
    "fp8_autocast",
    "get_device_compute_capability",
    "get_global_mesh_resource",
    "get_global_quantize_recipe",
    "get_global_recipe",
    "get_supported_quantization_recipes",
    "get_supported_scaling_modes",
    "is_fp8_available",
    "is_quantization_enabled",
    "is_fp8_gemm_with_all_layouts_supported",
    "is_scaling_mode_supported",
    "noop_quantizer_set",
    "update_collections",
    "update_delayed_scaling",
]
