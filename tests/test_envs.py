"""gjax.envs: strict tool-call parsing, the sandbox's bounds, the tools, the math and tool
environments (the one-step equality with the single-turn reward pipeline), many episodes in
flight, and the env.* config section."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from gjax import schema
from gjax.config import validate
from gjax.envs import (
    ENVIRONMENTS,
    TOOLS,
    EnvRunner,
    MalformedCall,
    MathEnv,
    Sandbox,
    SearchTool,
    ToolCall,
    ToolEnv,
    ToolError,
    build_env,
    check_config,
    parse_tool_calls,
    tool_turn,
    tools_system_block,
)
from gjax.envs import environments as envs_environments
from gjax.envs.tools import BM25, build_tool, load_corpus
from gjax.errors import ConfigError
from gjax.rewards.functions import REWARDS, build_reward
from gjax.rewards.pipeline import RewardPipeline, reward_specs
from gjax.rewards.verifier import Verifier
from gjax.train import CONFIG_CHECKS

# --------------------------------------------------------------------------- parsing


def _call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_well_formed_calls_parse_in_order():
    text = (
        "Let me compute. "
        + _call('{"name": "calculator", "arguments": {"expression": "2+3"}}')
        + " and "
        + _call('{"arguments": {"query": "Paris"}, "name": "search"}')
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("search", {"query": "Paris"}),
    ]
    assert parse_tool_calls("no call here, \\boxed{5}") == []


@pytest.mark.parametrize(
    "text, reason",
    [
        (_call('{"name": "calculator", "arguments": {"expression": "2+3"}'), "not valid JSON"),
        (_call("[1, 2]"), "a JSON list, not an object"),
        (_call('{"name": "calculator"}'), 'exactly "name" and "arguments"'),
        (_call('{"name": "c", "arguments": {}, "id": 1}'), 'exactly "name" and "arguments"'),
        (_call('{"name": 3, "arguments": {}}'), '"name" must be a non-empty string'),
        (_call('{"name": " ", "arguments": {}}'), '"name" must be a non-empty string'),
        (_call('{"name": "c", "arguments": "2+3"}'), '"arguments" must be an object'),
        (_call('{"name": "c", "name": "d", "arguments": {}}'), "duplicate key"),
        (_call('{"name": "c", "arguments": {"x": NaN}}'), "NaN is not valid JSON"),
        ('<tool_call>{"name": "c", "arguments": {}}', "never closed"),
        ('</tool_call>{"name": "c", "arguments": {}}', "without an opening"),
    ],
)
def test_malformed_calls_are_named_not_raised(text, reason):
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedCall)
    assert reason in call.reason


def test_a_call_opened_inside_another_is_malformed_and_the_inner_one_parses():
    inner = '{"name": "c", "arguments": {}}'
    calls = parse_tool_calls(f"<tool_call> oops <tool_call>{inner}</tool_call>")
    assert isinstance(calls[0], MalformedCall) and "opened inside" in calls[0].reason
    assert calls[1] == ToolCall("c", {})


def test_tool_turn_is_qwen25s_rendering_of_tool_messages():
    # Qwen2.5's chat template: consecutive `tool` messages in one user turn, each as
    # "\n<tool_response>\n" + content + "\n</tool_response>", then the generation prompt.
    assert tool_turn(["84", "error (timeout): x"]) == (
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response>"
        "\n<tool_response>\nerror (timeout): x\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    block = tools_system_block([{"type": "function", "function": {"name": "f"}}])
    assert block.startswith("# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "f"}}\n</tools>' in block
    assert block.endswith(
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


# --------------------------------------------------------------------------- sandbox


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(timeout_s=1.0, memory_mb=256, max_output_bytes=4096, workers=2) as s:
        yield s


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(
    "mode, source, kind",
    [
        ("python", "while True:\n    pass", "timeout"),
        ("calc", "9**9**9**9", "timeout"),
        ("python", "x = ' ' * (10 * 2**30)\nlen(x)", "memory"),
        ("python", "for i in range(1024):\n    print('x' * 2**20)", "output"),
        ("calc", "10**100000", "output"),
    ],
    ids=["loop-forever", "huge-power", "allocate-10GB", "print-1GB", "huge-number"],
)
def test_sandbox_cuts_runaway_code(sandbox, mode, source, kind):
    """A call that loops, allocates 10 GB or prints a gigabyte is cut within seconds, with the
    right kind; the trainer's process keeps its memory and its next call works."""
    rss0 = _peak_rss_mb()
    t0 = time.perf_counter()
    result = sandbox.run(mode, source)
    elapsed = time.perf_counter() - t0
    assert result.kind == kind, result
    assert result.output == ""
    assert elapsed < sandbox.timeout_s + 2.0
    assert _peak_rss_mb() - rss0 < 64  # the gigabyte never reached this process
    assert sandbox.stats()["in_flight"] == 0
    assert sandbox.run("calc", "6*7").output == "42\n"


