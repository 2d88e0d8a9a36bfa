"""lowbit.cpp_extensions.softmax, TE's import path for its softmax entry points.

Checked, on odd shapes in f32, f16 and bf16 with a scale that bf16/f16 cannot represent:
- the fused forwards against te_softmax below (TE's jax_* formula, jax.nn.softmax(scale *
  logits, where=mask != 1), in fp32 with the scale rounded to the logits' dtype as TE's
  kernels take it) within one unit in the last place of the output dtype (f32: 4e-6
  relative, the op's own tolerance in tests/test_softmax_ops.py), and bit for bit against
  lowbit.ops.softmax_forward given that rounded scale; uint8 masks with 0, 1 and 2 (only 1
  masks) and a fully masked row (zeros, as TE defines it);
- the backwards bit for bit against lowbit.ops.softmax_backward, and against jax.vjp of
  te_softmax within the bound of BWD_BOUND (the backward reads softmax_out rounded to the
  output dtype);
- TE's custom_vjp (transformer_engine/jax/softmax.py's rule) built on the shims, under jax.grad;
- the jax_* functions bit for bit against lowbit.ops.softmax.softmax_reference and against
  te_softmax, and their autodiff gradients;
- leading dims folded as TE's kernels fold them, jit, vmap, TE's kernel rule in
  is_softmax_kernel_available, and bad input (the message names the function and argument).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from softmax_reference import make, tol
from pytree_bits import assert_same_bits

from lowbit.cpp_extensions.softmax import (
    is_softmax_kernel_available, jax_general_softmax, jax_scaled_masked_softmax,
    jax_scaled_softmax, jax_scaled_upper_triang_masked_softmax, scaled_masked_softmax_bwd,
    scaled_masked_softmax_fwd, scaled_softmax_bwd, scaled_softmax_fwd,
    scaled_upper_triang_masked_softmax_bwd, scaled_upper_triang_masked_softmax_fwd)
from lowbit.ops.softmax import softmax_backward, softmax_forward, softmax_reference
from lowbit.softmax import AttnSoftmaxType, SoftmaxFusionType


def kernel_scale(scale, dtype):
    """TE's forward kernels take the scale as the logits' dtype (f16/bf16)."""
    return float(np.asarray(scale, dtype))


def te_softmax(logits, scale, mask=None, causal=False):
    """TE's jax_scaled_*_softmax in fp32: causal means mask = 1 - tril(ones)."""
    z = jnp.asarray(logits, jnp.float32) * np.float32(kernel_scale(scale, logits.dtype))
    if causal:
        mask = 1 - jnp.tril(jnp.ones(z.shape[-2:], jnp.uint8))
    return jax.nn.softmax(z, where=None if mask is None else jnp.asarray(mask) != 1)


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FUSIONS = ["scaled", "scaled_masked", "scaled_upper_triang"]
SHAPES = [(2, 3, 5, 7), (2, 3, 33, 129)]
SCALE = 1 / np.sqrt(80)  # not a bf16 or f16 value: the rounding TE's kernels do shows
FWD = {"scaled": scaled_softmax_fwd, "scaled_masked": scaled_masked_softmax_fwd,
       "scaled_upper_triang": scaled_upper_triang_masked_softmax_fwd}
OP = "lowbit.cpp_extensions."


make = functools.partial(make, te_mask=True)  # TE's uint8 masks (softmax_reference.make)


def fwd(fusion, x, mask, scale=SCALE):
    if fusion == "scaled_masked":
        return scaled_masked_softmax_fwd(x, mask, scale)
    return FWD[fusion](x, scale)


def bwd(fusion, dz, y, x, mask, scale=SCALE):
    if fusion == "scaled_masked":
        return scaled_masked_softmax_bwd(dz, y, x, mask, scale)
    if fusion == "scaled":
        return scaled_softmax_bwd(dz, y, x, scale)
    return scaled_upper_triang_masked_softmax_bwd(dz, y, x, scale)




