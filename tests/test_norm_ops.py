"""lowbit.ops.norm_forward / norm_backward against a jnp reference: values and gradients for
both norm types, zero-centered gamma, dtypes, odd shapes, epsilon edge cases, the fused
FP8 outputs, jit, vmap, sharding over virtual CPU devices, the backward workspace, bad input
(tests/test_norm_ops_cuda.py compares the CUDA kernels with the CPU reference on a GPU).

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
from conftest import run_on
from jax.sharding import NamedSharding, PartitionSpec as P
from norm_reference import (DTYPES, NORMS, ULP, args_for, assert_codes_close, assert_y_close, make,
                            norm_ref, stat_rtol)

from lowbit.ops import norm_backward, norm_forward
from lowbit.ops.norm import norm_backward_workspace_bytes


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
