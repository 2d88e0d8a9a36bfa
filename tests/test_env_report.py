"""`python -m lowbit`'s recipe report: native exactly where lowbit.ops.gemm's CUDA lowerings
put the recipe's GEMMs on cuBLASLt (MXFP8 and NVFP4 on compute capability 10.x only, FP8 block
on 9.0 only, per-tensor FP8 from 8.9), emulated elsewhere."""

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
    assert all(t.startswith("emulated") for t in recipe_support((10, 0), cuda_registered=False).values())
