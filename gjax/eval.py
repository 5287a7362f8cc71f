"""Evaluation: n samples per problem, pass@k / avg@n / maj@k, on the papers' benchmarks.

    python -m gjax.eval --checkpoint=workdirs/a_grae [--step=N] --benchmarks=heldout
    python -m gjax.eval --model=/models/Qwen2.5-Math-7B --benchmarks=math500,aime24,amc23 \
        [--num_samples=32] [--temperature=0.6] [--top_p=0.95] [--max_new_tokens=4096] \
        [--k=1,4,16] [--greedy] [--out=DIR]
    # local copies in each benchmark's own format (no Hub access needed):
    python -m gjax.eval --model=DIR --benchmarks=aime24=/data/aime_2024.parquet,math500=m.jsonl

`--checkpoint` is a training `--workdir` (or its `checkpoints` dir, or one step dir in it);
only the policy parameters are restored. `--model` is a Hugging Face checkpoint dir (local,
gs:// or hub id). Benchmarks: `gjax.data.benchmarks` (MATH-500, AIME 2024/2025, AMC23,
Minerva, OlympiadBench, and `heldout`: the embedded task's held-out split, offline).

Sampling follows the papers' evaluations (A-GRAE App. C.2: temperature 0.6, top-p 0.95, up
to 4096 new tokens; n per problem: 32 on AIME/AMC (DaGRPO's avg@32), 4 on the larger sets).
Reported per benchmark (`summarize`):

* ``pass@k``: the unbiased estimator of A-GRAE eq. (37), 1 - C(n-c, k) / C(n, k) averaged
  over problems (c correct of n samples); ``pass@1`` = mean c / n;
* ``avg@n``: mean accuracy over all n samples (the same number as pass@1; the name the
  papers use for small sets, e.g. DaGRPO's avg@32);
* ``maj@k``: accuracy of the majority answer among k samples (``maj_at_k``);
* ``greedy`` (with ``--greedy``): accuracy of one greedy (temperature 0) completion;
* ``no_answer`` (share of samples without an extractable answer), ``truncated`` (share that
  hit the token limit) and ``length_mean`` (new tokens).

Results go to `OUT/results.json` and `OUT/results.md` (a markdown table, also printed).
This module is the command; the work is `gjax.evaluation`'s: `metrics` (pass@k, maj@k,
`summarize`), `sampling` (`sample_and_score`), `report` (the table) and `heldout` (training's
held-out evaluation, `heldout_metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any

import jax
import numpy as np
from absl import flags
from etils import epath
from ml_collections import ConfigDict

from configs import common
from gjax import cli, model_record, paths, sharding
from gjax.checkpoint import Checkpointer
from gjax.config import resolve_mesh_shape
from gjax.data import benchmarks as bench_lib
from gjax.data.builders import run_data_config
from gjax.data.prompts import PromptData
from gjax.embedded import resolve_model_path
from gjax.evaluation.metrics import EvalError, Samples, parse_ks, summarize
from gjax.evaluation.report import markdown_table
from gjax.evaluation.sampling import sample_and_score
from gjax.models import hf_format, hf_import, lora
from gjax.rewards.pipeline import verifier_extractors
from gjax.rewards.verifier import Verifier
from gjax.rollout import LocalSampler, SamplingParams
from gjax.rollout.backend import stop_and_pad

log = logging.getLogger("gjax.eval")

# The papers' evaluation sampling (A-GRAE App. C.2).
PAPER_TEMPERATURE = 0.6
PAPER_TOP_P = 0.95
PAPER_MAX_NEW_TOKENS = 4096


def run_model_source(workdir: str) -> tuple[str, dict[str, Any]]:
    """(model dir, run config) of a training workdir: the policy recorded with the run
    (`WORKDIR/model`, see gjax.model_record), or for a run from before that record the base
    model named by the run's `config.json`, whose architecture and tokenizer it shares."""
    path = epath.Path(workdir) / "config.json"
    if not path.exists():
        raise EvalError(
            f"{path} not found: --checkpoint must be a gjax --workdir (or its checkpoints)"
        )
    run = json.loads(path.read_text())
    record = epath.Path(workdir) / model_record.MODEL_DIR
    if (record / "config.json").exists():
        return str(record), run
    return resolve_model_path(run["model"]["path"]), run


