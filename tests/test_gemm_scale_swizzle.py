"""The scale swizzle of the sm_100 MXFP8 GEMM (csrc/gemm/scale_swizzle.h): the C++ reference
(lowbit_gemm_swizzle_scales on the CPU), the jnp reference (swizzle_scales_jnp) and an index
loop written from cuBLAS's "1D block scaling factors layout" formula agree bit for bit; the
jnp unswizzle inverts both; entries past valid_rows / valid_cols are zeroed; bad input names
the argument; and on the GPU the CUDA kernel equals the CPU reference bit for bit."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on

gemm_mod = importlib.import_module("lowbit.ops.gemm")
DTYPES = [np.uint8, ml_dtypes.float8_e8m0fnu, ml_dtypes.float8_e4m3fn]
SHAPES = [(128, 4), (256, 8), (384, 12), (128, 36), (512, 4)]


def formula_swizzle(s, valid_rows=None, valid_cols=None):
    """cuBLAS's offset of scale (r, c): tile (r // 128) * (C / 4) + c // 4 of 512 bytes, and
    inside it (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4; zero outside the valid region."""
    bits = np.asarray(s).view(np.uint8)
    rows, cols = bits.shape
    vr = rows if valid_rows is None else valid_rows
    vc = cols if valid_cols is None else valid_cols
    out = np.full(rows * cols, 0xAB, np.uint8)  # every byte must be written
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            out[offset] = bits[r, c] if r < vr and c < vc else 0
    return out


def random_scales(rng, shape, dtype):
    """Every byte value, including the NaN codes (0xFF e8m0, 0x7F / 0xFF e4m3)."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8).view(dtype)


def bits(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_and_jnp_equal_the_documented_formula(dtype, shape, rng, cpu):
    s = random_scales(rng, shape, dtype)
    want = formula_swizzle(s)
    got_cpu = run_on(cpu, gemm_mod.swizzle_scales, s)
    got_jnp = gemm_mod.swizzle_scales_jnp(jnp.asarray(s))
    assert got_cpu.dtype == s.dtype and got_cpu.shape == (s.size,)
    np.testing.assert_array_equal(bits(got_cpu), want)
    np.testing.assert_array_equal(bits(got_jnp), want)


@pytest.mark.parametrize("shape,valid", [((256, 8), (200, 5)), ((128, 4), (1, 1)), ((384, 12), (384, 9)),
                                         ((128, 8), (0, 0)), ((256, 4), (129, 4))], ids=str)
def test_entries_past_the_valid_region_are_zeroed(shape, valid, rng, cpu):
    s = random_scales(rng, shape, ml_dtypes.float8_e8m0fnu)
    want = formula_swizzle(s, *valid)
    np.testing.assert_array_equal(bits(run_on(cpu, lambda x: gemm_mod.swizzle_scales(x, *valid), s)), want)
    np.testing.assert_array_equal(bits(gemm_mod.swizzle_scales_jnp(jnp.asarray(s), *valid)), want)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unswizzle_inverts_swizzle(shape, rng, cpu):
    s = random_scales(rng, shape, ml_dtypes.float8_e4m3fn)
    for swizzled in (run_on(cpu, gemm_mod.swizzle_scales, s), gemm_mod.swizzle_scales_jnp(jnp.asarray(s))):
        back = gemm_mod.unswizzle_scales_jnp(jnp.asarray(swizzled), *shape)
        np.testing.assert_array_equal(bits(back), bits(s))


def test_swizzle_is_not_the_identity(rng, cpu):
    """A guard on the test data: the order really changes (so equality above means something)."""
    s = random_scales(rng, (128, 4), np.uint8)
    assert not np.array_equal(bits(run_on(cpu, gemm_mod.swizzle_scales, s)), s.reshape(-1))


def test_quantizer_scales_swizzle(rng, cpu):
    """The MXFP8 quantizer's scale array (rowwise, padded to 128 x 4) goes through as is."""
    from lowbit.ops.quantize_block import quantize_mxfp8
    x = rng.normal(size=(130, 200)).astype(np.float32) * np.exp2(rng.integers(-20, 20, size=(130, 1)))
    q = run_on(cpu, lambda x: quantize_mxfp8(x, rowwise=True, colwise=False), x)
    scale = np.asarray(q[1])
    assert scale.shape == (256, 8)
    np.testing.assert_array_equal(bits(run_on(cpu, gemm_mod.swizzle_scales, scale)), formula_swizzle(scale))


@pytest.mark.parametrize("shape,dtype,exc,match", [
    ((100, 4), np.uint8, ValueError, "scale: expected a"),
    ((128, 6), np.uint8, ValueError, "scale: expected a"),
    ((128, 4), np.float32, TypeError, "scale: expected uint8"),
    ((128,), np.uint8, ValueError, "scale: expected a"),
], ids=str)
def test_bad_input_names_the_argument(shape, dtype, exc, match):
    with pytest.raises(exc, match=match):
        gemm_mod.swizzle_scales(np.zeros(shape, dtype))


def test_handler_checks_the_valid_region(cpu):
    s = np.zeros((128, 4), np.uint8)
    with pytest.raises(Exception, match="valid_rows / valid_cols"):
        jax.block_until_ready(run_on(cpu, lambda x: gemm_mod.swizzle_scales(x, 129, 4), s))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,valid", [((128, 4), None), ((384, 12), None), ((256, 36), (200, 33)),
                                         ((16384, 256), None), ((8192, 512), (8000, 509)),
                                         ((128, 8), (0, 0))], ids=str)
def test_cuda_kernel_equals_cpu_reference(dtype, shape, valid, rng, cpu, gpu):
    s = random_scales(rng, shape, dtype)
    f = (lambda x: gemm_mod.swizzle_scales(x, *valid)) if valid else gemm_mod.swizzle_scales
    g, c = run_on(gpu, f, s), run_on(cpu, f, s)
    np.testing.assert_array_equal(bits(g), bits(c))
    np.testing.assert_array_equal(bits(g), bits(gemm_mod.swizzle_scales_jnp(jnp.asarray(s), *(valid or ()))))
