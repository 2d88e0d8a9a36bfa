"""Shared by tests/test_gemm_ops.py, tests/test_gemm_ops_cuda.py and tests/test_gemm_algo.py:
the jnp reference of lowbit.ops.gemm and the CPU handler's exact summation order, the
tolerance model of a GPU GEMM against it (accumulation_gamma, gemm_atol, FROBENIUS), the
comparisons, the type cases and random operands; and (for test_gemm_algo and test_dense_backward)
the cuBLASLt algorithm attributes of a function's GEMM custom calls lowered for CUDA."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

gemm_mod = importlib.import_module("lowbit.ops.gemm")  # the module; lowbit.ops.gemm is the function
TENSOR_MODES = dict(a_scale_mode=np.int32(0), b_scale_mode=np.int32(0))  # gemm_p's per-tensor scales


def gemm_ref(a, b, sa=1.0, sb=1.0, bias=None, out_dtype=jnp.bfloat16):
    acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    acc = acc * (jnp.float32(sa) * jnp.float32(sb))
    return (acc if bias is None else acc + bias.astype(jnp.float32)).astype(out_dtype)


def sequential_ref(a, b, sa, sb, bias, out_dtype):
    """The CPU handler's documented order in numpy: exact fp32 products, summed k ascending
    (cumsum is sequential) from an accumulator of +0 as the C++ loop (+ 0 turns cumsum's all
    -0 sum into +0), then fl(fl(sa*sb) * acc), + bias, rounded to out_dtype."""
    a32 = np.asarray(a).astype(np.float32).reshape(-1, a.shape[-1])
    b32 = np.asarray(b).astype(np.float32)
    prod = a32[:, None, :] * b32[None, :, :]
    acc = np.float32(0) + np.cumsum(prod, axis=-1, dtype=np.float32)[..., -1]
    y = np.float32(np.float32(sa) * np.float32(sb)) * acc
    if bias is not None:
        y = y + np.asarray(bias).astype(np.float32)
    return y.astype(out_dtype).reshape(*a.shape[:-1], b.shape[0])


# Error models of the accumulation, as multiples of sum_k |a_k * b_k| * |sa * sb| (below).
U = 2.0**-24  # fp32 unit roundoff
CHUNK = 128   # products a Hopper FP8 GEMM sums in the tensor core before promoting to fp32


def accumulation_gamma(k: int, model: str) -> float:
    """"cpu": two fp32 sums of exact products in different orders; each is within
    (K-1)*u*sum|p| of the exact sum (Higham, gamma_{K-1}), so they differ by <= 2*K*u*sum|p|.
    "gpu": tensor-core adders may truncate instead of rounding (<= 2u per add): 4*K*u.
    "fp8_split" / "fp8_fast": Hopper's FP8 tensor cores add with about 14 significant bits
    (DeepSeek-V3 report, 3.3.2: ~2% max relative error at K=4096 without promotion). Modelled
    as truncation errors of 2^-14 relative that add up coherently, i.e. sqrt(n) * 2^-14 *
    sum|p| over n products relative to sum|p| ~ n, with a 4x margin: n = the promotion chunk
    (split accumulation promotes to fp32 at least every CHUNK products) or n = K (fast).
    A numpy simulation of 14-bit truncating accumulation (K = 4096, normal E4M3 x E5M2 data)
    stays 4x below these bounds elementwise, at 2.6% relative Frobenius error when fast."""
    fp32 = 2 * k * U if model == "cpu" else 4 * k * U
    if model == "fp8_split":
        return fp32 + 4 * np.sqrt(min(k, CHUNK)) * 2.0**-14
    if model == "fp8_fast":
        return fp32 + 4 * np.sqrt(k) * 2.0**-14
    return fp32


# Relative Frobenius error allowed on top of the elementwise bound on the GPU: below what a
# wrong layout (~1) or a lost scale (GPU tests use 0.3 and 2.5: >= 33% off) would give.
FROBENIUS = {"gpu": 2.0**-10, "fp8_split": 2.0**-6, "fp8_fast": 2.0**-3}


def gemm_atol(a, b, sa, sb, out_dtype, *, model="cpu", bias=None):
    """Per-element bound on |x - y| for two GEMMs of the same operands: the accumulation
    model's gamma * sum|a_k*b_k| * |sa*sb|; scaling and the bias add each round once (4*u*|y|);
    rounding both to the out dtype adds at most one ulp of it (eps_out*|y|, plus its smallest
    normal near zero). |y| is bounded by |a.b| + |bias|: with a bias, the one rounding to the
    out dtype is of the sum (a 16-valued bias over a near-zero product rounds at 16's ulp)."""
    a64 = np.asarray(a).astype(np.float64).reshape(-1, a.shape[-1])
    b64 = np.asarray(b).astype(np.float64)
    abs_dot = (np.abs(a64) @ np.abs(b64).T) * abs(float(sa) * float(sb))
    y = np.abs(np.asarray(gemm_ref(a, b, sa, sb, None, jnp.float32), np.float64)).reshape(abs_dot.shape)
    if bias is not None:
        y = y + np.abs(np.asarray(bias, np.float64)).reshape(1, -1)
    info = ml_dtypes.finfo(out_dtype)
    atol = (accumulation_gamma(a64.shape[-1], model) * abs_dot + (4 * U + float(info.eps)) * y
            + float(info.smallest_normal))
    return atol.reshape(*a.shape[:-1], b.shape[0])


def assert_close_gemm(got, want, atol, *, max_rel_frobenius=None):
    """Elementwise within `atol`; optionally also a relative Frobenius error bound (the GPU
    models' elementwise bounds are loose)."""
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got64 - want64)
    bad = ~(err <= atol)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements off; worst excess "
                           f"{np.max(np.where(bad, err - atol, 0)):.3g} at {np.argwhere(bad)[0]}")
    if max_rel_frobenius is None:
        return
    rel = np.linalg.norm(got64 - want64) / max(np.linalg.norm(want64), 1e-30)
    assert rel <= max_rel_frobenius, f"relative Frobenius error {rel:.3g} > {max_rel_frobenius}"


