"""The async reward pipeline: overlap with device work (by ordering, not wall-clock), failures."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.rewards.judge import OpenAIJudge
from gjax.rewards.pipeline import (
    JudgeUnavailableError,
    PipelineResult,
    RewardPipeline,
    RewardPipelineError,
)
from tests.judge_server import JudgeServer

B = 4
PROMPTS = [f"p{i // 2}" for i in range(B)]
COMPLETIONS = ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{3}"]
ANSWERS = ["1", "1", "3", "3"]
REFS = ["demo"] * B


def exact_match(prompts, completions, answers, *, completion_lengths, **metadata):
    return [float(c == f"\\boxed{{{a}}}") for c, a in zip(completions, answers)]


async def length_bonus(prompts, completions, answers, *, completion_lengths, **metadata):
    await asyncio.sleep(0)
    return [0.01 * n for n in completion_lengths]


class ScriptedJudge:
    """A judge whose reply waits for `release`; records when it started and on which thread."""

    def __init__(self, scores=None, fail=False):
        self.started = threading.Event()
        self.release = threading.Event()
        self.started_at = None
        self.scores = scores
        self.fail = fail
        self.calls = 0

    async def score(self, questions, responses, references):
        self.calls += 1
        self.started_at = time.perf_counter()
        self.started.set()
        while not self.release.is_set():  # a slow judge, as long as the test wants
            await asyncio.sleep(0.001)
        if self.fail:
            raise ConnectionError("judge endpoint down")
        return list(self.scores) if self.scores is not None else [5.0] * len(responses)


def test_rewards_overlap_device_work():
    """The judge runs while the device computes; result() is called after the device work."""
    judge = ScriptedJudge(scores=[9.0, 2.0, 8.0, 7.0])

    @jax.jit
    def device_logps(x):  # stands in for old/ref log-probs: a computation of known length
        for _ in range(4):
            x = jnp.tanh(x @ x.T) @ x
        return jax.nn.log_softmax(x, axis=-1)

    x = jnp.ones((64, 64)) / 64
    device_logps(x).block_until_ready()  # compile outside the step
    with RewardPipeline({"acc": exact_match}, judge=judge) as pipe:
        handle = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS)
        assert not handle.done()  # submit returned before the rewards were ready
        out = device_logps(x)  # dispatch device work ...
        # ... the judge is already running concurrently (it would never start if the pipeline
        # only worked inside result()):
        assert judge.started.wait(timeout=30)
        out.block_until_ready()
        device_end = time.perf_counter()
        judge.release.set()
        res = handle.result(timeout=30)
    t = res.timings
    assert judge.started_at < device_end
    assert t.submit <= t.start < judge.started_at < device_end < t.wait_begin
    assert t.start < t.wait_begin <= t.wait_end and t.end <= t.wait_end
    # overlap_s = min(end, wait_begin) - start: everything before the caller waited.
    assert res.metrics["rewards/overlap_s"] == pytest.approx(min(t.end, t.wait_begin) - t.start)
    assert res.metrics["rewards/overlap_s"] >= device_end - judge.started_at > 0
    assert 0 < res.metrics["rewards/overlap_frac"] <= 1
    assert res.metrics["rewards/wall_s"] == pytest.approx(t.end - t.start)
    assert res.metrics["rewards/wait_s"] == pytest.approx(t.wait_end - t.wait_begin)
    np.testing.assert_array_equal(res.rewards, [1, 0, 1, 1])
    np.testing.assert_array_equal(res.scores, [9, 2, 8, 7])
    assert res.scored.all() and res.valid.all()
    g = res.grouped(2)
    assert g["rewards_PxG"].shape == (2, 2) and g["scores_PxG"][0].tolist() == [9.0, 2.0]


def test_reward_functions_and_judge_run_concurrently():
    """An async reward function that needs the judge to have started proves they overlap."""
    judge = ScriptedJudge()

    async def waits_for_judge(prompts, completions, answers, *, completion_lengths, **metadata):
        while not judge.started.is_set():
            await asyncio.sleep(0.001)
        judge.release.set()
        return [1.0] * len(completions)

    with RewardPipeline({"w": waits_for_judge}, judge=judge) as pipe:
        res = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS).result(timeout=30)
    assert res.valid.all() and res.scored.all()
    assert res.timings.started["w"] <= res.timings.end
    assert res.timings.started["judge"] <= res.timings.end


def test_weights_sync_async_and_off_loop_execution():
    threads = {}

    def sync_fn(prompts, completions, answers, *, completion_lengths, **metadata):
        threads["sync"] = threading.current_thread().name
        assert metadata == {"step": 3}
        return exact_match(prompts, completions, answers, completion_lengths=completion_lengths)

    with RewardPipeline(
        {"acc": sync_fn, "len": length_bonus}, weights={"acc": 2.0, "len": 1.0}
    ) as pipe:
        res = pipe.submit(
            PROMPTS, COMPLETIONS, ANSWERS, completion_lengths=[10, 20, 30, 40], step=3
        ).result()
    np.testing.assert_allclose(res.rewards, [2.1, 0.2, 2.3, 2.4], rtol=1e-6)
    np.testing.assert_allclose(res.per_fn["len"], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    assert res.scores is None and res.scored is None
    assert threads["sync"].startswith("gjax-reward") and threads["sync"] != "gjax-reward-loop"
    assert res.metrics["rewards/acc_mean"] == pytest.approx(0.75)
    assert "rewards/time_acc_s" in res.metrics and "rewards/time_len_s" in res.metrics


def test_failing_reward_fn_is_counted_and_never_kills_the_loop(caplog):
    state = {"n": 0}

    def flaky(prompts, completions, answers, *, completion_lengths, **metadata):
        state["n"] += 1
        if state["n"] in (2, 3):
            raise RuntimeError(f"verifier crashed on call {state['n']}")
        return [1.0] * len(completions)

    def nan_item(prompts, completions, answers, *, completion_lengths, **metadata):
        return [0.0, None, np.nan, 1.0]

    with (
        caplog.at_level(logging.ERROR),
        RewardPipeline({"flaky": flaky, "nan": nan_item}, max_consecutive_failures=3) as pipe,
    ):
        r1 = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
        r2 = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
        r3 = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
        r4 = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
    np.testing.assert_array_equal(r1.valid, [True, False, False, True])  # None/NaN -> invalid
    assert r1.metrics["rewards/nonfinite"] == 2
    assert not r2.valid.any() and not r3.valid.any()  # on_reward_error='invalid'
    assert np.all(r2.rewards == 0) and np.isnan(r2.per_fn["flaky"]).all()
    assert r3.metrics["rewards/consecutive_failures"] == 2
    np.testing.assert_array_equal(r4.valid, r1.valid)  # recovered
    assert r4.metrics["rewards/consecutive_failures"] == 0
    assert r4.metrics["rewards/fn_failures"] == 2 and r4.metrics["rewards/failed_batches"] == 2
    assert "verifier crashed on call 2" in caplog.text


def test_zero_policy_keeps_samples():
    state = {"n": 0}

    def flaky(prompts, completions, answers, *, completion_lengths, **metadata):
        state["n"] += 1
        if state["n"] == 2:
            raise RuntimeError("boom")
        return [1.0] * len(completions)

    with RewardPipeline({"flaky": flaky, "acc": exact_match}, on_reward_error="zero") as pipe:
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
        res = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
    assert res.valid.all()
    np.testing.assert_array_equal(res.rewards, [1, 0, 1, 1])


def test_consecutive_failures_raise_a_clear_error():
    state = {"n": 0}

    def dies(prompts, completions, answers, *, completion_lengths, **metadata):
        state["n"] += 1
        if state["n"] > 1:
            raise OSError("disk full")
        return [0.0] * len(completions)

    with RewardPipeline({"dies": dies}, max_consecutive_failures=2) as pipe:
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()  # 1st failure: counted
        handle = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS)
        with pytest.raises(RewardPipelineError, match="2 consecutive batches.*disk full"):
            handle.result()
        with pytest.raises(RewardPipelineError):  # the handle keeps its error
            handle.result()


def test_first_call_errors_fail_fast():
    def wrong_signature(completions, answers):  # a programming error
        return [0.0] * len(completions)

    with (
        RewardPipeline({"bad": wrong_signature}) as pipe,
        pytest.raises(RewardPipelineError, match="'bad' raised TypeError.*first call"),
    ):
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()

    def wrong_length(prompts, completions, answers, *, completion_lengths, **metadata):
        return [1.0]

    with RewardPipeline({"short": wrong_length}, fail_fast_first_call=False) as pipe:
        res = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS).result()
    assert not res.valid.any() and res.metrics["rewards/batch_errors"] == 1


def test_judge_that_raises_gives_missing_scores_by_policy():
    judge = ScriptedJudge(fail=True)
    judge.release.set()
    with RewardPipeline(
        {"acc": exact_match}, judge=judge, on_missing="keep", fail_fast_first_call=False
    ) as pipe:
        res = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS).result()
    assert not res.scored.any() and res.valid.all()
    np.testing.assert_array_equal(res.scores, [10, 1, 10, 10])  # reward-consistent extremes
    assert res.metrics["rewards/judge_failures"] == 1
    assert res.metrics["judge/missing"] == 4

    judge = ScriptedJudge(scores=[7.0, None, 3.0, None])
    judge.release.set()
    with RewardPipeline({"acc": exact_match}, judge=judge, on_missing="drop") as pipe:
        res = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS).result()
    np.testing.assert_array_equal(res.valid, [True, False, True, False])
    np.testing.assert_array_equal(res.rewards, [1, 0, 1, 0])
    assert res.metrics["judge/dropped"] == 2

    judge = ScriptedJudge(fail=True)
    judge.release.set()
    with (
        RewardPipeline({"acc": exact_match}, judge=judge) as pipe,
        pytest.raises(RewardPipelineError, match="judge raised ConnectionError"),
    ):
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS).result()


def test_openai_judge_inside_the_pipeline():
    """The real client on the pipeline's loop thread, with one item whose endpoint fails."""
    with JudgeServer() as server:
        server.program("down", ["status:500"])
        server.program("flaky", ["status:503", "score:6"])
        judge = OpenAIJudge(
            model="m",
            base_url=server.base_url,
            api_key="k",
            timeout_s=5,
            max_retries=1,
            backoff_base_s=0.001,
            backoff_max_s=0.002,
        )
        questions = ["<<case:down>>", "<<case:flaky>>", "q", "q"]
        with RewardPipeline(
            {"acc": exact_match}, judge=judge, on_missing="fill", fill_value=4.0
        ) as pipe:
            r1 = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS, questions=questions).result(60)
            r2 = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS, questions=questions).result(60)
        for r in (r1, r2):
            np.testing.assert_array_equal(r.scores, [4.0, 6.0, 5.0, 5.0])
            np.testing.assert_array_equal(r.scored, [False, True, True, True])
            assert r.valid.all()
    stats = judge.stats()
    # Batch 1: items 3 and 4 are identical (one request); "down" fails twice, "flaky" retries.
    # Batch 2: "down" is asked again (failures are not cached), the rest come from the cache.
    counts = {k: stats[k] for k in ("items", "calls", "failures", "cache_hits", "dedup_hits")}
    assert counts == dict(items=8, calls=7, failures=2, cache_hits=3, dedup_hits=1)
    assert server.requests == 7
    # Metrics count per batch (a resumed run logs what an uninterrupted one would).
    assert r1.metrics["judge/items"] == r2.metrics["judge/items"] == 4
    assert r1.metrics["judge/calls"] + r2.metrics["judge/calls"] == 7


