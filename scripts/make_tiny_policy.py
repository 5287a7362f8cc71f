"""Builds the embedded default policy: a tiny Qwen2 warmed up on the synthetic task.

    python scripts/make_tiny_policy.py [--out gjax/assets/tiny_qwen2] [--steps 1000]

Everything is made here, with gjax itself, from --seed: the character tokenizer
(gjax.data.tokenizer), a small Qwen2 (tied embeddings, GQA, q/k/v bias), and a supervised
warm-up (prompt tokens masked out; loss from gjax's chunked log-prob kernel). The result is
written in Hugging Face format (safetensors + config + tokenizer). Float summation order is
part of the result: after a change to the model's matmul layout, a rerun's loss differs
from step 50 on and ends at another (similar) policy (docs/embedded_policy.md).

The warm-up corpus mixes two styles, as web text does: half of the targets are the worked
demonstration (step lines, then the boxed answer), half the bare boxed answer. The policy
learns both and picks between them at its first token, about evenly. Worked answers are
right far more often (measured on the committed policy, T = 0.7: 68% vs 33%), so the room
left for RL is a behaviour it can discover from its own samples -- work the problem out --
rather than knowledge it lacks. `warmup.json` logs greedy held-out accuracy and the share
of worked answers along the way, on this script's own held-out sample: the first 256 test
problems of seed `--seed` + 2. `gjax.train` evaluates the first `data.heldout_size` test
problems of `data.synthetic_seed` (0) instead, so the two figures differ for the same weights
(committed policy: 0.527 here, 0.512 there; docs/embedded_policy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs.common import EMBEDDED_TASK  # noqa: E402
from gjax.data import synthetic  # noqa: E402
from gjax.data.prompts import left_pad  # noqa: E402
from gjax.data.templates import apply_template  # noqa: E402
from gjax.data.tokenizer import build_tokenizer  # noqa: E402
from gjax.models import hf_export  # noqa: E402
from gjax.models.config import ModelConfig  # noqa: E402
from gjax.models.transformer import forward, init_params, lm_head_kernel  # noqa: E402
from gjax.objective.logprobs import token_logps_BxT  # noqa: E402
from gjax.rollout.sampler import SamplingParams, generate  # noqa: E402

PROMPT_LEN, COMPLETION_LEN = 32, 48


def model_config(tok) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        vocab_size=128,  # 102 tokens, padded for tidy shapes
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
    )


def bare_answer(problem) -> str:
    return f"{synthetic.BOXED}{problem.answer}}}"


def encode(tok, problems, bare=None):
    """Left-padded prompts and right-padded targets; ``bare[i]``: target is the bare answer."""
    bare = np.zeros(len(problems), bool) if bare is None else bare
    prompts = [
        tok(apply_template("plain", p.problem), add_special_tokens=False)["input_ids"]
        for p in problems
    ]
    comps = [
        tok(bare_answer(p) if b else p.demonstration, add_special_tokens=False)["input_ids"]
        + [tok.eos_token_id]
        for p, b in zip(problems, bare)
    ]
    p_ids, p_mask = left_pad([np.asarray(x) for x in prompts], PROMPT_LEN, tok.pad_token_id)
    c_ids = np.full((len(comps), COMPLETION_LEN), tok.pad_token_id, np.int32)
    c_mask = np.zeros((len(comps), COMPLETION_LEN), bool)
    for i, c in enumerate(comps):
        c = c[:COMPLETION_LEN]
        c_ids[i, : len(c)] = c
        c_mask[i, : len(c)] = True
    ids = np.concatenate([p_ids, c_ids], 1)
    mask = np.concatenate([p_mask.astype(bool), c_mask], 1)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    seg = np.concatenate([p_mask, np.ones_like(c_mask)], 1).astype(np.int32)
    return dict(ids=ids, pos=pos, seg=seg, targets=c_ids, tmask=c_mask), (p_ids, p_mask)


def sft_loss(params, cfg, b):
    """Mean NLL of the completion's tokens under `b["tmask"]` (the completion is the last
    `b["targets"].shape[1]` columns of `b["ids"]`)."""
    hidden = forward(params, cfg, b["ids"], b["pos"], b["seg"])
    s, c = hidden.shape[1], b["targets"].shape[1]
    hidden = hidden[:, s - c - 1 : s - 1]
    logps, _ = token_logps_BxT(
        hidden, lm_head_kernel(params, cfg), b["targets"], with_entropy=False
    )
    m = b["tmask"].astype(jnp.float32)
    return -(logps * m).sum() / m.sum()


def sft_step(cfg, lr: float, steps: int):
    """(the warm-up's AdamW, its jitted step (params, opt, batch) -> (params, opt, loss)):
    a 20-step warmup to `lr`, cosine decay over `steps`."""
    tx = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, lr, 20, steps), 0.9, 0.98, weight_decay=0.01
    )

    @jax.jit
    def step(params, opt, b):
        loss, g = jax.value_and_grad(sft_loss)(params, cfg, b)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss

    return tx, step


def evaluate(params, cfg, tok, problems) -> dict:
    """Greedy held-out accuracy, and the share of answers given with worked steps."""
    _, (p_ids, p_mask) = encode(tok, problems)
    sp = SamplingParams(
        max_new_tokens=COMPLETION_LEN,
        temperature=0.0,
        stop_token_ids=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
    )
    out = generate(params, cfg, p_ids, p_mask, jax.random.key(0), num_samples=1, sampling=sp)
    ids, n = np.asarray(out.tokens_BxN), np.asarray(out.lengths_B)
    texts = tok.batch_decode([r[:k] for r, k in zip(ids, n)], skip_special_tokens=True)
    correct = [synthetic.extract_boxed(t) == p.answer for t, p in zip(texts, problems)]
    worked = [not t.startswith(synthetic.BOXED) for t in texts]
    return {"heldout_accuracy": float(np.mean(correct)), "worked_fraction": float(np.mean(worked))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join("gjax", "assets", "tiny_qwen2"))
    ap.add_argument("--steps", type=int, default=1000, help="length of the lr schedule")
    ap.add_argument(
        "--bare_fraction",
        type=float,
        default=0.5,
        help="share of warm-up targets that are the bare boxed answer instead of the worked "
        "demonstration",
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval_every", type=int, default=50)
    args = ap.parse_args()

    tok = build_tokenizer()
    cfg = model_config(tok)
    params = init_params(cfg, jax.random.key(args.seed))
    task = synthetic.SyntheticConfig(**EMBEDDED_TASK)
    train = synthetic.generate(args.steps * args.batch, "train", seed=args.seed + 1, config=task)
    heldout = synthetic.generate(256, "test", seed=args.seed + 2, config=task)
    tx, step = sft_step(cfg, args.lr, args.steps)
    opt = tx.init(params)
    bare = np.random.default_rng(args.seed + 3).random(len(train)) < args.bare_fraction

    t0 = time.time()
    log = []
    for i in range(args.steps):
        rows = slice(i * args.batch, (i + 1) * args.batch)
        b, _ = encode(tok, train[rows], bare[rows])
        params, opt, loss = step(params, opt, b)
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            log.append({"step": i + 1, "loss": float(loss), **evaluate(params, cfg, tok, heldout)})
            print(json.dumps({**log[-1], "elapsed_s": round(time.time() - t0, 1)}), flush=True)
    hf_export.save_pretrained(params, cfg, args.out, tokenizer=tok)
    with open(os.path.join(args.out, "warmup.json"), "w") as f:
        json.dump({"args": vars(args), "log": log}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
