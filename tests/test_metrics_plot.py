import json
import os

from gjax.metrics import MetricsWriter, read_jsonl
from gjax.plot import plot_runs


def test_writer_truncates_rows_past_the_resume_step_and_plot_reads_runs(tmp_path):
    wd = str(tmp_path / "run_a")
    w = MetricsWriter(wd, total_steps=4, tensorboard=True, progress=False)
    for step in (1, 2, 3):
        w.write(
            step,
            {
                "reward/mean": step / 10,
                "optim/grad_norm": 1.0 + step,
                "policy/entropy": 0.5,
                "response/length_mean": 10.0 * step,
                "loss/total": float("nan"),
            },
        )
    w.close()
    assert read_jsonl(os.path.join(wd, "metrics.jsonl"))[0]["loss/total"] is None  # NaN -> null
    w = MetricsWriter(wd, total_steps=4, tensorboard=False, progress=False, start_step=2)
    w.write(3, {"reward/mean": 0.9})
    w.close()
    got = read_jsonl(os.path.join(wd, "metrics.jsonl"))
    assert [r["step"] for r in got] == [1, 2, 3] and got[-1]["reward/mean"] == 0.9
    assert os.listdir(os.path.join(wd, "tensorboard"))
    other = tmp_path / "run_b"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.2}) + "\n")
    out = plot_runs([wd, str(other)], str(tmp_path / "curves.png"))
    assert os.path.getsize(out) > 1000
