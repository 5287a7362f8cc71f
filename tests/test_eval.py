"""gjax.eval end to end: benchmark files in each set's own format, params-only checkpoint
restore, and `python -m gjax.eval` on the embedded policy (a checkpoint and a local file)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.common import EMBEDDED_TASK
from gjax import eval as ev
from gjax.data import benchmarks as bl
from gjax.data.sources import DataError
from gjax.data.synthetic import SyntheticConfig, generate
from gjax.evaluation import sampling as sampling_lib
from gjax.evaluation.heldout import HeldoutEval, heldout_metrics
from gjax.evaluation.metrics import EvalError, summarize
from gjax.evaluation.sampling import sample_and_score
from gjax.rollout import SampleOutput, SamplingParams
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")
pytestmark = pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built")

# Each benchmark's columns as published (the mapped ones plus the others it carries).
FORMATS = {
    "math500": (
        "jsonl",
        lambda i, p, a: {
            "problem": p,
            "solution": f"worked... \\boxed{{{a}}}",
            "answer": a,
            "subject": "Algebra",
            "level": 2,
            "unique_id": f"test/algebra/{i}.json",
        },
    ),
    "aime24": (
        "parquet",
        lambda i, p, a: {
            "id": 60 + i,
            "problem": p,
            "solution": "long solution",
            "answer": a,
            "url": "https://example.org",
            "year": "2024",
        },
    ),
    "aime25": ("jsonl", lambda i, p, a: {"problem": p, "answer": a, "id": str(i)}),
    "amc23": (
        "parquet",
        lambda i, p, a: {"id": i, "problem": p, "answer": float(a), "url": "u"},
    ),
    "minerva": (
        "jsonl",
        lambda i, p, a: {"problem": p, "solution": a, "type": "Physics", "idx": i},
    ),
    "olympiadbench": (
        "jsonl",
        lambda i, p, a: {"id": 1600 + i, "question": p, "answer": a, "subject": "Math"},
    ),
}


def _problems(n):
    return [
        p.as_dict() for p in generate(n, "test", seed=0, config=SyntheticConfig(**EMBEDDED_TASK))
    ]


def write_benchmark(name, directory, n=3):
    import datasets

    kind, row = FORMATS[name]
    rows = [row(i, d["problem"], d["answer"]) for i, d in enumerate(_problems(n))]
    path = os.path.join(directory, f"{name}.{kind}")
    ds = datasets.Dataset.from_list(rows)
    ds.to_json(path) if kind == "jsonl" else ds.to_parquet(path)
    return path, rows


@pytest.fixture(scope="module")
def tok():
    from gjax.models import hf_import

    return hf_import.load_tokenizer(EMBEDDED)


def test_registry_covers_the_papers_benchmarks():
    assert set(bl.BENCHMARKS.names()) == set(FORMATS)
    assert bl.BENCHMARKS.get("minerva").answer_field == "solution"
    assert bl.BENCHMARKS.get("olympiadbench").problem_field == "question"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_local_copy_in_the_benchmarks_own_format(name, tmp_path, tok):
    path, rows = write_benchmark(name, str(tmp_path))
    data = bl.load_benchmark(
        bl.parse_specs(f"{name}={path}")[0], tok, template="plain", max_prompt_len=64
    )
    b = bl.BENCHMARKS.get(name)
    assert data.problems == [r[b.problem_field] for r in rows]
    assert data.answers == [str(r[b.answer_field]) for r in rows]
    assert data.prompts[0] == rows[0][b.problem_field] + "\n"


def test_wrong_format_and_bad_specs_are_user_errors(tmp_path, tok):
    path, _ = write_benchmark("aime25", str(tmp_path))  # no "solution" column
    spec = bl.parse_specs(f"minerva={path}")[0]
    with pytest.raises(DataError, match="no column.*'solution'.*knoveleng/Minerva-Math"):
        bl.load_benchmark(spec, tok, template="plain", max_prompt_len=64)
    with pytest.raises(DataError, match="--benchmarks=math500=math500.jsonl"):  # offline Hub
        bl.load_benchmark(bl.parse_specs("math500")[0], tok, template="plain", max_prompt_len=64)
    with pytest.raises(DataError, match="unknown benchmark 'aime23'; valid: aime24, aime25"):
        bl.parse_specs("math500,aime23")
    with pytest.raises(DataError, match="listed twice"):
        bl.parse_specs("math500,math500=x.jsonl")
    with pytest.raises(DataError, match="empty"):
        bl.parse_specs(" , ")
    # A problem too long to evaluate is an error, never a silent skip.
    long = tmp_path / "long.jsonl"
    rows = [("Compute 1+1.", "2"), ("Compute " + "1+" * 40 + "1.", "41"), ("Compute 2*3.", "6")]
    long.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in rows))
    with pytest.raises(DataError, match="1 of 3 problems cannot be evaluated"):
        bl.load_benchmark(
            bl.parse_specs(f"aime25={long}")[0], tok, template="plain", max_prompt_len=24
        )


def test_heldout_is_the_runs_own_split(tok):
    from configs import common

    data_cfg = common.tiny(common.base()).data.to_dict()
    data_cfg["heldout_size"] = 5
    data = bl.load_benchmark(
        bl.BenchmarkSpec(bl.HELDOUT), tok, template="qwen_boxed", max_prompt_len=8,
        heldout_data=data_cfg,
    )  # fmt: skip
    want = _problems(5)
    assert data.problems == [d["problem"] for d in want]
    assert data.prompts[0] == want[0]["problem"] + "\n"  # the run's template (plain)


def save_checkpoint(workdir, steps_params):
    """A training workdir as gjax.train leaves it: config.json + orbax (state, meta)."""
    import optax

    from configs import common
    from gjax.checkpoint import Checkpointer
    from gjax.learner import TrainState

    config = common.tiny(common.base())
    config.data.heldout_size = 8
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    tx = optax.adam(1e-3)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    for step, params in steps_params:
        state = TrainState(step=jnp.int32(step), params=params, opt_state=tx.init(params))
        ckpt.save(step, state, {"data": None, "history": []}, force=True)
    ckpt.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Step 1: the embedded policy; step 2: the same with a zeroed embedding."""
    from gjax.models import hf_import

    _, params = hf_import.load_pretrained(EMBEDDED)
    broken = jax.tree.map(lambda x: x, params)
    broken["embed"]["embedding"] = jnp.zeros_like(params["embed"]["embedding"])
    wd = str(tmp_path_factory.mktemp("run"))
    save_checkpoint(wd, [(1, params), (2, broken)])
    return wd, params, broken


