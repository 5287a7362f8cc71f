"""The math-verify verifier: binary accuracy reward with per-item deadlines in a process pool.

Model outputs are untrusted input. A response such as ``\\boxed{10^{10^{10^{10}}}}`` or a
deeply nested expression can make SymPy run for hours or exhaust memory, and math-verify's
own timeout (``signal.alarm``) only works on the main thread of the main interpreter, so it
is useless inside the async reward pipeline. This module therefore:

1. disables math-verify's signal timeout (``parse(..., parsing_timeout=None)`` and
   ``verify(..., timeout_seconds=None)``; both accept ``None`` in math-verify 0.9), and
2. runs every item (extraction, parse of gold and prediction, ``verify``) in a worker
   process of a small pool (``forkserver`` context by default, ``spawn`` possible). The
   parent waits on the worker's pipe with a per-item deadline; a worker that overruns is
   killed (SIGKILL) and replaced, a worker that dies is replaced, and every worker is
   recycled after ``max_tasks_per_worker`` items (and after any exception) to bound memory.
   Workers also get an address-space limit (``worker_memory_mb``), so a huge integer is a
   ``MemoryError`` (a counted crash) rather than a swapping host.
3. ties every worker's life to its owner (the process that created the Verifier), so a
   trainer killed with SIGKILL leaves no worker burning CPU on a pathological item: on Linux
   the worker asks for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``; its parent
   is the forkserver, which exits with the owner, or the owner itself with ``spawn``); a
   watchdog thread exits when the owner is gone (covers platforms without prctl, as long as
   the item lets go of the GIL); and a per-item RLIMIT_CPU of ``timeout_s + cpu_slack_s``
   (the parent kills at ``timeout_s``) ends a runaway item whatever else failed.

A timed-out, crashing or unparseable item scores 0 and is counted in :meth:`Verifier.stats`;
nothing is raised into the training loop except programming errors (mismatched lengths,
use after :meth:`Verifier.close`).

Size limits (applied in the parent before anything is sent to a worker):
  * a response longer than ``max_response_chars`` keeps only its LAST ``max_response_chars``
    characters (the final answer lives at the end); counted as ``truncated``;
  * bytes are decoded as UTF-8 with replacement; lone surrogates are replaced by ``?``;
  * an extracted answer longer than ``max_answer_chars`` is refused (score 0, ``refused``),
    and so is a gold answer longer than ``max_answer_chars``.

Outcomes (exactly one per item, counted): ``correct`` (the only one scoring 1), ``wrong``,
``no_answer`` (no extractor matched), ``refused`` (size limits), ``parse_failure`` /
``gold_parse_failure`` (math-verify built no expression, only its raw-string fallback, and
the strings differ), ``timeout`` (deadline), ``crash`` (the worker died or raised).

Answers are extracted by ``VerifierConfig.extractors`` (gjax/answers.py, tried in
order, the first hit wins) and handed to ``math_verify.parse`` as ``\\boxed{answer}`` (LaTeX)
unless they already contain math delimiters (unescaped ``$``, ``\\(``, ``\\[``, ``\\boxed``), in which
case math-verify extracts from them. Gold answers are treated the same way. Then
``math_verify.verify(gold, pred)`` decides (gold first: verify is not symmetric).

Worker processes are started with ``forkserver`` (or ``spawn``), never ``fork`` (the parent
runs JAX threads). As with any such pool, a script that creates a Verifier must keep its
entry point under ``if __name__ == "__main__":``; the workers import the main module (for
``python -m gjax.train`` that is ``gjax.train`` and its imports: a slower worker start, not
a correctness problem).

Example::

    with Verifier(VerifierConfig(timeout_s=2.0)) as v:
        v.score(["... so the answer is \\\\boxed{\\\\frac{1}{2}}"], ["0.5"])  # array([1.], float32)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import resource
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing import forkserver
from typing import Any

import numpy as np

from gjax.answers import EXTRACTORS, extract_answer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Handing answers to math-verify
# --------------------------------------------------------------------------------------

# Unescaped $, \( or \[, or a box command: math-verify extracts from such text itself.
_MATH_DELIMITER_RE = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")


def _to_parse_input(answer: str) -> str:
    """LaTeX answers go to math-verify as ``\\boxed{...}``; delimited text as is."""
    if _MATH_DELIMITER_RE.search(answer):
        return answer
    return "\\boxed{" + answer + "}"


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    """Verifier settings (all static; see the module docstring for the policies).

    Attributes:
      extractors: extractor names tried in order (``boxed``, ``answer_tag``, ``regex``,
        ``math_verify``).
      answer_regex: pattern for the ``regex`` extractor (group 1 is the answer). It runs in
        the workers, so a catastrophic-backtracking pattern is bounded by the deadline too.
      timeout_s: per-item deadline (seconds from dispatch to a worker to its reply).
      num_workers: worker processes (and dispatcher threads).
      max_tasks_per_worker: recycle a worker after this many items (bounds memory growth).
      max_response_chars: longer responses keep only their last this-many characters.
      max_answer_chars: longer extracted (or gold) answers are refused (score 0).
      worker_memory_mb: RLIMIT_AS of each worker in MiB (None: no limit).
      float_rounding, numeric_precision, strict: passed to ``math_verify.verify``.
      start_method: ``forkserver`` (fast replacement: math-verify is preloaded) or ``spawn``.
      startup_timeout_s: how long to wait for a new worker to come up.
      gold_cache_size: parsed gold answers kept per worker (each gold recurs G times).
      cpu_slack_s: CPU seconds past ``timeout_s`` before a worker's RLIMIT_CPU ends its item
        (a backstop: the parent kills an overrunning worker at the deadline).
    """

    extractors: tuple[str, ...] = ("boxed", "answer_tag")
    answer_regex: str | None = None
    timeout_s: float = 5.0
    num_workers: int = 2
    max_tasks_per_worker: int = 1000
    max_response_chars: int = 32_768
    max_answer_chars: int = 1_024
    worker_memory_mb: int | None = 2_048
    float_rounding: int = 6
    numeric_precision: int = 15
    strict: bool = True
    start_method: str = "forkserver"
    startup_timeout_s: float = 60.0
    gold_cache_size: int = 4_096
    cpu_slack_s: float = 10.0

    def __post_init__(self):
        if not self.extractors:
            raise ValueError("VerifierConfig.extractors must name at least one extractor")
        for name in self.extractors:
            if name != "regex" and name not in EXTRACTORS:
                valid = ", ".join([*EXTRACTORS.names(), "regex"])
                raise ValueError(f"unknown answer extractor {name!r}; valid names: {valid}")
        if "regex" in self.extractors and not self.answer_regex:
            raise ValueError("extractor 'regex' needs VerifierConfig.answer_regex")
        if self.answer_regex is not None:
            re.compile(self.answer_regex)  # fail fast on a bad pattern
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.max_tasks_per_worker < 1:
            raise ValueError(f"max_tasks_per_worker must be >= 1, got {self.max_tasks_per_worker}")
        if not self.cpu_slack_s >= 0:
            raise ValueError(f"cpu_slack_s must be >= 0, got {self.cpu_slack_s}")
        if self.max_response_chars < 1 or self.max_answer_chars < 1:
            raise ValueError("max_response_chars and max_answer_chars must be >= 1")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn' (fork is unsafe with JAX "
                f"threads), got {self.start_method!r}"
            )


# --------------------------------------------------------------------------------------
# Worker process side
# --------------------------------------------------------------------------------------

# Item outcomes (the worker reports one; the parent adds "timeout" and "crash").
CORRECT = "correct"
WRONG = "wrong"
NO_ANSWER = "no_answer"
REFUSED = "refused"
PARSE_FAILURE = "parse_failure"
GOLD_PARSE_FAILURE = "gold_parse_failure"
ERROR = "error"
TIMEOUT = "timeout"
CRASH = "crash"


def _score_one(response: str, gold: str, cfg: VerifierConfig, gold_cache, regex) -> str:
    """Outcome of one (response, gold) pair; runs inside a worker."""
    from math_verify import parse, verify  # deferred: imported in the worker processes

    answer, _ = extract_answer(response, cfg.extractors, regex)
    if answer is None:
        return NO_ANSWER
    if len(answer) > cfg.max_answer_chars:
        return REFUSED
    gold_parsed = gold_cache.get(gold)
    if gold_parsed is None:
        gold_parsed = parse(_to_parse_input(gold), parsing_timeout=None)
        gold_cache[gold] = gold_parsed
        if len(gold_cache) > cfg.gold_cache_size:
            gold_cache.popitem(last=False)
    else:
        gold_cache.move_to_end(gold)
    if not gold_parsed:
        return GOLD_PARSE_FAILURE
    pred_parsed = parse(_to_parse_input(answer), parsing_timeout=None)
    if not pred_parsed:
        return PARSE_FAILURE
    ok = verify(
        gold_parsed,
        pred_parsed,
        float_rounding=cfg.float_rounding,
        numeric_precision=cfg.numeric_precision,
        strict=cfg.strict,
        timeout_seconds=None,
    )
    if ok:
        return CORRECT
    # math-verify falls back to the raw string when it cannot build an expression; such an
    # answer only matches by exact string equality. Count it as a parse failure, not "wrong".
    if all(isinstance(x, str) for x in gold_parsed):
        return GOLD_PARSE_FAILURE
    if all(isinstance(x, str) for x in pred_parsed):
        return PARSE_FAILURE
    return WRONG


_WARM_UP_PAIRS = (
    ("\\boxed{1}", "1"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "0.7071067811865476"),
    ("\\boxed{(1,2]}", "\\{1,2\\}"),
    ("\\boxed{x=1, y=2}", "(1,2)"),
    ("\\boxed{10\\%}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
)
_warm = False


def warm_up() -> None:
    """Run a few symbolic comparisons so SymPy's lazy imports happen now (idempotent)."""
    global _warm
    if _warm:
        return
    import math_verify.grader  # deferred: imported in the worker processes
    import math_verify.parser

    # We disable math-verify's signal timeout on purpose (the parent enforces deadlines);
    # silence its one-time warning about that, and its per-item debug/warning logs.
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    cfg = VerifierConfig()
    for response, gold in _WARM_UP_PAIRS:
        _score_one(response, gold, cfg, collections.OrderedDict(), None)
    _warm = True


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a SIGKILLed, unreaped owner)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _die_with_owner(owner_pid: int) -> None:
    """In a worker: SIGKILL when the parent dies (Linux), and a watchdog on the owner."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    # A forkserver child inherits the owner's end of the forkserver's "alive" pipe (for
    # children of its own); the forkserver only exits on EOF there, so a worker holding it
    # would keep its parent, hence itself, alive forever. Workers start no processes.
    alive_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    if not _pid_alive(owner_pid):  # the owner died before the signal was armed
        os._exit(1)

    def watch():
        while _pid_alive(owner_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="gjax-verifier-watchdog", daemon=True).start()


def _cpu_limit_next_item(budget_s: float) -> None:
    """Soft RLIMIT_CPU = CPU used so far + ``budget_s``: SIGXCPU (default: terminate) ends
    a runaway item even with no parent left to kill it. The hard limit is left alone, so the
    soft one can move up again before the next item."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + budget_s) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _worker_main(
    conn: multiprocessing.connection.Connection,
    cfg: VerifierConfig,
    owner_pid: int | None = None,
) -> None:
    """Worker loop: ``(response, gold)`` in, ``(outcome, detail)`` out; ``None`` stops it.

    ``owner_pid``: the Verifier's process; when given (a real worker process), the worker dies
    with it and each item runs under a CPU-time limit (module docstring, point 3).
    """
    if owner_pid is not None:
        _die_with_owner(owner_pid)
        with contextlib.suppress(ValueError, OSError):  # SIGXCPU must not write core files
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg.worker_memory_mb is not None:
        limit = int(cfg.worker_memory_mb) * 1024 * 1024
        # An already-lower hard limit raises: keep the existing one then.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    regex = re.compile(cfg.answer_regex) if cfg.answer_regex else None
    gold_cache: collections.OrderedDict = collections.OrderedDict()
    try:
        warm_up()  # a no-op when forked from the (already warm) forkserver
        conn.send(("ready", None))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            response, gold = msg
            if owner_pid is not None:
                _cpu_limit_next_item(cfg.timeout_s + cfg.cpu_slack_s)
            try:
                out = (_score_one(response, gold, cfg, gold_cache, regex), None)
            except Exception as e:  # noqa: BLE001 (an item must never kill the loop)
                out = (ERROR, f"{type(e).__name__}: {str(e)[:300]}")
            conn.send(out)
    except (EOFError, ConnectionError, KeyboardInterrupt):  # the owner closed or died: quietly
        pass
    finally:
        conn.close()