def test_submit_validation_and_close():
    judge = ScriptedJudge()
    judge.release.set()
    pipe = RewardPipeline({"acc": exact_match}, judge=judge)
    with pytest.raises(ValueError, match="needs `references`"):
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS)
    with pytest.raises(ValueError, match="4 completions but"):
        pipe.submit(PROMPTS[:3], COMPLETIONS, ANSWERS, REFS)
    handle = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS)
    pipe.close()  # waits for the pending batch
    assert handle.done() and isinstance(handle.result(), PipelineResult)
    assert not pipe._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS)
    with pytest.raises(ValueError, match="reserved"):
        RewardPipeline({"judge": exact_match})
    with pytest.raises(ValueError, match="unknown reward functions"):
        RewardPipeline({"acc": exact_match}, weights={"ac": 1.0})
    with pytest.raises(TypeError, match="Judge protocol"):
        RewardPipeline({"acc": exact_match}, judge=object())


def test_combined_reward_from_the_registry():
    from gjax.rewards.functions import REWARDS, build_reward

    if "format" not in REWARDS:
        pytest.skip("registry has no 'format' reward")
    reward = build_reward([{"name": "format"}])
    with RewardPipeline(reward) as pipe:
        res = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, completion_lengths=[3] * B).result()
    assert res.rewards.shape == (B,) and res.valid.shape == (B,)
    assert any(k.startswith("rewards/format") for k in res.metrics)
    # One name per figure: the terms' means are the CombinedReward's, the total's the pipeline's.
    m = res.metrics
    assert m["rewards/format/mean"] == m["rewards/mean"] == float(res.rewards[res.valid].mean())
    assert m["rewards/valid_fraction"] == float(res.valid.mean())
    assert not {"rewards/reward_mean", "rewards/total/mean", "rewards/valid_frac"} & set(m)


