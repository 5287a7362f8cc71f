"""One run of a study: trains (variant, seed) in its workdir, then evaluates held-out pass@k
against the base policy, then writes the DONE marker. `experiments.run` starts one worker
process per run; a rerun resumes from the workdir's checkpoint (gjax.train)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from experiments import passk, studies
from gjax import train as train_lib
from gjax.errors import run_cli

DONE_FILE = "done.json"


def workdir_of(out: str, study: str, variant: str, seed: int) -> str:
    return os.path.join(out, study, variant, f"seed_{seed}")


def read_done(workdir: str) -> dict | None:
    try:
        with open(os.path.join(workdir, DONE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_one(args) -> int:
    study = studies.get(args.study)
    variant = study.variant(args.variant)
    config = studies.build_config(
        study, variant, args.seed, steps=args.steps, eval_every=args.eval_every, smoke=args.smoke
    )
    workdir = workdir_of(args.out, study.name, variant.name, args.seed)
    t0 = time.time()
    signum = train_lib.train(config, workdir)
    if signum is not None:
        return 128 + signum  # stopped early, checkpoint saved: the next invocation resumes
    t_train = time.time() - t0
    n = studies.passk_samples(args.smoke, study)
    passk.evaluate(config, workdir, num_samples=n, cache_dir=os.path.join(args.out, "_base"))
    write_done(
        workdir,
        steps=config.train.steps,
        max_sampled_tokens=config.train.max_sampled_tokens,  # the budget it stopped at, if any
        passk_samples=n,
        train_s=round(t_train, 1),  # this invocation's (a resumed run: since the resume)
        passk_s=round(time.time() - t0 - t_train, 1),
    )
    return 0


def write_done(workdir: str, **marker) -> None:
    """The marker of a finished run (its steps and pass@k samples): the runner skips it."""
    with open(os.path.join(workdir, DONE_FILE), "w") as f:
        json.dump(marker, f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.worker", description=__doc__)
    p.add_argument("study")
    p.add_argument("variant")
    p.add_argument("seed", type=int)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int)
    p.add_argument("--eval_every", type=int)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("absl", "jax", "datasets", "orbax"):  # their INFO lines (as gjax.cli quiets)
        logging.getLogger(name).setLevel(logging.WARNING)
    run_cli(lambda: sys.exit(run_one(args)))


if __name__ == "__main__":
    main()
