"""Metrics sinks: JSONL (the record), TensorBoard (for eyes), a progress bar (for the terminal).

`MetricsWriter.write(step, metrics)` takes host floats; the loop hands it step N's metrics
while the device already runs step N+1 (pulled one step late, nanodo-style).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

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
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rows.append(json.loads(line))
    return rows


class MetricsWriter:
    """Appends one JSON object per step to `metrics.jsonl`, mirrors scalars to TensorBoard."""

    def __init__(
        self,
        workdir: str,
        *,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        start_step: int = 0,
    ):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._truncate_after(start_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, dynamic_ncols=True, desc="train", leave=True
            )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows the restored checkpoint does not cover (they will be redone)."""
        rows = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        with open(self.path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": int(step)}
        row.update({k: (v if math.isfinite(v) else None) for k, v in sorted(metrics.items())})
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

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
