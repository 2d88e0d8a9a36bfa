"""lowbit.ops.gemm with block scale modes on the GPU: cuBLASLt's block-scaled GEMMs and lowbit's
own wgmma kernel (LOWBIT_BLOCK_GEMM) against the CPU emulation within a stated tolerance
(gemm_block_reference.block_tolerance), the wgmma kernel's raster order and a cubin of its
kernels run in their place (LOWBIT_BLOCK_GEMM_CUBIN; neither changes a bit), the
kernel each path runs, and the pairs without a cuBLASLt path (emulated; MXFP8 on cuBLASLt on
10.x only). All tests are marked `gpu` (they skip without one)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from conftest import run_on
from gemm_block_reference import (BF16, E4M3, E5M2, F32, PAIR_IDS, PAIRS, Mode, block_tolerance, call,
                                  dequantized, gemm_mod, operands)


GPU_SHAPES = [(128, 256, 512), (1, 16, 128), (7, 17, 200), (130, 33, 1000), (256, 384, 4096),
              (300, 400, 2000), (520, 1040, 4096)]
# LOWBIT_BLOCK_GEMM: cuBLASLt's block scaling (the default) or lowbit's own wgmma kernel
# (csrc/gemm/block_gemm_sm90.h); both follow the same per-block order and tolerance.
BLOCK_PATHS = ["cublaslt", "wgmma"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", BLOCK_PATHS)
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("types", [(E4M3, E5M2), (E5M2, E4M3), (E4M3, E4M3)], ids=["e4m3-e5m2", "e5m2-e4m3", "e4m3-e4m3"])
def test_cuda_block_gemm_matches_cpu_emulation(a_mode, b_mode, m, n, k, out_dtype, types, path, rng, cpu,
                                               gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", path)
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, *types)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, a_mode, b_mode, bias, out_dtype)  # noqa: E731
    g = np.asarray(run_on(gpu, f, a, b, sa, sb, bias), np.float64)
    c = np.asarray(run_on(cpu, f, a, b, sa, sb, bias), np.float64)
    tol = block_tolerance(a, b, a_mode, sa, b_mode, sb, out_dtype, bias)
    assert np.all(np.abs(g - c) <= tol), np.max(np.abs(g - c) / tol)
    # A wrong scale layout would be off by factors of 2^16 (the scales span 2^-12..2^4).
    assert np.linalg.norm(g - c) <= 2.0**-6 * np.linalg.norm(c) + 1e-30


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["1", "3", "n1", "n5", "n1024"])
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("m,n,k", [(520, 1040, 4096), (300, 400, 2000)], ids=str)
def test_cuda_block_gemm_raster_order_changes_no_bit(a_mode, b_mode, m, n, k, group, rng, gpu, monkeypatch):
    """LOWBIT_BLOCK_GEMM_GROUP (benchmark-only) reorders the wgmma kernel's tiles, never their
    arithmetic: every order gives the default order's bits."""
    if capability_of(gpu) != "9.0":
        pytest.skip("the wgmma kernel is Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "wgmma")
    a, b, sa, sb = operands(rng, m, n, k, a_mode, b_mode, E4M3, E4M3)
    bias = rng.normal(size=(n,)).astype(BF16)
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, a_mode, b_mode, bias, BF16)  # noqa: E731
    monkeypatch.delenv("LOWBIT_BLOCK_GEMM_GROUP", raising=False)
    default = np.asarray(run_on(gpu, f, a, b, sa, sb, bias))
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM_GROUP", group)
    reordered = np.asarray(run_on(gpu, f, a, b, sa, sb, bias))
    np.testing.assert_array_equal(reordered.view(np.uint16), default.view(np.uint16))
    assert np.any(default != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["0", "x3", "n", "4a", "2000"])
def test_cuda_block_gemm_bad_raster_group_names_the_variable(value, rng, gpu, monkeypatch):
    if capability_of(gpu) != "9.0":
        pytest.skip("the wgmma kernel is Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "wgmma")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM_GROUP", value)
    a, b, sa, sb = operands(rng, 256, 256, 512, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    with pytest.raises(Exception, match="LOWBIT_BLOCK_GEMM_GROUP"):
        np.asarray(run_on(gpu, lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_128x128), a, b, sa, sb))


