"""lowbit.ops.quantize_grouped_fp8: bit for bit against a few-line reference that loops over
the groups with the single-tensor quantizer's semantics (jnp encode, numpy amax and
current scale) and against lowbit.ops.quantize_fp8 / compute_scale run per group; empty
groups, one-row groups, padding (sum(group_sizes) < M), negative and oversized sizes,
odd K, rank 3 with groups of several rows, special values; jit with changing sizes, vmap,
bad input, the CUDA lowering; and the CUDA kernel against the CPU handler (bit for bit). The
grouped block formats: tests/test_quantize_grouped_block.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from quantize_grouped_common import DTYPES, FP8, _assert_same, dtype_ids
from quantize_reference import assert_fp8_equal, quantize_ref

import lowbit
from lowbit.ops import compute_scale, quantize_fp8, quantize_grouped_fp8


def current_scale_ref(amax, fmax, pow2=False):
    """DESIGN.md §4 current scaling in numpy fp32 (IEEE division on the host)."""
    a = np.float32(amax)
    if not (np.isfinite(a) and a > 0):
        return np.float32(1.0)
    s = np.float32(fmax) / a
    s = np.float32(np.finfo(np.float32).max) if np.isinf(s) else s
    return np.array(s, np.float32).view(np.uint32) & np.uint32(0xFF800000) if pow2 else s


def grouped_ref(x, sizes, scale, fp8, flatten_axis=-1, pow2=False):
    """(rowwise, colwise, amax, scale): a loop over the groups, each quantized as one tensor."""
    f = flatten_axis % x.ndim
    unit, rows = int(np.prod(x.shape[1:f])), int(np.prod(x.shape[:f]))
    x2 = np.asarray(x).reshape(rows, -1)
    q = np.zeros(x2.shape, fp8)  # padding rows: code 0
    amaxes, scales, start = [], [], 0
    for g, n in enumerate(sizes):
        end = min(start + max(int(n), 0) * unit, rows)
        amax = np.max(np.abs(x2[start:end].astype(np.float32)), initial=0.0)
        s = current_scale_ref(amax, float(jnp.finfo(fp8).max), pow2) if scale is None else scale[g]
        s = np.asarray(s).view(np.float32).reshape(())
        q[start:end] = np.asarray(quantize_ref(jnp.asarray(x2[start:end]), s, fp8)[0])
        amaxes.append(amax)
        scales.append(s)
        start = end
    rowwise = q.reshape(x.shape)
    colwise = np.transpose(rowwise, tuple(range(f, x.ndim)) + tuple(range(f)))
    return rowwise, colwise, np.array(amaxes, np.float32), np.array(scales, np.float32)


def assert_f32_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (got, want)


def check(out, ref, rowwise=True, colwise=True):
    if rowwise:
        assert_fp8_equal(out.rowwise, ref[0])
    if colwise:
        assert_fp8_equal(out.colwise, ref[1])
    assert_f32_bits(out.amax, ref[2])
    assert_f32_bits(out.scale, ref[3])
    assert_f32_bits(out.scale_inv, np.float32(1.0) / ref[3])


# (x shape, flatten_axis, group sizes): empty groups, one-row groups, padding, odd K,
# negative and oversized sizes, several rows per first-dim entry.
CASES = [
    ((37, 19), -1, [5, 0, 1, 20, 3]),
    ((64, 128), -1, [64]),
    ((1, 7), -1, [1, 0]),
    ((300, 65), -1, [1, 1, 1, 0, 128, 7, 100]),
    ((40, 33), -1, [0, 0, 0]),
    ((25, 16), -1, [10, -4, 30, 2]),
    ((9, 3, 20), 2, [2, 0, 4, 1]),
    ((9, 3, 20), 1, [3, 3, 3]),
]


@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("shape,axis,sizes", CASES, ids=str)
def test_matches_reference(shape, axis, sizes, dtype, fp8, rng):
    x = random_with_specials(rng, shape, dtype, scale=40.0)
    g = np.asarray(sizes, np.int32)
    f = jax.jit(lambda v, gs, s: quantize_grouped_fp8(v, gs, s, out_dtype=fp8, flatten_axis=axis))
    check(f(x, g, None), grouped_ref(x, sizes, None, fp8, axis))
    scales = rng.choice(np.float32([1.0, 0.01, 1e4, 0.125, 3.0]), len(sizes)).astype(np.float32)
    check(f(x, g, scales), grouped_ref(x, sizes, scales, fp8, axis))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_power_2_scales(dtype, rng):
    x = random_with_specials(rng, (50, 24), dtype, scale=7.0)
    sizes = [13, 0, 1, 30]
    out = quantize_grouped_fp8(x, np.int32(sizes), use_power_2_scales=True)
    check(out, grouped_ref(x, sizes, None, jnp.float8_e4m3fn, pow2=True))


def test_each_group_equals_quantize_fp8(rng):
    """The existing single-tensor quantizer on each group's rows, its scale from
    compute_scale of its amax: the same bits, NaN signs included."""
    x = random_with_specials(rng, (45, 31), ml_dtypes.bfloat16, scale=100.0)
    sizes = [7, 0, 1, 25]
    out = quantize_grouped_fp8(x, np.int32(sizes), out_dtype=jnp.float8_e5m2)
    # Sliced in numpy: XLA:CPU's strided fp8 slice may rewrite NaN payloads.
    rowwise, colwise = np.asarray(out.rowwise).view(np.uint8), np.asarray(out.colwise).view(np.uint8)
    start = 0
    for g, n in enumerate(sizes):
        part = x[start:start + n]
        amax = quantize_fp8(part, jnp.float32(1.0)).amax
        scale, scale_inv = compute_scale(amax.reshape(1), fp8_max=57344.0)
        ref = quantize_fp8(part, scale, out_dtype=jnp.float8_e5m2, colwise=True)
        np.testing.assert_array_equal(rowwise[start:start + n], np.asarray(ref.rowwise).view(np.uint8))
        np.testing.assert_array_equal(colwise[:, start:start + n], np.asarray(ref.colwise).view(np.uint8))
        assert_f32_bits(out.amax[g], ref.amax)
        assert_f32_bits(out.scale_inv[g], scale_inv[0])
        start += n
    assert not rowwise[start:].any() and not colwise[:, start:].any()


@pytest.mark.parametrize("layout", ["rowwise", "colwise"])
def test_one_copy(layout, rng):
    x = random_with_specials(rng, (33, 17), np.float16)
    sizes = [3, 20, 0]
    out = quantize_grouped_fp8(x, np.int32(sizes), rowwise=layout == "rowwise", colwise=layout == "colwise")
    assert (out.rowwise is None) == (layout == "colwise") and (out.colwise is None) == (layout == "rowwise")
    check(out, grouped_ref(x, sizes, None, jnp.float8_e4m3fn), layout == "rowwise", layout == "colwise")


def test_jit_sizes_change_without_recompiling(rng):
    x = random_with_specials(rng, (64, 40), ml_dtypes.bfloat16)
    traces = []

    @jax.jit
    def f(v, gs):
        traces.append(1)
        return quantize_grouped_fp8(v, gs)

    for sizes in ([64, 0], [1, 63], [0, 10], [-1, 100]):
        check(f(x, np.int32(sizes)), grouped_ref(x, sizes, None, jnp.float8_e4m3fn))
    assert len(traces) == 1


def test_vmap(rng):
    x = random_with_specials(rng, (3, 20, 24), np.float32)
    sizes = np.int32([[5, 15], [0, 20], [1, 2]])
    out = jax.jit(jax.vmap(quantize_grouped_fp8))(x, sizes)
    for b in range(3):
        check(jax.tree.map(lambda a: a[b], out), grouped_ref(x[b], sizes[b], None, jnp.float8_e4m3fn))


def test_empty_x():
    out = quantize_grouped_fp8(jnp.zeros((0, 16), jnp.bfloat16), np.int32([0, 0]))
    assert out.rowwise.shape == (0, 16) and out.colwise.shape == (16, 0)
    assert_f32_bits(out.amax, [0.0, 0.0])
    assert_f32_bits(out.scale, [1.0, 1.0])


def test_bad_inputs():
    x = jnp.ones((8, 16), jnp.bfloat16)
    g = np.int32([4, 4])
    op = "lowbit.ops.quantize_grouped_fp8"
    with pytest.raises(ValueError, match=f"{op}: group_sizes: expected int32"):
        quantize_grouped_fp8(x, np.int64([4, 4]))
    with pytest.raises(ValueError, match=f"{op}: group_sizes"):
        quantize_grouped_fp8(x, np.int32([[4, 4]]))
    with pytest.raises(ValueError, match=f"{op}: group_sizes"):
        quantize_grouped_fp8(x, np.zeros((0,), np.int32))
    with pytest.raises(ValueError, match=f"{op}: group_sizes"):
        quantize_grouped_fp8(x, np.ones((1025,), np.int32))
    with pytest.raises(TypeError, match=f"{op}: x: expected float32, float16 or bfloat16"):
        quantize_grouped_fp8(jnp.ones((8, 16), jnp.int32), g)
    with pytest.raises(ValueError, match=f"{op}: x, flatten_axis"):
        quantize_grouped_fp8(jnp.ones((16,), jnp.float32), g)
    with pytest.raises(ValueError, match=f"{op}: x, flatten_axis"):
        quantize_grouped_fp8(jnp.ones((8, 16), jnp.float32), g, flatten_axis=0)
    with pytest.raises(ValueError, match=f"{op}: scale: expected float32 of shape \\(2,\\)"):
        quantize_grouped_fp8(x, g, jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=f"{op}: scale"):
        quantize_grouped_fp8(x, g, jnp.ones((2,), jnp.float16))
    with pytest.raises(ValueError, match=f"{op}: use_power_2_scales"):
        quantize_grouped_fp8(x, g, jnp.ones((2,), jnp.float32), use_power_2_scales=True)
    with pytest.raises(ValueError, match=f"{op}: rowwise, colwise"):
        quantize_grouped_fp8(x, g, rowwise=False, colwise=False)
    with pytest.raises(TypeError, match=f"{op}: out_dtype"):
        quantize_grouped_fp8(x, g, out_dtype=jnp.bfloat16)


@pytest.mark.cpu_reference  # the CPU handler's results (the CUDA one takes a workspace too: test_quantize_workspace.py)
def test_handler_validation():
    """The FFI handler's own checks (what the Python wrapper cannot catch)."""
    lowbit._ffi.load()
    x = jnp.ones((4, 8), jnp.bfloat16)
    e4, f32, sd = jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
    good = [sd((4, 8), e4), sd((8, 4), e4), sd((2,), f32), sd((2,), f32), sd((2,), f32)]

    def call(sizes, scale, results, fa=1, current=False):
        return jax.ffi.ffi_call("lowbit_quantize_grouped_fp8", results)(
            x, sizes, scale, flatten_axis=np.int32(fa), current_scaling=np.bool_(current),
            use_power_2_scales=np.bool_(False))

    sizes, scale = jnp.int32([1, 3]), jnp.ones((2,), f32)
    jax.block_until_ready(call(sizes, scale, good))  # sanity: the well-formed call runs
    op = "lowbit_quantize_grouped_fp8"
    cases = [
        ((sizes.astype(f32), scale, good), rf"{op}: group_sizes: expected s32 of shape \(G,\)"),
        ((sizes, jnp.ones((3,), f32), good), rf"{op}: scale: expected f32 of shape \(2,\)"),
        ((sizes, scale, good, 1, True), rf"{op}: scale: expected f32 of shape \(0,\)"),
        ((sizes, scale, good, 0), rf"{op}: flatten_axis: expected >= 1"),
        ((sizes, scale, good[:2] + [sd((3,), f32)] + good[3:]), rf"{op}: amax: expected f32 of shape \(2,\)"),
        ((sizes, scale, [sd((0,), e4), sd((0,), e4)] + good[2:]), rf"{op}: rowwise: neither"),
    ]
    for args, msg in cases:
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(call(*args))


