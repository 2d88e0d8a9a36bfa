"""lowbit.ops.quantize_fp8_block_colwise_rows (a band of rows' colwise FP8 block copy, read in
place): bit for bit the numpy reference's colwise copy of the band's rows (tests/
quantize_block_reference.py; 1x128 and 128x128 tiles, fp32 and power-of-two scales, both FP8
formats, every input dtype, odd widths, the last band short, empty bands, inf/NaN/zeros/near-max
and all-zero blocks), and so equal to lowbit.ops.quantize_fp8_block of the slice; bad input;
vmap; on a GPU the CUDA kernel against the CPU handler, bit for bit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on
from quantize_block_reference import (DTYPES, FP8, assert_bits_equal, assert_fp8_equal, ids,
                                      quantize_fp8_block_ref, with_block_specials)

from lowbit.ops.quantize_block import quantize_fp8_block
from lowbit.ops.quantize_block_rows import quantize_fp8_block_colwise_rows

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# (rows, cols), bands (row_begin, row_count): whole, inner, the short last band, empty.
CASES = [((300, 200), [(0, 300), (128, 128), (256, 44), (128, 0)]),
         ((512, 129), [(0, 256), (256, 256), (384, 128)]),
         ((129, 16), [(0, 128), (128, 1)]),
         ((1, 7), [(0, 1)])]


def _band_ref(x, r0, count, fp8, tile_2d, pow2):
    _, _, col, col_scale = quantize_fp8_block_ref(x[r0:r0 + count], fp8, tile_2d, pow2)
    return col, col_scale


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,bands", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x128", "128x128"])
def test_band_equals_reference(shape, bands, tile_2d, dtype, rng):
    x = with_block_specials(rng, shape, dtype)
    for r0, count in bands:
        for fp8, pow2 in zip(FP8, (False, True)):
            col, scale = quantize_fp8_block_colwise_rows(x, r0, count, out_dtype=fp8, tile_2d=tile_2d,
                                                         pow2_scales=pow2)
            want_col, want_scale = _band_ref(np.asarray(x), r0, count, fp8, tile_2d, pow2)
            assert col.shape == (shape[1], count) and col.dtype == fp8
            assert_fp8_equal(col, want_col)
            assert_bits_equal(scale, want_scale)


def test_band_equals_quantize_of_the_slice(rng):
    x = with_block_specials(rng, (640, 96), jnp.bfloat16)
    for r0, count in [(0, 384), (384, 256)]:
        got = jax.jit(lambda v: quantize_fp8_block_colwise_rows(v, r0, count, pow2_scales=True))(x)
        want = quantize_fp8_block(x[r0:r0 + count], pow2_scales=True, rowwise=False, colwise=True)
        assert_fp8_equal(got[0], np.asarray(want.colwise))
        assert_bits_equal(got[1], np.asarray(want.colwise_scale))


def test_vmap_maps_bands(rng):
    x = with_block_specials(rng, (3, 256, 40), jnp.float32)
    col, scale = jax.vmap(lambda v: quantize_fp8_block_colwise_rows(v, 128, 128))(x)
    for i in range(3):
        want_col, want_scale = _band_ref(np.asarray(x[i]), 128, 128, FP8[0], False, False)
        assert_fp8_equal(col[i], want_col)
        assert_bits_equal(scale[i], want_scale)


@pytest.mark.parametrize("args,kwargs,err,text", [
    ((np.ones((4, 4, 4), np.float32), 0, 4), {}, ValueError, "x: expected rank 2"),
    ((np.ones((256, 4), np.int32), 0, 4), {}, TypeError, "x: expected float32"),
    ((np.ones((256, 4), np.float32), 64, 4), {}, ValueError, "row_begin: expected a multiple of 128"),
    ((np.ones((256, 4), np.float32), 128, 200), {}, ValueError, "row_begin: expected a multiple of 128 with "
                                                                "row_begin + row_count <= 256"),
    ((np.ones((256, 4), np.float32), 0, 4), {"out_dtype": jnp.bfloat16}, TypeError, "out_dtype"),
])
def test_bad_input_names_the_argument(args, kwargs, err, text):
    with pytest.raises(err, match=re.escape("lowbit.ops.quantize_fp8_block_colwise_rows: " + text)):
        quantize_fp8_block_colwise_rows(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("shape,band", [((300, 200), (128, 172)), ((16384, 520), (8192, 8192)),
                                        ((1000, 4100), (256, 384))], ids=str)
def test_cuda_band_matches_cpu(shape, band, tile_2d, dtype, rng, cpu, gpu):
    x = with_block_specials(rng, shape, dtype)
    for fp8, pow2 in zip(FP8, (False, True)):
        f = lambda v: quantize_fp8_block_colwise_rows(v, *band, out_dtype=fp8, tile_2d=tile_2d,  # noqa: E731
                                                      pow2_scales=pow2)
        g_col, g_scale = run_on(gpu, f, x)
        c_col, c_scale = run_on(cpu, f, x)
        np.testing.assert_array_equal(g_col.view(np.uint8), c_col.view(np.uint8))
        np.testing.assert_array_equal(g_scale.view(np.uint32), c_scale.view(np.uint32))