def assert_matches_handler(got, a, b, sa=1.0, sb=1.0, bias=None, out_dtype=jnp.bfloat16):
    """`got` from the default backend against the CPU handler's order: bit for bit on the
    CPU; on the GPU (tools/gpu_check.sh runs the suite there) within the cuBLASLt model."""
    got = np.asarray(got)
    want = sequential_ref(a, b, sa, sb, bias, out_dtype)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        return
    model = "fp8_split" if jnp.dtype(a.dtype) in gemm_mod.FP8 else "gpu"
    a2, b2 = np.asarray(a).reshape(-1, a.shape[-1]), np.asarray(b)
    atol = gemm_atol(a2, b2, sa, sb, out_dtype, model=model, bias=bias).reshape(want.shape)
    assert_close_gemm(got, want, atol, max_rel_frobenius=FROBENIUS[model])


E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FP8_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
TYPE_CASES = ([(x, y, o) for (x, y) in FP8_PAIRS for o in (BF16, F16, F32)]
              + [(BF16, BF16, BF16), (BF16, BF16, F32), (F16, F16, F16), (F16, F16, F32)])
CASE_IDS = [f"{jnp.dtype(x).name}x{jnp.dtype(y).name}->{jnp.dtype(o).name}" for x, y, o in TYPE_CASES]


def operands(rng, m, n, k, a_dtype, b_dtype, out_dtype, with_bias=True, scale=2.0):
    a = (rng.standard_normal((m, k)) * scale).astype(np.float32).astype(a_dtype)
    b = (rng.standard_normal((n, k)) * scale).astype(np.float32).astype(b_dtype)
    sa, sb = np.float32(rng.uniform(0.25, 2.0)), np.float32(rng.uniform(0.25, 2.0))
    bias = (rng.standard_normal(n) * 4).astype(np.float32).astype(out_dtype) if with_bias else None
    return a, b, sa, sb, bias


def cuda_algo_or_first(monkeypatch, fn, *args, capability="10.0"):
    """(algo, algo_or_first) of every lowbit_gemm / lowbit_gemm_nvfp4 custom call of fn
    lowered for CUDA at `capability` (10.0 by default, where NVFP4 reaches cuBLASLt)."""
    monkeypatch.setattr(gemm_mod, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(importlib.import_module("lowbit._ffi"), "require_platform", lambda op, platform: None)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    lines = [ln for ln in text.splitlines() if re.search(r"custom_call @lowbit_gemm(_nvfp4)?\(", ln)]
    return [(int(re.search(r"\balgo = (-?\d+) : i32", ln).group(1)),
             re.search(r"\balgo_or_first = (true|false)", ln).group(1) == "true") for ln in lines]
