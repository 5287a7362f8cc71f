"""Where the learner's batches come from: one `Producer` interface for every mode.

The training loop asks `producer.get(step)` for step j's batch (a `StepBatch` of selected
groups, from `gjax.rollout.collect.collect_step`) and hands the params back after each update
with `producer.push(params, version)`; `data_state()` is the data position a checkpoint
saves. `make_producer` picks the implementation once, at set-up:

* `SyncProducer` (`rollout.max_staleness = 0`, rollouts on the train mesh): `get` collects
  the batch on the learner's thread from the params pushed last, the learner's own. The
  degenerate case of the schedule below (k = 0: v(j) = j).
* `AsyncProducer` (k > 0, or rollouts on devices of their own): a thread collects batches
  while the learner updates, at most k policy versions behind (with several processes too,
  below).

The staleness rule (deterministic on purpose): the batch of step j is sampled with policy
version

    v(j) = max(j - k, start)        (version = the train state's step: updates applied)

where `start` is the step the run (or its resume) started at. The producer waits for the
learner to push v(j) and never uses a newer one even when it is there, so a run is a function
of its config and seed, not of thread timing, and the learner never trains on a sample more
than k versions old (it waits for the batch instead). In steady state the lag is exactly k:
k = 1 is the one-step-off schedule (rollout of step j+1 runs during update j). At most k
batches wait in the queue and at most k + 1 param versions are held on the rollout devices.

Resume rule (`data_state`): a checkpoint at step s records the data position after the last
batch trained on (step s - 1), never the producer's: in-flight batches (steps s .. s+k-1,
sampled from versions s-k .. s-1 that the checkpoint does not hold) are discarded, and the
resumed producer draws them again from the same prompts with the same keys, from the restored
params (version s). So a resumed run sees exactly the uninterrupted run's data order and
per-step keys; its first k batches are at most as stale as the uninterrupted run's (lag
j - s instead of k), after which the two schedules agree again.

Weight push (`AsyncProducer`): `to_rollout` makes the rollout copy of pushed params (a
`jax.device_put` to the rollout mesh's shardings with split meshes, a device-side copy when
collocated, since the next update donates the train state's buffers). A backend that serves
its own weights (JetStream's versioned holder) receives them through `backend.push` before it
samples with them, so every completion of the step comes from that version; the producer
records its own version number on them, once per version. A LoRA run (`frozen`) places the
base on the rollout devices once and copies only the adapters per push (`adapters_only`). (`SyncProducer` hands the
learner's params to `generate`, which pushes new ones to such a backend itself.)

Several processes (`jax.distributed`): every process must issue the
programs that span other processes' devices (collectives, jits over global arrays) in the
same order, and two threads that both issued them would interleave differently on each
process. So the producer thread issues none: `push` (on the learner's thread, at a fixed
point of the loop) copies the params onto this process's own devices (`sharding.process_mesh`:
the train mesh's PartitionSpecs, an axis the processes split sharded over this process's
part of it, which takes an all-gather across processes) and, with `mesh.rollout_devices`,
on to this process's rollout devices (a `jax.device_put` within the host), and the thread samples, decodes and scores this
process's block of rows there (`Rollout.process_local`: each row's random draws are its row's of the whole batch).
Where the processes split only `data` (the usual layout) every device runs the program it
runs in one process, so the run equals one process's with the same devices; where they
split `fsdp`, log-probs agree to float rounding. Its host exchanges (metrics, `select_groups` counts, the
give-up of a failed rollout) go through jax's coordination key-value store under names
numbered per call (`multihost.KeyValueGather`), which the learner's collectives cannot pair
with. Every process makes the same exchanges in the same order, so the schedule, data order
and resume rule are the one-process ones. With a serving backend (`jetstream_grpc`: the
servers sample, the thread only sends this process's rows' requests) the push to the servers
is a collective (`replicas.ReplicaWeights`), so `push` makes it on the learner's thread
(`learner_pushes`): version v goes out once the thread has sampled every step of an older
version (steps below v + k; the servers hold one version), where one process's thread would
push it, and the thread waits for it as for any version.

Teacher-forced passes (old log-probs of anchors or with `recompute_old_logps`, reference
log-probs) are the learner's (`gjax.learner.Learner.batch`), with its params at the start of
the update: with k > 0 the old log-probs are then the PPO proximal policy and the sampler's
become `behaviour_logps_BxT` (mismatch metrics, `objective.behaviour_correction`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from gjax import multihost, sharding
from gjax.errors import UserError
from gjax.experience import Groups
from gjax.models import lora
from gjax.rollout.backend import RolloutBackend
from gjax.rollout.collect import Rollout, StepBatch, collect_step


class Producer(Protocol):
    """Step batches for the training loop, which hands params back after each update."""

    def get(self, step: int) -> StepBatch:
        """The batch of `step` (blocks until it is ready)."""
        ...

    def push(self, params, version: int) -> None:
        """The learner's params after `version` updates (a batch may be sampled with them)."""
        ...

    def data_state(self) -> dict | None:
        """The data position after the last batch the learner took (what a checkpoint saves)."""
        ...

    def close(self) -> None: ...


