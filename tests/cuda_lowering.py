"""Lowering for CUDA on a machine without a GPU: the lowbit_gemm custom calls a function's
CUDA program holds, so that the Python side of the CUDA path (lowering rules, padding,
argument order) is tested in CPU CI. jax lowers for any platform whose lowering rules are
registered; only compiling needs the device. The lowbit CUDA library need not be loaded
(its check is patched out) and the compute capability is whatever the test says.
"""

from __future__ import annotations

import importlib
import re
from typing import NamedTuple

import jax

_CALL = re.compile(r"stablehlo\.custom_call @lowbit_gemm\((.*?)\) \{(.*)\} : \((.*)\) -> \((.*)\)")


class GemmCall(NamedTuple):
    operand_types: list[str]   # "16x208xf8E4M3FN", ... (a, b, a_scale_inv, b_scale_inv, bias)
    result_types: list[str]    # (out, workspace)
    a_scale_mode: int
    b_scale_mode: int
    use_split_accumulator: bool


def _attr(attrs: str, name: str) -> str:
    match = re.search(rf"\b{name} = ([^,}}]+)", attrs)
    assert match, f"attribute {name} missing in {attrs}"
    return match.group(1).strip()


def cuda_gemm_calls(monkeypatch, fn, *args, capability: str = "9.0") -> list[GemmCall]:
    """The lowbit_gemm custom calls of jit(fn)(*args) lowered for CUDA on a GPU of
    `capability`."""
    gemm_mod = importlib.import_module("lowbit.ops.gemm")
    ffi = importlib.import_module("lowbit._ffi")
    monkeypatch.setattr(gemm_mod, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(ffi, "require_platform", lambda op, platform: None)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = []
    for line in text.splitlines():
        match = _CALL.search(line)
        if match:
            _, attrs, operands, results = match.groups()
            types = lambda s: re.findall(r"tensor<([^>]*)>", s)  # noqa: E731
            calls.append(GemmCall(types(operands), types(results),
                                  int(_attr(attrs, "a_scale_mode").split(":")[0]),
                                  int(_attr(attrs, "b_scale_mode").split(":")[0]),
                                  _attr(attrs, "use_split_accumulator") == "true"))
    assert ("lowbit_gemm" in text) == bool(calls), "a lowbit_gemm call the pattern missed"
    return calls