@pytest.mark.slow
def test_end_to_end_verifier_and_openai_judge_overlap_device():
    """The real stack: math-verify accuracy (process pool) + OpenAIJudge over HTTP || jax."""
    from gjax.rewards.functions import build_reward
    from gjax.rewards.verifier import Verifier

    @jax.jit
    def device_logps(x):
        return jax.nn.log_softmax(jnp.tanh(x @ x.T) @ x, axis=-1)

    x = jnp.ones((32, 32)) / 32
    device_logps(x).block_until_ready()
    completions = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{2}", "garbage"]
    answers = ["1/2"] * 4
    with (
        JudgeServer(default="sleep:0.05|score:8") as server,
        Verifier(num_workers=1, timeout_s=60.0) as verifier,
    ):
        judge = OpenAIJudge(model="m", base_url=server.base_url, api_key="k", timeout_s=30)
        reward = build_reward([{"name": "accuracy"}], verifier=verifier)
        with RewardPipeline({"reward": reward}, judge=judge) as pipe:
            handle = pipe.submit(["p"] * 4, completions, answers, REFS, completion_lengths=[5] * 4)
            device_logps(x).block_until_ready()
            res = handle.result(timeout=120)
    np.testing.assert_array_equal(res.rewards, [1, 1, 0, 0])
    np.testing.assert_array_equal(res.scores, [8, 8, 8, 8])
    assert res.valid.all() and res.scored.all()
    assert res.metrics["judge/calls"] == 4 and server.requests == 4
    # (Ordering/overlap is asserted deterministically in test_rewards_overlap_device_work.)
    assert 0 <= res.metrics["rewards/overlap_frac"] <= 1


