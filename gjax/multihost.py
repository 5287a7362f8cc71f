"""Multi-controller runs: `jax.distributed` start-up and the few host-level exchanges.

Every process runs the same program on its own devices (no Pathways, no Ray). A rollout
batch's rows are split into contiguous blocks, one per process, in the order the mesh lays
the batch axes over the processes (`RowLayout`): each process loads, samples, decodes and
scores only its block, and the global arrays are assembled from the blocks with
`jax.make_array_from_process_local_data`. Host-level exchanges are few and small:
group-level arrays (`*_PxG`: rewards, scores, flags) and per-step host metrics are
all-gathered (`gather_rows`, `combine_metrics`), selection counts and the stop flag agree
through `allgather`. With one process every function here is the identity.

Collectives (and so `allgather`, a jitted program over every process's devices) must be
issued in the same order on every process. A second thread that exchanges (the rollout
producer, `gjax.rollout.producer`) uses `KeyValueGather` instead: named keys in jax's
coordination store, which no other thread's calls can pair with, and `LocalRows` for its
rows, which never leave the process.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # the coordination client jax made
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from gjax.errors import UserError, format_user_error

log = logging.getLogger(__name__)


class DistributedError(UserError, RuntimeError):
    """A multi-process setup that cannot work (flags, environment or mesh)."""


ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
PEER_TIMEOUT_S = 300  # default of --peer_timeout_s: how long start-up waits for every process
PEER_DEAD_S = 30.0  # gjax's PeerWatch: a peer silent this long is dead; the survivors exit
HEARTBEAT_TIMEOUT_S = 100  # jax's own (it aborts the process): later than PeerWatch, always
WAITING_NOTE_S = 5.0  # start-up says it is waiting for peers after this, then every 30 s
# Default of --collective_timeout_s: how long a CPU (gloo) collective waits for a live peer
# still compiling or loading. A dead peer is found sooner, by PeerWatch (PEER_DEAD_S).
COLLECTIVE_TIMEOUT_S = 1800


def requested(jax_distributed: bool = False, coordinator_address: str | None = None) -> bool:
    """Whether this is meant to be a multi-process run: `--jax_distributed`, a coordinator
    flag, or any of the `JAX_*` variables in the environment (never silently one process)."""
    return bool(jax_distributed or coordinator_address) or any(os.environ.get(v) for v in ENV_VARS)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    peer_timeout_s: int = PEER_TIMEOUT_S,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S,
    peer_dead_s: float = PEER_DEAD_S,
    on_peer_failure: Callable[[str], None] | None = None,
) -> PeerWatch | None:
    """`jax.distributed.initialize` from flags, else the environment, else auto-detection.

    On TPU VMs (and SLURM / Open MPI / Kubernetes) JAX finds all three by itself. Elsewhere
    give them as flags or as `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`.
    CPU collectives across processes go through gloo.

    Faults end within bounded time. While peers are missing a line says so after
    `WAITING_NOTE_S` (then every 30 s); after `peer_timeout_s` the process prints a
    `DistributedError` paragraph naming the flags and exits 2 (jax, whose own time-out is set
    later, would abort with a C++ fatal error and no Python exception). Once running, with
    `on_peer_failure` a `PeerWatch` is returned: a peer silent for `peer_dead_s` (killed,
    host lost) makes it call `on_peer_failure(reason)` on its thread (which should print what
    to do and `os._exit`); jax itself aborts after `heartbeat_timeout_s`. A CPU (gloo)
    collective waits `collective_timeout_s` for a peer that is alive but late (compiling a
    program the other already runs, under load): XLA's own time-out, set here rather than
    left to jaxlib's default; one that still times out raises, and the caller says what to
    do (`gjax.train.collective_faults`: a `CollectiveFailed` paragraph).
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    given = [x is not None for x in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise DistributedError(
            "multi-process setup is incomplete: give all of --coordinator_address, "
            "--num_processes and --process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
            "JAX_PROCESS_ID), or none of them on a TPU VM, where JAX detects them; got "
            f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r}"
        )
    if all(given) and not 0 <= process_id < num_processes:
        raise DistributedError(
            f"--process_id={process_id} must be in [0, --num_processes={num_processes})"
        )
    # Cross-process collectives of the CPU backend (harmless where an accelerator runs them).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    set_collective_timeout(collective_timeout_s)
    who = (
        f"process {process_id} of {num_processes}" if all(given) else "this process"
    ) + f" (coordinator {coordinator_address or 'auto-detected'})"
    done = threading.Event()
    t0 = time.monotonic()

    def watch_start_up():
        # jax aborts the process (a C++ fatal error, no Python exception) when its own
        # initialization_timeout passes, so gjax gives up first, from this thread.
        note = WAITING_NOTE_S  # seconds after t0 of the next "waiting" line
        while not done.wait(max(min(note, peer_timeout_s) - (time.monotonic() - t0), 0.0)):
            waited = time.monotonic() - t0
            if waited >= peer_timeout_s:
                _exit_now(
                    DistributedError(
                        f"{who}: not every process joined within --peer_timeout_s="
                        f"{peer_timeout_s} s. Start all processes within that time of each "
                        "other, each with the same --coordinator_address=HOST:PORT (process 0's "
                        "host, a port free there) and --num_processes=N and its own "
                        "--process_id=0..N-1 (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                        "JAX_PROCESS_ID), or raise --peer_timeout_s."
                    )
                )
            if waited >= note:
                log.warning(
                    "%s: waiting %.0f s so far for the other processes to join; giving up "
                    "after --peer_timeout_s=%d",
                    who,
                    waited,
                    peer_timeout_s,
                )
                note += 30.0

    threading.Thread(target=watch_start_up, daemon=True, name="gjax-peers").start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=int(peer_timeout_s) + 60,  # gjax's bound comes first
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
        )
    finally:
        done.set()
    if on_peer_failure is None or jax.process_count() == 1:
        return None
    return PeerWatch(on_peer_failure, dead_after_s=peer_dead_s)


COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def set_collective_timeout(seconds: int) -> None:
    """How long XLA's CPU collectives (gloo) wait for the other processes, through XLA_FLAGS,
    which XLA reads once, when the first backend starts (so: before any jax computation). A
    value the user put in XLA_FLAGS is kept."""
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if COLLECTIVE_TIMEOUT_FLAG not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} {COLLECTIVE_TIMEOUT_FLAG}={int(seconds)}".strip()


class CollectiveFailed(DistributedError):
    """A cross-process operation failed, or timed out, while every process was still alive."""


class PeerWatch:
    """Notices a dead peer within `dead_after_s` and calls `on_failure(reason)` (on its thread).

    Every process bumps a counter under `gjax/beat/<index>` in jax's coordination key-value
    store every `BEAT_S` and reads everyone's; a peer whose counter has not moved for
    `dead_after_s`, or a coordinator that has not answered for as long, is dead. Reading the
    store is jax's own channel, but the decision is gjax's: jax's own heartbeat timeout is set
    longer, so jax does not abort the process first (its `missed_heartbeat_callback` cannot be
    given from Python in jax 0.10: the status it passes does not convert, std::bad_cast). The
    beats go on while the process exits normally (jax's shutdown barrier), so a slower peer
    finishing its evaluation is never taken for dead.

    Not covered: when process 0 (the coordinator) dies, jax's client in every other process
    aborts within about a second (its error polling fails; exit status 134 and jax's message
    "another task died"), before any Python code can run.
    """

    BEAT_S = 2.0

    def __init__(self, on_failure: Callable[[str], None], dead_after_s: float = PEER_DEAD_S):
        self.client = jax_distributed.global_state.client
        self.on_failure, self.dead_after_s = on_failure, dead_after_s
        self.index, self.count = jax.process_index(), jax.process_count()
        self.verdict = threading.Event()  # set once a peer is found dead
        self._started = time.monotonic()  # a peer not seen yet counts from here
        threading.Thread(target=self._run, daemon=True, name="gjax-peer-watch").start()

    def _run(self) -> None:
        beat, seen, reachable = 0, {}, time.monotonic()
        while True:
            now = time.monotonic()
            try:
                beat += 1
                self.client.key_value_set(f"gjax/beat/{self.index}", str(beat), True)
                beats = dict(self.client.key_value_dir_get("gjax/beat/"))
                reachable = now
            except Exception as e:  # the coordinator (process 0) is gone, or not answering
                if now - reachable > self.dead_after_s:
                    return self._fail(
                        f"the coordinator (process 0) has not answered process {self.index} of "
                        f"{self.count} for {now - reachable:.0f} s: {first_line(e)}"
                    )
                time.sleep(self.BEAT_S)
                continue
            for key, value in beats.items():
                peer = int(key.rsplit("/", 1)[1])
                if peer != self.index and seen.get(peer, (None,))[0] != value:
                    seen[peer] = (value, now)
            for peer in range(self.count):
                last = seen.get(peer, (None, self._started))[1] if peer != self.index else now
                if now - last > self.dead_after_s:
                    return self._fail(
                        f"process {peer} has sent no heartbeat for {now - last:.0f} s, as seen "
                        f"from process {self.index} of {self.count}"
                    )
            time.sleep(self.BEAT_S)

    def _fail(self, reason: str) -> None:
        self.on_failure(reason)  # normally ends the process
        self.verdict.set()

    def await_verdict(self) -> bool:
        """After an error in a collective: waits (at most `dead_after_s` + a beat) for a dead
        peer to be noticed, which ends the process through `on_failure`; False if none is."""
        log.warning(
            "a cross-process operation failed; checking whether a peer process died (up to %.0f s)",
            self.dead_after_s + 2 * self.BEAT_S,
        )
        return self.verdict.wait(self.dead_after_s + 2 * self.BEAT_S)


