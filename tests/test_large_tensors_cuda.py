"""The CUDA kernels on tensors of more than 2**31 elements, where 32-bit index arithmetic would
wrap: (262400, 8192) bf16, whose last 256 rows lie past element 2**31.

Every kernel here computes rows (or 128-row tiles, 32-value blocks) independently, so each
output's last rows must equal, bit for bit, the same op's output on those 256 rows alone; the
per-tensor amax must be the maximum planted in a row past 2**31; and the sums over rows (dbias,
dgamma, dbeta) must equal the sum of the op's sums over the first 2**31 elements and over the
last rows, within fp32 summation-order tolerance. GPU only. One test runs the families in turn,
so that one pytest worker holds their ~10-25 GB at a time (tools/gpu_check.sh runs 15 workers
on one GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.ops import amax, quantize_fp8
from lowbit.ops.activation import act_backward, act_forward
from lowbit.ops.norm import norm_backward, norm_forward
from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8
from lowbit.ops.softmax import softmax_backward, softmax_forward
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import DelayedScaling, Float8BlockScaling

C = 8192
HEAD = 2**31 // C                    # rows holding the first 2**31 elements
TAIL = 256                           # rows past them (a multiple of the 128-row tiles)
R = HEAD + TAIL
PLANTED = 1000.0                     # exact in bf16; |N(0, 9)| values stay far below it

def _big(seed: int, dtype=jnp.bfloat16, scale=3.0):
    """(R, C) of N(0, scale^2) made on the GPU, PLANTED at (R - 5, 77), past element 2**31."""
    def make(key):
        x = jax.random.normal(key, (R, C), dtype) * jnp.asarray(scale, dtype)
        return x.at[R - 5, 77].set(PLANTED)
    return jax.jit(make)(jax.random.PRNGKey(seed))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _assert_tail_equal(full, small, name: str):
    """full's last rows (along the one axis where the shapes differ) == small, bit for bit."""
    assert full.ndim == small.ndim, (name, full.shape, small.shape)
    axes = [i for i, (a, b) in enumerate(zip(full.shape, small.shape)) if a != b]
    assert len(axes) == 1, (name, full.shape, small.shape)
    ax = axes[0]
    tail = jax.lax.slice_in_dim(full, full.shape[ax] - small.shape[ax], full.shape[ax], axis=ax)
    np.testing.assert_array_equal(_bits(tail), _bits(small), err_msg=name)


def _assert_sum_split(total, head, tail, name: str):
    """A sum over all rows against the sums over the head and the tail rows: fp32 partial sums
    in another order, each of the three rounded to the output's dtype (half a bf16 ulp, 2^-9 of
    each: where head and tail cancel, their roundings dominate), plus 2^-12 of the largest sum
    (leaving out the 256 tail rows, ~1/32 of a sum's spread, fails it)."""
    total, head, tail = (np.asarray(v, np.float64) for v in (total, head, tail))
    want = head + tail
    bound = 2.0**-8 * (np.abs(total) + np.abs(head) + np.abs(tail)) + 2.0**-12 * np.max(np.abs(want))
    assert np.all(np.abs(total - want) <= bound), (name, float(np.max(np.abs(total - want) - bound)))


@pytest.mark.gpu
def test_kernels_past_element_2_31(gpu):
    with jax.default_device(gpu):
        _amax_and_per_tensor_quantize()
        for kind in ("1x128", "128x128", "mxfp8"):
            _block_quantizer(kind)
        _norm_forward_and_backward()
        _activation_forward_and_backward()
        _softmax_forward_and_backward()
        for recipe in (DelayedScaling(), Float8BlockScaling()):
            _dense_forward_and_backward(recipe)


def _amax_and_per_tensor_quantize():
    x = _big(0)
    assert x.size > 2**31
    assert float(jax.jit(amax)(x)) == PLANTED
    scale = jnp.float32(0.25)
    f = jax.jit(lambda v: quantize_fp8(v, scale, rowwise=True, colwise=True, compute_dbias=True))
    full, small, head = f(x), f(x[HEAD:]), f(x[:HEAD])
    _assert_tail_equal(full.rowwise, small.rowwise, "rowwise")
    _assert_tail_equal(full.colwise, small.colwise, "colwise")
    assert float(full.amax) == PLANTED
    _assert_sum_split(full.dbias, head.dbias, small.dbias, "dbias")


def _block_quantizer(kind):
    x = _big(1)
    if kind == "mxfp8":
        f = jax.jit(lambda v: quantize_mxfp8(v, rowwise=True, colwise=True, compute_dbias=True))
    else:
        f = jax.jit(lambda v: quantize_fp8_block(v, tile_2d=kind == "128x128", rowwise=True, colwise=True,
                                                 compute_dbias=kind == "1x128"))
    full, small = f(x), f(x[HEAD:])
    for name in ("rowwise", "rowwise_scale", "colwise", "colwise_scale"):
        _assert_tail_equal(getattr(full, name), getattr(small, name), name)
    if full.dbias is not None:
        _assert_sum_split(full.dbias, f(x[:HEAD]).dbias, small.dbias, "dbias")