@pytest.mark.parametrize(
    "mode, source, output, kind, error",
    [
        ("calc", "12*(3+4) - 2**3", "76\n", None, ""),
        ("calc", "sqrt(16) + floor(2.5)", "6.0\n", None, ""),
        ("calc", "1/0", "", "exception", "ZeroDivisionError"),
        ("calc", "__import__('os').system('true')", "", "exception", "not allowed"),
        ("calc", "(1).__class__", "", "exception", "not allowed"),
        ("calc", "x = 1", "", "exception", "SyntaxError"),
        (
            "python",
            "s = 0\nfor i in range(5):\n    s += i\nprint('s', s)\ns * 2",
            "s 10\n20\n",
            None,
            "",
        ),
        ("python", "import os", "", "exception", "import is not allowed"),
        (
            "python",
            "().__class__.__bases__",
            "",
            "exception",
            "attribute '__bases__' is not allowed",
        ),
        ("python", "open('/etc/passwd')", "", "exception", "NameError"),
    ],
)
def test_sandbox_modes(sandbox, mode, source, output, kind, error):
    result = sandbox.run(mode, source)
    assert (result.output, result.kind) == (output, kind)
    assert error in result.error


def test_sandbox_children_cannot_write_files(sandbox, tmp_path):
    # The python mode has no open(); even so the child's RLIMIT_FSIZE is 0. Show it with the
    # only writer left, print, by checking nothing appeared where the child runs (cwd=/).
    result = sandbox.run("python", "print(len(str(2**100)))")
    assert result.output == "31\n"
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- search


CORPUS = [
    {"title": "Paris", "text": "Paris is the capital of France, on the Seine."},
    {"title": "Lyon", "text": "Lyon is a city in France known for its food."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany."},
    {"title": "Seine", "text": "The Seine flows through Paris into the English Channel."},
]


def test_bm25_matches_the_formula_by_hand():
    docs = ["a b", "a a c", "c"]
    idx = BM25(docs, k1=1.5, b=0.75)
    avgdl = 2.0
    idf_a = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))
    # doc 1: f(a)=2, |d|=3
    want = idf_a * 2 * 2.5 / (2 + 1.5 * (1 - 0.75 + 0.75 * 3 / avgdl))
    assert idx.scores("a")[1] == pytest.approx(want, rel=1e-12)
    assert idx.scores("zzz") == [0.0, 0.0, 0.0]


def test_search_ranks_and_bounds_its_output():
    tool = SearchTool(CORPUS, top_k=2, passage_chars=20)
    out = tool({"query": "capital of France"})
    # Paris has capital, of and France; Berlin capital and of; Lyon only France.
    assert [line for line in out.splitlines() if line.startswith("[")] == [
        "[1] Paris",
        "[2] Berlin",
    ]
    assert "Paris is the capital ..." in out  # cut to passage_chars
    assert tool({"query": "Seine river"}).startswith("[1] Seine")
    assert tool({"query": "quantum"}) == "no passage matches the query"
    with pytest.raises(ToolError) as e:
        tool({"q": "Paris"})
    assert e.value.kind == "bad_arguments"