def collective_failed(err: BaseException) -> bool:
    """Whether `err` is (or was caused by) a failed jax runtime operation, e.g. a collective
    whose peer died (gloo fails at once) or timed out, rather than a user error or a bug of
    the caller's. jax raises a failed gloo collective as a ValueError ("UNKNOWN: Gloo
    AllGather failed: ... Timed out waiting 30000ms ..."), not a JaxRuntimeError."""
    while err is not None:
        if isinstance(err, jax.errors.JaxRuntimeError) or "Gloo " in first_line(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _exit_now(err: UserError) -> None:
    """`err` as the CLI prints a user error, then exit 2 at once: the main thread is inside
    jax (start-up, a collective) and cannot be interrupted."""
    print(format_user_error(err), file=sys.stderr, flush=True)
    os._exit(2)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def is_primary() -> bool:
    """Process 0 writes logs, metrics, summaries and run metadata (all processes save state)."""
    return jax.process_index() == 0


class RowLayout:
    """Which contiguous block of a batch's rows each process holds under `sharding`.

    `sharding` shards dimension 0 over the batch mesh axes; each process's devices must cover
    one contiguous block of rows of the same size, disjoint from the other processes' (true
    when the tensor axis stays within a host). `block` is this process's block index;
    `process_at[b]` the process holding block `b`.
    """

    def __init__(self, sharding: NamedSharding):
        self.sharding = sharding
        self.count = jax.process_count()
        rows = int(np.prod([sharding.mesh.shape[a] for a in _batch_axes(sharding)] or [1]))
        self.rows = rows  # devices the rows are split over
        if self.count == 1:
            self.block, self.process_at = 0, [0]
            return
        starts: dict[int, set[int]] = {}
        for device, index in sharding.devices_indices_map((rows,)).items():
            starts.setdefault(device.process_index, set()).add(index[0].indices(rows)[0])
        per = rows // self.count if rows % self.count == 0 else 0
        blocks = {}
        for proc, s in starts.items():
            first = min(s)
            ok = per > 0 and first % per == 0 and s == set(range(first, first + per))
            if not ok:
                break
            blocks[proc] = first // per
        if len(blocks) != self.count or len(set(blocks.values())) != self.count:
            raise DistributedError(
                f"the mesh {dict(sharding.mesh.shape)} does not give each of the {self.count} "
                "processes its own contiguous block of batch rows (the batch axes data*fsdp "
                f"= {rows} must be a multiple of the process count, and the tensor axis must "
                "stay within a host); change config.mesh"
            )
        self.block = blocks[jax.process_index()]
        self.process_at = [p for p, _ in sorted(blocks.items(), key=lambda kv: kv[1])]

    def check_rows(self, n: int, field: str) -> None:
        """Fails fast unless `n` rows split over the devices, each device's from one process."""
        if self.count > 1 and n % self.rows:
            raise DistributedError(
                f"{field}={n} must be a multiple of the data-parallel size {self.rows} "
                f"(mesh.data*mesh.fsdp) in a run of {self.count} processes, so that each "
                "device's rows come from one process"
            )


def _batch_axes(sharding: NamedSharding) -> tuple[str, ...]:
    first = sharding.spec[0] if len(sharding.spec) else None
    if first is None:
        return ()
    return (first,) if isinstance(first, str) else tuple(first)


def allgather(x) -> np.ndarray:
    """Every process's `x` stacked on a new leading axis, in process order."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def split_work(n: int, work, *, index=None, count=None, gather=allgather) -> np.ndarray:
    """`work(lo, hi)` (values for items `[lo, hi)`) on each process's contiguous 1/H share of
    `n` items; every process gets all `n` values, in item order. `index` / `count` default to
    this process's; `gather` is `allgather`'s stand-in for tests. Every process must call it."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if count == 1:
        return np.asarray(work(0, n))
    chunk = -(-n // count)
    lo, hi = min(n, index * chunk), min(n, (index + 1) * chunk)
    values = np.asarray(work(lo, hi))  # called on an empty share too: same dtype everywhere
    local = np.zeros(chunk, values.dtype)  # padding past `n`, cut below
    local[: hi - lo] = values
    return np.asarray(gather(local)).reshape(-1)[:n]


class KeyValueGather:
    """`allgather` through jax's coordination key-value store: for a thread other than the one
    that issues the collectives (see the module docstring).

    Call n writes this process's array under `<prefix>/<n>/<process>` and reads every
    process's. Every process makes the same calls on its own such thread, so the names agree
    whatever the other threads do. For small host arrays (counts, metrics, per-group figures).
    While it waits for a peer it asks `stopped()` every `POLL_MS` and raises `Stopped` once it
    says so (a producer closed before its peers reached the same call); a dead peer ends the
    process through `PeerWatch`.
    """

    POLL_MS = 1000
    _serial = itertools.count()  # every process creates its gathers in the same order

    class Stopped(Exception):
        """Waiting for peers was given up because `stopped()` said so."""

    def __init__(self, stopped: Callable[[], bool] = lambda: False):
        self.index, self.count = jax.process_index(), jax.process_count()
        self.client = jax_distributed.global_state.client if self.count > 1 else None
        self.prefix = f"gjax/gather/{next(self._serial)}"
        self.stopped = stopped
        self.calls = 0

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x)
        if self.count == 1:
            return x[None]
        n, self.calls = self.calls, self.calls + 1
        buf = io.BytesIO()
        np.save(buf, x, allow_pickle=False)
        self.client.key_value_set_bytes(self._key(n, self.index), buf.getvalue())
        parts = [x if p == self.index else self._get(self._key(n, p)) for p in range(self.count)]
        if n:  # each peer wrote call n after reading all of call n - 1: ours can go
            self.client.key_value_delete(self._key(n - 1, self.index))
        return np.stack(parts)

    def _key(self, n: int, process: int) -> str:
        return f"{self.prefix}/{n}/{process}"

    def _get(self, key: str) -> np.ndarray:
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, self.POLL_MS)
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                if self.stopped():
                    raise self.Stopped(key) from None
                continue
            return np.load(io.BytesIO(data), allow_pickle=False)


