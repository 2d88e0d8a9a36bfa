"""lowbit.flax: Flax (Linen) integration; TE-style modules in module.py, NNX twins in nnx.py.

`make_dot_general_cls(recipe)` returns a module class for `nn.Dense(dot_general=cls())`:
the Dense keeps its own parameters, initialisation and sharding; only the GEMM becomes
lowbit's quantized `dense`. Stateful recipes (DelayedScaling) keep their state as Flax
variables in the collection `_overwrite_with_gradient`: `x_scale (1,)`,
`x_amax_history (L,)`, and the same for `kernel` and `grad`. Their "gradient" is the state
for the next step, which the training loop writes back (overwrite-with-gradient); pass the
whole variable dict, not only `params`, from step to step.

NVFP4 (NVFP4BlockScaling) keeps no state but needs randomness: its stochastic rounding (of
the gradients) and random Hadamard transform signs take a key from the Flax RNG stream
"sr_rng", which the caller passes like dropout's, e.g.
`model.apply(variables, x, rngs={"dropout": k1, "sr_rng": k2})` (a new key per training
step). Each module that quantizes draws its own key from the stream (lowbit.dense.with_sr_key
makes of it an SR key per quantizer and one RHT sign key per GEMM, shared by the copies its
wgrad multiplies); a forward without it runs (no SR there; RHT signs all +), a gradient
without it raises an error naming "sr_rng". This holds for
make_dot_general_cls, wrap_function_in_state_module and the modules of module.py alike.

`wrap_function_in_te_state_module` is TE's calling convention (f gets a
`generate_quantizer_set` callable first; the class is named TEWrapper_*), lowbit's
`wrap_function_in_state_module` passes the set as the `quantizer_set` keyword instead.

`extend_logical_axis_rules` is lowbit.sharding's, here where TE's flax package has it. TE's
attention and transformer layers (DotProductAttention, MultiHeadAttention,
RelativePositionBiases, TransformerLayer, TransformerLayerType, in TE's flax/transformer.py)
are not part of lowbit: asking for one is an AttributeError that says so and what to use.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import linen as nn

from lowbit.dense import dense
from lowbit.quantize.helper import NVTE_FP8_COLLECTION_NAME, QuantizerFactory
from lowbit.quantize.quantizer import DelayedScaleQuantizer, QuantizerSet
from lowbit.sharding import extend_logical_axis_rules

OVERWRITE_WITH_GRADIENT = NVTE_FP8_COLLECTION_NAME  # "_overwrite_with_gradient"

# QuantizerSet field -> variable name prefix (TE's names).
_STATE_PREFIX = {"x": "x", "kernel": "kernel", "dgrad": "grad"}

__all__ = [
    "OVERWRITE_WITH_GRADIENT",
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "LowbitModuleBase",
    "Softmax",
    "TransformerEngineBase",
    "extend_logical_axis_rules",
    "make_dot_general_cls",
    "wrap_function_in_state_module",
    "wrap_function_in_te_state_module",
]


def _bind_state(module: nn.Module, quantizer_set: QuantizerSet, postfix: str = "",
                collection: str = OVERWRITE_WITH_GRADIENT) -> QuantizerSet:
    """Replaces the state leaves of stateful quantizers by this module's variables, named
    `{x|kernel|grad}{postfix}_scale` / `..._amax_history` in `collection`, and gives NVFP4
    quantizers a key from the "sr_rng" RNG stream when there is one."""
    bound = {}
    for field, prefix in _STATE_PREFIX.items():
        q = getattr(quantizer_set, field)
        if isinstance(q, DelayedScaleQuantizer):
            length = q.amax_history.shape[0]
            scale = module.variable(collection, f"{prefix}{postfix}_scale",
                                    jnp.ones, (1,), jnp.float32)
            history = module.variable(collection, f"{prefix}{postfix}_amax_history",
                                      jnp.zeros, (length,), jnp.float32)
            q = dataclasses.replace(q, scale=scale.value, amax_history=history.value)
        bound[field] = q
    bound = quantizer_set._replace(**bound)
    # NVFP4's stochastic rounding and RHT signs draw from the "sr_rng" stream when the module
    # has one (apply(..., rngs={"sr_rng": key})); without it SR gradients raise a clear error.
    if any(hasattr(q, "with_key") for q in bound.quantizers) and module.has_rng("sr_rng"):
        from lowbit.dense import with_sr_key

        bound = with_sr_key(bound, module.make_rng("sr_rng"))
    return bound


def wrap_function_in_state_module(f, quantization_recipe, name: str | None = None):
    """A Linen module class whose __call__(*args, **kwargs) calls
    f(*args, quantizer_set=<the recipe's set, bound to this module's state>, **kwargs).
    With NVFP4BlockScaling the set carries a key drawn from the "sr_rng" RNG stream when the
    caller passes one (apply(..., rngs={"sr_rng": key}); see the module docstring)."""

    class Wrapper(nn.Module):
        @nn.compact
        def __call__(self, *args, **kwargs):
            quantizer_set = QuantizerFactory.create_set(quantization_recipe)
            return f(*args, quantizer_set=_bind_state(self, quantizer_set), **kwargs)

    Wrapper.__name__ = Wrapper.__qualname__ = f"Wrapper_{name or f.__name__}"
    return Wrapper


def wrap_function_in_te_state_module(f, quantization_recipe, name: str | None = None):
    """TransformerEngine's form of wrap_function_in_state_module, for TE code ported as is: a
    Linen module class named `TEWrapper_{name or f.__name__}` (TE's name, so variable paths
    match TE's) whose __call__(*args, **kwargs) calls f(generate_quantizer_set, *args,
    **kwargs); `generate_quantizer_set(postfix="")` returns the recipe's set bound to this
    module's state, which lives in `_overwrite_with_gradient` (postfix tells several GEMMs of
    one f apart: "_0", "_1")."""

    class TEWrapper(nn.Module):
        def generate_quantizer_set(self, postfix: str = ""):
            quantizer_set = QuantizerFactory.create_set(quantization_recipe)
            return _bind_state(self, quantizer_set, postfix)

        @nn.compact
        def __call__(self, *args, **kwargs):
            return f(self.generate_quantizer_set, *args, **kwargs)

    TEWrapper.__name__ = TEWrapper.__qualname__ = f"TEWrapper_{name or f.__name__}"
    return TEWrapper


def make_dot_general_cls(quantization_recipe):
    """A module class usable as `nn.Dense(dot_general=cls())` that runs lowbit.dense.
    It is TE's: wrap_function_in_te_state_module's `TEWrapper_dot_general`, so its state's
    variable path (`_overwrite_with_gradient/.../TEWrapper_dot_general_0/x_scale`, ...) is
    the one TE gives. NVFP4BlockScaling: pass the "sr_rng" RNG stream to the model's apply,
    `model.apply(variables, x, rngs={"sr_rng": key})`, with a fresh key per step; gradients
    without it raise an error naming the stream (see the module docstring)."""

    def dot_general(generate_quantizer_set, x, kernel, dimension_numbers, precision=None,
                    preferred_element_type=None):
        del precision  # lowbit's GEMMs accumulate in fp32 whatever the precision asks
        contracting, batch = dimension_numbers
        if tuple(batch[0]) or tuple(batch[1]):
            raise ValueError(
                "lowbit.flax.make_dot_general_cls: dimension_numbers: batch dimensions are not "
                f"supported by the quantized dense, got {dimension_numbers}"
            )
        y = dense(x, kernel, contracting_dims=contracting, quantizer_set=generate_quantizer_set())
        return y if preferred_element_type is None else y.astype(preferred_element_type)

    return wrap_function_in_te_state_module(dot_general, quantization_recipe, "dot_general")


# The TE-style modules (module.py) build on _bind_state above; NNX twins: lowbit.flax.nnx.
from lowbit.flax.module import (  # noqa: E402
    DenseGeneral,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    LowbitModuleBase,
    Softmax,
    TransformerEngineBase,
)


# TE's flax names that lowbit does not port (TE's flax/transformer.py: attention, cuDNN fused
# attention, the transformer layer), for the error below.
_TE_TRANSFORMER_NAMES = frozenset({"DotProductAttention", "MultiHeadAttention", "RelativePositionBiases",
                                   "TransformerLayer", "TransformerLayerType"})


def __getattr__(name):
    """`lowbit.flax.nnx` (the NNX twins) as an attribute too, imported on first use."""
    if name == "nnx":
        import importlib

        return importlib.import_module("lowbit.flax.nnx")
    if name in _TE_TRANSFORMER_NAMES:
        raise AttributeError(
            f"module 'lowbit.flax' has no attribute {name!r}: TransformerEngine's attention and "
            f"transformer layers (transformer_engine.jax.flax.{name}) are not part of lowbit. Build the "
            f"layer from lowbit.flax's LayerNormDenseGeneral (the QKV projection), DenseGeneral and "
            f"LayerNormMLP around your own attention, as examples/fused_layer.py does, or keep Flax's "
            f"modules and pass make_dot_general_cls(recipe) as their dot_general")
    raise AttributeError(f"module 'lowbit.flax' has no attribute {name!r}")
