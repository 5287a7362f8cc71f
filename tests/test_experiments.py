"""experiments/: the study registry, the runner's resumability, the aggregation's statistics,
table and figures (synthetic runs in the trainer's formats), and one real smoke study."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import aggregate, outcome_logp, passk, run, studies, worker
from gjax import config_record, schema
from gjax import train as train_lib
from gjax.config import validate
from gjax.errors import ConfigError, UserError
from gjax.metrics import MetricsWriter
from gjax.objective.advantages import ADVANTAGES
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_t_quantile_and_interval_by_hand():
    # t_{0.975} from printed tables: df 1 -> 12.706, df 4 -> 2.776, df 29 -> 2.045.
    assert aggregate.t_quantile(1) == pytest.approx(12.7062, abs=1e-4)
    assert aggregate.t_quantile(4) == pytest.approx(2.7764, abs=1e-4)
    assert aggregate.t_quantile(29) == pytest.approx(2.0452, abs=1e-4)
    # 1..5: mean 3, sample sd sqrt(2.5), se sqrt(2.5 / 5) = 0.70711; 2.77645 * 0.70711 = 1.96324
    mean, half, n = aggregate.mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (mean, n) == (3.0, 5)
    assert half == pytest.approx(1.96324, abs=1e-4)
    assert math.isnan(aggregate.mean_ci([0.5])[1])


def test_every_variant_builds_a_valid_config():
    for study in studies.STUDIES.values():
        for v in study.variants:
            c = studies.build_config(study, v, seed=3, steps=7)
            assert (c.seed, c.data.shuffle_seed, c.train.steps) == (3, 3, 7)
            assert c.train.minibatches == study.overrides.get("train.minibatches", 1)
            # every arm logs cov/* (on :headroom), a variant's own objective preset included
            assert c.objective.covariance_metrics == (study.name != "smoke"), (study.name, v)
            validate(c, 1, checks=train_lib.CONFIG_CHECKS)
            obj = schema.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
            # the estimator accepts its hyperparameters (checked when it is traced)
            f32, b = jax.ShapeDtypeStruct((2, 8), jnp.float32), jax.ShapeDtypeStruct((2, 8), bool)
            jax.eval_shape(
                lambda r, v, s, a, o=obj: ADVANTAGES.get(o.advantage)(
                    r, v, scores_PxG=s, is_anchor_PxG=a, **dict(o.advantage_kwargs)
                ),
                f32, b, f32, b,
            )  # fmt: skip
    agrae = studies.get("a_grae_variants").variant("negative_dominant")
    kw = studies.build_config(studies.get("a_grae_variants"), agrae, 0).objective.advantage_kwargs
    assert (kw.sample_level, kw.group_level) == ("none", "negative_dominant")


def test_a_variant_override_wins_over_the_study_s():
    v = studies.Variant("x", "grpo", "doc", overrides={"train.minibatches": 8})
    study = studies.Study("s", "claim", (v,), overrides={"train.minibatches": 4, "seed": 9})
    c = studies.build_config(study, v, 0)
    assert (c.train.minibatches, c.seed) == (8, 0)  # the seed is the run's, set last
    assert (
        studies.build_config(study, studies.get("smoke").variant("grpo"), 0).train.minibatches == 4
    )


def test_an_override_of_a_missing_field_is_refused():
    v = studies.Variant("x", "grpo", "doc", overrides={"objective.advantage_kwargs.nope": 1})
    with pytest.raises(
        ConfigError, match="variant .x.: cannot set config.objective.advantage_kwargs.nope"
    ):
        studies.build_config(studies.Study("s", "claim", (v,)), v, 0)
    bad_study = studies.Study("s", "claim", (v,), overrides={"train.nope": 1})
    with pytest.raises(ConfigError, match="study .s.: cannot set config.train.nope"):
        studies.build_config(bad_study, studies.get("smoke").variant("grpo"), 0)
    with pytest.raises(ConfigError, match="no variant"):
        studies.get("smoke").variant("gpg")


def test_plan_skips_finished_runs_only(tmp_path):
    study = studies.get("smoke")
    out = str(tmp_path)
    wd = worker.workdir_of(out, "smoke", "grpo", 1)
    os.makedirs(wd)
    worker.write_done(wd, steps=2, passk_samples=studies.passk_samples(True))
    done = {(v, s): d for v, s, _, d in run.plan(study, 2, out=out, steps=2, smoke=True)}
    assert done == {("grpo", 0): False, ("grpo", 1): True, ("dr_grpo", 0): False,
                    ("dr_grpo", 1): False}  # fmt: skip
    # more steps asked for: the finished run resumes from its checkpoint
    assert not any(d for *_, d in run.plan(study, 2, out=out, steps=3, smoke=True))
    # later seeds only (`--first_seed 1 --seeds 2`): 1 (done) and 2, seed-major
    later = run.plan(study, 2, out=out, steps=2, smoke=True, first_seed=1)
    assert [(v, s, d) for v, s, _, d in later] == [("grpo", 1, True), ("dr_grpo", 1, False),
                                                   ("grpo", 2, False), ("dr_grpo", 2, False)]  # fmt: skip


def test_tool_use_study_s_heldout_prompts_offer_the_tools_its_runs_offer():
    """passk.py evaluates a multi-turn run's episodes on prompts rendered as the run renders
    them: the `tool` arm's offer the calculator, the `no_tool` arm's do not; both are the same
    problems, whose chain lengths the aggregation recovers."""
    from gjax.embedded import resolve_model_path
    from gjax.models.hf_import import load_tokenizer

    study = studies.get("tool_use")
    cfgs = {v.name: studies.build_config(study, v, 0) for v in study.variants}
    assert cfgs["tool"].env.name == "tool" and cfgs["no_tool"].env.name == ""
    tok = load_tokenizer(resolve_model_path(cfgs["tool"].model.path))
    held = {k: passk.heldout_prompts(c, tok) for k, c in cfgs.items()}
    line = "<|im_start|>system\ntools: calculator(expression)<|im_end|>\n"
    assert all(p.startswith(line) for p in held["tool"].prompts)
    assert [p.removeprefix(line) for p in held["tool"].prompts] == held["no_tool"].prompts
    ops = {k: aggregate.heldout_difficulty(c.to_dict()) for k, c in cfgs.items()}
    assert ops["tool"].tolist() == ops["no_tool"].tolist()
    assert set(ops["tool"].tolist()) == set(range(2, 7))


@pytest.mark.parametrize("command", [run.main, aggregate.main])
def test_a_command_s_user_error_is_one_paragraph_and_status_2(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        command(["no_such_study"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gjax: unknown study 'no_such_study'") and "Traceback" not in err


def test_plan_refuses_runs_trained_with_another_config(tmp_path):
    """A study whose definition changed (all_algorithms went off-policy) must neither count
    its old finished runs as done nor overwrite them."""
    study, out = studies.get("smoke"), str(tmp_path)
    wd = worker.workdir_of(out, "smoke", "grpo", 1)
    os.makedirs(wd)
    worker.write_done(wd, steps=2, passk_samples=studies.passk_samples(True))
    config = studies.build_config(study, study.variant("grpo"), 1, steps=2, smoke=True)
    config.log.eval_every = 7  # cadences may differ
    config_record.write(wd, config)
    done = lambda: {(v, s): d for v, s, _, d in run.plan(study, 2, out=out, steps=2, smoke=True)}
    assert done()["grpo", 1]
    # finished at a sampling budget the study does not give it (a HARMLESS field for resumes)
    marker = dict(steps=2, passk_samples=studies.passk_samples(True))
    worker.write_done(wd, **marker, max_sampled_tokens=1000)
    with pytest.raises(ConfigError, match=r"seed_1: train.max_sampled_tokens: 1000 -> 0"):
        run.plan(study, 2, out=out, steps=2, smoke=True)
    worker.write_done(wd, **marker, max_sampled_tokens=0)
    assert done()["grpo", 1]
    config.train.minibatches = 1 if config.train.minibatches != 1 else 2
    config_record.write(wd, config)
    with pytest.raises(ConfigError, match=r"smoke/grpo/seed_1: train.minibatches"):
        run.plan(study, 2, out=out, steps=2, smoke=True)
    # a workdir that never trained (no marker, no checkpoint) starts afresh, as the trainer
    # would: its config.json is no reason to refuse
    wd0 = worker.workdir_of(out, "smoke", "grpo", 0)
    config_record.write(wd0, config)
    os.remove(os.path.join(wd, worker.DONE_FILE))
    assert not any(d for *_, d in run.plan(study, 2, out=out, steps=2, smoke=True))
    os.makedirs(os.path.join(wd0, "checkpoints", "1"))  # a saved step: trained
    with pytest.raises(ConfigError, match=r"1 run\(s\) .*seed_0: .*train.minibatches"):
        run.plan(study, 2, out=out, steps=2, smoke=True)


def test_workers_share_one_compilation_cache_unless_one_is_chosen(tmp_path):
    env = run.worker_env({"PATH": "/bin"}, str(tmp_path))
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / ".jax_cache")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0  # the file lock for parallel writers
    assert env["PYTHONPATH"].split(os.pathsep)[0] == run.ROOT
    mine = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    env = run.worker_env(mine, str(tmp_path))
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"
    assert "JAX_COMPILATION_CACHE_MAX_SIZE" not in env  # the caller's cache, the caller's rules


def test_a_cache_entry_without_its_atime_is_removed_before_workers_start(tmp_path):
    """jax's size-limited cache reads every entry's atime file before each write: one missing
    (a worker killed between its two writes) made every later write fail, so every run of a
    study compiled everything again."""
    from jax._src import lru_cache

    cache = lru_cache.LRUCache(str(tmp_path), max_size=1 << 20)
    cache.put("jit_a-1", b"x" * 10)
    (tmp_path / "jit_b-2-cache").write_bytes(b"y" * 10)  # no jit_b-2-atime
    with pytest.raises(FileNotFoundError):
        cache.put("jit_c-3", b"z" * 10)  # jax's own behaviour: the write is lost
    env = run.worker_env({"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}, "unused")
    assert run.repair_cache(env) == []  # the caller's cache without a size limit: untouched
    assert (tmp_path / "jit_b-2-cache").exists()
    env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(1 << 20)
    assert run.repair_cache(env) == ["jit_b-2-cache"]
    cache.put("jit_c-3", b"z" * 10)
    assert cache.get("jit_c-3") == b"z" * 10 and cache.get("jit_a-1") == b"x" * 10
    assert run.repair_cache({**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "absent")}) == []


def test_sampled_tokens_are_the_logged_ones_else_estimated():
    cfg = {"rollout": {"prompts_per_step": 2, "num_samples": 4}}
    old = {"response/length_mean": 10.0, "sampling/rollouts": 2.0}  # 2 rounds x 8 x 10
    new = {**old, "response/sampled_tokens": 123.0}  # logged: every round's, summed
    got = aggregate.sampled_tokens({"config": cfg, "rows": [old, new, old]})
    assert got.tolist() == [160.0, 283.0, 443.0]


def _fake_run(out, variant, seed, *, final_counts, grad_norms, n=4, cov=False, evals=None):
    """A run's files as the trainer and the worker write them (`cov`: with `cov/*`, |c|
    percentile p at step s = s x {50: 1, 90: 2, 99: 5, 99.9: 20}[p] x (seed + 1),
    `reward/all_unsolved_frac` 0.25 and clip fractions 0.001 s (low) and 0.002 (high); `evals`: {step: held-out pass@1}, default 0.4 + 0.01 s
    at even steps)."""
    wd = worker.workdir_of(out, "smoke", variant, seed)
    w = MetricsWriter(wd, total_steps=len(grad_norms), tensorboard=False, progress=False)
    for step, g in enumerate(grad_norms, 1):
        row = {"optim/grad_norm": g, "policy/entropy": 0.2, "response/length_mean": 10.0,
               "sampling/rollouts": 1.0}  # fmt: skip
        if evals is not None and step in evals:
            row["eval/heldout_pass@1"] = evals[step]
        elif evals is None and step % 2 == 0:
            row["eval/heldout_pass@1"] = 0.4 + 0.01 * step
        if cov:  # `cov` also adds unsolved groups (a test device: runs with and without)
            row["reward/all_unsolved_frac"] = 0.25
            row["policy/clip_frac_low"], row["policy/clip_frac_high"] = 0.001 * step, 0.002
            for p, scale in (("p50", 1), ("p90", 2), ("p99", 5), ("p99.9", 20)):
                row[f"cov/abs_{p}"] = float(step * scale * (seed + 1))
        w.write(step, row)
    w.close()
    summary = {"steps": len(grad_norms), "heldout_accuracy_before": 0.3,
               "heldout_accuracy_after": 0.5, "heldout_pass@1_before": 0.3,
               "heldout_pass@1_after": 0.5}  # fmt: skip
    with open(os.path.join(wd, "summary.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(wd, "config.json"), "w") as f:
        json.dump({"rollout": {"prompts_per_step": 2, "num_samples": 4}}, f)
    base = [1, 1, 2, 2, 0]
    res = passk.result(base, final_counts, n=n, step=len(grad_norms), seed=seed)
    with open(os.path.join(wd, passk.PASSK_FILE), "w") as f:
        json.dump(res, f)


def test_aggregate_table_and_figures(tmp_path):
    runs, results = str(tmp_path / "runs"), str(tmp_path / "results")
    # grpo's final pass@1 over 5 problems x 4 samples: 10/20, 12/20, 14/20 -> 0.5, 0.6, 0.7
    for seed, counts in enumerate(([2, 2, 2, 2, 2], [4, 2, 2, 2, 2], [4, 4, 2, 2, 2])):
        _fake_run(runs, "grpo", seed, final_counts=counts, grad_norms=[1, 1, 10, 1, 1, 1], cov=True)
    # dr_grpo seed 0 falls from 0.5 to 0.3 (drop 0.2) and recovers to 0.4 but not its best.
    for seed, evals in enumerate(({2: 0.5, 4: 0.3, 6: 0.4}, None)):
        _fake_run(runs, "dr_grpo", seed, final_counts=[4] * 5, grad_norms=[1.0] * 6, evals=evals)
    out = aggregate.aggregate("smoke", runs, results)
    md = pathlib.Path(out, "results.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| variant"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    rows = {
        cells[0]: dict(zip(cols, cells))
        for line in md.split("Paired by seed")[0].splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    # mean 0.6, sd 0.1, se 0.057735, t(2) = 4.302653 -> half-width 0.248414
    assert rows["grpo"]["pass@1"] == "0.600 ± 0.248"
    assert rows["grpo"]["seeds"] == "3"
    assert rows["grpo"]["gnorm spikes"] == "1.0 ± 0.0"  # 10 > 3 x median 1, once per run
    assert rows["dr_grpo"]["pass@1"] == "1.000 ± 0.000"
    assert rows["dr_grpo"]["pass@4"] == "1.000 ± 0.000"
    # base: counts 1,1,2,2,0 of 4 -> pass@1 0.3 for every seed
    assert rows["base policy"]["pass@1"] == "0.300 ± 0.000"
    assert rows["grpo"]["sampled tokens"].startswith("480")  # 6 steps x 2 x 4 x 10 tokens
    assert rows["grpo"]["unsolved groups"] == "0.250 ± 0.000"
    assert rows["dr_grpo"]["unsolved groups"] == "–"  # logged none
    # clipped: mean over steps 1..6 of 0.001 s + 0.002 = 0.0055 -> 0.55 %
    assert rows["grpo"]["clipped %"] == "0.55 ± 0"
    assert rows["dr_grpo"]["clipped %"] == "–"
    # grpo: 0.3 before, then 0.42, 0.44, 0.46: never falls. dr_grpo: 0.2 and 0: mean 0.1,
    # sd 0.141421, se 0.1, t(1) = 12.706205 -> half-width 1.271
    assert rows["grpo"]["pass@1 drop"] == "0.000 ± 0.000"
    assert rows["dr_grpo"]["pass@1 drop"] == "0.100 ± 1.271"
    for name in ("curves.png", "passk.png", "pass1_vs_tokens.png"):
        assert os.path.getsize(os.path.join(out, name)) > 10_000
    per_run = json.loads(pathlib.Path(out, "runs.json").read_text())
    assert [r["pass@1"] for r in per_run["grpo"]] == pytest.approx([0.5, 0.6, 0.7])
    # c = 2 of n = 4 on every problem: pass@2 = 1 - C(2, 2) / C(4, 2) = 5/6
    assert per_run["grpo"][0]["pass@2"] == pytest.approx(5 / 6)
    # Covariance table: 6 steps, 10 % -> the first and the last row; seeds scale 1, 2, 3.
    cov_rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in md.split("Table 1's form")[1].splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
    }
    # p50: start 1 x (1, 2, 3) -> 2; end 6 x (1, 2, 3) = 6, 12, 18: mean 12, sd 6,
    # half-width 4.302653 x 6 / sqrt(3) = 14.9
    assert cov_rows["grpo"][1] == "2 -> 12 ± 14.9"
    assert cov_rows["grpo"][4] == "40 -> 240 ± 298"
    assert cov_rows["grpo"][5] == "20 ± 0"  # p99.9 / p50 = 20 in every run
    assert cov_rows["dr_grpo"][1:5] == ["–"] * 4  # logged no cov/*
    # A run whose first 10 % of steps logged no cov/* (turned on at a resume): no start.
    late = {"v": [{f"cov/abs_{p}@end": 2.0 for p in aggregate.COV_PERCENTILES}]}
    assert "| v | – -> 2 | – -> 2 | – -> 2 | – -> 2 | 1 |" in aggregate.cov_table(late)


def test_base_row_takes_each_seed_from_a_run_that_has_it():
    """A run still training (no pass@k yet) listed after a finished one of the same seed."""
    done = {"seed": 0, "steps": 200, "pass@1": 0.5, "base_pass@1": 0.3, "greedy_before": 0.2}
    figs = {"grpo": [done], "dr_grpo": [{"seed": 0, "steps": 120}]}
    md = aggregate.table(studies.get("smoke"), figs)
    base = next(line for line in md.splitlines() if line.startswith("| base policy"))
    assert base.split("|")[2:5] == [" 1 ", " 0 ", " 0.200 "]  # seeds, steps, greedy acc
    assert " 0.300 " in base.split("|")  # pass@1


def test_arms_that_sample_different_bases_get_a_base_row_each():
    """passk.json names its base setup (seed apart): arms that share it share one row, and
    runs written before it was recorded join the one setup there is; two setups (the tool
    study's arms: prompts with and without tools) give a row each, with its own figures."""
    run = lambda seed, setup, base: {
        "seed": seed, "steps": 2, "pass@1": 0.5, "base_pass@1": base, "base_setup": setup,
    }  # fmt: skip
    one = {"a": [run(0, "x", 0.25), run(1, "x", 0.75)], "b": [run(0, None, 0.25)]}
    assert [(label, len(rs)) for label, rs in aggregate.base_groups(one)] == [("base policy", 3)]
    two = {"tool": [run(0, "x", 0.25)], "no_tool": [run(0, "y", 0.125)], "c": [run(0, "x", 0.25)]}
    two["no_tool"].append({"seed": 1, "steps": 1})  # still training: no base of its own
    groups = aggregate.base_groups(two)
    assert [label for label, _ in groups] == ["base policy (tool, c)", "base policy (no_tool)"]
    md = aggregate.table(studies.get("smoke"), two)
    rows = {ln.split("|")[1].strip(): ln.split("|") for ln in md.splitlines()}
    assert rows["base policy (tool, c)"][5].strip() == "0.250"  # pass@1, after greedy acc
    assert rows["base policy (no_tool)"][5].strip() == "0.125"


def test_pass_at_k_by_difficulty_by_hand():
    ops_P = np.array([2, 2, 3, 4])
    pk = passk.result([4, 0, 1, 0], [4, 2, 0, 1], n=4, step=6, seed=0)
    got = aggregate.difficulty_figures({"passk": pk}, ops_P)
    # final: 2 ops -> counts 4, 2 of 4: pass@1 (1 + 0.5) / 2; pass@4 both solved once
    assert got["pass@1|ops=2"] == pytest.approx(0.75) and got["pass@4|ops=2"] == 1.0
    assert got["pass@1|ops=3"] == 0.0 and got["pass@4|ops=3"] == 0.0
    assert got["pass@1|ops=4"] == pytest.approx(0.25) and got["pass@4|ops=4"] == 1.0
    assert got["base_pass@1|ops=2"] == pytest.approx(0.5) and got["base_pass@4|ops=2"] == 0.5
    assert got["problems|ops=2"] == 2 and got["problems|ops=4"] == 1
    # A held-out set that does not match the counts (another data config): nothing.
    assert aggregate.difficulty_figures({"passk": pk}, ops_P[:3]) == {}
    assert aggregate.difficulty_figures({"passk": pk}, None) == {}
    # Two seeds of one arm; the base row takes one figure per seed however many arms.
    b = {"seed": 1, **aggregate.difficulty_figures({"passk": pk}, ops_P), "pass@1|ops=2": 0.25}
    b["base_pass@1|ops=2"] = 0.25
    a = {"seed": 0, **got}
    md = aggregate.difficulty_table({"grpo": [a, b], "dapo": [a]})
    lines = md.splitlines()
    assert lines[0].startswith("| variant | pass@1, 2 ops (2) | pass@1, 3 ops (1) |")
    assert lines[0].endswith("| pass@4, 4 ops (1) |")
    # grpo pass@1, 2 ops: 0.75 and 0.25: mean 0.5, sd 0.353553, t(1) 12.706205 -> 3.177
    assert lines[3].startswith("| grpo | 0.500 ± 3.177 | 0.000 ± 0.000 |")
    # base, 2 ops: seed 0 0.5, seed 1 0.25 once each (not seed 0 twice): mean 0.375,
    # sd 0.176777, se 0.125, t(1) 12.706205 -> 1.588
    assert lines[2].startswith("| base policy | 0.375 ± 1.588 |")
    assert aggregate.difficulty_table({"grpo": [{"seed": 0, "pass@1": 0.5}]}) == ""


def test_heldout_difficulty_is_each_problem_s_chain_length():
    """The held-out set rebuilt from a run's config, in its order: the generator's own num_ops."""
    from gjax.data import synthetic

    cfg = studies.build_config(studies.get("smoke"), studies.get("smoke").variants[0], 0)
    ops_P = aggregate.heldout_difficulty(cfg.to_dict())
    task = synthetic.SyntheticConfig(**cfg.data.synthetic.to_dict())
    seed = cfg.data.synthetic_seed
    want = [p.num_ops for p in synthetic.generate(len(ops_P), "test", seed=seed, config=task)]
    assert len(ops_P) == cfg.data.heldout_size and ops_P.tolist() == want
    assert len(set(want)) > 1  # a check that can fail: several difficulties
    assert aggregate.heldout_difficulty({"data": {"source": "gsm8k"}}) is None


def test_outcome_stats_by_hand():
    """Two groups of 2: (correct, wrong) and (correct, correct); x: past a row's length."""
    x = 9.0
    logps = np.array([[-0.1, -0.3, x], [-1.0, x, x], [-0.2, -0.2, -0.2], [-0.5, x, x]])
    got = outcome_logp.outcome_stats(
        logps, np.array([2, 1, 3, 1]), np.array([1, 0, 1, 1.0]), group=2
    )
    assert got["accuracy"] == 0.75 and got["mixed_groups"] == 1
    assert got["token_logp_correct"] == pytest.approx(-0.3)  # rows' means -0.2, -0.2, -0.5
    assert got["token_logp_wrong"] == pytest.approx(-1.0)
    assert (got["length_correct"], got["length_wrong"]) == (2.0, 1.0)
    # Group 1 only: tokens -0.1, -0.3 (A = +a), -1.0 (A = -a), a = 0.5 / (0.5 + 1e-6);
    # log-prob mean -1.4/3, A mean a/3: terms 0.24444a, 0.11111a, 0.71111a, mean 0.35556a.
    a = 0.5 / (0.5 + 1e-6)
    assert got["cov_logp_adv"] == pytest.approx(1.06667 * a / 3, rel=1e-4)
    assert got["cov_from_positive_adv"] == pytest.approx(0.35556 * a / 3, rel=1e-4)
    assert got["cov_from_negative_adv"] == pytest.approx(0.71111 * a / 3, rel=1e-4)


def test_paired_differences_by_seed():
    """b - a on the seeds both have (0 and 1; b's seed 2 has no partner)."""
    figs = {
        "a": [{"seed": 0, "pass@1": 0.5, "pass@64": 0.7}, {"seed": 1, "pass@1": 0.6}],
        "b": [
            {"seed": 0, "pass@1": 0.55, "pass@64": 0.8},
            {"seed": 1, "pass@1": 0.6, "pass@64": 0.9},
            {"seed": 2, "pass@1": 0.9},
        ],
        "c": [{"seed": s, "pass@1": 0.5 + 0.1 * s + 0.2 + 0.01 * (-1) ** s} for s in (0, 1)],
    }
    md = aggregate.paired_table(figs)
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in md.splitlines()[2:]}
    # b: diffs 0.05, 0.0: mean 0.025, sd 0.035355, se 0.025, t(1) = 12.706205 -> 0.318
    assert [c.strip() for c in rows["b"]] == ["2", "+0.025 ± 0.318", "+0.100"]
    # c: diffs 0.21, 0.19: mean 0.2, se 0.01, half-width 0.127 < 0.2: raw p = 1 - 2/pi x
    # atan(20) = 0.0318 < 0.05, but Holm over the two tested cells (b's p 0.5) gives 0.0637
    assert rows["c"][1].strip() == "+0.200 ± 0.127(*)"
    assert aggregate.paired_table({"a": figs["a"]}) == ""


