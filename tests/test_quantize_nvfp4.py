"""lowbit.ops.quantize_nvfp4: a numpy reference first (IEEE fp32, ml_dtypes codecs), then the
CPU handler == reference == the jnp twin bit for bit, SR unbiasedness, the RHT, the
dequantize error bound, jit / vmap, bad input, empty x, and that the CUDA lowering is the
kernel's custom call (tests/test_quantize_nvfp4_cuda.py compares CUDA with CPU on a GPU)."""

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from lowbit.ops.quantize_nvfp4 import (
    dequantize_nvfp4,
    quantize_nvfp4,
    rht16,
    rht_sign_bits,
    scale_shape,
    sr_random_bits,
)

F32 = np.float32


def _e4m3(v):  # RNE, saturating, NaN -> 0x7F
    b = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(v), 0x7F, b).astype(np.uint8)


def _e2m1(y, random=None):  # RNE or SR, saturating at 6, NaN -> sign | 7
    sign = (np.signbit(y) * 8).astype(np.uint8)
    mag = np.abs(y).astype(np.float64)
    if random is None:
        code = np.clip(mag, 0, 6).astype(F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7
    else:
        grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 8])
        lo = np.clip(np.searchsorted(grid, mag, side="right") - 1, 0, 7)
        frac = np.where(lo < 7, (mag - grid[lo]) / (grid[lo + 1] - grid[lo]), 0)
        code = lo + (random < np.floor(frac * 2.0**32))
    return np.where(np.isnan(y), sign | 7, sign | code).astype(np.uint8)


def _rht_np(v, bits):  # v (..., 16) float32, the documented order
    d = np.where((bits >> np.arange(16)) & 1, F32(-1), F32(1))
    v = (v * d).astype(F32)
    for h in (1, 2, 4, 8):
        for i in range(16):
            if not i & h:
                a, b = v[..., i].copy(), v[..., i + h].copy()
                v[..., i], v[..., i + h] = a + b, a - b
    v = (v * (d * F32(0.25))).astype(F32)
    return np.where(np.isnan(v), F32(np.nan), v)  # +NaN


def _copy_np(q, rnd, tile_2d):
    R, C = q.shape
    nb, rp = -(-C // 16), -(-R // 16) * 16 if tile_2d else R
    qp = np.zeros((rp, nb * 16), F32)
    qp[:R, :C] = q
    amax = np.abs(qp).max(initial=0)  # NaN beats everything below
    amax = np.nan if np.isnan(qp).any() else amax
    with np.errstate(all="ignore"):
        S = F32(2688) / F32(amax)
        S = F32(1) if not (0 < amax < np.inf) or np.isinf(S) else S
        blk = np.abs(qp).reshape(rp // 16 if tile_2d else R, 16 if tile_2d else 1, nb, 16)
        blk = np.where(np.isnan(blk).any(axis=(1, 3)), np.nan, np.max(np.nan_to_num(blk, nan=0), axis=(1, 3)))
        blk = np.repeat(blk, 16 if tile_2d else 1, axis=0)[:R]
        sd = _e4m3((blk / F32(6)).astype(F32) * S)
        sdv = sd.view(ml_dtypes.float8_e4m3fn).astype(F32)
        factor = np.where((sd & 0x7F) == 0, F32(0), np.minimum(S / sdv, np.finfo(F32).max)).astype(F32)
        y = (qp[:R] * np.repeat(factor, 16, axis=1)).astype(F32)
        y = np.where(np.isnan(y) & ~np.isnan(qp[:R]), np.abs(y), y)  # MulNanDefined: factor NaN is +
    r = None if rnd is None else np.pad(rnd, ((0, 0), (0, nb * 16 - C)))
    codes = np.pad(_e2m1(y, r)[:, :C], ((0, 0), (0, nb * 16 - C)))
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4))[:, : -(-C // 2)]
    scale = np.zeros(scale_shape(R, C), np.uint8)
    scale[:R, :nb] = sd
    return data, scale, np.array([F32(1) / S], F32)


def reference(x, random=None, bits=None, tile_2d=False):
    x = np.asarray(x, F32).reshape(x.shape[0], -1)
    q = x.T.copy()
    if bits is not None:
        full = q.shape[1] // 16 * 16
        q[:, :full] = _rht_np(q[:, :full].reshape(q.shape[0], -1, 16), int(bits[0])).reshape(q.shape[0], full)
    return (_copy_np(x, random, tile_2d)
            + _copy_np(q, None if random is None else random.reshape(x.shape).T, tile_2d))


def _data(shape, seed, specials=True, subnormals=True):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-6, 6, shape))).astype(F32)
    flat = x.reshape(-1)
    if flat.size >= 32:  # an all-zero block (row 0 starts with 16 zeros); tiny inputs keep theirs
        flat[:16] = 0
    flat[rng.integers(0, flat.size, 5)] = 0
    flat[rng.integers(0, flat.size, 2)] = F32(447.0) * rng.choice([-1, 1])
    if subnormals:
        flat[rng.integers(0, flat.size, 3)] = F32(3e-39)
    if specials:
        flat[rng.integers(0, flat.size)] = np.inf
        flat[rng.integers(0, flat.size)] = -np.nan
    return x


