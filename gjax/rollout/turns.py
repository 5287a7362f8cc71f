"""Turns on the continuous decoder: what `ContinuousDecoder` asks when a row's turn ends.

A row's turn ends when it emits a stop id or reaches its turn's length limit. `OneTurn` (every
`generate` call) ends the row there. `EnvTurns` (`ContinuousDecoder.generate_episodes`) hands
the turn to the row's episode of a `gjax.envs` environment instead: the turn's token ids are
decoded to text and the episode's step runs on an `EnvRunner` (host-side, asynchronous, bounded
workers) while the other slots go on decoding; when the step answers and the episode goes on,
its observation is encoded and the decoder appends those ids to the row's SAME slot as one
prefill chunk (its KV kept: the history is not prefilled again), then the row decodes its next
turn. The seam, declared whole (what `gjax.rollout.decoder._Schedule` calls):

    bind(prompt_mask_PxS, num_samples, sampling)  a new batch of rows (episodes started)
    first_limits(limits_B)   each row's length limit for its first turn
    end_turn(b, ids_T)       row b's turn (its token ids) ended; True: the row is finished
    answers(lengths_B, block)  [(b, observation ids, or None: finished)] steps that answered
    stats()                  figures of the batch (merged into the decoder's stats)

Limits (each truncates the episode and marks the row with its name in `limit_B`):
  'turns'        env `max_turns` policy turns ended and the episode is not done
  'tokens'       the trajectory (every policy and environment token after the prompt) is at
                 `sampling.max_new_tokens` (the decoder's cache width), or the observation
                 would not fit with room for one more policy token (it is not inserted)
  'turn_tokens'  a turn reached `turn_tokens` new tokens without a stop id; its episode
                 step still runs (it scores the turn) and the episode ends there
  'env'          the environment itself ended the episode truncated (`Step.truncated`)
The trajectory's reward is the sum of its steps' rewards (a turn without one adds nothing;
NaN, not computable, makes it NaN: the sample is invalid); an episode cut before any reward
has reward 0. Training discounts it by `env.discount` (`trajectory_rewards`: turn t weighs
discount**t; 1.0 is this sum).
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from gjax.envs.base import Step
from gjax.envs.runner import EnvRunner
from gjax.experience import Groups
from gjax.rollout.sampler import SamplingParams

LIMITS = ("", "turns", "tokens", "turn_tokens", "env")


def build_turns(config, runner: EnvRunner, rows: Sequence[Mapping[str, Any]], tokenizer):
    """`EnvTurns` from the `env.*` section: the policy's turns decoded as the single-turn
    reward decodes a completion (special tokens skipped), observations encoded without
    added special tokens (a chat template's turn markers in the text are parsed as theirs)."""
    return EnvTurns(
        runner,
        rows,
        encode=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
        max_turns=config.env.max_turns,
        turn_tokens=config.env.turn_tokens,
    )


def trajectory_rewards(rewards: Sequence[Sequence[float | None]], discount: float) -> np.ndarray:
    """[B] float32: each row's sum over its steps t = 0, 1, ... of discount**t * r_t (`env.
    discount`; 1.0 is the plain sum, bit for bit: 1.0**t * r == r). A step without a reward
    (None) adds nothing but still counts as a turn; NaN makes the row NaN (invalid); a row
    without any reward gets 0 (module docstring)."""
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"discount must be in (0, 1], got {discount}")
    out = np.zeros((len(rewards),), np.float32)
    for b, rs in enumerate(rewards):
        given = [discount**t * r for t, r in enumerate(rs) if r is not None]
        out[b] = math.fsum(given) if given else 0.0
    return out


class OneTurn:
    """Single-turn: a row's first turn is all of it."""

    def bind(self, prompt_mask_PxS, num_samples: int, sampling: SamplingParams) -> None:
        pass

    def first_limits(self, limits_B: np.ndarray) -> np.ndarray:
        return limits_B

    def end_turn(self, b: int, ids_T: np.ndarray) -> bool:
        return True

    def answers(self, lengths_B: np.ndarray, *, block: bool) -> list:
        return []

    def stats(self) -> dict[str, float]:
        return {}