def test_corpus_errors_name_the_line(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text("\n".join(json.dumps(p) for p in CORPUS) + "\n")
    assert load_corpus(str(good)) == CORPUS
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CORPUS[0]) + '\n{"title": "x"}\n')
    with pytest.raises(ConfigError, match="line 2 must be an object"):
        load_corpus(str(bad))
    with pytest.raises(ConfigError, match="cannot read the corpus"):
        load_corpus(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- environments

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_match(prompts, completions, answers, **metadata):
    """A test reward: 1 where the last \\boxed{} equals the answer string."""
    out = []
    for c, a in zip(completions, answers):
        found = _BOXED.findall(c)
        out.append(float(bool(found) and found[-1].strip() == a))
    return out


class Exploding:
    name = "explode"

    def schema(self):
        return {"type": "function", "function": {"name": "explode"}}

    def __call__(self, arguments):
        raise RuntimeError("the tool's own bug")

    def close(self):
        pass


class Chatty(Exploding):
    name = "chatty"

    def __call__(self, arguments):
        return "y" * 10_000


def _env_cfg(**overrides) -> ml_collections.ConfigDict:
    cfg = schema.base()
    for k, v in overrides.items():
        cfg.env[k] = v
    return cfg


def _tool_env(sandbox_cfg=None, **kw) -> ToolEnv:
    e = _env_cfg(tool_timeout_s=1.0, tool_memory_mb=256, **(sandbox_cfg or {})).env
    tools = [build_tool("calculator", e), build_tool("python", e), Exploding(), Chatty()]
    return ToolEnv(boxed_match, tools, **kw)


def _run(coro):
    return asyncio.run(coro)


ROW = {"problem": "What is 12*(3+4)?", "answer": "84"}


def test_tool_episode_calls_then_answers():
    env = _tool_env()
    try:
        ep = env.start(ROW)
        call = _call('{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}')
        s1 = _run(ep.step(f"I will compute it. {call}"))
        assert not s1.done and s1.reward is None and not s1.truncated
        assert s1.observation == tool_turn(["84"])
        assert s1.metrics["tools/calls"] == 1 and "tools/errors" not in s1.metrics
        s2 = _run(ep.step("So the answer is \\boxed{84}."))
        assert s2.done and s2.reward == 1.0 and not s2.truncated and s2.observation == ""
        with pytest.raises(RuntimeError, match="after the episode was done"):
            _run(ep.step("again"))
        stats = env.stats()
        assert stats["env/turns"] == 2 and stats["tools/calls"] == 1
        assert stats["env/episodes"] == stats["env/episodes_done"] == 1
    finally:
        env.close()


@pytest.mark.parametrize(
    "body, kind",
    [
        ('{"name": "calculator", "arguments": {"expression": "1/0"}}', "exception"),
        ('{"name": "calculator", "arguments": {"expr": "1"}}', "bad_arguments"),
        ('{"name": "python", "arguments": {"code": "while True: pass"}}', "timeout"),
        ('{"name": "python", "arguments": {"code": "x = [0] * 10**10"}}', "memory"),
        ('{"name": "python", "arguments": {"code": "while True: print(1)"}}', "output"),
        ('{"name": "explode", "arguments": {}}', "exception"),
        ('{"name": "chatty", "arguments": {}}', "output"),
        ('{"name": "shell", "arguments": {"cmd": "ls"}}', "unknown_tool"),
        ('{"name": "calculator", "arguments": {"expression": "1"}', "malformed"),
    ],
)
def test_every_tool_fault_is_an_observation_and_a_counted_kind(body, kind):
    env = _tool_env(max_output_chars=4096)
    try:
        step = _run(env.start(ROW).step(_call(body)))
        assert not step.done  # the episode goes on; the policy reads the error
        (response,) = re.findall(
            r"<tool_response>\n(.*?)\n</tool_response>", step.observation, re.S
        )
        assert response.startswith(f"error ({kind}): ")
        assert step.metrics[f"tools/errors/{kind}"] == 1 and step.metrics["tools/errors"] == 1
        assert env.stats()[f"tools/errors/{kind}"] == 1
    finally:
        env.close()


def test_limits_truncate_and_mark_the_episode():
    call = _call('{"name": "calculator", "arguments": {"expression": "2+2"}}')
    env = _tool_env(max_turns=2, max_tool_calls=8)
    try:
        ep = env.start(ROW)
        assert not _run(ep.step(call)).done
        last = _run(ep.step(call + " \\boxed{84}"))  # turn 2 of 2 still calls a tool
        assert last.done and last.truncated and last.metrics["env/truncated_turns"] == 1
        assert last.reward == 1.0  # scored like a final answer: the boxed answer counts
        assert "tools/calls" not in last.metrics  # its call was not run
        assert env.stats()["env/truncated"] == 1 and env.stats()["tools/calls"] == 1
    finally:
        env.close()
    env = _tool_env(max_turns=8, max_tool_calls=2)
    try:
        ep = env.start(ROW)
        assert not _run(ep.step(call + call)).done  # two calls: the whole budget
        last = _run(ep.step(call))
        assert last.done and last.truncated and last.metrics["env/truncated_tool_calls"] == 1
        assert last.reward == 0.0
    finally:
        env.close()


def test_many_episodes_in_flight_with_bounded_workers():
    """48 episodes step at once on the runner's loop; no more than the sandbox's two
    children ever run together, and every episode gets its own result."""
    env = _tool_env(workers=4)
    sandbox = env.tools["calculator"].sandbox
    n = 48
    with EnvRunner(env, max_in_flight=64) as runner:
        episodes = [runner.start({"problem": f"{i}*{i}", "answer": str(i * i)}) for i in range(n)]
        texts = [
            _call(json.dumps({"name": "calculator", "arguments": {"expression": f"{i}*{i}"}}))
            for i in range(n)
        ]
        steps = runner.step(episodes, texts)
        assert [s.observation for s in steps] == [tool_turn([str(i * i)]) for i in range(n)]
        finals = runner.step(episodes, [f"\\boxed{{{i * i}}}" for i in range(n)])
        assert all(s.done and s.reward == 1.0 for s in finals)
        stats = runner.stats()
    assert sandbox.stats()["max_in_flight"] == 2  # bounded, and the bound was reached
    assert sandbox.stats()["runs"] == n
    assert stats["env/max_in_flight"] > 4  # episodes were in flight together
    assert stats["env/steps"] == 2 * n and stats["env/in_flight"] == 0
    assert stats["tools/calls"] == n and stats["env/episodes_done"] == n


# --------------------------------------------------------------------------- math: one step


def _none_on_skip(prompts, completions, answers, *, completion_lengths, **metadata):
    """None for 'skip' completions; else 1 + the completion's length / 100 and whether the
    prompt (not the problem) reached it."""
    return [
        None if "skip" in c else 1.0 + n / 100 + p.startswith("<prompt>")
        for p, c, n in zip(prompts, completions, completion_lengths)
    ]


@pytest.fixture(scope="module")
def verifier():
    with Verifier(num_workers=1, timeout_s=20.0) as v:
        yield v


def test_math_env_step_equals_the_single_turn_reward_pipeline(verifier):
    """The degenerate one-step environment: stepping with a completion gives exactly the
    reward the single-turn reward pipeline gives that completion (float32, NaN = invalid)."""
    if "test_none_on_skip" not in REWARDS:
        REWARDS.add("test_none_on_skip", _none_on_skip)
    specs = reward_specs("accuracy,format:0.25,test_none_on_skip:0.5")
    reward = build_reward(specs, verifier=verifier)
    answers = ["1/2", "1/2", "3", "3", "x^2+2x+1", "7"]
    completions = [
        "so \\boxed{\\frac{1}{2}}",
        "<think>hm</think> \\boxed{0.5}",
        "the answer is 4, \\boxed{4}",
        "no answer at all",
        "\\boxed{(x+1)^2}",
        "skip this one \\boxed{7}",
    ]
    problems = [f"problem {i}" for i in range(len(answers))]
    prompts = [f"<prompt>{p}</prompt>" for p in problems]
    lengths = [3, 5, 8, 13, 21, 34]
    with RewardPipeline({"reward": reward}) as pipe:
        res = pipe.submit(
            prompts, completions, answers, questions=problems, completion_lengths=lengths
        ).result(timeout=120)
    env = ENVIRONMENTS.get("math")(_env_cfg(name="math"), reward_fn=reward)
    assert isinstance(env, MathEnv) and env.system_prompt() == ""
    with EnvRunner(env) as runner:
        rows = [
            {"problem": q, "prompt": p, "answer": a} for q, p, a in zip(problems, prompts, answers)
        ]
        steps = runner.step([runner.start(r) for r in rows], completions, lengths)
    got = np.array([s.reward for s in steps], np.float32)
    want = np.where(res.valid, res.rewards, np.nan).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert res.valid.tolist() == [True] * 5 + [False]
    # accuracy + 0.25 format + 0.5 (2 + n / 100): every term and the length reached the sum
    terms = [(1, 1), (1, 1), (0, 1), (0, 0), (1, 1)]
    expect = [a + 0.25 * f + 0.5 * (2 + n / 100) for (a, f), n in zip(terms, lengths)]
    np.testing.assert_array_equal(want[:5], np.float32(expect))
    assert all(s.done and not s.truncated and s.observation == "" for s in steps)
    with pytest.raises(RuntimeError, match="after the episode was done"):
        asyncio.run(_twice(env, rows[0]))


async def _twice(env, row):
    ep = env.start(row)
    await ep.step("\\boxed{1}")
    await ep.step("\\boxed{1}")


# --------------------------------------------------------------------------- config


def test_default_config_is_single_turn_and_validates():
    cfg = schema.base()
    assert cfg.env.name == ""
    check_config(cfg)
    with pytest.raises(ConfigError, match="no environment to build"):
        build_env(cfg, reward_fn=boxed_match)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rollout.decoder": "static"}, "the static sampler has no turns"),
        ({"rollout.backend": "jetstream", "anchors.per_group": 1}, "DaGRPO's anchors"),
        ({"anchors.per_group": 1}, "DaGRPO's anchors"),
        ({"reward.judge.name": "rule"}, "a judge's scores"),
    ],
)
def test_env_name_is_refused_in_training_naming_what_its_path_lacks(overrides, match):
    cfg = _env_cfg(name="tool")
    for k, v in overrides.items():
        section, _, key = k.rpartition(".")
        node = cfg
        for part in section.split("."):
            node = node[part]
        node[key] = v
    with pytest.raises(ConfigError, match="multi-turn training is not available") as e:
        envs_environments.check_config(cfg)
    assert re.search(match, str(e.value))
    if k == "anchors.per_group":  # the hook is the trainer's
        with pytest.raises(ConfigError, match=match):
            validate(cfg, 1, checks=CONFIG_CHECKS)


