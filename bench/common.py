"""Shared benchmark plumbing: timing, the measured copy-bandwidth ceiling, result tables.

Timing (time_fn): one jitted program applies the function to every input set (distinct
buffers, so nothing is served from the L2 cache), the way an op runs inside a training
step; the program is warmed up, then run `iters` times back to back, and the median of
`repeats` such batches divided by iters x sets is the time per call. Device time is read
as wall time around block_until_ready, which on one GPU stream equals event timing within
the launch overhead of the first call of a batch. Running each set in a program of its own
(`per_program=False`) adds the fixed cost of launching one executable to every call.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform).replace(" ", "_")


def time_fn(fn, input_sets, iters: int = 20, repeats: int = 5, warmup: int = 3,
            per_program: bool = True) -> float:
    """Median seconds per call of fn, over the input sets (see the module docstring)."""
    if per_program:
        f = jax.jit(lambda *sets: [fn(*s) for s in sets])
        calls = [tuple(input_sets)]
    else:
        f = jax.jit(fn)
        calls = list(input_sets)
    per_run = len(input_sets) if per_program else 1
    for i in range(warmup):
        jax.block_until_ready(f(*calls[i % len(calls)]))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for i in range(iters):
            out = f(*calls[i % len(calls)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / (iters * per_run))
    return statistics.median(samples)


def peak_bytes(compiled) -> int | None:
    """Peak device bytes of a compiled program (arguments + outputs + temporaries - aliases)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def time_step(step, variables, x, dy, iters: int) -> dict:
    """A training step (examples/quickstart_jax_utils.make_step) timed and measured:
    {"ms": median ms per step, "peak_bytes": the compiled step's peak device memory}."""
    compiled = step.lower(variables, x, dy).compile()
    t = time_fn(lambda v, x, dy: step(v, x, dy)[1:], [(variables, x, dy)], iters)
    return {"ms": t * 1e3, "peak_bytes": peak_bytes(compiled)}


def speedup_table(results: dict) -> list[dict]:
    """Adds speedup_vs_bf16 (and speedup_vs_flax_fp8 where a "flax_fp8" variant exists) to
    each variant's result dict and returns the printable rows."""
    rows = []
    for name, r in results.items():
        r["speedup_vs_bf16"] = results["bf16"]["ms"] / r["ms"]
        row = {"variant": name, "ms": r["ms"], "x bf16": r["speedup_vs_bf16"]}
        if "flax_fp8" in results:
            r["speedup_vs_flax_fp8"] = results["flax_fp8"]["ms"] / r["ms"]
            row["x flax_fp8"] = r["speedup_vs_flax_fp8"]
        row["peak GiB"] = (r["peak_bytes"] or 0) / 2**30
        rows.append(row)
    return rows


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = nbytes // 4
    sets = [(jnp.arange(n, dtype=jnp.float32) + i,) for i in range(2)]
    t = time_fn(lambda x: x + 1.0, sets)  # one read and one write per element
    return 2 * n * 4 / t


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}_{device_name()}.json"
    payload = {"device": device_name(), "jax": jax.__version__, **payload}
    path.write_text(json.dumps(payload, indent=2, default=float))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float | np.floating):
        return f"{v:.4g}"
    return str(v)