class Trajectories(NamedTuple):
    """Token-exact multi-turn rows, B = P*G prompt-major; N = sampling.max_new_tokens.

    tokens_BxN: every token after the prompt, as sampled or as the environment inserted it
    (pad after `lengths_B`); mask_BxN: 1 on every one of them (what the row attends);
    policy_mask_BxN: 1 on the policy's sampled tokens only (the loss mask); logps_BxN: the
    behaviour log-prob of each policy token (0 elsewhere); turns_B: policy turns; rewards:
    each row's per-step rewards; reward_B: their sum (see the module docstring); limit_B: the
    limit that truncated the row ('' none); observations: each row's inserted id lists.
    """

    tokens_BxN: np.ndarray
    mask_BxN: np.ndarray
    policy_mask_BxN: np.ndarray
    logps_BxN: np.ndarray
    lengths_B: np.ndarray
    turns_B: np.ndarray
    rewards: list
    reward_B: np.ndarray
    limit_B: list
    observations: list

    @property
    def truncated_B(self) -> np.ndarray:
        return np.asarray([x != "" for x in self.limit_B])

    def groups(self, prompt_ids_PxS, prompt_mask_PxS) -> Groups:
        """The learner's rows: `prompt ++ trajectory` token for token, the policy mask as the
        loss mask's part, the behaviour log-probs as old log-probs, the trajectory's reward
        (valid where finite) and its truncation."""
        p_ = np.asarray(prompt_ids_PxS).shape[0]
        rows = lambda x: np.asarray(x).reshape(p_, -1, *np.asarray(x).shape[1:])
        reward_PxG = rows(self.reward_B)
        valid_PxG = np.isfinite(reward_PxG)
        return Groups(
            prompt_ids_PxS=np.asarray(prompt_ids_PxS, np.int32),
            prompt_mask_PxS=np.asarray(prompt_mask_PxS, bool),
            completion_ids_PxGxN=rows(self.tokens_BxN).astype(np.int32),
            completion_mask_PxGxN=rows(self.mask_BxN).astype(bool),
            truncated_PxG=rows(self.truncated_B),
            is_anchor_PxG=np.zeros(reward_PxG.shape, bool),
            rewards_PxG=np.where(valid_PxG, reward_PxG, 0.0).astype(np.float32),
            scores_PxG=np.full(reward_PxG.shape, np.nan, np.float32),
            valid_PxG=valid_PxG,
            old_logps_PxGxN=rows(self.logps_BxN).astype(np.float32),
            policy_mask_PxGxN=rows(self.policy_mask_BxN).astype(bool),
        )