@pytest.mark.parametrize(
    "backend, processes", [("jetstream", 1), ("jetstream_grpc", 1), ("jetstream_grpc", 2)]
)
def test_env_name_on_a_jetstream_backend_validates(backend, processes, monkeypatch):
    """JetStream's backends drive episodes (gjax.rollout.jetstream_episodes); gjax.serve
    replicas in several processes too (each process its own rows; tests/
    test_multihost_jetstream.py). The in-process engine on several processes is refused for
    every run, single-turn too, by the factory."""
    import jax

    from gjax.rollout import factory

    cfg = _env_cfg(name="tool")
    cfg.rollout.backend = backend
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    envs_environments.check_config(cfg)
    if processes > 1:
        cfg.rollout.backend = "jetstream"
        with pytest.raises(ConfigError, match="serves one process's rollouts in that process"):
            factory.make_backend(cfg, None, None)


@pytest.mark.parametrize("name", ["math", "tool"])
@pytest.mark.parametrize("k, rollout_devices", [(0, 0), (1, 0), (2, 0), (1, 4)])
def test_env_name_trains_on_the_local_continuous_path_sync_or_async(name, k, rollout_devices):
    """The path gjax.rollout.episodes trains on: local, continuous, k = 0 (the defaults) or
    k > 0 (the producer thread rolls the episodes out), on the train mesh or on rollout
    devices of their own."""
    cfg = _env_cfg(name=name)
    cfg.rollout.max_staleness = k
    cfg.mesh.rollout_devices = rollout_devices
    envs_environments.check_config(cfg)
    validate(cfg, 8 if rollout_devices else 1, checks=CONFIG_CHECKS)


