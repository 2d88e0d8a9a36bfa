"""lowbit.quantize: scaling modes, ScaledTensor pytrees, quantizers, autocast (pure Python).

The kernels live in lowbit.ops; this package decides which to call with which scales and
carries the quantized tensors and the quantizer state as pytrees.
"""

from lowbit.quantize.delayed import compute_scale, update_delayed_scaling
from lowbit.quantize.helper import (
    QuantizerFactory,
    autocast,
    fp8_autocast,
    get_global_mesh_resource,
    get_global_recipe,
    is_quantization_enabled,
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
from lowbit.quantize.tensor import ScaledTensor, ScaledTensor1x, ScaledTensor2x

__all__ = [
    "BlockScaleQuantizer",
    "CurrentScaleQuantizer",
    "DataFamily",
    "DelayedScaleQuantizer",
    "GemmAccumulation",
    "NVFP4Quantizer",
    "QuantizeLayout",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "ScaledTensor",
    "ScaledTensor1x",
    "ScaledTensor2x",
    "ScalingMode",
    "autocast",
    "compute_scale",
    "fp8_autocast",
    "get_global_mesh_resource",
    "get_global_recipe",
    "is_quantization_enabled",
    "noop_quantizer_set",
    "update_delayed_scaling",
]
