"""lowbit.ops.gemm_accumulate (c + a @ b^T written over c): on the CPU bit for bit the numpy
references of the GEMM's fp32 result (tests/gemm_reference.py per-tensor, tests/
gemm_block_reference.py block modes) plus c in fp32, rounded once to c's dtype, for every FP8
pair, bf16 and f32 outputs, odd shapes and c with inf/NaN/zeros; c aliased to the output in
the lowered program and reused under donation; vmap; bad input naming the argument. On a GPU:
cuBLASLt's beta = 1 (and the separate-GEMM path for shapes cuBLASLt does not take) against the
CPU within the GEMM tolerances, also with LOWBIT_BLOCK_GEMM=wgmma (the accumulating GEMM stays
on cuBLASLt)."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on, special_values
from gemm_block_reference import PAIR_IDS, PAIRS, block_tolerance, operands as block_operands
from gemm_block_reference import sequential_ref as block_sequential_ref
from gemm_reference import FP8_PAIRS, accumulation_gamma, sequential_ref

from lowbit.ops.gemm import GemmScaleMode
from lowbit.ops.gemm_accumulate import gemm_accumulate

E4M3, E5M2, BF16, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32
SHAPES = [(1, 1, 1), (7, 17, 33), (64, 48, 256), (130, 40, 300)]


def _c(rng, shape, dtype, specials=False):
    c = (rng.standard_normal(shape) * 4).astype(np.float32)
    if specials and c.size >= 26:
        flat = c.reshape(-1)
        vals = special_values(dtype)
        flat[rng.choice(flat.size, vals.size, replace=False)] = vals
    return c.astype(dtype)


def _tensor_operands(rng, m, n, k, a_dtype, b_dtype):
    def fp8(shape, dtype):
        x = (rng.standard_normal(shape) * 2).astype(np.float32)
        return jnp.asarray(x).astype(dtype)
    return fp8((m, k), a_dtype), fp8((n, k), b_dtype), np.float32(rng.uniform(0.25, 2)), np.float32(rng.uniform(0.25, 2))


def _plus_c(y32, c):
    """fl(y + c) in fp32, rounded once to c's dtype: the op's formula."""
    return (np.asarray(y32, np.float32) + np.asarray(c).astype(np.float32)).astype(np.asarray(c).dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_dtype,b_dtype", FP8_PAIRS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_tensor_mode_equals_reference_plus_c(m, n, k, a_dtype, b_dtype, c_dtype, rng):
    a, b, sa, sb = _tensor_operands(rng, m, n, k, a_dtype, b_dtype)
    c = _c(rng, (m, n), c_dtype, specials=True)
    got = jax.jit(gemm_accumulate)(c, a, b, sa, sb)
    want = _plus_c(sequential_ref(a, b, sa, sb, None, np.float32), c)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.cpu_reference
@pytest.mark.parametrize("a_mode,b_mode", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("c_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,n,k", [(7, 17, 200), (130, 33, 300), (256, 128, 512)], ids=str)
def test_block_modes_equal_reference_plus_c(a_mode, b_mode, m, n, k, c_dtype, rng):
    a, b, sa, sb = block_operands(rng, m, n, k, a_mode, b_mode)
    c = _c(rng, (m, n), c_dtype)
    got = gemm_accumulate(c, a, b, sa, sb, a_scale_mode=a_mode, b_scale_mode=b_mode)
    want = _plus_c(block_sequential_ref(a, b, a_mode, sa, b_mode, sb, None, np.float32), c)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.cpu_reference
def test_empty_k_gives_c_plus_zero(rng):
    """K = 0: the GEMM is +0, so out = fl(+0 + c) (a -0 in c comes back +0)."""
    c = _c(rng, (5, 3), F32)
    c[0, 0] = -0.0
    got = np.asarray(gemm_accumulate(c, np.zeros((5, 0), E4M3), np.zeros((3, 0), E4M3)))
    np.testing.assert_array_equal(_bits(got), _bits(_plus_c(np.zeros((5, 3), np.float32), c)))
    assert _bits(got)[0, 0] == 0


def test_cuda_lowering_pads_k_or_adds_separately(rng, monkeypatch):
    """Lowered for CUDA (no GPU needed): K off 16 is zero-padded into the accumulating call;
    N off 16 takes lowbit_gemm and an add; K = 0 no GEMM at all."""
    monkeypatch.setattr(importlib.import_module("lowbit.ops.gemm"), "_cuda_capability", lambda: "9.0")
    monkeypatch.setattr(importlib.import_module("lowbit._ffi"), "require_platform", lambda op, platform: None)
    f = lambda c, a, b: gemm_accumulate(c, a, b)  # noqa: E731

    def calls(m, n, k):
        a, b, _, _ = _tensor_operands(rng, m, n, k, E4M3, E4M3)
        text = jax.jit(f).trace(_c(rng, (m, n), F32), a, b).lower(lowering_platforms=("cuda",)).as_text()
        acc = [line for line in text.splitlines() if "@lowbit_gemm_accumulate(" in line]
        return acc, text.count("@lowbit_gemm(")
    acc, plain = calls(32, 48, 40)
    assert plain == 0 and len(acc) == 1 and "tensor<32x48xf8E4M3FN>, tensor<48x48xf8E4M3FN>" in acc[0]
    acc, plain = calls(32, 40, 64)
    assert plain == 1 and not acc
    acc, plain = calls(32, 48, 0)
    assert plain == 0 and not acc


def test_c_is_aliased_to_the_output_and_reused_under_donation(rng):
    a, b, sa, sb = _tensor_operands(rng, 64, 32, 128, E4M3, E4M3)
    c = _c(rng, (64, 32), F32)
    text = jax.jit(gemm_accumulate).lower(c, a, b, sa, sb).as_text()
    assert re.search(r"output_operand_aliases = \[#stablehlo.output_operand_alias<output_tuple_indices = \[0\], "
                     r"operand_index = 4", text), text
    compiled = jax.jit(gemm_accumulate, donate_argnums=0).lower(c, a, b, sa, sb).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == c.nbytes


@pytest.mark.cpu_reference
def test_vmap_maps_each_problem(rng):
    a = jnp.asarray(rng.standard_normal((3, 16, 64)).astype(np.float32)).astype(E4M3)
    b = jnp.asarray(rng.standard_normal((3, 8, 64)).astype(np.float32)).astype(E5M2)
    c = _c(rng, (3, 16, 8), F32)
    got = jax.vmap(gemm_accumulate)(c, a, b)
    for i in range(3):
        want = _plus_c(sequential_ref(a[i], b[i], 1.0, 1.0, None, np.float32), c[i])
        np.testing.assert_array_equal(_bits(got[i]), _bits(want))


def test_chained_parts_add_up_to_the_whole(rng):
    """A K split in two, the second part accumulated into the first: the whole GEMM within
    one more fp32 rounding per element (what lowbit.dense's block backward relies on)."""
    a, b, sa, sb = block_operands(rng, 64, 40, 512, GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_1x128)
    whole = block_sequential_ref(a, b, GemmScaleMode.BLOCK_1x128, sa, GemmScaleMode.BLOCK_1x128, sb, None, np.float32)
    first = gemm_accumulate(np.zeros((64, 40), np.float32), a[:, :256], b[:, :256], sa[:2], sb[:2],
                            a_scale_mode=GemmScaleMode.BLOCK_1x128, b_scale_mode=GemmScaleMode.BLOCK_1x128)
    both = gemm_accumulate(first, a[:, 256:], b[:, 256:], sa[2:], sb[2:],
                           a_scale_mode=GemmScaleMode.BLOCK_1x128, b_scale_mode=GemmScaleMode.BLOCK_1x128)
    tol = block_tolerance(a, b, GemmScaleMode.BLOCK_1x128, sa, GemmScaleMode.BLOCK_1x128, sb, F32)
    assert np.all(np.abs(np.asarray(both, np.float64) - whole) <= tol)
    assert not np.array_equal(np.asarray(first), whole)  # the first part alone is not the whole


@pytest.mark.parametrize("args,kwargs,err,text", [
    ((np.zeros((4, 4), np.float32), np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)), {},
     TypeError, "a: expected FP8 operands"),
    ((np.zeros((4, 4), np.float32), np.zeros((4, 8), E4M3), np.zeros((5, 8), E4M3)), {},
     ValueError, "c: expected (4, 5) bf16, f16 or f32, got (4, 4) float32"),
    ((np.zeros((4, 4), np.float32), np.zeros((4, 8), E4M3), np.zeros((4, 9), E4M3)), {},
     ValueError, "b: expected a (M, K) and b (N, K)"),
    ((np.zeros((4, 4), np.int32), np.zeros((4, 8), E4M3), np.zeros((4, 8), E4M3)), {},
     ValueError, "c: expected (4, 4)"),
    ((np.zeros((4, 4), np.float32), np.zeros((4, 8), E5M2), np.zeros((4, 8), E5M2)), {},
     TypeError, "b: float8_e5m2 x float8_e5m2"),
    ((np.zeros((4, 4), np.float32), np.zeros((4, 128), E4M3), np.zeros((4, 128), E4M3)),
     {"a_scale_mode": GemmScaleMode.BLOCK_1x128}, ValueError, "b_scale_mode: expected block scales on both"),
    ((np.zeros((4, 4), np.float32), np.zeros((4, 128), E4M3), np.zeros((4, 128), E4M3)),
     {"a_scale_mode": GemmScaleMode.BLOCK_1x128, "b_scale_mode": GemmScaleMode.BLOCK_1x128},
     ValueError, "a_scale_inv: scale mode BLOCK_1x128 needs its scale array"),
])
def test_bad_input_names_the_argument(args, kwargs, err, text):
    with pytest.raises(err, match=re.escape("lowbit.ops.gemm_accumulate: " + text)):
        gemm_accumulate(*args, **kwargs)


