"""OpenAIJudge against a real OpenAI-compatible HTTP server on 127.0.0.1 (tests/judge_server.py)."""

from __future__ import annotations

import asyncio
import logging
import pickle

import numpy as np
import pytest

from gjax.rewards.judge import (
    DAGRPO_PROMPT_TEMPLATE,
    JUDGES,
    Judge,
    OpenAIJudge,
    check_template,
    clip_text,
    make_judge,
    parse_score,
    resolve_missing_scores,
)
from tests.judge_server import JudgeServer

KEY = "sk-gjax-test-9f8e7d6c5b4a"


@pytest.fixture(scope="module", autouse=True)
def _warm_client():
    # The first AsyncOpenAI request in a process pays ~1 s of lazy imports; keep that out of
    # the tests' tiny timeouts.
    with JudgeServer() as s:
        asyncio.run(_judge(s).score(["q"], ["warm-up"], ["r"]))


@pytest.fixture
def server():
    with JudgeServer() as s:
        yield s


def _judge(server: JudgeServer, **kw) -> OpenAIJudge:
    args = dict(
        model="judge-model",
        base_url=server.base_url,
        api_key=KEY,
        timeout_s=2.0,
        max_retries=3,
        backoff_base_s=0.001,
        backoff_max_s=0.004,
        seed=0,
    )
    args.update(kw)
    return OpenAIJudge(**args)


def _score(judge: OpenAIJudge, cases: list[str], responses: list[str] | None = None):
    responses = responses or [f"response {i}" for i in range(len(cases))]
    questions = [f"<<case:{c}>> problem" for c in cases]
    return asyncio.run(judge.score(questions, responses, ["reference"] * len(cases)))


def _counts(judge: OpenAIJudge, *names: str) -> dict[str, int]:
    stats = judge.stats()
    return {n: int(stats[n]) for n in names}


# ---------------------------------------------------------------------------------------------
# Parsing, prompt, failure policy (no server).


@pytest.mark.parametrize(
    "text, clamp, reject",
    [
        ("Score: 7", 7.0, 7.0),
        ("The steps are valid but incomplete.\nScore: 6", 6.0, 6.0),
        ("**Score:** 8.5", 8.5, 8.5),
        ("Final score = 4", 4.0, 4.0),
        ("Rating: [[9]]", 9.0, 9.0),
        ("7/10", 7.0, 7.0),
        ("I would give this 3 out of 10.", 3.0, 3.0),
        ("Score: 7/10", 7.0, 7.0),
        ("Score: 3/5", 6.0, 6.0),  # N/D with D != 10 is rescaled
        ('{"score": 7}', 7.0, 7.0),
        ('Here you go: {"reasoning": "ok", "Score": "5"}', 5.0, 5.0),
        ('{"score": 2} ... later Score: 9', 2.0, 2.0),  # JSON wins over keyed text
        ("  8  ", 8.0, 8.0),
        ("Score: 0", 1.0, None),  # out of range: clamp or reject
        ("Score: 11", 10.0, None),
        ('{"score": -3}', 1.0, None),
        ("Score: nan", None, None),
        ('{"score": "high"}', None, None),
        ("The final answer 32 is correct and step 2 is fine.", None, None),  # stray numbers
        ("I cannot grade this.", None, None),
        ("", None, None),
        (None, None, None),
    ],
)
def test_parse_score(text, clamp, reject):
    assert parse_score(text)[0] == clamp
    assert parse_score(text, out_of_range="reject")[0] == reject


def test_parse_score_status_and_bad_policy():
    assert parse_score("Score: 7") == (7.0, "ok")
    assert parse_score("Score: 0") == (1.0, "clamped")
    assert parse_score("Score: 0", out_of_range="reject") == (None, "unparseable")
    with pytest.raises(ValueError, match="out_of_range"):
        parse_score("Score: 7", out_of_range="wrap")


def test_template_checked_and_substitution_is_single_pass(server):
    check_template(DAGRPO_PROMPT_TEMPLATE)
    with pytest.raises(ValueError, match="missing fields \\['reference'\\]"):
        check_template("{question} {response}")
    with pytest.raises(ValueError, match="unknown fields \\['answer'\\]"):
        check_template("{question} {response} {reference} {answer}")
    with pytest.raises(ValueError):
        _judge(server, prompt_template="{question}")
    judge = _judge(server, prompt_template="Q={question} R={response} D={reference} {{json}}")
    msgs = judge.messages("q", "I say {reference} and {question}", "demo")
    assert msgs[-1]["content"] == "Q=q R=I say {reference} and {question} D=demo {json}"
    assert msgs[0]["role"] == "system"


def test_default_prompt_names_the_three_dagrpo_criteria():
    text = DAGRPO_PROMPT_TEMPLATE.lower()
    for criterion in (
        "correctness of the final answer",
        "validity of the reasoning",
        "completeness",
    ):
        assert criterion in text


