"""lowbit.dense's fused backward (lowbit.ops.dense_backward_fp8, csrc/dense/dense_backward.h):
dy's FP8 copies placed inside dk's buffer until the wgrad overwrites them.

The reference is lowbit.dense's unfused backward (LOWBIT_DENSE_BACKWARD=unfused: quantize dy,
then the two lowbit_gemm calls). On the CPU both run the same C++ references on the same
values, so every output is equal bit for bit: a placement that let one step overwrite an
operand a later step reads would show up here as wrong values (CheckDenseBwdPlan, run on
every plan, also rules out a GEMM writing its own operand, which these copies would not see).
On the GPU the dgrad and wgrad run as batched and sliced cuBLASLt GEMMs (other algorithms than
the whole GEMM), so dx and dk are compared within GEMM_TOL and dy's quantize outputs (amax,
dbias, the state) exactly.
"""

from __future__ import annotations

import importlib
import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gpu_devices, rel_err, run_on
from jax.sharding import NamedSharding, PartitionSpec as P

from lowbit.dense import DENSE_BACKWARD_ENV, dense
from lowbit.ops.gemm import PSUM_ENV
from lowbit.sharding import MeshResource, global_shard_guard
from lowbit.ops.dense_backward import dense_backward_fp8, dense_backward_fp8_p, dense_backward_plan
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

gemm_mod = importlib.import_module("lowbit.ops.gemm")

# (x shape, features): (m, n, k) = (prod(x.shape[:-1]), features, x.shape[-1]).
# The first is the seed Dense's proportions scaled down (m = 2k, n = 4k: 8 slices), the
# second takes 2 slices, the third has three batch dims (m = k, 8 slices), the fourth puts
# dy's rowwise segment boundary (row k = 320) inside a quantize tile (the CUDA kernel's 128-
# and 256-row tiles: the rows past it take the next segment's place) and has two unequal
# segments (the dgrad as one GEMM each). A bf16 (2-byte) dk fits dy's rowwise copy only where
# m <= k: the second and third.
# Relative error of lowbit's FP8 GEMMs: the CPU sums in fp32 in k order; Hopper's FP8 tensor
# cores keep fewer bits inside each accumulation chunk even with the split accumulator (two
# cuBLASLt algorithms for one product measured 1.0e-4 apart on an H200), as in test_dense.py.
GEMM_TOL = 1e-5 if jax.default_backend() == "cpu" else 5e-4

SHAPES = [((2, 256, 256), 1024), ((512, 512), 1024), ((2, 2, 64, 256), 1024), ((512, 320), 1024)]


def step(x, kernel, bias, qs, dy):
    """(dx, dk, dbias, the updated quantizer set) of one dense backward."""
    _, vjp = jax.vjp(lambda x, k, b, q: dense(x, k, b, contracting_dims=((x.ndim - 1,), (0,)), quantizer_set=q),
                     x, kernel, bias, qs)
    return vjp(dy)


def inputs(rng, x_shape, features, dtype, k_dtype, use_bias, specials=True):
    x = rng.standard_normal(x_shape).astype(np.float32)
    kernel = (rng.standard_normal((x_shape[-1], features)) * 0.05).astype(np.float32)
    dy = rng.standard_normal((*x_shape[:-1], features)).astype(np.float32) * 3
    if specials:  # a zero row, near-max values (saturate in E5M2 after scaling), inf and NaN
        dy.reshape(-1, features)[1] = 0.0
        dy.reshape(-1, features)[2, :7] = [6e4, -6e4, 1e-30, -0.0, 5e4, np.inf, np.nan]
    bias = rng.standard_normal(features).astype(np.float32) if use_bias else None
    return (jnp.asarray(x, dtype), jnp.asarray(kernel, k_dtype), None if bias is None else jnp.asarray(bias, dtype),
            jnp.asarray(dy, dtype))


def backward_both_ways(monkeypatch, fn, *args, fused="fused"):
    """fn(*args) traced with the fused backward (LOWBIT_DENSE_BACKWARD=`fused`) and with the
    unfused one (jit each; a fresh function per mode, so that no trace is reused across the
    switch)."""
    outs = []
    for mode in (fused, "unfused"):
        monkeypatch.setenv(DENSE_BACKWARD_ENV, mode)
        outs.append(jax.tree.map(np.asarray, jax.jit(lambda *a: fn(*a))(*args)))
    return outs


