"""Multi-turn training end to end (gjax.rollout.episodes), in this process on the embedded
policy: the one-step `math` environment trains bit for bit as the single-turn run (k = 0 and
k = 1); a `tool` run and a two-step environment's run (k = 0, and k = 1 on split meshes) train
for 2 steps, the loss reading the policy's tokens only. Slow (each run compiles what a run compiles; later runs here reuse it)."""

import json
import math

import numpy as np
import pytest

from gjax.envs.base import ENVIRONMENTS
from gjax.errors import ConfigError
from gjax.experience import to_model_inputs
from gjax.rollout import episodes as episodes_lib
from tests import two_step_env
from tests.test_train_e2e import EMBEDDED, rows, small_config, stable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not __import__("os").path.isdir(EMBEDDED), reason="no embedded policy"),
]

# The reward pipeline's own figures (its reward function's terms, its failure counters): a
# multi-turn run scores inside its episodes and has `rewards/mean`, `rewards/valid_fraction`
# and `rewards/nonfinite` of its own; the rest of the row is the same series.
PIPELINE_ONLY = {
    "rewards/accuracy/failed",
    "rewards/accuracy/invalid_items",
    "rewards/accuracy/mean",
    "rewards/batch_errors",
    "rewards/consecutive_failures",
    "rewards/failed_batches",
    "rewards/fn_failures",
    "rewards/judge_failures",
}
ENV_SERIES = {
    "env/turns_per_episode",
    "env/tool_calls",
    "env/tool_errors",
    *(f"env/tool_errors/{k}" for k in ("malformed", "unknown_tool", "timeout", "memory")),
    "env/truncated",
    "env/truncated_turns",
    "env/truncated_tokens",
    "env/truncated_turn_tokens",
    "env/truncated_env",
    "env/step_s",
    "env/wait_s",
    "env/step_overlap_frac",
    "env/tokens_inserted",
    "env/prefill_tokens_per_episode_kept",
    "env/prefill_tokens_per_episode_reprefill",
}


# A multi-turn run's summary.json keys beside the single-turn ones (greedy episodes only:
# eval.num_samples = 0 here).
EPISODE_SUMMARY = {
    f"heldout_{k}_{when}"
    for k in ("turns_mean", "tool_calls_mean", "tool_errors_mean", "truncated_frac")
    for when in ("before", "after")
}


def tiny(**env):
    c = small_config("grpo")
    c.train.steps = 2
    c.eval.num_samples = 0  # greedy held-out only: its compile is the run's sampler's
    c.env.update(env)
    return c


def summary(wd):
    return json.loads((wd / "summary.json").read_text())


def test_one_step_math_env_trains_bit_for_bit_as_the_single_turn_run(tmp_path, capsys):
    from gjax.train import train

    assert train(tiny(), str(tmp_path / "single")) is None
    assert train(tiny(name="math"), str(tmp_path / "math")) is None
    single, multi = rows(tmp_path / "single"), rows(tmp_path / "math")
    assert [r["step"] for r in single] == [r["step"] for r in multi] == [1, 2]
    for a, b in zip(single, multi, strict=True):
        a, b = stable(a), stable(b)
        assert set(a) - set(b) == PIPELINE_ONLY
        assert set(b) - set(a) >= ENV_SERIES and all(k.startswith("env/") for k in set(b) - set(a))
        same = sorted(set(a) & set(b))
        assert len(same) > 40
        assert {k: a[k] for k in same} == {k: b[k] for k in same}  # exact, not approximate
        assert b["env/turns_per_episode"] == 1.0 and b["env/tokens_inserted"] == 0.0
        assert (
            b["env/truncated"]
            == b["env/truncated_tokens"]
            == round(16 * a["response/clipped_frac"])
        )
    # Held-out evaluation over episodes (gjax.evaluation.episodes): the single-turn run's
    # figures exactly, plus the episodes' own (one turn each, no tool calls).
    s1, s2 = summary(tmp_path / "single"), summary(tmp_path / "math")
    assert {k: s2[k] for k in s1} == s1
    assert set(s2) - set(s1) == EPISODE_SUMMARY
    assert s2["heldout_turns_mean_before"] == s2["heldout_turns_mean_after"] == 1.0
    assert s2["heldout_tool_calls_mean_after"] == 0.0