def _bits_of(a):
    return np.asarray(a).view(np.uint8)


def _assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits_of(g), _bits_of(w))


CASES = [dict(), dict(tile_2d=True), dict(sr=True), dict(rht=True), dict(sr=True, rht=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c) or "rne")
@pytest.mark.parametrize("shape", [(37, 50), (16, 32), (5, 3)])
def test_cpu_handler_matches_numpy_reference(case, shape):
    key = jax.random.PRNGKey(shape[0])
    for specials in (True, False):
        x = _data(shape, shape[1] + specials, specials=specials)
        rnd = np.asarray(sr_random_bits(key, shape)) if case.get("sr") else None
        bits = np.asarray(rht_sign_bits(key)) if case.get("rht") else None
        got = quantize_nvfp4(x, random=rnd, rht_sign_bits=bits, tile_2d=case.get("tile_2d", False),
                             rowwise=True, colwise=True)
        _assert_same(got, reference(x, rnd, bits, case.get("tile_2d", False)))


@pytest.mark.parametrize("case,dtype", [(dict(), jnp.float32), (dict(tile_2d=True), jnp.bfloat16),
                                        (dict(sr=True, rht=True), jnp.float32)], ids=["rne", "2d-bf16", "sr-rht"])
def test_jnp_gpu_twin_matches_cpu_handler(case, dtype):
    """The jnp twin (the GPU tests' third reference), bit for bit (inputs without fp32
    subnormals: XLA:CPU flushes them, see the module doc)."""
    shape = (2, 19, 40)
    key = jax.random.PRNGKey(7)
    x = jnp.asarray(_data(shape, 3, subnormals=False)).astype(dtype)
    kw = dict(random=sr_random_bits(key, shape) if case.get("sr") else None,
              rht_sign_bits=rht_sign_bits(key) if case.get("rht") else None,
              tile_2d=case.get("tile_2d", False), rowwise=True, colwise=True, flatten_axis=2)
    _assert_same(jax.jit(lambda v: quantize_nvfp4(v, use_jnp=True, **kw))(x), quantize_nvfp4(x, **kw))


def test_jit_and_vmap_and_flatten_axis():
    x = jnp.asarray(_data((3, 8, 20), 5, specials=False))
    want = [quantize_nvfp4(x[i], colwise=True) for i in range(3)]
    got = jax.vmap(lambda v: quantize_nvfp4(v, colwise=True))(x)
    for i in range(3):
        _assert_same([g[i] for g in got], want[i])
    flat = quantize_nvfp4(x.reshape(24, 20), colwise=True)
    _assert_same(jax.jit(lambda v: quantize_nvfp4(v, colwise=True, flatten_axis=2))(x), flat)


def test_stochastic_rounding_is_unbiased():
    # 4000 rows of the same 16 values: every row gets the same scales, its own random words.
    n = 4000
    base = np.linspace(-5.3, 6.0, 16).astype(F32)
    x = np.tile(base, (n, 1))
    out = quantize_nvfp4(x, random=sr_random_bits(jax.random.PRNGKey(3), x.shape))
    deq = np.asarray(dequantize_nvfp4(out.rowwise, out.rowwise_scale, out.rowwise_global_scale_inv, cols=16))
    step = np.max(np.abs(base)) / 6 * 2 * 1.07  # the widest E2M1 gap (4 -> 6) in units, e4m3-rounded scale
    # Each sample lies within one gap around x: std of the mean <= step / (2 sqrt(n)); 6 sigma.
    assert np.all(np.abs(deq.mean(axis=0) - base) <= 6 * step / (2 * np.sqrt(n)))
    assert len(np.unique(deq[:, 3])) == 2  # really stochastic: both neighbours occur
    rne = quantize_nvfp4(x[:1])
    rne_deq = np.asarray(dequantize_nvfp4(rne.rowwise, rne.rowwise_scale, rne.rowwise_global_scale_inv, cols=16))
    assert np.abs(rne_deq[0] - base).max() > 6 * step / (2 * np.sqrt(n))  # RNE alone is biased here


