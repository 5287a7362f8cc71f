"""Weights & Biases: a run's series, config, held-out table and curves, mirrored to wandb.

On with `log.wandb_project` (empty: off); `log.wandb_entity`, `log.wandb_name`, `log.wandb_tags`
and `log.wandb_mode` (online | offline | disabled; empty: wandb's own default, WANDB_MODE or
online) say where and how. Process 0 logs, as it writes metrics.jsonl:

- every step's row, at `step=` the training step: the same figures as metrics.jsonl and
  TensorBoard (non-finite values left out, as TensorBoard does);
- the full config (updated on a resume that changed it: train.allow_config_change);
- at the end, the held-out table (`heldout/table`: one row before and one after training,
  accuracy, pass@k and dropped requests; the same figures go to the run's summary) and the
  curves of `gjax.plot` as an image (`curves`).

wandb keeps its local files in WANDB_DIR/wandb if WANDB_DIR is set, else in WORKDIR/wandb (a
local workdir), else in ./wandb; the console is not captured (wandb's own lines are silenced,
the run's id, URL and directory are logged). The run's id is kept in WORKDIR/wandb_run.json, with
the last step logged: a resumed run continues the same wandb run (`resume="allow"`). wandb's
steps cannot go back; the steps a killed run logged past its checkpoint are redone by the
resume, and wandb keeps its first values for them (one warning line says which steps);
metrics.jsonl and TensorBoard have the redone ones. A run started afresh in the workdir (no
checkpoint), or resumed into another log.wandb_project, starts a new wandb run.

wandb never stops training: an error at init leaves wandb off for the run, an error while
logging skips that call; each is one warning line (a count of failed calls closes the run).
What is refused before anything loads is what the user asked for and cannot work: wandb not
installed while log.wandb_project is set, an unknown log.wandb_mode, entity/name/tags/mode
set without a project (`check_config`, a hook of `gjax.config.validate`).

`read_run_file` reads a `.wandb` file back (an offline run, which `wandb sync` uploads): wandb
0.2x/0.3x has no Python reader of its own, so this decodes its record log (a LevelDB-style log
of wandb's own protobuf `Record`s, `wandb.proto.wandb_internal_pb2`: what `wandb sync` reads).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
import string
import struct
import tempfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from gjax import paths
from gjax.errors import ConfigError

log = logging.getLogger(__name__)

RECORD = "wandb_run.json"  # in the workdir: the wandb run's id and the last step logged
MODES = ("online", "offline", "disabled")
INSTALL = (
    "config.log.wandb_project is set ({project!r}) but the wandb package is not installed. "
    "Install it (`pip install wandb`, or `pip install -e '.[wandb]'`), or leave "
    "log.wandb_project empty to train without Weights & Biases (metrics.jsonl and "
    "TensorBoard are written either way)."
)


def parse_tags(text: str) -> list[str]:
    """`log.wandb_tags` ('a, b') -> ['a', 'b']; an empty entry is refused."""
    if not text.strip():
        return []
    tags = [t.strip() for t in text.split(",")]
    if not all(tags) or any(len(t) > 64 for t in tags):
        raise ConfigError(
            f"config.log.wandb_tags={text!r}: give a comma list of non-empty tags of at most "
            "64 characters each, e.g. 'grpo,tiny'"
        )
    return tags


def check_config(config) -> None:
    """`config.log`'s wandb fields can work: a hook of `gjax.config.validate`; raises
    ConfigError naming the field."""
    lg = config.log
    mode = lg.wandb_mode
    if mode and mode not in MODES:
        raise ConfigError(
            f"config.log.wandb_mode={mode!r} is not a wandb mode: give one of "
            f"{', '.join(MODES)}, or leave it empty for wandb's default (WANDB_MODE, else online)"
        )
    parse_tags(lg.wandb_tags)
    if not lg.wandb_project:
        given = [
            f"config.log.{k}"
            for k in ("wandb_entity", "wandb_name", "wandb_tags", "wandb_mode")
            if lg[k]
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but "
                "config.log.wandb_project is empty, so "
                "nothing would be logged to Weights & Biases: set "
                "--config.log.wandb_project=NAME, or drop those fields"
            )
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(INSTALL.format(project=lg.wandb_project))


def enabled(config) -> bool:
    return bool(config.log.wandb_project)


def _read_record(workdir: str) -> dict | None:
    try:
        return json.loads(paths.resolve(os.path.join(workdir, RECORD)).read_text())
    except (OSError, ValueError):
        return None


class WandbSink:
    """The run's wandb run (process 0): `log` each step's row, `heldout` and `curves` at the
    end; every wandb call is guarded (a failure is one warning line, training goes on)."""

    def __init__(
        self,
        config,
        workdir: str,
        *,
        start_step: int,
        warn: Callable[[str], None] = log.warning,
    ):
        self._workdir, self.warn = workdir, warn
        self._remote = paths.is_url(workdir)
        self.run = None
        self.failures, self.calls, self._first_failure = 0, 0, None
        self.skip_through = 0  # steps a run before this restart logged already
        self._skipped: list[int] = []
        self._last_step = start_step
        lg = config.log
        if lg.wandb_mode == "disabled":
            return  # asked off: no wandb run, no record
        record = _read_record(workdir) if start_step > 0 else None
        if record and record.get("project") != lg.wandb_project:
            record = None  # logged elsewhere before: a new run in this project
        try:
            import wandb

            run_id = record["id"] if record else _new_id()
            settings = wandb.Settings(console="off", silent=True)
            self.run = wandb.init(
                project=lg.wandb_project,
                entity=lg.wandb_entity or None,
                name=lg.wandb_name or None,
                tags=parse_tags(lg.wandb_tags) or None,
                mode=lg.wandb_mode or os.environ.get("WANDB_MODE") or None,
                dir=self._dir(),
                id=run_id,
                resume="allow",
                settings=settings,
            )
            # On a resume with train.allow_config_change, the changed values replace the old.
            self.run.config.update(config.to_dict(), allow_val_change=True)
        except Exception as e:  # noqa: BLE001 - wandb must never stop training
            self.run = None
            warn(
                f"wandb: could not start the run ({type(e).__name__}: {_short(e)}); training "
                "goes on without Weights & Biases (metrics.jsonl and TensorBoard are written)"
            )
            return
        if record:
            # wandb's own record of the run (online) and ours (offline too): the last step.
            known = max(int(record.get("last_step", 0)), int(self.run.starting_step or 0) - 1)
            self.skip_through = max(known, start_step)
            self._last_step = self.skip_through
        self._write_record()
        log.info(
            "wandb: %s run %s in project %s%s%s",
            "resumed" if record else "new",
            self.run.id,
            lg.wandb_project,
            "" if self.run.offline else f", {self.run.url}",
            f", local files in {self.run.dir}" if self.run.dir else "",
        )

    def _dir(self) -> str | None:
        # (WANDB_DIR and WANDB_MODE are read here, at each run's start: wandb reads its
        # environment once a process.)
        if os.environ.get("WANDB_DIR"):
            return os.environ["WANDB_DIR"]
        if self._remote:
            return None  # wandb's own: the current directory's ./wandb
        return self._workdir  # wandb adds wandb/: WORKDIR/wandb/offline-run-*

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        self.calls += 1
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - wandb must never stop training
            self.failures += 1
            if self._first_failure is None:
                self._first_failure = f"{what}: {type(e).__name__}: {_short(e)}"
                self.warn(
                    f"wandb: {self._first_failure}; training goes on (failed wandb calls are "
                    "counted, the count is logged at the end)"
                )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step `step`'s row (the figures metrics.jsonl has; non-finite ones left out)."""
        if self.run is None:
            return
        if step <= self.skip_through:
            if not self._skipped:
                self.warn(
                    f"wandb: run {self.run.id} already has steps up to {self.skip_through}, "
                    "logged before this restart (the run went past its last checkpoint); "
                    "wandb's steps cannot go back, so it keeps those first values and gets "
                    f"this run's from step {self.skip_through + 1} on (metrics.jsonl and "
                    "TensorBoard have the redone steps)"
                )
            self._skipped.append(step)
            return
        row = {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        self._call(f"logging step {step}", lambda: self.run.log(row, step=step))
        self._last_step = step
        if not self._remote:  # a gs:// workdir: the record is uploaded on flush()
            self._write_record()

    def heldout(self, step: int, before: Mapping[str, float], after: Mapping[str, float]):
        """The held-out table (before and after training) and the run's summary figures."""
        if self.run is None:
            return

        def send():
            import wandb

            names = _heldout_columns([before, after])
            rows = [["before", 0, *(before.get(k) for k in names)]]
            rows.append(["after", step, *(after.get(k) for k in names)])
            columns = ["when", "step", *(k.removeprefix("eval/heldout_") for k in names)]
            self.run.log(
                {"heldout/table": wandb.Table(columns=columns, data=rows)},
                step=max(step, self._last_step),
            )
            for when, m in (("before", before), ("after", after)):
                for k in names:
                    if m.get(k) is not None:
                        self.run.summary[f"heldout/{k.removeprefix('eval/heldout_')}_{when}"] = m[k]

        self._call("logging the held-out table", send)

    def curves(self, step: int, make_png: Callable[[str], Any]) -> None:
        """The curves of `gjax.plot` (`make_png(path)` draws them) as the image `curves`."""
        if self.run is None:
            return

        def send():
            import wandb

            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "curves.png")
                make_png(path)
                self.run.log({"curves": wandb.Image(path)}, step=max(step, self._last_step))

        self._call("logging the curves", send)

    def _write_record(self) -> None:
        text = json.dumps(
            {"id": self.run.id, "project": self.run.project, "last_step": self._last_step}
        )
        self._call("writing " + RECORD, lambda: paths.write_text(self._path(), text))

    def _path(self) -> str:
        return os.path.join(self._workdir, RECORD)

    def flush(self) -> None:
        if self.run is not None and self._remote:
            self._write_record()

    def close(self, exit_code: int = 0, *, preempted: bool = False) -> None:
        """Ends the wandb run (`preempted`: stopped by a signal, to be resumed); says how many
        wandb calls failed, and where an offline run's files are."""
        if self.run is None:
            return
        self._write_record()
        if preempted:
            self._call("marking the run preempted", self.run.mark_preempting)
        offline = self.run.offline and os.path.dirname(self.run.dir or "")
        self._call("finishing the run", lambda: self.run.finish(exit_code=exit_code))
        if offline:
            log.info("wandb: offline run in %s (upload it with `wandb sync %s`)", offline, offline)
        if self.failures:
            self.warn(
                f"wandb: {self.failures} of {self.calls} wandb calls failed (first: "
                f"{self._first_failure}); metrics.jsonl has every step"
            )
        self.run = None


