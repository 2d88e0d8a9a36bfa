"""lowbit: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs, with an exact CPU path."""

__version__ = "0.1.0"

from lowbit import ops  # noqa: E402

__all__ = ["ops", "__version__"]
