"""`python -m gjax.plot`: training panels, held-out accuracy and every `eval/*` series."""

import json

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from gjax import plot

TRAINING = ["reward", "entropy", "response length (tokens)", "grad norm"]


def write_run(path, rows, summary=None):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return str(path)


def train_row(step, **extra):
    return {
        "step": step,
        "reward/mean": 0.1 * step,
        "policy/entropy": 0.5,
        "response/length_mean": 10.0 + step,
        "optim/grad_norm": 1.0 + step,
        **extra,
    }


def lines(ax):
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}


def test_heldout_and_other_eval_series_get_panels_with_summary_endpoints(tmp_path):
    # Run a: evaluated every 2 steps (as --config.log.eval_every=2), pass@k from the eval
    # helper's keys, and a summary; its after-accuracy equals the step-4 evaluation.
    a = write_run(
        tmp_path / "run_a",
        [
            train_row(1),
            train_row(2, **{"eval/heldout_accuracy": 0.6}),
            train_row(3),
            train_row(
                4, **{"eval/heldout_accuracy": 0.7, "eval/heldout_pass@4": 0.9, "eval/x": None}
            ),
        ],
        {"heldout_accuracy_before": 0.5, "heldout_accuracy_after": 0.7},
    )
    # Run b: the README command (no intermediate evaluations): only summary.json knows.
    b = write_run(
        tmp_path / "run_b",
        [train_row(1), train_row(2), train_row(3)],
        {"heldout_accuracy_before": 0.5, "heldout_accuracy_after": 0.55},
    )
    fig = plot.make_figure([a, b], smooth=0.0)
    try:
        axes = fig.axes
        assert [ax.get_title() for ax in axes] == [
            *TRAINING,
            "held-out accuracy",
            "held-out pass@4",
        ]
        heldout, pass_k = lines(axes[4]), lines(axes[5])
        assert heldout == {"run_a": ([0, 2, 4], [0.5, 0.6, 0.7]), "run_b": ([0, 3], [0.5, 0.55])}
        assert pass_k == {"run_a": ([4], [0.9])}  # None-valued eval keys get no panel
        # Run a's evaluations during training are joined by a line; run b's summary-only
        # before/after are two markers, no line (nothing was measured between them).
        styles = {ln.get_label(): ln.get_linestyle() for ln in axes[4].lines}
        assert styles == {"run_a": "-", "run_b": "None"}
        assert all(ln.get_marker() == "o" for ln in axes[4].lines)
        assert lines(axes[0])["run_b"] == ([1, 2, 3], pytest.approx([0.1, 0.2, 0.3]))
        assert axes[3].get_yscale() == "log"
    finally:
        plt.close(fig)
    # Six panels: two rows of three, at 120 dpi.
    png = plot.plot_runs([a, b], str(tmp_path / "curves.png"))
    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (round(2 * 3.4 * 120), round(3 * 4.2 * 120))
    assert np.ptp(img[..., :3]) > 0.5  # drawn, not blank


def test_without_evaluations_the_four_training_panels(tmp_path):
    a = write_run(tmp_path / "run_a", [train_row(1), train_row(2)])
    fig = plot.make_figure([a])
    try:
        assert [ax.get_title() for ax in fig.axes] == TRAINING
    finally:
        plt.close(fig)


def test_eval_titles():
    assert plot.eval_title("eval/heldout_accuracy") == "held-out accuracy"
    assert plot.eval_title("eval/heldout_maj@8") == "held-out maj@8"
    assert plot.eval_title("eval/math500_pass@1") == "math500_pass@1"


def test_not_a_workdir_is_one_paragraph_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        plot.main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gjax: ") and "metrics.jsonl" in err and "Traceback" not in err


def test_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        plot.main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "WORKDIR --workdir of a gjax.train run" in out
    assert "--out OUT PNG file to write (default: curves.png)" in out
    assert "--smooth SMOOTH EMA weight for the training curves" in out


def test_smooth_outside_0_1_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        plot.main([str(tmp_path), "--smooth", "1"])
    assert exc.value.code == 2
    assert "--smooth must be in [0, 1), got 1.0" in capsys.readouterr().err
