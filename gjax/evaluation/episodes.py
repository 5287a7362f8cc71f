"""Held-out evaluation over episodes: a multi-turn run's held-out problems as episodes of its
environment (config.env), greedy and sampled, scored and reported as single completions are.

`EpisodeSampler` is a `gjax.evaluation.heldout.HeldoutSampler`: `heldout_metrics` asks it
for n scored samples per problem, and each sample is one episode on the continuous decoder
(`LocalSampler.generate_episodes`, KV kept across turns, gjax.rollout.turns), with the run's
limits (env.max_turns, env.turn_tokens, the trajectory's rollout.max_new_tokens) and the
environment's own (env.max_tool_calls, ...). The batching is `sample_and_score`'s
(`sampling.BatchPlan`): the same prompts, rows and keys, so an episode's first turn is drawn
exactly as the single completion it replaces.

An episode is correct when the environment ended it (its last step was `done`) and the run's
verifier accepts the episode's final policy turn (the turn that step scored) against the
problem's answer. Why this rule and not the episode's reward: the environments score that
same turn with the run's reward, whose accuracy term is this verifier, but a reward may add
shaping (a format bonus, a length penalty, per-turn rewards, env.discount) that is not
correctness; pass@k needs a yes or no, and this one is the single-turn evaluation's own, so on
the one-step `math` environment every figure equals the single-turn evaluation's exactly
(tests/test_eval_episodes.py). An episode the decoder cut before the environment ended it
(no room left for the next observation, a turn past env.turn_tokens that called a tool) gave
no final answer: it counts as wrong.

Figures per call (`figures`, prefixed by `heldout_metrics`): `turns_mean` (policy turns per
episode), `tool_calls_mean` and `tool_errors_mean` (per episode, from the steps' own counts),
`truncated_frac` (episodes a limit ended: the decoder's or the environment's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gjax.data.prompts import PromptData
from gjax.evaluation.heldout import HeldoutSampler, SingleTurn
from gjax.evaluation.metrics import Samples
from gjax.evaluation.sampling import Transfer, close_bar, plan_batches, progress_bar, score_texts
from gjax.rollout.sampler import SamplingParams
from gjax.rollout.turns import EnvTurns, build_turns

FIGURES = ("turns_mean", "tool_calls_mean", "tool_errors_mean", "truncated_frac")
MakeTurns = Callable[[Sequence[Mapping[str, Any]]], EnvTurns]  # data rows -> a batch's turns


@dataclasses.dataclass
class EpisodeSamples(Samples):
    """`Samples` whose samples are episodes: `texts` are the final policy turns (what was
    scored), `lengths_PxN` every token after the prompt (the policy's and the environment's),
    `truncated_PxN` a limit ended the episode; plus per-episode counts."""

    turns_PxN: np.ndarray | None = None  # int32 policy turns
    tool_calls_PxN: np.ndarray | None = None  # float32 tool calls run
    tool_errors_PxN: np.ndarray | None = None  # float32 tool errors (every kind)


class EpisodeSampler:
    """A `HeldoutSampler` drawing episodes: `make_turns(rows)` gives a batch's `EnvTurns`
    (one data row per prompt of the batch)."""

    def __init__(self, make_turns: MakeTurns):
        self.make_turns = make_turns

    def sample(self, backend, params, tokenizer, data, verifier, **kwargs) -> EpisodeSamples:
        return sample_episodes(
            backend, params, tokenizer, data, verifier, make_turns=self.make_turns, **kwargs
        )

    def figures(self, samples: EpisodeSamples) -> dict[str, float]:
        """`FIGURES` of the samples' episodes (the module docstring)."""
        per_episode = (
            samples.turns_PxN,
            samples.tool_calls_PxN,
            samples.tool_errors_PxN,
            samples.truncated_PxN,
        )
        return {k: float(np.mean(x)) for k, x in zip(FIGURES, per_episode, strict=True)}


def heldout_sampler(config, rollout, tokenizer) -> HeldoutSampler:
    """The held-out sampler of a training run: single completions (env.name = ''), else
    episodes of the run's environment on its rollout's runner (`EpisodeRollout.runner`: the
    same environment, tools and worker pools as training's episodes)."""
    if not config.env.name:
        return SingleTurn()
    runner = rollout.runner
    return EpisodeSampler(lambda rows: build_turns(config, runner, rows, tokenizer))


