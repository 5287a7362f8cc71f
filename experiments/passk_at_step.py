"""pass@k of an earlier checkpoint of a study's finished runs, e.g. to ask whether one arm
ends where another was at that step.

    python -m experiments.passk_at_step STUDY VARIANT --step N [--seeds 5] [--out experiments/runs]

Writes each run's WORKDIR/passk_stepN.json (kept: a rerun reads it) and prints JSON: the mean ±
95 % t half-width over the seeds of pass@1/4/16/64.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments import aggregate, passk, studies
from experiments.worker import workdir_of
from gjax.errors import run_cli


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.passk_at_step", description=__doc__)
    p.add_argument("study")
    p.add_argument("variant")
    p.add_argument("--step", type=int, required=True, help="a checkpoint step of the runs")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--out", default="experiments/runs", help="the runs' root (experiments.run's)")
    args = p.parse_args(argv)
    study = studies.get(args.study)
    variant = study.variant(args.variant)
    got = []
    for seed in range(args.seeds):
        wd = workdir_of(args.out, args.study, args.variant, seed)
        res = passk.read_result(os.path.join(wd, passk.passk_file(args.step))) or passk.evaluate(
            studies.build_config(study, variant, seed),
            wd,
            num_samples=studies.passk_samples(False, study),
            cache_dir=os.path.join(args.out, "_base"),
            step=args.step,
        )
        got.append(res["final"])
    summary = {
        f"pass@{k}": aggregate.fmt_ci(*aggregate.mean_ci([g[f"pass@{k}"] for g in got])[:2])
        for k in aggregate.TABLE_KS
    }
    print(json.dumps({"study": args.study, "variant": args.variant, "step": args.step,
                      "seeds": len(got), **summary}))  # fmt: skip


if __name__ == "__main__":
    run_cli(main)
