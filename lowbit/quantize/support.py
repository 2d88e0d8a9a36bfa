"""Which scaling modes and recipes run on this machine's GPUs natively, in TransformerEngine's
names (transformer_engine.jax.quantize: is_scaling_mode_supported, is_fp8_available,
get_supported_scaling_modes, get_supported_quantization_recipes, get_device_compute_capability),
so that TE code that picks its recipe with them ports unchanged.

"Supported" keeps TE's meaning: the mode's GEMMs have a hardware path (cuBLASLt) on the GPU
and lowbit's kernels have device code for it. lowbit also runs every mode where this says
False, as an exact emulation (the CPU, and GPUs without the hardware GEMM) with a one-time
notice: the reason string says so. The predicates per recipe are those of the CUDA lowerings
(lowbit.ops.gemm_config) and of `python -m lowbit`'s report, which reads RECIPE_GATES.
"""

from __future__ import annotations

import jax

from lowbit.ops.gemm_config import FP8_BLOCK_MODES, block_on_cublaslt, mxfp8_on_cublaslt
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                           NVFP4BlockScaling)

__all__ = [
    "RECIPE_GATES",
    "get_device_compute_capability",
    "get_supported_quantization_recipes",
    "get_supported_scaling_modes",
    "is_fp8_available",
    "is_fp8_gemm_with_all_layouts_supported",
    "is_scaling_mode_supported",
]


def _tensor_fp8_native(capability: str) -> bool:
    """Per-tensor FP8 GEMMs: cuBLASLt on compute capability 8.9 and up (DESIGN.md section 4)."""
    major, minor = (int(v) for v in capability.split("."))
    return (major, minor) >= (8, 9)


def _fp8_block_native(capability: str) -> bool:
    return block_on_cublaslt(FP8_BLOCK_MODES, capability)


# Each recipe's hardware-GEMM gate on a CUDA device of compute capability "major.minor", and
# the devices it names. MXFP8's and NVFP4's cuBLASLt paths (10.x only) are compiled in but
# were never run on a Blackwell GPU.
RECIPE_GATES = {
    "DelayedScaling": (_tensor_fp8_native, "sm_89+"),
    "Float8CurrentScaling": (_tensor_fp8_native, "sm_89+"),
    "Float8BlockScaling": (_fp8_block_native, "sm_90"),
    "MXFP8BlockScaling": (mxfp8_on_cublaslt, "sm_100 (compute capability 10.x)"),
    "NVFP4BlockScaling": (mxfp8_on_cublaslt, "sm_100 (compute capability 10.x)"),
}
_MODE_RECIPE = {
    ScalingMode.DELAYED_TENSOR_SCALING: "DelayedScaling",
    ScalingMode.CURRENT_TENSOR_SCALING: "Float8CurrentScaling",
    ScalingMode.FP8_BLOCK_1x128: "Float8BlockScaling",
    ScalingMode.FP8_BLOCK_128x128: "Float8BlockScaling",
    ScalingMode.MXFP8_1D_SCALING: "MXFP8BlockScaling",
    ScalingMode.NVFP4_1D_SCALING: "NVFP4BlockScaling",
    ScalingMode.NVFP4_2D_SCALING: "NVFP4BlockScaling",
}
_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def local_gpus():
    """This process's GPUs (none on a CPU-only jax)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def get_device_compute_capability(gpu_id: int = 0) -> int:
    """The compute capability of GPU `gpu_id` as TE writes it (90 for 9.0); 0 when there is
    no such GPU (the CPU)."""
    gpus = local_gpus()
    if isinstance(gpu_id, bool) or not isinstance(gpu_id, int) or gpu_id < 0:
        raise ValueError(f"lowbit.quantize.get_device_compute_capability: gpu_id: expected an int >= 0, "
                         f"got {gpu_id!r}")
    if gpu_id >= len(gpus):
        return 0
    major, minor = str(gpus[gpu_id].compute_capability).split(".")
    return int(major) * 10 + int(minor)


def is_fp8_gemm_with_all_layouts_supported(gpu_id: int = 0) -> bool:
    """TE's query: does GPU `gpu_id`'s FP8 GEMM take every operand layout (Blackwell, compute
    capability 10.x-11.x)? False on Hopper (K-major operands only: lowbit's quantizers then
    write the transposed colwise copies) and on the CPU."""
    return 100 <= get_device_compute_capability(gpu_id) < 120


def _gate(recipe_name: str, gpu_id: int) -> tuple[bool, str]:
    from lowbit import _ffi

    cc = get_device_compute_capability(gpu_id)
    native_on, needs = RECIPE_GATES[recipe_name]
    if cc == 0:
        return False, (f"no GPU {gpu_id}: lowbit runs {recipe_name} as an exact emulation here "
                       f"(its GEMMs need {needs})")
    if not _ffi.info()["cuda_registered"]:
        return False, "lowbit's CUDA library is not loaded for this GPU (python -m lowbit says why)"
    if not native_on(f"{cc // 10}.{cc % 10}"):
        return False, (f"{recipe_name}'s GEMMs need {needs}, GPU {gpu_id} is sm_{cc}: lowbit "
                       "runs them as an exact emulation")
    return True, ""


def _check_mode(scaling_mode) -> ScalingMode:
    if not isinstance(scaling_mode, ScalingMode):
        raise TypeError(f"lowbit.quantize.is_scaling_mode_supported: scaling_mode: expected a "
                        f"lowbit.quantize.ScalingMode, got {scaling_mode!r}")
    return scaling_mode


def is_scaling_mode_supported(scaling_mode=ScalingMode.NO_SCALING, gpu_id=None) -> tuple[bool, str]:
    """(True, "") when `scaling_mode`'s GEMMs run natively on GPU `gpu_id` (None: on every
    local GPU); else (False, why). NO_SCALING is always supported."""
    mode = _check_mode(scaling_mode)
    if mode == ScalingMode.NO_SCALING:
        return True, ""
    ids = [gpu_id] if gpu_id is not None else list(range(max(1, len(local_gpus()))))
    for i in ids:
        ok, why = _gate(_MODE_RECIPE[mode], i)
        if not ok:
            return ok, why
    return True, ""


def is_fp8_available(scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING, gpu_id=None) -> tuple[bool, str]:
    """TE's older name of is_scaling_mode_supported (per-tensor delayed scaling by default)."""
    return is_scaling_mode_supported(scaling_mode, gpu_id)


def get_supported_scaling_modes() -> list[ScalingMode]:
    """The scaling modes (NO_SCALING aside) that run natively on every local GPU."""
    return [m for m in ScalingMode if m != ScalingMode.NO_SCALING and is_scaling_mode_supported(m)[0]]


def get_supported_quantization_recipes() -> list:
    """Default instances of the recipes whose GEMMs run natively on every local GPU."""
    n = max(1, len(local_gpus()))
    return [r() for r in _RECIPES if all(_gate(r.__name__, i)[0] for i in range(n))]
