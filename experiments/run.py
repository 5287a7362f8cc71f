"""Runs a study: every (variant, seed) in its own worker process, N at a time.

    python -m experiments.run STUDY [--workers 2] [--seeds 5] [--first_seed 0]
        [--out experiments/runs] [--steps N] [--eval_every N] [--variants a,b] [--smoke]

Each run trains in OUT/STUDY/VARIANT/seed_S (metrics.jsonl, summary.json, checkpoints),
then writes passk.json (held-out pass@k, k = 1..64, final vs base params) and done.json.
A run with done.json for the same steps is skipped; an unfinished one resumes from its last
checkpoint. Ctrl-C stops every worker at the end of its step, checkpoint saved; so does
SIGTERM to the runner (`kill PID`: it passes the signal on; a runner started in the background
by a script ignores Ctrl-C's SIGINT, as do its workers). Rerun the same command to go on.
Each worker's output is in its workdir's worker.log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

from experiments import studies
from experiments.worker import read_done, workdir_of
from gjax import compile_cache, config_record
from gjax.errors import ConfigError, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(
    study,
    seeds: int,
    *,
    out: str,
    steps: int | None,
    smoke: bool,
    variants=None,
    first_seed: int = 0,
):
    """(variant, seed, workdir, done) of every run, seeds first_seed..first_seed + seeds - 1
    (a study's later seeds, added to its committed runs.json with `aggregate --add`); done:
    finished for these settings.
    Raises ConfigError where OUT holds a run of one (variant, seed) trained (finished or
    checkpointed) with another config, in any field but `config_record.HARMLESS` (the study's
    definition changed since), or finished at another `train.max_sampled_tokens`: neither
    skipped as done nor overwritten. A workdir with neither
    starts afresh, as the trainer would."""
    chosen = [study.variant(v) for v in variants] if variants else list(study.variants)
    runs, stale = [], []
    # Seed-major: a study stopped part-way has every arm at the seeds it finished (pairs).
    for seed in range(first_seed, first_seed + seeds):
        for v in chosen:
            config = studies.build_config(study, v, seed, steps=steps, smoke=smoke)
            wd = workdir_of(out, study.name, v.name, seed)
            marker = read_done(wd)
            trained = marker is not None or _has_checkpoint(wd)
            if trained and (diff := config_record.training_changes(wd, config)):
                stale.append((wd, "; ".join(f"{p}: {a!r} -> {b!r}" for p, (a, b) in diff.items())))
            # A finished run's sampling budget (a resume may change it; a study's may not).
            budget = config.train.max_sampled_tokens
            if marker is not None and marker.get("max_sampled_tokens", 0) != budget:
                was = marker.get("max_sampled_tokens", 0)
                stale.append((wd, f"train.max_sampled_tokens: {was!r} -> {budget!r}"))
            done = (
                marker is not None
                and marker["steps"] == config.train.steps
                and (marker["passk_samples"] == studies.passk_samples(smoke, study))
            )
            runs.append((v.name, seed, wd, done))
    if stale:
        raise ConfigError(
            f"{len(stale)} run(s) under {out} were trained with another config than study "
            f"{study.name!r} now gives them ({stale[0][0]}: {stale[0][1]}): "
            f"{', '.join(os.path.relpath(wd, out) for wd, _ in stale)}. Move them away (or pass "
            "another --out) to rerun them with this config."
        )
    return runs


def _has_checkpoint(workdir: str) -> bool:
    """Whether the trainer saved a step there (it resumes from it; else it starts afresh)."""
    try:
        return any(n.isdigit() for n in os.listdir(os.path.join(workdir, "checkpoints")))
    except OSError:
        return False


def worker_command(study: str, variant: str, seed: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "experiments.worker", study, variant, str(seed)]
    cmd += ["--out", os.path.abspath(args.out)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.eval_every is not None:
        cmd += ["--eval_every", str(args.eval_every)]
    if args.smoke:
        cmd.append("--smoke")
    return cmd


def worker_env(environ, out: str) -> dict[str, str]:
    """The workers' environment: this one, with the project importable and, unless the caller
    chose its own, one persistent compilation cache under OUT shared by every worker. A run's
    programs are the same for each seed (and many across variants), so only the first run of
    a program compiles it: about 230 s of a 490 s `:headroom` run on this 2-core CPU. The
    cached executable is the one a compile would produce; the size limit turns on jax's file
    lock for workers that write at once."""
    env = {**environ, "PYTHONPATH": os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")])}
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # workers share an accelerator
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.path.abspath(out), ".jax_cache")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
    return env


def repair_cache(env) -> list[str]:
    """Removes the entries of the workers' compilation cache (`env`'s) that have a `-cache`
    file but no `-atime` file, and returns their names; only where the cache has a size limit
    (without one jax writes no atime files at all). jax's size limit scans every entry's
    atime before each write, and one missing atime file makes every later write in the
    directory fail (a warning only): each run then compiles everything again, 1.5-2x its
    time. Such an entry is left by a process killed between its two writes, or by one that
    shared the directory without a size limit. Holds jax's lock on the directory."""
    cache_dir = env.get("JAX_COMPILATION_CACHE_DIR")
    if not cache_dir or int(env.get("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")) <= 0:
        return []
    return compile_cache.repair(cache_dir)


