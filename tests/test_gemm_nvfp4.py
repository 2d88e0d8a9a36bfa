"""lowbit.ops.gemm_nvfp4.nvfp4_gemm (packed NVFP4 operands): the CPU handler against a numpy
reference written from gemm.h's formula (bit for bit), against the jnp emulation and
lowbit.dense's emulated_nvfp4_gemm on quantizer output, the CUDA lowering's sm_100 gate
(one padded lowbit_gemm_nvfp4 on 10.x, the emulation elsewhere), the padding wrapper exact
through the CPU handler, bad input, and on the GPU the device result against the CPU."""

from __future__ import annotations

import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on

from lowbit.ops.quantize_nvfp4 import quantize_nvfp4

gemm_mod = importlib.import_module("lowbit.ops.gemm")
nvfp4_mod = importlib.import_module("lowbit.ops.gemm_nvfp4")
ffi_mod = importlib.import_module("lowbit._ffi")
BF16, F32 = jnp.bfloat16, jnp.float32
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def cdiv(a, b):
    return -(-a // b)


def random_operand(rng, rows, k, nan_padding=True):
    """Random packed codes (odd K: last high nibble 0), random finite e4m3 scales (NaN codes
    in the padding when asked: it must never be read) and a global scale_inv."""
    codes = rng.integers(0, 16, size=(rows, cdiv(k, 2) * 2), dtype=np.uint8)
    codes[:, k:] = 0
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    d0, d1 = nvfp4_mod.nvfp4_scale_shape(rows, k)
    s = np.full((d0, d1), 0x7F if nan_padding else 0, np.uint8)
    s[:rows, :cdiv(k, 16)] = rng.integers(0x08, 0x77, size=(rows, cdiv(k, 16)), dtype=np.uint8)
    gsi = np.float32([np.exp2(rng.uniform(-8, -2))])
    return data, s.view(ml_dtypes.float8_e4m3fn), gsi


def dequantized(data, scale, gsi, k):
    rows = data.shape[0]
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(rows, -1)[:, :k]
    sd = scale.astype(np.float32)[:rows, np.arange(k) // 16]
    return (E2M1[codes] * sd).astype(np.float32) * gsi[0]


def sequential_ref(a, b, k, bias, out_dtype):
    """gemm.h's emulation: operands dequantized, products rounded to fp32, summed in k order
    from an accumulator of +0 (so a sum of -0 products is +0, as in the C++ loop; cumsum
    starts from the first product, hence the + 0)."""
    a32, b32 = dequantized(*a, k), dequantized(*b, k)
    acc = np.float32(0) + np.cumsum(a32[:, None, :] * b32[None, :, :], axis=-1, dtype=np.float32)[..., -1]
    if bias is not None:
        acc = acc + np.asarray(bias).astype(np.float32)
    return acc.astype(out_dtype)


def call(a, b, bias=None, out_dtype=F32, k=None, **kw):
    return nvfp4_mod.nvfp4_gemm(a[0], b[0], a[1], b[1], a[2], b[2], bias, k=k, out_dtype=out_dtype, **kw)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 5, 17), (16, 8, 64), (7, 130, 100), (130, 9, 33)], ids=str)
