"""lowbit.ops.norm_forward / norm_backward against a jnp reference: values and gradients for
both norm types, zero-centered gamma, dtypes, odd shapes, epsilon edge cases, the fused
FP8 outputs, jit, vmap, sharding over virtual CPU devices, bad input; the CUDA kernels
against the CPU reference.

Tolerances. The op and the reference both compute in fp32 but sum rows in different
orders (the CPU op sequentially, XLA pairwise), so mu/rsigma differ relatively by about
sqrt(hidden) fp32 ulps (stat_rtol: ~3e-6 seen at hidden 4096) and the fp32 y by about as
much. Hence: mu, rsigma and f32 y within stat_rtol; y in bf16/f16 within one ulp
of the dtype; the FP8 codes, quantized from the op's fp32 y, equal a requantization of
that fp32 y bit for bit (checked exactly with f32 input, where y is the fp32 y), and
differ from the jnp reference's codes by at most one code, at rounding ties only (a
fraction <= 1e-3 of elements).
"""

from __future__ import annotations

import jax
import jax.test_util
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_with_specials, run_on
from jax.sharding import NamedSharding, PartitionSpec as P

import lowbit
from lowbit.ops import norm_backward, norm_forward
from lowbit.ops.norm import norm_backward_workspace_bytes


def norm_ref(x, gamma, beta, norm_type, zero_centered=False, eps=1e-6):
    """fp32 y, mu, rsigma of the jnp reference."""
    xf = x.astype(jnp.float32)
    w = gamma.astype(jnp.float32) + (1.0 if zero_centered else 0.0)
    if norm_type == "layernorm":
        mu = jnp.mean(xf, -1)
        rs = 1.0 / jnp.sqrt(jnp.mean(jnp.square(xf - mu[..., None]), -1) + eps)
        return (xf - mu[..., None]) * rs[..., None] * w + beta.astype(jnp.float32), mu, rs
    rs = 1.0 / jnp.sqrt(jnp.mean(jnp.square(xf), -1) + eps)
    return xf * rs[..., None] * w, None, rs


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
ULP = {np.dtype(np.float32): 2.0**-23, np.dtype(np.float16): 2.0**-10,
       np.dtype(ml_dtypes.bfloat16): 2.0**-7}
NORMS = ["layernorm", "rmsnorm"]


def make(rng, shape, dtype, gamma_dtype=np.float32, offset=0.5):
    x = (rng.standard_normal(shape) * 2 + offset).astype(dtype)
    h = shape[-1]
    gamma = (1 + 0.3 * rng.standard_normal(h)).astype(gamma_dtype)
    beta = (0.2 * rng.standard_normal(h)).astype(gamma_dtype)
    return x, gamma, beta


def args_for(norm_type, beta):
    return beta if norm_type == "layernorm" else None


def stat_rtol(hidden):
    """Relative tolerance of fp32 row statistics summed in different orders."""
    return 2e-6 + 2.4e-7 * np.sqrt(hidden)


def assert_y_close(y, ref_y, dtype):
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref_y, np.float32)
    if np.dtype(dtype) == np.float32:
        rtol = 2 * stat_rtol(ref.shape[-1])
        np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    else:
        # one ulp of the dtype, plus the fp32 y's own error (near zero: that of mu)
        tol = ULP[np.dtype(dtype)] * np.abs(ref) + 2 * stat_rtol(ref.shape[-1]) * np.abs(ref).max()
        assert np.all(np.abs(y - ref) <= tol), float(np.max(np.abs(y - ref) / tol))


def assert_forward_matches(g, c, norm_type, dtype, hidden, copies):
    """CUDA forward outputs g against the CPU ones c: statistics within stat_rtol, y within
    assert_y_close, FP8 codes at most one code apart (<= 0.1% of them), amax within 2 rtol.
    `copies`: the FP8 outputs that must exist ("q_rowwise", "q_colwise"); amax with them."""
    rtol = stat_rtol(hidden)
    np.testing.assert_allclose(g.rsigma, c.rsigma, rtol=rtol)
    if norm_type == "layernorm":
        np.testing.assert_allclose(g.mu, c.mu, rtol=rtol, atol=rtol)
    assert_y_close(g.y, c.y.astype(np.float32), dtype)
    for name in copies:
        assert getattr(c, name) is not None and c.amax is not None, name
    for a, b in ((g.q_rowwise, c.q_rowwise), (g.q_colwise, c.q_colwise)):
        assert (a is None) == (b is None)
        if b is not None:
            assert_codes_close(a, b)
    if c.amax is not None:
        np.testing.assert_allclose(g.amax, c.amax, rtol=2 * rtol)


def code_distance(a, b):
    """|a - b| in codes for fp8 arrays (sign-magnitude order)."""
    def ordered(q):
        u = q.view(np.uint8).astype(np.int32)
        return np.where(u & 0x80, -(u & 0x7F), u & 0x7F)
    return np.abs(ordered(np.asarray(a)) - ordered(np.asarray(b)))


