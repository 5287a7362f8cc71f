"""Checkpoints: periodic saves, exact round trip, and no run lost to a damaged or foreign one."""

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax import integrity
from gjax.checkpoint import Checkpointer, CheckpointError
from gjax.health import Diverged
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state(value: float) -> dict:
    w = jnp.arange(12.0).reshape(4, 3) + value  # distinct entries: a reordering would show
    return {"params": {"w": w}, "step": jnp.asarray(int(value), jnp.int32)}


def saved(tmp_path, steps, **kw) -> Checkpointer:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False, **kw)
    for s in steps:
        meta = {"data": {"pos": s}, "fingerprint": {"algo": "grpo"}}
        ckpt.save(s, state(float(s)), meta, force=True)
    ckpt.wait()
    return ckpt


def damage(ckpt: Checkpointer, step: int) -> None:
    """Overwrites every file of a step's train state, as a torn write would leave it."""
    for root, _, files in os.walk(os.path.join(str(ckpt.directory), str(step), "state")):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")


def test_periodic_saves_only_at_the_interval(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), save_interval_steps=40)
    assert [s for s in range(1, 121) if ckpt.should_save(s)] == [40, 80, 120]
    assert not Checkpointer(str(tmp_path / "off"), save_interval_steps=0).should_save(40)


def test_round_trip_is_exact(tmp_path):
    ckpt = saved(tmp_path, [2, 4], max_to_keep=5)
    step, got, meta = ckpt.restore(state(0.0), fingerprint={"algo": "grpo"})
    assert step == 4 and meta["data"] == {"pos": 4}
    np.testing.assert_array_equal(got["params"]["w"], state(4.0)["params"]["w"])
    assert int(got["step"]) == 4


def test_damaged_newest_checkpoint_falls_back_and_is_moved_aside(tmp_path, caplog):
    ckpt = saved(tmp_path, [2, 4], max_to_keep=5)
    damage(ckpt, 4)
    assert ckpt.restore(state(0.0))[0] == 2
    assert ckpt.all_steps() == [2, 4]  # a reader (export) leaves the directory as it is
    with caplog.at_level(logging.WARNING, logger="gjax.checkpoint"):
        step, got, meta = ckpt.restore(state(0.0), move_damaged=True)  # as train.py does
    assert step == 2 and meta["data"] == {"pos": 2}
    np.testing.assert_array_equal(got["params"]["w"], state(2.0)["params"]["w"])
    assert "checkpoint step 4" in caplog.text and "unreadable" in caplog.text
    # Kept to inspect, but out of the way, and the log says where.
    (aside,) = (tmp_path / "ckpt.damaged").iterdir()
    assert aside.name.startswith("4-") and (aside / "state").is_dir()
    assert f"aside to {aside}" in caplog.text
    assert ckpt.all_steps() == [2]
    # The resumed run reaches step 4 again and saves it (was: StepAlreadyExistsError).
    ckpt.save(4, state(4.0), {"data": {"pos": 4}}, force=True)
    ckpt.wait()
    assert ckpt.restore(state(0.0))[0] == 4


def noise(value: int) -> dict:
    """A state whose data file is large enough to damage in its middle."""
    w = jax.random.normal(jax.random.key(value), (256, 256))
    return {"params": {"w": w}, "step": jnp.asarray(value, jnp.int32)}


@pytest.mark.parametrize("how", ["bit_flips", "random_bytes"])
def test_silent_corruption_is_detected_and_falls_back(tmp_path, caplog, how):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False, max_to_keep=5)
    for s in (2, 4):
        ckpt.save(s, noise(s), {"data": {"pos": s}}, force=True)
    ckpt.wait()
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "ckpt" / "4") for f in fs]
    data_file = max(files, key=os.path.getsize)  # the array data (~240 KiB)
    data = bytearray(pathlib.Path(data_file).read_bytes())
    rng = np.random.default_rng(0)
    if how == "bit_flips":
        for i in rng.integers(len(data) // 4, 3 * len(data) // 4, 100):
            data[i] ^= 1 << int(rng.integers(8))
    else:
        data[len(data) // 2 : len(data) // 2 + 4096] = rng.bytes(4096)
    pathlib.Path(data_file).write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="gjax.checkpoint"):
        step, got, _ = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=5).restore(noise(0))
    assert step == 2  # was: step 4 restored with damaged values, NaN two steps later
    np.testing.assert_array_equal(got["params"]["w"], noise(2)["params"]["w"])
    assert "checkpoint step 4" in caplog.text and "damaged" in caplog.text


