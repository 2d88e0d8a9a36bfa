"""lowbit.ops.quantize_grouped_block (MXFP8, FP8 1x128 and 128x128 blocks, per group of rows):
the rowwise copy is the ordinary quantizer's; bit for bit against a reference that runs the
ungrouped quantizer on each group's rows and places its outputs at the packed layout's
offsets (odd sizes, empty groups, groups ending mid-block, a tail, rank 3); colwise alone,
grouped_block_slice, power-of-two scales, jit with changing and clipped sizes, vmap, empty x,
bad input, the handler's checks, the CUDA lowering; and the CUDA kernels against the CPU
handler (bit for bit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from quantize_grouped_common import DTYPES, FP8, _assert_same, cuda_cases, dtype_ids

import lowbit
from lowbit.ops import grouped_block_slice, quantize_fp8_block, quantize_grouped_block, quantize_mxfp8


# Reference: the ungrouped quantizer (quantize_mxfp8 / quantize_fp8_block) run on each group's
# rows alone, its outputs placed at the packed layout's offsets (computed here from the
# sizes), zeros everywhere else; the whole-x ungrouped rowwise copy for MXFP8 / 1x128.

BLOCK_KINDS = [("mxfp8", False), ("fp8_block", False), ("fp8_block", True)]
kind_ids = lambda k: "128x128" if k[1] else k[0]  # noqa: E731


def _u8(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _cdiv(a, b):
    return -(-a // b)


def _round4(a):
    return _cdiv(a, 4) * 4


def grouped_block_ref(x, sizes, mode, tile_2d, fp8, axis=-1, pow2=False, rowwise=True, colwise=True):
    """(rowwise, rowwise_scale, colwise, colwise_scale) as uint8 / uint32 bit arrays."""
    f = axis % x.ndim
    unit, rows = int(np.prod(x.shape[1:f])), int(np.prod(x.shape[:f]))
    cols, G, mx = int(np.prod(x.shape[f:])), len(sizes), mode == "mxfp8"

    def quant(v, row, col):
        if mx:
            return quantize_mxfp8(v, out_dtype=fp8, rowwise=row, colwise=col, flatten_axis=f)
        return quantize_fp8_block(v, out_dtype=fp8, tile_2d=tile_2d, pow2_scales=pow2, rowwise=row, colwise=col,
                                  flatten_axis=f)

    sdt = np.uint8 if mx else np.uint32
    if mx:
        r_scale, c_scale = None, (_round4(_cdiv(rows, 32)) + 4 * G, _cdiv(cols, 128) * 128)
    elif tile_2d:
        r_scale = (_cdiv(rows, 128) + G, _round4(_cdiv(cols, 128)))
        c_scale = (_cdiv(cols, 128), _round4(_cdiv(rows, 128)) + 4 * G)
    else:
        r_scale, c_scale = None, (_cdiv(rows, 128) + G, _round4(cols))
    out = [None] * 4
    if rowwise and not tile_2d:
        whole = quant(x, True, False)
        out[0], out[1] = _u8(whole.rowwise).reshape(rows, cols), _u8(whole.rowwise_scale)
    elif rowwise:
        out[0], out[1] = np.zeros((rows, cols), np.uint8), np.zeros(r_scale, sdt)
    if colwise:
        out[2], out[3] = np.zeros((rows, cols) if mx else (cols, rows), np.uint8), np.zeros(c_scale, sdt)
    start = s_off = t_off = u_off = 0
    for size in sizes:
        n = min(max(int(size), 0) * unit, rows - start)
        if n > 0:
            part = x[start // unit:(start + n) // unit]  # x's first dim counts entries of `unit` rows
            q = quant(part, tile_2d and rowwise, colwise)
            if tile_2d and rowwise:
                out[0][start:start + n] = _u8(q.rowwise).reshape(n, cols)
                out[1][t_off:t_off + _cdiv(n, 128)] = _u8(q.rowwise_scale)
            if colwise and mx:
                out[2][start:start + n] = _u8(q.colwise).reshape(n, cols)
                out[3][s_off:s_off + _round4(_cdiv(n, 32))] = _u8(q.colwise_scale)
            elif colwise:
                out[2][:, start:start + n] = _u8(q.colwise).reshape(cols, n)
                if tile_2d:
                    out[3][:, u_off:u_off + _round4(_cdiv(n, 128))] = _u8(q.colwise_scale)
                else:
                    out[3][t_off:t_off + _cdiv(n, 128)] = _u8(q.colwise_scale)
        start, s_off = start + n, s_off + _round4(_cdiv(n, 32))
        t_off, u_off = t_off + _cdiv(n, 128), u_off + _round4(_cdiv(n, 128))
    return out


def block_input(rng, shape, dtype, scale=30.0):
    """Random values with specials, plus an all-zero column and row (all-zero blocks both
    ways), near-max values down a column and NaN / inf planted in the first rows."""
    x = random_with_specials(rng, shape, dtype, scale=scale).reshape(shape[0], -1)
    x[:, 1] = 0
    x[min(2, x.shape[0] - 1)] = 0
    x[::3, min(6, x.shape[1] - 1)] = dtype(float(ml_dtypes.finfo(dtype).max) * 0.99)
    if x.shape[0] > 8 and x.shape[1] > 5:
        x[5, 3], x[7, 4], x[8, 5] = dtype(np.nan), dtype(np.inf), dtype(-np.inf)
    return x.reshape(shape)


def assert_block_equal(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, i
            continue
        g = _u8(g).reshape(w.shape) if i % 2 == 0 else _u8(g)
        assert g.shape == w.shape, (i, g.shape, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=f"output {i}")


def _grouped_block(x, g, mode, tile_2d, fp8=jnp.float8_e4m3fn, axis=-1, **kw):
    return quantize_grouped_block(x, g, scaling_mode=mode, tile_2d=tile_2d, out_dtype=fp8, flatten_axis=axis, **kw)


# (x shape, flatten_axis, sizes): odd sizes, empty groups, groups ending mid-block, a tail,
# one group of all rows, all groups empty, rank 3 with several rows per entry.
BLOCK_CASES = [
    ((300, 72), -1, [5, 0, 130, 33, 1, 100]),
    ((64, 160), -1, [64]),
    ((40, 33), -1, [0, 0, 0]),
    ((9, 3, 40), 2, [2, 0, 4, 1]),
]


@pytest.mark.parametrize("mode", ["mxfp8", "fp8_block"])
def test_block_formats_rowwise_are_the_ordinary_quantizer(mode, rng):
    x = random_with_specials(rng, (96, 256), ml_dtypes.bfloat16)
    out = quantize_grouped_block(x, np.int32([30, 0, 50]), scaling_mode=mode)
    ref = (quantize_mxfp8 if mode == "mxfp8" else quantize_fp8_block)(x)
    np.testing.assert_array_equal(np.asarray(out.rowwise).view(np.uint8), np.asarray(ref.rowwise).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(out.rowwise_scale).view(np.uint8),
                                  np.asarray(ref.rowwise_scale).view(np.uint8))
    assert out.colwise is None


@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=kind_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_block_colwise_matches_reference(kind, dtype, rng):
    mode, tile_2d = kind
    fp8 = jnp.float8_e5m2 if dtype == np.float16 else jnp.float8_e4m3fn
    for shape, axis, sizes in BLOCK_CASES[:1] if dtype != ml_dtypes.bfloat16 else BLOCK_CASES:
        x = block_input(rng, shape, dtype)
        out = _grouped_block(x, np.int32(sizes), mode, tile_2d, fp8, axis, colwise=True)
        assert_block_equal(out, grouped_block_ref(x, sizes, mode, tile_2d, fp8, axis))


@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=kind_ids)
@pytest.mark.parametrize("layout", ["colwise", "both"])
def test_block_one_copy_and_group_slice(kind, layout, rng):
    """Colwise alone, and grouped_block_slice: each group equals the ungrouped op of its rows."""
    mode, tile_2d = kind
    x = block_input(rng, (200, 136), ml_dtypes.bfloat16)
    sizes = np.int32([0, 129, 3, 40])  # a 28-row tail
    out = _grouped_block(x, sizes, mode, tile_2d, rowwise=layout == "both", colwise=True)
    want = grouped_block_ref(x, sizes, mode, tile_2d, jnp.float8_e4m3fn, rowwise=layout == "both")
    assert_block_equal(out, want)
    start = 0
    for g, n in enumerate(sizes):
        part = grouped_block_slice(out, sizes, g, shape=x.shape, scaling_mode=mode, tile_2d=tile_2d)
        quant = quantize_mxfp8 if mode == "mxfp8" else lambda v, **kw: quantize_fp8_block(v, tile_2d=tile_2d, **kw)
        ref = quant(x[start:start + n], rowwise=layout == "both", colwise=True)
        for a, b in zip(part, ref):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, _u8(b).view(a.dtype) if a.dtype == np.uint8 else np.asarray(b))
        start += n


def test_block_pow2_scales(rng):
    x = block_input(rng, (150, 130), np.float32, scale=5.0)
    sizes = [17, 0, 128]
    for tile_2d in (False, True):
        out = _grouped_block(x, np.int32(sizes), "fp8_block", tile_2d, pow2_scales=True, colwise=True)
        assert_block_equal(out, grouped_block_ref(x, sizes, "fp8_block", tile_2d, jnp.float8_e4m3fn, pow2=True))


def test_block_jit_sizes_change_without_recompiling_and_clip(rng):
    """Traced sizes: one compile; negative and oversized sizes clip as quantize_grouped_fp8's."""
    x = block_input(rng, (96, 64), ml_dtypes.bfloat16)
    traces = []

    @jax.jit
    def f(v, gs):
        traces.append(1)
        return quantize_grouped_block(v, gs, scaling_mode="fp8_block", colwise=True)

    for sizes, clipped in (([96, 0], [96, 0]), ([1, 63], [1, 63]), ([-3, 40], [0, 40]), ([50, 100], [50, 46])):
        assert_block_equal(f(x, np.int32(sizes)), grouped_block_ref(x, clipped, "fp8_block", False, jnp.float8_e4m3fn))
    assert len(traces) == 1


