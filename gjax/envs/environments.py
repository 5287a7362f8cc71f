"""The built-in environments, and building one from the `env.*` config section.

  math  the single-turn task as the degenerate one-step environment: the policy's one turn
        is scored by the run's reward (the verifier path of gjax.rewards, exactly as the
        single-turn reward pipeline scores the same completion) and the episode is done.
        The reward functions only: a judge's scores (DaGRPO) are not part of a step.
  tool  multi-step with tools (env.tools: calculator, python, search): a turn with tool
        calls gets their `<tool_response>`s and the episode goes on; a turn without one is
        the final answer, scored by the run's reward, and ends it. `env.max_turns` and
        `env.max_tool_calls` bound it: a turn with calls that would pass either ends the
        episode there, truncated (its tools are not run; its text is scored like a final
        answer, so a boxed answer beside the call still counts).

Tool faults never raise: a malformed call, an unknown tool, bad arguments, a tool's
exception, a time-out, a memory or output overrun become `error (<kind>): ...` inside the
`<tool_response>` and count as `tools/errors/<kind>` in the step's metrics and `stats()`.

The continuous decoder drives these (`ContinuousDecoder.generate_episodes`, through
gjax.rollout.turns) and training consumes its trajectories (gjax.rollout.episodes, which
calls `build_env`); `check_config` refuses env.name != '' on the paths that do not (naming
what the run's path lacks), so no run believes it trains multi-turn when it does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gjax.envs import tools as tools_lib
from gjax.envs.base import ENVIRONMENTS, Counters, Environment, Episode, Step
from gjax.envs.tool_calls import MalformedCall, parse_tool_calls, tool_turn, tools_system_block
from gjax.errors import ConfigError
from gjax.rewards.functions import RewardResult

RewardFn = Callable[..., Any]  # the reward registry's signature (gjax.rewards.functions)


async def score_turn(
    reward_fn: RewardFn, row: Mapping[str, Any], text: str, length: int | None = None
) -> float:
    """The run's reward of one completion, as the single-turn reward pipeline computes it for
    a batch of one: a `CombinedReward`'s total where it is valid and finite (float32, as the
    pipeline's `rewards`), NaN where it is not (the pipeline's invalid sample). A sync reward
    function runs on a thread, as in the pipeline, so it never blocks the episodes' loop."""
    prompt = row.get("prompt", row["problem"])
    lengths = None if length is None else np.asarray([length])
    call = functools.partial(
        reward_fn, [prompt], [text], [row["answer"]], completion_lengths=lengths
    )
    if inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(
        getattr(reward_fn, "__call__", None)  # noqa: B004 (a CombinedReward's async __call__)
    ):
        out = await call()
    else:
        out = await asyncio.to_thread(call)
        if inspect.isawaitable(out):
            out = await out
    if isinstance(out, RewardResult):
        value, valid = float(out.rewards_B[0]), bool(out.valid_B[0])
    else:
        (value,) = out
        value, valid = (math.nan, False) if value is None else (float(value), True)
    if not (valid and math.isfinite(value)):
        return math.nan
    return float(np.float32(value))


def _check_row(row: Mapping[str, Any]) -> None:
    missing = [k for k in ("problem", "answer") if k not in row]
    if missing:
        raise KeyError(f"an episode's data row needs {missing}; it has {sorted(row)}")


# --------------------------------------------------------------------------- math


class MathEpisode:
    def __init__(self, env: MathEnv, row: Mapping[str, Any]):
        self._env, self._row, self._done = env, row, False

    async def step(self, text: str, *, length: int | None = None) -> Step:
        if self._done:
            raise RuntimeError("step() after the episode was done")
        self._done = True
        reward = await score_turn(self._env.reward_fn, self._row, text, length)
        self._env.counters.add({"env/turns": 1, "env/episodes_done": 1})
        return Step("", reward, True, False, {"env/turns": 1.0})


class MathEnv:
    """One turn, scored by the run's reward, done."""

    name = "math"

    def __init__(self, reward_fn: RewardFn):
        self.reward_fn = reward_fn
        self.counters = Counters(("env/episodes", "env/episodes_done", "env/turns"))

    def system_prompt(self) -> str:
        return ""

    def start(self, row: Mapping[str, Any]) -> Episode:
        _check_row(row)
        self.counters.add({"env/episodes": 1})
        return MathEpisode(self, row)

    def stats(self) -> dict[str, float]:
        return self.counters.snapshot()

    def close(self) -> None:
        pass


@ENVIRONMENTS.register("math")
def math_env(config, *, reward_fn: RewardFn) -> Environment:
    return MathEnv(reward_fn)


# --------------------------------------------------------------------------- tool


def error_text(kind: str, message: str) -> str:
    """A tool fault as the policy reads it inside `<tool_response>`."""
    return f"error ({kind}): {message}"


