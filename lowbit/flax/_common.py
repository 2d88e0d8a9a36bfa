"""The math the Linen modules (module.py) and their NNX twins (nnx.py) share.

Both front ends create parameters and quantizer state their own way, then call these
functions with plain arrays and QuantizerSets, so the two compute the same thing.

Conventions (TransformerEngine's JAX modules):
  - parameters live in `dtype` (default fp32) and are cast to the input's dtype, except the
    GEMM kernels while a recipe quantizes: those are quantized from the stored precision;
  - DenseGeneral's kernel is (contracted input dims..., features...); LayerNormMLP's wi is
    (H, n_act, F), wo (F, H), wi_bias (n_act, F), wo_bias (H,);
  - LoRA adds (x . lora_a . lora_b) * alpha / rank (scale 1 when alpha is None), computed
    in high precision (fp32 accumulation) from the unquantized input: lora_a is
    (contracted dims..., features[:-1]..., rank), lora_b (features[:-1]..., rank,
    features[-1]); lora_b starts at zero, so a fresh adapter changes nothing.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from lowbit.dense import dense
from lowbit.layernorm import layernorm
from lowbit.layernorm_dense import layernorm_dense
from lowbit.quantize.quantizer import QuantizerSet
from lowbit.sharding import logical_constraint

# Activation tuples the fused activation kernels take (TE's pools); anything else (a
# callable, another flax.linen activation name) runs through the composed path.
GATED_ACTIVATIONS = tuple((a, "linear") for a in ("gelu", "silu", "relu", "quick_gelu", "squared_relu")) + (
    ("clamped_silu", "clamped_linear"),)  # GPT-OSS's clamped swiglu, at TE's default limit and alpha
PLAIN_ACTIVATIONS = tuple((a,) for a in ("gelu", "silu", "relu", "quick_gelu", "squared_relu"))


# The logit a masked entry gets (the fused softmax kernels' value, as in TE).
MASKED_LOGIT = -10000.0


def canonicalize_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, Iterable) else (x,)


def normalize_axes(axes: Iterable[int], ndim: int, op: str = "lowbit.flax", arg: str = "axis") -> tuple[int, ...]:
    """axes in [0, ndim), negative ones counted from the end; an error naming op and arg for
    an axis outside the input's rank."""
    out = []
    for ax in axes:
        if not -ndim <= ax < ndim:
            raise ValueError(f"{op}: {arg}: axis {ax} is out of range for an input of rank {ndim}")
        out.append(ax % ndim)
    return tuple(out)


def check_features(op: str, features: tuple) -> tuple:
    """Output sizes: positive ints (an error naming op otherwise)."""
    if not features or any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 1 for f in features):
        raise ValueError(f"{op}: features: expected positive ints, got {features!r}")
    return tuple(int(f) for f in features)


def default_scale_init(scale_init, zero_centered_gamma: bool):
    """TE's rule: ones, or zeros when gamma is zero-centered (the norm uses 1 + gamma)."""
    if scale_init is not None:
        return scale_init
    return nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones


def default_kernel_init(kernel_init, dtype):
    if kernel_init is not None:
        return kernel_init
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", dtype=dtype)


def stacked_init(init, n: int, axis: int = -2):
    """An initializer of n independently drawn (in, out) kernels stacked along `axis`:
    LayerNormMLP's wi (H, n_act, F), each slice initialised like a plain (H, F) kernel, from
    TE's key chain (each kernel's key split off the running key), so that a seed gives TE's
    initial weights."""

    def init_fn(key, each_shape, dtype=jnp.float32):
        kernels = []
        for _ in range(n):
            key, init_key = jax.random.split(key)
            kernels.append(init(init_key, each_shape, dtype))
        return jnp.stack(kernels, axis=axis).astype(dtype)

    return init_fn


def logical_axes(axes, ndim: int) -> tuple:
    """TE allows () for "no names"; Flax wants one name (or None) per dim."""
    return tuple(axes) if axes else (None,) * ndim


def constrain(x, axes):
    """A logical sharding constraint on an activation when axes are given (no-op otherwise,
    and outside a mesh with logical axis rules): lowbit.sharding.logical_constraint."""
    return logical_constraint(x, axes)


def check_last_axis(op: str, axis, ndim: int) -> None:
    """LayerNormDenseGeneral / LayerNormMLP normalize and contract x's last axis only (TE)."""
    if canonicalize_tuple(axis) not in ((-1,), (ndim - 1,)):
        raise ValueError(f"{op}: axis: only -1 is supported (as in TE), got {axis!r}")


