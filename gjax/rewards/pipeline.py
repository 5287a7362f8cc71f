"""Host-side async reward pipeline: the reward functions and the judge of a batch, concurrently.

Every reward function and the judge of one rollout batch run concurrently on an asyncio
event loop in a background thread; `submit(...)` schedules them and returns at once with a
handle, so the caller can go on (e.g. building the batch's anchors) and calls
`handle.result()` only when the rewards are needed:

    with RewardPipeline({"accuracy": accuracy_fn}, judge=judge) as pipe:
        handle = pipe.submit(problems, completions, answers, demonstrations)
        ...                                          # other host work meanwhile
        res = handle.result()                        # rewards [B], valid [B], scores [B], metrics

Reward functions have the signature of the reward registry (gjax/rewards/functions.py):
`fn(prompts, completions, answers, *, completion_lengths, **metadata) -> Sequence[float]`,
sync or async (an `async def`, or a sync function returning an awaitable). Sync functions run
in a small thread pool so a blocking verifier never stalls the loop; async ones run on it.
The combined reward is sum_i w_i r_i over the functions. A function may also return an object
with `rewards_B`, `valid_B` (and `metrics`), such as the registry's `CombinedReward` (which has
its own weights and error policy): its `valid_B` is and-ed into the batch's validity and its
metrics are passed through. `None` items are NaN: that sample becomes invalid.

Failures never kill the loop:
  * a reward function that raises, or returns the wrong length: that function's column is
    NaN for the batch; `on_reward_error='invalid'` (default) marks the whole batch invalid
    (valid=False: no sample trains on a reward that was not computed), `'zero'` uses 0.
    Non-finite values from a function make that sample invalid. Counted and logged.
  * a judge that raises: all its scores are missing for the batch; the missing-score policy
    (`on_missing`, see `judge.resolve_missing_scores`) then applies. Counted and logged.
  * `fail_fast_first_call=True`: an exception on the very FIRST call of a reward function or
    the judge is re-raised by `result()` as `RewardPipelineError` (a wrong signature must not
    turn into a silent run of zeros).
  * `max_consecutive_failures=N`: after N consecutive batches with a failure, `result()`
    raises `RewardPipelineError` naming the last error.
  * a judge that rejects the credentials (`JudgeAuthError`, HTTP 401/403): `result()` raises
    it at once, first call or not (no score can arrive; training on filled-in scores would
    be a silent run of made-up numbers).
  * `max_missing_batches=N`: after N consecutive batches whose fraction of missing judge
    scores exceeds `max_missing_fraction`, `result()` raises `JudgeUnavailableError`.

Judge score metrics count real scores only: `judge/score_mean` over the scores that arrived;
`judge/missing` and `judge/filled` (missing ones trained on a substituted score) apart.

Timings (seconds, `perf_counter`) in `PipelineResult.metrics`:
  rewards/wall_s     first reward work started -> everything finished
  rewards/queue_s    submit() -> work started on the loop
  rewards/wait_s     time `result()` blocked the caller
  rewards/overlap_s  reward wall time hidden behind the caller's work: min(end, wait_begin) - start
  rewards/overlap_frac  overlap_s / wall_s (1.0 = fully hidden)
plus per-function times `rewards/time_<name>_s`, `rewards/time_judge_s`, per-function means
`rewards/<name>_mean` (none for a CombinedReward, whose metrics give its terms' means), the
mean reward `rewards/mean` and `rewards/valid_fraction` over the batch, failure counters and
the judge's counters for the batch `judge/<counter>`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gjax.errors import ConfigError, UserError
from gjax.rewards.functions import REWARDS, CombinedReward, RewardSpec, build_reward
from gjax.rewards.judge import (
    ON_MISSING,
    Judge,
    JudgeAuthError,
    OpenAIJudge,
    resolve_missing_scores,
)
from gjax.rewards.judge import check_config as check_judge_config
from gjax.rewards.rule_judge import RuleJudge
from gjax.rewards.verifier import Verifier, VerifierConfig

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
_JUDGE_KEY = "<judge>"


class RewardPipelineError(RuntimeError):
    """Raised by `RewardHandle.result()` when rewards cannot be trusted any more."""


class JudgeUnavailableError(UserError, RewardPipelineError):
    """Too many judge scores missing for too many consecutive batches."""


@dataclasses.dataclass
class Timings:
    """perf_counter timestamps of one batch (None until reached)."""

    submit: float
    start: float | None = None
    end: float | None = None
    wait_begin: float | None = None
    wait_end: float | None = None
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> seconds
    started: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> timestamp


@dataclasses.dataclass
class PipelineResult:
    """Host arrays for one rollout batch of B = P*G samples (prompt-major)."""

    rewards: np.ndarray  # [B] f32, sum_i w_i r_i; 0 where invalid
    valid: np.ndarray  # [B] bool
    scores: np.ndarray | None  # [B] f32 in [1, 10] after the missing-score policy; None: no judge
    scored: np.ndarray | None  # [B] bool, True where the judge's score arrived
    per_fn: dict[str, np.ndarray]  # name -> [B] f32 (NaN where that function failed)
    metrics: dict[str, float]
    timings: Timings

    def grouped(self, G: int) -> dict[str, np.ndarray]:
        """`rewards_PxG`, `valid_PxG` (and `scores_PxG`, `scored_PxG` with a judge)."""
        B = self.rewards.shape[0]
        if G < 1 or B % G:
            raise ValueError(f"batch of {B} samples is not divisible into groups of G={G}")
        out = {"rewards_PxG": self.rewards.reshape(-1, G), "valid_PxG": self.valid.reshape(-1, G)}
        if self.scores is not None:
            out["scores_PxG"] = self.scores.reshape(-1, G)
            out["scored_PxG"] = self.scored.reshape(-1, G)
        return out


@dataclasses.dataclass
class _Raw:
    """What the loop produced, before the caller's wait is known."""

    per_fn: dict[str, np.ndarray]
    fn_ok: dict[str, bool]
    fn_valid: dict[str, np.ndarray]
    fn_metrics: dict[str, float]
    scores: list[float | None] | None
    errors: list[str]
    fatal: str | None
    auth_error: str | None = None  # the judge's JudgeAuthError message


