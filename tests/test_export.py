"""`python -m gjax.export`: a training workdir's checkpoint -> a Hugging Face checkpoint.

A workdir is built as training leaves it (run `config.json`, the `model/` record, orbax
checkpoints of a full train state whose params differ from the base policy's) without
running the trainer; the export is loaded by transformers and its logits compared with
gjax's on the checkpoint's params. `tests/test_gcs.py` does the same through a real
training run on a GCS emulator.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from configs import grpo  # noqa: E402
from gjax import cli, export, model_record  # noqa: E402
from gjax.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from gjax.data import builders, templates  # noqa: E402
from gjax.learner import TrainState, make_optimizer  # noqa: E402
from gjax.models import hf_export, hf_format, hf_import  # noqa: E402
from gjax.models import transformer as T  # noqa: E402
from tests.user_env import PYTHONPATH as USER_PATH  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")
TOL = 1e-4  # max abs logit difference in f32 (issue 11)

pytestmark = pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built")

_forward = jax.jit(T.forward, static_argnums=1, static_argnames="return_logits")


def _trained(params, seed):
    """The base params moved off their values, as training would."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, moved)


def make_workdir(workdir, *, record=True, base_path="/nonexistent/base_model", template=None):
    """A workdir as `gjax.train` leaves it, with checkpoints at steps 1 and 2.

    The run's `model.path` names a directory that does not exist: the export must not need
    the base model when the `model/` record is there. `template`: the run's
    `data.template` (default: the tiny config's). Returns (cfg, {step: params}).
    """
    config = grpo.get_config("tiny")
    with config.unlocked():
        config.model.path = base_path
        if template is not None:
            config.data.template = template
            config.data.max_prompt_len = 512
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    cfg, base = hf_import.load_pretrained(EMBEDDED)
    if record:
        model_record.save(str(workdir), cfg, EMBEDDED)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    saved = {}
    for step in (1, 2):
        params = _trained(base, seed=step)
        state = TrainState(
            step=jnp.asarray(step, jnp.int32), params=params, opt_state=tx.init(params)
        )
        ckpt.save(step, state, {"data": None, "history": []}, force=True)
        saved[step] = params
    ckpt.close()
    return cfg, saved