def normalize_activations(activations: Sequence[str | Callable]) -> tuple:
    """Lower-cased names, ("linear", "gelu") reordered to ("gelu", "linear") as TE does."""
    acts = tuple(a.lower() if isinstance(a, str) else a for a in activations)
    if not acts:
        raise ValueError("lowbit.flax.LayerNormMLP: activations: expected at least one")
    return tuple(reversed(acts)) if acts[0] == "linear" else acts


def is_fused_activation(acts: tuple) -> bool:
    return acts in GATED_ACTIVATIONS + PLAIN_ACTIVATIONS


def _activation_fn(fn_or_name):
    if fn_or_name == "linear":
        return lambda x: x
    if isinstance(fn_or_name, str):
        if fn_or_name == "quick_gelu":
            return lambda x: x * jax.nn.sigmoid(1.702 * x)
        if fn_or_name == "squared_relu":
            return lambda x: jnp.square(jax.nn.relu(x))
        fn = getattr(nn, fn_or_name, None)
        if not callable(fn):
            raise ValueError(f"lowbit.flax.LayerNormMLP: activations: {fn_or_name!r} is neither lowbit's fused "
                             "activation nor a flax.linen function")
        return fn
    if callable(fn_or_name):
        return fn_or_name
    raise ValueError(f"lowbit.flax.LayerNormMLP: activations: cannot use {fn_or_name!r}")


def apply_activations(h, acts: tuple):
    """h (..., n_act, F) -> (..., F): the product of the activations of the n_act slices."""
    if is_fused_activation(acts):
        from lowbit.activation import activation

        x = h if len(acts) > 1 else h.reshape(*h.shape[:-2], h.shape[-1])
        return activation(x, acts)
    parts = [_activation_fn(fn)(h[..., i, :]) for i, fn in enumerate(acts)]
    return functools.reduce(operator.mul, parts)


def lora_delta(x, axis: tuple[int, ...], features: tuple[int, ...], lora_a, lora_b, alpha):
    """(x . lora_a . lora_b) * alpha / rank over x's `axis` dims, accumulated in fp32, in
    x's dtype (see the module docstring for the shapes)."""
    rank = lora_a.shape[-1]
    scaling = 1.0 if alpha is None else alpha / rank
    x_names = "ijklm"[: len(axis)]
    out_names = "nopqr"[: len(features)]
    free = [d for d in range(x.ndim) if d not in axis]
    x = jnp.transpose(x, free + list(axis))
    spec = (f"...{x_names},{x_names}{out_names[:-1]}s,{out_names[:-1]}s{out_names[-1]}"
            f"->...{out_names}")
    y = jnp.einsum(spec, x, lora_a.astype(x.dtype), lora_b.astype(x.dtype),
                   preferred_element_type=jnp.float32)
    return (y * scaling).astype(x.dtype)


def quantizing(quantizer_set: QuantizerSet) -> bool:
    return quantizer_set.x is not None


def gemm_kernel(kernel, x_dtype, quantizer_set: QuantizerSet):
    """The kernel as the GEMM takes it: stored precision when quantized, else x's dtype."""
    return kernel if quantizing(quantizer_set) else kernel.astype(x_dtype)


def dense_general(x, kernel, bias, axis, quantizer_set, lora=None, input_axes=None):
    """DenseGeneral: x's `axis` dims contracted with the kernel's leading dims, + LoRA, + bias.
    `lora` is None or (lora_a, lora_b, alpha)."""
    x = constrain(x, input_axes)
    axis = normalize_axes(canonicalize_tuple(axis), x.ndim)
    n_in = len(axis)
    features = tuple(kernel.shape[n_in:])
    k = gemm_kernel(kernel, x.dtype, quantizer_set)
    y = dense(x, k, None if lora else bias, contracting_dims=(axis, tuple(range(n_in))),
              quantizer_set=quantizer_set)
    if lora:
        y = y + lora_delta(x, axis, features, *lora)
        if bias is not None:
            y = y + bias.astype(y.dtype)
    return y


def norm(x, scale, ln_bias, norm_type, zero_centered_gamma, epsilon):
    return layernorm(x, scale.astype(x.dtype), None if ln_bias is None else ln_bias.astype(x.dtype),
                     norm_type=norm_type, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon)