def backward_jaxpr(fn, *args) -> str:
    return str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def assert_trees_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


@pytest.mark.parametrize("x_shape,features", SHAPES)
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("dtype,k_dtype,use_bias", [(jnp.bfloat16, jnp.float32, True), (jnp.float32, jnp.float32, False),
                                                    (jnp.bfloat16, jnp.bfloat16, True)])
def test_fused_equals_unfused_bit_for_bit(monkeypatch, rng, x_shape, features, recipe, dtype, k_dtype, use_bias):
    if jax.default_backend() != "cpu":
        pytest.skip("bit-exact on the CPU references; the GPU comparison is test_cuda_fused_matches_unfused")
    if k_dtype == jnp.bfloat16 and math.prod(x_shape[:-1]) > x_shape[-1]:
        pytest.skip("m > k: no placement for a bf16 dk (test_applies_only_where_it_should)")
    x, kernel, bias, dy = inputs(rng, x_shape, features, dtype, k_dtype, use_bias)
    qs = QuantizerFactory.create_set(recipe)
    if isinstance(recipe, DelayedScaling):  # a realistic state: scales from an earlier step
        _, _, _, qs = step(x, kernel, bias, qs, dy)
    fn = lambda x, k, b, q, dy: step(x, k, b, q, dy)  # noqa: E731
    assert "lowbit_dense_backward_fp8" in backward_jaxpr(fn, x, kernel, bias, qs, dy)
    fused, unfused = backward_both_ways(monkeypatch, fn, x, kernel, bias, qs, dy)
    assert_trees_equal(fused, unfused)
    dx, dk, db, new_qs = fused
    assert dx.shape == x.shape and dx.dtype == x.dtype and dk.shape == kernel.shape and dk.dtype == kernel.dtype
    assert np.isnan(dk).any() and np.isfinite(dx.reshape(-1, dx.shape[-1])[0]).all()  # NaN in dk, not dx row 0
    assert (db is None) == (not use_bias)


def test_fused_backward_against_quantized_reference(rng):
    """dx = dy_q . k_q^T and dk = x_q^T . dy_q (current scaling, E5M2 dy), the fused path."""
    x, kernel, bias, dy = inputs(rng, (512, 256), 1024, jnp.float32, jnp.float32, True, specials=False)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    dx, dk, db, _ = jax.jit(step)(x, kernel, bias, qs, dy)

    def q(a, dtype):
        amax = jnp.max(jnp.abs(a))
        s = float(jnp.finfo(dtype).max) / amax
        return jnp.clip(a * s, -float(jnp.finfo(dtype).max), float(jnp.finfo(dtype).max)).astype(dtype).astype(
            jnp.float32) / s

    e4, e5, hi = jnp.float8_e4m3fn, jnp.float8_e5m2, jax.lax.Precision.HIGHEST
    dyq = q(dy, e5)
    assert rel_err(dx, jnp.dot(dyq, q(kernel, e4).T, precision=hi)) < GEMM_TOL
    assert rel_err(dk, jnp.dot(q(x, e4).T, dyq, precision=hi)) < GEMM_TOL
    np.testing.assert_allclose(db, np.asarray(dy).sum(0), rtol=1e-5, atol=1e-4)


def test_applies_only_where_it_should(rng):
    fn = lambda x, k, q, dy: step(x, k, None, q, dy)  # noqa: E731
    x, kernel, _, dy = inputs(rng, (512, 256), 1024, jnp.bfloat16, jnp.float32, False)
    delayed = QuantizerFactory.create_set(DelayedScaling())
    assert "lowbit_dense_backward_fp8" in backward_jaxpr(fn, x, kernel, delayed, dy)
    # No placement: m = 2k + 16 rows do not fit dk's left half; n / S not a multiple of 128.
    for xs, f in [((528, 256), 1024), ((512, 256), 1000)]:
        x2, k2, _, dy2 = inputs(rng, xs, f, jnp.bfloat16, jnp.float32, False)
        assert dense_backward_plan(xs[0], f, xs[1], jnp.float32, jnp.bfloat16, False) is None
        assert "lowbit_dense_backward_fp8" not in backward_jaxpr(fn, x2, k2, delayed, dy2)
    # A bf16 dk holds dy's rowwise copy only where m <= k.
    assert "lowbit_dense_backward_fp8" not in backward_jaxpr(fn, x, kernel.astype(jnp.bfloat16), delayed, dy)
    # Block recipes keep their own backward.
    block = QuantizerFactory.create_set(Float8BlockScaling())
    assert "lowbit_dense_backward_fp8" not in backward_jaxpr(fn, x, kernel, block, dy)