def test_outcome_probe_refuses_a_run_of_another_sampling_setup(tmp_path):
    study = studies.get("a_grae_variants")
    config = studies.build_config(study, study.variant("grpo"), 0)
    run = studies.build_config(study, study.variant("grpo"), 0)
    run.objective.advantage_kwargs.group_level = "ass"  # not a sampling setting: accepted
    config_record.write(str(tmp_path), run)
    outcome_logp._check_same_setup(config, str(tmp_path))
    run.rollout.temperature = 1.0
    config_record.write(str(tmp_path), run)
    with pytest.raises(UserError, match="rollout.temperature"):
        outcome_logp._check_same_setup(config, str(tmp_path))
    with pytest.raises(UserError, match="no config.json"):
        outcome_logp._check_same_setup(config, str(tmp_path / "none"))


def test_readme_block_gets_the_headline_columns(tmp_path):
    runs = str(tmp_path / "runs")
    for seed in range(2):
        _fake_run(runs, "grpo", seed, final_counts=[2, 2, 2, 2, 2], grad_norms=[1.0] * 4)
    readme = tmp_path / "README.md"
    text = "# R\n\n<!-- results:smoke:begin -->\nold table\n<!-- results:smoke:end -->\ntail\n"
    readme.write_text(text)
    aggregate.aggregate("smoke", runs, str(tmp_path / "results"), readme=str(readme))
    got = readme.read_text()
    assert "old table" not in got and got.endswith("<!-- results:smoke:end -->\ntail\n")
    block = got.split("begin -->\n")[1].split("<!--")[0].splitlines()
    assert block[0] == (
        "| variant | seeds | steps | greedy acc | pass@1 | entropy | sampled tokens |"
    )  # not pass@4 (not a headline column), nor pass@16/64 (the fake runs have n = 4)
    assert block[3].startswith("| grpo | 2 | 4 | 0.500 ± 0.000 | 0.500 ± 0.000 |")
    readme.write_text("# R without markers\n")
    with pytest.raises(UserError, match="results:smoke:begin"):
        aggregate.aggregate("smoke", runs, str(tmp_path / "results"), readme=str(readme))