def layernorm_dense_general(x, scale, ln_bias, kernel, bias, quantizer_set, *, norm_type,
                            zero_centered_gamma, epsilon, want_ln: bool, lora=None,
                            depth_scaling=None, layernorm_input_axes=None, dot_input_axes=None):
    """LayerNormDenseGeneral: norm over the last dim fused with the GEMM (layernorm_dense)
    when scale is given, a plain DenseGeneral when it is None. Returns (y, ln or None)."""
    x = constrain(x, layernorm_input_axes)
    k = gemm_kernel(kernel, x.dtype, quantizer_set)
    feature_axis = (x.ndim - 1,)
    features = tuple(kernel.shape[1:])
    bias_in_gemm = None if lora else bias
    if scale is None:
        ln = x
        y = dense(constrain(x, dot_input_axes), k, bias_in_gemm,
                  contracting_dims=(feature_axis, (0,)), quantizer_set=quantizer_set)
    else:
        need_ln = want_ln or bool(lora)
        out = layernorm_dense(
            x, k, scale.astype(x.dtype), None if ln_bias is None else ln_bias.astype(x.dtype),
            None if bias_in_gemm is None else bias_in_gemm.astype(x.dtype),
            norm_type=norm_type, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
            quantizer_set=quantizer_set, return_layernorm_output=need_ln)
        y, ln = out if need_ln else (out, None)
    if lora:
        y = y + lora_delta(ln, feature_axis, features, *lora)
        if bias is not None:
            y = y + bias.astype(y.dtype)
    if depth_scaling is not None:
        y = y / depth_scaling
    return y, (ln if want_ln else None)


def layernorm_mlp_general(x, scale, ln_bias, wi, wo, wi_bias, wo_bias, quantizer_sets, *,
                          norm_type, zero_centered_gamma, epsilon, activations, want_ln: bool,
                          dropout: Callable | None = None, lora=None,
                          ffn1_ckpt_name="ffn1", ffn2_ckpt_name="ffn2"):
    """LayerNormMLP. One fused layernorm_mlp when nothing has to happen between its pieces
    (norm enabled, no layernorm output asked for, no LoRA, no active dropout, a fused
    activation); otherwise layernorm_dense -> activation -> dropout -> dense, each piece
    quantized by its own GEMM's set. `dropout` is None or a function of the activation's
    output; `lora` is None or (wi_a, wi_b, wo_a, wo_b, alpha). Returns (out, ln or None)."""
    acts = normalize_activations(activations)
    qs1, qs2 = quantizer_sets
    n_act = wi.shape[-2]
    if len(acts) != n_act:
        raise ValueError(f"lowbit.flax.LayerNormMLP: wi_kernel: {n_act} slices for {len(acts)} activations")
    fused = (scale is not None and not want_ln and not lora and dropout is None
             and is_fused_activation(acts))
    if fused:
        from lowbit.layernorm_mlp import layernorm_mlp

        out = layernorm_mlp(
            x, scale.astype(x.dtype), None if ln_bias is None else ln_bias.astype(x.dtype),
            (gemm_kernel(wi, x.dtype, qs1), gemm_kernel(wo, x.dtype, qs2)),
            (None if wi_bias is None else wi_bias.astype(x.dtype),
             None if wo_bias is None else wo_bias.astype(x.dtype)),
            norm_type=norm_type, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
            ffn1_ckpt_name=ffn1_ckpt_name, ffn2_ckpt_name=ffn2_ckpt_name,
            activation_type=acts, quantizer_sets=(qs1, qs2))
        return out, None
    wi_lora = None if not lora else (lora[0], lora[1], lora[4])
    wo_lora = None if not lora else (lora[2], lora[3], lora[4])
    h, ln = layernorm_dense_general(
        x, scale, ln_bias, wi, wi_bias, qs1, norm_type=norm_type,
        zero_centered_gamma=zero_centered_gamma, epsilon=epsilon, want_ln=want_ln, lora=wi_lora)
    h = checkpoint_name(h, ffn1_ckpt_name)
    a = apply_activations(h, acts)
    if dropout is not None:
        a = dropout(a)
    out = dense_general(a, wo, wo_bias, -1, qs2, lora=wo_lora)
    return checkpoint_name(out, ffn2_ckpt_name), ln


def softmax_general(logits, mask, bias, scale_factor: float, softmax_fusion_type: str):
    """Softmax over the last dim of (batch, heads, q, k) logits (see module.Softmax)."""
    from lowbit.softmax import softmax

    fusion = getattr(softmax_fusion_type, "value", softmax_fusion_type)
    dtype = logits.dtype
    if bias is not None:
        logits = logits + bias.astype(dtype)
    if fusion == "scaled" and mask is not None:
        logits = jnp.where(mask > 0, jnp.asarray(MASKED_LOGIT, dtype), logits)
    return softmax(logits, mask if fusion == "scaled_masked" else None, scale_factor, fusion)
