"""Training curves as PNG, comparing runs, as in the papers' figures.

    python -m gjax.plot WORKDIR [WORKDIR ...] [--out curves.png] [--smooth 0.6]

Panels: reward, entropy, response length, grad norm (log axis), plus held-out accuracy when
present. Each run is one line, labelled by its workdir name.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from gjax.metrics import read_jsonl

PANELS = (
    ("reward/mean", "reward", False),
    ("policy/entropy", "entropy", False),
    ("response/length_mean", "response length (tokens)", False),
    ("optim/grad_norm", "grad norm", True),
)


def ema(values: np.ndarray, smooth: float) -> np.ndarray:
    if smooth <= 0 or len(values) == 0:
        return values
    out = np.empty_like(values)
    acc = values[0]
    for i, v in enumerate(values):
        acc = smooth * acc + (1 - smooth) * v
        out[i] = acc
    return out


def plot_runs(workdirs: list[str], out: str, smooth: float = 0.6) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for wd in workdirs:
        rows = read_jsonl(os.path.join(wd, "metrics.jsonl"))
        if not rows:
            raise FileNotFoundError(f"{wd}: no metrics.jsonl rows; is this a gjax workdir?")
        runs[os.path.basename(os.path.normpath(wd))] = rows
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (key, title, log_axis) in zip(axes, PANELS):
        for name, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if not pts:
                continue
            steps, vals = map(np.asarray, zip(*pts))
            ax.plot(steps, ema(vals.astype(float), smooth), label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log_axis:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", default="curves.png")
    parser.add_argument("--smooth", type=float, default=0.6)
    args = parser.parse_args(argv)
    print(plot_runs(args.workdirs, args.out, args.smooth))


if __name__ == "__main__":
    main()
