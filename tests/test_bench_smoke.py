"""Smoke run of benchmarks/train_step.py at toy sizes: it runs end to end, stdout is JSON lines
and the last line is the summary with consistent figures. Speed itself is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_train_step_benchmark_smoke():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as the benchmark is run by hand
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "train_step.py"),
            *("--prompts", "2", "--samples", "4", "--new-tokens", "6"),
            *("--warmup", "0", "--trl-warmup", "0", "--repeats", "1"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    kinds = [r["what"] for r in records]
    assert kinds[0] == "setup" and kinds[-1] == "summary"
    assert kinds.count("gjax_step") == 1 and kinds.count("trl_step") == 1
    s = records[-1]
    gjax = next(r for r in records if r["what"] == "gjax_step")
    trl = next(r for r in records if r["what"] == "trl_step")
    # The summary reports the timed steps (one each), and gjax's update compiled once.
    assert s["gjax_step_s"] == gjax["step_s"] > 0 and s["trl_step_s"] == trl["step_s"] > 0
    assert s["speedup"] == pytest.approx(trl["step_s"] / gjax["step_s"])
    assert s["gjax_update_compiles"] == 1
    assert (s["P"], s["G"], s["B"], s["max_new_tokens"]) == (2, 4, 8, 6)
    assert s["eos_stop"] is False
    # EOS stopping is off on both sides: every completion is full length.
    assert gjax["completion_tokens"] == 8 * 6
    assert trl["completion_len"] == 6
