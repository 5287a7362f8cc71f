"""A workdir's record of how its run was configured.

`WORKDIR/config.json` is the config the run started with; `WORKDIR/config_history.jsonl` has
one line per resume that changed a field: `{"step": N, "changes": {field: [old, new]}}`, the
change taking effect from checkpoint step N. A resume whose config differs from the recorded
one (config.json with the history applied) in a field that changes training is refused
(`check`) unless `train.allow_config_change`; the fields in `HARMLESS` may change freely; the
checkpoint's fingerprint fields (model, algo, objective, data source...) may never change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import ml_collections

from gjax import paths, schema
from gjax.errors import ConfigError

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
OPT_IN = "train.allow_config_change"

# Fields a resume may change without changing what a step trains: the run's length (but see
# `_training_changes`: a cosine schedule decays over it), checkpoint and log cadences (and
# where the run logs: Weights & Biases), storage and request timeouts, the compilation cache
# (a cached program is the one a compile makes), the server's address and the verifier's
# worker count; and how rollouts are decoded (decoder, slots, tokens per dispatch, prefill
# chunk): the same distribution,
# other draws at most, and nothing in the checkpoint (a run started when 'auto' was static on
# several processes resumes continuous). Anything else, parallelism and mesh included, needs
# the opt-in.
HARMLESS = frozenset(
    {
        OPT_IN,
        "train.steps",
        "train.max_sampled_tokens",
        "train.storage_timeout_s",
        "train.compilation_cache",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.async_save",
        "log.tensorboard",
        "log.progress",
        "log.eval_every",
        "log.wandb_project",
        "log.wandb_entity",
        "log.wandb_name",
        "log.wandb_tags",
        "log.wandb_mode",
        "eval.max_rows",
        "rollout.server_address",
        "rollout.request_timeout_s",
        "rollout.weight_transfer",
        "rollout.decoder",
        "rollout.decode_slots",
        "rollout.tokens_per_dispatch",
        "rollout.prefill_chunk",
        "rollout.kv_page_size",
        "rollout.kv_pages",
        "reward.workers",
    }
)


def flat(config: ml_collections.ConfigDict | dict) -> dict[str, Any]:
    """{dotted path: JSON value} of every leaf (as config.json writes it)."""
    if isinstance(config, ml_collections.ConfigDict):
        config = json.loads(config.to_json_best_effort())
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat(value).items()})
        else:
            out[key] = value
    return out


def recorded(workdir: str) -> dict[str, Any] | None:
    """The flat config the run last trained with (config.json plus its history), or None."""
    config_path = paths.resolve(os.path.join(workdir, CONFIG))
    if not config_path.exists():
        return None
    config = flat(json.loads(config_path.read_text()))
    history = paths.resolve(os.path.join(workdir, HISTORY))
    if history.exists():
        for line in history.read_text().splitlines():
            if line.strip():
                config.update({k: new for k, (_, new) in json.loads(line)["changes"].items()})
    return config


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{path: (old, new)} of the fields of `new` that differ from `old`. A field `old` lacks
    (added to the schema since) counts as its default; one `new` lacks (removed) is skipped;
    an unset objective.temperature is the rollout's (as the loss sees it)."""
    default = flat(schema.base())
    old, new = _as_trained({**default, **old}), _as_trained(new)
    out = {}
    for path, value in new.items():
        before = old.get(path)
        if path != OPT_IN and before != value:
            out[path] = (before, value)
    return out


def _as_trained(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("objective.temperature", 0) is None:
        return {**config, "objective.temperature": config["rollout.temperature"]}
    return config


def check(
    workdir: str, config: ml_collections.ConfigDict, fixed: Iterable[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """The changes of a resume in `workdir` against its recorded config (called only when the
    workdir has checkpoints, before the model and data load); raises ConfigError for one that
    changes training without `train.allow_config_change`, and for any change under `fixed`
    (the checkpoint's fingerprint, which no opt-in makes resumable), naming only the fields
    that differ."""
    saved = recorded(workdir)
    if saved is None:
        return {}
    diff = changes(saved, flat(config))
    fixed = tuple(fixed)
    unresumable = [p for p in diff if any(p == f or p.startswith(f + ".") for f in fixed)]
    if unresumable:  # the checkpoint's own check would refuse it, once everything had loaded
        listed = "; ".join(f"{p}: {diff[p][0]!r} -> {diff[p][1]!r}" for p in unresumable)
        raise ConfigError(
            f"--workdir {workdir} holds checkpoints of a run trained with another config, "
            f"and they cannot resume under this one ({listed}): these fields are fixed for "
            f"a run's life (--config.{OPT_IN}=True does not lift that). Use a new --workdir "
            "for the new config, or rerun the old values."
        )
    training = _training_changes(diff, config)
    if training and not config.train.allow_config_change:
        listed = "; ".join(f"{p}: {diff[p][0]!r} -> {diff[p][1]!r}" for p in training)
        raise ConfigError(
            f"--workdir {workdir} holds a run trained with another config, and resuming it "
            f"with this one would change how its next steps train ({listed}). Use a new "
            "--workdir for the new config, or rerun the old values, or set "
            f"--config.{OPT_IN}=True to resume with the change (config.json keeps the "
            f"original config; the change and the step it starts from go to {HISTORY})."
        )
    return diff


def training_changes(workdir: str, config: ml_collections.ConfigDict) -> dict[str, tuple]:
    """{path: (recorded, config's)} of the fields that would train differently from the run
    recorded in `workdir` (none when it has no record): what `check` refuses on a resume."""
    saved = recorded(workdir)
    if saved is None:
        return {}
    diff = changes(saved, flat(config))
    return {p: diff[p] for p in _training_changes(diff, config)}


def _training_changes(diff: dict, config: ml_collections.ConfigDict) -> list[str]:
    """The changed fields that change how the next steps train. `train.steps` is the length
    a cosine learning-rate schedule decays over (gjax.learner.make_optimizer): longer or
    shorter, it changes the rate of every remaining step."""
    cosine = config.optim.schedule == "cosine"
    return [p for p in diff if p not in HARMLESS or (p == "train.steps" and cosine)]


def write(workdir: str, config: ml_collections.ConfigDict) -> None:
    """A fresh run's record: config.json, and no history."""
    paths.write_text(os.path.join(workdir, CONFIG), config.to_json_best_effort(indent=2))
    history = paths.resolve(os.path.join(workdir, HISTORY))
    if history.exists():  # of a run whose checkpoints were removed
        history.unlink()


def resumed(
    workdir: str, config: ml_collections.ConfigDict, step: int, diff: dict[str, tuple[Any, Any]]
) -> None:
    """A resume's record: its changes (`check`), from checkpoint `step` on, added to the
    history; config.json written only where it is missing."""
    if not paths.resolve(os.path.join(workdir, CONFIG)).exists():
        paths.write_text(os.path.join(workdir, CONFIG), config.to_json_best_effort(indent=2))
        return
    if not diff:
        return
    history = paths.resolve(os.path.join(workdir, HISTORY))
    before = history.read_text() if history.exists() else ""
    line = json.dumps({"step": step, "changes": {k: list(v) for k, v in diff.items()}})
    history.write_text(before + line + "\n")
