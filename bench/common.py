"""Shared benchmark plumbing: timing, the measured copy-bandwidth ceiling, result tables.

Timing (time_fn): one jitted program applies the function to every input set (distinct
buffers, so nothing is served from the L2 cache), the way an op runs inside a training
step; the program is warmed up, then run `iters` times back to back, and the median of
`repeats` such batches divided by iters x sets is the time per call. Device time is read
as wall time around block_until_ready, which on one GPU stream equals event timing within
the launch overhead of the first call of a batch. Running each set in a program of its own
(`per_program=False`) adds the fixed cost of launching one executable to every call.

Device time (device_time_fn): the same program traced with jax.profiler (CUPTI kernel and
memset events); the summed durations of its device events per call. It leaves out the gaps
in which the GPU waits for the host between programs, which the wall clock of time_fn
counts: on an H100, ~10 us per call of a 2-call program (the fused quantize of a 16384 x
8192 bf16 tensor: 207.6 us of kernels, ~218 us of wall time per call).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.recipe import MMParams

RESULTS = Path(__file__).resolve().parent / "results"

# Recipe keywords for the `*_fast_bwd` variants: dgrad and wgrad at Hopper's fast
# accumulation (not the default numerics: split, as TE's and Flax FP8's).
FAST_BWD = dict(fp8_gemm_dgrad=MMParams(use_split_accumulator=False),
                fp8_gemm_wgrad=MMParams(use_split_accumulator=False))


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


def device_events(trace_dir: str) -> tuple[list, bool]:
    """The complete ("X") events of a jax.profiler trace's device lanes, and True; without a
    device lane (a CPU run), the events of every lane and False."""
    path = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))[0]
    events = json.load(gzip.open(path))["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    on_gpu = bool(gpu_pids)
    if not on_gpu:
        gpu_pids = {e["pid"] for e in events if e.get("ph") == "M"}
    return [e for e in events if e.get("ph") == "X" and e["pid"] in gpu_pids], on_gpu


def device_time_fn(fn, input_sets, iters: int = 10, warmup: int = 3) -> float | None:
    """Seconds of device time per call of fn (see the module docstring): time_fn's program,
    traced over `iters` runs; None where the trace has no device lane (CPU)."""
    f = jax.jit(lambda *sets: [fn(*s) for s in sets])
    for _ in range(warmup):
        jax.block_until_ready(f(*input_sets))
    trace_dir = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            out = None
            for _ in range(iters):
                out = f(*input_sets)
            jax.block_until_ready(out)
        events, on_gpu = device_events(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    if not on_gpu:
        return None
    # One stream: the events do not overlap, so their durations (us) add up to busy time.
    return sum(e.get("dur", 0.0) for e in events) * 1e-6 / (iters * len(input_sets))


def peak_bytes(compiled) -> int | None:
    """Peak device bytes of a compiled program (arguments + outputs + temporaries - aliases)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def _step_outputs(step, variables, x, dy):
    """(the step without its passed-through variables, for time_fn; the compiled step's peak
    device memory)."""
    compiled = step.lower(variables, x, dy).compile()
    return (lambda v, x, dy: step(v, x, dy)[1:]), peak_bytes(compiled)


def with_env(step, name: str, value: str):
    """The step (and its .lower) traced and run with os.environ[name] = value: the env knobs
    that lowbit reads at trace time apply to this variant only."""
    def scoped(fn):
        def call(*args):
            old = os.environ.get(name)
            os.environ[name] = value
            try:
                return fn(*args)
            finally:
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
        return call

    wrapped = scoped(step)
    wrapped.lower = scoped(step.lower)
    return wrapped


ALGO_TWIN_SUFFIX = "@algo"


def add_algo_argument(parser) -> None:
    """--algo TEXT: every lowbit variant chosen gets a twin, `<variant>@algo`, traced with
    LOWBIT_GEMM_ALGO=TEXT (lowbit/ops/gemm_config.py), timed in the same rounds as the variant."""
    parser.add_argument("--algo", default=None, metavar="TEXT",
                        help="also time each lowbit variant with LOWBIT_GEMM_ALGO=TEXT (as <variant>@algo)")


def add_algo_twins(cases: dict, text: str | None, fresh_step, baselines=("bf16", "flax_fp8")) -> dict:
    """cases with, after each lowbit case, its twin under LOWBIT_GEMM_ALGO=text (see
    add_algo_argument); unchanged when text is None. fresh_step(name) builds the variant's step
    anew: the twin cannot share the case's jitted function, whose trace cache would hand it
    the executable traced under the other value."""
    if text is None:
        return cases
    out = {}
    for name, (step, *rest) in cases.items():
        out[name] = (step, *rest)
        if name not in baselines:
            out[name + ALGO_TWIN_SUFFIX] = (with_env(fresh_step(name), "LOWBIT_GEMM_ALGO", text), *rest)
    return out


