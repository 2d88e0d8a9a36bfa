"""lowbit.ops.norm_forward / norm_backward on the GPU: the CUDA kernels (csrc/norm) against
the CPU reference within stated tolerances: the forward with and without FP8 outputs
(colwise, rowwise only, plain) on odd, unaligned and tile-edge shapes, its options (gamma
dtype, zero-centered gamma, E5M2, no y), every launch tuning variant (bit identical to the
default launch where a variant keeps the sum order), special values and NaN; the backward
(dx, dgamma, dbeta) and its run-to-run determinism. All tests are marked `gpu` (they skip
without one)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from norm_reference import (DTYPES, NORMS, ULP, args_for, assert_codes_close, assert_y_close, make,
                            stat_rtol)

from lowbit.ops import norm_backward, norm_forward


# Both backends share the elementwise code (norm_math.h, no FMA contraction); they differ
# only in the order of the row sums (sequential vs tree) and of the dgamma/dbeta sums
# (row order vs two-stage partials). So: mu/rsigma within stat_rtol; y within one ulp of
# its dtype plus the statistics' error; FP8 codes within one code, at a fraction <= 1e-3
# of elements (rounding boundaries crossed by the ~1e-6 relative y difference); amax
# within 2 * stat_rtol; dx like y; dgamma/dbeta within 1e-4 of the column's sum of |terms|.


def assert_forward_matches(g, c, norm_type, dtype, hidden, copies):
    """CUDA forward outputs g against the CPU ones c: statistics within stat_rtol, y within
    assert_y_close, FP8 codes at most one code apart (<= 0.1% of them), amax within 2 rtol.
    `copies`: the FP8 outputs that must exist ("q_rowwise", "q_colwise"); amax with them."""
    rtol = stat_rtol(hidden)
    np.testing.assert_allclose(g.rsigma, c.rsigma, rtol=rtol)
    if norm_type == "layernorm":
        np.testing.assert_allclose(g.mu, c.mu, rtol=rtol, atol=rtol)
    assert_y_close(g.y, c.y.astype(np.float32), dtype)
    for name in copies:
        assert getattr(c, name) is not None and c.amax is not None, name
    for a, b in ((g.q_rowwise, c.q_rowwise), (g.q_colwise, c.q_colwise)):
        assert (a is None) == (b is None)
        if b is not None:
            assert_codes_close(a, b)
    if c.amax is not None:
        np.testing.assert_allclose(g.amax, c.amax, rtol=2 * rtol)


# hidden 1001 and 4097 (not a multiple of 8) take the scalar, unaligned kernels.
GPU_SHAPES = [(1, 128), (3, 200), (257, 1000), (1031, 4096), (333, 8192), (65, 16384),
              (300, 1001), (129, 4097)]


def _gpu_case(norm_type, dtype, shape, rng, gamma_dtype=np.float32, colwise=True):
    x, gamma, beta = make(rng, shape, dtype, gamma_dtype)
    fwd = lambda x, g, b: norm_forward(  # noqa: E731
        x, g, b, norm_type=norm_type, quant_scale=np.float32(40.0), colwise=colwise)
    return x, gamma, args_for(norm_type, beta), fwd


# Forward only: the colwise transposed stores of the CUDA kernel take 16-byte column blocks
# when rows % 16 == 0 (full 32-row tiles, and a last tile of 16 rows at 1040), 4-byte words
# when rows % 4 == 0 (1028: a last tile of 4 rows), bytes otherwise; 16-row tiles at 8192.
GPU_FWD_SHAPES = GPU_SHAPES + [(1040, 4096), (1028, 2048), (96, 8192), (64, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", GPU_FWD_SHAPES, ids=str)
def test_cuda_forward_equals_cpu(norm_type, dtype, shape, rng, cpu, gpu):
    x, gamma, beta, fwd = _gpu_case(norm_type, dtype, shape, rng)
    assert_forward_matches(run_on(gpu, fwd, x, gamma, beta), run_on(cpu, fwd, x, gamma, beta),
                           norm_type, dtype, shape[-1], ("q_rowwise", "q_colwise"))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["rowwise_only", "colwise_only_no_y", "no_quant",
                                     "bf16_gamma", "zero_centered", "e5m2"])
def test_cuda_forward_variants(variant, rng, cpu, gpu):
    x, gamma, beta = make(rng, (515, 2048), ml_dtypes.bfloat16,
                          ml_dtypes.bfloat16 if variant == "bf16_gamma" else np.float32)
    kw = dict(quant_scale=np.float32(16.0))
    kw.update({"rowwise_only": {}, "colwise_only_no_y": dict(rowwise=False, colwise=True,
                                                              return_y=False),
               "no_quant": dict(quant_scale=None), "bf16_gamma": dict(colwise=True),
               "zero_centered": dict(zero_centered_gamma=True, colwise=True),
               "e5m2": dict(quant_dtype=jnp.float8_e5m2, colwise=True)}[variant])
    fwd = lambda x, g, b: norm_forward(x, g, b, **kw)  # noqa: E731
    g, c = run_on(gpu, fwd, x, gamma, beta), run_on(cpu, fwd, x, gamma, beta)
    for a, b in zip(g, c):
        assert (a is None) == (b is None)
        if a is None:
            continue
        if a.dtype.itemsize == 1:
            assert_codes_close(a, b)
        else:
            tol = ULP[np.dtype(a.dtype)] if a.dtype != np.float32 else stat_rtol(2048)
            b32 = b.astype(np.float32)
            assert np.all(np.abs(a.astype(np.float32) - b32) <= tol * (np.abs(b32) + np.abs(b32).max() * 0.01))


# The forward's launch tuning (LOWBIT_NORM_FWD_VARIANT, csrc/norm/norm_plan.h; benchmarked
# by bench/bench_norm.py --variants): every variant must agree with the CPU reference like
# the default. Shapes: one- and two-chunk rows, masked lanes (1000), one-warp rows (200,
# 128), rows spread thinly over blocks; colwise: column segments of 32, 64 or 128 rows
# (colspan) from one block or a cluster of up to 16 blocks reading each other's codes
# (coltile=32, 16, 8, 4; 4 with colspan=128 is capped at 16 blocks, 64 rows), cluster tiles
# contiguous or interleaved over the clusters (colorder), the barrier after the transposed
# stores whole or split (colsplit), block tiles chosen to leave L1 to gamma/beta or not
# (l1keep); 16-byte column stores (rows % 16 == 0: 1040, 272 and 80,
# whose last tiles have 16 or 80 rows), 4-byte stores or bytes (333, 257, 65 rows).
# The default launch is the parkeep=1 kernel (parstages=3 row stages); the settings of the
# per-row gamma/beta kernel name parkeep=0.
FWD_VARIANTS = ["parkeep=0,items=8", "parkeep=0,items=8,stages=2", "parkeep=0,items=16,stages=3",
                "parkeep=0,items=16,stages=4", "parkeep=0,stages=1", "parkeep=0,items=16,block=256",
                "parkeep=0,items=16,block=1024", "parkeep=0,items=8,colblock=512",
                "parkeep=0,colblock=256,stages=4", "parkeep=0,colblock=1024,stages=3",
                "parkeep=0,coltile=32", "parkeep=0,coltile=16", "parkeep=0,coltile=8",
                "parkeep=0,coltile=4,colblock=1024", "parkeep=0,items=8,coltile=8",
                "parkeep=0,colspan=32,colorder=0,colsplit=0,l1keep=0",
                "parkeep=0,colspan=32,coltile=8", "parkeep=0,colspan=64",
                "parkeep=0,colspan=64,colorder=0,coltile=16",
                "parkeep=0,colspan=128,colsplit=0,coltile=4", "parkeep=0,colsplit=0,colblock=1024",
                "parkeep=0,l1keep=0,colorder=0", "items=8,parkeep=1",
                "parstages=2", "parstages=1,coltile=8", "parstages=4,colblock=256", "parstages=0"]
FWD_VARIANT_SHAPES = [(3, 200), (272, 128), (257, 1000), (1040, 4096), (333, 8192), (80, 8192),
                      (65, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", FWD_VARIANTS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", FWD_VARIANT_SHAPES, ids=str)
def test_cuda_forward_tuning_variants(variant, norm_type, dtype, shape, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", variant)
    x, gamma, beta = make(rng, shape, dtype)
    beta = args_for(norm_type, beta)
    # The three kernels: colwise (its own block size and tiles), rowwise only, plain.
    for kw in (dict(quant_scale=np.float32(40.0), colwise=True),
               dict(quant_scale=np.float32(40.0)), {}):
        fwd = lambda x, g, b: norm_forward(x, g, b, norm_type=norm_type, **kw)  # noqa: E731
        assert_forward_matches(run_on(gpu, fwd, x, gamma, beta), run_on(cpu, fwd, x, gamma, beta),
                               norm_type, dtype, shape[-1],
                               ("q_rowwise",) * ("quant_scale" in kw) + ("q_colwise",) * bool(kw.get("colwise")))


# Settings that keep the items per thread (so the order of the row sums) and the
# elementwise math: gamma/beta staged in shared memory (parsmem: colwise, and the rowwise /
# plain kernels of > 8 items per thread; where the parameters do not fit beside two row
# stages and a 4-row tile, e.g. 16384 layernorm colwise, they are loaded per row), cluster barriers ordering
# shared memory only (colbar, split or whole), one block of 1024 threads per SM
# (colblock=1024: 4096 takes one 32-row tile without a cluster), gamma/beta held in
# registers by the colwise kernel (parkeep: blocks of <= 512 threads, one or more row
# groups, with or without a cluster; 16384 falls back to per-row loads). Each kernel's
# outputs (colwise, rowwise only, plain) must equal the default launch's bit for bit, and
# the CPU reference within its tolerances.
EXACT_FWD_VARIANTS = ["parkeep=0,parsmem=1", "parkeep=0,colbar=1", "parkeep=0,parsmem=1,colbar=1,colsplit=0",
                      "parkeep=0,parsmem=1,colblock=1024", "parkeep=0,colblock=1024,coltile=16,colbar=1",
                      "parkeep=0,parsmem=1,coltile=4,colspan=64,colbar=1,block=1024",
                      "parkeep=1,coltile=4,colspan=64,colsplit=0", "parkeep=0", "parkeep=0,stages=3",
                      "parstages=2"]


def assert_outputs_bit_identical(got, default, context=None):
    """Every NormForwardOut field of a tuning variant's launch equals the default launch's bit
    for bit (or both are None)."""
    for name in ("y", "mu", "rsigma", "q_rowwise", "q_colwise", "amax"):
        a, b = getattr(got, name), getattr(default, name)
        assert (a is None) == (b is None), (name, context)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (name, context)
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"{name} {context}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", EXACT_FWD_VARIANTS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("gamma_like_x,zero_centered", [(False, False), (True, True)])
@pytest.mark.parametrize("shape", [(1040, 4096), (333, 8192), (80, 8192), (65, 16384), (515, 2048)],
                         ids=str)
def test_cuda_forward_variants_bit_identical(variant, norm_type, dtype, gamma_like_x,
                                             zero_centered, shape, rng, cpu, gpu, monkeypatch):
    x, gamma, beta = make(rng, shape, dtype, dtype if gamma_like_x else np.float32)
    beta = args_for(norm_type, beta)
    for kw in (dict(quant_scale=np.float32(40.0), colwise=True),
               dict(quant_scale=np.float32(40.0)), {}):
        fwd = lambda x, g, b: norm_forward(  # noqa: E731
            x, g, b, norm_type=norm_type, zero_centered_gamma=zero_centered, **kw)
        monkeypatch.delenv("LOWBIT_NORM_FWD_VARIANT", raising=False)
        default = run_on(gpu, fwd, x, gamma, beta)
        monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", variant)
        got = run_on(gpu, fwd, x, gamma, beta)
        assert_outputs_bit_identical(got, default, kw)
        assert_forward_matches(got, run_on(cpu, fwd, x, gamma, beta), norm_type, dtype, shape[-1],
                               ("q_rowwise",) * ("quant_scale" in kw)
                               + ("q_colwise",) * bool(kw.get("colwise")))


# The parkeep=1 and parkeep=0 kernels in more combinations (one or more row groups,
# clusters of 1 to 16 blocks, contiguous or interleaved tiles, row stages, gamma/beta in
# shared memory) on special values: inf, NaN, zeros, subnormals and near-max x planted at
# random (random_with_specials), plus a zero row, a constant row and a row whose sums
# overflow; odd row counts. Every output must equal the default launch's bit for bit (the
# same elementwise code and sum order: NaN chunks take the same codec path); against the
# CPU reference the NaN pattern of y and the y of the rows without planted values agree.
# Not named *variants*: tools/gpu_check.sh's memcheck selection takes only the three of
# them in EXACT_FWD_VARIANTS.
SPECIAL_FWD_VARIANTS = ["parkeep=1", "parkeep=1,coltile=16,stages=3",
                        "parkeep=1,coltile=4,colspan=64,colsplit=0",
                        "parkeep=1,colblock=256,colbar=0", "parkeep=1,parstages=4", "parkeep=0",
                        "parkeep=0,colorder=0,stages=3", "parkeep=0,parsmem=1"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SPECIAL_FWD_VARIANTS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(333, 8192), (1041, 4096), (517, 2048)], ids=str)
def test_cuda_forward_tuning_special_values(variant, norm_type, dtype, shape, rng, cpu, gpu,
                                            monkeypatch):
    x = random_with_specials(rng, shape, dtype)
    x[5] = 0
    x[6] = 1.5
    x[7] = ml_dtypes.finfo(dtype).max
    _, gamma, beta = make(rng, shape, dtype)
    beta = args_for(norm_type, beta)
    fwd = lambda x, g, b: norm_forward(  # noqa: E731
        x, g, b, norm_type=norm_type, quant_scale=np.float32(40.0), colwise=True)
    monkeypatch.delenv("LOWBIT_NORM_FWD_VARIANT", raising=False)
    default = run_on(gpu, fwd, x, gamma, beta)
    monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", variant)
    got = run_on(gpu, fwd, x, gamma, beta)
    assert_outputs_bit_identical(got, default)
    ref = run_on(cpu, fwd, x, gamma, beta)
    y, ref_y = got.y.astype(np.float32), ref.y.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref_y))
    xf = np.abs(x.astype(np.float32))
    plain = np.all((xf < 1e3) & ((xf == 0) | (xf > 1e-30)), axis=1)  # no planted special
    assert plain.sum() > shape[0] // 2 and plain[5] and plain[6] and not plain[7]
    assert_y_close(y[plain], ref_y[plain], dtype)


@pytest.mark.gpu
def test_cuda_forward_bad_tuning_variant(rng, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", "stages=9")
    x, gamma, beta = make(rng, (8, 256), ml_dtypes.bfloat16)
    with pytest.raises(Exception, match=r"lowbit_norm_forward: LOWBIT_NORM_FWD_VARIANT: bad entry 'stages=9'"):
        run_on(gpu, lambda x: norm_forward(x, gamma, beta), x)


@pytest.mark.gpu
def test_cuda_forward_nan(rng, cpu, gpu):
    x, gamma, beta = make(rng, (64, 1024), ml_dtypes.bfloat16)
    x[7, 9] = np.nan
    fwd = lambda x: norm_forward(x, gamma, beta, quant_scale=np.float32(1.0), colwise=True)  # noqa: E731
    g, c = run_on(gpu, fwd, x), run_on(cpu, fwd, x)
    assert np.isnan(g.amax[0]) and np.isnan(c.amax[0])
    np.testing.assert_array_equal(np.isnan(g.y.astype(np.float32)), np.isnan(c.y.astype(np.float32)))


# Backward: 16384 x 1024 (8 row groups per block, many rows per group) and 4099 x 256 (32
# single-warp groups per block for bf16/f16, a masked last tile) exercise the next-row
# prefetch across tiles and the in-block sum of the groups' dgamma/dbeta.
GPU_BWD_SHAPES = GPU_SHAPES + [(16384, 1024), (4099, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", GPU_BWD_SHAPES, ids=str)
def test_cuda_backward_equals_cpu(norm_type, dtype, shape, rng, cpu, gpu):
    _check_cuda_backward(norm_type, dtype, shape, rng, cpu, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma_dtype,zero_centered", [(ml_dtypes.bfloat16, False),
                                                       (ml_dtypes.bfloat16, True),
                                                       (np.float32, True)], ids=str)
def test_cuda_backward_gamma_variants(gamma_dtype, zero_centered, rng, cpu, gpu):
    _check_cuda_backward("layernorm", ml_dtypes.bfloat16, (515, 2048), rng, cpu, gpu,
                         gamma_dtype=gamma_dtype, zero_centered=zero_centered)


def _check_cuda_backward(norm_type, dtype, shape, rng, cpu, gpu, gamma_dtype=np.float32,
                         zero_centered=False):
    x, gamma, beta = make(rng, shape, dtype, gamma_dtype)
    dz = rng.standard_normal(shape).astype(dtype)
    o = run_on(cpu, lambda x: norm_forward(x, gamma, args_for(norm_type, beta),
                                           norm_type=norm_type,
                                           zero_centered_gamma=zero_centered), x)
    bwd = lambda *a: norm_backward(*a, norm_type=norm_type,  # noqa: E731
                                   zero_centered_gamma=zero_centered)
    args = (dz, x, o.mu, o.rsigma, gamma)
    g, c = run_on(gpu, bwd, *args), run_on(cpu, bwd, *args)
    assert_y_close(g[0], c[0].astype(np.float32), dtype)
    xhat = (x.astype(np.float32) - (0 if o.mu is None else o.mu[..., None])) * o.rsigma[..., None]
    dzf = dz.astype(np.float32).reshape(-1, shape[-1])
    scales = [np.abs(dzf * xhat.reshape(-1, shape[-1])).sum(0), np.abs(dzf).sum(0)]
    # bf16 dgamma/dbeta: the two fp32 sums may round to neighbouring bf16 values.
    rounding = 0.0 if np.dtype(gamma_dtype) == np.float32 else ULP[np.dtype(gamma_dtype)]
    for got, want, s in zip(g[1:], c[1:], scales):
        if want is not None:
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.all(np.abs(got - want) <= 1e-4 * s + rounding * np.abs(want) + 1e-30)
    again = run_on(gpu, bwd, *args)  # deterministic dx and dgamma/dbeta
    for a, b in zip(again, g):
        if b is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_cuda_concurrent_shapes_from_threads(rng, gpu):
    """Host threads running the norm forward (FP8 copies) and backward at different hidden sizes
    at once: the kernels' dynamic shared-memory size follows the shape, and its limit is the
    kernel's, shared by every thread; it is raised and never lowered under one lock
    (RaiseDynamicSmemLimit), so no launch fails for another thread's setting. Each thread's
    results equal those of a single-threaded run."""
    import threading

    import jax

    def case(hidden):
        x = jnp.asarray(rng.standard_normal((257, hidden)), jnp.bfloat16)
        g = jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16)

        def step(x):
            out = norm_forward(x, g, b, quant_scale=jnp.float32(2.0), rowwise=True, colwise=True)
            dx, dg, db = norm_backward(x, x, out.mu, out.rsigma, g)
            return out.y, out.q_colwise, dx, dg, db
        g, b = jax.device_put((g, b), gpu)
        return jax.jit(step), jax.device_put(x, gpu)

    cases = [case(h) for h in (256, 1024, 4096, 12288)]
    want = [jax.tree.map(np.asarray, f(x)) for f, x in cases]
    errors, results = [], {}

    def run(i):
        f, x = cases[i % len(cases)]
        try:
            for _ in range(40):
                got = jax.tree.map(np.asarray, f(x))
            results[i] = got
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    for i, got in results.items():
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8)), got,
                     want[i % len(cases)])
    assert len(results) == 8
