"""lowbit.ops.quantize_fp8 / dequantize_fp8 on CUDA against the CPU handlers: bit for bit
(dbias within fp32 summation-order tolerance) on odd, misaligned and many-tile shapes, every
16-bit input bit pattern, special values, vmap, every tile variant and rowwise kernel, and
the errors for unknown variants (the CPU-side tests: tests/test_quantize_ops.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from quantize_reference import DTYPES, FP8, assert_dbias_close, dtype_ids

from lowbit.ops import dequantize_fp8, quantize_fp8


GPU_SHAPES = [((4097, 3001), -1), ((1024, 2048), -1), ((2048, 128), -1), ((100, 2048), -1),
              ((1, 65536), -1), ((65536, 1), -1), ((3, 5, 129), 1), ((2, 7, 64, 96), 2), ((16, 3000), -1),
              # More tiles than an H100 holds blocks (default 256 x 128 tiles: 384 tiles, 132
              # blocks), so blocks loop and the copy of the next tile overlaps this one:
              # 16-byte stores everywhere; rows and
              # cols = 8 (mod 16): 8-byte stores; = 4 (mod 8): 4-byte stores (and the
              # element-load path for 16-bit x).
              ((12288, 1024), -1), ((8200, 1032), -1), ((8196, 1028), -1)]
# Each kernel path: flat rowwise; tiled colwise only; tiled everything; tiled rowwise+dbias.
GPU_CONFIGS = [(True, False, False), (False, True, False), (True, True, True), (True, False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("shape,axis", GPU_SHAPES, ids=str)
def test_cuda_equals_cpu(shape, axis, dtype, rng, cpu, gpu):
    x = random_with_specials(rng, shape, dtype)
    for i, (rowwise, colwise, dbias) in enumerate(GPU_CONFIGS):
        fp8 = FP8[i % 2]

        def f(v, s):
            return quantize_fp8(v, s, out_dtype=fp8, rowwise=rowwise, colwise=colwise,
                                flatten_axis=axis, compute_dbias=dbias)

        s = np.float32(0.37)
        g, c = run_on(gpu, f, x, s), run_on(cpu, f, x, s)
        for name in ("rowwise", "colwise"):
            if getattr(c, name) is not None:
                np.testing.assert_array_equal(getattr(g, name).view(np.uint8), getattr(c, name).view(np.uint8))
        np.testing.assert_array_equal(g.amax.view(np.uint32), c.amax.view(np.uint32))
        if dbias:
            # The kernel sums 64-row tiles, then the tiles; the reference sums rows in order.
            assert_dbias_close(g.dbias, c.dbias, x, axis)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
def test_cuda_every_input_bit_pattern_equals_cpu(fp8, rng, cpu, gpu):
    # The kernel encodes with the hardware cvt where no NaN can occur and with the
    # formats.h codec otherwise: every 16-bit input, random fp32 bit patterns (ties,
    # subnormal outputs, saturation) and non-finite or zero scales must match the CPU bit
    # for bit, NaN signs included (MulNanDefined fixes them: a GPU multiply drops them).
    inputs = [np.arange(1 << 16, dtype=np.uint16).view(d).reshape(256, 256)
              for d in (np.float16, ml_dtypes.bfloat16)]
    inputs.append(rng.integers(0, 1 << 32, (512, 1024), dtype=np.uint32).view(np.float32))
    finite = np.where(np.isfinite(inputs[-1]), inputs[-1], np.float32(1.0))
    inputs.append(finite.astype(np.float32))
    for x in inputs:
        for scale in (1.0, 2.0**-7, 2.0**10, 0.37, 3.0e30, 0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan):
            f = lambda v, s: quantize_fp8(v, s, out_dtype=fp8, rowwise=True, colwise=True)  # noqa: E731
            g = lambda v, s: quantize_fp8(v, s, out_dtype=fp8)  # noqa: E731
            for fn in (f, g):
                a, b = run_on(gpu, fn, x, np.float32(scale)), run_on(cpu, fn, x, np.float32(scale))
                np.testing.assert_array_equal(a.rowwise.view(np.uint8), b.rowwise.view(np.uint8))
                if b.colwise is not None:
                    np.testing.assert_array_equal(a.colwise.view(np.uint8), b.colwise.view(np.uint8))
                np.testing.assert_array_equal(a.amax.view(np.uint32), b.amax.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_cuda_misaligned_and_special(dtype, rng, cpu, gpu):
    x = random_with_specials(rng, (513, 1030), dtype)

    def f(v):  # a slice starting one element in, and odd cols: the unvectorized paths
        w = v.reshape(-1)[1:1 + 511 * 1033].reshape(511, 1033)
        return quantize_fp8(w, jnp.float32(3.0), rowwise=True, colwise=True, compute_dbias=True)

    def g(v):
        return quantize_fp8(v.reshape(-1)[3:], jnp.float32(3.0))  # flat rowwise, odd length

    for fn in (f, g):
        a, b = run_on(gpu, fn, x), run_on(cpu, fn, x)
        np.testing.assert_array_equal(a.rowwise.view(np.uint8), b.rowwise.view(np.uint8))
        if b.colwise is not None:
            np.testing.assert_array_equal(a.colwise.view(np.uint8), b.colwise.view(np.uint8))
        np.testing.assert_array_equal(a.amax.view(np.uint32), b.amax.view(np.uint32))
    empty = lambda v: quantize_fp8(v[:0], jnp.float32(1.0), colwise=True, compute_dbias=True)  # noqa: E731
    e = run_on(gpu, empty, x)
    assert float(e.amax) == 0.0 and np.all(e.dbias.astype(np.float32) == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_ids)
def test_cuda_dequantize_equals_cpu(fp8, out_dtype, cpu, gpu):
    codes = np.tile(np.arange(256, dtype=np.uint8), 4099).view(fp8)  # every code, odd length
    # NaN codes keep their sign and give the canonical quiet NaN of out's dtype on both.
    for scale_inv in (1.0, 3.7e-3, 1e5, 0.0, -np.inf, -np.nan):
        f = lambda d: dequantize_fp8(d, jnp.float32(scale_inv), out_dtype)  # noqa: E731
        a, b = run_on(gpu, f, codes), run_on(cpu, f, codes)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        a, b = run_on(gpu, f, codes[5:]), run_on(cpu, f, codes[5:])
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.gpu
def test_cuda_vmap_equals_cpu(rng, cpu, gpu):
    x = random_with_specials(rng, (3, 129, 257), ml_dtypes.bfloat16)
    f = jax.vmap(lambda v: quantize_fp8(v, jnp.float32(2.0), rowwise=True, colwise=True, compute_dbias=True))
    a, b = run_on(gpu, f, x), run_on(cpu, f, x)
    np.testing.assert_array_equal(a.rowwise.view(np.uint8), b.rowwise.view(np.uint8))
    np.testing.assert_array_equal(a.colwise.view(np.uint8), b.colwise.view(np.uint8))
    np.testing.assert_array_equal(a.amax.view(np.uint32), b.amax.view(np.uint32))


# Every tile variant of the CUDA tiled kernel (LOWBIT_QUANTIZE_TILE_VARIANT, quantize.h;
# the launcher reads it on every call, and run_on compiles afresh) against the CPU. Shapes
# with more tiles than the GPU holds blocks (4160 x 2056: 1105 tiles of 64 rows, 561 of
# 128, 289 of 256), so blocks loop through the pipeline; rows = 4 (mod 8) (4-byte colwise stores,
# partial 128-row tiles); cols = 4 (mod 8) (element loads for 16-bit x); unaligned odd
# shapes; one row (1-byte colwise stores).
TILE_VARIANTS = ["r64s2", "r64s3", "r128s2", "r64s2b16", "r64s3b1", "r128s2b3", "r256s2", "r256s2b2"]
VARIANT_SHAPES = [((4160, 2056), -1), ((4100, 1028), -1), ((513, 3001), -1), ((2, 7, 64, 96), 2),
                  ((1, 4100), -1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("variant", TILE_VARIANTS)
def test_cuda_tile_variants_equal_cpu(variant, dtype, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_TILE_VARIANT", variant)
    for shape, axis in VARIANT_SHAPES:
        x = random_with_specials(rng, shape, dtype)
        for i, (rowwise, colwise, dbias) in enumerate(GPU_CONFIGS[1:]):  # the tiled kernel's
            def f(v, s):
                return quantize_fp8(v, s, out_dtype=FP8[i % 2], rowwise=rowwise, colwise=colwise,
                                    flatten_axis=axis, compute_dbias=dbias)

            s = np.float32(0.37)
            g, c = run_on(gpu, f, x, s), run_on(cpu, f, x, s)
            for name in ("rowwise", "colwise"):
                if getattr(c, name) is not None:
                    np.testing.assert_array_equal(getattr(g, name).view(np.uint8), getattr(c, name).view(np.uint8),
                                                  err_msg=f"{name} {shape}")
            np.testing.assert_array_equal(g.amax.view(np.uint32), c.amax.view(np.uint32))
            if dbias:
                assert_dbias_close(g.dbias, c.dbias, x, axis)


# The rowwise-only kernels (LOWBIT_QUANTIZE_ROWWISE_KERNEL, quantize.h) against the CPU:
# steps of one or two 16-byte chunks (n not a multiple of 16: the scalar tail), and the
# tiled kernel without its colwise copy.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("kernel", ["chunks1", "chunks2", "tiled"])
def test_cuda_rowwise_kernels_equal_cpu(kernel, dtype, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_ROWWISE_KERNEL", kernel)
    for shape in ((4097, 3001), (12288, 1024), (1, 65541), (3, 5, 129)):
        x = random_with_specials(rng, shape, dtype)
        for fp8 in FP8:
            def f(v, s):
                return quantize_fp8(v, s, out_dtype=fp8, rowwise=True, colwise=False)

            s = np.float32(0.37)
            g, c = run_on(gpu, f, x, s), run_on(cpu, f, x, s)
            np.testing.assert_array_equal(g.rowwise.view(np.uint8), c.rowwise.view(np.uint8), err_msg=f"{shape}")
            np.testing.assert_array_equal(g.amax.view(np.uint32), c.amax.view(np.uint32))


@pytest.mark.gpu
def test_cuda_bad_rowwise_kernel(gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_ROWWISE_KERNEL", "chunks4")
    with pytest.raises(Exception, match=r"lowbit_quantize_fp8: LOWBIT_QUANTIZE_ROWWISE_KERNEL=\"chunks4"):
        run_on(gpu, lambda v: quantize_fp8(v, jnp.float32(1.0), colwise=False), jnp.ones((64, 128), jnp.bfloat16))


@pytest.mark.gpu
def test_cuda_bad_tile_variant(gpu, monkeypatch):
    x = jnp.ones((64, 128), jnp.bfloat16)
    for bad in ("r32s2", "r128s3", "r256s3", "r512s2", "r64s2b0", "r64s2x", "fast", "r64s2p1"):
        monkeypatch.setenv("LOWBIT_QUANTIZE_TILE_VARIANT", bad)
        with pytest.raises(Exception, match=r"lowbit_quantize_fp8: LOWBIT_QUANTIZE_TILE_VARIANT=\"" + bad):
            run_on(gpu, lambda v: quantize_fp8(v, jnp.float32(1.0), colwise=True), x)
