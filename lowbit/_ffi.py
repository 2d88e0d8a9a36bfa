"""Loads lowbit's shared libraries once and registers every XLA FFI target.

`TARGETS` is the one table of FFI targets: target name -> handler symbol prefix. The CPU
library (lib/liblowbit.so) exports `<prefix>Cpu` for every target and is registered for
platform "cpu" always; the CUDA library (lib/liblowbit_cuda.so, present when lowbit was
built with nvcc) exports `<prefix>Cuda` and is registered for platform "CUDA" when a GPU is
visible and the library holds device code for it (`LowbitCudaArchProbe`, one call per compute
capability among JAX's GPUs: the default build is sm_90a and sm_100a machine code, which runs
on compute capability 9.0 and 10.0 only). A missing or stale library raises
`LowbitLibraryError` saying how to rebuild; a GPU without device code gets that error, naming
the GPU and the build's -gencode flags, when an op is lowered for it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import jax

ABI_VERSION = 1

TARGETS: dict[str, str] = {
    "lowbit_amax": "LowbitAmax",
    "lowbit_encode": "LowbitEncode",
    "lowbit_decode": "LowbitDecode",
    "lowbit_act_forward": "LowbitActForward",
    "lowbit_act_backward": "LowbitActBackward",
    "lowbit_softmax_forward": "LowbitSoftmaxForward",
    "lowbit_softmax_backward": "LowbitSoftmaxBackward",
    "lowbit_norm_forward": "LowbitNormForward",
    "lowbit_norm_backward": "LowbitNormBackward",
    "lowbit_quantize_fp8": "LowbitQuantizeFp8",
    "lowbit_dequantize_fp8": "LowbitDequantizeFp8",
    "lowbit_quantize_fp8_block": "LowbitQuantizeFp8Block",
    "lowbit_dequantize_fp8_block": "LowbitDequantizeFp8Block",
    "lowbit_quantize_mxfp8": "LowbitQuantizeMxfp8",
    "lowbit_dequantize_mxfp8": "LowbitDequantizeMxfp8",
    "lowbit_act_quantize_block": "LowbitActQuantizeBlock",
    "lowbit_norm_quantize_block": "LowbitNormQuantizeBlock",
    "lowbit_quantize_nvfp4": "LowbitQuantizeNvfp4",
    "lowbit_gemm": "LowbitGemm",
    "lowbit_gemm_swizzle_scales": "LowbitGemmSwizzleScales",
    "lowbit_gemm_nvfp4": "LowbitGemmNvfp4",
    "lowbit_gemm_accumulate": "LowbitGemmAccumulate",
    "lowbit_quantize_fp8_block_colwise_rows": "LowbitQuantizeFp8BlockColwiseRows",
    "lowbit_compute_scale": "LowbitComputeScale",
    "lowbit_scale_inverse": "LowbitScaleInverse",
    "lowbit_update_delayed_scaling": "LowbitUpdateDelayedScaling",
    "lowbit_quantize_grouped_fp8": "LowbitQuantizeGroupedFp8",
    "lowbit_quantize_grouped_block": "LowbitQuantizeGroupedBlock",
    "lowbit_quantize_grouped_nvfp4": "LowbitQuantizeGroupedNvfp4",
    "lowbit_dense_backward_fp8": "LowbitDenseBackwardFp8",
}

# Targets with a CPU handler only (no CUDA kernel yet): the CUDA library need not export
# them, and their ops lower to an exact jnp twin on the GPU instead (see each op's module).
CPU_ONLY_TARGETS: dict[str, str] = {}

_REBUILD = (
    "rebuild it from the source tree with `pip install --no-build-isolation -e .` "
    "(or `pip install .`), or point LOWBIT_LIBRARY_DIR at a folder holding a current build"
)


# The CUDA library's probe for device code (csrc/common/arch_probe.cu).
CUDA_ARCH_PROBE = "LowbitCudaArchProbe"
_REBUILD_CUDA = (
    "Rebuild lowbit for this GPU with nvcc (CUDA 12.8+; on a GPU other than compute capability "
    "9.0 or 10.0 also LOWBIT_CUDA_ARCH_FLAGS, e.g. `pip install --no-build-isolation "
    "-Ccmake.define.LOWBIT_CUDA_ARCH_FLAGS=-gencode=arch=compute_89,code=sm_89 .`: untested), or "
    "run on the CPU with JAX_PLATFORMS=cpu."
)


class LowbitLibraryError(RuntimeError):
    """The native library is missing, stale, or lacks the backend an op was lowered for."""


class _State:
    lock = threading.Lock()
    cpu: ctypes.CDLL | None = None
    cpu_path: Path | None = None
    cuda: ctypes.CDLL | None = None
    cuda_path: Path | None = None
    cuda_error: str | None = None
    cuda_registered = False
    loaded = False


def _search_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("LOWBIT_LIBRARY_DIR"):
        dirs.append(Path(os.environ["LOWBIT_LIBRARY_DIR"]))
    import lowbit

    # Editable installs spread the package over the source tree and site-packages.
    for entry in getattr(lowbit, "__path__", []):
        dirs.append(Path(entry) / "lib")
    # The source tree put first on sys.path shadows an install's package folder: look in
    # every lowbit/lib on the path too (the ABI check below still rejects a stale one).
    for entry in sys.path:
        candidate = Path(entry or ".") / "lowbit" / "lib"
        if candidate not in dirs:
            dirs.append(candidate)
    return dirs


def _find(name: str) -> Path | None:
    for d in _search_dirs():
        if (d / name).is_file():
            return d / name
    return None


def _check(lib: ctypes.CDLL, path: Path, suffix: str) -> None:
    try:
        abi = lib.LowbitAbiVersion()
    except AttributeError:
        abi = None
    prefixes = list(TARGETS.values()) + (list(CPU_ONLY_TARGETS.values()) if suffix == "Cpu" else [])
    missing = [p + suffix for p in prefixes if not hasattr(lib, p + suffix)]
    if suffix == "Cuda" and not hasattr(lib, CUDA_ARCH_PROBE):
        missing.append(CUDA_ARCH_PROBE)
    if abi != ABI_VERSION or missing:
        raise LowbitLibraryError(
            f"lowbit: {path} is stale (ABI {abi}, this lowbit expects {ABI_VERSION}"
            + (f"; missing handlers {', '.join(missing)}" if missing else "")
            + f"): {_REBUILD}"
        )


def _gpu_present() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def _build_info(lib: ctypes.CDLL) -> str:
    """The library's LowbitBuildInfo string (version, ABI, flavor, the CUDA build's flags)."""
    build = lib.LowbitBuildInfo
    build.restype = ctypes.c_char_p
    return build().decode()


def _gpus_without_device_code(lib: ctypes.CDLL, path: Path) -> str | None:
    """Why `lib`'s kernels cannot run on a GPU JAX uses, or None when they run on all of them:
    LowbitCudaArchProbe on one device per compute capability (a probe that cannot tell, e.g.
    a device JAX numbers differently, blocks nothing)."""
    probe = getattr(lib, CUDA_ARCH_PROBE)
    probe.argtypes, probe.restype = [ctypes.c_int], ctypes.c_int
    one_per_capability = {}
    for device in jax.devices("gpu"):
        one_per_capability.setdefault(str(getattr(device, "compute_capability", "?")), device)
    for capability, device in one_per_capability.items():
        ordinal = getattr(device, "local_hardware_id", None)
        if ordinal is None or probe(int(ordinal)) != 1:
            continue
        return (f"{path} has no device code for {device.device_kind} (compute capability "
                f"{capability}); it was built as `{_build_info(lib)}`")
    return None


def load() -> None:
    """Loads the libraries and registers their targets; later calls return at once."""
    if _State.loaded:
        return
    with _State.lock:
        if _State.loaded:
            return
        path = _find("liblowbit.so")
        if path is None:
            raise LowbitLibraryError(
                "lowbit: liblowbit.so was not found in "
                + ", ".join(str(d) for d in _search_dirs())
                + f": the package was installed without its native library; {_REBUILD}"
            )
        lib = ctypes.cdll.LoadLibrary(str(path))
        _check(lib, path, "Cpu")
        for target, prefix in {**TARGETS, **CPU_ONLY_TARGETS}.items():
            fn = getattr(lib, prefix + "Cpu")
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
        _State.cpu, _State.cpu_path = lib, path

        cuda_path = _find("liblowbit_cuda.so")
        if cuda_path is None:
            _State.cuda_error = "lowbit was built without CUDA (no liblowbit_cuda.so)"
        elif _gpu_present():
            try:
                cuda_lib = ctypes.cdll.LoadLibrary(str(cuda_path))
            except OSError as e:
                _State.cuda_error = f"cannot load {cuda_path}: {e}"
            else:
                _check(cuda_lib, cuda_path, "Cuda")
                _State.cuda, _State.cuda_path = cuda_lib, cuda_path
                _State.cuda_error = _gpus_without_device_code(cuda_lib, cuda_path)
                if _State.cuda_error is None:
                    for target, prefix in TARGETS.items():
                        fn = getattr(cuda_lib, prefix + "Cuda")
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="CUDA")
                    _State.cuda_registered = True
        else:
            _State.cuda_path = cuda_path
            _State.cuda_error = "no GPU is visible to JAX"
        _State.loaded = True


def cpu_library() -> ctypes.CDLL:
    """The loaded CPU library (for its plain C helpers, e.g. LowbitDenseBackwardPlan)."""
    load()
    return _State.cpu


def require_platform(op: str, platform: str) -> None:
    """Raises a clear error when `op` is lowered for a platform lowbit has no handler for."""
    load()
    if platform == "cuda" and op in CPU_ONLY_TARGETS:
        raise LowbitLibraryError(f"{op}: has no CUDA handler (its op lowers to a jnp twin on the GPU)")
    if platform == "cuda" and not _State.cuda_registered:
        raise LowbitLibraryError(f"{op}: cannot lower for CUDA: {_State.cuda_error}. {_REBUILD_CUDA}")


def info() -> dict:
    """What was loaded, for `python -m lowbit`."""
    load()
    out = {
        "cpu_library": str(_State.cpu_path),
        "cpu_build": _build_info(_State.cpu),
        "cuda_library": str(_State.cuda_path) if _State.cuda_path else None,
        "cuda_registered": _State.cuda_registered,
        "cuda_note": _State.cuda_error,
        "platforms": ["cpu"] + (["CUDA"] if _State.cuda_registered else []),
    }
    if _State.cuda is not None:
        out["cuda_build"] = _build_info(_State.cuda)
    return out
