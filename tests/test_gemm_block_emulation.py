"""lowbit.ops.gemm with block scale modes (FP8 1x128 / 128x128, MXFP8) on the CPU handler: its
exact emulation against a numpy reference written from gemm.h's formula (bit for bit on small
shapes, and within fp32 error of a float64 product on larger ones), scale layouts (padding
entries are never read), NaN scales, multi-dimensional operands, vmap, the one-time notice,
and bad input in the Python layer and in the handler."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_block_reference import (BF16, E4M3, E5M2, F32, PAIR_IDS, PAIRS, Mode, block_tolerance, call,
                                  dequantized, gemm_mod, operands, sequential_ref)

import lowbit


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 7, 200), (130, 3, 257), (4, 129, 384)], ids=str)
def test_cpu_emulation_is_the_documented_formula(a_mode, b_mode, m, n, k, rng):
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, E4M3, E5M2)
    got = np.asarray(jax.jit(call, static_argnums=(4, 5))(a, b, sa, sb, a_mode, b_mode))
    np.testing.assert_array_equal(got, sequential_ref(a, b, a_mode, sa, b_mode, sb, None, np.float32))
    assert np.isfinite(got).all()  # the NaN padding of the scale arrays was never read


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
def test_cpu_emulation_bias_and_rounding(a_mode, b_mode, out_dtype, rng):
    m, n, k = 9, 40, 300
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    got = np.asarray(call(a, b, sa, sb, a_mode, b_mode, bias, out_dtype)).astype(np.float32)
    want = sequential_ref(a, b, a_mode, sa, b_mode, sb, bias, out_dtype).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
def test_cpu_emulation_close_to_float64_product(a_mode, b_mode, rng):
    """Larger shape: within fp32 summation error (2*K*u*sum|p|) of the exact product."""
    m, n, k = 160, 136, 1100
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode)
    a64, b64 = dequantized(a, a_mode, sa).astype(np.float64), dequantized(b, b_mode, sb).astype(np.float64)
    exact = a64 @ b64.T
    bound = 2 * k * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T) + 1e-30
    got = np.asarray(call(a, b, sa, sb, a_mode, b_mode)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.cpu_reference
def test_cpu_emulation_of_quantized_tensors_matches_dequantized_product(rng):
    """End to end with the block quantizers: x (1x128) . w (128x128) is the product of the
    dequantized copies."""
    x = rng.normal(size=(70, 300)).astype(np.float32)
    w = rng.normal(size=(50, 300)).astype(np.float32)
    xq = lowbit.ops.quantize_fp8_block(x, tile_2d=False)
    wq = lowbit.ops.quantize_fp8_block(w, tile_2d=True)
    got = call(xq.rowwise, wq.rowwise, xq.rowwise_scale, wq.rowwise_scale, Mode.BLOCK_1x128,
               Mode.BLOCK_128x128)
    xd = lowbit.ops.dequantize_fp8_block(xq.rowwise, xq.rowwise_scale, tile_2d=False, out_dtype=F32)
    wd = lowbit.ops.dequantize_fp8_block(wq.rowwise, wq.rowwise_scale, tile_2d=True, out_dtype=F32)
    want = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64).T
    bound = 2 * 300 * 2.0**-24 * (np.abs(np.asarray(xd, np.float64)) @ np.abs(np.asarray(wd, np.float64)).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)
    mq_x = lowbit.ops.quantize_mxfp8(x)
    mq_w = lowbit.ops.quantize_mxfp8(w)
    got = call(mq_x.rowwise, mq_w.rowwise, mq_x.rowwise_scale, mq_w.rowwise_scale, Mode.MXFP8, Mode.MXFP8)
    xd = np.asarray(lowbit.ops.dequantize_mxfp8(mq_x.rowwise, mq_x.rowwise_scale, out_dtype=F32), np.float64)
    wd = np.asarray(lowbit.ops.dequantize_mxfp8(mq_w.rowwise, mq_w.rowwise_scale, out_dtype=F32), np.float64)
    assert np.all(np.abs(np.asarray(got, np.float64) - xd @ wd.T) <= 2 * 300 * 2.0**-24 * (np.abs(xd) @ np.abs(wd).T))


def test_nan_scale_propagates(rng):
    a, b, sa, sb = operands(rng, 3, 4, 64, Mode.MXFP8, Mode.MXFP8)
    sa = np.array(sa)
    sa.view(np.uint8)[1, 0] = 255  # NaN block of row 1
    got = np.asarray(call(a, b, sa, sb, Mode.MXFP8, Mode.MXFP8))
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def assert_is_the_product(got, a, b, a_mode, sa, b_mode, sb):
    """got (f32) is the block-scaled product: the emulation's bits where the default backend
    is the CPU, else (cuBLASLt or the wgmma kernel) within block_tolerance of them."""
    want = sequential_ref(a, b, a_mode, sa, b_mode, sb, None, np.float32)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = block_tolerance(a, b, a_mode, sa, b_mode, sb, F32)
        assert np.all(np.abs(got.astype(np.float64) - want) <= tol)


def test_multi_dim_operands_use_the_flattened_views(rng):
    m, n, k = 6, 10, 130
    a, b, sa, sb = operands(rng, m, n, k, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    got = lowbit.ops.gemm(a.reshape(2, 3, k), b.reshape(2, 5, k).reshape(10, k), sa, sb, out_dtype=F32,
                          a_scale_mode=Mode.BLOCK_1x128, b_scale_mode=Mode.BLOCK_128x128)
    assert_is_the_product(np.asarray(got).reshape(m, n), a, b, Mode.BLOCK_1x128, sa, Mode.BLOCK_128x128, sb)


def test_vmap_maps_over_the_batch(rng):
    ops = [operands(rng, 5, 6, 140, Mode.BLOCK_1x128, Mode.BLOCK_1x128) for _ in range(3)]
    a, b, sa, sb = (np.stack(x) for x in zip(*ops))
    f = jax.vmap(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128))
    got = np.asarray(f(a, b, sa, sb))
    for i in range(3):
        assert_is_the_product(got[i], a[i], b[i], Mode.BLOCK_1x128, sa[i], Mode.BLOCK_1x128, sb[i])


@pytest.mark.cpu_reference
def test_emulation_notice_is_given_once(rng):
    gemm_mod._NOTICED.clear()
    a, b, sa, sb = operands(rng, 3, 3, 33, Mode.BLOCK_1x128, Mode.BLOCK_1x128)
    with pytest.warns(UserWarning, match="exact emulation"):
        jax.jit(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128))(a, b, sa, sb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_1x128) + 1)(a, b, sa, sb)


# ---------------------------------------------------------------- bad input


def test_bad_scale_input_names_the_argument(rng):
    a, b, sa, sb = operands(rng, 5, 7, 200, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(ValueError, match=r"lowbit.ops.gemm: b_scale_inv: expected shape \(1, 4\)"):
        call(a, b, sa, sb[:, :2], Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(TypeError, match=r"a_scale_inv: expected float32"):
        call(a, b, sa.astype(np.float16), sb, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(ValueError, match=r"b_scale_mode: expected block scales on both operands"):
        call(a, b, sa, None, Mode.BLOCK_1x128, Mode.TENSOR)
    with pytest.raises(ValueError, match=r"MXFP8 scales pair only with MXFP8"):
        call(a, b, sa, sb, Mode.BLOCK_1x128, Mode.MXFP8)
    with pytest.raises(ValueError, match=r"a_scale_inv: scale mode BLOCK_1x128 needs its scale array"):
        call(a, b, None, sb, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(TypeError, match=r"a: block scale modes need FP8 operands"):
        call(a.astype(BF16), b.astype(BF16), sa, sb, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(ValueError, match=r"a_scale_mode: expected a GemmScaleMode"):
        call(a, b, sa, sb, 7, Mode.BLOCK_128x128)


def test_handler_checks_scale_shapes(rng):
    """The C++ handler validates too (a caller binding gemm_p directly)."""
    a, b, sa, sb = operands(rng, 5, 7, 200, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    f = jax.jit(lambda a, b, sa, sb: gemm_mod.gemm_p.bind(
        a, b, sa, sb, jnp.zeros((0,), F32), out_dtype=jnp.dtype(F32), use_split_accumulator=np.bool_(True),
        a_scale_mode=np.int32(1), b_scale_mode=np.int32(2)))
    with pytest.raises(Exception, match=r"lowbit_gemm: a_scale_inv: expected shape \(2, 8\) for scale mode "
                                        r"block_1x128 of a 5 x 200 operand, got \(2, 4\)"):
        jax.block_until_ready(f(a, b, sa[:, :4], sb))