def split_checkpoint_path(path: str, step: int | None) -> tuple[str, str, int | None]:
    """--checkpoint -> (workdir, checkpoints dir, step): a workdir, its `checkpoints` dir, or
    one step dir in it (`.../checkpoints/40`, which names the step)."""
    p = epath.Path(path if "://" in path else os.path.abspath(path))
    if (p / "checkpoints").is_dir():
        return str(p), str(p / "checkpoints"), step
    if (
        p.name.isdigit()
        and (p.parent / p.name).is_dir()
        and (p.parent.parent / "config.json").exists()
    ):
        if step is not None and step != int(p.name):
            raise EvalError(f"--checkpoint names step {p.name} but --step={step}")
        return str(p.parent.parent), str(p.parent), int(p.name)
    if (p.parent / "config.json").exists() and p.is_dir():
        return str(p.parent), str(p), step
    raise EvalError(
        f"--checkpoint={path}: no gjax checkpoints there (expected a --workdir with "
        "config.json and checkpoints/, its checkpoints/ dir, or a step dir inside it)"
    )


def restore_params(ckpt_dir: str, abstract_params, step: int | None = None):
    """(step, params) of a training checkpoint, the params alone (`Checkpointer.restore_params`:
    orbax partial restore into `abstract_params`' shapes and shardings)."""

    ckpt = Checkpointer(ckpt_dir)
    try:
        return ckpt.restore_params(abstract_params, step=step)
    finally:
        ckpt.close()


@dataclasses.dataclass
class _Policy:
    """What the CLI evaluates: params on a mesh, their model config and tokenizer."""

    cfg: Any
    params: Any
    tokenizer: Any
    model_path: str
    run: dict[str, Any]  # the training run's config (a tiny-default stand-in for --model)
    label: str
    step: int | None
    out_dir: str
    mesh: Any


def _load_policy(F, mesh_for) -> _Policy:
    """--checkpoint (params restored alone) or --model (an HF dir), placed on the mesh."""

    if F.checkpoint:
        workdir, ckpt_dir, step = split_checkpoint_path(F.checkpoint, F.step)
        model_path, run = run_model_source(workdir)
    else:
        tiny = common.tiny(common.base())  # `heldout` with --model: the embedded task's
        model_path, step = resolve_model_path(F.model), None
        run = {"data": tiny.data.to_dict(), "rollout": tiny.rollout.to_dict()}
    mesh = mesh_for(run)
    dtype = F.dtype or run.get("model", {}).get("dtype")
    overrides = {"dtype": dtype} if dtype else {}
    if F.checkpoint and run.get("model", {}).get("lora", {}).get("rank", 0):
        # A LoRA run's checkpoints hold its adapters: the base comes from its model.path.
        cfg = hf_import.load_config(model_path, **overrides)
        cfg = cfg.replace(param_dtype=run["model"].get("param_dtype", "float32"))
        ckpt = Checkpointer(ckpt_dir)
        try:
            step, cfg, adapters, base = model_record.restore_lora(
                ckpt, cfg, run["model"], step, mesh
            )
        finally:
            ckpt.close()
        params = lora.merge(base, adapters)
        label, out_dir = f"{workdir} step {step}", os.path.join(workdir, "eval", f"step_{step}")
    elif F.checkpoint:
        param_dtype = run.get("model", {}).get("param_dtype", "float32")
        cfg = hf_import.load_config(model_path, **overrides).replace(param_dtype=param_dtype)
        shapes = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, np.dtype(cfg.jnp_param_dtype)),
            hf_format.param_shapes(cfg),
            is_leaf=lambda x: isinstance(x, tuple),
        )
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            shapes,
            sharding.param_shardings(shapes, mesh),
        )
        step, params = restore_params(ckpt_dir, abstract, step)
        label, out_dir = f"{workdir} step {step}", os.path.join(workdir, "eval", f"step_{step}")
    else:
        cfg, params = hf_import.load_pretrained(model_path, mesh=mesh, **overrides)
        label = F.model
        out_dir = os.path.join("eval_results", os.path.basename(os.path.normpath(F.model)))
    tok = hf_import.load_tokenizer(model_path)
    return _Policy(cfg, params, tok, model_path, run, label, step, out_dir, mesh)


