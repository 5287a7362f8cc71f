"""Per-token decode cost with LoRA adapters: merged into the kernels vs low-rank in the step.

A server holding a LoRA policy (`gjax.rollout.handoff`) can apply the adapters two ways:
* merged: W' = W + (alpha / r) A B once per pushed version (`lora.merged`, then the base's
  decode layout), then every decode step is the base model's step;
* low-rank: the base kernels as they are and, in every step, y += (alpha / r) (x A) B for each
  adapted projection (two skinny matmuls per target per layer).

This times, on the `--shape` dims with `--layers` layers (random weights, `--dtype`), one
decode step's layer matmuls for `--slots` rows (fused q|k|v, o, fused gate|up, down: what
`transformer.decode_layers`' layout runs; attention over the KV cache is the same in both and
left out) in the base / merged form and with the low-rank terms of all 7 targets, and what
each form costs per version: the merged form rebuilds the whole decode layout with the new
adapters (`decode_layers` with adapters), the low-rank form keeps the base's layout (built
once) and only casts the adapters.

    python benchmarks/lora_decode.py                               # 1.5B dims, 4 layers, ~1 min
    python benchmarks/lora_decode.py --layers=1 --repeats=3        # smoke

Prints one JSON line: per-step ms of each form, the low-rank's overhead, the merged form's
seconds per version and the decode steps per version after which merging is cheaper.

Measured 2026-12-01 on the shared 2-core CPU (load 17-21: other jobs; f32, 32 slots, rank 16,
1.5B dims): 2 layers, 40 repeats: merged 488 ms a step, low-rank 584 ms (1.20x), the merged
layout 1.59 s a version (the base's, built once for the low-rank form: 1.00 s), break-even
after 17 steps of a version; 4 layers, 20 repeats: 626 vs 563 ms (0.90x: within this box's
noise). By count the low-rank terms add r (in + out) / (in x out) = 1.4 % of the layer FLOPs
and weight bytes per token, in 14 more, skinny matmuls. gjax's decode step runs the low-rank
form (`transformer.decode_layers` keeps the adapters apart): merged into a bf16 kernel, an
update much smaller than W rounds away (tests/test_lora.py), so the sampler would not sample
the policy the learner trains; the low-rank form computes what the learner does.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from gjax.flops import QWEN2_SHAPES
from gjax.models import lora, transformer
from gjax.models.config import LORA_TARGETS, ModelConfig


def model(shape: str, layers: int, rank: int, dtype: str) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        **{**QWEN2_SHAPES[shape], "num_layers": layers},
        tie_word_embeddings=True,
        attention_bias=True,
        param_dtype=dtype,
        dtype=dtype,
        lora_rank=rank,
        lora_alpha=2.0 * rank,
        lora_targets=LORA_TARGETS,
    )


def random_tree(abstract, seed: int):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(abstract))))
    return jax.tree.map(
        lambda x: 0.02 * jax.random.normal(next(keys), x.shape, jnp.float32).astype(x.dtype),
        abstract,
    )


def layer_matmuls(x_SxD, lp, cfg: ModelConfig, adapters=None):
    """One decode step's layer matmuls (residual adds, SwiGLU), optionally + the low-rank terms
    of every target (`adapters`: that layer's {target: (A, B)})."""
    hq = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    s = cfg.lora_scale

    def low(name, x):
        a, b = adapters[name]
        return s * jnp.dot(jnp.dot(x, a), b)

    qkv = jnp.dot(x_SxD, lp["qkv"])
    if adapters is not None:
        qkv = qkv + jnp.concatenate([low(n, x_SxD) for n in "qkv"], axis=-1)
    q = qkv[:, :hq] + 0.0 * qkv[:, hq : hq + kv].sum(-1, keepdims=True)  # keep k, v live
    o = jnp.dot(q, lp["o"])
    if adapters is not None:
        o = o + low("o", q)
    x_SxD = x_SxD + o
    gu = jnp.dot(x_SxD, lp["gate_up"])
    if adapters is not None:
        gu = gu + jnp.concatenate([low("gate", x_SxD), low("up", x_SxD)], axis=-1)
    g, u = jnp.split(gu, 2, axis=-1)
    h = jax.nn.silu(g) * u
    down = jnp.dot(h, lp["down"])
    if adapters is not None:
        down = down + low("down", h)
    return x_SxD + down


def per_layer_adapters(adapters, cfg: ModelConfig):
    out = []
    for i in range(cfg.num_layers):
        layer = {}
        for name in cfg.lora_targets:
            group, proj = lora.TARGET_PATHS[name]
            p = adapters["layers"][group][proj]
            layer[name] = (
                p["lora_a"][i].astype(cfg.jnp_dtype),
                p["lora_b"][i].astype(cfg.jnp_dtype),
            )
        out.append(layer)
    return out


def best_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2-1.5b", choices=sorted(QWEN2_SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    cfg = model(args.shape, args.layers, args.rank, args.dtype)
    # The layers only (the decode layout reads nothing else).
    base = {"layers": random_tree(transformer.abstract_params(cfg.without_lora())["layers"], 0)}
    adapters = random_tree(lora.abstract_adapters(cfg), 1)
    params = lora.merge(base, adapters)
    layers_of = jax.jit(transformer.decode_layers, static_argnames=("cfg",))
    # The merged form: the adapters folded into the kernels, a plain model's decode layout.
    merge_layout = jax.jit(
        lambda p: transformer.decode_layers(lora.merged(p, cfg), cfg.without_lora())
    )
    merged = merge_layout(params)
    plain = layers_of(base, cfg=cfg.without_lora())
    low = per_layer_adapters(adapters, cfg)
    x = jax.random.normal(jax.random.key(2), (args.slots, cfg.hidden_size), cfg.jnp_dtype)

    @jax.jit
    def step_merged(layers, x):
        for lp in layers:
            x = layer_matmuls(x, lp, cfg)
        return x

    @jax.jit
    def step_low_rank(layers, low, x):
        for lp, ad in zip(layers, low):
            x = layer_matmuls(x, lp, cfg, ad)
        return x

    # The two forms compute the same step (to float rounding).
    want, got = step_merged(merged, x), step_low_rank(plain, low, x)
    rel_diff = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    merged_ms = best_ms(step_merged, merged, x, repeats=args.repeats)
    low_ms = best_ms(step_low_rank, plain, low, x, repeats=args.repeats)
    build_lora_ms = best_ms(merge_layout, params, repeats=3)
    build_base_ms = best_ms(lambda p: layers_of(p, cfg=cfg.without_lora()), base, repeats=3)
    # Per version: the merged form rebuilds the layout; the low-rank form keeps the base's.
    merge_ms = build_lora_ms
    overhead_ms = low_ms - merged_ms
    print(
        json.dumps(
            {
                "shape": args.shape,
                "layers": args.layers,
                "rank": args.rank,
                "slots": args.slots,
                "dtype": args.dtype,
                "backend": jax.default_backend(),
                "merged_step_ms": round(merged_ms, 3),
                "low_rank_step_ms": round(low_ms, 3),
                "low_rank_over_merged": round(low_ms / merged_ms, 3),
                "max_rel_diff": rel_diff,
                "layout_ms_base_once": round(build_base_ms, 1),
                "merged_layout_ms_per_version": round(merge_ms, 1),
                # Decode steps of one version after which merging once costs less than the
                # low-rank terms in every step (None: the low-rank step is not slower).
                "breakeven_steps": round(merge_ms / overhead_ms, 1) if overhead_ms > 0 else None,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
