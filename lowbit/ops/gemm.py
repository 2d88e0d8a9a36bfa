"""lowbit.ops.gemm: out = (a_scale_inv * a) @ (b_scale_inv * b)^T + bias through lowbit_gemm.

Layout: a is (..., K) (leading dims flattened into M), b is (N, K), out is (..., N): both
operands K-major, the one layout the C++ op takes (csrc/gemm/gemm.h); callers with other
layouts transpose first. Types: a and b both FP8 (not both E5M2), both bf16 or both f16;
out bf16, f16 or f32 (with 16-bit inputs: the input type or f32); bias (N,) in the out type.
Accumulation is fp32; the CPU handler sums each dot product in increasing k order (exact
products; FP8 operands with a one-time notice that the CPU emulates), the CUDA handler is
cuBLASLt (`use_split_accumulator=False` selects Hopper's faster, less precise FP8
accumulation).

FP8 on cuBLASLt needs K and N to be multiples of 16: the CUDA lowering zero-pads K and N
(zero terms leave every sum unchanged) and slices the result; the CPU handler takes any shape.

Block scale modes (`a_scale_mode` / `b_scale_mode`, GemmScaleMode; FP8 operands only): the
scale_invs are then the 2-D arrays the block quantizers emit for the (rows, K) view of each
operand (csrc/gemm/gemm.h has the layouts): BLOCK_1x128 f32 (ceil(K/128), roundup(rows, 4)),
BLOCK_128x128 f32 (ceil(rows/128), roundup(ceil(K/128), 4)), MXFP8 e8m0 (roundup(rows, 128),
roundup(ceil(K/32), 4)). Both operands block-scaled or neither; MXFP8 only with MXFP8.
  CPU: the exact emulation (each operand dequantized to fp32 with its block scales, then an
    fp32 GEMM in increasing k order), with a one-time notice.
  CUDA, FP8 block on compute capability 9.0: cuBLASLt's VEC128_32F / BLK128x128_32F scale
    modes (CUDA 12.9+) for (1x128, 128x128), (128x128, 1x128) and (1x128, 1x128); M, N and K
    are zero-padded to multiples of 16 (the scale arrays with them, so that the 1x128 scale
    rows are exactly M or N long); accumulation is always cuBLASLt's per-128-K-block fp32
    promotion (fast accumulation does not apply); bias is added in fp32 after the GEMM.
  CUDA, MXFP8 on compute capability 10.x (Blackwell): cuBLASLt's VEC32_UE8M0 scale mode; M
    and N are zero-padded to multiples of 16 and K to 128 (the scale arrays keep their
    shapes; their entries past ceil(K/32) are zeroed so that padding K blocks add 0), the
    C++ launcher swizzles both scale arrays into cuBLASLt's 128 x 4 tile order in its
    workspace (gemm_workspace_bytes), bias is added in fp32 after the GEMM. Compile-checked
    only: no Blackwell GPU has run it yet (tests/test_gemm_block.py compares it with the CPU
    emulation where one is present).
  CUDA otherwise (MXFP8 off 10.x, FP8 block off Hopper, 128x128 x 128x128): the same
    emulation in jnp (fp32 HIGHEST dot), with a one-time notice.
Block modes map over vmapped batches and are partitioned (below) where shards hold whole tiles.

NVFP4 (`nvfp4_gemm`, its own op lowbit_gemm_nvfp4 at the end of this file): packed E2M1
operands with e4m3 block scales and fp32 global scale_invs as lowbit.ops.quantize_nvfp4
stores them; the exact emulation on the CPU and off 10.x, cuBLASLt on 10.x (compile-checked
only). 2-D; vmap maps it over the batch; partitioned like the block modes (rows of a, N of b,
K with a psum) where shards hold whole 16-blocks of unpadded scale dims, else gathered
(_make_nvfp4_gemm). lowbit.dense multiplies its NVFP4 copies through it, the wgrad of RHT
copies included (x's and dy's colwise copies share one sign vector, so their stored values
multiply to the product); emulated_nvfp4_gemm is left for a GEMM with one transformed operand
(lowbit.dense.nvfp4_packed_gemm_ok).

Algorithm (CUDA): `algo` picks entry `algo` of the list of algorithms cuBLASLt's
heuristic returns (0 = its first choice; a plan-cache key in C++). `gemm(algo=None)` takes
it from LOWBIT_GEMM_ALGO, read at trace time: "k" for every FP8 kind, or
"kind=k,kind=k" with kinds fp8_fast (per-tensor, fast accumulation: the forward GEMM),
fp8_split (per-tensor, split accumulation, a 16-bit output: dgrad), fp8_split_f32 (the same
with an f32 output: the wgrad of an f32 kernel; cuBLASLt's heuristic list, which the index
points into, depends on the output type), fused_dgrad (the dgrad of the fused Dense
backward, lowbit.ops.dense_backward_fp8, at split accumulation: dy's rowwise copy read at
dk's row pitch and batched over its row segments, a problem cuBLASLt ranks apart from the
standalone dgrad), block (FP8 1x128 / 128x128), mxfp8 and nvfp4 (nvfp4_gemm); unset kinds
take DEFAULT_ALGO (0, cuBLASLt's first choice, but fused_dgrad: 1). A
bad value raises a ValueError naming the variable; an index past what cuBLASLt returns for a
problem fails that GEMM with the count it did return where the user set it; a library default
(DEFAULT_ALGO's) runs entry 0 there instead (the custom calls' algo_or_first attribute, in
lowbit_gemm, lowbit_gemm_nvfp4 and the fused Dense backward alike). bench/bench_gemm.py --algo-sweep
times every index.

Workspace: the lowbit_gemm custom call has a second result, a u8 workspace that XLA's buffer
assignment plans like any temp (XLA's FFI scratch allocator hands out nothing in jax 0.11):
gemm_workspace_bytes() on CUDA (GEMM_WORKSPACE_BYTES, plus the swizzled MXFP8 scales), 0
bytes on the CPU. It exists only in the lowering rules
(`_lower_with_workspace`): gemm_p itself has one result, so abstract evaluation, batching
and partitioning never see it; it is never sharded (each device's custom call gets its own).

Sharding (Shardy rule + custom_partitioning): leading dims of a sharded -> each device
multiplies its rows (data parallel); N sharded (b's rows, column-parallel TP) -> out's last
dim and bias sharded alike; K sharded in both operands (row-parallel TP) -> each device
computes its partial product, a psum (or a reduce-scatter) over the K axes sums them, then
bias is added once in fp32 and the sum is rounded to out_dtype. The partial products are
rounded to out_dtype and summed in it (as XLA's sharded dot and TransformerEngine do), or
kept in fp32 and rounded once with LOWBIT_GEMM_PSUM=fp32 (PSUM_ENV below). No other
collective is inserted by the op.

Block modes: the same rule, with the scale arrays sharded with their data, when (a) only the
first row dim and the first contracted dim of an operand are sharded (a shard's flattened
rows / K are then one contiguous slice) and (b) each shard holds whole tiles and the scale
dim it splits has no padding (_sharding.clean_split): rows of a 1x128 operand with R % 4 == 0;
rows of a 128x128 operand in whole 128-row tiles; MXFP8 rows with R % 128 == 0; K in whole
128-blocks (32 for MXFP8) with, for 128x128, ceil(K/128) % 4 == 0 and, for MXFP8,
ceil(K/32) % 4 == 0. Each shard re-pads its scale slices to its own layout (fit_scale). A
sharded dim failing (a) or (b) is gathered, its scales with it: exact, not parallel. No
clean rule exists where the global scale dim is padded (R % 4 != 0 for 1x128 rows,
ceil(K/128) % 4 != 0 for 128x128 K, R % 128 != 0 or ceil(K/32) % 4 != 0 for MXFP8): the
padding sits at the end of the global dim, so equal slices of it do not line up with equal
slices of the data; nor where a shard would split a tile. The Shardy rule ties the first row
and contracted dims to their scale dims by a shared major factor (tiled_group_rule), so that
propagation shards the scales with their data.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive
from lowbit.ops._sharding import (COLS, ROWS, SCALE_DIMS, axes_entry, clean_split, compound_sizes, fit_scale,
                                  named_shardings, spec_entries, tiled_group_rule)

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
# fused_dgrad_algo_*). A problem without a second entry runs the first (GemmArgs::algo_or_first).
DEFAULT_ALGO = {"fp8_fast": 0, "fp8_split": 0, "fp8_split_f32": 0, "fused_dgrad": 1, "block": 0, "mxfp8": 0,
                "nvfp4": 0}


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


def _sum_k_partials(acc, psum_axes, scatter, bias, out_dtype):
    """The tail of a K-sharded GEMM (tensor / block and NVFP4 alike): this shard's partial
    product `acc` (in _reduce_dtype) reduce-scattered over `scatter`'s (axis, dim) pairs and
    psum'ed over `psum_axes`, then the bias (a tuple of none or one) added in fp32 and the sum
    rounded to out_dtype."""
    for axis, dim in scatter:
        acc = jax.lax.psum_scatter(acc, axis, scatter_dimension=dim, tiled=True)
    if psum_axes:
        acc = jax.lax.psum(acc, psum_axes)
    if bias:
        acc = acc.astype(jnp.float32) + bias[0].astype(jnp.float32)
    return acc.astype(out_dtype)


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


def gemm_workspace_bytes(a_mode: GemmScaleMode, m: int, n: int, k: int) -> int:
    """GemmWorkspaceBytes in csrc/gemm/gemm.h: the CUDA custom call's workspace."""
    if a_mode != GemmScaleMode.MXFP8:
        return GEMM_WORKSPACE_BYTES
    padded = lambda rows: _round_up(math.prod(scale_shape(a_mode, rows, k)), 256)  # noqa: E731
    return GEMM_WORKSPACE_BYTES + padded(m) + padded(n)


