"""Multi-turn episodes on a JetStream backend: each turn one request, the history resent.

A JetStream server keeps nothing of a request once it has answered, so a policy turn is one
request whose prompt is the row's whole history: its prompt, then every token after it so
far, the policy's as sampled and the environment's as inserted, sent as token ids
(`DecodeRequest.token_content`: token-exact, nothing decoded and re-tokenized), with
`max_tokens` what the turn may still add (`EnvTurns.turn_limit`). The turns go out in
waves: every live row's next turn in one `generate` call of the single-turn client (its
retries, deadline and dropped-request accounting), then each ended turn's environment step
on the run's `EnvRunner` (`EnvTurns.end_turn` / `answers`, as the continuous decoder drives
them), then the next wave with the rows whose episodes go on. The rows' results are the
decoder's: `gjax.rollout.turns.Trajectories`, the limits and the env/ figures of `EnvTurns`.

What differs from the local continuous decoder (`ContinuousDecoder.generate_episodes`, KV kept
across turns): every turn's request carries the whole history, every row its own prompt:
`env/prefill_tokens_per_episode_sent` counts the tokens sent, beside the decoder's `_kept`
and `_reprefill` figures (what the server computes can be less: the in-process engine
reuses one prefill for consecutive identical prompts, the first wave's rows of a group);
environment steps overlap each other but not decoding (a wave waits for its slowest step:
`env/wait_s` is all of `env/step_s` less the steps' own overlap); the server samples with
its own keys (no row keys: a rerun draws other episodes). A request the client dropped (its
retries spent) ends its episode unscored: the row is invalid (`EnvTurns.fail`), as a dropped
single completion is; a wave with every request dropped stops the run (`ServingFailed`).

Several processes (jax.distributed, `jetstream_grpc`): each process's client plays the episodes
of its own rows, as it sends its own single completions (the client's `generate_episodes` takes
this process's block of the global prompts), with its own environment runner; the step's env/
figures are pooled by `gjax.rollout.episodes` (tests/test_multihost_jetstream.py).

Sizes: a turn's prompt can be as long as prompt + trajectory, so the server's prefill bucket
must hold `data.max_prompt_len + rollout.max_new_tokens` (`gjax.rollout.buckets.served_prompt_len`:
the in-process engine and `gjax.serve` size themselves with it; the client refuses a longer
history with `PromptTooLong`).
"""

from __future__ import annotations

import collections
import time

import numpy as np

from gjax.data.prompts import left_pad
from gjax.rollout.collect import ServingFailed
from gjax.rollout.sampler import SamplingParams
from gjax.rollout.turns import EnvTurns, Trajectories


def generate_episodes(
    client,
    params,
    prompt_tokens_PxS,
    prompt_mask_PxS,
    *,
    num_samples: int,
    sampling: SamplingParams,
    turns: EnvTurns,
) -> tuple[Trajectories, dict[str, float]]:
    """(trajectories of P * G episodes, the batch's stats) on `client` (a
    `gjax.rollout.jetstream_backend` client); host prompts. The stats: `turns.stats()`, the
    environment wait and the prefill tokens sent (the step's env/ figures), and the waves'
    counts (`episode_*`: requests, dropped, waves; for benchmarks and tests, not logged). A
    wave whose every request failed raises `ServingFailed` (the run stops, as a single-turn
    rollout's does); some dropped: those rows are invalid, the others go on."""
    tokens_PxS = np.asarray(prompt_tokens_PxS)
    mask_PxS = np.asarray(prompt_mask_PxS).astype(bool)
    g_, n_, pad = num_samples, sampling.max_new_tokens, sampling.pad_token_id
    b_ = tokens_PxS.shape[0] * g_
    prompts = [t[m].astype(np.int32) for t, m in zip(tokens_PxS, mask_PxS)]
    turns.bind(mask_PxS, g_, sampling)
    tok_BxN = np.full((b_, n_), pad, np.int32)
    logp_BxN = np.zeros((b_, n_), np.float32)
    policy_BxN = np.zeros((b_, n_), np.int32)
    len_B = np.zeros((b_,), np.int32)
    limit_B = turns.first_limits(np.full((b_,), n_, np.int32))
    stats: collections.Counter = collections.Counter()
    live = list(range(b_))
    while live:
        histories = [np.concatenate([prompts[b // g_], tok_BxN[b, : len_B[b]]]) for b in live]
        hist_LxW, mask_LxW = left_pad(histories, max(len(h) for h in histories), pad)
        out = client.generate(
            params,
            hist_LxW,
            mask_LxW,
            None,  # the server samples with its own keys
            num_samples=1,
            sampling=sampling,
            max_tokens_B=limit_B[live] - len_B[live],
        )
        stats["waves"] += 1
        stats["requests"] += len(live)
        stats["prefill_tokens_sent"] += int(mask_LxW.sum())
        valid_L = np.ones(len(live), bool) if out.valid_B is None else np.asarray(out.valid_B)
        if not valid_L.any():  # the server is not answering: nothing to learn from
            raise ServingFailed(
                f"every request of turn wave {stats['waves']} ({len(live)} requests) failed "
                f"({client.failure()}), so the run stopped before training on episodes the "
                "server did not play."
            )
        ended = []
        for i, b in enumerate(live):
            if not valid_L[i]:
                turns.fail(b)
                stats["requests_dropped"] += 1
                continue
            k, n = int(out.lengths_B[i]), int(len_B[b])
            tok_BxN[b, n : n + k] = np.asarray(out.tokens_BxN[i, :k])
            logp_BxN[b, n : n + k] = np.asarray(out.logps_BxN[i, :k])
            policy_BxN[b, n : n + k] = 1
            len_B[b] = n + k
            turns.end_turn(b, tok_BxN[b, n : n + k])
            ended.append(b)
        live = sorted(_next_turns(turns, set(ended), tok_BxN, len_B, limit_B, stats))
    mask_BxN = (np.arange(n_)[None, :] < len_B[:, None]).astype(np.int32)
    traj = turns.trajectories(tok_BxN, mask_BxN, policy_BxN, logp_BxN, len_B)
    episodes = max(b_, 1)
    figures = {
        **turns.stats(),
        "env_wait_s": stats["env_wait_s"],
        "env/prefill_tokens_per_episode_sent": stats["prefill_tokens_sent"] / episodes,
        "episode_waves": float(stats["waves"]),
        "episode_requests": float(stats["requests"]),
        "episode_requests_dropped": float(stats["requests_dropped"]),
    }
    return traj, figures


def _next_turns(turns: EnvTurns, waiting: set, tok_BxN, len_B, limit_B, stats) -> list[int]:
    """Waits for every ended turn's environment step; the rows whose episode goes on, with
    the observation's ids appended and the next turn's limit set."""
    going_on = []
    while waiting:
        t0 = time.perf_counter()
        answered = turns.answers(len_B, block=True)
        stats["env_wait_s"] += time.perf_counter() - t0
        for b, ids in answered:
            waiting.discard(b)
            if ids is None:  # the episode ended (done, or a limit)
                continue
            n, m = int(len_B[b]), len(ids)
            tok_BxN[b, n : n + m] = ids
            len_B[b] = n + m
            limit_B[b] = turns.turn_limit(n + m)
            going_on.append(b)
    return going_on
