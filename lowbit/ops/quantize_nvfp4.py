"""lowbit.ops.quantize_nvfp4: NVFP4 quantization (E2M1 data, E4M3 scale per 16 values or per
16x16 tile, fp32 global scale per copy), stochastic rounding and the random Hadamard transform.

Numerics and layouts are those of csrc/quantize/quantize_nvfp4.h, in short, for x viewed as
R x C (R = prod(shape[:f]), f = flatten_axis) and a stored copy Q (rowwise: x, R x C;
colwise: x^T, C x R, K-major for wgrad, optionally RHT-transformed):
  A = max|Q|; S = 2688 / A (1 when A is 0, inf or NaN or S overflows);
  block scale sd = e4m3_rne_sat(amax_blk / 6 * S); q = e2m1(Q * S / sd) (0 when sd is 0),
  RNE or stochastic (random word w rounds the magnitude up iff w < rem * 2^(32 - shift),
  i.e. with probability exactly rem / 2^shift: unbiased); global_scale_inv = 1 / S.
  Data: two codes per byte, element 2j in the low nibble, uint8 (rows of Q, ceil(cols/2));
  scales: e4m3 (roundup(rows, 128), roundup(ceil(cols/16), 4)), padding 0.
  Random words: uint32 of x's shape; x[r, c] and its colwise element use the same word.
  RHT: T = D H D / 4 on full 16-groups of each column of x (colwise copy only), D from the
  low 16 bits of rht_sign_bits (bit set: -1). T is symmetric and orthogonal: T T = I.
  NaN results of T are the positive quiet NaN.
dequantize_nvfp4: (e2m1(q) * e4m3(sd)) * global_scale_inv in jnp (the first product exact).

Backends: lowbit_quantize_nvfp4 lowers to the C++ reference on the CPU and to the CUDA
kernels (csrc/quantize/quantize_nvfp4.cu) on a GPU; both give the same bits.
`quantize_nvfp4_jnp` (use_jnp=True) is an exact jnp twin of the reference, the tests' third
reference (integer arithmetic for every division and rounding, since XLA's fp32 division on
the GPU is not correctly rounded). It equals the handlers bit for bit
(tests/test_quantize_nvfp4.py, tests/test_quantize_nvfp4_cuda.py), except that XLA:CPU
flushes fp32 subnormals (FTZ/DAZ), so on the CPU the twin may differ for inputs or block
intermediates below 2^-126; XLA:GPU keeps subnormals, as the reference does.
The global amax is taken over the whole (unsharded) tensor: the op has no partitioning rule
(sharded inputs are gathered). vmap maps the op over the batch (one quantization each).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.amax import check_high_precision
from lowbit.ops.quantize import check_copies_and_axis
from lowbit.ops.quantize_block import _looped_batcher

OP = "lowbit.ops.quantize_nvfp4"
BLOCK = 16
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_FLT_MAX_BITS = 0x7F7FFFFF
_INF_BITS = 0x7F800000
_E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


class Nvfp4Quantized(NamedTuple):
    rowwise: jax.Array | None  # uint8 (R, ceil(C/2)), packed E2M1
    rowwise_scale: jax.Array | None  # e4m3 (roundup(R, 128), roundup(ceil(C/16), 4))
    rowwise_global_scale_inv: jax.Array | None  # f32 (1,)
    colwise: jax.Array | None  # uint8 (C, ceil(R/2)): x^T
    colwise_scale: jax.Array | None  # e4m3 (roundup(C, 128), roundup(ceil(R/16), 4))
    colwise_global_scale_inv: jax.Array | None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """E4M3 scale shape of a stored rows x cols NVFP4 copy."""
    return _cdiv(rows, 128) * 128, _cdiv(_cdiv(cols, BLOCK), 4) * 4


def flat_view(shape, flatten_axis: int) -> tuple[int, int]:
    return int(np.prod(shape[:flatten_axis], dtype=np.int64)), int(np.prod(shape[flatten_axis:], dtype=np.int64))


def sr_random_bits(key, shape) -> jax.Array:
    """The stochastic-rounding words for a tensor of `shape` (uint32, same on every backend)."""
    return jax.random.bits(key, tuple(shape), jnp.uint32)


def rht_sign_bits(key) -> jax.Array:
    """The RHT sign vector of `key` as uint32 (1,), low 16 bits used."""
    return jax.random.bits(key, (1,), jnp.uint32) & jnp.uint32(0xFFFF)


# ------------------------------------------------------------------ exact jnp arithmetic


def _u32(v):
    return jnp.uint32(v)


def _bits(x):
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _float(bits):
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _normalized(bits):
    """(significand in [2^23, 2^24), unbiased exponent) of non-zero finite |x| bits."""
    e, m = (bits >> 23).astype(jnp.int32), bits & _u32(0x7FFFFF)
    shift = jnp.maximum(jax.lax.clz(m).astype(jnp.int32) - 8, 0)
    sub = e == 0
    sig = jnp.where(sub, m << shift.astype(jnp.uint32), m | _u32(0x800000))
    return sig, jnp.where(sub, -126 - shift, e - 127)


def div_rn(a, b):
    """a / b correctly rounded (IEEE RNE, subnormals kept) for finite a >= 0, b > 0, by
    integer long division: XLA's fp32 division is not correctly rounded on the GPU."""
    ab, bb = _bits(a), _bits(b)
    ma, ea = _normalized(ab)
    mb, eb = _normalized(bb)
    lt = ma < mb
    ma = jnp.where(lt, ma << 1, ma)
    e = ea - eb - lt.astype(jnp.int32)
    q, r = jnp.zeros_like(ma), ma
    for _ in range(26):  # q = floor(ma * 2^25 / mb) in [2^25, 2^26)
        bit = r >= mb
        r = jnp.where(bit, r - mb, r)
        q = (q << 1) | bit.astype(jnp.uint32)
        r = r << 1
    sticky = r != 0
    shift = jnp.clip(jnp.where(e >= -126, 2, -(e + 124)), 2, 27).astype(jnp.uint32)
    code = q >> shift
    guard = (q >> (shift - 1)) & 1
    rest = ((q & ((_u32(1) << (shift - 1)) - 1)) != 0) | sticky
    up = (guard == 1) & (rest | ((code & 1) == 1))
    code = code + up.astype(jnp.uint32)
    normal = ((e + 127).astype(jnp.uint32) << 23) + code - _u32(1 << 23)
    out = jnp.where(e >= -126, jnp.where(e > 127, _u32(_INF_BITS), normal), code)
    return _float(jnp.where(ab == 0, _u32(0), out))


