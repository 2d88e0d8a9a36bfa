"""lowbit.ops.gemm's cuBLASLt handler against the CPU handler within the derived tolerance
(gemm_reference.py): FP8 pairs at split and fast accumulation, every type case, odd shapes
(padded), the fp32 bias bound on gemm_p directly, the plan cache with new buffers, the
compiled program's custom call, and the handler's own type error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on
from gemm_reference import (BF16, CASE_IDS, E4M3, E5M2, F32, FP8_PAIRS, FROBENIUS, TENSOR_MODES, TYPE_CASES,
                            assert_close_gemm, gemm_atol, gemm_mod, operands)

import lowbit


GPU_SHAPES = [(128, 256, 512), (1000, 2048, 4096)]  # (M, N, K)


def _cuda_vs_cpu(rng, cpu, gpu, m, n, k, a_dtype, b_dtype, out_dtype, with_bias, split):
    a, b, _, _, bias = operands(rng, m, n, k, a_dtype, b_dtype, out_dtype, with_bias)
    sa, sb = np.float32(0.3), np.float32(2.5)
    f = lambda *x: lowbit.ops.gemm(*x, out_dtype=out_dtype, use_split_accumulator=split)
    args = (a, b, sa, sb) + ((bias,) if with_bias else ())
    g, c = run_on(gpu, f, *args), run_on(cpu, f, *args)
    model = "gpu" if jnp.dtype(a_dtype) not in gemm_mod.FP8 else ("fp8_split" if split else "fp8_fast")
    assert_close_gemm(g, c, gemm_atol(a, b, sa, sb, out_dtype, model=model, bias=bias),
                      max_rel_frobenius=FROBENIUS[model])


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype,b_dtype", FP8_PAIRS, ids=str)
@pytest.mark.parametrize("split", [True, False], ids=["split", "fast"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES, ids=str)
def test_cuda_fp8_matches_cpu(a_dtype, b_dtype, split, m, n, k, rng, cpu, gpu):
    _cuda_vs_cpu(rng, cpu, gpu, m, n, k, a_dtype, b_dtype, BF16, True, split)


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", TYPE_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_cuda_every_type_case_matches_cpu(a_dtype, b_dtype, out_dtype, with_bias, rng, cpu, gpu):
    _cuda_vs_cpu(rng, cpu, gpu, 128, 256, 512, a_dtype, b_dtype, out_dtype, with_bias, True)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1, 16), (7, 17, 48), (33, 64, 1000), (5, 100, 16)], ids=str)
def test_cuda_odd_shapes_are_padded(m, n, k, rng, cpu, gpu):
    _cuda_vs_cpu(rng, cpu, gpu, m, n, k, E4M3, E5M2, BF16, True, True)
    _cuda_vs_cpu(rng, cpu, gpu, m, n, k, BF16, BF16, F32, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E5M2), (BF16, BF16)], ids=str)
@pytest.mark.parametrize("m,n,k", [(37, 200, 256), (130, 33, 1000)], ids=str)
def test_cuda_f32_bias_bound_on_gemm_p_directly(a_dtype, b_dtype, m, n, k, rng, cpu, gpu):
    """lowbit.ops.gemm adds an fp32 output's bias in XLA, so only a direct binder of gemm_p
    hands it to the custom call, whose CUDA handler adds it after cuBLASLt
    (GemmBiasAddF32Cuda): that path against the CPU handler."""
    a, b, sa, sb, bias = operands(rng, m, n, k, a_dtype, b_dtype, F32)
    f = lambda a, b, sa, sb, bias: gemm_mod.gemm_padded(  # noqa: E731
        a, b, sa.reshape(1), sb.reshape(1), bias, out_dtype=jnp.dtype(F32),
        use_split_accumulator=np.bool_(True))
    g, c = run_on(gpu, f, a, b, sa, sb, bias), run_on(cpu, f, a, b, sa, sb, bias)
    model = "fp8_split" if jnp.dtype(a_dtype) in gemm_mod.FP8 else "gpu"
    assert_close_gemm(g, c, gemm_atol(a, b, sa, sb, F32, model=model, bias=bias),
                      max_rel_frobenius=FROBENIUS[model])
    # The bias is there: without it the output moves by |bias| (4 sigma of normal draws).
    assert np.abs(np.asarray(g, np.float64) - np.asarray(run_on(gpu, f, a, b, sa, sb, 0 * bias),
                                                          np.float64)).max() > 1.0


@pytest.mark.gpu
def test_cuda_plan_cache_takes_new_pointers_and_scales(rng, cpu, gpu):
    """Calls of one cached plan with other buffers, scales and bias must not reuse old ones."""
    f = jax.jit(lambda *x: lowbit.ops.gemm(*x, out_dtype=BF16))
    for _ in range(3):
        a, b, sa, sb, bias = operands(rng, 64, 128, 256, E4M3, E4M3, BF16)
        args = jax.device_put((a, b, sa, sb, bias), gpu)
        g = np.asarray(f(*args))
        c = run_on(cpu, f, a, b, sa, sb, bias)
        assert_close_gemm(g, c, gemm_atol(a, b, sa, sb, BF16, model="fp8_split", bias=bias),
                          max_rel_frobenius=FROBENIUS["fp8_split"])


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype", [E4M3, BF16], ids=str)
def test_cuda_program_contains_lowbit_gemm(a_dtype, gpu):
    a = jax.device_put(jnp.ones((64, 128), a_dtype), gpu)
    b = jax.device_put(jnp.ones((32, 128), a_dtype), gpu)
    hlo = jax.jit(lambda x, y: lowbit.ops.gemm(x, y)).lower(a, b).compile().as_text()
    assert "lowbit_gemm" in hlo
    assert "cublas" not in hlo.lower()  # no XLA dot rewritten to its own cuBLAS call


@pytest.mark.gpu
def test_cuda_rejects_e5m2_pair_from_handler(gpu):
    one = jax.device_put(np.ones((1,), np.float32), gpu)
    x = jax.device_put(np.ones((16, 16), E5M2), gpu)
    empty = jax.device_put(np.zeros((0,), BF16), gpu)
    f = jax.jit(lambda x, s, e: gemm_mod.gemm_p.bind(x, x, s, s, e, out_dtype=jnp.dtype(BF16),
                                                     use_split_accumulator=np.bool_(True), **TENSOR_MODES))
    with pytest.raises(Exception, match=r"lowbit_gemm: b: f8e5m2 x f8e5m2"):
        jax.block_until_ready(f(x, one, empty))