def test_digest_sees_one_flipped_bit_anywhere_and_ignores_sharding():
    x = jax.random.normal(jax.random.key(0), (8, 6))
    base, _ = integrity.inspect({"x": x})
    bits = np.asarray(x).view(np.uint32).copy()
    for i, b in [(0, 0), (17, 31), (47, 13)]:  # first, middle, last element; low and sign bits
        flipped = bits.copy()
        flipped.flat[i] ^= np.uint32(1 << b)
        assert integrity.inspect({"x": jnp.asarray(flipped.view(np.float32))})[0] != base
    # Swapping two elements changes it too (the weights depend on the position).
    swapped = np.asarray(x).copy()
    swapped.flat[[3, 4]] = swapped.flat[[4, 3]]
    assert integrity.inspect({"x": jnp.asarray(swapped)})[0] != base
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    sharded = jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    )
    assert integrity.inspect({"x": sharded})[0] == base
    # bf16 and integer leaves are covered too, and non-finite values are counted.
    mixed = {"h": x.astype(jnp.bfloat16).at[0, 0].set(jnp.inf), "n": jnp.arange(5)}
    assert integrity.inspect(mixed)[1] == {"['h']": 1}


def test_nonfinite_state_is_never_saved_and_the_error_names_the_intact_step(tmp_path):
    ckpt = saved(tmp_path, [2], max_to_keep=5)
    bad = state(3.0)
    bad["params"]["w"] = bad["params"]["w"].at[1, 1].set(jnp.nan)
    with pytest.raises(Diverged) as e:
        ckpt.save(3, bad, {"data": {"pos": 3}}, force=True)
    msg = str(e.value)
    assert "step 3: the train state holds 1 non-finite values of 13" in msg
    assert f"last intact checkpoint is step 2 in {ckpt.directory}" in msg
    ckpt.wait()
    assert ckpt.all_steps() == [2]


def test_nonfinite_checkpoint_from_an_older_version_is_skipped(tmp_path):
    ckpt = saved(tmp_path, [2], max_to_keep=5)
    bad = state(3.0)
    bad["params"]["w"] = bad["params"]["w"] * jnp.inf
    import orbax.checkpoint as ocp

    args = ocp.args.Composite(state=ocp.args.StandardSave(bad), meta=ocp.args.JsonSave({}))
    ckpt._mngr.save(3, args=args, force=True)  # as the old code did: no check, no digest
    ckpt.wait()
    assert ckpt.restore(state(0.0), move_damaged=True)[0] == 2
    assert ckpt.all_steps() == [2]


FAILING_SAVE = textwrap.dedent(
    """
    import json, resource, signal, sys, time
    import jax, jax.numpy as jnp
    from gjax.checkpoint import Checkpointer, CheckpointSaveError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    ckpt = Checkpointer(sys.argv[1], async_save=True, save_interval_steps=1)
    ckpt.save(1, {"w": jnp.zeros((100,))}, {"step": 1}, force=True)
    ckpt.wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the disk is "full"
    big = {"w": jax.random.normal(jax.random.key(0), (400_000,))}  # 1.6 MB, incompressible
    t0, out = time.time(), {}
    try:
        ckpt.save(2, big, {"step": 2}, force=True)
        while time.time() - t0 < 60:  # the training loop: one check() per step
            ckpt.check()
            time.sleep(0.05)
    except CheckpointSaveError as e:
        out = {"error": str(e), "after_s": time.time() - t0}
    out["steps"] = ckpt.all_steps()
    print(json.dumps(out))
    """
)