def gather_rows(x: np.ndarray, layout: RowLayout, *, gather=allgather) -> np.ndarray:
    """This process's rows -> all rows of the batch, blocks in mesh order (host arrays)."""
    if layout.count == 1:
        return np.asarray(x)
    parts = gather(x)
    return np.concatenate([parts[p] for p in layout.process_at])


def any_process(flag: bool, *, gather=allgather) -> bool:
    """True on every process when `flag` is set on any (e.g. a SIGTERM seen by one host)."""
    return bool(gather(np.asarray(bool(flag))).any())


def stop_signal(signum: int | None, *, gather=allgather) -> tuple[int | None, int | None]:
    """(signal, process): the stop signal of the lowest-numbered process that received one and
    that process's index, the same on every process; (None, None) when none did. A signal
    (SIGTERM on one host of a preempted pod) often reaches only some processes."""
    got = np.asarray(gather(np.asarray(signum or 0, np.int64))).reshape(-1)
    first = int(np.flatnonzero(got)[0]) if got.any() else None
    return (None, None) if first is None else (int(got[first]), first)


def combine_metrics(metrics: Mapping[str, float], *, gather=allgather) -> dict[str, float]:
    """Per-process host metrics -> one global figure each, the same on every process.

    Times (`*_s`, `*latency*`) take the slowest process (it gates the step); means and
    fractions (`*mean*`, `*frac*`, `*std*`) the mean over processes (each process holds the
    same number of rows); everything else is a count and is summed. Every process must report
    the same keys.
    """
    if jax.process_count() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    sig = gather(np.asarray([len(keys), zlib.crc32("\n".join(keys).encode())], np.int64))
    if not (sig == sig[0]).all():
        raise DistributedError(
            "processes report different host metric keys; they must run the same config"
        )
    values = gather(np.asarray([float(metrics[k]) for k in keys], np.float64))
    out = {}
    for i, k in enumerate(keys):
        col = values[:, i]
        if k.endswith("_s") or "latency" in k or "_s_" in k:
            out[k] = float(col.max())
        elif any(w in k for w in ("mean", "frac", "std")):
            out[k] = float(col.mean())
        else:
            out[k] = float(col.sum())
    return out


