"""Every config builds and validates; bad configs fail at start, naming the field."""

import importlib

import ml_collections
import pytest

from configs import common
from gjax.config import ConfigError, check_schema, resolve_mesh_shape, validate

ALGOS = ("grpo", "dr_grpo", "dapo", "gpg", "a_grae", "dagrpo", "cw_grpo")


@pytest.mark.parametrize("arg", [None, "tiny"])
@pytest.mark.parametrize("algo", ALGOS)
def test_every_config_builds_and_validates(algo, arg):
    module = importlib.import_module(f"configs.{algo}")
    assert "python -m gjax.train --config=configs/" in module.__doc__
    c = module.get_config(arg)
    assert c.algo == algo
    validate(c, num_devices=8 if arg is None else 1)
    common.to_objective_config(c.objective)
    if arg == "tiny":
        assert c.model.path == common.EMBEDDED_POLICY and c.data.source == "synthetic"
        # The embedded task's difficulty is set; every other task field stays overridable.
        assert {k: c.data.synthetic[k] for k in common.EMBEDDED_TASK} == common.EMBEDDED_TASK
        assert set(c.data.synthetic) == set(common.base().data.synthetic)


def test_paper_settings_are_the_defaults():
    from configs import a_grae, dagrpo, gpg

    a = a_grae.get_config()
    assert (a.rollout.num_samples, a.optim.lr, a.model.path) == (8, 1e-6, "Qwen/Qwen2.5-Math-7B")
    assert a.objective.advantage_kwargs.alpha == 1.0
    d = dagrpo.get_config()
    assert d.objective.advantage_kwargs.delta == 3.0 and d.train.steps == 500
    assert d.objective.advantage_kwargs.scale == "none"  # Dr.GRPO setting: no std
    assert d.objective.aggregation == "seq_mean_token_sum_norm" and d.objective.kl_beta == 0
    assert d.anchors.per_group == 1 and d.reward.judge == "openai"
    g = gpg.get_config()
    assert g.sampling.min_valid_fraction == 0.6 and g.objective.policy_loss == "pg"


def test_unknown_key_is_named():
    c = common.base()
    c.optim.learning_rate = 1.0
    with pytest.raises(
        ConfigError, match=r"'config\.optim\.learning_rate'.* config\.optim are: .*\blr\b"
    ):
        check_schema(c, common.base())


def test_wrong_type_is_named():
    # ConfigDicts built from base() are type-safe already; a config assembled by hand is not.
    c = ml_collections.ConfigDict({"rollout": {"num_samples": "eight"}})
    with pytest.raises(ConfigError, match=r"config\.rollout\.num_samples must be int"):
        check_schema(c, common.base())


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("rollout.num_samples", 1, r"rollout\.num_samples.*G >= 2"),
        ("rollout.prompts_per_step", 3, r"train\.minibatches"),
        ("train.microbatches", 3, r"train\.microbatches"),
        ("anchors.per_group", 8, r"anchors\.per_group"),
        ("rollout.top_p", 0.0, r"rollout\.top_p"),
        ("sampling.min_valid_fraction", 1.5, r"sampling\.min_valid_fraction"),
        ("reward.judge", "gpt", r"reward\.judge"),
    ],
)
def test_bad_values_are_named(field, value, match):
    c = common.tiny(common.base())
    c.train.minibatches = 2
    section, key = field.split(".")
    c[section][key] = value
    with pytest.raises(ConfigError, match=match):
        validate(c, 1)


def test_mesh_resolution_and_errors():
    c = common.base()
    c.mesh.fsdp, c.mesh.tensor = 2, 2
    assert resolve_mesh_shape(c.mesh, 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"not divisible"):
        resolve_mesh_shape(c.mesh, 6)
    c.mesh.data = 3
    with pytest.raises(ConfigError, match=r"data\*fsdp\*tensor = 12"):
        resolve_mesh_shape(c.mesh, 8)


def test_batch_must_split_over_data_parallel_devices():
    c = common.tiny(common.base())
    c.rollout.prompts_per_step, c.rollout.num_samples = 1, 2  # 2 sequences on 4 devices
    with pytest.raises(ConfigError, match=r"data-parallel size 4"):
        validate(c, 4)


def test_objective_hyperparameters_are_checked():
    c = common.objective("a_grae")
    c.advantage_kwargs.alpha = 0.5  # a known one: fine
    assert dict(common.to_objective_config(c).advantage_kwargs)["alpha"] == 0.5
    c.advantage_kwargs.unlock()
    c.advantage_kwargs.alpah = 0.5
    with pytest.raises(ValueError, match=r"advantage_kwargs: \['alpah'\].*valid: .*'alpha'"):
        common.to_objective_config(c)
    with pytest.raises(ValueError, match=r"unknown objective field"):
        common.objective("grpo", eps=0.1)


def test_config_arg_is_checked():
    from configs import grpo

    with pytest.raises(ValueError, match=r"unknown config argument 'small'"):
        grpo.get_config("small")
