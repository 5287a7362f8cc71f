"""The rollout client's replica pool (`gjax.rollout.replicas`) over real gRPC on 127.0.0.1:
least outstanding requests, a dead replica taken out and its requests resubmitted, a replica
that comes back probed and used again (only once it serves the required version). The
replicas are small gRPC servers with gjax.serve's weight service (`WeightReceiver`, the one
the probe asks) and a stand-in Decode that answers with its replica's index; the model's own
Decode is exercised by tests/test_jetstream_grpc.py and tests/test_multihost_jetstream.py."""

import asyncio
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from gjax import schema
from gjax.errors import ConfigError

replicas = pytest.importorskip("gjax.rollout.replicas")
from gjax.rollout.engine import ParamsHolder  # noqa: E402
from gjax.rollout.jetstream_compat import jetstream  # noqa: E402
from gjax.rollout.weight_stream import WeightReceiver  # noqa: E402

pb = jetstream.jetstream_pb2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Replica:
    """A gRPC server on 127.0.0.1:port: Decode answers [index] after `delay_s`; Version is
    gjax.serve's own (`WeightReceiver` over a `ParamsHolder` at `version`)."""

    def __init__(self, index: int, port: int, version: int = 0, delay_s: float = 0.0):
        import grpc

        self.holder = ParamsHolder({"w": jnp.zeros(2, jnp.float32)}, version=version)
        self.calls = 0
        outer = self

        class Servicer(jetstream.jetstream_pb2_grpc.OrchestratorServicer):
            async def Decode(self, request, context):  # noqa: N802
                outer.calls += 1
                await asyncio.sleep(delay_s)
                sample = pb.DecodeResponse.StreamContent.Sample(token_ids=[index])
                yield pb.DecodeResponse(
                    stream_content=pb.DecodeResponse.StreamContent(samples=[sample])
                )

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def start():
            server = grpc.aio.server()
            jetstream.jetstream_pb2_grpc.add_OrchestratorServicer_to_server(Servicer(), server)
            server.add_generic_rpc_handlers((WeightReceiver(self.holder).handler(),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            return server

        self._server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _request():
    return pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=[1, 2]))


def _ids(responses):
    return [t for r in responses for s in r.stream_content.samples for t in s.token_ids]


def test_least_outstanding_failover_and_readmission():
    ports = [_free_port(), _free_port()]
    servers = [_Replica(0, ports[0]), _Replica(1, ports[1], delay_s=0.3)]
    pool = replicas.ReplicaPool([f"127.0.0.1:{p}" for p in ports], probe_s=0.2)
    try:
        deadline = lambda: time.monotonic() + 10
        # Least outstanding, ties to the first listed.
        held = [pool.acquire(deadline()) for _ in range(3)]
        assert [r.index for r in held] == [0, 1, 0]
        pool.release(held[0])
        pool.release(held[2])
        assert pool.acquire(deadline()).index == 0  # 0 in flight on replica 0, 1 on replica 1
        for r in (held[1], pool.replicas[0]):
            pool.release(r)
        assert [r.outstanding for r in pool.replicas] == [0, 0]

        # Replica 1 dies with requests in flight: they fail UNAVAILABLE and go to replica 0.
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(pool.call, _request(), deadline(), _ids) for _ in range(8)]
            time.sleep(0.1)  # replica 1's requests are in flight (it answers after 0.3 s)
            servers[1].stop()
            got = [f.result(20) for f in futures]
        assert got.count([0]) == 8 and servers[1].calls >= 1
        assert not pool.replicas[1].live and pool.resubmitted >= 1
        m = pool.metrics()
        assert m["rollout/replica1/failures"] >= 1 and m["rollout/replica0/requests"] >= 8
        assert pool.call(_request(), deadline(), _ids) == [0]  # no request tries the dead one

        # Back, but behind the required version: not used until it serves it; the pusher's
        # hook (`on_behind`) is asked to bring it up to date, then the probe admits it.
        pool.required = 3
        pushed = []
        pool.on_behind = lambda r: pushed.append(r.index)
        servers[1] = _Replica(1, ports[1], version=2)
        time.sleep(1.0)
        assert not pool.replicas[1].live and 1 in pushed
        t0 = time.monotonic()
        servers[1].holder.swap({"w": np.ones(2, np.float32)}, 3)
        while not pool.replicas[1].live and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        print(f"re-admitted {time.monotonic() - t0:.2f} s after serving the version")
        assert pool.replicas[1].live and time.monotonic() - t0 < 1.0
        held = [pool.acquire(deadline()) for _ in range(2)]
        assert sorted(r.index for r in held) == [0, 1]  # used again
        for r in held:
            pool.release(r)

        # await_version: replicas that report it stay; one that does not is taken out.
        servers[0].holder.swap({"w": np.ones(2, np.float32)}, 4)
        assert pool.await_version(4, 0.5) == [4, 3]
        assert [r.live for r in pool.replicas] == [True, False]
        # An unreachable replica is taken out at once, not waited for.
        pool.admit(pool.replicas[1])
        servers[1].stop()
        t0 = time.monotonic()
        assert pool.await_version(4, 30) == [4, -1]
        assert time.monotonic() - t0 < 5 and not pool.replicas[1].live
        servers[1] = _Replica(1, ports[1], version=4)
        # All out: a call waits for one until its deadline, then TimeoutError.
        pool.down(pool.replicas[0], "test")
        pool.required = 99
        with pytest.raises(TimeoutError):
            pool.call(_request(), time.monotonic() + 0.5, _ids)
    finally:
        pool.close()
        for s in servers:
            s.stop()