def _new_id() -> str:
    """A fresh run id (wandb's form: 8 of [a-z0-9]), known before `wandb.init`."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _heldout_columns(evals: list[Mapping[str, float]]) -> list[str]:
    keys: list[str] = []
    for m in evals:
        keys += [k for k in m if k not in keys]
    return keys


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


# --- reading a .wandb file back ----------------------------------------------------------------
# The record log: a 7-byte header (b":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
# chunks, each a 7-byte header (CRC-32 of the type byte and the data, length, type: full /
# first / middle / last) and its data; a block's tail shorter than a header is zeros.
_MAGIC = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
_BLOCK, _HEAD = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_run_file(path: str) -> list:
    """The `Record`s (wandb.proto.wandb_internal_pb2) of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if data[:_HEAD] != _MAGIC:
        raise ValueError(f"{path}: not a wandb run file (header {data[:_HEAD]!r})")
    records, pending, pos = [], None, _HEAD
    while pos + _HEAD <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEAD:
            pos += left
            continue
        crc, size, kind = struct.unpack("<IHB", data[pos : pos + _HEAD])
        chunk = data[pos + _HEAD : pos + _HEAD + size]
        if kind == 0 and size == 0:  # zero padding to the block's end
            pos += left
            continue
        if len(chunk) < size or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            break  # a torn tail (a killed writer): the records before it stand
        pos += _HEAD + size
        if kind == _FULL:
            payloads = [chunk]
        elif kind == _FIRST:
            pending, payloads = chunk, []
        elif kind == _MIDDLE and pending is not None:
            pending, payloads = pending + chunk, []
        elif kind == _LAST and pending is not None:
            payloads, pending = [pending + chunk], None
        else:
            raise ValueError(f"{path}: a chunk of type {kind} at byte {pos} out of order")
        for payload in payloads:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
    return records