@pytest.mark.parametrize("out_dtype,with_bias", [(F32, False), (BF16, True), (jnp.float16, True)], ids=str)
def test_cpu_handler_is_the_documented_formula(m, n, k, out_dtype, with_bias, rng, cpu):
    a, b = random_operand(rng, m, k), random_operand(rng, n, k)
    bias = rng.normal(size=(n,)).astype(out_dtype) if with_bias else None
    got = run_on(cpu, lambda *x: call(x[:3], x[3:6], *x[6:], out_dtype=out_dtype, k=k), *a, *b,
                 *([bias] if with_bias else []))
    want = sequential_ref(a, b, k, bias, out_dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_cpu_emulation_notice_is_given_once(rng, cpu):
    """DESIGN 4: the CPU handler is an emulation (no FP4 hardware path) and says so once."""
    gemm_mod._NOTICED.clear()
    a, b = random_operand(rng, 3, 40), random_operand(rng, 5, 40)
    with pytest.warns(UserWarning, match="NVFP4 GEMMs run as an exact emulation on the CPU"):
        run_on(cpu, lambda *x: call(x[:3], x[3:], k=40), *a, *b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_on(cpu, lambda *x: call(x[:3], x[3:], k=40) * 2, *a, *b)


def test_matches_dense_emulation_on_quantizer_output(rng, cpu):
    """Quantized by lowbit.ops.quantize_nvfp4, multiplied packed: equal to the emulation
    lowbit.dense uses (dequantize, HIGHEST fp32 dot) within fp32 reordering."""
    x = rng.normal(size=(40, 96)).astype(np.float32)
    w = rng.normal(size=(24, 96)).astype(np.float32)
    qx = run_on(cpu, lambda v: quantize_nvfp4(v), x)
    qw = run_on(cpu, lambda v: quantize_nvfp4(v), w)
    got = np.asarray(run_on(cpu, lambda *v: nvfp4_mod.nvfp4_gemm(*v, k=96, out_dtype=F32),
                            qx[0], qw[0], qx[1], qw[1], qx[2], qw[2]), np.float64)
    xd, wd = dequantized(qx[0], qx[1], qx[2], 96), dequantized(qw[0], qw[1], qw[2], 96)
    emu = np.asarray(run_on(cpu, lambda p, q: nvfp4_mod.emulated_nvfp4_gemm(p, q, out_dtype=F32), xd, wd))
    tol = 4 * 96 * 2.0**-24 * (np.abs(xd.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T)
    assert np.all(np.abs(got - emu) <= tol)
    assert np.abs(got).max() > 0


def test_jnp_emulation_matches_handler(rng, cpu):
    a, b = random_operand(rng, 33, 70), random_operand(rng, 20, 70)
    h = np.asarray(run_on(cpu, lambda *x: call(x[:3], x[3:], k=70), *a, *b), np.float64)
    e = np.asarray(run_on(cpu, lambda *x: nvfp4_mod.emulated_nvfp4_gemm_packed(
        x[0], x[3], x[1], x[4], x[2], x[5], jnp.zeros((0,), F32), out_dtype=F32, k=70), *a, *b), np.float64)
    a32, b32 = dequantized(*a, 70).astype(np.float64), dequantized(*b, 70).astype(np.float64)
    assert np.all(np.abs(h - e) <= 4 * 70 * 2.0**-24 * (np.abs(a32) @ np.abs(b32).T))


@pytest.mark.cpu_reference
@pytest.mark.parametrize("m,n,k", [(7, 17, 200), (1, 16, 64), (130, 33, 1000), (16, 16, 33)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=str)
def test_cuda_wrapper_padding_on_cpu_handler_is_exact(m, n, k, with_bias, rng):
    """_nvfp4_gemm_cuda (M, N to 16, K to 64, NaN scale padding zeroed, bias in fp32 after)
    through the CPU handler equals the formula bit for bit."""
    a, b = random_operand(rng, m, k), random_operand(rng, n, k)
    bias = rng.normal(size=(n,)).astype(BF16) if with_bias else np.zeros((0,), BF16)
    f = jax.jit(lambda *x: nvfp4_mod._nvfp4_gemm_cuda(x[0], x[3], x[1], x[4], x[2], x[5], x[6],
                                                     out_dtype=jnp.dtype(BF16), k=k, algo=0))
    got = np.asarray(f(*a, *b, bias)).astype(np.float32)
    want = sequential_ref(a, b, k, bias if with_bias else None, BF16)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def cuda_calls(monkeypatch, fn, *args, capability):
    monkeypatch.setattr(gemm_mod, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(ffi_mod, "require_platform", lambda op, platform: None)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    pattern = re.compile(r"custom_call @lowbit_gemm_nvfp4\((.*?)\) \{(.*)\} : \((.*)\) -> \((.*)\)")
    types = lambda s: re.findall(r"tensor<([^>]*)>", s)  # noqa: E731
    matches = [mt for mt in map(pattern.search, text.splitlines()) if mt]
    return [(types(mt.group(3)), types(mt.group(4)), mt.group(2)) for mt in matches]


@pytest.mark.parametrize("capability", ["10.0", "10.3"])
@pytest.mark.parametrize("m,n,k", [(7, 17, 200), (256, 128, 4096), (16, 32, 64)], ids=str)
def test_cuda_lowering_on_sm100_emits_one_padded_call(capability, m, n, k, rng, monkeypatch):
    a, b = random_operand(rng, m, k), random_operand(rng, n, k)
    bias = rng.normal(size=(n,)).astype(BF16)
    f = lambda *x: call(x[:3], x[3:6], x[6], out_dtype=BF16, k=k, algo=2)  # noqa: E731
    (ops, results, attrs), = cuda_calls(monkeypatch, f, *a, *b, bias, capability=capability)
    mp, np_, kp = cdiv(m, 16) * 16, cdiv(n, 16) * 16, cdiv(k, 64) * 64
    sa, sb = nvfp4_mod.nvfp4_scale_shape(m, k), nvfp4_mod.nvfp4_scale_shape(n, k)
    assert sa == nvfp4_mod.nvfp4_scale_shape(mp, kp) and sb == nvfp4_mod.nvfp4_scale_shape(np_, kp)
    assert ops == [f"{mp}x{kp // 2}xui8", f"{np_}x{kp // 2}xui8", f"{sa[0]}x{sa[1]}xf8E4M3FN",
                   f"{sb[0]}x{sb[1]}xf8E4M3FN", "1xf32", "1xf32", "0xf32"]
    ws = gemm_mod.GEMM_WORKSPACE_BYTES + sum(cdiv(x * y, 256) * 256 for x, y in (sa, sb))
    assert results == [f"{mp}x{np_}xf32", f"{ws}xui8"]
    assert re.search(rf"\bk = {kp} : i64", attrs) and re.search(r"\balgo = 2 : i32", attrs)


@pytest.mark.parametrize("capability", ["9.0", "8.9", "12.0", ""])
def test_cuda_lowering_emulates_off_sm100(capability, rng, monkeypatch):
    a, b = random_operand(rng, 7, 100), random_operand(rng, 9, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        assert cuda_calls(monkeypatch, lambda *x: call(x[:3], x[3:], k=100), *a, *b, capability=capability) == []


@pytest.mark.parametrize("which", ["a_scale", "b_scale", "bias"])
@pytest.mark.parametrize("capability", ["10.0", "9.0"], ids=["cublaslt", "emulated"])
def test_cuda_lowering_refuses_wrong_shapes(which, capability, rng, monkeypatch):
    """gemm_nvfp4_p bound directly with a wrongly shaped block scale array or bias is refused by
    the CUDA lowering, in the C++ handler's words, before its padding or emulation could slice
    the scales or broadcast a (1,) bias over N."""
    k = 100
    a, b = list(random_operand(rng, 7, k)), list(random_operand(rng, 9, k))
    bias = np.zeros((0,), F32)
    if which == "a_scale":
        a[1], want = a[1][:, :4], r"a_scale: expected e4m3 \(128, 8\), got float8_e4m3fn \(128, 4\)"
    elif which == "b_scale":
        b[1], want = b[1][:64], r"b_scale: expected e4m3 \(128, 8\), got float8_e4m3fn \(64, 8\)"
    else:
        bias, want = np.ones((1,), F32), r"bias: expected \(9,\) or \(0,\), got \(1,\)"
    f = lambda *x: nvfp4_mod.gemm_nvfp4_p.bind(  # noqa: E731
        x[0], x[3], x[1], x[4], x[2], x[5], x[6], out_dtype=jnp.dtype(F32), k=np.int64(k), algo=np.int32(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time emulation notice
        with pytest.raises(ValueError, match="lowbit_gemm_nvfp4: " + want):
            cuda_calls(monkeypatch, f, *a, *b, bias, capability=capability)
        a, b = random_operand(rng, 7, k), random_operand(rng, 9, k)  # correctly shaped: lowers
        cuda_calls(monkeypatch, f, *a, *b, np.ones((9,), F32), capability=capability)


@pytest.mark.parametrize("bad,match", [
    (dict(a_data=np.zeros((4, 3), np.uint8)), "a: expected packed E2M1 uint8 \\(rows, 5\\)"),
    (dict(a_data=np.zeros((4, 5), np.int8)), "a: expected packed E2M1"),
    (dict(b_scale=np.zeros((128, 4), np.float32)), "b_scale: expected float8_e4m3fn"),
    (dict(a_gsi=np.ones((2,), np.float32)), "a_global_scale_inv: expected one float32"),
    (dict(bias=np.zeros((3,), np.float32)), "bias: expected"),
    (dict(algo=40), "algo: expected"),
], ids=str)
def test_bad_input_names_the_argument(bad, match, rng):
    a, b = random_operand(rng, 4, 10), random_operand(rng, 6, 10)
    kw = dict(a_data=a[0], b_data=b[0], a_scale=a[1], b_scale=b[1], a_gsi=a[2], b_gsi=b[2], bias=None, algo=None)
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        nvfp4_mod.nvfp4_gemm(kw["a_data"], kw["b_data"], kw["a_scale"], kw["b_scale"], kw["a_gsi"], kw["b_gsi"],
                            kw["bias"], k=10, out_dtype=F32, algo=kw["algo"])


def test_handler_validates_too(rng, cpu):
    a, b = random_operand(rng, 4, 10), random_operand(rng, 6, 10)
    f = lambda *x: nvfp4_mod.gemm_nvfp4_p.bind(*x, jnp.zeros((0,), F32), out_dtype=jnp.dtype(F32),  # noqa: E731
                                              k=np.int64(12), algo=np.int32(0))
    with pytest.raises(Exception, match="lowbit_gemm_nvfp4: a: expected packed E2M1 as u8 \\(rows, 6\\)"):
        run_on(cpu, f, a[0], b[0], a[1], b[1], a[2], b[2])


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 256, 512), (7, 17, 200), (130, 33, 1000), (256, 384, 4096)], ids=str)
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=str)
def test_cuda_matches_cpu(m, n, k, out_dtype, rng, cpu, gpu):
    """On 10.x cuBLASLt (swizzled e4m3 scales, alpha = a_gsi * b_gsi; NaN codes in the scale
    padding), elsewhere the jnp emulation: within the block tolerance of gemm_block_reference.py
    (exact products, fp32 sums in another order, ~14-bit inner accumulation)."""
    a, b = random_operand(rng, m, k), random_operand(rng, n, k)
    bias = rng.normal(size=(n,)).astype(out_dtype)
    f = lambda *x: call(x[:3], x[3:6], x[6], out_dtype=out_dtype, k=k)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = np.asarray(run_on(gpu, f, *a, *b, bias), np.float64)
        hlo = jax.jit(f).lower(*jax.device_put((*a, *b, bias), gpu)).compile().as_text()
    c = np.asarray(run_on(cpu, f, *a, *b, bias), np.float64)
    cap = str(getattr(gpu, "compute_capability", ""))
    assert ("lowbit_gemm_nvfp4" in hlo) == gemm_mod.mxfp8_on_cublaslt(cap)
    a64, b64 = dequantized(*a, k).astype(np.float64), dequantized(*b, k).astype(np.float64)
    eps = float(ml_dtypes.finfo(out_dtype).eps)
    tol = ((4 * k * 2.0**-24 + 4 * np.sqrt(128) * 2.0**-14) * (np.abs(a64) @ np.abs(b64).T)
           + eps * (np.abs(a64 @ b64.T) + np.abs(bias.astype(np.float64))) + float(ml_dtypes.finfo(out_dtype).tiny))
    assert np.all(np.abs(g - c) <= tol), np.max(np.abs(g - c) / tol)
    assert np.linalg.norm(g - c) <= 2.0**-6 * np.linalg.norm(c) + 1e-30


# ---------------------------------------------------------------- vmap and sharding


def test_vmap_equals_the_loop(rng, cpu):
    """Batched operands (with their scales and global scale_invs), b unbatched or batched,
    the batch at axis 0 or 1 of a: bit for bit the per-element calls."""
    m, n, k, batch = 19, 24, 80, 3
    ops_a = [random_operand(rng, m, k) for _ in range(batch)]
    ops_b = [random_operand(rng, n, k) for _ in range(batch)]
    bias = rng.normal(size=(n,)).astype(np.float32)
    a = [np.stack([o[i] for o in ops_a]) for i in range(3)]
    b = [np.stack([o[i] for o in ops_b]) for i in range(3)]
    f = lambda a, b, sa, sb, ga, gb: nvfp4_mod.nvfp4_gemm(a, b, sa, sb, ga, gb, bias, k=k, out_dtype=F32)  # noqa: E731
    loop = np.stack([run_on(cpu, f, ops_a[i][0], ops_b[i][0], ops_a[i][1], ops_b[i][1], ops_a[i][2], ops_b[i][2])
                     for i in range(batch)])
    both = run_on(cpu, jax.vmap(f), a[0], b[0], a[1], b[1], a[2], b[2])
    np.testing.assert_array_equal(both.view(np.uint32), loop.view(np.uint32))
    moved = run_on(cpu, jax.vmap(f, in_axes=(1, 0, 0, 0, 0, 0)), np.moveaxis(a[0], 0, 1), b[0], a[1], b[1], a[2], b[2])
    np.testing.assert_array_equal(moved.view(np.uint32), loop.view(np.uint32))
    b0 = [x[0] for x in b]
    only_a = run_on(cpu, jax.vmap(f, in_axes=(0, None, 0, None, 0, None)), a[0], b0[0], a[1], b0[1], a[2], b0[2])
    loop_a = np.stack([run_on(cpu, f, ops_a[i][0], b0[0], ops_a[i][1], b0[1], ops_a[i][2], b0[2]) for i in range(batch)])
    np.testing.assert_array_equal(only_a.view(np.uint32), loop_a.view(np.uint32))


def _mesh2():
    from jax.sharding import Mesh
    return Mesh(np.array(jax.devices("cpu")[:2]), ("x",))


def _local_call_rows(hlo: str):
    """(a rows, b rows, packed K) of the compiled lowbit_gemm_nvfp4 custom calls."""
    out = []
    for line in hlo.splitlines():
        if 'custom_call_target="lowbit_gemm_nvfp4"' in line:
            shapes = re.findall(r"u8\[(\d+),(\d+)\]", line.split("custom-call(", 1)[1])
            out.append((int(shapes[0][0]), int(shapes[1][0]), int(shapes[0][1])))
    return out


NVFP4_SHARD_CASES = {  # M, N, K, a spec, b spec, local (a rows, b rows, packed K), exact, all-reduces
    "rows": (256, 48, 96, ("x", None), (None, None), (128, 48, 48), True, 0),
    "n": (40, 256, 96, (None, None), ("x", None), (40, 128, 48), True, 0),
    "k": (40, 48, 256, (None, "x"), (None, "x"), (40, 48, 64), False, 1),
    "rows_unclean": (200, 48, 96, ("x", None), (None, None), (200, 48, 48), True, 0),  # 200 % 128: gathered
    "k_unclean": (40, 48, 96, (None, "x"), (None, "x"), (40, 48, 48), True, 0),  # ceil(96/16) % 4: gathered
}


@pytest.mark.cpu_reference  # the mesh is CPU devices: the unsharded result is the CPU's too
@pytest.mark.parametrize("psum", ["out", "fp32"])
@pytest.mark.parametrize("case", list(NVFP4_SHARD_CASES))
def test_sharded_equals_unsharded(case, psum, rng, monkeypatch):
    """On a 2-device mesh: rows of a or N of b sharded give the unsharded bits (each shard
    runs the same k-order sums on its rows); K sharded gives partial sums psum'ed (fp32
    ones within reordering; with LOWBIT_GEMM_PSUM=out, the default, each partial rounded to
    bf16 first); splits that would cut a scale tile or a padded scale dim gather."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lowbit.ops.gemm import PSUM_ENV
    monkeypatch.setenv(PSUM_ENV, psum)
    m, n, k, a_spec, b_spec, local, exact, n_reduce = NVFP4_SHARD_CASES[case]
    a, b = random_operand(rng, m, k, nan_padding=False), random_operand(rng, n, k, nan_padding=False)
    bias = rng.normal(size=(n,)).astype(BF16)
    f = jax.jit(lambda *x: call(x[:3], x[3:6], x[6], out_dtype=BF16, k=k))
    want = np.asarray(f(*a, *b, bias)).astype(np.float32)
    mesh = _mesh2()
    args = (jax.device_put(a[0], NamedSharding(mesh, P(*a_spec))), a[1], a[2],
            jax.device_put(b[0], NamedSharding(mesh, P(*b_spec))), b[1], b[2], bias)
    got = np.asarray(f(*args)).astype(np.float32)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        a64, b64 = dequantized(*a, k).astype(np.float64), dequantized(*b, k).astype(np.float64)
        abs_dot = np.abs(a64) @ np.abs(b64).T
        tol = 4 * k * 2.0**-24 * abs_dot + 2.0**-7 * np.abs(want) + 1e-30
        if psum == "out":  # two bf16 partials (each off by <= 2^-9 of its magnitude <= abs_dot)
            tol = tol + 2.0**-8 * abs_dot
        assert np.all(np.abs(got - want) <= tol)
    hlo = f.lower(*args).compile().as_text()
    assert _local_call_rows(hlo) == [local]
    assert len(re.findall(r"\sall-reduce(?:-start)?\(", hlo)) == n_reduce
