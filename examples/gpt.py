"""A small GPT built from lowbit.flax modules, trained on bytes of CPython's standard library
sources (examples/data.py) in bf16, with each FP8 recipe and NVFP4; the recipes are compared on
the same initialisation and the same batches.

    python examples/gpt.py --config small      # the CPU: a few minutes
    python examples/gpt.py --config gpu        # a GPU: 6 layers, d=512, a few thousand steps

Model: token + learned position embeddings, N pre-norm blocks of
LayerNormDenseGeneral (fused QKV) -> causal attention (lowbit Softmax, "scaled_upper_triang")
-> DenseGeneral (output projection) -> residual -> LayerNormMLP (gelu) -> residual, a final
LayerNorm and an output head tied to the token embedding (kept in fp32, as the embedding).
Parameters are fp32, activations bf16; every GEMM of the blocks runs in the recipe's format.
The recipe is taken from `lowbit.autocast` around the traced step. DelayedScaling's state
(collection `_overwrite_with_gradient`) is threaded through the steps: the step
differentiates with respect to it and the gradient is the next step's state; optax only
updates `params`. NVFP4's stochastic rounding and RHT signs draw from the Flax RNG stream
"sr_rng", fed a fresh key each step (fold_in(key(seed + 2), step); evaluation uses a fixed
one). Recipes whose kernels are missing on this build are listed and skipped with the
reason their quantizer gives.

Writes to --out (default runs/gpt): loss_curves.png, results.md (final train/val loss per
recipe), results.json; progress (step, loss, tokens/s) is printed while it trains.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lowbit  # noqa: E402
from data import VOCAB_SIZE, batches, load_corpus  # noqa: E402
from lowbit.flax import OVERWRITE_WITH_GRADIENT  # noqa: E402
from lowbit.flax.module import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP, Softmax  # noqa: E402
from lowbit.quantize import QuantizerFactory  # noqa: E402
from lowbit.recipe import (  # noqa: E402
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    d_model: int
    heads: int
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    log_every: int
    eval_every: int
    eval_batches: int
    max_bytes: int | None
    weight_decay: float = 0.1


CONFIGS = {
    "tiny": Config(layers=1, d_model=32, heads=2, seq_len=32, batch=4, steps=30, lr=3e-3,
                   warmup=5, log_every=10, eval_every=15, eval_batches=2, max_bytes=1_000_000),
    "small": Config(layers=2, d_model=128, heads=4, seq_len=64, batch=16, steps=250, lr=2e-3,
                    warmup=25, log_every=25, eval_every=125, eval_batches=8, max_bytes=8_000_000),
    "gpu": Config(layers=6, d_model=512, heads=8, seq_len=256, batch=32, steps=3000, lr=6e-4,
                  warmup=200, log_every=100, eval_every=500, eval_batches=32, max_bytes=None),
}

RECIPES = {
    "none": None,
    "DelayedScaling": DelayedScaling(),
    "Float8CurrentScaling": Float8CurrentScaling(),
    "MXFP8BlockScaling": MXFP8BlockScaling(),
    "Float8BlockScaling": Float8BlockScaling(),
    "NVFP4BlockScaling": NVFP4BlockScaling(),
}

ACT_DTYPE = jnp.bfloat16


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        d, heads = self.cfg.d_model, self.cfg.heads
        head_dim = d // heads
        qkv, _ = LayerNormDenseGeneral(
            features=(3, heads, head_dim), use_bias=True, return_layernorm_output=False,
            kernel_axes=("embed", "qkv", "heads", "kv"), bias_axes=("qkv", "heads", "kv"),
            name="qkv")(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]              # (B, T, heads, head_dim)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        probs = Softmax(scale_factor=1.0 / math.sqrt(head_dim),
                        softmax_fusion_type="scaled_upper_triang", name="softmax")(logits)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        x = x + DenseGeneral(d, axis=(-2, -1), kernel_axes=("heads", "kv", "embed"),
                             bias_axes=("embed",), name="out")(attn)
        y, _ = LayerNormMLP(intermediate_dim=4 * d, activations=("gelu",), use_bias=True,
                            intermediate_dropout_rate=0.0, return_layernorm_output=False,
                            name="mlp")(x, deterministic=True)
        return x + y


class GPT(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(VOCAB_SIZE, self.cfg.d_model, name="wte",
                         embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))
        pos = self.param("wpe", nn.with_logical_partitioning(init, (None, "embed")),
                         (self.cfg.seq_len, self.cfg.d_model))
        x = (embed(tokens) + pos[: tokens.shape[1]]).astype(ACT_DTYPE)
        for i in range(self.cfg.layers):
            x = Block(self.cfg, name=f"block_{i}")(x)
        x = LayerNorm(name="ln_f")(x)
        return embed.attend(x.astype(jnp.float32))


def recipe_unavailable(recipe) -> str | None:
    """Why this build cannot run `recipe` (its quantizers' or GEMMs' error), or None."""
    if recipe is None:
        return None
    try:
        lowbit.dense(jnp.ones((4, 32), ACT_DTYPE), jnp.ones((32, 32), ACT_DTYPE),
                     quantizer_set=QuantizerFactory.create_set(recipe))
    except NotImplementedError as e:
        return str(e)
    return None


def train_one(name, recipe, cfg, corpus, seed, log):
    model = GPT(cfg)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                                       end_value=cfg.lr / 10),
                    b2=0.95, weight_decay=cfg.weight_decay))

    def loss_fn(variables, x, y, sr_key):
        with lowbit.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model.apply(variables, x, rngs={"sr_rng": sr_key})  # NVFP4's SR and RHT
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, qstate, opt_state, x, y, sr_key):
        loss, grads = jax.value_and_grad(loss_fn)({"params": params, OVERWRITE_WITH_GRADIENT: qstate}, x, y,
                                                  sr_key)
        updates, opt_state = tx.update(grads["params"], opt_state, params)
        # overwrite-with-gradient: the quantizer state's gradient is its next value
        return optax.apply_updates(params, updates), grads[OVERWRITE_WITH_GRADIENT], opt_state, loss

    sr_base = jax.random.PRNGKey(seed + 2)
    eval_loss = jax.jit(lambda p, q, x, y: loss_fn({"params": p, OVERWRITE_WITH_GRADIENT: q}, x, y, sr_base))
    val_batches = [b for b, _ in zip(batches(corpus.val, cfg.batch, cfg.seq_len, seed + 1),
                                     range(cfg.eval_batches))]

    def validate(params, qstate):
        return float(np.mean([eval_loss(params, qstate, x, y) for x, y in val_batches]))

    x0 = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    with lowbit.autocast(enabled=recipe is not None, recipe=recipe):
        variables = nn.meta.unbox(model.init(jax.random.PRNGKey(seed), x0))
    params, qstate = variables["params"], variables.get(OVERWRITE_WITH_GRADIENT, {})
    opt_state = tx.init(params)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    log(f"[{name}] {n_params / 1e6:.2f}M parameters, {cfg.steps} steps of {cfg.batch}x{cfg.seq_len} tokens")

    train_curve, val_curve, tokens_per_step = [], [], cfg.batch * cfg.seq_len
    start = t_log = time.perf_counter()
    tok_s = 0.0
    data = batches(corpus.train, cfg.batch, cfg.seq_len, seed)
    for i in range(1, cfg.steps + 1):
        x, y = next(data)
        params, qstate, opt_state, loss = step(params, qstate, opt_state, x, y,
                                               jax.random.fold_in(sr_base, i))
        train_curve.append(float(loss))
        if i == 1:
            log(f"[{name}] step 1 loss {train_curve[-1]:.3f} (compiled in {time.perf_counter() - start:.1f}s)")
            t_log, steps_since = time.perf_counter(), 0
            continue
        steps_since += 1
        if i % cfg.log_every == 0 or i == cfg.steps:
            tok_s = steps_since * tokens_per_step / (time.perf_counter() - t_log)
            window = np.mean(train_curve[-steps_since:])
            log(f"[{name}] step {i:5d} loss {window:.3f} {tok_s:,.0f} tokens/s")
            t_log, steps_since = time.perf_counter(), 0
        if i % cfg.eval_every == 0 or i == cfg.steps:
            val_curve.append((i, validate(params, qstate)))
            log(f"[{name}] step {i:5d} val loss {val_curve[-1][1]:.3f}")
            t_log = time.perf_counter()
    tail = max(1, cfg.steps // 10)
    return {
        "train_curve": train_curve,
        "val_curve": val_curve,
        "final_train_loss": float(np.mean(train_curve[-tail:])),
        "final_val_loss": val_curve[-1][1],
        "tokens_per_s": tok_s,
        "wall_s": time.perf_counter() - start,
    }


def write_table(results, skipped, path):
    base = results.get("none", {}).get("final_val_loss")
    lines = ["| recipe | final train loss | final val loss | val vs none | tokens/s | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        rel = "" if base is None or name == "none" else f"{100 * (r['final_val_loss'] / base - 1):+.2f}%"
        lines.append(f"| {name} | {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} | {rel} | "
                     f"{r['tokens_per_s']:,.0f} | {r['wall_s']:.1f} |")
    for name, reason in skipped.items():
        lines.append(f"| {name} | skipped: {reason} | | | | |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def write_plot(results, cfg, path, log):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no loss_curves.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    window = max(1, cfg.steps // 50)
    for name, r in results.items():
        curve = np.convolve(r["train_curve"], np.ones(window) / window, mode="valid")
        line, = ax.plot(np.arange(window, window + len(curve)), curve, label=f"{name} train")
        steps, vals = zip(*r["val_curve"])
        ax.plot(steps, vals, "o--", color=line.get_color(), label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(f"GPT {cfg.layers}x{cfg.d_model}, seq {cfg.seq_len}: bf16 vs FP8/FP4 recipes")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help=f"comma-separated subset of {','.join(RECIPES)}")
    parser.add_argument("--steps", type=int, help="override the config's step count")
    parser.add_argument("--out", default="runs/gpt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    if args.steps:
        cfg = dataclasses.replace(cfg, steps=args.steps, warmup=min(cfg.warmup, max(1, args.steps // 10)),
                                  eval_every=min(cfg.eval_every, args.steps))
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; choose from {list(RECIPES)}")
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    t0 = time.perf_counter()
    corpus = load_corpus(cfg.max_bytes)
    log(f"corpus: {corpus.n_files} stdlib files, {len(corpus.train):,} train / {len(corpus.val):,} "
        f"val bytes; device {jax.devices()[0].platform}; config {args.config}: {cfg}")
    results, skipped = {}, {}
    for name in names:
        reason = recipe_unavailable(RECIPES[name])
        if reason:
            skipped[name] = reason
            log(f"[{name}] skipped: {reason}")
            continue
        results[name] = train_one(name, RECIPES[name], cfg, corpus, args.seed, log)
    table = write_table(results, skipped, os.path.join(args.out, "results.md"))
    write_plot(results, cfg, os.path.join(args.out, "loss_curves.png"), log)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "config_name": args.config,
                   "results": results, "skipped": skipped}, f)
    log("\n" + table)
    log(f"wrote {args.out}/loss_curves.png, results.md, results.json in {time.perf_counter() - t0:.0f}s")
    return results


if __name__ == "__main__":
    main()
