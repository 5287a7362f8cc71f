"""Weights streamed from the trainer to a `gjax.serve` server over gRPC, with no storage trip.

A small service on the server's port, with raw-bytes messages (no compiled protos):

    /gjax.Weights/Spec  unary:  b"" -> JSON {"version": v, "leaves": [[path, dtype, shape], ...],
                                             "adapters": record or null}
    /gjax.Weights/Version  unary:  b"" -> JSON {"version": v}
    /gjax.Weights/Push  client-streaming: messages -> JSON {"version": v}

Each Push message is `<u32 header length><JSON header><raw bytes>`: first {"version": v},
then one per chunk {"path", "dtype", "shape", "offset"} + that chunk's bytes (a leaf in C
order, already cast by the trainer to the dtype the server computes in: a bf16 server gets
bf16 bytes), last {"commit": total_bytes}. The server copies chunks into host buffers and, at
the commit only, checks every leaf is whole, places them on its params' shardings and swaps
them into the engine's `ParamsHolder` between decode steps (as a directory push does). A stream
that ends early, is cancelled or carries a bad chunk changes nothing: the server keeps serving
the previous version.

The versioned push directory (`gjax.rollout.weight_push`) stays the fallback and the restart
path: `GrpcWeightPusher` writes there when the stream fails, and a restarted server starts from
the directory's LATEST (which gRPC pushes do not update): the rollout client asks the served
version before each batch and pushes again if it is behind, so only requests retried within the
batch that met the restart are served by the older weights.

A LoRA server (`gjax.rollout.handoff`) lists only its adapter leaves in Spec, with its adapter
record; the trainer streams only those leaves, and refuses by name (before sending) a server
whose record is not its own (full weights, another rank or targets, another base).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from gjax.errors import UserError
from gjax.rollout.handoff import Handoff

log = logging.getLogger("gjax")

SERVICE = "gjax.Weights"
# Chunks stay under the receive limit the server sets (the gRPC default is 4 MiB).
CHUNK_BYTES = 8 << 20
MAX_MESSAGE_BYTES = 64 << 20
SERVER_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),)
_LEN = struct.Struct("<I")


class WeightSpecMismatch(UserError, ValueError):
    """The trainer's params do not have the served params' leaves and shapes."""


def message(header: dict, payload=b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(h)), h, payload))


def parse(msg: bytes) -> tuple[dict, memoryview]:
    (n,) = _LEN.unpack_from(msg)
    return json.loads(bytes(msg[_LEN.size : _LEN.size + n])), memoryview(msg)[_LEN.size + n :]


def _leaves(params) -> list[tuple[str, object]]:
    return [
        (jax.tree_util.keystr(k), x) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]
    ]


def spec_of(params) -> list[list]:
    """[[path, dtype name, shape], ...] of `params`' leaves, in tree order."""
    return [[p, jnp.dtype(x.dtype).name, list(x.shape)] for p, x in _leaves(params)]


class _Incoming:
    """One Push stream's buffers; nothing reaches the holder before `assemble`."""

    def __init__(self, spec: list[list], version: int):
        self.version = version
        self.spec = {p: (np.dtype(jnp.dtype(d)), tuple(s)) for p, d, s in spec}
        self.buffers: dict[str, np.ndarray] = {}
        self.received: dict[str, int] = {}
        self.bytes = 0

    def take(self, header: dict, payload: memoryview) -> None:
        path = header.get("path")
        if path not in self.spec:
            raise ValueError(f"unknown leaf {path!r}")
        dtype, shape = self.spec[path]
        if header["dtype"] != dtype.name or tuple(header["shape"]) != shape:
            raise ValueError(
                f"leaf {path}: sent {header['dtype']}{header['shape']}, serving "
                f"{dtype.name}{list(shape)}"
            )
        nbytes = dtype.itemsize * int(np.prod(shape))
        buf = self.buffers.get(path)
        if buf is None:
            buf = self.buffers[path] = np.empty(nbytes, np.uint8)
        offset, n = int(header["offset"]), len(payload)
        if offset < 0 or offset + n > nbytes:
            raise ValueError(f"leaf {path}: chunk [{offset}, {offset + n}) outside {nbytes} bytes")
        buf[offset : offset + n] = np.frombuffer(payload, np.uint8)  # chunks do not overlap
        self.received[path] = self.received.get(path, 0) + n
        self.bytes += n

    def assemble(self, like):
        """The params tree on `like`'s shardings; raises if a leaf is incomplete."""
        out = []
        for path, x in _leaves(like):
            dtype, shape = self.spec[path]
            if path not in self.buffers or self.received[path] != self.buffers[path].size:
                raise ValueError(f"leaf {path} is incomplete")
            out.append(jax.device_put(self.buffers[path].view(dtype).reshape(shape), x.sharding))
        return jax.tree.unflatten(jax.tree.structure(like), out)