class EnvTurns:
    """Rows as episodes of `runner`'s environment (see the module docstring).

    rows: one data row per prompt (`problem`, `answer`, ...; row b's episode starts from
    rows[b // G]). encode(text) -> token ids of an observation; decode(ids) -> the policy
    turn's text as the environment reads it (the single-turn reward's decoding, e.g.
    `tokenizer.decode(ids, skip_special_tokens=True)`). max_turns: policy turns per episode.
    turn_tokens: new tokens per turn (0: up to the trajectory's budget).
    """

    def __init__(
        self,
        runner: EnvRunner,
        rows: Sequence[Mapping[str, Any]],
        *,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[Sequence[int]], str],
        max_turns: int,
        turn_tokens: int = 0,
    ):
        if max_turns < 1 or turn_tokens < 0:
            raise ValueError(
                f"max_turns must be >= 1 and turn_tokens >= 0, got {max_turns}, {turn_tokens}"
            )
        self.runner, self.rows = runner, list(rows)
        self.encode, self.decode = encode, decode
        self.max_turns, self.turn_tokens = int(max_turns), int(turn_tokens)

    def bind(self, prompt_mask_PxS, num_samples: int, sampling: SamplingParams) -> None:
        p_ = np.asarray(prompt_mask_PxS).shape[0]
        if len(self.rows) != p_:
            raise ValueError(f"{len(self.rows)} data rows for {p_} prompts")
        self.g_, b_ = num_samples, p_ * num_samples
        self.n_ = sampling.max_new_tokens
        self.stop_ids = frozenset(sampling.stop_token_ids)
        self.prompt_len_B = np.repeat(np.asarray(prompt_mask_PxS).sum(-1), num_samples)
        self.episodes = [self.runner.start(self.rows[b // num_samples]) for b in range(b_)]
        self.turns_B = np.zeros((b_,), np.int32)
        self.rewards: list[list] = [[] for _ in range(b_)]
        self.limit_B = [""] * b_
        self.done_B = np.zeros((b_,), bool)  # the environment ended the episode (Step.done)
        self.observations: list[list] = [[] for _ in range(b_)]
        self.cut_B = np.zeros((b_,), bool)  # the turn in flight ended without a stop id
        self.in_flight: dict[concurrent.futures.Future, int] = {}
        self.metrics: collections.Counter = collections.Counter()
        # each row's own step counts (tools/calls, tools/errors/<kind>, ...): per episode
        self.row_metrics = [collections.Counter() for _ in range(b_)]
        self.reprefill_tokens = 0  # what re-prefilling each re-entry's history would cost
        self.step_seconds: list[float] = []  # this batch's steps' seconds (the runner's)

    def _budget(self) -> int:
        return self.turn_tokens or self.n_

    def first_limits(self, limits_B: np.ndarray) -> np.ndarray:
        return np.minimum(limits_B, self._budget()).astype(np.int32)

    def turn_limit(self, length: int) -> int:
        """The length limit of a turn that starts at trajectory length `length`."""
        return min(length + self._budget(), self.n_)

    def end_turn(self, b: int, ids_T: np.ndarray) -> bool:
        ids = [int(i) for i in ids_T]
        self.turns_B[b] += 1
        self.cut_B[b] = not ids or ids[-1] not in self.stop_ids
        future = self.runner.submit(
            self.episodes[b], self.decode(ids), length=len(ids), seconds=self.step_seconds
        )
        self.in_flight[future] = b
        return False

    def answers(self, lengths_B: np.ndarray, *, block: bool) -> list:
        if not self.in_flight:
            return []
        done, _ = concurrent.futures.wait(
            list(self.in_flight),
            timeout=None if block else 0,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        out = []
        for future in sorted(done, key=self.in_flight.get):  # row order: deterministic
            b = self.in_flight.pop(future)
            out.append((b, self._answer(b, future.result(), int(lengths_B[b]))))
        return out

    def _answer(self, b: int, step: Step, length: int):
        """The ids to insert after row b's turn, or None where its episode ends here."""
        self.rewards[b].append(step.reward)
        counts = {k: float(v) for k, v in step.metrics.items()}
        self.metrics.update(counts)
        self.row_metrics[b].update(counts)
        full = length >= self.n_
        self.done_B[b] = step.done
        if step.done:
            if step.truncated:
                self.limit_B[b] = "env"
            elif self.cut_B[b]:
                self.limit_B[b] = "tokens" if full else "turn_tokens"
            return None
        if self.cut_B[b]:
            self.limit_B[b] = "tokens" if full else "turn_tokens"
            return None
        if self.turns_B[b] >= self.max_turns:
            self.limit_B[b] = "turns"
            return None
        ids = [int(i) for i in self.encode(step.observation)]
        if not ids:
            raise RuntimeError(
                f"environment {self.runner.env.name!r}: a step that is not done returned an "
                "empty observation (nothing for the policy's next turn to follow)"
            )
        if length + len(ids) + 1 > self.n_:
            self.limit_B[b] = "tokens"
            return None
        self.observations[b].append(ids)
        self.reprefill_tokens += int(self.prompt_len_B[b]) + length + len(ids)
        return ids

    def fail(self, b: int) -> None:
        """Row b's turn was never decoded (a serving backend dropped its request): its episode
        ends unscored, the row invalid (reward NaN, as a dropped single completion's)."""
        self.rewards[b].append(math.nan)

    def trajectories(self, tokens_BxN, mask_BxN, policy_mask_BxN, logps_BxN, lengths_B):
        """The batch's `Trajectories`: the decoded rows with this batch's turns, rewards,
        limits and observations."""
        return Trajectories(
            tokens_BxN=np.asarray(tokens_BxN),
            mask_BxN=np.asarray(mask_BxN),
            policy_mask_BxN=np.asarray(policy_mask_BxN).astype(np.int32),
            logps_BxN=np.asarray(logps_BxN),
            lengths_B=np.asarray(lengths_B),
            turns_B=self.turns_B.copy(),
            rewards=[list(r) for r in self.rewards],
            reward_B=self.reward_B(),
            limit_B=list(self.limit_B),
            observations=[list(o) for o in self.observations],
        )

    def reward_B(self) -> np.ndarray:
        """Each row's reward: the sum of its steps' rewards (module docstring)."""
        return trajectory_rewards(self.rewards, 1.0)

    def stats(self) -> dict[str, float]:
        inserted = sum(len(x) for obs in self.observations for x in obs)
        prompts = float(self.prompt_len_B.sum())
        episodes = max(len(self.episodes), 1)
        own = {
            "env/turns_per_episode": float(self.turns_B.mean()) if len(self.turns_B) else 0.0,
            "env/truncated": float(sum(x != "" for x in self.limit_B)),
            **{f"env/truncated_{k}": float(self.limit_B.count(k)) for k in LIMITS if k},
            "env/tokens_inserted": float(inserted),
            # prefill tokens per episode: KV kept (the prompt, shared by the G rows of a group,
            # and the inserted tokens) vs prefilling each turn's whole history again
            "env/prefill_tokens_per_episode_kept": (prompts / self.g_ + inserted) / episodes,
            "env/prefill_tokens_per_episode_reprefill": (prompts / self.g_ + self.reprefill_tokens)
            / episodes,
            # seconds in environment steps (summed over episodes; they overlap each other and
            # decoding: the decoder's `env_wait_s` is the part no slot decoded through)
            "env/step_s": float(sum(self.step_seconds)),
        }
        # The steps' own counts (tools/calls, tools/errors/<kind>, ...); a name this batch's
        # figures already have keeps the batch's (a `tool` step's `env/truncated` counts
        # steps the environment truncated, not trajectories: those are `env/truncated_env`).
        return {**{k: v for k, v in self.metrics.items() if k != "env/turns"}, **own}