@pytest.mark.parametrize("case", ["scale_shape", "scale_type", "e5m2_pair", "control"])
def test_handler_checks_name_the_op(case, cpu):
    """The handler's own checks (the primitive bound directly, past the Python wrapper's) are
    the GEMM's, with messages naming lowbit_gemm_accumulate, not lowbit_gemm."""
    _check_handler_messages(case, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["scale_type", "e5m2_pair", "control"])
def test_cuda_handler_checks_name_the_op(case, gpu):
    """The same on the CUDA handler (tensor scales: the lowering keeps the custom call for
    these shapes; bad block scales would go to its separate GEMM and add instead)."""
    _check_handler_messages(case, gpu)


def _check_handler_messages(case, device):
    p = importlib.import_module("lowbit.ops.gemm_accumulate").gemm_accumulate_p
    a, b = jnp.ones((16, 128), E4M3), jnp.ones((32, 128), E4M3)
    one, c = jnp.ones((1,), F32), jnp.zeros((16, 32), F32)
    modes = dict(a_scale_mode=0, b_scale_mode=0)
    want = {"scale_shape": "a_scale_inv: expected shape (1, 16) for scale mode block_1x128",
            "scale_type": "b_scale_inv: expected f32 for scale mode tensor",
            "e5m2_pair": "b: f8e5m2 x f8e5m2 has no FP8 GEMM", "control": None}[case]
    args = [a, b, one, one, c]
    if case == "scale_shape":
        args[2], args[3] = jnp.ones((16, 1), F32), jnp.ones((1, 32), F32)
        modes = dict(a_scale_mode=1, b_scale_mode=1)
    elif case == "scale_type":
        args[3] = jnp.ones((1,), BF16)
    elif case == "e5m2_pair":
        args[0], args[1] = a.astype(E5M2), b.astype(E5M2)
    f = jax.jit(lambda *xs: p.bind(*xs, use_split_accumulator=True, algo=0, algo_or_first=False, **modes))
    if case == "control":  # the same call with good arguments runs: 16 x 128 ones . ones
        np.testing.assert_array_equal(np.asarray(run_on(device, f, *args)),
                                      np.full((16, 32), 128.0, np.float32))
        return
    with pytest.raises(Exception, match=re.escape("lowbit_gemm_accumulate: " + want)):
        run_on(device, f, *args)


