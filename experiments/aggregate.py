"""Aggregates a study's runs into a table and figures: mean and 95 % confidence interval
over seeds (Student t, n - 1 degrees of freedom) per variant.

    python -m experiments.aggregate STUDY [--runs experiments/runs] [--out experiments/results]
        [--readme README.md]

Reads each run's metrics.jsonl, summary.json and passk.json (OUT of `experiments.run`) and
writes RESULTS/STUDY/: results.md (the table), runs.json (every run's final figures),
curves.png (held-out pass@1, entropy, response length, grad norm and the training reward over
steps), passk.png (pass@k against k, final and base policy) and pass1_vs_tokens.png (held-out
pass@1 against the sampled completion tokens: see `sampled_tokens`).

    python -m experiments.aggregate STUDY --from_results experiments/results/STUDY

re-renders results.md from the committed runs.json alone (the run directories are not
committed): every table but the equal-cost one, which is kept from the old results.md.

    python -m experiments.aggregate STUDY --from_results experiments/results/STUDY --add \
        --runs RUNS

adds the runs RUNS holds (arms run after the others, or later seeds of committed arms:
`experiments.run --first_seed`) to that runs.json first.

The paired table's statistics: per cell the paired t test's p, Holm-adjusted over the study's
paired cells (a verdict is drawn from all of them); TOST equivalence against
`EQUIVALENCE_MARGINS`; and per variant the share of samples / tokens its declared
intervention acted on (`studies.Variant.acts`), "not exercised" under 5 %.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import numpy as np

from experiments import studies
from experiments.passk import PASSK_FILE, heldout_prompts
from gjax.errors import ConfigError, UserError, run_cli
from gjax.evaluation.metrics import pass_at_k
from gjax.metrics import read_jsonl
from gjax.plot import ema
from gjax.rewards.rule_judge import find_expression

TABLE_KS = (1, 4, 16, 64)
PASS1 = "eval/heldout_pass@1"
CURVES = (  # (metrics key, title, log axis, smoothed)
    (PASS1, "held-out pass@1", False, False),
    ("policy/entropy", "entropy (nats/token)", False, True),
    ("response/length_mean", "response length (tokens)", False, True),
    ("optim/grad_norm", "grad norm", True, True),
    ("reward/mean", "training reward (mean)", False, True),  # A-GRAE Fig. 5's learning speed
)
SMOOTH = 0.6  # EMA weight of the training curves (gjax.plot's default)
TAIL = 0.1  # "final" training figures: the mean over the last 10 % of steps
FORMATS = {"length": ".1f", "grad_spikes": ".1f", "sampled_tokens": ".3g", "clipped_pct": ".3g"}
CLIP_KEYS = ("policy/clip_frac_low", "policy/clip_frac_high", "policy/clip_frac_dual")
# CW-GRPO Table 1's form: percentiles of |Cov(log-prob, advantage)| per token (`cov/*`,
# `objective.covariance_metrics`), at the start and at the end of training.
COV_PERCENTILES = ("p50", "p90", "p99", "p99.9")
SPIKE_FACTOR = 3.0  # a grad-norm spike: a step above 3 x the run's median grad norm
_BY_OPS = re.compile(r"pass@(\d+)\|ops=(\d+)$")  # `difficulty_figures`' keys
EQUAL_TOKENS_SPREAD = 1.1  # variants whose sampled tokens differ more get an equal-cost table


# --------------------------------------------------------------------------- statistics


def t_cdf_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd
        acc, term = 0.0, 1.0
        for i in range(1, (df - 1) // 2 + 1):
            acc += term
            term *= c2 * (2 * i) / (2 * i + 1)
        return 2 / math.pi * (theta + (s * math.cos(theta) * acc if df > 1 else 0.0))
    acc, term = 0.0, 1.0
    for i in range(1, df // 2 + 1):
        acc += term
        term *= c2 * (2 * i - 1) / (2 * i)
    return s * acc


def t_quantile(df: int, confidence: float = 0.95) -> float:
    """t such that P(|T| < t) = confidence (bisection; exact to ~1e-12)."""
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, df) < confidence:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_two_sided(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values, confidence: float = 0.95) -> tuple[float, float, int]:
    """(mean, half-width of the two-sided t interval, n); half-width is nan for n < 2."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], float)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, 0
    if n == 1:
        return float(x[0]), math.nan, 1
    se = x.std(ddof=1) / math.sqrt(n)
    return float(x.mean()), float(t_quantile(n - 1, confidence) * se), n


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with integer df (one-sided; from `t_cdf_two_sided`)."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    upper = (1.0 - t_cdf_two_sided(abs(t), df)) / 2
    return upper if t >= 0 else 1.0 - upper


def paired_t(diffs) -> dict[str, float]:
    """The paired t test of per-seed differences against 0: {"mean", "half" (95 % t
    half-width), "n", "se", "p" (two-sided)}; se, half and p are nan for n < 2. Zero spread:
    p = 1 for a zero mean, 0 otherwise (t is 0 / infinite)."""
    x = np.asarray([v for v in diffs if v is not None and np.isfinite(v)], float)
    n = len(x)
    out = {"mean": float(x.mean()) if n else math.nan, "n": n}
    out.update(se=math.nan, half=math.nan, p=math.nan)
    if n < 2:
        return out
    se = float(x.std(ddof=1) / math.sqrt(n))
    out.update(se=se, half=t_quantile(n - 1) * se)
    if se == 0:
        out["p"] = 1.0 if out["mean"] == 0 else 0.0
    else:
        out["p"] = 1.0 - t_cdf_two_sided(abs(out["mean"]) / se, n - 1)
    return out