def assert_codes_close(a, b):
    """FP8 codes of two implementations whose row statistics differ by rounding: at most one
    code apart, in at most 0.1% of the codes, or 2 codes in a small array (a value within
    the statistics' rounding of a code boundary flips; in 600 codes one flip is 0.17%)."""
    d = code_distance(a, b)
    assert d.max() <= 1 and (d > 0).sum() <= max(2, 1e-3 * d.size), ((d > 0).sum(), d.size)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 128), (3, 200), (257, 1000), (2, 3, 4096), (3, 16384)],
                         ids=str)
def test_forward_matches_reference(norm_type, dtype, shape, rng):
    x, gamma, beta = make(rng, shape, dtype)
    out = jax.jit(lambda x, g, b: norm_forward(x, g, b, norm_type=norm_type))(
        x, gamma, args_for(norm_type, beta))
    ref_y, ref_mu, ref_rs = norm_ref(jnp.asarray(x), gamma, beta, norm_type)
    assert out.y.dtype == x.dtype and out.y.shape == x.shape
    assert out.rsigma.shape == shape[:-1] and out.q_rowwise is None and out.amax is None
    rtol = stat_rtol(shape[-1])
    np.testing.assert_allclose(out.rsigma, ref_rs, rtol=rtol)
    if norm_type == "layernorm":
        np.testing.assert_allclose(out.mu, ref_mu, rtol=rtol, atol=rtol)
    else:
        assert out.mu is None
    assert_y_close(out.y, ref_y, dtype)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("gamma_dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gamma_dtype_and_zero_centered(norm_type, gamma_dtype, zero_centered, rng):
    x, gamma, beta = make(rng, (33, 256), ml_dtypes.bfloat16, gamma_dtype)
    if zero_centered:
        gamma = (gamma.astype(np.float32) - 1).astype(gamma_dtype)
    out = norm_forward(x, gamma, args_for(norm_type, beta), norm_type=norm_type,
                       zero_centered_gamma=zero_centered)
    ref_y, _, _ = norm_ref(jnp.asarray(x), gamma, beta, norm_type, zero_centered)
    assert_y_close(out.y, ref_y, ml_dtypes.bfloat16)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-6, 10.0])
def test_epsilon_and_constant_rows(norm_type, eps, rng):
    x, gamma, beta = make(rng, (6, 300), np.float32)
    x[1] = 3.25  # layernorm: var = 0 exactly
    x[2] = 0.0  # rmsnorm: mean(x^2) = 0
    out = norm_forward(x, gamma, args_for(norm_type, beta), norm_type=norm_type, epsilon=eps)
    ref_y, _, ref_rs = norm_ref(jnp.asarray(x), gamma, beta, norm_type, eps=eps)
    np.testing.assert_allclose(out.rsigma, ref_rs, rtol=stat_rtol(300))
    finite = np.isfinite(np.asarray(ref_y)).all(-1)
    assert_y_close(np.asarray(out.y)[finite], np.asarray(ref_y)[finite], np.float32)
    if eps == 0.0:  # 0 * inf: NaN rows, as in the reference
        assert np.isinf(np.asarray(out.rsigma)[2 if norm_type == "rmsnorm" else 1])


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("qdtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_quantized_outputs_exact_from_fp32_y(norm_type, qdtype, rng):
    x, gamma, beta = make(rng, (37, 264), np.float32)
    x[5, 7] = 400.0  # an outlier: saturates after scaling
    scale = np.float32(30.0)
    out = jax.jit(lambda x, g, b, s: norm_forward(
        x, g, b, norm_type=norm_type, quant_scale=s, quant_dtype=qdtype, colwise=True))(
        x, gamma, args_for(norm_type, beta), scale)
    y = np.asarray(out.y)
    fmax = float(ml_dtypes.finfo(qdtype).max)
    expect = np.clip(y * scale, -fmax, fmax).astype(qdtype)
    np.testing.assert_array_equal(np.asarray(out.q_rowwise).view(np.uint8), expect.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(out.q_colwise).view(np.uint8),
                                  expect.T.view(np.uint8))
    assert out.amax.shape == (1,) and float(out.amax[0]) == float(np.abs(y).max())
    ref_y, _, _ = norm_ref(jnp.asarray(x), gamma, beta, norm_type)
    ref_q = np.clip(np.asarray(ref_y) * scale, -fmax, fmax).astype(qdtype)
    assert_codes_close(out.q_rowwise, ref_q)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_quantized_low_precision_input_and_no_y(dtype, rng):
    x, gamma, beta = make(rng, (65, 1000), dtype)
    out = norm_forward(x, gamma, beta, quant_scale=np.float32(8.0), return_y=False,
                       rowwise=False, colwise=True)
    assert out.y is None and out.q_rowwise is None and out.q_colwise.shape == (1000, 65)
    ref_y, _, _ = norm_ref(jnp.asarray(x), gamma, beta, "layernorm")
    ref_q = np.clip(np.asarray(ref_y) * 8.0, -448, 448).astype(jnp.float8_e4m3fn)
    assert_codes_close(np.asarray(out.q_colwise).T, ref_q)
    np.testing.assert_allclose(out.amax[0], np.abs(np.asarray(ref_y)).max(), rtol=1e-5)


def test_amax_nan_wins(rng):
    x, gamma, beta = make(rng, (4, 128), np.float32)
    x[2, 3] = np.nan
    out = norm_forward(x, gamma, beta, quant_scale=np.float32(1.0))
    assert np.isnan(float(out.amax[0]))


def _custom_vjp_norm(norm_type, zero_centered):
    @jax.custom_vjp
    def f(x, gamma, beta):
        return norm_forward(x, gamma, args_for(norm_type, beta), norm_type=norm_type,
                            zero_centered_gamma=zero_centered).y

    def fwd(x, gamma, beta):
        o = norm_forward(x, gamma, args_for(norm_type, beta), norm_type=norm_type,
                         zero_centered_gamma=zero_centered)
        return o.y, (x, o.mu, o.rsigma, gamma, beta)

    def bwd(res, dz):
        x, mu, rs, gamma, beta = res
        dx, dg, db = norm_backward(dz, x, mu, rs, gamma, norm_type=norm_type,
                                   zero_centered_gamma=zero_centered)
        return dx, dg, jnp.zeros_like(beta) if db is None else db

    f.defvjp(fwd, bwd)
    return f


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(1, 128), (5, 200), (257, 1000), (3, 4096)], ids=str)
def test_backward_matches_jax_vjp(norm_type, zero_centered, shape, rng):
    x, gamma, beta = make(rng, shape, np.float32)
    dz = rng.standard_normal(shape).astype(np.float32)
    ref = lambda x, g, b: norm_ref(x, g, b, norm_type, zero_centered)[0]  # noqa: E731
    _, vjp = jax.vjp(ref, jnp.asarray(x), jnp.asarray(gamma), jnp.asarray(beta))
    rdx, rdg, rdb = vjp(jnp.asarray(dz))
    o = norm_forward(x, gamma, args_for(norm_type, beta), norm_type=norm_type,
                     zero_centered_gamma=zero_centered)
    dx, dg, db = jax.jit(lambda *a: norm_backward(*a, norm_type=norm_type,
                                                  zero_centered_gamma=zero_centered))(
        dz, x, o.mu, o.rsigma, gamma)
    scale = np.abs(np.asarray(rdx)).max()
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(dg, rdg, rtol=1e-4, atol=1e-5 * np.abs(rdg).max())
    if norm_type == "layernorm":
        np.testing.assert_allclose(db, rdb, rtol=1e-4, atol=1e-5 * np.abs(rdb).max())
    else:
        assert db is None


