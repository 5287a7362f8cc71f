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


@pytest.mark.slow  # a subprocess: jax import and compiles
def test_paged_kv_benchmark_smoke():
    """benchmarks/paged_kv.py at toy sizes, the decoder's and (--engine) the JetStream
    engine's: both layouts decode the same greedy tokens (the script asserts it) within the
    same KV budget; the ratios are the per-step counts'."""
    toy = (
        *("--vocab", "64", "--hidden", "32", "--mlp", "48", "--layers", "1", "--heads", "2"),
        *("--kv-heads", "1", "--prompts", "8", "--samples", "2", "--max-prompt", "5"),
        *("--new-tokens", "32", "--page", "4", "--kv-budget", "148"),
    )
    records = _benchmark_records("paged_kv.py", *toy)
    contiguous, paged, s = records
    assert (contiguous["what"], paged["what"], s["what"]) == ("contiguous", "paged", "summary")
    assert max(contiguous["kv_tokens"], paged["kv_tokens"]) <= s["kv_budget_tokens"] == 148
    assert s["greedy_tokens_equal"] is True
    for r in (contiguous, paged):
        assert r["useful_tokens_per_step"] == s["useful_tokens"] / r["decode_steps"]
    assert s["rows_in_flight_paged_over_contiguous"] == pytest.approx(
        paged["rows_in_flight"] / contiguous["rows_in_flight"]
    )
    # --engine: the same workload on the JetStream engine (JetStream's Driver, in-process)
    contiguous, paged, s = _benchmark_records("paged_kv.py", *toy, "--engine")
    assert (contiguous["what"], paged["what"]) == ("engine_contiguous", "engine_paged")
    assert max(contiguous["kv_tokens"], paged["kv_tokens"]) <= s["kv_budget_tokens"] == 148
    assert s["greedy_tokens_equal"] is True and paged["slots"] == 8 * contiguous["slots"]
    for r in (contiguous, paged):
        assert r["useful_tokens_per_step"] == s["useful_tokens"] / r["decode_steps"]


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


# ------------------------------------------------------------------ loss_kernels.py