def main(argv) -> None:
    del argv

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    F = flags.FLAGS
    if bool(F.checkpoint) == bool(F.model):
        raise EvalError("give exactly one of --checkpoint (a training workdir) or --model (HF dir)")
    for name in ("checkpoint", "model", "out"):
        paths.require_backend(F[name].value, f"--{name}")
    specs = bench_lib.parse_specs(F.benchmarks)

    def mesh_for(run):  # the run's mesh (or data-parallel), --fsdp / --tensor override it
        mesh_cfg = dict(run.get("mesh") or {"data": -1, "fsdp": 1, "tensor": 1})
        for axis in ("fsdp", "tensor"):
            if F[axis].value is not None:
                mesh_cfg[axis], mesh_cfg["data"] = F[axis].value, -1
        shape = resolve_mesh_shape(ConfigDict(mesh_cfg), jax.device_count())
        return sharding.make_mesh(shape)

    # Jitted sampling traced from here on sees the mesh and the logical-axis rules.
    with contextlib.ExitStack() as scope:
        policy = _load_policy(F, mesh_for)
        scope.enter_context(jax.set_mesh(policy.mesh))
        scope.enter_context(sharding.use_rules())
        cfg, tok, run = policy.cfg, policy.tokenizer, policy.run
        eos, pad_id = stop_and_pad(cfg, tok)
        out_dir = F.out or policy.out_dir
        # The run's own prompt template for its checkpoints; the papers' for a model.
        template = F.template or (run["data"]["template"] if F.checkpoint else "qwen_boxed")
        results: dict[str, dict[str, float]] = {}
        per_benchmark: dict[str, dict[str, Any]] = {}
        backend = LocalSampler(cfg)
        # The run's answer extractors for its checkpoints (the format its prompts ask for).
        extractors = verifier_extractors(
            F.extractors or run.get("reward", {}).get("extractors", "boxed,answer_tag")
        )
        verifier = Verifier(
            timeout_s=F.verifier_timeout_s,
            num_workers=F.verifier_workers,
            extractors=extractors,
        )
        with verifier:
            for i, spec in enumerate(specs):
                data = bench_lib.load_benchmark(
                    spec,
                    tok,
                    template=template,
                    max_prompt_len=cfg.max_position_embeddings - 1,
                    heldout_data=run_data_config(run),
                )
                room = cfg.max_position_embeddings - max(len(x) for x in data.prompt_ids)
                heldout = spec.name == bench_lib.HELDOUT
                want = F.max_new_tokens or (
                    run["rollout"]["max_new_tokens"] if heldout else PAPER_MAX_NEW_TOKENS
                )
                if F.max_new_tokens and want > room:
                    raise EvalError(
                        f"--max_new_tokens={want} does not fit: {spec.name}'s longest prompt "
                        f"leaves {room} of the model's {cfg.max_position_embeddings} positions"
                    )
                n = F.num_samples or bench_lib.default_num_samples(spec.name)
                sampling = SamplingParams(
                    max_new_tokens=min(want, room),
                    temperature=F.temperature,
                    top_p=F.top_p,
                    stop_token_ids=eos,
                    pad_token_id=pad_id,
                )
                results[spec.name] = _evaluate_one(
                    F, spec.name, backend, policy.params, tok, data, verifier, n, sampling,
                    rng=jax.random.fold_in(jax.random.key(F.seed), i), out_dir=out_dir,
                )  # fmt: skip
                per_benchmark[spec.name] = {
                    "source": spec.path or bench_lib.source_of(spec.name),
                    "num_samples": n,
                    "k": parse_ks(F.k, n),
                    "max_new_tokens": sampling.max_new_tokens,
                }
    report = {
        "evaluated": policy.label,
        "model": policy.model_path,
        "step": policy.step,
        "settings": {
            "temperature": F.temperature,
            "top_p": F.top_p,
            "template": template,
            "extractors": list(extractors),
            "seed": F.seed,
        },
        "per_benchmark": per_benchmark,
        "benchmarks": results,
    }
    table = markdown_table(results)
    out = epath.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(f"# {policy.label}\n\n{table}")
    print(f"\n{policy.label}\n\n{table}\nresults: {out / 'results.json'}, {out / 'results.md'}")