def pool_counts(
    metrics: Mapping[str, float], *, means: Collection[str] = (), gather=allgather
) -> dict[str, float]:
    """Per-process counts -> their sums over the processes (`means`: the mean, for per-row
    figures over equal numbers of rows), the same on every process. Unlike `combine_metrics`
    the processes may report different keys (counts of events some of them never saw): the
    result has every process's, a key a process lacks counting 0 there. One process: the
    figures as they are. Three small gathers."""
    if jax.process_count() == 1:
        return {k: float(v) for k, v in metrics.items()}
    keys = union_keys(metrics, gather=gather)
    values = gather(np.asarray([float(metrics.get(k, 0.0)) for k in keys], np.float64))
    return {
        k: float(values[:, i].mean() if k in means else values[:, i].sum())
        for i, k in enumerate(keys)
    }


def union_keys(keys: Iterable[str], *, gather=allgather) -> list[str]:
    """Every process's `keys` merged, sorted: the same list on every process (two gathers:
    the longest encoding's length, then every process's names padded to it)."""
    blob = "\n".join(sorted(keys)).encode()
    width = int(np.asarray(gather(np.asarray(len(blob), np.int64))).max())
    padded = np.zeros(width, np.uint8)
    padded[: len(blob)] = np.frombuffer(blob, np.uint8)
    names = set()
    for row in np.asarray(gather(padded)):
        names.update(k for k in bytes(row).rstrip(b"\0").decode().split("\n") if k)
    return sorted(names)


def put_rows(x: np.ndarray, layout: RowLayout) -> jax.Array:
    """This process's rows (block `layout.block`) -> the global array, sharded by rows."""
    global_shape = (x.shape[0] * layout.count, *x.shape[1:])
    if global_shape[0] % layout.rows:
        if layout.count == 1:  # too few rows to shard: replicate (the model code copes)
            return put_global(x, layout.sharding.mesh)
        raise DistributedError(
            f"{global_shape[0]} rows cannot be split over the {layout.rows} data-parallel "
            f"devices (mesh.data*mesh.fsdp) of {layout.count} processes; make "
            "config.rollout.prompts_per_step a multiple of the data-parallel size"
        )
    return jax.make_array_from_process_local_data(layout.sharding, np.asarray(x), global_shape)