def test_pass1_at_equal_sampled_tokens():
    """Variant a spends 100 tokens a step, b 50: at b's budget (200) a is read at its step 2."""

    def run(per_step, evals):
        rows = [{"step": s, "response/sampled_tokens": per_step} for s in range(1, 5)]
        for s, v in evals.items():
            rows[s - 1][aggregate.PASS1] = v
        return {"config": {}, "rows": rows, "summary": {"heldout_pass@1_before": 0.3}}

    runs = {"a": [run(100.0, {2: 0.5, 4: 0.7})], "b": [run(50.0, {2: 0.4, 4: 0.6})]}
    assert aggregate.pass1_at_tokens(runs["a"][0], 300.0) == pytest.approx(0.6)
    assert aggregate.pass1_at_tokens(runs["a"][0], 100.0) == pytest.approx(0.4)  # (0, 0.3)
    assert aggregate.pass1_at_tokens(runs["b"][0], 201.0) is None  # past its last evaluation
    runs["b"].append(run(60.0, {2: 0.4, 4: 0.6}))  # 240 tokens: the budget stays 200
    figs = {
        "a": [{"sampled_tokens": 400.0}],
        "b": [{"sampled_tokens": 200.0}, {"sampled_tokens": 240.0}],
    }
    md = aggregate.equal_tokens_table(runs, figs)
    assert "| a | 1 | 2.00 | 0.500 |" in md  # one seed: no interval
    # b: 0.6 at 200 tokens, and 0.4 + 0.2 x (200 - 120) / 120 = 0.5333 (evaluations at 120
    # and 240 tokens) -> mean 0.5667, sd 0.0471, half-width 12.706205 x 0.0471 / sqrt(2) = 0.424
    assert "| b | 2 | 1.10 | 0.567 ± 0.424 |" in md
    # Equal mean budgets, seeds 20 % apart: no table (the spread is between variants).
    assert aggregate.equal_tokens_table(runs, {"a": figs["b"], "b": figs["b"]}) == ""
    assert "sampled tokens (mean) / 200 " in md