def test_env_switch_and_bad_values(monkeypatch, rng):
    fn = lambda x, k, q, dy: step(x, k, None, q, dy)  # noqa: E731
    x, kernel, _, dy = inputs(rng, (512, 256), 1024, jnp.bfloat16, jnp.float32, False)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "unfused")
    assert "lowbit_dense_backward_fp8" not in backward_jaxpr(fn, x, kernel, qs, dy)
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "sometimes")
    with pytest.raises(ValueError, match="LOWBIT_DENSE_BACKWARD='sometimes': expected one of 'fused', 'fused_sharded'"):
        backward_jaxpr(fn, x, kernel, qs, dy)


def test_plan_sizes():
    # The seed Dense (8x2048 tokens, 8192 -> 32768, f32 kernel): 8 slices; the scratch is one
    # slice of dy's colwise copy (4096 x 16384 bytes) behind the 32 MiB cuBLASLt workspace.
    slices, scratch = dense_backward_plan(16384, 32768, 8192, jnp.float32, jnp.bfloat16, True)
    assert slices == 8
    assert scratch == (32 << 20) + 256 + 4096 * 16384
    assert dense_backward_plan(16384, 32768, 8192, jnp.float32, jnp.bfloat16, True, cuda=False) == (8, 4096 * 16384)
    assert scratch < 2 * 16384 * 32768 // 8  # far below the unfused copies (1 GiB)
    assert dense_backward_plan(16384, 32768, 8192, jnp.bfloat16, jnp.bfloat16, True) is None  # m > k for bf16 dk


def test_op_errors_name_the_argument(rng):
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    dy = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
    x_col = jnp.ones((256, 512), f8)
    one = jnp.ones((1,), f32)
    with pytest.raises(ValueError, match="no placement"):
        dense_backward_fp8(dy[:500], x_col[:, :500], jnp.ones((256, 1024), f8), one, one, one, one,
                           q_dtype=jnp.float8_e5m2, dx_dtype=jnp.bfloat16, dk_dtype=f32, compute_dbias=False)
    with pytest.raises(ValueError, match="q_dtype"):
        dense_backward_fp8(dy, x_col, jnp.ones((256, 1024), f8), one, one, one, one, q_dtype=jnp.bfloat16,
                           dx_dtype=jnp.bfloat16, dk_dtype=f32, compute_dbias=False)
    # The arguments are checked before the placement (which would call any of these "no placement").
    k_row = jnp.ones((256, 1024), f8)
    for args, exc, match in [
            ((dy[0], x_col, k_row), ValueError, "dense_backward_fp8: dy: expected a 2-D array"),
            ((dy.astype(jnp.int32), x_col, k_row), TypeError, "dense_backward_fp8: dy: expected float32"),
            ((dy, x_col.astype(f32), k_row), TypeError, "dense_backward_fp8: x_col: expected float8"),
            ((dy, x_col[:, :500], k_row), ValueError, "dense_backward_fp8: x_col, k_row: expected shapes")]:
        with pytest.raises(exc, match=match):
            dense_backward_fp8(*args, one, one, one, one, q_dtype=jnp.float8_e5m2, dx_dtype=jnp.bfloat16,
                               dk_dtype=f32, compute_dbias=False)
    with pytest.raises(Exception, match="lowbit_dense_backward_fp8: k_row"):  # the handler's check
        jax.block_until_ready(dense_backward_fp8_p.bind(
            dy, x_col, jnp.ones((256, 1008), f8), one, one, one, one, q_dtype=np.int32(5),
            dx_dtype=jnp.dtype(jnp.bfloat16), dk_dtype=jnp.dtype(f32), dbias=False))
    with pytest.raises(Exception, match="lowbit_dense_backward_fp8: wgrad_algo"):  # past kGemmMaxAlgo
        jax.block_until_ready(dense_backward_fp8_p.bind(
            dy, x_col, jnp.ones((256, 1024), f8), one, one, one, one, q_dtype=np.int32(5),
            dx_dtype=jnp.dtype(jnp.bfloat16), dk_dtype=jnp.dtype(f32), dbias=False, wgrad_algo=32))


