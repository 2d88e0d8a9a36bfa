"""docs/usage.md stays true: its Python blocks run, in order, in one namespace, on whatever
backend the suite runs on (the CPU in CI). Each block asserts what it shows (shapes, the
delayed-scaling state changing from step to step), so a block that runs but no longer does
what the page says fails here."""

from __future__ import annotations

import os
import re
import sys
import types
import warnings

import pytest

PAGE = os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_usage_page_has_blocks():
    with open(PAGE) as f:
        blocks = python_blocks(f.read())
    assert len(blocks) >= 6, "docs/usage.md: expected its examples as ```python blocks"


def test_usage_page_blocks_run_in_order():
    with open(PAGE) as f:
        blocks = python_blocks(f.read())
    # A registered module, as Flax's dataclass transform looks classes' modules up in sys.modules.
    module = types.ModuleType("lowbit_docs_usage")
    sys.modules[module.__name__] = module
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the page shows current APIs
            warnings.simplefilter("ignore", UserWarning)  # the emulation notices (NVFP4, the CPU)
            for i, block in enumerate(blocks):
                try:
                    exec(compile(block, f"docs/usage.md block {i}", "exec"), module.__dict__)
                except Exception as e:  # noqa: BLE001 - name the block that broke
                    pytest.fail(f"docs/usage.md python block {i} failed: {type(e).__name__}: {e}\n{block}")
    finally:
        del sys.modules[module.__name__]


def test_quantizers_the_page_names_are_lowbit_ops_functions():
    """The page's table of quantized copies names each quantizer of `lowbit.ops`; every name
    of lowbit's and lowbit.ops' __all__ resolves."""
    import lowbit

    with open(PAGE) as f:
        text = f.read()
    section = text[text.index("## Quantized copies"):]
    section = section[:section.index("\n## ", 1)]
    names = set(re.findall(r"^\| [^|]*\(`(\w+)`", section, flags=re.M))
    assert {"quantize_fp8", "quantize_fp8_block", "quantize_mxfp8", "quantize_nvfp4"} <= names
    for name in names:
        assert callable(getattr(lowbit.ops, name)), f"lowbit.ops.{name}"
    for mod in (lowbit, lowbit.ops):
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{mod.__name__}.{name}"
    assert lowbit.flax.nnx.DenseGeneral.__module__ == "lowbit.flax.nnx"  # an attribute, as the page uses it