def test_block_vmap(rng):
    x = block_input(rng, (2, 70, 40), np.float32)
    sizes = np.int32([[33, 37], [0, 50]])
    out = jax.jit(jax.vmap(lambda v, g: quantize_grouped_block(v, g, colwise=True)))(x, sizes)
    for b in range(2):
        got = jax.tree.map(lambda a: np.asarray(a)[b], out)
        assert_block_equal(got, grouped_block_ref(x[b], sizes[b], "mxfp8", False, jnp.float8_e4m3fn))


def test_block_empty_x():
    for mode, tile_2d in BLOCK_KINDS:
        out = _grouped_block(jnp.zeros((0, 16), jnp.bfloat16), np.int32([0, 0]), mode, tile_2d, colwise=True)
        assert out.colwise.size == 0 and not _u8(out.colwise_scale).any()


def test_block_bad_inputs():
    x = jnp.ones((8, 16), jnp.bfloat16)
    op = "lowbit.ops.quantize_grouped_block"
    with pytest.raises(ValueError, match=f"{op}: group_sizes: expected int32"):
        quantize_grouped_block(x, np.int64([4, 4]), colwise=True)
    with pytest.raises(ValueError, match=f"{op}: group_sizes: expected int32"):
        quantize_grouped_block(x, np.float32([4, 4]))
    with pytest.raises(ValueError, match=f"{op}: group_sizes: expected non-negative sizes summing to at most"):
        quantize_grouped_block(x, np.int32([4, 5]), colwise=True)
    with pytest.raises(ValueError, match=f"{op}: group_sizes: expected non-negative"):
        quantize_grouped_block(x, np.int32([-1, 5]), scaling_mode="fp8_block", colwise=True)
    with pytest.raises(ValueError, match=f"{op}: group_sizes"):
        quantize_grouped_block(x, np.ones((1025,), np.int32) * 0, colwise=True)
    with pytest.raises(ValueError, match=f"{op}: scaling_mode"):
        quantize_grouped_block(x, np.int32([4]), scaling_mode="nvfp4")
    with pytest.raises(ValueError, match=f"{op}: tile_2d, pow2_scales"):
        quantize_grouped_block(x, np.int32([4]), scaling_mode="mxfp8", tile_2d=True)
    with pytest.raises(ValueError, match=f"{op}: x, flatten_axis"):
        quantize_grouped_block(x, np.int32([4]), colwise=True, flatten_axis=0)
    with pytest.raises(ValueError, match=f"{op}: rowwise, colwise"):
        quantize_grouped_block(x, np.int32([4]), rowwise=False, colwise=False)
    with pytest.raises(TypeError, match=f"{op}: x: expected float32, float16 or bfloat16"):
        quantize_grouped_block(jnp.ones((8, 16), jnp.int32), np.int32([4]), colwise=True)