def _round_magnitude(abs_bits, mant: int, bias: int, random=None):
    """formats.h RoundMagnitudeRne / RoundMagnitudeStochastic on finite |x| bits."""
    emin = 1 - bias
    exp32 = (abs_bits >> 23).astype(jnp.int32)
    man = abs_bits & _u32(0x7FFFFF)
    if random is None:
        sig, e = man | _u32(0x800000), exp32 - 127
    else:
        sub = exp32 == 0
        sig, e = jnp.where(sub, man, man | _u32(0x800000)), jnp.where(sub, -126, exp32 - 127)
    shift = 23 - mant + jnp.maximum(emin - e, 0)
    s = jnp.clip(shift, 1, 31).astype(jnp.uint32)
    r = jnp.where(shift >= 32, _u32(0), sig >> s)
    rem = jnp.where(shift >= 32, sig, sig & ((_u32(1) << s) - 1))
    if random is None:
        half = _u32(1) << (s - 1)
        up = (rem > half) | ((rem == half) & ((r & 1) == 1))
        r = jnp.where(shift > 24, _u32(0), r + up.astype(jnp.uint32))
        zero = exp32 == 0
    else:
        up_shift = jnp.clip(32 - shift, 0, 31).astype(jnp.uint32)
        down_shift = jnp.clip(shift - 32, 0, 31).astype(jnp.uint32)
        threshold = jnp.where(shift <= 32, rem << up_shift, jnp.where(shift >= 56, _u32(0), rem >> down_shift))
        r = r + (random < threshold).astype(jnp.uint32)
        zero = sig == 0
    code = jnp.where(e < emin, r, ((e - emin + 1).astype(jnp.uint32) << mant) + r - _u32(1 << mant))
    return jnp.where(zero, _u32(0), code)


def encode_e4m3(x):
    """formats.h FloatToE4m3 (RNE, saturating, NaN -> sign | 0x7F) as uint8."""
    u = _bits(x)
    sign, mag = (u >> 24) & _u32(0x80), u & _u32(0x7FFFFFFF)
    code = jnp.minimum(_round_magnitude(jnp.minimum(mag, _u32(_INF_BITS - 1)), 3, 7), _u32(0x7E))
    return (sign | jnp.where(mag > _INF_BITS, _u32(0x7F), code)).astype(jnp.uint8)


