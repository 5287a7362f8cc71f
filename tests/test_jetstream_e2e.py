"""End to end: the README command with rollouts served in-process by JetStream."""

import json

import pytest

from tests.test_train_e2e import EMBEDDED, env, rows, run  # noqa: F401 - shared fixture

pytest.importorskip("gjax.rollout.jetstream_backend")

pytestmark = [pytest.mark.slow]


def test_tiny_grpo_with_jetstream_backend_gains_ten_points(env, tmp_path):  # noqa: F811
    """`:tiny` with rollout.backend=jetstream learns as the local sampler does (>= 10 points)
    and samples every step on-policy from the weights pushed after the previous update."""
    wd = tmp_path / "grpo_js"
    run(
        "configs/grpo.py:tiny",
        wd,
        env,
        "--config.rollout.backend=jetstream",
        "--config.log.progress=False",
        # 40 of the default 120 steps: the gain is made by then (README, "First run").
        "--config.train.steps=40",
        small=False,
        timeout=900,
    )
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["heldout_accuracy_after"] - summary["heldout_accuracy_before"] >= 0.10, summary
    got = rows(wd)
    assert [r["rollout/policy_version"] for r in got] == list(range(len(got)))
    assert all(r["rollout/version_lag_max"] == 0 for r in got)
    assert all(r["rollout/requests_dropped"] == 0 for r in got)
    # The engine's log-probs are the trainer's: the first update's ratio is 1.
    assert abs(got[0]["policy/ratio"] - 1.0) < 1e-5
