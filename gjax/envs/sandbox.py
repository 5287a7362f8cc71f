"""A sandbox for untrusted tool code: one fresh child process per call, bounded in time,
memory and output; nothing the policy writes is evaluated in the trainer's process.

`Sandbox.run(mode, source)` starts `python -I -S gjax/envs/_sandbox_child.py` (isolated: no
site-packages, no environment variables, no gjax), writes the source to its stdin and reads
its stdout and stderr while it runs. The bounds:
  * memory: the child sets RLIMIT_AS to `memory_mb` before it reads the source, so an
    allocation past it is a MemoryError (kind `memory`);
  * time: the parent kills the child's process group `timeout_s` after the start (kind
    `timeout`); the child's RLIMIT_CPU (`timeout_s` rounded up, + 1 s) ends it even if the
    parent cannot;
  * output: stdout is read in chunks and the child killed as soon as it passes
    `max_output_bytes` (kind `output`): a gigabyte of prints never reaches the trainer's
    memory; stderr (the error message) is capped the same way;
  * no file writes (RLIMIT_FSIZE 0), no new processes (RLIMIT_NPROC 0), no core files, and
    the child dies with its parent (PR_SET_PDEATHSIG).
At most `workers` children run at once (a semaphore; callers wait their turn). A fresh
process per call costs ~20 ms but keeps no state from one untrusted call to the next.

Why a child per call and these two modes (`calc`: an arithmetic AST walker; `python`: a
snippet with curated builtins and no `_` names): the walker cannot express anything but
arithmetic, yet arithmetic alone can run for hours (`9**9**9**9`) or fill memory, so it needs
the process bounds; the python mode is for code tools and shows the bounds on loops, large
allocations and floods of output. A builtins-free `exec` is not a security boundary on its
own; the process limits are. They do not cut the network: run untrusted-code tools on
machines where that matters inside a container or VM as well.

Every failure comes back as a `SandboxResult` with `kind` set; `run` raises only for a
closed sandbox or an unknown mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
MODES = ("calc", "python")
_STDERR_CAP = 4096


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one call produced: `kind` None (ok; `output` is its stdout) or one of
    `exception` (the code raised; `error` says what), `memory`, `timeout`, `output` (too much
    output), `crash` (the child died otherwise)."""

    output: str
    kind: str | None = None
    error: str = ""
    seconds: float = 0.0


class Sandbox:
    """Bounded child processes for untrusted code (see the module docstring)."""

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_bytes: int = 16_384,
        workers: int = 2,
    ):
        if not timeout_s > 0 or memory_mb < 16 or max_output_bytes < 1 or workers < 1:
            raise ValueError(
                f"Sandbox needs timeout_s > 0, memory_mb >= 16, max_output_bytes >= 1, "
                f"workers >= 1; got {timeout_s}, {memory_mb}, {max_output_bytes}, {workers}"
            )
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.workers = int(workers)
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._children: set[subprocess.Popen] = set()
        self._counts = {"runs": 0, "in_flight": 0, "max_in_flight": 0}
        self._closed = False

    def stats(self) -> dict[str, float]:
        """Runs so far, children running now and the most ever at once."""
        with self._lock:
            return dict(self._counts)

    def run(self, mode: str, source: str) -> SandboxResult:
        """Runs `source` in a fresh bounded child (blocks until it ends or is cut)."""
        if mode not in MODES:
            raise ValueError(f"unknown sandbox mode {mode!r}; valid modes: {', '.join(MODES)}")
        with self._slots:
            if self._closed:
                raise RuntimeError("Sandbox is closed")
            with self._lock:
                self._counts["runs"] += 1
                self._counts["in_flight"] += 1
                self._counts["max_in_flight"] = max(
                    self._counts["max_in_flight"], self._counts["in_flight"]
                )
            try:
                return self._run(mode, source)
            finally:
                with self._lock:
                    self._counts["in_flight"] -= 1

    def _run(self, mode: str, source: str) -> SandboxResult:
        t0 = time.perf_counter()
        cpu_s = math.ceil(self.timeout_s) + 1
        argv = [sys.executable, "-I", "-S", CHILD, mode, str(self.memory_mb << 20), str(cpu_s)]
        argv.append(str(os.getpid()))
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes all of it
            env={},
            cwd="/",
            close_fds=True,
        )
        with self._lock:
            self._children.add(proc)
        try:
            kind, out, err = self._talk(proc, source.encode("utf-8", "replace"), t0)
        finally:
            self._kill(proc)
            with self._lock:
                self._children.discard(proc)
        seconds = time.perf_counter() - t0
        text = out.decode("utf-8", "replace")
        message = err.decode("utf-8", "replace").strip()
        if kind is None:
            rc = proc.returncode
            if rc == 0:
                return SandboxResult(text, None, "", seconds)
            if rc == 1:
                kind = "exception"
            elif rc == 3:
                kind, message = "memory", f"ran out of its {self.memory_mb} MiB of memory"
            elif rc == -signal.SIGXCPU:
                kind, message = "timeout", f"used more than {cpu_s} s of CPU time"
            elif b"MemoryError" in err:  # CPython gave up outside Python code
                kind, message = "memory", f"ran out of its {self.memory_mb} MiB of memory"
            else:
                kind, message = "crash", f"the tool's process ended with status {rc}"
        elif kind == "timeout":
            message = f"did not finish within {self.timeout_s:g} s"
        elif kind == "output":
            message = f"printed more than {self.max_output_bytes} bytes"
        return SandboxResult("", kind, message, seconds)

    def _talk(self, proc: subprocess.Popen, source: bytes, t0: float):
        """Feeds stdin, reads stdout/stderr under the bounds; (kind or None, out, err)."""
        try:
            proc.stdin.write(source)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it died at once; its status says why
        out, err = bytearray(), bytearray()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        try:
            while sel.get_map():
                left = self.timeout_s - (time.perf_counter() - t0)
                if left <= 0:
                    return "timeout", b"", b""
                for key, _ in sel.select(timeout=left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = key.data
                    buf += chunk
                    if buf is out and len(out) > self.max_output_bytes:
                        return "output", b"", b""
                    if buf is err and len(err) > _STDERR_CAP:
                        del err[_STDERR_CAP:]
            left = self.timeout_s - (time.perf_counter() - t0)
            try:
                proc.wait(timeout=max(left, 0.001))
            except subprocess.TimeoutExpired:
                return "timeout", b"", b""
            return None, bytes(out), bytes(err)
        finally:
            sel.close()

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def close(self) -> None:
        """Kills children still running and refuses new calls (idempotent)."""
        self._closed = True
        with self._lock:
            children = list(self._children)
        for proc in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