def _fused_attrs(rng, dgrad_split=True):
    """The fused op's attributes (name -> text) as lowered for dy (512, 1024), an f32 dk."""
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    dy = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
    one = jnp.ones((1,), f32)
    fn = lambda dy: dense_backward_fp8(dy, jnp.ones((256, 512), f8), jnp.ones((256, 1024), f8), one, one, one,  # noqa: E731
                                       one, q_dtype=jnp.float8_e5m2, dx_dtype=jnp.bfloat16, dk_dtype=f32,
                                       compute_dbias=False, dgrad_split=dgrad_split)
    text = jax.jit(fn).lower(dy).as_text()
    names = ("dgrad_algo", "wgrad_algo", "dgrad_algo_or_first", "wgrad_algo_or_first")
    return {name: re.search(rf"\b{name} = ([^,}}]+)", text).group(1).strip() for name in names}


@pytest.mark.parametrize("dgrad_split", [True, False], ids=["split", "fast"])
def test_op_takes_the_gemm_algorithms_by_kind(rng, monkeypatch, dgrad_split):
    """The fused op's two GEMM launches run at the cuBLASLt heuristic indices of their kinds
    (LOWBIT_GEMM_ALGO), passed to the handler as attributes: at split accumulation each has a
    kind of its own, fused_dgrad (dy's rowwise copy read at dk's pitch) and fused_wgrad (dy's
    colwise slices, dk's columns at its pitch), not the standalone GEMMs' fp8_split and
    fp8_split_f32; at fast accumulation the dgrad takes fp8_fast. Indices the user set are
    strict (no fallback to cuBLASLt's first choice)."""
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_split=3,fp8_split_f32=5,fused_dgrad=6,fp8_fast=7,fused_wgrad=4")
    attrs = _fused_attrs(rng, dgrad_split)
    assert attrs["dgrad_algo"] == ("6 : i32" if dgrad_split else "7 : i32"), attrs
    assert attrs["wgrad_algo"] == "4 : i32", attrs
    assert attrs["dgrad_algo_or_first"] == attrs["wgrad_algo_or_first"] == "false", attrs


def test_op_defaults_fall_back_to_the_first_choice(rng, monkeypatch):
    """Unset, the indices are DEFAULT_ALGO's (fused_dgrad's is not the standalone dgrad's) and
    marked as library defaults, which the CUDA handler replaces by cuBLASLt's first choice
    where a problem has no such entry; a kind the user sets is strict, the other stays a
    default."""
    monkeypatch.delenv("LOWBIT_GEMM_ALGO", raising=False)
    attrs = _fused_attrs(rng)
    assert attrs["dgrad_algo"] == f"{gemm_mod.DEFAULT_ALGO['fused_dgrad']} : i32", attrs
    assert attrs["wgrad_algo"] == f"{gemm_mod.DEFAULT_ALGO['fused_wgrad']} : i32", attrs
    assert attrs["dgrad_algo_or_first"] == attrs["wgrad_algo_or_first"] == "true", attrs
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fused_dgrad=2")
    attrs = _fused_attrs(rng)
    assert (attrs["dgrad_algo"], attrs["dgrad_algo_or_first"], attrs["wgrad_algo_or_first"]) == \
        ("2 : i32", "false", "true"), attrs


def test_unfused_fallback_gemms_take_the_standalone_kinds(monkeypatch):
    """Where no placement fits and the op runs the unfused GEMMs, its dgrad is a standalone
    GEMM again and takes fp8_split's index, not fused_dgrad's; its wgrad likewise
    fp8_split_f32's, not fused_wgrad's."""
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_split=3,fused_dgrad=6,fp8_split_f32=5,fused_wgrad=2")
    attrs = importlib.import_module("lowbit.ops.dense_backward")._gemm_attrs
    args = (jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, True, True)
    assert (int(attrs(*args)["dgrad_algo"]), int(attrs(*args)["wgrad_algo"])) == (6, 2)
    assert (int(attrs(*args, fused=False)["dgrad_algo"]), int(attrs(*args, fused=False)["wgrad_algo"])) == (3, 5)


