"""Linen modules with the fields, parameter names/shapes and logical axis names of
TransformerEngine's JAX modules (transformer_engine.jax.flax), running lowbit's ops.

Quantization: a module quantizes its GEMMs with `quantization_recipe` when that field is
set, else with the recipe of the enclosing `lowbit.autocast` block at trace time, else not
at all. Recipes whose kernels are missing raise their NotImplementedError from the call.

Delayed-scaling state: each GEMM's quantizers keep `scale (1,)` and `amax_history (L,)`
as Flax variables in the collection `_overwrite_with_gradient` (lowbit.flax.
OVERWRITE_WITH_GRADIENT), named `x_scale`, `x_amax_history`, `kernel_*`, `grad_*`
(LayerNormMLP: `x_0_scale`, ..., `grad_1_amax_history`, one set per GEMM, as TE names
them). Their "gradient" is the next step's state, so a training step differentiates with
respect to the whole variable dict and writes that collection's gradient back in place of
the old value (overwrite-with-gradient); the optimizer only sees `params`. Call each
module once per step: two calls would add their two updated states.

Parameters are created through `nn.with_logical_partitioning`, so `nn.logical_axis_rules`
+ `nn.logical_to_mesh_sharding` shard them; TE's defaults: LayerNorm scale/ln_bias
("embed",), LayerNormMLP wi_kernel ("embed", "act", "mlp"), wo_kernel ("mlp", "embed"),
wi_bias ("act", "mlp"), wo_bias ("embed",); DenseGeneral's are the caller's (kernel_axes).
Initializer fields left None (kernel_init, scale_init) are resolved in __post_init__ to
TE's defaults, as TE's modules do. The shared math (paths, LoRA) is in _common.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from lowbit.flax import OVERWRITE_WITH_GRADIENT, _bind_state
from lowbit.activation import check_activation_params
from lowbit.flax import _common as C
from lowbit.ops.norm import canonical_norm_type
from lowbit.quantize.helper import QuantizerFactory, get_global_recipe
from lowbit.quantize.quantizer import QuantizerSet
from lowbit.recipe import Recipe
from lowbit.sharding import check_batch_first
from lowbit.softmax import AttnSoftmaxType

# TE's type names (transformer_engine.jax.flax.module), for annotations in ported code.
PRNGKey = Any
Shape = tuple[int, ...]
DType = Any  # a jnp dtype
Array = jax.Array
PrecisionLike = None | str | jax.lax.Precision | tuple[str, str] | tuple[jax.lax.Precision, jax.lax.Precision]
Initializer = Callable[..., Any]

__all__ = [
    "LowbitModuleBase",
    "TransformerEngineBase",
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "Softmax",
    "make_dot_general_cls",
    "wrap_function_in_te_state_module",
]


def _param(module: nn.Module, name: str, init, axes, shape, dtype):
    """A parameter with one logical axis name (or None) per dim."""
    names = C.logical_axes(axes, len(shape))
    return module.param(name, nn.with_logical_partitioning(init, names), tuple(shape), dtype)


def _norm_params(module, norm_type, hidden, scale_init, scale_axes, bias_init, bias_axes, dtype):
    norm_type = canonical_norm_type(norm_type)  # TE's spellings: "LayerNorm", "rms_norm", ...
    scale = _param(module, "scale", scale_init, scale_axes, (hidden,), dtype)
    if norm_type == "rmsnorm":
        return scale, None
    if norm_type != "layernorm":
        raise ValueError(f"lowbit.flax: layernorm_type: expected 'layernorm' or 'rmsnorm', got {norm_type!r}")
    return scale, _param(module, "ln_bias", bias_init, bias_axes, (hidden,), dtype)


def _lora_params(module, prefix, kernel_init, in_shape, features, rank, dtype):
    """TE's LoRA pair: {prefix}lora_a_kernel (in..., features[:-1]..., rank) and
    {prefix}lora_b_kernel (features[:-1]..., rank, features[-1]), b zero-initialised."""
    a_shape = (*in_shape, *features[:-1], rank)
    b_shape = (*features[:-1], rank, features[-1])
    a = _param(module, f"{prefix}lora_a_kernel", kernel_init, (), a_shape, dtype)
    b = _param(module, f"{prefix}lora_b_kernel", nn.initializers.zeros, (), b_shape, dtype)
    return a, b


def _fill_default_initializers(module) -> None:
    """TE's __post_init__: a kernel_init left None becomes TE's default,
    variance_scaling(1.0, "fan_in", "truncated_normal", dtype=module.dtype), and a scale_init
    left None ones (zeros with zero_centered_gamma), so the fields hold the initializers that
    __call__ uses from construction on; given initializers are kept."""
    if getattr(module, "kernel_init", False) is None:
        module.kernel_init = C.default_kernel_init(None, module.dtype)
    if getattr(module, "scale_init", False) is None:
        module.scale_init = C.default_scale_init(None, module.zero_centered_gamma)


def _check_te_fields(module, op: str) -> None:
    """TE's fields that lowbit takes at their defaults only (an error, never a silent no-op):
    transpose_batch_sequence (lowbit's modules take batch-first inputs),
    quantization_checkpoint_name (remat names lowbit's GEMM outputs through
    lowbit.checkpoint_policies instead of the quantized copies), and LayerNormMLP's
    activation_params (clamped swiglu at TE's defaults, limit 7.0 and alpha 1.702)."""
    check_batch_first(op, module.transpose_batch_sequence)
    _check_checkpoint_name(op, module.quantization_checkpoint_name)
    check_activation_params(op, getattr(module, "activation_params", None))


def _check_checkpoint_name(op: str, name) -> None:
    if name is not None:
        raise ValueError(f"{op}: quantization_checkpoint_name: expected None (name the GEMM outputs "
                         f"for remat with lowbit.checkpoint_policies), got {name!r}")


class LowbitModuleBase(nn.Module):
    """Base of the quantized modules: builds a GEMM's QuantizerSet from the module's
    `quantization_recipe` or the active autocast recipe, bound to this module's
    delayed-scaling variables (see the module docstring)."""

    quantization_recipe: Recipe | None = dataclasses.field(default=None, kw_only=True)

    def active_recipe(self) -> Recipe | None:
        return self.quantization_recipe if self.quantization_recipe is not None else get_global_recipe()

    def generate_quantizer_set(self, postfix: str = "", variable_collection: str | None = None,
                               quantization_checkpoint_name: str | None = None,
                               fp8_recipe: Recipe | None = None) -> QuantizerSet:
        """The QuantizerSet of one GEMM; `postfix` tells a module's GEMMs apart ("_0", "_1").
        TE's signature; quantization_checkpoint_name: None only (see _check_te_fields)."""
        _check_checkpoint_name("lowbit.flax: generate_quantizer_set", quantization_checkpoint_name)
        recipe = fp8_recipe if fp8_recipe is not None else self.active_recipe()
        quantizer_set = QuantizerFactory.create_set(recipe) if recipe is not None else QuantizerSet()
        return _bind_state(self, quantizer_set, postfix,
                           variable_collection or OVERWRITE_WITH_GRADIENT)


TransformerEngineBase = LowbitModuleBase


class Softmax(nn.Module):
    """Softmax over the last dim of (batch, heads, q_seqlen, k_seqlen) logits:
    softmax(scale_factor * (logits + bias)) with masked entries (mask > 0, TE's convention)
    removed. softmax_fusion_type: "scaled" (a given mask sets the masked logits to -10000),
    "scaled_masked" (the mask goes to the fused kernel), "scaled_upper_triang" (causal;
    any mask is ignored)."""

    scale_factor: float = 1.0
    softmax_fusion_type: str = "scaled"
    softmax_type: Any = AttnSoftmaxType.VANILLA_SOFTMAX

    @nn.compact
    def __call__(self, inputs, mask=None, bias=None):
        if self.softmax_type not in (AttnSoftmaxType.VANILLA_SOFTMAX, "vanilla"):
            raise ValueError("lowbit.flax.Softmax: softmax_type: expected AttnSoftmaxType.VANILLA_SOFTMAX "
                             f"(lowbit has no off-by-one or learnable softmax), got {self.softmax_type!r}")
        return C.softmax_general(inputs, mask, bias, self.scale_factor, self.softmax_fusion_type)


class LayerNorm(nn.Module):
    """LayerNorm / RMSNorm over the last dim (parameters `scale`, `ln_bias`); the output
    has the input's dtype."""

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str, ...] = ("embed",)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: tuple[str, ...] = ("embed",)
    dtype: Any = jnp.float32

    def __post_init__(self):
        _fill_default_initializers(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, x):
        scale, ln_bias = _norm_params(self, self.layernorm_type, x.shape[-1], self.scale_init, self.scale_axes,
                                      self.bias_init, self.bias_axes, self.dtype)
        return C.norm(x, scale, ln_bias, self.layernorm_type, self.zero_centered_gamma, self.epsilon)


class DenseGeneral(LowbitModuleBase):
    """y = x . kernel (+ LoRA) (+ bias) over x's `axis` dims. kernel: (x's axis dims...,
    features...), bias: features; LoRA: lora_a_kernel / lora_b_kernel (see _common)."""

    features: int | Iterable[int]
    kernel_init: Initializer | None = None
    kernel_axes: tuple[str, ...] = ()
    use_bias: bool = True
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: tuple[str, ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int | Iterable[int] = -1
    dtype: Any = jnp.float32
    input_axes: tuple[str, ...] = ()
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None

    def __post_init__(self):
        _fill_default_initializers(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs):
        _check_te_fields(self, "lowbit.flax.DenseGeneral")
        features = C.check_features("lowbit.flax.DenseGeneral", C.canonicalize_tuple(self.features))
        axis = C.normalize_axes(C.canonicalize_tuple(self.axis), inputs.ndim, "lowbit.flax.DenseGeneral")
        in_shape = tuple(inputs.shape[ax] for ax in axis)
        kernel = _param(self, "kernel", self.kernel_init, self.kernel_axes, in_shape + features, self.dtype)
        bias = (_param(self, "bias", self.bias_init, self.bias_axes, features, self.dtype)
                if self.use_bias else None)
        lora = None
        if self.enable_low_rank_adaptation:
            lora = (*_lora_params(self, "", self.kernel_init, in_shape, features,
                                  self.low_rank_adaptation_dim, self.dtype),
                    self.low_rank_adaptation_alpha)
        return C.dense_general(inputs, kernel, bias, axis, self.generate_quantizer_set(),
                               lora=lora, input_axes=self.input_axes)


class LayerNormDenseGeneral(LowbitModuleBase):
    """norm(x) . kernel (+ LoRA) (+ bias) [/ depth_scaling], norm and GEMM fused
    (layernorm_dense). Returns (y, the norm's output or None), as TE does. kernel:
    (hidden, features...)."""

    features: int | Iterable[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str, ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: tuple[str, ...] = ("embed",)
    kernel_init: Initializer | None = None
    kernel_axes: tuple[str, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: tuple[str, ...] = ()
    return_layernorm_output: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int | Iterable[int] = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: tuple[str, ...] | None = None
    dot_input_axes: tuple[str, ...] | None = None
    depth_scaling: float | None = None
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None

    def __post_init__(self):
        _fill_default_initializers(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs):
        _check_te_fields(self, "lowbit.flax.LayerNormDenseGeneral")
        C.check_last_axis("lowbit.flax.LayerNormDenseGeneral", self.axis, inputs.ndim)
        hidden = inputs.shape[-1]
        features = C.canonicalize_tuple(self.features)
        quantizer_set = self.generate_quantizer_set()
        scale = ln_bias = None
        if self.enable_layernorm:
            scale, ln_bias = _norm_params(self, self.layernorm_type, hidden, self.scale_init, self.scale_axes,
                                          self.ln_bias_init, self.ln_bias_axes, self.dtype)
        kernel = _param(self, "kernel", self.kernel_init, self.kernel_axes, (hidden, *features), self.dtype)
        lora = None
        if self.enable_low_rank_adaptation:
            lora = (*_lora_params(self, "", self.kernel_init, (hidden,), features,
                                  self.low_rank_adaptation_dim, self.dtype),
                    self.low_rank_adaptation_alpha)
        bias = (_param(self, "bias", self.bias_init, self.bias_axes, features, self.dtype)
                if self.use_bias else None)
        return C.layernorm_dense_general(
            inputs, scale, ln_bias, kernel, bias, quantizer_set,
            norm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon, want_ln=self.return_layernorm_output, lora=lora,
            depth_scaling=self.depth_scaling, layernorm_input_axes=self.layernorm_input_axes,
            dot_input_axes=self.dot_input_axes)


class LayerNormMLP(LowbitModuleBase):
    """norm -> wi (H, n_act, F) -> activations -> dropout -> wo (F, H), with biases wi_bias
    (n_act, F), wo_bias (H,) and LoRA pairs wi_lora_* / wo_lora_*. Returns (out, the
    norm's output or None), as TE does.

    One fused lowbit.layernorm_mlp runs the block when nothing must happen between its
    pieces. Active intermediate dropout (rate > 0 and not deterministic), LoRA,
    return_layernorm_output, enable_layernorm=False or an activation without a fused kernel
    select the composed path instead: layernorm_dense -> activation -> dropout -> dense,
    each GEMM still quantized with its own set (the same math, one more HBM round trip).
    layernorm_input_axes constrains the input's sharding; dot_1_input_axes and
    dot_2_input_axes (TE's names for the GEMMs' inputs, which here exist only inside the
    fused ops) are accepted and not applied (lowbit.sharding)."""

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str, ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: tuple[str, ...] = ("embed",)
    kernel_init: Initializer | None = None
    kernel_axes_1: tuple[str, ...] = ("embed", "act", "mlp")
    kernel_axes_2: tuple[str, ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: tuple[str, ...] = ("act", "mlp")
    bias_axes_2: tuple[str, ...] = ("embed",)
    return_layernorm_output: bool = False
    activations: Sequence[str | Callable] = ("gelu",)
    activation_params: dict | None = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int | Iterable[int] = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: tuple[str, ...] | None = None
    dot_1_input_axes: tuple[str, ...] | None = None
    dot_2_input_axes: tuple[str, ...] | None = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None

    def __post_init__(self):
        _fill_default_initializers(self)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs, deterministic: bool = False):
        _check_te_fields(self, "lowbit.flax.LayerNormMLP")
        C.check_last_axis("lowbit.flax.LayerNormMLP", self.axis, inputs.ndim)
        qs1 = self.generate_quantizer_set("_0")
        qs2 = self.generate_quantizer_set("_1")
        acts = C.normalize_activations(self.activations)
        n_act, hidden, ffn = len(acts), inputs.shape[-1], self.intermediate_dim
        scale = ln_bias = None
        if self.enable_layernorm:
            scale, ln_bias = _norm_params(self, self.layernorm_type, hidden, self.scale_init, self.scale_axes,
                                          self.ln_bias_init, self.ln_bias_axes, self.dtype)
        wi = self.param("wi_kernel",
                        nn.with_logical_partitioning(C.stacked_init(self.kernel_init, n_act),
                                                     C.logical_axes(self.kernel_axes_1, 3)),
                        (hidden, ffn), self.dtype)
        wo = _param(self, "wo_kernel", self.kernel_init, self.kernel_axes_2, (ffn, hidden), self.dtype)
        wi_bias = wo_bias = None
        if self.use_bias:
            wi_bias = _param(self, "wi_bias", self.bias_init, self.bias_axes_1, (n_act, ffn), self.dtype)
            wo_bias = _param(self, "wo_bias", self.bias_init, self.bias_axes_2, (hidden,), self.dtype)
        lora = None
        if self.enable_low_rank_adaptation:
            rank = self.low_rank_adaptation_dim
            wi_a = self.param("wi_lora_a_kernel",
                              nn.with_logical_partitioning(C.stacked_init(self.kernel_init, n_act), (None,) * 3),
                              (hidden, rank), self.dtype)
            wi_b = _param(self, "wi_lora_b_kernel", nn.initializers.zeros, (), (n_act, rank, ffn), self.dtype)
            wo_a, wo_b = _lora_params(self, "wo_", self.kernel_init, (ffn,), (hidden,), rank, self.dtype)
            lora = (wi_a, wi_b, wo_a, wo_b, self.low_rank_adaptation_alpha)
        dropout = None
        if self.intermediate_dropout_rate > 0 and not deterministic:
            layer = nn.Dropout(rate=self.intermediate_dropout_rate,
                               broadcast_dims=self.intermediate_hidden_dropout_dims,
                               rng_collection=self.intermediate_dropout_rng_name)
            dropout = lambda a: layer(a, deterministic=False)  # noqa: E731
        return C.layernorm_mlp_general(
            C.constrain(inputs, self.layernorm_input_axes), scale, ln_bias, wi, wo, wi_bias,
            wo_bias, (qs1, qs2), norm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma, epsilon=self.epsilon,
            activations=acts, want_ln=self.return_layernorm_output, dropout=dropout, lora=lora,
            ffn1_ckpt_name=self.ffn1_ckpt_name, ffn2_ckpt_name=self.ffn2_ckpt_name)


# TE defines these two in flax/module.py as well: the same objects as lowbit.flax's.
from lowbit.flax import make_dot_general_cls, wrap_function_in_te_state_module  # noqa: E402,F401
