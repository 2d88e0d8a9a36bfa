"""lowbit.ops.quantize_nvfp4 on the GPU: the CUDA kernels (csrc/quantize/quantize_nvfp4.cu)
== the CPU reference (and, on a subset, == the jnp twin run on the GPU), bit for bit, for
every output (packed data, E4M3 scales with their padding, global_scale_inv): rowwise /
colwise / both, 1x16 and
16x16 blocks, RNE and stochastic rounding, with and without the RHT, f32 / bf16 / f16,
shapes that are not multiples of 2, 16, 64 or 128 (the kernels' scalar and 16-byte load
paths), and data with zeros, all-zero blocks, inf, NaN, near-max values and subnormals.
All tests are marked `gpu` (they skip without one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_on
from nvfp4_bits import assert_same as _assert_same, bits as _bits
from lowbit.ops.quantize_nvfp4 import quantize_nvfp4, rht_sign_bits, sr_random_bits

F32 = np.float32
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _data(rng, shape, kind="mixed"):
    """fp32 data of a kind; `mixed` is normal values over 12 binades with planted specials."""
    n = int(np.prod(shape))
    if kind == "zeros":
        return np.zeros(shape, F32)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-6, 6, n))).astype(F32)
    if kind == "mixed":
        if n >= 32:  # an all-zero block (row 0 starts with 16 zeros); tiny inputs keep theirs
            x[:16] = 0
        for value, count in ((0.0, 5), (447.0, 2), (-447.0, 1), (3e-39, 3), (-1e-45, 2),
                             (np.inf, 1), (-np.inf, 1), (np.nan, 1), (-np.nan, 1)):
            x[rng.integers(0, n, count)] = F32(value)
    elif kind == "one_nan":  # one NaN, else zeros: NaN global amax, NaN block scale
        x[:] = 0
        x[rng.integers(0, n)] = -np.nan
        x[rng.integers(0, n)] = F32(1.5)
    elif kind == "inf":  # inf beside finite values: S = 1, saturated blocks
        x[rng.integers(0, n, 3)] = np.inf
        x[rng.integers(0, n, 2)] = -np.inf
    elif kind == "subnormal":  # every value an fp32 subnormal: S overflows to 1
        x = (rng.integers(-(1 << 22), 1 << 22, n).astype(np.int64)).astype(F32) * F32(2.0**-149)
    elif kind == "huge":  # near fp32 max: S and the block scales become tiny
        x = (rng.uniform(-1, 1, n) * 3e38).astype(F32)
    elif kind == "near_max":  # the e4m3 / e2m1 saturation edges (block amax = global amax)
        x = rng.choice(np.array([6.0, -6.0, 5.99, 2688.0, -2687.9, 448.0, 0.0], F32), n)
    return x.reshape(shape)


def _inputs(rng, shape, dtype, kind, sr, rht):
    x = jnp.asarray(_data(rng, shape, kind)).astype(dtype)
    key = jax.random.PRNGKey(int(rng.integers(0, 1 << 30)))
    rnd = sr_random_bits(key, shape) if sr else jnp.zeros((0,), jnp.uint32)
    bits = rht_sign_bits(jax.random.fold_in(key, 1)) if rht else jnp.zeros((1,), jnp.uint32)
    return x, rnd, bits


def _fn(sr, rht, use_jnp=False, **kw):
    def f(x, rnd, bits):
        return tuple(quantize_nvfp4(x, random=rnd if sr else None, rht_sign_bits=bits if rht else None,
                                    use_jnp=use_jnp, **kw))
    return f


def _check(rng, cpu, gpu, shape, dtype, kind="mixed", sr=False, rht=False, twin=False, **kw):
    """CUDA == CPU reference; with `twin` also the jnp twin run on the GPU (XLA:GPU keeps
    subnormals; its compile is slow, so only a subset of the cases runs it)."""
    args = _inputs(rng, shape, dtype, kind, sr, rht)
    cuda = run_on(gpu, _fn(sr, rht, **kw), *args)
    ref = run_on(cpu, _fn(sr, rht, **kw), *args)
    what = f"{shape} {jnp.dtype(dtype).name} {kind} sr={sr} rht={rht} {kw}"
    _assert_same(cuda, ref, "cuda vs cpu " + what)
    if twin:
        _assert_same(run_on(gpu, _fn(sr, rht, use_jnp=True, **kw), *args), ref, "jnp twin vs cpu " + what)


VARIANTS = {  # name -> (tile_2d, sr, rht)
    "rne": (False, False, False), "2d": (True, False, False), "sr": (False, True, False),
    "rht": (False, False, True), "sr-rht": (False, True, True), "2d-rht": (True, False, True),
    "2d-sr": (True, True, False), "2d-sr-rht": (True, True, True),
}
# Odd everything; 16-byte paths for x (cols % 8 == 0 bf16/f16, % 4 f32) and the random words
# (cols % 4 == 0); partial tiles, blocks, RHT groups and odd packed rows in both copies.
SHAPES = [(1, 1), (5, 3), (37, 50), (130, 36), (96, 160), (200, 259)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_equals_cpu_and_twin_both_copies(variant, dtype, shape, rng, cpu, gpu):
    tile_2d, sr, rht = VARIANTS[variant]
    _check(rng, cpu, gpu, shape, DTYPES[dtype], sr=sr, rht=rht, tile_2d=tile_2d, rowwise=True,
           colwise=True, twin=shape == (37, 50))


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["rowwise", "colwise", "both"])
@pytest.mark.parametrize("variant", ["rne", "sr-rht", "2d-rht"])
def test_cuda_single_copies(copies, variant, rng, cpu, gpu):
    """The amax scratch differs per requested copy (and with RHT): each alone, and both."""
    tile_2d, sr, rht = VARIANTS[variant]
    for shape in [(67, 45), (48, 128)]:
        _check(rng, cpu, gpu, shape, jnp.bfloat16, sr=sr, rht=rht, tile_2d=tile_2d,
               rowwise=copies != "colwise", colwise=copies != "rowwise")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["zeros", "one_nan", "inf", "subnormal", "huge", "near_max"])
@pytest.mark.parametrize("variant", ["rne", "2d-sr-rht", "sr-rht", "2d"])
def test_cuda_special_data(kind, variant, rng, cpu, gpu):
    tile_2d, sr, rht = VARIANTS[variant]
    for shape, dtype in [((35, 50), jnp.float32), ((64, 48), jnp.bfloat16)]:
        _check(rng, cpu, gpu, shape, dtype, kind=kind, sr=sr, rht=rht, tile_2d=tile_2d,
               rowwise=True, colwise=True, twin=variant == "2d-sr-rht" and dtype == jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["rne", "sr-rht", "2d-rht"])
def test_cuda_many_tiles(variant, rng, cpu, gpu):
    """Thousands of CTAs and amax atomics; flatten_axis over a 3-D input."""
    tile_2d, sr, rht = VARIANTS[variant]
    _check(rng, cpu, gpu, (3, 700, 1001), jnp.bfloat16, sr=sr, rht=rht, tile_2d=tile_2d,
           rowwise=True, colwise=True, flatten_axis=2)
    _check(rng, cpu, gpu, (2048, 1536), jnp.float32, sr=sr, rht=rht, tile_2d=tile_2d,
           rowwise=True, colwise=True)


@pytest.mark.gpu
def test_cuda_vmap_equals_cpu(rng, cpu, gpu):
    x = jnp.asarray(_data(rng, (3, 40, 33)))

    def f(v):
        return tuple(jax.vmap(lambda u: quantize_nvfp4(u, colwise=True, tile_2d=True))(v))

    _assert_same(run_on(gpu, f, x), run_on(cpu, f, x), "vmap")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_cuda_empty_x(shape, rng, cpu, gpu):
    """Only the global scales are written (1)."""
    x = jnp.zeros(shape, jnp.float32)
    f = _fn(False, True, rowwise=True, colwise=True)
    bits = jnp.ones((1,), jnp.uint32)
    got = run_on(gpu, f, x, jnp.zeros((0,), jnp.uint32), bits)
    _assert_same(got, run_on(cpu, f, x, jnp.zeros((0,), jnp.uint32), bits), f"empty {shape}")
    np.testing.assert_array_equal(got[2], np.ones((1,), F32))
