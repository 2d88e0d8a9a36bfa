"""lowbit.ops.gemm: a jnp reference and the exact summation order of the CPU handler, every
type combination, out dtypes, bias, odd shapes, jit, vmap, sharding over virtual CPU devices,
bad input, and the cuBLASLt handler against the CPU one within a derived tolerance."""

from __future__ import annotations

import importlib
import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit
from lowbit.ops.gemm import PSUM_ENV

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


@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", TYPE_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("m,k,n", [(1, 16, 1), (7, 48, 17), (33, 1000, 64), (33, 16, 17)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_cpu_matches_references(a_dtype, b_dtype, out_dtype, m, k, n, with_bias, rng, cpu):
    """The CPU handler (pinned to the CPU on every backend): its exact order and the jnp one."""
    a, b, sa, sb, bias = operands(rng, m, n, k, a_dtype, b_dtype, out_dtype, with_bias)
    got = run_on(cpu, lambda *x: lowbit.ops.gemm(*x, out_dtype=out_dtype), a, b, sa, sb, bias)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (m, n)
    want = sequential_ref(a, b, sa, sb, bias, out_dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    assert_close_gemm(got, gemm_ref(a, b, sa, sb, bias, out_dtype), gemm_atol(a, b, sa, sb, out_dtype, bias=bias))


def test_cpu_fp8_emulation_notice_is_given_once(rng, cpu):
    """DESIGN 4: a GEMM with no hardware path (every FP8 GEMM on the CPU) says so once; a
    16-bit GEMM, which is not an emulation, says nothing."""
    gemm_mod._NOTICED.clear()
    a, b, sa, sb, bias = operands(rng, 5, 7, 48, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_on(cpu, lambda *x: lowbit.ops.gemm(*x, out_dtype=jnp.bfloat16), a, b, sa, sb, bias)
    a, b, sa, sb, bias = operands(rng, 5, 7, 48, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, jnp.bfloat16)
    with pytest.warns(UserWarning, match="FP8 GEMMs run as an exact emulation on the CPU"):
        run_on(cpu, lambda *x: lowbit.ops.gemm(*x, out_dtype=jnp.bfloat16), a, b, sa, sb, bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_on(cpu, lambda *x: lowbit.ops.gemm(*x, out_dtype=jnp.float32) + 1, a, b, sa, sb, None)


def test_leading_dims_defaults_and_eager(rng):
    a = rng.standard_normal((2, 3, 32)).astype(E4M3)
    b = rng.standard_normal((48, 32)).astype(E4M3)
    got = lowbit.ops.gemm(a, b)  # scale_invs default to 1, out bf16, eager
    assert got.shape == (2, 3, 48) and got.dtype == jnp.bfloat16
    assert_matches_handler(got, a, b)
    scalar_scales = lowbit.ops.gemm(a, b, jnp.float32(0.5), np.full((1,), 4.0, np.float32))
    assert_matches_handler(scalar_scales, a, b, 0.5, 4.0)


def test_empty_and_k_zero(rng):
    b = rng.standard_normal((5, 0)).astype(BF16)
    bias = np.arange(5, dtype=np.float32).astype(BF16)
    got = lowbit.ops.gemm(np.zeros((3, 0), BF16), b, bias=bias)
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(bias, (3, 5)))
    assert lowbit.ops.gemm(np.zeros((0, 16), E4M3), np.zeros((4, 16), E4M3)).shape == (0, 4)


def test_nan_and_inf_propagate():
    a = np.ones((2, 16), np.float32).astype(E5M2)
    a[0, 3] = np.inf
    a[1, 5] = np.nan
    b = np.ones((16, 16), np.float32).astype(E4M3)
    got = np.asarray(lowbit.ops.gemm(a, b, out_dtype=F32))
    assert np.isposinf(got[0]).all() and np.isnan(got[1]).all()


@pytest.mark.parametrize("a_dtype,b_dtype", FP8_PAIRS, ids=str)
def test_padded_lowering_path_equals_direct(a_dtype, b_dtype, rng, cpu):
    """The CUDA lowering pads K and N of FP8 GEMMs to multiples of 16; on the CPU handler
    (pinned to the CPU on every backend) the padded computation must give the unpadded
    result bit for bit."""
    a, b, sa, sb, bias = operands(rng, 7, 17, 40, a_dtype, b_dtype, BF16)
    args = (a, b, sa.reshape(1), sb.reshape(1), bias)
    padded = run_on(cpu, lambda *x: gemm_mod.gemm_padded(*x, out_dtype=jnp.dtype(BF16),
                                                         use_split_accumulator=np.bool_(True), **TENSOR_MODES),
                    *args)
    np.testing.assert_array_equal(np.asarray(padded), sequential_ref(a, b, sa, sb, bias, BF16))


def test_cuda_lowering_pads_fp8_k_and_n(monkeypatch):
    """Lowered for CUDA (no GPU needed): FP8 K and N padded to 16, the result sliced back;
    16-bit and aligned FP8 GEMMs go to lowbit_gemm unchanged."""
    monkeypatch.setattr(gemm_mod._ffi, "require_platform", lambda op, platform: None)

    def lowered(a_shape, b_shape, dtype):
        args = (jax.ShapeDtypeStruct(a_shape, dtype), jax.ShapeDtypeStruct(b_shape, dtype),
                jax.ShapeDtypeStruct((b_shape[0],), BF16))
        f = jax.jit(lambda a, b, bias: lowbit.ops.gemm(a, b, bias=bias))
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered((7, 40), (17, 40), E4M3)
    assert "stablehlo.custom_call @lowbit_gemm" in text and "use_split_accumulator = true" in text
    assert ("(tensor<7x48xf8E4M3FN>, tensor<32x48xf8E4M3FN>, tensor<1xf32>, tensor<1xf32>, tensor<32xbf16>)"
            f" -> (tensor<7x32xbf16>, tensor<{gemm_mod.GEMM_WORKSPACE_BYTES}xui8>)") in text
    assert "stablehlo.slice" in text
    for shape, dtype in [((7, 48), E4M3), ((7, 40), BF16)]:
        text = lowered(shape, (17, shape[1]) if dtype == BF16 else (32, 48), dtype)
        assert "stablehlo.pad" not in text and "stablehlo.custom_call @lowbit_gemm" in text


def test_workspace_is_a_dropped_second_result():
    """The custom call returns (out, u8 workspace): 0 bytes on the CPU, GEMM_WORKSPACE_BYTES
    (32 MiB + 256, XLA-planned, replacing the FFI scratch allocator) on CUDA, none when
    empty; gemm_p itself has one result."""
    args = (jax.ShapeDtypeStruct((5, 32), E4M3), jax.ShapeDtypeStruct((16, 32), E4M3))
    f = jax.jit(lambda a, b: lowbit.ops.gemm(a, b))
    text = f.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "-> (tensor<5x16xbf16>, tensor<0xui8>)" in text
    one, empty = jax.ShapeDtypeStruct((1,), F32), jax.ShapeDtypeStruct((0,), BF16)
    out = jax.eval_shape(lambda a, b, s, e: gemm_mod.gemm_p.bind(
        a, b, s, s, e, out_dtype=jnp.dtype(BF16), use_split_accumulator=np.bool_(True), **TENSOR_MODES),
        *args, one, empty)
    assert out.shape == (5, 16) and out.dtype == jnp.bfloat16
    assert gemm_mod.GEMM_WORKSPACE_BYTES == (32 << 20) + 256  # kGemmWorkspaceBytes, gemm.h


def test_vmap(rng):
    a = rng.standard_normal((4, 5, 32)).astype(E4M3)
    b = rng.standard_normal((3, 32)).astype(E4M3)
    bs = rng.standard_normal((4, 3, 32)).astype(E4M3)
    bias = rng.standard_normal((3,)).astype(BF16)
    f = lambda x, y: lowbit.ops.gemm(x, y, bias=bias)
    folded = np.asarray(jax.jit(jax.vmap(f, in_axes=(0, None)))(a, b))
    both = np.asarray(jax.vmap(f)(a, bs))
    moved = np.asarray(jax.vmap(f, in_axes=(1, None))(a, b))  # batch over a's axis 1
    nested = np.asarray(jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, None))(a.reshape(2, 2, 5, 32), b))
    for i in range(4):
        assert_matches_handler(folded[i], a[i], b, bias=bias)
        assert_matches_handler(both[i], a[i], bs[i], bias=bias)
        assert_matches_handler(moved[:, i], a[i], b, bias=bias)
        assert_matches_handler(nested[i // 2, i % 2], a[i], b, bias=bias)
    scales = rng.uniform(0.5, 2.0, (4,)).astype(np.float32)
    per_scale = np.asarray(jax.vmap(lambda s: lowbit.ops.gemm(a[0], b, s))(scales))
    for i, s in enumerate(scales):
        assert_matches_handler(per_scale[i], a[0], b, s)


def test_primitive_batching_rule(rng):
    """gemm_p's own rule (used when vmap reaches the primitive directly): fold or map."""
    a = rng.standard_normal((3, 5, 32)).astype(E4M3)
    b = rng.standard_normal((3, 4, 32)).astype(E4M3)
    one, empty = np.ones((1,), np.float32), np.zeros((0,), BF16)
    bind = lambda x, y: gemm_mod.gemm_p.bind(x, y, one, one, empty, out_dtype=jnp.dtype(BF16),
                                             use_split_accumulator=np.bool_(True), **TENSOR_MODES)
    for in_axes, pick in [((0, None), lambda i: (a[i], b[0])), ((0, 0), lambda i: (a[i], b[i])),
                          ((None, 0), lambda i: (a[0], b[i])), ((1, None), lambda i: (a[:, i], b[0]))]:
        got = np.asarray(jax.vmap(bind, in_axes=in_axes)(a if in_axes[0] is not None else a[0],
                                                          b if in_axes[1] is not None else b[0]))
        for i in range(got.shape[0]):
            assert_matches_handler(got[i], *pick(i))


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def _collectives(hlo: str) -> set[str]:
    return {c for c in COLLECTIVES if c in hlo}


# (a spec, b spec, bias spec, a shape, collectives expected)
SHARDINGS = [
    (P("x", None), P(), P(), (64, 96), set()),                        # data parallel
    (P(("x", "y"), None), P(), P(), (64, 96), set()),                 # M over both axes
    (P("x", "y", None), P(), P(), (4, 16, 96), set()),                # batch and sequence
    (P(), P("y", None), P("y"), (64, 96), set()),                     # column-parallel TP
    (P("x", None), P("y", None), P("y"), (64, 96), set()),            # DP x TP
    (P(None, "y"), P(None, "y"), P(), (64, 96), {"all-reduce"}),      # row-parallel TP
    (P("x", "y"), P(None, "y"), P(), (64, 96), {"all-reduce"}),       # DP x row-parallel TP
]


def _gemm_out_types(hlo: str) -> set[str]:
    """The element types of the lowbit_gemm custom calls' first results in compiled HLO."""
    return set(re.findall(r"= \((\w+)\[[^\n]*custom_call_target=\"lowbit_gemm\"", hlo))


def two_shard_ref(a, b, sa, sb, bias, out_dtype):
    """LOWBIT_GEMM_PSUM=out with K split in two halves: each half's GEMM (sequential_ref)
    rounded to out_dtype, the two summed and rounded to out_dtype (the all-reduce of two
    values rounds once whatever its order), then + bias in fp32 and rounded again."""
    half = a.shape[-1] // 2
    p0 = sequential_ref(a[..., :half], b[:, :half], sa, sb, None, out_dtype).astype(np.float32)
    p1 = sequential_ref(a[..., half:], b[:, half:], sa, sb, None, out_dtype).astype(np.float32)
    y = (p0 + p1).astype(out_dtype)
    if bias is not None:
        y = (y.astype(np.float32) + np.asarray(bias).astype(np.float32)).astype(out_dtype)
    return y


@pytest.mark.parametrize("a_spec,b_spec,bias_spec,a_shape,expected", SHARDINGS,
                         ids=[f"{s[0]}-{s[1]}" for s in SHARDINGS])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("psum", ["out", "fp32"])
def test_sharded_equals_unsharded(a_spec, b_spec, bias_spec, a_shape, expected, with_bias, psum, rng,
                                  monkeypatch):
    monkeypatch.setenv(PSUM_ENV, psum)
    mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices("cpu")[:4])
    k, n = a_shape[-1], 64
    a = rng.standard_normal(a_shape).astype(E4M3)
    b = rng.standard_normal((n, k)).astype(E5M2)
    bias = rng.standard_normal(n).astype(BF16) if with_bias else None
    sa, sb = np.float32(0.75), np.float32(1.5)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(a, a_spec), put(b, b_spec), sa, sb) + ((put(bias, bias_spec),) if with_bias else ())
    f = jax.jit(lambda a, b, sa, sb, *bias: lowbit.ops.gemm(a, b, sa, sb, *bias))
    got = np.asarray(f(*args))
    hlo = f.lower(*args).compile().as_text()
    if not expected:  # no partial sums: every shard computes whole dot products
        np.testing.assert_array_equal(got, sequential_ref(a, b, sa, sb, bias, BF16))
    elif psum == "fp32":  # fp32 partial sums psum'ed in another order, then one rounding
        assert_close_gemm(got, sequential_ref(a, b, sa, sb, bias, BF16),
                          gemm_atol(a, b, sa, sb, BF16, bias=bias))
        assert _gemm_out_types(hlo) == {"f32"}, "the partial products must stay fp32"
    else:  # K over "y" in two halves: bf16 partial products, a bf16 psum (half the bytes)
        np.testing.assert_array_equal(got, two_shard_ref(a, b, sa, sb, bias, BF16))
        # The GEMM hands its psum bf16 partial products (on the CPU, XLA then widens the
        # all-reduce itself to f32 and back, which gives the same bits for two shards).
        assert _gemm_out_types(hlo) == {"bf16"}, "the partial products must be rounded to bf16"
    assert "lowbit_gemm" in hlo
    assert _collectives(hlo) == expected, f"collectives {_collectives(hlo)}, expected {expected}"