class ToolEpisode:
    def __init__(self, env: ToolEnv, row: Mapping[str, Any]):
        self._env, self._row = env, row
        self.turns = 0
        self.tool_calls = 0
        self.done = False

    async def step(self, text: str, *, length: int | None = None) -> Step:
        if self.done:
            raise RuntimeError("step() after the episode was done")
        env = self._env
        self.turns += 1
        metrics = {"env/turns": 1.0}
        calls = parse_tool_calls(text)
        over_turns = self.turns >= env.max_turns
        over_calls = self.tool_calls + len(calls) > env.max_tool_calls
        if calls and not over_turns and not over_calls:
            self.tool_calls += len(calls)
            metrics["tools/calls"] = float(len(calls))  # calls run (malformed ones included)
            responses = [await env.call(c, metrics) for c in calls]
            env.counters.add(metrics)
            return Step(tool_turn(responses), None, False, False, metrics)
        # A final answer, or tool calls no turn is left to read (or no calls are left for).
        self.done = True
        truncated = bool(calls)
        if truncated:
            metrics["env/truncated"] = 1.0
            metrics["env/truncated_turns" if over_turns else "env/truncated_tool_calls"] = 1.0
        metrics["env/episodes_done"] = 1.0
        reward = await score_turn(env.reward_fn, self._row, text, length)
        env.counters.add(metrics)
        return Step("", reward, True, truncated, metrics)


class ToolEnv:
    """Multi-step with tools (see the module docstring)."""

    name = "tool"

    def __init__(
        self,
        reward_fn: RewardFn,
        tools: Sequence[tools_lib.Tool],
        *,
        max_turns: int = 4,
        max_tool_calls: int = 8,
        max_output_chars: int = 4096,
        workers: int = 2,
    ):
        if max_turns < 1 or max_tool_calls < 0 or max_output_chars < 1 or workers < 1:
            raise ValueError(
                "ToolEnv needs max_turns >= 1, max_tool_calls >= 0, max_output_chars >= 1, "
                f"workers >= 1; got {max_turns}, {max_tool_calls}, {max_output_chars}, {workers}"
            )
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools named twice in {names}")
        self.reward_fn = reward_fn
        self.tools = {t.name: t for t in tools}
        self.max_turns, self.max_tool_calls = int(max_turns), int(max_tool_calls)
        self.max_output_chars = int(max_output_chars)
        self.counters = Counters(
            ("env/episodes", "env/episodes_done", "env/turns", "env/truncated", "tools/calls")
            + tuple(f"tools/errors/{k}" for k in tools_lib.ERROR_KINDS)
        )
        # Tools block: they run on these threads, never on the event loop.
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gjax-tool")

    def system_prompt(self) -> str:
        return tools_system_block([t.schema() for t in self.tools.values()])

    def start(self, row: Mapping[str, Any]) -> Episode:
        _check_row(row)
        self.counters.add({"env/episodes": 1})
        return ToolEpisode(self, row)

    async def call(self, call, metrics: dict[str, float]) -> str:
        """One call's response text; a fault is counted in `metrics` and described."""
        kind, out = None, ""
        if isinstance(call, MalformedCall):
            kind = "malformed"
            out = (
                f"malformed tool call: {call.reason}. Write <tool_call>"
                '{"name": <tool name>, "arguments": {...}}</tool_call>'
            )
        elif call.name not in self.tools:
            kind = "unknown_tool"
            out = f"unknown tool {call.name[:100]!r}; available tools: {', '.join(self.tools)}"
        else:
            loop = asyncio.get_running_loop()
            try:
                out = await loop.run_in_executor(self._pool, self.tools[call.name], call.arguments)
                if not isinstance(out, str):
                    raise TypeError(f"tool returned {type(out).__name__}, not text")
                if len(out) > self.max_output_chars:
                    kind = "output"
                    out = f"the output is longer than {self.max_output_chars} characters"
            except tools_lib.ToolError as e:
                kind, out = e.kind, str(e)
            except Exception as e:  # noqa: BLE001 (a tool's fault is the policy's observation)
                kind, out = "exception", f"{type(e).__name__}: {str(e)[:300]}"
        if kind is None:
            return out
        key = f"tools/errors/{kind}"
        metrics[key] = metrics.get(key, 0.0) + 1.0
        metrics["tools/errors"] = metrics.get("tools/errors", 0.0) + 1.0
        return error_text(kind, out)

    def stats(self) -> dict[str, float]:
        return self.counters.snapshot()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.tools.values():
            t.close()


@ENVIRONMENTS.register("tool")
def tool_env(config, *, reward_fn: RewardFn) -> Environment:
    e = config.env
    tools = [tools_lib.build_tool(n, e) for n in tools_lib.tool_names(e.tools)]
    return ToolEnv(
        reward_fn,
        tools,
        max_turns=e.max_turns,
        max_tool_calls=e.max_tool_calls,
        max_output_chars=e.tool_output_chars,
        workers=e.tool_workers,
    )


# --------------------------------------------------------------------------- config


TOOL_PROMPTS = ("auto", "none")  # env.tool_prompt


