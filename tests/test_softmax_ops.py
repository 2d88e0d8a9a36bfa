"""lowbit.ops.softmax_forward / softmax_backward and lowbit.softmax: values against a jnp
reference for the three fusion types, TE's mask convention, gradients, jit, vmap, sharding
over virtual CPU devices, the jnp fallback beyond the CUDA limit, bad input, and the CUDA
kernel against the CPU one.

Tolerances: the row sums are added in another order than jnp's, exp is lowbit's own (within
1 ulp) and y = e * (1 / sum) rounds twice, so f32 results agree to ~1e-6 relative; f16/bf16
outputs to one unit in the last place.
"""

from __future__ import annotations

import math

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from softmax_reference import make, tol
from conftest import run_on
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit
from lowbit.softmax import SoftmaxType


def softmax_ref(x, mask=None, scale=1.0, fusion="scaled"):
    z = jnp.asarray(x, jnp.float32) * np.float32(scale)
    if fusion == "scaled_masked":
        z = jnp.where(jnp.asarray(mask).astype(jnp.int32) == 1, -10000.0, z)
    if fusion == "scaled_upper_triang":
        q, k = z.shape[-2:]
        z = jnp.where(jnp.arange(k)[None] > jnp.arange(q)[:, None], -jnp.inf, z)
    y = jax.nn.softmax(z, axis=-1)
    if fusion == "scaled_masked":
        y = jnp.where(jnp.max(z, -1, keepdims=True) == -10000.0, 0.0, y)
    return y


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FUSIONS = ["scaled", "scaled_masked", "scaled_upper_triang"]
SHAPES = [(1, 1, 1, 1), (2, 3, 5, 7), (2, 2, 33, 33), (1, 2, 16, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_forward_backward_match_reference(fusion, dtype, shape, rng):
    x, mask = make(rng, shape, dtype, fusion)
    y = jax.jit(lambda v, m: lowbit.ops.softmax_forward(v, m, 0.7, fusion))(x, mask)
    want = softmax_ref(x, mask, 0.7, fusion)
    assert y.dtype == x.dtype and y.shape == shape
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(want.astype(dtype), np.float32), **tol(dtype))
    if fusion == "scaled_masked":
        assert np.all(np.asarray(y, np.float32)[0, :, 0] == 0)
    if fusion == "scaled_upper_triang":  # q <= k here: key j > query i is masked to exactly 0
        above = np.triu(np.ones(shape[2:], bool), 1)
        assert np.all(np.asarray(y, np.float32)[..., above] == 0)
    dy = rng.standard_normal(shape).astype(dtype)
    dx = jax.jit(lambda d, v: lowbit.ops.softmax_backward(d, v, 0.7, fusion))(dy, y)
    yf, dyf = np.asarray(y, np.float32), np.asarray(dy, np.float32)
    want_dx = 0.7 * (yf * dyf - yf * np.sum(yf * dyf, -1, keepdims=True))
    np.testing.assert_allclose(np.asarray(dx, np.float32), want_dx, rtol=tol(dtype)["rtol"] * 4,
                               atol=tol(dtype)["atol"] * 8 + 1e-6)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_public_softmax_grads(fusion, rng):
    x, mask = make(rng, (2, 2, 6, 6), np.float32, fusion)
    if mask is not None:
        mask[0, 0, 0, :] = False
    f = lambda v: lowbit.softmax(v, mask, 0.5, fusion)  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(x), softmax_ref(x, mask, 0.5, fusion), rtol=4e-6, atol=1e-7)
    jax.test_util.check_grads(f, (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
    w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    g = jax.grad(lambda v: jnp.sum(f(v) * w))(x)
    g_ref = jax.grad(lambda v: jnp.sum(softmax_ref(v, mask, 0.5, fusion) * w))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def test_te_enum_names_and_mask_dtypes(rng):
    x, mask = make(rng, (2, 2, 4, 8), np.float32, "scaled_masked")
    ref = softmax_ref(x, mask, 1.0, "scaled_masked")
    for m in (mask, mask.astype(np.int8), mask.astype(np.uint8)):
        np.testing.assert_allclose(lowbit.softmax(x, m, 1.0, SoftmaxType.SCALED_MASKED),
                                   ref, rtol=4e-6, atol=1e-7)
    # a broadcast (1, 1, q, k) mask
    _, m1 = make(rng, (2, 2, 4, 8), np.float32, "scaled_masked", mask_batch=1)
    np.testing.assert_allclose(lowbit.ops.softmax_forward(x, m1, 1.0, "scaled_masked"),
                               softmax_ref(x, m1, 1.0, "scaled_masked"), rtol=4e-6, atol=1e-7)
    y = lowbit.softmax(x, None, 1.0, "scaled_upper_triang_masked")
    np.testing.assert_allclose(y, softmax_ref(x, None, 1.0, "scaled_upper_triang"), rtol=4e-6, atol=1e-7)


def test_vmap_and_fallback(rng):
    x, mask = make(rng, (3, 2, 2, 5, 9), np.float32, "scaled")[0], None
    _, mask = make(rng, (2, 2, 5, 9), np.float32, "scaled_masked")
    f = jax.vmap(lambda v: lowbit.ops.softmax_forward(v, mask, 2.0, "scaled_masked"))
    np.testing.assert_allclose(jax.jit(f)(x), jax.vmap(lambda v: softmax_ref(v, mask, 2.0, "scaled_masked"))(x),
                               rtol=4e-6, atol=1e-7)
    g = jax.vmap(lambda m: lowbit.ops.softmax_forward(x[0], m, 2.0, "scaled_masked"))(np.stack([mask, ~mask]))
    np.testing.assert_allclose(g[1], softmax_ref(x[0], ~mask, 2.0, "scaled_masked"), rtol=4e-6, atol=1e-7)
    big = rng.standard_normal((1, 1, 2, 16385)).astype(np.float32)
    hlo = jax.jit(lambda v: lowbit.ops.softmax_forward(v)).lower(big).as_text()
    assert "lowbit_softmax_forward" not in hlo
    np.testing.assert_allclose(lowbit.ops.softmax_forward(big), softmax_ref(big), rtol=4e-6, atol=1e-9)


@pytest.mark.parametrize("spec", [P("a", "b"), P(None, None, ("a", "b")), P("a", None, None, "b")], ids=str)
def test_sharded_equals_unsharded(spec, rng):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x, mask = make(rng, (4, 4, 8, 32), np.float32, "scaled_masked")
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = lambda v, m: lowbit.softmax(v, m, 0.3, "scaled_masked")  # noqa: E731
    g = lambda v, m: jax.grad(lambda u: jnp.sum(f(u, m) ** 2))(v)  # noqa: E731
    with jax.default_device(jax.devices("cpu")[0]):  # the reference on the CPU too (not a GPU)
        want_f, want_g = f(x, mask), g(x, mask)
    np.testing.assert_array_equal(jax.jit(f)(xs, mask), want_f)
    np.testing.assert_array_equal(jax.jit(g)(xs, mask), want_g)
    assert "lowbit_softmax_forward" in jax.jit(f).lower(xs, mask).compile().as_text()


def test_bad_input():
    x = np.ones((2, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="lowbit.ops.softmax_forward: fusion_type"):
        lowbit.ops.softmax_forward(x, fusion_type="masked")
    with pytest.raises(ValueError, match=r"softmax_forward: logits: expected shape \(batch, heads, q, k\)"):
        lowbit.ops.softmax_forward(x[0])
    with pytest.raises(TypeError, match="softmax_forward: logits: expected float32"):
        lowbit.ops.softmax_forward(x.astype(np.int32))
    with pytest.raises(ValueError, match="softmax_forward: mask: scaled_masked needs a mask"):
        lowbit.ops.softmax_forward(x, None, 1.0, "scaled_masked")
    with pytest.raises(ValueError, match=r"softmax_forward: mask: expected shape \(2 or 1, 1, 4, 4\)"):
        lowbit.ops.softmax_forward(x, np.zeros((2, 2, 4, 4), bool), 1.0, "scaled_masked")
    with pytest.raises(TypeError, match="softmax_forward: mask: expected bool, int8 or uint8"):
        lowbit.ops.softmax_forward(x, np.zeros((2, 1, 4, 4), np.float32), 1.0, "scaled_masked")
    with pytest.raises(ValueError, match="softmax_backward: y: expected"):
        lowbit.ops.softmax_backward(x, x[:1])
    with pytest.raises(ValueError, match="lowbit.softmax: softmax_fusion_type"):
        lowbit.softmax(x, None, 1.0, "nope")
    # TE's function ignores a mask the fusion type does not apply; lowbit refuses it.
    for fusion in ("scaled", "scaled_upper_triang"):
        with pytest.raises(ValueError, match=f"lowbit.softmax: mask: .*'{fusion}' would ignore it"):
            lowbit.softmax(x, np.zeros((2, 1, 4, 4), bool), 1.0, fusion)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["0", "1", "2", "3"])  # LOWBIT_SOFTMAX_VARIANT (softmax.cu)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("shape", [(2, 3, 129, 129), (1, 2, 7, 16384), (2, 1, 64, 4097), (3, 2, 33, 1),
                                   (1, 1, 1000, 1000), (1, 2, 40, 2048), (2, 2, 24, 520), (1, 3, 9, 64)],
                         ids=str)
