"""Smoke run of benchmarks/train_step.py at toy sizes: it runs end to end, stdout is JSON lines
and the last line is the summary with consistent figures. Speed itself is never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_step_records(*args: str) -> list[dict]:
    """`benchmarks/train_step.py ARGS` as it is run by hand (one CPU device): its JSON lines."""
    return _benchmark_records("train_step.py", *args)


def _benchmark_records(script: str, *args: str) -> list[dict]:
    """`benchmarks/SCRIPT ARGS` as it is run by hand (one CPU device): its JSON lines."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_train_step_benchmark_smoke():
    records = _train_step_records(
        *("--prompts", "2", "--samples", "4", "--new-tokens", "6"),
        *("--warmup", "0", "--trl-warmup", "0", "--repeats", "1"),
    )
    kinds = [r["what"] for r in records]
    assert kinds[0] == "setup" and kinds[-1] == "summary"
    assert kinds.count("gjax_step") == 1 and kinds.count("trl_step") == 1
    s = records[-1]
    gjax = next(r for r in records if r["what"] == "gjax_step")
    trl = next(r for r in records if r["what"] == "trl_step")
    # The summary reports the timed steps (one each), and gjax's update compiled once.
    assert s["gjax_step_s"] == gjax["step_s"] > 0 and s["trl_step_s"] == trl["step_s"] > 0
    assert s["speedup"] == pytest.approx(trl["step_s"] / gjax["step_s"])
    assert s["gjax_update_compiles"] == 1
    assert (s["P"], s["G"], s["B"], s["max_new_tokens"]) == (2, 4, 8, 6)
    assert s["eos_stop"] is False
    # EOS stopping is off on both sides: every completion is full length.
    assert gjax["completion_tokens"] == 8 * 6
    assert trl["completion_len"] == 6
    # FLOPs: full-length completions leave only prompt padding; the CPU peak is measured.
    assert s["learner_executed_flops"] >= s["learner_useful_flops"] > 0
    assert s["step_useful_flops"] > s["learner_useful_flops"]
    assert s["learner_mfu"] > 0 and s["peak_source"].startswith("measured")
    # XLA counts every matmul the formula does, plus elementwise ops.
    assert 1.0 <= s["xla_over_formula"] <= 1.15


