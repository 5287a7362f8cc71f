"""End to end: training runs on the embedded default.

The per-algorithm smoke runs call `gjax.train.train` in this process: its start-up is paid once
and the seven configs, whose shapes agree, share one compiled sampler. `python -m gjax.train`
runs in a subprocess where the process is the subject: signals, kill -9, exit codes, the
one-paragraph errors, the README's command as users run it. Slow (each run compiles the
sampler, the log-prob pass and the update), so marked `slow`; CI still runs them. Subprocesses
share the session's persistent compilation cache (tests/conftest.py).
"""

import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")
# Small shapes: a handful of prompts per step, short held-out set.
SMALL = [
    "--config.rollout.prompts_per_step=4",
    "--config.rollout.num_samples=4",
    "--config.data.heldout_size=16",
    "--config.log.progress=False",
    "--config.log.tensorboard=False",
    "--config.checkpoint.async_save=False",
]
VOLATILE = (
    "time/",
    "throughput/",
    "rewards/time",
    "rewards/wall",
    "rewards/queue",
    "rewards/wait",
    "rewards/overlap",
    "rewards/accuracy/time",
    "judge/latency",
)

# Names that repeated another series of the row (issue 18) -> the name kept for it.
REMOVED_DUPLICATES = {
    "adv/omega_s": "adv/reward_mean",
    "rewards/reward_mean": "rewards/mean",
    "rewards/total/mean": "rewards/mean",
    "rewards/valid_frac": "rewards/valid_fraction",
    "count/mean_response_length": "response/length_mean",
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built"),
]


@pytest.fixture(scope="module")
def env():
    e = dict(os.environ)
    e.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = USER_PATH  # no torch (tests/user_env.py); the session's compile cache
    return e


# The resume test's run: 10 steps, so that once the resumed run has saved step 4 it has steps
# left to be stopped in.
RESUMED = ("--config.train.steps=10", "--config.checkpoint.every=2")


@pytest.fixture(scope="module")
def clean_run(env, tmp_path_factory):
    """`grpo.py:tiny` run once, uninterrupted, for RESUMED's 10 steps: the reference of the
    resume test, and the finished grpo workdir that the refusal tests copy and resume (each
    of those paid a run of its own before). Tests read it only, never write to it."""
    wd = tmp_path_factory.mktemp("clean") / "clean"
    run("configs/grpo.py:tiny", wd, env, *RESUMED)
    return wd


def command(config, workdir, *extra, small=True):
    return [
        sys.executable,
        "-m",
        "gjax.train",
        f"--config={config}",
        f"--workdir={workdir}",
        *(SMALL if small else ()),
        *extra,
    ]


