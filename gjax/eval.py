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
Training's held-out evaluation (`gjax.train`) calls `heldout_metrics` from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from absl import flags

from gjax import multihost
from gjax.cli import UserError
from gjax.data.prompts import PromptData, left_pad
from gjax.rewards.verifier import extract_answer
from gjax.rollout import RolloutBackend, SamplingParams

log = logging.getLogger("gjax.eval")

# The papers' evaluation sampling (A-GRAE App. C.2).
PAPER_TEMPERATURE = 0.6
PAPER_TOP_P = 0.95
PAPER_MAX_NEW_TOKENS = 4096


class EvalError(UserError, ValueError):
    """A bad evaluation request (flags, k values, paths); the message says what to change."""


# ------------------------------------------------------------------------------ metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: 1 - C(n-c, k) / C(n, k) (A-GRAE eq. (37)).

    The probability that at least one of k samples drawn without replacement from the n
    generated (c of them correct) is correct. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i),
    which equals the binomial ratio and never forms large binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    if k == 1:
        return c / n  # exact (the product below rounds)
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


_KEY_DROP = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s|\\text\{\s*\}")


def answer_key(text: str, extractors: Sequence[str] = ("boxed", "answer_tag")) -> str | None:
    """The vote of one completion for maj@k: its extracted final answer, normalized by
    string (spacing, ``\\left``/``\\right``, ``$``, ``\\dfrac``/``\\tfrac`` -> ``\\frac``, a
    trailing period dropped), or None when it has none. Answers equal in value but written
    differently (``0.5`` and ``\\frac12``) vote apart."""
    answer, _ = extract_answer(text, extractors)
    if answer is None:
        return None
    key = _KEY_DROP.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key.rstrip(".") or None


def maj_at_k(keys: Sequence[str | None], correct: Sequence[float], k: int) -> float:
    """Majority-vote accuracy of one problem over its n samples, in chunks of k.

    The n samples are split into floor(n/k) consecutive chunks of k; in each, the answer
    given most often (by `answer_key`; samples without an answer do not vote) wins, and the
    chunk scores that answer's correctness. A tie between answers scores the mean
    correctness of the tied answers (the expected score of a uniform tie-break), so the
    result does not depend on the order of the samples. A chunk where nobody answered scores
    0. Returns the mean over chunks.
    """
    n = len(keys)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n = len(keys) = len(correct); got k={k}, n={n}")
    scores = []
    for start in range(0, n - k + 1, k):
        chunk = [(keys[i], float(correct[i])) for i in range(start, start + k)]
        votes = Counter(key for key, _ in chunk if key is not None)
        if not votes:
            scores.append(0.0)
            continue
        top = max(votes.values())
        winners = [key for key, v in votes.items() if v == top]
        # All samples with one key share its correctness; their mean guards odd verifier cases.
        scores.append(
            float(np.mean([np.mean([c for key, c in chunk if key == w]) for w in winners]))
        )
    return float(np.mean(scores))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []
    return sorted(set(ks) | {n})


def parse_ks(text: str | Sequence[int] | None, n: int, *, where: str = "--k") -> list[int]:
    if text is None or text == "":
        return default_ks(n)
    try:
        ks = sorted({int(x) for x in (text.split(",") if isinstance(text, str) else text)})
    except ValueError as e:
        raise EvalError(f"{where}={text!r}: expected a comma-separated list of integers") from e
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise EvalError(
            f"{where}: k={bad} outside 1..n={n} (pass@k and maj@k need k <= the samples per "
            "problem); lower k or raise the number of samples"
        )
    return ks


@dataclasses.dataclass
class Samples:
    """The scored completions of P problems x N samples (prompt-major)."""

    texts: list[list[str]]  # [P][N]
    correct_PxN: np.ndarray  # float32 in {0, 1}
    lengths_PxN: np.ndarray  # int32 new tokens (stop token included)
    truncated_PxN: np.ndarray  # bool: no stop token within max_new_tokens
    keys: list[list[str | None]]  # answer_key per sample


def summarize(samples: Samples, ks: Sequence[int]) -> dict[str, float]:
    """Benchmark metrics from scored samples (see the module docstring)."""
    p, n = samples.correct_PxN.shape
    correct_P = samples.correct_PxN.sum(-1).astype(int)
    out: dict[str, float] = {"problems": p, "n": n}
    out[f"avg@{n}"] = float(samples.correct_PxN.mean())
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct_P]))
    for k in ks:
        if k > 1:
            out[f"maj@{k}"] = float(
                np.mean([maj_at_k(samples.keys[i], samples.correct_PxN[i], k) for i in range(p)])
            )
    out["no_answer"] = float(np.mean([[key is None for key in row] for row in samples.keys]))
    out["truncated"] = float(samples.truncated_PxN.mean())
    out["length_mean"] = float(samples.lengths_PxN.mean())
    return out


