"""Evaluation: n samples per problem, pass@k / avg@n / maj@k, on the papers' benchmarks.

    python -m gjax.eval --checkpoint=workdirs/a_grae [--step=N] --benchmarks=heldout
    python -m gjax.eval --model=/models/Qwen2.5-Math-7B --benchmarks=math500,aime24,amc23 \
        [--num_samples=32] [--temperature=0.6] [--top_p=0.95] [--max_new_tokens=4096] \
        [--k=1,4,16] [--greedy] [--out=DIR]
    # local copies in each benchmark's own format (no Hub access needed):
    python -m gjax.eval --model=DIR --benchmarks=aime24=/data/aime_2024.parquet,math500=m.jsonl
    # the same prompts, greedy settings and scoring as an lm-evaluation-harness task
    # (gjax.evaluation.lm_eval_task; writes DIR/gjax_heldout/, evaluates nothing):
    python -m gjax.eval --checkpoint=workdirs/a_grae --write_lm_eval_task=DIR

`--checkpoint` is a training `--workdir` (or its `checkpoints` dir, or one step dir in it);
only the policy parameters are restored. A run trained on a multi-turn environment
(config.env.name other than `math`) is refused: its held-out evaluation is over episodes,
training's own (`gjax.evaluation.episodes`, summary.json). `--model` is a Hugging Face checkpoint dir (local,
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
from gjax.evaluation import lm_eval_task
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


def _model_and_run(checkpoint: str | None, model: str | None) -> tuple[str, dict[str, Any]]:
    """(model dir, run config) of --checkpoint (a training run) or --model (an HF dir, with
    the tiny config's data and rollout standing in for the run: `heldout` is the embedded
    task's)."""
    if checkpoint:
        workdir, _, _ = split_checkpoint_path(checkpoint, None)
        model_path, run = run_model_source(workdir)
        check_single_turn(checkpoint, run)
        return model_path, run
    tiny = common.tiny(common.base())
    return resolve_model_path(model), {
        "data": tiny.data.to_dict(),
        "rollout": tiny.rollout.to_dict(),
    }


def check_single_turn(checkpoint: str, run: dict[str, Any]) -> None:
    """This command samples single completions: a run trained on episodes of a multi-turn
    environment (config.env.name, other than the one-step `math`, whose episode is one
    completion scored alike) is refused in one paragraph naming where its figures are."""
    name = (run.get("env") or {}).get("name", "")
    if not name or name == "math":
        return
    raise EvalError(
        f"--checkpoint={checkpoint}: this run trained on episodes of the {name!r} environment "
        "(config.env.name); gjax.eval samples single completions, without the environment's "
        "turns or tools, so its figures would not measure what the run learned. The run's "
        "held-out evaluation is over episodes: see its summary.json (heldout_*) and, with "
        "--config.log.eval_every=N, its metrics.jsonl. To score single completions anyway, "
        "export the policy (python -m gjax.export --workdir=RUN --out=DIR) and pass --model=DIR."
    )


def _load_policy(F, mesh_for) -> _Policy:
    """--checkpoint (params restored alone) or --model (an HF dir), placed on the mesh."""

    if F.checkpoint:
        workdir, ckpt_dir, step = split_checkpoint_path(F.checkpoint, F.step)
    model_path, run = _model_and_run(F.checkpoint, F.model)
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
        step, label = None, F.model
        out_dir = os.path.join("eval_results", os.path.basename(os.path.normpath(F.model)))
    tok = hf_import.load_tokenizer(model_path)
    return _Policy(cfg, params, tok, model_path, run, label, step, out_dir, mesh)


def prompt_format(
    run: dict[str, Any], template: str | None, extractors: str | None, is_run: bool
) -> tuple[str, tuple[str, ...]]:
    """(prompt template, answer extractors) of an evaluation: the flags', else the run's own
    for its checkpoints (the format its prompts ask for), else the papers' for a model."""
    template = template or (run["data"]["template"] if is_run else "qwen_boxed")
    names = extractors or run.get("reward", {}).get("extractors", "boxed,answer_tag")
    return template, verifier_extractors(names)


def benchmark_prompts(
    spec: bench_lib.BenchmarkSpec,
    cfg,
    tok,
    run: dict[str, Any],
    *,
    template: str,
    max_new_tokens: int | None = None,
    temperature: float = PAPER_TEMPERATURE,
    top_p: float = PAPER_TOP_P,
) -> tuple[PromptData, SamplingParams]:
    """A benchmark's prompts (every problem, templated and tokenized) and its sampling: up to
    `max_new_tokens` (default: the run's rollout length for `heldout`, else the papers'),
    capped by the context the longest prompt leaves; stops at the model's EOS."""
    data = bench_lib.load_benchmark(
        spec,
        tok,
        template=template,
        max_prompt_len=cfg.max_position_embeddings - 1,
        heldout_data=run_data_config(run),
    )
    room = cfg.max_position_embeddings - max(len(x) for x in data.prompt_ids)
    heldout = spec.name == bench_lib.HELDOUT
    want = max_new_tokens or (run["rollout"]["max_new_tokens"] if heldout else PAPER_MAX_NEW_TOKENS)
    if max_new_tokens and want > room:
        raise EvalError(
            f"--max_new_tokens={want} does not fit: {spec.name}'s longest prompt "
            f"leaves {room} of the model's {cfg.max_position_embeddings} positions"
        )
    eos, pad_id = stop_and_pad(cfg, tok)
    sampling = SamplingParams(
        max_new_tokens=min(want, room),
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=eos,
        pad_token_id=pad_id,
    )
    return data, sampling


def greedy_sampling(sampling: SamplingParams) -> SamplingParams:
    """`--greedy`'s sampling: temperature 0 (argmax), otherwise as `sampling`."""
    return dataclasses.replace(sampling, temperature=0.0, top_p=1.0)


def write_lm_eval_tasks(
    out_dir: str,
    *,
    checkpoint: str | None = None,
    model: str | None = None,
    benchmarks: str = bench_lib.HELDOUT,
    template: str | None = None,
    extractors: str | None = None,
    max_new_tokens: int | None = None,
    verifier_timeout_s: float = 5.0,
) -> list[str]:
    """Writes each benchmark as a local lm-evaluation-harness task, `out_dir/gjax_<name>/`
    (`gjax.evaluation.lm_eval_task`): the prompts, max new tokens, stop tokens and answer
    scoring of `gjax.eval --greedy` on the same checkpoint. Reads the run's config, the
    model's config and its tokenizer, never the weights. Returns the task dirs."""
    if bool(checkpoint) == bool(model):
        raise EvalError("give exactly one of --checkpoint (a training workdir) or --model (HF dir)")
    model_path, run = _model_and_run(checkpoint, model)
    cfg = hf_import.load_config(model_path)
    tok = hf_import.load_tokenizer(model_path)
    template, names = prompt_format(run, template, extractors, bool(checkpoint))
    stop_ids, _ = stop_and_pad(cfg, tok)
    stop = [tok.decode([i], skip_special_tokens=False) for i in stop_ids]
    dirs = []
    for spec in bench_lib.parse_specs(benchmarks):
        data, sampling = benchmark_prompts(
            spec, cfg, tok, run, template=template, max_new_tokens=max_new_tokens
        )
        _check_tokenization(spec.name, data, tok)
        source = {
            "evaluated": checkpoint or model,
            "model": model_path,
            "template": (
                run_data_config(run)["template"] if spec.name == bench_lib.HELDOUT else template
            ),
            "benchmark_source": spec.path or bench_lib.source_of(spec.name),
        }
        dirs.append(
            lm_eval_task.write_task(
                out_dir,
                spec.name,
                data,
                max_new_tokens=sampling.max_new_tokens,
                stop=stop,
                extractors=names,
                verifier_timeout_s=verifier_timeout_s,
                source=source,
            )
        )
    return dirs


def _check_tokenization(name: str, data: PromptData, tok) -> None:
    """The prompts' text must come back as gjax's token ids (lm-eval tokenizes the text)."""
    for prompt, ids in zip(data.prompts, data.prompt_ids):
        if tok(prompt, add_special_tokens=False)["input_ids"] != ids.tolist():
            raise EvalError(
                f"benchmark {name!r}: a templated prompt does not tokenize back to the ids gjax "
                f"samples from ({prompt[:80]!r}...), so lm-eval would not see gjax's input; "
                "this tokenizer cannot be evaluated through a text task"
            )


def main(argv) -> None:
    del argv

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    F = flags.FLAGS
    if bool(F.checkpoint) == bool(F.model):
        raise EvalError("give exactly one of --checkpoint (a training workdir) or --model (HF dir)")
    for name in ("checkpoint", "model", "out", "write_lm_eval_task"):
        paths.require_backend(F[name].value, f"--{name}")
    specs = bench_lib.parse_specs(F.benchmarks)
    if F.write_lm_eval_task:
        dirs = write_lm_eval_tasks(
            F.write_lm_eval_task,
            checkpoint=F.checkpoint,
            model=F.model,
            benchmarks=F.benchmarks,
            template=F.template,
            extractors=F.extractors,
            max_new_tokens=F.max_new_tokens,
            verifier_timeout_s=F.verifier_timeout_s,
        )
        tasks = ",".join(os.path.basename(d) for d in dirs)
        print(
            f"lm-eval task(s) {tasks} written to {F.write_lm_eval_task}. Evaluate an export "
            "(python -m gjax.export --workdir=RUN --out=EXPORT) with:\n  lm_eval --model hf "
            "--model_args pretrained=EXPORT,dtype=float32,add_bos_token=False "
            f"--tasks {tasks} --include_path {F.write_lm_eval_task} --batch_size 32"
        )
        return

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
        out_dir = F.out or policy.out_dir
        template, extractors = prompt_format(run, F.template, F.extractors, bool(F.checkpoint))
        results: dict[str, dict[str, float]] = {}
        per_benchmark: dict[str, dict[str, Any]] = {}
        backend = LocalSampler(cfg)
        verifier = Verifier(
            timeout_s=F.verifier_timeout_s,
            num_workers=F.verifier_workers,
            extractors=extractors,
        )
        with verifier:
            for i, spec in enumerate(specs):
                data, sampling = benchmark_prompts(
                    spec, cfg, tok, run, template=template, max_new_tokens=F.max_new_tokens,
                    temperature=F.temperature, top_p=F.top_p,
                )  # fmt: skip
                n = F.num_samples or bench_lib.default_num_samples(spec.name)
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
            backend, params, tok, data, verifier, num_samples=1, sampling=greedy_sampling(sampling),
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
    d.DEFINE_string(
        "write_lm_eval_task",
        None,
        "Write the benchmarks as lm-evaluation-harness tasks in this dir (DIR/gjax_<name>/: "
        "gjax's prompts, greedy, max new tokens, stop tokens, scoring) instead of evaluating.",
    )


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
