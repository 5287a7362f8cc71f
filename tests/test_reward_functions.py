"""Reward functions: registry, built-ins (accuracy, format), DAPO's overlong penalty,
combination, faults."""

from __future__ import annotations

import asyncio
import logging
import threading

import ml_collections
import numpy as np
import pytest

from gjax.rewards.functions import (
    REWARDS,
    RewardFunctionError,
    RewardSpec,
    build_reward,
    format_ok,
    soft_overlong_penalty,
)
from gjax.rewards.verifier import Verifier


@pytest.fixture(scope="module")
def verifier():
    with Verifier(num_workers=1, timeout_s=20.0) as v:
        yield v


def _register(name, fn):
    """Register a test reward once per process (the registry refuses duplicates)."""
    if name not in REWARDS:
        REWARDS.add(name, fn)
    return name


def _length_ramp(
    prompts,
    completions,
    answers,
    *,
    completion_lengths,
    max_length: int,
    cache_length: int,
    **metadata,
):
    """A reward of the lengths, with required config (DAPO's ramp, as a test function)."""
    del prompts, answers, metadata
    if completion_lengths is None:
        raise TypeError("the 'test_length_ramp' reward needs completion_lengths")
    if len(completion_lengths) != len(completions):
        raise ValueError(f"{len(completion_lengths)} completion_lengths")
    return soft_overlong_penalty(
        completion_lengths, max_length=max_length, cache_length=cache_length
    )


RAMP = _register("test_length_ramp", _length_ramp)


def _batch(n=4):
    return ["p"] * n, [rf"\boxed{{{i}}}" for i in range(n)], [str(i) for i in range(n)]


# ------------------------------------------------------------------ DAPO overlong


def test_soft_overlong_penalty_golden():
    # L_max = 20, L_cache = 5: free up to 15, then a linear ramp to -1 at 20 (DAPO eq. (13)).
    got = soft_overlong_penalty([0, 15, 16, 18, 20, 21, 100], max_length=20, cache_length=5)
    np.testing.assert_allclose(got, [0, 0, -0.2, -0.6, -1, -1, -1], rtol=0, atol=1e-7)
    assert got.dtype == np.float32
    # cache_length == max_length: the ramp starts at 0.
    np.testing.assert_allclose(
        soft_overlong_penalty([0, 5, 10], max_length=10, cache_length=10), [0, -0.5, -1]
    )
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty([1], max_length=4, cache_length=5)
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty([1], max_length=4, cache_length=0)


def test_overlong_has_one_entry_point():
    """DAPO's shaping is set by config.sampling.overlong_*; the retired reward function's name
    is refused with a pointer there."""
    from configs import common
    from gjax.errors import ConfigError
    from gjax.rewards.pipeline import check_config

    assert "overlong" not in REWARDS
    c = common.tiny(common.base())
    c.reward.functions = "accuracy,overlong:1.0"
    with pytest.raises(ConfigError, match=r"retired.*sampling\.overlong_buffer.*overlong_penalty"):
        check_config(c)


def test_a_reward_of_the_lengths_needs_them():
    reward = build_reward([{"name": RAMP, "max_length": 8, "cache_length": 4}])
    p, c, a = _batch(3)
    out = reward.compute(p, c, a, completion_lengths=[2, 6, 9])
    np.testing.assert_allclose(out.rewards_B, [0.0, -0.5, -1.0])
    reward2 = build_reward([{"name": RAMP, "max_length": 8, "cache_length": 4}])
    with pytest.raises(RewardFunctionError, match="completion_lengths"):
        reward2.compute(p, c, a)  # a programming error on the first call: fail fast
    with pytest.raises(ValueError, match="completion_lengths has shape"):
        reward.compute(p, c, a, completion_lengths=[1, 2])


# ------------------------------------------------------------------ format


