"""The cuBLASLt algorithm knob of lowbit.ops.gemm (LOWBIT_GEMM_ALGO, `algo=`): parsing with
errors naming the variable, the per-kind defaults, the index reaching the custom call as its
`algo` attribute (lowered for CUDA without a GPU) beside `algo_or_first` (true for a library
default), the handlers' own range check, and on the GPU every index cuBLASLt offers giving
results within the tolerances of gemm_reference.py / gemm_block_reference.py, and a default past
the list running the first choice."""

from __future__ import annotations

import importlib
import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on
from gemm_reference import cuda_algo_or_first

import lowbit

gemm_mod = importlib.import_module("lowbit.ops.gemm")
nvfp4_mod = importlib.import_module("lowbit.ops.gemm_nvfp4")
ffi_mod = importlib.import_module("lowbit._ffi")
Mode = gemm_mod.GemmScaleMode
E4M3, E5M2, BF16, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32
KINDS = tuple(gemm_mod.DEFAULT_ALGO)


@pytest.mark.parametrize("text,want", [
    ("", {}), ("  ", {}), ("0", {k: 0 for k in KINDS}), ("3", {k: 3 for k in KINDS}),
    ("31", {k: 31 for k in KINDS}), ("fp8_fast=2", {"fp8_fast": 2}),
    ("fp8_fast=2, block=1", {"fp8_fast": 2, "block": 1}),
    ("fp8_split=0,fp8_fast=4,block=7,mxfp8=1", {"fp8_split": 0, "fp8_fast": 4, "block": 7, "mxfp8": 1}),
], ids=repr)
def test_parse_algo(text, want):
    assert gemm_mod.parse_algo(text) == want


@pytest.mark.parametrize("text", ["-1", "32", "1.5", "x", "fp8=1", "block", "block=", "block=-2",
                                  "block=1,block=2", "block=1,", "=3", "1,2", "block=99"], ids=repr)
def test_parse_algo_rejects_bad_values_naming_the_variable(text):
    with pytest.raises(ValueError, match=f"LOWBIT_GEMM_ALGO: expected .*got {re.escape(repr(text.strip()))}"):
        gemm_mod.parse_algo(text)


def test_bad_environment_value_fails_the_first_fp8_gemm(monkeypatch, rng):
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fast")
    a = jnp.asarray(rng.normal(size=(4, 32)), E4M3)
    with pytest.raises(ValueError, match="LOWBIT_GEMM_ALGO"):
        lowbit.ops.gemm(a, a)


def test_environment_is_read_at_trace_time(monkeypatch):
    """Each trace reads the variable as it is then (a benchmark traces variants under
    different values in one process); unset, the kinds fall back to DEFAULT_ALGO."""
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "block=5")
    assert gemm_mod.resolve_algo(None, E4M3, Mode.BLOCK_1x128, True) == 5
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "block=6")
    assert gemm_mod.resolve_algo(None, E4M3, Mode.BLOCK_1x128, True) == 6
    monkeypatch.delenv("LOWBIT_GEMM_ALGO")
    assert gemm_mod.resolve_algo(None, E4M3, Mode.BLOCK_1x128, True) == gemm_mod.DEFAULT_ALGO["block"]


def test_split_f32_output_is_its_own_kind(monkeypatch):
    """cuBLASLt's heuristic list depends on the output type, so a split-accumulation GEMM with
    an f32 output (an f32 kernel's wgrad) takes fp8_split_f32's index, not fp8_split's."""
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_split=2,fp8_split_f32=4")
    r = gemm_mod.resolve_algo
    assert r(None, E4M3, Mode.TENSOR, True, jnp.float32) == 4
    assert r(None, E4M3, Mode.TENSOR, True, jnp.bfloat16) == 2
    assert r(None, E4M3, Mode.TENSOR, True) == 2  # no output dtype given: fp8_split
    assert r(None, E4M3, Mode.TENSOR, False, jnp.float32) == 0  # fast accumulation: fp8_fast
    assert gemm_mod.algo_kind(E4M3, Mode.BLOCK_1x128, True, jnp.float32) == "block"