def test_rht_twice_is_identity_and_dequantize_inverts_it(rng):
    bits = rht_sign_bits(jax.random.PRNGKey(1))
    ints = jnp.asarray(rng.integers(-40, 40, (5, 16)).astype(F32))  # exact arithmetic
    once = rht16(ints, bits)
    assert not np.array_equal(np.asarray(once), np.asarray(ints))
    np.testing.assert_array_equal(np.asarray(rht16(once, bits)), np.asarray(ints))
    v = jnp.asarray(rng.standard_normal((7, 16)).astype(F32))
    np.testing.assert_allclose(np.asarray(rht16(rht16(v, bits), bits)), np.asarray(v), rtol=0, atol=2e-6)
    # Norms are kept (orthogonal), and the colwise copy dequantizes back near x.
    np.testing.assert_allclose(np.linalg.norm(np.asarray(rht16(v, bits)), axis=1),
                               np.linalg.norm(np.asarray(v), axis=1), rtol=1e-5)
    x = _data((48, 24), 2, specials=False, subnormals=False)
    out = quantize_nvfp4(x, rowwise=False, colwise=True, rht_sign_bits=bits)
    back = np.asarray(dequantize_nvfp4(out.colwise, out.colwise_scale, out.colwise_global_scale_inv,
                                       cols=48, rht_sign_bits=bits)).T
    err = np.abs(back - x).max() / np.abs(x).max()
    assert 0 < err < 0.2


@pytest.mark.parametrize("tile_2d", [False, True])
def test_dequantize_error_bound(tile_2d):
    x = _data((33, 45), 9, specials=False, subnormals=False)
    out = quantize_nvfp4(x, tile_2d=tile_2d, colwise=True)
    deq = np.asarray(dequantize_nvfp4(out.rowwise, out.rowwise_scale, out.rowwise_global_scale_inv, cols=45))
    deq_t = np.asarray(dequantize_nvfp4(out.colwise, out.colwise_scale, out.colwise_global_scale_inv, cols=33))
    blocks = np.pad(np.abs(x), ((0, 15), (0, 3)))
    if tile_2d:
        amax = blocks[:48].reshape(3, 16, 3, 16).max(axis=(1, 3)).repeat(16, 0).repeat(16, 1)[:33, :45]
    else:
        amax = blocks[:33].reshape(33, 3, 16).max(axis=2).repeat(16, 1)[:, :45]
    # Half the widest E2M1 gap (1 unit), a unit being amax_blk / 6 within the E4M3 rounding (2^-4).
    assert np.all(np.abs(deq - x) <= amax / 6 * 1.07 + 1e-30)
    if tile_2d:  # 16x16 tiles: the colwise copy is exactly the transpose
        np.testing.assert_array_equal(deq_t.T, deq)


def test_bad_input():
    x = jnp.ones((4, 16), jnp.float32)
    with pytest.raises(TypeError, match="quantize_nvfp4: x"):
        quantize_nvfp4(x.astype(jnp.int32))
    with pytest.raises(ValueError, match="quantize_nvfp4: random"):
        quantize_nvfp4(x, random=jnp.zeros((4, 15), jnp.uint32))
    with pytest.raises(ValueError, match="quantize_nvfp4: flatten_axis"):
        quantize_nvfp4(x, flatten_axis=2)
    with pytest.raises(ValueError, match="quantize_nvfp4: rht_sign_bits"):
        quantize_nvfp4(x, rht_sign_bits=jnp.zeros((2,), jnp.uint32))
    with pytest.raises(ValueError, match="quantize_nvfp4: rowwise, colwise"):
        quantize_nvfp4(x, rowwise=False)
    with pytest.raises(ValueError, match="lowbit.ops.dequantize_nvfp4: scale"):
        dequantize_nvfp4(jnp.zeros((4, 8), jnp.uint8), jnp.zeros((4, 4), jnp.float8_e4m3fn),
                         jnp.ones((1,)), cols=16)
    good = quantize_nvfp4(jnp.ones((4, 16), jnp.float32))
    args = (good.rowwise, good.rowwise_scale, good.rowwise_global_scale_inv)
    with pytest.raises(ValueError, match="dequantize_nvfp4: cols: expected an int >= 0"):
        dequantize_nvfp4(*args, cols=-1)
    with pytest.raises(ValueError, match="dequantize_nvfp4: global_scale_inv: expected one float32"):
        dequantize_nvfp4(*args[:2], jnp.ones((3,)), cols=16)
    with pytest.raises(ValueError, match="dequantize_nvfp4: rht_sign_bits: expected one integer"):
        dequantize_nvfp4(*args, cols=16, rht_sign_bits=jnp.zeros((2,), jnp.uint32))
    with pytest.raises(TypeError, match="dequantize_nvfp4: out_dtype: expected float32, float16 or bfloat16"):
        dequantize_nvfp4(*args, cols=16, out_dtype=jnp.int8)


