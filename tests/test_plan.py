"""The memory planner (gjax.plan) on the committed tiny shape and a few fake CPU devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo
from gjax import plan
from gjax.models import lora, quant, transformer
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**rollout):
    c = grpo.get_config("tiny")
    c.rollout.prompts_per_step = 4
    c.rollout.num_samples = 2
    c.rollout.max_new_tokens = 8
    c.rollout.decode_slots = 4
    c.data.max_prompt_len = 8
    c.model.lora.rank = 2
    c.rollout.update(rollout)
    return c


@pytest.fixture(scope="module")
def tiny_plan():
    """Every row, with the static sampler (one rollout program: the fastest to compile)."""
    config = _config(decoder="static")
    hf = plan._hf_of(config, None)
    rows, mesh = plan.make_plan(config, hf, jax.devices()[:2])
    return config, hf, {row.mode: row for row in rows}, mesh


@pytest.mark.slow  # the module's plan: about 35 s of compiles, cold
def test_rows_count_what_each_mode_holds(tiny_plan):
    config, hf, rows, mesh = tiny_plan
    assert mesh == {"data": 2, "fsdp": 1, "seq": 1, "tensor": 1}
    assert list(rows) == ["full", "lora", "qlora"]
    full, lora_row, qlora = rows["full"], rows["lora"], rows["qlora"]
    cfg = plan.model_config(config, hf)
    n_params = lora.count(transformer.abstract_params(cfg.without_lora()))
    n_adapters = lora.count(lora.abstract_adapters(cfg))
    # data-parallel mesh: every device holds whole (f32) trees; Adam: mu and nu, + counts
    assert full.figures["base"] == 0
    assert full.figures["trained"] == 4 * n_params
    assert lora_row.figures["base"] == 4 * n_params
    assert lora_row.figures["trained"] == 4 * n_adapters
    assert 8 * n_params <= full.figures["optimizer"] < 8 * n_params + 64
    assert 8 * n_adapters <= lora_row.figures["optimizer"] < 8 * n_adapters + 64
    assert lora_row.figures["optimizer"] * 10 < full.figures["optimizer"]
    # the compiled programs' temporaries are there, and the qlora base is int8 + scales
    for row in rows.values():
        assert row.figures["update_temp"] > 0 and row.figures["rollout_temp"] > 0
        assert row.figures["kv"] > 0
    kernels = sum(
        int(np.prod(x.shape))
        for path, x in jax.tree_util.tree_leaves_with_path(
            transformer.abstract_params(cfg.without_lora())
        )
        if str(path[0].key) == "layers" and str(path[-1].key) == "kernel"
    )
    q_cfg = cfg.replace(base_quant="int8")
    q_base = lora.split(transformer.abstract_params(q_cfg))[0]
    assert qlora.figures["base"] == quant.stored_bytes(q_base)  # int8 codes + f32 scales
    assert qlora.figures["base"] < lora_row.figures["base"] - 2.5 * kernels
    assert qlora.figures["trained"] == lora_row.figures["trained"]
    assert "base int8 + rank-2 adapters" in qlora.what
    assert qlora.peak < lora_row.peak


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "jetstream"])
def test_continuous_decoder_kv_is_the_slot_state_whole_on_each_device(backend):
    """The local decoder's regions hold prompts of data.max_prompt_len; the in-process
    JetStream engine's, one per slot, its prefill bucket wide, a multi-turn run's sized for a
    turn's whole history (8 + 8 tokens and the BOS: the 32 bucket)."""
    config = _config(backend=backend)
    if backend == "jetstream":
        config.env.name = "math"
    hf = plan._hf_of(config, None)
    (row,), _ = plan.make_plan(config, hf, jax.devices()[:2], modes=("lora",))
    cfg = plan.model_config(config, hf)
    r = config.rollout
    regions = min(r.decode_slots, 4 * -(-r.decode_slots // r.num_samples))
    width = config.data.max_prompt_len
    if backend == "jetstream":
        regions, width = r.decode_slots, 32
    per_layer = (r.decode_slots * r.max_new_tokens + regions * width) * (
        cfg.num_kv_heads * cfg.head_dim * 4 * 2  # f32 (the tiny config computes in f32), k + v
    )
    assert row.figures["kv"] == per_layer * cfg.num_layers
    assert row.figures["kv"] < row.figures["decode_state"]  # + logits, counters, keys
    assert row.figures["decode_weights"] > 0 and row.figures["rollout_temp"] > 0


@pytest.mark.slow  # the module's plan: about 35 s of compiles, cold
def test_fits_or_not_against_the_chip(tiny_plan):
    _, _, rows, _ = tiny_plan
    rows = list(rows.values())
    big = plan.Chip(16 * plan.GiB, "tpu", "test")
    tiny = plan.Chip(1 << 20, "tpu", "test: 1 MiB")
    text = plan.table(rows, big, 0.1)
    assert "GiB per device" in text and "fits 14.40 GiB?" in text
    assert [line.split()[-1] for line in text.splitlines()[3:]] == ["fits"] * 3
    text = plan.table(rows, tiny, 0.1)
    assert "MiB per device" in text
    assert [line.endswith(" does not fit") for line in text.splitlines()[3:]] == [True] * 3


@pytest.mark.slow
def test_update_temp_follows_the_microbatch(tiny_plan):
    """Compiled, not counted: a quarter of the rows per microbatch needs less temp."""
    config, hf, rows, _ = tiny_plan
    config = config.copy_and_resolve_references()
    config.train.microbatches = 4
    (quarter,), _ = plan.make_plan(config, hf, jax.devices()[:2], modes=("lora",))
    assert quarter.figures["update_temp"] < rows["lora"].figures["update_temp"]
    assert quarter.figures["batch"] == rows["lora"].figures["batch"]


@pytest.mark.slow  # the module's plan: about 35 s of compiles, cold
def test_static_sampler_kv_shards_by_batch(tiny_plan):
    config, hf, rows, _ = tiny_plan
    cfg = plan.model_config(config, hf)
    r, s = config.rollout, config.data.max_prompt_len
    whole = (r.prompts_per_step * s + r.prompts_per_step * r.num_samples * r.max_new_tokens) * (
        cfg.num_kv_heads * cfg.head_dim * 4 * 2 * cfg.num_layers
    )
    assert rows["lora"].figures["kv"] == whole // 2  # rows split over the 2 data devices
    assert rows["lora"].figures["decode_state"] == 0


def _cli(*args):
    # without the suite's 8 fake devices: the command asks jax for the slice's own count
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = USER_PATH
    return subprocess.run(
        [sys.executable, "-m", "gjax.plan", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (["--slice=v9-8"], ["--slice='v9-8' is not a known slice", "v5e-8", "h200"]),
        (["--slice=v5e-8", "--shape=llama9"], ["--shape='llama9'", "qwen3-8b"]),
        (["--slice=v5e-8", "--modes=full,half"], ["--modes=full,half", "unknown ['half']"]),
        (
            ["--slice=v5e-8", "--config.mesh.tensor=3"],
            ["config.mesh", "8 devices"],
        ),
    ],
)
def test_bad_input_is_one_paragraph(args, words):
    out = _cli("--config=configs/grpo.py:tiny", *args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("gjax: ")
    for w in words:
        assert w in out.stderr


@pytest.mark.slow
def test_command_prints_the_table_and_writes_json(tmp_path):
    path = tmp_path / "plan.json"
    out = _cli(
        "--config=configs/grpo.py:tiny",
        "--slice=v5e-4",
        "--modes=lora,qlora",
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.decode_slots=4",
        f"--json={path}",
    )
    assert out.returncode == 0, out.stderr
    assert "v5e-4 (4 x v5e, 16.00 GiB each" in out.stdout
    assert "mesh {'data': 4, 'fsdp': 1, 'seq': 1, 'tensor': 1}" in out.stdout
    assert out.stdout.count(" fits") >= 2
    rep = json.loads(path.read_text())
    assert rep["chips"] == 4 and rep["hbm_bytes_per_chip"] == 16 * 2**30
    assert [r["mode"] for r in rep["rows"]] == ["lora", "qlora"]
    assert all(r["fits"] for r in rep["rows"])
    assert rep["rows"][1]["base_bytes"] < rep["rows"][0]["base_bytes"]
