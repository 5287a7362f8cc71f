"""Where a run's files live: a local directory or a URL (gs://), named and written one way.

Every gjax command takes paths as a user types them: `workdirs/a_grae`, `~/runs/x`,
`gs://BUCKET/runs/x`. `resolve` turns each into an `etils.epath.Path`: local paths become
absolute (orbax and tensorstore refuse relative ones), URLs pass through unchanged. Files are
then read and written through epath, so `gs://` goes through gcsfs (the `gcs` extra) and
checkpoints through orbax's tensorstore gcs driver; there is no gjax-specific GCS code. Point
both at a GCS emulator by environment only (`STORAGE_EMULATOR_HOST` for gcsfs and
google-cloud-storage, `TENSORSTORE_GCS_HTTP_URL` for tensorstore), as `tests/test_gcs.py` does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from gjax.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageError(UserError, RuntimeError):
    """A path on storage that this installation cannot reach (a missing extra)."""


class StorageUnavailable(StorageError):
    """Storage kept failing (or did not answer) for the whole bound; nothing more can be
    written, so the process exits at once after its paragraph (`exit_now`)."""

    exit_now = True


def bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` on a daemon thread, waited for at most `timeout_s`: its result or its exception,
    or `TimeoutError` (the thread is left behind: a call stuck on storage cannot be stopped)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="gjax-storage")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def with_retries(
    fn: Callable[[], T], *, what: str, timeout_s: float, then: Callable[[], str] | None = None
) -> T:
    """`fn()`, retried with exponential backoff (1 s, doubling, at most 30 s between tries)
    while it fails, for at most `timeout_s` in all (a try that hangs counts too). Past the
    bound: `StorageUnavailable` saying `what` failed and why, followed by `then()` (e.g. the
    last intact checkpoint)."""
    start, delay, tries = time.monotonic(), 1.0, 0
    while True:
        left = timeout_s - (time.monotonic() - start)
        tries += 1
        try:
            return bounded(fn, max(left, 0.1))
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            reason = f"{type(e).__name__}: {reason}" if reason else type(e).__name__
            left = timeout_s - (time.monotonic() - start)
            if left <= delay:
                raise StorageUnavailable(
                    f"{what} kept failing for {time.monotonic() - start:.0f} s ({tries} tr{'y' if tries == 1 else 'ies'}, "
                    f"the last: {reason}); the storage is unreachable or refuses the write, "
                    f"so the run stopped (bound: config.train.storage_timeout_s={timeout_s:g})."
                    + (f" {then()}" if then else "")
                ) from None
            log.warning("%s failed (%s); retrying in %.0f s", what, reason, delay)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


def is_url(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


def require_backend(path: str | os.PathLike | None, flag: str) -> None:
    """Fails with one paragraph when `path` (the value of `flag`) is on Cloud Storage and gcsfs,
    which epath reads gs:// through, is not installed (the `gcs` extra)."""
    if path is None or not os.fspath(path).startswith("gs://"):
        return
    try:
        import gcsfs  # noqa: F401 - optional dependency (the gcs extra)
    except ImportError as e:
        raise StorageError(
            f"{flag}={os.fspath(path)} is on Google Cloud Storage, which needs the gcs extra "
            f"(gcsfs; here: {type(e).__name__}: {e}). Install it with pip install -e '.[gcs]' "
            "(from the gjax checkout; or pip install gcsfs), then rerun."
        ) from None


def resolve(path: str | os.PathLike) -> epath.Path:
    """`path` as an epath: a URL unchanged, a local path absolute with `~` expanded."""
    path = os.fspath(path)
    if is_url(path):
        return epath.Path(path)
    return epath.Path(os.path.abspath(os.path.expanduser(path)))


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes a whole (small) file, local or remote; creates the parent directory."""
    p = resolve(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def read_text(path: str | os.PathLike) -> str:
    return resolve(path).read_text()