def run(config, workdir, env, *extra, small=True, timeout=600):
    proc = subprocess.run(
        command(config, workdir, *extra, small=small),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def small_config(algo, arg="tiny"):
    """`configs/<algo>.py:ARG` with SMALL's overrides, for a run in this process."""
    c = importlib.import_module(f"configs.{algo}").get_config(arg)
    c.rollout.prompts_per_step = 4
    c.rollout.num_samples = 4
    c.data.heldout_size = 16
    c.log.progress = False
    c.log.tensorboard = False
    c.checkpoint.async_save = False
    return c


@pytest.mark.parametrize(
    "algo", ["grpo", "dr_grpo", "dapo", "gpg", "a_grae", "dagrpo", "cw_grpo", "cispo", "pass_at_k"]
)
def test_each_algorithm_runs_a_few_steps(algo, tmp_path, capsys):
    """In this process, on the suite's 8 CPU devices (data-parallel 8): the sampler compiled
    for the first algorithm serves the others (same shapes, same sampling).

    The held-out pass@k (8 samples of each of 16 problems, before and after: 16 sampler
    calls to the 2 steps' 2) is drawn only where its batch shape is one of its own: dagrpo's
    groups hold an anchor, cw_grpo steps 8 prompts. Elsewhere it would repeat, to the
    rollout's shape and compiled sampler, what grpo's run in
    test_resume_after_sigkill_and_ctrl_c_matches_uninterrupted_run checks (and
    tests/test_eval.py, test_heldout_metrics_samples_in_the_rollout_shape_when_it_can):
    greedy held-out accuracy only."""
    from gjax.train import train

    wd = tmp_path / algo
    c = small_config(algo)
    c.train.steps = 2
    if algo not in ("dagrpo", "cw_grpo"):
        c.eval.num_samples = 0
    if algo == "cw_grpo":  # its 4 microbatches must each hold a multiple of the 8 devices' rows
        c.rollout.prompts_per_step = 8
    if algo == "pass_at_k":  # k below the group of 4 (k = G is refused: every advantage 0)
        c.objective.advantage_kwargs.k = 2
    assert train(c, str(wd)) is None  # finished, not stopped by a signal
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln]  # results: plain stdout
    assert out[0].startswith("held-out before: accuracy ")
    assert out[1].startswith("held-out accuracy after 2 steps: ")
    got = rows(wd)
    assert [r["step"] for r in got] == [1, 2]
    for r in got:  # one name per series
        assert not set(r) & set(REMOVED_DUPLICATES), sorted(set(r) & set(REMOVED_DUPLICATES))
        assert {"adv/reward_mean", "rewards/mean", "rewards/valid_fraction"} <= set(r)
    for r in got:  # every step's row has a finite loss and gradient norm (was: `is not None`)
        # (A non-finite value is written as null.)
        for key in ("loss/total", "optim/grad_norm"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["reward/accuracy"] <= 1.0
    summary = json.loads((wd / "summary.json").read_text())
    assert set(summary) >= {"heldout_accuracy_before", "heldout_accuracy_after"}
    held = summary["heldout"]  # which rows were held out, and from where
    assert (held["source"], held["split"]) == ("synthetic", "test")
    assert len(held["rows"]) == summary["heldout_size"] == c.data.heldout_size
    if algo == "dagrpo":
        assert "judge/score_mean" in got[0] and "adv/masked_fraction" in got[0]
    if algo == "gpg":
        assert got[0]["adv/alpha"] >= 1.0
    if algo == "pass_at_k":
        assert 0.0 <= got[0]["adv/pass_at_k"] <= 1.0


def test_headroom_task_runs_two_steps(tmp_path, capsys):
    """`:headroom` (the studies' task: longer prompts and answers, so new shapes) validates and
    trains; greedy held-out only, so the new compiles are the sampler's and the update's."""
    from gjax.train import train

    c = small_config("grpo", "headroom")
    c.train.steps = 2
    c.eval.num_samples = 0
    assert train(c, str(tmp_path / "headroom")) is None
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert out[1].startswith("held-out accuracy after 2 steps: ")
    got = rows(tmp_path / "headroom")
    assert [r["step"] for r in got] == [1, 2]
    assert all(math.isfinite(r["loss/total"]) for r in got)
    for r in got:  # one round of 4 x 4 completions: the sampled tokens are their lengths' sum
        assert r["response/sampled_tokens"] == pytest.approx(16 * r["response/length_mean"])
    held = json.loads((tmp_path / "headroom" / "summary.json").read_text())["heldout"]
    assert (held["source"], held["split"], len(held["rows"])) == ("synthetic", "test", 16)


@pytest.mark.parametrize("algo", ["a_grae"])
def test_embedded_default_learns(algo, env, tmp_path):
    """The README's main command, defaults untouched: held-out accuracy rises >= 10 points.

    (Measured on an idle 2-core CPU: 0.512 -> 0.715 for a_grae, about 2 minutes. GRPO's gain
    on `:tiny` is asserted by tests/test_jetstream_e2e.py, the same objective with rollouts
    from the JetStream engine; a second local-sampler run cost the suite 3 minutes.)
    """
    wd = tmp_path / algo
    logged = {**env, "JAX_LOG_COMPILES": "1"}  # one "Compiling jit(update)" line per program
    proc = run(f"configs/{algo}.py:tiny", wd, logged, "--config.log.progress=False", small=False)
    # The packed bin shapes its batches meet (gjax.packing's ladders): 4 update programs, where
    # the finer ladder before compiled 21 (4-7 s each on 2 cores; cached or not, each is one).
    assert proc.stderr.count("Compiling jit(update)") <= 4
    summary = json.loads((wd / "summary.json").read_text())
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    assert after - before >= 0.10, summary
    got = rows(wd)
    first, last = got[:10], got[-10:]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    # It learned by working problems out: longer answers, higher training reward.
    assert mean(last, "response/length_mean") > mean(first, "response/length_mean") + 2
    assert mean(last, "reward/mean") > mean(first, "reward/mean")
    assert all(0.5 < r["pack/fill"] <= 1 for r in got)  # the padding waste, still reported


def test_resume_after_sigkill_and_ctrl_c_matches_uninterrupted_run(env, clean_run, tmp_path):
    """Kill -9 after a checkpoint, resume, Ctrl-C, resume: same metrics as one clean run.

    (Ctrl-C and SIGTERM share one handler: finish the step, save, exit 128 + signal.) Then the
    finished workdir, rerun with a smaller train.steps, says so and keeps its summary."""
    args = RESUMED
    clean, broken = clean_run, tmp_path / "broken"

    # 1) SIGKILL as soon as the step-2 checkpoint is complete.
    proc = subprocess.Popen(
        command("configs/grpo.py:tiny", broken, *args),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt2 = broken / "checkpoints" / "2"
    deadline = time.time() + 600
    while not (ckpt2 / "_CHECKPOINT_METADATA").exists() and time.time() < deadline:
        assert proc.poll() is None, "run ended before it could be killed"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (broken / "summary.json").exists()

    # 2) Resume, and Ctrl-C it once it has saved step 4 (proof that it is the resumed process
    #    that runs, signal handler installed): it saves where it stopped and exits 130.
    proc = subprocess.Popen(
        command("configs/grpo.py:tiny", broken, *args),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ckpt4 = broken / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not ckpt4.exists():
        time.sleep(0.1)
    assert proc.poll() is None, "the resumed run ended before it could be sent SIGTERM"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out[-4000:]  # was: a KeyboardInterrupt traceback, no save
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    saved = sorted(int(p.name) for p in (broken / "checkpoints").iterdir() if p.name.isdigit())
    assert f"SIGINT: stopped at step {saved[-1]}, checkpoint at step {saved[-1]} saved" in out
    # It stopped early, with a checkpoint where it stopped (not only the periodic ones).
    assert not (broken / "summary.json").exists()
    assert 4 <= saved[-1] < 10 and saved[-1] == max(r["step"] for r in rows(broken)), saved

    # 3) Resume to the end, with the progress bar a user sees.
    proc = run("configs/grpo.py:tiny", broken, env, *args, "--config.log.progress=True")
    want, got = [stable(r) for r in rows(clean)], [stable(r) for r in rows(broken)]
    assert [r["step"] for r in got] == list(range(1, 11))
    assert got == want
    summary = json.loads((broken / "summary.json").read_text())
    assert summary == json.loads((clean / "summary.json").read_text())
    # stderr is a pipe, not a terminal: no bar, a logged progress line with its legend. The
    # results are plain lines on stdout: the held-out figures before training, then after
    # it, and the workdir's layout.
    assert "%|" not in proc.stderr and "step 10/10: reward " in proc.stderr
    assert "training samples" in proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line]
    assert lines[0].startswith(
        f"held-out before: accuracy {summary['heldout_accuracy_before']:.3f}"
    )
    assert lines[1].startswith("held-out accuracy after 10 steps: ")
    assert lines[2] == f"workdir {broken}:"
    for part in ("metrics.jsonl", "checkpoints/", "summary.json"):  # (TensorBoard is off)
        assert any(line.lstrip().startswith(part) for line in lines[3:]), part

    # 4) The finished workdir with a smaller train.steps: nothing to do, and it says so; the
    #    summary stays true (was: silently rewritten as "steps": 5).
    proc = run("configs/grpo.py:tiny", broken, env, "--config.train.steps=5")
    assert "already at step 10 >= train.steps=5: nothing to train" in proc.stdout
    assert json.loads((broken / "summary.json").read_text()) == summary

    # 5) The disk fills up: every file stops at 2 MiB (the state's data file is ~8 MiB), so
    #    the save at step 12 fails. The run stops at once (was: trained on, crashed at the
    #    next save, or hung at exit) with a clear error; step 10 stays intact.
    #    The child limits itself before it runs gjax.train (a preexec_fn would run Python in a
    #    fork of this process, unsafe once the in-process runs above have started JAX's threads).
    full_disk = (
        "import resource, runpy, signal; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "  # writes past the limit get EFBIG
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20)); "
        "runpy.run_module('gjax.train', run_name='__main__', alter_sys=True)"
    )
    train_argv = command(
        "configs/grpo.py:tiny",
        broken,
        "--config.train.steps=16",
        *args[1:],
        "--config.checkpoint.async_save=True",  # the default: the write fails in the background
    )[3:]  # (after `python -m gjax.train`)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", full_disk, *train_argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())  # the paragraph is wrapped for the terminal
    assert err.endswith("fix the directory first."), proc.stderr[-3000:]
    assert "gjax: saving the checkpoint of step 12" in err and "File too large" in err
    assert "last intact checkpoint is step 10" in err
    # It stopped as soon as the background write failed, at the next save at the latest.
    assert max(r["step"] for r in rows(broken)) <= 14
    assert time.time() - t0 < 300
    assert not (broken / "checkpoints" / "12").exists()
    assert (broken / "checkpoints" / "10" / "_CHECKPOINT_METADATA").exists()


