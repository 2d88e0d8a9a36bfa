"""Helpers the seed tutorials import as `quickstart_jax_utils` (same call signature as
TransformerEngine's tutorial utilities, our own implementation).

speedometer() jits one forward+backward step of a Flax model (the backward w.r.t. all
variables and the input, seeded with `output_grad`), warms it up, then prints the mean time
of `timing_iters` steps. With a stateful recipe (DelayedScaling) the updated quantizer state
comes back as the gradient of the `_overwrite_with_gradient` collection and is fed into the
next step, as a training loop would.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp

import lowbit

OVERWRITE = "_overwrite_with_gradient"


def make_step(model_apply_fn: Callable, forward_kwargs: dict, rngs=None):
    def loss_and_grads(variables, x, output_grad):
        def fwd(v, inp):
            return model_apply_fn(v, inp, rngs=rngs, **forward_kwargs)

        y, vjp = jax.vjp(fwd, variables, x)
        # As in training, where the output gradient comes from a loss of y, the backward
        # starts after the forward: without this tie XLA may run backward work that needs
        # only output_grad and the params (an output layer's dgrad) before the forward and
        # keep its result live throughout.
        output_grad, _ = jax.lax.optimization_barrier((output_grad, y))
        var_grads, x_grad = vjp(output_grad.astype(y.dtype))
        return y, var_grads, x_grad

    @jax.jit
    def compiled(variables, x, output_grad):
        # The params are not returned: an unchanged argument returned from a jitted function
        # is a copy (the arguments are not donated): on the seed Dense a 1 GiB copy of the
        # kernel in every step (0.7 ms of copy kernels in its trace), bf16's included.
        return loss_and_grads(variables, x, output_grad)

    def step(variables, x, output_grad):
        y, var_grads, x_grad = compiled(variables, x, output_grad)
        if OVERWRITE in variables:
            variables = {**variables, OVERWRITE: var_grads[OVERWRITE]}
        return variables, y, var_grads, x_grad

    step.lower = compiled.lower  # the compiled program (tests and bench/common.py read it)
    return step


def speedometer(
    model_apply_fn: Callable,
    variables: Any,
    input: jnp.ndarray,
    output_grad: jnp.ndarray,
    model_init_fn: Callable = None,
    forward_kwargs: dict = {},
    autocast_kwargs: Optional[dict] = None,
    timing_iters: int = 50,
    warmup_iters: int = 50,
    rngs: Dict[str, jax.Array] = None,
) -> float:
    """Prints and returns the mean milliseconds of one jitted forward+backward step."""
    del model_init_fn
    with lowbit.autocast(**(autocast_kwargs or {})):
        step = make_step(model_apply_fn, dict(forward_kwargs), rngs)
        for _ in range(warmup_iters):
            variables, *outs = step(variables, input, output_grad)
        jax.block_until_ready(outs)
        start = time.perf_counter()
        for _ in range(timing_iters):
            variables, *outs = step(variables, input, output_grad)
        jax.block_until_ready(outs)
    mean_ms = (time.perf_counter() - start) / timing_iters * 1e3
    print(f"Mean time: {mean_ms} ms")
    return mean_ms
