"""lowbit.ops.quantize_fp8_block / quantize_mxfp8 and their dequantize ops on the GPU: the CUDA
kernels against the CPU handlers, bit for bit (every layout, 1x128 and 128x128 tiles, MXFP8,
both FP8 formats, power-of-two scales, the staged and unstaged tile kernels, every 16-bit
input bit pattern, misaligned and odd shapes, dequantize), dbias included (the fixed
summation order of csrc/quantize/block_dbias.h on both backends, empty x, the f32 result) and
run-to-run identical. All tests are marked `gpu` (they skip without one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from quantize_block_reference import DTYPES, F32, FP8, _quantize, _quantize_with_dbias, ids, with_block_specials

import lowbit
from lowbit.ops.quantize_block import (
    dequantize_fp8_block,
    dequantize_mxfp8,
    quantize_fp8_block,
    quantize_fp8_block_p,
    quantize_mxfp8,
    quantize_mxfp8_p,
)

# numpy warns on the inf/NaN the special values produce; they are the point of the test.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


GPU_SHAPES = [((4096, 3072), -1), ((4097, 3001), -1), ((2048, 128), -1), ((100, 2048), -1),
              ((1, 65536), -1), ((65536, 1), -1), ((3, 5, 129), 1), ((2, 7, 64, 96), 2), ((33, 3000), -1)]


def _bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", GPU_SHAPES, ids=str)
def test_cuda_equals_cpu(shape, axis, dtype, rng, cpu, gpu):
    x = with_block_specials(rng, shape, dtype)
    configs = [("1x128", True, True), ("1x128", True, False), ("1x128", False, True),
               ("128x128", True, True), ("128x128", False, True), ("mxfp8", True, True),
               ("mxfp8", True, False), ("mxfp8", False, True)]
    for i, (kind, rowwise, colwise) in enumerate(configs):
        f = _quantize(kind, rowwise, colwise, axis, FP8[i % 2], bool(i % 3 == 0))
        g, c = run_on(gpu, f, x), run_on(cpu, f, x)
        for a, b in zip(g, c):
            assert (a is None) == (b is None)
            if b is not None:
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{kind} {rowwise} {colwise}")


@pytest.mark.gpu
@pytest.mark.parametrize("staged", ["1", "0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", [(4100, 3080), (8192, 4096), (257, 640), (1, 65536)], ids=str)
def test_cuda_staged_and_unstaged_tiles_equal_cpu(shape, dtype, staged, rng, cpu, gpu, monkeypatch):
    # LOWBIT_BLOCK_TILE_STAGED: the plain tile kernels' staged form (the next tile's loads in
    # flight through shared memory, the default) and the unstaged one, on vectorizable shapes
    # with partial tiles in both dims and several tiles per block, with dbias and without.
    monkeypatch.setenv("LOWBIT_BLOCK_TILE_STAGED", staged)
    x = with_block_specials(rng, shape, dtype)
    configs = [("1x128", True, True), ("1x128", False, True), ("128x128", True, True), ("mxfp8", True, True),
               ("mxfp8", False, True)]
    for i, (kind, rowwise, colwise) in enumerate(configs):
        for f in (_quantize_with_dbias(kind, rowwise, colwise, -1, FP8[i % 2], bool(i % 2 == 0)),
                  _quantize(kind, rowwise, colwise, -1, FP8[(i + 1) % 2], bool(i % 2 == 1))):
            for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{kind} {rowwise} {colwise}")


@pytest.mark.gpu
def test_cuda_bad_staging_knob_is_an_error(gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_BLOCK_TILE_STAGED", "yes")
    x = jnp.ones((256, 256), jnp.bfloat16)
    for f in (lambda v: quantize_fp8_block(v, rowwise=True, colwise=True),
              lambda v: quantize_mxfp8(v, rowwise=True, colwise=True)):
        with pytest.raises(Exception, match=r"LOWBIT_BLOCK_TILE_STAGED=\"yes\": expected 0 or 1"):
            run_on(gpu, f, x)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=ids)
def test_cuda_every_input_bit_pattern_equals_cpu(fp8, rng, cpu, gpu):
    # Hardware cvt where no NaN can occur, the formats.h codec elsewhere: every 16-bit input
    # and random fp32 bit patterns (ties, subnormals, saturation, NaN signs) must match.
    inputs = [np.arange(1 << 16, dtype=np.uint16).view(d).reshape(256, 256) for d in (np.float16, ml_dtypes.bfloat16)]
    inputs.append(rng.integers(0, 1 << 32, (512, 1024), dtype=np.uint32).view(F32))
    inputs.append(np.where(np.isfinite(inputs[-1]), inputs[-1], F32(1)))
    inputs.append((rng.standard_normal((384, 640)) * 1e-3).astype(F32))
    for x in inputs:
        for fn in (lambda v: quantize_fp8_block(v, out_dtype=fp8, rowwise=True, colwise=True),
                   lambda v: quantize_fp8_block(v, out_dtype=fp8, tile_2d=True, pow2_scales=True, rowwise=True, colwise=True),
                   lambda v: quantize_mxfp8(v, out_dtype=fp8, rowwise=True, colwise=True)):
            for a, b in zip(run_on(gpu, fn, x), run_on(cpu, fn, x)):
                assert (a is None) == (b is None)  # fields not asked for (dbias)
                if a is not None:
                    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_misaligned_equals_cpu(dtype, rng, cpu, gpu):
    x = with_block_specials(rng, (513, 1030), dtype)

    def f(v):  # a slice starting one element in, odd cols: the unvectorized paths
        w = v.reshape(-1)[1 : 1 + 511 * 1033].reshape(511, 1033)
        return (quantize_fp8_block(w, rowwise=True, colwise=True),
                quantize_fp8_block(w, tile_2d=True, rowwise=True, colwise=True),
                quantize_mxfp8(w, rowwise=True, colwise=True))

    for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=ids)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=ids)
def test_cuda_dequantize_equals_cpu(fp8, out_dtype, rng, cpu, gpu):
    codes = np.tile(np.arange(256, dtype=np.uint8), 257 * 3).view(fp8).reshape(257, 768)
    s_block = (rng.standard_normal((6, 260)) * 1e3).astype(F32)  # 1x128 scale_inv of 257 x 768
    s_block[0, :4] = [0.0, -np.inf, np.nan, 1e-40]
    s_2d = (rng.standard_normal((3, 8)) * 1e-3).astype(F32)
    s_mx = rng.integers(0, 256, (384, 24), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    s_mx_col = rng.integers(0, 256, (12, 768), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    fns = [(lambda d, s: dequantize_fp8_block(d, s, out_dtype=out_dtype), s_block),
           (lambda d, s: dequantize_fp8_block(d, s, tile_2d=True, out_dtype=out_dtype), s_2d),
           (lambda d, s: dequantize_mxfp8(d, s, out_dtype=out_dtype), s_mx),
           (lambda d, s: dequantize_mxfp8(d, s, colwise=True, out_dtype=out_dtype), s_mx_col)]
    for fn, s in fns:
        np.testing.assert_array_equal(_bits(run_on(gpu, fn, codes, s)), _bits(run_on(cpu, fn, codes, s)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,axis", GPU_SHAPES + [((8, 2048, 1024), 2)], ids=str)
def test_cuda_dbias_equals_cpu(shape, axis, dtype, rng, cpu, gpu):
    # dbias bit for bit (the fixed order of block_dbias.h on both backends; NaN canonical) and
    # identical on two GPU runs; the copies and scales bit for bit as without dbias.
    x = with_block_specials(rng, shape, dtype)
    configs = [("1x128", True, True), ("1x128", True, False), ("1x128", False, True),
               ("128x128", True, True), ("mxfp8", True, True), ("mxfp8", True, False), ("mxfp8", False, True)]
    for i, (kind, rowwise, colwise) in enumerate(configs):
        f = _quantize_with_dbias(kind, rowwise, colwise, axis, FP8[i % 2], bool(i % 3 == 0))
        g, g2, c = run_on(gpu, f, x), run_on(gpu, f, x), run_on(cpu, f, x)
        for a, a2, b in zip(g, g2, c):
            assert (a is None) == (b is None)
            if b is not None:
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{kind} {rowwise} {colwise}")
                np.testing.assert_array_equal(_bits(a), _bits(a2), err_msg=f"rerun {kind} {rowwise} {colwise}")
    # Integers: exact in any order, so equal to numpy's sum as well.
    ints = rng.integers(-8, 9, shape).astype(dtype)
    for kind in ("1x128", "mxfp8"):
        got = run_on(gpu, _quantize_with_dbias(kind, True, True, axis), ints).dbias
        want = np.asarray(ints, np.float64).reshape(int(np.prod(shape[:axis % len(shape)])), -1).sum(0)
        np.testing.assert_array_equal(np.asarray(got, np.float64).reshape(-1), np.asarray(want.astype(dtype), np.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_dbias_of_empty_x_is_zero(dtype, rng, cpu, gpu):
    # No rows: dbias (cols values, in x's dtype and in f32) is the only output, zeroed by the
    # launchers' preamble (dbias_finalize.cuh: PrepareDbias); all bits 0, as on the CPU. A
    # first call on real data leaves nonzero bytes in freed device memory for the outputs
    # to reuse, so a dbias left unwritten would show.
    x = with_block_specials(rng, (300, 1033), dtype)
    run_on(gpu, _quantize_with_dbias("mxfp8", True, True, -1), x)
    e4 = jnp.float8_e4m3fn

    def f(v):
        outs = []
        for shape, axis in (((0, 1033), 1), ((2, 0, 1033), 2)):
            e = v[:0].reshape(shape)
            for kind in ("1x128", "128x128", "mxfp8"):
                outs.append(_quantize_with_dbias(kind, True, True, axis)(e).dbias)
            block = quantize_fp8_block_p.bind(e, flatten_axis=np.int32(axis), tile_2d=np.bool_(False),
                                              pow2_scales=np.bool_(False), out_dtype=e4, rowwise=True,
                                              colwise=True, dbias_dtype=jnp.dtype(jnp.float32))
            mx = quantize_mxfp8_p.bind(e, flatten_axis=np.int32(axis), out_dtype=e4, rowwise=True, colwise=True,
                                       dbias_dtype=jnp.dtype(jnp.float32))
            outs += [block[4], mx[4]]
        return outs

    got, want = run_on(gpu, f, x), run_on(cpu, f, x)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == (1033,) and a.dtype == b.dtype, i
        assert a.dtype == (dtype if i % 5 < 3 else np.float32), i
        np.testing.assert_array_equal(_bits(a), np.zeros_like(_bits(a)), err_msg=str(i))
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=str(i))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_dbias_f32_and_misaligned_equal_cpu(dtype, rng, cpu, gpu):
    # The f32 dbias result (what the sharded rule asks for) through the handler, and the
    # unvectorized paths (a slice starting one element in, odd cols).
    lowbit._ffi.load()
    x = with_block_specials(rng, (1537, 1033), dtype)  # holds the 1535 x 1033 slice one element in
    e4, f32 = jnp.float8_e4m3fn, jnp.float32
    r, c = x.shape

    def f(v):
        w = v.reshape(-1)[1 : 1 + 1535 * 1033].reshape(1535, 1033)
        # the primitives (their CUDA lowering adds the handler's workspace result)
        block = quantize_fp8_block_p.bind(v, flatten_axis=np.int32(1), tile_2d=np.bool_(False),
                                          pow2_scales=np.bool_(False), out_dtype=jnp.dtype(e4), rowwise=True,
                                          colwise=False, dbias_dtype=jnp.dtype(f32))
        mx = quantize_mxfp8_p.bind(v, flatten_axis=np.int32(1), out_dtype=jnp.dtype(e4), rowwise=False, colwise=True,
                                   dbias_dtype=jnp.dtype(f32))
        assert [o.shape for o in block] == [(r, c), (9, r + 3), (0,), (0,), (c,)]
        assert [o.shape for o in mx] == [(0,), (0,), (r, c), (52, 1152), (c,)]
        return (block, mx, _quantize_with_dbias("1x128", True, True, -1)(w),
                _quantize_with_dbias("mxfp8", True, True, -1)(w))

    for a, b in zip(jax.tree.leaves(run_on(gpu, f, x)), jax.tree.leaves(run_on(cpu, f, x))):
        np.testing.assert_array_equal(_bits(a), _bits(b))