def test_clip_text_keeps_tail_and_sanitizes():
    text = "A" * 1000 + "\\boxed{42}"
    clipped = clip_text(text, 100)
    assert clipped.endswith("\\boxed{42}") and clipped.startswith("A" * 50)
    assert len(clipped) < 200
    assert clip_text("bad \ud800 surrogate", 100) == "bad ? surrogate"
    assert clip_text(b"bytes", 100) == "b'bytes'"


def test_resolve_missing_scores_policies():
    scores = [8.0, None, 3.0, None]
    rewards = np.array([1.0, 1.0, 0.0, 0.0])
    s, v, scored, m = resolve_missing_scores(scores, on_missing="keep", rewards=rewards)
    np.testing.assert_array_equal(s, [8.0, 10.0, 3.0, 1.0])  # positive -> 10, negative -> 1
    np.testing.assert_array_equal(v, [True] * 4)
    np.testing.assert_array_equal(scored, [True, False, True, False])
    assert m["judge/missing"] == 2 and m["judge/missing_fraction"] == 0.5
    s, v, _, m = resolve_missing_scores(scores, on_missing="drop", fill_value=5.0)
    np.testing.assert_array_equal(v, [True, False, True, False])
    assert np.isfinite(s).all() and m["judge/dropped"] == 2
    s, v, _, _ = resolve_missing_scores(
        [np.nan, 4.0], on_missing="fill", fill_value=5.5, valid=[True, False]
    )
    np.testing.assert_array_equal(s, [5.5, 4.0])
    np.testing.assert_array_equal(v, [True, False])  # fill never changes validity
    with pytest.raises(ValueError, match="needs the rewards"):
        resolve_missing_scores(scores, on_missing="keep")
    with pytest.raises(ValueError, match="on_missing"):
        resolve_missing_scores(scores, on_missing="ignore")


# ---------------------------------------------------------------------------------------------
# Against the server.


def test_good_scores_garbage_and_exact_counters(server):
    server.program("good", ["score:7"])
    server.program("json", ["json:8"])
    server.program("garbage", ["text:lorem ipsum, no grade here"])
    server.program("high", ["score:15"])
    judge = _judge(server)
    assert isinstance(judge, Judge)
    out = _score(judge, ["good", "json", "garbage", "high"])
    assert out == [7.0, 8.0, None, 10.0]
    assert _counts(
        judge,
        "items",
        "scored",
        "missing",
        "calls",
        "retries",
        "unparseable",
        "clamped",
        "failures",
    ) == dict(
        items=4, scored=3, missing=1, calls=4, retries=0, unparseable=1, clamped=1, failures=0
    )
    assert server.requests == 4
    assert judge.stats()["latency_n"] == 4 and judge.stats()["latency_max_s"] > 0
    body = server.bodies[0]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    # An unparseable reply is not cached: asking again costs a request.
    _score(judge, ["garbage"])
    assert server.requests == 5


def test_retries_on_500_429_and_dropped_connections_then_success(server):
    server.program("e500", ["status:500", "status:503", "score:6"])
    server.program("drop", ["drop", "score:4"])
    server.program("rate", ["429:0.25", "score:9"])
    judge = _judge(server)
    assert _score(judge, ["e500", "drop", "rate"]) == [6.0, 4.0, 9.0]
    assert _counts(
        judge,
        "calls",
        "retries",
        "server_errors",
        "connection_errors",
        "rate_limited",
        "failures",
        "scored",
    ) == dict(
        calls=7,
        retries=4,
        server_errors=2,
        connection_errors=1,
        rate_limited=1,
        failures=0,
        scored=3,
    )
    assert server.per_case["e500"] == 3 and server.per_case["drop"] == 2
    # Retry-After honoured: the retry came no earlier than 0.25 s after the 429 (the backoff
    # alone would have waited at most 4 ms).
    times = [t for case, t in server.arrivals if case == "rate"]
    assert len(times) == 2 and times[1] - times[0] >= 0.25


def test_failure_policy_after_retries_exhausted(server):
    server.program("down", ["status:502"])
    server.program("ok", ["score:8"])
    judge = _judge(server, max_retries=2)
    out = _score(judge, ["down", "ok"])
    assert out == [None, 8.0]
    assert _counts(judge, "calls", "retries", "failures", "server_errors", "missing") == dict(
        calls=4, retries=2, failures=1, server_errors=3, missing=1
    )
    assert server.per_case["down"] == 3
    s, v, scored, _ = resolve_missing_scores(out, on_missing="fill", fill_value=5.5)
    np.testing.assert_array_equal(s, [5.5, 8.0])
    np.testing.assert_array_equal(scored, [False, True])
    _, v, _, _ = resolve_missing_scores(out, on_missing="drop")
    np.testing.assert_array_equal(v, [False, True])
    # A failure is not cached: the next batch asks again.
    _score(judge, ["down"])
    assert server.per_case["down"] == 6


