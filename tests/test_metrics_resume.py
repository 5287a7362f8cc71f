"""The run's record across a resume: JSONL rebuilt from the checkpoint, TensorBoard without
duplicate steps, a progress bar whose fields say what they are; the collapse warning."""

import math
import os
import struct
import time

import pytest
from tensorboardX.proto import event_pb2

from gjax import metrics as metrics_lib
from gjax.health import CollapseWatch
from gjax.metrics import (
    BAR_FORMAT,
    MetricsWriter,
    progress_postfix,
    read_jsonl,
    workdir_layout,
)


def tensorboard_scalars(logdir: str) -> dict[str, list[int]]:
    """Steps per tag as TensorBoard shows them: its reader walks the event files in order and,
    at a SessionLog.START event of step s, drops what it holds at steps >= s (a restart)."""
    events = []
    for name in sorted(os.listdir(logdir)):
        data = (open(os.path.join(logdir, name), "rb")).read()  # noqa: SIM115
        pos = 0
        while pos < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n]))
            pos += 12 + n + 4
    shown: dict[str, list[int]] = {}
    for e in events:
        if e.HasField("session_log") and e.session_log.status == e.session_log.START:
            shown = {tag: [s for s in steps if s < e.step] for tag, steps in shown.items()}
        for v in e.summary.value:
            shown.setdefault(v.tag, []).append(e.step)
    return shown


def write_steps(w, steps):
    for s in steps:
        w.write(s, {"reward/mean": s / 10, "time/step_s": 0.5})