class WeightReceiver:
    """Server side: the `gjax.Weights` service over a `ParamsHolder` (on a grpc.aio server);
    `handoff` (the server's `Handoff`): what a push holds (LoRA: the adapters over its base)."""

    def __init__(self, holder, handoff=None):
        self.holder = holder
        self.handoff = handoff or Handoff()
        self.spec = spec_of(self.handoff.like(holder.params))

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Spec": grpc.unary_unary_rpc_method_handler(self._spec),
                "Version": grpc.unary_unary_rpc_method_handler(self._version),
                "Push": grpc.stream_unary_rpc_method_handler(self._push),
            },
        )

    async def _spec(self, request: bytes, context) -> bytes:
        del request, context
        reply = {"version": self.holder.version, "leaves": self.spec}
        return json.dumps({**reply, "adapters": self.handoff.record}).encode()

    async def _version(self, request: bytes, context) -> bytes:
        del request, context
        return json.dumps({"version": self.holder.version}).encode()

    async def _push(self, requests, context) -> bytes:
        incoming, committed = None, None
        try:
            async for msg in requests:
                header, payload = parse(msg)
                if incoming is None:
                    incoming = _Incoming(self.spec, int(header["version"]))
                elif "commit" in header:
                    committed = int(header["commit"])
                else:
                    incoming.take(header, payload)
            if incoming is None or committed is None or committed != incoming.bytes:
                raise ValueError("the stream ended before its commit message")
            version = incoming.version
            if version <= self.holder.version:
                raise ValueError(f"version {version} is not newer than {self.holder.version}")
            loop = asyncio.get_running_loop()
            like = self.handoff.like(self.holder.params)
            params = self.handoff.params_from(
                await loop.run_in_executor(None, incoming.assemble, like)
            )
        except (ValueError, KeyError, TypeError, struct.error) as e:
            log.warning("weight stream rejected, still serving %d: %s", self.holder.version, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"weight push rejected: {e}")
        if not self.holder.swap_if_newer(params, version):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {version} is not newer than {self.holder.version}",
            )
        log.info("serving policy version %d (%d bytes over gRPC)", version, incoming.bytes)
        return json.dumps({"version": version}).encode()


class WeightServer:
    """A `WeightReceiver` alone on host:port (its own loop thread), for benchmarks and tools
    that have no engine; `gjax.serve` adds the receiver to its JetStream server instead."""

    def __init__(self, holder, address: str, handoff=None):
        self.receiver = WeightReceiver(holder, handoff)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def start():
            server = grpc.aio.server(options=SERVER_OPTIONS)
            server.add_generic_rpc_handlers((self.receiver.handler(),))
            self.port = server.add_insecure_port(address)
            await server.start()
            return server

        self._server = asyncio.run_coroutine_threadsafe(start(), self._loop).result()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