@pytest.mark.parametrize(
    "text, require_think, ok",
    [
        (r"<think>a</think> so \boxed{1}", False, True),
        (r"<think>a</think><answer>1</answer>", True, True),
        (r"reasoning</think> \boxed{1}", True, True),  # <think> opened by the template
        (r"\boxed{1}", False, True),
        (r"\boxed{1}", True, False),  # no think block when one is required
        (r"<think>a</think> no answer", False, False),
        (r"\boxed{1} <think>a</think>", False, False),  # the answer must follow the thinking
        (r"<think>a<think>b</think> \boxed{1}", False, False),  # two opens
        (r"<think>a</think></think> \boxed{1}", False, False),  # two closes
        (r"</think> x <think> \boxed{1}", False, False),  # closed before opened
        (r"<think>never closed \boxed{1}", False, False),
        (r"<think>a</think> \boxed{\frac{1}{2}", False, False),  # unbalanced box
    ],
)
def test_format_ok(text, require_think, ok):
    assert format_ok(text, require_think=require_think) is ok


def test_format_reward_values():
    reward = build_reward(["format"])
    out = reward.compute(
        ["p"] * 3, [r"<think>x</think>\boxed{2}", "none", None], ["2"] * 3, completion_lengths=None
    )
    np.testing.assert_array_equal(out.rewards_B, [1.0, 0.0, 0.0])


# ------------------------------------------------------------------ accuracy and combination


def test_weighted_combination_golden(verifier):
    reward = build_reward(
        [
            "accuracy",
            ("format", 0.5),
            {"name": RAMP, "weight": 2.0, "kwargs": {"max_length": 10, "cache_length": 4}},
        ],
        verifier=verifier,
    )
    assert reward.names == ["accuracy", "format", RAMP]
    completions = [
        r"<think>x</think> \boxed{\dfrac{1}{2}}",  # right, formatted, short
        r"\boxed{3}",  # wrong, formatted, in the ramp: (6 - 8) / 4 = -0.5
        "I give up",  # wrong, unformatted, over the limit: -1
    ]
    out = reward.compute(
        ["q"] * 3, completions, ["0.5", "2", "1"], completion_lengths=np.array([5, 8, 12])
    )
    np.testing.assert_allclose(out.components["accuracy"], [1, 0, 0])
    np.testing.assert_allclose(out.components["format"], [1, 1, 0])
    np.testing.assert_allclose(out.components[RAMP], [0, -0.5, -1])
    np.testing.assert_allclose(out.rewards_B, [1.5, -0.5, -2.0], rtol=0, atol=1e-6)
    assert out.rewards_B.dtype == np.float32 and out.valid_B.all()
    assert out.metrics["rewards/accuracy/mean"] == pytest.approx(1 / 3)
    assert out.rewards_B[out.valid_B].mean() == pytest.approx(-1 / 3, abs=1e-6)
    # The total's mean and the valid fraction are the pipeline's (rewards/mean, valid_fraction).
    assert not {"rewards/valid_frac", "rewards/total/mean"} & set(out.metrics)
    assert reward.stats()["rewards/accuracy/calls"] == 1


def test_user_sync_and_async_functions():
    def length_bonus(prompts, completions, answers, *, completion_lengths, scale=1.0, **metadata):
        return [scale * len(c) for c in completions]

    async def uses_metadata(prompts, completions, answers, *, completion_lengths, **metadata):
        await asyncio.sleep(0)
        return [float(r == a) for r, a in zip(metadata["references"], answers)]

    _register("test_length_bonus", length_bonus)
    _register("test_uses_metadata", uses_metadata)
    reward = build_reward(
        [{"name": "test_length_bonus", "scale": 0.5}, ("test_uses_metadata", 2.0)]
    )
    out = reward.compute(
        ["p", "p"], ["ab", "abcd"], ["x", "y"], completion_lengths=None, references=["x", "z"]
    )
    np.testing.assert_allclose(out.rewards_B, [0.5 * 2 + 2.0, 0.5 * 4])


