"""The seed transformer layer (examples/te_integration_layer.py: FlaxTransformerLayer) rebuilt
from lowbit's fused Linen modules, the step after the `dot_general` drop-in that TE's
quickstart takes: LayerNorm + QKV projection in one `LayerNormDenseGeneral` (the norm writes
its output already quantized), the output projection as a `DenseGeneral`, and LayerNorm + MLP
in one `LayerNormMLP` (GEMM -> fused bias + gelu + quantize -> GEMM).

Same math as the Flax layer: pre-LN, eps 1e-5, fused QKV split per head, Flax's
`nn.dot_product_attention` with attention dropout, tanh-approximated gelu, biases on every
GEMM, two residual adds. The Flax layer's activations become fp32 after its first LayerNorm
(fp32 params promote a bf16 input), so its attention and residuals run in fp32; this layer
casts q, k, v and the projections to fp32 at the same places, so that the attention costs
the same in both and only the norm/GEMM/activation path differs. `from_flax_params` maps a
FlaxTransformerLayer's params onto this layer (tests/test_fused_layer.py checks that both
compute the same function without quantization).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import linen as nn

from lowbit import flax as lowbit_flax


class FusedTransformerLayer(nn.Module):
    """FlaxTransformerLayer with lowbit's fused modules; `quantization_recipe` None runs
    unquantized (or under `lowbit.autocast`)."""

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    quantization_recipe: object = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, attention_mask: Optional[jnp.ndarray] = None,
                 deterministic: bool = False) -> jnp.ndarray:
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        heads, kv = self.num_attention_heads, self.hidden_size // self.num_attention_heads
        recipe = self.quantization_recipe

        res = x
        qkv, _ = lowbit_flax.LayerNormDenseGeneral(
            features=3 * self.hidden_size, epsilon=self.layernorm_eps, use_bias=True,
            return_layernorm_output=False, quantization_recipe=recipe, name="ln_qkv")(x)
        qkv = qkv.astype(jnp.float32).reshape(*qkv.shape[:2], heads, 3 * kv)
        q, k, v = jnp.split(qkv, 3, axis=3)
        dropout_rng = None
        if not deterministic and self.attention_dropout > 0:
            dropout_rng = self.make_rng("dropout")
        x = nn.dot_product_attention(query=q, key=k, value=v, mask=attention_mask,
                                     dropout_rng=dropout_rng, dropout_rate=self.attention_dropout,
                                     deterministic=deterministic, broadcast_dropout=True)
        x = x.reshape(*x.shape[:2], self.hidden_size)
        x = lowbit_flax.DenseGeneral(features=self.hidden_size, use_bias=True,
                                     quantization_recipe=recipe, name="proj")(x)
        x = res + x.astype(jnp.float32)

        res = x
        y, _ = lowbit_flax.LayerNormMLP(
            intermediate_dim=self.ffn_hidden_size, epsilon=self.layernorm_eps, use_bias=True,
            activations=("gelu",), intermediate_dropout_rate=0.0, return_layernorm_output=False,
            quantization_recipe=recipe, name="ln_mlp")(x, deterministic=deterministic)
        return y.astype(jnp.float32) + res


def from_flax_params(flax_params: dict) -> dict:
    """FlaxTransformerLayer params -> FusedTransformerLayer params (same values)."""
    p = flax_params
    mlp = p["FlaxMLP_0"]
    return {
        "ln_qkv": {"scale": p["LayerNorm_0"]["scale"], "ln_bias": p["LayerNorm_0"]["bias"],
                   "kernel": p["Dense_0"]["kernel"], "bias": p["Dense_0"]["bias"]},
        "proj": {"kernel": p["Dense_1"]["kernel"], "bias": p["Dense_1"]["bias"]},
        "ln_mlp": {"scale": p["LayerNorm_1"]["scale"], "ln_bias": p["LayerNorm_1"]["bias"],
                   "wi_kernel": mlp["Dense_0"]["kernel"][:, None, :],
                   "wi_bias": mlp["Dense_0"]["bias"][None, :],
                   "wo_kernel": mlp["Dense_1"]["kernel"], "wo_bias": mlp["Dense_1"]["bias"]},
    }
