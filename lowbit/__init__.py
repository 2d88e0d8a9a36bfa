"""lowbit: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs, with an exact CPU path.

Functions with their own backward (output in the input's dtype): `dense`, `layernorm`,
`layernorm_dense`, `layernorm_mlp`, `activation`, `softmax` (`activation` and `layernorm` with a
quantizer: its quantized values, dequantized; `quantized_activation` and `quantized_layernorm`:
the ScaledTensor, forward only). Recipes: `lowbit.recipe`;
quantizers: `lowbit.quantize`; Flax modules: `lowbit.flax` (imported on first use).

Each of those six names is its submodule, callable as the function it is named after: both
lowbit's `lowbit.dense(x, kernel)` and TE's `te.dense.dense(x, kernel)` (with `import lowbit as
te`; TE's `transformer_engine.jax.dense` is the module) work, as does `import lowbit.dense`.
"""

import importlib
import types

__version__ = "0.1.0"

from lowbit import ops  # noqa: E402
from lowbit import quantize, recipe  # noqa: E402
from lowbit.activation import quantized_activation  # noqa: E402
from lowbit.layernorm import quantized_layernorm  # noqa: E402
from lowbit.quantize.helper import autocast, fp8_autocast, get_global_recipe  # noqa: E402
# TE's top-level names (transformer_engine.jax): the state collection's name and its merge.
from lowbit.quantize.helper import NVTE_FP8_COLLECTION_NAME, update_collections  # noqa: E402


class _FunctionModule(types.ModuleType):
    """A submodule that is also its namesake function (the module docstring)."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


for _name in ("activation", "dense", "layernorm", "layernorm_dense", "layernorm_mlp", "softmax"):
    importlib.import_module(f"lowbit.{_name}").__class__ = _FunctionModule
del _name
from lowbit import activation, dense, layernorm, layernorm_dense, layernorm_mlp, softmax  # noqa: E402

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