def test_sync_functions_do_not_block_the_event_loop():
    # The sync term waits for an event that only the async term sets: if the sync function
    # ran on the event loop thread, the async one could not run and the wait would time out.
    ready = threading.Event()

    def waits(prompts, completions, answers, *, completion_lengths, **metadata):
        if not ready.wait(timeout=20):
            raise AssertionError("the async reward never ran: the loop was blocked")
        return [1.0] * len(completions)

    async def sets(prompts, completions, answers, *, completion_lengths, **metadata):
        await asyncio.sleep(0.01)
        ready.set()
        return [1.0] * len(completions)

    _register("test_waits", waits)
    _register("test_sets", sets)
    out = build_reward(["test_waits", "test_sets"]).compute(*_batch(2))
    np.testing.assert_array_equal(out.rewards_B, [2.0, 2.0])


# ------------------------------------------------------------------ failure policy


def _flaky(fail_on):
    """A reward that raises RuntimeError on the calls listed in ``fail_on`` (0-based)."""
    calls = {"n": 0}

    def fn(prompts, completions, answers, *, completion_lengths, **metadata):
        n = calls["n"]
        calls["n"] += 1
        if n in fail_on:
            raise RuntimeError(f"service down (call {n})")
        return [1.0] * len(completions)

    return fn


@pytest.mark.parametrize("policy", ["zero", "invalid"])
def test_raising_function_is_counted_not_raised(policy, caplog):
    name = _register(f"test_flaky_{policy}", _flaky(fail_on={0, 2}))
    _register("test_const", lambda prompts, completions, answers, **metadata: [0.25] * len(answers))
    reward = build_reward([name, "test_const"], on_error=policy)
    p, c, a = _batch(3)
    with caplog.at_level(logging.ERROR, logger="gjax.rewards.functions"):
        first = reward.compute(p, c, a)  # a RuntimeError on the first call is not a bug: counted
    assert "service down (call 0)" in caplog.text and "RuntimeError" in caplog.text
    second = reward.compute(p, c, a)
    third = reward.compute(p, c, a)
    for out in (first, third):
        assert np.isnan(out.components[name]).all()
        assert out.metrics[f"rewards/{name}/failed"] == 1.0
        if policy == "zero":
            np.testing.assert_allclose(out.rewards_B, [0.25] * 3)
            assert out.valid_B.all()
        else:
            np.testing.assert_array_equal(out.rewards_B, [0.0] * 3)
            assert not out.valid_B.any()
            assert out.valid_B.mean() == 0.0
    np.testing.assert_allclose(second.rewards_B, [1.25] * 3)
    assert second.valid_B.all()
    s = reward.stats()
    assert s[f"rewards/{name}/calls"] == 3 and s[f"rewards/{name}/failures"] == 2


@pytest.mark.parametrize("policy", ["zero", "invalid"])
def test_unscored_items(policy):
    def partial(prompts, completions, answers, *, completion_lengths, **metadata):
        return [1.0, None, float("nan"), 3.0]

    name = _register("test_partial", partial)
    out = build_reward([name], on_error=policy).compute(*_batch(4))
    assert out.metrics[f"rewards/{name}/invalid_items"] == 2.0
    if policy == "zero":
        np.testing.assert_array_equal(out.rewards_B, [1.0, 0.0, 0.0, 3.0])
        assert out.valid_B.all()
    else:
        np.testing.assert_array_equal(out.valid_B, [True, False, False, True])
        np.testing.assert_array_equal(out.rewards_B, [1.0, 0.0, 0.0, 3.0])
    assert out.metrics[f"rewards/{name}/mean"] == 2.0