def swizzle_scales_jnp(scale, valid_rows=None, valid_cols=None):
    """The jnp reference of csrc/gemm/scale_swizzle.h: a (R, C) one-byte scale matrix (R % 128
    == 0, C % 4 == 0) -> its R * C entries in cuBLASLt's 128 x 4 tile order, the entries at
    rows >= valid_rows or cols >= valid_cols zeroed."""
    r, c = scale.shape
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint8) if scale.dtype != jnp.uint8 else scale
    vr = r if valid_rows is None else valid_rows
    vc = c if valid_cols is None else valid_cols
    keep = (jnp.arange(r)[:, None] < vr) & (jnp.arange(c)[None, :] < vc)
    bits = jnp.where(keep, bits, jnp.uint8(0))
    # (row tile, row // 32 within it, row % 32, col tile, col % 4) -> tiles, then row % 32,
    # then row // 32, then col % 4.
    tiles = bits.reshape(r // 128, 4, 32, c // 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1)
    return tiles if scale.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(tiles, scale.dtype)


def unswizzle_scales_jnp(swizzled, rows: int, cols: int):
    """The inverse of swizzle_scales_jnp (with nothing zeroed): R * C bytes -> (R, C)."""
    t = swizzled.reshape(rows // 128, cols // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return t.reshape(rows, cols)


def _swizzle_abstract(scale, *, valid_rows, valid_cols):
    del valid_rows, valid_cols
    return jax.core.ShapedArray((math.prod(scale.shape),), scale.dtype)


swizzle_scales_p = ffi_primitive("lowbit_gemm_swizzle_scales", "lowbit_gemm_swizzle_scales",
                                 _swizzle_abstract, attrs=("valid_rows", "valid_cols"))


def swizzle_scales(scale, valid_rows=None, valid_cols=None):
    """The C++ scale swizzle (CPU reference or CUDA kernel, scale_swizzle.h) as an op: what
    the sm_100 MXFP8 GEMM applies inside its launcher, exposed so that the kernel can be
    tested on any GPU. scale: (R, C) uint8 / float8_e8m0fnu / float8_e4m3fn."""
    scale = jnp.asarray(scale)
    if scale.ndim != 2 or scale.shape[0] % 128 or scale.shape[1] % 4:
        raise ValueError(f"{OP}: scale: expected a (multiple of 128, multiple of 4) matrix, got {scale.shape}")
    if scale.dtype not in (jnp.dtype(jnp.uint8), _E8M0, jnp.dtype(jnp.float8_e4m3fn)):
        raise TypeError(f"{OP}: scale: expected uint8, float8_e8m0fnu or float8_e4m3fn, got {scale.dtype}")
    r, c = scale.shape
    return swizzle_scales_p.bind(scale, valid_rows=np.int64(r if valid_rows is None else valid_rows),
                                 valid_cols=np.int64(c if valid_cols is None else valid_cols))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(mode: GemmScaleMode, rows: int, k: int) -> tuple[int, ...]:
    """The scale_inv shape of a rows x k operand in `mode` ((1,) for TENSOR)."""
    if mode == GemmScaleMode.BLOCK_1x128:
        return (_cdiv(k, 128), _round_up(rows, 4))
    if mode == GemmScaleMode.BLOCK_128x128:
        return (_cdiv(rows, 128), _round_up(_cdiv(k, 128), 4))
    if mode == GemmScaleMode.MXFP8:
        return (_round_up(rows, 128), _round_up(_cdiv(k, 32), 4))
    return (1,)


_NOTICED: set[str] = set()


def _notice_once(key: str, message: str) -> None:
    """The one-time notice DESIGN.md asks for when a GEMM is emulated."""
    if key not in _NOTICED:
        _NOTICED.add(key)
        warnings.warn(message, stacklevel=3)


def dequantize_operand(data, scale, mode: GemmScaleMode):
    """fp32 data (rows, K) times its block scales (the emulation's operand)."""
    rows, k = data.shape
    values = data.astype(jnp.float32)
    if mode == GemmScaleMode.BLOCK_1x128:
        s = jnp.repeat(scale[:, :rows].T, 128, axis=1)[:, :k]
    elif mode == GemmScaleMode.BLOCK_128x128:
        s = jnp.repeat(jnp.repeat(scale[:_cdiv(rows, 128), :_cdiv(k, 128)], 128, axis=0), 128, axis=1)
        s = s[:rows, :k]
    elif mode == GemmScaleMode.MXFP8:
        e = jax.lax.bitcast_convert_type(scale[:rows, :_cdiv(k, 32)], jnp.uint8).astype(jnp.int32)
        s = jnp.where(e == 255, jnp.float32(jnp.nan), jnp.ldexp(jnp.float32(1), e - 127))
        s = jnp.repeat(s, 32, axis=1)[:, :k]
    else:
        s = scale.reshape(())
    return values * s


def emulated_gemm(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, a_scale_mode, b_scale_mode):
    """The block-scaled GEMM emulated in jnp: dequantize both operands to fp32, a HIGHEST
    precision fp32 dot, + bias in fp32, rounded to out_dtype (the CPU handler's formula; only
    the summation order differs)."""
    a32 = dequantize_operand(a, a_scale_inv, GemmScaleMode(int(a_scale_mode)))
    b32 = dequantize_operand(b, b_scale_inv, GemmScaleMode(int(b_scale_mode)))
    acc = jnp.dot(a32, b32.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if bias.shape[0]:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


def emulated_nvfp4_gemm(a, b, bias=None, *, out_dtype, contracting_ndim: int = 1):
    """The NVFP4 GEMM emulation: a (M..., K...) . b (N..., K...)^T over the last
    contracting_ndim dims of the two dequantized operands (fp32, NVFP4Tensor1x.dequantize),
    a HIGHEST-precision fp32 dot, + bias in fp32, rounded to out_dtype, on every device (said
    once). lowbit.dense uses it only for a GEMM with exactly one RHT-transformed operand (its
    stored values do not multiply to the product), which only a hand-built quantizer set
    mixing use_rht makes; its GEMMs are otherwise nvfp4_gemm below, the packed-operand op with
    the cuBLASLt path on compute capability 10.x, whose emulation off 10.x gives this
    function's bits for the same (dequantized) operands."""
    _notice_once("nvfp4", "lowbit.ops.gemm: NVFP4 GEMMs through emulated_nvfp4_gemm (in lowbit.dense: "
                 "one RHT-transformed operand, from a quantizer set mixing use_rht) run as an exact "
                 "emulation (dequantize, fp32 GEMM) on every device")
    kd = int(contracting_ndim)
    dims = ((tuple(range(a.ndim - kd, a.ndim)), tuple(range(b.ndim - kd, b.ndim))), ((), ()))
    acc = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


def _abstract(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator,
              a_scale_mode, b_scale_mode, algo=0, algo_or_first=False):
    del a_scale_inv, b_scale_inv, bias, use_split_accumulator, a_scale_mode, b_scale_mode, algo, algo_or_first
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), out_dtype)


# a (M, K), b (N, K), a_scale_inv / b_scale_inv ((1,) or the 2-D block arrays), bias (N,) or
# (0,) -> (M, N). The custom call's second result (the workspace) is added by the lowering
# rules below.
gemm_p = ffi_primitive("lowbit_gemm", "lowbit_gemm", _abstract,
                       attrs=("use_split_accumulator", "a_scale_mode", "b_scale_mode", "algo", "algo_or_first"))
_ffi_lowering = jax.ffi.ffi_lowering("lowbit_gemm")


def _lower_with_workspace(ctx, a, b, a_scale_inv, b_scale_inv, bias, *, workspace_bytes,
                          use_split_accumulator, a_scale_mode, b_scale_mode, algo=0, algo_or_first=False):
    """Emits lowbit_gemm with results (out, workspace u8[workspace_bytes]); returns out."""
    (out_aval,) = ctx.avals_out
    workspace = jax.core.ShapedArray((workspace_bytes,), jnp.uint8)
    out, _ = _ffi_lowering(ctx.replace(avals_out=[out_aval, workspace]), a, b, a_scale_inv,
                           b_scale_inv, bias, use_split_accumulator=use_split_accumulator,
                           a_scale_mode=np.int32(a_scale_mode), b_scale_mode=np.int32(b_scale_mode),
                           algo=np.int32(algo), algo_or_first=bool(algo_or_first))
    return [out]


def _cpu_lowering(ctx, *args, out_dtype, use_split_accumulator, a_scale_mode, b_scale_mode, algo=0,
                  algo_or_first=False):
    del out_dtype
    _ffi.require_platform("lowbit_gemm", "cpu")
    if a_scale_mode != GemmScaleMode.TENSOR:
        _notice_once("cpu", "lowbit.ops.gemm: block-scaled GEMMs run as an exact emulation on the "
                     "CPU (each operand dequantized to fp32 with its block scales, then an fp32 GEMM)")
    elif jnp.dtype(ctx.avals_in[0].dtype).itemsize == 1:
        _notice_once("cpu-fp8", "lowbit.ops.gemm: FP8 GEMMs run as an exact emulation on the CPU "
                     "(exact products of the FP8 values, summed in fp32 in increasing k order, "
                     "times the scale_invs)")
    return _lower_with_workspace(ctx, *args, workspace_bytes=0,
                                 use_split_accumulator=use_split_accumulator,
                                 a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode, algo=algo,
                                 algo_or_first=algo_or_first)


mlir.register_lowering(gemm_p, _cpu_lowering, platform="cpu")


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def gemm_padded(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator,
                a_scale_mode=GemmScaleMode.TENSOR, b_scale_mode=GemmScaleMode.TENSOR, algo=0,
                algo_or_first=False):
    """gemm_p with K and N zero-padded to multiples of 16 (and M too under block scaling,
    with the 1x128 scale rows padded alike; K to 128 under MXFP8, its scale entries past
    ceil(K/32) zeroed) and the result sliced back."""
    (m, k), n = a.shape, b.shape[0]
    block = a_scale_mode != GemmScaleMode.TENSOR
    mxfp8 = a_scale_mode == GemmScaleMode.MXFP8
    mp = _round_up(m, FP8_DIM_MULTIPLE) if block else m
    kp = _round_up(k, MXFP8_K_MULTIPLE if mxfp8 else FP8_DIM_MULTIPLE)
    np_ = _round_up(n, FP8_DIM_MULTIPLE)
    a = jnp.pad(a, ((0, mp - m), (0, kp - k)))
    b = jnp.pad(b, ((0, np_ - n), (0, kp - k)))
    if bias.shape[0]:
        bias = jnp.pad(bias, (0, np_ - n))

    def pad_scale(scale, mode, rows):
        if mode == GemmScaleMode.MXFP8:
            # Same shape (K's 32-blocks were already padded to 4); the padding K blocks now
            # meet zero data, so their scales must be finite: 0x00 (2^-127).
            used = jnp.arange(scale.shape[1])[None, :] < _cdiv(k, 32)
            bits = jax.lax.bitcast_convert_type(scale, jnp.uint8)
            return jax.lax.bitcast_convert_type(jnp.where(used, bits, jnp.uint8(0)), _E8M0)
        if mode != GemmScaleMode.BLOCK_1x128:
            return scale  # 16-padding never adds a 128-block: the 2-D shapes stay
        return jnp.pad(scale, ((0, 0), (0, rows - scale.shape[1])))

    a_scale_inv = pad_scale(a_scale_inv, a_scale_mode, mp)
    b_scale_inv = pad_scale(b_scale_inv, b_scale_mode, np_)
    out = gemm_p.bind(a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dtype,
                      use_split_accumulator=use_split_accumulator,
                      a_scale_mode=np.int32(a_scale_mode), b_scale_mode=np.int32(b_scale_mode),
                      algo=np.int32(algo), algo_or_first=bool(algo_or_first))
    return out[:m, :n]


def _block_bias_epilogue(out_dtype, mxfp8: bool) -> bool:
    """Whether cuBLASLt adds a block-scaled GEMM's bias in its epilogue: FP8 block scaling with a
    16-bit output (the bias in that dtype, added in fp32 before the one rounding: the formula
    of the emulation). An fp32 output's bias, and MXFP8's, are added in fp32 afterwards."""
    return not mxfp8 and jnp.dtype(out_dtype) != jnp.dtype(jnp.float32)


def _cublaslt_block_ready(m: int, n: int, k: int, bias_len: int, mxfp8: bool = False,
                          out_dtype=jnp.float32) -> bool:
    """True for the block-scaled problems the CUDA lowering hands to the custom call as they
    are: M, N and K multiples of 16 (K of 128 for MXFP8) and a bias only where cuBLASLt's
    epilogue takes it (_block_bias_epilogue; what _block_gemm_cuda binds)."""
    k_multiple = MXFP8_K_MULTIPLE if mxfp8 else FP8_DIM_MULTIPLE
    return not (m % FP8_DIM_MULTIPLE or n % FP8_DIM_MULTIPLE or k % k_multiple
                or (bias_len and not _block_bias_epilogue(out_dtype, mxfp8)))


def _block_gemm_cuda(a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator,
                     a_scale_mode, b_scale_mode, algo=0, algo_or_first=False):
    """FP8 block scaling on cuBLASLt: padded, and the bias either in cuBLASLt's epilogue
    (_block_bias_epilogue) or added in fp32 afterwards. Every gemm_p it binds is
    _cublaslt_block_ready, so the CUDA lowering of those emits the custom call directly (no
    second trip through this function)."""
    mxfp8 = GemmScaleMode(int(a_scale_mode)) == GemmScaleMode.MXFP8
    if not bias.shape[0] or _block_bias_epilogue(out_dtype, mxfp8):
        return gemm_padded(a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dtype,
                           use_split_accumulator=use_split_accumulator,
                           a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode, algo=algo,
                           algo_or_first=algo_or_first)
    acc = gemm_padded(a, b, a_scale_inv, b_scale_inv, jnp.zeros((0,), jnp.float32),
                      out_dtype=jnp.dtype(jnp.float32), use_split_accumulator=use_split_accumulator,
                      a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode, algo=algo,
                      algo_or_first=algo_or_first)
    return (acc + bias.astype(jnp.float32)).astype(out_dtype)


@functools.lru_cache(maxsize=None)
def _cuda_capability() -> str:
    """The compute capability of the first CUDA device, "9.0" style ("" when unknown)."""
    try:
        return str(getattr(jax.devices("cuda")[0], "compute_capability", ""))
    except RuntimeError:
        return ""


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


def _shape_text(shape) -> str:
    """A shape as the C++ handlers print it: (2, 4), (7,), ()."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_bound_shapes(avals, modes) -> None:
    """The C++ handler's scale and bias shape checks (csrc/ffi/gemm_ffi.cc), made before the
    CUDA lowering pads or emulates: a gemm_p bound directly with a wrongly shaped block scale
    array would otherwise be padded into a valid-looking one (its missing rows scaled by 0),
    and a (1,) bias broadcast over N where it is added in fp32 after the GEMM, instead of
    refused. gemm() checks the same in its own words first (_scale_arg)."""
    (m, k), n = avals[0].shape, avals[1].shape[0]
    bias = tuple(avals[4].shape)
    if len(bias) != 1 or bias[0] not in (0, n):
        raise ValueError(f"lowbit_gemm: bias: expected shape ({n},) or (0,), got {_shape_text(bias)}")
    for name, aval, mode, rows in (("a_scale_inv", avals[2], modes[0], m),
                                   ("b_scale_inv", avals[3], modes[1], n)):
        if mode == GemmScaleMode.TENSOR:
            continue
        want = scale_shape(mode, rows, k)
        if tuple(aval.shape) != want:
            raise ValueError(f"lowbit_gemm: {name}: expected shape ({want[0]}, {want[1]}) for scale "
                             f"mode {mode.name.lower()} of a {rows} x {k} operand, got {_shape_text(aval.shape)}")


def _cuda_lowering(ctx, a, b, a_scale_inv, b_scale_inv, bias, *, out_dtype, use_split_accumulator,
                   a_scale_mode, b_scale_mode, algo=0, algo_or_first=False):
    a_aval, b_aval = ctx.avals_in[0], ctx.avals_in[1]
    (m, k), n = a_aval.shape, b_aval.shape[0]
    modes = (GemmScaleMode(int(a_scale_mode)), GemmScaleMode(int(b_scale_mode)))
    _check_bound_shapes(ctx.avals_in, modes)
    kw = dict(out_dtype=out_dtype, a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode)
    lower = functools.partial(mlir.lower_fun, multiple_results=False)
    if modes[0] != GemmScaleMode.TENSOR:
        if not block_on_cublaslt(modes, _cuda_capability()):
            _notice_once(f"cuda-{modes}", f"lowbit.ops.gemm: no cuBLASLt path for scale modes "
                         f"{modes[0].name} x {modes[1].name} on compute capability "
                         f"{_cuda_capability() or 'unknown'}; emulating it exactly (dequantize to "
                         "fp32, fp32 GEMM)")
            return lower(functools.partial(emulated_gemm, **kw))(ctx, a, b, a_scale_inv, b_scale_inv, bias)
        if not _cublaslt_block_ready(m, n, k, ctx.avals_in[4].shape[0], modes[0] == GemmScaleMode.MXFP8,
                                     out_dtype):
            # Padded (and bias split off) by _block_gemm_cuda, whose gemm_p binds come back
            # here ready and fall through to the custom call.
            fn = functools.partial(_block_gemm_cuda, use_split_accumulator=use_split_accumulator,
                                   algo=algo, algo_or_first=algo_or_first, **kw)
            return lower(fn)(ctx, a, b, a_scale_inv, b_scale_inv, bias)
    elif a_aval.dtype in FP8 and (k % FP8_DIM_MULTIPLE or n % FP8_DIM_MULTIPLE):
        padded = functools.partial(gemm_padded, use_split_accumulator=use_split_accumulator,
                                   algo=algo, algo_or_first=algo_or_first, **kw)
        return lower(padded)(ctx, a, b, a_scale_inv, b_scale_inv, bias)
    _ffi.require_platform("lowbit_gemm", "cuda")
    # The handler returns early on empty problems.
    workspace_bytes = gemm_workspace_bytes(modes[0], m, n, k) if m and n else 0
    return _lower_with_workspace(ctx, a, b, a_scale_inv, b_scale_inv, bias,
                                 workspace_bytes=workspace_bytes,
                                 use_split_accumulator=use_split_accumulator,
                                 a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode, algo=algo,
                                 algo_or_first=algo_or_first)


mlir.register_lowering(gemm_p, _cuda_lowering, platform="cuda")


def _gemm_2d(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_split_accumulator, k_ndim=1,
             a_scale_mode=GemmScaleMode.TENSOR, b_scale_mode=GemmScaleMode.TENSOR, algo=0,
             algo_or_first=False):
    """a (M..., K...) . b (N..., K...) -> (M..., N...) through one gemm_p call on the (M, K) and
    (N, K) views (the last k_ndim dims of both are contracted)."""
    m_shape, n_shape = a.shape[:a.ndim - k_ndim], b.shape[:b.ndim - k_ndim]
    k = math.prod(a.shape[a.ndim - k_ndim:])
    out = gemm_p.bind(a.reshape(-1, k), b.reshape(-1, k), a_scale_inv, b_scale_inv, bias.reshape(-1),
                      out_dtype=out_dtype, use_split_accumulator=np.bool_(use_split_accumulator),
                      a_scale_mode=np.int32(a_scale_mode), b_scale_mode=np.int32(b_scale_mode),
                      algo=np.int32(algo), algo_or_first=bool(algo_or_first))
    return out.reshape(*m_shape, *n_shape)


def _gemm_p_batch(args, dims, *, out_dtype, use_split_accumulator, a_scale_mode, b_scale_mode, algo=0,
                  algo_or_first=False):
    a, b, sa, sb, bias = args
    da, *rest = dims
    if all(d is None for d in rest) and a_scale_mode == GemmScaleMode.TENSOR:
        a = jnp.moveaxis(a, da, 0)  # only a batched: fold the batch into M
        return _gemm_2d(a, b, sa, sb, bias, out_dtype, use_split_accumulator, algo=algo,
                        algo_or_first=algo_or_first), 0
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
    out = jax.lax.map(
        lambda xs: gemm_p.bind(*xs, out_dtype=out_dtype, use_split_accumulator=use_split_accumulator,
                               a_scale_mode=a_scale_mode, b_scale_mode=b_scale_mode, algo=algo,
                               algo_or_first=algo_or_first),
        tuple(args))
    return out, 0


batching.primitive_batchers[gemm_p] = _gemm_p_batch


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def plan_sharding(mesh_shape: dict, a_spec, b_spec, out_spec, out_shape, k_ndim: int):
    """The per-dim mesh axes one sharded gemm runs with, from its operands' and result's specs
    (lists of per-dim axis tuples). Returns (m, n, k, scatter): m / n / k the axes of a's rows,
    b's rows and the contracted dims (a's and b's alike), and scatter a list of (axis, output
    dim) pairs: the partial sums over that k axis are reduce-scattered onto that output dim
    (the rest of the k axes are psum'ed).

    Conflicts, each axis sharding at most one factor: an axis on both a's rows and b's rows
    stays where the propagated result sharding has it (Shardy decided; any other choice costs
    a reshard after the GEMM) and, when the result has it on neither, drops from b's rows (b
    gathered, as FSDP does; sequence parallelism gathers a first, see gather_rows); a
    contracted dim whose axis is taken by a row dim,
    or sharded differently in a and b, is gathered. A k axis is scattered onto an output dim
    whose result sharding asks for it (row-parallel TP feeding sequence-parallel tokens,
    FSDP weight gradients), when that dim splits evenly."""
    m_nd = len(a_spec) - k_ndim
    m = [tuple(e) for e in a_spec[:m_nd]]
    n = [tuple(e) for e in b_spec[:len(b_spec) - k_ndim]]
    m_axes = {ax for e in m for ax in e}
    out_n = {ax for e in out_spec[m_nd:] for ax in e}
    for i, e in enumerate(n):
        clash = [ax for ax in e if ax in m_axes]
        if clash and all(ax in out_n for ax in clash):
            m = [tuple(ax for ax in me if ax not in clash) for me in m]
            m_axes -= set(clash)
        elif clash:
            n[i] = ()
    used = m_axes | {ax for e in n for ax in e}
    k = []
    for ka, kb in zip(a_spec[m_nd:], b_spec[len(b_spec) - k_ndim:]):
        ka, kb = tuple(ka), tuple(kb)
        axes = ka if (ka == kb or not kb) else (kb if not ka else ())
        if any(ax in used for ax in axes):
            axes = ()
        used |= set(axes)
        k.append(axes)
    scatter = []
    out = m + n
    for ax in (ax for e in k for ax in e):
        for d, want in enumerate(out_spec):
            have = out[d]
            if ax in want and ax not in have and tuple(want[:len(have) + 1]) == have + (ax,):
                size = math.prod(mesh_shape[x] for x in have + (ax,))
                if out_shape[d] % size == 0:
                    out[d] = have + (ax,)
                    scatter.append((ax, d))
                    break
    return m, n, k, scatter


def _gather_rows_partition(mesh, arg_shapes, result_shape):
    del result_shape
    (x,) = arg_shapes
    spec = spec_entries(x.sharding, len(x.shape))
    sharding = NamedSharding(mesh, PartitionSpec(spec[0], *[None] * (len(spec) - 1)))
    return mesh, lambda a: a, sharding, (sharding,)


@functools.lru_cache(maxsize=None)
def _make_gather_rows(n_rows: int, n_rest: int):
    """Identity on x (rows..., rest...) whose Shardy rule and partition replicate every row
    dim but the first: the row all-gather of sequence parallelism, visible to propagation so
    that the GEMM after it keeps its weight's column sharding."""
    gather = custom_partitioning(lambda a: a)
    rows = [f"r{i}" for i in range(n_rows)]
    dims = " ".join(rows + [f"c{i}" for i in range(n_rest)])
    gather.def_partition(
        partition=named_shardings(_gather_rows_partition),
        sharding_rule=lambda mesh, vt, rt: (f"{dims} -> {dims}",
                                            {"need_replication_factors": tuple(rows[1:])}))
    return gather