def test_client_errors_are_not_retried(server):
    server.program("bad", ["status:400"])
    server.program("badjson", ["badjson"])
    judge = _judge(server)
    assert _score(judge, ["bad", "badjson"]) == [None, None]
    assert _counts(judge, "calls", "retries", "failures", "other_errors") == dict(
        calls=2, retries=0, failures=2, other_errors=2
    )


@pytest.mark.parametrize("status", [401, 403])
def test_rejected_credentials_raise_at_once(status, caplog):
    """A wrong key (the server checks the Bearer token) or a 403: `score` raises
    JudgeAuthError (a user error) after one request per item, and every later call raises
    without a request; the key never appears in the message or the log."""
    from gjax.errors import UserError
    from gjax.rewards.judge import JudgeAuthError

    caplog.set_level(logging.INFO)
    with JudgeServer(api_key="the-right-key" if status == 401 else None) as server:
        server.default = f"status:{status}"
        judge = _judge(server, api_key_env="GJAX_JUDGE_KEY_NAME")
        with pytest.raises(JudgeAuthError, match=rf"rejected the credentials \(HTTP {status}\)"):
            _score(judge, ["a", "b", "c"])
        assert server.requests == 3  # not retried
        with pytest.raises(JudgeAuthError, match=r"GJAX_JUDGE_KEY_NAME") as err:
            _score(judge, ["d"])
        assert server.requests == 3  # no request once the credentials are known bad
    assert isinstance(err.value, UserError)
    assert KEY not in str(err.value) and KEY not in caplog.text


def test_httpx_request_lines_are_quiet(server, caplog):
    """httpx logs one INFO line per request unless quieted; the judge quiets it."""
    caplog.set_level(logging.INFO)
    judge = _judge(server)
    assert _score(judge, ["a", "b"]) == [5.0, 5.0]
    assert server.requests >= 2
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


def test_out_of_range_policy_reaches_the_judge_from_the_config(server):
    from configs import common
    from gjax.rewards.pipeline import build_rewards

    server.program("high", ["score:42"])
    c = common.base()
    c.reward.functions = "format"
    c.reward.judge.name, c.reward.judge.base_url = "openai", server.base_url
    for policy, want in (("clamp", 10.0), ("reject", None)):
        c.reward.judge.out_of_range = policy
        pipe = build_rewards(c, verifier=None)
        try:
            assert pipe.judge.out_of_range == policy
            assert _score(pipe.judge, ["high"]) == [want]
        finally:
            pipe.close()


def test_a_key_pasted_as_the_env_name_is_refused_unshown(tmp_path):
    from configs import common
    from gjax.config import validate
    from gjax.errors import ConfigError
    from gjax.train import CONFIG_CHECKS

    with pytest.raises(ValueError, match="NAME of an environment variable") as err:
        OpenAIJudge(model="m", base_url="http://127.0.0.1:1/v1", api_key_env=KEY)
    assert KEY not in str(err.value)
    c = common.tiny(common.base())
    c.reward.judge.api_key_env = KEY
    with pytest.raises(ConfigError, match=r"config\.reward\.judge\.api_key_env") as err:
        validate(c, 1, checks=CONFIG_CHECKS)
    assert KEY not in str(err.value)
    for name in ("OPENAI_API_KEY", "HF_TOKEN", "MY_JUDGE_KEY_2"):  # real names pass
        c.reward.judge.api_key_env = name
        validate(c, 1, checks=CONFIG_CHECKS)
    c.reward.judge.out_of_range = "wrap"
    with pytest.raises(ConfigError, match=r"judge\.out_of_range"):
        validate(c, 1, checks=CONFIG_CHECKS)


