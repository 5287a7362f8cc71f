"""The policy a run trains, recorded with the run: `WORKDIR/model/`.

When training starts it writes the policy's HF `config.json` (the architecture it loaded,
with the trained param dtype), the base checkpoint's `generation_config.json` (sampling
defaults and special ids) and its tokenizer files: an HF checkpoint without weights. The
weights live in `WORKDIR/checkpoints/`. Together they are all `python -m gjax.export` needs,
so an export works from the workdir alone (local or gs://), without the base model.
"""

from __future__ import annotations

import json

from gjax import paths
from gjax.embedded import resolve_model_path
from gjax.errors import UserError
from gjax.models import hf_export, hf_import
from gjax.models.config import ModelConfig

MODEL_DIR = "model"


class RecordError(UserError, ValueError):
    """A workdir or option that cannot give an export; the message says what to change."""


def save(workdir: str, cfg: ModelConfig, source: str) -> None:
    """Records the policy loaded from `source` (a local or gs:// dir) with the run."""
    hf_export.save_model_files(
        cfg,
        str(paths.resolve(workdir) / MODEL_DIR),
        tokenizer=source,
        generation_config=hf_export.source_generation_config(source),
    )


def load(workdir: str) -> tuple[ModelConfig, str]:
    """`(cfg, a directory holding its tokenizer)` of the policy the run in `workdir` trained.

    A run from before `WORKDIR/model/` was recorded falls back to the base model named in its
    `config.json` (its config and tokenizer are read, not its weights).
    """
    wd = paths.resolve(workdir)
    config_path = wd / "config.json"
    if not config_path.exists():
        raise RecordError(
            f"{config_path} not found: --workdir={workdir} is not a gjax training run "
            "(pass the --workdir the training command wrote)"
        )
    run_config = json.loads(config_path.read_text())
    record = wd / MODEL_DIR
    if (record / "config.json").exists():
        source = str(record)
    else:
        source = resolve_model_path(run_config["model"]["path"])
    cfg = hf_import.load_config(source, param_dtype=run_config["model"]["param_dtype"])
    return cfg, source


def run_config(workdir: str) -> dict:
    """The run's recorded `config.json` (gjax.config_record) as a dict."""
    return json.loads((paths.resolve(workdir) / "config.json").read_text())


def prompt_template(workdir: str) -> str | None:
    """The name of the prompt template the run in `workdir` trained with (its `config.json`'s
    `data.template`), or None for a config without one."""
    return run_config(workdir).get("data", {}).get("template")
