"""The seed tutorial "JAX: Integrating TE into an existing framework", on lowbit.

The model code below is the tutorial's, unchanged; only the imports differ
(`transformer_engine.common.recipe` -> `lowbit.recipe`, `transformer_engine.jax.flax` ->
`lowbit.flax`); main adds one closing check, the output against the unquantized layer's from
the same params. Run it at the tutorial's shapes on a GPU, or smaller anywhere:

    python examples/te_integration_layer.py --recipe DelayedScaling
    python examples/te_integration_layer.py --small --recipe Float8CurrentScaling
"""

import argparse
import os
import sys
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_jax_utils as utils  # noqa: E402
from lowbit import flax as te_flax  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling  # noqa: E402,F401


class FlaxMLP(nn.Module):
    """Feed-forward network in Transformer layer
    Built with plain Flax modules.
    """
    hidden_size: int
    ffn_hidden_size: int
    dot_general_cls: callable = lambda: None

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        x = nn.gelu(x, approximate=True)  # equivalent to tanh approximation
        x = nn.Dense(features=self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        return x


class FlaxTransformerLayer(nn.Module):
    """Basic Transformer layer using plain Flax modules"""
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    dot_general_cls: callable = lambda: None

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        attention_mask: Optional[jnp.ndarray] = None,
        deterministic: bool = False
    ) -> jnp.ndarray:
        # Create causal mask if not provided
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)

        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # Fused QKV projection
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        dropout_rng = None
        if not deterministic and self.attention_dropout > 0:
            dropout_rng = self.make_rng('dropout')

        x = nn.dot_product_attention(
            query=q,
            key=k,
            value=v,
            mask=attention_mask,
            dropout_rng=dropout_rng,
            dropout_rate=self.attention_dropout,
            deterministic=deterministic,
            broadcast_dropout=True,
        )

        x = x.reshape(x.shape[0], x.shape[1], self.hidden_size)

        # Output projection
        x = nn.Dense(features=self.hidden_size, use_bias=True, dot_general=self.dot_general_cls())(x)

        x = res + x

        # Second residual connection
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # MLP
        mlp = FlaxMLP(
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            dot_general_cls=self.dot_general_cls,
        )
        x = mlp(x)

        return x + res


SEED_SHAPE = dict(hidden_size=4096, sequence_length=2048, batch_size=4, ffn_hidden_size=16384,
                  num_attention_heads=32)
SMALL_SHAPE = dict(hidden_size=256, sequence_length=64, batch_size=2, ffn_hidden_size=1024,
                   num_attention_heads=4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="DelayedScaling",
                        choices=["none", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
                                 "NVFP4BlockScaling"])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    shape = SMALL_SHAPE if args.small else SEED_SHAPE
    iters = args.iters or (3 if args.small else 50)

    hidden_size, sequence_length = shape["hidden_size"], shape["sequence_length"]
    batch_size, ffn_hidden_size = shape["batch_size"], shape["ffn_hidden_size"]
    num_attention_heads = shape["num_attention_heads"]
    dtype = jnp.bfloat16

    key, dropout_key = jax.random.split(jax.random.PRNGKey(42))
    x = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)
    dy = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)

    dot_general_cls = lambda: None
    rngs = {'dropout': dropout_key}
    if args.recipe != "none":
        quantization_recipe = globals()[args.recipe]()
        dot_general_cls = te_flax.make_dot_general_cls(quantization_recipe)
        if isinstance(quantization_recipe, NVFP4BlockScaling):
            rngs['sr_rng'] = jax.random.PRNGKey(0)

    flax_transformer = FlaxTransformerLayer(
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        dot_general_cls=dot_general_cls,
    )
    var_collect = flax_transformer.init(key, x, attention_mask=None, deterministic=False)
    print(f"Parameter shapes: {jax.tree_util.tree_map(lambda x: x.shape, var_collect['params'])}")
    print("Additional state: "
          f"{jax.tree_util.tree_map(lambda x: x.shape, {k: v for k, v in var_collect.items() if k != 'params'})}")
    y = flax_transformer.apply(var_collect, x, attention_mask=None, deterministic=True)
    print(f"Output shape: {y.shape} dtype: {y.dtype}")
    mean_ms = utils.speedometer(
        model_apply_fn=flax_transformer.apply,
        variables=var_collect,
        input=x,
        output_grad=dy,
        forward_kwargs={"attention_mask": None, "deterministic": False},
        rngs=rngs,
        timing_iters=iters,
        warmup_iters=min(iters, 5),
    )
    # Not in the tutorial: how far the output is from the unquantized layer's, same params.
    unquantized = FlaxTransformerLayer(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                       num_attention_heads=num_attention_heads)
    y_ref = unquantized.apply({"params": var_collect["params"]}, x, attention_mask=None, deterministic=True)
    rel = float(jnp.linalg.norm((y - y_ref).astype(jnp.float32)) / jnp.linalg.norm(y_ref.astype(jnp.float32)))
    print(f"output vs the unquantized layer: relative difference {rel:.4f}")
    return {"mean_ms": mean_ms, "rel_diff": rel, "variables": var_collect}


if __name__ == "__main__":
    main()