def test_async_env_run_is_still_refused_where_its_path_lacks_a_piece():
    """k > 0 lifts no other refusal: the message names the missing piece, not staleness."""
    cfg = _env_cfg(name="tool")
    cfg.rollout.max_staleness = 1
    cfg.rollout.decoder = "static"
    with pytest.raises(ConfigError, match="the static sampler has no turns") as e:
        envs_environments.check_config(cfg)
    assert "max_staleness" not in str(e.value)


def test_turn_tokens_beyond_the_trajectory_budget_is_a_config_error():
    cfg = _env_cfg(turn_tokens=10**6)
    with pytest.raises(ConfigError, match="env.turn_tokens=1000000 is more than"):
        validate(cfg, 1, checks=CONFIG_CHECKS)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"name": "chess"}, r"not an environment; valid names: \['math', 'tool'\]"),
        ({"name": "tool", "tools": "calculator,shell"}, "unknown tool 'shell'"),
        ({"name": "tool", "tools": " , "}, "names no tool"),
        ({"name": "tool", "tools": "search"}, "needs config.env.search_corpus"),
        ({"name": "tool", "tools": "calculator,calculator"}, "names a tool twice"),
    ],
)
def test_bad_env_fields_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_config(_env_cfg(**overrides))


def test_build_env_from_config(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(p) for p in CORPUS))
    cfg = _env_cfg(name="tool", tools="calculator,search", search_corpus=str(corpus), max_turns=3)
    env = build_env(cfg, reward_fn=boxed_match)
    try:
        assert isinstance(env, ToolEnv) and sorted(env.tools) == ["calculator", "search"]
        assert env.max_turns == 3 and env.max_tool_calls == cfg.env.max_tool_calls
        prompt = env.system_prompt()
        assert '"name": "calculator"' in prompt and '"name": "search"' in prompt
        step = _run(
            env.start(ROW).step(_call('{"name": "search", "arguments": {"query": "Seine"}}'))
        )
        assert "[1] Seine" in step.observation or "[1] Paris" in step.observation
    finally:
        env.close()
    assert sorted(TOOLS) == ["calculator", "python", "search"]