@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (0, 0)])
def test_empty_x(shape):
    """Empty data and scales of their shapes; global_scale_inv 1 (A = 0 gives S = 1)."""
    x = jnp.zeros(shape, jnp.bfloat16)
    got = quantize_nvfp4(x, rowwise=True, colwise=True, rht_sign_bits=rht_sign_bits(jax.random.PRNGKey(0)))
    want = quantize_nvfp4(x, rowwise=True, colwise=True, use_jnp=True,
                          rht_sign_bits=rht_sign_bits(jax.random.PRNGKey(0)))
    _assert_same(got, want)
    r, c = shape
    assert got.rowwise.shape == (r, -(-c // 2)) and got.colwise.shape == (c, -(-r // 2))
    assert got.rowwise_scale.shape == scale_shape(r, c) and got.colwise_scale.shape == scale_shape(c, r)
    for g in (got.rowwise_global_scale_inv, got.colwise_global_scale_inv):
        np.testing.assert_array_equal(np.asarray(g), np.ones((1,), F32))


def test_cuda_lowering_is_the_kernel(monkeypatch):
    """On a GPU the op lowers to the lowbit_quantize_nvfp4 custom call (the CUDA kernels), not
    to the jnp twin (checked without a GPU: lowering needs no device)."""
    from lowbit import _ffi

    monkeypatch.setattr(_ffi, "require_platform", lambda op, platform: None)
    x = jnp.ones((32, 48), jnp.bfloat16)
    f = jax.jit(lambda v, r: quantize_nvfp4(v, random=r, colwise=True, tile_2d=True,
                                            rht_sign_bits=jnp.ones((1,), jnp.uint32)))
    text = f.trace(x, jnp.zeros(x.shape, jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @lowbit_quantize_nvfp4") == 1
    assert "shift_right_logical" not in text  # the twin's integer division would show here


def test_handler_validation():
    """The FFI handler (the CPU one here, the CUDA one on a GPU backend) rejects malformed
    calls with the op and argument named."""
    from lowbit import _ffi

    _ffi.load()
    x = jnp.ones((20, 40), jnp.bfloat16)
    sd, u8, e4, f32, u32 = jax.ShapeDtypeStruct, jnp.uint8, jnp.float8_e4m3fn, jnp.float32, jnp.uint32
    good = [sd((20, 20), u8), sd(scale_shape(20, 40), e4), sd((1,), f32),
            sd((40, 10), u8), sd(scale_shape(40, 20), e4), sd((1,), f32)]
    rnd, bits = jnp.zeros((0,), u32), jnp.ones((1,), u32)

    def call(results, x=x, rnd=rnd, bits=bits, flatten_axis=1):
        f = jax.ffi.ffi_call("lowbit_quantize_nvfp4", results)
        return jax.block_until_ready(f(x, rnd, bits, flatten_axis=np.int32(flatten_axis),
                                       tile_2d=np.bool_(False), rht=np.bool_(True)))

    call(good)  # sanity: the well-formed call runs
    cases = [
        (dict(rnd=jnp.zeros((20, 39), u32)), "lowbit_quantize_nvfp4: random: expected u32"),
        (dict(bits=jnp.ones((2,), u32)), "lowbit_quantize_nvfp4: rht_sign_bits: expected u32"),
        (dict(flatten_axis=2), r"lowbit_quantize_nvfp4: flatten_axis: expected a value in \[0, 1\]"),
        (dict(x=x.astype(jnp.int32)), "lowbit_quantize_nvfp4: x: expected f32, f16 or bf16"),
        (dict(results=[sd((20, 21), u8)] + good[1:]), "lowbit_quantize_nvfp4: rowwise: expected u8"),
        (dict(results=good[:4] + [sd(scale_shape(40, 20), u8)] + good[5:]),
         "lowbit_quantize_nvfp4: colwise_scale: expected"),
        (dict(results=good[:5] + [sd((2,), f32)]), "lowbit_quantize_nvfp4: colwise_global_scale_inv: expected"),
        (dict(results=[sd((0,), u8), good[1], sd((0,), f32)] + good[3:]), "lowbit_quantize_nvfp4: rowwise_scale"),
    ]
    for kw, msg in cases:
        results = kw.pop("results", good)
        with pytest.raises(Exception, match=msg):
            call(results, **kw)