def test_cuda_lowering(monkeypatch):
    """Lowered for CUDA without a GPU: one custom call with the buffers and attributes the
    CUDA handler binds (the lowbit CUDA library's check is patched out)."""
    import importlib
    monkeypatch.setattr(importlib.import_module("lowbit._ffi"), "require_platform", lambda op, platform: None)
    x, g = jnp.ones((12, 3, 40), jnp.bfloat16), jnp.int32([2, 0, 2])
    f = lambda v, gs: quantize_grouped_fp8(v, gs, flatten_axis=2, use_power_2_scales=True)  # noqa: E731
    text = jax.jit(f).trace(x, g).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @lowbit_quantize_grouped_fp8" in ln]
    assert len(calls) == 1, text
    assert "current_scaling = true" in calls[0] and "use_power_2_scales = true" in calls[0]
    assert "flatten_axis = 2" in calls[0]
    assert "tensor<12x3x40xf8E4M3FN>" in calls[0] and "tensor<40x12x3xf8E4M3FN>" in calls[0]


# ---------------------------------------------------------------- CUDA == CPU

def _cuda_cases(rng):
    """(x shape, flatten_axis, sizes): tiles holding many groups, groups ending mid-tile,
    padding, odd K (the element-load path), 1024 groups, rank 3."""
    many = rng.integers(0, 5, 1024).astype(np.int32)
    return [
        ((1000, 264), -1, [1, 0, 300, 5, 129, 255, 0, 1]),
        ((517, 131), -1, [7, 1, 1, 200, 0, 17]),
        ((256, 128), -1, [256]),
        ((300, 1), -1, [100, 0, 150]),
        ((2048, 96), -1, list(many)),
        ((40, 6, 72), 2, [3, 0, 1, 30]),
        ((8, 2048), -1, [0, 3, 0, 4]),
    ]


