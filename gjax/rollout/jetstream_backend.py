"""`RolloutBackend`s served by JetStream: in-process (its Driver) or over gRPC (`gjax.serve`).

Both send all P x G requests at once as JetStream `DecodeRequest`s carrying the exact prompt
token ids (the engine drops the BOS JetStream adds; see `gjax.rollout.engine`) and gather
the streamed token ids. A request that fails is retried with exponential backoff, at most
`max_retries` times and within `timeout_s` of the batch's start (`rollout.request_timeout_s`);
then it is dropped: its row comes back empty with `valid_B = False`, which masks it out of its
group, and the step goes on (a request the server rejects as invalid is dropped at once). Over
gRPC the requests spread over the replicas of `rollout.server_addresses`
(`gjax.rollout.replicas`: least outstanding; a replica that fails UNAVAILABLE is taken out
and its requests go to the others at once; with none live a call waits for one, probed every
0.5 s, so a restarted server is used within about a second). In a multi-process run each
process sends its own rows.

In-process (`JetStreamBackend`), the gjax `Engine` records each generated token's log-prob
(same definition as the local sampler) and params version, so on-policy rows need no second
forward. The gRPC reply carries token ids only, so `JetStreamGrpcBackend` returns zeros and
`returns_logps = False` tells the learner to recompute them by teacher forcing.

Weights: `generate(params, ...)` pushes `params` when they are a new object (after every
update). In-process this swaps the engine's `ParamsHolder` (no recompilation); over gRPC it
writes them to a versioned directory the servers watch (`gjax.rollout.weight_push`), or with
`rollout.weight_transfer='grpc'` process 0 streams them to each server
(`gjax.rollout.weight_stream`; the directory stays the fallback), and every process waits for
each replica to serve the new version (`gjax.rollout.replicas.ReplicaWeights`). The seconds
and bytes of the push since the last metrics row are the step's `rollout/push_s` and
`rollout/push_bytes` (0 without a push).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
import numpy as np

from gjax import multihost, schema
from gjax.errors import UserError
from gjax.models import lora
from gjax.rollout import jetstream_episodes
from gjax.rollout.backend import LocalSampler, rollout_sampling
from gjax.rollout.buckets import prefill_bucket, served_prompt_len
from gjax.rollout.engine import RESTART_TOKEN, Engine, ParamsHolder
from gjax.rollout.handoff import Handoff, adapter_record
from gjax.rollout.jetstream_compat import Driver, jetstream
from gjax.rollout.sampler import SampleOutput, SamplingParams
from gjax.rollout.weight_push import WeightPusher

log = logging.getLogger("gjax")


class PromptTooLong(UserError, ValueError):
    """A prompt that does not fit the engine's largest prefill bucket."""