class GrpcWeightPusher:
    """Trainer side: `push(params) -> the version the server now samples with`.

    Streams each leaf, cast to the server's dtype, in `chunk_bytes` chunks. If the server
    does not answer within `connect_s` or the stream fails (server down, restarted,
    rejected), the version goes through `fallback` (a `WeightPusher` on the push directory).
    `handoff` (the trainer's `Handoff`): what a push streams (LoRA: the adapters only).
    """

    def __init__(
        self,
        address: str,
        *,
        fallback=None,
        timeout_s: float = 600.0,
        connect_s: float = 2.0,
        chunk_bytes=None,
        handoff=None,
    ):
        self.address = address
        self.handoff = handoff or Handoff()
        self.connect_s = connect_s
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        # Reconnects within 0.5 s of a restarted server (as the rollout requests' channel).
        options = (
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 500),
        )
        self._channel = grpc.insecure_channel(address, options=options)
        self._spec_call = self._channel.unary_unary(f"/{SERVICE}/Spec")
        self._push_call = self._channel.stream_unary(f"/{SERVICE}/Push")
        self._version_call = self._channel.unary_unary(f"/{SERVICE}/Version")
        self._spec = None
        self.version = fallback.version if fallback is not None else 0
        self.last_bytes = 0

    def spec(self) -> dict:
        """The served params' {path: (dtype, shape)} and version (asked once, then cached)."""
        if self._spec is None:
            reply = self._spec_call(b"", timeout=self.connect_s, wait_for_ready=True)
            reply = json.loads(reply)
            # The server's record, checked against this trainer's: refused by name.
            Handoff(reply.get("adapters")).check(
                self.handoff.record, f"the weight push to the gjax.serve server at {self.address}"
            )
            self._spec = {p: (d, tuple(s)) for p, d, s in reply["leaves"]}
            self.version = max(self.version, int(reply["version"]))
        return self._spec

    def check(self, params) -> None:
        """Raises WeightSpecMismatch unless `params` has the served leaves and shapes."""
        spec = self.spec()
        mine = {p: tuple(x.shape) for p, x in _leaves(self.handoff.payload(params))}
        if mine.keys() != spec.keys() or any(mine[p] != spec[p][1] for p in spec):
            diff = sorted(set(mine.items()) ^ {(p, s) for p, (_, s) in spec.items()})
            raise WeightSpecMismatch(
                f"the trainer's params do not match the params the gjax.serve server at "
                f"{self.address} serves (path, shape differing: {diff[:4]}). Start the server "
                "with the trainer's --config (same model.path)."
            )

    def messages(self, params, version: int):
        """The Push stream of `params` as `version` (a generator: one leaf on the host at once).
        Call `check(params)` first."""
        spec, leaves = self.spec(), _leaves(self.handoff.payload(params))
        yield message({"version": version})
        total = 0
        for path, x in leaves:
            dtype, shape = spec[path]
            host = np.ascontiguousarray(jax.device_get(jnp.asarray(x).astype(dtype)))
            raw = memoryview(host.reshape(-1).view(np.uint8))  # bf16 has no buffer format
            for offset in range(0, max(host.nbytes, 1), self.chunk_bytes):
                chunk = raw[offset : offset + self.chunk_bytes]
                yield message(
                    {"path": path, "dtype": dtype, "shape": list(shape), "offset": offset}, chunk
                )
                total += len(chunk)
        self.last_bytes = total
        yield message({"commit": total})

    def push(self, params, version: int | None = None) -> int:
        """Streams `params` as `version` (default: the next one); returns the served version."""
        # A server not reachable within connect_s gets the version through the directory,
        # where it (restarted) finds it.
        try:
            self.check(params)  # first: a server's own version counts (a fresh trainer)
        except grpc.RpcError as e:
            return self._fall_back(params, e, version)
        if version is None:
            version = max(self.version, self.fallback.version if self.fallback else 0) + 1
        try:
            reply = self._push_call(self.messages(params, version), timeout=self.timeout_s)
        except grpc.RpcError as e:
            return self._fall_back(params, e, version)
        self.version = version
        return int(json.loads(reply)["version"])

    def _fall_back(self, params, error, version=None) -> int:
        self._spec = None  # a restarted server may differ; ask again next time
        if self.fallback is None:
            raise error
        if version is None:
            version = max(self.version, self.fallback.version) + 1
        log.warning(
            "weight push over gRPC to %s failed (%s); writing version %d to %s instead",
            self.address,
            error.code() if callable(getattr(error, "code", None)) else error,
            version,
            self.fallback.root,
        )
        served = self.fallback.push(params, version)
        self.last_bytes = self.fallback.last_bytes
        self.version = version
        return served

    def behind(self) -> bool:
        """True if the server serves an older version than the last pushed (it restarted from
        the directory); False if it is current or does not answer within connect_s."""
        try:
            reply = self._version_call(b"", timeout=self.connect_s, wait_for_ready=True)
        except grpc.RpcError:
            return False  # the requests themselves wait for it and retry
        return int(json.loads(reply)["version"]) < self.version

    def close(self):
        self._channel.close()
