"""`python -m lowbit`'s recipe report: native exactly where lowbit.ops.gemm's CUDA lowerings
put the recipe's GEMMs on cuBLASLt (MXFP8 and NVFP4 on compute capability 10.x only, FP8 block
on 9.0 only, per-tensor FP8 from 8.9), emulated elsewhere; on a GPU without lowbit's CUDA
handlers, nowhere (the lowering error says why)."""

import pytest

from lowbit.__main__ import RECIPES, recipe_support
from lowbit.ops.gemm import mxfp8_on_cublaslt


@pytest.mark.parametrize("cc,native", [
    ((8, 6), set()),
    ((8, 9), {"DelayedScaling", "Float8CurrentScaling"}),
    ((9, 0), {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"}),
    ((10, 0), {"DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"}),
    ((10, 3), {"DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"}),
    ((12, 0), {"DelayedScaling", "Float8CurrentScaling"}),  # not 10.x: no cuBLASLt MXFP8 / NVFP4 path
])
def test_report_follows_the_gemm_gates(cc, native):
    got = recipe_support(cc, cuda_registered=True)
    assert set(got) == set(RECIPES)
    assert {name for name, text in got.items() if text.startswith("native")} == native
    for name in ("MXFP8BlockScaling", "NVFP4BlockScaling"):
        assert (name in native) == mxfp8_on_cublaslt(f"{cc[0]}.{cc[1]}")
    assert all(text.startswith("emulated exactly (needs") for name, text in got.items() if name not in native)


def test_report_without_a_gpu_or_cuda_handlers():
    assert set(recipe_support(None, cuda_registered=False).values()) == {"emulated exactly (CPU reference)"}
    # A GPU without lowbit's CUDA handlers runs no lowbit op at all: not "emulated".
    for cc in ((8, 9), (9, 0), (10, 0)):
        assert all(t.startswith("not on this GPU") for t in recipe_support(cc, cuda_registered=False).values())


def test_gpu_without_device_code_is_a_clear_lowering_error(monkeypatch):
    """What an op lowered for CUDA says when the CUDA library has no device code for the GPU
    (LowbitCudaArchProbe said so at load): the op, the GPU, the build and how to rebuild."""
    from lowbit import _ffi

    _ffi.load()
    why = ("/x/liblowbit_cuda.so has no device code for NVIDIA L4 (compute capability 8.9); it was "
           "built as `lowbit 0.1.0 abi=1 cuda=13.0 -gencode=arch=compute_90a,code=sm_90a`")
    monkeypatch.setattr(_ffi._State, "cuda_registered", False)
    monkeypatch.setattr(_ffi._State, "cuda_error", why)
    with pytest.raises(_ffi.LowbitLibraryError) as err:
        _ffi.require_platform("lowbit_quantize_fp8", "cuda")
    text = str(err.value)
    assert text.startswith("lowbit_quantize_fp8: cannot lower for CUDA: " + why)
    assert "LOWBIT_CUDA_ARCH_FLAGS" in text and "JAX_PLATFORMS=cpu" in text
    _ffi.require_platform("lowbit_quantize_fp8", "cpu")  # the CPU handlers stay registered


def test_stale_cuda_library_without_the_arch_probe_is_refused(tmp_path):
    """A CUDA library that exports every handler but not LowbitCudaArchProbe is stale."""
    from lowbit import _ffi

    class Lib:
        def LowbitAbiVersion(self):
            return _ffi.ABI_VERSION
    lib = Lib()
    for prefix in _ffi.TARGETS.values():
        setattr(lib, prefix + "Cuda", object())
    with pytest.raises(_ffi.LowbitLibraryError, match=_ffi.CUDA_ARCH_PROBE):
        _ffi._check(lib, tmp_path / "liblowbit_cuda.so", "Cuda")
    setattr(lib, _ffi.CUDA_ARCH_PROBE, object())
    _ffi._check(lib, tmp_path / "liblowbit_cuda.so", "Cuda")


@pytest.mark.gpu
def test_arch_probe_on_the_gpu():
    """On a GPU the build has code for (tools/gpu_check.sh builds sm_90a for an H100/H200), the
    probe says so for every GPU JAX uses, and the CUDA handlers are registered; an ordinal with no
    device is an error code (negative), not a verdict."""
    import ctypes

    import jax

    from lowbit import _ffi

    info = _ffi.info()
    assert info["cuda_registered"] and info["cuda_note"] is None, info
    assert "-gencode" in info["cuda_build"] and "sm_90a" in info["cuda_build"], info["cuda_build"]
    probe = getattr(_ffi._State.cuda, _ffi.CUDA_ARCH_PROBE)
    probe.argtypes, probe.restype = [ctypes.c_int], ctypes.c_int
    for device in jax.devices("gpu"):
        assert probe(device.local_hardware_id) == 0, device
    assert probe(4096) < 0
    assert probe(jax.devices("gpu")[0].local_hardware_id) == 0  # the failed call left nothing sticky