def test_cuda_equals_cpu(shape, fusion, dtype, variant, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_SOFTMAX_VARIANT", variant)  # the launcher reads it at every call
    if fusion == "scaled_upper_triang" and shape[2] > shape[3]:
        shape = (*shape[:2], shape[3], shape[3])
    x, mask = make(rng, shape, dtype, fusion)
    dy = rng.standard_normal(shape).astype(dtype)
    f = lambda v, m, d: (lambda y: (y, lowbit.ops.softmax_backward(d, y, 0.9, fusion)))(  # noqa: E731
        lowbit.ops.softmax_forward(v, m, 0.9, fusion))
    (yg, dxg), (yc, dxc) = run_on(gpu, f, x, mask, dy), run_on(cpu, f, x, mask, dy)
    t = dict(tol(dtype), rtol=max(tol(dtype)["rtol"], cuda_cpu_rtol(shape[-1])))
    np.testing.assert_allclose(yg.astype(np.float32), yc.astype(np.float32), **t)
    np.testing.assert_allclose(dxg.astype(np.float32), dxc.astype(np.float32), rtol=t["rtol"] * 4,
                               atol=t["atol"] * 8 + 1e-6)
    if fusion == "scaled_upper_triang":
        q, k = shape[2:]
        assert np.all(yg[..., np.arange(k)[None] > np.arange(q)[:, None]] == 0)


def cuda_cpu_rtol(k):
    """Bound on |y_cuda - y_cpu| / y for the fp32 forward. Both compute the same exp bits and
    differ only in the row sum of k positive values: the kernel adds up to 64 values per
    thread in order, 5 warp butterfly levels, then up to 31 warp partials in order (each
    value meets <= 100 roundings); the reference adds pairwise over blocks of 8
    (7 + ceil(log2(k / 8)) roundings). Each sum is within n u of the exact one (u = 2^-24),
    and each side rounds 1 / sum and the product e * (1 / sum) once each:
    rtol = (100 + 7 + ceil(log2(k / 8)) + 4) u."""
    return (100 + 7 + max(0, math.ceil(math.log2(k / 8))) + 4) * 2.0 ** -24


@pytest.mark.gpu
def test_cuda_unaligned(rng, cpu, gpu):
    x = rng.standard_normal((2, 2, 9, 130)).astype(ml_dtypes.bfloat16)
    f = lambda v: lowbit.ops.softmax_forward(v[..., 1:129], None, 1.0)  # noqa: E731
    np.testing.assert_allclose(run_on(gpu, f, x).astype(np.float32), run_on(cpu, f, x).astype(np.float32),
                               **tol(ml_dtypes.bfloat16))


@pytest.mark.gpu
def test_cuda_bad_variant_is_an_error(rng, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_SOFTMAX_VARIANT", "7")
    x = rng.standard_normal((1, 1, 4, 64)).astype(np.float32)
    with pytest.raises(Exception, match="lowbit_softmax_forward: LOWBIT_SOFTMAX_VARIANT: expected 0, 1, 2 or 3"):
        np.asarray(run_on(gpu, lambda v: lowbit.ops.softmax_forward(v, None, 1.0), x))