class RewardHandle:
    """Future of one batch's rewards. `result()` blocks only if they are not ready yet."""

    def __init__(self, pipeline: RewardPipeline, future: concurrent.futures.Future, batch: int):
        self._pipeline = pipeline
        self._future = future
        self.batch = batch
        self.timings: Timings | None = None
        self._result: PipelineResult | None = None
        self._error: RewardPipelineError | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> PipelineResult:
        with self._lock:
            if self._result is not None:
                return self._result
            if self._error is not None:
                raise self._error
            t0 = time.perf_counter()
            try:
                raw, timings = self._future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"rewards of batch {self.batch} not ready after {timeout}s"
                ) from None
            timings.wait_begin = t0
            timings.wait_end = time.perf_counter()
            self.timings = timings
            try:
                self._result = self._pipeline._finalize(raw, timings, self.batch)
            except (RewardPipelineError, JudgeAuthError) as e:
                self._error = e
                raise
            return self._result


class RewardPipeline:
    """Runs reward functions and a judge on a background event loop, one handle per batch.

    Args:
      reward_fns: name -> reward function (or one function, named 'reward').
      weights: name -> weight of the combined reward (default 1.0 each).
      judge: optional `Judge` (DaGRPO eq. (7)); needs `references` in `submit`.
      on_missing, fill_value, positive_threshold: missing-score policy, see
        `judge.resolve_missing_scores`.
      on_reward_error: 'invalid' (default) or 'zero', see the module docstring.
      fail_fast_first_call: re-raise an exception from a function's very first call.
      max_consecutive_failures: raise after this many consecutive failing batches (None: never).
      max_missing_fraction, max_missing_batches: raise after `max_missing_batches` consecutive
        batches with more than this fraction of judge scores missing (None: never).
      max_workers: threads for sync reward functions.
    """

    def __init__(
        self,
        reward_fns: Mapping[str, RewardFn] | RewardFn,
        *,
        weights: Mapping[str, float] | None = None,
        judge: Judge | None = None,
        on_missing: str = "keep",
        fill_value: float = 5.5,
        positive_threshold: float = 0.5,
        on_reward_error: str = "invalid",
        fail_fast_first_call: bool = True,
        max_consecutive_failures: int | None = None,
        max_missing_fraction: float = 0.5,
        max_missing_batches: int | None = None,
        max_workers: int = 4,
    ):
        if callable(reward_fns) and not isinstance(reward_fns, Mapping):
            reward_fns = {"reward": reward_fns}
        if not reward_fns:
            raise ValueError("RewardPipeline needs at least one reward function")
        for name, fn in reward_fns.items():
            if name == "judge":
                raise ValueError("'judge' is reserved for the judge; rename that reward function")
            if not callable(fn):
                raise TypeError(f"reward function {name!r} is not callable: {fn!r}")
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(reward_fns))
        if unknown:
            raise ValueError(
                f"weights for unknown reward functions {unknown}; have {sorted(reward_fns)}"
            )
        if judge is not None and not isinstance(judge, Judge):
            raise TypeError(f"judge must implement the Judge protocol (async score), got {judge!r}")
        if on_missing not in ON_MISSING:
            raise ValueError(f"on_missing must be one of {ON_MISSING}, got {on_missing!r}")
        if on_reward_error not in ("invalid", "zero"):
            raise ValueError(
                f"on_reward_error must be 'invalid' or 'zero', got {on_reward_error!r}"
            )
        if max_consecutive_failures is not None and max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures must be >= 1 or None, got {max_consecutive_failures}"
            )
        if not 0.0 <= max_missing_fraction <= 1.0:
            raise ValueError(f"max_missing_fraction must be in [0, 1], got {max_missing_fraction}")
        if max_missing_batches is not None and max_missing_batches < 1:
            raise ValueError(f"max_missing_batches must be >= 1 or None, got {max_missing_batches}")
        self.max_missing_fraction = float(max_missing_fraction)
        self.max_missing_batches = max_missing_batches
        self._missing_run = 0  # consecutive batches above max_missing_fraction
        self.reward_fns = dict(reward_fns)
        self.weights = {name: float(weights.get(name, 1.0)) for name in self.reward_fns}
        self.judge = judge
        self.on_missing = on_missing
        self.fill_value = float(fill_value)
        self.positive_threshold = float(positive_threshold)
        self.on_reward_error = on_reward_error
        self.fail_fast_first_call = fail_fast_first_call
        self.max_consecutive_failures = max_consecutive_failures

        self._lock = threading.Lock()
        self._called: set[str] = set()  # functions that have been called at least once
        self._judge_seen: dict[str, float] = {}  # the judge's counters at the last result
        self._batches = 0
        self._counts = {"batches": 0, "failed_batches": 0, "fn_failures": 0, "judge_failures": 0}
        self._consecutive = 0
        self._pending: set[concurrent.futures.Future] = set()
        self._closed = False

        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="gjax-reward"
        )
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._run_loop, name="gjax-reward-loop", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    # -- public API ----------------------------------------------------------------------------

    def submit(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        answers: Sequence[str],
        references: Sequence[str] | None = None,
        *,
        questions: Sequence[str] | None = None,
        completion_lengths: Sequence[int] | np.ndarray | None = None,
        **metadata: Any,
    ) -> RewardHandle:
        """Starts rewards (and judge scores) for one batch; returns immediately.

        `questions` are what the judge sees as the problem (default: `prompts`);
        `references` are the judge's reference demonstrations (DaGRPO eq. (7) o_demo).
        """
        if self._closed:
            raise RuntimeError("RewardPipeline is closed")
        B = len(completions)
        lengths = {"prompts": len(prompts), "answers": len(answers)}
        if references is not None:
            lengths["references"] = len(references)
        if questions is not None:
            lengths["questions"] = len(questions)
        if completion_lengths is not None:
            lengths["completion_lengths"] = len(completion_lengths)
        bad = {k: n for k, n in lengths.items() if n != B}
        if bad:
            raise ValueError(f"submit: {B} completions but {bad}")
        if self.judge is not None and references is None:
            raise ValueError("submit: the judge needs `references` (one reference per completion)")
        batch_args = dict(
            prompts=list(prompts),
            completions=list(completions),
            answers=list(answers),
            references=None if references is None else list(references),
            questions=list(prompts if questions is None else questions),
            completion_lengths=None
            if completion_lengths is None
            else np.asarray(completion_lengths),
            metadata=metadata,
        )
        timings = Timings(submit=time.perf_counter())
        with self._lock:
            batch = self._batches
            self._batches += 1
        future = asyncio.run_coroutine_threadsafe(self._run_batch(batch_args, timings), self._loop)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return RewardHandle(self, future, batch)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {f"rewards/{k}": float(v) for k, v in self._counts.items()}

    def close(self, timeout: float | None = 30.0) -> None:
        """Waits for submitted batches (up to `timeout`), closes the judge, stops the loop."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        if pending:
            _, not_done = concurrent.futures.wait(pending, timeout=timeout)
            for f in not_done:
                f.cancel()
        aclose = getattr(self.judge, "aclose", None)
        if aclose is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(aclose(), self._loop).result(timeout=10)
            except Exception as e:  # closing must not raise over a training loop's exit
                log.warning("judge.aclose() failed: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop side -------------------------------------------------------------------------

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _first_call(self, name: str) -> bool:
        with self._lock:
            first = name not in self._called
            self._called.add(name)
        return first

    async def _timed(self, name: str, timings: Timings, coro_fn: Callable[[], Any]):
        t0 = time.perf_counter()
        timings.started[name] = t0
        try:
            return await coro_fn()
        finally:
            timings.parts[name] = time.perf_counter() - t0

    async def _call_reward(self, name: str, fn: RewardFn, args: dict):
        kwargs = dict(args["metadata"])
        kwargs["completion_lengths"] = args["completion_lengths"]
        call = functools.partial(
            fn, args["prompts"], args["completions"], args["answers"], **kwargs
        )
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        ):
            out = await call()
        else:
            out = await asyncio.get_running_loop().run_in_executor(None, call)
            if inspect.isawaitable(out):
                out = await out
        fn_valid, fn_metrics = None, {}
        if hasattr(out, "rewards_B") and hasattr(out, "valid_B"):
            # A CombinedReward (gjax/rewards/functions.py): already weighted, with its own policy.
            fn_valid = np.asarray(out.valid_B, bool).reshape(-1)
            fn_metrics = dict(getattr(out, "metrics", {}) or {})
            out = out.rewards_B
        if not isinstance(out, np.ndarray):
            out = [np.nan if v is None else v for v in out]
        values = np.asarray(out, dtype=np.float64).reshape(-1)
        B = len(args["completions"])
        if values.shape[0] != B or (fn_valid is not None and fn_valid.shape[0] != B):
            raise ValueError(
                f"reward function {name!r} returned {values.shape[0]} values for {B} completions"
            )
        return values, fn_valid, fn_metrics

    async def _run_batch(self, args: dict, timings: Timings) -> tuple[_Raw, Timings]:
        timings.start = time.perf_counter()
        B = len(args["completions"])
        names = list(self.reward_fns)
        jobs = [
            self._timed(name, timings, functools.partial(self._call_reward, name, fn, args))
            for name, fn in self.reward_fns.items()
        ]
        if self.judge is not None:
            judge = self.judge
            jobs.append(
                self._timed(
                    "judge",
                    timings,
                    lambda: judge.score(args["questions"], args["completions"], args["references"]),
                )
            )
        firsts = {name: self._first_call(name) for name in names}
        if self.judge is not None:
            firsts["judge"] = self._first_call(_JUDGE_KEY)
        outs = await asyncio.gather(*jobs, return_exceptions=True)
        timings.end = time.perf_counter()

        per_fn: dict[str, np.ndarray] = {}
        fn_ok: dict[str, bool] = {}
        fn_valid: dict[str, np.ndarray] = {}
        fn_metrics: dict[str, float] = {}
        errors: list[str] = []
        fatal = None
        for name, out in zip(names, outs):
            if isinstance(out, BaseException):
                msg = f"reward function {name!r} raised {type(out).__name__}: {out}"
                log.error("%s", msg, exc_info=out)
                errors.append(msg)
                per_fn[name] = np.full(B, np.nan)
                fn_ok[name] = False
                if firsts[name] and self.fail_fast_first_call:
                    fatal = f"{msg} on its first call (fail_fast_first_call=True)"
            else:
                per_fn[name], valid_B, metrics = out
                fn_ok[name] = True
                if valid_B is not None:
                    fn_valid[name] = valid_B
                fn_metrics.update(metrics)
        scores = None
        auth_error = None
        if self.judge is not None:
            out = outs[-1]
            if isinstance(out, JudgeAuthError):
                auth_error = str(out)
                errors.append(f"judge: {auth_error}")
                scores = [None] * B
            elif isinstance(out, BaseException):
                msg = f"judge raised {type(out).__name__}: {out}"
                log.error("%s", msg, exc_info=out)
                errors.append(msg)
                scores = [None] * B
                if firsts["judge"] and self.fail_fast_first_call:
                    fatal = f"{msg} on its first call (fail_fast_first_call=True)"
            elif len(out) != B:
                msg = f"judge returned {len(out)} scores for {B} completions"
                log.error("%s", msg)
                errors.append(msg)
                scores = [None] * B
            else:
                scores = list(out)
        raw = _Raw(per_fn, fn_ok, fn_valid, fn_metrics, scores, errors, fatal, auth_error)
        return raw, timings

    # -- the caller side -----------------------------------------------------------------------

    def _judge_counters(self) -> dict[str, float]:
        """The judge's counters since the previous result (`judge/<counter>`).

        Per-batch counts rather than the judge's process-lifetime totals, so a resumed run
        logs what an uninterrupted one would (sum the column for totals); the latency
        figures are gauges and pass through. Batches in flight together share their counts.
        """
        stats = getattr(self.judge, "stats", None)
        if stats is None:
            return {}
        with self._lock:
            now, seen = stats(), self._judge_seen
            self._judge_seen = now
        return {
            f"judge/{k}": float(v)
            if k.startswith("latency_") and k != "latency_n"
            else float(v - seen.get(k, 0.0))
            for k, v in now.items()
        }

    def _check_missing(self, fraction: float, batch: int) -> None:
        with self._lock:
            self._missing_run = self._missing_run + 1 if fraction > self.max_missing_fraction else 0
            run = self._missing_run
        if self.max_missing_batches is not None and run >= self.max_missing_batches:
            raise JudgeUnavailableError(
                f"the judge returned no score for more than {self.max_missing_fraction:.0%} of "
                f"the responses in {run} consecutive batches ({fraction:.0%} in batch {batch}), "
                "so training would run on substituted scores. Check the judge endpoint "
                "(config.reward.judge.base_url, its logs above), or loosen "
                "config.reward.judge.max_missing_fraction / max_missing_steps."
            )

    def _finalize(self, raw: _Raw, timings: Timings, batch: int) -> PipelineResult:
        B = len(next(iter(raw.per_fn.values())))
        with self._lock:
            self._counts["batches"] += 1
            self._counts["fn_failures"] += sum(not ok for ok in raw.fn_ok.values())
            self._counts["judge_failures"] += sum(e.startswith("judge") for e in raw.errors)
            if raw.errors:
                self._counts["failed_batches"] += 1
                self._consecutive += 1
            else:
                self._consecutive = 0
            consecutive = self._consecutive
        if raw.auth_error is not None:
            raise JudgeAuthError(raw.auth_error)
        if raw.fatal is not None:
            raise RewardPipelineError(raw.fatal)
        if (
            self.max_consecutive_failures is not None
            and consecutive >= self.max_consecutive_failures
        ):
            raise RewardPipelineError(
                f"rewards failed in {consecutive} consecutive batches (max_consecutive_failures="
                f"{self.max_consecutive_failures}); last error (batch {batch}): {raw.errors[-1]}"
            )

        valid = np.ones(B, bool)
        total = np.zeros(B, np.float64)
        for name, values in raw.per_fn.items():
            if not raw.fn_ok[name]:
                if self.on_reward_error == "invalid":
                    valid[:] = False
                continue
            finite = np.isfinite(values)
            valid &= finite
            if name in raw.fn_valid:
                valid &= raw.fn_valid[name]
            total += self.weights[name] * np.where(finite, values, 0.0)
        n_nonfinite = int(
            sum((~np.isfinite(v)).sum() for n, v in raw.per_fn.items() if raw.fn_ok[n])
        )
        rewards = np.where(valid, total, 0.0).astype(np.float32)

        metrics: dict[str, float] = dict(raw.fn_metrics)
        scores = scored = None
        if raw.scores is not None:
            scores, valid, scored, judge_metrics = resolve_missing_scores(
                raw.scores,
                on_missing=self.on_missing,
                fill_value=self.fill_value,
                rewards=rewards,
                valid=valid,
                positive_threshold=self.positive_threshold,
            )
            rewards = np.where(valid, rewards, 0.0).astype(np.float32)
            metrics.update(self._judge_counters())
            metrics.update(judge_metrics)
            # Real scores only; substituted ones (on_missing keep/fill) are counted apart.
            metrics["judge/score_mean"] = float(scores[scored].mean()) if scored.any() else 0.0
            metrics["judge/scored"] = float(scored.sum())
            metrics["judge/filled"] = float((~scored & valid).sum())
            self._check_missing(judge_metrics["judge/missing_fraction"], batch)

        wall = timings.end - timings.start
        overlap = max(0.0, min(timings.end, timings.wait_begin) - timings.start)
        metrics.update(
            {
                "rewards/wall_s": wall,
                "rewards/queue_s": timings.start - timings.submit,
                "rewards/wait_s": timings.wait_end - timings.wait_begin,
                "rewards/overlap_s": overlap,
                "rewards/overlap_frac": overlap / wall if wall > 0 else 1.0,
                "rewards/valid_fraction": float(valid.mean()) if B else 0.0,
                "rewards/nonfinite": float(n_nonfinite),
                "rewards/batch_errors": float(len(raw.errors)),
                "rewards/consecutive_failures": float(consecutive),
            }
        )
        for name, seconds in timings.parts.items():
            metrics[f"rewards/time_{name}_s"] = seconds
        for name, values in raw.per_fn.items():
            if isinstance(self.reward_fns[name], CombinedReward):  # its metrics: its terms' means
                continue
            finite = np.isfinite(values)
            metrics[f"rewards/{name}_mean"] = float(values[finite].mean()) if finite.any() else 0.0
        metrics["rewards/mean"] = float(rewards[valid].mean()) if valid.any() else 0.0
        metrics.update(self.stats())
        return PipelineResult(
            rewards=rewards,
            valid=valid,
            scores=scores,
            scored=scored,
            per_fn={k: v.astype(np.float32) for k, v in raw.per_fn.items()},
            metrics=metrics,
            timings=timings,
        )


def reward_specs(functions: str) -> list[RewardSpec]:
    """`config.reward.functions` ("name[:weight],...") as specs, each name and weight checked
    (a `ConfigError` naming the field)."""
    specs = []
    for item in functions.split(","):
        name, _, weight = item.strip().partition(":")
        if name == "overlong":
            raise ConfigError(
                f"config.reward.functions: {functions!r}: the 'overlong' reward function is "
                "retired; DAPO's soft overlong punishment has one way to be set: "
                "--config.sampling.overlong_buffer=<L_cache tokens> and "
                "--config.sampling.overlong_penalty=<its weight> (configs/dapo.py)"
            )
        if name not in REWARDS:
            raise ConfigError(
                f"config.reward.functions: unknown reward function {name!r} in {functions!r}; "
                f"valid names: {sorted(REWARDS)}; write a comma list of name[:weight]"
            )
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = math.nan
        if not math.isfinite(w):
            raise ConfigError(
                f"config.reward.functions: the weight of {name!r} must be a finite number, got "
                f"{weight!r} in {functions!r}"
            )
        specs.append(RewardSpec(name, w))
    return specs


def verifier_extractors(extractors: str) -> tuple[str, ...]:
    """`config.reward.extractors` ("boxed,answer_tag") as the verifier's extractor names, each
    checked (a `ConfigError` naming the field and the valid names)."""
    names = tuple(n.strip() for n in extractors.split(",") if n.strip())
    try:
        VerifierConfig(extractors=names)
    except ValueError as e:
        raise ConfigError(
            f"config.reward.extractors={extractors!r}: {e}; write a comma list of names, the "
            "answer format the prompt template asks for first (e.g. 'answer_line' for DAPO's "
            "'Answer: ...', 'boxed,answer_tag' for \\boxed{} and <answer> tags)"
        ) from None
    return names


def build_verifier(config) -> Verifier:
    """The run's verifier from `config.reward`: its deadline, workers and answer extractors."""
    r = config.reward
    return Verifier(
        timeout_s=r.timeout_s, num_workers=r.workers, extractors=verifier_extractors(r.extractors)
    )


def check_config(config) -> None:
    """`config.reward` can work: reward function names and weights, the answer extractors, the
    judge's fields. A hook of `gjax.config.validate`, run before anything is written."""
    reward_specs(config.reward.functions)
    verifier_extractors(config.reward.extractors)
    check_judge_config(config.reward.judge)


def build_rewards(config, verifier) -> RewardPipeline:
    """The run's reward pipeline from `config.reward`: weighted reward functions and judge."""
    reward = build_reward(reward_specs(config.reward.functions), verifier=verifier)
    j = config.reward.judge
    judge = None
    if j.name == "rule":
        judge = RuleJudge(noise_std=j.noise_std, noise_seed=config.seed)
    elif j.name == "openai":
        judge = OpenAIJudge(
            base_url=j.base_url,
            model=j.model,
            api_key_env=j.api_key_env,
            max_concurrency=j.concurrency,
            timeout_s=j.timeout_s,
            max_retries=j.max_retries,
            out_of_range=j.out_of_range,
        )
    return RewardPipeline(
        {"reward": reward},
        judge=judge,
        on_missing=j.on_missing,
        fill_value=j.fill_score,
        max_missing_fraction=j.max_missing_fraction,
        max_missing_batches=j.max_missing_steps or None,
    )
