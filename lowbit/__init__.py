"""lowbit: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs, with an exact CPU path.

Functions with their own backward (output in the input's dtype): `dense`, `layernorm`,
`layernorm_dense`, `layernorm_mlp`, `activation`, `softmax` (`activation` and `layernorm` with a
quantizer: its quantized values, dequantized; `quantized_activation` and `quantized_layernorm`:
the ScaledTensor, forward only). Recipes: `lowbit.recipe`;
quantizers: `lowbit.quantize`; Flax modules: `lowbit.flax` (imported on first use).
"""

import importlib

__version__ = "0.1.0"

from lowbit import ops  # noqa: E402
from lowbit import quantize, recipe  # noqa: E402
from lowbit.activation import activation, quantized_activation  # noqa: E402
from lowbit.dense import dense  # noqa: E402
from lowbit.layernorm import layernorm, quantized_layernorm  # noqa: E402
from lowbit.layernorm_dense import layernorm_dense  # noqa: E402
from lowbit.layernorm_mlp import layernorm_mlp  # noqa: E402
from lowbit.quantize.helper import autocast, fp8_autocast, get_global_recipe  # noqa: E402
# TE's top-level names (transformer_engine.jax): the state collection's name and its merge.
from lowbit.quantize.helper import NVTE_FP8_COLLECTION_NAME, update_collections  # noqa: E402
from lowbit.softmax import softmax  # noqa: E402

_LAZY = ("flax", "checkpoint_policies", "sharding")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"lowbit.{name}")
    if name == "MeshResource":  # TE exports it at the top level too
        return importlib.import_module("lowbit.sharding").MeshResource
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


__all__ = [
    "ops",
    "quantize",
    "recipe",
    "autocast",
    "fp8_autocast",
    "get_global_recipe",
    "activation",
    "quantized_activation",
    "dense",
    "layernorm",
    "quantized_layernorm",
    "layernorm_dense",
    "layernorm_mlp",
    "softmax",
    "flax",
    "checkpoint_policies",
    "sharding",
    "MeshResource",
    "NVTE_FP8_COLLECTION_NAME",
    "update_collections",
    "__version__",
]
