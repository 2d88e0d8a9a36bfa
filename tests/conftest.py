"""Shared pytest setup.

Tests run on JAX's default backend: the CPU in CI (exercising the C++ references through
the CPU handlers), the GPU under tools/gpu_check.sh (exercising the CUDA kernels). Tests
that compare the two backends directly are marked `gpu` and skip without a GPU; tests of the
CPU handlers' exact arithmetic are marked `cpu_reference` and run on the CPU everywhere.
"""

from __future__ import annotations

import os

# Several tests shard over virtual CPU devices; this must happen before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# References are fp32: on a GPU, XLA's default fp32 dot uses TF32, which would make the
# jnp references less precise than the code they check.
jax.config.update("jax_default_matmul_precision", "highest")


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(autouse=True)
def _cpu_reference_on_the_cpu(request):
    """Tests marked `cpu_reference` assert the CPU handlers' exact arithmetic, which the CUDA
    paths meet only within the tolerances their own tests state: under a GPU default backend
    (tools/gpu_check.sh's suite on CUDA) they run with the CPU as default device."""
    if request.node.get_closest_marker("cpu_reference") is None or jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_collection_modifyitems(config, items):
    if gpu_devices():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(a, b) -> float:
    """Relative Frobenius error ||a - b|| / ||b||, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_on(device, fn, *args, **kwargs):
    """Runs jit(fn) with its inputs and computation placed on `device`; returns numpy."""
    args = jax.device_put(args, device)
    with jax.default_device(device):
        out = jax.jit(fn, **kwargs)(*args)
    return jax.tree.map(np.asarray, out)


@pytest.fixture
def cpu():
    return jax.devices("cpu")[0]


@pytest.fixture
def gpu():
    devices = gpu_devices()
    if not devices:
        pytest.skip("needs a CUDA GPU")
    return devices[0]


@pytest.fixture
def rng():
    """A fresh numpy Generator per test. The seed is printed (pytest shows it for a failing
    test); LOWBIT_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("LOWBIT_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


def special_values(dtype) -> np.ndarray:
    """inf, NaN, zeros, denormals and near-max values for a float dtype (as float32)."""
    info = ml_dtypes.finfo(dtype)
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max),
            float(info.tiny), float(info.smallest_subnormal), -float(info.smallest_subnormal),
            float(info.max) * 0.999, 1.0, -1.0]
    return np.array(vals, np.float32)


def random_with_specials(rng, shape, dtype, scale=3.0):
    """Normal random values with special values planted at random positions."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    flat = x.reshape(-1)
    specials = special_values(dtype)
    if flat.size >= 4 * specials.size:
        idx = rng.choice(flat.size, specials.size, replace=False)
        flat[idx] = specials
    return flat.reshape(shape).astype(dtype)
