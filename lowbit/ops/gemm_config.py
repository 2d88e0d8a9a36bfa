"""lowbit.ops.gemm_config: what a lowbit GEMM call is configured with, shared by lowbit.ops.gemm,
lowbit.ops.gemm_nvfp4 and lowbit.ops.dense_backward.

- the operand and output dtypes the ops take, and the sizes the C++ side fixes
  (csrc/gemm/gemm.h: FP8 dims padded to multiples of 16, the cuBLASLt workspace);
- GemmScaleMode, how a scale_inv is read, the block mode pairs cuBLASLt runs per compute
  capability (block_on_cublaslt) and the block problems it takes as they are;
- the cuBLASLt algorithm per GEMM kind: LOWBIT_GEMM_ALGO over DEFAULT_ALGO (below);
- LOWBIT_GEMM_PSUM: the dtype a K-sharded GEMM sums its shards' partial products in.
Both environment variables are read at trace time.

The cuBLASLt algorithm (CUDA): a GEMM's `algo` picks entry `algo` of the list of algorithms
cuBLASLt's heuristic returns (0 = its first choice; a plan-cache key in C++). `gemm(algo=None)`
takes it from LOWBIT_GEMM_ALGO, read at trace time: "k" for every FP8 kind, or "kind=k,kind=k"
with kinds fp8_fast (per-tensor, fast accumulation: the forward GEMM), fp8_split (per-tensor,
split accumulation, a 16-bit output: dgrad), fp8_split_f32 (the same with an f32 output: the
wgrad of an f32 kernel; cuBLASLt's heuristic list, which the index points into, depends on the
output type), fused_dgrad (the dgrad of the fused Dense backward, lowbit.ops.dense_backward_fp8,
at split accumulation: dy's rowwise copy read at dk's row pitch and batched over its row
segments, a problem cuBLASLt ranks apart from the standalone dgrad), fused_wgrad (that op's
wgrad at split accumulation: dy's colwise copy in column slices, each a launch writing dk's
columns at dk's pitch), block (FP8 1x128 / 128x128), mxfp8 and nvfp4 (gemm_nvfp4.nvfp4_gemm);
unset kinds take DEFAULT_ALGO (0, cuBLASLt's first choice, but fused_dgrad: 1). A bad value
raises a ValueError naming the variable; an index past what cuBLASLt returns for a problem fails
that GEMM with the count it did return where the user set it; a library default (DEFAULT_ALGO's)
runs entry 0 there instead (the custom calls' algo_or_first attribute, in lowbit_gemm,
lowbit_gemm_nvfp4 and the fused Dense backward alike). bench/bench_gemm.py --algo-sweep times
every index.
"""

from __future__ import annotations

import enum
import functools
import os

import jax.numpy as jnp
import numpy as np

OP = "lowbit.ops.gemm"
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_DIM_MULTIPLE = 16  # kFp8DimMultiple in csrc/gemm/gemm.h
GEMM_WORKSPACE_BYTES = (32 << 20) + 256  # kGemmWorkspaceBytes in csrc/gemm/gemm.h
MXFP8_K_MULTIPLE = 128  # kMxfp8KMultiple in csrc/gemm/cublaslt_gemm_cuda.cc
MAX_ALGO = 32  # kGemmMaxAlgo in csrc/gemm/gemm.h: algo is 0..MAX_ALGO-1
ALGO_ENV = "LOWBIT_GEMM_ALGO"
# The cuBLASLt heuristic index each kind of FP8 GEMM runs with unless LOWBIT_GEMM_ALGO says
# otherwise (0 = cuBLASLt's first choice); bench/bench_gemm.py --algo-sweep measures the others.
# fused_dgrad = 1: on H100s the seed Dense step ran 1.3% (three alternating pairs) and 1.6%
# (four rounds, another machine) faster with it, the seed layer from the fused modules the
# same (22.36 vs 22.35 ms) (2026-11-27; bench/results/dense_dgrad_algo_* and
# fused_dgrad_algo_*). fused_wgrad = 0: indices 1-7 were no faster (H200, 2026-11-29,
# fused_backward_sweep_NVIDIA_H200.json). A problem without a second entry runs the first
# (GemmArgs::algo_or_first).
DEFAULT_ALGO = {"fp8_fast": 0, "fp8_split": 0, "fp8_split_f32": 0, "fused_dgrad": 1, "fused_wgrad": 0,
                "block": 0, "mxfp8": 0, "nvfp4": 0}


