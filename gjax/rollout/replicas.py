"""`gjax.serve` replicas behind one rollout client: least outstanding requests, fail-over, re-use.

`ReplicaPool` holds one channel per replica (`rollout.server_addresses`). `call` sends a request
to the live replica with the fewest requests in flight (ties: the first listed); a replica
whose call fails UNAVAILABLE (killed, unreachable) is taken out and the request goes to
another live one at once (`resubmitted`), so nothing is lost while one replica lives, within
the request's deadline. With none live, `call` waits for one until its deadline. A probe thread
asks each replica out of service for its policy version (`gjax.Weights/Version`) every
`probe_s`; one that answers with at least the `required` version is used again. One that
answers with an older version (restarted from the push directory behind a streamed push) is
handed to `on_behind` (the pusher's re-push) and stays out until it serves the version.

`ReplicaWeights` pushes a new policy version to every replica: through the versioned
directory (every process takes part in orbax's save; process 0 writes LATEST), or streamed
over gRPC by process 0 (params gathered to its host; a LoRA run's adapters only, its
`handoff`), and then every process waits for each
replica to report the version, so a step's rollouts start only on replicas that serve it.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import grpc
import jax
from jax.experimental import multihost_utils

from gjax import multihost
from gjax.rollout.handoff import Handoff
from gjax.rollout.jetstream_compat import jetstream
from gjax.rollout.weight_stream import SERVICE, GrpcWeightPusher

log = logging.getLogger("gjax")

# A server that is back is reconnected to within ~0.5 s: gRPC's default reconnect backoff
# grows to 120 s while a server is down.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 500),
)


class Replica:
    """One server: its channel, stubs and counters (guarded by the pool's lock)."""

    def __init__(self, index: int, address: str):
        self.index, self.address = index, address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.decode = jetstream.jetstream_pb2_grpc.OrchestratorStub(self.channel).Decode
        self.version_call = self.channel.unary_unary(f"/{SERVICE}/Version")
        self.live = True  # until a call fails UNAVAILABLE
        self.outstanding = 0
        self.stats = {"requests": 0, "failures": 0, "outstanding_max": 0}

    def served_version(self, timeout: float) -> int | None:
        """The policy version the server samples with; None if it does not answer in time,
        -1 if it is unreachable (UNAVAILABLE: nothing listens, or it died)."""
        try:
            reply = self.version_call(b"", timeout=timeout)
        except grpc.RpcError as e:
            return -1 if e.code() == grpc.StatusCode.UNAVAILABLE else None
        return int(json.loads(reply)["version"])


class ReplicaPool:
    """Requests over live replicas by least outstanding; see the module docstring."""

    def __init__(self, addresses: list[str], *, probe_s: float = 0.5):
        self.replicas = [Replica(i, a) for i, a in enumerate(addresses)]
        self.probe_s = probe_s
        self.required = 0  # a replica is used only while it serves at least this version
        self.on_behind = None  # callable(replica): re-pushes the current version to it
        self.resubmitted = 0  # requests moved to another replica after a failure
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="gjax-replicas", daemon=True)
        self._thread.start()

    def acquire(self, deadline: float) -> Replica:
        """The live replica with the fewest outstanding requests (now counted one more);
        waits for one until `deadline` (monotonic), then raises TimeoutError."""
        with self._cond:
            while True:
                live = [r for r in self.replicas if r.live]
                if live:
                    r = min(live, key=lambda r: (r.outstanding, r.index))
                    r.outstanding += 1
                    r.stats["requests"] += 1
                    r.stats["outstanding_max"] = max(r.stats["outstanding_max"], r.outstanding)
                    return r
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no gjax.serve replica answered")
                self._cond.wait(min(left, self.probe_s))

    def release(self, replica: Replica) -> None:
        with self._cond:
            replica.outstanding -= 1

    def down(self, replica: Replica, reason) -> None:
        """Takes `replica` out of service until a probe finds it serving `required`."""
        with self._cond:
            replica.stats["failures"] += 1
            if replica.live:
                replica.live = False
                log.warning("rollout replica %s taken out of service: %s", replica.address, reason)

    def admit(self, replica: Replica) -> None:
        with self._cond:
            if not replica.live:
                replica.live = True
                log.info("rollout replica %s back in service", replica.address)
            self._cond.notify_all()

    def call(self, request, deadline: float, parse):
        """`parse(responses)` of `request` decoded by a live replica; a replica that fails
        UNAVAILABLE is taken out and the request sent to another until `deadline`."""
        while True:
            replica = self.acquire(deadline)
            try:
                timeout = max(0.01, deadline - time.monotonic())
                return parse(replica.decode(request, timeout=timeout))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.down(replica, f"{e.code()} {e.details()}")
                with self._cond:
                    self.resubmitted += 1
            finally:
                self.release(replica)

    def await_version(self, version: int, timeout_s: float, abort=None) -> list[int]:
        """Sets `required = version` and waits (at most `timeout_s`) until every replica in
        service reports it; one that does not, or is unreachable, is taken out (the probe
        re-admits it once it serves the version). Returns the versions reported (-1: none).
        `abort()` is called while waiting; what it raises ends the wait (a refused push)."""
        self.required = version
        deadline = time.monotonic() + timeout_s
        seen = [-1] * len(self.replicas)
        pending = [r for r in self.replicas if r.live]
        while pending:
            if abort is not None:
                abort()
            for r in list(pending):
                v = r.served_version(min(self.probe_s, max(0.01, deadline - time.monotonic())))
                seen[r.index] = -1 if v is None else v
                if v == -1:
                    pending.remove(r)
                    self.down(r, "unreachable after a weight push")
                elif v is not None and v >= version:
                    pending.remove(r)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for r in pending:
            self.down(r, f"it serves version {seen[r.index]}, not {version}, after {timeout_s:g} s")
        return seen

    def check(self) -> None:
        """Takes out each live replica that serves an older version than `required` (it
        restarted from the push directory since the last push)."""
        for r in self.replicas:
            if r.live and self.required:
                v = r.served_version(self.probe_s)
                if v == -1:
                    self.down(r, "unreachable")
                elif v is not None and v < self.required:
                    self.down(r, f"it serves version {v}, not {self.required} (restarted?)")

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_s):
            for r in self.replicas:
                if r.live or self._stop.is_set():
                    continue
                v = r.served_version(self.probe_s)
                if v is None or v < 0:
                    continue
                if v < self.required and self.on_behind is not None:
                    try:
                        self.on_behind(r)
                    except Exception as e:  # noqa: BLE001 - tried again at the next probe
                        log.warning("re-push to replica %s failed: %s", r.address, e)
                    v = r.served_version(self.probe_s)
                if v is not None and v >= max(self.required, 0):
                    self.admit(r)

    def metrics(self) -> dict[str, float]:
        """Per replica since the last call: requests sent, failures, the most in flight."""
        out = {}
        with self._cond:
            for r in self.replicas:
                for k, v in r.stats.items():
                    out[f"rollout/replica{r.index}/{k}"] = float(v)
                r.stats = dict.fromkeys(r.stats, 0)
        return out

    def describe(self) -> str:
        return ", ".join(
            f"{r.address} ({'live' if r.live else 'out of service'})" for r in self.replicas
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for r in self.replicas:
            r.channel.close()


def host_params(params):
    """`params` as host arrays on process 0 (None elsewhere). A collective in a multi-process
    run (every process calls it, in the same order), gathered one leaf at a time so the other
    processes hold at most one whole leaf, never the whole model."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for leaf in leaves:
        full = multihost_utils.process_allgather(leaf, tiled=True)
        out.append(full if multihost.is_primary() else None)
        del full
    return jax.tree.unflatten(treedef, out) if multihost.is_primary() else None


class ReplicaWeights:
    """`push(params) -> version`: a new policy version on every replica of `pool`.

    `directory` (a `weight_push.WeightPusher`) is written on every push unless `stream`, where
    process 0 streams the params to each replica (`GrpcWeightPusher`, the directory being the
    fallback of a one-process run) and keeps a host copy, which `pool.on_behind` re-pushes to
    a replica that comes back with an older version. Every process then waits, at most
    `ack_timeout_s`, for each replica to serve the version (`ReplicaPool.await_version`).
    """

    def __init__(
        self, pool: ReplicaPool, directory, *, stream: bool, ack_timeout_s: float, handoff=None
    ):
        self.pool, self.directory, self.stream = pool, directory, stream
        self.handoff = handoff or Handoff()  # LoRA: the adapters only (the directory's too)
        self.ack_timeout_s = ack_timeout_s
        self.version = directory.version
        self.last_bytes = 0
        self._lock = threading.Lock()
        self._host = None  # process 0, streaming: the last pushed params on the host
        self._streams = []
        if stream and multihost.is_primary():
            one = jax.process_count() == 1  # orbax saves are collectives: no fallback then
            self._streams = [
                GrpcWeightPusher(
                    r.address,
                    fallback=directory if one else None,
                    timeout_s=ack_timeout_s,
                    handoff=self.handoff,
                )
                for r in pool.replicas
            ]
            pool.on_behind = self._repush

    def push(self, params) -> int:
        """Every process calls it, in the same order (a collective)."""
        params = self.handoff.payload(params)  # LoRA: only the adapters travel
        version = self.version + 1
        if self.stream:
            # Newer than any replica serves (streamed versions are not in the directory).
            seen = [r.served_version(self.pool.probe_s) for r in self.pool.replicas]
            version = max([version, *(v + 1 for v in seen if v is not None)])
            if jax.process_count() > 1:
                version = int(multihost.allgather(version).max())
            host = host_params(params)  # a collective: on every process
            if multihost.is_primary():
                with self._lock:  # host and version together: `_repush` reads both
                    self._host, self.version = host, version
                    for r, pusher in zip(self.pool.replicas, self._streams):
                        self._stream_to(r, pusher, host, version)
                    self.last_bytes = max((p.last_bytes for p in self._streams), default=0)
        else:
            self.directory.push(params, version, wait=False)
            self.last_bytes = self.directory.last_bytes
        self.version = version
        # Directory: a replica that refuses the version (another base) says why in the
        # directory; its paragraph ends the wait.
        abort = None if self.stream else lambda: self.directory.raise_if_refused(version)
        seen = self.pool.await_version(version, self.ack_timeout_s, abort)
        if jax.process_count() > 1:  # every process has seen the same replicas catch up
            multihost_utils.sync_global_devices(f"gjax-weights-{version}")
        served = version if max(seen) >= version else max(max(seen), 0)
        if jax.process_count() > 1:  # one label for every process's rows
            served = int(multihost.allgather(served).min())
        return served

    def _stream_to(self, replica, pusher, host, version: int) -> None:
        try:
            pusher.push(host, version=version)
        except grpc.RpcError as e:  # no fallback (several processes): out until re-pushed
            self.pool.down(replica, f"the weight push failed: {e.code()}")

    def _repush(self, replica) -> None:
        with self._lock:
            if self._host is not None:
                pusher = self._streams[replica.index]
                pusher.push(self._host, version=self.version)

    def behind(self) -> bool:
        """Never here: the pool checks each replica's version itself (`ReplicaPool.check`)."""
        return False

    def close(self) -> None:
        for p in self._streams:
            p.close()
