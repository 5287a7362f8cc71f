"""Export a gjax training run (local or gs://) to Hugging Face format.

    python -m gjax.export --workdir=workdirs/a_grae --out=hf_out [--step=N]
                          [--dtype=bfloat16] [--max_shard_size=5GB] [--format=hf|peft]

Needs only the workdir. Training records its policy's architecture and tokenizer in
`WORKDIR/model/` when it starts (HF `config.json`, `generation_config.json`, tokenizer files:
an HF checkpoint without weights); the export restores just the policy params of the newest
checkpoint (or `--step`), never the optimizer state nor the base model's weights, and writes
safetensors shards (+ `model.safetensors.index.json` when there are several), `config.json`,
`generation_config.json` and the tokenizer, loadable by
`transformers.AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer`. The tokenizer's
chat template is the run's prompt template (`data.template`, as Jinja from
`gjax.data.templates.CHAT_TEMPLATES`), so `apply_chat_template` on one user turn with
`add_generation_prompt=True` gives exactly the prompts it was trained on. `--workdir` and
`--out` may be relative, absolute or gs:// paths. A workdir written before `model/` was
recorded falls back to the base model named in its `config.json` (its config and tokenizer
only).

A LoRA run (`model.lora.rank` > 0) checkpoints only its adapters, so its export also loads
the frozen base from the run's `model.path` (as training resolved it, `embedded:` names
included) and refuses a base whose content (`gjax.models.lora.base_digest`) is not the one
the checkpoint recorded. Two forms:

    python -m gjax.export --workdir=WD --out=merged               # --format=hf (default)
    python -m gjax.export --workdir=WD --out=adapter --format=peft

`--format=hf` writes the merged weights (each adapted kernel W + (alpha / r) A B) as a plain
Hugging Face checkpoint of the base architecture, as above; `--format=peft` writes a PEFT
LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer),
loadable by `peft.PeftModel.from_pretrained(base, out)` on the base model. `--format=peft`
of a full fine-tuning run is refused (it has no adapters).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from absl import flags

from gjax import cli, model_record, paths, sharding
from gjax.checkpoint import Checkpointer
from gjax.data import templates
from gjax.embedded import resolve_model_path
from gjax.models import hf_export, hf_format, lora
from gjax.models.config import ModelConfig, dtype_from_name

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's --workdir (local or gs://).")
_OUT = flags.DEFINE_string("out", None, "Output directory (local or gs://).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DTYPE = flags.DEFINE_string(
    "dtype",
    None,
    "Write tensors in this dtype: float32, bfloat16 or float16 (default: as trained).",
)
_SHARD = flags.DEFINE_string("max_shard_size", "5GB", "Bytes per safetensors file.")
FORMATS = ("hf", "peft")
_FORMAT = flags.DEFINE_enum(
    "format",
    "hf",
    FORMATS,
    "hf: a Hugging Face checkpoint (a LoRA run's adapters merged into the base); "
    "peft: a LoRA run's adapters as a PEFT adapter directory.",
)


def export(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    format: str = "hf",
) -> int:
    """Writes the run's checkpoint `step` (default: newest) to `out` in `format` ("hf" or
    "peft", see the module docstring); returns the step."""
    paths.require_backend(workdir, "--workdir")
    paths.require_backend(out, "--out")
    try:
        if dtype is not None:
            dtype_from_name(dtype)
        hf_export.parse_size(max_shard_size)
    except ValueError as e:
        raise model_record.RecordError(str(e)) from None
    if format not in FORMATS:
        raise model_record.RecordError(
            f"--format={format!r} is not an export format; use one of {list(FORMATS)}"
        )
    cfg, source = model_record.load(workdir)
    run_model = model_record.run_config(workdir)["model"]
    lora_run = bool(run_model.get("lora", {}).get("rank", 0))
    if format == "peft" and not lora_run:
        raise model_record.RecordError(
            f"--format=peft writes LoRA adapters, but the run in {workdir} fine-tuned all "
            "parameters (its config.json has model.lora.rank=0), so it has none: export it as a "
            "Hugging Face checkpoint (--format=hf, the default)"
        )
    chat_template = _chat_template(model_record.prompt_template(workdir))
    ckpt = Checkpointer(paths.resolve(workdir) / "checkpoints", async_save=False)
    try:
        if lora_run:
            mesh = sharding.make_mesh({}, devices=jax.local_devices(backend="cpu")[:1])
            step, lora_cfg, adapters, base = model_record.restore_lora(
                ckpt, cfg, run_model, step, mesh
            )
        else:
            step, params = ckpt.restore_params(
                _abstract(hf_format.param_shapes(cfg), cfg), step=step
            )
    finally:
        ckpt.close()
    out_path = str(paths.resolve(out))
    if format == "peft":
        hf_export.save_peft_adapter(
            adapters,
            lora_cfg,
            out_path,
            base_model_name_or_path=resolve_model_path(run_model["path"]),
            tokenizer=source,
            dtype=dtype,
            chat_template=chat_template,
        )
        return step
    if lora_run:
        params = lora.merged(lora.merge(base, adapters), lora_cfg)
    hf_export.save_pretrained(
        params,
        cfg,
        out_path,
        tokenizer=source,
        max_shard_size=max_shard_size,
        dtype=dtype,
        chat_template=chat_template,
    )
    return step


def _abstract(shapes, cfg: ModelConfig):
    return jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, np.dtype(cfg.jnp_param_dtype)),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _chat_template(name: str | None) -> str | None:
    """The Jinja form of the run's prompt template; None (keep the tokenizer's) for `chat`,
    whose prompts came from that template, and, with a warning, for one without a form."""
    if name == "chat":
        return None
    if name not in templates.CHAT_TEMPLATES:
        logging.warning(
            "the run's prompt template %r has no chat template form "
            "(gjax.data.templates.CHAT_TEMPLATES); the export keeps the tokenizer's, which may "
            "not give the prompts the model was trained on",
            name,
        )
        return None
    return templates.CHAT_TEMPLATES[name]


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        # orbax logs each restore step by step (INFO, through absl); --verbosity=0 shows it.
        logging.getLogger("absl").setLevel(logging.WARNING)
    step = export(
        _WORKDIR.value,
        _OUT.value,
        step=_STEP.value,
        dtype=_DTYPE.value,
        max_shard_size=_SHARD.value,
        format=_FORMAT.value,
    )
    print(f"exported step {step} of {_WORKDIR.value} to {paths.resolve(_OUT.value)}")
    jax.effects_barrier()


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir", "out"])
    cli.run(main)