def _loss_kernels_module():
    spec = importlib.util.spec_from_file_location(
        "loss_kernels_bench", os.path.join(ROOT, "benchmarks", "loss_kernels.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_loss_kernels_benchmark_smoke(tmp_path):
    """`--smoke` (the CI mode): the table leads stdout, then a JSON line per method and the
    summary last; every method ran, on the same loss, JAX's in one process."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT
    cache = tmp_path / "jax_cache"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "loss_kernels.py"), "--smoke"]
        + ["--compilation-cache", str(cache)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("## N = 64 tokens x D = 32 x V = 1024")
    assert lines[1].startswith("platform: jax: cpu (") and "torch: cpu (" in lines[1]
    first_json = next(i for i, line in enumerate(lines) if line.startswith("{"))
    text, records = lines[:first_json], [json.loads(line) for line in lines[first_json:]]
    rows, s = records[:-1], records[-1]
    assert s["summary"] is True and s["cases"] == [[64, 32, 1024]]
    bench = _loss_kernels_module()
    assert [r["method"] for r in rows] == list(bench.METHODS)
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["time_s"] > 0 and r["cpu_s"] >= 0 and r["platform"] == "cpu", r
        assert (r["tokens"], r["hidden"], r["vocab"]) == (64, 32, 1024)
    # Every method but the floor evaluates the same PPO-clip token-mean loss on the same data.
    losses = {r["method"]: r["loss"] for r in rows if r["method"] != "floor"}
    for m, loss in losses.items():
        assert loss == pytest.approx(losses["fused"], rel=1e-5), (m, losses)
    jax_rows = [r for r in rows if r["framework"] == "jax"]
    torch_rows = [r for r in rows if r["framework"] == "torch"]
    assert len({r["pid"] for r in jax_rows}) == 1  # one process for the JAX methods
    assert len({r["pid"] for r in torch_rows}) == len(torch_rows) == 2  # one each for RSS
    assert all(r["temp_mb"] is not None for r in jax_rows)
    assert all(r["rss_mb"] is not None for r in torch_rows)
    assert any(cache.iterdir())  # the JAX methods compiled into the persistent cache
    # A table row per method and a verdict per peer (everything but fused and the floor).
    assert sum(line.startswith("| ") for line in text) == 1 + len(rows)
    verdicts = [line for line in text if line.startswith("vs ")]
    assert [v.split(":")[0] for v in verdicts] == [
        f"vs {m}" for m in bench.METHODS if m not in ("fused", "floor")
    ]
    assert all(("faster" in v or "slower" in v) and v.endswith("at N = 64") for v in verdicts)
    assert s["speedup_vs_trl"] == [
        pytest.approx(torch_rows[0]["time_s"] / rows[1]["time_s"], rel=1e-3)
    ]
    run = s["run"]
    assert run["cores"] == os.cpu_count() and run["wall_s"] > 0 and run["cpu_s"] > 0
    assert 0 < run["calls_cpu_s"] <= run["cpu_s"]


def _row(n, method, time_s, cpu_s=None, **kw):
    return {
        "tokens": n,
        "hidden": 8,
        "vocab": 16,
        "method": method,
        "time_s": time_s,
        "cpu_s": time_s if cpu_s is None else cpu_s,
        **kw,
    }


def test_loss_kernels_crossover_is_where_fused_stays_ahead():
    bench = _loss_kernels_module()
    rows = [
        _row(512, "fused", 1.0),
        _row(512, "naive", 0.6),
        _row(2048, "fused", 4.0),
        _row(2048, "naive", 4.4, cpu_s=3.9),
        _row(8192, "fused", 16.0),
        _row(8192, "naive", 19.0),
        _row(512, "trl", 0.9),
        _row(2048, "trl", 4.5),
        _row(8192, "trl", 15.0),
    ]
    assert bench.crossover(rows, "naive") == 2048
    assert bench.crossover(rows, "naive", "cpu_s") == 8192
    assert bench.crossover(rows, "trl") is None  # ahead at 2048, behind again at 8192
    s = bench.summary(rows)
    assert s["crossover_N"]["naive"] == {"wall": 2048, "cpu": 8192}
    assert s["crossover_N"]["trl"] == {"wall": None, "cpu": None}
    table = bench.sweep_table(rows)
    assert "fused overtakes naive: wall from N = 2048 on, cpu from N = 8192 on" in table
    assert "fused overtakes trl: wall not within the swept N" in table
    # A point the sweep lacks (skipped: no memory) ends the run of wins there.
    rows[3] = _row(2048, "naive", None, skipped="needs 9 GiB")
    assert bench.crossover(rows, "naive") == 8192
    assert "| 2048 | 4.000 | skipped |" in bench.sweep_table(rows)


def test_loss_kernels_verdict_words():
    bench = _loss_kernels_module()
    fused = _row(512, "fused", 2.0, cpu_s=3.0, framework="jax", temp_mb=40.0, platform="cpu")
    naive = _row(512, "naive", 1.0, cpu_s=3.3, framework="jax", temp_mb=600.0, platform="cpu")
    v = bench.verdict(fused, naive)
    assert v.startswith("vs naive: fused is slower (0.50x naive's speed in wall time, 1.10x")
    assert "in CPU time: faster)" in v and "smaller (15.0x less memory, XLA temp" in v
    assert v.endswith("at N = 512")
    trl = _row(512, "trl", 4.0, framework="torch", rss_mb=30.0, platform="cpu")
    fused["rss_mb"] = 300.0  # across frameworks on the CPU: RSS against RSS
    v = bench.verdict(fused, trl)
    assert "fused is faster (2.00x" in v and "larger (10.0x more memory, RSS 300.0 vs 30.0" in v
    fused["platform"] = "tpu"  # torch has no TPU: its peers then run on the host CPU
    assert bench.verdict(fused, trl).endswith("at N = 512 (different platforms: tpu vs cpu)")
    skipped = {"tokens": 512, "method": "trl", "skipped": "needs 20 GiB"}
    assert bench.verdict(fused, skipped) == "vs trl: trl has no time (needs 20 GiB)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "510"], "multiple of 4"),
        (["--tokens", "512,x"], "not a positive integer"),
        (["--cases", "512x1536"], "is not N x D x V"),
        (["--methods", "fused,bogus"], "unknown bogus"),
        (["--reps", "0"], "--reps must be >= 1"),
    ],
)
def test_loss_kernels_bad_flags_are_user_errors(argv, message):
    from gjax.errors import UserError

    bench = _loss_kernels_module()
    with pytest.raises(UserError, match=message):
        bench.main(argv)


def test_loss_kernels_plans():
    bench = _loss_kernels_module()

    def plan(*argv):
        ap_args = bench.build_parser().parse_args(list(argv))
        return bench._plan(ap_args)

    assert plan() == ([(512, 1536, 151936)], list(bench.METHODS), 2)
    assert plan("--tokens", "512,2048", "8192")[0] == [
        (512, 1536, 151936),
        (2048, 1536, 151936),
        (8192, 1536, 151936),
    ]
    assert len(plan("--full")[0]) == 6
    assert plan("--smoke") == ([(64, 32, 1024)], list(bench.METHODS), 1)
    assert plan("--methods", "trl,fused")[1] == ["fused", "trl"]


def test_loss_kernels_report_orders_cases_by_tokens():
    bench = _loss_kernels_module()
    rows = [_row(n, m, 1.0) for n in (8192, 512, 2048) for m in ("naive", "fused", "floor")]
    blocks = bench.report_blocks(rows)
    heads = [b.splitlines()[0] for b in blocks]
    assert [h.split(" tokens")[0] for h in heads[:3]] == [f"## N = {n}" for n in (512, 2048, 8192)]
    assert heads[3].startswith("## sweep over N at D = 8 x V = 16") and len(blocks) == 4
    assert [r["method"] for r in rows[:3]] == ["floor", "fused", "naive"]
    assert "| 512 | 1.000 | 1.00 (1.00) |" in blocks[3]


@pytest.mark.slow  # a subprocess: jax import and compiles (~40 s on a busy 2-core CPU)
def test_multiturn_prefill_benchmark_counts_what_keeping_kv_saves():
    """benchmarks/multiturn_prefill.py at toy sizes: KV kept prefills the prompt once per group
    plus the observations; re-prefilling the history costs more."""
    (rec,) = _benchmark_records(
        "multiturn_prefill.py",
        *("--prompts", "2", "--samples", "2", "--prompt-tokens", "8", "--turns", "1"),
        *("--obs-tokens", "4", "--turn-tokens", "8", "--slots", "4", "--jetstream"),
    )
    assert rec["episodes"] == 4 and 1 <= rec["turns_per_episode"] <= 2
    kept = rec["prefill_tokens_per_episode_kept"]
    assert kept == 8 / 2 + 4 * (rec["turns_per_episode"] - 1)  # one observation per re-entry
    assert rec["prefill_tokens_per_episode_reprefill"] > kept
    # The JetStream engine's requests: every row sends its own prompt (8, not 8 / G) and each
    # later turn its whole history: what its own episodes' reprefill count says, plus the
    # prompt the group did not share.
    sent = rec["jetstream_prefill_tokens_per_episode"]
    assert sent == rec["jetstream_counted_reprefill"] + 8 * (1 - 1 / 2)
    assert sent > rec["jetstream_counted_kept"] and rec["jetstream_requests"] >= 4


def _accelerator(tmp_path, *args: str, timeout: float = 900) -> tuple[dict, str, str]:
    """`benchmarks/accelerator.py ARGS --json --markdown` in tmp_path: (report, markdown,
    stderr)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT
    out_json, out_md = tmp_path / "accel.json", tmp_path / "accel.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "accelerator.py"), *args]
        + ["--json", str(out_json), "--markdown", str(out_md)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_json.read_text()), out_md.read_text(), proc.stderr


ACCEL_STAGES = ["ceilings", "efficiency", "decode", "update", "head", "step", "async"]


@pytest.mark.slow
def test_accelerator_benchmark_tiny(tmp_path):
    """The accelerator command in its CPU mode, one stage (decode) forced over its budget:
    it is stopped and recorded as skipped, every other stage still runs and reports its
    figures; the JSON and the markdown table say so."""
    report, md, _ = _accelerator(tmp_path, "--tiny", "--budgets", "decode=0.5")
    assert report["what"] == "accelerator" and report["schema"] == 1 and report["tiny"]
    assert (report["platform"], report["device_count"]) == ("cpu", 1)
    assert 0 < report["wall_s"] <= report["total_budget_s"]
    assert list(report["stages"]) == ACCEL_STAGES
    for name, rec in report["stages"].items():
        assert rec["status"] in ("ok", "skipped", "failed"), name
        assert rec["wall_s"] <= rec["budget_s"] + 5, name  # the budget held
        if rec["status"] == "ok":
            figs = rec["figures"]
            assert figs and not [k for k in figs if k.endswith("_error")], (name, figs)
        else:
            assert rec.get("reason") or rec.get("error"), name
        assert f"| {name} | {rec['status']}" in md
    decode = report["stages"]["decode"]
    assert decode["status"] == "skipped" and decode["budget_s"] == 0.5
    assert decode["reason"].startswith("over its budget of 0.5 s")
    assert all(report["stages"][n]["status"] == "ok" for n in ACCEL_STAGES if n != "decode")
    figs = {n: r["figures"] for n, r in report["stages"].items() if r["status"] == "ok"}
    assert figs["ceilings"]["matmul_flops"] > 0 and figs["ceilings"]["copy_bytes_per_s"] > 0
    eff = figs["efficiency"]
    assert eff["kv_in_place"] is True and eff["decode_bytes_over_ideal"] > 1
    assert 0 < eff["decode_ideal_int8_over_float"] < 1  # the int8 step's ideal bytes
    assert eff["host_syncs_per_dispatch"] == 1 and eff["host_syncs_per_train_step"] == 1
    assert 1 <= eff["update_packed_padding_waste"] < eff["update_flops_xla"]["padded_padding_waste"]
    assert 0 < figs["update"]["mfu"] < figs["update"]["hfu"]
    assert figs["head"]["fused_over_floor"] > 0 and figs["head"]["naive_over_floor"] > 0
    step = figs["step"]
    assert step["completion_tokens"] == 2 * 2 * 12  # every row full length
    assert set(step["phases_s"]) == {"decode", "prefill", "learner", "host"}
    assert sum(step["phases_s"].values()) == pytest.approx(step["phases_step_s"], rel=1e-6)
    assert figs["async"]["over_sync"] == pytest.approx(
        figs["async"]["steps_per_s"] / step["steps_per_s"]
    )


def test_accelerator_benchmark_total_budget_and_bad_flags(tmp_path):
    """With no time left every stage is skipped, saying why (no child starts); a bad
    --budgets entry is one paragraph, not a traceback."""
    report, md, _ = _accelerator(tmp_path, "--tiny", "--total-budget", "1")
    assert [r["status"] for r in report["stages"].values()] == ["skipped"] * len(ACCEL_STAGES)
    assert all("total budget is spent" in r["reason"] for r in report["stages"].values())
    assert md.count("| skipped: the run's total budget is spent") == len(ACCEL_STAGES)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "accelerator.py"), "--budgets", "x=1"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--budgets: 'x=1' is not NAME=SECONDS" in proc.stderr


@pytest.mark.slow
def test_long_response_benchmark_tiny():
    """benchmarks/long_response.py --tiny: rows up to the 256-token cap decoded on paged KV,
    packed, trained with mesh.seq = 2 on a reward that varies in a group (non-zero
    gradients), and resumed from the step-1 checkpoint to step 2."""
    (out,) = _benchmark_records("long_response.py", "--tiny")
    assert out["resumed"] and out["steps"] == [1, 2]
    assert (out["max_new_tokens"], out["seq"], out["kv_page_size"]) == (256, 2, 32)
    assert out["length_max"] == 256 and 0 < out["clipped_frac"] < 1  # long-tailed, some cut
    assert 0 < out["length_mean"] < 256
    assert all(math.isfinite(g) and g > 0 for g in out["grad_norm"])
    assert all(0 < f <= 1 for f in out["pack"]["pack/fill"])


@pytest.mark.slow
def test_algorithm_costs_benchmark_tiny():
    """benchmarks/algorithm_costs.py --tiny: the smoke study's two variants timed side by side
    in one process; the ratios are against the first, and the tiny mode's one packed shape
    leaves nothing to compile inside a timed window."""
    setup, *variants, summary = _benchmark_records("algorithm_costs.py", "--tiny")
    assert setup["variants"] == ["grpo", "dr_grpo"] and setup["matmul_flops"] > 0
    assert [v["variant"] for v in variants] == setup["variants"]
    grpo, dr_grpo = variants
    assert grpo["learner_over_baseline"] == grpo["step_over_baseline"] == 1.0
    for v in variants:
        assert v["learner_net_s"]["median"] > 0 and v["step_net_s"]["median"] > 0
        assert v["compile_s_in_timed"] < 0.5
        assert v["completion_tokens_per_step"] > 0 and v["rollout_rounds_per_step"] == 1.0
        assert 0 < v["learner_over_matmul_floor"] < 1
    ratio = dr_grpo["step_net_s"]["median"] / grpo["step_net_s"]["median"]
    assert summary["dr_grpo_step_over_baseline"] == pytest.approx(ratio)