@pytest.mark.parametrize("norm_type", NORMS)
def test_check_grads_through_custom_vjp(norm_type, rng):
    x, gamma, beta = make(rng, (4, 128), np.float32)
    f = _custom_vjp_norm(norm_type, False)
    jax.test_util.check_grads(f, (x, gamma, beta), order=1, modes=["rev"], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
def test_backward_low_precision(dtype, rng):
    x, gamma, beta = make(rng, (31, 520), dtype, dtype)
    dz = rng.standard_normal(x.shape).astype(dtype)
    o = norm_forward(x, gamma, beta)
    dx, dg, db = norm_backward(dz, x, o.mu, o.rsigma, gamma)
    assert dx.dtype == dtype and dg.dtype == dtype and db.dtype == dtype
    ref = lambda x, g, b: norm_ref(x, g, b, "layernorm")[0]  # noqa: E731
    _, vjp = jax.vjp(ref, *(jnp.asarray(a, jnp.float32) for a in (x, gamma, beta)))
    rdx, rdg, rdb = vjp(jnp.asarray(dz, jnp.float32))
    tol = 2 * ULP[np.dtype(dtype)]
    for got, want in ((dx, rdx), (dg, rdg), (db, rdb)):
        got, want = np.asarray(got, np.float32), np.asarray(want)
        assert np.all(np.abs(got - want) <= tol * (np.abs(want) + 1e-2 * np.abs(want).max()))


def test_vmap_forward_and_backward(rng):
    x, gamma, beta = make(rng, (3, 5, 128), ml_dtypes.bfloat16)
    f = lambda x: norm_forward(x, gamma, beta)  # noqa: E731
    got, want = jax.jit(jax.vmap(f))(x), f(x)
    for a, b in ((got.y, want.y), (got.mu, want.mu), (got.rsigma, want.rsigma)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got1 = jax.vmap(f, in_axes=1, out_axes=1)(x)
    np.testing.assert_array_equal(np.asarray(got1.y), np.asarray(want.y))
    # per-example gamma and quantization: mapped one example at a time
    gammas = np.stack([gamma, gamma * 2]).astype(np.float32)
    xs = x[:2]
    g = jax.vmap(lambda x, g: norm_forward(x, g, beta.astype(np.float32),
                                           quant_scale=np.float32(4.0), colwise=True))(xs, gammas)
    for i in range(2):
        o = norm_forward(xs[i], gammas[i], beta.astype(np.float32), quant_scale=np.float32(4.0),
                         colwise=True)
        for a, b in zip(jax.tree.map(lambda v: v[i], g), o):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    dz = rng.standard_normal(x.shape).astype(x.dtype)
    bwd = lambda dz, x, mu, rs: norm_backward(dz, x, mu, rs, gamma)  # noqa: E731
    vdx, vdg, vdb = jax.vmap(bwd)(dz, x, want.mu, want.rsigma)
    for i in range(x.shape[0]):
        dx, dg, db = bwd(dz[i], x[i], want.mu[i], want.rsigma[i])
        np.testing.assert_array_equal(np.asarray(vdx[i]), np.asarray(dx))
        np.testing.assert_array_equal(np.asarray(vdg[i]), np.asarray(dg))
        np.testing.assert_array_equal(np.asarray(vdb[i]), np.asarray(db))


MESH_SPECS = [P("a", "b", None), P(("a", "b"), None, None), P("a", None, "b"), P()]


# Both sides on CPU devices: with a GPU present, an uncommitted unsharded call would run on
# the GPU (other row-sum order, other rounding) while the mesh is made of CPU devices.
@pytest.mark.parametrize("spec", MESH_SPECS, ids=str)
@pytest.mark.parametrize("norm_type", NORMS)
def test_sharded_forward_equals_unsharded(spec, norm_type, rng, cpu):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x, gamma, beta = make(rng, (8, 12, 256), np.float32)
    x[5, 3, 17] = 50.0
    f = jax.jit(lambda x, g, b: norm_forward(x, g, b, norm_type=norm_type,
                                             quant_scale=np.float32(2.0), colwise=True))
    with jax.default_device(cpu):
        want = f(*jax.device_put((x, gamma, args_for(norm_type, beta)), cpu))
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        got = f(xs, gamma, args_for(norm_type, beta))
        hlo = f.lower(xs, gamma, args_for(norm_type, beta)).compile().as_text()
    for a, b in zip(got, want):
        if a is not None:
            assert a.devices() <= set(mesh.devices.flat) and b.devices() == {cpu}
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert "lowbit_norm_forward" in hlo
    rows_sharded = spec != P() and (spec[0] is not None or spec[1] is not None)
    assert ("all-reduce" in hlo) == rows_sharded  # the amax pmax, nothing else
    hidden_sharded = len(spec) == 3 and spec[2] is not None
    assert ("all-gather" in hlo) == hidden_sharded


@pytest.mark.parametrize("spec", MESH_SPECS, ids=str)
@pytest.mark.parametrize("norm_type", NORMS)
def test_sharded_backward_equals_unsharded(spec, norm_type, rng, cpu):
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu")[:4])
    x, gamma, beta = make(rng, (8, 12, 256), np.float32)
    dz = rng.standard_normal(x.shape).astype(np.float32)
    f = jax.jit(lambda *a: norm_backward(*a, norm_type=norm_type))
    sh = NamedSharding(mesh, spec)
    row_sh = NamedSharding(mesh, P(*spec[:2]))
    with jax.default_device(cpu):
        o = run_on(cpu, lambda x: norm_forward(x, gamma, args_for(norm_type, beta),
                                               norm_type=norm_type), x)
        want = f(*jax.device_put((dz, x, o.mu, o.rsigma, gamma), cpu))
        args = (jax.device_put(dz, sh), jax.device_put(x, sh),
                None if o.mu is None else jax.device_put(o.mu, row_sh),
                jax.device_put(o.rsigma, row_sh), gamma)
        got = f(*args)
        lowered = f.lower(*args)
        hlo = lowered.compile().as_text()
    assert got[0].devices() <= set(mesh.devices.flat) and want[0].devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(got[1:], want[1:]):
        if a is not None:  # psum of per-shard sums: a different summation order
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())
    rows_sharded = spec != P() and (spec[0] is not None or spec[1] is not None)
    assert ("all-reduce" in hlo) == rows_sharded
    assert ("all-gather" in hlo) == (len(spec) == 3 and spec[2] is not None)
    # The workspace result is sized from the per-device shape (the lowering runs after
    # partitioning): rows per device = 96 / (devices sharding the rows).
    row_devices = 1
    for e in spec[:2]:  # every mesh axis has 2 devices
        row_devices *= 1 if e is None else 2 ** len(e) if isinstance(e, tuple) else 2
    per_device = norm_backward_workspace_bytes(np.float32, 96 // row_devices, 256)
    assert f"u8[{per_device}]" in hlo, hlo


# ---------------------------------------------------------------- backward workspace

# (dtype, rows, hidden) -> bytes; the same table is in csrc/norm/norm_test.cc
# (NormPlan.BackwardWorkspaceBytes). One partial row per block: (1, 128), (3, 200),
# (300, 1001) and (65, 16384) f32 have fewer row tiles than an H100 has resident blocks, so
# they equal what its launcher uses; the others hit the 512-block cap.
WORKSPACE_CASES = [(np.float32, 1, 128, 1024), (np.float32, 3, 200, 1600),
                   (np.float16, 16384, 1024, 4194304), (np.float32, 65, 16384, 8519680),
                   (ml_dtypes.bfloat16, 300, 1001, 600600), (np.float32, 0, 128, 0),
                   (np.float32, 100000, 16384, 67108864), (ml_dtypes.bfloat16, 5, 20000, 0),
                   (ml_dtypes.bfloat16, 16384, 4096, 16777216)]


@pytest.mark.parametrize("dtype,rows,hidden,nbytes", WORKSPACE_CASES, ids=str)
def test_backward_workspace_bytes(dtype, rows, hidden, nbytes):
    assert norm_backward_workspace_bytes(dtype, rows, hidden) == nbytes


def test_backward_workspace_is_an_extra_dropped_result(rng):
    """The lowering adds a u8 workspace result to the custom call; the op returns 3 arrays.
    The CPU handler rejects a size other than C++'s (checked on every CPU backward call)."""
    x, gamma, beta = make(rng, (2, 3, 200), np.float32)
    o = norm_forward(x, gamma, beta)
    f = jax.jit(lambda *a: norm_backward(*a))
    text = f.lower(x, x, o.mu, o.rsigma, gamma).as_text()
    assert f"tensor<{norm_backward_workspace_bytes(np.float32, 6, 200)}xui8>" in text
    assert len(f(x, x, o.mu, o.rsigma, gamma)) == 3
    # zero rows: no workspace, dgamma/dbeta are zeros
    z = jnp.zeros((0, 200), jnp.float32)
    dx, dg, db = norm_backward(z, z, jnp.zeros(0), jnp.zeros(0), gamma)
    assert dx.shape == (0, 200) and not np.asarray(dg).any() and not np.asarray(db).any()


def test_bad_input():
    x = jnp.ones((4, 128), jnp.float32)
    g, b = jnp.ones(128), jnp.zeros(128)
    with pytest.raises(ValueError, match=r"lowbit.ops.norm_forward: beta: rmsnorm takes no beta"):
        norm_forward(x, g, b, norm_type="rmsnorm")
    with pytest.raises(ValueError, match=r"lowbit.ops.norm_forward: beta: layernorm needs beta"):
        norm_forward(x, g)
    with pytest.raises(ValueError, match=r"lowbit.ops.norm_forward: gamma: expected shape \(128,\)"):
        norm_forward(x, jnp.ones(127), b)
    with pytest.raises(TypeError, match=r"lowbit.ops.norm_forward: x: expected float32"):
        norm_forward(jnp.ones((4, 128), jnp.int32), g, b)
    with pytest.raises(ValueError, match=r"lowbit.ops.norm_forward: norm_type: expected"):
        norm_forward(x, g, b, norm_type="batchnorm")
    with pytest.raises(ValueError, match=r"hidden size 20000 is outside the supported range"):
        norm_forward(jnp.ones((2, 20000)), jnp.ones(20000), jnp.zeros(20000))
    with pytest.raises(TypeError, match=r"gamma: expected float32 or x's dtype"):
        norm_forward(x.astype(jnp.bfloat16), g.astype(jnp.float16), b.astype(jnp.float16))
    with pytest.raises(TypeError, match=r"quant_dtype"):
        norm_forward(x, g, b, quant_scale=np.float32(1), quant_dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"lowbit.ops.norm_backward: mu: layernorm needs mu"):
        norm_backward(x, x, None, jnp.ones(4), g)


def test_ffi_rejects_hidden_beyond_maximum():
    """The handler's own check (the Python layer checks first in normal use)."""
    from lowbit.ops.norm import _Fwd, norm_fwd_p

    cfg = _Fwd(1, False, 1e-6, None, True, True, False)
    x = jnp.ones((2, 20000), jnp.float32)
    with pytest.raises(Exception, match=r"lowbit_norm_forward: x: hidden size 20000 exceeds "
                                         r"the supported maximum 16384"):
        jax.block_until_ready(norm_fwd_p.bind(x, jnp.ones(20000), jnp.zeros(0), jnp.zeros(0),
                                              **cfg.params()))


# ---------------------------------------------------------------- CUDA vs CPU
# Both backends share the elementwise code (norm_math.h, no FMA contraction); they differ
# only in the order of the row sums (sequential vs tree) and of the dgamma/dbeta sums
# (row order vs two-stage partials). So: mu/rsigma within stat_rtol; y within one ulp of
# its dtype plus the statistics' error; FP8 codes within one code, at a fraction <= 1e-3
# of elements (rounding boundaries crossed by the ~1e-6 relative y difference); amax
# within 2 * stat_rtol; dx like y; dgamma/dbeta within 1e-4 of the column's sum of |terms|.

# hidden 1001 and 4097 (not a multiple of 8) take the scalar, unaligned kernels.
GPU_SHAPES = [(1, 128), (3, 200), (257, 1000), (1031, 4096), (333, 8192), (65, 16384),
              (300, 1001), (129, 4097)]


def _gpu_case(norm_type, dtype, shape, rng, gamma_dtype=np.float32, colwise=True):
    x, gamma, beta = make(rng, shape, dtype, gamma_dtype)
    fwd = lambda x, g, b: norm_forward(  # noqa: E731
        x, g, b, norm_type=norm_type, quant_scale=np.float32(40.0), colwise=colwise)
    return x, gamma, args_for(norm_type, beta), fwd


# Forward only: the colwise transposed stores of the CUDA kernel take 16-byte column blocks
# when rows % 16 == 0 (full 32-row tiles, and a last tile of 16 rows at 1040), 4-byte words
# when rows % 4 == 0 (1028: a last tile of 4 rows), bytes otherwise; 16-row tiles at 8192.
GPU_FWD_SHAPES = GPU_SHAPES + [(1040, 4096), (1028, 2048), (96, 8192), (64, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", GPU_FWD_SHAPES, ids=str)
def test_cuda_forward_equals_cpu(norm_type, dtype, shape, rng, cpu, gpu):
    x, gamma, beta, fwd = _gpu_case(norm_type, dtype, shape, rng)
    assert_forward_matches(run_on(gpu, fwd, x, gamma, beta), run_on(cpu, fwd, x, gamma, beta),
                           norm_type, dtype, shape[-1], ("q_rowwise", "q_colwise"))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["rowwise_only", "colwise_only_no_y", "no_quant",
                                     "bf16_gamma", "zero_centered", "e5m2"])
def test_cuda_forward_variants(variant, rng, cpu, gpu):
    x, gamma, beta = make(rng, (515, 2048), ml_dtypes.bfloat16,
                          ml_dtypes.bfloat16 if variant == "bf16_gamma" else np.float32)
    kw = dict(quant_scale=np.float32(16.0))
    kw.update({"rowwise_only": {}, "colwise_only_no_y": dict(rowwise=False, colwise=True,
                                                              return_y=False),
               "no_quant": dict(quant_scale=None), "bf16_gamma": dict(colwise=True),
               "zero_centered": dict(zero_centered_gamma=True, colwise=True),
               "e5m2": dict(quant_dtype=jnp.float8_e5m2, colwise=True)}[variant])
    fwd = lambda x, g, b: norm_forward(x, g, b, **kw)  # noqa: E731
    g, c = run_on(gpu, fwd, x, gamma, beta), run_on(cpu, fwd, x, gamma, beta)
    for a, b in zip(g, c):
        assert (a is None) == (b is None)
        if a is None:
            continue
        if a.dtype.itemsize == 1:
            assert_codes_close(a, b)
        else:
            tol = ULP[np.dtype(a.dtype)] if a.dtype != np.float32 else stat_rtol(2048)
            b32 = b.astype(np.float32)
            assert np.all(np.abs(a.astype(np.float32) - b32) <= tol * (np.abs(b32) + np.abs(b32).max() * 0.01))


# The forward's launch tuning (LOWBIT_NORM_FWD_VARIANT, csrc/norm/norm_plan.h; benchmarked
# by bench/bench_norm.py --variants): every variant must agree with the CPU reference like
# the default. Shapes: one- and two-chunk rows, masked lanes (1000), one-warp rows (200,
# 128), rows spread thinly over blocks; colwise: column segments of 32, 64 or 128 rows
# (colspan) from one block or a cluster of up to 16 blocks reading each other's codes
# (coltile=32, 16, 8, 4; 4 with colspan=128 is capped at 16 blocks, 64 rows), cluster tiles
# contiguous or interleaved over the clusters (colorder), the barrier after the transposed
# stores whole or split (colsplit), block tiles chosen to leave L1 to gamma/beta or not
# (l1keep); 16-byte column stores (rows % 16 == 0: 1040, 272 and 80,
# whose last tiles have 16 or 80 rows), 4-byte stores or bytes (333, 257, 65 rows).
# The default launch is the parkeep=1 kernel (parstages=3 row stages); the settings of the
# per-row gamma/beta kernel name parkeep=0.
FWD_VARIANTS = ["parkeep=0,items=8", "parkeep=0,items=8,stages=2", "parkeep=0,items=16,stages=3",
                "parkeep=0,items=16,stages=4", "parkeep=0,stages=1", "parkeep=0,items=16,block=256",
                "parkeep=0,items=16,block=1024", "parkeep=0,items=8,colblock=512",
                "parkeep=0,colblock=256,stages=4", "parkeep=0,colblock=1024,stages=3",
                "parkeep=0,coltile=32", "parkeep=0,coltile=16", "parkeep=0,coltile=8",
                "parkeep=0,coltile=4,colblock=1024", "parkeep=0,items=8,coltile=8",
                "parkeep=0,colspan=32,colorder=0,colsplit=0,l1keep=0",
                "parkeep=0,colspan=32,coltile=8", "parkeep=0,colspan=64",
                "parkeep=0,colspan=64,colorder=0,coltile=16",
                "parkeep=0,colspan=128,colsplit=0,coltile=4", "parkeep=0,colsplit=0,colblock=1024",
                "parkeep=0,l1keep=0,colorder=0", "items=8,parkeep=1",
                "parstages=2", "parstages=1,coltile=8", "parstages=4,colblock=256", "parstages=0"]
FWD_VARIANT_SHAPES = [(3, 200), (272, 128), (257, 1000), (1040, 4096), (333, 8192), (80, 8192),
                      (65, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", FWD_VARIANTS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", FWD_VARIANT_SHAPES, ids=str)
def test_cuda_forward_tuning_variants(variant, norm_type, dtype, shape, rng, cpu, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", variant)
    x, gamma, beta = make(rng, shape, dtype)
    beta = args_for(norm_type, beta)
    # The three kernels: colwise (its own block size and tiles), rowwise only, plain.
    for kw in (dict(quant_scale=np.float32(40.0), colwise=True),
               dict(quant_scale=np.float32(40.0)), {}):
        fwd = lambda x, g, b: norm_forward(x, g, b, norm_type=norm_type, **kw)  # noqa: E731
        assert_forward_matches(run_on(gpu, fwd, x, gamma, beta), run_on(cpu, fwd, x, gamma, beta),
                               norm_type, dtype, shape[-1],
                               ("q_rowwise",) * ("quant_scale" in kw) + ("q_colwise",) * bool(kw.get("colwise")))


# Settings that keep the items per thread (so the order of the row sums) and the
# elementwise math: gamma/beta staged in shared memory (parsmem: colwise, and the rowwise /
# plain kernels of > 8 items per thread; where the parameters do not fit beside two row
# stages and a 4-row tile, e.g. 16384 layernorm colwise, they are loaded per row), cluster barriers ordering
# shared memory only (colbar, split or whole), one block of 1024 threads per SM
# (colblock=1024: 4096 takes one 32-row tile without a cluster), gamma/beta held in
# registers by the colwise kernel (parkeep: blocks of <= 512 threads, one or more row
# groups, with or without a cluster; 16384 falls back to per-row loads). Each kernel's
# outputs (colwise, rowwise only, plain) must equal the default launch's bit for bit, and
# the CPU reference within its tolerances.
EXACT_FWD_VARIANTS = ["parkeep=0,parsmem=1", "parkeep=0,colbar=1", "parkeep=0,parsmem=1,colbar=1,colsplit=0",
                      "parkeep=0,parsmem=1,colblock=1024", "parkeep=0,colblock=1024,coltile=16,colbar=1",
                      "parkeep=0,parsmem=1,coltile=4,colspan=64,colbar=1,block=1024",
                      "parkeep=1,coltile=4,colspan=64,colsplit=0", "parkeep=0", "parkeep=0,stages=3",
                      "parstages=2"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", EXACT_FWD_VARIANTS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("gamma_like_x,zero_centered", [(False, False), (True, True)])
@pytest.mark.parametrize("shape", [(1040, 4096), (333, 8192), (80, 8192), (65, 16384), (515, 2048)],
                         ids=str)
def test_cuda_forward_variants_bit_identical(variant, norm_type, dtype, gamma_like_x,
                                             zero_centered, shape, rng, cpu, gpu, monkeypatch):
    x, gamma, beta = make(rng, shape, dtype, dtype if gamma_like_x else np.float32)
    beta = args_for(norm_type, beta)
    for kw in (dict(quant_scale=np.float32(40.0), colwise=True),
               dict(quant_scale=np.float32(40.0)), {}):
        fwd = lambda x, g, b: norm_forward(  # noqa: E731
            x, g, b, norm_type=norm_type, zero_centered_gamma=zero_centered, **kw)
        monkeypatch.delenv("LOWBIT_NORM_FWD_VARIANT", raising=False)
        default = run_on(gpu, fwd, x, gamma, beta)
        monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", variant)
        got = run_on(gpu, fwd, x, gamma, beta)
        for name in ("y", "mu", "rsigma", "q_rowwise", "q_colwise", "amax"):
            a, b = getattr(got, name), getattr(default, name)
            assert (a is None) == (b is None), (name, kw)
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, (name, kw)
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8),
                                              err_msg=f"{name} {kw}")
        assert_forward_matches(got, run_on(cpu, fwd, x, gamma, beta), norm_type, dtype, shape[-1],
                               ("q_rowwise",) * ("quant_scale" in kw)
                               + ("q_colwise",) * bool(kw.get("colwise")))


# The parkeep=1 and parkeep=0 kernels in more combinations (one or more row groups,
# clusters of 1 to 16 blocks, contiguous or interleaved tiles, row stages, gamma/beta in
# shared memory) on special values: inf, NaN, zeros, subnormals and near-max x planted at
# random (random_with_specials), plus a zero row, a constant row and a row whose sums
# overflow; odd row counts. Every output must equal the default launch's bit for bit (the
# same elementwise code and sum order: NaN chunks take the same codec path); against the
# CPU reference the NaN pattern of y and the y of the rows without planted values agree.
# Not named *variants*: tools/gpu_check.sh's memcheck selection takes only the three of
# them in EXACT_FWD_VARIANTS.
SPECIAL_FWD_VARIANTS = ["parkeep=1", "parkeep=1,coltile=16,stages=3",
                        "parkeep=1,coltile=4,colspan=64,colsplit=0",
                        "parkeep=1,colblock=256,colbar=0", "parkeep=1,parstages=4", "parkeep=0",
                        "parkeep=0,colorder=0,stages=3", "parkeep=0,parsmem=1"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SPECIAL_FWD_VARIANTS)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(333, 8192), (1041, 4096), (517, 2048)], ids=str)
def test_cuda_forward_tuning_special_values(variant, norm_type, dtype, shape, rng, cpu, gpu,
                                            monkeypatch):
    x = random_with_specials(rng, shape, dtype)
    x[5] = 0
    x[6] = 1.5
    x[7] = ml_dtypes.finfo(dtype).max
    _, gamma, beta = make(rng, shape, dtype)
    beta = args_for(norm_type, beta)
    fwd = lambda x, g, b: norm_forward(  # noqa: E731
        x, g, b, norm_type=norm_type, quant_scale=np.float32(40.0), colwise=True)
    monkeypatch.delenv("LOWBIT_NORM_FWD_VARIANT", raising=False)
    default = run_on(gpu, fwd, x, gamma, beta)
    monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", variant)
    got = run_on(gpu, fwd, x, gamma, beta)
    for name in ("y", "mu", "rsigma", "q_rowwise", "q_colwise", "amax"):
        a, b = getattr(got, name), getattr(default, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    ref = run_on(cpu, fwd, x, gamma, beta)
    y, ref_y = got.y.astype(np.float32), ref.y.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref_y))
    xf = np.abs(x.astype(np.float32))
    plain = np.all((xf < 1e3) & ((xf == 0) | (xf > 1e-30)), axis=1)  # no planted special
    assert plain.sum() > shape[0] // 2 and plain[5] and plain[6] and not plain[7]
    assert_y_close(y[plain], ref_y[plain], dtype)


@pytest.mark.gpu
def test_cuda_forward_bad_tuning_variant(rng, gpu, monkeypatch):
    monkeypatch.setenv("LOWBIT_NORM_FWD_VARIANT", "stages=9")
    x, gamma, beta = make(rng, (8, 256), ml_dtypes.bfloat16)
    with pytest.raises(Exception, match=r"lowbit_norm_forward: LOWBIT_NORM_FWD_VARIANT: bad entry 'stages=9'"):
        run_on(gpu, lambda x: norm_forward(x, gamma, beta), x)


@pytest.mark.gpu
def test_cuda_forward_nan(rng, cpu, gpu):
    x, gamma, beta = make(rng, (64, 1024), ml_dtypes.bfloat16)
    x[7, 9] = np.nan
    fwd = lambda x: norm_forward(x, gamma, beta, quant_scale=np.float32(1.0), colwise=True)  # noqa: E731
    g, c = run_on(gpu, fwd, x), run_on(cpu, fwd, x)
    assert np.isnan(g.amax[0]) and np.isnan(c.amax[0])
    np.testing.assert_array_equal(np.isnan(g.y.astype(np.float32)), np.isnan(c.y.astype(np.float32)))


# Backward: 16384 x 1024 (8 row groups per block, many rows per group) and 4099 x 256 (32
# single-warp groups per block for bf16/f16, a masked last tile) exercise the next-row
# prefetch across tiles and the in-block sum of the groups' dgamma/dbeta.
GPU_BWD_SHAPES = GPU_SHAPES + [(16384, 1024), (4099, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", GPU_BWD_SHAPES, ids=str)
def test_cuda_backward_equals_cpu(norm_type, dtype, shape, rng, cpu, gpu):
    _check_cuda_backward(norm_type, dtype, shape, rng, cpu, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma_dtype,zero_centered", [(ml_dtypes.bfloat16, False),
                                                       (ml_dtypes.bfloat16, True),
                                                       (np.float32, True)], ids=str)
def test_cuda_backward_gamma_variants(gamma_dtype, zero_centered, rng, cpu, gpu):
    _check_cuda_backward("layernorm", ml_dtypes.bfloat16, (515, 2048), rng, cpu, gpu,
                         gamma_dtype=gamma_dtype, zero_centered=zero_centered)


def _check_cuda_backward(norm_type, dtype, shape, rng, cpu, gpu, gamma_dtype=np.float32,
                         zero_centered=False):
    x, gamma, beta = make(rng, shape, dtype, gamma_dtype)
    dz = rng.standard_normal(shape).astype(dtype)
    o = run_on(cpu, lambda x: norm_forward(x, gamma, args_for(norm_type, beta),
                                           norm_type=norm_type,
                                           zero_centered_gamma=zero_centered), x)
    bwd = lambda *a: norm_backward(*a, norm_type=norm_type,  # noqa: E731
                                   zero_centered_gamma=zero_centered)
    args = (dz, x, o.mu, o.rsigma, gamma)
    g, c = run_on(gpu, bwd, *args), run_on(cpu, bwd, *args)
    assert_y_close(g[0], c[0].astype(np.float32), dtype)
    xhat = (x.astype(np.float32) - (0 if o.mu is None else o.mu[..., None])) * o.rsigma[..., None]
    dzf = dz.astype(np.float32).reshape(-1, shape[-1])
    scales = [np.abs(dzf * xhat.reshape(-1, shape[-1])).sum(0), np.abs(dzf).sum(0)]
    # bf16 dgamma/dbeta: the two fp32 sums may round to neighbouring bf16 values.
    rounding = 0.0 if np.dtype(gamma_dtype) == np.float32 else ULP[np.dtype(gamma_dtype)]
    for got, want, s in zip(g[1:], c[1:], scales):
        if want is not None:
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.all(np.abs(got - want) <= 1e-4 * s + rounding * np.abs(want) + 1e-30)
    again = run_on(gpu, bwd, *args)  # deterministic dx and dgamma/dbeta
    for a, b in zip(again, g):
        if b is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