def test_server_addresses_one_place():
    c = schema.base()
    assert schema.server_addresses(c.rollout) == ["127.0.0.1:9000"]
    c.rollout.server_addresses = "h1:1, h2:2"
    assert schema.server_addresses(c.rollout) == ["h1:1", "h2:2"]
    c.rollout.server_address = "h2:2"  # one of them: fine
    assert schema.server_addresses(c.rollout) == ["h1:1", "h2:2"]
    c.rollout.server_address = "h3:3"
    with pytest.raises(ConfigError, match="is not one of"):
        schema.server_addresses(c.rollout)
    c.rollout.server_address = "127.0.0.1:9000"
    for bad, words in (("h1:1,h1:1", "twice"), ("h1:1,nohost", "must be HOST:PORT")):
        c.rollout.server_addresses = bad
        with pytest.raises(ConfigError, match=words):
            schema.server_addresses(c.rollout)


def test_streamed_push_reaches_every_replica_and_a_restarted_one_is_brought_up(tmp_path):
    """`ReplicaWeights` (stream): one version on both replicas; a replica restarted at an
    older version is re-pushed the current params by the probe, then used again."""
    from gjax.rollout.weight_push import WeightPusher

    ports = [_free_port(), _free_port()]
    servers = [_Replica(0, ports[0]), _Replica(1, ports[1])]
    pool = replicas.ReplicaPool([f"127.0.0.1:{p}" for p in ports], probe_s=0.2)
    weights = replicas.ReplicaWeights(
        pool, WeightPusher(tmp_path / "push"), stream=True, ack_timeout_s=10
    )
    try:
        new = {"w": jnp.asarray([1.0, 2.0])}
        assert weights.push(new) == 1 and weights.last_bytes == 8
        for s in servers:
            assert s.holder.version == 1
            np.testing.assert_array_equal(s.holder.params["w"], [1.0, 2.0])
        servers[1].stop()
        servers[1] = _Replica(1, ports[1], version=0)  # restarted: the initial weights
        pool.check()  # what each rollout batch does first
        assert not pool.replicas[1].live
        t0 = time.monotonic()
        while not pool.replicas[1].live and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert pool.replicas[1].live and servers[1].holder.version == 1
        np.testing.assert_array_equal(servers[1].holder.params["w"], [1.0, 2.0])
        assert weights.push({"w": jnp.asarray([3.0, 4.0])}) == 2
        assert [s.holder.version for s in servers] == [2, 2]
    finally:
        weights.close()
        pool.close()
        for s in servers:
            s.stop()


def test_repush_right_after_a_streamed_push_sends_the_new_version():
    """A probe's re-push waiting on the lock while a push streams runs as the lock is
    released: it must send the new params as the new version (it sent them labelled with the
    previous one, set only after the lock was released)."""
    import types

    sent = []

    class Pusher:
        last_bytes = 0

        def push(self, host, version):
            sent.append((float(host["w"][0]), version))

        def close(self):
            pass

    replica = types.SimpleNamespace(index=0, address="127.0.0.1:1", served_version=lambda t: 3)
    pool = types.SimpleNamespace(
        replicas=[replica], probe_s=0.01, on_behind=None, await_version=lambda v, t, abort=None: [v]
    )
    weights = replicas.ReplicaWeights(
        pool, types.SimpleNamespace(version=3), stream=True, ack_timeout_s=1.0
    )
    weights._streams = [Pusher()]
    real = weights._lock

    class Lock:  # on release, a re-push that was waiting runs before push goes on
        def __enter__(self):
            real.acquire()

        def __exit__(self, *exc):
            real.release()
            weights._lock = real
            t = threading.Thread(target=weights._repush, args=(replica,))
            t.start()
            t.join()

    weights._lock = Lock()
    assert weights.push({"w": np.ones(2, np.float32)}) == 4
    assert sent == [(1.0, 4), (1.0, 4)]
