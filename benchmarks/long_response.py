"""A long-response GRPO run end to end on the CPU (issue 34 item 4): rows up to
`--max_new_tokens` (8192) decoded by the continuous decoder on paged KV, packed, trained with
the update's token axis split over `--seq` devices (ring attention), then resumed from the
checkpoint of its first step.

    python benchmarks/long_response.py                  # 8192 new tokens (see below)
    python benchmarks/long_response.py --tiny           # 256 new tokens (CI)

The policy is a random-weight Qwen2 shape (`--hidden`, `--layers`; the embedded character
tokenizer) written to a temp dir, with max_position_embeddings = the prompt budget plus
`--max_new_tokens`, whose EOS logit is held under the others so that lengths are long-tailed:
its (untied) head column is 0 (logit 0) and the others' logits have standard deviation sigma,
chosen so that the EOS probability per token is about 1.5 / max_new_tokens (geometric lengths,
about e^-1.5 = 22 % of rows cut at the cap, a mean of (1 - e^-1.5) / 1.5 = 0.52 of it: a
rollout of 8 rows reaches the cap 6 times in 7; 3 / max_new_tokens gave rows of mean 1018,
max 4142 of 8192). The reward is a length-bounded one registered here
(`long_length_<N>`: the completion's length over max_new_tokens, in [0, 1]): it varies within a
group, so the advantages and the gradients are not zero.

Measured (2026-12-03, the 2-core CPU, two study workers beside it): the whole 8192-token run
took 47.6 min; per step 8 rows of mean 4146 / 3838 tokens, one of 8 at the cap each step, 8192
decode steps (537 / 552 s of rollout), packed into 5 / 4 bins of the 8216-token row (fill 0.51
/ 0.94), grad norm 1.03 / 1.40; step 2 resumed from step 1's checkpoint.

Prints one JSON line: the lengths decoded (max, mean, rows at the cap), the packed bins
(`pack/*`), the step times, and whether the second run resumed from step 1 and went on to
step 2. Everything is a real `gjax.train.train` call on the production path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# 8 CPU devices (data x seq), set before jax is imported; a user's own XLA_FLAGS win.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

PROMPT_LEN = 24  # the embedded task's prompt budget (configs/common.py `tiny`)


def eos_sigma(z_DxV, eos: int, max_new_tokens: int, rate: float = 1.5, draws: int = 512) -> float:
    """The scale sigma of the head `sigma / sqrt(D) * z_DxV` (z standard normal, EOS's column
    0) that puts the EOS probability at `rate` / max_new_tokens on average over final hidden
    states h with |h|^2 = D in random directions (the final norm's output): the logits are
    then sigma * x with x = z^T h / sqrt(D) ~ N(0, 1) per token. Solved by bisection on
    a Monte Carlo mean, not from the lognormal mean sum_i exp(l_i) ~ (V - 1) exp(sigma^2 / 2):
    at sigma ~2.5 that sum's typical value is well under its mean (its tail carries it), so
    the formula overshoots the EOS rate (at 8192 tokens it gave rows of mean 1404, max 3328)."""
    import numpy as np

    d_, _ = z_DxV.shape
    u = np.random.default_rng(1).normal(size=(draws, d_))
    x_NxV = (u / np.linalg.norm(u, axis=1, keepdims=True)) @ z_DxV  # z^T h / sqrt(D)
    x_NxV = np.delete(x_NxV, eos, axis=1)
    target = rate / max_new_tokens

    def p_eos(sigma):  # 1 / (1 + sum_i exp(sigma x_i)): EOS's logit is 0
        return float(np.mean(1.0 / (1.0 + np.exp(sigma * x_NxV).sum(1))))

    lo, hi = 0.0, 20.0
    if p_eos(lo) <= target:  # V is large against max_new_tokens: no spread needed
        return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if p_eos(mid) > target else (lo, mid)
    return 0.5 * (lo + hi)


def write_policy(out: str, *, hidden: int, layers: int, max_new_tokens: int) -> dict:
    """The random-weight policy (see the module docstring); returns its settings."""
    import jax
    import numpy as np

    from gjax.data.tokenizer import build_tokenizer
    from gjax.models import hf_export
    from gjax.models.config import ModelConfig
    from gjax.models.transformer import init_params

    tok = build_tokenizer()
    heads = max(1, hidden // 16)
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        rope_theta=1_000_000.0,  # long-context RoPE base, as Qwen2.5's
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=True,
        max_position_embeddings=PROMPT_LEN + max_new_tokens,
        bos_token_id=None,
        eos_token_id=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
    )
    params = init_params(cfg, jax.random.key(0))
    # The final norm's output has |h|^2 ~ hidden, so head columns of
    # N(0, (sigma / sqrt(hidden))^2) give logits of standard deviation sigma; EOS's column 0
    # gives it logit 0. The head is untied: a tied one scores a token's own embedding at
    # ~sigma * sqrt(hidden), so the policy repeats its input and never draws the EOS.
    z_DxV = np.random.default_rng(0).normal(size=(hidden, cfg.vocab_size))
    z_DxV[:, tok.eos_token_id] = 0.0
    sigma = eos_sigma(z_DxV, tok.eos_token_id, max_new_tokens)
    head_DxV = z_DxV * (sigma / math.sqrt(hidden))
    params["lm_head"]["kernel"] = jax.numpy.asarray(head_DxV, jax.numpy.float32)
    hf_export.save_pretrained(params, cfg, out, tokenizer=tok)
    return {"hidden": hidden, "layers": layers, "sigma": round(sigma, 3)}


def register_reward(max_new_tokens: int) -> str:
    """`long_length_<N>`: a completion's length over N, in [0, 1] (a reward function's
    configuration is its name here: `reward.functions` lists names)."""
    from gjax.rewards.functions import REWARDS

    name = f"long_length_{max_new_tokens}"
    if name not in REWARDS:

        @REWARDS.register(name)
        def long_length(prompts, completions, answers, *, completion_lengths, **metadata):
            return [min(1.0, float(n) / max_new_tokens) for n in completion_lengths]

    return name


def config(policy: str, args):
    from configs import grpo

    c = grpo.get_config("tiny")
    c.model.path = policy
    c.model.remat = "full"
    c.rollout.max_new_tokens = args.max_new_tokens
    c.rollout.temperature = 1.0
    c.rollout.prompts_per_step = 2
    c.rollout.num_samples = 4
    c.rollout.kv_page_size = args.page
    # one slot per row: every slot runs each decode step, live or not (64 slots, the default,
    # made a step 8x the work on this CPU)
    c.rollout.decode_slots = c.rollout.prompts_per_step * c.rollout.num_samples
    c.reward.functions = register_reward(args.max_new_tokens)
    c.mesh.data, c.mesh.seq = -1, args.seq
    c.train.steps = 1
    c.checkpoint.every = 1
    c.checkpoint.async_save = False
    c.data.heldout_size = 1
    c.eval.num_samples = 0  # one held-out row only: random weights, nothing to measure there
    # sampled, not greedy: greedy never draws the EOS held under every other logit, so each
    # evaluation would decode max_new_tokens (8192 steps, before and after training)
    c.eval.greedy_temperature = 1.0
    c.log.progress = c.log.tensorboard = False
    return c


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max_new_tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2, help="mesh.seq of the update")
    p.add_argument("--page", type=int, default=256, help="rollout.kv_page_size")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="256 new tokens, pages of 32 (CI)")
    p.add_argument("--workdir", default="", help="where the run goes (default: a temp dir)")
    args = p.parse_args(argv)
    if args.tiny:
        args.max_new_tokens, args.page = 256, 32

    from gjax.metrics import read_jsonl
    from gjax.train import train

    with tempfile.TemporaryDirectory() as tmp:
        policy = os.path.join(tmp, "policy")
        shape = write_policy(
            policy, hidden=args.hidden, layers=args.layers, max_new_tokens=args.max_new_tokens
        )
        workdir = args.workdir or os.path.join(tmp, "run")
        c = config(policy, args)
        with contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON line only
            train(c, workdir)  # step 1, checkpointed
            c.train.steps = 2
            train(c, workdir)  # resumes from step 1, trains step 2
        rows = list(read_jsonl(os.path.join(workdir, "metrics.jsonl")))
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    steps = [r["step"] for r in rows]
    out = {
        "benchmark": "long_response",
        "max_new_tokens": args.max_new_tokens,
        "seq": args.seq,
        "kv_page_size": args.page,
        **shape,
        "steps": steps,
        "resumed": steps == [1, 2] and summary.get("steps") == 2,
        "length_max": max(r["response/length_max"] for r in rows),
        "length_mean": sum(r["response/length_mean"] for r in rows) / len(rows),
        "clipped_frac": sum(r["response/clipped_frac"] for r in rows) / len(rows),
        "pack": {k: [r[k] for r in rows] for k in sorted(rows[0]) if k.startswith("pack/")},
        "grad_norm": [r["optim/grad_norm"] for r in rows],
        "step_s": [round(r["time/step_s"], 2) for r in rows],
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
