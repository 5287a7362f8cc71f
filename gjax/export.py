"""Export a gjax training checkpoint (local or gs://) to Hugging Face format.

    python -m gjax.export --workdir=gs://BUCKET/runs/a_grae --out=/tmp/a_grae_hf [--step=N]
                          [--dtype=bfloat16] [--max_shard_size=5GB]

Reads the run's `config.json` for the base model (its architecture and tokenizer), restores
the policy parameters of the newest (or given) checkpoint, and writes safetensors shards +
index, `config.json`, `generation_config.json` and the tokenizer, loadable by
`transformers.AutoModelForCausalLM.from_pretrained(out)`. `--out` may be a gs:// path.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags
from etils import epath

from gjax import cli
from gjax.checkpoint import Checkpointer
from gjax.embedded import resolve_model_path
from gjax.models import hf_io
from gjax.trainer import TrainState, make_optimizer

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's --workdir.")
_OUT = flags.DEFINE_string("out", None, "Output directory (local or gs://).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DTYPE = flags.DEFINE_string("dtype", None, "Write tensors in this dtype (e.g. bfloat16).")
_SHARD = flags.DEFINE_string("max_shard_size", "5GB", "Bytes per safetensors file.")


def export(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
) -> int:
    config_path = epath.Path(workdir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: is {workdir!r} a gjax --workdir?")
    run_config = json.loads(config_path.read_text())
    base = resolve_model_path(run_config["model"]["path"])
    cfg, params = hf_io.load_pretrained(base, param_dtype=run_config["model"]["param_dtype"])
    tx, _ = make_optimizer(ml_collections.ConfigDict(run_config["optim"]), 1)
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
    )
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    step, state, _ = ckpt.restore(abstract, step=step)
    hf_io.save_pretrained(
        state.params, cfg, out, tokenizer=base, max_shard_size=max_shard_size, dtype=dtype
    )
    ckpt.close()
    return step


def main(argv):
    del argv
    step = export(
        _WORKDIR.value,
        _OUT.value,
        step=_STEP.value,
        dtype=_DTYPE.value,
        max_shard_size=_SHARD.value,
    )
    print(f"exported step {step} of {_WORKDIR.value} to {_OUT.value}")
    jax.effects_barrier()


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir", "out"])
    cli.run(main)
