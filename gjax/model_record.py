"""The policy a run trains, recorded with the run: `WORKDIR/model/`.

When training starts it writes the policy's HF `config.json` (the architecture it loaded,
with the trained param dtype), the base checkpoint's `generation_config.json` (sampling
defaults and special ids) and its tokenizer files: an HF checkpoint without weights. The
weights live in `WORKDIR/checkpoints/`. Together they are all `python -m gjax.export` needs,
so an export works from the workdir alone (local or gs://), without the base model.
"""

from __future__ import annotations

import json

import jax
import ml_collections

from gjax import paths, sharding
from gjax.embedded import resolve_model_path
from gjax.errors import UserError
from gjax.models import hf_export, hf_import, lora, quant, transformer
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


def restore_lora(ckpt, cfg: ModelConfig, run_model: dict, step, mesh):
    """`(step, lora cfg, adapters, base)` of a LoRA run (`ckpt` its Checkpointer): the
    checkpoint's adapters and the frozen base loaded from the run's `model.path` onto `mesh`,
    refused unless its content is the base the adapters trained on (the checkpoint's
    `model.base_digest`); a QLoRA base is quantized as in training (`gjax.models.quant`)."""
    step, meta = ckpt.restore_meta(step=step)
    recorded = meta.get("fingerprint", {})
    if "model.lora" not in recorded or not recorded.get("model.base_digest"):
        raise RecordError(
            f"the checkpoint of step {step} in {ckpt.directory} records no LoRA settings or "
            "base digest (model.lora, model.base_digest), though the run's config.json has "
            "model.lora.rank > 0: it was not written by a gjax LoRA run, so its adapters "
            "cannot be exported"
        )
    record = json.loads(recorded["model.lora"])
    lora_cfg = lora.configure(
        cfg, ml_collections.ConfigDict({**record, "targets": ",".join(record["targets"])})
    )
    abstract = lora.abstract_adapters(lora_cfg)  # placed on `mesh`, as the base will be
    shardings = sharding.param_shardings(abstract, mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    step, adapters = ckpt.restore_params(abstract, step=step)
    base_path = resolve_model_path(run_model["path"])
    base = _load_base(base_path, run_model, step, ckpt.directory, mesh)
    digest = lora.base_digest(base)
    if digest != recorded["model.base_digest"]:
        where = run_model["path"] + ("" if base_path == run_model["path"] else f" ({base_path})")
        raise RecordError(
            f"the base model at model.path={where} is not the one the "
            f"LoRA adapters of step {step} in {ckpt.directory} were trained on: its content "
            f"digest is {digest}, the checkpoint recorded {recorded['model.base_digest']}. The "
            "weights at that path changed since training; put the original base back there "
            "to export the adapters (they fit only the base they trained on)."
        )
    if lora_cfg.base_quant != "none":
        abstract = lora.split(transformer.abstract_params(lora_cfg))[0]
        base = quant.quantize_base(base, lora_cfg, sharding.param_shardings(abstract, mesh))
    return step, lora_cfg, adapters, base


def _load_base(path: str, run_model: dict, step: int, directory, mesh) -> dict:
    """The run's frozen base, in its trained param dtype, on `mesh`."""
    try:
        _, base = hf_import.load_pretrained(path, mesh=mesh, param_dtype=run_model["param_dtype"])
    except UserError:
        raise
    except (OSError, ValueError) as e:
        raise RecordError(
            f"a LoRA run's checkpoints hold only its adapters (step {step} in {directory}), so "
            f"the export loads the frozen base from the run's model.path={run_model['path']}"
            f"{'' if path == run_model['path'] else f' ({path})'}, which could not be loaded ({type(e).__name__}: {e}); make the base "
            "model available at that path again"
        ) from None
    return base