def gather_rows(a, n_rows: int):
    """a with its row dims (the first n_rows) after the first gathered (sequence parallelism:
    (batch, seq@tp, ...) -> (batch, seq, ...) before a column-parallel GEMM)."""
    if n_rows < 2:
        return a
    return _make_gather_rows(n_rows, a.ndim - n_rows)(a)


_LAYOUT = {GemmScaleMode.BLOCK_1x128: "1x128", GemmScaleMode.BLOCK_128x128: "128x128",
           GemmScaleMode.MXFP8: "mxfp8"}


def _block_clean(mesh_shape: dict, axes, extent: int, group: int, modes) -> bool:
    """True when sharding an operand group (ROWS or COLS = K) of `extent` over `axes` keeps
    whole tiles and unpadded scale dims in every one of `modes` (clean_split)."""
    shards = math.prod(mesh_shape[ax] for ax in axes)
    return all(clean_split(extent, shards, t, p)
               for mode in modes for g, t, p in SCALE_DIMS[_LAYOUT[mode]] if g == group)


def _block_specs(mesh_shape: dict, a_spec, b_spec, a_shape, b_shape, k_ndim: int, a_mode, b_mode):
    """a's and b's specs cut to what a block-scaled GEMM can run sharded: only the first
    row dim and the first contracted dim of each keep their axes (the flattened shard is
    then one contiguous slice), and only where clean_split holds for the scale layouts."""
    def cut(spec, shape, mode):
        rows = len(shape) - k_ndim
        out = [() for _ in spec]
        if rows and _block_clean(mesh_shape, spec[0], math.prod(shape[:rows]), ROWS, (mode,)):
            out[0] = spec[0]
        out[rows] = spec[rows]
        return out
    a, b = cut(a_spec, a_shape, a_mode), cut(b_spec, b_shape, b_mode)
    ka, kb = len(a_shape) - k_ndim, len(b_shape) - k_ndim
    k = math.prod(a_shape[ka:])
    for spec, at in ((a, ka), (b, kb)):
        if not _block_clean(mesh_shape, spec[at], k, COLS, (a_mode, b_mode)):
            spec[at] = ()
    return a, b