def test_programming_errors_fail_fast_on_first_call_only():
    state = {"n": 0}

    def buggy(prompts, completions, answers, *, completion_lengths, **metadata):
        state["n"] += 1
        if state["n"] == 1:
            return [1.0] * (len(completions) + 1)  # wrong length
        if state["n"] == 3:
            return None.shape  # AttributeError, after one success
        return [1.0] * len(completions)

    name = _register("test_buggy", buggy)
    reward = build_reward([name])
    with pytest.raises(RewardFunctionError, match="first call.*shape"):
        reward.compute(*_batch(2))
    np.testing.assert_array_equal(reward.compute(*_batch(2)).rewards_B, [1.0, 1.0])
    out = reward.compute(*_batch(2))  # the later bug is counted, not raised
    assert out.metrics[f"rewards/{name}/failed"] == 1.0

    def not_numbers(prompts, completions, answers, **metadata):
        return "yes"

    with pytest.raises(RewardFunctionError, match="sequence of 2 floats"):
        build_reward([_register("test_not_numbers", not_numbers)]).compute(*_batch(2))

    def typo(prompts, completions, answers, **metadata):
        return [undefined_name] * len(completions)  # noqa: F821

    with pytest.raises(RewardFunctionError, match="NameError"):
        build_reward([_register("test_typo", typo)]).compute(*_batch(2))


# ------------------------------------------------------------------ build-time validation


def test_bad_specs_fail_at_build_time(verifier):
    with pytest.raises(KeyError, match="valid names: .*accuracy.*format"):
        build_reward(["acuracy"])
    with pytest.raises(RewardFunctionError, match="needs a Verifier"):
        build_reward(["accuracy"])
    with pytest.raises(RewardFunctionError, match="max_length"):
        build_reward([RAMP])  # missing required config
    with pytest.raises(RewardFunctionError, match="unknown config kwargs"):
        build_reward([{"name": "format", "requires_think": True}])

    def no_metadata(prompts, completions, answers, *, completion_lengths):
        return [0.0] * len(answers)

    with pytest.raises(RewardFunctionError, match=r"\*\*metadata"):
        build_reward([_register("test_no_metadata", no_metadata)])

    def too_many(prompts, completions, answers, extra, **metadata):
        return [0.0] * len(answers)

    with pytest.raises(RewardFunctionError, match="does not fit"):
        build_reward([_register("test_too_many", too_many)])
    with pytest.raises(ValueError, match="duplicate"):
        build_reward(["format", "format"])
    assert build_reward(["format"]).on_error == "invalid"  # the documented default
    with pytest.raises(ValueError, match="on_error"):
        build_reward(["format"], on_error="ignore")
    with pytest.raises(ValueError, match="non-finite weight"):
        build_reward([("format", float("nan"))])
    with pytest.raises(ValueError, match="one of each"):
        build_reward(["format"]).compute(["p"], ["a", "b"], ["1", "2"])
    with pytest.raises(ValueError, match="already registered"):
        REWARDS.add("accuracy", lambda *a, **k: None)


def test_spec_forms():
    assert RewardSpec.parse("format") == RewardSpec("format", 1.0, {})
    assert RewardSpec.parse(("format", 0.5)) == RewardSpec("format", 0.5, {})
    assert RewardSpec.parse((RAMP, 1, {"max_length": 3})).kwargs == {"max_length": 3}
    cfg = ml_collections.ConfigDict(
        {"name": RAMP, "weight": 2.0, "max_length": 16, "cache_length": 4}
    )
    spec = RewardSpec.parse(cfg)
    assert spec == RewardSpec(RAMP, 2.0, {"max_length": 16, "cache_length": 4})
    nested = RewardSpec.parse({"name": RAMP, "kwargs": {"max_length": 16}, "cache_length": 4})
    assert nested.kwargs == {"max_length": 16, "cache_length": 4}
    with pytest.raises(ValueError, match="no 'name'"):
        RewardSpec.parse({"weight": 1.0})
    with pytest.raises(TypeError, match="cannot read"):
        RewardSpec.parse(3)


def test_async_call_from_a_running_loop(verifier):
    reward = build_reward(["accuracy", "format"], verifier=verifier)

    async def main():
        return await asyncio.gather(
            reward(*_batch(3), completion_lengths=[1, 2, 3]),
            reward(["p"], ["no"], ["1"], completion_lengths=[1]),
        )

    a, b = asyncio.run(main())
    np.testing.assert_array_equal(a.rewards_B, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(b.rewards_B, [0.0])
