"""A small helper that turns one lowbit FFI target into a JAX primitive.

Each op family in lowbit/ops/ defines its primitives with `ffi_primitive`: abstract
evaluation and batching are the family's; lowering goes through `jax.ffi.ffi_lowering`
for "cpu" and "cuda", after `_ffi.require_platform` has made sure a handler exists (a
clear error instead of XLA's "No registered implementation for custom call").
"""

from __future__ import annotations

from functools import partial

from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jax

from lowbit import _ffi


def ffi_primitive(
    name: str,
    target: str,
    abstract_eval,
    *,
    multiple_results: bool = False,
    attrs: tuple[str, ...] = (),
):
    """`attrs` names the primitive params passed to the handler as FFI attributes (with
    their numpy types); every other param only shapes the abstract evaluation."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    lower = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, platform, **params):
        _ffi.require_platform(target, platform)
        return lower(ctx, *args, **{k: v for k, v in params.items() if k in attrs})

    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, partial(lowering, platform=platform), platform=platform)
    return prim
