"""Test-wide setup: 8 fake CPU devices so sharding tests can build meshes; one compilation
cache for the session's processes."""

import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
# One persistent compilation cache for every process of the suite: this one and the
# `python -m gjax.train` subprocesses, which inherit the environment (and which rerun programs
# that an earlier test already compiled). Entries are keyed by the program, the compile options,
# the device count and the jax version, so a cache kept across sessions stays valid; the size
# limit (LRU eviction) also turns on jax's file lock, for processes that write at once.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"gjax-test-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# gcsfs reads this when imported: with it on, gcsfs asks the Storage Control gRPC API (which the
# GCS emulator of tests/gcs_emulator.py does not serve) for each bucket's type, 60 s per bucket.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from tests.gcs_emulator import gcs  # noqa: E402, F401 - fixture: a GCS emulator on 127.0.0.1


def pytest_collection_modifyitems(items):
    """The end-to-end (`slow`) tests first, in their files' order: with the suite's two
    workers (pytest-xdist, pyproject's addopts) the long ones start at once, instead of
    closing the run one after another while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# A worker process that dies (SIGABRT/SIGSEGV from native code: twice in ~15 CI runs, at
# different tests, each passing when rerun and in isolation: see README, Tests) takes its
# test with it. That test runs once more on a fresh worker; a second crash fails it. The rerun
# is counted in the summary line ("1 rerun") and named in the terminal summary.
_CRASHED: list[str] = []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem in _CRASHED:
        return  # crashed twice: failed
    _CRASHED.append(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
    return None


def pytest_terminal_summary(terminalreporter):
    if _CRASHED:
        terminalreporter.section("worker crashes")
        for nodeid in _CRASHED:
            terminalreporter.line(f"{nodeid}: its worker crashed; run once more on a fresh worker")