@pytest.mark.slow
def test_smoke_study_runs_resumes_and_aggregates(tmp_path):
    """The real thing: 2 variants x 1 seed x 1 step, 2 workers; a second invocation skips
    both; aggregation reads what the trainer and the worker wrote."""
    out = str(tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": USER_PATH, "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "experiments.run", "smoke", "--seeds", "1", "--steps", "1",
           "--smoke", "--workers", "2", "--out", out]  # fmt: skip
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    logs = {}
    for v in ("grpo", "dr_grpo"):
        wd = worker.workdir_of(out, "smoke", v, 0)
        assert worker.read_done(wd)["steps"] == 1
        pk = json.loads(pathlib.Path(wd, passk.PASSK_FILE).read_text())
        assert pk["n"] == studies.SMOKE_PASSK_SAMPLES and pk["problems"] == 16
        logs[wd] = os.path.getsize(os.path.join(wd, "worker.log"))
    second = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "2 runs, 2 done, 0 to run" in second.stdout
    assert {wd: os.path.getsize(os.path.join(wd, "worker.log")) for wd in logs} == logs
    res = aggregate.aggregate("smoke", out, str(tmp_path / "results"))
    md = pathlib.Path(res, "results.md").read_text()
    assert "| grpo | 1 | 1 |" in md and "| dr_grpo | 1 | 1 |" in md
    # The real runs' held-out set, rebuilt from their config.json, lines up with passk.json.
    by_ops = md.split("By difficulty")[1].splitlines()
    head = next(line for line in by_ops if line.startswith("| variant"))
    counts = [int(c.split("(")[1].rstrip(") ")) for c in head.split("|")[2:-1] if "pass@1," in c]
    assert sum(counts) == 16 and len(counts) > 1


