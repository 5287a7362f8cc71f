"""Regenerates the README's results table: every `:tiny` config, trained as a user would.

    python scripts/readme_results.py [--configs grpo,a_grae,...] [--eval_every 40]
        [--root workdirs/readme_results] [--write [--readme README.md]] [--set FIELD=VALUE ...]

Runs `python -m gjax.train --config=configs/NAME.py:tiny --config.log.eval_every=40` for each
config, one after another in fresh workdirs under `--root`, then the README's own command as
written (`a_grae.py:tiny`, no intermediate evaluations; skip with `--no-readme_command`).
From each workdir it reads the held-out accuracy before and after training (`summary.json`)
and at the first intermediate evaluation (`eval/heldout_accuracy` in `metrics.jsonl`), and
times the whole command (start-up, compilation and evaluations included; each run with an
empty compilation cache of its own, `WORKDIR.cache`, as a first run has). It prints one JSON
line per run and a JSON summary last, and the markdown table, dated and naming the machine, on
stderr and in `ROOT/readme_block.md`. Only with `--write` does it also put that table between
the `<!-- readme_results:begin -->` and `<!-- readme_results:end -->` markers of `--readme`
(README.md by default); without it no file outside `--root` changes.

About 20 minutes on an idle 2-core CPU; wall times mean little on a loaded machine (the
summary records the load average at the start). `--set` passes a field override to every
run, e.g. `--set train.steps=4 --set data.heldout_size=16` for a quick check of the script.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README's order, and what each row's label says beyond the config's name.
CONFIGS = ("grpo", "a_grae", "dagrpo", "gpg", "dapo", "dr_grpo", "cw_grpo")
NOTES = {"dagrpo": "rule judge, 1 anchor per group", "dapo": "dynamic sampling"}
README_COMMAND = "a_grae"
WIDTH = 95  # the README's line width
BEGIN, END = "<!-- readme_results:begin -->", "<!-- readme_results:end -->"


def fail(message: str, status: int = 2) -> None:
    """A user error (status 2) or a failed run (1): one paragraph on stderr, no traceback."""
    print(f"readme_results: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "jax": importlib.metadata.version("jax"),
        "loadavg_1min_at_start": round(os.getloadavg()[0], 2),
    }


def fresh_workdir(path: str) -> None:
    """Remove a previous run of this script's (a gjax workdir) so timings include compilation
    and nothing resumes; refuse anything else."""
    if not os.path.exists(path):
        return
    if not os.path.exists(os.path.join(path, "config.json")):
        fail(f"{path} exists and is not a gjax workdir; choose another --root")
    shutil.rmtree(path)


def run_one(name: str, workdir: str, eval_every: int, overrides: list[str], env) -> dict:
    """One `gjax.train` run; `eval_every=0`: the README command as written (progress bar too)."""
    fresh_workdir(workdir)
    cmd = [
        sys.executable,
        "-m",
        "gjax.train",
        f"--config=configs/{name}.py:tiny",
        f"--workdir={workdir}",
        *(
            [f"--config.log.eval_every={eval_every}", "--config.log.progress=False"]
            if eval_every
            else []
        ),
        *(f"--config.{o}" for o in overrides),
    ]
    log_path = workdir.rstrip("/") + ".log"
    # A first run's time: gjax.train's default compilation cache, empty (a cache of its own
    # under the run's XDG_CACHE_HOME), so no run reads another's programs.
    cache_home = workdir.rstrip("/") + ".cache"
    shutil.rmtree(cache_home, ignore_errors=True)
    env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = cache_home
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        print(tail, file=sys.stderr)
        fail(
            f"{' '.join(cmd)} exited {proc.returncode}; its output is in {log_path}. "
            "No table written.",
            status=1,
        )
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    mid = [
        r for r in rows if r["step"] == eval_every and r.get("eval/heldout_accuracy") is not None
    ]
    return {
        "config": name,
        "command": " ".join(["python", *cmd[1:]]),
        "steps": max(r["step"] for r in rows),
        "heldout_size": summary["heldout_size"],
        "before": summary["heldout_accuracy_before"],
        "mid_step": eval_every or None,
        "mid": mid[0]["eval/heldout_accuracy"] if mid else None,
        "after": summary["heldout_accuracy_after"],
        "response_length_first_last": [
            rows[0].get("response/length_mean"),
            rows[-1].get("response/length_mean"),
        ],
        "wall_s": round(wall, 1),
    }


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s"


def table(results: list[dict], meta: dict) -> str:
    grid = [r for r in results if r["mid_step"]]
    plain = [r for r in results if not r["mid_step"]]
    steps = {r["steps"] for r in results}
    heldout = {r["heldout_size"] for r in results}
    m = meta["machine"]
    head = (
        f"Measured {meta['date']} by `python scripts/readme_results.py` on {m['cores']} cores of "
        f"{m['cpu']} (jax {m['jax']}, Python {m['python']}; 1-minute load average "
        f"{m['loadavg_1min_at_start']} at the start); greedy accuracy on "
        f"{'/'.join(map(str, sorted(heldout)))} held-out problems."
    )
    if meta["overrides"]:
        head += " Overrides: " + ", ".join(f"`{o}`" for o in meta["overrides"]) + "."
    paragraphs = [textwrap.fill(head, WIDTH, break_on_hyphens=False)]
    if grid:
        mid = grid[0]["mid_step"]
        after = f"after {steps.pop()} steps" if len(steps) == 1 else "after"
        lines = [
            f"| config | before | step {mid} | {after} | wall |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in grid:
            label = f"`{r['config']}`" + (
                f" ({NOTES[r['config']]})" if r["config"] in NOTES else ""
            )
            mid_value = "-" if r["mid"] is None else f"{r['mid']:.3f}"
            lines.append(
                f"| {label} | {r['before']:.3f} | {mid_value} | {r['after']:.3f} | "
                f"{minutes(r['wall_s'])} |"
            )
        paragraphs.append("\n".join(lines))
    for r in plain:
        text = (
            f"The README command as written (`{r['config']}.py:tiny`, no intermediate "
            f"evaluations) takes {minutes(r['wall_s'])}: {r['before']:.3f} -> {r['after']:.3f}."
        )
        paragraphs.append(textwrap.fill(text, WIDTH, break_on_hyphens=False))
    return "\n\n".join(paragraphs)


def rewrite_readme(path: str, block: str) -> None:
    with open(path) as f:
        text = f.read()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        fail(f"{path} has no {BEGIN} ... {END} block to rewrite; add the two markers")
    with open(path, "w") as f:
        f.write(pattern.sub(lambda _: f"{BEGIN}\n\n{block}\n\n{END}", text, count=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list, README order")
    ap.add_argument("--eval_every", type=int, default=40, help="the table's middle column")
    ap.add_argument(
        "--readme_command",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also time the README command as written ({README_COMMAND}.py:tiny)",
    )
    ap.add_argument("--root", default=os.path.join("workdirs", "readme_results"))
    ap.add_argument(
        "--write",
        action="store_true",
        help="rewrite the results block of --readme (default: only print it and save it in --root)",
    )
    ap.add_argument(
        "--readme", default=os.path.join(ROOT, "README.md"), help="the file --write rewrites"
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="config override"
    )
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if args.write and not args.readme:
        fail("--write needs a file to rewrite: set --readme=PATH (README.md by default)")
    unknown = [n for n in names if not os.path.exists(os.path.join(ROOT, "configs", f"{n}.py"))]
    if unknown or not names:
        fail(f"unknown config(s) {unknown} in --configs; valid: {','.join(CONFIGS)}")
    env = dict(os.environ, PYTHONPATH=ROOT)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "machine": machine(),
        "overrides": args.set,
    }
    os.makedirs(args.root, exist_ok=True)
    root = os.path.abspath(args.root)
    runs = [(n, os.path.join(root, n), args.eval_every) for n in names]
    if args.readme_command:
        runs.append((README_COMMAND, os.path.join(root, "readme_command"), 0))
    results = []
    for name, workdir, eval_every in runs:
        results.append(run_one(name, workdir, eval_every, args.set, env))
        print(json.dumps(results[-1]), flush=True)
    block = table(results, meta)
    saved = os.path.join(root, "readme_block.md")
    with open(saved, "w") as f:
        f.write(block + "\n")
    if args.write:
        rewrite_readme(args.readme, block)
    print(block, file=sys.stderr)
    if not args.write:
        print(
            f"readme_results: {args.readme} left alone; the block above is in {saved} "
            "(--write puts it between the README's markers)",
            file=sys.stderr,
        )
    written = args.readme if args.write else None
    print(json.dumps({**meta, "results": results, "readme": written, "block": saved}))


if __name__ == "__main__":
    main()
