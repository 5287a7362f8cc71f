"""Config validation: fail at start, naming the field, before anything expensive happens.

`validate(config, num_devices)` checks the structure against `configs.common.base()` (an
unknown or mistyped key names the valid ones), value ranges, mesh/batch divisibility, and
length budgets. It returns the resolved mesh shape.
"""

from __future__ import annotations

import difflib

import ml_collections

from gjax.cli import UserError


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the field and what to do."""


def _walk(cfg: ml_collections.ConfigDict, prefix: str = ""):
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            yield from _walk(value, path + ".")
        else:
            yield path, value


def check_schema(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict) -> None:
    """Every key of `config` exists in `schema` with a compatible type."""
    want = dict(_walk(schema))
    for path, value in _walk(config):
        if path.startswith(("objective.advantage_kwargs.", "objective.token_weights_kwargs.")):
            continue  # per-estimator; checked against its signature by to_objective_config
        if path not in want:
            section = path.rpartition(".")[0]
            siblings = sorted(k for k in want if k.rpartition(".")[0] == section)
            close = difflib.get_close_matches(path, siblings, n=3, cutoff=0.5)
            hint = f" Did you mean {close}?" if close else ""
            raise ConfigError(
                f"unknown config field 'config.{path}'.{hint} Valid fields here: {siblings}"
            )
        ref = want[path]
        if ref is None or value is None:
            continue
        ok = isinstance(value, type(ref)) or (isinstance(ref, float) and isinstance(value, int))
        if isinstance(ref, bool) != isinstance(value, bool):
            ok = False
        if not ok:
            raise ConfigError(
                f"config.{path} must be {type(ref).__name__}, got {type(value).__name__} "
                f"({value!r})"
            )


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config.{field}: {msg}")


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    shape = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
    for axis, size in shape.items():
        _require(size == -1 or size >= 1, f"mesh.{axis}", f"must be >= 1 or -1, got {size}")
    fixed = 1
    for size in shape.values():
        fixed *= size if size > 0 else 1
    free = [a for a, s in shape.items() if s == -1]
    _require(len(free) <= 1, "mesh", f"at most one axis may be -1, got {free}")
    if free:
        _require(
            num_devices % fixed == 0,
            f"mesh.{free[0]}",
            f"{num_devices} devices are not divisible by the fixed axes' product {fixed}",
        )
        shape[free[0]] = num_devices // fixed
    total = shape["data"] * shape["fsdp"] * shape["tensor"]
    _require(
        total == num_devices,
        "mesh",
        f"data*fsdp*tensor = {total} but {num_devices} devices are available",
    )
    return shape


def validate(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    from configs import common

    check_schema(config, common.base())
    n_roll = config.mesh.rollout_devices
    _require(
        0 <= n_roll < num_devices,
        "mesh.rollout_devices",
        f"must be in [0, {num_devices}) (0: rollouts share the train mesh), got {n_roll}",
    )
    mesh = resolve_mesh_shape(config.mesh, num_devices - n_roll)
    r, t, s = config.rollout, config.train, config.sampling
    _require(
        r.num_samples >= 2,
        "rollout.num_samples",
        f"group-relative advantages need G >= 2 samples per prompt, got {r.num_samples}",
    )
    _require(
        0 <= config.anchors.per_group < r.num_samples,
        "anchors.per_group",
        f"must be in [0, num_samples={r.num_samples}), got {config.anchors.per_group}",
    )
    _require(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    for name in ("minibatches", "microbatches", "num_iterations", "steps"):
        _require(t[name] >= 1, f"train.{name}", f"must be >= 1, got {t[name]}")
    data_parallel = mesh["data"] * mesh["fsdp"]
    per_update = t.minibatches * t.microbatches
    _require(
        r.prompts_per_step % t.minibatches == 0,
        "train.minibatches",
        f"prompts_per_step={r.prompts_per_step} is not divisible by minibatches={t.minibatches}",
    )
    seqs = r.prompts_per_step * r.num_samples
    _require(
        seqs % (per_update * data_parallel) == 0,
        "train.microbatches",
        f"the {seqs} sequences per step (prompts_per_step*num_samples) must split evenly "
        f"into minibatches*microbatches={per_update} pieces of a size divisible by the "
        f"data-parallel size {data_parallel} (mesh.data*mesh.fsdp)",
    )
    _require(
        0 <= r.max_staleness <= 16,
        "rollout.max_staleness",
        f"must be in [0, 16] policy versions, got {r.max_staleness}",
    )
    _require(
        n_roll == 0 or n_roll % mesh["tensor"] == 0,
        "mesh.rollout_devices",
        f"the rollout mesh keeps mesh.tensor={mesh['tensor']}, which must divide {n_roll}",
    )
    _require(
        config.objective.behaviour_correction == "none" or r.recompute_old_logps,
        "objective.behaviour_correction",
        "corrects the sampler against the trainer's own old log-probs: set "
        "--config.rollout.recompute_old_logps=True",
    )
    _require(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _require(
        config.objective.temperature == r.temperature,
        "objective.temperature",
        f"the loss must score log_softmax(logits / T) at the sampling temperature: got "
        f"{config.objective.temperature} but rollout.temperature = {r.temperature}",
    )
    _require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _require(r.top_k >= 0, "rollout.top_k", f"must be >= 0, got {r.top_k}")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _require(config.data.max_prompt_len >= 1, "data.max_prompt_len", "must be >= 1")
    _require(
        0.0 <= s.min_valid_fraction <= 1.0,
        "sampling.min_valid_fraction",
        f"must be in [0, 1], got {s.min_valid_fraction}",
    )
    _require(s.max_rollouts_per_step >= 1, "sampling.max_rollouts_per_step", "must be >= 1")
    _require(
        0 <= s.overlong_buffer < r.max_new_tokens,
        "sampling.overlong_buffer",
        f"must be in [0, max_new_tokens={r.max_new_tokens})",
    )
    _require(
        config.reward.judge in ("none", "openai", "rule"),
        "reward.judge",
        f"must be one of none|openai|rule, got {config.reward.judge!r}",
    )
    _require(
        config.reward.judge_on_missing in ("keep", "drop", "fill"),
        "reward.judge_on_missing",
        "must be keep|drop|fill",
    )
    _require(config.optim.lr > 0, "optim.lr", f"must be > 0, got {config.optim.lr}")
    _require(
        config.optim.schedule in ("constant", "cosine"), "optim.schedule", "must be constant|cosine"
    )
    _require(config.checkpoint.every >= 1, "checkpoint.every", "must be >= 1")
    return mesh
