"""The workdir's config record: a resume that changes training is refused unless opted in, and
an accepted change is appended to config_history.jsonl with its step."""

import json

import pytest

from configs import common
from gjax import config_record
from gjax.errors import ConfigError
from gjax.train import fingerprint


def _config():
    return common.tiny(common.base())


def _check(wd, c):
    return config_record.check(str(wd), c, fingerprint(c))


def test_an_unchanged_or_harmless_resume_passes(tmp_path):
    c = _config()
    config_record.write(str(tmp_path), c)
    assert _check(tmp_path, c) == {}
    c.train.steps, c.log.eval_every, c.checkpoint.every = 400, 10, 7
    c.train.storage_timeout_s, c.reward.workers = 30.0, 2
    assert _check(tmp_path, c) == {
        "train.steps": (120, 400),
        "log.eval_every": (0, 10),
        "checkpoint.every": (40, 7),
        "train.storage_timeout_s": (300.0, 30.0),
        "reward.workers": (1, 2),
    }


def test_a_longer_run_under_a_cosine_schedule_changes_training(tmp_path):
    """A cosine learning rate decays over train.steps: extending the run changes the rate of
    every remaining step, so it needs the opt-in (a constant schedule's does not)."""
    c = _config()
    c.optim.schedule = "cosine"
    config_record.write(str(tmp_path), c)
    c.train.steps = 400
    with pytest.raises(ConfigError, match=r"train\.steps: 120 -> 400"):
        _check(tmp_path, c)
    c.train.allow_config_change = True
    assert _check(tmp_path, c) == {"train.steps": (120, 400)}


def test_a_training_change_is_refused_naming_each_field(tmp_path):
    c = _config()
    config_record.write(str(tmp_path), c)
    saved = (tmp_path / "config.json").read_text()
    c.optim.lr, c.rollout.top_k, c.train.steps = 1e-4, 5, 400
    with pytest.raises(ConfigError) as err:
        _check(tmp_path, c)
    msg = " ".join(str(err.value).split())
    assert "optim.lr: 3e-05 -> 0.0001" in msg and "rollout.top_k: 0 -> 5" in msg
    assert "train.steps" not in msg  # harmless: not a reason to refuse
    assert "new --workdir" in msg and "--config.train.allow_config_change=True" in msg
    assert "\n" not in str(err.value)  # one paragraph
    assert (tmp_path / "config.json").read_text() == saved


def test_a_fingerprint_change_is_refused_naming_only_the_fields_that_differ(tmp_path):
    """algo, objective, model...: fixed for a run's life (the checkpoint's fingerprint), so no
    opt-in lifts them; refused here, before anything loads, naming each differing leaf (not
    the objective's whole settings, twice)."""
    c = _config()
    config_record.write(str(tmp_path), c)
    c.algo, c.objective.eps_high, c.optim.lr = "other", 0.28, 1e-4
    c.train.allow_config_change = True
    with pytest.raises(ConfigError) as err:
        _check(tmp_path, c)
    msg = str(err.value)
    assert "algo: 'grpo' -> 'other'" in msg and "objective.eps_high: 0.2 -> 0.28" in msg
    assert "{" not in msg and "objective.clip" not in msg  # only what differs
    assert "new --workdir" in msg and "\n" not in msg


def test_resume_with_another_objective_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """gjax.train refuses it before the model, data and held-out set load (it used to be the
    checkpoint's refusal, once all of them had)."""
    import jax.numpy as jnp

    from gjax import checkpoint as ckpt_lib
    from gjax import train as train_lib
    from gjax.models import hf_import

    c = _config()
    wd = str(tmp_path)
    config_record.write(wd, c)
    ckpt = ckpt_lib.Checkpointer(
        str(tmp_path / "checkpoints"), async_save=False, save_interval_steps=1
    )
    ckpt.save(1, {"w": jnp.ones(3)}, {"fingerprint": fingerprint(c)}, force=True)
    ckpt.wait()
    ckpt.close()

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded the model before refusing the config")

    monkeypatch.setattr(hf_import, "load_policy", no_loading)
    c.objective.eps_high = 0.28
    with pytest.raises(ConfigError, match=r"objective\.eps_high: 0\.2 -> 0\.28"):
        train_lib.train(c, wd)


def test_an_opted_in_change_is_recorded_and_becomes_the_baseline(tmp_path):
    wd = str(tmp_path)
    c = _config()
    config_record.write(wd, c)
    original = (tmp_path / "config.json").read_text()
    c.optim.lr, c.train.steps = 1e-4, 400
    c.train.allow_config_change = True
    diff = _check(tmp_path, c)
    assert diff == {"optim.lr": (3e-5, 1e-4), "train.steps": (120, 400)}
    config_record.resumed(wd, c, 120, diff)
    assert (tmp_path / "config.json").read_text() == original
    lines = (tmp_path / config_record.HISTORY).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 120, "changes": {"optim.lr": [3e-5, 1e-4], "train.steps": [120, 400]}}
    ]
    # The next resume, without the opt-in, compares against the changed config.
    c.train.allow_config_change = False
    assert _check(tmp_path, c) == {}
    c.optim.lr = 3e-5  # going back is a change again
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.0001 -> 3e-05"):
        _check(tmp_path, c)
    c.train.allow_config_change = True
    config_record.resumed(wd, c, 200, _check(tmp_path, c))
    lines = (tmp_path / config_record.HISTORY).read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 200, "changes": {"optim.lr": [1e-4, 3e-5]}}
    assert config_record.recorded(wd)["optim.lr"] == 3e-5


def test_a_fresh_start_drops_a_stale_history_and_old_fields_count_as_defaults(tmp_path):
    wd = str(tmp_path)
    c = _config()
    (tmp_path / config_record.HISTORY).write_text('{"step": 5, "changes": {}}\n')
    config_record.write(wd, c)
    assert not (tmp_path / config_record.HISTORY).exists()
    # A config.json written before a field existed: the field counts as its default; one the
    # schema no longer has is ignored.
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["train"]["allow_config_change"], saved["sampling"]["overlong_penalty"]
    saved["train"]["gone"] = 1
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert _check(tmp_path, c) == {}
    # A config.json from before objective.temperature followed rollout.temperature: the same
    # temperature, set explicitly, is no change.
    saved["objective"]["temperature"] = 0.7
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert _check(tmp_path, c) == {}
    c.sampling.overlong_penalty = 0.5
    with pytest.raises(ConfigError, match=r"sampling\.overlong_penalty: 1\.0 -> 0\.5"):
        _check(tmp_path, c)


def test_a_run_started_on_an_earlier_decoder_resumes_on_the_default(tmp_path):
    """A workdir whose config.json predates rollout.decoder (absent: 'auto', once static on
    several processes) or names 'static' resumes on today's default without the opt-in: the
    decoder and its scheduling change draws, not the state; the change is recorded."""
    wd = str(tmp_path)
    c = _config()
    config_record.write(wd, c)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["rollout"]["decoder"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert _check(tmp_path, c) == {}
    saved["rollout"]["decoder"] = "static"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    c.rollout.decode_slots, c.rollout.tokens_per_dispatch, c.rollout.prefill_chunk = 32, 4, 16
    diff = _check(tmp_path, c)
    assert diff == {
        "rollout.decoder": ("static", "auto"),
        "rollout.decode_slots": (64, 32),
        "rollout.tokens_per_dispatch": (8, 4),
        "rollout.prefill_chunk": (0, 16),
    }
    config_record.resumed(wd, c, 10, diff)
    assert config_record.recorded(wd)["rollout.decoder"] == "auto"
