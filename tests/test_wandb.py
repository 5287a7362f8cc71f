"""Weights & Biases (gjax.wandb_log), offline: no network, no account.

wandb writes an offline run to a `.wandb` record log under WANDB_DIR; these tests read those
files back (`wandb_log.read_offline_run`, which decodes wandb's own protobuf records) and
compare them with what the run wrote to metrics.jsonl and summary.json.
"""

import glob
import importlib
import json
import logging
import os
import shutil
import time

import pytest

from gjax import wandb_log
from gjax.errors import ConfigError

pytest.importorskip("wandb")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, its files (and its settings) under tmp_path/wandb_dir."""
    d = tmp_path / "wandb_dir"
    d.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(d))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(d / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(d / "cache"))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return d


def run_files(d) -> list[str]:
    """The offline runs' `.wandb` files under `d`, oldest first, each complete: wandb's
    service writes a file's tail (up to its `exit` record) after `finish()` has returned."""
    files = sorted(glob.glob(os.path.join(d, "wandb", "offline-run-*", "run-*.wandb")))
    for path in files:
        deadline = time.monotonic() + 60
        while not (records := wandb_log.read_run_file(path)) or (
            records[-1].WhichOneof("record_type") != "exit"
        ):
            assert time.monotonic() < deadline, f"{path}: no exit record after 60 s"
            time.sleep(0.1)
    return files


def base_config():
    return importlib.import_module("configs.grpo").get_config("tiny")


def test_config_refusals_name_the_field(monkeypatch):
    """What the user asked for and cannot work is refused before anything loads."""
    from gjax.config import validate
    from gjax.train import CONFIG_CHECKS

    c = base_config()
    wandb_log.check_config(c)  # off by default: nothing to check
    c.log.wandb_mode = "offline"
    with pytest.raises(
        ConfigError, match="config.log.wandb_mode is set but config.log.wandb_project"
    ):
        wandb_log.check_config(c)
    c.log.wandb_project = "p"
    wandb_log.check_config(c)
    c.log.wandb_mode = "ofline"
    with pytest.raises(ConfigError, match="'ofline' is not a wandb mode"):
        wandb_log.check_config(c)
    c.log.wandb_mode = ""
    c.log.wandb_tags = "a,,b"
    with pytest.raises(ConfigError, match="wandb_tags='a,,b'"):
        wandb_log.check_config(c)
    c.log.wandb_tags = " grpo , tiny "
    assert wandb_log.parse_tags(c.log.wandb_tags) == ["grpo", "tiny"]
    # wandb not installed: one paragraph saying how to install it, from the trainer's hooks.
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"not installed.*pip install wandb") as e:
        validate(c, 1, checks=CONFIG_CHECKS)
    assert "\n" not in str(e.value)


def test_wandb_errors_never_stop_training(tmp_path, offline, monkeypatch):
    """An error at init turns wandb off (one warning); errors while logging are one warning
    and a count at the end."""
    import wandb

    c = base_config()
    c.log.wandb_project = "gjax-test"
    warnings = []

    def broken_init(**kw):
        raise wandb.errors.CommError("network is unreachable")

    with monkeypatch.context() as m:
        m.setattr(wandb, "init", broken_init)
        sink = wandb_log.WandbSink(c, str(tmp_path / "a"), start_step=0, warn=warnings.append)
    assert sink.run is None and len(warnings) == 1
    assert "could not start the run (CommError: network is unreachable)" in warnings[0]
    sink.log(1, {"x": 1.0})
    sink.heldout(1, {"eval/heldout_accuracy": 0.1}, {"eval/heldout_accuracy": 0.2})
    sink.close()
    assert len(warnings) == 1

    warnings.clear()
    sink = wandb_log.WandbSink(c, str(tmp_path / "b"), start_step=0, warn=warnings.append)
    assert sink.run is not None and warnings == []
    sink.log(1, {"x": 1.0, "nan": float("nan")})

    def broken_log(*a, **kw):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(sink.run, "log", broken_log)
        sink.log(2, {"x": 2.0})
        sink.log(3, {"x": 3.0})
    assert len(warnings) == 1 and "logging step 2: OSError: disk full" in warnings[0]
    sink.close(exit_code=143, preempted=True)  # a SIGTERM stop: to be resumed
    assert len(warnings) == 2 and "2 of " in warnings[1] and "calls failed" in warnings[1]
    (path,) = run_files(offline)
    got = wandb_log.read_offline_run(path)
    assert got["history"] == {1: {"x": 1.0}}  # non-finite left out, as TensorBoard does
    assert (got["exit_code"], got["preempting"]) == (143, True)