class GemmScaleMode(enum.IntEnum):
    """How a scale_inv is read (GemmScaleMode in csrc/gemm/gemm.h)."""

    TENSOR = 0          # one f32
    BLOCK_1x128 = 1     # f32 per 1x128 tile along K
    BLOCK_128x128 = 2   # f32 per 128x128 tile
    MXFP8 = 3           # e8m0 per 32 values along K


FP8_BLOCK_MODES = (GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_128x128)
# (a, b) mode pairs cuBLASLt runs, on sm_90 only (the pairs PyTorch's _scaled_mm hands it,
# aten/src/ATen/native/cuda/ScaledBlas.cpp; 128x128 x 128x128 is not among them).
CUBLASLT_BLOCK_PAIRS = ((GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_128x128),
                        (GemmScaleMode.BLOCK_128x128, GemmScaleMode.BLOCK_1x128),
                        (GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_1x128))
_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)


def mxfp8_on_cublaslt(capability: str) -> bool:
    """The sm_100 gate: MXFP8 runs on cuBLASLt on compute capability 10.x exactly (cuBLASLt's
    VEC32_UE8M0 mode; the C++ launcher checks the same), and is emulated everywhere else."""
    return capability.split(".")[0] == "10"


def block_on_cublaslt(modes, capability: str) -> bool:
    """Whether the CUDA lowering hands a block-scaled (a, b) mode pair to cuBLASLt on a device
    of `capability` ("9.0" style); False = the jnp emulation."""
    if modes == (GemmScaleMode.MXFP8, GemmScaleMode.MXFP8):
        return mxfp8_on_cublaslt(capability)
    return modes in CUBLASLT_BLOCK_PAIRS and capability == "9.0"


def _block_bias_epilogue(out_dtype, mxfp8: bool) -> bool:
    """Whether cuBLASLt adds a block-scaled GEMM's bias in its epilogue: FP8 block scaling with a
    16-bit output (the bias in that dtype, added in fp32 before the one rounding: the formula
    of the emulation). An fp32 output's bias, and MXFP8's, are added in fp32 afterwards."""
    return not mxfp8 and jnp.dtype(out_dtype) != jnp.dtype(jnp.float32)


def _cublaslt_block_ready(m: int, n: int, k: int, bias_len: int, mxfp8: bool = False,
                          out_dtype=jnp.float32) -> bool:
    """True for the block-scaled problems the CUDA lowering hands to the custom call as they
    are: M, N and K multiples of 16 (K of 128 for MXFP8) and a bias only where cuBLASLt's
    epilogue takes it (_block_bias_epilogue; what lowbit.ops.gemm._block_gemm_cuda binds)."""
    k_multiple = MXFP8_K_MULTIPLE if mxfp8 else FP8_DIM_MULTIPLE
    return not (m % FP8_DIM_MULTIPLE or n % FP8_DIM_MULTIPLE or k % k_multiple
                or (bias_len and not _block_bias_epilogue(out_dtype, mxfp8)))


def parse_algo(text: str) -> dict[str, int]:
    """LOWBIT_GEMM_ALGO's value -> {kind: index}: "" -> {}, "k" -> every kind k,
    "kind=k,kind=k" -> those kinds (see the module docstring)."""
    text = text.strip()
    if not text:
        return {}
    usage = (f"{ALGO_ENV}: expected an index 0..{MAX_ALGO - 1} for every FP8 GEMM, or "
             f"'kind=index' pairs separated by commas with kinds {', '.join(DEFAULT_ALGO)}; got {text!r}")

    def index(word: str) -> int:
        word = word.strip()
        if not word.isdigit() or int(word) >= MAX_ALGO:
            raise ValueError(usage)
        return int(word)

    if "=" not in text:
        k = index(text)
        return {kind: k for kind in DEFAULT_ALGO}
    out = {}
    for item in text.split(","):
        kind, sep, value = item.partition("=")
        kind = kind.strip()
        if not sep or kind not in DEFAULT_ALGO or kind in out:
            raise ValueError(usage)
        out[kind] = index(value)
    return out