def _scale_sharding(mode, row_axes, k_axes):
    """The scale array's per-dim axes for an operand whose rows / K are sharded so."""
    return [row_axes if g == ROWS else k_axes for g, _, _ in SCALE_DIMS[_LAYOUT[mode]]]


@functools.lru_cache(maxsize=None)
def _make_gemm(out_dtype: np.dtype, use_split_accumulator: bool, has_bias: bool, k_ndim: int,
               n_ndim: int, a_mode: GemmScaleMode = GemmScaleMode.TENSOR,
               b_mode: GemmScaleMode = GemmScaleMode.TENSOR, algo: int = 0, psum_fp32: bool = False,
               algo_or_first: bool = False):
    """The partitioned, vmappable gemm for one static configuration; args (a, b, sa, sb[, bias]).
    A K-sharded GEMM sums its partial products in _reduce_dtype(out_dtype, psum_fp32).

    Block modes: sharded like the tensor mode where _block_specs allows (rows on the first
    row dim, K on the first contracted dim, whole tiles and unpadded scale dims per shard),
    the scales sharded with their data (each shard re-pads its slices to its own layout,
    fit_scale); every other sharded dim is gathered, scales with it."""
    block = a_mode != GemmScaleMode.TENSOR

    def fitted(a, b, sa, sb):
        if not block:
            return sa, sb
        rows_a, rows_b = math.prod(a.shape[:a.ndim - k_ndim]), math.prod(b.shape[:b.ndim - k_ndim])
        k = math.prod(a.shape[a.ndim - k_ndim:])
        return (fit_scale(sa, scale_shape(a_mode, rows_a, k)), fit_scale(sb, scale_shape(b_mode, rows_b, k)))

    def local(a, b, sa, sb, *bias):
        bias_arr = bias[0] if has_bias else jnp.zeros((0,), out_dtype)
        sa, sb = fitted(a, b, sa, sb)
        return _gemm_2d(a, b, sa, sb, bias_arr, out_dtype, use_split_accumulator, k_ndim, a_mode, b_mode,
                        algo, algo_or_first)

    def local_k_sharded(psum_axes, scatter):
        def lower(a, b, sa, sb, *bias):
            red = _reduce_dtype(out_dtype, psum_fp32)
            sa, sb = fitted(a, b, sa, sb)
            acc = _gemm_2d(a, b, sa, sb, jnp.zeros((0,), red), red, use_split_accumulator, k_ndim,
                           a_mode, b_mode, algo, algo_or_first)
            return _sum_k_partials(acc, psum_axes, scatter, bias, out_dtype)
        return lower

    partitioned = custom_partitioning(local)

    def partition(mesh, arg_shapes, result_shape):
        specs = [[_spec_axes(e) for e in spec_entries(s.sharding, len(s.shape))]
                 for s in (arg_shapes[0], arg_shapes[1], result_shape)]
        if block:
            specs[:2] = _block_specs(dict(mesh.shape), specs[0], specs[1], arg_shapes[0].shape,
                                     arg_shapes[1].shape, k_ndim, a_mode, b_mode)
        m, n, k, scatter = plan_sharding(dict(mesh.shape), *specs, result_shape.shape, k_ndim)
        out = m + n
        for axis, dim in scatter:
            out[dim] = out[dim] + (axis,)
        ns = lambda *entries: NamedSharding(mesh, PartitionSpec(*[axes_entry(e) for e in entries]))  # noqa: E731
        if block:
            k0 = k[0] if k else ()
            scales = [ns(*_scale_sharding(a_mode, m[0] if m else (), k0)),
                      ns(*_scale_sharding(b_mode, n[0] if n else (), k0))]
        else:
            scales = [ns(()), ns(())]
        arg_shardings = [ns(*m, *k), ns(*n, *k), *scales]
        if has_bias:
            arg_shardings.append(ns(*out[len(m):]))
        scattered = {axis for axis, _ in scatter}
        psum_axes = tuple(ax for e in k for ax in e if ax not in scattered)
        lower = local_k_sharded(psum_axes, tuple(scatter)) if any(k) else local
        return mesh, lower, ns(*out), tuple(arg_shardings)

    def rule(mesh, value_types, result_types):
        del mesh, result_types
        a_shape, b_shape = value_types[0].shape, value_types[1].shape
        m = [f"m{i}" for i in range(len(a_shape) - k_ndim)]
        n = [f"n{i}" for i in range(n_ndim)]
        k = [f"k{i}" for i in range(k_ndim)]
        reduction = list(k)
        if not block:
            operands = [" ".join(m + k), " ".join(n + k), "sa", "sb"] + ([" ".join(n)] if has_bias else [])
            return (f"{', '.join(operands)} -> {' '.join(m + n)}",
                    {"reduction_factors": tuple(reduction), "need_replication_factors": ("sa", "sb")})
        # Block modes: the first row dim of each operand and the first contracted dim share a
        # major factor with the scale dims that tile them (tiled_group_rule), so that the
        # scales propagate with their data; untied scale dims get factors of their own.
        sizes = {}
        kk = math.prod(a_shape[len(m):])
        k_tiles = [(t, p) for mode in (a_mode, b_mode) for g, t, p in SCALE_DIMS[_LAYOUT[mode]] if g == COLS]
        k_expr, k_scale, k_sizes = tiled_group_rule("k0", a_shape[len(m)], kk, k_tiles)
        sizes.update(k_sizes)
        reduction = k_expr.strip("()").split() + k[1:]
        k = [k_expr] + k[1:]
        k_scale = iter(k_scale)
        scale_exprs = []
        groups = []
        for tag, names, shape, mode in (("a", m, a_shape, a_mode), ("b", n, b_shape, b_mode)):
            rows = len(names)
            layout = SCALE_DIMS[_LAYOUT[mode]]
            row_tiles = [(t, p) for g, t, p in layout if g == ROWS]
            if rows:
                r_expr, r_scale, r_sizes = tiled_group_rule(names[0], shape[0], math.prod(shape[:rows]), row_tiles)
                sizes.update(r_sizes)
                names[0] = r_expr
            else:
                r_scale = [None] * len(row_tiles)
            r_scale = iter(r_scale)
            dims = []
            for i, (g, _, _) in enumerate(layout):
                e = next(r_scale) if g == ROWS else next(k_scale)
                dims.append(e if e is not None else f"s{tag}{i}")
            scale_exprs.append(" ".join(dims))
            groups.append(names)
        operands = [" ".join(m + k), " ".join(n + k), *scale_exprs] + ([" ".join(n)] if has_bias else [])
        text = f"{', '.join(operands)} -> {' '.join(m + n)}"
        return text, {"reduction_factors": tuple(reduction), **compound_sizes([text], sizes)}

    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)
    # A batched `a` alone folds into M for tensor scaling (block scales cover the unbatched rows).
    return _vmappable(partitioned, fold_a_batch=not block)