def sample_episodes(
    backend,
    params,
    tokenizer,
    data: PromptData,
    verifier,
    *,
    make_turns: MakeTurns,
    num_samples: int,
    sampling: SamplingParams,
    rng: jax.Array,
    max_rows: int = 256,
    batch_shape: tuple[int, int] | None = None,
    width: int | None = None,
    progress: bool | str = False,
    transfer: Transfer | None = None,
) -> EpisodeSamples:
    """`num_samples` episodes of every problem of `data`, scored (the module docstring): the
    batching, keys and progress bar of `sample_and_score`, each call
    `backend.generate_episodes` (the local backend's continuous decoder). `transfer`: several
    processes (every process holds every batch, as `sample_and_score`'s): each process runs
    the episodes of its block of the batch's prompts on its own devices with the whole
    batch's row keys (its rows equal one process's), then every process gathers every row."""
    put = transfer.put_full if transfer is not None else (lambda x: x)
    gather = transfer.gather_rows if transfer is not None else np.asarray
    n_problems, n = len(data), num_samples
    plan = plan_batches(data, n, max_rows=max_rows, batch_shape=batch_shape, width=width)
    g = plan.g
    mine = transfer.block_of(plan.p) if transfer is not None else slice(None)
    finals: list[list[np.ndarray]] = [[] for _ in range(n_problems)]
    shape = (n_problems, plan.samples)
    lengths, turns = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    truncated, done = np.zeros(shape, bool), np.zeros(shape, bool)
    calls, errors = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    bar = progress_bar(progress, n_problems * n)
    for rows, ids_PxS, mask_PxS, call, key in plan.batches(data, rng):
        padded = rows + [rows[-1]] * (plan.p - len(rows))
        episode_rows = [
            {"problem": data.problems[r], "answer": data.answers[r], "prompt": data.prompts[r]}
            for r in padded[mine]
        ]
        bound = make_turns(episode_rows)  # this process's block of the batch
        traj = backend.generate_episodes(
            params, put(ids_PxS), put(mask_PxS), key, num_samples=g, sampling=sampling, turns=bound
        )
        per_row = {  # every process's rows, in batch order
            "tokens": traj.tokens_BxN,
            "policy": traj.policy_mask_BxN,
            "lengths": traj.lengths_B,
            "turns": traj.turns_B,
            "truncated": traj.truncated_B,
            "done": bound.done_B,
            "calls": np.asarray([m["tools/calls"] for m in bound.row_metrics], np.float32),
            "errors": np.asarray([m["tools/errors"] for m in bound.row_metrics], np.float32),
        }
        b = {k: np.asarray(gather(np.asarray(v))) for k, v in per_row.items()}
        for j, r in enumerate(rows):
            cols = slice(call * g, (call + 1) * g)
            rows_g = slice(j * g, (j + 1) * g)
            finals[r].extend(
                final_turn(b["tokens"][i], b["policy"][i], b["lengths"][i])
                for i in range(j * g, (j + 1) * g)
            )
            lengths[r, cols] = b["lengths"][rows_g]
            turns[r, cols] = b["turns"][rows_g]
            truncated[r, cols] = b["truncated"][rows_g]
            done[r, cols] = b["done"][rows_g]
            calls[r, cols] = b["calls"][rows_g]
            errors[r, cols] = b["errors"][rows_g]
        if bar is not None:
            bar.update(len(rows) * min(g, n - call * g))
    close_bar(bar)
    flat = [ids for row in finals for ids in row[:n]]
    decoded = tokenizer.batch_decode(flat, skip_special_tokens=True) if flat else []
    texts = [decoded[i * n : (i + 1) * n] for i in range(n_problems)]
    correct, keys = score_texts(texts, data, verifier)
    done = done[:, :n]
    return EpisodeSamples(
        texts=texts,
        correct_PxN=np.where(done, correct, 0.0).astype(np.float32),
        lengths_PxN=lengths[:, :n],
        truncated_PxN=truncated[:, :n],
        keys=[[k if d else None for k, d in zip(ks, ds)] for ks, ds in zip(keys, done)],
        turns_PxN=turns[:, :n],
        tool_calls_PxN=calls[:, :n],
        tool_errors_PxN=errors[:, :n],
    )


def final_turn(tokens_N: np.ndarray, policy_mask_N: np.ndarray, length: int) -> np.ndarray:
    """The ids of a trajectory's last policy turn: its last run of policy tokens (every one
    of them for a one-turn episode: the whole completion). Empty if it has none."""
    policy = np.asarray(policy_mask_N[:length], bool)
    idx = np.flatnonzero(policy)
    if not idx.size:
        return tokens_N[:0]
    last = int(idx[-1])
    before = np.flatnonzero(~policy[: last + 1])
    start = int(before[-1]) + 1 if before.size else 0
    return tokens_N[start : last + 1]