def put_global(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array every process holds in full -> a replicated global array."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_process_local_data(replicated, np.asarray(x), np.shape(x))


def local_rows(x: jax.Array, layout: RowLayout) -> np.ndarray:
    """A global row-major array -> this process's block of rows as a host array."""
    if layout.count == 1:
        return np.asarray(x)
    x = jax.device_put(x, layout.sharding)  # a no-op when already laid out by rows
    n = x.shape[0]
    pieces = {s.index[0].indices(n)[0]: s.data for s in x.addressable_shards}
    return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)])


class RowTransfer:
    """A batch's rows between this process's host and the global arrays on the mesh.

    Per-sequence arrays (`*_BxS`, `*_BxT`) hold this process's block of rows (`layout`);
    group-level arrays (`*_PxG`) are all-gathered and replicated, so every normalizer of the
    update is computed over the whole batch. With one process these are plain transfers.
    """

    def __init__(self, batch_sharding: NamedSharding):
        self.allgather = allgather  # host exchanges: collectives, on the loop's thread
        self.layout = RowLayout(batch_sharding)
        self.batch_sharding = batch_sharding
        self.replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())

    def put_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's host arrays -> the global batch on the devices."""
        out = {}
        for k, v in arrays.items():
            if k.endswith(("_BxS", "_BxT")):
                out[k] = self.put_rows(v)
            elif k.endswith("_PxG"):
                out[k] = put_global(self.gather_rows(v), self.replicated.mesh)
            else:
                out[k] = put_global(v, self.replicated.mesh)
        return out

    def put_rows(self, x: np.ndarray) -> jax.Array:
        """This process's rows -> the global array sharded over the batch axes."""
        return put_rows(x, self.layout)

    def sampler_rows(self, x: np.ndarray):
        """This process's rows as the sampler's input: the global array (several processes),
        or the host array (one process: the sampler's jit places it on the params' mesh)."""
        return self.put_rows(x) if self.layout.count > 1 else np.asarray(x)

    def local_rows(self, x: jax.Array) -> np.ndarray:
        """A global row-sharded array -> this process's rows on the host."""
        return local_rows(x, self.layout)

    def gather_rows(self, x: np.ndarray) -> np.ndarray:
        """This process's rows of a host array -> every process's, in batch order."""
        return gather_rows(x, self.layout)

    def put_full(self, x: np.ndarray) -> jax.Array:
        """A whole batch every process holds (held-out prompts) -> the global array."""
        if self.layout.count == 1:
            return x
        return self.put_rows(x[self.block_of(x.shape[0])])

    def block_of(self, n: int) -> slice:
        """This process's rows of a whole batch of `n` rows (`put_full`'s share)."""
        per = n // self.layout.count
        return slice(self.layout.block * per, (self.layout.block + 1) * per)

    def pull_full(self, x: jax.Array) -> np.ndarray:
        """A global row-sharded array -> all of its rows on every process's host."""
        return self.gather_rows(self.local_rows(x))


class LocalRows:
    """`RowTransfer`'s rollout half for a thread that issues no collectives (the rollout
    producer of a multi-process run): each process samples its own block of rows on its own
    devices (`row_block` for the sampler's random draws), rows never leave the process, and
    host exchanges go through `allgather` (a `KeyValueGather`). `layout` is the batch's
    `RowLayout` (the order of the blocks)."""

    def __init__(self, layout: RowLayout, gather: KeyValueGather):
        self.layout, self.allgather = layout, gather
        self.row_block = (layout.block, layout.count)

    def sampler_rows(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def local_rows(self, x) -> np.ndarray:
        return np.asarray(x)

    def gather_rows(self, x: np.ndarray) -> np.ndarray:
        return gather_rows(x, self.layout, gather=self.allgather)