def test_bad_workdir_and_foreign_checkpoint_fail_clearly(env, clean_run, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(clean_run, wd)  # a finished grpo run's workdir, checkpoints and all
    proc = subprocess.run(
        command("configs/dapo.py:tiny", wd, "--config.train.steps=2"),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
    err = " ".join(proc.stderr.split())  # one paragraph, wrapped: refused before loading
    assert "holds checkpoints of a run trained with another config" in err, err
    assert "algo: 'grpo' -> 'dapo'" in err, err
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = subprocess.run(
        command("configs/grpo.py:tiny", blocker / "sub"),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # The paragraph is wrapped for the terminal; where it wraps depends on the path's length.
    assert proc.returncode != 0 and "is not writable" in " ".join(proc.stderr.split())


def test_a_resume_that_changes_training_is_refused_unless_opted_in(env, clean_run, tmp_path):
    """A resume with another optim.lr stops at start (one paragraph naming the field, old ->
    new, and the ways on; config.json untouched); with train.allow_config_change it trains on,
    config.json keeps the original and config_history.jsonl records the change and its step.
    Extending train.steps alone is harmless."""
    wd = tmp_path / "run"
    shutil.copytree(clean_run, wd)  # a finished grpo run of 10 steps, checkpoints every 2
    original = (wd / "config.json").read_text()
    changed = ["--config.train.steps=11", "--config.optim.lr=0.0001"]
    proc = subprocess.run(
        command("configs/grpo.py:tiny", wd, *changed),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    flat = " ".join(proc.stderr.split())
    assert "optim.lr: 3e-05 -> 0.0001" in flat and "train.steps" not in flat, flat
    assert "new --workdir" in flat and "--config.train.allow_config_change=True" in flat
    assert "mesh" not in proc.stderr  # refused before the model loads
    assert (wd / "config.json").read_text() == original
    assert not (wd / "config_history.jsonl").exists()
    run("configs/grpo.py:tiny", wd, env, *changed, "--config.train.allow_config_change=True")
    assert (wd / "config.json").read_text() == original
    history = [json.loads(x) for x in (wd / "config_history.jsonl").read_text().splitlines()]
    # Harmless changes (checkpoint.every back to tiny's 40) are recorded too.
    changes = {"optim.lr": [3e-05, 0.0001], "train.steps": [10, 11], "checkpoint.every": [2, 40]}
    assert history == [{"step": 10, "changes": changes}]
    assert [r["step"] for r in rows(wd)] == list(range(1, 12))


def test_judge_faults_stop_the_run_with_one_paragraph(env, tmp_path):
    """DaGRPO against a real HTTP judge on 127.0.0.1. (1) Every request fails (HTTP 500): the
    first steps train on substituted scores, which the metrics say (score_mean over real scores
    only: 0; all filled), and the third bad batch in a row stops the run. (2) A wrong key
    (HTTP 401): the first step stops the run. Both: one paragraph, exit 2, no traceback."""
    from tests.judge_server import JudgeServer

    with JudgeServer(default="status:500", api_key="right-key") as server:
        judge = [
            "--config.reward.judge.name=openai",
            f"--config.reward.judge.base_url={server.base_url}",
            "--config.reward.judge.api_key_env=GJAX_E2E_JUDGE_KEY",
            "--config.reward.judge.max_retries=0",
            "--config.reward.judge.max_missing_steps=3",
            "--config.train.steps=4",
            "--config.eval.num_samples=0",  # the judge is the subject: greedy held-out only
        ]
        results = {}
        for name, key in (("down", "right-key"), ("wrong_key", "wrong-key")):
            wd = tmp_path / name
            results[name] = subprocess.run(
                command("configs/dagrpo.py:tiny", wd, *judge),
                env={**env, "GJAX_E2E_JUDGE_KEY": key},
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
    down, wrong = results["down"], results["wrong_key"]
    assert down.returncode == 2, down.stderr[-4000:]
    assert "3 consecutive batches" in down.stderr and "Traceback" not in down.stderr
    first = rows(tmp_path / "down")[0]
    assert first["step"] == 1
    assert first["judge/score_mean"] == 0.0 and first["judge/scored"] == 0
    assert first["judge/filled"] == 16  # 4 prompts x G = 4, all kept on substituted scores
    assert wrong.returncode == 2, wrong.stderr[-4000:]
    assert "rejected the credentials (HTTP 401)" in wrong.stderr
    assert "Traceback" not in wrong.stderr and "wrong-key" not in wrong.stderr
    assert not os.path.exists(tmp_path / "wrong_key" / "metrics.jsonl") or not rows(
        tmp_path / "wrong_key"
    )
