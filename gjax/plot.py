"""Training curves as PNG, comparing runs, as in the papers' figures.

    python -m gjax.plot WORKDIR [WORKDIR ...] [--out curves.png] [--smooth 0.6]

Panels: reward, entropy, response length, grad norm (log axis); then held-out accuracy and
one panel for every other `eval/*` series (e.g. pass@k) that any run's metrics carry. Each run
is one line, labelled by its workdir name. Training series are smoothed (EMA, `--smooth`);
evaluations are sparse and drawn as measured, one marker per evaluation. The held-out panel
also takes the run's `summary.json` (accuracy before training at step 0, after training at
the last step), so a run without `--config.log.eval_every` still shows where it started and
ended: those two points are markers only, since nothing was measured between them; a line
joins a run's evaluations only when it evaluated during training.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from gjax.errors import UserError, run_cli
from gjax.metrics import read_jsonl

PANELS = (
    ("reward/mean", "reward", False),
    ("policy/entropy", "entropy", False),
    ("response/length_mean", "response length (tokens)", False),
    ("optim/grad_norm", "grad norm", True),
)
EVAL_PREFIX = "eval/"
HELDOUT = "eval/heldout_accuracy"
MAX_COLUMNS = 4


def ema(values: np.ndarray, smooth: float) -> np.ndarray:
    if smooth <= 0 or len(values) == 0:
        return values
    out = np.empty_like(values)
    acc = values[0]
    for i, v in enumerate(values):
        acc = smooth * acc + (1 - smooth) * v
        out[i] = acc
    return out


def eval_title(key: str) -> str:
    """`eval/heldout_pass@8` -> `held-out pass@8`."""
    name = key[len(EVAL_PREFIX) :]
    if name.startswith("heldout_"):
        name = "held-out " + name[len("heldout_") :].replace("_", " ")
    return name


def eval_keys(runs: dict[str, list[dict]]) -> list[str]:
    """Every `eval/*` key with a value in any run: held-out accuracy first, the rest sorted."""
    keys = {
        k
        for rows in runs.values()
        for r in rows
        for k, v in r.items()
        if k.startswith(EVAL_PREFIX) and v is not None
    }
    return sorted(keys, key=lambda k: (k != HELDOUT, k))


def series(rows: list[dict], key: str, summary: dict | None = None) -> list[tuple[int, float]]:
    """(step, value) of `key`; for held-out accuracy, `summary.json`'s before/after added."""
    pts = {r["step"]: float(r[key]) for r in rows if r.get(key) is not None}
    if key == HELDOUT and summary:
        before, after = (
            summary.get("heldout_accuracy_before"),
            summary.get("heldout_accuracy_after"),
        )
        if before is not None:
            pts.setdefault(0, float(before))
        if after is not None and rows:
            pts.setdefault(max(r["step"] for r in rows), float(after))
    return sorted(pts.items())


def load_run(workdir: str) -> tuple[list[dict], dict | None]:
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    if not rows:
        raise UserError(
            f"{workdir}: no metrics.jsonl rows; give the --workdir of a gjax.train run "
            "(it writes WORKDIR/metrics.jsonl from its first step)"
        )
    summary = None
    path = os.path.join(workdir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    return rows, summary


def make_figure(workdirs: list[str], smooth: float = 0.6):
    """The figure (Agg backend): the training panels, then one panel per `eval/*` series."""
    import matplotlib  # imported on use: slow, and only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: a slow import, only when plotting

    runs, summaries = {}, {}
    for wd in workdirs:
        name = os.path.basename(os.path.normpath(wd))
        runs[name], summaries[name] = load_run(wd)
    evals = eval_keys(runs)
    if any(s and s.get("heldout_accuracy_after") is not None for s in summaries.values()):
        evals = [HELDOUT, *(k for k in evals if k != HELDOUT)]
    panels = [(key, title, log, False) for key, title, log in PANELS]
    panels += [(key, eval_title(key), False, True) for key in evals]
    nrows = math.ceil(len(panels) / MAX_COLUMNS)
    ncols = math.ceil(len(panels) / nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(panels) :]:
        ax.remove()
    for ax, (key, title, log_axis, is_eval) in zip(axes, panels):
        for i, (name, rows) in enumerate(runs.items()):
            pts = series(rows, key, summaries[name])
            if not pts:
                continue
            steps, vals = map(np.asarray, zip(*pts))
            color = f"C{i}"
            if is_eval:
                # A line only through evaluations made during training (eval_every): with
                # summary.json's before/after alone, nothing was measured in between.
                measured = any(r.get(key) is not None for r in rows)
                style = "o-" if measured else "o"
                ax.plot(steps, vals, style, color=color, label=name, markersize=4)
            else:
                ax.plot(steps, ema(vals.astype(float), smooth), color=color, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log_axis:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_runs(workdirs: list[str], out: str, smooth: float = 0.6) -> str:
    fig = make_figure(workdirs, smooth)
    import matplotlib.pyplot as plt  # deferred: a slow import, only when plotting

    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gjax.plot", description=__doc__.split("\n")[0])
    parser.add_argument(
        "workdirs",
        nargs="+",
        metavar="WORKDIR",
        help="--workdir of a gjax.train run (holds metrics.jsonl); several runs are compared, "
        "one line each, labelled by the directory's name",
    )
    parser.add_argument(
        "--out", default="curves.png", help="PNG file to write (default: %(default)s)"
    )
    parser.add_argument(
        "--smooth",
        type=float,
        default=0.6,
        help="EMA weight for the training curves, in [0, 1): 0 draws them raw, higher is "
        "smoother; evaluations are never smoothed (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        parser.error(f"--smooth must be in [0, 1), got {args.smooth}")
    run_cli(lambda: print(plot_runs(args.workdirs, args.out, args.smooth)))


if __name__ == "__main__":
    main()