def test_restore_params_reads_the_params_alone(workdir):
    from gjax.checkpoint import CheckpointError
    from gjax.models import hf_import

    wd, params, broken = workdir
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    ckpt = os.path.join(wd, "checkpoints")
    step, got = ev.restore_params(ckpt, abstract)  # newest
    assert step == 2
    jax.tree.map(np.testing.assert_array_equal, got, broken)
    step, got = ev.restore_params(ckpt, abstract, step=1)
    assert step == 1
    jax.tree.map(np.testing.assert_array_equal, got, params)
    with pytest.raises(CheckpointError, match="no checkpoint for step 3.*steps \\[1, 2\\]"):
        ev.restore_params(ckpt, abstract, step=3)
    # --checkpoint forms: the workdir, its checkpoints/ dir, a step dir (relative too).
    assert ev.split_checkpoint_path(wd, None) == (wd, ckpt, None)
    assert ev.split_checkpoint_path(ckpt, 1) == (wd, ckpt, 1)
    rel = os.path.relpath(os.path.join(ckpt, "2"))
    assert ev.split_checkpoint_path(rel, None) == (wd, ckpt, 2)
    with pytest.raises(EvalError, match="no gjax checkpoints"):
        ev.split_checkpoint_path(os.path.dirname(wd), None)
    assert ev.run_model_source(wd)[0] == EMBEDDED
    del hf_import


@pytest.mark.slow
def test_cli_on_a_checkpoint_and_a_local_benchmark(workdir, tmp_path):
    wd, _, _ = workdir
    path, _ = write_benchmark("amc23", str(tmp_path), n=8)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": USER_PATH, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gjax.eval",
            f"--checkpoint={os.path.join(wd, 'checkpoints', '1')}",  # a step dir: step 1
            f"--benchmarks=heldout,amc23={path}",
            "--num_samples=4",
            "--k=1,2,4",
            "--max_new_tokens=32",
            f"--out={out}",
            "--verifier_workers=1",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((out / "results.json").read_text())
    assert report["step"] == 1 and report["settings"]["template"] == "plain"
    assert report["settings"]["temperature"] == 0.6 and report["settings"]["top_p"] == 0.95
    for name in ("heldout", "amc23"):
        m = report["benchmarks"][name]
        assert (m["problems"], m["n"]) == (8, 4)
        assert m["pass@1"] == pytest.approx(m["avg@4"], abs=1e-6)
        assert 0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1
        # The embedded policy solves about half of these problems (README: 0.512 greedy).
        assert 0.1 < m["pass@1"] < 0.95, m
        assert m["no_answer"] < 0.5
    table = (out / "results.md").read_text()
    assert "| heldout | 8 | 4 |" in table and "| amc23 | 8 | 4 |" in table
    assert "pass@4" in proc.stdout and "results.json" in proc.stdout
    assert "%|" not in proc.stderr  # stderr is a pipe, not a terminal: no progress bars


