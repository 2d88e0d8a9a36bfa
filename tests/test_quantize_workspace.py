"""The CUDA quantizers' dbias workspace is a result of their custom call, which XLA plans with
the program's memory (csrc/ffi/ffi_util.h: WorkspaceFromResult), not run-time scratch: the
CUDA lowering declares it with the size of the C++ formula (one fp32 row of column sums per
kernel tile of rows, only with dbias) and the op's outputs leave it out; the CUDA handler
rejects a workspace too small. The lowering is checked on any machine (lowered for CUDA, not
compiled), the handler on a GPU."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.ops.quantize import quantize_fp8
from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8
from lowbit.ops.quantize_grouped import quantize_grouped_fp8
from lowbit.ops.quantize_grouped_block import quantize_grouped_block
from lowbit.ops.quantize_grouped_nvfp4 import quantize_grouped_nvfp4

BF16, F32 = jnp.bfloat16, jnp.float32
# op -> (custom call target, the CUDA kernel's tile rows: quantize.h kQuantizeTileRows,
# block_dbias.h kFp8BlockDbiasTileRows / kMxfp8DbiasTileRows)
OPS = {
    "fp8": ("lowbit_quantize_fp8", 64,
            lambda x, dbias: quantize_fp8(x, jnp.ones((1,), F32), compute_dbias=dbias)),
    "fp8_block": ("lowbit_quantize_fp8_block", 128,
                  lambda x, dbias: quantize_fp8_block(x, compute_dbias=dbias)),
    "fp8_block_128x128": ("lowbit_quantize_fp8_block", 128,
                          lambda x, dbias: quantize_fp8_block(x, tile_2d=True, compute_dbias=dbias)),
    "mxfp8": ("lowbit_quantize_mxfp8", 64, lambda x, dbias: quantize_mxfp8(x, compute_dbias=dbias)),
}


def _cuda_results(monkeypatch, target, fn, *args):
    """The result types of each `target` custom call of jit(fn)(*args) lowered for CUDA."""
    monkeypatch.setattr(importlib.import_module("lowbit._ffi"), "require_platform", lambda op, platform: None)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    pattern = re.compile(rf"stablehlo\.custom_call @{target}\(.*\) -> \((.*)\)")
    return [re.findall(r"tensor<([^>]*)>", m.group(1)) for m in map(pattern.search, text.splitlines()) if m]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dbias", [True, False], ids=["dbias", "no_dbias"])
@pytest.mark.parametrize("shape", [(3, 100, 384), (257, 130)], ids=str)
def test_cuda_lowering_declares_the_workspace(monkeypatch, op, dbias, shape):
    target, tile_rows, fn = OPS[op]
    x = jnp.zeros(shape, BF16)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    want = -(-rows // tile_rows) * cols * 4 if dbias else 0
    (results,) = _cuda_results(monkeypatch, target, lambda x: fn(x, dbias), x)
    assert results[-1] == f"{want}xui8"
    # the CPU lowering has no such result, and the op's outputs are unchanged
    cpu_text = jax.jit(lambda x: fn(x, dbias)).lower(x).as_text()
    cpu_results = re.search(rf"stablehlo\.custom_call @{target}\(.*\) -> \((.*)\)", cpu_text).group(1)
    assert len(re.findall(r"tensor<", cpu_results)) == len(results) - 1
    assert "xui8" not in cpu_results


# grouped op -> (target, CUDA workspace bytes for G groups: the group tables of
# csrc/quantize/quantize_grouped*.h, *WorkspaceBytes)
GROUPED = {
    "grouped_fp8": ("lowbit_quantize_grouped_fp8", lambda g: 4 * g,
                    lambda x, sizes: quantize_grouped_fp8(x, sizes, jnp.ones(sizes.shape, F32), colwise=True)),
    "grouped_block": ("lowbit_quantize_grouped_block", lambda g: (g + 1) * 20,
                      lambda x, sizes: quantize_grouped_block(x, sizes, colwise=True)),
    "grouped_nvfp4": ("lowbit_quantize_grouped_nvfp4", lambda g: (g + 1) * 24 + 8 * g,
                      lambda x, sizes: quantize_grouped_nvfp4(x, sizes, colwise=True)),
}


@pytest.mark.parametrize("op", GROUPED)
@pytest.mark.parametrize("groups", [1, 7])
def test_grouped_cuda_lowering_declares_the_workspace(monkeypatch, op, groups):
    target, want, fn = GROUPED[op]
    x, sizes = jnp.zeros((96, 256), BF16), jnp.ones((groups,), jnp.int32)
    (results,) = _cuda_results(monkeypatch, target, fn, x, sizes)
    assert results[-1] == f"{want(groups)}xui8"
    cpu_text = jax.jit(fn).lower(x, sizes).as_text()
    assert "xui8>)" not in re.search(rf"stablehlo\.custom_call @{target}\(.*", cpu_text).group(0).split("->")[1]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fp8", "fp8_block", "mxfp8"])
def test_cuda_handler_rejects_a_short_workspace(op, gpu):
    """The CUDA handler called directly with one byte less than its workspace needs; the same
    call with the full workspace runs and gives the op's dbias, bit for bit."""
    lowbit._ffi.load()
    target, tile_rows, fn = OPS[op]
    qmod = importlib.import_module("lowbit.ops.quantize")
    bmod = importlib.import_module("lowbit.ops.quantize_block")
    rng = np.random.default_rng(7)
    x = jax.device_put(jnp.asarray(rng.standard_normal((300, 256)), BF16), gpu)
    common = dict(out_dtype=jnp.dtype(jnp.float8_e4m3fn), rowwise=True, colwise=True, dbias_dtype=jnp.dtype(BF16))
    if op == "fp8":
        prim, args, attrs = qmod.quantize_fp8_p, (x, jax.device_put(jnp.ones((1,), F32), gpu)), {}
    elif op == "fp8_block":
        prim, args, attrs = bmod.quantize_fp8_block_p, (x,), dict(tile_2d=np.bool_(False), pow2_scales=np.bool_(False))
    else:
        prim, args, attrs = bmod.quantize_mxfp8_p, (x,), {}
    attrs["flatten_axis"] = np.int32(1)
    res = list(jax.eval_shape(lambda *a: prim.bind(*a, **attrs, **common), *args))
    need = -(-300 // tile_rows) * 256 * 4
    call = lambda n: jax.block_until_ready(jax.jit(  # noqa: E731
        lambda *a: jax.ffi.ffi_call(target, res + [jax.ShapeDtypeStruct((n,), jnp.uint8)])(*a, **attrs))(*args))
    with pytest.raises(Exception, match=rf"{target}: workspace: expected u8 of shape \(n,\) with n >= {need}"):
        call(need - 1)
    dbias = np.asarray(call(need)[-2])
    want = np.asarray(fn(x, True).dbias)
    assert dbias.dtype == want.dtype == jnp.dtype(BF16)
    np.testing.assert_array_equal(dbias.view(np.uint16), want.view(np.uint16))