@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_forward_matches_te_formula_and_lowbit_op(fusion, dtype, shape, rng):
    mask_batch = 1 if shape == SHAPES[1] else None  # TE's broadcast mask batch, and a full one
    x, mask = make(rng, shape, dtype, fusion, mask_batch)
    y = fwd(fusion, x, mask)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_same_bits(y, softmax_forward(x, mask, kernel_scale(SCALE, dtype), fusion))
    ref = te_softmax(x, SCALE, mask, causal=fusion == "scaled_upper_triang")
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, **tol(dtype))
    if fusion == "scaled_masked":
        assert not np.asarray(y, np.float32)[0, :, 0].any()  # fully masked row: zeros
        assert (np.asarray(y, np.float32)[0, :, 1] > 0).all()  # 2 does not mask
        assert not np.asarray(y, np.float32)[np.broadcast_to(mask == 1, shape)].any()
    if fusion == "scaled_upper_triang":
        q, k = shape[-2:]
        assert not np.asarray(y, np.float32)[..., np.arange(k)[None] > np.arange(q)[:, None]].any()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_forward_rounds_the_scale_to_the_logits_dtype(dtype, rng):
    x, _ = make(rng, SHAPES[1], dtype, "scaled")
    y = scaled_softmax_fwd(x, SCALE)
    rounded = softmax_forward(x, None, kernel_scale(SCALE, dtype), "scaled")
    assert kernel_scale(SCALE, dtype) != float(np.float32(SCALE))
    assert (np.asarray(rounded) != np.asarray(softmax_forward(x, None, SCALE, "scaled"))).any()
    assert_same_bits(y, rounded)


def bwd_bound(dz, y, ref, scale, dtype):
    """|dx - ref| bound: softmax_out's error (u |y|: u = eps / 2, its rounding to f16/bf16; f32:
    4 eps, the forward's exp, sum and division) enters y * dz, y * s and s = sum(y * dz); dx is
    rounded once more. Taken with a factor 2 margin."""
    eps = float(jnp.finfo(dtype).eps)
    u = 4 * eps if np.dtype(dtype) == np.float32 else eps / 2
    dz, y = np.asarray(dz, np.float64), np.abs(np.asarray(y, np.float64))
    s = np.abs(dz * y).sum(-1, keepdims=True)
    return 2 * (u * abs(scale) * y * (np.abs(dz) + 2 * s) + u * np.abs(ref)) + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_backward_matches_jax_vjp_and_lowbit_op(fusion, dtype, rng):
    shape = SHAPES[1]
    x, mask = make(rng, shape, dtype, fusion)
    dz = rng.standard_normal(shape).astype(dtype)
    y = fwd(fusion, x, mask)
    dx = bwd(fusion, dz, y, x, mask)
    assert dx.dtype == dz.dtype and dx.shape == dz.shape
    assert_same_bits(dx, softmax_backward(dz, y, SCALE, fusion))
    causal = fusion == "scaled_upper_triang"
    _, vjp = jax.vjp(lambda l: te_softmax(l, SCALE, mask, causal), jnp.asarray(x, jnp.float32))
    # TE's backward kernel takes the scale in fp32, its forward rounded (te_softmax's)
    ref = np.asarray(vjp(jnp.asarray(dz, jnp.float32))[0], np.float64) \
        * (SCALE / kernel_scale(SCALE, dtype))
    dx64 = np.asarray(dx, np.float64)
    assert np.abs(ref).max() > 1e-3
    assert (np.abs(dx64 - ref) <= bwd_bound(dz, y, ref, SCALE, dtype)).all()
    if fusion == "scaled_masked":
        assert not dx64[0, :, 0].any()  # fully masked row: no gradient


def te_softmax_vjp(fusion):
    """transformer_engine/jax/softmax.py's _softmax, its imports changed to lowbit's shims."""

    def fwd_rule(logits, mask, scale_factor):
        if fusion == "scaled_masked":
            output = scaled_masked_softmax_fwd(logits, mask, scale_factor)
        elif fusion == "scaled_upper_triang":
            output = scaled_upper_triang_masked_softmax_fwd(logits, scale_factor)
        else:
            output = scaled_softmax_fwd(logits, scale_factor)
        return output, (output, logits, mask)

    def bwd_rule(scale_factor, ctx, dz):
        output, logits, mask = ctx
        if fusion == "scaled_masked":
            return scaled_masked_softmax_bwd(dz, output, logits, mask, scale_factor), None
        if fusion == "scaled_upper_triang":
            return scaled_upper_triang_masked_softmax_bwd(dz, output, logits, scale_factor), None
        return scaled_softmax_bwd(dz, output, logits, scale_factor), None

    f = jax.custom_vjp(lambda logits, mask, scale: fwd_rule(logits, mask, scale)[0],
                       nondiff_argnums=(2,))
    f.defvjp(fwd_rule, bwd_rule)
    return f