# LOWBIT_GEMM_PSUM: how a K-sharded (row-parallel) GEMM sums its shards' partial products.
#   "out" (default): each shard's partial product is rounded to out_dtype and the collective
#     sums in out_dtype, as XLA's own sharded dot and TransformerEngine's GEMM do: a bf16
#     output moves half the bytes of fp32 through NCCL (the seed Dense's DP=2/TP=2 step
#     spends ~1 ms of its 8 on the difference on 4 H200s).
#   "fp32": fp32 partial products and an fp32 psum, rounded once at the end (one rounding
#     instead of two; twice the collective's bytes for a 16-bit output).
# An f32 out_dtype is the same either way.
PSUM_ENV = "LOWBIT_GEMM_PSUM"


def psum_in_fp32() -> bool:
    """LOWBIT_GEMM_PSUM (read at trace time): True for "fp32", False for "out" or unset."""
    value = os.environ.get(PSUM_ENV, "") or "out"
    if value not in ("out", "fp32"):
        raise ValueError(f"{OP}: {PSUM_ENV}={value!r}: expected 'out' or 'fp32'")
    return value == "fp32"


def _reduce_dtype(out_dtype, psum_fp32: bool):
    """The dtype a K-sharded GEMM's partial products are summed in (see PSUM_ENV)."""
    return jnp.dtype(jnp.float32) if psum_fp32 else jnp.dtype(out_dtype)


@functools.lru_cache(maxsize=None)
def _parse_algo_cached(text: str) -> tuple[tuple[str, int], ...]:
    return tuple(parse_algo(text).items())


def _env_algo() -> dict[str, int]:
    """LOWBIT_GEMM_ALGO as it is now (read at trace time, as the other env knobs, so that a
    benchmark can trace variants under different values; each value parsed once)."""
    return dict(_parse_algo_cached(os.environ.get(ALGO_ENV, "")))


def kind_algo(kind: str | None) -> tuple[int, bool]:
    """(heuristic index, algo_or_first) of a DEFAULT_ALGO kind (None: the 16-bit GEMMs, index
    0): LOWBIT_GEMM_ALGO's index, strict (past cuBLASLt's list the GEMM fails, naming the
    count), else DEFAULT_ALGO's, a library default, which runs cuBLASLt's first choice where a
    problem has no such entry (the custom calls' algo_or_first, GemmArgs::algo_or_first)."""
    if kind is None:
        return 0, True
    env = _env_algo()
    return (env[kind], False) if kind in env else (DEFAULT_ALGO[kind], True)


def algo_kind(a_dtype, a_mode: GemmScaleMode, use_split_accumulator: bool, out_dtype=None) -> str | None:
    """The DEFAULT_ALGO kind of a GEMM, None for the 16-bit GEMMs (always algo 0)."""
    if jnp.dtype(a_dtype) not in FP8:
        return None
    if a_mode == GemmScaleMode.MXFP8:
        return "mxfp8"
    if a_mode != GemmScaleMode.TENSOR:
        return "block"
    if not use_split_accumulator:
        return "fp8_fast"
    f32_out = out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32
    return "fp8_split_f32" if f32_out else "fp8_split"


def _checked_algo(op: str, algo) -> tuple[int, bool]:
    """A caller's `algo` argument, checked: (index, False), an index the user chose is strict."""
    if isinstance(algo, bool) or not isinstance(algo, (int, np.integer)) or not 0 <= algo < MAX_ALGO:
        raise ValueError(f"{op}: algo: expected None or an index 0..{MAX_ALGO - 1}, got {algo!r}")
    return int(algo), False


def resolve_algo_choice(algo, a_dtype, a_mode: GemmScaleMode, use_split_accumulator: bool,
                        out_dtype=None) -> tuple[int, bool]:
    """(heuristic index, algo_or_first) a gemm call runs with: `algo` when given (checked,
    strict), else its kind's (kind_algo; out_dtype: the GEMM's output dtype, which tells
    fp8_split_f32 from fp8_split)."""
    if algo is not None:
        return _checked_algo(OP, algo)
    return kind_algo(algo_kind(a_dtype, a_mode, use_split_accumulator, out_dtype))


def resolve_algo(algo, a_dtype, a_mode: GemmScaleMode, use_split_accumulator: bool, out_dtype=None) -> int:
    """The heuristic index of resolve_algo_choice."""
    return resolve_algo_choice(algo, a_dtype, a_mode, use_split_accumulator, out_dtype)[0]
