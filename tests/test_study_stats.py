"""The studies' statistics (experiments/aggregate.py): Holm-adjusted p, TOST equivalence, the
"not exercised" share, and re-rendering results.md from a committed runs.json alone."""

from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np
import pytest

from experiments import aggregate, studies, worker
from gjax.errors import ConfigError, UserError

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results"


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 (m = 4): x 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; the
    # step-down keeps them monotone: the last becomes max(0.06, 0.04) = 0.06.
    got = aggregate.holm([0.01, 0.04, 0.03, 0.005])
    assert got == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1: 0.5 x 2 = 1.0, then max(1.0, 0.6 x 1) = 1.0
    assert aggregate.holm([0.6, 0.5]) == pytest.approx([1.0, 1.0])
    # cells without a test stay nan and do not count in m: m = 2
    got = aggregate.holm([0.01, math.nan, 0.04])
    assert got[[0, 2]] == pytest.approx([0.02, 0.04]) and math.isnan(got[1])
    assert aggregate.holm([]).shape == (0,)


def test_holm_is_monotone_capped_and_never_below_the_raw_p():
    p = np.random.default_rng(0).uniform(0, 0.2, size=50)
    adj = aggregate.holm(p)
    order = np.argsort(p)
    assert np.all(np.diff(adj[order]) >= 0)  # a smaller raw p never gets a larger adjusted p
    assert np.all(adj >= p) and np.all(adj <= 1.0)
    assert adj[order[0]] == pytest.approx(50 * p[order[0]])  # the smallest: Bonferroni's


def test_paired_t_and_one_sided_tail_by_hand():
    # d = 1, 2, 3: mean 2, sd 1, se 1/sqrt(3), t = 2 sqrt(3), df 2, where
    # P(|T| < t) = t / sqrt(t^2 + 2) (A&S 26.7.3): p = 1 - sqrt(12 / 14)
    got = aggregate.paired_t([1.0, 2.0, 3.0])
    assert got["p"] == pytest.approx(1 - math.sqrt(6 / 7), abs=1e-12)
    assert got["mean"] == 2.0 and got["n"] == 3
    assert got["se"] == pytest.approx(1 / math.sqrt(3))
    assert aggregate.t_sf(2 * math.sqrt(3), 2) == pytest.approx((1 - math.sqrt(6 / 7)) / 2)
    assert aggregate.t_sf(-2 * math.sqrt(3), 2) == pytest.approx((1 + math.sqrt(6 / 7)) / 2)
    assert aggregate.t_sf(0.0, 5) == pytest.approx(0.5)
    assert math.isnan(aggregate.paired_t([0.5])["p"])
    assert aggregate.paired_t([0.1, 0.1])["p"] == 0.0  # no spread, a non-zero mean
    assert aggregate.paired_t([0.0, 0.0])["p"] == 1.0


def test_tost_by_hand():
    # d = 0.004, 0.006, 0.008: mean 0.006, se 0.002 / sqrt(3), margin 0.02. The binding test
    # is the upper one: t = (0.02 - 0.006) / se = 7 sqrt(3), t^2 = 147, so
    # p = P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2 = (1 - sqrt(147 / 149)) / 2 (df 2).
    c = aggregate.paired_t([0.004, 0.006, 0.008])
    got = aggregate.tost(c["mean"], c["se"], c["n"], 0.02)
    assert got["p"] == pytest.approx((1 - math.sqrt(147 / 149)) / 2, rel=1e-9)
    # 90 % interval: t_0.90(2) solves t / sqrt(t^2 + 2) = 0.9: t = sqrt(1.62 / 0.19)
    half = math.sqrt(1.62 / 0.19) * 0.002 / math.sqrt(3)
    assert (got["lo"], got["hi"]) == pytest.approx((0.006 - half, 0.006 + half), abs=1e-9)
    # the same differences against a margin of 0.008: the interval (up to 0.00937) crosses it
    assert aggregate.tost(c["mean"], c["se"], c["n"], 0.008)["p"] > 0.05
    assert math.isnan(aggregate.tost(0.01, math.nan, 1, 0.02)["p"])


def _figs(ref, **variants):
    """{variant: [run figures]} from per-seed values of (pass@1, entropy)."""
    out = {"ref": [{"seed": s, "pass@1": p, "entropy": e} for s, (p, e) in enumerate(ref)]}
    for name, vals in variants.items():
        out[name] = [{"seed": s, "pass@1": p, "entropy": e} for s, (p, e) in enumerate(vals)]
    return out


