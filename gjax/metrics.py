"""Metrics sinks: JSONL (the record), TensorBoard (for eyes), a progress bar (for the terminal).

`MetricsWriter.write(step, metrics)` takes host floats; the loop hands it step N's metrics
while the device already runs step N+1 (pulled one step late, nanodo-style).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from gjax import paths

PROGRESS_KEYS = (
    ("reward/mean", "r"),
    ("reward/accuracy", "acc"),
    ("response/length_mean", "len"),
    ("policy/entropy", "ent"),
    ("optim/grad_norm", "gn"),
    ("time/step_s", "s/it"),
)


def to_host(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars -> python floats (one transfer for the whole dict)."""
    import jax

    host = jax.device_get(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in host.items()}


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Rows of a JSONL file (local or gs://); [] if there is none."""
    p = paths.resolve(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Appends one JSON object per step to `metrics.jsonl`, mirrors scalars to TensorBoard.

    In a gs:// workdir (objects cannot be appended to) the whole file is uploaded at most
    every `REMOTE_FLUSH_S` seconds and on `flush()`, which the loop calls before each
    checkpoint, so every row a resume keeps is stored; TensorBoard's gs:// writer
    (tensorboardX, through google-cloud-storage) uploads its events on its own flushes.
    """

    REMOTE_FLUSH_S = 30.0

    def __init__(
        self,
        workdir: str,
        *,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        start_step: int = 0,
    ):
        root = paths.resolve(workdir)
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "metrics.jsonl"
        self._remote = paths.is_url(workdir)
        self._lines: list[str] = []  # gs://: the file's content, uploaded whole
        self._uploaded_at = time.monotonic()
        self._truncate_after(start_step)
        self._file = None if self._remote else open(self.path, "a")  # noqa: SIM115 - for the run
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(root / "tensorboard"))
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, dynamic_ncols=True, desc="train", leave=True
            )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows the restored checkpoint does not cover (they will be redone)."""
        rows = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        self._lines = [json.dumps(r) for r in rows]
        self.path.write_text("".join(line + "\n" for line in self._lines))
        if not self._remote:
            self._lines = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": int(step)}
        row.update({k: (v if math.isfinite(v) else None) for k, v in sorted(metrics.items())})
        if self._remote:
            self._lines.append(json.dumps(row))
            if time.monotonic() - self._uploaded_at >= self.REMOTE_FLUSH_S:
                self.flush()
        else:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            shown = {short: f"{metrics[k]:.3g}" for k, short in PROGRESS_KEYS if k in metrics}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - self._bar.n)

    def flush(self) -> None:
        """Makes every row written so far durable (a gs:// workdir: one upload)."""
        if self._remote:
            self.path.write_text("".join(line + "\n" for line in self._lines))
            self._uploaded_at = time.monotonic()
        else:
            self._file.flush()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