def _gpu_vs_cpu(gpu, cpu, f, *args):
    return np.asarray(run_on(gpu, f, *args), np.float64), np.asarray(run_on(cpu, f, *args), np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype,b_dtype", FP8_PAIRS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,n,k", [(7, 17, 33), (128, 256, 512), (300, 64, 1024)], ids=str)
def test_cuda_tensor_mode_matches_cpu(m, n, k, a_dtype, b_dtype, c_dtype, rng, cpu, gpu):
    a, b, sa, sb = _tensor_operands(rng, m, n, k, a_dtype, b_dtype)
    c = _c(rng, (m, n), c_dtype)
    g, want = _gpu_vs_cpu(gpu, cpu, gemm_accumulate, c, a, b, sa, sb)
    a64, b64 = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    abs_dot = (np.abs(a64) @ np.abs(b64).T) * float(sa) * float(sb)
    eps = float(ml_dtypes.finfo(c_dtype).eps)
    tol = accumulation_gamma(k, "fp8_split") * abs_dot + eps * (np.abs(want) + abs_dot) + 1e-30
    assert np.all(np.abs(g - want) <= tol), np.max(np.abs(g - want) / tol)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cublaslt", "wgmma"])
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:4], ids=PAIR_IDS[:4])
@pytest.mark.parametrize("c_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,n,k", [(7, 17, 200), (256, 384, 4096), (512, 1024, 2048)], ids=str)
def test_cuda_block_modes_match_cpu(a_mode, b_mode, m, n, k, c_dtype, path, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", path)
    a, b, sa, sb = block_operands(rng, m, n, k, a_mode, b_mode)
    c = _c(rng, (m, n), c_dtype)
    f = lambda c, a, b, sa, sb: gemm_accumulate(c, a, b, sa, sb, a_scale_mode=a_mode, b_scale_mode=b_mode)  # noqa: E731
    g, want = _gpu_vs_cpu(gpu, cpu, f, c, a, b, sa, sb)
    tol = block_tolerance(a, b, a_mode, sa, b_mode, sb, c_dtype, np.asarray(c))
    assert np.all(np.abs(g - want) <= tol), np.max(np.abs(g - want) / tol)
    # Without c the result would be off by |c| (~4): far past the tolerance.
    assert np.linalg.norm(g - want) <= 2.0**-6 * np.linalg.norm(want) + 1e-30