# --------------------------------------------------------------------------------------
# Parent side: one worker slot
# --------------------------------------------------------------------------------------


class _WorkerDied(Exception):
    pass


class _WorkerGone(_WorkerDied):
    """The worker had exited before it read the item (not the item's fault)."""


class _ItemTimeout(Exception):  # not TimeoutError: that one is an OSError subclass
    pass


class _Slot:
    """One worker process and its pipe; restarted lazily by the dispatcher that holds it."""

    def __init__(self, ctx, cfg: VerifierConfig):
        self._ctx = ctx
        self._cfg = cfg
        self._owner = os.getpid()
        self.proc = None
        self.conn = None
        self.tasks = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def start(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._cfg, self._owner),
            daemon=True,
            name="gjax-verifier",
        )
        proc.start()
        child_conn.close()
        self.proc, self.conn, self.tasks = proc, parent_conn, 0
        try:
            if not parent_conn.poll(self._cfg.startup_timeout_s):
                raise _WorkerDied(
                    f"verifier worker did not start within {self._cfg.startup_timeout_s}s"
                )
            tag, _ = parent_conn.recv()
            if tag != "ready":
                raise _WorkerDied(f"unexpected verifier worker greeting {tag!r}")
        except (EOFError, OSError, _WorkerDied):
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)
            if hasattr(self.proc, "close") and not self.proc.is_alive():
                self.proc.close()
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    def stop(self) -> None:
        """Graceful stop (recycling, close); falls back to kill."""
        if self.alive():
            try:
                self.conn.send(None)
                self.proc.join(timeout=1)
            except (OSError, EOFError, BrokenPipeError):
                pass
        self.kill()

    def run(self, payload, timeout_s: float):
        """Send one item; ``(outcome, detail)`` or raise _ItemTimeout / _WorkerDied."""
        # A worker that exited before reading the item leaves it unread in its socket: the
        # send fails (EPIPE) or the read is reset (ECONNRESET, Linux AF_UNIX). One that read
        # the item and died on it closes a drained socket: a plain EOF.
        try:
            self.conn.send(payload)
            if not self.conn.poll(timeout_s):
                raise _ItemTimeout
            out = self.conn.recv()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _WorkerGone(f"{type(e).__name__}: {e}") from None
        except (EOFError, OSError) as e:
            raise _WorkerDied(f"{type(e).__name__}: {e}") from None
        self.tasks += 1
        return out