class SyncProducer:
    """k = 0 on the train mesh: `get(step)` collects on the learner's thread, from the params
    pushed last (the learner's current ones: version = step)."""

    def __init__(self, collect: Callable[[int, Any], StepBatch], params, start: int, data_state):
        self._collect = collect
        self._params, self._version = params, start
        self._consumed_data_state = data_state

    def get(self, step: int) -> StepBatch:
        batch = self._collect(step, self._params)
        batch.step, batch.version = step, self._version
        self._consumed_data_state = batch.data_state
        return batch

    def push(self, params, version: int) -> None:
        self._params, self._version = params, version  # no copy: used before the next update

    def data_state(self) -> dict | None:
        return self._consumed_data_state

    def close(self) -> None:
        pass


def tag_version(groups: Groups, version: int) -> None:
    """Sets `policy_version_PxG`: `version` on sampled completions, -1 on anchors.

    The producer pushed exactly this version before sampling, so it overrides whatever
    numbering a serving backend keeps of its own."""
    v = np.full(groups.is_anchor_PxG.shape, version, np.int32)
    groups.policy_version_PxG = np.where(groups.is_anchor_PxG, -1, v).astype(np.int32)


def lag_metrics(groups: Groups, learner_version: int) -> dict[str, float]:
    """Policy version lag of the sampled (non-anchor) completions at the update."""
    v = groups.policy_version_PxG
    sampled = v[v >= 0]
    if sampled.size == 0:
        return {}
    lag = learner_version - sampled
    return {"async/version_lag_mean": float(lag.mean()), "async/version_lag_max": float(lag.max())}


