"""Versioned weight push from the trainer to a separate `gjax.serve` server.

The protocol is a directory (local or gs://, through etils.epath and orbax):

    PUSH_DIR/v00000007/   params of policy version 7 (an orbax StandardCheckpointer save)
    PUSH_DIR/LATEST       "7": written by the trainer after the save is complete
    PUSH_DIR/SERVED       "7": written by the server once its decode steps use version 7

The trainer (`WeightPusher.push`) saves, then bumps LATEST, then waits (bounded) for SERVED
to reach the version, so the next rollout batch samples from the new weights. The server
(`WeightWatcher`) polls LATEST, restores the version onto its own params' shapes and
shardings, and swaps them into the engine's `ParamsHolder` between decode steps (nothing
recompiles). A restarted server starts from LATEST. Versions older than the previous one are
deleted by the trainer.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger("gjax")


def _read_int(path: epath.Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _write_int(path: epath.Path, value: int) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(str(value))
    tmp.replace(path)


def version_dir(root: epath.Path, version: int) -> epath.Path:
    return root / f"v{version:08d}"


def latest_version(root) -> int | None:
    return _read_int(epath.Path(root) / "LATEST")


def served_version(root) -> int | None:
    return _read_int(epath.Path(root) / "SERVED")


def restore(root, version: int, like):
    """Params of `version`, restored onto the shapes, dtypes and shardings of `like`."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(version_dir(epath.Path(root), version).resolve(), target)


class WeightPusher:
    """Trainer side: `push(params) -> the version the server now samples with`."""

    def __init__(self, root, *, ack_timeout_s: float = 60.0, poll_s: float = 0.05):
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
        self.last_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        path = version_dir(self.root, version)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path.resolve(), params, force=True)
        self.version = version
        if jax.process_index() == 0:
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
            time.sleep(self.poll_s)
        served = served_version(self.root) or 0
        log.warning(
            "weight push: the server did not load version %d within %.0f s (serving %d)",
            version,
            self.ack_timeout_s,
            served,
        )
        return served

    def behind(self) -> bool:
        """Never: a restarted server loads the newest version in the directory itself."""
        return False

    def close(self) -> None:
        pass  # nothing held between pushes


class WeightWatcher:
    """Server side: polls LATEST and swaps each new version into `holder` (a ParamsHolder)."""

    def __init__(self, root, holder, *, poll_s: float = 0.2):
        self.root = epath.Path(root)
        self.holder = holder
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
        params = restore(self.root, version, self.holder.params)
        if not self.holder.swap_if_newer(params, version):
            return False  # a newer version arrived over gRPC meanwhile
        if announce:
            _write_int(self.root / "SERVED", version)
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
            except Exception:  # noqa: BLE001 - a half-written version is retried next poll
                log.exception("weight push: loading the latest version failed; retrying")

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