def _assert_trained_on_policy_tokens(seen, got):
    """Each step's learner rows (`seen`) against its metrics row (`got`): the loss mask is the
    policy mask of valid samples, the inserted tokens are counted and carry old log-prob 0,
    and the policy tokens keep the sampler's log-probs."""
    for groups, r in zip(seen, got, strict=True):
        host = to_model_inputs(groups)
        policy = groups.policy_mask_PxGxN.reshape(host["loss_mask_BxT"].shape)
        inserted = groups.completion_mask_PxGxN.reshape(policy.shape) & ~policy
        np.testing.assert_array_equal(
            host["loss_mask_BxT"], policy & groups.valid_PxG.reshape(-1, 1)
        )
        assert inserted.sum() == r["env/tokens_inserted"] > 0
        assert (host["old_logps_BxT"][inserted] == 0).all()
        behaviour = host["old_logps_BxT"][policy]  # the sampler's log-probs, kept
        assert (behaviour <= 0).all() and (behaviour < 0).any()


@pytest.fixture
def two_step(monkeypatch):
    """`two_step` in the registry for one test only (the registry has no removal; other tests
    list its names)."""
    monkeypatch.setitem(ENVIRONMENTS._items, two_step_env.NAME, two_step_env.factory)
    return two_step_env.NAME


def _recorded(monkeypatch):
    """The groups every EpisodeRollout call returns, in order."""
    seen = []
    call = episodes_lib.EpisodeRollout.__call__

    def record(self, *args):
        out = call(self, *args)
        seen.append(out.groups)
        return out

    monkeypatch.setattr(episodes_lib.EpisodeRollout, "__call__", record)
    return seen


def test_two_step_env_trains_on_the_policy_tokens_only(tmp_path, monkeypatch, two_step):
    """Observations are in the learner's rows (attended) and out of its loss mask; the
    trajectory's reward is the turns' rewards, discounted by env.discount."""
    from gjax.train import train

    seen = _recorded(monkeypatch)
    c = tiny(name=two_step, max_turns=2, discount=0.5)
    assert train(c, str(tmp_path / "two")) is None
    got = rows(tmp_path / "two")
    assert [r["step"] for r in got] == [1, 2]
    assert all(math.isfinite(r["loss/total"]) for r in got)
    assert len(seen) == 2
    _assert_trained_on_policy_tokens(seen, got)
    for groups, r in zip(seen, got, strict=True):
        assert groups.policy_mask_PxGxN.sum() == r["response/sampled_tokens"]
        # 0.5 at turn 0, the answer's reward (0 or 1) at turn 1 weighed 0.5: 0.5 or 1.0
        episodes = r["env/turns_per_episode"]
        assert 1.0 <= episodes <= 2.0
        assert set(np.unique(groups.rewards_PxG[groups.valid_PxG])) <= {0.5, 1.0}


def test_two_step_env_trains_on_the_jetstream_engine(tmp_path, monkeypatch, two_step):
    """rollout.backend=jetstream (the in-process engine behind JetStream's Driver): each
    turn's request resends the history (gjax.rollout.jetstream_episodes); the learner trains
    on the policy's tokens with the engine's log-probs, the observations attended and
    unmasked; the resent prefill is counted beside what keeping the KV would prefill; the
    held-out episodes run on a local continuous decoder (`evaluation_backend`)."""
    pytest.importorskip("gjax.rollout.jetstream_backend")
    from gjax.train import train

    seen = _recorded(monkeypatch)
    c = tiny(name=two_step, max_turns=2, discount=0.5)
    c.rollout.backend = "jetstream"
    assert train(c, str(tmp_path / "served")) is None
    got = rows(tmp_path / "served")
    assert [r["step"] for r in got] == [1, 2]
    _assert_trained_on_policy_tokens(seen, got)
    for r in got:
        assert 1.0 <= r["env/turns_per_episode"] <= 2.0
        assert r["rollout/requests_dropped"] == 0.0
        sent = r["env/prefill_tokens_per_episode_sent"]
        assert r["env/prefill_tokens_per_episode_kept"] < sent
        assert r["env/step_overlap_frac"] <= 1.0
    s = summary(tmp_path / "served")
    assert set(s) >= EPISODE_SUMMARY and 1.0 <= s["heldout_turns_mean_after"] <= 2.0