class ScriptedBackend:
    """A `RolloutBackend` that answers from the prompt: sample j of a call is the problem's
    right answer (boxed, then EOS) for even j, a wrong one running to the token limit for odd
    j. It records every call's shapes and sampling, so batching is checked without a model."""

    def __init__(self, tok, data):
        self.tok, self.calls = tok, []
        self.answer_of = {tuple(ids): a for ids, a in zip(data.prompt_ids, data.answers)}

    def generate(self, params, ids_PxS, mask_PxS, rng, *, num_samples, sampling):
        self.calls.append((ids_PxS.shape, num_samples, sampling))
        n, eos = sampling.max_new_tokens, sampling.stop_token_ids[0]
        tokens, lengths = [], []
        for ids, mask in zip(ids_PxS, mask_PxS):
            answer = self.answer_of[tuple(ids[mask.astype(bool)])]
            for j in range(num_samples):
                if j % 2 == 0:
                    t = self.tok(f"\\boxed{{{answer}}}", add_special_tokens=False)["input_ids"]
                    t = [*t, eos]
                else:
                    t = self.tok("\\boxed{1000}" + "1" * n, add_special_tokens=False)["input_ids"]
                t = t[:n]
                lengths.append(len(t))
                tokens.append(t + [sampling.pad_token_id] * (n - len(t)))
        return SampleOutput(np.asarray(tokens, np.int32), None, None, np.asarray(lengths, np.int32))


class DroppingBackend(ScriptedBackend):
    """A serving backend's answers: `ScriptedBackend`'s, except that the requests `drop(i)`
    selects (i counts every request so far) come back dropped (no tokens, valid_B False), and
    `failure` names the server as a serving backend does."""

    def __init__(self, tok, data, drop):
        super().__init__(tok, data)
        self.drop, self.served = drop, 0

    def generate(self, params, ids_PxS, mask_PxS, rng, *, num_samples, sampling):
        out = super().generate(
            params, ids_PxS, mask_PxS, rng, num_samples=num_samples, sampling=sampling
        )
        b = len(out.lengths_B)
        valid = np.array([not self.drop(self.served + i) for i in range(b)])
        self.served += b
        tokens = np.where(valid[:, None], out.tokens_BxN, sampling.pad_token_id)
        lengths = np.where(valid, out.lengths_B, 0).astype(np.int32)
        return SampleOutput(tokens, None, None, lengths, valid_B=valid)

    def failure(self):
        return "server 127.0.0.1:1: connection refused"


@pytest.fixture(scope="module")
def verifier():
    from gjax.rewards.verifier import Verifier

    with Verifier(num_workers=1) as v:
        yield v


