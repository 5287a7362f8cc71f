"""Metrics sinks: JSONL (the record), TensorBoard (for eyes), a progress bar (for the terminal).

`MetricsWriter.write(step, metrics)` takes host floats (and mirrors them to Weights & Biases
with log.wandb_project: `gjax.wandb_log`); the loop hands it step N's metrics
while the device already runs step N+1 (pulled one step late, nanodo-style).

On resume from step k the sinks continue where the checkpoint ends: JSONL rows past k are
dropped (and rows up to k that the file lacks are rebuilt from the checkpoint's history),
and TensorBoard purges its events past k (`purge_step`), so no step appears twice.
The progress bar starts at the first step written, so its rate and ETA leave out the
first step's compilation; it fits an 80-column terminal, and is drawn only on a terminal
(a redirected stderr gets a logged progress line every `LOG_EVERY_S` seconds instead).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gjax import paths

log = logging.getLogger(__name__)

# The progress line: short keys and few digits, so that the whole line fits 80 columns;
# tqdm's own rate is left out (s/step says it).
PROGRESS_KEYS = (
    ("reward/mean", "reward", ".2f"),
    ("policy/entropy", "ent", ".2g"),
    ("optim/grad_norm", "gnorm", ".2g"),
)
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{remaining}{postfix}]"
LEGEND = (
    "progress: reward = mean reward of this step's training samples; ent = policy entropy "
    "(nats/token); gnorm = gradient norm; s/step = seconds per step. metrics.jsonl has every "
    "figure. The first step compiles, so the ETA starts with the second."
)
# Without a terminal (stderr redirected to a file) no bar is drawn: the progress line is
# logged once per this many seconds, and at the last step.
LOG_EVERY_S = 60.0


def interactive() -> bool:
    """Whether stderr is a terminal: progress bars only there (a log file gets no bars)."""
    return sys.stderr.isatty()


def progress_postfix(metrics: Mapping[str, float]) -> str:
    """`reward 0.55 ent 0.18 gnorm 0.74 1.25s/step` from a row (the figures it has)."""
    parts = [f"{short} {metrics[k]:{fmt}}" for k, short, fmt in PROGRESS_KEYS if k in metrics]
    if "time/step_s" in metrics:
        parts.append(f"{metrics['time/step_s']:.3g}s/step")
    return " ".join(parts)


def to_host(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Device scalars -> python floats (one transfer for the whole dict)."""
    import jax  # on use: gjax.plot reads metrics files without jax

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

    `history` (the rows a resumed checkpoint holds, steps 1..start_step) rebuilds rows that
    `metrics.jsonl` lacks (a deleted or truncated file).

    In a gs:// workdir (objects cannot be appended to) the whole file is uploaded at most
    every `REMOTE_FLUSH_S` seconds and on `flush()`, which the loop calls before each
    checkpoint, so every row a resume keeps is stored; a failing upload is retried with
    backoff for `storage_timeout_s`, then `paths.StorageUnavailable` ends the run, its message
    followed by `last_intact()`; TensorBoard's gs:// writer
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
        history: list[Mapping[str, Any]] = (),
        storage_timeout_s: float = 300.0,
        last_intact: Callable[[], str] | None = None,
        wandb=None,
    ):
        root = paths.resolve(workdir)
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / "metrics.jsonl"
        self._remote = paths.is_url(workdir)
        self._timeout_s, self._last_intact = storage_timeout_s, last_intact
        self._lines: list[str] = []  # gs://: the file's content, uploaded whole
        self._uploaded_at = time.monotonic()
        self._wandb = None  # set below; the truncation's flush (gs://) comes first
        self._truncate_after(start_step, history)
        self._file = None if self._remote else open(self.path, "a")  # noqa: SIM115 - for the run
        self._wandb = wandb  # a gjax.wandb_log.WandbSink (log.wandb_project) or None
        if wandb is not None:
            wandb.warn = self.warn  # its warnings above the progress bar too
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported only when log.tensorboard is on

            # purge_step: TensorBoard drops this directory's earlier events at steps >= it
            # (the steps a killed run wrote past its checkpoint; they are redone).
            self._tb = SummaryWriter(
                str(root / "tensorboard"), purge_step=start_step + 1 if start_step else None
            )
        self._progress, self._total = progress, total_steps
        self._bar = None
        self._tty = interactive()
        self._logged_at = -math.inf  # no terminal: when the progress line was last logged

    def _truncate_after(self, step: int, history: list[Mapping[str, Any]]) -> None:
        """On resume, drop rows the restored checkpoint does not cover (they will be redone),
        and rebuild from `history` the rows up to `step` that the file lacks."""
        kept = {r["step"]: r for r in read_jsonl(self.path) if r.get("step", 0) <= step}
        lost = {
            int(r["step"]): _row(int(r["step"]), {k: v for k, v in r.items() if k != "step"})
            for r in history
            if r["step"] <= step and r["step"] not in kept
        }
        if lost:
            log.warning(
                "%s lacked %d of the %d steps the checkpoint covers; rebuilt them from the "
                "checkpoint's history (without time/ and throughput/ figures, which it does not "
                "keep)",
                self.path,
                len(lost),
                step,
            )
        rows = {**lost, **kept}
        self._lines = [json.dumps(rows[s]) for s in sorted(rows)]
        if self._remote:
            self.flush()
        else:
            self.path.write_text("".join(line + "\n" for line in self._lines))
            self._lines = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        line = json.dumps(_row(step, metrics))
        if self._remote:
            self._lines.append(line)
            if time.monotonic() - self._uploaded_at >= self.REMOTE_FLUSH_S:
                self.flush()
        else:
            self._file.write(line + "\n")
            self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, metrics)
        if self._progress:
            self._show(step, metrics)

    def _show(self, step: int, metrics: Mapping[str, float]) -> None:
        postfix = progress_postfix(metrics)
        if not self._tty:  # a log file: one line now and then, no bar
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY_S or step == self._total:
                if self._logged_at == -math.inf:
                    log.info("%s", LEGEND)
                log.info("step %d/%d: %s", step, self._total, postfix)
                self._logged_at = now
            return
        if self._bar is None:  # started at the first step written: the ETA leaves out compiles
            from tqdm import tqdm  # imported only when log.progress is on

            tqdm.write(LEGEND, file=sys.stderr)
            self._bar = tqdm(
                total=self._total,
                initial=step,
                dynamic_ncols=True,
                desc="train",
                bar_format=BAR_FORMAT,
                leave=True,
                postfix=postfix,
            )
            return
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def warn(self, message: str) -> None:
        """A warning for the user: above the progress bar while there is one, else logged."""
        if self._bar is not None:
            self._bar.write(f"WARNING: {message}", file=sys.stderr)
        else:
            log.warning(message)

    def flush(self) -> None:
        """Makes every row written so far durable (a gs:// workdir: one upload)."""
        if self._remote:
            text = "".join(line + "\n" for line in self._lines)
            paths.with_retries(
                lambda: self.path.write_text(text),
                what=f"uploading {self.path}",
                timeout_s=self._timeout_s,
                then=self._last_intact,
            )
            self._uploaded_at = time.monotonic()
        else:
            self._file.flush()
        if self._wandb is not None:
            self._wandb.flush()

    def close(self) -> None:
        """Closes the sinks; the bar ends its line, so what is printed next has its own."""
        self.flush()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _row(step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    row = {"step": int(step)}
    row.update({k: (_finite(v)) for k, v in sorted(metrics.items())})
    return row


def _finite(v):
    return v if v is None or math.isfinite(v) else None


def workdir_layout(
    workdir: str, *, checkpoint_steps: list[int], tensorboard: bool, wandb: bool = False
) -> str:
    """What a run leaves in its workdir, for the last lines it prints."""
    ckpts = ", ".join(map(str, checkpoint_steps)) or "none"
    lines = [
        f"workdir {workdir}:",
        "  metrics.jsonl   one JSON row per step (python -m gjax.plot WORKDIR --out curves.png)",
        *(
            ["  tensorboard/    TensorBoard events (tensorboard --logdir WORKDIR/tensorboard)"]
            if tensorboard
            else []
        ),
        *(
            ["  wandb_run.json  the Weights & Biases run's id: a resume continues that run"]
            if wandb
            else []
        ),
        f"  checkpoints/    steps {ckpts}; the same command resumes, gjax.export converts",
        "  summary.json    held-out accuracy before and after training",
        "  config.json     the full config the run started with (changes: config_history.jsonl)",
    ]
    return "\n".join(lines).replace("WORKDIR", workdir)