@pytest.mark.cpu_reference  # the CPU handler's results (the CUDA one takes a workspace too: test_quantize_workspace.py)
def test_block_handler_validation():
    lowbit._ffi.load()
    x, u8, f32, sd = jnp.ones((40, 8), jnp.bfloat16), jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
    e8 = jnp.float8_e8m0fnu
    good = [sd((0,), u8), sd((0,), e8), sd((40, 8), u8), sd((4 + 8, 128), e8)]

    def call(results, kind=0, fa=1, sizes=jnp.int32([30, 10])):
        return jax.ffi.ffi_call("lowbit_quantize_grouped_block", results)(
            x, sizes, flatten_axis=np.int32(fa), kind=np.int32(kind), pow2_scales=np.bool_(False))

    jax.block_until_ready(call(good))  # sanity: the well-formed call runs
    op = "lowbit_quantize_grouped_block"
    cases = [
        ((good, 3), rf"{op}: kind: expected 0"),
        ((good, 0, 0), rf"{op}: flatten_axis: expected >= 1"),
        ((good, 0, 1, jnp.float32([30, 10])), rf"{op}: group_sizes: expected s32"),
        ((good[:3] + [sd((4, 128), e8)],), rf"{op}: colwise_scale: expected f8e8m0fnu of shape \(12, 128\)"),
        ((good[:3] + [sd((12, 128), f32)],), rf"{op}: colwise_scale: expected f8e8m0fnu"),
        ((good, 1), rf"{op}: colwise: expected f8e4m3fn or f8e5m2 of shape \(8, 40\)"),
        (([sd((0,), u8), sd((3,), e8)] + good[2:],), rf"{op}: rowwise_scale: expected an empty result"),
    ]
    for args, msg in cases:
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(call(*args))


