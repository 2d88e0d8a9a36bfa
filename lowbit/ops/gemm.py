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
    only: no Blackwell GPU has run it yet (tests/test_gemm_block_cuda.py compares it with the CPU
    emulation where one is present).
  CUDA otherwise (MXFP8 off 10.x, FP8 block off Hopper, 128x128 x 128x128): the same
    emulation in jnp (fp32 HIGHEST dot), with a one-time notice.
Block modes map over vmapped batches and are partitioned (below) where shards hold whole tiles.

NVFP4 is its own op, lowbit_gemm_nvfp4, in lowbit.ops.gemm_nvfp4 (nvfp4_gemm on packed E2M1
operands); it shares this module's algorithm choice, workspace size, K-partial sums and
sharding plan.

Algorithm (CUDA): `algo` picks entry `algo` of cuBLASLt's heuristic list (0 = its first choice);
`gemm(algo=None)` takes it per GEMM kind from LOWBIT_GEMM_ALGO or DEFAULT_ALGO (gemm_config's
docstring lists the kinds and what a bad or out-of-range index does).

Workspace: the lowbit_gemm custom call has a second result, a u8 workspace that XLA's buffer
assignment plans like any temp (XLA's FFI scratch allocator failed the 256-byte aligned
requests made for cuBLASLt and allocates outside the compile-time plan: csrc/ffi/gemm_ffi.cc):
gemm_workspace_bytes() on CUDA (GEMM_WORKSPACE_BYTES, plus the swizzled MXFP8 scales), 0
bytes on the CPU. It exists only in the lowering rules
(`_lower_with_workspace`): gemm_p itself has one result, so abstract evaluation, batching
and partitioning never see it; it is never sharded (each device's custom call gets its own).

Sharding (Shardy rule + custom_partitioning): data parallel over a's rows, column-parallel
over N, row-parallel over K (partial products summed by a psum or reduce-scatter), block
modes with their scales where shards hold whole tiles; gemm_sharding's docstring has the rule.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive
from lowbit.ops._sharding import (COLS, ROWS, SCALE_DIMS, axes_entry, compound_sizes, fit_scale,
                                  named_shardings, spec_entries, tiled_group_rule)
# Re-exported: the configuration, argument-check and sharding pieces live in their own
# modules, and callers (lowbit.dense, lowbit.ops.dense_backward, the tests, the benchmarks)
# read them here too.
from lowbit.ops.gemm_args import (_check_bound_shapes, _check_scale_modes, _scale_arg, _shape_text,  # noqa: F401
                                  check_operands)
from lowbit.ops.gemm_config import (ALGO_ENV, CUBLASLT_BLOCK_PAIRS, DEFAULT_ALGO, FP8, FP8_BLOCK_MODES,  # noqa: F401
                                    FP8_DIM_MULTIPLE, GEMM_WORKSPACE_BYTES, HALF, MAX_ALGO, MXFP8_K_MULTIPLE, OP,
                                    OUT, PSUM_ENV, _E8M0, GemmScaleMode, _block_bias_epilogue, _checked_algo,
                                    _cublaslt_block_ready, _reduce_dtype, algo_kind, block_on_cublaslt, kind_algo,
                                    mxfp8_on_cublaslt, parse_algo, psum_in_fp32, resolve_algo, resolve_algo_choice)
from lowbit.ops.gemm_scales import (_cdiv, _round_up, dequantize_operand, emulated_gemm,  # noqa: F401
                                    gemm_workspace_bytes, scale_shape, swizzle_scales, swizzle_scales_jnp,
                                    swizzle_scales_p, unswizzle_scales_jnp)
from lowbit.ops.gemm_sharding import (_LAYOUT, _block_specs, _scale_sharding, _spec_axes,  # noqa: F401
                                      _sum_k_partials, _vmappable, gather_rows, plan_sharding)


_NOTICED: set[str] = set()


def _notice_once(key: str, message: str) -> None:
    """The one-time notice DESIGN.md asks for when a GEMM is emulated."""
    if key not in _NOTICED:
        _NOTICED.add(key)
        warnings.warn(message, stacklevel=3)


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
    the FP8 kinds, see gemm_config's docstring, and 0 for 16-bit operands); no effect on the
    CPU or where the GEMM is emulated.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    kd, k_shape, n_shape, out_dtype, bias = check_operands(a, b, contracting_ndim, out_dtype, bias)
    a_mode, b_mode = _check_scale_modes(a_scale_mode, b_scale_mode, a.dtype)
    k_size = math.prod(k_shape)
    sa = _scale_arg("a_scale_inv", a_scale_inv, a_mode, math.prod(a.shape[:a.ndim - kd]), k_size)
    sb = _scale_arg("b_scale_inv", b_scale_inv, b_mode, math.prod(n_shape), k_size)
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