def _vmappable(partitioned, fold_a_batch: bool):
    """A partitioned GEMM under a custom_vmap rule (custom_partitioning has no batching rule):
    with fold_a_batch, a batched `a` alone folds into M (still partitioned); anything else
    runs once per batch element (lax.map), the unbatched operands broadcast along the batch
    (custom_vmap puts batched ones at axis 0)."""
    @jax.custom_batching.custom_vmap
    def fn(*args):
        return partitioned(*args)

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        if fold_a_batch and in_batched[0] and not any(in_batched[1:]):
            return fn(*args), True
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip(args, in_batched)]
        return jax.lax.map(lambda xs: fn(*xs), tuple(args)), True

    return fn


def _scale_arg(name: str, x, mode: GemmScaleMode = GemmScaleMode.TENSOR, rows: int = 1, k: int = 1):
    if mode != GemmScaleMode.TENSOR:
        if x is None:
            raise ValueError(f"{OP}: {name}: scale mode {mode.name} needs its scale array")
        x = jnp.asarray(x)
        want_dtype = _E8M0 if mode == GemmScaleMode.MXFP8 else jnp.dtype(jnp.float32)
        if x.dtype != want_dtype:
            raise TypeError(f"{OP}: {name}: expected {want_dtype} for scale mode {mode.name}, got {x.dtype}")
        want = scale_shape(mode, rows, k)
        if tuple(x.shape) != want:
            raise ValueError(f"{OP}: {name}: expected shape {want} for scale mode {mode.name} of a "
                             f"{rows} x {k} operand, got {tuple(x.shape)}")
        return x
    if x is None:
        return jnp.ones((1,), jnp.float32)
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"{OP}: {name}: expected float32, got {x.dtype}")
    if x.size != 1:
        raise ValueError(f"{OP}: {name}: expected one value (shape () or (1,)), got shape {x.shape}")
    return x.reshape(1)