class _Stuck:
    async def step(self, text, *, length=None):
        await asyncio.Event().wait()  # never set


class _StuckEnv(MathEnv):
    def start(self, row):
        return _Stuck()


def test_closing_the_runner_cancels_steps_in_flight():
    runner = EnvRunner(_StuckEnv(boxed_match), max_in_flight=2)
    futures = [runner.submit(runner.start(ROW), "x") for _ in range(3)]
    deadline = time.monotonic() + 10
    while runner.stats()["env/in_flight"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert runner.stats()["env/in_flight"] == 2  # the third waits for a slot
    runner.close()
    assert all(f.cancelled() for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(_Stuck(), "x")


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


def test_a_sandbox_child_dies_with_its_trainer(tmp_path):
    """A trainer killed with SIGKILL mid-call leaves no tool process looping (PDEATHSIG)."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import threading, time\n"
        "from gjax.envs.sandbox import Sandbox\n"
        "s = Sandbox(timeout_s=60)\n"
        "threading.Thread(target=s.run, args=('python', 'while True: pass'), daemon=True).start()\n"
        "while not s._children: time.sleep(0.01)\n"
        "print(next(iter(s._children)).pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    child = None
    try:
        child = int(trainer.stdout.readline())
        time.sleep(0.3)  # the child has bound itself and loops
        assert _alive(child)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the tool's process outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait()
        if child is not None and _alive(child):  # only after a failure: leave nothing behind
            os.kill(child, signal.SIGKILL)
