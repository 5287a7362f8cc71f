"""Reward functions: a strict registry, the built-ins, and their weighted, fault-tolerant sum.

Every reward function has one signature (sync or async)::

    def fn(prompts, completions, answers, *, completion_lengths, **metadata) -> Sequence[float]
    async def fn(prompts, completions, answers, *, completion_lengths, **metadata) -> Sequence[float]

* ``prompts``, ``completions``, ``answers``: equal-length sequences (``B`` items, prompt-major:
  each prompt and its answer repeated ``G`` times), completions as decoded text.
* ``completion_lengths``: ``int[B]`` completion lengths in tokens (``None`` if the caller has
  none; functions that need it raise).
* ``**metadata``: whatever else the caller passes per batch (e.g. ``references``); a function
  must accept ``**metadata`` so new keys never break it.
* extra keyword-only parameters are configuration, bound once from the spec's ``kwargs``
  (e.g. ``max_length``); a parameter named ``verifier`` receives the shared :class:`Verifier`.
* returns one float per completion; ``None``/NaN marks that item as unscored.

Register your own with ``@REWARDS.register("name")`` and combine by name::

    reward = build_reward([{"name": "accuracy"}, {"name": "format", "weight": 0.1,
                            "require_think": True}], verifier=verifier)
    out = await reward(prompts, completions, answers, completion_lengths=lengths_B)
    out.rewards_B, out.valid_B, out.metrics

Failure policy (``on_error``), for a function that raises or returns unusable output, and
for single items it returns as ``None``/NaN; every case is counted and logged with the
exception, never raised into the training loop:
  * ``"invalid"`` (default): the affected items get ``valid_B = False`` (and reward 0), so
    the advantage estimator drops them through ``valid_PxG``: no sample trains on a reward
    that was not computed (the same default as gjax/rewards/pipeline.py).
  * ``"zero"``: that component is 0 for the affected items; they stay valid.
The verifier never produces unscored items: its timeouts and crashes are a counted 0
(see gjax/rewards/verifier.py).
Fail fast instead: a bad spec (unknown name, missing or unknown kwargs, a function without
``**metadata``) raises at build time, and a programming error on a function's FIRST call
(``TypeError``, ``NameError``, ``AttributeError``, ``ImportError``, output of the wrong
length or type) raises :class:`RewardFunctionError`: such a bug would otherwise silently
train on zeros. After a function has succeeded once, all its errors are counted instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gjax.answers import EXTRACTORS
from gjax.registry import Registry
from gjax.rewards.verifier import Verifier

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
REWARDS: Registry[RewardFn] = Registry("reward function")

ON_ERROR_POLICIES = ("invalid", "zero")
_PROGRAMMING_ERRORS = (TypeError, NameError, AttributeError, ImportError)


class RewardFunctionError(RuntimeError):
    """A reward function is broken (bad spec, or a programming error on its first call)."""


class _BadOutput(TypeError):
    """A reward function returned something that is not ``B`` numbers."""


# --------------------------------------------------------------------------------------
# Built-in reward functions
# --------------------------------------------------------------------------------------


@REWARDS.register("accuracy")
async def accuracy(
    prompts, completions, answers, *, completion_lengths=None, verifier: Verifier, **metadata
):
    """Binary accuracy: 1 if math-verify finds the final answer equal to the ground truth."""
    del prompts, completion_lengths, metadata
    return await verifier.ascore(completions, answers)


def format_ok(
    text: str, *, require_think: bool = False, extractors: Sequence[str] = ("boxed", "answer_tag")
) -> bool:
    """Whether ``text`` has a final answer and well-formed think tags.

    Well formed: at most one ``<think>`` and one ``</think>``; ``</think>`` after ``<think>``
    (a lone ``</think>`` is fine: templates often open the think block in the prompt); the
    answer (``\\boxed{}``/``<answer>`` per ``extractors``) found after ``</think>``. With
    ``require_think`` a ``</think>`` must be present.
    """
    n_open, n_close = text.count("<think>"), text.count("</think>")
    if n_open > 1 or n_close > 1 or (n_open == 1 and n_close == 0):
        return False
    if require_think and n_close == 0:
        return False
    tail = text
    if n_close:
        close = text.find("</think>")
        if n_open and text.find("<think>") > close:
            return False
        tail = text[close + len("</think>") :]
    return any(EXTRACTORS.get(name)(tail) for name in extractors if name in EXTRACTORS)


@REWARDS.register("format")
def format_reward(
    prompts,
    completions,
    answers,
    *,
    completion_lengths=None,
    require_think: bool = False,
    extractors: Sequence[str] = ("boxed", "answer_tag"),
    **metadata,
):
    """1 where :func:`format_ok` holds (final answer present, think tags well formed), else 0."""
    del prompts, answers, completion_lengths, metadata
    return [
        float(format_ok(c, require_think=require_think, extractors=extractors))
        if isinstance(c, str)
        else 0.0
        for c in completions
    ]


def soft_overlong_penalty(lengths_B, *, max_length: int, cache_length: int) -> np.ndarray:
    """DAPO soft overlong punishment (DAPO eq. (13)), ``float32[B]`` in [-1, 0].

    With ``L_max = max_length``, ``L_cache = cache_length`` and ``|y|`` the length in tokens:

        R(y) = 0                               if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
             = -1                              if |y| > L_max

    The penalty is added to the accuracy reward (weight 1 in DAPO) after `reward/accuracy` is
    measured: set `config.sampling.overlong_buffer` (L_cache) and `overlong_penalty` (the
    weight), the one way to shape rewards by length (it was also a reward function named
    "overlong" until that entry point was retired).
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    lengths_B = np.asarray(lengths_B, dtype=np.float64)
    free = max_length - cache_length
    pen_B = np.where(lengths_B <= free, 0.0, (free - lengths_B) / cache_length)
    pen_B = np.where(lengths_B > max_length, -1.0, pen_B)
    return pen_B.astype(np.float32)