def test_unfused_ops_mark_library_default_indices(rng, monkeypatch):
    """The unfused primitives the op falls back to (allow_fused=False: a pure data-parallel
    mesh) pass the same algo_or_first as the fused op: true for DEFAULT_ALGO's indices, false
    for a kind the user sets."""
    from gemm_reference import cuda_algo_or_first
    local = importlib.import_module("lowbit.ops.dense_backward")._local
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    dy = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
    one = jnp.ones((1,), f32)

    def attrs():  # a fresh function per trace: jit's trace cache does not see the variable
        fn = lambda dy: local(dy, jnp.ones((256, 512), f8), jnp.ones((256, 1024), f8), one, one, one, one,  # noqa: E731
                              q_code=5, dx_dtype=jnp.dtype(jnp.bfloat16), dk_dtype=jnp.dtype(f32), dbias=False,
                              dbias_dtype=None, allow_fused=False)
        return cuda_algo_or_first(monkeypatch, fn, dy)

    monkeypatch.delenv("LOWBIT_GEMM_ALGO", raising=False)
    assert attrs() == [(0, True), (0, True)]
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_split_f32=2")
    assert attrs() == [(0, True), (2, False)]


def test_vmap_maps_the_op(rng):
    fn = lambda x, k, dy: step(x, k, None, QuantizerFactory.create_set(Float8CurrentScaling()), dy)[:2]  # noqa: E731
    x, kernel, _, dy = inputs(rng, (512, 256), 1024, jnp.float32, jnp.float32, False, specials=False)
    xs, dys = jnp.stack([x, x * 2]), jnp.stack([dy, -dy])
    dx, dk = jax.jit(jax.vmap(fn, in_axes=(0, None, 0)))(xs, kernel, dys)
    for i in range(2):
        dx_i, dk_i = jax.jit(fn)(xs[i], kernel, dys[i])
        np.testing.assert_array_equal(np.asarray(dx[i]), np.asarray(dx_i))
        np.testing.assert_array_equal(np.asarray(dk[i]), np.asarray(dk_i))


# Sharded (4 virtual CPU devices, (dp=2, tp=2)): x spec, kernel spec, dy spec, MeshResource.
SHARDED_LAYOUTS = {
    "dp": (P("dp"), P(), P("dp"), MeshResource(dp_resource="dp")),
    "tp_column": (P(), P(None, "tp"), P(None, None, "tp"), MeshResource(tp_resource="tp")),
    "tp_row": (P(None, None, "tp"), P("tp", None), P(), MeshResource(tp_resource="tp")),
    "dp_tp": (P("dp"), P(None, "tp"), P("dp", None, "tp"), MeshResource(dp_resource="dp", tp_resource="tp")),
}


