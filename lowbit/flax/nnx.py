"""NNX twins of the Linen modules in lowbit.flax.module (TransformerEngine has none).

Same math (both call lowbit/flax/_common.py), same parameter names, shapes and logical
axis names; NNX needs the input sizes at construction: `DenseGeneral(in_features,
features, ..., rngs=nnx.Rngs(0))`, `LayerNormMLP(in_features, intermediate_dim, ...)`.
Parameters are `nnx.Param`s whose logical axis names sit in the `out_sharding` metadata
(`nnx.get_partition_spec(nnx.state(model))`; not sharded eagerly: map the names with
`flax.linen.logical_axis_rules` when placing the state on a mesh).

Quantization: the recipe is the module's `quantization_recipe`, else the active
`lowbit.autocast` recipe when the module is called. Delayed-scaling state is created at
construction (from that recipe, or the autocast block the module is built in) as
`QuantizerState` variables (alias `Fp8Meta`) named like the Linen variables
(`x_scale`, `kernel_amax_history`, ..., LayerNormMLP: `x_0_scale`, ...). Their gradient
is the next step's state. A training step therefore differentiates with respect to both
kinds and writes the state part back:

    diff = nnx.DiffState(0, nnx.Any(nnx.Param, QuantizerState))
    grads = nnx.grad(loss_fn, argnums=diff)(model)
    param_grads = update_quantizer_state(model, grads)   # writes the new state, returns the rest
    optimizer.update(model, param_grads)                 # nnx.Optimizer(..., wrt=nnx.Param)

Call each module once per step (two calls would add their two updated states).

NVFP4 (NVFP4BlockScaling) draws its stochastic-rounding / RHT key, like nnx.Dropout, from
the "sr_rng" stream of the `rngs` the module was built with (`rngs=nnx.Rngs(0, sr_rng=1)`:
a fresh key per call, the stream's count kept in the module's state), or takes one per call
(`module(x, sr_key=key)`, which wins over the stream); LayerNormMLP gives GEMM i
fold_in(key, i). Each GEMM's key goes through lowbit.dense.with_sr_key (an SR key per
quantizer, one RHT sign key shared by the copies the wgrad multiplies), as in the Linen
modules. Without either, the forward runs (it needs no key) and a gradient raises an error
naming "sr_rng".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from lowbit.dense import with_sr_key
from lowbit.flax import _common as C
from lowbit.ops.norm import canonical_norm_type
from lowbit.quantize.helper import QuantizerFactory, get_global_recipe
from lowbit.quantize.quantizer import DelayedScaleQuantizer, QuantizerSet
from lowbit.recipe import DelayedScaling, Recipe

__all__ = [
    "QuantizerState",
    "Fp8Meta",
    "update_quantizer_state",
    "LowbitModuleBase",
    "TransformerEngineBase",
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "Softmax",
]

_STATE_PREFIX = {"x": "x", "kernel": "kernel", "dgrad": "grad"}


class QuantizerState(nnx.Variable):
    """Delayed-scaling state of one quantizer (scale (1,) or amax history (L,)); written
    from the gradient each step, never by the optimizer."""


Fp8Meta = QuantizerState


def update_quantizer_state(model: nnx.Module, grads: nnx.State) -> nnx.State:
    """Writes the QuantizerState part of `grads` (the next step's state) into `model` and
    returns the rest (the parameters' gradients)."""
    param_grads, state = nnx.split_state(grads, nnx.Not(QuantizerState), QuantizerState)
    nnx.update(model, state)
    return param_grads


def _param(rngs: nnx.Rngs | None, init, axes, shape, dtype) -> nnx.Param:
    key = rngs.params() if rngs is not None else None
    value = init(key, tuple(shape), dtype)
    return nnx.Param(value, out_sharding=C.logical_axes(axes, value.ndim), eager_sharding=False)


def _lora_params(rngs, kernel_init, in_shape, features, rank, dtype, enabled: bool):
    """(lora_a (in..., features[:-1]..., rank), lora_b (features[:-1]..., rank,
    features[-1]), zero-initialised) Params, or (None, None)."""
    if not enabled:
        return None, None
    a = _param(rngs, kernel_init, (), (*in_shape, *features[:-1], rank), dtype)
    b = _param(rngs, nn.initializers.zeros, (), (*features[:-1], rank, features[-1]), dtype)
    return a, b


def _value(variable):
    return None if variable is None else variable[...]


class LowbitModuleBase(nnx.Module):
    """Holds the recipe and the delayed-scaling state; builds each GEMM's QuantizerSet."""

    def _init_quantization(self, quantization_recipe: Recipe | None, postfixes=("",),
                           rngs: nnx.Rngs | None = None) -> None:
        self.quantization_recipe = quantization_recipe
        # NVFP4's key stream (a fork, as nnx.Dropout keeps its own), if the caller gave one.
        has_stream = isinstance(rngs, nnx.Rngs) and "sr_rng" in rngs
        self.sr_rngs = rngs["sr_rng"].fork() if has_stream else nnx.data(None)
        recipe = quantization_recipe if quantization_recipe is not None else get_global_recipe()
        if not isinstance(recipe, DelayedScaling):
            return
        for postfix in postfixes:
            for prefix in _STATE_PREFIX.values():
                setattr(self, f"{prefix}{postfix}_scale", QuantizerState(jnp.ones((1,), jnp.float32)))
                setattr(self, f"{prefix}{postfix}_amax_history",
                        QuantizerState(jnp.zeros((recipe.amax_history_len,), jnp.float32)))

    def active_recipe(self) -> Recipe | None:
        return self.quantization_recipe if self.quantization_recipe is not None else get_global_recipe()

    def generate_quantizer_set(self, postfix: str = "", sr_key=None) -> QuantizerSet:
        """The recipe's set bound to this module's state; NVFP4 quantizers get `sr_key`, else
        a fresh key from the "sr_rng" stream when the module has one (else none)."""
        recipe = self.active_recipe()
        if recipe is None:
            return QuantizerSet()
        quantizer_set = QuantizerFactory.create_set(recipe)
        bound = {}
        for field, prefix in _STATE_PREFIX.items():
            q = getattr(quantizer_set, field)
            if isinstance(q, DelayedScaleQuantizer):
                scale = getattr(self, f"{prefix}{postfix}_scale", None)
                history = getattr(self, f"{prefix}{postfix}_amax_history", None)
                if scale is None or history is None or history[...].shape != q.amax_history.shape:
                    raise ValueError(
                        f"lowbit.flax.nnx.{type(self).__name__}: DelayedScaling needs its state, "
                        "made at construction: build the module with quantization_recipe=<the "
                        "recipe> or inside the same lowbit.autocast block")
                q = dataclasses.replace(q, scale=scale[...], amax_history=history[...])
            bound[field] = q
        bound = quantizer_set._replace(**bound)
        if any(hasattr(q, "with_key") for q in bound.quantizers):
            if sr_key is None and self.sr_rngs is not None:
                sr_key = self.sr_rngs()
            bound = with_sr_key(bound, sr_key)
        return bound


TransformerEngineBase = LowbitModuleBase


class Softmax(nnx.Module):
    """See lowbit.flax.module.Softmax."""

    def __init__(self, scale_factor: float = 1.0, softmax_fusion_type: str = "scaled"):
        self.scale_factor = scale_factor
        self.softmax_fusion_type = softmax_fusion_type

    def __call__(self, inputs, mask=None, bias=None):
        return C.softmax_general(inputs, mask, bias, self.scale_factor, self.softmax_fusion_type)


def _norm_params(num_features, layernorm_type, zero_centered_gamma, scale_init,
                 scale_axes, bias_init, bias_axes, dtype, rngs):
    """(scale, ln_bias or None) Params."""
    layernorm_type = canonical_norm_type(layernorm_type)  # TE's spellings: "LayerNorm", ...
    if layernorm_type not in ("layernorm", "rmsnorm"):
        raise ValueError(f"lowbit.flax.nnx: layernorm_type: expected 'layernorm' or 'rmsnorm', got {layernorm_type!r}")
    scale_init = C.default_scale_init(scale_init, zero_centered_gamma)
    scale = _param(rngs, scale_init, scale_axes, (num_features,), dtype)
    ln_bias = (_param(rngs, bias_init, bias_axes, (num_features,), dtype)
               if layernorm_type == "layernorm" else None)
    return scale, ln_bias


class LayerNorm(nnx.Module):
    """See lowbit.flax.module.LayerNorm; parameters `scale`, `ln_bias`."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, layernorm_type: str = "layernorm",
                 zero_centered_gamma: bool = False, scale_init=None, scale_axes=("embed",),
                 bias_init=nn.initializers.zeros, bias_axes=("embed",), dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.epsilon, self.layernorm_type, self.zero_centered_gamma = epsilon, layernorm_type, zero_centered_gamma
        self.scale, self.ln_bias = _norm_params(num_features, layernorm_type, zero_centered_gamma,
                                                scale_init, scale_axes, bias_init, bias_axes,
                                                dtype, rngs)

    def __call__(self, x):
        return C.norm(x, self.scale[...], _value(self.ln_bias), self.layernorm_type,
                      self.zero_centered_gamma, self.epsilon)


class DenseGeneral(LowbitModuleBase):
    """See lowbit.flax.module.DenseGeneral; `in_features` are the sizes of x's `axis` dims."""

    def __init__(self, in_features: int | Iterable[int], features: int | Iterable[int], *,
                 axis: int | Iterable[int] = -1, use_bias: bool = True, kernel_init=None,
                 bias_init=nn.initializers.zeros, kernel_axes=(), bias_axes=(),
                 enable_low_rank_adaptation: bool = False, low_rank_adaptation_dim: int = 32,
                 low_rank_adaptation_alpha: float | None = None, dtype=jnp.float32,
                 input_axes=(), quantization_recipe: Recipe | None = None, rngs: nnx.Rngs):
        in_shape = C.canonicalize_tuple(in_features)
        features = C.check_features("lowbit.flax.nnx.DenseGeneral", C.canonicalize_tuple(features))
        if len(in_shape) != len(C.canonicalize_tuple(axis)):
            raise ValueError("lowbit.flax.nnx.DenseGeneral: in_features: one size per axis")
        self.axis, self.input_axes = C.canonicalize_tuple(axis), tuple(input_axes)
        kernel_init = C.default_kernel_init(kernel_init, dtype)
        self.kernel = _param(rngs, kernel_init, kernel_axes, in_shape + features, dtype)
        self.bias = _param(rngs, bias_init, bias_axes, features, dtype) if use_bias else None
        self.lora_alpha = low_rank_adaptation_alpha
        self.lora_a_kernel, self.lora_b_kernel = _lora_params(
            rngs, kernel_init, in_shape, features, low_rank_adaptation_dim, dtype,
            enable_low_rank_adaptation)
        self._init_quantization(quantization_recipe, rngs=rngs)

    def __call__(self, inputs, *, sr_key=None):
        lora = None
        if self.lora_a_kernel is not None:
            lora = (self.lora_a_kernel[...], self.lora_b_kernel[...], self.lora_alpha)
        return C.dense_general(inputs, self.kernel[...], _value(self.bias), self.axis,
                               self.generate_quantizer_set(sr_key=sr_key), lora=lora,
                               input_axes=self.input_axes)


class LayerNormDenseGeneral(LowbitModuleBase):
    """See lowbit.flax.module.LayerNormDenseGeneral; returns (y, norm output or None)."""

    def __init__(self, in_features: int, features: int | Iterable[int], *,
                 enable_layernorm: bool = True, layernorm_type: str = "layernorm",
                 epsilon: float = 1e-6, zero_centered_gamma: bool = False, scale_init=None,
                 scale_axes=("embed",), ln_bias_init=nn.initializers.zeros, ln_bias_axes=("embed",),
                 kernel_init=None, kernel_axes=(), use_bias: bool = False,
                 bias_init=nn.initializers.zeros, bias_axes=(), return_layernorm_output: bool = False,
                 enable_low_rank_adaptation: bool = False, low_rank_adaptation_dim: int = 32,
                 low_rank_adaptation_alpha: float | None = None, dtype=jnp.float32,
                 layernorm_input_axes=None, dot_input_axes=None, depth_scaling: float | None = None,
                 axis: int | Iterable[int] = -1, quantization_recipe: Recipe | None = None, rngs: nnx.Rngs):
        features = C.canonicalize_tuple(features)
        self.axis = axis
        self.layernorm_type, self.epsilon, self.zero_centered_gamma = layernorm_type, epsilon, zero_centered_gamma
        self.return_layernorm_output, self.depth_scaling = return_layernorm_output, depth_scaling
        self.layernorm_input_axes, self.dot_input_axes = layernorm_input_axes, dot_input_axes
        self.scale, self.ln_bias = _norm_params(
            in_features, layernorm_type, zero_centered_gamma, scale_init, scale_axes,
            ln_bias_init, ln_bias_axes, dtype, rngs) if enable_layernorm else (None, None)
        kernel_init = C.default_kernel_init(kernel_init, dtype)
        self.kernel = _param(rngs, kernel_init, kernel_axes, (in_features, *features), dtype)
        self.lora_alpha = low_rank_adaptation_alpha
        self.lora_a_kernel, self.lora_b_kernel = _lora_params(
            rngs, kernel_init, (in_features,), features, low_rank_adaptation_dim, dtype,
            enable_low_rank_adaptation)
        self.bias = _param(rngs, bias_init, bias_axes, features, dtype) if use_bias else None
        self._init_quantization(quantization_recipe, rngs=rngs)

    def __call__(self, inputs, *, sr_key=None):
        C.check_last_axis("lowbit.flax.nnx.LayerNormDenseGeneral", self.axis, inputs.ndim)
        lora = None
        if self.lora_a_kernel is not None:
            lora = (self.lora_a_kernel[...], self.lora_b_kernel[...], self.lora_alpha)
        return C.layernorm_dense_general(
            inputs, _value(self.scale), _value(self.ln_bias), self.kernel[...], _value(self.bias),
            self.generate_quantizer_set(sr_key=sr_key), norm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma, epsilon=self.epsilon,
            want_ln=self.return_layernorm_output, lora=lora, depth_scaling=self.depth_scaling,
            layernorm_input_axes=self.layernorm_input_axes, dot_input_axes=self.dot_input_axes)


class LayerNormMLP(LowbitModuleBase):
    """See lowbit.flax.module.LayerNormMLP (fused vs composed path); returns (out, norm
    output or None). Dropout draws from `rngs`' `intermediate_dropout_rng_name` stream."""

    def __init__(self, in_features: int, intermediate_dim: int = 2048, *,
                 enable_layernorm: bool = True, layernorm_type: str = "layernorm",
                 epsilon: float = 1e-6, zero_centered_gamma: bool = False, scale_init=None,
                 scale_axes=("embed",), ln_bias_init=nn.initializers.zeros, ln_bias_axes=("embed",),
                 kernel_init=None, kernel_axes_1=("embed", "act", "mlp"), kernel_axes_2=("mlp", "embed"),
                 use_bias: bool = False, bias_init=nn.initializers.zeros,
                 bias_axes_1=("act", "mlp"), bias_axes_2=("embed",),
                 return_layernorm_output: bool = False,
                 activations: Sequence[str | Callable] = ("gelu",),
                 intermediate_dropout_rng_name: str = "dropout",
                 intermediate_dropout_rate: float = 0.0,
                 intermediate_hidden_dropout_dims: Sequence[int] = (),
                 enable_low_rank_adaptation: bool = False, low_rank_adaptation_dim: int = 32,
                 low_rank_adaptation_alpha: float | None = None, dtype=jnp.float32,
                 layernorm_input_axes=None, ffn1_ckpt_name: str = "ffn1", ffn2_ckpt_name: str = "ffn2",
                 axis: int | Iterable[int] = -1, dot_1_input_axes=None, dot_2_input_axes=None,
                 quantization_recipe: Recipe | None = None, rngs: nnx.Rngs):
        del dot_1_input_axes, dot_2_input_axes  # accepted, not applied (lowbit.flax.module.LayerNormMLP)
        acts = C.normalize_activations(activations)
        self.axis = axis
        n_act, hidden, ffn = len(acts), in_features, intermediate_dim
        self.activations = acts
        self.layernorm_type, self.epsilon, self.zero_centered_gamma = layernorm_type, epsilon, zero_centered_gamma
        self.return_layernorm_output, self.layernorm_input_axes = return_layernorm_output, layernorm_input_axes
        self.ffn1_ckpt_name, self.ffn2_ckpt_name = ffn1_ckpt_name, ffn2_ckpt_name
        self.scale, self.ln_bias = _norm_params(
            hidden, layernorm_type, zero_centered_gamma, scale_init, scale_axes,
            ln_bias_init, ln_bias_axes, dtype, rngs) if enable_layernorm else (None, None)
        kernel_init = C.default_kernel_init(kernel_init, dtype)
        self.wi_kernel = _param(rngs, C.stacked_init(kernel_init, n_act), kernel_axes_1, (hidden, ffn), dtype)
        self.wo_kernel = _param(rngs, kernel_init, kernel_axes_2, (ffn, hidden), dtype)
        self.wi_bias = _param(rngs, bias_init, bias_axes_1, (n_act, ffn), dtype) if use_bias else None
        self.wo_bias = _param(rngs, bias_init, bias_axes_2, (hidden,), dtype) if use_bias else None
        self.lora_alpha = low_rank_adaptation_alpha
        rank, lora = low_rank_adaptation_dim, enable_low_rank_adaptation
        self.wi_lora_a_kernel = (_param(rngs, C.stacked_init(kernel_init, n_act), (), (hidden, rank), dtype)
                                 if lora else None)
        self.wi_lora_b_kernel = _param(rngs, nn.initializers.zeros, (), (n_act, rank, ffn), dtype) if lora else None
        self.wo_lora_a_kernel, self.wo_lora_b_kernel = _lora_params(
            rngs, kernel_init, (ffn,), (hidden,), rank, dtype, lora)
        self.dropout = nnx.Dropout(
            intermediate_dropout_rate, broadcast_dims=tuple(intermediate_hidden_dropout_dims),
            rng_collection=intermediate_dropout_rng_name, rngs=rngs,
        ) if intermediate_dropout_rate > 0 else None
        self._init_quantization(quantization_recipe, postfixes=("_0", "_1"), rngs=rngs)

    def __call__(self, inputs, deterministic: bool = False, *, sr_key=None):
        C.check_last_axis("lowbit.flax.nnx.LayerNormMLP", self.axis, inputs.ndim)
        lora = None
        if self.wi_lora_a_kernel is not None:
            lora = (self.wi_lora_a_kernel[...], self.wi_lora_b_kernel[...],
                    self.wo_lora_a_kernel[...], self.wo_lora_b_kernel[...], self.lora_alpha)
        dropout = None
        if self.dropout is not None and not deterministic:
            dropout = lambda a: self.dropout(a, deterministic=False)  # noqa: E731
        return C.layernorm_mlp_general(
            C.constrain(inputs, self.layernorm_input_axes), _value(self.scale), _value(self.ln_bias),
            self.wi_kernel[...], self.wo_kernel[...], _value(self.wi_bias), _value(self.wo_bias),
            tuple(self.generate_quantizer_set(postfix, None if sr_key is None else jax.random.fold_in(sr_key, i))
                  for i, postfix in enumerate(("_0", "_1"))),
            norm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon, activations=self.activations, want_ln=self.return_layernorm_output,
            dropout=dropout, lora=lora, ffn1_ckpt_name=self.ffn1_ckpt_name,
            ffn2_ckpt_name=self.ffn2_ckpt_name)