def test_paired_cells_mark_holm_survivors_raw_only_and_equivalence():
    ref = [(0.30, 0.10), (0.31, 0.11), (0.32, 0.12), (0.30, 0.10)]
    figs = _figs(
        ref,
        big=[(p + d, e) for (p, e), d in zip(ref, (0.05, 0.051, 0.049, 0.05))],  # tiny spread
        small=[(p + d, e + 0.02) for (p, e), d in zip(ref, (0.001, 0.004, -0.001, 0.003))],
    )
    cells = {(c["variant"], c["key"]): c for c in aggregate.paired_cells(figs)}
    assert len(cells) == 4  # 2 variants x 2 columns the reference has: the Holm family
    big, small = cells["big", "pass@1"], cells["small", "pass@1"]
    # small's pass@1: d = 0.001, 0.004, -0.001, 0.003: mean 0.00175, sd 0.0022174,
    # se 0.0011087, t = 1.5784 (df 3): raw p ~0.21; within +-0.02 by TOST
    assert small["mean"] == pytest.approx(0.00175)
    assert 0.1 < small["p"] < 0.3 and small["tost"]["p"] < 0.05
    ps = [c["p"] for c in cells.values()]
    assert [cells[k]["holm"] for k in cells] == pytest.approx(list(aggregate.holm(ps)))
    assert big["holm"] < 0.05 and aggregate.paired_mark(big) == "*"
    assert aggregate.paired_mark(small) == "="
    assert aggregate.paired_reading(small) == "equivalent within ± 0.02"
    # entropy: big's differences are all 0 (p 1, equivalent), small's all +0.02: p 0,
    # exactly at the margin, so not within it
    assert (
        cells["big", "entropy"]["p"] == 1.0
        and aggregate.paired_mark(cells["big", "entropy"]) == "="
    )
    assert aggregate.paired_reading(cells["small", "entropy"]) == "differs"
    # A raw p under 0.05 that Holm does not keep: m = 2 tests of p 0.0318 (see
    # tests/test_experiments.py) and 0.5.
    c = {"n": 2, "p": 0.0318, "holm": 0.0636, "key": "pass@64", "tost": {"p": 0.9}}
    assert aggregate.paired_mark(c) == "(*)"
    assert aggregate.paired_reading(c) == "inconclusive (raw p only, not after Holm)"


def test_a_share_under_5_percent_is_not_exercised():
    study = studies.get("dagrpo")
    base = {"pass@1": 0.38, "entropy": 0.09}
    figs = {
        "dr_grpo": [{"seed": s, **base} for s in range(2)],
        "no_anchors": [
            {"seed": s, **base, "adv/masked_fraction": m} for s, m in enumerate((0.015, 0.019))
        ],  # fmt: skip
        "delta_5": [{"seed": s, **base, "adv/masked_fraction": 0.087} for s in range(2)],
    }
    md = aggregate.paired_table(figs, study)
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in md.splitlines()}
    assert rows["variant"] == "acted on"
    assert rows["no_anchors"] == "the masks: 1.7 % of samples (not exercised)"
    assert rows["delta_5"] == "the masks: 8.7 % of samples"
    # a study without declared interventions has no such column
    assert "acted on" not in aggregate.paired_table(figs, studies.get("gpg"))
    # DAPO's clip in all_algorithms: clipped_pct is in % already
    dapo = [{"seed": 0, "clipped_pct": 0.0122}]
    got = aggregate.acted_share(studies.get("all_algorithms"), "dapo", dapo)
    assert (
        aggregate.fmt_acted(got) == "the clip (eps_high 0.28): 0.0122 % of tokens (not exercised)"
    )


def test_an_intervention_measured_by_an_unrecorded_key_is_refused():
    with pytest.raises(ConfigError, match="adv/masked_fraction"):
        studies.Variant("v", "grpo", "doc", acts=(("the masks", "masked_share"),))