def test_a_tool_prompt_longer_than_the_prompt_budget_stops_the_run(tmp_path):
    """env.tool_prompt='auto' (the default) on the embedded policy: the tools' block alone
    is longer than data.max_prompt_len, and the run stops at its data, in one paragraph."""
    from gjax.train import train

    with pytest.raises(ConfigError, match=r"calculator\) takes \d+ prompt tokens") as e:
        train(tiny(name="tool", tools="calculator"), str(tmp_path / "auto"))
    assert "config.data.max_prompt_len=24" in str(e.value) and "tool_prompt='none'" in str(e.value)


def test_tool_env_trains_two_steps(tmp_path, monkeypatch):
    """`tool` with the calculator: the run completes, its rows' loss masks cover the policy's
    tokens only, and the multi-turn metrics are in every row."""
    from gjax.train import train

    seen = _recorded(monkeypatch)
    # The calculator's description (~760 prompt tokens of the character-level tokenizer) does
    # not fit the embedded policy's 24-token prompts: the run trains without it.
    c = tiny(name="tool", tools="calculator", tool_prompt="none")
    assert train(c, str(tmp_path / "tool")) is None
    s = summary(tmp_path / "tool")  # the held-out evaluation ran episodes, before and after
    assert set(s) >= EPISODE_SUMMARY
    assert 1.0 <= s["heldout_turns_mean_after"] <= tiny().env.max_turns
    assert 0.0 <= s["heldout_accuracy_after"] <= 1.0
    got = rows(tmp_path / "tool")
    assert [r["step"] for r in got] == [1, 2]
    for groups, r in zip(seen, got, strict=True):
        assert math.isfinite(r["loss/total"]) and math.isfinite(r["optim/grad_norm"])
        assert set(r) >= ENV_SERIES
        assert r["env/tool_errors"] == sum(
            v for k, v in r.items() if k.startswith("env/tool_errors/")
        )
        host = to_model_inputs(groups)
        policy = groups.policy_mask_PxGxN.reshape(host["loss_mask_BxT"].shape)
        assert not (host["loss_mask_BxT"] & ~policy).any()
        assert (policy <= groups.completion_mask_PxGxN.reshape(policy.shape)).all()


def test_one_step_math_env_at_k1_trains_as_the_single_turn_k1_run(tmp_path):
    """Asynchronous (rollout.max_staleness = 1): the producer thread rolls the episodes out
    with the version the schedule names, as it samples single completions, so the one-step
    `math` run's series equal the single-turn k = 1 run's exactly, version lags included."""
    from gjax.train import train

    runs = {}
    for name in ("", "math"):
        c = tiny(name=name)
        c.rollout.max_staleness = 1
        assert train(c, str(tmp_path / (name or "single"))) is None
        runs[name] = rows(tmp_path / (name or "single"))
    single, multi = runs[""], runs["math"]
    assert [r["async/version_lag_max"] for r in single] == [0.0, 1.0]
    for a, b in zip(single, multi, strict=True):
        a, b = stable(a), stable(b)
        assert set(a) - set(b) == PIPELINE_ONLY
        same = sorted(set(a) & set(b))
        assert {"async/version_lag_max", "async/version_lag_mean"} <= set(same)
        assert {k: a[k] for k in same} == {k: b[k] for k in same}  # exact, not approximate


def test_two_step_env_at_k1_on_rollout_devices_of_their_own(tmp_path, monkeypatch, two_step):
    """k = 1 with split meshes (mesh.rollout_devices = 4 of the suite's 8): the episodes run
    on the producer thread, one behind the learner, and their rows are what k = 0 makes:
    observations attended but out of the loss mask, behaviour log-probs on policy tokens,
    every row tagged with the one version its whole episode was decoded with."""
    from gjax.train import train

    seen = _recorded(monkeypatch)
    c = tiny(name=two_step, max_turns=2, discount=0.5)
    c.rollout.max_staleness = 1
    c.mesh.rollout_devices = 4
    assert train(c, str(tmp_path / "two")) is None
    got = rows(tmp_path / "two")
    assert [r["step"] for r in got] == [1, 2]
    assert [r["async/version_lag_max"] for r in got] == [0.0, 1.0]
    assert [r["async/version_lag_mean"] for r in got] == [0.0, 1.0]  # one version per step
    assert all(math.isfinite(r["loss/total"]) for r in got)
    assert len(seen) == 2
    _assert_trained_on_policy_tokens(seen, got)
    for groups, r in zip(seen, got, strict=True):
        assert groups.policy_mask_PxGxN.sum() == r["response/sampled_tokens"]
        assert set(np.unique(groups.rewards_PxG[groups.valid_PxG])) <= {0.5, 1.0}