def _batch(tok):
    """Two prompts, the shorter left-padded: tokens, mask, positions ([2, T])."""
    texts = ["What is 12+30? Answer: \\boxed{42}", "7*6=?"]
    ids = [tok(t)["input_ids"] for t in texts]
    n = max(len(i) for i in ids)
    tokens = np.zeros((2, n), np.int64)
    mask = np.zeros((2, n), np.int64)
    for r, row in enumerate(ids):
        tokens[r, n - len(row) :] = row
        mask[r, n - len(row) :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, mask, positions


def assert_logits_match(out_dir, params, cfg):
    """transformers loads `out_dir` (model and tokenizer); its logits are gjax's on `params`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert tok("1+2=3")["input_ids"] == hf_import.load_tokenizer(EMBEDDED)("1+2=3")["input_ids"]
    tokens, mask, positions = _batch(tok)
    with torch.no_grad():
        hf = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()
    _, ours = _forward(
        params,
        cfg,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        return_logits=True,
    )
    diff = np.abs(hf - np.asarray(ours))[mask.astype(bool)].max()
    assert diff <= TOL, diff


def run_export(cwd, *args):
    env = {**os.environ, "PYTHONPATH": USER_PATH, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "gjax.export", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_exports_relative_workdir_quietly_and_transformers_loads_it(tmp_path):
    """Issue 14.1: the README's natural form, relative paths, newest step, no log flood."""
    cfg, saved = make_workdir(tmp_path / "workdirs" / "a_grae")
    proc = run_export(tmp_path, "--workdir=workdirs/a_grae", "--out=hf_out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "hf_out"
    assert f"exported step 2 of workdirs/a_grae to {out}" in proc.stdout
    # Nothing from orbax's INFO logging (it printed 32 lines per export).
    noisy = [line for line in proc.stderr.splitlines() if "orbax" in line or line.startswith("I")]
    assert not noisy, noisy
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    gen = json.loads((out / "generation_config.json").read_text())
    base_gen = hf_export.source_generation_config(EMBEDDED)
    assert {k: gen[k] for k in base_gen if k != "transformers_version"} == {
        k: v for k, v in base_gen.items() if k != "transformers_version"
    }
    assert_logits_match(str(out), saved[2], cfg)


def test_step_dtype_shards_and_errors(tmp_path, monkeypatch):
    cfg, saved = make_workdir(tmp_path / "wd")
    monkeypatch.chdir(tmp_path)
    # An older step, in bf16, in shards with an index.
    step = export.export("wd", "bf16", step=1, dtype="bfloat16", max_shard_size="200KB")
    assert step == 1
    files = os.listdir(tmp_path / "bf16")
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) > 1 and hf_format.INDEX_FILE in files
    index = json.loads((tmp_path / "bf16" / hf_format.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == {n for n, _ in hf_format.iter_hf_names(cfg)}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = {}
    for shard in shards:
        tensors.update(safetensors.numpy.load_file(str(tmp_path / "bf16" / shard)))
    embed = np.asarray(saved[1]["embed"]["embedding"])
    got = tensors["model.embed_tokens.weight"]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, embed.astype(ml_dtypes.bfloat16))
    assert not np.array_equal(embed, np.asarray(saved[2]["embed"]["embedding"]))

    # User errors (the CLI prints them as one paragraph, exit 2); nothing is called damaged.
    with pytest.raises(CheckpointError) as err:
        export.export("wd", "x", step=7)
    assert " ".join(cli.format_user_error(err.value).split()) == (
        f"gjax: no checkpoint for step 7 in {tmp_path}/wd/checkpoints; it has steps [1, 2]"
    )
    with pytest.raises(model_record.RecordError, match="not a gjax training run"):
        export.export("nowhere", "x")
    with pytest.raises(model_record.RecordError, match="unknown dtype 'int8'"):
        export.export("wd", "x", dtype="int8")


def test_workdir_without_record_uses_the_base_models_config_and_tokenizer(tmp_path):
    """Runs from before `model/` was recorded: config and tokenizer come from model.path."""
    cfg, saved = make_workdir(tmp_path / "old", record=False, base_path=EMBEDDED)
    assert export.export(str(tmp_path / "old"), str(tmp_path / "out")) == 2
    assert_logits_match(str(tmp_path / "out"), saved[2], cfg)


def _training_prompts(workdir, tokenizer):
    """(problems, prompts) as the run in `workdir` templates them: its held-out set, built
    from its recorded `config.json` by the training data path."""
    data = json.loads((workdir / "config.json").read_text())["data"]
    prompts = builders.build_prompt_data({**data, "heldout_size": 8}, tokenizer, heldout=True)
    return prompts.problems, prompts.prompts


@pytest.mark.parametrize("template", [None, "qwen_boxed", "r1"])
def test_chat_template_of_the_export_gives_the_training_prompt(tmp_path, template):
    """Issue 18.6: the exported model's chat template is the prompt format it was trained on
    (the tiny configs' `plain` one answered '' under the tokenizer's ChatML template)."""
    make_workdir(tmp_path / "wd", template=template)
    export.export(str(tmp_path / "wd"), str(tmp_path / "out"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    problems, prompts = _training_prompts(tmp_path / "wd", hf_import.load_tokenizer(EMBEDDED))
    assert len(problems) == 8
    for problem, prompt in zip(problems, prompts):
        chat = [{"role": "user", "content": problem}]
        got = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert got == prompt
    if template is None:  # the README's runs: the prompt is the problem and a newline
        assert prompts[0] == problems[0] + "\n"


def test_chat_run_keeps_the_tokenizers_template(tmp_path):
    """A `chat` run was prompted by the tokenizer's own template: the export keeps it."""
    make_workdir(tmp_path / "wd", template="chat")
    export.export(str(tmp_path / "wd"), str(tmp_path / "out"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.chat_template == hf_import.load_tokenizer(EMBEDDED).chat_template
    problems, prompts = _training_prompts(tmp_path / "wd", hf_import.load_tokenizer(EMBEDDED))
    chat = [{"role": "user", "content": problems[0]}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == prompts[0]


@pytest.mark.parametrize("name", sorted(templates.CHAT_TEMPLATES))
def test_chat_templates_render_as_the_prompt_templates(name):
    """Each Jinja form equals its Python template on text with Jinja and escape syntax."""
    tok = hf_import.load_tokenizer(EMBEDDED)
    for problem in [
        "Compute 3*((7+5)-4).",
        " Find \\boxed{x}: {{ y }} {% raw %} \"q\" 's'\nline 2\t\u00e9 ",
    ]:
        got = tok.apply_chat_template(
            [{"role": "user", "content": problem}],
            tokenize=False,
            add_generation_prompt=True,
            chat_template=templates.CHAT_TEMPLATES[name],
        )
        assert got == templates.apply_template(name, problem)


def test_template_without_a_chat_form_keeps_the_tokenizers_with_a_warning(tmp_path, caplog):
    make_workdir(tmp_path / "wd", template="mine")  # registered by the user's own code
    with caplog.at_level("WARNING"):
        export.export(str(tmp_path / "wd"), str(tmp_path / "out"))
    assert "prompt template 'mine' has no chat template form" in caplog.text
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.chat_template == hf_import.load_tokenizer(EMBEDDED).chat_template