# --------------------------------------------------------------------------------------
# Specs and the combined reward
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One term of the total reward: ``weight * REWARDS[name](..., **kwargs)``."""

    name: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, spec: Any) -> RewardSpec:
        """From a RewardSpec, a name, ``(name, weight)`` or a mapping ``{name, weight, **kw}``
        (``kwargs`` may also be given nested under the key ``kwargs``)."""
        if isinstance(spec, RewardSpec):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, tuple) and len(spec) in (2, 3):
            return cls(spec[0], float(spec[1]), dict(spec[2]) if len(spec) == 3 else {})
        if isinstance(spec, Mapping) or hasattr(spec, "to_dict"):
            d = dict(spec.to_dict() if hasattr(spec, "to_dict") else spec)
            if "name" not in d:
                raise ValueError(f"reward spec {d!r} has no 'name'")
            name = d.pop("name")
            weight = float(d.pop("weight", 1.0))
            kwargs = dict(d.pop("kwargs", None) or {})
            kwargs.update(d)
            return cls(name, weight, kwargs)
        raise TypeError(f"cannot read a reward spec from {spec!r}")


@dataclasses.dataclass
class RewardResult:
    """The combined reward of one batch.

    rewards_B: ``float32[B]`` weighted sum of the components (0 where invalid).
    valid_B: ``bool[B]``; False only under ``on_error="invalid"`` for failed items.
    components: name -> ``float32[B]`` raw (unweighted) values, NaN where failed.
    metrics: flat ``{str: float}`` for logging (means, failures, wall times).
    """

    rewards_B: np.ndarray
    valid_B: np.ndarray
    components: dict[str, np.ndarray]
    metrics: dict[str, float]


class _Term:
    def __init__(self, spec: RewardSpec, fn: RewardFn, bound: dict[str, Any]):
        self.spec, self.fn, self.bound = spec, fn, bound
        self.succeeded = False
        self.calls = self.failures = self.invalid_items = 0
        self.time_s = 0.0


def _check_signature(spec: RewardSpec, fn: RewardFn, verifier: Verifier | None) -> dict[str, Any]:
    """Bound config kwargs for ``fn``; raises RewardFunctionError on a spec/signature mismatch."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(f"reward {spec.name!r}: cannot inspect {fn!r}: {e}") from e
    params = sig.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise RewardFunctionError(
            f"reward {spec.name!r} must accept **metadata; expected signature "
            "fn(prompts, completions, answers, *, completion_lengths, **metadata)"
        )
    bound = dict(spec.kwargs)
    unknown = [k for k in bound if k not in params or k in ("prompts", "completions", "answers")]
    if unknown:
        raise RewardFunctionError(
            f"reward {spec.name!r} got unknown config kwargs {unknown}; its parameters: "
            f"{[n for n in params if params[n].kind is inspect.Parameter.KEYWORD_ONLY]}"
        )
    if "verifier" in params and "verifier" not in bound:
        if verifier is None and params["verifier"].default is inspect.Parameter.empty:
            raise RewardFunctionError(
                f"reward {spec.name!r} needs a Verifier: build_reward(..., verifier=Verifier())"
            )
        if verifier is not None:
            bound["verifier"] = verifier
    try:
        sig.bind([], [], [], completion_lengths=None, **bound)
    except TypeError as e:
        raise RewardFunctionError(
            f"reward {spec.name!r} does not fit fn(prompts, completions, answers, *, "
            f"completion_lengths, **metadata) with config {sorted(spec.kwargs)}: {e}"
        ) from e
    return bound


