"""gjax's benchmarks (the held-out set of a run first) as local lm-evaluation-harness tasks.

    python -m gjax.eval --checkpoint=RUN --write_lm_eval_task=TASKS   # writes TASKS/gjax_heldout/
    python -m gjax.export --workdir=RUN --out=EXPORT
    lm_eval --model hf --model_args pretrained=EXPORT,dtype=float32,add_bos_token=False \\
        --tasks gjax_heldout --include_path TASKS --batch_size 1

One task directory per benchmark, ``TASKS/gjax_<benchmark>/``:

* ``docs.jsonl``: one row per problem (``prompt``, ``answer``, ``problem``), every problem
  of the benchmark in gjax's order; ``prompt`` is the exact text gjax's sampler is given
  (the run's template applied, e.g. its chat turns), so the task must run without
  ``--apply_chat_template`` and without few-shot examples: the model sees gjax's input.
* ``gjax_<benchmark>.yaml``: a ``generate_until`` task: greedy decoding (``do_sample:
  false``, ``repetition_penalty: 1.0`` whatever the checkpoint's generation config says),
  gjax's max new tokens (the run's ``rollout.max_new_tokens`` for ``heldout``, capped by the
  context as ``gjax.eval`` caps it) and its stop sequences (the text of the model's EOS
  tokens, on which gjax's sampler stops).
* ``settings.json`` and ``utils.py``: the scoring. ``process_results`` scores a completion
  with gjax's own verifier (``gjax.rewards.verifier.Verifier``: the run's answer extractors,
  math-verify, the same deadline), so the metric ``acc`` is ``gjax.eval``'s greedy accuracy
  on the problems lm-eval evaluated. lm-eval must therefore run where gjax is importable.

``add_bos_token=False`` makes lm-eval's HF backend tokenize as gjax does (no special tokens
added; the templates hold whatever the model needs). Agreement is per problem up to greedy
near-ties: transformers and gjax compute the same float32 logits in a different order, so
where two tokens' logits nearly tie the argmax may differ and the completions with it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from gjax.data.prompts import PromptData
from gjax.evaluation.metrics import EvalError
from gjax.rewards.verifier import CORRECT, Verifier

TASK_PREFIX = "gjax_"
DOCS = "docs.jsonl"
SETTINGS = "settings.json"
METRIC = "acc"

_UTILS = '''"""lm-evaluation-harness hooks of a gjax task (written by gjax.eval --write_lm_eval_task):
the documents next to this file, scored by gjax's verifier (gjax.evaluation.lm_eval_task)."""

import os

from gjax.evaluation import lm_eval_task

_HERE = os.path.dirname(os.path.abspath(__file__))


def load_docs(**kwargs):
    return lm_eval_task.load_docs(_HERE)


def process_results(doc, results):
    return lm_eval_task.process_results(_HERE, doc, results)
'''


def task_name(benchmark: str) -> str:
    return f"{TASK_PREFIX}{benchmark}"


def _yaml_str(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax, ASCII-escaped, is one)."""
    return json.dumps(text, ensure_ascii=True)


def task_yaml(name: str, *, max_new_tokens: int, stop: Sequence[str]) -> str:
    until = ", ".join(_yaml_str(s) for s in stop)
    return f"""# Written by gjax.eval --write_lm_eval_task; see gjax/evaluation/lm_eval_task.py.
task: {name}
custom_dataset: !function utils.load_docs
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
num_fewshot: 0
target_delimiter: ""
fewshot_delimiter: ""
generation_kwargs:
  until: [{until}]
  do_sample: false
  temperature: 0.0
  repetition_penalty: 1.0
  max_gen_toks: {int(max_new_tokens)}
process_results: !function utils.process_results
metric_list:
  - metric: {METRIC}
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(
    out_dir: str,
    benchmark: str,
    data: PromptData,
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    extractors: Sequence[str],
    verifier_timeout_s: float,
    source: Mapping[str, Any] | None = None,
) -> str:
    """Writes ``out_dir/gjax_<benchmark>/`` (module docstring); returns that directory.

    `data`: the benchmark's prompts as gjax evaluates them; `stop`: the text of the stop
    tokens; `source`: what the set was built from (recorded in settings.json)."""
    if max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1 for the lm-eval task, got {max_new_tokens}")
    if not stop or any(not s for s in stop):
        raise EvalError(f"the lm-eval task needs non-empty stop sequences, got {list(stop)}")
    name = task_name(benchmark)
    d = epath.Path(out_dir) / name
    d.mkdir(parents=True, exist_ok=True)
    with (d / DOCS).open("w") as f:
        for prompt, answer, problem in zip(data.prompts, data.answers, data.problems):
            f.write(json.dumps({"prompt": prompt, "answer": answer, "problem": problem}) + "\n")
    settings = {
        "task": name,
        "benchmark": benchmark,
        "problems": len(data),
        "max_new_tokens": int(max_new_tokens),
        "stop": list(stop),
        "extractors": list(extractors),
        "verifier_timeout_s": float(verifier_timeout_s),
        "source": dict(source or {}),
    }
    (d / SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
    (d / f"{name}.yaml").write_text(task_yaml(name, max_new_tokens=max_new_tokens, stop=stop))
    (d / "utils.py").write_text(_UTILS)
    return str(d)


def read_settings(task_dir: str) -> dict[str, Any]:
    path = os.path.join(task_dir, SETTINGS)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise EvalError(
            f"{path} is missing or unreadable ({e}): write the task again with "
            "`python -m gjax.eval --checkpoint=RUN --write_lm_eval_task=DIR`"
        ) from None


def load_docs(task_dir: str):
    """The task's documents as lm-eval's ``custom_dataset`` wants them: {"test": Dataset}."""
    import datasets

    rows = []
    with open(os.path.join(task_dir, DOCS)) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    columns = {k: [r[k] for r in rows] for k in ("prompt", "answer", "problem")}
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict(columns)})


_verifiers: dict[str, Verifier] = {}
_lock = threading.Lock()


def _close_verifiers() -> None:
    with _lock:
        for v in _verifiers.values():
            v.close()
        _verifiers.clear()


atexit.register(_close_verifiers)


def verifier_for(task_dir: str) -> Verifier:
    """The task's verifier (its extractors and deadline), one per task dir per process."""
    key = os.path.abspath(task_dir)
    with _lock:
        v = _verifiers.get(key)
        if v is None:
            s = read_settings(key)
            v = Verifier(
                timeout_s=s["verifier_timeout_s"], num_workers=1, extractors=tuple(s["extractors"])
            )
            _verifiers[key] = v
        return v


def score(task_dir: str, completion: str, answer: str) -> tuple[float, str]:
    """(1.0 or 0.0, the verifier's outcome) of one completion against the gold answer."""
    outcome = verifier_for(task_dir).score_detailed([completion], [answer])[0]
    return float(outcome == CORRECT), outcome


def process_results(task_dir: str, doc: Mapping[str, Any], results: Sequence[str]) -> dict:
    """lm-eval's per-document hook: ``results[0]`` is the greedy completion."""
    value, _ = score(task_dir, results[0], doc["answer"])
    return {METRIC: value}
