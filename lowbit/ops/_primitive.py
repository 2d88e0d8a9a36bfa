"""Small helpers that turn lowbit FFI targets into JAX ops.

Each op family in lowbit/ops/ defines its primitives with `ffi_primitive`: abstract
evaluation and batching are the family's; lowering goes through `jax.ffi.ffi_lowering`
for "cpu" and "cuda", after `_ffi.require_platform` has made sure a handler exists (a
clear error instead of XLA's "No registered implementation for custom call").
`cuda_workspace` gives a CUDA handler its device workspace as one more result, declared in
the lowering and dropped (XLA plans it with the program's memory; csrc/ffi/ffi_util.h,
WorkspaceFromResult). `vmap_body` is the batching rule of the families' custom_vmap ops.
"""

from __future__ import annotations

from functools import partial

from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jax
import jax.numpy as jnp

from lowbit import _ffi


def ffi_primitive(
    name: str,
    target: str,
    abstract_eval,
    *,
    multiple_results: bool = False,
    attrs: tuple[str, ...] = (),
    cuda_workspace=None,
):
    """`attrs` names the primitive params passed to the handler as FFI attributes (with
    their numpy types); every other param only shapes the abstract evaluation.
    `cuda_workspace(avals_in, **params) -> bytes`: the CUDA custom call gets one more result,
    u8 of that many bytes, its workspace, which the op's outputs leave out (the CPU handler
    has no such result)."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    lower = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, platform, **params):
        _ffi.require_platform(target, platform)
        ffi_attrs = {k: v for k, v in params.items() if k in attrs}
        if platform != "cuda" or cuda_workspace is None:
            return lower(ctx, *args, **ffi_attrs)
        workspace = jax.core.ShapedArray((int(cuda_workspace(ctx.avals_in, **params)),), jnp.uint8)
        outs = lower(ctx.replace(avals_out=[*ctx.avals_out, workspace]), *args, **ffi_attrs)
        return outs[:-1]

    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, partial(lowering, platform=platform), platform=platform)
    return prim


def vmap_body(fn):
    """The def_vmap rule of a custom_vmap op that batches by vmapping its body `fn` (the op
    on unbatched operands, whose primitives have batching rules of their own): operands
    batched at axis 0 (where custom_vmap puts them) or not at all, every output batched."""

    def rule(axis_size, in_batched, *args):
        axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(fn, in_axes=axes, axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return rule