class _JetStreamClient:
    """Shared request building, retries and assembly; subclasses submit one request."""

    returns_logps = False

    def __init__(self, *, max_prefill_length: int, timeout_s: float, max_retries: int, backoff_s):
        self.max_prefill_length = max_prefill_length
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._params_id = None
        self.version = 0  # the version new requests are served with
        self.latest_version = 0  # the newest pushed (ahead of `version` if a push is unacked)
        self.counters = {"requests": 0, "retried": 0, "dropped": 0}
        self.last_error = None  # the last dropped request's error, for the run's message
        self._last = {}
        self._pushed = {"rollout/push_s": 0.0, "rollout/push_bytes": 0.0}
        self._local = threading.local()  # each thread's last `generate_episodes` figures

    # subclasses
    def _submit(self, request, deadline: float) -> concurrent.futures.Future: ...
    def _push(self, params) -> tuple[int, int]: ...  # (version, bytes sent)
    def _prepare(self, sampling: SamplingParams) -> None: ...
    def _finish(self, rows: dict, out: dict) -> None: ...

    def push(self, params) -> int:
        """Serves `params` from now on; returns their policy version."""
        with self._lock:
            t0 = time.perf_counter()
            self._params_id = id(params)
            self.version, nbytes = self._push(params)
            self.latest_version = max(self.latest_version + 1, self.version)
            self._pushed = {
                "rollout/push_s": time.perf_counter() - t0,
                "rollout/push_bytes": float(nbytes),
            }
            return self.version

    def metrics(self, gather=multihost.allgather) -> dict[str, float]:
        """The last batch's serving figures and the push since the last call (for the step's
        metrics row; a push before the first step, e.g. for an evaluation, counts in it),
        combined over processes through `gather`."""
        out = {**self._last, **self._pushed, **self._replica_metrics()}
        self._pushed = {"rollout/push_s": 0.0, "rollout/push_bytes": 0.0}
        return _combine(out, gather)

    def _replica_metrics(self) -> dict[str, float]:
        return {}

    def failure(self) -> str:
        error = f"last error: {self.last_error}" if self.last_error else "see the warnings above"
        return f"{error}; served by {self.served_by()}"

    def served_by(self) -> str:
        return "the in-process JetStream engine (config.rollout.backend=jetstream)"

    def generate(
        self,
        params,
        prompt_tokens_PxS,
        prompt_mask_PxS,
        rng,
        *,
        num_samples,
        sampling,
        max_tokens_B=None,
    ) -> SampleOutput:
        """`RolloutBackend.generate`; `max_tokens_B` optionally caps each request's length
        (JetStream's per-request `max_tokens`; at most `sampling.max_new_tokens`). Its steps:
        the prompts' ids (`_prompt_ids`), one request per row, sent with retries within one
        deadline (`_send`), the replies laid out as rows (`_rows`), the counters."""
        del rng  # the engine samples with its own per-request keys
        prompts = self._prompt_ids(prompt_tokens_PxS, prompt_mask_PxS)
        if id(params) != self._params_id:
            self.push(params)
        g_ = num_samples
        b_, n_ = len(prompts) * g_, sampling.max_new_tokens
        with self._lock:
            self._prepare(sampling)
            requests = [
                jetstream.jetstream_pb2.DecodeRequest(
                    token_content=jetstream.jetstream_pb2.DecodeRequest.TokenContent(
                        token_ids=prompts[b // g_].tolist()
                    ),
                    max_tokens=n_ if max_tokens_B is None else min(n_, int(max_tokens_B[b])),
                )
                for b in range(b_)
            ]
            replies, retried, dropped = self._send(requests)
            out = self._rows(replies, b_, n_, sampling.pad_token_id)
        self.counters["requests"] += b_
        self.counters["retried"] += retried
        self.counters["dropped"] += dropped
        lag = self.latest_version - out["version"][out["valid"]]
        self._last = {
            "rollout/requests_retried": float(retried),
            "rollout/requests_dropped": float(dropped),
            "rollout/policy_version": float(self.latest_version),
            "rollout/version_lag_max": float(lag.max()) if lag.size else 0.0,
            "rollout/version_lag_mean": float(lag.mean()) if lag.size else 0.0,
        }
        return SampleOutput(
            out["tokens"],
            out["mask"],
            out["logps"],
            out["mask"].sum(-1).astype(np.int32),
            out["valid"],
            out["version"],
        )

    def generate_episodes(
        self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling, turns
    ):
        """Multi-turn rows (`gjax.rollout.turns.Trajectories`) on the server, each turn one
        request carrying the row's whole history (`gjax.rollout.jetstream_episodes`); this
        process's rows, on the host. The batch's figures: `episode_stats()`; its requests
        retried and dropped, over every turn, in `metrics()`."""
        del rng  # the server samples with its own per-request keys
        retried, dropped = self.counters["retried"], self.counters["dropped"]
        traj, self._local.stats = jetstream_episodes.generate_episodes(
            self,
            params,
            _host_rows(prompt_tokens_PxS)[0],
            _host_rows(prompt_mask_PxS)[0],
            num_samples=num_samples,
            sampling=sampling,
            turns=turns,
        )
        self._last["rollout/requests_retried"] = float(self.counters["retried"] - retried)
        self._last["rollout/requests_dropped"] = float(self.counters["dropped"] - dropped)
        return traj

    def episode_stats(self) -> dict[str, float]:
        """This thread's last `generate_episodes` batch's figures (`EnvTurns.stats` and more)."""
        return getattr(self._local, "stats", {})

    def _prompt_ids(self, prompt_tokens_PxS, prompt_mask_PxS) -> list[np.ndarray]:
        """Each prompt's ids (its mask's tokens); one the engine cannot prefill is refused."""
        tokens_PxS = np.asarray(prompt_tokens_PxS)
        mask_PxS = np.asarray(prompt_mask_PxS).astype(bool)
        prompts = [t[m].astype(np.int32) for t, m in zip(tokens_PxS, mask_PxS)]
        for p, ids in enumerate(prompts):
            if len(ids) + 1 > self.max_prefill_length:
                raise PromptTooLong(
                    f"prompt {p} has {len(ids)} tokens; the JetStream engine's "
                    f"max_prefill_length={self.max_prefill_length} holds {self.max_prefill_length - 1} "
                    "(one position is JetStream's BOS). Raise config.data.max_prompt_len (the "
                    "engine's bucket follows it) or shorten the prompts."
                )
        return prompts

    def _send(self, requests) -> tuple[dict, int, int]:
        """(replies by row, requests retried, requests dropped): every request sent, the
        failed ones again after a backoff (`max_retries` times) within one deadline for the
        whole batch; a rejected one (INVALID_ARGUMENT) is not retried. A request the engine
        restarted (`Restarted`: weight_change='restart', or preempted for its paged KV) is
        no fault: it goes again with the next round at once, outside the retry budget (a
        retried request, counted). What is still missing at the end is dropped, with one
        warning line."""
        rows, retried, error, pending, given_up = {}, 0, None, list(range(len(requests))), []
        deadline = time.monotonic() + self.timeout_s  # the whole batch, retries included
        attempt = 0
        while time.monotonic() < deadline:
            futures = {b: self._submit(requests[b], deadline) for b in pending}
            failed, restarted = [], []
            for b, fut in futures.items():
                try:
                    rows[b] = (fut.result(max(0.0, deadline - time.monotonic())), fut)
                except Exception as e:  # noqa: BLE001 - any failure is retried, then counted
                    fut.cancel()
                    error = e
                    if _restarted(e):
                        restarted.append(b)
                        continue
                    if _rejected(e):  # INVALID_ARGUMENT: a retry gets the same answer
                        given_up.append(b)
                    else:
                        failed.append(b)
            if failed and attempt == self.max_retries:  # out of retries: they are dropped
                given_up += failed
                failed = []
            pending = failed + restarted
            if not pending:
                break
            if failed:  # a fault: back off first
                attempt += 1
                wait = self.backoff_s * 2 ** (attempt - 1)
                time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            retried += len(pending)
        pending += given_up
        if pending:
            self.last_error = _short(error, self.timeout_s)
            log.warning(
                "JetStream: %d of %d requests dropped after at most %d retries within %.0f s "
                "(last error: %s)",
                len(pending),
                len(requests),
                self.max_retries,
                self.timeout_s,
                _short(error, self.timeout_s),
            )
        return rows, retried, len(pending)

    def _rows(self, replies: dict, b_: int, n_: int, pad_id: int) -> dict[str, np.ndarray]:
        """The replies as [B, N] rows (pad and mask 0 past each reply, `valid` False for a
        dropped row), then `_finish`'s log-probs and versions."""
        out = {
            "tokens": np.full((b_, n_), pad_id, np.int32),
            "mask": np.zeros((b_, n_), np.int32),
            "logps": np.zeros((b_, n_), np.float32),
            "valid": np.zeros((b_,), bool),
            "version": np.full((b_,), self.version, np.int32),
        }
        for b, (ids, _) in replies.items():
            out["tokens"][b, : len(ids)] = ids
            out["mask"][b, : len(ids)] = 1
            out["valid"][b] = True
        self._finish(replies, out)
        return out


def _combine(metrics: dict[str, float], gather) -> dict[str, float]:
    """Per-process serving figures -> the run's: the slowest push, the newest version, the
    largest lag / in-flight count, the mean lag, every other count summed (every process
    calls it, in the same order)."""
    if jax.process_count() == 1:
        return metrics
    keys = sorted(metrics)
    values = gather(np.asarray([metrics[k] for k in keys], np.float64))
    out = {}
    for i, k in enumerate(keys):
        col = values[:, i]
        if k.endswith(("_s", "_max", "policy_version", "push_bytes")):
            out[k] = float(col.max())
        elif k.endswith("_mean"):
            out[k] = float(col.mean())
        else:
            out[k] = float(col.sum())
    return out


_GLOBAL_FIELDS = ("tokens_BxN", "mask_BxN", "logps_BxN", "lengths_B")


def _host_rows(x):
    """(this process's rows of `x` on the host, the global sharding or None): a global array
    sharded over rows (several processes) gives its block (`gjax.multihost.RowLayout`)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        n = x.shape[0]
        pieces = {s.index[0].indices(n)[0]: s.data for s in x.addressable_shards}
        return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)]), x.sharding
    return np.asarray(x), None


def _global_rows(x: np.ndarray, like) -> jax.Array:
    """This process's rows -> the global array laid out by rows as `like` (a sharding)."""
    spec = jax.sharding.PartitionSpec(like.spec[0], *([None] * (x.ndim - 1)))
    sharding = jax.sharding.NamedSharding(like.mesh, spec)
    shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    return jax.make_array_from_process_local_data(sharding, x, shape)


class Restarted(RuntimeError):
    """The engine ended the request with RESTART_TOKEN: send it again (not a fault)."""


def _restarted(error) -> bool:
    """The engine restarted the request (in-process: `Restarted`; gRPC: ABORTED)."""
    if isinstance(error, Restarted):
        return True
    code = getattr(error, "code", None)
    return callable(code) and getattr(code(), "name", "") == "ABORTED"


def _rejected(error) -> bool:
    """The server answered INVALID_ARGUMENT: a retry would get the same answer."""
    code = getattr(error, "code", None)
    return callable(code) and getattr(code(), "name", "") == "INVALID_ARGUMENT"


def _short(error, timeout_s: float) -> str:
    if error is None:
        return "none"
    if isinstance(error, TimeoutError):
        return f"no answer within rollout.request_timeout_s={timeout_s:g} s"
    code = getattr(error, "code", None)
    if callable(code):
        return f"{code()} {getattr(error, 'details', lambda: '')()}"
    return repr(error)


def _token_ids(responses, max_tokens: int) -> list[int]:
    """The request's first `max_tokens` token ids; raises if the engine failed or restarted
    it within them (the tokens past max_tokens, from a call's extra columns, are dropped
    first: a failure there is not the request's)."""
    ids: list[int] = []
    for resp in responses:
        for sample in resp.stream_content.samples:
            ids.extend(sample.token_ids)
    ids = ids[:max_tokens]
    if RESTART_TOKEN in ids:  # weight_change='restart' or paged KV preemption: sent again
        raise Restarted("the engine restarted this request; it is sent again")
    if any(t < 0 for t in ids):  # the engine's ERROR_TOKEN: the request's slot failed
        raise RuntimeError("the engine produced non-finite logits for this request")
    return ids


class JetStreamBackend(_JetStreamClient):
    """In-process serving: the gjax `Engine` behind JetStream's `Driver`/orchestrator.

    `Driver` (`gjax.rollout.jetstream_compat.Driver`: JetStream's, with gjax's generate thread)
    runs its prefill, generate and detokenize threads in this process; requests go
    through `LLMOrchestrator.Decode` (the gRPC servicer's method, called directly) on an
    asyncio loop thread. The engine's ResultTokens also carry each token's log-prob and the
    params version; they are joined to requests by serial (prefill order, which is the order
    requests are placed, one prefill thread) and checked against the returned tokens.
    """

    returns_logps = True

    def __init__(
        self,
        cfg,
        params,
        *,
        sampling: SamplingParams,
        slots: int,
        max_prompt_len: int,
        mesh=None,
        seed: int = 0,
        timeout_s: float = 600.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        tokens_per_dispatch: int = 1,
        weight_change: str = "finish",
        kv_page_size: int = 0,
        kv_pages: int | None = None,
        paged_attention: str = "auto",
        poison_freed_pages: bool = False,
    ):
        max_prefill = prefill_bucket(max_prompt_len)
        super().__init__(
            max_prefill_length=max_prefill,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        self.holder = ParamsHolder(params, version=0)
        self._params_id = id(params)
        self.engine = Engine(
            cfg,
            self.holder,
            sampling=sampling,
            max_concurrent_decodes=slots,
            max_prefill_length=max_prefill,
            mesh=mesh,
            seed=seed,
            tokens_per_dispatch=tokens_per_dispatch,
            weight_change=weight_change,
            kv_page_size=kv_page_size,
            kv_pages=kv_pages,
            paged_attention=paged_attention,
            poison_freed_pages=poison_freed_pages,
        )
        self.driver = Driver(
            prefill_engines=[self.engine],
            generate_engines=[self.engine],
            prefill_params=[self.holder],
            generate_params=[self.holder],
            interleaved_mode=True,
        )
        # JetStream's detokenize thread is not a daemon: a process leaving on an exception
        # would wait for it forever. Stop the Driver before interpreter shutdown joins it
        # (the hook concurrent.futures uses for the same reason).
        threading._register_atexit(self.close)
        self._closed = False
        self._orchestrator = jetstream.orchestrator.LLMOrchestrator(driver=self.driver)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="jetstream-client", daemon=True
        )
        self._loop_thread.start()
        self._serial_of: dict[int, int] = {}  # id(future) -> request serial
        self._placed = 0
        self._preempted_seen = 0  # the engine's preemptions already reported (`metrics`)

    def _push(self, params):
        return self.holder.swap(params), 0  # the same process: nothing is sent

    def _replica_metrics(self) -> dict[str, float]:
        """Paged KV (rollout.kv_page_size): requests the engine preempted since the last
        call (its pool short; each sent again) and the pool's peak pages in use."""
        stats = self.engine.kv_stats
        if not stats:
            return {}
        seen, self._preempted_seen = self._preempted_seen, stats["requests_preempted"]
        return {
            "rollout/requests_preempted": float(stats["requests_preempted"] - seen),
            "rollout/kv_pages_peak_max": float(stats["kv_pages_peak"]),
        }

    def _prepare(self, sampling):
        self.engine.set_sampling(sampling)

    async def _decode(self, request):
        return _token_ids([r async for r in self._orchestrator.Decode(request)], request.max_tokens)

    def _submit(self, request, deadline):
        del deadline  # the caller waits on the future until then
        # Coroutines start in submission order and place their request before their first
        # await, so the k-th request placed is the k-th prefilled: its serial.
        fut = asyncio.run_coroutine_threadsafe(self._decode(request), self._loop)
        self._serial_of[id(fut)] = self._placed
        self._placed += 1
        return fut

    def _finish(self, rows, out):
        records = self.engine.drain_records()
        by_serial: dict[int, np.ndarray] = {}
        if len(records):
            order = np.lexsort((records[:, 1], records[:, 0]))
            records = records[order]
            starts = np.flatnonzero(np.diff(records[:, 0], prepend=-1))
            for chunk in np.split(records, starts[1:]):
                by_serial[int(chunk[0, 0])] = chunk
        for b, (_ids, fut) in rows.items():
            rec = by_serial.get(self._serial_of.get(id(fut), -1))
            n = int(out["mask"][b].sum())
            if rec is None or len(rec) < n or not np.array_equal(rec[:n, 2], out["tokens"][b, :n]):
                raise RuntimeError(
                    f"JetStream engine records do not match request {b}'s tokens: the "
                    "serial bookkeeping is broken (another client on this Driver?)"
                )
            out["logps"][b, :n] = rec[:n, 3].view(np.float32)
            out["version"][b] = rec[:n, 4].min() if n else self.version
        self._serial_of.clear()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.driver.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()


class JetStreamGrpcBackend(_JetStreamClient):
    """`gjax.serve` replicas over gRPC (`gjax.rollout.replicas`). Log-probs are recomputed by
    the trainer. In a multi-process run `generate` takes global arrays laid out by rows and
    returns them so (as the local sampler does; `valid_B`, `version_B`: this process's rows);
    each process sends only its own rows' requests."""

    returns_logps = False

    def __init__(
        self,
        address: str | list[str],
        *,
        max_prompt_len: int,
        server_sampling: SamplingParams | None = None,
        local=None,
        weights=None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_workers: int = 256,
        pool=None,
    ):
        # optional dependency (the jetstream extra): only the gRPC client needs grpc
        from gjax.rollout.replicas import ReplicaPool

        super().__init__(
            max_prefill_length=prefill_bucket(max_prompt_len),
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.address = self.addresses[0]
        self.pool = pool if pool is not None else ReplicaPool(self.addresses)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, "jetstream-grpc")
        # replicas.ReplicaWeights, weight_push.WeightPusher or weight_stream.GrpcWeightPusher;
        # None: the servers keep their own
        self.weights = weights
        # A DecodeRequest carries no sampling settings: the server samples with the run's
        # (`server_sampling`); other settings (greedy held-out evaluation) run on `local`.
        self.server_sampling = server_sampling
        self.local = local

    def generate(
        self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling, **kw
    ):
        # The server ignores `row_block` (a process-local rollout's block of the batch).
        as_served = dataclasses.replace(sampling, row_block=(0, 1))
        if self.server_sampling is not None and as_served != self.server_sampling:
            if self.local is None:
                raise ValueError(
                    f"the JetStream server samples with {self.server_sampling}; got {sampling} "
                    "(a DecodeRequest carries no sampling settings)"
                )
            return self.local.generate(
                params,
                prompt_tokens_PxS,
                prompt_mask_PxS,
                rng,
                num_samples=num_samples,
                sampling=sampling,
            )
        # A server that restarted from an older version (the gRPC stream's case): push again.
        if self.weights is not None and id(params) == self._params_id and self.weights.behind():
            self._params_id = None
        self.pool.check()  # a replica behind the pushed version waits for it
        tokens_PxS, like = _host_rows(prompt_tokens_PxS)
        mask_PxS, _ = _host_rows(prompt_mask_PxS)
        resubmitted = self.pool.resubmitted
        out = super().generate(
            params, tokens_PxS, mask_PxS, rng, num_samples=num_samples, sampling=sampling, **kw
        )
        moved = self.pool.resubmitted - resubmitted  # sent again to another replica
        self.counters["retried"] += moved
        self._last["rollout/requests_retried"] += moved
        if like is None:
            return out
        # Per-sequence arrays global (as the local sampler's); valid / version stay this
        # process's rows, which is what the rollout reads them as.
        return out._replace(**{f: _global_rows(getattr(out, f), like) for f in _GLOBAL_FIELDS})

    def _push(self, params):
        if self.weights is None:
            return self.version, 0
        return self.weights.push(params), self.weights.last_bytes

    def _prepare(self, sampling):
        pass

    def _submit(self, request, deadline):
        # A replica that fails UNAVAILABLE is taken out and the request goes to another; with
        # none live the call waits for one (probed every 0.5 s) until the deadline.
        parse = functools.partial(_token_ids, max_tokens=request.max_tokens)
        return self._pool.submit(self.pool.call, request, deadline, parse)

    def _finish(self, rows, out):
        pass

    def _replica_metrics(self) -> dict[str, float]:
        return self.pool.metrics() if len(self.addresses) > 1 else {}

    def served_by(self) -> str:
        if len(self.addresses) == 1:
            return f"the gjax.serve server at {self.address} (config.rollout.server_address)"
        return f"the gjax.serve replicas {self.pool.describe()} (config.rollout.server_addresses)"

    def close(self):
        if self.weights is not None:
            self.weights.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.pool.close()


def _handoff(model_cfg, params) -> Handoff:
    """What this run pushes to its replicas: with LoRA the adapters only, named by their
    record (rank, alpha, targets and the base's digest, computed here once)."""
    if not lora.enabled(model_cfg):
        return Handoff()
    return Handoff(adapter_record(model_cfg, lora.split(params)[0]))


def from_config(config, model_cfg, params, *, mesh=None, workdir=None, tokenizer=None):
    """The backend `config.rollout.backend` names (jetstream | jetstream_grpc)."""
    r = config.rollout
    if r.backend == "jetstream":
        return JetStreamBackend(
            model_cfg,
            params,
            sampling=SamplingParams(max_new_tokens=r.max_new_tokens),
            slots=r.decode_slots,
            max_prompt_len=served_prompt_len(config),
            mesh=mesh,
            seed=config.seed,
            timeout_s=r.request_timeout_s,
            max_retries=r.max_retries,
            tokens_per_dispatch=r.tokens_per_dispatch,
            weight_change=r.weight_change,
            kv_page_size=r.kv_page_size,
            kv_pages=r.kv_pages or None,
            paged_attention=r.paged_attention,
        )
    # grpc is optional (the jetstream extra): imported only for the gRPC client.
    from gjax.rollout.replicas import ReplicaPool, ReplicaWeights

    addresses = schema.server_addresses(r)
    pool = ReplicaPool(addresses)
    push_dir = r.push_dir or os.path.join(workdir or ".", "push")
    handoff = _handoff(model_cfg, params)
    weights = ReplicaWeights(
        pool,
        WeightPusher(push_dir, ack_timeout_s=r.request_timeout_s, handoff=handoff),
        stream=r.weight_transfer == "grpc",
        ack_timeout_s=r.request_timeout_s,
        handoff=handoff,
    )
    return JetStreamGrpcBackend(
        addresses,
        pool=pool,
        max_prompt_len=served_prompt_len(config),
        server_sampling=rollout_sampling(config, model_cfg, tokenizer),
        local=LocalSampler(model_cfg),
        weights=weights,
        timeout_s=r.request_timeout_s,
        max_retries=r.max_retries,
    )