def _run_both(cpu, gpu, x, sizes, scale, fp8, axis, **kw):
    f = lambda v, g, s: tuple(quantize_grouped_fp8(v, g, s, out_dtype=fp8, flatten_axis=axis, **kw))  # noqa: E731
    return run_on(gpu, f, x, np.int32(sizes), scale), run_on(cpu, f, x, np.int32(sizes), scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_cuda_equals_cpu(dtype, fp8, rng, cpu, gpu):
    for shape, axis, sizes in _cuda_cases(rng):
        x = random_with_specials(rng, shape, dtype, scale=50.0)
        x.reshape(-1)[:: max(1, x.size // 7)] = dtype(float(ml_dtypes.finfo(dtype).max) * 0.99)  # near-max
        a, b = _run_both(cpu, gpu, x, sizes, None, fp8, axis)
        _assert_same(a, b)
        check(GroupedFp8OutOf(b), grouped_ref(x, sizes, None, fp8, axis))
        scales = rng.choice(np.float32([1.0, 0.01, 1e4, 0.0, np.inf]), len(sizes)).astype(np.float32)
        a, b = _run_both(cpu, gpu, x, sizes, scales, fp8, axis)
        _assert_same(a, b)


def GroupedFp8OutOf(t):  # noqa: N802 - a tuple from run_on back to the named result
    from lowbit.ops import GroupedFp8Quantized
    return GroupedFp8Quantized(*t)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rowwise", "colwise"])
def test_cuda_one_copy_and_pow2_equal_cpu(layout, rng, cpu, gpu):
    x = random_with_specials(rng, (777, 200), ml_dtypes.bfloat16)
    sizes = [100, 1, 0, 600]
    a, b = _run_both(cpu, gpu, x, sizes, None, jnp.float8_e4m3fn, -1, use_power_2_scales=True,
                     rowwise=layout == "rowwise", colwise=layout == "colwise")
    _assert_same(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_cuda_misaligned_and_empty(dtype, rng, cpu, gpu):
    x = random_with_specials(rng, (131, 67), dtype)
    g = np.int32([60, 0, 3, 40])

    def f(v, gs):  # a slice starting one element in, odd cols: the unvectorized paths
        w = v.reshape(-1)[1:1 + 127 * 67].reshape(127, 67)
        return tuple(quantize_grouped_fp8(w, gs))

    _assert_same(run_on(gpu, f, x, g), run_on(cpu, f, x, g))
    for scale in (None, np.float32([2.0, 3.0, 0.5, 8.0])):
        e = lambda v, gs, s=scale: tuple(quantize_grouped_fp8(v[:0], gs, s))  # noqa: E731
        _assert_same(run_on(gpu, e, x, g), run_on(cpu, e, x, g))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["r64s2", "r64s3", "r128s2", "r256s2", "r256s2b4", "r64s2b1"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=dtype_ids)
def test_cuda_tile_variants_equal_cpu(variant, dtype, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_QUANTIZE_TILE_VARIANT", variant)
    x = random_with_specials(rng, (1200, 392), dtype)
    sizes = [0, 300, 1, 255, 257, 100]
    for scale in (None, np.float32([1.0, 2.0, 0.5, 1e3, 1e-3, 7.0])):
        a, b = _run_both(cpu, gpu, x, sizes, scale, jnp.float8_e4m3fn, -1)
        _assert_same(a, b)


@pytest.mark.gpu
def test_cuda_vmap_equals_cpu(rng, cpu, gpu):
    x = random_with_specials(rng, (2, 300, 136), ml_dtypes.bfloat16)
    sizes = np.int32([[100, 200], [0, 299]])
    f = lambda v, g: tuple(jax.vmap(quantize_grouped_fp8)(v, g))  # noqa: E731
    _assert_same(run_on(gpu, f, x, sizes), run_on(cpu, f, x, sizes))