def _as_values(out: Any, batch: int) -> np.ndarray:
    """Reward-function output -> ``float64[B]`` (None -> NaN); TypeError/ValueError if unusable."""
    if isinstance(out, np.ndarray | Sequence) and not isinstance(out, str | bytes):
        vals = (
            [math.nan if v is None else v for v in out] if not isinstance(out, np.ndarray) else out
        )
        try:
            arr = np.asarray(vals, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise _BadOutput(f"reward output is not numeric: {e}") from None
        if arr.shape != (batch,):
            raise _BadOutput(f"reward output has shape {arr.shape}, expected ({batch},)")
        return arr
    raise _BadOutput(
        f"reward output must be a sequence of {batch} floats, got {type(out).__name__}"
    )


class CombinedReward:
    """``sum_i weight_i * reward_i`` over registered reward functions, never crashing the loop.

    Call ``await reward(prompts, completions, answers, completion_lengths=..., **metadata)``
    (or :meth:`compute` from synchronous code). All terms run concurrently; sync functions
    run in a thread so they never block the event loop. See the module docstring for the
    failure policy.
    """

    def __init__(
        self,
        specs: Sequence[Any],
        *,
        verifier: Verifier | None = None,
        on_error: str = "invalid",
    ):
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
        parsed = [RewardSpec.parse(s) for s in specs]
        if not parsed:
            raise ValueError("need at least one reward spec")
        names = [s.name for s in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward names in {names}")
        self.on_error = on_error
        self._terms = []
        for spec in parsed:
            fn = REWARDS.get(spec.name)
            if not math.isfinite(spec.weight):
                raise ValueError(f"reward {spec.name!r} has a non-finite weight {spec.weight}")
            self._terms.append(_Term(spec, fn, _check_signature(spec, fn, verifier)))
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [t.spec.name for t in self._terms]

    async def _run_term(self, term: _Term, args, kwargs, batch: int):
        t0 = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(term.fn):
                out = await term.fn(*args, **kwargs, **term.bound)
            else:
                out = await asyncio.to_thread(term.fn, *args, **kwargs, **term.bound)
                if inspect.isawaitable(out):
                    out = await out
            vals = _as_values(out, batch)
            err = None
        except Exception as e:  # noqa: BLE001 (the policy decides)
            vals, err = None, e
        dt = time.perf_counter() - t0
        with self._lock:
            term.calls += 1
            term.time_s += dt
            if err is None:
                term.succeeded = True
            elif not term.succeeded and isinstance(err, _PROGRAMMING_ERRORS):
                # On the first call these are bugs (wrong signature, bad output): fail fast.
                raise RewardFunctionError(
                    f"reward {term.spec.name!r} failed on its first call: "
                    f"{type(err).__name__}: {err}"
                ) from err
            else:
                term.failures += 1
        if err is not None:
            logger.error(
                "reward %r failed on a batch of %d (policy %r): %s",
                term.spec.name,
                batch,
                self.on_error,
                err,
                exc_info=err,
            )
            vals = np.full((batch,), math.nan)
        return vals, dt, err is not None

    async def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        answers: Sequence[Any],
        *,
        completion_lengths: Sequence[int] | np.ndarray | None = None,
        **metadata,
    ) -> RewardResult:
        batch = len(completions)
        if len(prompts) != batch or len(answers) != batch:
            raise ValueError(
                f"got {len(prompts)} prompts, {batch} completions, {len(answers)} answers; "
                "pass one of each per completion (prompt-major, repeated G times)"
            )
        if completion_lengths is not None:
            completion_lengths = np.asarray(completion_lengths)
            if completion_lengths.shape != (batch,):
                raise ValueError(
                    f"completion_lengths has shape {completion_lengths.shape}, expected ({batch},)"
                )
        args = (prompts, completions, answers)
        kwargs = {"completion_lengths": completion_lengths, **metadata}
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(self._run_term(t, args, kwargs, batch) for t in self._terms)
        )
        rewards_B = np.zeros((batch,), np.float64)
        valid_B = np.ones((batch,), bool)
        components: dict[str, np.ndarray] = {}
        metrics: dict[str, float] = {}
        for term, (vals, dt, failed) in zip(self._terms, results):
            name = term.spec.name
            bad_B = ~np.isfinite(vals)
            n_bad_items = int(bad_B.sum()) if not failed else 0
            if n_bad_items:
                logger.warning("reward %r gave %d unscored items (None/NaN/inf)", name, n_bad_items)
            with self._lock:
                term.invalid_items += n_bad_items
            if self.on_error == "invalid":
                valid_B &= ~bad_B
            rewards_B += term.spec.weight * np.where(bad_B, 0.0, vals)
            components[name] = vals.astype(np.float32)
            ok = vals[~bad_B]
            metrics[f"rewards/{name}/mean"] = float(ok.mean()) if ok.size else math.nan
            metrics[f"rewards/{name}/failed"] = float(failed)
            metrics[f"rewards/{name}/invalid_items"] = float(n_bad_items)
            metrics[f"rewards/{name}/time_s"] = dt
        rewards_B = np.where(valid_B, rewards_B, 0.0).astype(np.float32)
        # The total's mean and the valid fraction are the pipeline's `rewards/mean` and
        # `rewards/valid_fraction` (after the judge too): not repeated here.
        metrics["rewards/time_s"] = time.perf_counter() - t0
        return RewardResult(rewards_B, valid_B, components, metrics)

    def compute(self, *args, **kwargs) -> RewardResult:
        """Synchronous :meth:`__call__` (not from inside a running event loop)."""
        return asyncio.run(self(*args, **kwargs))

    def stats(self) -> dict[str, float]:
        """Cumulative per-term counters: calls, failures, invalid items, wall time."""
        out: dict[str, float] = {}
        with self._lock:
            for t in self._terms:
                p = f"rewards/{t.spec.name}"
                out[f"{p}/calls"] = t.calls
                out[f"{p}/failures"] = t.failures
                out[f"{p}/invalid_items"] = t.invalid_items
                out[f"{p}/time_s"] = t.time_s
        return out


def build_reward(
    specs: Sequence[Any], *, verifier: Verifier | None = None, on_error: str = "invalid"
) -> CombinedReward:
    """A :class:`CombinedReward` from specs (see :meth:`RewardSpec.parse` for the forms)."""
    return CombinedReward(specs, verifier=verifier, on_error=on_error)
