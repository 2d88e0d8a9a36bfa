"""lowbit.dense's banded Float8BlockScaling backward (lowbit.dense_block_backward: dy's colwise
copy in bands of tokens, the wgrad accumulated band by band): dx and dbias bit for bit the
plain backward's (LOWBIT_DENSE_BACKWARD=unfused), dw within the fp32 summation error of the
same products, for every tile choice and both scale rules; where it applies and where not; the
band edges and band scale slices; the CUDA program it lowers to; and the compiled step's
temporaries, at least half of dy's colwise copy smaller than the plain backward's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit import dense_block_backward
from lowbit.dense_block_backward import band_edges, k_band_scale
from lowbit.ops.gemm import GemmScaleMode
from lowbit.ops.quantize_block import quantize_fp8_block
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling

U = 2.0**-24
RECIPES = {"default": Float8BlockScaling(), "f32_scales": Float8BlockScaling(use_f32_scales=True),
           "x2": Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
           "g2": Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2)}


@pytest.fixture(autouse=True)
def _one_device(monkeypatch):
    """The suite's process has 8 virtual CPU devices (conftest); the banded backward runs in
    processes with one (single_device), as on one GPU."""
    monkeypatch.setattr(dense_block_backward, "single_device", lambda: True)


def _inputs(rng, m=600, k=300, n=136, kernel_dtype=np.float32):
    x = rng.normal(size=(2, m // 2, k)).astype(jnp.bfloat16)
    w = (rng.normal(size=(k, n)) / np.sqrt(k)).astype(kernel_dtype)
    bias = rng.normal(size=(n,)).astype(jnp.bfloat16)
    dy = rng.normal(size=(2, m // 2, n)).astype(jnp.bfloat16)
    return x, w, bias, dy


def _backward(qs, x, w, bias, dy):
    @jax.jit
    def f(x, w, bias, dy):
        _, vjp = jax.vjp(lambda x, w, b: lowbit.dense(x, w, b, contracting_dims=((2,), (0,)), quantizer_set=qs),
                         x, w, bias)
        return vjp(dy)
    return f(x, w, bias, dy)


def _deq(t):
    return np.asarray(t.dequantize(), np.float64)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("m,k,n", [(600, 300, 136), (1024, 256, 144)], ids=str)  # the second cuBLASLt-ready
def test_banded_equals_the_plain_backward(name, m, k, n, rng, monkeypatch):
    qs = QuantizerFactory.create_set(RECIPES[name])
    x, w, bias, dy = _inputs(rng, m=m, k=k, n=n)
    dx, dw, dbias = _backward(qs, x, w, bias, dy)
    monkeypatch.setenv("LOWBIT_DENSE_BACKWARD", "unfused")
    dx_u, dw_u, dbias_u = _backward(qs, x, w, bias, dy)
    np.testing.assert_array_equal(np.asarray(dx).view(np.uint16), np.asarray(dx_u).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(dbias).view(np.uint16), np.asarray(dbias_u).view(np.uint16))
    # dw: both are fp32 sums of the products of x's and dy's colwise copies over the m tokens
    # (one in two bands), so they differ by at most 2*m*u*sum|p|, plus cuBLASLt's 14-bit inner
    # sums inside each 128-block on a GPU.
    both = dict(is_rowwise=False, is_colwise=True, flatten_axis=2)
    xq, _ = qs.x.quantize(x, **both)
    dyq, _ = qs.dgrad.quantize(dy, **both)
    a, b = _deq(xq).reshape(x.shape[2], -1), _deq(dyq).reshape(dy.shape[2], -1)
    m = a.shape[1]
    gamma = 2 * m * U + (0.0 if jax.default_backend() == "cpu" else 8 * np.sqrt(128) * 2.0**-14)
    bound = gamma * (np.abs(a) @ np.abs(b).T) + 2 * U * np.abs(np.asarray(dw_u, np.float64)) + 1e-30
    assert np.all(np.abs(np.asarray(dw, np.float64) - np.asarray(dw_u, np.float64)) <= bound)
    assert dw.dtype == jnp.float32 and dw.shape == w.shape


def _program(qs, x, w, bias, dy):
    f = lambda x, w, b, dy: jax.vjp(lambda x, w, b: lowbit.dense(  # noqa: E731
        x, w, b, contracting_dims=((2,), (0,)), quantizer_set=qs), x, w, b)[1](dy)
    return jax.jit(f).lower(x, w, bias, dy).as_text()


@pytest.mark.parametrize("case,applies", [("default", True), ("unfused", False), ("devices", False), ("bf16_kernel", False),
                                          ("one_block", False), ("two_blocks", True), ("mxfp8", False),
                                          ("delayed", False)])
def test_where_it_applies(case, applies, rng, monkeypatch):
    recipe = {"mxfp8": MXFP8BlockScaling(), "delayed": DelayedScaling()}.get(case, Float8BlockScaling())
    m = {"one_block": 128, "two_blocks": 130}.get(case, 600)
    # k and n multiples of 16: on a GPU backend the accumulating GEMM is then the custom call
    x, w, bias, dy = _inputs(rng, m=m, k=256, n=144, kernel_dtype=jnp.bfloat16 if case == "bf16_kernel" else np.float32)
    if case == "unfused":
        monkeypatch.setenv("LOWBIT_DENSE_BACKWARD", "unfused")
    if case == "devices":
        monkeypatch.setattr(dense_block_backward, "single_device", lambda: jax.device_count() == 1
                            and len(jax.devices("cpu")) == 1)
        assert len(jax.devices("cpu")) > 1  # conftest's 8 virtual CPU devices
    text = _program(QuantizerFactory.create_set(recipe), x, w, bias, dy)
    assert ("lowbit_gemm_accumulate" in text) == applies
    assert ("lowbit_quantize_fp8_block_colwise_rows" in text) == applies
    if applies:
        bands = len(band_edges(m)) - 1
        assert text.count("@lowbit_quantize_fp8_block_colwise_rows(") == bands
        assert text.count("@lowbit_gemm_accumulate(") == bands - 1


def test_band_edges(monkeypatch):
    assert band_edges(600, 2) == [0, 256, 600]
    assert band_edges(16384, 2) == [0, 8192, 16384]
    assert band_edges(16384, 3) == [0, 5504, 10880, 16384]
    assert band_edges(130, 3) == [0, 128, 130]
    assert band_edges(128, 3) == [0, 128]
    assert band_edges(1000, 3) == [0, 384, 640, 1000]
    assert band_edges(1000) == band_edges(1000, dense_block_backward.BANDS)
    monkeypatch.setenv("LOWBIT_DENSE_BLOCK_BANDS", "4")
    assert band_edges(1024) == [0, 256, 512, 768, 1024]
    monkeypatch.setenv("LOWBIT_DENSE_BLOCK_BANDS", "0")
    with pytest.raises(ValueError, match="LOWBIT_DENSE_BLOCK_BANDS='0': expected a positive integer"):
        band_edges(1024)


@pytest.mark.parametrize("tile_2d,mode", [(False, GemmScaleMode.BLOCK_1x128), (True, GemmScaleMode.BLOCK_128x128)],
                         ids=["1x128", "128x128"])
def test_band_scale_is_the_quantizers_scale_of_the_band(tile_2d, mode, rng):
    """x's colwise copy is the wgrad's a operand (k rows, m columns): the scales of its columns
    [m0, m1) are those the quantizer gives x's rows [m0, m1)."""
    m, k = 700, 260
    x = rng.normal(size=(m, k)).astype(np.float32) * np.exp2(rng.integers(-8, 8, size=(m, 1)))
    full = quantize_fp8_block(x, tile_2d=tile_2d, rowwise=False, colwise=True).colwise_scale
    for m0, m1 in [(0, 256), (256, 700), (384, 512)]:
        band = quantize_fp8_block(x[m0:m1], tile_2d=tile_2d, rowwise=False, colwise=True).colwise_scale
        np.testing.assert_array_equal(np.asarray(k_band_scale(full, mode, k, m, m0, m1)), np.asarray(band))