# --------------------------------------------------------------------------------------
# The Verifier
# --------------------------------------------------------------------------------------

_COUNTERS = (
    "batches",
    "calls",
    "correct",
    "wrong",
    "no_answer",
    "refused",
    "parse_failures",
    "gold_parse_failures",
    "timeouts",
    "crashes",
    "worker_errors",
    "worker_deaths",
    "worker_starts",
    "worker_recycles",
    "truncated",
    "in_flight",  # a gauge: items at a worker right now
)
_OUTCOME_COUNTER = {
    CORRECT: "correct",
    WRONG: "wrong",
    NO_ANSWER: "no_answer",
    REFUSED: "refused",
    PARSE_FAILURE: "parse_failures",
    GOLD_PARSE_FAILURE: "gold_parse_failures",
    TIMEOUT: "timeouts",
}


def _sanitize(text: Any, max_chars: int) -> tuple[str, bool]:
    """Untrusted response -> a valid str of at most ``max_chars`` (its tail)."""
    if text is None:
        return "", False
    if isinstance(text, bytes | bytearray | memoryview):
        text = bytes(text)[-4 * max_chars :].decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = str(text)
    truncated = len(text) > max_chars
    if truncated:
        text = text[-max_chars:]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (e.g. from a bad detokenizer)
        text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text, truncated