@pytest.mark.parametrize("layout", sorted(SHARDED_LAYOUTS))
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()], ids=["delayed", "current"])
def test_sharded_fused_equals_sharded_unfused_bit_for_bit(monkeypatch, rng, layout, recipe):
    """Under a MeshResource, dense_backward_fp8_sharded: each device runs the fused op on its
    blocks (dp: m / 2 rows; tp column: n / 2 features), psums dx over n's axes, dk and the
    fp32 dbias over m's, and gives the unfused sharded ops' bits (their GEMM psums in the
    output dtype, LOWBIT_GEMM_PSUM's default). Row-parallel TP leaves each device k / 2 = 128
    rows of dk, too few for dy's 512 rowwise rows (m <= 2k for an f32 dk): those devices run
    the unfused primitives inside the op, with the same bits. The default ("fused") runs it
    where the MeshResource names a tp axis, and keeps the unfused ops under pure DP; the mode
    "fused_sharded" runs it under every layout."""
    if jax.default_backend() != "cpu":
        pytest.skip("virtual CPU devices; tests/test_sharding_gpu.py runs the tutorial's layout on 4 GPUs")
    x_spec, k_spec, dy_spec, resource = SHARDED_LAYOUTS[layout]
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])
    x, kernel, bias, dy = inputs(rng, (2, 256, 256), 1024, jnp.bfloat16, jnp.float32, True)
    qs = QuantizerFactory.create_set(recipe)
    if isinstance(recipe, DelayedScaling):
        _, _, _, qs = step(x, kernel, bias, qs, dy)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(x, x_spec), put(kernel, k_spec), put(bias, P()), qs, put(dy, dy_spec))
    fn = lambda x, k, b, q, dy: step(x, k, b, q, dy)  # noqa: E731
    with global_shard_guard(resource):
        fused, unfused = backward_both_ways(monkeypatch, fn, *args, fused="fused_sharded")
        monkeypatch.setenv(DENSE_BACKWARD_ENV, "fused_sharded")
        hlo = jax.jit(lambda *a: fn(*a)).lower(*args).compile().as_text()
        monkeypatch.setenv(DENSE_BACKWARD_ENV, "fused")
        default_hlo = jax.jit(lambda *a: fn(*a)).lower(*args).compile().as_text()
    assert_trees_equal(fused, unfused)
    default_fused = resource.tp_resource is not None and layout != "tp_row"
    assert ("lowbit_dense_backward_fp8" in default_hlo) == default_fused
    assert ("lowbit_dense_backward_fp8" in hlo) == (layout != "tp_row")
    assert "all-gather" not in hlo and "reduce-scatter" not in hlo
    # and close to the single-device backward (only the psums' rounding differs)
    single = jax.tree.map(np.asarray, jax.jit(lambda *a: fn(*a))(x, kernel, bias, qs, dy))
    for got, want in zip(jax.tree.leaves(fused[:3]), jax.tree.leaves(single[:3])):
        got, want = got.astype(np.float32), want.astype(np.float32)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), finite)
        np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=2e-2 * np.abs(want[finite]).max())


def test_tp_axis_of_one_device_keeps_the_unfused_ops(monkeypatch, rng):
    """The seed tutorial's DP=2 configuration: a (dp=2, tp=1) mesh under MeshResource(dp, tp).
    The tp axis shards nothing, so by default the compiled step has no fused op (data
    parallelism alone: the separate ops overlap the wgrad's all-reduce with the dgrad) and the
    same bits as LOWBIT_DENSE_BACKWARD=unfused; "fused_sharded" still runs it; a (2, 2) mesh
    runs it by default."""
    if jax.default_backend() != "cpu":
        pytest.skip("virtual CPU devices")
    x, kernel, bias, dy = inputs(rng, (2, 256, 256), 1024, jnp.bfloat16, jnp.float32, True)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    fn = lambda x, k, b, q, dy: step(x, k, b, q, dy)  # noqa: E731

    def compiled(mesh, mode):
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(x, P("dp")), put(kernel, P(None, "tp")), put(bias, P()), qs, put(dy, P("dp", None, "tp")))
        monkeypatch.setenv(DENSE_BACKWARD_ENV, mode)
        with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
            exe = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
            return exe.as_text(), jax.tree.map(np.asarray, exe(*args))

    dp_only = jax.make_mesh((2, 1), ("dp", "tp"), devices=jax.devices("cpu")[:2])
    text, out = compiled(dp_only, "fused")
    assert "lowbit_dense_backward_fp8" not in text
    text_unfused, out_unfused = compiled(dp_only, "unfused")
    assert_trees_equal(out, out_unfused)
    assert "lowbit_dense_backward_fp8" in compiled(dp_only, "fused_sharded")[0]
    dp_tp = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])
    assert "lowbit_dense_backward_fp8" in compiled(dp_tp, "fused")[0]


