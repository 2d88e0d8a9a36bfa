"""Error naming shared by lowbit.cpp_extensions' TE-compatible entry points.

The shims validate through lowbit's own ops, whose messages name the op and the argument
("lowbit.ops.norm_forward: gamma: expected shape (160,), got (159,)"). named_errors(op)
prefixes such a message with the entry point the caller used, so that it reads
"lowbit.cpp_extensions.normalization_fwd: lowbit.ops.norm_forward: gamma: ...".
"""

from __future__ import annotations

import contextlib

import numpy as np

from lowbit.quantize.tensor import NoScaleTensor


@contextlib.contextmanager
def named_errors(op: str):
    """Re-raises a plain ValueError or TypeError from the block with `op: ` in front (other
    exception types, e.g. JAX's tracer errors, whose constructors differ, pass unchanged)."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if type(e) not in (ValueError, TypeError) or str(e).startswith(f"{op}:"):
            raise
        raise type(e)(f"{op}: {e}") from e


def check_flag(op: str, name: str, value, hint: str = "") -> bool:
    """`value` as a bool; TypeError naming `op` and `name` (then `hint`) unless it is a Python
    or NumPy bool."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    shape = getattr(value, "shape", None)
    got = f"an array of shape {tuple(shape)}" if shape is not None else repr(value)
    raise TypeError(f"{op}: {name}: expected a bool, got {got}{hint}")


def unwrap(x):
    """A NoScaleTensor's data (TE's functions take either it or a plain array), else x."""
    return x.data if isinstance(x, NoScaleTensor) else x