def time_step(step, variables, x, dy, iters: int) -> dict:
    """A training step (examples/quickstart_jax_utils.make_step) timed and measured:
    {"ms": median ms per step, "peak_bytes": the compiled step's peak device memory}."""
    fn, peak = _step_outputs(step, variables, x, dy)
    t = time_fn(fn, [(variables, x, dy)], iters)
    return {"ms": t * 1e3, "peak_bytes": peak}


def time_steps(cases: dict, iters: int, rounds: int = 3) -> dict:
    """Training steps of several variants timed round-robin: `rounds` rounds, each timing
    every variant once (a median of 2 batches of `iters` steps), and per variant the median
    over the rounds. An H100 running FP8 GEMMs back to back sits at its 700 W power cap with
    its SM clock at ~1.3 GHz instead of 1.98 (nvidia-smi, throttle reason SW power cap), and
    how hot the card is shifts every step's time by up to 5% (the seed Dense's bf16 step:
    39.2 to 41.0 ms in one session): timed one after another, the variant that runs first
    gets the coolest card. Round-robin gives every variant the same mix of card states.
    cases: {name: (step, variables, x, dy)}; returns {name: {"ms", "ms_rounds",
    "peak_bytes"}}. Each compile and each timing is printed as it finishes (flushed), so a
    run cut short by a time limit still leaves its numbers in the log."""
    fns, out = {}, {}
    for name, case in cases.items():
        fns[name], peak = _step_outputs(*case)
        out[name] = {"ms_rounds": [], "peak_bytes": peak}
        print(f"compiled {name}: peak {(peak or 0) / 2**30:.3f} GiB", flush=True)
    for r in range(rounds):
        for name, (_, variables, x, dy) in cases.items():
            t = time_fn(fns[name], [(variables, x, dy)], iters, repeats=2, warmup=2)
            out[name]["ms_rounds"].append(t * 1e3)
            print(f"round {r + 1}/{rounds} {name}: {t * 1e3:.3f} ms", flush=True)
    for r in out.values():
        r["ms"] = statistics.median(r["ms_rounds"])
    return out


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


def copy_bandwidth(nbytes: int = 1 << 30, device_time: bool = False) -> float | None:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus written: from
    the wall clock (time_fn) or, with device_time, from the kernel time (device_time_fn;
    None without a GPU)."""
    n = nbytes // 4
    sets = [(jnp.arange(n, dtype=jnp.float32) + i,) for i in range(2)]
    copy = lambda x: x + 1.0  # noqa: E731  (one read and one write per element)
    t = device_time_fn(copy, sets) if device_time else time_fn(copy, sets)
    return None if t is None else 2 * n * 4 / t


SMALL_SHAPES = [(256, 512), (128, 1024)]
GPU_SHAPES = [(16384, 8192), (8192, 32768)]


def add_size_args(parser) -> None:
    """--small, --shapes ROWSxCOLS... and --iters, as the quantize benchmarks take them."""
    parser.add_argument("--small", action="store_true", help="tiny sizes, runs on the CPU")
    parser.add_argument("--shapes", nargs="*", default=None, help="ROWSxCOLS, e.g. 16384x8192")
    parser.add_argument("--iters", type=int, default=None)


def sizes(args, gpu_shapes=GPU_SHAPES, small_shapes=SMALL_SHAPES):
    """(shapes, iters, repeats) from add_size_args' arguments: --shapes, else the --small or
    GPU defaults; 3 iterations x 2 repeats with --small, 20 x 5 otherwise."""
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    else:
        shapes = list(small_shapes if args.small else gpu_shapes)
    return shapes, args.iters or (3 if args.small else 20), 2 if args.small else 5


def copy_bandwidths(small: bool) -> tuple[float, float | None]:
    """The copy bandwidth on the wall clock and from kernel time (None without a GPU), over
    1 MiB with --small and 1 GiB otherwise; prints the header line the benchmarks share."""
    nbytes = 1 << 20 if small else 1 << 30
    wall, dev = copy_bandwidth(nbytes), copy_bandwidth(nbytes, device_time=True)
    print(f"device {device_name()}, copy bandwidth {wall / 1e9:.1f} GB/s (read + write)"
          + (f", {dev / 1e9:.1f} GB/s from kernel time" if dev else ""))
    return wall, dev


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
