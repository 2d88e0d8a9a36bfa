"""lowbit.ops.encode / decode: the codecs of csrc/common/formats.h as ops.

These exist so that tests can check the host and the device codecs (the ones every
quantizer uses) against ml_dtypes over every bit pattern. Codes are uint16 (narrow codes
zero-extended; E2M1 one nibble per code). `random` (uint32, one word per value) selects
stochastic rounding for E4M3, E5M2 and E2M1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops._primitive import ffi_primitive

CODECS = {"e4m3": 0, "e5m2": 1, "e8m0": 2, "e2m1": 3, "e8m0_round_up": 4, "bf16": 5, "f16": 6}
STOCHASTIC = ("e4m3", "e5m2", "e2m1")


def _codec(op: str, fmt: str) -> np.int32:
    if fmt not in CODECS:
        raise ValueError(f"{op}: fmt: expected one of {sorted(CODECS)}, got {fmt!r}")
    return np.int32(CODECS[fmt])


encode_p = ffi_primitive(
    "lowbit_encode",
    "lowbit_encode",
    lambda x, random, *, format: jax.core.ShapedArray(x.shape, jnp.uint16),
    attrs=("format",),
)
decode_p = ffi_primitive(
    "lowbit_decode",
    "lowbit_decode",
    lambda codes, *, format: jax.core.ShapedArray(codes.shape, jnp.float32),
    attrs=("format",),
)


def encode(x, fmt: str, random=None) -> jax.Array:
    """fp32 -> uint16 codes in `fmt`, round to nearest even or stochastic with `random`."""
    code = _codec("lowbit.ops.encode", fmt)
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"lowbit.ops.encode: x: expected float32, got {x.dtype}")
    if random is None:
        random = jnp.zeros((0,), jnp.uint32)
    else:
        if fmt not in STOCHASTIC:
            raise ValueError(f"lowbit.ops.encode: random: stochastic rounding needs one of {STOCHASTIC}")
        random = jnp.asarray(random)
        if random.dtype != jnp.uint32 or random.shape != x.shape:
            raise ValueError(
                f"lowbit.ops.encode: random: expected uint32 of shape {x.shape}, "
                f"got {random.dtype}{random.shape}"
            )
    return encode_p.bind(x, random, format=code)


def decode(codes, fmt: str) -> jax.Array:
    """uint16 codes in `fmt` -> fp32."""
    code = _codec("lowbit.ops.decode", fmt)
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.uint16:
        raise TypeError(f"lowbit.ops.decode: codes: expected uint16, got {codes.dtype}")
    return decode_p.bind(codes, format=code)
