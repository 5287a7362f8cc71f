"""A run's held-out set as an lm-evaluation-harness task (`gjax.eval --write_lm_eval_task`).

The task dir carries gjax's exact prompts, greedy max new tokens, stop text and scoring; the
slow test evaluates the exported embedded policy with `lm_eval`'s HF backend on CPU and
checks its accuracy against gjax.eval's greedy accuracy, problem by problem.
"""

import dataclasses
import glob
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from gjax import eval as ev
from gjax import model_record
from gjax.data import benchmarks as bench_lib
from gjax.evaluation import lm_eval_task
from gjax.evaluation.metrics import EvalError
from gjax.models import hf_import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")

pytestmark = pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built")


def make_run(workdir, params=None, **overrides):
    """A workdir as gjax.train leaves it: config.json, the model/ record and (with `params`)
    a step-1 checkpoint. `overrides`: "section.key" -> value in the tiny config."""
    import optax

    from gjax.checkpoint import Checkpointer
    from gjax.learner import TrainState

    config = common.tiny(common.base())
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    os.makedirs(os.path.join(workdir, "checkpoints"), exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    cfg, base = hf_import.load_pretrained(EMBEDDED)
    model_record.save(str(workdir), cfg, EMBEDDED)
    if params is not None:
        tx = optax.adam(1e-3)
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
        state = TrainState(step=jnp.int32(1), params=params, opt_state=tx.init(params))
        ckpt.save(1, state, {"data": None, "history": []}, force=True)
        ckpt.close()
    return config


def read(*parts):
    with open(os.path.join(*parts)) as f:
        return f.read()


def import_utils(task_dir):
    """The task's utils.py, imported from its file as lm-eval imports it (not on sys.path)."""
    spec = importlib.util.spec_from_file_location("utils", os.path.join(task_dir, "utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_task_carries_the_runs_prompts_lengths_stops_and_extractors(tmp_path):
    wd = str(tmp_path / "run")
    # Not the tiny defaults (plain, 32 new tokens, boxed + answer_tag): the run's own.
    make_run(
        wd,
        **{"data.template": "qwen_boxed", "rollout.max_new_tokens": 24, "reward.extractors": "boxed"},
    )  # fmt: skip
    (task_dir,) = ev.write_lm_eval_tasks(str(tmp_path / "tasks"), checkpoint=wd)
    assert os.path.basename(task_dir) == "gjax_heldout"

    # The prompts gjax.eval samples from, every held-out problem in its order.
    model_path, run = ev.run_model_source(wd)
    tok = hf_import.load_tokenizer(model_path)
    cfg = hf_import.load_config(model_path)
    template, _ = ev.prompt_format(run, None, None, True)
    data, sampling = ev.benchmark_prompts(
        bench_lib.BenchmarkSpec(bench_lib.HELDOUT), cfg, tok, run, template=template
    )
    docs = [json.loads(line) for line in read(task_dir, "docs.jsonl").splitlines()]
    assert len(docs) == len(data) == run["data"]["heldout_size"]
    assert [d["prompt"] for d in docs] == data.prompts
    assert [d["answer"] for d in docs] == data.answers
    assert docs[0]["prompt"].startswith("<|im_start|>system")  # the chat turns, templated
    assert docs[0]["prompt"].endswith("<|im_start|>assistant\n")

    settings = json.loads(read(task_dir, "settings.json"))
    assert sampling.max_new_tokens == settings["max_new_tokens"] == 24
    assert settings["stop"] == ["<|endoftext|>"] == [tok.decode([1], skip_special_tokens=False)]
    assert settings["extractors"] == ["boxed"]
    assert settings["source"]["template"] == "qwen_boxed"
    yaml = read(task_dir, "gjax_heldout.yaml")
    for line in (
        "task: gjax_heldout",
        "output_type: generate_until",
        "doc_to_text: prompt",
        "num_fewshot: 0",
        '  until: ["<|endoftext|>"]',
        "  do_sample: false",
        "  repetition_penalty: 1.0",
        "  max_gen_toks: 24",
        "process_results: !function utils.process_results",
        "custom_dataset: !function utils.load_docs",
    ):
        assert line in yaml.splitlines(), line

    # The shipped hooks: the documents, and gjax's verifier with the run's extractors.
    utils = import_utils(task_dir)
    test = utils.load_docs(pretrained="ignored")["test"]
    assert test["prompt"] == data.prompts
    doc = docs[0]
    gold = doc["answer"]
    assert utils.process_results(doc, [f"so \\boxed{{{gold}}}"]) == {"acc": 1.0}
    assert utils.process_results(doc, [f"\\boxed{{{int(gold) + 1}}}"]) == {"acc": 0.0}
    # answer_tag is not among this run's extractors, so a tagged answer does not count.
    assert utils.process_results(doc, [f"<answer>{gold}</answer>"]) == {"acc": 0.0}


def test_task_writer_refuses_bad_settings(tmp_path):
    with pytest.raises(EvalError, match="exactly one of --checkpoint"):
        ev.write_lm_eval_tasks(str(tmp_path), checkpoint=None, model=None)
    data = dataclasses.make_dataclass("D", ["prompts", "answers", "problems"])([], [], [])
    with pytest.raises(EvalError, match="non-empty stop sequences"):
        lm_eval_task.write_task(
            str(tmp_path), "x", data, max_new_tokens=4, stop=[""], extractors=["boxed"],
            verifier_timeout_s=1.0,
        )  # fmt: skip
    with pytest.raises(EvalError, match="settings.json is missing"):
        lm_eval_task.verifier_for(str(tmp_path))
    # A prompt whose text does not tokenize back to gjax's ids cannot be a text task.
    tok = hf_import.load_tokenizer(EMBEDDED)
    prompt = "Compute 1+2.\n"
    ids = np.asarray(tok(prompt, add_special_tokens=False)["input_ids"], np.int32)
    good = dataclasses.make_dataclass("P", ["prompts", "prompt_ids"])([prompt], [ids])
    ev._check_tokenization("heldout", good, tok)
    bad = dataclasses.replace(good, prompt_ids=[ids[1:]])
    with pytest.raises(EvalError, match="does not tokenize back"):
        ev._check_tokenization("heldout", bad, tok)


LIMIT = 32


@pytest.mark.slow
def test_lm_eval_on_the_export_agrees_with_gjax_greedy(tmp_path):
    """The README's commands: write the task, export the run, `lm_eval --model hf`; its acc
    on the first LIMIT held-out problems against gjax.eval's greedy on the same problems."""
    pytest.importorskip("lm_eval")
    from gjax import export, sharding
    from gjax.evaluation.sampling import sample_and_score
    from gjax.rewards.verifier import Verifier
    from gjax.rollout import LocalSampler

    cfg, params = hf_import.load_pretrained(EMBEDDED)
    wd, tasks, out = str(tmp_path / "run"), str(tmp_path / "tasks"), str(tmp_path / "export")
    make_run(wd, params)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "gjax.eval", f"--checkpoint={wd}", f"--write_lm_eval_task={tasks}"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--tasks gjax_heldout --include_path {tasks}" in proc.stdout
    export.export(wd, out)

    # gjax's side: gjax.eval --greedy's prompts and sampling on the checkpoint's params.
    model_path, run = ev.run_model_source(wd)
    tok = hf_import.load_tokenizer(model_path)
    template, extractors = ev.prompt_format(run, None, None, True)
    data, sampling = ev.benchmark_prompts(
        bench_lib.BenchmarkSpec(bench_lib.HELDOUT), cfg, tok, run, template=template
    )
    first = {
        f.name: getattr(data, f.name)[:LIMIT]
        for f in dataclasses.fields(data)
        if isinstance(getattr(data, f.name), list | np.ndarray)
    }
    data = dataclasses.replace(data, **first)
    mesh = sharding.make_mesh({"data": jax.device_count(), "fsdp": 1, "tensor": 1})
    _, params = hf_import.load_pretrained(EMBEDDED, mesh=mesh)  # as gjax.eval places them
    with (
        jax.set_mesh(mesh),
        sharding.use_rules(),
        Verifier(num_workers=1, extractors=extractors) as verifier,
    ):
        ours = sample_and_score(
            LocalSampler(cfg), params, tok, data, verifier, num_samples=1,
            sampling=ev.greedy_sampling(sampling), rng=jax.random.key(0),
        )  # fmt: skip

    # lm-eval's side: the documented command on the export (batched: one generate call).
    results = str(tmp_path / "lm_eval_out")
    proc = subprocess.run(
        [
            sys.executable, "-m", "lm_eval", "--model", "hf",
            "--model_args", f"pretrained={out},dtype=float32,add_bos_token=False",
            "--tasks", "gjax_heldout", "--include_path", tasks, "--device", "cpu",
            "--batch_size", str(LIMIT), "--limit", str(LIMIT),
            "--output_path", results, "--log_samples",
        ],
        env={**env, "TOKENIZERS_PARALLELISM": "false"}, cwd=str(tmp_path),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (agg,) = glob.glob(os.path.join(results, "*", "results_*.json"))
    (per_doc,) = glob.glob(os.path.join(results, "*", "samples_gjax_heldout_*.jsonl"))
    theirs = sorted(
        (json.loads(line) for line in read(per_doc).splitlines()), key=lambda r: r["doc_id"]
    )
    assert [r["doc_id"] for r in theirs] == list(range(LIMIT))

    same_text = 0
    for i, r in enumerate(theirs):
        # The model's input is gjax's prompt, character for character.
        assert r["arguments"]["gen_args_0"]["arg_0"] == data.prompts[i]
        assert r["doc"]["answer"] == data.answers[i]
        if r["filtered_resps"][0] == ours.texts[i][0]:
            same_text += 1
            assert r["acc"] == ours.correct_PxN[i, 0], (i, r["filtered_resps"][0])
    ours_acc = float(ours.correct_PxN.mean())
    theirs_acc = json.loads(read(agg))["results"]["gjax_heldout"]["acc,none"]
    print(f"lm-eval acc {theirs_acc:.4f}, gjax greedy {ours_acc:.4f}; {same_text}/{LIMIT} same")
    # Greedy near-ties in float32 may flip a completion; on the embedded policy none did.
    assert same_text == LIMIT
    assert theirs_acc == pytest.approx(ours_acc, abs=1e-9)
    assert 0.1 < ours_acc < 0.9  # the embedded policy solves about half: a real signal