def test_psum_env_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(PSUM_ENV, "bf16")
    with pytest.raises(ValueError, match=r"lowbit.ops.gemm: LOWBIT_GEMM_PSUM='bf16': expected 'out' or 'fp32'"):
        lowbit.ops.gemm(np.ones((16, 16), E4M3), np.ones((16, 16), E4M3))


BAD = [
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 16), BF16)), TypeError,
     r"lowbit.ops.gemm: b: expected both operands FP8 or neither"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E5M2), np.ones((3, 16), E5M2)), TypeError,
     r"lowbit.ops.gemm: b: float8_e5m2 x float8_e5m2"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), F32), np.ones((3, 16), F32)), TypeError,
     r"lowbit.ops.gemm: b: expected a and b both FP8, both bfloat16 or both float16"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 8), E4M3)), ValueError,
     r"lowbit.ops.gemm: b: expected \(N, 16\) to match a \(2, 16\), got \(3, 8\)"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((16,), E4M3)), ValueError,
     r"lowbit.ops.gemm: b: expected shape \(N, K\)"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), BF16), np.ones((3, 16), BF16), out_dtype=F16), TypeError,
     r"lowbit.ops.gemm: out_dtype: with bfloat16 operands expected bfloat16 or float32, got float16"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 16), E4M3), out_dtype=E4M3), TypeError,
     r"lowbit.ops.gemm: out_dtype: expected bfloat16, float16 or float32"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 16), E4M3), np.ones((1,), F16)), TypeError,
     r"lowbit.ops.gemm: a_scale_inv: expected float32, got float16"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 16), E4M3), None, np.ones((2,), F32)),
     ValueError, r"lowbit.ops.gemm: b_scale_inv: expected one value"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 16), E4M3), bias=np.ones((4,), BF16)),
     ValueError, r"lowbit.ops.gemm: bias: expected shape \(3,\), got \(4,\)"),
    (lambda: lowbit.ops.gemm(np.ones((2, 16), E4M3), np.ones((3, 16), E4M3), bias=np.ones((3,), F32)),
     TypeError, r"lowbit.ops.gemm: bias: expected out_dtype bfloat16, got float32"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=range(len(BAD)))
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_handler_validates_too():
    """The raw primitive reaches the C++ checks, which name the op and the argument."""
    one = np.ones((1,), np.float32)
    bind = lambda a, b, bias, out: gemm_mod.gemm_p.bind(
        a, b, one, one, bias, out_dtype=jnp.dtype(out), use_split_accumulator=np.bool_(True), **TENSOR_MODES)
    with pytest.raises(Exception, match=r"lowbit_gemm: bias: expected the out type bf16, got f32"):
        jax.block_until_ready(bind(np.ones((2, 16), E4M3), np.ones((3, 16), E4M3), np.ones((3,), F32), BF16))
    with pytest.raises(Exception, match=r"lowbit_gemm: b: f8e5m2 x f8e5m2"):
        jax.block_until_ready(bind(np.ones((2, 16), E5M2), np.ones((3, 16), E5M2), np.ones((0,), BF16), BF16))


# ---------------------------------------------------------------- GPU: cuBLASLt vs the CPU handler

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


def test_type_cases_cover_every_valid_combination():
    dtypes = [E4M3, E5M2, BF16, F16, F32]
    valid = set()
    for a, b, o in itertools.product(dtypes, dtypes, [BF16, F16, F32]):
        try:
            jax.eval_shape(lambda x, y, o=o: lowbit.ops.gemm(x, y, out_dtype=o),
                           jax.ShapeDtypeStruct((1, 16), a), jax.ShapeDtypeStruct((1, 16), b))
            valid.add((jnp.dtype(a), jnp.dtype(b), jnp.dtype(o)))
        except TypeError:
            pass
    assert valid == {(jnp.dtype(a), jnp.dtype(b), jnp.dtype(o)) for a, b, o in TYPE_CASES}