@pytest.mark.slow
def test_train_refuses_a_pasted_key_before_writing_anything(tmp_path):
    """`python -m gjax.train` with a key as reward.judge.api_key_env (or as the field's old
    name): one paragraph, exit 2, the key neither printed nor written (no config.json)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    wd = tmp_path / "run"
    for field in ("reward.judge.api_key_env", "reward.judge_api_key_env"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gjax.train",
                "--config=configs/grpo.py:tiny",
                f"--workdir={wd}",
                f"--config.{field}={KEY}",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert field in proc.stderr and "Traceback" not in proc.stderr
        assert KEY not in proc.stdout + proc.stderr
        assert not (wd / "config.json").exists()


def test_slow_replies_time_out_and_are_retried(server):
    server.program("slow", ["sleep:2.0|score:7", "score:7"])
    server.program("always_slow", ["sleep:2.0|score:7"])
    judge = _judge(server, timeout_s=0.5, max_retries=1)
    assert _score(judge, ["slow", "always_slow"]) == [7.0, None]
    assert _counts(judge, "calls", "retries", "timeouts", "failures") == dict(
        calls=4, retries=2, timeouts=3, failures=1
    )


def test_concurrency_bound_is_never_exceeded(server):
    server.default = "sleep:0.15|score:5"
    judge = _judge(server, max_concurrency=3)
    out = asyncio.run(judge.score(["q"] * 10, [f"distinct {i}" for i in range(10)], ["r"] * 10))
    assert out == [5.0] * 10
    assert server.requests == 10
    assert 2 <= server.max_inflight <= 3


def test_concurrency_bound_holds_during_retries(server):
    server.default = "sleep:0.05|status:500"
    judge = _judge(server, max_concurrency=2, max_retries=2)
    out = asyncio.run(judge.score(["q"] * 6, [f"r{i}" for i in range(6)], ["r"] * 6))
    assert out == [None] * 6
    assert server.requests == 18 == judge.stats()["calls"]
    assert server.max_inflight <= 2


def test_cache_and_inflight_dedup(server):
    judge = _judge(server)
    out = asyncio.run(judge.score(["q"] * 5, ["same answer"] * 5, ["ref"] * 5))
    assert out == [5.0] * 5
    assert server.requests == 1
    assert _counts(judge, "calls", "dedup_hits", "cache_hits", "items") == dict(
        calls=1, dedup_hits=4, cache_hits=0, items=5
    )
    # A later batch (new event loop) hits the cache.
    out = asyncio.run(judge.score(["q", "q"], ["same answer", "other"], ["ref", "ref"]))
    assert out == [5.0, 5.0]
    assert server.requests == 2
    assert _counts(judge, "calls", "cache_hits") == dict(calls=2, cache_hits=1)
    # The key covers the model and the prompt: another model or reference is a new request.
    other = _judge(server, model="another-judge")
    asyncio.run(other.score(["q"], ["same answer"], ["ref"]))
    asyncio.run(judge.score(["q"], ["same answer"], ["another ref"]))
    assert server.requests == 4
    # cache_size=0 disables the cache.
    nocache = _judge(server, cache_size=0)
    for _ in range(2):
        asyncio.run(nocache.score(["q"], ["same answer"], ["ref"]))
    assert server.requests == 6


def test_api_key_never_in_logs_repr_or_pickles(server, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    server.program("down", ["status:500"])
    server.program("garbage", ["text:???"])
    judge = _judge(server, max_retries=1)
    _score(judge, ["down", "garbage", "ok"])
    assert judge.stats()["failures"] == 1
    assert server.auth_headers and all(h == f"Bearer {KEY}" for h in server.auth_headers)
    assert "giving up" in caplog.text  # the failure was logged ...
    assert KEY not in caplog.text  # ... without the key
    for text in (repr(judge), str(judge), repr(judge.__dict__), str(judge.stats())):
        assert KEY not in text
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(judge)
    with pytest.raises(TypeError, match="API key"):
        pickle.dumps(judge._api_key)
    # From an environment variable named in the config.
    monkeypatch.setenv("GJAX_TEST_JUDGE_KEY", "sk-from-env-123")
    env_judge = _judge(server, api_key=None, api_key_env="GJAX_TEST_JUDGE_KEY")
    _score(env_judge, ["ok"], ["env"])
    assert server.auth_headers[-1] == "Bearer sk-from-env-123"
    assert "sk-from-env-123" not in repr(env_judge) + caplog.text


def test_config_errors(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):
        OpenAIJudge(model="gpt-4o")
    with pytest.raises(ValueError, match="model"):
        OpenAIJudge(model="", base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="max_concurrency"):
        OpenAIJudge(model="m", base_url="http://127.0.0.1:1/v1", max_concurrency=0)
    with pytest.raises(ValueError, match="unknown OpenAIJudge config keys \\['modle'\\]"):
        OpenAIJudge.from_config({"modle": "m"})
    judge = make_judge("openai", {"model": "m", "base_url": "http://127.0.0.1:1/v1"})
    assert isinstance(judge, OpenAIJudge) and "openai" in JUDGES
    with pytest.raises(KeyError, match="valid names"):
        make_judge("gpt5-magic")
    with pytest.raises(ValueError, match="one question and one reference per response"):
        asyncio.run(judge.score(["q"], ["a", "b"], ["r", "r"]))


def test_giant_and_invalid_utf8_responses_are_sent(server):
    judge = _judge(server, max_chars=1000)
    out = _score(judge, ["ok", "ok"], ["x" * 1_000_000 + "\\boxed{1}", "bad \udcff text"])
    assert out == [5.0, 5.0]
    sent = [b["messages"][-1]["content"] for b in server.bodies]
    assert all(len(s) < 5000 for s in sent)
    assert any("\\boxed{1}" in s for s in sent)