def test_rerender_from_runs_json_alone_keeps_the_equal_cost_section(tmp_path):
    figs = _figs(
        [(0.30, 0.10), (0.31, 0.11), (0.32, 0.12)],
        dr_grpo=[(0.35, 0.09), (0.37, 0.10), (0.36, 0.11)],
    )
    figs = {"grpo": figs["ref"], "dr_grpo": figs["dr_grpo"]}
    for runs in figs.values():
        for f in runs:
            f["steps"] = 4
    d = tmp_path / "smoke"
    d.mkdir()
    (d / "runs.json").write_text(json.dumps(figs))
    equal = "\nAt equal cost: from the run directories.\n\n| variant | x |\n| a | 1 |\n"
    (d / "results.md").write_text("# old\n\nold tables\n" + equal)
    before = (d / "runs.json").read_text()
    assert aggregate.rerender("smoke", str(d)) == str(d)
    md = (d / "results.md").read_text()
    assert "old tables" not in md and md.endswith(equal)
    assert (d / "runs.json").read_text() == before
    # dr_grpo - grpo: pass@1 0.05, 0.06, 0.04 -> mean 0.05, se 0.005774, x t(2) 4.302653 =
    # 0.025; entropy -0.01 in every seed (up to rounding): both cells differ
    assert "| dr_grpo | pass@1 | 3 | +0.050 ± 0.025 |" in md
    assert "2 of 2 cells have a raw p < 0.05, 2 survive Holm" in md
    # without a results.md there: no equal-cost section, the rest as before
    os.remove(d / "results.md")
    aggregate.rerender("smoke", str(d))
    assert "At equal cost" not in (d / "results.md").read_text()


def test_a_variant_pairs_against_its_versus_arm():
    """`Variant.versus`: DAPO's clip-higher alone is DAPO with it minus DAPO without, seed by
    seed; the others still pair against the first variant, and every cell is in one Holm
    family."""
    study = studies.Study(
        "s",
        "claim",
        (
            studies.Variant("grpo", "grpo", "doc"),
            studies.Variant("dapo", "dapo", "doc"),
            studies.Variant("dapo_sym", "dapo", "doc", versus="dapo"),
        ),
    )
    figs = _figs(
        [(0.30, 0.10), (0.31, 0.11), (0.32, 0.12)],
        dapo=[(0.40, 0.10), (0.41, 0.11), (0.42, 0.12)],
        dapo_sym=[(0.38, 0.10), (0.40, 0.11), (0.39, 0.12)],
    )
    figs = {"grpo": figs["ref"], "dapo": figs["dapo"], "dapo_sym": figs["dapo_sym"]}
    cells = {(c["variant"], c["key"]): c for c in aggregate.paired_cells(figs, study)}
    assert cells["dapo", "pass@1"]["versus"] == "grpo"
    assert cells["dapo", "pass@1"]["mean"] == pytest.approx(0.10)
    sym = cells["dapo_sym", "pass@1"]  # -0.02, -0.01, -0.03 against dapo
    assert sym["versus"] == "dapo" and sym["mean"] == pytest.approx(-0.02)
    assert len(cells) == 4
    md = aggregate.paired_table(figs, study)
    assert md.splitlines()[0].startswith("| variant | vs | seeds |")
    assert "| dapo_sym | dapo | 3 | -0.020 ± 0.025" in md
    assert "| dapo_sym | dapo | pass@1 | 3 |" in aggregate.paired_tests_table(figs, study)
    # without its reference's runs a variant has no paired cells
    del figs["dapo"]
    assert {c["variant"] for c in aggregate.paired_cells(figs, study)} == set()
    with pytest.raises(ConfigError, match="paired against 'dap'"):
        studies.Study("s", "c", (studies.Variant("a", "grpo", "d", versus="dap"),))
    with pytest.raises(ConfigError, match=r"\(a, b\) form a cycle"):
        studies.Study(
            "s",
            "c",
            (
                studies.Variant("grpo", "grpo", "d"),
                studies.Variant("a", "grpo", "d", versus="b"),
                studies.Variant("b", "grpo", "d", versus="a"),
            ),
        )


