"""Config validation: fail at start, naming the field, before anything expensive happens.

`validate(config, num_devices)` checks the structure against `configs.common.base()` (an
unknown or mistyped key names the valid ones), every numeric field against its `Range` in
`configs.common.FIELDS`, every name against its registry (objective parts, reward functions,
templates, rollout backends), mesh/batch divisibility, and length budgets, all before the
model and the data load. It returns the resolved mesh shape.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re

import ml_collections

from gjax.cli import UserError


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric field, written as an interval: `Range("(0, 1]")`.

    `inf` closes an unbounded side; `also` lists values allowed besides the interval (e.g.
    `-1` for "all remaining devices"). Every value must be finite; `None` is allowed only for
    fields whose default is `None` (a placeholder meaning "off" or "all").
    """

    interval: str
    also: tuple = ()

    def _bounds(self) -> tuple[bool, float, float, bool]:
        m = re.fullmatch(r"([\[(])\s*(-?inf|[^,]+?)\s*,\s*(-?inf|[^,]+?)\s*([\])])", self.interval)
        if not m:
            raise ValueError(f"bad interval {self.interval!r}; write e.g. '[0, 1)' or '(0, inf)'")
        return m[1] == "[", float(m[2]), float(m[3]), m[4] == "]"

    def __post_init__(self):
        self._bounds()

    def __contains__(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if value in self.also:
            return True
        lo_closed, lo, hi, hi_closed = self._bounds()
        return (
            math.isfinite(value)
            and (lo <= value if lo_closed else lo < value)
            and (value <= hi if hi_closed else value < hi)
        )

    def __str__(self) -> str:
        lo_closed, lo, hi, hi_closed = self._bounds()
        if math.isinf(hi):
            text = f"{'>=' if lo_closed else '>'} {_num(lo)}"
        else:
            text = f"in {self.interval}"
        return text + "".join(f" or {_num(a)}" for a in self.also)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _walk(cfg: ml_collections.ConfigDict, prefix: str = ""):
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            yield from _walk(value, path + ".")
        else:
            yield path, value


def unknown_field(path: str, known, how: str = "") -> ConfigError:
    """The error for `config.<path>`, not among the `known` leaf paths: it names the deepest
    section that exists, the closest valid names there and all of that section's fields."""
    known = set(known)
    sections = {""} | {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
    parts = path.split(".")
    depth = max(i for i in range(len(parts)) if ".".join(parts[:i]) in sections)
    section = ".".join(parts[:depth])
    prefix = f"{section}." if section else ""
    children = sorted(
        {k[len(prefix) :].split(".")[0] for k in known | sections if k.startswith(prefix) and k}
        - {""}
    )
    close = difflib.get_close_matches(parts[depth], children, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(f'config.{prefix}{c}') for c in close)}?"
    where = f"config.{section}" if section else "config"
    return ConfigError(
        f"unknown config field 'config.{path}'{how}.{hint if close else ''} The fields of "
        f"{where} are: {', '.join(children)}. Run with --help to see every field and its meaning."
    )


def check_schema(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict) -> None:
    """Every key of `config` exists in `schema` with a compatible type."""
    want = dict(_walk(schema))
    for path, value in _walk(config):
        if path.startswith(("objective.advantage_kwargs.", "objective.token_weights_kwargs.")):
            continue  # per-estimator; checked against its signature by to_objective_config
        if path not in want:
            raise unknown_field(path, want)
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


# Rollout backends `gjax.train.make_backend` builds; a new backend adds its name here.
ROLLOUT_BACKENDS = ("local", "jetstream", "jetstream_grpc")
DTYPES = ("float32", "bfloat16", "float16")


def _get(config: ml_collections.ConfigDict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


def check_ranges(config: ml_collections.ConfigDict, fields: dict, schema) -> None:
    """Every numeric field with a `Range` in `fields` (`configs.common.FIELDS`) lies in it."""
    for path, (doc, valid) in fields.items():
        if valid is None:
            continue
        value = _get(config, path)
        if value is None and _get(schema, path) is None:
            continue  # a placeholder left unset: off / all
        if value not in valid:
            raise ConfigError(
                f"config.{path}={value!r} is out of range: it must be {valid}. Set "
                f"--config.{path} to a value {valid} (the field: {doc})."
            )


def reward_specs(functions: str) -> list[tuple[str, float]]:
    """`config.reward.functions` ("name[:weight],...") as (name, weight) pairs, checked."""
    from gjax.rewards.functions import REWARDS

    specs = []
    for item in functions.split(","):
        name, _, weight = item.strip().partition(":")
        _require(
            name in REWARDS,
            "reward.functions",
            f"unknown reward function {name!r} in {functions!r}; valid names: "
            f"{sorted(REWARDS)}; write a comma list of name[:weight]",
        )
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = math.nan
        _require(
            math.isfinite(w),
            "reward.functions",
            f"the weight of {name!r} must be a finite number, got {weight!r} in {functions!r}",
        )
        specs.append((name, w))
    return specs


def check_names(config: ml_collections.ConfigDict) -> None:
    """Every name field refers to something that exists (registries, dtypes, files)."""
    import glob
    import os

    from configs import common
    from gjax.data.sources import SYNTHETIC, _looks_like_path
    from gjax.data.synthetic import SyntheticConfig
    from gjax.data.templates import TEMPLATES
    from gjax.models.config import REMAT_POLICIES

    m, d = config.model, config.data
    for name in ("dtype", "param_dtype"):
        _require(m[name] in DTYPES, f"model.{name}", f"must be one of {DTYPES}, got {m[name]!r}")
    _require(
        m.remat in REMAT_POLICIES,
        "model.remat",
        f"must be one of {REMAT_POLICIES}, got {m.remat!r}",
    )
    _require(
        d.template in TEMPLATES,
        "data.template",
        f"unknown template {d.template!r}; valid: {sorted(TEMPLATES)}",
    )
    if d.source == SYNTHETIC:
        try:
            SyntheticConfig(**d.synthetic.to_dict())
        except ValueError as e:
            raise ConfigError(f"config.data.synthetic: {e}") from None
    elif _looks_like_path(d.source) and "://" not in d.source:
        _require(
            bool(glob.glob(os.path.expanduser(d.source))),
            "data.source",
            f"no file or directory matches {d.source!r} (relative to {os.getcwd()}); give a "
            "local .jsonl/.parquet/.arrow file or directory, a Hub id, or 'synthetic'",
        )
    reward_specs(config.reward.functions)
    _require(
        config.rollout.backend in ROLLOUT_BACKENDS,
        "rollout.backend",
        f"must be one of {ROLLOUT_BACKENDS}, got {config.rollout.backend!r}",
    )
    try:
        common.to_objective_config(config.objective)
    except (ValueError, KeyError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(
            msg if msg.startswith("config.") else f"config.objective: {msg}"
        ) from None


def check_model(config: ml_collections.ConfigDict, path: str) -> str:
    """The local directory of the policy at `path` (from `config.model.path`), after checking
    that its config.json exists, is supported and fits the run's lengths; no weight is read."""
    from gjax.models import hf_format, hf_import

    try:
        local = hf_format.resolve_dir(path)
        cfg = hf_import.load_config(local)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"config.model.path={config.model.path!r}: {e}. Set config.model.path to a local or "
            "gs:// checkpoint directory, a Hugging Face hub id, or embedded:tiny_qwen2."
        ) from None
    S, T = config.data.max_prompt_len, config.rollout.max_new_tokens
    _require(
        cfg.max_position_embeddings >= S + T,
        "rollout.max_new_tokens",
        f"data.max_prompt_len + rollout.max_new_tokens = {S + T} exceeds the model's "
        f"max_position_embeddings={cfg.max_position_embeddings}",
    )
    return local


def validate(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    from configs import common

    schema = common.base()
    check_schema(config, schema)
    check_ranges(config, common.FIELDS, schema)
    check_names(config)
    n_roll = config.mesh.rollout_devices
    _require(
        n_roll < num_devices,
        "mesh.rollout_devices",
        f"must be in [0, {num_devices}) (0: rollouts share the train mesh), got {n_roll}",
    )
    mesh = resolve_mesh_shape(config.mesh, num_devices - n_roll)
    import jax

    _require(
        jax.process_count() == 1 or (n_roll == 0 and config.rollout.max_staleness == 0),
        "rollout.max_staleness",
        "the asynchronous rollout pipeline (max_staleness > 0 or mesh.rollout_devices > 0) "
        "runs in one process; a multi-process run trains synchronously",
    )
    r, t, s = config.rollout, config.train, config.sampling
    _require(
        config.anchors.per_group < r.num_samples,
        "anchors.per_group",
        f"must be in [0, num_samples={r.num_samples}), got {config.anchors.per_group}",
    )
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
    _require(
        config.objective.temperature == r.temperature,
        "objective.temperature",
        f"the loss must score log_softmax(logits / T) at the sampling temperature: got "
        f"{config.objective.temperature} but rollout.temperature = {r.temperature}",
    )
    _require(
        s.overlong_buffer < r.max_new_tokens,
        "sampling.overlong_buffer",
        f"must be in [0, max_new_tokens={r.max_new_tokens}), got {s.overlong_buffer}",
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
    from gjax.rewards.judge import check_reward_config

    check_reward_config(config.reward)  # judge fields; a key pasted as the env name is refused
    _require(
        config.optim.schedule in ("constant", "cosine"), "optim.schedule", "must be constant|cosine"
    )
    from gjax.evaluation.heldout import HeldoutEval

    HeldoutEval.from_config(config.eval)  # pass_k against num_samples; raises ConfigError
    return mesh
