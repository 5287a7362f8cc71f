"""Versioned weight push from the trainer to a separate `gjax.serve` server.

The protocol is a directory (local or gs://, through etils.epath and orbax):

    PUSH_DIR/v00000007/   params of policy version 7 (an orbax StandardCheckpointer save)
    PUSH_DIR/LATEST       "7": written by the trainer after the save is complete
    PUSH_DIR/SERVED       "7": written by the server once its decode steps use version 7
    PUSH_DIR/REFUSED      "7 <why>": written by a server that refuses version 7 (another base)

The trainer (`WeightPusher.push`) saves, then bumps LATEST, then waits (bounded) for SERVED
to reach the version, so the next rollout batch samples from the new weights. The server
(`WeightWatcher`) polls LATEST, restores the version onto its own params' shapes and
shardings, and swaps them into the engine's `ParamsHolder` between decode steps (nothing
recompiles). A restarted server starts from LATEST. Versions older than the previous one are
deleted by the trainer.

A LoRA run (`gjax.rollout.handoff`) saves only the adapters in a version and beside them
`handoff.ADAPTER_META` (rank, alpha, targets, base digest); the server restores them onto its
own adapters and serves them over the base it loaded. A server whose record differs refuses
the version by name (REFUSED), and the trainer waiting for it raises that paragraph.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import jax
import orbax.checkpoint as ocp
from etils import epath

from gjax.rollout.handoff import ADAPTER_META, Handoff, HandoffMismatch

log = logging.getLogger("gjax")


def _read_int(path: epath.Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _write_text(path: epath.Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    tmp.replace(path)


def _write_int(path: epath.Path, value: int) -> None:
    _write_text(path, str(value))


def version_dir(root: epath.Path, version: int) -> epath.Path:
    return root / f"v{version:08d}"


def latest_version(root) -> int | None:
    return _read_int(epath.Path(root) / "LATEST")


def served_version(root) -> int | None:
    return _read_int(epath.Path(root) / "SERVED")


def version_record(root, version: int) -> dict | None:
    """The adapter record of a pushed version (None: a full-weight push)."""
    try:
        return json.loads((version_dir(epath.Path(root), version) / ADAPTER_META).read_text())
    except FileNotFoundError:
        return None


def refused(root) -> tuple[int, str] | None:
    """(version, why) a server refused last, or None."""
    try:
        version, _, why = (epath.Path(root) / "REFUSED").read_text().partition(" ")
        return int(version), why
    except (FileNotFoundError, ValueError):
        return None


def restore(root, version: int, like):
    """Params of `version`, restored onto the shapes, dtypes and shardings of `like`."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(version_dir(epath.Path(root), version).resolve(), target)


class WeightPusher:
    """Trainer side: `push(params) -> the version the server now samples with`. `handoff`
    (`gjax.rollout.handoff.Handoff`): what a push writes (LoRA: the adapters and their record)."""

    def __init__(self, root, *, ack_timeout_s: float = 60.0, poll_s: float = 0.05, handoff=None):
        self.handoff = handoff or Handoff()
        self.root = epath.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ack_timeout_s = ack_timeout_s
        self.poll_s = poll_s
        self.version = latest_version(self.root) or 0
        self.last_bytes = 0  # bytes the last push wrote

    def push(self, params, version: int | None = None, *, wait: bool = True) -> int:
        """Saves `params` as `version` (default: the next one); returns the served version
        (`wait=False`: returns `version` at once; the caller asks the servers themselves).
        In a multi-process run every process calls it (orbax's save is a collective) and
        process 0 writes LATEST."""
        version = self.version + 1 if version is None else version
        params = self.handoff.payload(params)
        self.last_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        path = version_dir(self.root, version)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path.resolve(), params, force=True)
        self.version = version
        if jax.process_index() == 0:
            if self.handoff.adapters:  # before LATEST: a server reads it with the version
                (path / ADAPTER_META).write_text(json.dumps(self.handoff.record))
            _write_int(self.root / "LATEST", version)
            for old in self.root.glob("v*"):
                if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                    old.rmtree(missing_ok=True)
        if not wait:
            return version
        deadline = time.monotonic() + self.ack_timeout_s
        while time.monotonic() < deadline:
            served = served_version(self.root)
            if served is not None and served >= version:
                return served
            self.raise_if_refused(version)
            time.sleep(self.poll_s)
        served = served_version(self.root) or 0
        log.warning(
            "weight push: the server did not load version %d within %.0f s (serving %d)",
            version,
            self.ack_timeout_s,
            served,
        )
        return served

    def raise_if_refused(self, version: int) -> None:
        """Raises the server's HandoffMismatch paragraph if it refused `version`."""
        got = refused(self.root)
        if got is not None and got[0] >= version:
            raise HandoffMismatch(
                f"the gjax.serve server refused weight version {got[0]}: {got[1]}"
            )

    def behind(self) -> bool:
        """Never: a restarted server loads the newest version in the directory itself."""
        return False

    def close(self) -> None:
        pass  # nothing held between pushes


class WeightWatcher:
    """Server side: polls LATEST and swaps each new version into `holder` (a ParamsHolder);
    `handoff` (the server's `Handoff`): what a version holds (LoRA: adapters over its base)."""

    def __init__(self, root, holder, *, poll_s: float = 0.2, handoff=None):
        self.root = epath.Path(root)
        self.holder = holder
        self.handoff = handoff or Handoff()
        self._refused = None  # the version refused last (logged once)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-watcher", daemon=True)

    def load_latest(self, *, announce: bool = True) -> bool:
        """Swaps in LATEST if it is newer than what is served; True if it did. `announce`:
        writes SERVED (`announce=False`: writes nothing, for a server not yet bound to its
        port, which may still be refused; `start` writes it)."""
        version = latest_version(self.root)
        if version is None or version <= self.holder.version:
            return False
        try:
            self.handoff.check(
                version_record(self.root, version), f"weight version {version} in {self.root}"
            )
        except HandoffMismatch as e:
            if announce and self._refused != version:
                _write_text(self.root / "REFUSED", f"{version} {e}")
                log.error("weight push refused: %s", e)
            self._refused = version
            raise
        payload = restore(self.root, version, self.handoff.like(self.holder.params))
        params = self.handoff.params_from(payload)
        if not self.holder.swap_if_newer(params, version):
            return False  # a newer version arrived over gRPC meanwhile
        if announce:
            _write_int(self.root / "SERVED", version)
            (self.root / "REFUSED").unlink(missing_ok=True)
        log.info("serving policy version %d", version)
        return True

    def start(self) -> WeightWatcher:
        self.root.mkdir(parents=True, exist_ok=True)
        self.load_latest(announce=False)  # written just below
        _write_int(self.root / "SERVED", self.holder.version)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.poll_s):
            try:
                self.load_latest()
            except HandoffMismatch:
                pass  # logged and written (REFUSED) once; a newer version may fit
            except Exception:  # noqa: BLE001 - a half-written version is retried next poll
                log.exception("weight push: loading the latest version failed; retrying")

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