@pytest.mark.parametrize("fusion", FUSIONS)
def test_te_custom_vjp_on_the_shims_under_grad(fusion, rng):
    x, mask = make(rng, SHAPES[0], np.float32, fusion)
    w = rng.standard_normal(SHAPES[0]).astype(np.float32)
    f = te_softmax_vjp(fusion)
    got = jax.jit(jax.grad(lambda l: (f(l, mask, SCALE) * w).sum()))(x)
    causal = fusion == "scaled_upper_triang"
    ref = jax.grad(lambda l: (te_softmax(l, SCALE, mask, causal) * w).sum())(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_jax_functions_match_reference_and_te_formula(fusion, dtype, rng):
    x, mask = make(rng, SHAPES[0], dtype, fusion)
    if fusion == "scaled":
        y = jax_scaled_softmax(x, SCALE)
    elif fusion == "scaled_masked":
        y = jax_scaled_masked_softmax(x, mask, SCALE)
    else:
        y = jax_scaled_upper_triang_masked_softmax(x, SCALE)
    assert y.dtype == x.dtype
    lowbit_mask = None if mask is None else mask == 1
    assert_same_bits(y, softmax_reference(x, lowbit_mask, jnp.asarray(SCALE, dtype), fusion))
    ref = te_softmax(x, SCALE, mask, causal=fusion == "scaled_upper_triang")
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, **tol(dtype))
    # and agrees with the fused forward (both round the scale as TE does)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(fwd(fusion, x, mask),
                                                                     np.float32), **tol(dtype))