def _openai_judge(server, **kw):
    args = dict(model="judge", base_url=server.base_url, api_key="k", max_retries=0, timeout_s=5)
    return OpenAIJudge(**{**args, **kw})


def test_rejected_judge_credentials_stop_at_once():
    """HTTP 401 from the judge (a wrong key): the first batch's result() raises JudgeAuthError,
    even with fail_fast_first_call=False, instead of training on filled-in scores."""
    from gjax.rewards.judge import JudgeAuthError

    with JudgeServer(api_key="right") as server:
        judge = _openai_judge(server, api_key="wrong")
        with RewardPipeline({"acc": exact_match}, judge=judge, fail_fast_first_call=False) as pipe:
            handle = pipe.submit(PROMPTS, COMPLETIONS, ANSWERS, REFS)
            with pytest.raises(JudgeAuthError, match=r"rejected the credentials \(HTTP 401\)"):
                handle.result(timeout=60)
            with pytest.raises(JudgeAuthError):  # the handle keeps its error
                handle.result()


def test_score_metrics_count_real_scores_and_a_silent_judge_stops_the_run():
    """judge/score_mean averages the scores that arrived (filled ones are counted apart); a
    judge missing more than max_missing_fraction of its scores for max_missing_batches
    batches in a row stops the run; one good batch resets the count."""
    with JudgeServer() as server:
        server.program("up", ["score:3"])
        server.program("down", ["status:500"])
        judge = _openai_judge(server)
        pipe = RewardPipeline(
            {"acc": exact_match},
            judge=judge,
            on_missing="keep",
            max_missing_fraction=0.5,
            max_missing_batches=2,
        )
        with pipe:

            def batch(cases, tag):
                qs = [f"<<case:{c}>> q" for c in cases]
                comps = [f"{c} {tag}" for c in COMPLETIONS]  # fresh items: no cache hits
                return pipe.submit(PROMPTS, comps, ANSWERS, REFS, questions=qs).result(60)

            res = batch(["up", "down", "down", "down"], 0)  # 3/4 missing: bad batch 1
            m = res.metrics
            assert m["judge/score_mean"] == 3.0  # not pulled up by the filled-in 10s and 1s
            assert (m["judge/scored"], m["judge/missing"], m["judge/filled"]) == (1, 3, 3)
            res = batch(["up", "up", "down", "down"], 1)  # 1/2 missing: not above the bound
            assert res.metrics["judge/score_mean"] == 3.0
            batch(["down"] * 4, 2)  # bad batch 1 again
            with pytest.raises(JudgeUnavailableError, match=r"2 consecutive batches"):
                batch(["down"] * 4, 3)
