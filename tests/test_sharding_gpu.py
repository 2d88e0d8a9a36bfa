"""The seed Dense tutorial's multi-GPU section on real GPUs: one Flax nn.Dense whose GEMM is
lowbit's (make_dot_general_cls), DP=2 x TP=2 on the first 4 GPUs (column-parallel kernel
P(None, 'tp'), bias P('tp'), x P('dp'), dy P('dp', None, 'tp'), delayed-scaling state
replicated), as bench/bench_dense_multi.py times it. tests/test_sharding.py checks the same
partitioning rules on virtual CPU devices; this checks the CUDA kernels and NCCL under them.

For DelayedScaling and Float8CurrentScaling, with dense's backward as the fused op on each
device's blocks (the default under a mesh with a tp axis) and as separate ops
(LOWBIT_DENSE_BACKWARD=unfused), one jitted fwd+bwd step (the tutorial's make_step)
sharded on 4 GPUs against the same step on one GPU, unsharded:
  - y, dx, dkernel agree within 1e-2 * max|reference|, dbias (XLA's bf16 reduction, not
    lowbit's) within 4e-2 * max|reference| (see the comment at the check);
  - DelayedScaling's updated amax history / scale equal the reference bit for bit, replicated
    and identical on every device;
  - the compiled sharded program runs its 3 GEMMs (fwd, dgrad, wgrad) as lowbit_gemm custom
    calls (or the forward one and lowbit_dense_backward_fp8), with no bf16 dot (XLA dot,
    Triton GEMM fusion or cuBLAS custom call) in their place.
Skipped unless JAX sees at least 4 GPUs.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from bench_dense_multi import DenseBlock, shard_variables  # noqa: E402
from conftest import gpu_devices  # noqa: E402
# bench_dense_multi put examples/ on sys.path: the tutorial's own step
from quickstart_jax_utils import OVERWRITE, make_step  # noqa: E402

import lowbit  # noqa: E402
from lowbit.dense import DENSE_BACKWARD_ENV  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from lowbit.sharding import MeshResource, global_shard_guard  # noqa: E402

BATCH, SEQ, HIDDEN, FEATURES = 4, 256, 1024, 2048
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


@pytest.fixture
def gpus4():
    devices = gpu_devices()
    if len(devices) < 4:
        pytest.skip(f"needs 4 GPUs for the DP=2 x TP=2 mesh, JAX sees {len(devices)}")
    return devices[:4]


def _f32(a):
    return np.asarray(a, np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["fused", "unfused"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_dense_dp2_tp2_equals_single_gpu(recipe, backward, gpus4, monkeypatch):
    monkeypatch.setenv(DENSE_BACKWARD_ENV, backward)
    model = DenseBlock(FEATURES, lowbit.flax.make_dot_general_cls(RECIPES[recipe]()))
    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, SEQ, HIDDEN), jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(1), (BATCH, SEQ, FEATURES), jnp.bfloat16)
    variables = jax.jit(model.init)(jax.random.PRNGKey(2), x)
    mesh = Mesh(np.array(gpus4).reshape(2, 2), ("dp", "tp"))

    # The reference runs under the same MeshResource so both runs trace the same ops (the
    # sharded fused dense backward on one device, or the unfused ops).
    with global_shard_guard(MeshResource(dp_resource="dp", tp_resource="tp")):
        ref_vars, ref_y, ref_grads, ref_dx = make_step(model.apply, {})(
            *jax.device_put((variables, x, dy), gpus4[0]))
        sharded_args = (shard_variables(variables, mesh),
                        jax.device_put(x, NamedSharding(mesh, P("dp", None, None))),
                        jax.device_put(dy, NamedSharding(mesh, P("dp", None, "tp"))))
        step = make_step(model.apply, {})
        new_vars, y, grads, dx = step(*sharded_args)
        hlo = step.lower(*sharded_args).compile().as_text()

    # The FP8 operands are the same bits in both runs: every amax is reduced over the whole
    # mesh before the cast, so each shard quantizes with the reference's scale. What differs
    # is how the partial sums add up: the tp-split dgrad is a psum of two partial sums over F,
    # the wgrad a psum over dp of per-shard token sums (each partial rounded to bf16 and
    # summed in bf16, LOWBIT_GEMM_PSUM's default), and cuBLASLt may pick other split-K /
    # tile orders for the per-shard shapes. So an element can land up to ~2 bf16 ulps of the
    # partials' magnitude (2^-8 relative each, < 1% of max|ref| together) off; fp32 order
    # error is ~1e-6 relative. 1e-2 * max|ref| stays far below a real bug (a wrong shard, a
    # missing psum: O(max|ref|) errors).
    # dbias is not lowbit's: nn.Dense adds the bias after dot_general, so its gradient is
    # XLA's bf16 reduce_sum of dy (a bf16 accumulator over 1024 tokens; sharded, two
    # 512-token sums all-reduced over dp). Each run is off the exact sum by up to ~1.5% of
    # max|dbias| (measured with the CPU's sequential reduction), hence 4e-2 * max|ref|.
    ref_params, params = ref_grads["params"]["Dense_0"], grads["params"]["Dense_0"]
    for name, got, want, tol in (("y", y, ref_y, 1e-2), ("dx", dx, ref_dx, 1e-2),
                                 ("dkernel", params["kernel"], ref_params["kernel"], 1e-2),
                                 ("dbias", params["bias"], ref_params["bias"], 4e-2)):
        want = _f32(want)
        assert got.shape == want.shape and np.abs(want).max() > 0, name
        np.testing.assert_allclose(_f32(got), want, rtol=0, atol=tol * np.abs(want).max(), err_msg=name)

    state, ref_state = jax.tree.leaves(new_vars.get(OVERWRITE, {})), jax.tree.leaves(ref_vars.get(OVERWRITE, {}))
    assert len(state) == len(ref_state) == (6 if recipe == "delayed" else 0)  # x, kernel, dy: history + scale
    for got, want, before in zip(state, ref_state, jax.tree.leaves(variables.get(OVERWRITE, {}))):
        want = np.asarray(want)
        assert not np.array_equal(want, np.asarray(before)), "the step must update the state"
        shards = [np.asarray(s.data) for s in got.addressable_shards]
        assert len(shards) == 4 and all(s.shape == want.shape for s in shards), "state must be replicated"
        for shard in shards:
            np.testing.assert_array_equal(shard, want)

    # lowbit's GEMMs: the forward GEMM and the fused backward op (the default under a mesh
    # with a tp axis), or 3 GEMMs per Dense (fwd, dgrad, wgrad: LOWBIT_DENSE_BACKWARD=unfused),
    # and no bf16 GEMM in their place: no XLA dot (also inside a Triton GEMM fusion) and no
    # cuBLAS custom call.
    fused = backward == "fused"
    assert hlo.count('custom_call_target="lowbit_gemm"') == (1 if fused else 3), hlo
    assert hlo.count('custom_call_target="lowbit_dense_backward_fp8"') == int(fused), hlo
    assert " dot(" not in hlo and "__cublas" not in hlo
