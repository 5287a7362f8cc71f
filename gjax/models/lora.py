"""LoRA: low-rank adapters beside a frozen base (Hu et al. 2021, "LoRA", eq. (3)).

A targeted projection (`ModelConfig.lora_targets`, names in `LORA_TARGETS`: q, k, v, o, gate,
up, down) computes

    y = x W + (alpha / r) (x A) B,     A [in, r] (U(+-1/sqrt(in)), PEFT's), B [r, out] (zeros)

so the adapted model starts as the base exactly. The adapters live in the param tree beside
the kernel they adapt (`layers/attn/q/{kernel, lora_a, lora_b}`, stacked on the `layers` axis
like every layer param; logical axes: A as W's rows, B as W's columns, `gjax.sharding`).
The training forward (`transformer.Linear`), the sampler's prefill and its decode steps
(`transformer.decode_layers`) all run the low-rank form; a merged export folds the adapters
into their kernels (`merged`, `transformer.merged_kernel`).

A run with LoRA keeps two trees: the frozen `base` (the loaded checkpoint, never donated,
stored once) and the trained `adapters` (what the optimizer, its state and checkpoints
hold). `merge(base, adapters)` is the policy's whole tree (a dict union: no copy), and the
KL reference is the base itself under `cfg.without_lora()` (no second copy of the weights).

Why not a library: qwix (Tunix's choice) adds LoRA by intercepting a Flax module's matmuls
and finding the weight by the identity of the param array. gjax's projections cast their
kernel to the compute dtype before the matmul (a bf16 run has another array, so qwix finds
no weight) and its decode step is a pure function over fused per-layer kernels, outside any
module: qwix would reach neither. The adapter itself is these two lines; what a library
would add here (quantized bases) is what QLoRA takes from one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import numpy as np

from gjax import integrity, sharding
from gjax.models import quant, transformer
from gjax.models.config import LORA_TARGETS, ModelConfig, parse_lora_targets

Params = dict[str, Any]
ADAPTER_LEAVES = ("lora_a", "lora_b")
# Where each target sits in the param tree, and its Hugging Face (PEFT) module name.
TARGET_PATHS = {
    "q": ("attn", "q"),
    "k": ("attn", "k"),
    "v": ("attn", "v"),
    "o": ("attn", "o"),
    "gate": ("mlp", "gate"),
    "up": ("mlp", "up"),
    "down": ("mlp", "down"),
}
HF_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
assert set(TARGET_PATHS) == set(LORA_TARGETS) == set(HF_MODULES)


def enabled(cfg: ModelConfig) -> bool:
    return cfg.lora_rank > 0


def split(params: Params) -> tuple[Params, Params]:
    """A tree with adapters -> `(base, adapters)`, each with only its own leaves."""

    def walk(tree):
        base, adapters = {}, {}
        for key, value in tree.items():
            if key in ADAPTER_LEAVES:
                adapters[key] = value
            elif isinstance(value, dict):
                b, a = walk(value)
                if b:
                    base[key] = b
                if a:
                    adapters[key] = a
            else:
                base[key] = value
        return base, adapters

    return walk(params)


def merge(base: Params | None, adapters: Params) -> Params:
    """The policy's whole tree from the frozen base and the adapters (a dict union, no array
    is copied); `base` None (full fine-tuning): `adapters` is already the whole tree."""
    if base is None:
        return adapters

    def walk(b, a):
        out = dict(b)
        for key, value in a.items():
            out[key] = walk(b[key], value) if isinstance(value, dict) else value
        return out

    return walk(base, adapters)


def abstract_adapters(cfg: ModelConfig) -> Params:
    """The adapters of `cfg` as `jax.ShapeDtypeStruct`s (no allocation)."""
    return split(transformer.abstract_params(cfg))[1]


def adapter_logical_axes(cfg: ModelConfig) -> Params:
    return split(transformer.param_logical_axes(cfg))[1]


def init_adapters(cfg: ModelConfig, rng, shardings=None) -> Params:
    """Fresh adapters (A he_uniform, B zeros), created in place with `shardings` (a tree like
    the adapters', e.g. `gjax.sharding.param_shardings(abstract_adapters(cfg), mesh)`).
    Only the adapters are computed: the base's initializers are dead code to XLA."""
    init = jax.jit(lambda key: split(transformer.init_params(cfg, key))[1], out_shardings=shardings)
    return init(rng)


def configure(cfg: ModelConfig, lora_config) -> ModelConfig:
    """`cfg` with a run's `config.model.lora` (rank 0: unchanged, full fine-tuning)."""
    if not lora_config.rank:
        return cfg
    return cfg.replace(
        lora_rank=int(lora_config.rank),
        lora_alpha=float(lora_config.alpha),
        lora_targets=parse_lora_targets(lora_config.targets),
        lora_dtype=lora_config.dtype,
        base_quant=lora_config.get("quantize", "none"),
    )


def attach(cfg: ModelConfig, params: Params, lora_config, mesh, rng):
    """A run's trained params: `(cfg, frozen, trained)`. With `config.model.lora.rank` > 0
    the loaded `params` become the frozen base (quantized if `model.lora.quantize` says so:
    QLoRA, `gjax.models.quant`) and `trained` fresh adapters placed on `mesh` by the
    logical-axis rules; else `(cfg, None, params)` (full fine-tuning)."""
    cfg = configure(cfg, lora_config)
    if not enabled(cfg):
        return cfg, None, params
    if cfg.base_quant != "none":
        abstract_base = split(transformer.abstract_params(cfg))[0]
        params = quant.quantize_base(params, cfg, sharding.param_shardings(abstract_base, mesh))
    shardings = sharding.param_shardings(abstract_adapters(cfg), mesh)
    return cfg, params, init_adapters(cfg, rng, shardings)


def as_record(lora_config) -> dict:
    """What a checkpoint records of `config.model.lora` (a resume must match it)."""
    return {
        "rank": int(lora_config.rank),
        "alpha": float(lora_config.alpha),
        "targets": list(parse_lora_targets(lora_config.targets)),
        "dtype": lora_config.dtype,
        "quantize": lora_config.get("quantize", "none"),
    }


def base_digest(base: Params | None) -> str | None:
    """A content hash of the base as loaded (before any quantization): sha256 over its
    arrays' paths, shapes, dtypes and `gjax.integrity` digests (computed on the devices, the
    same however the base is sharded). A checkpoint's adapters fit only the base they
    trained on."""
    if base is None:
        return None
    digests, _ = integrity.inspect(base)
    shapes = {
        jax.tree_util.keystr(path): [list(x.shape), str(x.dtype)]
        for path, x in jax.tree_util.tree_leaves_with_path(base)
    }
    text = json.dumps({"digests": digests, "shapes": shapes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def merged(params: Params, cfg: ModelConfig) -> Params:
    """The base tree with every adapted kernel replaced by W + (alpha / r) A B (W's dtype;
    a quantized base's kernels dequantized): a plain model of `cfg.without_lora()` with
    `base_quant="none"` (what a merged export writes)."""
    base, _ = split(params)
    out = jax.tree.map(lambda x: x, base)  # new dicts, same arrays
    for group, proj in quant.PROJECTIONS:
        p = params["layers"][group][proj]
        if "lora_a" in p or "kernel_scale" in p:
            q = out["layers"][group][proj]
            q["kernel"] = transformer.merged_kernel(p, cfg)
            q.pop("kernel_scale", None)
    return out


def count(tree: Params) -> int:
    """Number of scalars in a tree (parameter counts in tests, logs and the planner)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