@pytest.mark.parametrize("m,band_k", [(512, 256), (600, 352)], ids=str)  # 600: the band of 344 padded to 352
def test_cuda_program_accumulates_the_second_band_in_place(m, band_k, rng, monkeypatch):
    from cuda_lowering import cuda_gemm_calls
    monkeypatch.setenv("LOWBIT_DENSE_BLOCK_BANDS", "2")
    x, w, bias, dy = _inputs(rng, m=m, k=256, n=128)
    qs = QuantizerFactory.create_set(Float8BlockScaling())
    f = lambda x, w, b, dy: jax.vjp(lambda x, w, b: lowbit.dense(  # noqa: E731
        x, w, b, contracting_dims=((2,), (0,)), quantizer_set=qs), x, w, b)[1](dy)
    calls = cuda_gemm_calls(monkeypatch, f, x, w, bias, dy)  # patches the capability to 9.0
    # (y is not returned: its GEMM is dead code) the dgrad, then the first band's wgrad
    assert [(c.a_scale_mode, c.b_scale_mode) for c in calls] == [(1, 2), (1, 1)]
    text = jax.jit(f).trace(x, w, bias, dy).lower(lowering_platforms=("cuda",)).as_text()
    acc = [line for line in text.splitlines() if "@lowbit_gemm_accumulate(" in line]
    assert len(acc) == 1
    assert re.search(r"output_operand_alias<output_tuple_indices = \[0\],\s*operand_index = 4", acc[0])
    # x's band (k rows, its tokens) and dy's second band (n rows, the same tokens), dk (k, n) f32
    operands = re.search(r"\} : \((.*)\) ->", acc[0]).group(1)
    assert operands.startswith(f"tensor<256x{band_k}xf8E4M3FN>, tensor<128x{band_k}xf8E4M3FN>")
    assert operands.endswith("tensor<256x128xf32>")


@pytest.mark.cpu_reference  # the CPU's buffer assignment: on a GPU the GEMM workspace dominates at this size
def test_step_temporaries_shrink_by_at_least_half_of_dys_colwise_copy(rng, monkeypatch):
    m, k, n = 2048, 512, 1024
    x, w, bias, dy = _inputs(rng, m=m, k=k, n=n)
    qs = QuantizerFactory.create_set(Float8BlockScaling())

    def temps():
        f = jax.jit(lambda x, w, b, dy: jax.vjp(lambda x, w, b: lowbit.dense(
            x, w, b, contracting_dims=((2,), (0,)), quantizer_set=qs), x, w, b)[1](dy))
        return f.lower(x, w, bias, dy).compile().memory_analysis().temp_size_in_bytes

    banded = temps()
    monkeypatch.setenv("LOWBIT_DENSE_BACKWARD", "unfused")
    plain = temps()
    assert banded <= plain - m * n // 2, (banded, plain)
