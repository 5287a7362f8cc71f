"""Checkpoints: periodic saves, exact round trip, and no run lost to a damaged or foreign one."""

import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from gjax.checkpoint import Checkpointer, CheckpointError


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


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    ckpt = saved(tmp_path, [2, 4], max_to_keep=5)
    damage(ckpt, 4)
    with caplog.at_level(logging.ERROR, logger="gjax.checkpoint"):
        step, got, meta = ckpt.restore(state(0.0))
    assert step == 2 and meta["data"] == {"pos": 2}
    np.testing.assert_array_equal(got["params"]["w"], state(2.0)["params"]["w"])
    assert "checkpoint step 4" in caplog.text and "unreadable" in caplog.text
    assert ckpt.all_steps() == [2, 4]  # nothing deleted: the damaged step is left to inspect


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