def test_resolve_algo_kinds_and_defaults(monkeypatch):
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_split=3")
    monkeypatch.setitem(gemm_mod.DEFAULT_ALGO, "fp8_fast", 2)  # a per-kind default, as the lead may set
    r = gemm_mod.resolve_algo
    assert r(None, E4M3, Mode.TENSOR, False) == 2
    assert r(None, E5M2, Mode.TENSOR, True) == 3
    assert r(None, E5M2, Mode.TENSOR, True, jnp.bfloat16) == 3
    assert r(None, E4M3, Mode.TENSOR, True, jnp.float32) == 0  # fp8_split_f32: its own kind
    assert r(None, E4M3, Mode.BLOCK_128x128, True) == 0
    assert r(None, E4M3, Mode.MXFP8, True) == 0
    assert r(None, BF16, Mode.TENSOR, True) == 0  # 16-bit GEMMs: always cuBLASLt's choice
    assert r(7, E4M3, Mode.TENSOR, True) == 7     # explicit wins


@pytest.mark.parametrize("algo", [-1, 32, 1.0, "1", True])
def test_explicit_bad_algo_names_the_argument(algo, rng):
    a = jnp.asarray(rng.normal(size=(4, 32)), E4M3)
    with pytest.raises(ValueError, match="lowbit.ops.gemm: algo: expected"):
        lowbit.ops.gemm(a, a, algo=algo)


def cuda_algo_attrs(monkeypatch, fn, *args, capability="9.0"):
    """The `algo` attribute of every GEMM custom call of fn lowered for CUDA."""
    return [algo for algo, _ in cuda_algo_or_first(monkeypatch, fn, *args, capability=capability)]


def test_algo_reaches_the_custom_call(monkeypatch, rng):
    a = jnp.asarray(rng.normal(size=(32, 64)), E4M3)
    b = jnp.asarray(rng.normal(size=(48, 64)), E4M3)
    sa, sb = np.ones((1,), np.float32), np.ones((1,), np.float32)
    assert cuda_algo_attrs(monkeypatch, lambda a, b: lowbit.ops.gemm(a, b, sa, sb), a, b) == [0]
    assert cuda_algo_attrs(monkeypatch, lambda a, b: lowbit.ops.gemm(a, b, sa, sb, algo=5), a, b) == [5]
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_fast=4,fp8_split=2,block=3")
    fast = lambda a, b: lowbit.ops.gemm(a, b, sa, sb, use_split_accumulator=False)  # noqa: E731
    assert cuda_algo_attrs(monkeypatch, fast, a, b) == [4]
    assert cuda_algo_attrs(monkeypatch, lambda a, b: lowbit.ops.gemm(a, b, sa, sb), a, b) == [2]
    # Padded problems (K, N not multiples of 16) keep it through the padding wrapper.
    a2, b2 = a[:, :50], b[:17, :50]
    assert cuda_algo_attrs(monkeypatch, lambda a, b: lowbit.ops.gemm(a, b, sa, sb), a2, b2) == [2]
    s1 = jnp.ones(gemm_mod.scale_shape(Mode.BLOCK_1x128, 32, 64), F32)
    s2 = jnp.ones(gemm_mod.scale_shape(Mode.BLOCK_128x128, 48, 64), F32)
    blk = lambda a, b: lowbit.ops.gemm(a, b, s1, s2, bias=jnp.ones((48,), BF16),  # noqa: E731
                                       a_scale_mode=Mode.BLOCK_1x128, b_scale_mode=Mode.BLOCK_128x128)
    assert cuda_algo_attrs(monkeypatch, blk, a, b) == [3]
    h = jnp.asarray(rng.normal(size=(32, 64)), BF16)
    assert cuda_algo_attrs(monkeypatch, lambda x: lowbit.ops.gemm(x, x), h) == [0]