def encode_e2m1(x, random=None):
    """formats.h FloatToE2m1 / FloatToE2m1Stochastic as uint8 nibbles (NaN -> sign | 7)."""
    u = _bits(x)
    sign, mag = (u >> 28) & _u32(0x8), u & _u32(0x7FFFFFFF)
    code = jnp.minimum(_round_magnitude(jnp.minimum(mag, _u32(_INF_BITS - 1)), 1, 1, random), _u32(7))
    return (sign | jnp.where(mag > _INF_BITS, _u32(7), code)).astype(jnp.uint8)


def _mul_nan_defined(x, s):
    """fp8_codec.h MulNanDefined: the IEEE product, NaN results with lowbit's sign rule."""
    p = x * s
    xb, sb = _bits(x), _bits(s)
    xnan, snan = (xb & _u32(0x7FFFFFFF)) > _INF_BITS, (sb & _u32(0x7FFFFFFF)) > _INF_BITS
    sign = jnp.where(xnan, xb, jnp.where(snan, sb, xb ^ sb)) & _u32(0x80000000)
    return jnp.where(jnp.isnan(p), _float(sign | _u32(0x7FC00000)), p)


def global_scale(amax_bits):
    """S from the copy's amax bits (quantize_nvfp4.h Nvfp4GlobalScale)."""
    usable = (amax_bits != 0) & (amax_bits < _INF_BITS)
    s = div_rn(jnp.float32(2688.0), _float(jnp.where(usable, amax_bits, _u32(0x3F800000))))
    return jnp.where(usable & (_bits(s) < _INF_BITS), s, jnp.float32(1.0))


def rht16(v, sign_bits):
    """T v on the last axis (16): quantize_nvfp4.h Nvfp4Rht16, same operation order."""
    neg = ((sign_bits.reshape(()) >> jnp.arange(16, dtype=jnp.uint32)) & 1) == 1
    lanes = list(jnp.moveaxis(jnp.where(neg, -v, v), -1, 0))
    h = 1
    while h < 16:
        for i in range(16):
            if not i & h:
                a, b = lanes[i], lanes[i + h]
                lanes[i], lanes[i + h] = a + b, a - b
        h <<= 1
    factor = jnp.where(neg, jnp.float32(-0.25), jnp.float32(0.25))
    out = jnp.stack(lanes, axis=-1) * factor
    return jnp.where(jnp.isnan(out), _float(_u32(0x7FC00000)), out)  # NaN canonical, as the C++