def test_sharded_op_skipped_for_fsdp_and_fp32_psum(monkeypatch, rng):
    """With LOWBIT_DENSE_BACKWARD=fused_sharded, FSDP (reduce-scattered weight gradients) and
    LOWBIT_GEMM_PSUM=fp32 keep the unfused ops."""
    fn = lambda x, k, q, dy: step(x, k, None, q, dy)  # noqa: E731
    x, kernel, _, dy = inputs(rng, (2, 256, 256), 1024, jnp.bfloat16, jnp.float32, False)
    qs = QuantizerFactory.create_set(DelayedScaling())
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "fused_sharded")
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        assert "lowbit_dense_backward_fp8" in backward_jaxpr(fn, x, kernel, qs, dy)
        monkeypatch.setenv(PSUM_ENV, "fp32")
        assert "lowbit_dense_backward_fp8" not in backward_jaxpr(fn, x, kernel, qs, dy)
        monkeypatch.delenv(PSUM_ENV)
    with global_shard_guard(MeshResource(dp_resource="dp", fsdp_resource="dp")):
        assert "lowbit_dense_backward_fp8" not in backward_jaxpr(fn, x, kernel, qs, dy)


def temp_bytes(fn, *args) -> int:
    return jax.jit(lambda *a: fn(*a)).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.gpu
def test_fused_backward_needs_less_temporary_memory(monkeypatch, rng, gpu):
    """On the GPU the compiled step's temporaries shrink by at least dy's colwise copy (m n
    bytes; XLA already put the rowwise one into dk's buffer) less the op's scratch (one
    colwise slice and the GEMM workspace). (XLA:CPU assigns buffers otherwise: not checked.)"""
    x, kernel, bias, dy = inputs(rng, (1024, 512), 2048, jnp.bfloat16, jnp.float32, True, specials=False)
    qs = QuantizerFactory.create_set(DelayedScaling())
    fn = lambda x, k, b, q, dy: step(x, k, b, q, dy)  # noqa: E731
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "unfused")
    unfused = temp_bytes(fn, x, kernel, bias, qs, dy)
    monkeypatch.setenv(DENSE_BACKWARD_ENV, "fused")
    fused = temp_bytes(fn, x, kernel, bias, qs, dy)
    m, n = 1024, 2048
    _, scratch = dense_backward_plan(m, n, 512, jnp.float32, jnp.bfloat16, True)
    assert fused <= unfused - m * n + scratch, (fused, unfused)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape,features", SHAPES)
@pytest.mark.parametrize("dtype,k_dtype,use_bias", [(jnp.bfloat16, jnp.float32, True), (jnp.float32, jnp.float32, False)])
def test_cuda_fused_matches_unfused(monkeypatch, rng, gpu, cpu, x_shape, features, dtype, k_dtype, use_bias):
    x, kernel, bias, dy = inputs(rng, x_shape, features, dtype, k_dtype, use_bias, specials=False)
    qs = QuantizerFactory.create_set(Float8CurrentScaling())
    fn = lambda x, k, b, q, dy: step(x, k, b, q, dy)  # noqa: E731
    outs = {}
    for mode in ("fused", "unfused"):
        monkeypatch.setenv(DENSE_BACKWARD_ENV, mode)
        outs[mode] = run_on(gpu, lambda *a: fn(*a), x, kernel, bias, qs, dy)
        outs[mode + "_cpu"] = run_on(cpu, lambda *a: fn(*a), x, kernel, bias, qs, dy)
    (dx, dk, db, q), (dx_u, dk_u, db_u, q_u) = outs["fused"], outs["unfused"]
    dx_tol = GEMM_TOL if dtype == jnp.float32 else 4e-3  # a bf16 dx: its rounding too
    assert rel_err(dx, dx_u) < dx_tol and rel_err(dk, dk_u) < GEMM_TOL
    assert rel_err(dk, outs["fused_cpu"][1]) < GEMM_TOL and rel_err(dx, outs["fused_cpu"][0]) < dx_tol
    if use_bias:  # dbias: the same kernel and summation order in both
        np.testing.assert_array_equal(db, db_u)
    assert_trees_equal(q, q_u)


@pytest.mark.gpu
def test_cuda_fused_special_values(monkeypatch, rng, gpu):
    """inf/NaN/zeros/near-max in dy: the same amax, dbias and non-finite pattern as unfused."""
    x, kernel, bias, dy = inputs(rng, (512, 256), 1024, jnp.bfloat16, jnp.float32, True)
    qs = QuantizerFactory.create_set(DelayedScaling())
    fn = lambda x, k, b, q, dy: step(x, k, b, q, dy)  # noqa: E731
    outs = []
    for mode in ("fused", "unfused"):
        monkeypatch.setenv(DENSE_BACKWARD_ENV, mode)
        outs.append(run_on(gpu, lambda *a: fn(*a), x, kernel, bias, qs, dy))
    (dx, dk, db, q), (dx_u, dk_u, db_u, q_u) = outs
    np.testing.assert_array_equal(np.isfinite(dk), np.isfinite(dk_u))
    np.testing.assert_array_equal(np.isfinite(dx), np.isfinite(dx_u))
    np.testing.assert_array_equal(db.view(np.uint8), db_u.view(np.uint8))
    assert_trees_equal(q, q_u)