def _check_scale_modes(a_mode, b_mode, a_dtype):
    for name, mode in (("a_scale_mode", a_mode), ("b_scale_mode", b_mode)):
        try:
            GemmScaleMode(mode)
        except ValueError:
            raise ValueError(f"{OP}: {name}: expected a GemmScaleMode, got {mode!r}") from None
    a_mode, b_mode = GemmScaleMode(a_mode), GemmScaleMode(b_mode)
    if (a_mode == GemmScaleMode.TENSOR) != (b_mode == GemmScaleMode.TENSOR):
        raise ValueError(f"{OP}: b_scale_mode: expected block scales on both operands or neither, "
                         f"got {a_mode.name} and {b_mode.name}")
    if (a_mode == GemmScaleMode.MXFP8) != (b_mode == GemmScaleMode.MXFP8):
        raise ValueError(f"{OP}: b_scale_mode: MXFP8 scales pair only with MXFP8 scales, "
                         f"got {a_mode.name} and {b_mode.name}")
    if a_mode != GemmScaleMode.TENSOR and a_dtype not in FP8:
        raise TypeError(f"{OP}: a: block scale modes need FP8 operands, got {a_dtype}")
    return a_mode, b_mode


def gemm(a, b, a_scale_inv=None, b_scale_inv=None, bias=None, *, out_dtype=jnp.bfloat16,
         use_split_accumulator: bool = True, contracting_ndim: int = 1,
         sequence_parallel: bool = False, a_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR,
         b_scale_mode: GemmScaleMode = GemmScaleMode.TENSOR, algo: int | None = None) -> jax.Array:
    """(a_scale_inv * a) . (b_scale_inv * b)^T + bias for a (M..., K...), b (N..., K...) ->
    (M..., N...), contracting the last `contracting_ndim` dims of both (default: a (..., K),
    b (N, K)); bias has b's N... shape.

    Scale-invs default to 1 and apply to every input type. `use_split_accumulator` matters
    for FP8 on the GPU only (False: cuBLASLt fast accumulation). `sequence_parallel`: a's
    row dims after the first are gathered first (gather_rows), so a (batch, seq@tp, K) meets
    a column-parallel b (N@tp, K) by an all-gather of a (Megatron's sequence parallelism)
    instead of gathering b; see plan_sharding for the rest of the sharding rule.

    `a_scale_mode` / `b_scale_mode` (GemmScaleMode, see the module docstring): the block
    scale arrays are those of the (prod(M...), prod(K...)) and (prod(N...), prod(K...)) views.

    `algo`: cuBLASLt's heuristic index on CUDA (None: LOWBIT_GEMM_ALGO or DEFAULT_ALGO for
    the FP8 kinds, see the module docstring, and 0 for 16-bit operands); no effect on the
    CPU or where the GEMM is emulated.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    kd = int(contracting_ndim)
    if kd < 1:
        raise ValueError(f"{OP}: contracting_ndim: expected >= 1, got {contracting_ndim}")
    if a.ndim < kd:
        raise ValueError(f"{OP}: a: expected shape (..., K) with {kd} contracted dims, got {a.shape}")
    if b.ndim < kd + 1:
        raise ValueError(f"{OP}: b: expected shape (N, K) (N..., then {kd} contracted dims), got {b.shape}")
    k_shape, n_shape = a.shape[a.ndim - kd:], b.shape[:b.ndim - kd]
    if b.shape[b.ndim - kd:] != k_shape:
        want = "(N, " + ", ".join(map(str, k_shape)) + ")"
        raise ValueError(f"{OP}: b: expected {want} to match a {a.shape}, got {b.shape}")
    if a.dtype in FP8 or b.dtype in FP8:
        if a.dtype not in FP8 or b.dtype not in FP8:
            raise TypeError(f"{OP}: b: expected both operands FP8 or neither, got {a.dtype} and {b.dtype}")
        if a.dtype == b.dtype == jnp.float8_e5m2:
            raise TypeError(f"{OP}: b: float8_e5m2 x float8_e5m2 has no FP8 GEMM; use float8_e4m3fn for one")
    elif a.dtype not in HALF or b.dtype != a.dtype:
        raise TypeError(f"{OP}: b: expected a and b both FP8, both bfloat16 or both float16, "
                        f"got {a.dtype} and {b.dtype}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT:
        raise TypeError(f"{OP}: out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if a.dtype in HALF and out_dtype not in (a.dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"{OP}: out_dtype: with {a.dtype} operands expected {a.dtype} or float32, got {out_dtype}")
    a_mode, b_mode = _check_scale_modes(a_scale_mode, b_scale_mode, a.dtype)
    k_size = math.prod(k_shape)
    sa = _scale_arg("a_scale_inv", a_scale_inv, a_mode, math.prod(a.shape[:a.ndim - kd]), k_size)
    sb = _scale_arg("b_scale_inv", b_scale_inv, b_mode, math.prod(n_shape), k_size)
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != n_shape:
            raise ValueError(f"{OP}: bias: expected shape {n_shape}, got {bias.shape}")
        if bias.dtype != out_dtype:
            raise TypeError(f"{OP}: bias: expected out_dtype {out_dtype}, got {bias.dtype}")
    m_shape = a.shape[:a.ndim - kd]
    if a.size == 0 or b.size == 0:  # nothing to multiply: out is bias (or 0)
        base = jnp.zeros(n_shape, out_dtype) if bias is None else bias
        return jnp.broadcast_to(base, (*m_shape, *n_shape))
    if sequence_parallel:
        a = gather_rows(a, a.ndim - kd)
    if a_mode != GemmScaleMode.TENSOR:
        use_split_accumulator = True  # block scales have the split accumulation only
    algo, algo_or_first = resolve_algo_choice(algo, a.dtype, a_mode, bool(use_split_accumulator), out_dtype)
    # An f32 bias is one f32 add on the f32 output (the op's formula, fl(acc + bias), so the
    # same bits), left to XLA: it fuses into whatever consumes the output (a residual add, the
    # attention's scaling) instead of a pass of its own. cuBLASLt's FP8 bias epilogue takes no
    # f32 bias with an f32 output, so the custom call would add it in a separate kernel
    # (gemm_epilogue.h). Other biases ride in the custom call's epilogue.
    bias_in_call = bias is not None and out_dtype != jnp.float32
    fn = _make_gemm(out_dtype, bool(use_split_accumulator), bias_in_call, kd, len(n_shape), a_mode, b_mode, algo,
                    psum_in_fp32(), algo_or_first)
    out = fn(a, b, sa, sb, *([bias] if bias_in_call else []))
    return out if bias is None or bias_in_call else out + bias


def gemm_reference(a, b, a_scale_inv=1.0, b_scale_inv=1.0, bias=None, *, out_dtype=jnp.bfloat16):
    """The jnp reference: dequantize to fp32, a HIGHEST-precision dot, bias, round."""
    acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    acc = acc * (jnp.float32(a_scale_inv) * jnp.float32(b_scale_inv))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


# ---------------------------------------------------------------- NVFP4

NVFP4_K_MULTIPLE = 64  # kNvfp4KMultiple in csrc/gemm/cublaslt_gemm_cuda.cc
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def nvfp4_scale_shape(rows: int, k: int) -> tuple[int, int]:
    """The e4m3 block scale array of a rows x k NVFP4 operand (quantize_nvfp4.h)."""
    return (_round_up(rows, 128), _round_up(_cdiv(k, 16), 4))


def nvfp4_workspace_bytes(m: int, n: int, k: int) -> int:
    """GemmWorkspaceBytes in csrc/gemm/gemm.h for lowbit_gemm_nvfp4."""
    padded = lambda rows: _round_up(math.prod(nvfp4_scale_shape(rows, k)), 256)  # noqa: E731
    return GEMM_WORKSPACE_BYTES + padded(m) + padded(n)


def _nvfp4_abstract(a, b, a_scale, b_scale, a_gsi, b_gsi, bias, *, out_dtype, k, algo=0, algo_or_first=False):
    del a_scale, b_scale, a_gsi, b_gsi, bias, k, algo, algo_or_first
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), out_dtype)


# a, b packed E2M1 (rows, ceil(K/2)) uint8, their e4m3 scales and f32 (1,) global scale_invs,
# bias (N,) or (0,) -> (M, N); the lowering rules add the workspace result, as for gemm_p.
gemm_nvfp4_p = ffi_primitive("lowbit_gemm_nvfp4", "lowbit_gemm_nvfp4", _nvfp4_abstract,
                             attrs=("k", "algo", "algo_or_first"))
_nvfp4_ffi_lowering = jax.ffi.ffi_lowering("lowbit_gemm_nvfp4")


def _nvfp4_lower_with_workspace(ctx, *args, workspace_bytes, k, algo, algo_or_first=False):
    (out_aval,) = ctx.avals_out
    workspace = jax.core.ShapedArray((workspace_bytes,), jnp.uint8)
    out, _ = _nvfp4_ffi_lowering(ctx.replace(avals_out=[out_aval, workspace]), *args,
                                 k=np.int64(k), algo=np.int32(algo), algo_or_first=bool(algo_or_first))
    return [out]


def _nvfp4_cpu_lowering(ctx, *args, out_dtype, k, algo=0, algo_or_first=False):
    del out_dtype
    _ffi.require_platform("lowbit_gemm_nvfp4", "cpu")
    _notice_once("nvfp4-cpu", "lowbit.ops.gemm: NVFP4 GEMMs run as an exact emulation on the CPU "
                 "(the C++ reference: E2M1 values times their block and global scales, fp32 sums in "
                 "increasing k order)")
    return _nvfp4_lower_with_workspace(ctx, *args, workspace_bytes=0, k=k, algo=algo,
                                       algo_or_first=algo_or_first)


mlir.register_lowering(gemm_nvfp4_p, _nvfp4_cpu_lowering, platform="cpu")


def emulated_nvfp4_gemm_packed(a, b, a_scale, b_scale, a_gsi, b_gsi, bias, *, out_dtype, k):
    """The NVFP4 emulation on packed operands: each dequantized to fp32 as
    dequantize_nvfp4 does ((e2m1 * e4m3) * global_scale_inv), a HIGHEST fp32 dot, + bias in
    fp32, rounded to out_dtype."""
    from lowbit.ops.quantize_nvfp4 import dequantize_nvfp4
    a32 = dequantize_nvfp4(a, a_scale, a_gsi, cols=k)
    b32 = dequantize_nvfp4(b, b_scale, b_gsi, cols=k)
    acc = jnp.dot(a32, b32.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if bias.shape[0]:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


def _nvfp4_gemm_cuda(a, b, a_scale, b_scale, a_gsi, b_gsi, bias, *, out_dtype, k, algo, algo_or_first=False):
    """NVFP4 on cuBLASLt: M and N zero-padded to 16, K to 64 (zero bytes are E2M1 zeros; the
    scale arrays keep their shapes, their entries past ceil(K/16) zeroed), bias added in fp32
    afterwards, the result sliced back."""
    m, n = a.shape[0], b.shape[0]
    mp, np_, kp = _round_up(m, FP8_DIM_MULTIPLE), _round_up(n, FP8_DIM_MULTIPLE), _round_up(k, NVFP4_K_MULTIPLE)
    a = jnp.pad(a, ((0, mp - m), (0, kp // 2 - a.shape[1])))
    b = jnp.pad(b, ((0, np_ - n), (0, kp // 2 - b.shape[1])))

    def fit(scale):
        used = jnp.arange(scale.shape[1])[None, :] < _cdiv(k, 16)
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        return jax.lax.bitcast_convert_type(jnp.where(used, bits, jnp.uint8(0)), _E4M3)

    f32 = jnp.dtype(jnp.float32)
    out = gemm_nvfp4_p.bind(a, b, fit(a_scale), fit(b_scale), a_gsi, b_gsi, jnp.zeros((0,), f32),
                            out_dtype=f32 if bias.shape[0] else out_dtype, k=np.int64(kp),
                            algo=np.int32(algo), algo_or_first=bool(algo_or_first))[:m, :n]
    if bias.shape[0]:
        out = (out + bias.astype(jnp.float32)).astype(out_dtype)
    return out


def nvfp4_emulation_lowering(ctx, *args, out_dtype, k, algo=0, algo_or_first=False):
    """gemm_nvfp4_p lowered to emulated_nvfp4_gemm_packed (jnp): the CUDA lowering off 10.x;
    tests register it for the CPU too, to run that path there."""
    del algo, algo_or_first
    fn = functools.partial(emulated_nvfp4_gemm_packed, out_dtype=out_dtype, k=int(k))
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _check_bound_nvfp4_shapes(avals, k: int) -> None:
    """The C++ handler's block scale and bias shape checks (csrc/ffi/gemm_ffi.cc
    Nvfp4ArgsFromBuffers), made before the CUDA lowering pads or emulates: there a gemm_nvfp4_p
    bound directly with a (1,) bias would be broadcast over N (it is added in fp32 after the
    GEMM) and a wrongly shaped scale array sliced or padded, instead of refused. nvfp4_gemm()
    checks the same first."""
    n = avals[1].shape[0]
    for name, aval, rows in (("a_scale", avals[2], avals[0].shape[0]), ("b_scale", avals[3], n)):
        want = nvfp4_scale_shape(rows, k)
        if tuple(aval.shape) != want:
            raise ValueError(f"lowbit_gemm_nvfp4: {name}: expected e4m3 ({want[0]}, {want[1]}), got "
                             f"{aval.dtype} {_shape_text(aval.shape)}")
    bias = avals[6]
    if bias.ndim != 1 or bias.shape[0] not in (0, n):
        raise ValueError(f"lowbit_gemm_nvfp4: bias: expected ({n},) or (0,), got {_shape_text(bias.shape)}")


def _nvfp4_cuda_lowering(ctx, a, b, a_scale, b_scale, a_gsi, b_gsi, bias, *, out_dtype, k, algo=0,
                         algo_or_first=False):
    m, n = ctx.avals_in[0].shape[0], ctx.avals_in[1].shape[0]
    _check_bound_nvfp4_shapes(ctx.avals_in, int(k))
    lower = functools.partial(mlir.lower_fun, multiple_results=False)
    args = (a, b, a_scale, b_scale, a_gsi, b_gsi, bias)
    if not mxfp8_on_cublaslt(_cuda_capability()):
        _notice_once("nvfp4-cuda", f"lowbit.ops.gemm: no cuBLASLt NVFP4 path on compute capability "
                     f"{_cuda_capability() or 'unknown'} (10.x only); emulating it exactly (dequantize "
                     "to fp32, fp32 GEMM)")
        return nvfp4_emulation_lowering(ctx, *args, out_dtype=out_dtype, k=k)
    ready = not (m % FP8_DIM_MULTIPLE or n % FP8_DIM_MULTIPLE or k % NVFP4_K_MULTIPLE or ctx.avals_in[6].shape[0])
    if not ready:
        fn = functools.partial(_nvfp4_gemm_cuda, out_dtype=out_dtype, k=int(k), algo=int(algo),
                               algo_or_first=bool(algo_or_first))
        return lower(fn)(ctx, *args)
    _ffi.require_platform("lowbit_gemm_nvfp4", "cuda")
    workspace_bytes = nvfp4_workspace_bytes(m, n, int(k)) if m and n else 0
    return _nvfp4_lower_with_workspace(ctx, *args, workspace_bytes=workspace_bytes, k=k, algo=algo,
                                       algo_or_first=algo_or_first)


mlir.register_lowering(gemm_nvfp4_p, _nvfp4_cuda_lowering, platform="cuda")


def nvfp4_gemm(a, b, a_scale, b_scale, a_global_scale_inv, b_global_scale_inv, bias=None, *, k: int,
               out_dtype=jnp.bfloat16, algo: int | None = None) -> jax.Array:
    """out (M, N) = dequant(a) (M, K) . dequant(b) (N, K)^T + bias for NVFP4 copies as
    lowbit.ops.quantize_nvfp4 stores them: a / b packed E2M1 uint8 (rows, ceil(K/2)), their
    e4m3 scales (roundup(rows, 128), roundup(ceil(K/16), 4)) and f32 global_scale_invs (one
    value each); K given since the packed width cannot tell an odd K.

    CPU: the exact emulation of csrc/gemm/gemm.h (each operand dequantized as
    dequantize_nvfp4 does, products rounded to fp32 and summed in increasing k). CUDA on
    compute capability 10.x: cuBLASLt (E2M1 x E2M1, VEC16_UE4M3 scales swizzled in the
    launcher, alpha = a_gsi * b_gsi), compile-checked only; elsewhere the emulation in jnp
    with a one-time notice. 2-D operands (callers reshape: lowbit.dense passes its copies'
    stored 2-D views); vmap maps over the batch; sharding as in _make_nvfp4_gemm.
    RHT-transformed copies multiply as stored (T applied to both operands' K with the same
    signs leaves the product unchanged up to rounding; dequantize_nvfp4 would undo it
    instead)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    op = f"{OP} (nvfp4)"
    k = int(k)
    kb = _cdiv(k, 2)
    for name, x in (("a", a), ("b", b)):
        if x.dtype != jnp.uint8 or x.ndim != 2 or x.shape[1] != kb:
            raise ValueError(f"{op}: {name}: expected packed E2M1 uint8 (rows, {kb}) for K={k}, "
                             f"got {x.dtype}{x.shape}")
    scales = []
    for name, x, rows in (("a_scale", a_scale, a.shape[0]), ("b_scale", b_scale, b.shape[0])):
        x = jnp.asarray(x)
        if x.dtype != _E4M3 or tuple(x.shape) != nvfp4_scale_shape(rows, k):
            raise ValueError(f"{op}: {name}: expected float8_e4m3fn {nvfp4_scale_shape(rows, k)}, "
                             f"got {x.dtype}{tuple(x.shape)}")
        scales.append(x)
    globals_ = []
    for name, x in (("a_global_scale_inv", a_global_scale_inv), ("b_global_scale_inv", b_global_scale_inv)):
        x = jnp.asarray(x)
        if x.dtype != jnp.float32 or x.size != 1:
            raise ValueError(f"{op}: {name}: expected one float32, got {x.dtype}{x.shape}")
        globals_.append(x.reshape(1))
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT:
        raise TypeError(f"{op}: out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if bias is None:
        bias = jnp.zeros((0,), out_dtype)
    else:
        bias = jnp.asarray(bias)
        if bias.shape != (b.shape[0],) or bias.dtype != out_dtype:
            raise ValueError(f"{op}: bias: expected {out_dtype} ({b.shape[0]},), got {bias.dtype}{bias.shape}")
    algo, algo_or_first = kind_algo("nvfp4") if algo is None else _checked_algo(op, algo)
    if a.shape[0] == 0 or b.shape[0] == 0 or k == 0:
        base = bias if bias.shape[0] else jnp.zeros((b.shape[0],), out_dtype)
        return jnp.broadcast_to(base, (a.shape[0], b.shape[0]))
    has_bias = bool(bias.shape[0])
    fn = _make_nvfp4_gemm(out_dtype, k, int(algo), has_bias, psum_in_fp32(), algo_or_first)
    return fn(a, b, *scales, *globals_, *([bias] if has_bias else []))


def _nvfp4_gemm_p_batch(args, dims, **params):
    """vmap rule of gemm_nvfp4_p: one call per batch element (the block scales cover the
    unbatched rows, so the batch cannot fold into M)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = tuple(batching.bdim_at_front(x, d, size) for x, d in zip(args, dims))
    return jax.lax.map(lambda xs: gemm_nvfp4_p.bind(*xs, **params), args), 0


batching.primitive_batchers[gemm_nvfp4_p] = _nvfp4_gemm_p_batch

# The NVFP4 operands in _sharding's terms: rows tile 1 with the scale rows padded to 128, K
# in 16-value blocks (8 packed bytes) with the block count padded to 4.
_NVFP4_ROW_TILE, _NVFP4_K_TILE = (1, 128), (16, 4)


def _nvfp4_specs(mesh_shape: dict, a_spec, b_spec, m: int, n: int, k: int):
    """a's and b's (rows, K) axes cut to what the NVFP4 GEMM runs sharded (clean_split):
    rows that split evenly with rows % 128 == 0 (an unpadded scale dim), K that splits into
    whole 16-blocks with ceil(K/16) % 4 == 0; the rest is gathered."""
    shards = lambda axes: math.prod(mesh_shape[ax] for ax in axes)  # noqa: E731
    out = []
    for spec, rows in ((a_spec, m), (b_spec, n)):
        r, kk = spec
        r = r if clean_split(rows, shards(r), *_NVFP4_ROW_TILE) else ()
        kk = kk if clean_split(k, shards(kk), *_NVFP4_K_TILE) else ()
        out.append([r, kk])
    return out


@functools.lru_cache(maxsize=None)
def _make_nvfp4_gemm(out_dtype: np.dtype, k: int, algo: int, has_bias: bool, psum_fp32: bool = False,
                     algo_or_first: bool = False):
    """The partitioned, vmappable NVFP4 GEMM for one static configuration; args (a, b,
    a_scale, b_scale, a_gsi, b_gsi[, bias]), a / b packed (rows, ceil(k/2)).

    Sharding (custom_partitioning + Shardy rule, gemm_p's plan_sharding): a's rows sharded
    (data parallel), b's rows (N, column-parallel, bias with them), K in both (row-parallel:
    partial products in _reduce_dtype(out_dtype, psum_fp32), psum or reduce-scatter, then
    bias in fp32 and the rounding to out_dtype),
    the block scales sharded with their data and re-padded per shard (fit_scale), the global
    scale_invs replicated. Only clean splits shard (_nvfp4_specs): rows with rows % 128 == 0
    (the scale dim unpadded, so its equal slices line up with the rows'); K with K % 64 == 0
    and whole 16-blocks per shard (the packed bytes then split evenly too). A sharded dim failing that is gathered: exact, not
    parallel. Under vmap every call maps over the batch (lax.map)."""

    def call(k_local, dtype, a, b, sa, sb, ga, gb, bias):
        sa = fit_scale(sa, nvfp4_scale_shape(a.shape[0], k_local))
        sb = fit_scale(sb, nvfp4_scale_shape(b.shape[0], k_local))
        return gemm_nvfp4_p.bind(a, b, sa, sb, ga, gb, bias, out_dtype=dtype, k=np.int64(k_local),
                                 algo=np.int32(algo), algo_or_first=bool(algo_or_first))

    def local_fn(k_local):
        def local(a, b, sa, sb, ga, gb, *bias):
            bias_arr = bias[0] if has_bias else jnp.zeros((0,), out_dtype)
            return call(k_local, out_dtype, a, b, sa, sb, ga, gb, bias_arr)
        return local

    def local_k_sharded(k_local, psum_axes, scatter):
        def lower(a, b, sa, sb, ga, gb, *bias):
            red = _reduce_dtype(out_dtype, psum_fp32)
            acc = call(k_local, red, a, b, sa, sb, ga, gb, jnp.zeros((0,), red))
            return _sum_k_partials(acc, psum_axes, scatter, bias, out_dtype)
        return lower

    partitioned = custom_partitioning(local_fn(k))

    def partition(mesh, arg_shapes, result_shape):
        mesh_shape = dict(mesh.shape)
        specs = [[_spec_axes(e) for e in spec_entries(s.sharding, 2)]
                 for s in (arg_shapes[0], arg_shapes[1], result_shape)]
        m, n = arg_shapes[0].shape[0], arg_shapes[1].shape[0]
        specs[:2] = _nvfp4_specs(mesh_shape, specs[0], specs[1], m, n, k)
        (mr,), (nr,), (kk,), scatter = plan_sharding(mesh_shape, *specs, result_shape.shape, 1)
        out = [mr, nr]
        for axis, dim in scatter:
            out[dim] = out[dim] + (axis,)
        ns = lambda *entries: NamedSharding(mesh, PartitionSpec(*[axes_entry(e) for e in entries]))  # noqa: E731
        arg_shardings = [ns(mr, kk), ns(nr, kk), ns(mr, kk), ns(nr, kk), ns(()), ns(())]
        if has_bias:
            arg_shardings.append(ns(out[1]))
        scattered = {axis for axis, _ in scatter}
        psum_axes = tuple(ax for ax in kk if ax not in scattered)
        k_local = k // math.prod(mesh_shape[ax] for ax in kk)
        lower = local_k_sharded(k_local, psum_axes, tuple(scatter)) if kk else local_fn(k_local)
        return mesh, lower, ns(*out), tuple(arg_shardings)

    def rule(mesh, value_types, result_types):
        del mesh, result_types
        (m, kb), n = value_types[0].shape, value_types[1].shape[0]
        sizes = {}
        # K in packed bytes: a 16-value scale block is 8 bytes.
        k_expr, k_scale, k_sizes = tiled_group_rule("k", kb, kb, [(8, 4), (8, 4)])
        sizes.update(k_sizes)
        exprs = []
        for tag, rows in (("m", m), ("n", n)):
            r_expr, (r_scale,), r_sizes = tiled_group_rule(tag, rows, rows, [_NVFP4_ROW_TILE])
            sizes.update(r_sizes)
            exprs.append((r_expr, r_scale or f"s{tag}0"))
        (am, sam), (bn, sbn) = exprs
        ka, kb_ = k_scale[0] or "ska", k_scale[1] or "skb"
        operands = [f"{am} {k_expr}", f"{bn} {k_expr}", f"{sam} {ka}", f"{sbn} {kb_}", "ga", "gb"]
        if has_bias:
            operands.append(bn)
        text = f"{', '.join(operands)} -> {am} {bn}"
        return text, {"reduction_factors": tuple(k_expr.strip("()").split()),
                      "need_replication_factors": ("ga", "gb"), **compound_sizes([text], sizes)}

    partitioned.def_partition(partition=named_shardings(partition), sharding_rule=rule)
    return _vmappable(partitioned, fold_a_batch=False)