@pytest.mark.slow
def test_tool_use_study_runs_episodes_and_gives_each_arm_its_base(tmp_path):
    """The multi-turn study end to end (1 step, smoke evaluations): the `tool` arm trains and
    is evaluated on calculator episodes, `no_tool` on single completions; their passk.json
    name different base setups, so the table has a base row per arm."""
    out = str(tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": USER_PATH, "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "experiments.run", "tool_use", "--seeds", "1", "--steps", "1",
           "--smoke", "--workers", "2", "--out", out]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    pks = {}
    for v in ("tool", "no_tool"):
        wd = worker.workdir_of(out, "tool_use", v, 0)
        pks[v] = json.loads(pathlib.Path(wd, passk.PASSK_FILE).read_text())
        assert pks[v]["n"] == studies.SMOKE_PASSK_SAMPLES and pks[v]["problems"] == 16
    assert pks["tool"]["base_setup"] != pks["no_tool"]["base_setup"]
    summary = json.loads(
        pathlib.Path(worker.workdir_of(out, "tool_use", "tool", 0), "summary.json").read_text()
    )
    assert any("tool_calls" in k for k in summary), sorted(summary)  # held-out episodes
    md = pathlib.Path(aggregate.aggregate("tool_use", out, str(tmp_path / "r")), "results.md")
    text = md.read_text()
    assert "| base policy (tool) |" in text and "| base policy (no_tool) |" in text


