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


def check_te_keywords(op: str, amax_scope, transpose_batch_sequence,
                      output_amax_when_no_scaling=False) -> None:
    """TE 2.12's extra keywords of its quantize, norm and activation entry points, accepted
    where lowbit computes what TE does: amax_scope None or an AmaxScope (lowbit's one amax
    rule: lowbit.cpp_extensions.amax), transpose_batch_sequence either bool (TE reads it only
    to find a TPSP-sharded sequence dim for the amax), output_amax_when_no_scaling False
    (lowbit does not report an amax for an unquantized output): True is an error."""
    from lowbit.cpp_extensions.amax import AmaxScope

    if amax_scope is not None and not isinstance(amax_scope, AmaxScope):
        raise TypeError(f"{op}: amax_scope: expected None or a lowbit.cpp_extensions.AmaxScope, "
                        f"got {amax_scope!r}")
    check_flag(op, "transpose_batch_sequence", transpose_batch_sequence)
    if check_flag(op, "output_amax_when_no_scaling", output_amax_when_no_scaling):
        raise ValueError(f"{op}: output_amax_when_no_scaling: expected False (lowbit reports no "
                         f"amax for an unquantized output), got True")