def test_failed_async_save_stops_the_run_at_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": USER_PATH, "XLA_FLAGS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_SAVE, str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Was: the error surfaced only at the next save (10 steps later, 5 tracebacks).
    assert "error" in out, out
    assert out["after_s"] < 30
    assert "saving the checkpoint of step 2" in out["error"] and "File too large" in out["error"]
    assert "last intact checkpoint is step 1" in out["error"]
    assert out["steps"] == [1]
    step, got, _ = Checkpointer(str(tmp_path / "ckpt")).restore({"w": jnp.ones((100,))})
    assert step == 1 and float(got["w"].sum()) == 0.0


def test_no_readable_checkpoint_names_each_step_and_what_to_do(tmp_path):
    ckpt = saved(tmp_path, [2, 4], max_to_keep=5)
    damage(ckpt, 2)
    damage(ckpt, 4)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(state(0.0))
    msg = str(e.value)
    assert "no readable checkpoint" in msg and "step 4:" in msg and "step 2:" in msg
    assert "start a new --workdir" in msg


def test_checkpoint_of_another_config_is_refused_by_field(tmp_path):
    ckpt = saved(tmp_path, [2])
    with pytest.raises(CheckpointError, match="algo: checkpoint has 'grpo', config has 'dapo'"):
        ckpt.restore(state(0.0), fingerprint={"algo": "dapo"})


def test_a_foreign_objective_names_only_its_differing_keys(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    objective = {"clip_eps": 0.2, "eps_high": 0.2, "kl_beta": 0.0}
    meta = {"fingerprint": {"algo": "grpo", "objective": json.dumps(objective)}}
    ckpt.save(2, state(2.0), meta, force=True)
    ckpt.wait()
    current = {"algo": "grpo", "objective": json.dumps({**objective, "eps_high": 0.28})}
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(state(0.0), fingerprint=current)
    msg = str(e.value)
    assert "objective.eps_high: checkpoint has 0.2, config has 0.28" in msg
    assert "clip_eps" not in msg and "{" not in msg


def test_a_save_that_hangs_on_storage_is_bounded_and_names_the_intact_step(tmp_path):
    """Storage that stops answering mid-save: `wait` gives up after storage_timeout_s with one
    paragraph naming the committed step (not the one in flight), and exits at once."""
    import threading

    from gjax.checkpoint import CheckpointStorageTimeout

    ckpt = saved(tmp_path, [1], storage_timeout_s=1.0)
    ckpt.save(2, state(2.0), {"data": {"pos": 2}}, force=True)  # synchronous: committed
    hang = threading.Event()
    ckpt._mngr.wait_until_finished = lambda: hang.wait(60)  # an upload that never answers
    ckpt._mngr.is_saving_in_progress = lambda: True
    ckpt._saving = 3  # as if step 3 were being written
    ckpt._mngr.all_steps = lambda: [1, 2, 3]  # orbax lists the step in flight
    t0 = time.monotonic()
    with pytest.raises(CheckpointStorageTimeout) as e:
        ckpt.wait()
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "step 3" in msg and "storage_timeout_s=1" in msg
    assert "The last intact checkpoint is step 2" in msg and e.value.exit_now
    hang.set()


def test_storage_retries_back_off_then_stop_within_the_bound(caplog):
    from gjax import paths

    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionRefusedError("connection refused")
        return "ok"

    assert paths.with_retries(flaky, what="uploading x", timeout_s=30) == "ok"
    assert [round(b - a) for a, b in zip(calls, calls[1:])] == [1, 2]  # backoff doubles
    assert caplog.text.count("uploading x failed (ConnectionRefusedError") == 2

    failing = lambda: (_ for _ in ()).throw(OSError("down"))  # noqa: E731
    for fn, tries in (
        (failing, "(2 tries, the last: OSError"),
        (lambda: time.sleep(60), "(1 try,"),
    ):
        t0 = time.monotonic()
        with pytest.raises(paths.StorageUnavailable) as e:
            paths.with_retries(fn, what="uploading y", timeout_s=3, then=lambda: "Step 7 is safe.")
        assert time.monotonic() - t0 < 4.5
        assert str(e.value).startswith("uploading y kept failing") and e.value.exit_now
        assert str(e.value).endswith("Step 7 is safe.") and "storage_timeout_s=3" in str(e.value)
        assert tries in str(e.value), str(e.value)  # a try that hung for the bound: "1 try"