@pytest.mark.slow
def test_sigterm_to_the_runner_stops_its_workers_with_a_checkpoint(tmp_path):
    """`kill RUNNER` (a runner started by a script in the background, where Ctrl-C's SIGINT is
    ignored): it passes SIGTERM on, the worker's trainer saves a checkpoint at the end of its
    step and exits 143, no further run starts, and nothing is left running."""
    out = str(tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": USER_PATH, "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "experiments.run", "smoke", "--seeds", "2", "--steps", "500",
           "--smoke", "--workers", "1", "--variants", "grpo", "--out", out]  # fmt: skip
    runner = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wd = worker.workdir_of(out, "smoke", "grpo", 0)
    metrics = pathlib.Path(wd, "metrics.jsonl")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and runner.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert runner.poll() is None, "the runner ended before training"
        runner.send_signal(signal.SIGTERM)
        stdout, _ = runner.communicate(timeout=180)
    finally:
        runner.kill()
    assert runner.returncode == 1, stdout
    assert "grpo seed 0: stopped (checkpoint saved" in stdout, stdout
    assert not os.path.exists(worker.workdir_of(out, "smoke", "grpo", 1))  # never started
    assert worker.read_done(wd) is None
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert last < 500 and str(last) in os.listdir(os.path.join(wd, "checkpoints"))
    for pid in filter(str.isdigit, os.listdir("/proc")):  # the worker is gone too
        with contextlib.suppress(OSError):
            assert out not in pathlib.Path(f"/proc/{pid}/cmdline").read_text(), pid


