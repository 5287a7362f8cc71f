"""One run per workdir: the lock is taken atomically, refused while its owner may be alive,
taken over from a dead process of this host, released at the end (local and gs://)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from gjax import runlock


def _owner(path):
    with open(path) as f:
        return json.load(f)


def _lock(workdir, **owner):
    path = runlock.lock_path(str(workdir))
    base = {"run_id": "other", "host": socket.gethostname(), "pid": os.getpid(), "processes": 2}
    with open(path, "w") as f:
        json.dump({**base, **owner}, f)
    return path


def test_hold_creates_and_releases_the_lock(tmp_path):
    path = runlock.lock_path(str(tmp_path / "wd"))
    with runlock.hold(str(tmp_path / "wd")) as held:
        assert held == path
        owner = _owner(path)
        assert owner["pid"] == os.getpid() and owner["processes"] == 1
        with pytest.raises(runlock.WorkdirLockedError) as e:  # a second run in the same dir
            runlock.acquire(str(tmp_path / "wd"))
    assert not os.path.exists(path)
    msg = str(e.value)
    assert path in msg and f"rm {path}" in msg and f"pid {os.getpid()}" in msg
    assert "\n" not in msg  # one paragraph


@pytest.mark.parametrize("owner", [{}, {"host": "another-host", "pid": 1}])
def test_a_live_or_unknowable_owner_is_refused(tmp_path, owner):
    path = _lock(tmp_path, **owner)  # this (live) process, or a process of another host
    with pytest.raises(runlock.WorkdirLockedError, match="the workdir is in use"):
        runlock.acquire(str(tmp_path))
    assert _owner(path)["run_id"] == "other"  # left as it was


def test_a_dead_local_owners_lock_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = _lock(tmp_path, pid=dead.pid)
    assert runlock.acquire(str(tmp_path)) == path
    assert _owner(path)["pid"] == os.getpid()
    assert "stale lock" in caplog.text
    runlock.release(path)
    assert not os.path.exists(path)


def test_release_leaves_a_lock_another_run_took_over(tmp_path):
    path = runlock.acquire(str(tmp_path))
    _lock(tmp_path, run_id="newer")  # e.g. taken over by hand while this run hung
    runlock.release_all()
    assert _owner(path)["run_id"] == "newer"


def test_gcs_workdir_lock(gcs):
    fs, _ = gcs
    workdir = "gs://bucket/locked_run"
    with runlock.hold(workdir) as path:
        assert fs.exists(path.removeprefix("gs://"))
        with pytest.raises(runlock.WorkdirLockedError, match="gcloud storage rm gs://"):
            runlock.acquire(workdir)
    assert not fs.exists(path.removeprefix("gs://"))
