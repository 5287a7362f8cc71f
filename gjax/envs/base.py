"""The environment seam: what a multi-turn rollout asks of a task, declared whole.

An `Environment` starts an `Episode` from a data row; the episode is advanced by the policy's
text, one turn at a time, and each `step` answers with a `Step`: the environment's text to
insert before the policy's next turn (a tool's output, feedback), this turn's reward if any,
and whether the episode is over (and whether a limit ended it). Steps are coroutines: they
await the verifier's process pool, tools' sandboxes and other host work, so many episodes
are in flight at once on one event loop (gjax.envs.runner.EnvRunner) while bounded worker
pools do the work.

    env = build_env(config, reward_fn=reward)          # gjax.envs.environments
    episode = env.start({"problem": ..., "answer": ...})
    step = await episode.step(policy_text)             # Step(observation, reward, done, ...)

Rewards follow the reward pipeline's convention (gjax.rewards.pipeline): a float per turn
that has one, `None` for a turn without, NaN where the reward could not be computed (that
sample is invalid, as in the pipeline).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Step:
    """The environment's answer to one policy turn.

    observation: text inserted before the policy's next turn ('' once done).
    reward: this turn's reward (None: none for this turn; NaN: not computable, invalid).
    done: the episode is over.
    truncated: a limit (env.max_turns, env.max_tool_calls) ended it, not the policy.
    metrics: this step's counts (`tools/calls`, `tools/errors/<kind>`, ...).
    """

    observation: str
    reward: float | None
    done: bool
    truncated: bool = False
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Episode(Protocol):
    """One episode of an environment, advanced by the policy's text."""

    async def step(self, text: str, *, length: int | None = None) -> Step:
        """The environment's answer to the policy's turn `text` (one call per turn; calling
        it after a step that was `done` is a programming error). `length`: the turn's tokens,
        handed to the reward functions as `completion_lengths` (None: unknown)."""
        ...


class Environment(Protocol):
    """A task the policy acts in over one or more turns."""

    name: str

    def system_prompt(self) -> str:
        """Text the prompt's system message carries for this environment (the tools'
        signatures; '' for none)."""
        ...

    def start(self, row: Mapping[str, Any]) -> Episode:
        """A new episode for the data row (`problem`, `answer`, optionally `prompt`)."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since creation: episodes, turns, truncations, tool calls and errors."""
        ...

    def close(self) -> None:
        """Frees worker pools and sandboxes (idempotent)."""
        ...


# name -> factory(config, *, reward_fn) -> Environment (gjax.envs.environments registers them)
ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment")


class Counters:
    """Thread-safe named counts (an environment's `stats`)."""

    def __init__(self, names=()):
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(names, 0.0)

    def add(self, counts: Mapping[str, float]) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] = self._counts.get(k, 0.0) + v

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)