def heldout(tok, size):
    from configs import common
    from gjax.data.builders import build_prompt_data

    cfg = common.tiny(common.base()).data.to_dict()
    cfg["heldout_size"] = size
    return build_prompt_data(cfg, tok, heldout=True)


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (pytest's capture is not one): progress bars are drawn."""
    monkeypatch.setattr(sampling_lib, "interactive", lambda: True)


def test_sample_and_score_batches_every_problem_n_times(tok, verifier, capfd, terminal):
    data = heldout(tok, 10)
    backend = ScriptedBackend(tok, data)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.6, stop_token_ids=(1,))
    s = sample_and_score(
        backend, None, tok, data, verifier, num_samples=6, sampling=sampling,
        rng=jax.random.key(0), max_rows=16, progress="bench",
    )  # fmt: skip
    # G = 6 per call, P = 16 // 6 = 2 prompts per call (rounded up to the devices), 10 problems.
    d = jax.device_count()
    p = -(-2 // d) * d
    assert {c[:2] for c in backend.calls} == {((p, 24), 6)}
    assert len(backend.calls) == -(-10 // p)
    for i in range(10):
        assert len(s.texts[i]) == 6
        assert s.texts[i][0] == f"\\boxed{{{data.answers[i]}}}"  # the problem's own row
    np.testing.assert_array_equal(s.correct_PxN, np.tile([1, 0], (10, 3)))
    np.testing.assert_array_equal(s.truncated_PxN, np.tile([False, True], (10, 3)))
    assert (s.lengths_PxN[:, 1::2] == 12).all()
    assert s.keys[0][:2] == [data.answers[0], "1000"]
    m = summarize(s, [1, 2, 6])
    assert m["pass@1"] == 0.5 and m["pass@6"] == 1
    assert m["pass@2"] == pytest.approx(1 - 3 / 15)  # 1 - C(3,2)/C(6,2)
    assert "bench: 100%" in capfd.readouterr().err  # the progress bar reached the end

    # n larger than a call: a problem's samples span several calls.
    backend.calls.clear()
    s = sample_and_score(
        backend, None, tok, data, verifier, num_samples=6, sampling=sampling,
        rng=jax.random.key(0), batch_shape=(4, 4), width=32,
    )  # fmt: skip
    assert {c[:2] for c in backend.calls} == {
        ((-(-4 // jax.device_count()) * jax.device_count(), 32), 4)
    }
    np.testing.assert_array_equal(s.correct_PxN, np.tile([1, 0, 1, 0, 1, 0], (10, 1)))


def test_heldout_metrics_samples_in_the_rollout_shape_when_it_can(
    tok, verifier, capfd, terminal, monkeypatch
):
    import ml_collections

    data = heldout(tok, 8)
    backend = ScriptedBackend(tok, data)
    settings = HeldoutEval.from_config(
        ml_collections.ConfigDict(
            dict(num_samples=4, temperature=0.7, top_p=1.0, pass_k="1,4", max_rows=256)
        )
    )
    rollout = SamplingParams(
        max_new_tokens=12, temperature=0.7, stop_token_ids=(1,), pad_token_id=0
    )
    kw = dict(max_new_tokens=12, eos=(1,), pad_id=0, progress=True)
    m = heldout_metrics(
        backend, None, tok, data, verifier, settings, rollout_sampling=rollout,
        rollout_shape=(2, 2), **kw,
    )  # fmt: skip
    assert m == {
        "eval/heldout_accuracy": 1.0,  # the greedy call's first sample is the right one
        "eval/heldout_pass@1": 0.5,
        "eval/heldout_pass@4": 1.0,
    }
    (_, g1, greedy_sampling), sampled = backend.calls[0], backend.calls[1:]
    assert g1 == 1 and greedy_sampling.temperature == 0.0
    # pass@k: the rollout's own shape, prompt width and sampling (its compiled program).
    d = jax.device_count()
    assert {(c[0], c[1]) for c in sampled} == {((-(-2 // d) * d, data.max_prompt_length), 2)}
    assert {c[2] for c in sampled} == {rollout}
    err = capfd.readouterr().err
    assert "eval greedy: 100%" in err and "eval pass@4: 100%" in err
    # Sampling that differs from the rollout's: the evaluation's own shape.
    backend.calls.clear()
    monkeypatch.setattr(sampling_lib, "interactive", lambda: False)  # a log file: no bars
    heldout_metrics(
        backend, None, tok, data, verifier, settings,
        rollout_sampling=dataclasses.replace(rollout, temperature=1.0), rollout_shape=(2, 2),
        **kw,
    )  # fmt: skip
    assert backend.calls[1][1] == 4
    assert "eval " not in capfd.readouterr().err


def test_heldout_dropped_requests_are_counted_and_all_dropped_is_an_error(tok, verifier, caplog):
    """A serving backend's dropped requests score as wrong, and the evaluation says how many
    (metrics, the printed line, a warning); a batch with all of them dropped is an error,
    not pass@k 0.000."""
    import ml_collections

    from gjax.evaluation.report import markdown_table
    from gjax.rollout.collect import ServingFailed
    from gjax.train import _fmt_eval

    data = heldout(tok, 8)
    settings = HeldoutEval.from_config(
        ml_collections.ConfigDict(
            dict(num_samples=4, temperature=0.7, top_p=1.0, pass_k="1,4", max_rows=256)
        )
    )
    kw = dict(max_new_tokens=12, eos=(1,), pad_id=0)
    # The first 2 greedy requests and, of the pass@k samples, every fourth one are dropped.
    backend = DroppingBackend(tok, data, lambda i: i < 2 or (i >= 8 and i % 4 == 0))
    m = heldout_metrics(backend, None, tok, data, verifier, settings, **kw)
    assert m == {
        "eval/heldout_accuracy": 0.75,  # 6 of 8: the dropped 2 count as wrong
        "eval/heldout_dropped": 2.0,
        "eval/heldout_pass@1": 0.25,  # samples 1, 3 are wrong by script, sample 0 dropped
        "eval/heldout_pass@4": 1.0,
        "eval/heldout_sampled_dropped": 8.0,
    }
    assert "2 of 8 greedy completions were dropped" in caplog.text
    assert "8 of 32 pass@k samples were dropped" in caplog.text
    assert _fmt_eval(m) == (
        "accuracy 0.750 (2 requests dropped, counted as wrong), pass@1 0.250, "
        "pass@4 1.000 (8 samples dropped, counted as wrong)"
    )
    s = sample_and_score(
        DroppingBackend(tok, data, lambda i: i == 0), None, tok, data, verifier,
        num_samples=1, sampling=SamplingParams(max_new_tokens=12, stop_token_ids=(1,)),
        rng=jax.random.key(0),
    )  # fmt: skip
    assert summarize(s, [1])["dropped"] == 1
    table = markdown_table({"a": summarize(s, [1]), "b": {**summarize(s, [1]), "dropped": 0}})
    assert "| dropped |" in table.splitlines()[0] and table.splitlines()[3].count("| 0 |") == 1

    # Every pass@k request dropped (greedy answered): an error naming the server.
    backend = DroppingBackend(tok, data, lambda i: i >= 8)
    with pytest.raises(ServingFailed) as err:
        heldout_metrics(backend, None, tok, data, verifier, settings, **kw)
    msg = str(err.value)
    assert "every request of a held-out evaluation batch was dropped" in msg
    assert "127.0.0.1:1: connection refused" in msg and "\n" not in msg


def _own_data_run(workdir):
    """A run as `gjax.train` leaves it after training on the user's own JSONL: columns
    problem and answer only (no `demonstration`), the held-out set carved from it."""
    import optax

    from configs import common
    from gjax.checkpoint import Checkpointer
    from gjax.learner import TrainState
    from gjax.models import hf_import

    os.makedirs(workdir, exist_ok=True)
    source = os.path.join(workdir, "mine.jsonl")
    with open(source, "w") as f:
        for row in _problems(16):
            f.write(json.dumps({"problem": row["problem"], "answer": row["answer"]}) + "\n")
    config = common.tiny(common.base())  # data.demonstration_field = "demonstration"
    config.data.source, config.data.heldout_source = source, ""
    config.data.heldout_fraction, config.data.heldout_size = 0.25, 4
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    _, params = hf_import.load_pretrained(EMBEDDED)
    tx = optax.adam(1e-3)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    state = TrainState(step=jnp.int32(1), params=params, opt_state=tx.init(params))
    ckpt.save(1, state, {"data": None, "history": []}, force=True)
    ckpt.close()
    return source


def test_heldout_of_a_run_on_own_data_without_demonstrations(tmp_path, tok):
    """`heldout` of a run trained on a JSONL without a demonstration column reads the data as
    training did (the field blanked where nothing uses it), not the raw run config."""
    from gjax.data.builders import run_data_config

    wd = str(tmp_path / "run")
    _own_data_run(wd)
    _, run = ev.run_model_source(wd)
    assert run["data"]["demonstration_field"] == "demonstration"  # as the run config says
    with pytest.raises(DataError, match="no column 'demonstration'"):  # the raw config
        bl.load_benchmark(
            bl.BenchmarkSpec(bl.HELDOUT), tok, template="plain", max_prompt_len=32,
            heldout_data=run["data"],
        )  # fmt: skip
    data = bl.load_benchmark(
        bl.BenchmarkSpec(bl.HELDOUT), tok, template="plain", max_prompt_len=32,
        heldout_data=run_data_config(run),
    )  # fmt: skip
    assert len(data) == 4 and data.origin["carved"]["fraction"] == 0.25
    assert not data.has_demonstrations


@pytest.mark.slow
def test_cli_on_a_run_trained_on_own_data_without_demonstrations(tmp_path):
    wd = str(tmp_path / "run")
    _own_data_run(wd)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": USER_PATH, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "gjax.eval", f"--checkpoint={wd}", "--benchmarks=heldout",
            "--num_samples=1", "--k=1", "--max_new_tokens=4", f"--out={out}",
            "--verifier_workers=1",
        ],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["benchmarks"]["heldout"]["problems"] == 4
    assert report["settings"]["extractors"] == ["boxed", "answer_tag"]  # the run's
