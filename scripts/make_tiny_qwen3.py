"""Writes tests/data/tiny_qwen3: a tiny Qwen3-shaped HF checkpoint with random weights.

    python scripts/make_tiny_qwen3.py [--out tests/data/tiny_qwen3]

Qwen3's shape where it differs from Qwen2's: per-head q/k RMSNorm, head_dim (32) independent
of hidden / heads (64 / 4 = 16), no q/k/v bias, untied embeddings (as Qwen3-8B; the small
Qwen3s tie them, which the parity tests cover). GQA 4 -> 2, 2 layers, the tokenizer of
gjax/assets/tiny_qwen2 (vocab 128). Weights are drawn from numpy's seeded generator (norms
1 + 0.1 N(0, 1), the rest 0.15 N(0, 1): O(1) logits with distinct argmaxes) and written by
gjax's own exporter in float32; the same bytes on every run (checked in tests/test_qwen3.py,
which also loads the files in transformers and compares logits).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from gjax.models import hf_export, hf_format
from gjax.models.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")
SEED = 3

CONFIG = ModelConfig(
    model_type="qwen3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    max_position_embeddings=256,
    eos_token_id=(1,),
    pad_token_id=0,
)


def random_params(cfg: ModelConfig, seed: int = SEED) -> dict:
    """The gjax param tree of `cfg`, leaves in sorted-path order from one seeded generator."""
    rng = np.random.default_rng(seed)
    flat = hf_format._flatten(hf_format.param_shapes(cfg))
    leaves = {}
    for path in sorted(flat):
        noise = rng.standard_normal(flat[path]).astype(np.float32)
        leaves[path] = 1.0 + 0.1 * noise if path[-1] == "scale" else 0.15 * noise
    tree: dict = {}
    for path, value in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def write(out: str) -> None:
    hf_export.save_pretrained(random_params(CONFIG), CONFIG, out, tokenizer=TOKENIZER)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "tiny_qwen3"))
    write(ap.parse_args().out)


if __name__ == "__main__":
    main()