@pytest.mark.parametrize("fusion", FUSIONS)
def test_jax_functions_autodiff(fusion, rng):
    x, mask = make(rng, SHAPES[0], np.float32, fusion)
    w = rng.standard_normal(SHAPES[0]).astype(np.float32)
    fn = {"scaled": lambda l: jax_scaled_softmax(l, SCALE),
          "scaled_masked": lambda l: jax_scaled_masked_softmax(l, mask, SCALE),
          "scaled_upper_triang": lambda l: jax_scaled_upper_triang_masked_softmax(l, SCALE)}
    got = jax.grad(lambda l: (fn[fusion](l) * w).sum())(x)
    causal = fusion == "scaled_upper_triang"
    ref = jax.grad(lambda l: (te_softmax(l, SCALE, mask, causal) * w).sum())(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_jax_masked_softmax_broadcasts_any_mask_and_takes_none(rng):
    x = (rng.standard_normal((2, 3, 5, 7)) * 4).astype(np.float32)
    mask = rng.random((5, 7)) < 0.3  # broadcast over batch and heads; bool
    mask[0] = True
    y = jax_scaled_masked_softmax(x, mask, SCALE)
    np.testing.assert_allclose(y, te_softmax(x, SCALE, mask), **tol(np.float32))
    assert not np.asarray(y)[:, :, 0].any()
    fmask = np.where(mask, 1.0, 0.5).astype(np.float32)  # TE's test is mask != 1, any dtype
    assert_same_bits(jax_scaled_masked_softmax(x, fmask, SCALE), y)
    assert_same_bits(jax_scaled_masked_softmax(x, None, SCALE), jax_scaled_softmax(x, SCALE))


def test_jax_general_softmax(rng):
    x = (rng.standard_normal((4, 9, 6)) * 3).astype(np.float32)
    where = rng.random((4, 9, 1)) < 0.7
    where[1] = False  # every entry of the softmax over axis 1 excluded
    y = jax_general_softmax(x, axis=1, where=where)
    ref = jax.nn.softmax(x, axis=1, where=where)  # TE's formula with no offset
    np.testing.assert_allclose(y, ref, **tol(np.float32))
    assert not np.asarray(y)[1].any() and np.asarray(y).any()
    np.testing.assert_allclose(jax_general_softmax(x), jax.nn.softmax(x), **tol(np.float32))


def test_leading_dims_fold_like_te_kernels(rng):
    x = (rng.standard_normal((2, 2, 3, 5, 7)) * 4).astype(ml_dtypes.bfloat16)
    x4 = x.reshape(4, 3, 5, 7)
    s = kernel_scale(SCALE, x.dtype)
    for mask in [rng.integers(0, 2, (2, 2, 1, 5, 7), np.uint8),
                 rng.integers(0, 2, (1, 1, 1, 5, 7), np.uint8)]:
        y = scaled_masked_softmax_fwd(x, mask, SCALE)
        assert y.shape == x.shape
        want = softmax_forward(x4, mask.reshape(-1, 1, 5, 7), s, "scaled_masked")
        assert_same_bits(y, np.asarray(want).reshape(x.shape))
    x3 = x[0, 0]  # (heads, q, k): TE's kernel takes a batch of 1
    assert_same_bits(scaled_upper_triang_masked_softmax_fwd(x3, SCALE),
                     softmax_forward(x3[None], None, s, "scaled_upper_triang")[0])
    dz = rng.standard_normal(x.shape).astype(x.dtype)
    y = scaled_softmax_fwd(x, SCALE)
    assert_same_bits(scaled_softmax_bwd(dz, y, x, SCALE),
                     np.asarray(softmax_backward(dz.reshape(x4.shape), y.reshape(x4.shape),
                                                 SCALE, "scaled")).reshape(x.shape))


def test_jit_and_vmap(rng):
    x, mask = make(rng, SHAPES[0], ml_dtypes.bfloat16, "scaled_masked")
    eager = scaled_masked_softmax_fwd(x, mask, SCALE)
    assert_same_bits(jax.jit(scaled_masked_softmax_fwd, static_argnums=2)(x, mask, SCALE), eager)
    xs = np.stack([x, x[::-1]])
    got = jax.vmap(lambda a: scaled_masked_softmax_fwd(a, mask, SCALE))(xs)
    assert_same_bits(got[0], eager)
    assert_same_bits(got[1], scaled_masked_softmax_fwd(x[::-1], mask, SCALE))
    dz = rng.standard_normal(x.shape).astype(x.dtype)
    assert_same_bits(jax.jit(scaled_masked_softmax_bwd, static_argnums=4)(dz, eager, x, mask,
                                                                           SCALE),
                     scaled_masked_softmax_bwd(dz, eager, x, mask, SCALE))


S, M, U = (SoftmaxFusionType.SCALED, SoftmaxFusionType.SCALED_MASKED,
           SoftmaxFusionType.SCALED_UPPER_TRIANG_MASKED)
V = AttnSoftmaxType.VANILLA_SOFTMAX
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

# Rows a CUDA block does (TE's get_batch_per_block): next_pow2(k) = p, warp = min(p, 32)
# threads, 128 // warp warps, 2 rows a warp when p <= 128: k 16 -> 16, k 17..32 -> 8,
# k 33..128 -> 8, k > 128 -> 4.
KERNEL_RULE = [
    (S, V, 2, 2, 16, 16, BF16, True),     # q 16 % 16 rows a block
    (S, V, 2, 2, 8, 16, BF16, False),     # q 8 % 16
    (M, V, 1, 4, 24, 100, F16, True),     # k 100 -> 8 rows, 24 % 8
    (M, V, 1, 4, 20, 100, F16, False),    # 20 % 8
    (S, V, 2, 2, 20, 200, BF16, True),    # k 200 -> 4 rows
    (S, V, 2, 2, 4, 16384, BF16, True),   # the largest k
    (S, V, 2, 2, 4, 16385, BF16, False),  # k > 16384
    (S, V, 2, 2, 16, 15, BF16, False),    # k < 16
    (S, V, 2, 2, 18, 200, BF16, False),   # q % 4
    (S, V, 2, 3, 16, 16, BF16, False),    # batch * heads % 4
    (S, V, 2, 2, 16, 16, F32, False),     # f32: no kernel
    (M, V, 2, 2, 16, 16, np.dtype(ml_dtypes.bfloat16), True),
    (U, V, 4, 4, 16, 16, BF16, True),     # causal: q == k, batch * heads 16 % 16
    (U, V, 2, 2, 16, 16, BF16, False),    # batch * heads 4 % 16
    (U, V, 1, 4, 256, 256, F16, True),    # k 256 -> 4 rows
    (U, V, 1, 4, 256, 512, F16, False),   # q != k
    ("scaled_upper_triang", "vanilla", 1, 4, 256, 256, F16, True),  # lowbit's strings
    (S, AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, 2, 2, 16, 16, BF16, False),
    (M, AttnSoftmaxType.LEARNABLE_SOFTMAX, 2, 2, 16, 16, BF16, False),
    ("bogus", AttnSoftmaxType.LEARNABLE_SOFTMAX, 2, 2, 16, 16, BF16, False),  # TE checks first
]


@pytest.mark.parametrize("fusion, softmax_type, b, h, q, k, dtype, expected", KERNEL_RULE)
def test_is_softmax_kernel_available_follows_te_rule(fusion, softmax_type, b, h, q, k, dtype,
                                                     expected):
    assert is_softmax_kernel_available(fusion, softmax_type, b, h, q, k, dtype) is expected


def test_bad_input_names_the_function_and_argument(rng):
    x, mask = make(rng, SHAPES[0], ml_dtypes.bfloat16, "scaled_masked")
    y = scaled_masked_softmax_fwd(x, mask, SCALE)
    f = {n: OP + n for n in ["scaled_masked_softmax_fwd", "scaled_softmax_fwd",
                             "scaled_masked_softmax_bwd", "scaled_upper_triang_masked_softmax_bwd",
                             "jax_scaled_softmax", "jax_scaled_masked_softmax",
                             "jax_general_softmax", "is_softmax_kernel_available"]}
    cases = [
        (ValueError, rf"{f['scaled_masked_softmax_fwd']}: mask: expected shape \(\.\.\., 1, 5, 7\)",
         lambda: scaled_masked_softmax_fwd(x, mask[..., :6], SCALE)),
        (ValueError, rf"{f['scaled_masked_softmax_fwd']}: mask: .*got \(2, 3, 5, 7\)",
         lambda: scaled_masked_softmax_fwd(x, np.broadcast_to(mask, x.shape), SCALE)),
        (ValueError, rf"{f['scaled_masked_softmax_fwd']}: mask: .*batch 2 .*got \(3, 1, 5, 7\)",
         lambda: scaled_masked_softmax_fwd(x, np.concatenate([mask, mask[:1]]), SCALE)),
        (ValueError, rf"{f['scaled_masked_softmax_fwd']}: mask: .*got None",
         lambda: scaled_masked_softmax_fwd(x, None, SCALE)),
        (TypeError, rf"{f['scaled_masked_softmax_fwd']}: mask: expected uint8 .*got float32",
         lambda: scaled_masked_softmax_fwd(x, mask.astype(np.float32), SCALE)),
        (TypeError, rf"{f['scaled_masked_softmax_fwd']}: logits: .*got int32",
         lambda: scaled_masked_softmax_fwd(x.astype(np.int32), mask, SCALE)),
        (ValueError, rf"{f['scaled_masked_softmax_fwd']}: logits: .*at least 4 dims",
         lambda: scaled_masked_softmax_fwd(x[0], mask[0], SCALE)),
        (ValueError, rf"{f['scaled_softmax_fwd']}: logits: .*at least 3 dims, got \(5, 7\)",
         lambda: scaled_softmax_fwd(x[0, 0], SCALE)),
        (TypeError, rf"{f['scaled_softmax_fwd']}: scale_factor: expected a static float",
         lambda: scaled_softmax_fwd(x, "half")),
        (TypeError, rf"{f['scaled_softmax_fwd']}: scale_factor: expected a static float",
         lambda: jax.jit(scaled_softmax_fwd)(x, SCALE)),
        (ValueError, rf"{f['scaled_masked_softmax_bwd']}: softmax_out: expected dz's shape",
         lambda: scaled_masked_softmax_bwd(y[:1], y, x, mask, SCALE)),
        (TypeError, rf"{f['scaled_masked_softmax_bwd']}: softmax_out: expected dz's dtype bfloat16",
         lambda: scaled_masked_softmax_bwd(y, y.astype(np.float32), x, mask, SCALE)),
        (TypeError, rf"{f['scaled_upper_triang_masked_softmax_bwd']}: dz: .*got int8",
         lambda: scaled_upper_triang_masked_softmax_bwd(y.astype(np.int8), y.astype(np.int8),
                                                        x, SCALE)),
        (NotImplementedError, rf"{f['jax_scaled_softmax']}: softmax_offset: .*vanilla",
         lambda: jax_scaled_softmax(x, SCALE, 0.0)),
        (ValueError, rf"{f['jax_scaled_masked_softmax']}: mask: .*broadcastable.*\(2, 1, 5, 6\)",
         lambda: jax_scaled_masked_softmax(x, mask[..., :6], SCALE)),
        (TypeError, rf"{f['jax_scaled_masked_softmax']}: logits: .*got int32",
         lambda: jax_scaled_masked_softmax(x.astype(np.int32), mask, SCALE)),
        (NotImplementedError, rf"{f['jax_general_softmax']}: initial: .*got 0.0",
         lambda: jax_general_softmax(x, initial=0.0)),
        (NotImplementedError, rf"{f['jax_general_softmax']}: offset: ",
         lambda: jax_general_softmax(x, offset=1.0)),
        (ValueError, rf"{f['jax_general_softmax']}: where: .*broadcastable.*\(4, 5, 7\)",
         lambda: jax_general_softmax(x, where=np.ones((4, 5, 7), bool))),
        (ValueError, rf"{f['jax_general_softmax']}: axis: .*got 4",
         lambda: jax_general_softmax(x, axis=4)),
        (NotImplementedError, rf"{f['is_softmax_kernel_available']}: softmax_fusion_type: .*bogus",
         lambda: is_softmax_kernel_available("bogus", V, 2, 2, 16, 16, BF16)),
        (TypeError, rf"{f['is_softmax_kernel_available']}: q_seqlen: expected an int, got 16.0",
         lambda: is_softmax_kernel_available(S, V, 2, 2, 16.0, 16, BF16)),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()