def _train_step_module():
    spec = importlib.util.spec_from_file_location(
        "train_step_bench", os.path.join(ROOT, "benchmarks", "train_step.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "shape, params", [("qwen2-0.5b", 494_032_768), ("qwen2-1.5b", 1_543_714_304)]
)
def test_shapes_have_qwen25_parameter_counts(shape, params):
    # The parameter counts of Qwen/Qwen2.5-0.5B and -1.5B (tied embeddings, q/k/v bias).
    bench = _train_step_module()
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_tiny_policy

    from gjax.data.tokenizer import build_tokenizer
    from gjax.models.transformer import abstract_params

    cfg = bench.shape_config(make_tiny_policy.model_config(build_tokenizer()), shape)
    assert cfg.head_dim * cfg.num_heads == cfg.hidden_size
    assert sum(x.size for x in jax.tree.leaves(abstract_params(cfg))) == params


def test_pareto_lengths_mean_at_most_a_quarter():
    bench = _train_step_module()
    lengths = bench.pareto_lengths(np.random.default_rng(0), 200_000, 48)
    assert lengths.min() >= 1 and lengths.max() <= 48
    assert lengths.max() == 48  # a heavy tail: some rows still run to the limit
    assert lengths.mean() <= 48 / 4


@pytest.mark.slow
def test_train_step_benchmark_pareto_smoke():
    records = _train_step_records(
        *("--prompts", "2", "--samples", "4", "--new-tokens", "16", "--skip-trl"),
        *("--warmup", "0", "--repeats", "1", "--length-dist", "pareto"),
        *("--peak-flops", "1e12"),
    )
    s, step = records[-1], next(r for r in records if r["what"] == "gjax_step")
    assert s["length_dist"] == "pareto" and 0 < step["completion_tokens"] < 8 * 16
    assert s["learner_executed_over_useful"] > 1.5  # ragged rows padded to 32 + 16
    # Split: the padding waste x remat's recompute factor; HFU counts what MFU leaves out.
    assert s["learner_padding_waste"] * s["learner_recompute_factor"] == pytest.approx(
        s["learner_executed_over_useful"]
    )
    assert 1 < s["learner_recompute_factor"] < s["learner_executed_over_useful"]
    assert s["learner_hfu"] == pytest.approx(  # one timed step
        s["learner_mfu"] * s["learner_executed_over_useful"]
    )
    assert s["peak_flops"] == 1e12 and s["peak_source"] == "--peak-flops"
    assert s["learner_mfu"] == pytest.approx(step["learner_useful_flops"] / step["update_s"] / 1e12)


@pytest.mark.slow
def test_train_step_compare_packing_smoke():
    records = _train_step_records(
        *("--prompts", "2", "--samples", "4", "--new-tokens", "16", "--compare-packing"),
        *("--warmup", "0", "--repeats", "2", "--length-dist", "pareto", "--microbatches", "2"),
        # auto_coarse left out: below 16 bins both ladders are exact (auto's J).
        *("--packing-modes", "padded,packed,auto_quarter,auto,auto_blocked,auto_ffd"),
    )
    s = records[-1]
    steps = [r for r in records if r["what"] == "packing_step"]
    modes = {"padded", "packed", "auto", "auto_quarter", "auto_blocked", "auto_ffd"}
    assert s["what"] == "packing_summary" and len(steps) == 2 * len(modes)
    # Each batch runs six ways (padded; packed in fixed bins; auto bins on the ladder, rounded
    # to a quarter of the rows, with the causal-blocked XLA attention, and packed by first-fit
    # decreasing alone; the order rotates):
    # same rows, same loss, fewer executed FLOPs.
    for i in (0, len(modes)):
        batch = steps[i : i + len(modes)]
        assert {r["mode"] for r in batch} == modes
        assert len({r["real_tokens"] for r in batch}) == 1
        for r in batch:
            assert r["loss"] == pytest.approx(batch[0]["loss"], abs=1e-6)
    for mode in modes:  # executed = padding waste x remat's recompute factor (per batch;
        # the summary's are medians over 2 batches, so equal to 1e-3)
        assert s[f"{mode}_update_padding_waste"] * s[f"{mode}_update_recompute_factor"] == (
            pytest.approx(s[f"{mode}_update_executed_over_useful"], rel=1e-3)
        )
        assert 1 < s[f"{mode}_update_recompute_factor"] < 1.5  # remat 'full'
    blocked = s["auto_blocked_attn_executed_over_useful"]
    assert blocked == pytest.approx(s["auto_attn_executed_over_useful"] * 5 / 8)  # 4 chunks
    assert s["auto_blocked_update_padding_waste"] < s["auto_update_padding_waste"]
    assert s["packed_update_executed_over_useful"] < s["padded_update_executed_over_useful"]
    assert s["packed_update_compiles"] == 1  # one static bin shape for every batch
    assert 1 <= s["auto_update_compiles"] <= 2  # at most one per batch (and 4 shapes)
    assert 1 <= s["auto_quarter_update_compiles"] <= 2
    assert max(s["auto_bins_J"]) <= max(s["auto_quarter_bins_J"])  # the ladder is finer
    assert (s["auto_packer"], s["auto_ffd_packer"]) == ("mbs", "ffd")
    assert all(a <= b for a, b in zip(s["auto_bins_used"], s["auto_ffd_bins_used"], strict=True))
    assert s["auto_update_executed_over_useful"] < s["padded_update_executed_over_useful"]
    assert s["packed_shape"].endswith("x 48 tokens") and s["train"]["microbatches"] == 2


@pytest.mark.slow
def test_rollout_backends_benchmark_smoke():
    """Static vs continuous at a KV budget of 2 static groups / 4 slots: the run checks that
    both decode the same tokens; the summary's counts are consistent."""
    records = _benchmark_records(
        "rollout_backends.py",
        *("--vocab", "64", "--hidden", "32", "--mlp", "48", "--layers", "1", "--heads", "2"),
        *("--kv-heads", "1", "--prompts", "4", "--samples", "2", "--max-prompt", "5"),
        *("--new-tokens", "16", "--kv-budget", "84", "--tokens-per-dispatch", "4"),
        *("--repeats", "1"),
    )
    setup, s = records[0], records[-1]
    assert setup["what"] == "setup" and s["what"] == "summary"
    assert (setup["static_rows"], setup["continuous_slots"]) == (4, 4)
    assert s["continuous_decode_steps"] >= setup["length_max"]
    assert (s["greedy_rows_identical"], s["greedy_tokens_agreeing"]) == (1.0, 1.0)
    assert s["static_useful_tokens_per_step"] == s["useful_tokens"] / s["static_decode_steps"]
    assert s["useful_per_step_continuous_over_static"] == pytest.approx(
        s["static_decode_steps"] / s["continuous_decode_steps"]
    )
    assert 0 < s["continuous_slot_occupancy"] <= 1 and 0 <= s["continuous_host_fraction"] < 1
    assert s["roofline"] == "not measured: no accelerator"


@pytest.mark.slow
def test_engine_step_benchmark_smoke():
    """The engine's cost per token over the static sampler's: one record, finite ratios for
    one and several tokens per generate call."""
    (rec,) = _benchmark_records(
        "engine_step.py",
        *("--vocab", "64", "--hidden", "32", "--mlp", "48", "--layers", "1", "--heads", "2"),
        *("--kv-heads", "1", "--prompts", "2", "--samples", "2", "--prompt-len", "5"),
        *("--new-tokens", "9", "--tokens-per-dispatch", "4", "--repeats", "1"),
    )
    assert (rec["rows"], rec["new_tokens"]) == (4, 9)
    # The static cost per token is a difference of two CPU timings (9 tokens minus 1): at this
    # size it is timer noise and can come out negative (-2.5e-6 s seen), so only finiteness.
    for name in ("static_cpu_s_per_token", "engine_k1_over_static", "engine_k4_over_static"):
        assert math.isfinite(rec[name]) and rec[name] != 0, rec


@pytest.mark.slow
def test_lora_decode_benchmark_smoke():
    """benchmarks/lora_decode.py on one layer of the 0.5B dims: one record; the merged and the
    low-rank step compute the same thing, and every figure is finite."""
    (rec,) = _benchmark_records(
        "lora_decode.py", "--shape=qwen2-0.5b", "--layers=1", "--slots=4", "--repeats=2"
    )
    assert (rec["layers"], rec["rank"], rec["slots"]) == (1, 16, 4)
    assert rec["max_rel_diff"] < 1e-4, rec
    for name in ("merged_step_ms", "low_rank_step_ms", "merged_layout_ms_per_version"):
        assert math.isfinite(rec[name]) and rec[name] > 0, rec