def prompt_tools(env_cfg) -> list[dict[str, Any]]:
    """The JSON-schema function specs a run's prompts describe (gjax.data.templates
    render_prompt): the tools of the `tool` environment with env.tool_prompt='auto'; none for
    single-turn runs, the `math` environment and env.tool_prompt='none'."""
    check_fields(env_cfg)
    if env_cfg.name != "tool" or env_cfg.tool_prompt == "none":
        return []
    specs = []
    for name in tools_lib.tool_names(env_cfg.tools):
        tool = tools_lib.build_tool(name, env_cfg)  # a sandbox starts no process until a call
        try:
            specs.append(tool.schema())
        finally:
            tool.close()
    return specs


def check_fields(env_cfg) -> None:
    """`config.env` names an environment and tools that exist (ConfigError otherwise)."""
    name = env_cfg.name
    if name and name not in ENVIRONMENTS:
        raise ConfigError(
            f"config.env.name={name!r} is not an environment; valid names: "
            f"{ENVIRONMENTS.names()} ('' for single-turn rollouts)"
        )
    if env_cfg.tool_prompt not in TOOL_PROMPTS:
        raise ConfigError(
            f"config.env.tool_prompt={env_cfg.tool_prompt!r} is not a choice; valid: "
            f"{', '.join(TOOL_PROMPTS)} (auto: a tool environment's prompts describe its tools; "
            "none: they do not)"
        )
    if name == "tool":
        names = tools_lib.tool_names(env_cfg.tools)
        if "search" in names and not env_cfg.search_corpus:
            raise ConfigError(
                "config.env.tools includes 'search', which needs config.env.search_corpus: a "
                'JSONL file of {"title": ..., "text": ...} passages'
            )


def check_config(config) -> None:
    """A hook of `gjax.config.validate`: `config.env` can work, on a path that trains on it.

    Multi-turn training (gjax.rollout.episodes) runs on the local backend's continuous
    decoder, in one process or several, synchronously or asynchronously (rollout.max_staleness
    >= 0, on the train mesh or on mesh.rollout_devices: the producer thread rolls the episodes
    out), and on the JetStream backends (gjax.rollout.jetstream_episodes: the history resent
    each turn, so the server's prefill bucket must hold prompt + trajectory): the in-process
    engine in one process, gjax.serve replicas in one or several (each process plays its own
    rows' episodes on the servers, as it sends its own single completions; the in-process
    engine is refused on several processes by `gjax.rollout.factory` for every run). A run
    with env.name set on another path is refused rather than silently trained
    single-turn, and the message names the missing piece of the run's own path. Not part of
    an episode either: DaGRPO's anchors (demonstrations are single completions) and a judge's
    scores."""
    check_fields(config.env)
    e, r = config.env, config.rollout
    if e.turn_tokens > r.max_new_tokens:
        raise ConfigError(
            f"config.env.turn_tokens={e.turn_tokens} is more than "
            f"config.rollout.max_new_tokens={r.max_new_tokens}, which bounds a whole "
            "trajectory; lower it, or 0 for the trajectory's budget"
        )
    if not e.name:
        return
    if r.backend != "local":
        _check_served_episodes(config)
    if r.backend == "local" and r.decoder == "static":
        missing = "the static sampler has no turns (the continuous decoder has)"
    elif config.anchors.per_group > 0:
        missing = "DaGRPO's anchors (anchors.per_group > 0) are single completions, not episodes"
    elif config.reward.judge.name != "none":
        missing = f"a judge's scores (reward.judge.name={config.reward.judge.name!r}) are not "
        missing += "part of an episode's steps"
    else:
        return
    raise ConfigError(
        f"config.env.name={e.name!r}: multi-turn training is not available on this path: "
        f"{missing}. Multi-turn training runs on --config.rollout.backend=local with the "
        "continuous decoder (--config.rollout.decoder=continuous), or on a JetStream backend; "
        "or leave config.env.name='' (the default) for single-turn runs."
    )


def _check_served_episodes(config) -> None:
    """A JetStream server's prefill bucket holds a turn's whole history (the prompt and the
    trajectory so far: `served_prompt_len`), or the run is refused here."""
    from gjax.rollout.buckets import PREFILL_BUCKETS, served_prompt_len

    need = served_prompt_len(config)
    if need + 1 > PREFILL_BUCKETS[-1]:
        raise ConfigError(
            f"config.env.name={config.env.name!r} on the {config.rollout.backend} backend: "
            "each turn's request resends the row's history, up to data.max_prompt_len + "
            f"rollout.max_new_tokens = {need} tokens, more than JetStream's largest prefill "
            f"bucket ({PREFILL_BUCKETS[-1]}, one position its BOS); lower either, or use "
            "--config.rollout.backend=local (the continuous decoder keeps the KV instead)"
        )


def build_env(config, *, reward_fn: RewardFn) -> Environment:
    """The environment `config.env.name` with the run's reward function (the `CombinedReward`
    that gjax.rewards.pipeline.build_rewards gives the reward pipeline)."""
    check_fields(config.env)
    if not config.env.name:
        raise ConfigError("config.env.name is '' (single-turn): there is no environment to build")
    return ENVIRONMENTS.get(config.env.name)(config, reward_fn=reward_fn)