@pytest.mark.gpu
@pytest.mark.parametrize("path,kernel", [("wgmma", "BlockGemmKernel"), ("cublaslt", "nvjet")])
def test_cuda_block_gemm_path_runs_its_kernel(path, kernel, rng, gpu, monkeypatch, tmp_path):
    """LOWBIT_BLOCK_GEMM picks the kernel that runs on Hopper: the profiler's kernel names show
    lowbit's BlockGemmKernel for "wgmma" and cuBLASLt's (not lowbit's) for the default."""
    import glob
    import gzip

    if capability_of(gpu) != "9.0":
        pytest.skip("the block GEMM paths are Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", path)
    a, b, sa, sb = operands(rng, 256, 256, 1024, Mode.BLOCK_1x128, Mode.BLOCK_1x128)
    args = jax.device_put((a, b, sa, sb), gpu)
    f = jax.jit(lambda a, b, sa, sb: call(a, b, sa, sb, Mode.BLOCK_1x128, Mode.BLOCK_1x128))
    jax.block_until_ready(f(*args))
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        jax.block_until_ready(f(*args))
    trace = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    assert trace
    text = "".join(gzip.open(t, "rt").read() for t in trace)
    assert ("BlockGemmKernel" in text) == (path == "wgmma")
    assert kernel in text


@pytest.mark.gpu
def test_cuda_block_gemm_runs_cublaslt_on_hopper(rng, gpu):
    """On compute capability 9.0 the program holds lowbit_gemm (no emulation); elsewhere the
    documented emulation runs."""
    a, b, sa, sb = operands(rng, 64, 128, 256, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    args = jax.device_put((a, b, sa, sb), gpu)
    hlo = jax.jit(lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_128x128)).lower(*args).compile().as_text()
    assert ("lowbit_gemm" in hlo) == (getattr(gpu, "compute_capability", "") == "9.0")


def capability_of(device) -> str:
    return str(getattr(device, "compute_capability", ""))


@pytest.mark.gpu
@pytest.mark.parametrize("a_mode,b_mode", PAIRS[3:], ids=PAIR_IDS[3:])
def test_cuda_pairs_without_cublaslt_path_are_emulated(a_mode, b_mode, rng, cpu, gpu):
    """128x128 x 128x128 anywhere and MXFP8 off compute capability 10.x (the sm_100 gate, so
    on an H100 too): the jnp emulation, and no lowbit_gemm in the program."""
    if a_mode == Mode.MXFP8 and gemm_mod.mxfp8_on_cublaslt(capability_of(gpu)):
        pytest.skip("MXFP8 runs on cuBLASLt here: test_cuda_mxfp8_matches_cpu_emulation")
    a, b, sa, sb = operands(rng, 33, 40, 300, a_mode, b_mode)
    args = jax.device_put((a, b, sa, sb), gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        hlo = jax.jit(lambda *x: call(*x, a_mode, b_mode)).lower(*args).compile().as_text()
    assert "lowbit_gemm" not in hlo
    f = lambda *x: call(*x, a_mode, b_mode)  # noqa: E731
    g = np.asarray(run_on(gpu, f, a, b, sa, sb), np.float64)
    c = np.asarray(run_on(cpu, f, a, b, sa, sb), np.float64)
    a64, b64 = dequantized(a, a_mode, sa).astype(np.float64), dequantized(b, b_mode, sb).astype(np.float64)
    assert np.all(np.abs(g - c) <= 8 * 300 * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES + [(300, 200, 1056)], ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
def test_cuda_mxfp8_matches_cpu_emulation(m, n, k, out_dtype, rng, cpu, gpu):
    """MXFP8 on the GPU against the CPU emulation: on 10.x through cuBLASLt (swizzled scales,
    NaN codes in the scale padding, which the padding of K must not let through), within the
    block tolerance; elsewhere the emulation. The program holds lowbit_gemm exactly on 10.x."""
    a, b, sa, sb = operands(rng, m, n, k, Mode.MXFP8, Mode.MXFP8, E4M3, E5M2)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    f = lambda a, b, sa, sb, bias: call(a, b, sa, sb, Mode.MXFP8, Mode.MXFP8, bias, out_dtype)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        g = np.asarray(run_on(gpu, f, a, b, sa, sb, bias), np.float64)
        args = jax.device_put((a, b, sa, sb, bias), gpu)
        hlo = jax.jit(f).lower(*args).compile().as_text()
    c = np.asarray(run_on(cpu, f, a, b, sa, sb, bias), np.float64)
    assert ("lowbit_gemm" in hlo) == gemm_mod.mxfp8_on_cublaslt(capability_of(gpu))
    tol = block_tolerance(a, b, Mode.MXFP8, sa, Mode.MXFP8, sb, out_dtype, bias)
    assert np.all(np.abs(g - c) <= tol), np.max(np.abs(g - c) / tol)
    # A wrongly swizzled scale is off by factors up to 2^30 (the exponents span 110..139).
    assert np.linalg.norm(g - c) <= 2.0**-6 * np.linalg.norm(c) + 1e-30


REPO = pathlib.Path(__file__).resolve().parents[1]


def _cubin_variants(tmp_path):
    """block_gemm_sm90.cu compiled alone to sm_90a cubins (the library's nvcc flags): "same" from
    the library's source path (the anonymous namespace's mangled name follows the path, so the
    override finds the kernel by its exact name), "moved" from a copy elsewhere (found by the
    name after "BlockGemmKernel"), and tools/sass_control.py's two yield variants of "moved".
    Skips where nvcc or cuobjdump is missing."""
    nvcc, cuobjdump = shutil.which("nvcc"), shutil.which("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump on PATH (the GPU machine has both)")
    source = REPO / "csrc" / "gemm" / "block_gemm_sm90.cu"
    moved_source = tmp_path / "elsewhere" / source.name
    moved_source.parent.mkdir()
    moved_source.write_bytes(source.read_bytes())
    out = {"same": tmp_path / "same.cubin", "moved": tmp_path / "moved.cubin"}
    for name, src in (("same", source), ("moved", moved_source)):
        subprocess.run([nvcc, "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "--expt-relaxed-constexpr", "-lineinfo", f"-I{REPO / 'csrc'}", "-o", str(out[name]),
                        str(src)], check=True)
    namespaces = {name: set(re.findall(rb"_GLOBAL__N__\w+?_", out[name].read_bytes())) for name in out}
    assert namespaces["same"] and namespaces["same"] != namespaces["moved"]
    for policy in ("yield0", "yield1"):
        out[policy] = tmp_path / f"{policy}.cubin"
        subprocess.run([sys.executable, str(REPO / "tools" / "sass_control.py"), str(out["moved"]),
                        str(out[policy]), "--policy", policy, "--ops", "FFMA,FMUL", "--cuobjdump", cuobjdump],
                       check=True)
        assert out[policy].read_bytes() != out["moved"].read_bytes()
    return out


@pytest.mark.gpu
def test_cuda_block_gemm_cubin_override_changes_no_bit(rng, gpu, monkeypatch, tmp_path):
    """LOWBIT_BLOCK_GEMM_CUBIN (benchmark-only) runs a cubin's kernels in place of the built
    ones, found by either name; the yield variants of tools/sass_control.py change scheduling
    bits only, so every mode pair and out dtype gives the built kernel's bits."""
    if capability_of(gpu) != "9.0":
        pytest.skip("the wgmma kernel is Hopper's")
    cubins = _cubin_variants(tmp_path)
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "wgmma")
    for a_mode, b_mode in PAIRS[:3]:
        for out_dtype in (BF16, F32):
            a, b, sa, sb = operands(rng, 520, 1040, 4096, a_mode, b_mode, E4M3, E5M2)
            f = lambda a, b, sa, sb: call(a, b, sa, sb, a_mode, b_mode, None, out_dtype)  # noqa: E731
            monkeypatch.delenv("LOWBIT_BLOCK_GEMM_CUBIN", raising=False)
            want = np.asarray(run_on(gpu, f, a, b, sa, sb))
            assert np.any(want != 0)
            for name, path in cubins.items():
                monkeypatch.setenv("LOWBIT_BLOCK_GEMM_CUBIN", str(path))
                got = np.asarray(run_on(gpu, f, a, b, sa, sb))
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)


