"""Two processes, one program: jax.distributed on the CPU (loopback coordinator, gloo
collectives), 2 local CPU devices each, a 4-way data-parallel mesh. Each process trains the
same tiny lowbit model (DenseGeneral + LayerNormMLP, DelayedScaling) for a few steps on its
half of every batch; both must report the same losses, parameters and delayed-scaling state.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lowbit

TIMEOUT_S = 180

CHILD = textwrap.dedent('''
    import hashlib, json, os, sys
    # Import the lowbit the parent test imported (its source tree), not another install.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__
                        and "skbc" not in type(f).__module__]
    sys.path.insert(0, os.environ["LOWBIT_SRC"])
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=os.environ["COORD"], num_processes=2,
                               process_id=int(os.environ["PROC"]), initialization_timeout=60)
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import lowbit
    from lowbit.flax import OVERWRITE_WITH_GRADIENT, DenseGeneral, LayerNormMLP
    from lowbit.recipe import DelayedScaling
    from lowbit.sharding import MeshResource, global_shard_guard

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = DenseGeneral(32, kernel_axes=("embed", "mlp"), name="proj")(x)
            out, _ = LayerNormMLP(intermediate_dim=64, activations=("gelu",),
                                  intermediate_dropout_rate=0.0, return_layernorm_output=False)(h)
            return out

    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    model = Model()
    rng = np.random.default_rng(0)  # same data in both processes; each feeds its own shard
    batches = [rng.standard_normal((8, 16, 32)).astype(np.float32) for _ in range(3)]
    x_sharding = NamedSharding(mesh, P("dp"))
    replicated = NamedSharding(mesh, P())

    def global_batch(b):
        return jax.make_array_from_callback(b.shape, x_sharding,
                                            lambda idx: jnp.asarray(b[idx], jnp.bfloat16))

    def loss_fn(params, state, x):
        y = model.apply({"params": params, OVERWRITE_WITH_GRADIENT: state}, x)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    with global_shard_guard(MeshResource(dp_resource="dp")), \\
            lowbit.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
        variables = jax.jit(model.init, out_shardings=replicated)(
            jax.random.PRNGKey(0), global_batch(batches[0]))
        variables = nn.unbox(variables)

        @jax.jit
        def train_step(variables, x):
            loss, (gp, gs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                variables["params"], variables[OVERWRITE_WITH_GRADIENT], x)
            params = jax.tree.map(lambda p, g: p - 0.05 * g, variables["params"], gp)
            return loss, {"params": params, OVERWRITE_WITH_GRADIENT: gs}

        losses = []
        for b in batches:
            loss, variables = train_step(variables, global_batch(b))
            losses.append(float(np.asarray(loss.addressable_shards[0].data)))

    def local(a):  # replicated: every local shard holds the whole value
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)
        return shards[0]

    leaves = {}
    for k, v in jax.tree_util.tree_leaves_with_path(variables):
        a = local(v)
        name = jax.tree_util.keystr(k)
        leaves[name] = hashlib.sha256(a.tobytes()).hexdigest()
        if "x_amax_history" in name:
            leaves[name + " nonzero"] = int(np.count_nonzero(a))
    print("RESULT " + json.dumps({"losses": losses, "leaves": leaves}), flush=True)
    jax.distributed.shutdown()
''')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_data_parallel_training_agrees(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    coord = f"127.0.0.1:{_free_port()}"
    procs, logs = [], []
    for proc_id in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "COORD": coord, "PROC": str(proc_id),
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "LOWBIT_SRC": str(Path(lowbit.__file__).resolve().parents[1])}
        # Files, not pipes: a process blocked on a full pipe would stall the other in the
        # shutdown barrier.
        logs.append(tmp_path / f"proc{proc_id}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"two-process run exceeded {TIMEOUT_S} s: {logs[0].read_text()[-2000:]}")
    results = []
    for p, log in zip(procs, logs):
        out = log.read_text()
        assert p.returncode == 0, out[-4000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    first, second = results
    assert len(first["losses"]) == 3 and all(v == v for v in first["losses"])
    assert first["losses"] == second["losses"]  # bit for bit: the same global program
    assert first["leaves"].keys() == second["leaves"].keys()
    assert any("amax_history" in k for k in first["leaves"])
    for key, value in first["leaves"].items():
        assert value == second["leaves"][key], key
    nonzero = [v for k, v in first["leaves"].items() if k.endswith(" nonzero")]
    assert nonzero and all(v == 3 for v in nonzero)  # three steps recorded in the history
