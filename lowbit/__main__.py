"""`python -m lowbit`: the environment report, then a tiny end-to-end demo.

Prints lowbit's, jax's and jaxlib's versions, the CUDA versions, the native libraries
loaded and the platforms their handlers are registered for, the GPU and its compute
capability, and for each recipe whether it runs natively here or is emulated exactly.
`--demo` (the default) then runs lowbit.ops.amax on the default device and checks it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import lowbit
from lowbit import _ffi
from lowbit.quantize.support import RECIPE_GATES, local_gpus


# Each recipe's hardware-GEMM gate and the devices it names: lowbit.quantize.support, which
# also answers TE's is_scaling_mode_supported.
RECIPES = RECIPE_GATES


def _cuda_driver_version() -> str | None:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{(version.value % 1000) // 10}"


def _capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    major, minor = str(cc).split(".")
    return int(major), int(minor)


def recipe_support(cc: tuple[int, int] | None, cuda_registered: bool) -> dict[str, str]:
    """How each recipe's GEMMs run on a GPU of compute capability `cc` (None: no GPU). A GPU
    without lowbit's CUDA handlers (no CUDA library, or none with device code for it: the
    report's cuda_note says which) runs no lowbit op; the CPU does (JAX_PLATFORMS=cpu)."""
    recipes = {}
    for name, (native_on, needs) in RECIPES.items():
        if cc is not None and not cuda_registered:
            recipes[name] = "not on this GPU (see cuda_note); on the CPU with JAX_PLATFORMS=cpu"
        elif cc is not None and native_on(f"{cc[0]}.{cc[1]}"):
            recipes[name] = f"native (sm_{cc[0]}{cc[1]})"
        elif cc is not None:
            recipes[name] = f"emulated exactly (needs {needs})"
        else:
            recipes[name] = "emulated exactly (CPU reference)"
    return recipes


def report() -> dict:
    info = _ffi.info()
    gpus = local_gpus()
    cc = _capability(gpus[0]) if gpus else None
    recipes = recipe_support(cc, info["cuda_registered"])
    return {
        "lowbit": lowbit.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version.split()[0],
        "cuda_driver": _cuda_driver_version(),
        "cpu_library": info["cpu_library"],
        "cpu_build": info["cpu_build"],
        "cuda_library": info["cuda_library"],
        "cuda_build": info.get("cuda_build"),
        "cuda_note": info["cuda_note"],
        "platforms_registered": info["platforms"],
        "default_backend": jax.default_backend(),
        "gpu": [f"{d.device_kind} (compute capability {d.compute_capability})" for d in gpus],
        "recipes": recipes,
    }


def demo() -> bool:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1023, 257)) * 3).astype(jnp.bfloat16)
    x[17, 31] = -12.5
    got = float(jax.jit(lowbit.ops.amax)(x))
    want = float(np.max(np.abs(x.astype(np.float32))))
    ok = got == want
    print(f"demo: lowbit.ops.amax on {jax.default_backend()} of a (1023, 257) bf16 tensor = "
          f"{got} (numpy: {want}) -> {'OK' if ok else 'MISMATCH'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit", description=__doc__.splitlines()[0])
    parser.add_argument("--no-demo", action="store_true", help="print the report only")
    args = parser.parse_args(argv)
    for key, value in report().items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:22s} {v}")
        else:
            print(f"{key:24s} {value}")
    if args.no_demo:
        return 0
    return 0 if demo() else 1


if __name__ == "__main__":
    sys.exit(main())