def test_arms_run_later_join_the_committed_runs_json(tmp_path):
    """`--add`: a study's runs.json holds grpo (its run directories gone); dr_grpo's finished
    runs, made later, join it in the study's order and the paired table covers them (an
    unfinished one stays out); adding them again is refused, and with `replace` replaces
    them instead of appending; later seeds of a committed arm join it in seed order."""
    from tests.test_experiments import _fake_run

    d = tmp_path / "results"
    d.mkdir()
    grpo = [{"seed": s, "pass@1": p, "steps": 6} for s, p in enumerate((0.30, 0.35, 0.40))]
    (d / "runs.json").write_text(json.dumps({"grpo": grpo}))
    runs = str(tmp_path / "runs")
    for seed in range(4):  # pass@1 1.0: every problem solved in all 4 samples
        _fake_run(runs, "dr_grpo", seed, final_counts=[4] * 5, grad_norms=[1.0] * 6)
        if seed < 3:  # seed 3 unfinished (no done.json): left out
            worker.write_done(worker.workdir_of(runs, "smoke", "dr_grpo", seed), steps=6)
    for again in (False, True):  # added, then replaced (refused without `replace`)
        if again:
            with pytest.raises(
                UserError, match="dr_grpo seed 0, dr_grpo seed 1, dr_grpo seed 2 al"
            ):
                aggregate.rerender("smoke", str(d), add_runs=runs)
        assert aggregate.rerender("smoke", str(d), add_runs=runs, replace=again) == str(d)
        got = json.loads((d / "runs.json").read_text())
        assert list(got) == ["grpo", "dr_grpo"] and got["grpo"] == grpo
        assert [r["seed"] for r in got["dr_grpo"]] == [0, 1, 2]
        assert [r["pass@1"] for r in got["dr_grpo"]] == [1.0, 1.0, 1.0]
    md = (d / "results.md").read_text()
    # dr_grpo - grpo: 0.70, 0.65, 0.60: mean 0.65, sd 0.05, se 0.028868, x t(2) = 0.124
    assert "| dr_grpo | pass@1 | 3 | +0.650 ± 0.124 |" in md
    with pytest.raises(SystemExit):  # --add without the runs.json to add to
        aggregate.main(["smoke", "--add", "--runs", runs])
    # Seeds 3 and 4 of grpo, run later (`experiments.run --first_seed 3`), join its 0-2.
    later = str(tmp_path / "later")
    for seed in (4, 3):
        _fake_run(later, "grpo", seed, final_counts=[0] * 5, grad_norms=[1.0] * 6)
        worker.write_done(worker.workdir_of(later, "smoke", "grpo", seed), steps=6)
    aggregate.rerender("smoke", str(d), add_runs=later)
    got = json.loads((d / "runs.json").read_text())
    assert [r["seed"] for r in got["grpo"]] == [0, 1, 2, 3, 4]
    assert got["grpo"][:3] == grpo and [r["pass@1"] for r in got["grpo"][3:]] == [0.0, 0.0]
    assert [r["seed"] for r in got["dr_grpo"]] == [0, 1, 2]


def test_rerender_refuses_a_missing_or_foreign_runs_json(tmp_path):
    with pytest.raises(UserError, match="cannot re-render"):
        aggregate.rerender("smoke", str(tmp_path))
    (tmp_path / "runs.json").write_text(json.dumps({"gspo": [{"seed": 0}]}))
    with pytest.raises(UserError, match="gspo"):
        aggregate.rerender("smoke", str(tmp_path))


@pytest.mark.parametrize(
    "study, cells, raw, kept",
    [
        ("cw_grpo_vs_grpo", 10, 4, 3),  # 5, 4, 3 before Clip-Cov joined
        ("dagrpo", 60, 35, 25),  # 45, 32, 27 before masks_delta_8 and the noisy judge (2026-12-03)
        ("gpg", 40, 11, 4),  # 25, 10, 4 before row A and its group sizes joined (2026-12-03)
        ("a_grae_variants", 40, 21, 6),
        # 45, 28, 20 before the matched-budget and issue 37 item 3's arms joined (2026-12-02)
        ("all_algorithms", 70, 35, 18),
        ("tool_use", 4, 4, 4),  # (4, 4, 4 at 3 seeds too)
        ("all_algorithms_lr", 45, 0, 0),  # one seed per arm: no paired test can pass
    ],
)
def test_the_committed_studies_holm_counts(study, cells, raw, kept):
    """Issue 37's recount of the committed runs.json: cells with a raw p < 0.05 and those that
    survive Holm per study."""
    figs = json.loads((RESULTS / study / "runs.json").read_text())
    got = aggregate.paired_cells(figs, studies.get(study))
    assert len(got) == cells
    assert sum(c["p"] < 0.05 for c in got) == raw
    assert sum(c["holm"] < 0.05 for c in got) == kept
    # a raw p < 0.05 is the 95 % interval excluding 0 (the old star)
    assert all((c["p"] < 0.05) == (abs(c["mean"]) > c["half"]) for c in got)