def test_episode_table_by_hand():
    """Turns per episode as logged; tool calls, errors and truncations (the step's counts)
    per episode rolled out: P x G = 16 rows a step, 10 steps, first / last step = 10 %."""
    rows = [
        {"step": i + 1, "env/turns_per_episode": 1.0 + i / 10, "env/tool_calls": 8.0 * i,
         "env/tool_errors": 2.0, "env/truncated": 4.0, "env/episodes_done": 12.0}
        for i in range(10)
    ]  # fmt: skip
    run = {"rows": rows, "summary": {}, "passk": None}
    run["config"] = {"rollout": {"prompts_per_step": 2, "num_samples": 8}}
    f = aggregate.run_figures(run)
    assert f["env/tool_calls@start"] == 0.0 and f["env/tool_calls@end"] == 72 / 16
    assert f["env/turns_per_episode@end"] == 1.9 and f["env/truncated@end"] == 0.25
    md = aggregate.episode_table({"tool": [f], "no_tool": [{"seed": 0}]})
    assert "| tool | 1 -> 1.9 | 0 -> 4.5 | 0.125 -> 0.125 | 0.25 -> 0.25 |" in md
    assert "| no_tool | – | – | – | – |" in md
    assert aggregate.episode_table({"grpo": [{"seed": 0}]}) == ""


def test_base_setup_is_the_same_across_seeds_and_anchors_and_differs_with_tools():
    """passk.json's base setup: the seed (samples, data shuffle) and a demonstration column
    the held-out prompts do not read leave it; offering tools changes it."""
    setup = lambda study, v, seed: passk.base_setup(
        studies.build_config(studies.get(study), studies.get(study).variant(v), seed)
    )
    assert setup("dagrpo", "delta_3", 0) == setup("dagrpo", "delta_3", 3)
    assert setup("dagrpo", "delta_3", 0) == setup("dagrpo", "no_anchors", 1)
    assert setup("tool_use", "tool", 0) == setup("tool_use", "tool", 2)
    assert setup("tool_use", "tool", 0) != setup("tool_use", "no_tool", 0)
