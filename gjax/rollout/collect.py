"""The host side of a rollout: sample groups, decode them, score them, select a step's batch.

`Rollout(params, prompts, rng)` runs one round on this process's prompts:
1. the backend generates G - A completions per prompt (A = DaGRPO anchors, appended as
   demonstrations + EOS);
2. completions are decoded and handed to the reward pipeline (its own thread);
3. rewards/judge scores come back into the `Groups` (DAPO's soft overlong shaping on top);
4. metrics are computed over every process's rows.
Old log-probs in the groups are the sampler's (the behaviour policy's; 0 for anchors): every
teacher-forced pass is the learner's (`gjax.learner.Learner.batch`), in every mode.

`collect_step` repeats rounds until `select_groups` fills a step's P groups (DAPO dynamic
sampling, GPG's beta_th carry-over), all with one set of params.

With several processes each process runs all of this on its own block of prompts (the
sampler is one global program over everyone's rows; decoding and rewards stay on the host
that owns the rows); only metrics and selection counts are exchanged, through the transfer's
`allgather`. `Rollout.process_local` is the same rollout for a thread that issues no
collectives (the asynchronous producer's): each process samples its block on its own devices.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from gjax import multihost
from gjax.errors import UserError
from gjax.experience import Groups, append_anchors, select_groups
from gjax.models.config import ModelConfig
from gjax.rewards.functions import soft_overlong_penalty
from gjax.rollout.backend import RolloutBackend, rollout_sampling, stop_and_pad
from gjax.rollout.sampler import SampleOutput

# A rollout in which every request failed (all rows dropped) is tried this many more times;
# then the run stops: an update on no rows would log reward 0 and push a new version.
ALL_DROPPED_RETRIES = 2


class ServingFailed(UserError, RuntimeError):
    """Every request of a rollout failed, on every try: the serving backend is not answering."""


@dataclasses.dataclass
class RolloutResult:
    groups: Groups
    metrics: dict[str, float]


@dataclasses.dataclass
class StepBatch:
    """One step's selected groups, the version they were sampled with, and host metrics."""

    step: int
    version: int
    groups: Groups
    metrics: dict[str, float]
    data_state: dict | None = None  # the data iterator's position after this batch