def test_resume_after_kill_leaves_no_duplicate_tensorboard_steps(tmp_path):
    wd = str(tmp_path)
    w = MetricsWriter(wd, total_steps=6, tensorboard=True, progress=False)
    write_steps(w, range(1, 6))  # killed -9 after step 5; the checkpoint holds step 3
    w._tb.close()  # at most what a killed run leaves on disk
    time.sleep(1.1)  # event files are named (and read in order) by their second of creation
    w = MetricsWriter(wd, total_steps=6, tensorboard=True, progress=False, start_step=3)
    write_steps(w, range(4, 7))
    w.close()
    tb = tensorboard_scalars(os.path.join(wd, "tensorboard"))
    assert tb["reward/mean"] == [1, 2, 3, 4, 5, 6]  # was: 1..5 then 4, 5, 6 again
    assert [r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl"))] == list(range(1, 7))


def test_deleted_or_truncated_metrics_are_rebuilt_from_the_checkpoint_history(tmp_path, caplog):
    wd = str(tmp_path)
    w = MetricsWriter(wd, total_steps=5, tensorboard=False, progress=False)
    write_steps(w, range(1, 5))
    w.close()
    path = os.path.join(wd, "metrics.jsonl")
    history = [
        {"step": s, "reward/mean": s / 10, "loss/total": math.nan if s == 2 else 1.0}
        for s in range(1, 5)
    ]
    lines = open(path).read().splitlines()  # noqa: SIM115
    with open(path, "w") as f:  # a row lost in the middle, and rows past the checkpoint
        f.write("\n".join([lines[0], lines[2], lines[3]]) + "\n")
    MetricsWriter(
        wd, total_steps=5, tensorboard=False, progress=False, start_step=3, history=history
    ).close()
    got = read_jsonl(path)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[1] == {"step": 2, "loss/total": None, "reward/mean": 0.2}  # from the history
    assert got[0]["time/step_s"] == 0.5  # rows the file kept are kept as written
    os.remove(path)  # was: silently restarted at step 4, the history gone
    with caplog.at_level("WARNING", logger="gjax.metrics"):
        MetricsWriter(
            wd, total_steps=5, tensorboard=False, progress=False, start_step=4, history=history
        ).close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]
    assert "lacked 4 of the 4 steps" in caplog.text and "rebuilt" in caplog.text


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (pytest's capture is not one): progress bars are drawn."""
    monkeypatch.setattr(metrics_lib, "interactive", lambda: True)


def test_progress_bar_is_labelled_and_its_eta_leaves_out_the_first_step(tmp_path, capsys, terminal):
    w = MetricsWriter(str(tmp_path), total_steps=10, tensorboard=False, progress=True)
    metrics = {"reward/mean": 0.5, "reward/accuracy": 0.25, "time/step_s": 0.1}
    w.write(1, metrics)  # step 1: its time is the compile
    bar = w._bar
    assert bar.n == 1 and bar.initial == 1  # tqdm's rate counts from here: (n - initial) / t
    w.write(2, metrics)
    w.close()
    err = capsys.readouterr().err
    assert "reward 0.50 0.1s/step]" in err and "acc" not in err  # no training "accuracy"
    assert "training samples" in err and "ETA starts" in err
    assert err.endswith("\n")  # a closed bar ends its line: what follows has its own


@pytest.mark.parametrize(
    "row",
    [
        {"reward/mean": 0.547, "policy/entropy": 0.179, "optim/grad_norm": 0.742, "time/step_s": 12.3},
        {"reward/mean": -0.123, "policy/entropy": 0.0034, "optim/grad_norm": 12.3, "time/step_s": 123.4},
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    "step, total, elapsed_s", [(1, 3, 0.0), (500, 1000, 6000.0), (5000, 10_000, 3e5)]
)
def test_progress_line_fits_80_columns_with_entropy_grad_norm_and_step_time(
    row, step, total, elapsed_s
):
    from tqdm import tqdm

    postfix = progress_postfix(row)
    assert postfix.startswith("reward ") and " ent " in postfix and " gnorm " in postfix
    line = tqdm.format_meter(
        step, total, elapsed_s, ncols=80, prefix="train", bar_format=BAR_FORMAT, postfix=postfix
    )
    assert len(line) <= 80 and line.endswith(f", {postfix}]"), line  # whole, not trimmed
    assert "█" in line or step * 8 < total  # room is left for the bar


def test_without_a_terminal_progress_is_a_log_line_not_a_bar(tmp_path, capsys, caplog):
    w = MetricsWriter(str(tmp_path), total_steps=3, tensorboard=False, progress=True)
    row = {"reward/mean": 0.5, "policy/entropy": 0.2, "optim/grad_norm": 0.7, "time/step_s": 0.1}
    with caplog.at_level("INFO", logger="gjax.metrics"):
        for step in (1, 2, 3):
            w.write(step, row)
    w.close()
    assert w._bar is None and capsys.readouterr().err == ""  # no tqdm output at all
    logged = [r.getMessage() for r in caplog.records]
    # The legend once; the first step, then at most one line a minute, and the last.
    assert logged[0].startswith("progress: reward = ")
    assert logged[1:] == [
        "step 1/3: reward 0.50 ent 0.2 gnorm 0.7 0.1s/step",
        "step 3/3: reward 0.50 ent 0.2 gnorm 0.7 0.1s/step",
    ]


def test_workdir_layout_names_every_output():
    text = workdir_layout("/w", checkpoint_steps=[40, 80], tensorboard=True)
    for part in ("metrics.jsonl", "/w/tensorboard", "steps 40, 80", "summary.json", "config.json"):
        assert part in text


@pytest.mark.parametrize(
    "row, why",
    [
        ({"policy/entropy": 11.9, "optim/grad_norm": 0.3, "reward/mean": 0.4}, "uniform"),
        ({"policy/entropy": 2.0, "optim/grad_norm": 0.0, "reward/mean": 0.0}, "nothing"),
    ],
)
def test_collapse_with_finite_numbers_is_warned_once(row, why):
    watch = CollapseWatch(vocab_size=151_936)  # ln V = 11.93
    healthy = {"policy/entropy": 2.0, "optim/grad_norm": 0.3, "reward/mean": 0.4}
    got = [watch(1, row), watch(2, row), watch(3, healthy), watch(4, row), watch(5, row)]
    assert got == [None] * 5  # two in a row, then healthy: no warning
    msg = watch(6, row)
    assert watch(7, row) is None and watch(8, healthy) is None  # once
    assert msg.startswith("steps 4-6: training has collapsed") and why in msg
    assert "lower optim.lr" in msg


def test_warnings_go_above_the_progress_bar(tmp_path, capsys, caplog, terminal):
    w = MetricsWriter(str(tmp_path), total_steps=3, tensorboard=False, progress=False)
    with caplog.at_level("WARNING", logger="gjax.metrics"):
        w.warn("no bar: logged")
    assert "no bar: logged" in caplog.text
    w = MetricsWriter(str(tmp_path), total_steps=3, tensorboard=False, progress=True)
    w.write(1, {"reward/mean": 0.5})
    w.warn("collapsed")
    w.close()
    err = capsys.readouterr().err
    # tqdm clears the bar's line (\r), writes the warning on a line of its own, redraws.
    assert "\rWARNING: collapsed\n" in err and err.index("WARNING") > err.index("train  33%")


def test_a_stop_on_all_dropped_requests_keeps_the_trained_steps_row(tmp_path):
    """Rows are written one step late; a rollout whose requests all fail stops the run in the
    next step's rollout, after the previous step trained: that step's row is still written."""
    import jax.numpy as jnp

    from configs import common
    from gjax import train as train_lib
    from gjax.rollout.collect import ServingFailed

    class Checkpointer:
        def wait(self):
            pass

        def last_intact(self):
            return "No checkpoint has been saved."

    class Producer:
        def get(self, step):
            raise ServingFailed("every request of the rollout was dropped.")

    config = common.tiny(common.base())
    config.log.progress, config.log.tensorboard = False, False
    recorder = train_lib.Recorder(config, str(tmp_path), Checkpointer(), [], 0, 64)
    recorder.add(1, {"loss/total": jnp.float32(0.25)}, {"reward/mean": 0.5})
    with pytest.raises(ServingFailed, match="step 2: every request"):
        train_lib._produce(Producer(), 1, Checkpointer(), recorder)
    # A mid-run held-out evaluation (log.eval_every) whose requests were all dropped: the
    # step it follows trained, and its row is written too.
    recorder.add(2, {"loss/total": jnp.float32(0.125)}, {"reward/mean": 0.75})

    def evaluate(params):
        raise ServingFailed("every request of a held-out evaluation batch was dropped.")

    with pytest.raises(ServingFailed, match="step 2: every request of a held-out"):
        train_lib._evaluate_mid_run(evaluate, None, 1, Checkpointer(), recorder)
    recorder.close()
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [(r["step"], r["loss/total"], r["reward/mean"]) for r in rows] == [
        (1, 0.25, 0.5),
        (2, 0.125, 0.75),
    ]