@pytest.mark.gpu
def test_cuda_default_index_past_the_list_runs_the_first_choice(rng, gpu):
    """An index cuBLASLt does not list for the problem (31: it lists far fewer) fails the
    GEMM when the user set it and, marked as a library default (*_algo_or_first), runs
    cuBLASLt's first choice: the same bits as index 0."""
    f8, f32, bf16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16
    dy = jnp.asarray(rng.standard_normal((512, 1024)) * 3, bf16)
    x_col = jnp.asarray(rng.standard_normal((256, 512)), f8)
    k_row = jnp.asarray(rng.standard_normal((256, 1024)), f8)
    s, si = jnp.full((1,), 2.0, f32), jnp.full((1,), 0.5, f32)

    def call(dy, x_col, k_row, s, si, *, algo, or_first):
        return dense_backward_fp8_p.bind(
            dy, x_col, k_row, s, si, si, si, q_dtype=np.int32(5), dx_dtype=jnp.dtype(bf16), dk_dtype=jnp.dtype(f32),
            dbias=False, dgrad_algo=algo, wgrad_algo=algo, dgrad_algo_or_first=or_first, wgrad_algo_or_first=or_first)[:2]

    args = (dy, x_col, k_row, s, si)
    first = run_on(gpu, partial(call, algo=0, or_first=False), *args)
    fallback = run_on(gpu, partial(call, algo=31, or_first=True), *args)
    for got, want in zip(fallback, first):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    with pytest.raises(Exception, match="heuristic algorithms for .*index 31 .*does not exist"):
        jax.block_until_ready(run_on(gpu, partial(call, algo=31, or_first=False), *args))


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_f32_dbias_equals_the_quantizers(rng, platform, cpu):
    """The op's fp32 dbias (what the sharded op psums when dy's rows are sharded) equals
    lowbit.ops.quantize_fp8's fp32 dbias of the same dy bit for bit (one kernel and partial-sum
    order), and its other outputs the bf16-dbias call's."""
    device = cpu if platform == "cpu" else next(iter(gpu_devices()), None)
    if device is None:
        pytest.skip("needs a CUDA GPU")
    from lowbit.ops.quantize import quantize_fp8_p
    f8, f32, bf16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16
    dy = jnp.asarray(rng.standard_normal((512, 1024)) * 3, bf16)
    x_col = jnp.asarray(rng.standard_normal((256, 512)), f8)
    k_row = jnp.asarray(rng.standard_normal((256, 1024)), f8)
    s, si = jnp.full((1,), 2.0, f32), jnp.full((1,), 0.5, f32)

    def both(dy, x_col, k_row, s, si):
        kw = dict(q_dtype=np.int32(5), dx_dtype=jnp.dtype(bf16), dk_dtype=jnp.dtype(f32), dbias=True)
        wide = dense_backward_fp8_p.bind(dy, x_col, k_row, s, si, si, si, dbias_dtype=jnp.dtype(f32), **kw)
        narrow = dense_backward_fp8_p.bind(dy, x_col, k_row, s, si, si, si, **kw)
        quant = quantize_fp8_p.bind(dy, s, flatten_axis=np.int32(1), out_dtype=jnp.dtype(jnp.float8_e5m2),
                                    rowwise=True, colwise=True, dbias_dtype=jnp.dtype(f32))
        return wide, narrow, quant[3]

    wide, narrow, want = run_on(device, both, dy, x_col, k_row, s, si)
    assert wide[2].dtype == np.float32 and wide[2].shape == (1024,)
    np.testing.assert_array_equal(wide[2], want)
    for a, b in zip(wide[:2] + wide[3:], narrow[:2] + narrow[3:]):
        np.testing.assert_array_equal(a, b)
