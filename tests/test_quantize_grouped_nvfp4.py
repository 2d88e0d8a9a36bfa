"""lowbit.ops.quantize_grouped_nvfp4 (NVFP4 per group of rows, every copy group-bound): bit for
bit against a reference that runs the ungrouped quantize_nvfp4 (and its jnp twin) on each
group's rows alone and places its outputs at the packed layout's offsets, zeros elsewhere (odd
and empty groups, sizes not multiples of 16, a tail, odd cols, rank 3; f32 / bf16 / f16; 16x16
tiles, stochastic rounding, RHT; one copy alone); special values and an all-zero group;
grouped_nvfp4_slice; the layout's size bounds; jit with changing and clipped sizes, vmap,
empty x, bad input, the handler's checks, the CUDA lowering; and the CUDA kernels against the
CPU handler (bit for bit, marked `gpu`)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on
from nvfp4_bits import NAMES, assert_same as _assert_same, bits as _bits
from quantize_grouped_common import cuda_cases

import lowbit
from lowbit.ops import grouped_nvfp4_offsets, grouped_nvfp4_slice, quantize_grouped_nvfp4, quantize_nvfp4
from lowbit.ops.quantize_grouped_nvfp4 import grouped_nvfp4_shapes
from lowbit.ops.quantize_nvfp4 import rht_sign_bits, sr_random_bits

F32 = np.float32
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
VARIANTS = {  # name -> (tile_2d, sr, rht)
    "rne": (False, False, False), "2d": (True, False, False), "sr": (False, True, False),
    "rht": (False, False, True), "sr-rht": (False, True, True), "2d-sr-rht": (True, True, True),
}


def _data(rng, shape, dtype=np.float32, subnormals=True):
    """Normal values over 12 binades with zeros, near-max values, inf, NaN and (optionally) fp32
    subnormals planted; an all-zero 16-value block at the start."""
    n = int(np.prod(shape))
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-6, 6, n))).astype(F32)
    if n >= 32:
        x[:16] = 0
    planted = [(0.0, 4), (447.0, 2), (-447.0, 1), (np.inf, 1), (-np.inf, 1), (np.nan, 1), (-np.nan, 1)]
    if subnormals:
        planted.append((3e-39, 2))
    for value, count in planted:
        x[rng.integers(0, n, count)] = F32(value)
    return x.reshape(shape).astype(dtype)


def grouped_ref(x, sizes, *, random=None, bits=None, tile_2d=False, rowwise=True, colwise=True, axis=-1,
                use_jnp=False):
    """The packed layout built from quantize_nvfp4 (or its jnp twin) of each group's rows alone:
    zeros everywhere, each group's arrays at its offsets (uint8 / f32 numpy arrays)."""
    f = axis % x.ndim
    rows, cols = int(np.prod(x.shape[:f])), int(np.prod(x.shape[f:]))
    G = len(sizes)
    shapes = grouped_nvfp4_shapes(rows, cols, G)
    o = grouped_nvfp4_offsets(sizes, x.shape, f)
    unit = o["unit"]
    out = [np.zeros(shapes[0], np.uint8), np.zeros(shapes[1], np.uint8), np.ones(G, F32),
           np.zeros(shapes[2], np.uint8), np.zeros(shapes[3], np.uint8), np.ones(G, F32)]
    for g in range(G):
        s, n = int(o["start"][g]), int(o["n"][g])
        if n == 0:
            continue
        part = x[s // unit:(s + n) // unit]
        rnd = None if random is None else np.asarray(random)[s // unit:(s + n) // unit]
        q = [_bits(a) if a is not None else None
             for a in quantize_nvfp4(part, random=rnd, rht_sign_bits=bits, tile_2d=tile_2d, rowwise=True,
                                     colwise=True, flatten_axis=f, use_jnp=use_jnp)]
        P, B, Q = int(o["P"][g]), int(o["B"][g]), int(o["Q"][g])
        out[0][s:s + n] = q[0]
        out[1][P:P + q[1].shape[0]] = q[1]
        out[2][g] = q[2].view(F32)[0]
        out[3][cols * B:cols * B + q[3].size] = q[3].reshape(-1)
        c128 = q[4].shape[0]
        out[4][c128 * Q:c128 * Q + q[4].size] = q[4].reshape(-1)
        out[5][g] = q[5].view(F32)[0]
    if not rowwise:
        out[:3] = [None] * 3
    if not colwise:
        out[3:] = [None] * 3
    return out


def _options(variant, key, shape):
    tile_2d, sr, rht = VARIANTS[variant]
    random = sr_random_bits(key, shape) if sr else None
    bits = rht_sign_bits(jax.random.fold_in(key, 1)) if rht else None
    return dict(random=random, rht_sign_bits=bits, tile_2d=tile_2d)


def _run(x, sizes, axis=-1, rowwise=True, colwise=True, **opts):
    return quantize_grouped_nvfp4(x, np.int32(sizes), rowwise=rowwise, colwise=colwise, flatten_axis=axis, **opts)


def _ref(x, sizes, axis=-1, rowwise=True, colwise=True, use_jnp=False, **opts):
    return grouped_ref(x, sizes, random=opts.get("random"), bits=opts.get("rht_sign_bits"),
                       tile_2d=opts.get("tile_2d", False), rowwise=rowwise, colwise=colwise, axis=axis,
                       use_jnp=use_jnp)


def _random_sizes(rng, first_dim, groups):
    """Random non-negative sizes summing to at most first_dim (some 0, a tail most times)."""
    cuts = np.sort(rng.integers(0, first_dim + 1, groups))
    sizes = np.diff(np.concatenate([[0], cuts]))
    sizes[rng.random(groups) < 0.2] = 0
    return [int(s) for s in sizes]


# (x shape, flatten_axis, sizes): odd sizes, empty groups, sizes not multiples of 16, groups
# ending mid-tile, a 31-row tail; one group of all rows with odd cols; every group empty;
# rank 3 with 3 rows per entry of the first dim.
CASES = [
    ((300, 72), -1, [5, 0, 130, 33, 1, 100]),
    ((64, 33), -1, [64]),
    ((40, 33), -1, [0, 0, 0]),
    ((9, 3, 40), 2, [2, 0, 4, 1]),
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_ungrouped_per_group(variant, dtype, rng):
    """The whole packed layout (padding included) against quantize_nvfp4 per group."""
    cases = CASES + [((77, 24), -1, _random_sizes(rng, 77, 5))]
    for shape, axis, sizes in cases if dtype == "bf16" else cases[:1] + cases[-1:]:
        x = _data(rng, shape, DTYPES[dtype])
        opts = _options(variant, jax.random.PRNGKey(int(rng.integers(1 << 30))), shape)
        _assert_same(_run(x, sizes, axis, **opts), _ref(x, sizes, axis, **opts), f"{shape} {sizes}")


@pytest.mark.parametrize("variant", ["rne", "2d", "sr-rht", "2d-sr-rht"])
def test_matches_jnp_twin_per_group(variant, rng):
    """The same against the jnp twin (no fp32 subnormals: XLA:CPU flushes them)."""
    for shape, axis, sizes in [CASES[0], CASES[3], ((50, 17), -1, _random_sizes(rng, 50, 4))]:
        x = _data(rng, shape, np.float32, subnormals=False)
        opts = _options(variant, jax.random.PRNGKey(int(rng.integers(1 << 30))), shape)
        _assert_same(_run(x, sizes, axis, **opts), _ref(x, sizes, axis, use_jnp=True, **opts), f"{shape} {sizes}")


@pytest.mark.parametrize("copies", ["rowwise", "colwise"])
@pytest.mark.parametrize("variant", ["rne", "sr-rht", "2d-sr-rht"])
def test_one_copy_and_slice(copies, variant, rng):
    """One copy alone; grouped_nvfp4_slice gives each group as quantize_nvfp4 returns it."""
    x = _data(rng, (200, 136), ml_dtypes.bfloat16)
    sizes = [0, 129, 3, 40]  # a 28-row tail
    opts = _options(variant, jax.random.PRNGKey(int(rng.integers(1 << 30))), x.shape)
    row, col = copies == "rowwise", copies == "colwise"
    out = _run(x, sizes, rowwise=row, colwise=col, **opts)
    _assert_same(out, _ref(x, sizes, rowwise=row, colwise=col, **opts))
    start = 0
    for g, n in enumerate(sizes):
        part = grouped_nvfp4_slice(out, sizes, g, shape=x.shape)
        rnd = None if opts["random"] is None else opts["random"][start:start + n]
        want = quantize_nvfp4(x[start:start + n], random=rnd, rht_sign_bits=opts["rht_sign_bits"],
                              tile_2d=opts["tile_2d"], rowwise=row, colwise=col)
        for name, a, b in zip(NAMES, part, want):
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == np.asarray(b).dtype and a.shape == b.shape, (name, a.shape, b.shape)
                np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"group {g} {name}")
        start += n


@pytest.mark.parametrize("variant", ["rne", "2d-sr-rht"])
def test_special_values_and_an_all_zero_group(variant, rng):
    """inf / NaN / near-max groups (S = 1, saturated or NaN blocks), an all-zero group (global
    scale 1, zero codes and scales), a group of one row."""
    x = _data(rng, (120, 48), np.float32)
    sizes = [20, 30, 1, 40, 17]
    x[20:50] = 0                                   # group 1: all zeros
    x[50] = np.inf                                 # group 2: one row of inf
    x[51:91:3] = F32(448.0 * 6 * 0.999)            # group 3: near 2688
    x[60, 5], x[70, 7] = np.nan, -np.inf
    x[91:108] = rng.choice(np.array([6.0, -6.0, 5.99, 2688.0, -2687.9, 448.0, 0.0], F32), (17, 48))
    opts = _options(variant, jax.random.PRNGKey(3), x.shape)
    out = _run(x, sizes, **opts)
    _assert_same(out, _ref(x, sizes, **opts))
    zero = grouped_nvfp4_slice(out, sizes, 1, shape=x.shape)
    assert not _bits(zero.rowwise).any() and not _bits(zero.rowwise_scale).any()
    assert not (_bits(zero.colwise) & 0x77).any()  # +-0 codes (the RHT's sign flips make some -0)
    assert not _bits(zero.colwise_scale).any()
    np.testing.assert_array_equal(zero.rowwise_global_scale_inv, np.ones(1, F32))
    np.testing.assert_array_equal(zero.colwise_global_scale_inv, np.ones(1, F32))
    inf = grouped_nvfp4_slice(out, sizes, 2, shape=x.shape)
    np.testing.assert_array_equal(inf.rowwise_global_scale_inv, np.ones(1, F32))  # A = inf -> S = 1


def test_padding_is_zero_and_groups_are_written(rng):
    """Bytes outside every group's slots are 0 (tail rows, per-group scale padding, unused ends);
    every group's data holds non-zero codes (x has no zeros here)."""
    x = (rng.uniform(0.5, 2.0, (150, 40)) * rng.choice([-1, 1], (150, 40))).astype(F32)
    sizes = [7, 0, 64, 50]  # 29-row tail
    out = _run(x, sizes)
    o = grouped_nvfp4_offsets(sizes, x.shape)
    cols, blocks = 40, 3  # ceil(40 / 16) scale columns per rowwise row
    used = [np.zeros(np.shape(a), bool) for a in out]
    for g in range(len(sizes)):
        s, n, P, B, Q = (int(o[k][g]) for k in ("start", "n", "P", "B", "Q"))
        packed, col_blocks = -(-n // 2), -(-n // 16)
        pitch = -(-col_blocks // 4) * 4
        used[0][s:s + n] = True
        used[1][P:P + n, :blocks] = True
        for c in range(cols):  # row c of the group's (cols, packed) data and (128, pitch) scales
            used[3][cols * B + c * packed:cols * B + (c + 1) * packed] = True
            used[4][128 * Q + c * pitch:128 * Q + c * pitch + col_blocks] = True
    for i in (0, 1, 3, 4):
        b = _bits(out[i])
        assert not b[~used[i]].any(), NAMES[i]
        assert b[used[i]].all(), NAMES[i]  # values in [0.5, 2): no zero code or scale in a group


def test_size_bounds_hold_for_every_split():
    """The packed shapes hold every split of the rows (the header's bound proof, by brute force
    over small cases), and equal the ungrouped shapes for G = 1."""
    from lowbit.ops.quantize_nvfp4 import scale_shape
    for rows, G in itertools.product(range(0, 140, 3), (1, 2, 3)):
        shapes = grouped_nvfp4_shapes(rows, 40, G)
        if G == 1:
            assert shapes[1] == scale_shape(rows, 40)
            assert shapes[2][0] == 40 * -(-rows // 2) and shapes[3][0] == int(np.prod(scale_shape(40, rows)))
        for sizes in itertools.product(range(0, rows + 1, max(1, rows // 9)), repeat=G):
            o = grouped_nvfp4_offsets(sizes, (rows, 40))
            n, last = o["n"], G - 1
            assert o["P"][last] + -(-n[last] // 128) * 128 <= shapes[1][0]
            assert 40 * (o["B"][last] + -(-n[last] // 2)) <= shapes[2][0]
            assert 128 * 4 * (o["Q"][last] // 4 + -(-n[last] // 64)) <= shapes[3][0]


def test_slot_alignment(rng):
    """Every scale slot starts at a 16-byte multiple; data slots do for sizes that are multiples
    of 32 rows (the module doc's rule for reading a group in place)."""
    for cols in (40, 33, 256):
        pitch, c128 = -(-(-(-cols // 16)) // 4) * 4, -(-cols // 128) * 128
        sizes = _random_sizes(rng, 1000, 12)
        o = grouped_nvfp4_offsets(sizes, (1000, cols))
        assert (o["P"] * pitch % 16 == 0).all() and (c128 * o["Q"] % 16 == 0).all()
        o = grouped_nvfp4_offsets([32 * (s // 32) for s in sizes], (1000, cols))
        assert (o["start"] * -(-cols // 2) % 16 == 0).all() and (cols * o["B"] % 16 == 0).all()


def test_jit_sizes_change_without_recompiling_and_clip(rng):
    """Traced sizes: one compile; negative and oversized sizes clip as quantize_grouped_fp8's."""
    x = _data(rng, (96, 48), ml_dtypes.bfloat16)
    key = jax.random.PRNGKey(5)
    rnd, bits = sr_random_bits(key, x.shape), rht_sign_bits(key)
    traces = []

    @jax.jit
    def f(v, gs, r):
        traces.append(1)
        return quantize_grouped_nvfp4(v, gs, random=r, rht_sign_bits=bits, colwise=True)

    for sizes, clipped in (([96, 0], [96, 0]), ([1, 63], [1, 63]), ([-3, 40], [0, 40]), ([50, 100], [50, 46]),
                           ([17, 5], [17, 5])):
        _assert_same(f(x, np.int32(sizes), rnd), _ref(x, clipped, random=rnd, rht_sign_bits=bits), f"{sizes}")
    assert len(traces) == 1


def test_vmap(rng):
    x = _data(rng, (2, 70, 40), np.float32)
    sizes = np.int32([[33, 37], [0, 50]])
    out = jax.jit(jax.vmap(lambda v, g: quantize_grouped_nvfp4(v, g, colwise=True, tile_2d=True)))(x, sizes)
    for b in range(2):
        got = [np.asarray(a)[b] for a in out]
        _assert_same(got, _ref(x[b], list(sizes[b]), tile_2d=True), f"batch {b}")
    # Batched random words with shared sign bits and sizes.
    rnd = sr_random_bits(jax.random.PRNGKey(9), x.shape)
    bits = rht_sign_bits(jax.random.PRNGKey(10))
    f = jax.vmap(lambda v, r: quantize_grouped_nvfp4(v, sizes[0], random=r, rht_sign_bits=bits, colwise=True))
    out = f(x, rnd)
    for b in range(2):
        got = [np.asarray(a)[b] for a in out]
        _assert_same(got, _ref(x[b], list(sizes[0]), random=rnd[b], rht_sign_bits=bits), f"sr-rht batch {b}")


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_empty_x(shape):
    """Empty data and scales; every global_scale_inv 1 (A = 0 gives S = 1, as quantize_nvfp4)."""
    x = jnp.zeros(shape, jnp.bfloat16)
    out = quantize_grouped_nvfp4(x, np.int32([0, 0, 0]), colwise=True, rht_sign_bits=jnp.ones((1,), jnp.uint32))
    for name, a in zip(NAMES, out):
        if "global" in name:
            np.testing.assert_array_equal(np.asarray(a), np.ones(3, F32))
        else:
            assert a.size == 0, name
    ungrouped = quantize_nvfp4(x, colwise=True)
    np.testing.assert_array_equal(np.asarray(ungrouped.rowwise_global_scale_inv), np.ones(1, F32))


def test_bad_inputs():
    x = jnp.ones((8, 16), jnp.bfloat16)
    op = "lowbit.ops.quantize_grouped_nvfp4"
    g = np.int32([4, 4])
    cases = [
        (TypeError, f"{op}: x: expected float32, float16 or bfloat16", (x.astype(jnp.int32), g), {}),
        (ValueError, f"{op}: group_sizes: expected int32", (x, np.int64([4, 4])), {}),
        (ValueError, f"{op}: group_sizes: expected int32", (x, np.zeros((1025,), np.int32)), {}),
        (ValueError, f"{op}: group_sizes: expected int32", (x, np.zeros((0,), np.int32)), {}),
        (ValueError, f"{op}: group_sizes: expected non-negative sizes summing to at most", (x, np.int32([4, 5])), {}),
        (ValueError, f"{op}: group_sizes: expected non-negative", (x, np.int32([-1, 5])), {}),
        (ValueError, f"{op}: x, flatten_axis", (x, g), dict(flatten_axis=0)),
        (ValueError, f"{op}: x, flatten_axis", (x[0], g), {}),
        (ValueError, f"{op}: flatten_axis", (x, g), dict(flatten_axis=2)),
        (ValueError, f"{op}: rowwise, colwise", (x, g), dict(rowwise=False)),
        (ValueError, f"{op}: random: expected uint32 of shape", (x, g), dict(random=jnp.zeros((8, 15), jnp.uint32))),
        (ValueError, f"{op}: random: expected uint32 of shape", (x, g), dict(random=jnp.zeros((8, 16), jnp.int32))),
        (ValueError, f"{op}: rht_sign_bits: expected uint32 of shape", (x, g),
         dict(rht_sign_bits=jnp.zeros((2,), jnp.uint32))),
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=msg):
            quantize_grouped_nvfp4(*args, **kw)


@pytest.mark.cpu_reference  # the CPU handler's results (the CUDA one takes a workspace too: test_quantize_workspace.py)
def test_handler_validation():
    """The CPU FFI handler rejects malformed calls with the op and argument named (the CUDA one
    runs the same checks, ParseArgs)."""
    lowbit._ffi.load()
    x = jnp.ones((40, 8), jnp.bfloat16)
    sd, u8, e4, f32, u32 = jax.ShapeDtypeStruct, jnp.uint8, jnp.float8_e4m3fn, jnp.float32, jnp.uint32
    shapes = grouped_nvfp4_shapes(40, 8, 2)
    good = [sd(shapes[0], u8), sd(shapes[1], e4), sd((2,), f32), sd(shapes[2], u8), sd(shapes[3], e4), sd((2,), f32)]
    empty = [sd((0,), u8), sd((0,), e4), sd((0,), f32)]

    def call(results=good, x=x, sizes=jnp.int32([30, 10]), rnd=jnp.zeros((0,), u32), bits=jnp.ones((1,), u32), fa=1):
        return jax.block_until_ready(jax.ffi.ffi_call("lowbit_quantize_grouped_nvfp4", results)(
            x, sizes, rnd, bits, flatten_axis=np.int32(fa), tile_2d=np.bool_(False), rht=np.bool_(True)))

    call()  # sanity: the well-formed call runs
    call(good[:3] + empty)  # rowwise only
    op = "lowbit_quantize_grouped_nvfp4"
    cases = [
        (dict(x=x.astype(jnp.int32)), rf"{op}: x: expected f32, f16 or bf16"),
        (dict(fa=0), rf"{op}: flatten_axis: expected >= 1"),
        (dict(fa=2), rf"{op}: flatten_axis: expected a value in \[0, 1\]"),
        (dict(sizes=jnp.float32([30, 10])), rf"{op}: group_sizes: expected s32"),
        (dict(sizes=jnp.zeros((1025,), jnp.int32)), rf"{op}: group_sizes: expected s32 of shape \(G,\)"),
        (dict(rnd=jnp.zeros((40, 7), u32)), rf"{op}: random: expected u32 of shape \(40, 8\)"),
        (dict(bits=jnp.ones((2,), u32)), rf"{op}: rht_sign_bits: expected u32 of shape \(1,\)"),
        (dict(results=[sd((40, 5), u8)] + good[1:]), rf"{op}: rowwise: expected u8 of shape \(40, 4\)"),
        (dict(results=good[:1] + [sd(shapes[1], u8)] + good[2:]), rf"{op}: rowwise_scale: expected f8e4m3fn"),
        (dict(results=good[:2] + [sd((1,), f32)] + good[3:]), rf"{op}: rowwise_global_scale_inv: expected f32 of shape \(2,\)"),
        (dict(results=good[:3] + [sd((8, 21), u8)] + good[4:]), rf"{op}: colwise: expected u8 of shape \({shapes[2][0]},\)"),
        (dict(results=good[:4] + [sd((10,), e4)] + good[5:]), rf"{op}: colwise_scale: expected f8e4m3fn"),
        (dict(results=[sd((40, 4), u8), sd((0,), e4), sd((0,), f32)] + good[3:]), rf"{op}: rowwise_global_scale_inv"),
    ]
    for kw, msg in cases:
        with pytest.raises(Exception, match=msg):
            call(**kw)


def test_cuda_lowering(monkeypatch):
    """On a GPU the op lowers to the lowbit_quantize_grouped_nvfp4 custom call (checked without a
    GPU: lowering needs no device)."""
    import importlib
    monkeypatch.setattr(importlib.import_module("lowbit._ffi"), "require_platform", lambda op, platform: None)
    x, g = jnp.ones((12, 3, 40), jnp.bfloat16), jnp.int32([2, 0, 2])
    f = lambda v, gs, r: quantize_grouped_nvfp4(v, gs, random=r, rht_sign_bits=jnp.ones((1,), jnp.uint32),  # noqa: E731
                                                tile_2d=True, colwise=True, flatten_axis=2)
    text = jax.jit(f).trace(x, g, jnp.zeros(x.shape, jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @lowbit_quantize_grouped_nvfp4" in ln]
    assert len(calls) == 1, text
    assert "flatten_axis = 2" in calls[0] and "tile_2d = true" in calls[0] and "rht = true" in calls[0]
    assert "tensor<3xf32>" in calls[0] and "tensor<36x20xui8>" in calls[0]


# ---------------------------------------------------------------- CUDA == CPU (bit for bit)


def _cuda_cases(rng):
    """The grouped kernels' CUDA cases (quantize_grouped_common.cuda_cases) and random sizes."""
    return cuda_cases(rng) + [((333, 600), -1, _random_sizes(rng, 333, 9))]


def _both(cpu, gpu, x, sizes, axis, variant, key, **kw):
    opts = _options(variant, key, x.shape)
    r, b = opts.pop("random"), opts.pop("rht_sign_bits")
    args = (x, np.int32(sizes)) + ((r,) if r is not None else ()) + ((b,) if b is not None else ())

    def f(v, gs, *extra):
        extra = list(extra)
        rr = extra.pop(0) if r is not None else None
        bb = extra.pop(0) if b is not None else None
        return tuple(quantize_grouped_nvfp4(v, gs, random=rr, rht_sign_bits=bb, flatten_axis=axis, **opts, **kw))

    return run_on(gpu, f, *args), run_on(cpu, f, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_equals_cpu(variant, dtype, rng, cpu, gpu):
    for shape, axis, sizes in _cuda_cases(rng):
        x = _data(rng, shape, DTYPES[dtype])
        key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
        a, b = _both(cpu, gpu, x, sizes, axis, variant, key, rowwise=True, colwise=True)
        _assert_same(a, b, f"cuda vs cpu {shape} {variant} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["rowwise", "colwise"])
@pytest.mark.parametrize("variant", ["rne", "sr-rht", "2d-sr-rht", "rht"])
def test_cuda_one_copy_equals_cpu(copies, variant, rng, cpu, gpu):
    """The amax slots differ per requested copy (and with RHT): each alone."""
    x = _data(rng, (777, 200), ml_dtypes.bfloat16)
    a, b = _both(cpu, gpu, x, [100, 1, 0, 600], -1, variant, jax.random.PRNGKey(int(rng.integers(1 << 30))),
                 rowwise=copies == "rowwise", colwise=copies == "colwise")
    _assert_same(a, b, f"{copies} {variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["rne", "2d-sr-rht", "sr-rht"])
def test_cuda_special_values_equal_cpu(variant, rng, cpu, gpu):
    x = _data(rng, (120, 48), np.float32)
    x[20:50] = 0
    x[50] = np.inf
    x[51:91:3] = F32(448.0 * 6 * 0.999)
    x[60, 5], x[70, 7] = np.nan, -np.inf
    x[91:108] = rng.choice(np.array([6.0, -6.0, 5.99, 2688.0, -2687.9, 448.0, 0.0], F32), (17, 48))
    x[108:] = (rng.integers(-(1 << 22), 1 << 22, (12, 48)).astype(F32) * F32(2.0**-149))  # subnormal group
    a, b = _both(cpu, gpu, x, [20, 30, 1, 40, 17, 12], -1, variant, jax.random.PRNGKey(3), rowwise=True,
                 colwise=True)
    _assert_same(a, b, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_misaligned_and_empty(dtype, rng, cpu, gpu):
    x = _data(rng, (131, 67), DTYPES[dtype])
    g = np.int32([60, 0, 3, 40])

    def f(v, gs):  # a slice starting one element in, odd cols: the unvectorized paths
        w = v.reshape(-1)[1:1 + 127 * 67].reshape(127, 67)
        return tuple(quantize_grouped_nvfp4(w, gs, colwise=True, rht_sign_bits=jnp.ones((1,), jnp.uint32)))

    _assert_same(run_on(gpu, f, x, g), run_on(cpu, f, x, g), "misaligned")
    e = lambda v, gs: tuple(quantize_grouped_nvfp4(v[:0], gs, colwise=True))  # noqa: E731
    _assert_same(run_on(gpu, e, x, g), run_on(cpu, e, x, g), "empty")


@pytest.mark.gpu
def test_cuda_vmap_equals_cpu(rng, cpu, gpu):
    x = _data(rng, (2, 300, 136), ml_dtypes.bfloat16)
    sizes = np.int32([[100, 200], [0, 299]])
    f = lambda v, g: tuple(jax.vmap(lambda a, b: quantize_grouped_nvfp4(a, b, colwise=True, tile_2d=True))(v, g))  # noqa: E731
    _assert_same(run_on(gpu, f, x, sizes), run_on(cpu, f, x, sizes), "vmap")


@pytest.mark.gpu
def test_cuda_jit_new_sizes_and_clipping_equal_cpu(rng, cpu, gpu):
    x = _data(rng, (200, 64), ml_dtypes.bfloat16)
    f = lambda v, g: tuple(quantize_grouped_nvfp4(v, g, colwise=True))  # noqa: E731
    for sizes in ([200, 0], [-3, 40], [50, 300], [13, 17, 19]):
        _assert_same(run_on(gpu, f, x, np.int32(sizes)), run_on(cpu, f, x, np.int32(sizes)), f"{sizes}")
