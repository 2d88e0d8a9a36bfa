"""lowbit: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs, with an exact CPU path."""

__version__ = "0.1.0"

from lowbit import ops  # noqa: E402
from lowbit import quantize, recipe  # noqa: E402
from lowbit.quantize.helper import autocast, fp8_autocast, get_global_recipe  # noqa: E402
from lowbit.activation import activation  # noqa: E402
from lowbit.softmax import softmax  # noqa: E402

__all__ = [
    "ops",
    "quantize",
    "recipe",
    "autocast",
    "fp8_autocast",
    "get_global_recipe",
    "activation",
    "softmax",
    "__version__",
]
