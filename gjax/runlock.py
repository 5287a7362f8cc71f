"""One run per workdir: `WORKDIR/.lock`, held by the run's process set while it trains.

Process 0 creates the lock file atomically (`O_CREAT | O_EXCL`) with the run's id, host, pid
and process count, and deletes it when the run ends (normally, on an error, on a signal). A
second run on a locked workdir is refused with one paragraph naming the lock file, its owner
and how to clear it, unless the owner is a process of this host that no longer exists (a
killed run): then the stale lock is taken over, with a warning. An owner on another host
cannot be checked from here, so its lock stays until it is deleted by hand.

`gs://` workdirs: best effort. Cloud Storage can create an object only if it does not exist
(a generation precondition), but epath / gcsfs do not expose that; the lock is checked, then
written, then read back, which catches every start but two within about a second of each
other. A stale gs:// lock is taken over the same way (its owner a dead process of this host);
one of another host is deleted by hand (`gcloud storage rm`). A run that ends because storage
stopped answering leaves its lock (it cannot delete it); the next run on that host takes it
over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid

import jax

from gjax import multihost, paths
from gjax.errors import ConfigError, UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_held: dict[str, str] = {}  # lock file -> run id, held by this process (see `release_all`)


class WorkdirLockedError(UserError, RuntimeError):
    """Another run (alive, or not known to be dead) holds the workdir."""


def lock_path(workdir: str) -> str:
    return os.path.join(os.fspath(workdir), LOCK_NAME)


def _owner(num_processes: int) -> dict:
    return {
        "run_id": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "processes": num_processes,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _read(path: str) -> dict:
    try:
        return json.loads(paths.read_text(path))
    except (OSError, ValueError):
        return {}


def _stale(owner: dict) -> bool:
    """True when the owner is known dead: a process of this host that no longer exists."""
    return (
        owner.get("host") == socket.gethostname()
        and isinstance(owner.get("pid"), int)
        and owner["pid"] != os.getpid()
        and not _alive(owner["pid"])
    )


def _refuse(path: str, owner: dict) -> WorkdirLockedError:
    who = (
        f"run {owner.get('run_id', '?')} (pid {owner.get('pid', '?')} on host "
        f"{owner.get('host', '?')}, {owner.get('processes', '?')} process(es), started "
        f"{owner.get('started', '?')})"
        if owner
        else "a run whose lock file cannot be read"
    )
    rm = "gcloud storage rm" if paths.is_url(path) else "rm"
    return WorkdirLockedError(
        f"the workdir is in use: {path} is held by {who}. Two runs in one workdir would "
        "overwrite each other's metrics and checkpoints. Wait for that run to end, use another "
        f"--workdir, or, if that run is gone (its host was lost), delete the lock: {rm} {path}"
    )


def acquire(workdir: str, num_processes: int = 1) -> str:
    """Creates `WORKDIR/.lock` for this run; returns its path. Raises `WorkdirLockedError`."""
    path = lock_path(workdir)
    owner = _owner(num_processes)
    text = json.dumps(owner)
    for _ in range(2):  # a second try after taking over a stale lock
        if paths.is_url(path):
            p = paths.resolve(path)
            if not p.exists():
                paths.write_text(path, text)
                time.sleep(1.0)  # a concurrent writer's object replaces ours within this
                if _read(path).get("run_id") == owner["run_id"]:
                    break
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                break
        held = _read(path)
        if not _stale(held):
            raise _refuse(path, held)
        log.warning(
            "taking over the stale lock %s of pid %s on this host (that process is gone)",
            path,
            held.get("pid"),
        )
        paths.resolve(path).unlink(missing_ok=True)
    else:
        raise _refuse(path, _read(path))
    _held[path] = owner["run_id"]
    return path


def release(path: str) -> None:
    """Deletes the lock if this process holds it (never one another run took over)."""
    run_id = _held.pop(path, None)
    if run_id is None:
        return
    try:
        if _read(path).get("run_id") in (run_id, None):
            paths.resolve(path).unlink(missing_ok=True)
    except OSError as e:  # storage down at exit: the lock stays, the message says how to clear
        log.warning("could not delete the workdir lock %s: %s", path, e)


def release_all() -> None:
    """Releases every lock this process holds (before an `os._exit`, which skips `finally`)."""
    for path in list(_held):
        release(path)


@contextlib.contextmanager
def hold(workdir: str):
    """The workdir's lock for this run's process set: process 0 takes it (every process
    learns whether it could), and deletes it when the block ends."""
    path, err = None, None
    if multihost.is_primary():
        try:
            path = acquire(workdir, jax.process_count())
        except WorkdirLockedError as e:
            err = e
        except Exception as e:  # any filesystem's error (local, gcsfs): the user's to fix
            hint = " (gs:// needs the gcs extra and credentials)" if paths.is_url(workdir) else ""
            err = ConfigError(
                f"--workdir {workdir!r} is not writable{hint}: {type(e).__name__}: {e}"
            )
    if multihost.any_process(err is not None):
        raise err or WorkdirLockedError(
            f"the workdir is in use, or not writable: process 0 could not take the lock "
            f"{lock_path(workdir)} (its message says why); this process stops with it"
        )
    try:
        yield path
    except BaseException as e:
        if path is not None and not getattr(e, "exit_now", False):  # storage may not answer
            release(path)
        raise
    if path is not None:
        release(path)
