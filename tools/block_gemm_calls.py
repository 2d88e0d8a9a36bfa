"""Runs the seed Dense's Float8BlockScaling GEMMs (bench/bench_dense.py's block floor shapes:
fwd and dgrad 1x128 x 128x128, wgrad 1x128 x 1x128, bf16 out; wgrad_f32: the wgrad with the f32
output that lowbit.dense writes for an f32 kernel) twice each on the path
LOWBIT_BLOCK_GEMM picks, for Nsight Compute (tools/profile_block_gemm.sh): skip one launch,
profile the next.

    LOWBIT_BLOCK_GEMM=wgmma python tools/block_gemm_calls.py fwd wgrad
"""

import sys

import jax
import jax.numpy as jnp

import lowbit
from lowbit.ops.gemm import GemmScaleMode, scale_shape

M, K, N = 16384, 8192, 32768  # tokens, hidden, features of the seed Dense
B1, B2 = GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_128x128
SHAPES = {  # (a rows, b rows, contracted, a mode, b mode, out dtype)
    "fwd": (M, N, K, B1, B2, jnp.bfloat16),    # x rowwise x kernel colwise
    "dgrad": (M, K, N, B1, B2, jnp.bfloat16),  # dy rowwise x kernel rowwise
    "wgrad": (K, N, M, B1, B1, jnp.bfloat16),  # x colwise x dy colwise
    "wgrad_f32": (K, N, M, B1, B1, jnp.float32),
}


def operand(key, rows, cols, mode):
    data = jax.random.normal(key, (rows, cols)).astype(jnp.float8_e4m3fn)
    return data, jnp.ones(scale_shape(mode, rows, cols), jnp.float32)


def main(which):
    key = jax.random.PRNGKey(0)
    for name in which:
        m, n, k, ma, mb, out = SHAPES[name]
        (a, sa), (b, sb) = operand(key, m, k, ma), operand(key, n, k, mb)
        f = jax.jit(lambda a, b, sa, sb, ma=ma, mb=mb, out=out: lowbit.ops.gemm(
            a, b, sa, sb, out_dtype=out, a_scale_mode=ma, b_scale_mode=mb))
        for _ in range(2):
            jax.block_until_ready(f(a, b, sa, sb))
        print(name, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