# ------------------------------------------------------------------------- sampling + scoring


def stop_token_ids(cfg, tokenizer) -> tuple[tuple[int, ...], int]:
    """(stop ids, pad id) as training's rollout uses them."""
    eos = tuple(cfg.eos_token_id) or (tokenizer.eos_token_id,)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return eos, pad


class Transfer(Protocol):
    """Whole batches between the host and the devices when several processes share a mesh:
    `put_full` takes the batch every process holds in full and returns the global array,
    `pull_full` returns a global row-sharded array in full on every process
    (`gjax.trainer.Steps` implements it over `gjax.multihost`)."""

    def put_full(self, x: np.ndarray) -> jax.Array: ...

    def pull_full(self, x: jax.Array) -> np.ndarray: ...


def sample_and_score(
    backend: RolloutBackend,
    params,
    tokenizer,
    data: PromptData,
    verifier,
    *,
    num_samples: int,
    sampling: SamplingParams,
    rng: jax.Array,
    max_rows: int = 256,
    batch_shape: tuple[int, int] | None = None,
    width: int | None = None,
    progress: bool | str = False,
    transfer: Transfer | None = None,
) -> Samples:
    """Draws `num_samples` completions for every problem of `data` and scores them.

    Every call to the sampler has the same shape (P prompts x G samples, P a multiple of
    the device count, the last batch padded with repeats that are dropped), so it compiles
    once. `max_rows` bounds P x G per call; a problem's n samples span several calls when
    n > G. `batch_shape=(P, G)` and `width` (padded prompt length; default: the longest
    prompt, rounded up to 8) fix the shape instead, e.g. to the training rollout's so that
    its compiled program is reused. `progress`: a tqdm bar (its description, if a string).
    `transfer` moves whole batches between host and devices in a multi-process run (every
    process samples every batch, the devices each decoding their rows; see `Transfer`, and
    the verifier's work is split over the processes); by default numpy arrays go in as they
    are.
    """
    put = transfer.put_full if transfer is not None else (lambda x: x)
    pull = transfer.pull_full if transfer is not None else np.asarray
    n_problems, n = len(data), num_samples
    devices = jax.device_count()
    if batch_shape is not None:
        p, g = batch_shape
    else:
        g = min(n, max(1, max_rows))
        p = min(max(1, max_rows // g), n_problems)  # prompts per call
    p = -(-p // devices) * devices  # the batch axis is sharded over the devices
    calls_per_problem = -(-n // g)
    longest = max(len(x) for x in data.prompt_ids)
    width = width or -(-longest // 8) * 8
    if width < longest:
        raise ValueError(f"width {width} < the longest prompt ({longest} tokens)")
    texts: list[list[str]] = [[] for _ in range(n_problems)]
    lengths = np.zeros((n_problems, calls_per_problem * g), np.int32)
    truncated = np.zeros((n_problems, calls_per_problem * g), bool)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=n_problems * n,
            desc=progress if isinstance(progress, str) else "eval",
            unit="sample",
            dynamic_ncols=True,
            leave=False,
        )
    stop = set(sampling.stop_token_ids)
    for start in range(0, n_problems, p):
        rows = list(range(start, min(start + p, n_problems)))
        padded = rows + [rows[-1]] * (p - len(rows))
        ids_PxS, mask_PxS = left_pad([data.prompt_ids[r] for r in padded], width, data.pad_id)
        for call in range(calls_per_problem):
            key = jax.random.fold_in(jax.random.fold_in(rng, start), call)
            out = backend.generate(
                params, put(ids_PxS), put(mask_PxS), key, num_samples=g, sampling=sampling
            )
            tokens_BxN, lengths_B = pull(out.tokens_BxN), pull(out.lengths_B)
            decoded = tokenizer.batch_decode(
                [t[:m] for t, m in zip(tokens_BxN[: len(rows) * g], lengths_B)],
                skip_special_tokens=True,
            )
            for j, r in enumerate(rows):
                texts[r].extend(decoded[j * g : (j + 1) * g])
                cols = slice(call * g, (call + 1) * g)
                lengths[r, cols] = lengths_B[j * g : (j + 1) * g]
                last = tokens_BxN[j * g : (j + 1) * g][
                    np.arange(g), np.maximum(lengths_B[j * g : (j + 1) * g] - 1, 0)
                ]
                truncated[r, cols] = ~np.isin(last, list(stop)) if stop else False
            if bar is not None:
                bar.update(len(rows) * min(g, n - call * g))
    if bar is not None:
        bar.refresh()  # the last update may fall inside tqdm's redraw interval
        bar.close()
    texts = [t[:n] for t in texts]
    lengths, truncated = lengths[:, :n], truncated[:, :n]
    flat = [t for row in texts for t in row]
    golds = [a for a in data.answers for _ in range(n)]
    # Every process holds every text; each verifies its 1/H and the scores are all-gathered,
    # so the work is split and all processes report the same figures.
    correct = multihost.split_work(
        len(flat), lambda lo, hi: np.asarray(verifier.score(flat[lo:hi], golds[lo:hi]), np.float32)
    ).reshape(n_problems, n)
    extractors = getattr(getattr(verifier, "config", None), "extractors", ("boxed", "answer_tag"))
    keys = [[answer_key(t, extractors) for t in row] for row in texts]
    return Samples(texts, correct, lengths, truncated, keys)


# ---------------------------------------------------------------- training's held-out eval


@dataclasses.dataclass(frozen=True)
class HeldoutEval:
    """`config.eval` of a training run: what its held-out evaluation samples and reports."""

    num_samples: int  # n per problem for pass@k (0: greedy accuracy only)
    temperature: float
    top_p: float
    ks: tuple[int, ...]
    max_rows: int

    @classmethod
    def from_config(cls, eval_cfg) -> HeldoutEval:
        from gjax.config import ConfigError

        n = int(eval_cfg.num_samples)
        if n < 0:
            raise ConfigError(f"config.eval.num_samples must be >= 0, got {n}")
        if eval_cfg.max_rows < 1:
            raise ConfigError(f"config.eval.max_rows must be >= 1, got {eval_cfg.max_rows}")
        if n and not (eval_cfg.temperature > 0 and 0 < eval_cfg.top_p <= 1):
            raise ConfigError(
                "config.eval.temperature must be > 0 and config.eval.top_p in (0, 1] when "
                f"config.eval.num_samples > 0; got {eval_cfg.temperature}, {eval_cfg.top_p}"
            )
        try:
            ks = tuple(parse_ks(eval_cfg.pass_k, n, where="config.eval.pass_k")) if n else ()
        except EvalError as e:
            raise ConfigError(str(e)) from e
        return cls(n, float(eval_cfg.temperature), float(eval_cfg.top_p), ks, eval_cfg.max_rows)


def heldout_metrics(
    backend: RolloutBackend,
    params,
    tokenizer,
    data: PromptData,
    verifier,
    settings: HeldoutEval,
    *,
    max_new_tokens: int,
    eos: tuple[int, ...],
    pad_id: int,
    greedy_temperature: float = 0.0,
    seed: int = 0,
    rollout_sampling: SamplingParams | None = None,
    rollout_shape: tuple[int, int] | None = None,
    progress: bool = False,
    transfer: Transfer | None = None,
) -> dict[str, float]:
    """Training's held-out figures: ``eval/heldout_accuracy`` (one completion per problem at
    `greedy_temperature`, 0 = greedy) and, when ``settings.num_samples`` > 0,
    ``eval/heldout_pass@k`` for each k (n samples at the settings' temperature and top-p).

    When the pass@k sampling equals the training rollout's (`rollout_sampling`), the samples
    are drawn in the rollout's batch shape (`rollout_shape` = (P, G), prompts padded to
    ``data.max_prompt_length`` as the rollouts are): the sampler's compiled program is the
    rollout's own, so the evaluation adds no compilation to the run."""
    rng = jax.random.fold_in(jax.random.key(seed), 0xE7A1)
    greedy = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=greedy_temperature,
        stop_token_ids=eos,
        pad_token_id=pad_id,
    )
    s = sample_and_score(
        backend,
        params,
        tokenizer,
        data,
        verifier,
        num_samples=1,
        sampling=greedy,
        rng=rng,
        max_rows=settings.max_rows,
        progress="eval greedy" if progress else False,
        transfer=transfer,
    )
    out = {"eval/heldout_accuracy": float(s.correct_PxN.mean())}
    if settings.num_samples:
        sampled = dataclasses.replace(
            greedy, temperature=settings.temperature, top_p=settings.top_p
        )
        shared = rollout_shape is not None and sampled == rollout_sampling
        s = sample_and_score(
            backend,
            params,
            tokenizer,
            data,
            verifier,
            num_samples=settings.num_samples,
            sampling=sampled,
            rng=jax.random.fold_in(rng, 1),
            max_rows=settings.max_rows,
            batch_shape=rollout_shape if shared else None,
            width=data.max_prompt_length if shared else None,
            progress=f"eval pass@{settings.ks[-1]}" if progress else False,
            transfer=transfer,
        )
        for k, v in summarize(s, settings.ks).items():
            if k.startswith("pass@"):
                out[f"eval/heldout_{k}"] = v
    return out


# ------------------------------------------------------------------------------ reports


def markdown_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """One row per benchmark: problems, n, greedy, avg@n, pass@k..., maj@n."""

    def order(col: str) -> tuple:
        name, _, k = col.partition("@")
        rank = {"problems": 0, "n": 1, "greedy": 2, "avg": 3, "pass": 4, "maj": 5}
        return (rank.get(name, 9), int(k) if k.isdigit() else 0)

    cols: list[str] = []
    for m in results.values():
        n = int(m["n"])
        for c in m:
            shown = not c.startswith("maj@") or c == f"maj@{n}"
            if shown and c not in ("no_answer", "truncated", "length_mean") and c not in cols:
                cols.append(c)
    cols = sorted(cols, key=order) + ["no_answer", "truncated", "length_mean"]

    def fmt(c, v):
        if v is None:
            return ""
        if c in ("problems", "n"):
            return str(int(v))
        return f"{v:.1f}" if c == "length_mean" else f"{100 * v:.1f}"

    lines = [
        "| benchmark | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for name, m in results.items():
        lines.append(f"| {name} | " + " | ".join(fmt(c, m.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n\n(accuracies in %; length_mean in new tokens)\n"


# --------------------------------------------------------------------------------- the CLI


def run_model_source(workdir: str) -> tuple[str, dict[str, Any]]:
    """(model dir, run config) of a training workdir: the policy recorded with the run
    (`WORKDIR/model`, see gjax.model_record), or for a run from before that record the base
    model named by the run's `config.json`, whose architecture and tokenizer it shares."""
    from etils import epath

    from gjax import model_record
    from gjax.embedded import resolve_model_path

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
    from etils import epath

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
    from gjax.checkpoint import Checkpointer

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
    from gjax import sharding
    from gjax.embedded import resolve_model_path
    from gjax.models import hf_io

    if F.checkpoint:
        workdir, ckpt_dir, step = split_checkpoint_path(F.checkpoint, F.step)
        model_path, run = run_model_source(workdir)
    else:
        from configs import common

        tiny = common.tiny(common.base())  # `heldout` with --model: the embedded task's
        model_path, step = resolve_model_path(F.model), None
        run = {"data": tiny.data.to_dict(), "rollout": tiny.rollout.to_dict()}
    mesh = mesh_for(run)
    dtype = F.dtype or run.get("model", {}).get("dtype")
    overrides = {"dtype": dtype} if dtype else {}
    if F.checkpoint:
        param_dtype = run.get("model", {}).get("param_dtype", "float32")
        cfg = hf_io.load_config(model_path, **overrides).replace(param_dtype=param_dtype)
        shapes = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, np.dtype(cfg.jnp_param_dtype)),
            hf_io.param_shapes(cfg),
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
        cfg, params = hf_io.load_pretrained(model_path, mesh=mesh, **overrides)
        label = F.model
        out_dir = os.path.join("eval_results", os.path.basename(os.path.normpath(F.model)))
    tok = hf_io.load_tokenizer(model_path)
    return _Policy(cfg, params, tok, model_path, run, label, step, out_dir, mesh)


def main(argv) -> None:
    del argv
    from ml_collections import ConfigDict

    from gjax import sharding
    from gjax.config import resolve_mesh_shape
    from gjax.data import benchmarks as bench_lib
    from gjax.rewards.verifier import Verifier
    from gjax.rollout import LocalSampler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    F = flags.FLAGS
    if bool(F.checkpoint) == bool(F.model):
        raise EvalError("give exactly one of --checkpoint (a training workdir) or --model (HF dir)")
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
        eos, pad_id = stop_token_ids(cfg, tok)
        out_dir = F.out or policy.out_dir
        # The run's own prompt template for its checkpoints; the papers' for a model.
        template = F.template or (run["data"]["template"] if F.checkpoint else "qwen_boxed")
        results: dict[str, dict[str, float]] = {}
        per_benchmark: dict[str, dict[str, Any]] = {}
        backend = LocalSampler(cfg)
        with Verifier(timeout_s=F.verifier_timeout_s, num_workers=F.verifier_workers) as verifier:
            for i, spec in enumerate(specs):
                data = bench_lib.load_benchmark(
                    spec,
                    tok,
                    template=template,
                    max_prompt_len=cfg.max_position_embeddings - 1,
                    heldout_data=run.get("data"),
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
            "seed": F.seed,
        },
        "per_benchmark": per_benchmark,
        "benchmarks": results,
    }
    table = markdown_table(results)
    from etils import epath

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
    from etils import epath

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
    """The CLI's flags, defined only when run as a program (train imports this module)."""
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
    from gjax import cli

    _define_flags()
    cli.run(main)