@pytest.mark.gpu
def test_cuda_block_gemm_bad_cubin_names_the_variable(rng, cpu, gpu, monkeypatch, tmp_path):
    if capability_of(gpu) != "9.0":
        pytest.skip("the wgmma kernel is Hopper's")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM", "wgmma")
    monkeypatch.setenv("LOWBIT_BLOCK_GEMM_CUBIN", str(tmp_path / "missing.cubin"))
    a, b, sa, sb = operands(rng, 256, 256, 512, Mode.BLOCK_1x128, Mode.BLOCK_128x128)
    f = lambda *x: call(*x, Mode.BLOCK_1x128, Mode.BLOCK_128x128)  # noqa: E731
    with pytest.raises(Exception, match="LOWBIT_BLOCK_GEMM_CUBIN"):
        np.asarray(run_on(gpu, f, a, b, sa, sb))
    # The failed load is that call's error only (before, it stayed the runtime's last error
    # and the process's next GEMM reported it as its own launch failing): the next call runs
    # the built kernel and matches the CPU emulation.
    monkeypatch.delenv("LOWBIT_BLOCK_GEMM_CUBIN")
    got = np.asarray(run_on(gpu, f, a, b, sa, sb), np.float64)
    want = np.asarray(run_on(cpu, f, a, b, sa, sb), np.float64)
    assert np.any(want != 0)
    assert np.all(np.abs(got - want) <= block_tolerance(a, b, Mode.BLOCK_1x128, sa, Mode.BLOCK_128x128, sb, F32))