class Verifier:
    """Binary accuracy by math-verify, bounded per item, safe from any thread.

    ``score(responses, answers) -> float32[B]`` is synchronous and thread-safe;
    ``await ascore(...)`` is the same without blocking an event loop. Item outcomes
    (``correct``, ``wrong``, ``no_answer``, ``refused``, ``parse_failure``,
    ``gold_parse_failure``, ``timeout``, ``crash``) are available per call through
    :meth:`score_detailed` and in aggregate through :meth:`stats`. Only ``correct`` scores 1.

    Use as a context manager, or call :meth:`close` (workers are daemon processes, so an
    unclosed verifier does not keep the interpreter alive).
    """

    def __init__(self, config: VerifierConfig | None = None, **overrides):
        cfg = config or VerifierConfig()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        if multiprocessing.current_process().daemon:
            raise RuntimeError(
                "Verifier needs worker processes, which a daemonic process (e.g. a "
                "multiprocessing.Pool worker) may not start: create the Verifier in the main "
                "process or a non-daemonic child, and call it from threads or asyncio there"
            )
        ctx = multiprocessing.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            # New workers fork from a server that already imported and warmed math-verify and
            # SymPy, so a killed worker is replaced in milliseconds. (No effect if the server
            # is already running; the workers then warm up themselves.)
            ctx.set_forkserver_preload(["gjax.rewards._verifier_warmup"])
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._latency_sum = 0.0
        self._latency_max = 0.0
        self._latencies: collections.deque[float] = collections.deque(maxlen=4096)
        self._closed = False
        self._idle: collections.deque[_Slot] = collections.deque()
        self._idle_cv = threading.Condition()
        self._slots = [_Slot(ctx, cfg) for _ in range(cfg.num_workers)]
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=cfg.num_workers, thread_name_prefix="gjax-verifier"
        )
        try:
            # Start all workers concurrently (import time overlaps).
            list(self._executor.map(self._start_slot, self._slots))
        except BaseException:
            self.close()
            raise
        self._idle.extend(self._slots)

    # -- bookkeeping ---------------------------------------------------------------------

    def _start_slot(self, slot: _Slot) -> None:
        slot.start()
        with self._lock:
            self._counts["worker_starts"] += 1

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def stats(self) -> dict[str, float]:
        """A snapshot of the counters (items, outcomes, pool events, latency in seconds)."""
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            n = len(self._latencies)
            lat = np.sort(np.fromiter(self._latencies, dtype=np.float64, count=n))
            out["latency_s_mean"] = self._latency_sum / max(self._counts["calls"], 1)
            out["latency_s_max"] = self._latency_max
        out["latency_s_p50"] = float(lat[n // 2]) if n else 0.0
        out["latency_s_p95"] = float(lat[min(n - 1, int(0.95 * n))]) if n else 0.0
        return out

    def worker_pids(self) -> list[int | None]:
        """Process ids of the workers (None for a slot waiting to be restarted)."""
        pids: list[int | None] = []
        for slot in self._slots:
            proc = slot.proc  # read once: a dispatcher may be replacing it right now
            try:
                pids.append(proc.pid if proc is not None and proc.is_alive() else None)
            except ValueError:  # closed by a concurrent kill()
                pids.append(None)
        return pids

    # -- the per-item path (runs on a dispatcher thread) -------------------------------

    def _acquire(self) -> _Slot:
        with self._idle_cv:
            while not self._idle:
                self._idle_cv.wait()
            return self._idle.popleft()

    def _release(self, slot: _Slot) -> None:
        with self._idle_cv:
            self._idle.append(slot)
            self._idle_cv.notify()

    def _run_item(self, response: str, gold: str) -> str:
        slot = self._acquire()
        outcome = CRASH
        t0 = time.perf_counter()
        try:
            for attempt in range(2):
                if not slot.alive():
                    if slot.proc is not None:  # died between items (e.g. killed from outside)
                        self._count("worker_deaths")
                        slot.kill()
                    self._start_slot(slot)
                t0 = time.perf_counter()
                self._count("in_flight")
                try:
                    outcome, detail = slot.run((response, gold), self.config.timeout_s)
                except _ItemTimeout:
                    outcome = TIMEOUT
                    slot.kill()
                except _WorkerGone:
                    # Died between items, but its exit was not visible yet (a forkserver
                    # child's `is_alive` lags by milliseconds): replace it, send again once.
                    self._count("worker_deaths")
                    slot.kill()
                    if attempt == 0:
                        continue
                    outcome = CRASH
                    logger.warning("two verifier workers in a row were gone; item scored 0")
                except _WorkerDied as e:
                    outcome = CRASH
                    self._count("worker_deaths")
                    logger.warning("verifier worker died on an item (%s); replacing it", e)
                    slot.kill()
                finally:
                    self._count("in_flight", -1)
                break
            if outcome == ERROR:
                outcome = CRASH
                self._count("worker_errors")
                logger.warning("verifier item raised in the worker: %s", detail)
                slot.stop()  # state after e.g. MemoryError is suspect: recycle
                self._count("worker_recycles")
            elif slot.tasks >= self.config.max_tasks_per_worker:
                slot.stop()
                self._count("worker_recycles")
        except Exception as e:  # noqa: BLE001 (e.g. a replacement worker failed to start)
            logger.warning("verifier worker unavailable (%s); item scored 0", e)
            slot.kill()
            outcome = CRASH
        finally:
            latency = time.perf_counter() - t0
            with self._lock:
                self._counts["calls"] += 1
                self._counts["crashes" if outcome == CRASH else _OUTCOME_COUNTER[outcome]] += 1
                self._latency_sum += latency
                self._latency_max = max(self._latency_max, latency)
                self._latencies.append(latency)
            self._release(slot)
        return outcome

    # -- public API -----------------------------------------------------------------------

    def _prepare(self, responses: Sequence[Any], answers: Sequence[Any]):
        if self._closed:
            raise RuntimeError("Verifier is closed")
        if isinstance(responses, str | bytes) or isinstance(answers, str | bytes):
            raise TypeError("responses and answers must be sequences of strings, not a string")
        if len(responses) != len(answers):
            raise ValueError(
                f"got {len(responses)} responses but {len(answers)} answers; pass one ground "
                "truth per response (repeat each prompt's answer G times)"
            )
        items = []
        n_trunc = 0
        for r, a in zip(responses, answers):
            r, truncated = _sanitize(r, self.config.max_response_chars)
            a, _ = _sanitize(a, 4 * self.config.max_answer_chars)
            n_trunc += truncated
            items.append((r, a))
        with self._lock:
            self._counts["batches"] += 1
            self._counts["truncated"] += n_trunc
        return items

    def _submit(self, item: tuple[str, str]):
        response, gold = item
        if len(gold.strip()) == 0 or len(gold) > self.config.max_answer_chars:
            # Refused without a worker round trip (a data problem, never the policy's fault).
            fut: concurrent.futures.Future = concurrent.futures.Future()
            with self._lock:
                self._counts["calls"] += 1
                self._counts["gold_parse_failures"] += 1
            fut.set_result(GOLD_PARSE_FAILURE)
            return fut
        return self._executor.submit(self._run_item, response, gold)

    def score_detailed(self, responses: Sequence[Any], answers: Sequence[Any]) -> list[str]:
        """Per-item outcome names (see the class docstring)."""
        futures = [self._submit(it) for it in self._prepare(responses, answers)]
        return [f.result() for f in futures]

    def score(self, responses: Sequence[Any], answers: Sequence[Any]) -> np.ndarray:
        """``float32[B]``: 1.0 where the response's final answer equals the ground truth."""
        return _to_rewards(self.score_detailed(responses, answers))

    async def ascore_detailed(self, responses: Sequence[Any], answers: Sequence[Any]) -> list[str]:
        futures = [self._submit(it) for it in self._prepare(responses, answers)]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def ascore(self, responses: Sequence[Any], answers: Sequence[Any]) -> np.ndarray:
        """Awaitable :meth:`score`; the work runs on the pool, the event loop stays free."""
        return _to_rewards(await self.ascore_detailed(responses, answers))

    def close(self) -> None:
        """Stop the dispatchers and the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        for slot in self._slots:
            slot.stop()

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; close() is the supported way
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Verifier(workers={c.num_workers}, timeout_s={c.timeout_s}, "
            f"extractors={c.extractors}, closed={self._closed})"
        )


def _to_rewards(outcomes: Sequence[str]) -> np.ndarray:
    return np.fromiter((o == CORRECT for o in outcomes), dtype=np.float32, count=len(outcomes))
