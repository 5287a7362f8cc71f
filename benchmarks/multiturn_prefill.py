"""Prefill tokens per multi-turn episode: the continuous decoder's re-entry (KV kept) vs
prefilling each turn's whole history again.

Workload: P prompts x G samples of a random model; every episode runs `--turns` policy turns
(a turn ends at one of `--stops` stop ids, sampled at temperature 1, or at `--turn-tokens`),
each followed by an observation of `--obs-tokens` ids, then one last turn that the
environment scores and ends. Counted, not timed (the counts carry over to any machine):
  kept       the prompt once per group (its G rows share its KV) + every inserted
             observation token: what `ContinuousDecoder.generate_episodes` prefills;
  reprefill  the same prompt, then at each re-entry the row's whole history (prompt, turns,
             observations): what a server that resends the history prefills.
Also reported: turns per episode, the rows' truncations, the decoder's wall time (after a
warm-up batch: compiling left out) and the time it waited on the environment with no slot
decoding (the environment's steps otherwise overlap decoding).

`--jetstream`: the same episodes also on the in-process JetStream engine
(`gjax.rollout.jetstream_episodes`: each turn one request with the history resent, every row
its own prompt), whose prefill is measured, not counted: `jetstream_prefill_tokens_per_episode`
(the requests' prompt tokens), its wall time beside the decoder's and the ratios (both after
a warm-up batch: the walls leave compiling out).

    python benchmarks/multiturn_prefill.py                      # ~20 s on a 2-core CPU
    python benchmarks/multiturn_prefill.py --jetstream

Prints one JSON line (the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gjax.envs import EnvRunner, Step
from gjax.models import transformer as tr
from gjax.models.config import ModelConfig
from gjax.rollout import SamplingParams
from gjax.rollout.decoder import ContinuousDecoder
from gjax.rollout.turns import EnvTurns


class FixedTurnsEnv:
    """Every episode: `turns` observations of `obs_tokens` ids, then done (reward 1)."""

    name = "fixed_turns"

    def __init__(self, turns: int, obs_tokens: int, vocab: int, stops):
        self.turns = turns
        pool = [i for i in range(vocab) if i not in stops]
        self.obs = " ".join(str(pool[i % len(pool)]) for i in range(obs_tokens))

    def system_prompt(self):
        return ""

    def start(self, row):
        env = self

        class Episode:
            n = 0

            async def step(self, text, *, length=None):
                self.n += 1
                if self.n <= env.turns:
                    return Step(env.obs, None, False)
                return Step("", 1.0, True)

        return Episode()

    def stats(self):
        return {}

    def close(self):
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3, help="observations per episode")
    ap.add_argument("--obs-tokens", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--stops", type=int, default=3, help="stop ids (of 61): ~20 tokens a turn")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--jetstream", action="store_true", help="also on the JetStream engine")
    args = ap.parse_args(argv)

    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
    )
    params = tr.init_params(cfg, jax.random.key(0))
    stops = tuple(range(1, 1 + args.stops))
    n_ = (args.turns + 1) * (args.turn_tokens + args.obs_tokens)
    sp = SamplingParams(max_new_tokens=n_, temperature=1.0, stop_token_ids=stops, pad_token_id=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, cfg.vocab_size, (args.prompts, args.prompt_tokens)).astype(np.int32)
    mask = np.ones_like(tokens)
    env = FixedTurnsEnv(args.turns, args.obs_tokens, cfg.vocab_size, stops)
    dec = ContinuousDecoder(cfg, slots=args.slots, tokens_per_dispatch=8)
    rows = [{"problem": str(i), "answer": ""} for i in range(args.prompts)]

    def make_turns(runner):
        return EnvTurns(
            runner,
            rows,
            encode=lambda t: [int(w) for w in t.split()],
            decode=lambda ids: " ".join(map(str, ids)),
            max_turns=args.turns + 1,
            turn_tokens=args.turn_tokens,
        )

    for _ in range(2):  # warm-up (the decoder's programs compile), then measured
        with EnvRunner(env, max_in_flight=64) as runner:
            t0 = time.perf_counter()
            out = dec.generate_episodes(
                params,
                tokens,
                mask,
                jax.random.key(1),
                num_samples=args.samples,
                sampling=sp,
                turns=make_turns(runner),
            )
            wall = time.perf_counter() - t0
    served = (
        _on_jetstream(cfg, params, tokens, mask, sp, env, make_turns, args)
        if args.jetstream
        else {}
    )
    st = dec.stats
    kept = st["env/prefill_tokens_per_episode_kept"]
    again = st["env/prefill_tokens_per_episode_reprefill"]
    print(
        json.dumps(
            {
                "episodes": len(out.lengths_B),
                "turns_per_episode": float(out.turns_B.mean()),
                "truncated": {k: out.limit_B.count(k) for k in set(out.limit_B) if k},
                "trajectory_tokens_mean": float(out.lengths_B.mean()),
                "policy_tokens_mean": float(out.policy_mask_BxN.sum(1).mean()),
                "prefill_tokens_per_episode_kept": kept,
                "prefill_tokens_per_episode_reprefill": again,
                "reprefill_over_kept": again / kept,
                "wall_s": wall,
                "env_wait_s": st.get("env_wait_s", 0.0),
                "reenter_calls": st.get("reenter_calls", 0),
                **served,
                **(
                    {
                        "jetstream_prefill_over_kept": served[
                            "jetstream_prefill_tokens_per_episode"
                        ]
                        / kept,
                        "jetstream_wall_over_decoder": served["jetstream_wall_s"] / wall,
                    }
                    if served
                    else {}
                ),
            }
        ),
        flush=True,
    )


def _on_jetstream(cfg, params, tokens, mask, sp, env, make_turns, args) -> dict:
    """The same episodes on the in-process JetStream engine, after one warm-up batch (its
    prefill buckets and generate compile on first use)."""
    from gjax.rollout.jetstream_backend import JetStreamBackend

    backend = JetStreamBackend(
        cfg,
        params,
        sampling=sp,
        slots=args.slots,
        max_prompt_len=tokens.shape[1] + sp.max_new_tokens,  # a turn resends its history
        tokens_per_dispatch=8,
    )
    try:
        for _ in range(2):  # warm-up, then measured
            with EnvRunner(env, max_in_flight=64) as runner:
                t0 = time.perf_counter()
                out = backend.generate_episodes(
                    params, tokens, mask, None, num_samples=args.samples, sampling=sp,
                    turns=make_turns(runner),
                )  # fmt: skip
                wall = time.perf_counter() - t0
        st = backend.episode_stats()
    finally:
        backend.close()
    return {
        "jetstream_turns_per_episode": float(out.turns_B.mean()),
        "jetstream_prefill_tokens_per_episode": st["env/prefill_tokens_per_episode_sent"],
        # its own episodes counted as the decoder's are (they sample other turns)
        "jetstream_counted_kept": st["env/prefill_tokens_per_episode_kept"],
        "jetstream_counted_reprefill": st["env/prefill_tokens_per_episode_reprefill"],
        "jetstream_requests": st["episode_requests"],
        "jetstream_waves": st["episode_waves"],
        "jetstream_wall_s": wall,
        "jetstream_env_wait_s": st["env_wait_s"],
    }


if __name__ == "__main__":
    main()