def _apply_rht_to_rows(q, sign_bits):
    """T on the full 16-groups along each row of q (R x C); a partial tail is left as is."""
    rows, cols = q.shape
    full = cols // BLOCK * BLOCK
    if full == 0:
        return q
    head = rht16(q[:, :full].reshape(rows, full // BLOCK, BLOCK), sign_bits).reshape(rows, full)
    return jnp.concatenate([head, q[:, full:]], axis=1)


def _quantize_copy(q, random, tile_2d: bool):
    """One stored copy Q (R x C fp32) -> (packed data, e4m3 scales, global_scale_inv (1,))."""
    R, C = q.shape
    nb = _cdiv(C, BLOCK)
    Rp = _cdiv(R, BLOCK) * BLOCK if tile_2d else R
    qp = jnp.pad(q, ((0, Rp - R), (0, nb * BLOCK - C)))
    abs_bits = _bits(qp) & _u32(0x7FFFFFFF)
    S = global_scale(jnp.max(abs_bits))
    if tile_2d:
        blk = jnp.max(abs_bits.reshape(Rp // BLOCK, BLOCK, nb, BLOCK), axis=(1, 3))
        blk = jnp.repeat(blk, BLOCK, axis=0)[:R]
    else:
        blk = jnp.max(abs_bits.reshape(R, nb, BLOCK), axis=2)
    amax_blk = _float(blk)
    finite = blk < _INF_BITS
    a6 = jnp.where(finite, div_rn(jnp.where(finite, amax_blk, 0.0), jnp.float32(6.0)), amax_blk)
    sd = encode_e4m3(a6 * S)
    sd_value = jnp.asarray(_E4M3_VALUES)[sd.astype(jnp.int32)]
    safe_sd = jnp.where((sd & 0x7F) == 0, jnp.float32(1.0), jnp.where(jnp.isnan(sd_value), 1.0, sd_value))
    factor = div_rn(jnp.broadcast_to(S, safe_sd.shape), safe_sd)
    factor = jnp.where(_bits(factor) == _INF_BITS, _float(_u32(_FLT_MAX_BITS)), factor)
    factor = jnp.where((sd & 0x7F) == 0, jnp.float32(0.0), factor)
    factor = jnp.where((sd & 0x7F) == 0x7F, _float(_u32(0x7FC00000)), factor)
    y = _mul_nan_defined(qp[:R], jnp.repeat(factor, BLOCK, axis=1))
    if random is not None:
        random = jnp.pad(random, ((0, 0), (0, nb * BLOCK - C)))
    codes = jnp.pad(encode_e2m1(y, random)[:, :C], ((0, 0), (0, C % 2)))  # odd C: high nibble 0
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sr, sc = scale_shape(R, C)
    scale = jnp.pad(sd, ((0, sr - R), (0, sc - nb)))
    return data, jax.lax.bitcast_convert_type(scale, E4M3), div_rn(jnp.float32(1.0), S).reshape(1)


def quantize_nvfp4_jnp(x, random, rht_sign_bits, *, flatten_axis: int, tile_2d: bool, rht: bool,
                       rowwise: bool, colwise: bool):
    """The exact jnp twin of the CPU handler; the primitive's outputs (empty when not wanted)."""
    R, C = flat_view(x.shape, flatten_axis)
    x2 = x.reshape(R, C).astype(jnp.float32)
    rnd = None if random.size == 0 else random.reshape(R, C)
    empty = (jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), E4M3), jnp.zeros((0,), jnp.float32))
    out = []
    out += _quantize_copy(x2, rnd, tile_2d) if rowwise and x2.size else empty
    if colwise and x2.size:
        q = x2.T
        if rht:
            q = _apply_rht_to_rows(q, rht_sign_bits)
        out += _quantize_copy(q, None if rnd is None else rnd.T, tile_2d)
    else:
        out += empty
    if not x2.size:  # empty x: empty data and scales of their shapes, global scales 1
        want = _abstract(x, random, rht_sign_bits, flatten_axis=flatten_axis, tile_2d=tile_2d,
                         rht=rht, rowwise=rowwise, colwise=colwise)
        out = [jnp.ones(a.shape, a.dtype) if a.dtype == jnp.float32 else jnp.zeros(a.shape, a.dtype)
               for a in want]  # global_scale_inv 1 (A = 0, S = 1), as the handlers
    return tuple(out)


# ------------------------------------------------------------------ primitive


def _abstract(x, random, rht_sign_bits, *, flatten_axis, tile_2d, rht, rowwise, colwise):
    del random, rht_sign_bits, tile_2d, rht
    R, C = flat_view(x.shape, int(flatten_axis))
    empty = [jax.core.ShapedArray((0,), t) for t in (jnp.uint8, E4M3, jnp.float32)]

    def copy(r, c):
        return [jax.core.ShapedArray((r, _cdiv(c, 2)), jnp.uint8), jax.core.ShapedArray(scale_shape(r, c), E4M3),
                jax.core.ShapedArray((1,), jnp.float32)]

    return tuple((copy(R, C) if rowwise else empty) + (copy(C, R) if colwise else empty))


# (x, random | (0,), rht_sign_bits (1,)) -> (rowwise, scale, global_scale_inv, colwise, ...).
quantize_nvfp4_p = ffi_primitive("lowbit_quantize_nvfp4", "lowbit_quantize_nvfp4", _abstract,
                                 multiple_results=True, attrs=("flatten_axis", "tile_2d", "rht"))
_looped_batcher(quantize_nvfp4_p)


def check_sr_rht_args(op: str, x, random, rht_sign_bits):
    """(random, sign_bits, rht) as the NVFP4 handlers take them: `random` uint32 of x's shape or
    None (RNE: an empty array), `rht_sign_bits` uint32 (1,) or None (no RHT: zeros); a
    ValueError naming `op` and the argument otherwise."""
    if random is None:
        random = jnp.zeros((0,), jnp.uint32)
    else:
        random = jnp.asarray(random)
        if random.dtype != jnp.uint32 or random.shape != x.shape:
            raise ValueError(f"{op}: random: expected uint32 of shape {x.shape}, got {random.dtype}{random.shape}")
    rht = rht_sign_bits is not None
    sign_bits = jnp.zeros((1,), jnp.uint32) if not rht else jnp.asarray(rht_sign_bits)
    if sign_bits.dtype != jnp.uint32 or sign_bits.shape != (1,):
        raise ValueError(f"{op}: rht_sign_bits: expected uint32 of shape (1,), got {sign_bits.dtype}{sign_bits.shape}")
    return random, sign_bits, rht

def quantize_nvfp4(x, *, random=None, rht_sign_bits=None, tile_2d: bool = False, rowwise: bool = True,
                   colwise: bool = False, flatten_axis: int = -1, use_jnp: bool = False) -> Nvfp4Quantized:
    """NVFP4-quantizes x (see the module doc). `random`: uint32 of x's shape for stochastic
    rounding (sr_random_bits), None for RNE. `rht_sign_bits`: uint32 (1,) (rht_sign_bits(key))
    applies the RHT to the colwise copy; None for none. use_jnp: run the jnp twin directly."""
    x = jnp.asarray(x)
    check_high_precision(OP, "x", x)
    axis = check_copies_and_axis(OP, x, rowwise, colwise, flatten_axis)
    random, sign_bits, rht = check_sr_rht_args(OP, x, random, rht_sign_bits)
    params = dict(flatten_axis=np.int32(axis), tile_2d=np.bool_(tile_2d), rht=np.bool_(rht),
                  rowwise=bool(rowwise), colwise=bool(colwise))
    if use_jnp:
        outs = quantize_nvfp4_jnp(x, random, sign_bits, **{**params, "flatten_axis": axis,
                                                            "tile_2d": bool(tile_2d), "rht": rht})
    else:
        outs = quantize_nvfp4_p.bind(x, random, sign_bits, **params)
    outs = list(outs)
    row = outs[:3] if rowwise else [None] * 3
    col = outs[3:] if colwise else [None] * 3
    return Nvfp4Quantized(*row, *col)


def dequantize_nvfp4(data, scale, global_scale_inv, *, cols: int, rht_sign_bits=None,
                     out_dtype=jnp.float32) -> jax.Array:
    """One stored copy back to (rows, cols): (e2m1(q) * e4m3(sd)) * global_scale_inv, then
    T again on the full 16-groups of each row when the copy was RHT-transformed."""
    op = "lowbit.ops.dequantize_nvfp4"
    if isinstance(cols, bool) or not isinstance(cols, (int, np.integer)) or cols < 0:
        raise ValueError(f"{op}: cols: expected an int >= 0, got {cols!r}")
    check_high_precision(op, "out_dtype", out_dtype)
    data, scale = jnp.asarray(data), jnp.asarray(scale)
    if data.dtype != jnp.uint8 or data.ndim != 2 or data.shape[1] != _cdiv(cols, 2):
        raise ValueError(f"{op}: data: expected uint8 (rows, {_cdiv(cols, 2)}), got {data.dtype}{data.shape}")
    rows = data.shape[0]
    if scale.dtype != E4M3 or scale.shape != scale_shape(rows, cols):
        raise ValueError(f"{op}: scale: expected float8_e4m3fn {scale_shape(rows, cols)}, got {scale.dtype}{scale.shape}")
    global_scale_inv = jnp.asarray(global_scale_inv)
    if global_scale_inv.size != 1 or not jnp.issubdtype(global_scale_inv.dtype, jnp.floating):
        raise ValueError(f"{op}: global_scale_inv: expected one float32, got "
                         f"{global_scale_inv.dtype}{global_scale_inv.shape}")
    if rht_sign_bits is not None and int(np.prod(jnp.shape(rht_sign_bits))) != 1:
        raise ValueError(f"{op}: rht_sign_bits: expected one integer (16 sign bits), got shape "
                         f"{jnp.shape(rht_sign_bits)}")
    codes = jnp.stack([data & 0xF, data >> 4], axis=-1).reshape(rows, -1)[:, :cols]
    sd = jax.lax.bitcast_convert_type(scale, jnp.uint8)[:rows, : _cdiv(cols, BLOCK)]
    sd = jnp.repeat(jnp.asarray(_E4M3_VALUES)[sd.astype(jnp.int32)], BLOCK, axis=1)[:, :cols]
    values = jnp.asarray(_E2M1_VALUES)[codes.astype(jnp.int32)] * sd * jnp.asarray(global_scale_inv).reshape(())
    if rht_sign_bits is not None:
        values = _apply_rht_to_rows(values, jnp.asarray(rht_sign_bits))
    return values.astype(out_dtype)