def _pad_rows(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.full((len(ids), width), pad_id, np.int32)
    mask = np.zeros((len(ids), width), bool)
    for i, row in enumerate(ids):
        row = row[:width]
        out[i, : len(row)] = row
        mask[i, : len(row)] = True
    return out, mask


class Rollout:
    """Samples and scores groups for this process's prompts (see the module docstring)."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        backend: RolloutBackend,
        tokenizer,
        rewards,
        transfer: multihost.RowTransfer,
        config,
    ):
        self.backend = backend
        self.tok = tokenizer
        self.rewards = rewards  # gjax.rewards.pipeline.RewardPipeline
        self.transfer = transfer
        self.G = config.rollout.num_samples
        self.A = config.anchors.per_group
        self.T = config.rollout.max_new_tokens
        self.eos, self.pad_id = stop_and_pad(model_cfg, tokenizer)
        self.sampling = rollout_sampling(config, model_cfg, tokenizer)
        self.overlong_buffer = config.sampling.overlong_buffer
        self.overlong_penalty = config.sampling.overlong_penalty
        self.request_timeout_s = config.rollout.request_timeout_s

    def __call__(self, params, prompts, rng) -> RolloutResult:
        t0 = time.perf_counter()
        groups = self._sample(params, prompts, rng)
        t_sample = time.perf_counter() - t0
        lengths = groups.completion_mask_PxGxN.sum(2).reshape(-1)
        scored = self._score(groups, prompts, lengths).result()
        accuracy = self._apply_rewards(groups, scored, lengths)
        metrics = {
            **self._metrics(groups, accuracy, lengths),
            "time/sample_s": t_sample,
            **self.backend.metrics(self.transfer.allgather),
            # Per-batch figures only: process-lifetime counters would restart on a resume.
            **multihost.combine_metrics(
                {k: float(v) for k, v in scored.metrics.items() if k != "rewards/batches"},
                gather=self.transfer.allgather,
            ),
        }
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return RolloutResult(groups, metrics)

    def process_local(self, transfer: multihost.LocalRows) -> Rollout:
        """This rollout on `transfer`: each process samples its own block of rows on the
        devices of the params it is given, with those rows' random draws of the whole batch
        (so the rows equal the global sampler's), and exchanges only through `transfer`."""
        local = copy.copy(self)
        local.transfer = transfer
        local.sampling = dataclasses.replace(self.sampling, row_block=transfer.row_block)
        return local

    def anchors(self, demonstrations: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """DaGRPO anchors: each prompt's demonstration (+ EOS) as A completions [P, A, T]."""
        ids = [
            self.tok(d, add_special_tokens=False)["input_ids"] + [self.eos[0]]
            for d in demonstrations
        ]
        tok, mask = _pad_rows(ids, self.T, self.pad_id)
        reps = lambda x: np.repeat(x[:, None], self.A, axis=1)
        return reps(tok), reps(mask)

    def _sample(self, params, prompts, rng) -> Groups:
        """G - A completions per prompt from the backend, then the A anchors."""
        P, g_on = len(prompts), self.G - self.A
        # Several processes: each puts its block of the prompts into the global batch (or,
        # process-local, keeps it). One process: host arrays, placed by the sampler's jit on
        # the params' mesh (the rollout mesh when rollouts have devices of their own).
        put = self.transfer.sampler_rows
        agree = lambda flag: multihost.any_process(flag, gather=self.transfer.allgather)
        start, tries = time.monotonic(), 0
        while True:
            tries += 1
            out: SampleOutput = self.backend.generate(
                params,
                put(prompts.prompt_ids_PxS),
                put(prompts.prompt_mask_PxS),
                rng,
                num_samples=g_on,
                sampling=self.sampling,
            )
            # Every process's rows dropped: nothing to learn from (all processes agree).
            if out.valid_B is None or agree(np.asarray(out.valid_B).any()):
                break
            # Tried again only while the first try's request deadline lasts: a try that waited
            # it out (a server that is down) is not repeated. Every process decides alike.
            spent = time.monotonic() - start
            late = tries > ALL_DROPPED_RETRIES or spent >= self.request_timeout_s
            if agree(late):
                raise ServingFailed(
                    f"every rollout request failed on {tries} tr{'y' if tries == 1 else 'ies'} "
                    f"of the same rollout in {spent:.0f} s ({len(out.valid_B)} requests each; "
                    f"{self.backend.failure()}), so the run stopped before training on empty "
                    "rollouts."
                )
        local = lambda x: self.transfer.local_rows(x).reshape(P, g_on, self.T)
        tokens = local(out.tokens_BxN)
        mask = local(out.mask_BxN).astype(bool)
        groups = Groups(
            prompt_ids_PxS=np.asarray(prompts.prompt_ids_PxS, np.int32),
            prompt_mask_PxS=np.asarray(prompts.prompt_mask_PxS, bool),
            completion_ids_PxGxN=tokens,
            completion_mask_PxGxN=mask,
            truncated_PxG=~np.any(mask & np.isin(tokens, self.eos), axis=2),
            is_anchor_PxG=np.zeros((P, g_on), bool),
            rewards_PxG=np.zeros((P, g_on), np.float32),
            scores_PxG=np.full((P, g_on), np.nan, np.float32),
            # A serving backend's dropped requests (retries exhausted) leave their group.
            valid_PxG=np.ones((P, g_on), bool)
            if out.valid_B is None
            else np.asarray(out.valid_B, bool).reshape(P, g_on),
        )
        # The sampler's log-probs: the behaviour policy's (anchors: 0, the learner's to fill).
        groups.old_logps_PxGxN = np.asarray(local(out.logps_BxN), np.float32)
        if self.A:
            groups = append_anchors(groups, *self.anchors(prompts.demonstrations))
            pad = np.zeros((P, self.A, self.T), np.float32)
            groups.old_logps_PxGxN = np.concatenate([groups.old_logps_PxGxN, pad], axis=1)
        if out.version_B is not None:
            groups.policy_version_PxG = np.concatenate(
                [np.asarray(out.version_B, np.int32).reshape(P, g_on), np.full((P, self.A), -1)],
                axis=1,
            ).astype(np.int32)
        return groups

    def _score(self, groups: Groups, prompts, lengths: np.ndarray):
        """Decodes the completions and submits them to the reward pipeline (a handle)."""
        P, G, T = groups.completion_ids_PxGxN.shape
        flat_ids = groups.completion_ids_PxGxN.reshape(P * G, T)
        texts = self.tok.batch_decode(
            [row[:n] for row, n in zip(flat_ids, lengths)], skip_special_tokens=True
        )
        rep = lambda xs: [x for x in xs for _ in range(G)]
        return self.rewards.submit(
            rep(prompts.prompts),
            texts,
            rep(prompts.answers),
            rep(prompts.demonstrations) if self.rewards.judge is not None else None,
            questions=rep(prompts.problems),
            completion_lengths=lengths,
        )

    def _apply_rewards(self, groups: Groups, scored, lengths: np.ndarray) -> np.ndarray:
        """Rewards, validity and judge scores into `groups`; returns the accuracy before
        DAPO's soft overlong punishment (DAPO eq. (13)) is added to the rewards."""
        P, G = groups.rewards_PxG.shape
        grouped = scored.grouped(G)
        groups.rewards_PxG = grouped["rewards_PxG"].astype(np.float32)
        groups.valid_PxG = grouped["valid_PxG"] & groups.valid_PxG
        if "scores_PxG" in grouped:
            groups.scores_PxG = grouped["scores_PxG"].astype(np.float32)
        accuracy = groups.rewards_PxG.copy()
        self._shape_overlong(groups, lengths)
        return accuracy

    def _shape_overlong(self, groups: Groups, lengths: np.ndarray) -> None:
        """DAPO's soft overlong punishment (eq. (13)) added to `groups`' rewards."""
        if self.overlong_buffer:
            P, G = groups.rewards_PxG.shape
            pen = soft_overlong_penalty(
                lengths, max_length=self.T, cache_length=self.overlong_buffer
            )
            groups.rewards_PxG = groups.rewards_PxG + self.overlong_penalty * pen.reshape(P, G)

    def _metrics(self, groups: Groups, accuracy: np.ndarray, lengths) -> dict[str, float]:
        """Reward and length figures over every process's rows (one small all-gather)."""
        P, G = groups.rewards_PxG.shape
        per_sample = np.stack(
            [
                groups.rewards_PxG,
                accuracy,
                lengths.reshape(P, G),
                groups.truncated_PxG,
                groups.is_anchor_PxG,
                groups.scores_PxG,
            ],
            axis=-1,
        ).astype(np.float32)
        rewards_all, acc_all, len_all, trunc_all, anchor_all, _ = np.moveaxis(
            self.transfer.gather_rows(per_sample), -1, 0
        )
        on = anchor_all == 0
        return {
            "reward/mean": float(rewards_all[on].mean()),
            "reward/std": float(rewards_all[on].std()),
            "reward/accuracy": float(acc_all[on].mean()),
            "reward/all_solved_frac": float(np.all(acc_all >= 1, axis=1).mean()),
            "reward/all_unsolved_frac": float(np.all(acc_all <= 0, axis=1).mean()),
            "response/length_mean": float(len_all[on].mean()),
            "response/length_max": float(len_all[on].max()),
            # Completion tokens the sampler produced this round (anchors are not sampled);
            # collect_step sums them over rounds: GPG's "equal sampled tokens" axis.
            "response/sampled_tokens": float(len_all[on].sum()),
            "response/clipped_frac": float(trunc_all[on].mean()),
        }


# Per-round metrics that collect_step adds up over a step's rounds (the rest: the last round's).
SUMMED_OVER_ROUNDS = ("response/sampled_tokens",)


def collect_step(
    rollout: Rollout,
    data_iter,
    params,
    key: jax.Array,
    *,
    P: int,
    sampling,
    allgather: Callable[[np.ndarray], np.ndarray] | None = None,
) -> StepBatch:
    """Rollout rounds until `select_groups` fills P groups (or the last allowed round).

    `sampling` is `config.sampling`; round r uses key `fold_in(key, r)`. In a multi-process
    run `P` is this process's share and `allgather` (gjax.multihost) makes every process
    decide on global counts. Returns the batch with `step`/`version` left at -1 (the caller
    knows them) and the data position after it.
    """
    min_valid = 1.0 if sampling.dynamic else sampling.min_valid_fraction
    carried: Groups | None = None
    host_metrics: dict[str, float] = {}
    for round_ in range(sampling.max_rollouts_per_step):
        prompts = next(data_iter)
        res = rollout(params, prompts, jax.random.fold_in(key, round_))
        host_metrics = {
            **res.metrics,
            **{
                k: v + host_metrics.get(k, 0.0)
                for k, v in res.metrics.items()
                if k.startswith("time/") or k in SUMMED_OVER_ROUNDS
            },
        }
        candidates = res.groups if carried is None else Groups.concat([carried, res.groups])
        batch_groups, carried = select_groups(
            candidates,
            P,
            min_valid_fraction=min_valid,
            drop_zero_variance=sampling.dynamic,
            final_round=round_ == sampling.max_rollouts_per_step - 1,
            allgather=allgather,
        )
        if batch_groups is not None:
            break
    host_metrics["sampling/rollouts"] = round_ + 1
    return StepBatch(
        step=-1,
        version=-1,
        groups=batch_groups,
        metrics=host_metrics,
        data_state=dict(data_iter.state()),
    )