def run_study(args) -> int:
    """Runs what is not done; returns the number of runs that failed."""
    study = studies.get(args.study)
    variants = args.variants.split(",") if args.variants else None
    runs = plan(
        study,
        args.seeds,
        out=args.out,
        steps=args.steps,
        smoke=args.smoke,
        variants=variants,
        first_seed=args.first_seed,
    )
    todo = [r for r in runs if not r[3]]
    print(f"{study.name}: {len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} to run "
          f"with {args.workers} workers", flush=True)  # fmt: skip
    env = worker_env(os.environ, args.out)
    if removed := repair_cache(env):
        print(f"compilation cache: removed {len(removed)} entries without an atime file (they "
              "would stop every later write to it)", flush=True)  # fmt: skip
    lock, finished, failed, live, stopping = threading.Lock(), [0], [], set(), threading.Event()

    def one(run) -> None:
        variant, seed, wd, _ = run
        if stopping.is_set():
            return
        os.makedirs(wd, exist_ok=True)
        t0 = time.time()
        with open(os.path.join(wd, "worker.log"), "a") as log:
            with lock:  # no worker starts after a stop (`stop` below holds the lock)
                if stopping.is_set():
                    return
                proc = subprocess.Popen(
                    worker_command(study.name, variant, seed, args),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env=env,
                )
                live.add(proc)
            code = proc.wait()
        with lock:
            live.discard(proc)
            finished[0] += 1
            if code == 0:
                status = "done"
            elif code in (130, 143):  # SIGINT / SIGTERM: the trainer saved a checkpoint
                status = "stopped (checkpoint saved; rerun to resume)"
            elif code in (-signal.SIGINT, -signal.SIGTERM):  # before training, or in pass@k
                status = "stopped (rerun to resume from its last checkpoint)"
            else:
                status = f"FAILED (exit {code}; see {wd}/worker.log)"
            if code != 0:
                failed.append(wd)
            print(f"[{finished[0]}/{len(todo)}] {variant} seed {seed}: {status} in "
                  f"{time.time() - t0:.0f} s", flush=True)  # fmt: skip

    def stop(signum, frame):  # SIGTERM (`kill PID`): the workers are told, unlike Ctrl-C's
        with lock:
            stopping.set()
            for proc in live:
                proc.send_signal(signal.SIGTERM)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.workers)
    try:
        for f in [pool.submit(one, r) for r in todo]:
            f.result()
    except KeyboardInterrupt:  # Ctrl-C reached the workers too: each saves a checkpoint
        stopping.set()
        # The workers were told once; a second `kill` must not make them exit unsaved (the
        # trainer's "again: at once"): ignored while they save (SIGKILL ends the runner).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pool.shutdown(wait=True, cancel_futures=True)
        print("interrupted: rerun the same command to resume", file=sys.stderr, flush=True)
        return len(todo)
    finally:
        signal.signal(signal.SIGTERM, previous)
    pool.shutdown()
    if failed:
        print(f"{len(failed)} runs failed: {', '.join(failed)}", file=sys.stderr, flush=True)
    return len(failed)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m experiments.run", description=__doc__.split("\n")[0]
    )
    p.add_argument("study", help=f"one of: {', '.join(studies.STUDIES)}")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (default: 2)")
    p.add_argument("--seeds", type=int, default=5, help="how many seeds (default: 5)")
    p.add_argument("--first_seed", type=int, default=0, help="seeds from this one (default: 0)")
    p.add_argument("--out", default="experiments/runs", help="runs dir (default: %(default)s)")
    p.add_argument("--steps", type=int, help="train.steps (default: each config's)")
    p.add_argument("--eval_every", type=int, help="held-out eval every N steps (default: steps/8)")
    p.add_argument("--variants", help="comma list: only these variants")
    p.add_argument("--smoke", action="store_true", help="tiny evaluations (CI's smoke test)")
    args = p.parse_args(argv)
    if args.workers < 1 or args.seeds < 1 or (args.steps is not None and args.steps < 1):
        p.error("--workers, --seeds and --steps must be >= 1")
    if args.first_seed < 0:
        p.error("--first_seed must be >= 0")
    run_cli(lambda: sys.exit(1 if run_study(args) else 0))


if __name__ == "__main__":
    main()
