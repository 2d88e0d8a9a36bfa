"""lowbit.ops.amax: values against a jnp reference, NaN/inf/empty rules, jit, vmap,
sharding over virtual CPU devices, bad input, and the CUDA kernel against the CPU one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit


def amax_ref(x):
    return jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0)


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
SHAPES = [(1,), (7,), (37, 129), (3, 5, 17), (2, 1, 4099), (1024, 33)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(dtype, shape, rng):
    x = (rng.standard_normal(shape) * 10).astype(dtype)
    got = jax.jit(lowbit.ops.amax)(x)
    assert got.dtype == jnp.float32 and got.shape == ()
    assert float(got) == float(amax_ref(jnp.asarray(x)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_nan_inf_and_empty(dtype, rng):
    x = (rng.standard_normal((17, 33)) * 5).astype(dtype)
    x[3, 4] = np.inf
    assert np.isinf(float(lowbit.ops.amax(x)))
    x[9, 1] = -np.nan
    assert np.isnan(float(lowbit.ops.amax(x)))
    assert float(lowbit.ops.amax(np.zeros((0, 5), dtype))) == 0.0
    assert float(lowbit.ops.amax(np.float32(-2.5).astype(dtype))) == 2.5


def test_vmap_and_nested_vmap(rng):
    x = (rng.standard_normal((3, 4, 257)) * 4).astype(ml_dtypes.bfloat16)
    got = jax.jit(jax.vmap(jax.vmap(lowbit.ops.amax)))(x)
    np.testing.assert_array_equal(np.asarray(got), np.max(np.abs(x.astype(np.float32)), axis=-1))
    got1 = jax.vmap(lowbit.ops.amax, in_axes=1)(x)
    np.testing.assert_array_equal(np.asarray(got1), np.max(np.abs(x.astype(np.float32)), axis=(0, 2)))


@pytest.mark.parametrize("spec", [P("a", "b"), P("a", None), P(None, ("a", "b")), P()])
def test_sharded_equals_unsharded(spec, rng):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x = (rng.standard_normal((64, 96)) * 3).astype(np.float32)
    x[rng.integers(64), rng.integers(96)] = -1000.0
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lowbit.ops.amax)
    assert float(f(xs)) == 1000.0
    hlo = f.lower(xs).compile().as_text()
    assert "lowbit_amax" in hlo
    if spec != P():
        assert "all-reduce" in hlo and "all-gather" not in hlo
    x[5, 7] = np.nan
    assert np.isnan(float(f(jax.device_put(x, NamedSharding(mesh, spec)))))


def test_rejects_integer_input():
    with pytest.raises(TypeError, match=r"lowbit.ops.amax: x: expected float32, float16 or bfloat16, got int32"):
        lowbit.ops.amax(jnp.arange(5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES + [(4096, 8191), (1 << 22,)], ids=str)
def test_cuda_equals_cpu(dtype, shape, rng, cpu, gpu):
    x = random_with_specials(rng, shape, dtype)
    x_finite = np.where(np.isfinite(x.astype(np.float32)), x, dtype(1.0)).astype(dtype)
    for data in (x, x_finite):
        g = run_on(gpu, lowbit.ops.amax, data)
        c = run_on(cpu, lowbit.ops.amax, data)
        np.testing.assert_array_equal(g.view(np.uint32) if np.isnan(g) else g, c.view(np.uint32) if np.isnan(c) else c)
    # misaligned start: a slice starting one element in takes the unvectorized path
    g = run_on(gpu, lambda v: lowbit.ops.amax(v[1:]), x_finite.reshape(-1))
    c = run_on(cpu, lambda v: lowbit.ops.amax(v[1:]), x_finite.reshape(-1))
    assert g == c


@pytest.mark.gpu
def test_cuda_vmap_rows_equal_cpu(rng, cpu, gpu):
    x = (rng.standard_normal((301, 77)) * 7).astype(ml_dtypes.bfloat16)
    f = jax.vmap(lowbit.ops.amax)
    np.testing.assert_array_equal(run_on(gpu, f, x), run_on(cpu, f, x))