def _items(items) -> dict[str, Any]:
    """wandb's items -> {key: value}; a nested key (a media object's fields) -> nested dicts."""
    out: dict[str, Any] = {}
    for i in items:
        if not i.value_json:
            continue
        *parents, leaf = [i.key] if i.key else list(i.nested_key)
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = json.loads(i.value_json)
    return out


def read_offline_run(path: str) -> dict[str, Any]:
    """What a `.wandb` file holds: {"id", "project", "name", "tags", "config", "history"
    (step -> {key: value}, wandb's own `_` keys left out), "summary", "exit_code" (None: the
    run did not finish), "preempting"}."""
    out: dict[str, Any] = {
        "config": {},
        "history": {},
        "summary": {},
        "exit_code": None,
        "preempting": False,
    }
    for r in read_run_file(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(
                id=r.run.run_id,
                project=r.run.project,
                name=r.run.display_name,
                tags=list(r.run.tags),
            )
            out["config"].update(_items(r.run.config.update))
        elif kind == "config":
            out["config"].update(_items(r.config.update))
        elif kind == "history":
            row = _items(r.history.item)
            step = int(row.get("_step", r.history.step.num))
            out["history"].setdefault(step, {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")}
            )
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
        elif kind == "preempting":
            out["preempting"] = True
        elif kind == "summary":
            out["summary"].update(
                {k: v for k, v in _items(r.summary.update).items() if not k.startswith("_")}
            )
    out["config"].pop("_wandb", None)
    return out