def test_library_default_index_is_marked_or_first(monkeypatch, rng):
    """An index from DEFAULT_ALGO reaches the custom call with algo_or_first (cuBLASLt's first
    choice runs where a problem has no entry at it); one the user sets, by `algo=` or by
    LOWBIT_GEMM_ALGO, does not (past the list it fails, naming the count)."""
    monkeypatch.delenv("LOWBIT_GEMM_ALGO", raising=False)
    monkeypatch.setitem(gemm_mod.DEFAULT_ALGO, "fp8_split", 3)  # a raised default, as the lead may set
    a = jnp.asarray(rng.normal(size=(32, 64)), E4M3)
    b = jnp.asarray(rng.normal(size=(48, 64)), E5M2)
    split = lambda a, b, **kw: lowbit.ops.gemm(a, b, **kw)  # noqa: E731
    assert cuda_algo_or_first(monkeypatch, split, a, b) == [(3, True)]
    assert cuda_algo_or_first(monkeypatch, lambda a, b: split(a, b, algo=3), a, b) == [(3, False)]
    padded = lambda a, b: split(a[:, :50], b[:17, :50])  # noqa: E731  (K, N not multiples of 16)
    assert cuda_algo_or_first(monkeypatch, padded, a, b) == [(3, True)]
    h = jnp.asarray(rng.normal(size=(32, 64)), BF16)
    assert cuda_algo_or_first(monkeypatch, lambda x: lowbit.ops.gemm(x, x), h) == [(0, True)]
    # A fresh function per trace: jit's trace cache does not see the variable.
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_split=3")
    assert cuda_algo_or_first(monkeypatch, lambda a, b: split(a, b), a, b) == [(3, False)]
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "fp8_fast=1")  # another kind set: fp8_split's is still the default
    assert cuda_algo_or_first(monkeypatch, lambda a, b: split(a, b), a, b) == [(3, True)]


