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

import os

from etils import epath


def is_url(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


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