def test_a_resume_continues_the_recorded_run_without_going_back(tmp_path, offline):
    """The workdir's record names the run and its last step: a resume from step 3 of a run
    that logged up to 5 continues that run from step 6; one in another project starts anew."""
    c = base_config()
    c.log.wandb_project = "gjax-test"
    wd = tmp_path / "run"
    wd.mkdir()
    record = {"id": "old00run", "project": "gjax-test", "last_step": 5}
    (wd / wandb_log.RECORD).write_text(json.dumps(record))
    warnings = []
    sink = wandb_log.WandbSink(c, str(wd), start_step=3, warn=warnings.append)
    assert (sink.run.id, sink.skip_through) == ("old00run", 5)
    for step in (4, 5, 6):
        sink.log(step, {"x": float(step)})
    sink.close()
    assert len(warnings) == 1 and "already has steps up to 5" in warnings[0]
    (path,) = run_files(offline)
    assert wandb_log.read_offline_run(path)["history"] == {6: {"x": 6.0}}
    assert json.loads((wd / wandb_log.RECORD).read_text())["last_step"] == 6

    c.log.wandb_project = "another"
    sink = wandb_log.WandbSink(c, str(wd), start_step=6, warn=warnings.append)
    assert sink.run.id != "old00run" and sink.skip_through == 0
    sink.close()
    assert json.loads((wd / wandb_log.RECORD).read_text())["project"] == "another"


def test_reader_reads_records_across_blocks(tmp_path, offline):
    """Records longer than what is left of a 32 KiB block are split in chunks: read whole."""
    import wandb

    run = wandb.init(project="p", id="blocks1", dir=str(offline), config={"a": {"b": [1, 2]}})
    rows = {s: {f"k{i}/{'x' * 40}": s * 1000.0 + i / 7 for i in range(60)} for s in range(1, 41)}
    for s, row in rows.items():
        run.log(row, step=s)
    run.finish()
    (path,) = run_files(offline)
    assert os.path.getsize(path) > 3 * 32768
    got = wandb_log.read_offline_run(path)
    assert got["id"] == "blocks1" and got["config"] == {"a": {"b": [1, 2]}}
    assert got["history"] == rows


@pytest.mark.slow
def test_offline_run_logs_what_metrics_jsonl_has_and_resumes_the_same_run(
    tmp_path, offline, caplog
):
    from gjax.train import train
    from tests.test_train_e2e import EMBEDDED, rows, small_config

    if not os.path.isdir(EMBEDDED):
        pytest.skip("embedded policy not built")
    c = small_config("grpo")
    c.train.steps = 2
    c.checkpoint.every = 1
    c.eval.num_samples = 0  # greedy held-out only: fewer compiles
    c.log.wandb_project = "gjax-test"
    c.log.wandb_name = "tiny-run"
    c.log.wandb_tags = "grpo,tiny"
    wd = tmp_path / "run"
    assert train(c, str(wd)) is None

    (first,) = run_files(offline)
    got = wandb_log.read_offline_run(first)
    record = json.loads((wd / "wandb_run.json").read_text())
    assert (got["id"], got["project"]) == (record["id"], "gjax-test")
    assert (got["name"], got["tags"]) == ("tiny-run", ["grpo", "tiny"])
    assert record["last_step"] == 2
    assert (got["exit_code"], got["preempting"]) == (0, False)
    # The config, whole.
    assert got["config"] == json.loads(json.dumps(c.to_dict()))
    # Every step's series as metrics.jsonl has them (non-finite ones are null there, absent
    # in wandb, as in TensorBoard).
    jsonl = rows(wd)
    assert sorted(got["history"]) == [r["step"] for r in jsonl] == [1, 2]
    for r in jsonl:
        want = {k: v for k, v in r.items() if k != "step" and v is not None}
        logged = got["history"][r["step"]]
        assert {k: logged[k] for k in want} == want, r["step"]
        assert set(logged) - set(want) <= {"heldout/table", "curves"}
    # The held-out table (before and after) and the curves, at the last step.
    summary = json.loads((wd / "summary.json").read_text())
    last = got["history"][2]
    assert last["heldout/table"]["_type"] == "table-file"
    assert last["curves"]["_type"] == "image-file"
    files = os.path.join(os.path.dirname(first), "files")
    with open(os.path.join(files, last["heldout/table"]["path"])) as f:
        table = json.load(f)
    assert table["columns"][:3] == ["when", "step", "accuracy"]
    assert [row[:3] for row in table["data"]] == [
        ["before", 0, summary["heldout_accuracy_before"]],
        ["after", 2, summary["heldout_accuracy_after"]],
    ]
    assert os.path.getsize(os.path.join(files, last["curves"]["path"])) > 10_000
    assert got["summary"]["heldout/accuracy_after"] == summary["heldout_accuracy_after"]

    # A resume continues the same wandb run. Here the run is resumed as if killed past its
    # last checkpoint (the checkpoint of step 2 removed): step 2 is redone, and since wandb's
    # steps cannot go back it is not sent again (the run says so); step 3 follows.
    shutil.rmtree(wd / "checkpoints" / "2")
    c.train.steps = 3
    with caplog.at_level(logging.WARNING):
        assert train(c, str(wd)) is None
    said = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage()]
    assert len(said) == 1 and f"run {got['id']} already has steps up to 2" in said[0], said
    second = run_files(offline)[1]
    again = wandb_log.read_offline_run(second)
    assert again["id"] == got["id"]
    assert sorted(again["history"]) == [3]
    jsonl = rows(wd)
    assert [r["step"] for r in jsonl] == [1, 2, 3]
    row3 = {k: v for k, v in jsonl[2].items() if k != "step" and v is not None}
    assert {k: again["history"][3][k] for k in row3} == row3
    assert json.loads((wd / "wandb_run.json").read_text()) == {
        "id": got["id"],
        "project": "gjax-test",
        "last_step": 3,
    }
