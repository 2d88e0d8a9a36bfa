"""lowbit.ops.gemm: a jnp reference and the exact summation order of the CPU handler, every
type combination, out dtypes, bias, odd shapes, jit, vmap, sharding over virtual CPU devices,
bad input (the cuBLASLt handler against the CPU one: tests/test_gemm_ops_cuda.py; the
references and the tolerance model: gemm_reference.py)."""

from __future__ import annotations

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from gemm_reference import (BF16, CASE_IDS, E4M3, E5M2, F16, F32, FP8_PAIRS, TENSOR_MODES, TYPE_CASES,
                            assert_close_gemm, assert_matches_handler, gemm_atol, gemm_mod, gemm_ref,
                            operands, sequential_ref)
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit
from lowbit.ops.gemm import PSUM_ENV


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