def test_block_cuda_lowering(monkeypatch):
    import importlib
    monkeypatch.setattr(importlib.import_module("lowbit._ffi"), "require_platform", lambda op, platform: None)
    x, g = jnp.ones((12, 3, 40), jnp.bfloat16), jnp.int32([2, 0, 2])
    f = lambda v, gs: quantize_grouped_block(v, gs, scaling_mode="fp8_block", tile_2d=True, colwise=True,  # noqa: E731
                                             flatten_axis=2)
    text = jax.jit(f).trace(x, g).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @lowbit_quantize_grouped_block" in ln]
    assert len(calls) == 1, text
    assert "kind = 2" in calls[0] and "flatten_axis = 2" in calls[0]
    assert "tensor<12x3x40xf8E4M3FN>" in calls[0] and "tensor<40x12x3xf8E4M3FN>" in calls[0]


# ---------------------------------------------------------------- grouped block: CUDA == CPU

def _block_both(cpu, gpu, x, sizes, mode, tile_2d, fp8, axis, **kw):
    f = lambda v, g: tuple(_grouped_block(v, g, mode, tile_2d, fp8, axis, **kw))  # noqa: E731
    return run_on(gpu, f, x, np.int32(sizes)), run_on(cpu, f, x, np.int32(sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=dtype_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=kind_ids)
def test_block_cuda_equals_cpu(kind, dtype, fp8, rng, cpu, gpu):
    mode, tile_2d = kind
    for shape, axis, sizes in cuda_cases(rng):
        x = block_input(rng, shape, dtype, scale=50.0)
        a, b = _block_both(cpu, gpu, x, sizes, mode, tile_2d, fp8, axis, colwise=True)
        _assert_same(a, b)
    # One case against the per-group reference too (the CPU handler is that reference).
    assert_block_equal(b, grouped_block_ref(x, sizes, mode, tile_2d, fp8, axis))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=kind_ids)
@pytest.mark.parametrize("layout", ["rowwise", "colwise"])
def test_block_cuda_one_copy_and_pow2_equal_cpu(kind, layout, rng, cpu, gpu):
    mode, tile_2d = kind
    x = block_input(rng, (777, 200), ml_dtypes.bfloat16)
    kw = {"pow2_scales": True} if mode == "fp8_block" else {}
    a, b = _block_both(cpu, gpu, x, [100, 1, 0, 600], mode, tile_2d, jnp.float8_e4m3fn, -1,
                       rowwise=layout == "rowwise", colwise=layout == "colwise", **kw)
    _assert_same(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=kind_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_block_cuda_misaligned_and_empty(kind, dtype, rng, cpu, gpu):
    mode, tile_2d = kind
    x = block_input(rng, (131, 67), dtype)
    g = np.int32([60, 0, 3, 40])

    def f(v, gs):  # a slice starting one element in, odd cols: the unvectorized paths
        w = v.reshape(-1)[1:1 + 127 * 67].reshape(127, 67)
        return tuple(_grouped_block(w, gs, mode, tile_2d, colwise=True))

    _assert_same(run_on(gpu, f, x, g), run_on(cpu, f, x, g))
    e = lambda v, gs: tuple(_grouped_block(v[:0], gs, mode, tile_2d, colwise=True))  # noqa: E731
    _assert_same(run_on(gpu, e, x, g), run_on(cpu, e, x, g))


@pytest.mark.gpu
def test_block_cuda_vmap_equals_cpu(rng, cpu, gpu):
    x = block_input(rng, (2, 300, 136), ml_dtypes.bfloat16)
    sizes = np.int32([[100, 200], [0, 299]])
    for mode, tile_2d in BLOCK_KINDS:
        one = lambda a, b, m=mode, t=tile_2d: _grouped_block(a, b, m, t, colwise=True)  # noqa: E731
        f = lambda v, g, q=one: tuple(jax.vmap(q)(v, g))  # noqa: E731
        _assert_same(run_on(gpu, f, x, sizes), run_on(cpu, f, x, sizes))