def _norm_forward_and_backward():
    x, dz = _big(2), _big(3, scale=1.0)
    gamma = jax.random.normal(jax.random.PRNGKey(4), (C,), jnp.float32).astype(jnp.bfloat16)
    beta = jax.random.normal(jax.random.PRNGKey(5), (C,), jnp.float32).astype(jnp.bfloat16)
    scale = jnp.float32(2.0)
    fwd = jax.jit(lambda v: norm_forward(v, gamma, beta, quant_scale=scale, rowwise=True, colwise=True))
    full, small = fwd(x), fwd(x[HEAD:])
    for name in ("y", "mu", "rsigma", "q_rowwise", "q_colwise"):
        _assert_tail_equal(getattr(full, name), getattr(small, name), name)
    # amax is max |y| before y's rounding to bf16: within its half ulp of the rounded maximum
    y_max = float(jnp.max(jnp.abs(full.y.astype(jnp.float32))))
    assert abs(float(full.amax[0]) - y_max) <= 2.0**-8 * y_max, (float(full.amax[0]), y_max)
    bwd = jax.jit(lambda d, v, mu, rs: norm_backward(d, v, mu, rs, gamma))
    dx, dgamma, dbeta = bwd(dz, x, full.mu, full.rsigma)
    dx_t, dgamma_t, dbeta_t = bwd(dz[HEAD:], x[HEAD:], small.mu, small.rsigma)
    head = fwd(x[:HEAD])
    _, dgamma_h, dbeta_h = bwd(dz[:HEAD], x[:HEAD], head.mu, head.rsigma)
    _assert_tail_equal(dx, dx_t, "dx")
    _assert_sum_split(dgamma, dgamma_h, dgamma_t, "dgamma")
    _assert_sum_split(dbeta, dbeta_h, dbeta_t, "dbeta")


def _activation_forward_and_backward():
    x, dz = _big(6), _big(7, scale=1.0)
    scale = jnp.float32(4.0)
    fwd = jax.jit(lambda v: act_forward(v, "gelu", quant_scale=scale, rowwise=True, colwise=True))
    full, small = fwd(x), fwd(x[HEAD:])
    for name in ("y", "q_rowwise", "q_colwise"):
        _assert_tail_equal(getattr(full, name), getattr(small, name), name)
    assert float(full.amax[0]) == PLANTED  # gelu(1000) = 1000
    bwd = jax.jit(lambda d, v: act_backward(d, v, "gelu", quant_scale=scale, rowwise=True, colwise=True,
                                            compute_dbias=True))
    full_b, small_b, head_b = bwd(dz, x), bwd(dz[HEAD:], x[HEAD:]), bwd(dz[:HEAD], x[:HEAD])
    for name in ("dx", "q_rowwise", "q_colwise"):
        _assert_tail_equal(getattr(full_b, name), getattr(small_b, name), name)
    _assert_sum_split(full_b.dbias, head_b.dbias, small_b.dbias, "dbias")


def _softmax_forward_and_backward():
    x, dy = _big(8)[None, None], _big(9, scale=1.0)[None, None]
    fwd = jax.jit(lambda v: softmax_forward(v, None, 0.5, "scaled"))
    y, y_t = fwd(x), fwd(x[:, :, HEAD:])
    _assert_tail_equal(y, y_t, "y")
    bwd = jax.jit(lambda d, v: softmax_backward(d, v, 0.5, "scaled"))
    _assert_tail_equal(bwd(dy, y), bwd(dy[:, :, HEAD:], y_t), "dx")


def _dense_forward_and_backward(recipe):
    """lowbit.dense with x (R, C): its GEMMs (cuBLASLt) read and write past element 2**31.
    DelayedScaling's first step casts with scale 1 and block scales are local, so the last rows
    of y and dx are those of the same dense on the last rows alone, up to the GEMMs'
    accumulation order (cuBLASLt may pick another kernel for another M): within 2 bf16 ulps."""
    x = _big(10)
    k = (jax.random.normal(jax.random.PRNGKey(11), (C, 256), jnp.float32) / 90).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(12), (R, 256), jnp.bfloat16)
    qs = QuantizerFactory.create_set(recipe)

    def loss(x, k, w):
        return jnp.sum(lowbit.dense(x, k, quantizer_set=qs).astype(jnp.float32) * w.astype(jnp.float32))

    step = jax.jit(lambda x, k, w: (lowbit.dense(x, k, quantizer_set=qs), jax.grad(loss, (0, 1))(x, k, w)))
    y, (dx, dk) = step(x, k, w)
    y_t, (dx_t, dk_t) = step(x[HEAD:], k, w[HEAD:])
    _, (_, dk_h) = step(x[:HEAD], k, w[:HEAD])
    name = type(recipe).__name__
    for full, small, what in ((y, y_t, "y"), (dx, dx_t, "dx")):
        tail = np.asarray(full[HEAD:], np.float32)
        small = np.asarray(small, np.float32)
        np.testing.assert_allclose(tail, small, rtol=2.0**-7, atol=2.0**-7 * float(np.max(np.abs(small))),
                                   err_msg=f"{name} {what}")
    _assert_sum_split(dk, dk_h, dk_t, f"{name} dk")