class AsyncProducer:
    """Produces step batches on a thread, at most `max_staleness` versions behind the learner.

    produce(step, params, version) -> StepBatch runs one step's rollout (`collect_step`
    bound to the rollout and the data iterator); it owns the data iterator while the
    producer runs. `to_rollout(params)` makes the rollout copy of pushed params; `context()`
    returns the context (mesh and sharding rules) the producer thread runs in. A serving
    `backend` is pushed each version by the thread, or with `learner_pushes` by `push` on the
    learner's thread (several processes: the push is a collective).
    """

    def __init__(
        self,
        produce: Callable[[int, Any, int], StepBatch],
        *,
        max_staleness: int,
        start: int,
        stop: int,
        to_rollout: Callable[[Any], Any],
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        backend: RolloutBackend | None = None,
        learner_pushes: bool = False,
    ):
        self.k = max_staleness
        self.start, self.stop = start, stop
        self._produce = produce
        self._to_rollout = to_rollout
        self._context = context
        self._backend = backend
        self._learner_pushes = learner_pushes
        self._cv = threading.Condition()
        self._params: dict[int, Any] = {}  # version -> rollout copy
        self._ready: dict[int, StepBatch] = {}  # step -> batch
        self._produced = start  # steps before this one are produced
        self._error: BaseException | None = None
        self._closed = False
        self._consumed_data_state: dict | None = None
        self.wait_intervals: list[tuple[float, float]] = []  # producer waits for weights
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def version_for(self, step: int) -> int:
        return max(step - self.k, self.start)

    # ------------------------------------------------------------------------- learner side

    def begin(self, params, data_state: dict | None) -> AsyncProducer:
        """Pushes the starting version and starts the thread."""
        self._consumed_data_state = data_state
        self.push(params, self.start)
        self._thread.start()
        return self

    def push(self, params, version: int) -> None:
        """Hands the learner's params of `version` over (a copy; no host round trip)."""
        if version > self.version_for(self.stop - 1):
            return  # no batch will be sampled with it
        if self._learner_pushes:
            self._serve(params, version)
            return
        copy = self._to_rollout(params)
        with self._cv:
            self._params[version] = copy
            self._cv.notify_all()

    def _serve(self, params, version: int) -> None:
        """`push` with `learner_pushes`: the backend's push, on this (the learner's) thread,
        once the producer has sampled every step of an older version (steps below
        `version + k`: the servers hold one version); then the producer may sample with it."""
        needed = self.start if version == self.start else min(version + self.k, self.stop)
        with self._cv:
            while self._produced < needed and self._error is None and not self._closed:
                self._cv.wait()
            if self._error is not None or self._closed:
                return  # `get` raises the producer's error
        self._backend.push(params)  # a collective: every process, at this point of the loop
        with self._cv:
            self._params[version] = params  # the servers hold the weights; this is their tag
            self._cv.notify_all()

    def get(self, step: int) -> StepBatch:
        """The batch of `step` (blocks); its `metrics` gain the learner's wait and the lag."""
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._ready and self._error is None:
                self._cv.wait()
            if step not in self._ready:  # batches made before a failure are still served
                if isinstance(self._error, UserError):  # its paragraph, not a traceback
                    raise self._error
                raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
            batch = self._ready.pop(step)
        if step - batch.version > self.k or batch.step != step:
            raise AssertionError(
                f"step {step} got batch {batch.step} of version {batch.version} (k={self.k})"
            )
        self._consumed_data_state = batch.data_state
        batch.metrics["time/learner_wait_s"] = time.perf_counter() - t0
        batch.metrics.update(lag_metrics(batch.groups, step))
        return batch

    def data_state(self) -> dict | None:
        """The data position after the last batch the learner took (what a checkpoint saves)."""
        return self._consumed_data_state

    @property
    def closed(self) -> bool:
        """Whether `close` was called (the producer thread then stops at its next wait)."""
        return self._closed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------------ producer side

    def _run(self) -> None:
        served = None  # the version the backend was last pushed from this thread
        try:
            with self._context():
                for step in range(self.start, self.stop):
                    version = self.version_for(step)
                    t0 = time.perf_counter()
                    with self._cv:
                        while version not in self._params and not self._closed:
                            self._cv.wait()
                        if self._closed:
                            return
                        for old in [v for v in self._params if v < version]:
                            del self._params[old]
                        params = self._params[version]
                    self.wait_intervals.append((t0, time.perf_counter()))
                    waited = self.wait_intervals[-1][1] - t0
                    # A backend serving its own copy of the weights gets each version once
                    # (with `learner_pushes` the learner's thread pushed it already).
                    pushes = self._backend is not None and not self._learner_pushes
                    if pushes and version != served:
                        self._backend.push(params)
                        served = version
                    batch = self._produce(step, params, version)
                    batch.step, batch.version = step, version
                    tag_version(batch.groups, version)
                    batch.metrics["time/producer_wait_s"] = waited
                    with self._cv:
                        self._ready[step] = batch
                        self._produced = step + 1
                        self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised on the learner's thread
            with self._cv:
                self._error = e
                self._cv.notify_all()


@contextlib.contextmanager
def _on_mesh(mesh):
    with jax.set_mesh(mesh), sharding.use_rules():  # both are per thread
        yield


