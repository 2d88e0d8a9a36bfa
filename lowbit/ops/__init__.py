"""lowbit.ops: JAX primitives over lowbit's FFI targets, one module per op family."""

from lowbit.ops.amax import amax
from lowbit.ops.formats import decode, encode

__all__ = ["amax", "decode", "encode"]