def test_nvfp4_library_default_index_is_marked_or_first(monkeypatch, rng):
    monkeypatch.delenv("LOWBIT_GEMM_ALGO", raising=False)
    m, n, k = 128, 256, 64
    packed = lambda rows: jnp.asarray(rng.integers(0, 256, size=(rows, k // 2)), jnp.uint8)  # noqa: E731
    scale = lambda rows: jnp.ones(nvfp4_mod.nvfp4_scale_shape(rows, k), jnp.float8_e4m3fn)  # noqa: E731
    one = jnp.ones((1,), F32)
    args = (packed(m), packed(n), scale(m), scale(n), one, one)
    f = lambda *x, **kw: nvfp4_mod.nvfp4_gemm(*x, k=k, out_dtype=F32, **kw)  # noqa: E731
    assert cuda_algo_or_first(monkeypatch, f, *args) == [(0, True)]
    assert cuda_algo_or_first(monkeypatch, lambda *x: f(*x, algo=2), *args) == [(2, False)]
    monkeypatch.setenv("LOWBIT_GEMM_ALGO", "nvfp4=0")
    assert cuda_algo_or_first(monkeypatch, lambda *x: f(*x), *args) == [(0, False)]


def test_handler_checks_the_algo_range(cpu, rng):
    """A caller binding gemm_p directly with an index out of 0..31 gets the handler's error."""
    a = rng.normal(size=(4, 32)).astype(E4M3)
    one, empty = np.ones((1,), np.float32), np.zeros((0,), np.float32)
    f = lambda a, s, e: gemm_mod.gemm_p.bind(  # noqa: E731
        a, a, s, s, e, out_dtype=jnp.dtype(F32), use_split_accumulator=np.bool_(True),
        a_scale_mode=np.int32(0), b_scale_mode=np.int32(0), algo=np.int32(40))
    with pytest.raises(Exception, match="lowbit_gemm: algo: expected a cuBLASLt heuristic index in 0..31"):
        run_on(cpu, f, a, one, empty)


def test_cpu_results_do_not_depend_on_algo(cpu, rng):
    a = rng.normal(size=(9, 40)).astype(E4M3)
    b = rng.normal(size=(11, 40)).astype(E5M2)
    outs = [run_on(cpu, lambda a, b, i=i: lowbit.ops.gemm(a, b, out_dtype=F32, algo=i), a, b) for i in (0, 3)]
    np.testing.assert_array_equal(outs[0], outs[1])


# ---------------------------------------------------------------- GPU

def run_or_skip(device, fn, *args):
    """fn on the device; a skip when cuBLASLt offers fewer algorithms than the index."""
    try:
        return np.asarray(run_on(device, fn, *args), np.float64)
    except Exception as e:  # noqa: BLE001 (XlaRuntimeError)
        if "heuristic algorithms for" in str(e):
            pytest.skip(str(e).splitlines()[0])
        raise


@pytest.mark.gpu
@pytest.mark.parametrize("algo", range(6))
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
def test_cuda_tensor_fp8_every_algo_matches_cpu(algo, split, rng, cpu, gpu):
    """Per-tensor FP8 at each heuristic index, against the CPU reference within
    gemm_reference.py's tolerance."""
    from gemm_reference import FROBENIUS, assert_close_gemm, gemm_atol
    m, n, k = 256, 384, 1024
    a = rng.normal(size=(m, k)).astype(E4M3)
    b = rng.normal(size=(n, k)).astype(E5M2)
    sa, sb = np.float32([0.75]), np.float32([1.5])
    f = lambda a, b: lowbit.ops.gemm(a, b, sa, sb, out_dtype=BF16, use_split_accumulator=split,  # noqa: E731
                                     algo=algo)
    g = run_or_skip(gpu, f, a, b)
    c = np.asarray(run_on(cpu, f, a, b), np.float64)
    model = "fp8_split" if split else "fp8_fast"
    assert_close_gemm(g, c, gemm_atol(a, b, sa[0], sb[0], BF16, model=model), max_rel_frobenius=FROBENIUS[model])


@pytest.mark.gpu
@pytest.mark.parametrize("algo", range(6))
@pytest.mark.parametrize("a_mode,b_mode", [(Mode.BLOCK_1x128, Mode.BLOCK_128x128),
                                           (Mode.BLOCK_1x128, Mode.BLOCK_1x128)], ids=["1x128-128x128", "1x128-1x128"])
def test_cuda_block_fp8_every_algo_matches_cpu(algo, a_mode, b_mode, rng, cpu, gpu):
    """FP8 block scaling at each heuristic index (cuBLASLt on 9.0; elsewhere the emulation,
    where the index is unused), against the CPU emulation within gemm_block_reference.py's
    tolerance."""
    from gemm_block_reference import block_tolerance, operands
    a, b, sa, sb = operands(rng, 256, 384, 1024, a_mode, b_mode, E4M3, E5M2)
    f = lambda *x: lowbit.ops.gemm(*x, out_dtype=F32, a_scale_mode=a_mode, b_scale_mode=b_mode,  # noqa: E731
                                   algo=algo)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice off Hopper
        g = run_or_skip(gpu, f, a, b, sa, sb)
    c = np.asarray(run_on(cpu, f, a, b, sa, sb), np.float64)
    tol = block_tolerance(a, b, a_mode, sa, b_mode, sb, F32)
    assert np.all(np.abs(g - c) <= tol), np.max(np.abs(g - c) / tol)


@pytest.mark.gpu
def test_cuda_index_past_the_list_names_the_count(rng, gpu):
    a = rng.normal(size=(64, 128)).astype(E4M3)
    f = lambda a: lowbit.ops.gemm(a, a, algo=31)  # noqa: E731
    try:
        run_on(gpu, f, a)
    except Exception as e:  # noqa: BLE001
        assert re.search(r"cuBLASLt returned only \d+ heuristic algorithms for .* index 31 "
                         r"\(LOWBIT_GEMM_ALGO\) does not exist", str(e)), str(e)
    else:
        pytest.skip("cuBLASLt lists 32 algorithms for this problem: no index past its list")


@pytest.mark.gpu
def test_cuda_default_index_past_the_list_runs_the_first_choice(rng, gpu, monkeypatch):
    """A raised DEFAULT_ALGO that a problem's list does not reach (31) runs cuBLASLt's first
    choice: the same bits as index 0; the same index set by the user fails, naming the count."""
    a = rng.normal(size=(64, 128)).astype(E4M3)
    b = rng.normal(size=(96, 128)).astype(E5M2)
    sa, sb = np.float32([0.5]), np.float32([2.0])
    monkeypatch.delenv("LOWBIT_GEMM_ALGO", raising=False)
    try:
        run_on(gpu, lambda a, b: lowbit.ops.gemm(a, b, sa, sb, out_dtype=F32, algo=31), a, b)
    except Exception as e:  # noqa: BLE001 (XlaRuntimeError)
        assert re.search(r"cuBLASLt returned only \d+ heuristic algorithms", str(e)), str(e)
    else:
        pytest.skip("cuBLASLt lists 32 algorithms for this problem: no index past its list")
    first = np.asarray(run_on(gpu, lambda a, b: lowbit.ops.gemm(a, b, sa, sb, out_dtype=F32, algo=0), a, b))
    monkeypatch.setitem(gemm_mod.DEFAULT_ALGO, "fp8_split_f32", 31)
    got = np.asarray(run_on(gpu, lambda a, b: lowbit.ops.gemm(a, b, sa, sb, out_dtype=F32), a, b))
    np.testing.assert_array_equal(got.view(np.uint32), first.view(np.uint32))
