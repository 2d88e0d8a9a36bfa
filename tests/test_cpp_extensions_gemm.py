"""lowbit.cpp_extensions.gemm, TE's `tex.gemm`: checked against a few-line jnp reference (the
operands dequantized from the copies the GEMM takes, an fp32 HIGHEST dot, rounded to the
output dtype) within a stated tolerance, for plain bf16 / f16 / f32 operands and for each
recipe's quantizers (per-tensor delayed and current, MXFP8, FP8 block), on odd shapes with
one and two contracting dims; every operand layout TE takes (lhs (M, K) or (K, M), rhs (K, N)
or (N, K)) gives the same bits, as do pre-quantized ScaledTensor2x operands, a quantizer_set
and NoScaleTensor operands; bias with fuse_bias (and, as in TE, not without it); jit; the
helpers (sanitize_dims, get_non_contracting_dims, transpose_dims, CollectiveOpSet); and bad
input, whose message names the entry point and the argument.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gemm_reference import FROBENIUS, assert_close_gemm, gemm_atol, gemm_ref
from lowbit.cpp_extensions import (CollectiveOp, CollectiveOpSet, gemm, gemm_uses_jax_dot,
                                   get_non_contracting_dims, noop_collective_op_set, sanitize_dims,
                                   transpose_dims)
from lowbit.ops.gemm import gemm as lowbit_gemm
from lowbit.quantize import NoScaleTensor, QuantizerFactory, ScaledTensor1x
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "block": Float8BlockScaling(),
}
M_SHAPE, K, N = (3, 37), 160, 48  # odd rows; K a multiple of the 32- and 128-blocks' tails


def operands(rng, dtype=ml_dtypes.bfloat16, k_shape=(K,)):
    x = jnp.asarray(rng.standard_normal((*M_SHAPE, *k_shape)) * 2, dtype)
    w = jnp.asarray(rng.standard_normal((*k_shape, N)) * 0.5, dtype)
    return x, w


def quantizers(recipe):
    qs = QuantizerFactory.create_set(RECIPES[recipe])
    x_q, k_q = qs.x, qs.kernel
    if recipe == "delayed":  # a scale other than 1
        x_q, k_q = x_q.update(jnp.array([7.0], jnp.float32)), k_q.update(jnp.array([2.0], jnp.float32))
    return x_q, k_q


def taken_copies(x_q, k_q, x, w):
    """x's rowwise and w's colwise copy, the ones the GEMM takes, dequantized to fp32 (the
    exact products of data and scales: a bf16 dq_dtype would round them)."""
    xq, _ = x_q.quantize(x, is_rowwise=True, is_colwise=False, flatten_axis=x.ndim - 1)
    wq, _ = k_q.quantize(w, is_rowwise=False, is_colwise=True, flatten_axis=1)
    return (dataclasses.replace(xq, dq_dtype=jnp.float32).dequantize(),
            dataclasses.replace(wq, dq_dtype=jnp.float32).dequantize())


def assert_gemm_of(out, xd, wd, *, fast=True, bias=None):
    """out within the accumulation model of lowbit's GEMM tests (tests/gemm_reference.py) of
    xd (M..., K) . wd (K, N), the fp32 values the GEMM multiplies: on the CPU two fp32 sums in
    different orders; on a GPU Hopper's FP8 tensor-core sums (fast: unpromoted over all of K;
    else promoted every 128 products, which block scaling always does), plus the output's
    rounding and a relative Frobenius bound."""
    a = np.asarray(xd, np.float32).reshape(-1, xd.shape[-1])
    b = np.asarray(wd, np.float32).T
    model = "cpu" if jax.default_backend() == "cpu" else ("fp8_fast" if fast else "fp8_split")
    atol = gemm_atol(a, b, 1.0, 1.0, out.dtype, model=model, bias=bias)
    want = gemm_ref(jnp.asarray(a), jnp.asarray(b), 1.0, 1.0, bias, jnp.float32)
    assert_close_gemm(np.asarray(out, np.float32).reshape(want.shape), want, atol,
                      max_rel_frobenius=FROBENIUS.get(model))


def reference(a, b, n_contract, out_dtype):
    """a (M..., K...) . b (K..., N...) in fp32 at HIGHEST, rounded to out_dtype."""
    out = jnp.tensordot(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), n_contract,
                        precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def assert_close_to(got, ref, rtol):
    """|got - ref| <= rtol * max|ref| + one rounding to got's dtype (2**-8 relative for bf16,
    2**-11 for f16, none for f32): the reference sums in fp32 in another order and is not
    rounded."""
    ulp = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}.get(jnp.dtype(got.dtype), 0.0)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=ulp, atol=rtol * np.abs(ref).max())


# ---------------------------------------------------------------- unquantized


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
def test_unquantized_every_layout(dtype, rng):
    x, w = operands(rng, dtype)
    out = gemm(x, w)
    assert out.dtype == dtype and out.shape == (*M_SHAPE, N)
    # fp32 sums in another order: 1e-5 of the largest output; f16/bf16 then one rounding
    assert_close_to(out, reference(x, w, 1, jnp.float32), 1e-5)
    if dtype != np.float32:  # lowbit's own op, unquantized, with the same K-major operands
        np.testing.assert_array_equal(out, lowbit_gemm(x, w.T, out_dtype=dtype))
    xt = jnp.moveaxis(x, -1, 0)  # (K, M...)
    for lhs, rhs, dims in [(xt, w, ((0,), (0,))), (x, w.T, ((2,), (1,))), (xt, w.T, ((0,), (-1,)))]:
        np.testing.assert_array_equal(gemm(lhs, rhs, contracting_dims=dims), out)


def test_unquantized_bias_two_contracting_dims_and_jit(rng):
    x, w = operands(rng, k_shape=(5, 32))
    bias = jnp.asarray(rng.standard_normal(N), jnp.bfloat16)
    dims = ((2, 3), (0, 1))
    out = gemm(x, w, contracting_dims=dims, bias=bias, fuse_bias=True)
    ref = reference(x, w, 2, jnp.float32) + np.asarray(bias, np.float32)
    assert_close_to(out, ref, 1e-5)
    # TE adds the bias only with fuse_bias (and without grad): a bias alone changes nothing
    np.testing.assert_array_equal(gemm(x, w, contracting_dims=dims, bias=bias),
                                  gemm(x, w, contracting_dims=dims))
    jitted = jax.jit(lambda x, w, b: gemm(x, w, contracting_dims=dims, bias=b, fuse_bias=True))
    np.testing.assert_array_equal(jitted(x, w, bias), out)
    # NoScaleTensor operands (what TE's cpp_extensions return unquantized) are their data
    np.testing.assert_array_equal(gemm(NoScaleTensor(x), NoScaleTensor(w), contracting_dims=dims,
                                       bias=bias, fuse_bias=True), out)


# ---------------------------------------------------------------- quantized


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_matches_dequantized_reference(recipe, rng):
    x, w = operands(rng)
    x_q, k_q = quantizers(recipe)
    out = gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q)
    assert out.dtype == jnp.bfloat16 and out.shape == (*M_SHAPE, N)
    # the reference multiplies the very copies the GEMM takes: x's rowwise (blocks along K)
    # and w's colwise (blocks down its K columns), dequantized in fp32 (exact); per-tensor
    # FP8 at TE's default fast accumulation
    assert_gemm_of(out, *taken_copies(x_q, k_q, x, w), fast=recipe in ("delayed", "current"))
    # and within the format's error of the unquantized product (E4M3: 2**-4 per operand)
    assert_close_to(out, reference(x, w, 1, jnp.float32), 0.1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_layouts_prequantized_and_set_agree(recipe, rng):
    x, w = operands(rng)
    x_q, k_q = quantizers(recipe)
    out = gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q)
    xt, wt = jnp.moveaxis(x, -1, 0), w.T
    # every layout quantizes blocks along K, so every layout gives the same bits
    for lhs, rhs, dims in [(xt, w, ((0,), (0,))), (x, wt, ((2,), (1,))), (xt, wt, ((0,), (1,)))]:
        np.testing.assert_array_equal(gemm(lhs, rhs, dims, lhs_quantizer=x_q, rhs_quantizer=k_q), out)
    # ScaledTensor2x operands: gemm takes the copy each usage needs
    x2, _ = x_q.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=2)
    w2, _ = k_q.quantize(w, is_rowwise=True, is_colwise=True, flatten_axis=1)
    np.testing.assert_array_equal(gemm(x2, w2), out)
    np.testing.assert_array_equal(gemm(x2.rowwise_tensor, w2.colwise_tensor), out)
    # quantizer_set (TE's backward-compatible keyword) and jit
    qset = QuantizerFactory.create_set(RECIPES[recipe])._replace(x=x_q, kernel=k_q)
    np.testing.assert_array_equal(gemm(x, w, quantizer_set=qset), out)
    np.testing.assert_array_equal(jax.jit(lambda x, w: gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q))(x, w), out)


def test_delayed_quantizer_warns_that_its_amax_is_lost(rng):
    """gemm returns the product only: a delayed-scaling quantizer's amax cannot reach
    quantizer.update(), so gemm says so; a pre-quantized operand (whose amax the caller has)
    gives the same bits without the warning."""
    x, w = operands(rng)
    x_q, k_q = quantizers("delayed")
    with pytest.warns(UserWarning, match="gemm: lhs's delayed-scaling quantizer: its amax is not returned"):
        out = gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q)
    xq, _ = x_q.quantize(x, is_rowwise=True, is_colwise=False, flatten_axis=2)
    wq, _ = k_q.quantize(w, is_rowwise=False, is_colwise=True, flatten_axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*exact emulation")  # the CPU's FP8 notice
        np.testing.assert_array_equal(gemm(xq, wq), out)
    np.testing.assert_array_equal(xq.amax, jnp.max(jnp.abs(x)).astype(jnp.float32).reshape(1))


def test_quantized_bias_and_accumulation_choice(rng):
    x, w = operands(rng)
    x_q, k_q = quantizers("current")
    bias = jnp.asarray(rng.standard_normal(N), jnp.bfloat16)
    out = gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q, bias=bias, fuse_bias=True)
    plain = gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q)
    copies = taken_copies(x_q, k_q, x, w)
    assert_gemm_of(out, *copies, bias=bias)
    assert not np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    # the accumulation choice reaches the GEMM call (None: the recipe's fprop, fast by
    # default); each result is within its model; the CPU has one accumulation: equal bits
    for split in (True, False, None):
        call = jax.jit(lambda x, w: gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q,
                                         use_split_accumulator=split))
        assert f"use_split_accumulator = {str(bool(split)).lower()}" in call.lower(x, w).as_text()
        got = call(x, w)
        assert_gemm_of(got, *copies, fast=not split)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(got, plain)


# ---------------------------------------------------------------- helpers and bad input


def test_helpers():
    assert sanitize_dims(4, (-1, 0, None)) == (3, 0) and sanitize_dims(3, -2) == (1,)
    assert get_non_contracting_dims(4, (-1, 1)) == (0, 2)
    assert transpose_dims(2, (0,), flatten_axis=1) == (1,)  # TE's formula, both readings
    assert transpose_dims(3, (2,), flatten_axis=1) == (0,)
    assert transpose_dims(3, (0, 1), flatten_axis=-1) == (1, 2)
    assert transpose_dims(3, (), flatten_axis=1) == ()
    assert gemm_uses_jax_dot() is False
    assert noop_collective_op_set == CollectiveOpSet(CollectiveOp.NONE, CollectiveOp.NONE)
    ag = CollectiveOpSet.create(CollectiveOp.ALL_GATHER)
    assert ag.backward.is_reduce_scatter and ag.forward.is_all_gather
    assert CollectiveOpSet.create(CollectiveOp.REDUCE_SCATTER).backward == CollectiveOp.ALL_GATHER


def test_bad_input(rng):
    x, w = operands(rng)
    x_q, k_q = quantizers("current")
    x2, _ = x_q.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=2)
    cases = [
        (ValueError, "collective_op: only CollectiveOp.NONE",
         lambda: gemm(x, w, collective_op=CollectiveOp.ALL_GATHER)),
        (ValueError, "fuse_gelu: only False", lambda: gemm(x, w, fuse_gelu=True)),
        (ValueError, "grad: only False", lambda: gemm(x, w, grad=True)),
        (TypeError, "unexpected keyword 'precision'", lambda: gemm(x, w, precision=None)),
        (TypeError, "use_split_accumulator: expected a bool",
         lambda: gemm(x, w, lhs_quantizer=x_q, rhs_quantizer=k_q, use_split_accumulator="yes")),
        (ValueError, "contracting_dims: lhs's .* must be its leading or its trailing",
         lambda: gemm(jnp.moveaxis(x, -1, 1), w, ((1,), (0,)))),
        (ValueError, "contracting_dims: lhs's .* not consecutive",
         lambda: gemm(x.reshape(3, 37, 5, 32), w.reshape(5, 32, N), ((1, 3), (0, 1)))),
        (ValueError, "contracting_dims: .* contract different sizes", lambda: gemm(x, w[:-1])),
        (ValueError, "contracting_dims: rhs's .* leave it no free dim", lambda: gemm(x, w[:, 0], ((2,), (0,)))),
        (ValueError, "rhs_quantizer: a quantized GEMM needs both", lambda: gemm(x, w, lhs_quantizer=x_q)),
        (ValueError, "bias: expected shape \\(48,\\) and dtype bfloat16",
         lambda: gemm(x, w, bias=jnp.zeros((N,), jnp.float32), fuse_bias=True)),
        (TypeError, "rhs: unquantized operands need one dtype", lambda: gemm(x, w.astype(jnp.float32))),
        (ValueError, "lhs: get_tensor: usage: TensorUsage.LHS needs the rowwise copy",
         lambda: gemm(x2.colwise_tensor, w, rhs_quantizer=k_q)),
        (ValueError, "lhs: a copy split at flatten_axis 1 does not contract dims \\(2,\\)",
         lambda: gemm(x_q.quantize(x, is_colwise=False, flatten_axis=1)[0], w, rhs_quantizer=k_q)),
        (TypeError, "transpose_batch_sequence: expected a bool", lambda: gemm(x, w, transpose_batch_sequence=1)),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match="lowbit.cpp_extensions.gemm: " + pattern):
            call()
    assert isinstance(x2.rowwise_tensor, ScaledTensor1x)