def holm(p_values) -> np.ndarray:
    """Holm-Bonferroni step-down adjusted p-values (Holm 1979), in the input's order: the
    i-th smallest of m p-values becomes max over j <= i of min(1, (m - j + 1) p_(j)); reject
    where the adjusted p < alpha controls the family-wise error at alpha. nan entries (cells
    with no test) stay nan and do not count in m."""
    p = np.asarray(p_values, float)
    out = np.full(p.shape, math.nan)
    idx = np.flatnonzero(~np.isnan(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return out


def tost(mean: float, se: float, n: int, margin: float) -> dict[str, float]:
    """Two one-sided t tests (Schuirmann 1987) that a paired mean difference lies within
    (-margin, +margin): p = max(P(T > (mean + margin) / se), P(T < (mean - margin) / se))
    with n - 1 df; equivalence at 5 % iff the 90 % t interval {"lo", "hi"} lies inside the
    margin. nan for n < 2."""
    if n < 2 or math.isnan(se):
        return {"p": math.nan, "lo": math.nan, "hi": math.nan}
    df, half = n - 1, t_quantile(n - 1, 0.90) * se
    if se == 0:
        p = 0.0 if abs(mean) < margin else 1.0
    else:
        p = max(t_sf((mean + margin) / se, df), t_sf((margin - mean) / se, df))
    return {"p": p, "lo": mean - half, "hi": mean + half}


def fmt_p(p: float) -> str:
    if math.isnan(p):
        return "–"
    return "< 0.0001" if p < 1e-4 else f"{p:.4f}"


def fmt_ci(mean: float, half: float, fmt: str = ".3f") -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:{fmt}}" if math.isnan(half) else f"{mean:{fmt}} ± {half:{fmt}}"


# --------------------------------------------------------------------------- runs


def load_runs(runs_dir: str, study, *, finished_only: bool = False) -> dict[str, list[dict]]:
    """{variant: [run, ...]} in the study's variant order; a run: its rows, summary, passk,
    config; only seeds with metrics (`finished_only`: only runs the worker finished, its
    done.json written)."""
    from experiments.worker import read_done  # (gjax.train with it: only where it is used)

    out = {}
    for v in study.variants:
        vdir = os.path.join(runs_dir, study.name, v.name)
        seeds = sorted(
            (d for d in os.listdir(vdir) if d.startswith("seed_")) if os.path.isdir(vdir) else [],
            key=lambda d: int(d.removeprefix("seed_")),
        )
        runs = []
        for d in seeds:
            wd = os.path.join(vdir, d)
            if finished_only and read_done(wd) is None:
                continue
            rows = read_jsonl(os.path.join(wd, "metrics.jsonl"))
            if rows:
                runs.append(
                    {
                        "seed": int(d.removeprefix("seed_")),
                        "workdir": wd,
                        "rows": rows,
                        "summary": _json(os.path.join(wd, "summary.json")) or {},
                        "passk": _json(os.path.join(wd, PASSK_FILE)),
                        "config": _json(os.path.join(wd, "config.json")) or {},
                    }
                )
        if runs:
            out[v.name] = runs
    if not out:
        raise UserError(
            f"no runs of study {study.name!r} under {runs_dir}/{study.name}: run "
            f"`python -m experiments.run {study.name}` first (or give --runs)"
        )
    return out


def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sampled_tokens(run: dict) -> np.ndarray:
    """Cumulative completion tokens sampled by the end of each step (steps 1..N): the logged
    `response/sampled_tokens` (every round's), else estimated as rollout rounds x P x G x that
    step's mean response length (the length is the last round's; anchors counted as sampled)."""
    r = run["config"].get("rollout", {})
    per_round = r.get("prompts_per_step", 1) * r.get("num_samples", 1)
    tok = [
        row["response/sampled_tokens"]
        if row.get("response/sampled_tokens") is not None
        else row.get("sampling/rollouts", 1) * per_round * (row.get("response/length_mean") or 0.0)
        for row in run["rows"]
    ]
    return np.cumsum(tok)


def pass1_points(run: dict) -> list[tuple[int, float]]:
    """(step, held-out pass@1): the evaluations during training, the summary's before (step
    0) and after (the last step)."""
    pts = {r["step"]: r[PASS1] for r in run["rows"] if r.get(PASS1) is not None}
    s = run["summary"]
    if s.get("heldout_pass@1_before") is not None:
        pts.setdefault(0, s["heldout_pass@1_before"])
    if s.get("heldout_pass@1_after") is not None:
        pts.setdefault(
            s.get("steps", max(r["step"] for r in run["rows"])), s["heldout_pass@1_after"]
        )
    return sorted(pts.items())


def pass1_vs_tokens(run: dict) -> tuple[np.ndarray, np.ndarray]:
    """(completion tokens sampled by each evaluation, its held-out pass@1): `pass1_points`
    on the token axis (`pass1_vs_tokens.png`, the equal-cost table)."""
    tokens = np.concatenate([[0.0], sampled_tokens(run)])
    pts = [(tokens[min(s, len(tokens) - 1)], v) for s, v in pass1_points(run)]
    x, y = zip(*pts) if pts else ((), ())
    return np.asarray(x, float), np.asarray(y, float)


def pass1_at_tokens(run: dict, budget: float) -> float | None:
    """Held-out pass@1 when the run had sampled `budget` completion tokens: linear between the
    evaluations around it (None past the run's last evaluation)."""
    x, y = pass1_vs_tokens(run)
    if not len(x) or budget > x[-1]:
        return None
    return float(np.interp(budget, x, y))


def equal_tokens_table(runs: dict[str, list[dict]], figs: dict[str, list[dict]]) -> str:
    """Held-out pass@1 of every variant at the budget every run reached (the fewest tokens
    any run sampled, so every finished seed counts; `seeds` says how many did: a run that
    stopped before its summary may end its evaluations short of it): a comparison at equal
    cost; "" when the variants' mean budgets are within 10 % of each other (the final pass@1
    already compares them)."""
    spent = {name: np.mean([f["sampled_tokens"] for f in figs[name]]) for name in runs}
    if max(spent.values()) < EQUAL_TOKENS_SPREAD * min(spent.values()):
        return ""
    budget = min(f["sampled_tokens"] for name in runs for f in figs[name])
    lines = [
        f"| variant | seeds | sampled tokens (mean) / {budget:.3g} "
        f"| held-out pass@1 at {budget:.3g} tokens |",
        "| --- | --- | --- | --- |",
    ]
    for name, rs in runs.items():
        m, h, n = mean_ci([pass1_at_tokens(r, budget) for r in rs])
        lines.append(f"| {name} | {n} | {spent[name] / budget:.2f} | {fmt_ci(m, h)} |")
    return "\n".join(lines) + "\n"


def run_figures(run: dict) -> dict[str, float]:
    """One run's final figures: the table's columns."""
    rows, s, pk = run["rows"], run["summary"], run["passk"]
    tail = rows[-max(1, round(len(rows) * TAIL)) :]
    out = {
        "greedy_before": s.get("heldout_accuracy_before"),
        "greedy_after": s.get("heldout_accuracy_after"),
        "steps": rows[-1]["step"],
    }
    if pk is not None:
        for k in range(1, pk["n"] + 1):
            out[f"pass@{k}"] = pk["final"][f"pass@{k}"]
            out[f"base_pass@{k}"] = pk["base"][f"pass@{k}"]
        out["base_setup"] = pk.get("base_setup")  # which base policy (None: runs before it)
    elif s.get("heldout_pass@1_after") is not None:  # no passk.json: the trainer's own
        out["pass@1"] = s["heldout_pass@1_after"]
    for key, name in (("policy/entropy", "entropy"), ("response/length_mean", "length")):
        vals = [r[key] for r in tail if r.get(key) is not None]
        out[name] = float(np.mean(vals)) if vals else None
    g = np.asarray([r["optim/grad_norm"] for r in rows if r.get("optim/grad_norm") is not None])
    out["grad_spikes"] = int(np.sum(g > SPIKE_FACTOR * np.median(g))) if len(g) else None
    out["sampled_tokens"] = float(sampled_tokens(run)[-1])
    # The share of loss tokens the objective's clip cut (PPO's, GSPO's sequence clip counted
    # per token, CISPO's weight clip), mean over steps, in %: 0 for every on-policy update.
    clipped = [sum(r.get(k, 0.0) for k in CLIP_KEYS) for r in rows if CLIP_KEYS[0] in r]
    out["clipped_pct"] = 100.0 * float(np.mean(clipped)) if clipped else None
    # A-GRAE App. D.3's collapse signature: training groups with no correct sample, and the
    # held-out pass@1's largest fall below its best so far (0 for a run that never falls).
    vals = [
        r["reward/all_unsolved_frac"] for r in tail if r.get("reward/all_unsolved_frac") is not None
    ]
    out["unsolved"] = float(np.mean(vals)) if vals else None
    pts = np.asarray([v for _, v in pass1_points(run)], float)
    out["pass1_drop"] = float(np.max(np.maximum.accumulate(pts) - pts)) if len(pts) else None
    for key in ("tw/cov_mean", "tw/cov_std", "adv/masked_fraction"):
        vals = [r[key] for r in tail if r.get(key) is not None]
        if vals:
            out[key] = float(np.mean(vals))
    head = rows[: len(tail)]
    for key in (*(f"cov/abs_{p}" for p in COV_PERCENTILES), *EPISODE_COLS):
        for when, part in (("start", head), ("end", tail)):
            vals = [_per_episode(r, key, run) for r in part if r.get(key) is not None]
            if vals:
                out[f"{key}@{when}"] = float(np.mean(vals))
    return out


def heldout_difficulty(config: dict) -> np.ndarray | None:
    """Each held-out problem's number of operations, in passk.json's order, for a run on the
    synthetic task (the held-out set rebuilt as the run built it: its data config, its
    tokenizer's prompt filter); None for any other data."""
    if config.get("data", {}).get("source") != "synthetic":
        return None
    import ml_collections

    from gjax.data.synthetic import solution_steps
    from gjax.embedded import resolve_model_path
    from gjax.models.hf_import import load_tokenizer

    c = ml_collections.ConfigDict(config)
    heldout = heldout_prompts(c, load_tokenizer(resolve_model_path(c.model.path)))
    return np.asarray([len(solution_steps(find_expression(q))) for q in heldout.problems])


def difficulty_figures(run: dict, ops_P: np.ndarray | None) -> dict[str, float]:
    """pass@1 and pass@n by the held-out problems' number of operations, final and base:
    {"pass@1|ops=2": ..., "base_pass@64|ops=2": ...}."""
    pk = run["passk"]
    if pk is None or ops_P is None or len(ops_P) != pk["problems"]:
        return {}
    n = pk["n"]
    out = {f"problems|ops={ops}": int(np.sum(ops_P == ops)) for ops in np.unique(ops_P)}
    for when, prefix in (("final", ""), ("base", "base_")):
        c_P = np.asarray(pk[when]["correct_counts"])
        for ops in np.unique(ops_P):
            for k in (1, n):
                est = [pass_at_k(n, int(c), k) for c in c_P[ops_P == ops]]
                out[f"{prefix}pass@{k}|ops={ops}"] = float(np.mean(est))
    return out


def base_groups(figures: dict[str, list[dict]]) -> list[tuple[str, list[dict]]]:
    """The base policies a study's arms sample, as (row label, the runs of the arms that
    sample it): one, "base policy", where the runs' passk.json name at most one base setup
    (`experiments.passk.base_setup`; runs from before it was recorded name none and join
    it) -- the usual case; else one per setup, "base policy (arm, ...)" (arms that prompt or
    roll out the base differently, e.g. with and without tools), where a run naming none (one
    still training) has no base to add."""
    every = [f for fs in figures.values() for f in fs]
    if len({f.get("base_setup") for f in every} - {None}) <= 1:
        return [("base policy", every)]
    groups: dict[str, tuple[list[str], list[dict]]] = {}
    for name, runs in figures.items():
        for f in runs:
            if f.get("base_setup") is None:
                continue
            names, members = groups.setdefault(f["base_setup"], ([], []))
            members.append(f)
            if name not in names:
                names.append(name)
    return [(f"base policy ({', '.join(names)})", members) for names, members in groups.values()]


def difficulty_table(figures: dict[str, list[dict]]) -> str:
    """pass@1 and pass@n per number of operations (columns, with the number of problems),
    base policy first; '' when no run has them."""
    every = [f for fs in figures.values() for f in fs]
    cols = sorted(  # (k, ops) of every "pass@K|ops=OPS" key
        {tuple(map(int, m.groups())) for f in every for key in f if (m := _BY_OPS.match(key))}
    )
    if not cols:
        return ""
    count = {ops: max(f.get(f"problems|ops={ops}", 0) for f in every) for _, ops in cols}
    head = ["variant", *(f"pass@{k}, {ops} ops ({count[ops]})" for k, ops in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    # The base policy's figures depend on the seed only: one per seed, as in `table`.
    k0, ops0 = cols[0]
    rows = []
    for label, runs in base_groups(figures):
        base = {f["seed"]: f for f in runs if f"base_pass@{k0}|ops={ops0}" in f}
        rows.append((label, list(base.values()), "base_"))
    rows += [(name, fs, "") for name, fs in figures.items()]
    for name, fs, prefix in rows:
        keys = [f"{prefix}pass@{k}|ops={ops}" for k, ops in cols]
        cells = [fmt_ci(*mean_ci([f.get(key) for f in fs])[:2]) for key in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- table


def table(study, figures: dict[str, list[dict]], *, only: tuple[str, ...] | None = None) -> str:
    """The markdown table: one row per variant (and the base policy), mean ± 95 % CI; `only`:
    these columns (keys of `run_figures`) of the full table, e.g. `HEADLINE_COLS`."""
    every = [f for runs in figures.values() for f in runs]
    ks = [k for k in TABLE_KS if any(f"pass@{k}" in f for f in every)]
    cols = [("greedy_after", "greedy acc")]
    cols += [(f"pass@{k}", f"pass@{k}") for k in ks]
    cols += [("entropy", "entropy"), ("length", "length"), ("grad_spikes", "gnorm spikes")]
    cols += (
        [("unsolved", "unsolved groups")]
        if any(f.get("unsolved") is not None for f in every)
        else []
    )
    cols += [("pass1_drop", "pass@1 drop")]
    cols += [("clipped_pct", "clipped %")] if any(f.get("clipped_pct") for f in every) else []
    cols += [(k, k) for k in ("tw/cov_mean", "adv/masked_fraction") if any(k in f for f in every)]
    cols += [("sampled_tokens", "sampled tokens")]
    if only is not None:
        cols = [c for c in cols if c[0] in only]
    head = ["variant", "seeds", "steps", *(title for _, title in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base = {"greedy_after": "greedy_before", **{f"pass@{k}": f"base_pass@{k}" for k in ks}}
    # The base policy's figures depend on the seed only: one value per seed, from any run of
    # it that has one (a run still training has none yet); one row per base the arms sample
    # (`base_groups`: the same, except where arms prompt it differently).
    for label, runs in base_groups(figures):
        per_seed = {
            src: {f["seed"]: f[src] for f in runs if f.get(src) is not None}
            for src in base.values()
        }
        base_vals = {col: mean_ci(per_seed[src].values()) for col, src in base.items()}
        if any(v[2] for v in base_vals.values()):
            cells = [label, str(max(v[2] for v in base_vals.values())), "0"]
            cells += [fmt_ci(*base_vals[c][:2]) if c in base_vals else "" for c, _ in cols]
            lines.append("| " + " | ".join(cells) + " |")
    for name, runs in figures.items():
        steps = sorted({f["steps"] for f in runs})
        cells = [name, str(len(runs)), "/".join(map(str, steps))]
        for col, _ in cols:
            m, h, _n = mean_ci([f.get(col) for f in runs])
            cells.append(fmt_ci(m, h, FORMATS.get(col, ".3f")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# The README's results table: a study's table with these columns (`--readme`).
HEADLINE_COLS = ("greedy_after", "pass@1", "pass@16", "pass@64", "entropy", "sampled_tokens")


def write_readme_block(path: str, study_name: str, block: str) -> None:
    """Replaces what lies between `<!-- results:STUDY:begin -->` and `<!-- results:STUDY:end
    -->` in the markdown file `path` with `block`."""
    begin, end = f"<!-- results:{study_name}:begin -->", f"<!-- results:{study_name}:end -->"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"cannot read {path} for --readme: {e.strerror}") from None
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise UserError(
            f"{path} has no single `{begin}` ... `{end}` block for --readme to fill: put "
            "the two markers, each on a line of its own, where the table belongs"
        )
    head, rest = text.split(begin)
    text = head + begin + "\n" + block + rest[rest.index(end) :]
    with open(path, "w") as f:
        f.write(text)


PAIRED_COLS = (("greedy_after", "greedy acc"), ("pass@1", "pass@1"), ("pass@4", "pass@4"),
               ("pass@64", "pass@64"), ("entropy", "entropy"))  # fmt: skip
# TOST margins per paired column: what "matches" / "equal" may hide. 0.02 absolute for the
# accuracies: 5 % of GRPO's final pass@1 (0.37-0.39), under the smallest paired effect a
# README reports as a finding (A-GRAE positive-dominant's pass@1 -0.028), and above the
# seed-to-seed sd of a paired difference in the committed studies (median over a study's arms:
# pass@1 and pass@4 0.002-0.007, 3-10x below the margin; greedy 0.008-0.016); a paired pass@64
# difference spreads 0.011-0.028 per seed (64 samples on 256 problems), so five seeds show
# pass@64 equivalence only for a mean difference near 0. Entropy: 0.01 nats/token, 10 % of
# GRPO's final 0.095-0.105 (paired sd 0.002-0.010).
EQUIVALENCE_MARGINS = {"greedy_after": 0.02, "pass@1": 0.02, "pass@4": 0.02, "pass@64": 0.02,
                       "entropy": 0.01}  # fmt: skip
ALPHA = 0.05
NOT_EXERCISED_PCT = 5.0  # an intervention that acted on fewer samples / tokens: not exercised


def _reference(study, names: list[str], name: str) -> str:
    """The variant `name` is paired against: its own `versus`, else the first variant."""
    if study is not None:
        try:
            return study.reference(name)
        except ConfigError:  # a variant the registry no longer has (a committed study's)
            pass
    return names[0]


def paired_cells(figures: dict[str, list[dict]], study=None) -> list[dict]:
    """Every (variant, column) cell of the paired table, each variant minus its reference
    (`studies.Study.reference`: the first variant, or its `versus`) seed by seed:
    `paired_t`'s figures, "holm" (Holm-adjusted over the study's cells that have a test: the
    family a verdict is drawn from), "tost" (against the column's `EQUIVALENCE_MARGINS`),
    "variant", "versus", "key", "title"."""
    names = list(figures)
    if len(names) < 2:
        return []
    first = {f["seed"]: f for f in figures[names[0]]}
    cols = [(k, t) for k, t in PAIRED_COLS if any(k in f for f in first.values())]
    cells = []
    for name in names[1:]:
        versus = _reference(study, names, name)
        if versus not in figures:
            continue  # its reference has no runs: nothing to pair with
        ref = {f["seed"]: f for f in figures[versus]}
        for key, title in cols:
            d = [
                f[key] - ref[f["seed"]][key]
                for f in figures[name]
                if f.get(key) is not None and ref.get(f["seed"], {}).get(key) is not None
            ]
            c = paired_t(d)
            c.update(variant=name, versus=versus, key=key, title=title)
            c["tost"] = tost(c["mean"], c["se"], c["n"], EQUIVALENCE_MARGINS[key])
            cells.append(c)
    for c, adj in zip(cells, holm([c["p"] for c in cells])):
        c["holm"] = float(adj)
    return cells


def _versus_column(cells: list[dict], first: str) -> bool:
    """Whether some variant is paired against another than the first (a "vs" column)."""
    return any(c["versus"] != first for c in cells)


def acted_share(study, name: str, runs: list[dict]) -> list[tuple[str, float, str]]:
    """(what, mean share in % over seeds, unit) of each intervention the variant declares
    (`studies.Variant.acts`) that its runs recorded."""
    try:
        acts = study.variant(name).acts
    except ConfigError:  # a variant the registry no longer has (a committed study's)
        return []
    out = []
    for what, key in acts:
        unit, scale = studies.SHARES[key]
        vals = [f[key] * scale for f in runs if f.get(key) is not None]
        if vals:
            out.append((what, float(np.mean(vals)), unit))
    return out


def fmt_acted(shares: list[tuple[str, float, str]]) -> str:
    return "; ".join(
        f"{what}: {pct:.3g} % of {unit}" + (" (not exercised)" if pct < NOT_EXERCISED_PCT else "")
        for what, pct, unit in shares
    )


def paired_table(figures: dict[str, list[dict]], study=None) -> str:
    """Each variant minus the first (the study's baseline), seed by seed: a seed fixes the data
    order and the sampling keys, so runs of one seed share their first rollouts and differ only
    by the variant. Mean difference ± 95 % t half-width over the seeds both have; * where the
    Holm-adjusted p < 0.05 over the study's cells, (*) where only the raw p is, = where TOST
    shows equivalence within the column's margin; with `study`, a last column "acted on":
    the share of samples / tokens each declared intervention touched. '' when nothing pairs."""
    cells = paired_cells(figures, study)
    if not cells:
        return ""
    first = next(iter(figures))
    cols = list(dict.fromkeys((c["key"], c["title"]) for c in cells))
    acted = {n: acted_share(study, n, figures[n]) for n in figures} if study else {}
    with_acted = any(acted.values())
    vs = _versus_column(cells, first)
    head = ["variant", *(["vs"] if vs else []), "seeds", *(t for _, t in cols),
            *(["acted on"] if with_acted else [])]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in dict.fromkeys(c["variant"] for c in cells):
        row = [c for c in cells if c["variant"] == name]
        ref = {f["seed"] for f in figures[row[0]["versus"]]}
        seeds = {f["seed"] for f in figures[name] if f["seed"] in ref}
        out = [fmt_paired(c) + paired_mark(c) for c in row]
        if with_acted:
            out.append(fmt_acted(acted[name]) or "–")
        lead = [name, *([row[0]["versus"]] if vs else []), str(len(seeds))]
        lines.append("| " + " | ".join(lead + out) + " |")
    return "\n".join(lines) + "\n"


def fmt_paired(c: dict) -> str:
    if c["n"] == 0:
        return "–"
    return f"{c['mean']:+.3f}" if c["n"] == 1 else f"{c['mean']:+.3f} ± {c['half']:.3f}"


def paired_mark(c: dict) -> str:
    mark = "*" if c["holm"] < ALPHA else "(*)" if c["p"] < ALPHA else ""
    return mark + ("=" if c["tost"]["p"] < ALPHA else "")


def paired_reading(c: dict) -> str:
    """One cell's verdict: a difference that survives Holm, one that only the raw p shows, an
    equivalence within the margin (TOST), or neither."""
    if c["n"] < 2:
        return "no test (one seed)"
    margin = EQUIVALENCE_MARGINS[c["key"]]
    within = c["tost"]["p"] < ALPHA
    if c["holm"] < ALPHA:
        return f"differs, by less than ± {margin:g}" if within else "differs"
    if c["p"] < ALPHA:
        note = "raw p only, not after Holm"
        return f"equivalent within ± {margin:g} ({note})" if within else f"inconclusive ({note})"
    return f"equivalent within ± {margin:g}" if within else "inconclusive"


def paired_tests_table(figures: dict[str, list[dict]], study=None) -> str:
    """Every cell of the paired table in full: the difference and its 95 % interval, the raw
    and the Holm-adjusted two-sided p, the 90 % interval and the TOST p against the margin,
    and the reading (`paired_reading`)."""
    cells = paired_cells(figures, study)
    if not cells:
        return ""
    vs = _versus_column(cells, next(iter(figures)))
    head = ["variant", *(["vs"] if vs else []), "metric", "seeds", "difference ± 95 %", "p",
            "Holm p", "90 % interval", "margin", "TOST p", "reading"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in cells:
        t = c["tost"]
        ci = "–" if math.isnan(t["lo"]) else f"[{t['lo']:+.3f}, {t['hi']:+.3f}]"
        row = [c["variant"], *([c["versus"]] if vs else []), c["title"], str(c["n"]),
               fmt_paired(c), fmt_p(c["p"]),
               fmt_p(c["holm"]), ci, f"± {EQUIVALENCE_MARGINS[c['key']]:g}", fmt_p(t["p"]),
               paired_reading(c)]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _per_episode(row: dict, key: str, run: dict) -> float:
    """A step's figure; the episode counts of `EPISODE_COUNTS` per episode rolled out. They
    are sums over the P x G episodes of the step's last rollout round (a step's rounds add up
    their time and sampled tokens only, gjax.rollout.collect), those a limit cut included."""
    if key not in EPISODE_COUNTS:
        return row[key]
    r = run["config"].get("rollout", {})
    return row[key] / (r.get("prompts_per_step", 1) * r.get("num_samples", 1))


# A multi-turn run's training episodes: gjax.rollout.episodes logs turns per episode and, of
# the rest, the step's counts (`EPISODE_COUNTS`, divided by the step's episodes).
EPISODE_COUNTS = ("env/tool_calls", "env/tool_errors", "env/truncated")
EPISODE_COLS = {
    "env/turns_per_episode": "turns",
    "env/tool_calls": "tool calls",
    "env/tool_errors": "tool errors",
    "env/truncated": "truncated",
}


def start_to_end(runs: list[dict], key: str) -> str:
    """ "start -> end ± half-width" of a figure's `key@start` / `key@end` means over the runs
    (seeds); "–" where no run has an end."""
    start, _, _ = mean_ci([f.get(f"{key}@start") for f in runs])
    end, half, _ = mean_ci([f.get(f"{key}@end") for f in runs])
    if math.isnan(end):
        return "–"
    return f"{fmt_ci(start, math.nan, '.3g')} -> {fmt_ci(end, half, '.3g')}"


def episode_table(figures: dict[str, list[dict]]) -> str:
    """Per variant, each training-episode figure (`EPISODE_COLS`, per episode) at the start
    -> at the end of training (means over the first / last 10 % of steps, then ± over seeds);
    "" when no run trained on episodes."""
    every = [f for runs in figures.values() for f in runs]
    if not any(f"{key}@end" in f for f in every for key in EPISODE_COLS):
        return ""
    head = ["variant", *EPISODE_COLS.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, runs in figures.items():
        cells = [name]
        cells += [start_to_end(runs, key) for key in EPISODE_COLS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cov_table(figures: dict[str, list[dict]]) -> str:
    """CW-GRPO Table 1's form: per variant, each |covariance| percentile at the start -> at
    the end of training (means over the first / last 10 % of steps, then over seeds), and the
    tail-to-bulk ratio p99.9 / p50 at the end; "" when no run logged `cov/*`."""
    every = [f for runs in figures.values() for f in runs]
    if not any(f"cov/abs_{COV_PERCENTILES[0]}@end" in f for f in every):
        return ""
    head = ["variant", *(f"abs cov {p}" for p in COV_PERCENTILES), "p99.9 / p50 at the end"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, runs in figures.items():
        cells = [name]
        cells += [start_to_end(runs, f"cov/abs_{p}") for p in COV_PERCENTILES]
        ratio = [
            f[f"cov/abs_{COV_PERCENTILES[-1]}@end"] / f[f"cov/abs_{COV_PERCENTILES[0]}@end"]
            for f in runs
            if f.get(f"cov/abs_{COV_PERCENTILES[0]}@end")
        ]
        cells.append(fmt_ci(*mean_ci(ratio)[:2], ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- figures


def band(series: list[tuple[np.ndarray, np.ndarray]]):
    """Mean and 95 % half-width over runs at the x values all runs share."""
    common = sorted(set.intersection(*(set(x.tolist()) for x, _ in series)))
    if not common:
        return None
    ys = np.stack([np.interp(common, x, y) for x, y in series])
    stats = [mean_ci(ys[:, i]) for i in range(len(common))]
    mean = np.asarray([m for m, _, _ in stats])
    half = np.nan_to_num(np.asarray([h for _, h, _ in stats]))
    return np.asarray(common), mean, half


def _plot_band(ax, x, mean, half, color, label, style="-"):
    ax.plot(x, mean, style, color=color, label=label, markersize=3)
    ax.fill_between(x, mean - half, mean + half, color=color, alpha=0.2, linewidth=0)


def figures(runs: dict[str, list[dict]], out_dir: str) -> list[str]:
    import matplotlib  # on use: a slow import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred with matplotlib

    written = []
    ncols = 3
    nrows = -(-len(CURVES) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(CURVES) :]:
        ax.set_visible(False)
    for ax, (key, title, log_axis, smooth) in zip(axes.flat, CURVES):
        for i, (name, rs) in enumerate(runs.items()):
            series = []
            for r in rs:
                pts = pass1_points(r) if key == PASS1 else [
                    (row["step"], row[key]) for row in r["rows"] if row.get(key) is not None
                ]  # fmt: skip
                if pts:
                    x, y = map(np.asarray, zip(*pts))
                    series.append((x, ema(y.astype(float), SMOOTH) if smooth else y))
            b = band(series) if series else None
            if b is not None:
                _plot_band(ax, *b, f"C{i}", name, "o-" if key == PASS1 else "-")
        ax.set_title(title)
        ax.set_xlabel("step")
        if log_axis:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    _legend(axes[0][0])
    fig.tight_layout()
    written.append(_save(fig, plt, os.path.join(out_dir, "curves.png")))

    fig, ax = plt.subplots(figsize=(5.5, 4))
    every = [r["passk"] for rs in runs.values() for r in rs if r["passk"] is not None]
    n = min((p["n"] for p in every), default=1)
    ks = np.arange(1, n + 1)
    for i, (name, rs) in enumerate(runs.items()):
        final = [[r["passk"]["final"][f"pass@{k}"] for k in ks] for r in rs if r["passk"]]
        if final:
            _plot_band(ax, *band([(ks, np.asarray(y)) for y in final]), f"C{i}", name)
    by_arm = {
        name: [
            {"seed": r["passk"]["seed"], "base_setup": r["passk"].get("base_setup"),
             "pk": r["passk"]}
            for r in rs if r["passk"] is not None
        ]
        for name, rs in runs.items()
    }  # fmt: skip
    styles = ("--", ":", "-.")
    for j, (label, members) in enumerate(base_groups(by_arm)):
        base = {m["seed"]: [m["pk"]["base"][f"pass@{k}"] for k in ks] for m in members}
        if base:  # one per seed
            series = [(ks, np.asarray(y)) for y in base.values()]
            name = "base" + label.removeprefix("base policy")
            _plot_band(ax, *band(series), "k", name, styles[j % len(styles)])
    ax.set_xscale("log", base=2)
    ticks = [k for k in ks if k & (k - 1) == 0]
    ax.set_xticks(ticks, [str(k) for k in ticks])
    ax.set_xlabel("k")
    ax.set_title("held-out pass@k at the end")
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    written.append(_save(fig, plt, os.path.join(out_dir, "passk.png")))

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, (name, rs) in enumerate(runs.items()):
        series = [xy for xy in map(pass1_vs_tokens, rs) if len(xy[0])]
        if not series:
            continue
        grid = np.linspace(0, min(x[-1] for x, _ in series), 40)
        b = band([(grid, np.interp(grid, x, y)) for x, y in series])
        if b is not None:
            _plot_band(ax, *b, f"C{i}", name)
    ax.set_xlabel("sampled completion tokens")
    ax.set_title("held-out pass@1 at equal sampled tokens")
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    written.append(_save(fig, plt, os.path.join(out_dir, "pass1_vs_tokens.png")))
    return written


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(fig, plt, path: str) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


EQUAL_COST_HEAD = "\nAt equal cost: "  # the equal-cost section's start in results.md


def aggregate(study_name: str, runs_dir: str, out_root: str, *, readme: str | None = None) -> str:
    """Writes RESULTS/STUDY/{results.md, runs.json, *.png}; returns that directory. `readme`:
    a markdown file whose `results:STUDY` block gets the table's `HEADLINE_COLS`."""
    study = studies.get(study_name)
    runs = load_runs(runs_dir, study)
    figs = runs_figures(runs)
    out_dir = os.path.join(out_root, study.name)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "runs.json"), "w") as f:
        json.dump(figs, f, indent=1)
    equal = equal_tokens_table(runs, figs)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(results_md(study, figs, equal_section=_equal_section(equal) if equal else ""))
    figures(runs, out_dir)
    if readme is not None:
        write_readme_block(readme, study.name, table(study, figs, only=HEADLINE_COLS))
    return out_dir


def runs_figures(runs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """runs.json's content: each run's final figures (`run_figures`, `difficulty_figures`)."""
    ops = {}  # the held-out set's difficulty per data config (one per study in practice)
    for r in (r for rs in runs.values() for r in rs):
        key = json.dumps([r["config"].get("data"), r["config"].get("model", {}).get("path")])
        if key not in ops:
            ops[key] = heldout_difficulty(r["config"])
        r["difficulty"] = ops[key]
    return {
        name: [
            {"seed": r["seed"], **run_figures(r), **difficulty_figures(r, r["difficulty"])}
            for r in rs
        ]
        for name, rs in runs.items()
    }


def rerender(
    study_name: str,
    results_dir: str,
    *,
    readme: str | None = None,
    add_runs: str | None = None,
    replace: bool = False,
) -> str:
    """Rewrites RESULTS_DIR/results.md from RESULTS_DIR/runs.json alone (the run directories
    not needed; runs.json and the figures stay as they are): every table but the equal-cost
    one, which needs each run's evaluations over steps (not in runs.json) and is carried over
    from the results.md there, if it has one. Returns RESULTS_DIR.

    `add_runs`: a runs dir holding runs made after the committed ones (new arms, or later
    seeds of committed arms), whose directories are gone: their finished runs' figures join
    those of runs.json (`join_runs`), written back, and every table (the paired tests and
    Holm's correction included) is drawn from the union; the figures (their curves are not
    in runs.json) and the equal-cost table stay as they were."""
    study = studies.get(study_name)
    path = os.path.join(results_dir, "runs.json")
    figs = _json(path)
    if not isinstance(figs, dict) or not figs:
        raise UserError(
            f"cannot re-render from {path}: no such file, or not the runs.json "
            "`python -m experiments.aggregate` writes (variant -> list of run figures); give "
            "--from_results a study's results directory, e.g. experiments/results/gpg"
        )
    unknown = [name for name in figs if name not in {v.name for v in study.variants}]
    if unknown:
        raise UserError(
            f"{path} has variants {', '.join(unknown)} that study {study.name!r} does not; "
            f"its variants: {', '.join(v.name for v in study.variants)}: name the study that "
            "wrote it"
        )
    if add_runs is not None:
        figs = join_runs(figs, runs_figures(load_runs(add_runs, study, finished_only=True)),
                         study, path=path, add_runs=add_runs, replace=replace)  # fmt: skip
        with open(path, "w") as f:
            json.dump(figs, f, indent=1)
    md_path = os.path.join(results_dir, "results.md")
    try:
        with open(md_path) as f:
            old = f.read()
    except OSError:
        old = ""
    equal = old[old.index(EQUAL_COST_HEAD) :] if EQUAL_COST_HEAD in old else ""
    with open(md_path, "w") as f:
        f.write(results_md(study, figs, equal_section=equal))
    if readme is not None:
        write_readme_block(readme, study.name, table(study, figs, only=HEADLINE_COLS))
    return results_dir


def join_runs(
    figs: dict[str, list[dict]],
    added: dict[str, list[dict]],
    study,
    *,
    path: str,
    add_runs: str,
    replace: bool,
) -> dict[str, list[dict]]:
    """runs.json's figures with `added`'s runs joined, per (variant, seed): in the study's
    variant order, each variant's runs by seed. A (variant, seed) both hold is refused (its
    committed run would be lost to whatever the runs dir holds), unless `replace`: then the
    runs dir's run of it replaces the committed one."""
    again = [
        f"{name} seed {r['seed']}"
        for name, rs in added.items()
        for r in rs
        if r["seed"] in {c["seed"] for c in figs.get(name, [])}
    ]
    if again and not replace:
        raise UserError(
            f"{path} has {', '.join(again)} already; {add_runs} holds runs of them too. "
            "Adding would replace those committed runs: pass --replace to do that, or move "
            "those runs out of the runs dir to add only the new ones."
        )
    out = {}
    for v in study.variants:
        by_seed = {r["seed"]: r for r in figs.get(v.name, [])}
        by_seed.update({r["seed"]: r for r in added.get(v.name, [])})
        if by_seed:
            out[v.name] = [by_seed[s] for s in sorted(by_seed)]
    return out


def _equal_section(equal: str) -> str:
    return (
        EQUAL_COST_HEAD + "held-out pass@1 (the training-time evaluations, "
        "`eval.num_samples` per problem) at the sampled-token budget every run "
        "reached, linear between evaluations.\n\n" + equal
    )


def results_md(study, figs: dict[str, list[dict]], *, equal_section: str = "") -> str:
    """results.md from the runs' figures (runs.json's content); `equal_section`: the
    equal-cost section, appended as given (it needs the runs' curves)."""
    docs = "\n".join(f"- `{v.name}`: {v.doc}" for v in study.variants if v.name in figs)
    md = (
        f"# {study.name}\n\nClaim: {study.claim}.\n\n{docs}\n\n"
        "Mean ± 95 % confidence half-width over seeds (Student t). pass@k: n samples per "
        "held-out problem at the end of training (the base policy: the same samples' seeds "
        "with the initial params); greedy acc: one greedy completion per problem; entropy, "
        f"length: mean over the last {TAIL:.0%} of steps; gnorm spikes: steps with a grad norm "
        f"above {SPIKE_FACTOR:g} x the run's median; unsolved groups: the share of training "
        f"groups with no correct sample, last {TAIL:.0%} of steps; pass@1 drop: the held-out "
        "pass@1's largest fall below its best so far during training; sampled tokens: "
        "`response/sampled_tokens` summed (runs before it: rounds x P x G x mean length).\n\n"
        + table(study, figs)
    )
    paired = paired_table(figs, study)
    if paired:
        cells = paired_cells(figs, study)
        raw = sum(c["p"] < ALPHA for c in cells)
        kept = sum(c["holm"] < ALPHA for c in cells)
        margins = ", ".join(
            f"{title} ± {EQUIVALENCE_MARGINS[key]:g}"
            for key, title in dict.fromkeys((c["key"], c["title"]) for c in cells)
        )
        md += (
            f"\nPaired by seed against `{next(iter(figs))}`"
            + (" or the arm in the vs column" if _versus_column(cells, next(iter(figs))) else "")
            + " (one seed: the same data order and first rollouts in every arm): the mean difference ± 95 % t half-width over the "
            "seeds both have. * where the difference survives Holm's correction over the "
            f"study's {len(cells)} paired cells (Holm-adjusted p < {ALPHA:g}: the chance of "
            "any false difference among them stays under 5 %), (*) where only the raw p is "
            f"under {ALPHA:g} (the interval excludes 0); = where two one-sided t tests (TOST, "
            f"5 %) show the difference within the margin ({margins}). {raw} of "
            f"{len(cells)} cells have a raw p < {ALPHA:g}, {kept} survive Holm."
        )
        if any(acted_share(study, n, figs[n]) for n in figs):
            md += (
                " Acted on: the share of samples or tokens the variant's own intervention "
                "touched (mean over seeds; a clip: `clipped %`, mean over steps; the masks: "
                f"`adv/masked_fraction`, last {TAIL:.0%} of steps); under "
                f"{NOT_EXERCISED_PCT:g} % it is not exercised, and a null result about it "
                "says nothing either way."
            )
        md += "\n\n" + paired
        md += (
            "\nEvery paired cell: the raw two-sided p of the paired t test, the Holm-adjusted "
            "p, the 90 % t interval of the difference and the TOST p against the margin "
            "(equivalence at 5 % iff the 90 % interval lies inside it).\n\n"
            + paired_tests_table(figs, study)
        )
    cov = cov_table(figs)
    if cov:
        md += (
            "\nCovariance of log-prob and advantage per token (CW-GRPO Table 1's form, "
            "`cov/*`): percentiles of its absolute value, the mean over the first 10 % of "
            "steps -> over the last 10 % (± over seeds).\n\n" + cov
        )
    episodes = episode_table(figs)
    if episodes:
        md += (
            "\nTraining episodes (multi-turn arms): per episode, the mean over the first 10 % "
            "of steps -> over the last 10 % (± over seeds); tool errors of every kind, "
            "truncated: the share of episodes a limit ended.\n\n" + episodes
        )
    by_ops = difficulty_table(figs)
    if by_ops:
        md += (
            "\nBy difficulty: held-out pass@k at the end of training over the problems with "
            "the same number of operations (the synthetic task's chain length; in brackets: "
            "how many held-out problems have it; the base policy's from its own samples), "
            "mean ± 95 % t half-width over seeds.\n\n" + by_ops
        )
    return md + equal_section


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m experiments.aggregate", description=__doc__.split("\n")[0]
    )
    p.add_argument("study", help=f"one of: {', '.join(studies.STUDIES)}")
    p.add_argument("--runs", default="experiments/runs", help="runs dir (default: %(default)s)")
    p.add_argument("--out", default="experiments/results", help="default: %(default)s")
    p.add_argument(
        "--readme",
        help="also fill this markdown file's <!-- results:STUDY:begin/end --> block with the "
        "table's headline columns (the README's Results section)",
    )
    p.add_argument(
        "--from_results",
        metavar="DIR",
        help="re-render DIR/results.md from DIR/runs.json alone (no run directories; the "
        "figures and runs.json stay; the equal-cost table is kept from the old results.md)",
    )
    p.add_argument(
        "--add",
        action="store_true",
        help="with --from_results: add the finished runs that --runs holds to DIR/runs.json "
        "(arms run after the others, or later seeds of its arms) and re-render from the union",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="with --add: runs (variant, seed) DIR/runs.json has already are replaced by "
        "--runs' runs of them",
    )
    args = p.parse_args(argv)
    if (args.add or args.replace) and args.from_results is None:
        p.error("--add needs --from_results DIR (the runs.json to add to)")
    if args.from_results is not None:
        add = args.runs if args.add else None
        kw = dict(readme=args.readme, add_runs=add, replace=args.replace)
        run_cli(lambda: print(rerender(args.study, args.from_results, **kw)))
    else:
        run_cli(lambda: print(aggregate(args.study, args.runs, args.out, readme=args.readme)))


if __name__ == "__main__":
    main()
