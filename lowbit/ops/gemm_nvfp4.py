"""lowbit.ops.gemm_nvfp4: the NVFP4 GEMM, out = dequant(a) . dequant(b)^T + bias, through its
own FFI target lowbit_gemm_nvfp4.

Operands as lowbit.ops.quantize_nvfp4 stores them: packed E2M1 (rows, ceil(K/2)) uint8, e4m3
block scales per 16 values and an fp32 global scale_inv each. CPU: the C++ reference's exact
emulation (products rounded to fp32, summed in increasing k). CUDA on compute capability 10.x:
cuBLASLt (compile-checked only: no Blackwell GPU has run it yet); on other GPUs the same
emulation in jnp (dequantize, fp32 HIGHEST dot), with a one-time notice. vmap maps over the
batch; custom_partitioning + Shardy rules shard rows, N and K where shards hold whole 16-blocks
of unpadded scale dims, else gather (_make_nvfp4_gemm). lowbit.dense multiplies its NVFP4
copies through nvfp4_gemm, the wgrad of RHT copies included (x's and dy's colwise copies share
one sign vector, so their stored values multiply to the product); emulated_nvfp4_gemm
(dequantized operands) is left for a GEMM with one transformed operand
(lowbit.dense.nvfp4_packed_gemm_ok).

Shares the algorithm choice (kind "nvfp4" of LOWBIT_GEMM_ALGO) and workspace size of
lowbit.ops.gemm_config and the K-partial sums and sharding plan of lowbit.ops.gemm_sharding;
the compute capability is read through lowbit.ops.gemm (_cuda_capability), so that one
override covers both GEMM ops.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from lowbit import _ffi
from lowbit.ops._primitive import ffi_primitive
from lowbit.ops._sharding import (axes_entry, clean_split, compound_sizes, fit_scale, named_shardings, spec_entries,
                                  tiled_group_rule)
from lowbit.ops.gemm import _notice_once
from lowbit.ops.gemm_args import _shape_text
from lowbit.ops.gemm_config import (FP8_DIM_MULTIPLE, GEMM_WORKSPACE_BYTES, OP, OUT, _checked_algo, _reduce_dtype,
                                    kind_algo, mxfp8_on_cublaslt, psum_in_fp32)
from lowbit.ops.gemm_scales import _cdiv, _round_up
from lowbit.ops.gemm_sharding import _spec_axes, _sum_k_partials, _vmappable, plan_sharding

# The module, not the function lowbit.ops re-exports under its name: _cuda_capability is read
# through it at lowering time, so that one override (tests) covers gemm and nvfp4_gemm alike.
_gemm = importlib.import_module("lowbit.ops.gemm")


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
    if not mxfp8_on_cublaslt(_gemm._cuda_capability()):
        _notice_once("nvfp4-cuda", f"lowbit.ops.gemm: no cuBLASLt NVFP4 path on compute capability "
                     f"{_gemm._cuda_capability() or 'unknown'} (10.x only); emulating it exactly (dequantize "
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
    and whole 16-blocks per shard (the packed bytes then split evenly too). A sharded dim
    failing that is gathered: exact, not parallel. Under vmap every call maps over the batch
    (lax.map)."""

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