def make_producer(
    *,
    rollout: Rollout,
    data_iter,
    params,
    base_key: jax.Array,
    config,
    start: int,
    train_mesh,
    rollout_mesh,
    backend: RolloutBackend,
    frozen=None,
) -> Producer:
    """The run's producer, started: synchronous for k = 0 on the train mesh, else an
    `AsyncProducer` on the rollout mesh (several processes: on each process's own devices of
    the train mesh). Step j's batch is `collect_step` with key `fold_in(base_key, j)` on this
    process's share of the prompts in every case. `frozen`: a LoRA run's base (in `params`,
    never donated): placed on the rollout devices once, so a push moves only the adapters."""
    k = config.rollout.max_staleness
    gather = None  # several processes, asynchronous: the producer thread's host exchanges
    if k == 0 and rollout_mesh is train_mesh:
        to_rollout = None
    elif jax.process_count() > 1:  # each process samples on devices of its own
        local_mesh = sharding.process_mesh(train_mesh)
        to_rollout = sharding.process_local_copy(train_mesh, local_mesh)
        if rollout_mesh is train_mesh:
            rollout_mesh = local_mesh
        else:  # this process's rollout devices (sharding.make_meshes): one more local copy
            to_rollout = _then_put(to_rollout, rollout_mesh)
        gather = multihost.KeyValueGather()
        rollout = rollout.process_local(multihost.LocalRows(rollout.transfer.layout, gather))
        # The key, made replicated over the train mesh, copied from this process's shard.
        local_key = base_key.addressable_data(0)
        base_key = jax.device_put(local_key, jax.sharding.NamedSharding(rollout_mesh, PS()))
    elif rollout_mesh is train_mesh:

        def to_rollout(p):
            return jax.tree.map(jnp.copy, p)  # the next update donates the learner's buffers
    else:

        def to_rollout(p):
            return jax.device_put(p, sharding.param_shardings(p, rollout_mesh))

        # The same key bits, replicated on the rollout devices (keys feed the sampler there).
        base_key = jax.device_put(base_key, jax.sharding.NamedSharding(rollout_mesh, PS()))

    def collect(step, rollout_params, version=None):
        del version
        return collect_step(
            rollout,
            data_iter,
            rollout_params,
            jax.random.fold_in(base_key, step),
            P=data_iter.local_batch_size,  # this process's slots of the P
            sampling=config.sampling,
            allgather=rollout.transfer.allgather,
        )

    if to_rollout is not None and frozen is not None:
        collocated = rollout_mesh is train_mesh and jax.process_count() == 1
        to_rollout = adapters_only(to_rollout, frozen, collocated=collocated)
    if to_rollout is None:
        return SyncProducer(collect, params, start, dict(data_iter.state()))
    producer = AsyncProducer(
        collect,
        max_staleness=k,
        start=start,
        stop=config.train.steps,
        to_rollout=to_rollout,
        context=lambda: _on_mesh(rollout_mesh),
        backend=backend,
        # Several processes: a serving backend's push is a collective (the loop's thread).
        learner_pushes=gather is not None and config.rollout.backend != "local",
    )
    if gather is not None:  # a closed producer stops waiting for peers that will not come
        gather.stopped = lambda: producer.closed
    return producer.begin(params, dict(data_iter.state()))


def _then_put(copy: Callable[[Any], Any], mesh) -> Callable[[Any], Any]:
    """`copy`, then `jax.device_put` onto `mesh` by the logical-axis rules (devices of this
    process only)."""

    def put(params):
        local = copy(params)
        return jax.device_put(local, sharding.param_shardings(local, mesh))

    return put


def adapters_only(copy: Callable[[Any], Any], frozen, *, collocated: bool) -> Callable:
    """A LoRA run's `to_rollout`: `copy` applied to the adapters alone, over the frozen base
    placed once (`collocated`: the base itself, which no update donates; else `copy(frozen)`
    now), so a push moves the adapters (about 1 % of the bytes at rank 16), never the base."""
    base = frozen if collocated else copy(frozen)
    return lambda params: lora.merge(base, copy(lora.split(params)[1]))