def _evaluate_one(F, name, backend, params, tok, data, verifier, n, sampling, *, rng, out_dir):
    """One benchmark's metrics: n samples per problem, plus greedy with --greedy."""
    ks = parse_ks(F.k, n)
    log.info(
        "%s: %d problems x %d samples (T=%s, top-p=%s, <= %d new tokens)",
        name, len(data), n, sampling.temperature, sampling.top_p, sampling.max_new_tokens,
    )  # fmt: skip
    kw = dict(rng=rng, max_rows=F.max_rows)
    samples = sample_and_score(
        backend, params, tok, data, verifier, num_samples=n, sampling=sampling, progress=name, **kw
    )
    metrics = summarize(samples, ks)
    if F.greedy:
        greedy = sample_and_score(
            backend, params, tok, data, verifier, num_samples=1,
            sampling=dataclasses.replace(sampling, temperature=0.0, top_p=1.0),
            progress=f"{name} greedy", **kw,
        )  # fmt: skip
        metrics["greedy"] = float(greedy.correct_PxN.mean())
    log.info("%s: %s", name, json.dumps(metrics))
    if F.save_samples:
        _write_samples(out_dir, name, data, samples)
    return metrics


def _write_samples(out_dir: str, name: str, data: PromptData, samples: Samples) -> None:
    out = epath.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{name}_samples.jsonl").open("w") as f:
        for i in range(len(data)):
            row = {
                "problem": data.problems[i],
                "answer": data.answers[i],
                "completions": samples.texts[i],
                "correct": samples.correct_PxN[i].tolist(),
                "votes": samples.keys[i],
            }
            f.write(json.dumps(row) + "\n")


def _define_flags() -> None:
    """The CLI's flags, defined only when run as a program (tests import this module)."""
    d = flags
    d.DEFINE_string("checkpoint", None, "A training --workdir, its checkpoints/ dir or a step dir.")
    d.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
    d.DEFINE_string("model", None, "A Hugging Face checkpoint dir (local, gs:// or hub id).")
    d.DEFINE_string("benchmarks", "heldout", "Comma list of NAME or NAME=local_path.")
    d.DEFINE_integer("num_samples", None, "n per problem (default: per benchmark, 4 to 32).")
    d.DEFINE_float("temperature", PAPER_TEMPERATURE, "Sampling temperature.")
    d.DEFINE_float("top_p", PAPER_TOP_P, "Nucleus sampling mass.")
    d.DEFINE_integer("max_new_tokens", None, "Default 4096 (heldout: the run's), within context.")
    d.DEFINE_string("k", None, "k values of pass@k and maj@k (default: 1, 2, 4, ... n).")
    d.DEFINE_bool("greedy", False, "Also report greedy (temperature 0) accuracy.")
    d.DEFINE_string("template", None, "Prompt template (default: the run's, else qwen_boxed).")
    d.DEFINE_string(
        "extractors",
        None,
        "Answer extractors, comma list (default: the run's, else boxed,answer_tag).",
    )
    d.DEFINE_string("out", None, "Output dir (default: WORKDIR/eval/step_N or eval_results/NAME).")
    d.DEFINE_integer("max_rows", 256, "Sequences per sampler call (bounds memory).")
    d.DEFINE_integer("seed", 0, "Sampling seed.")
    d.DEFINE_string("dtype", None, "Compute dtype (default: the run's, else the model's).")
    d.DEFINE_integer("fsdp", None, "Mesh fsdp axis (default: the run's, else 1).")
    d.DEFINE_integer("tensor", None, "Mesh tensor axis (default: the run's, else 1).")
    d.DEFINE_float("verifier_timeout_s", 5.0, "Per-answer verifier deadline in seconds.")
    d.DEFINE_integer("verifier_workers", 2, "Verifier worker processes.")
    d.DEFINE_bool("save_samples", False, "Also write OUT/<benchmark>_samples.jsonl.")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
