"""Rollouts that overlap training: a producer thread with bounded policy staleness.

A step's rollout batch is `collect_step`: rollout rounds (sample, score, old/ref log-probs)
until `select_groups` has P groups (DAPO dynamic sampling, GPG's beta_th carry-over), all
drawn with one set of params. With `rollout.max_staleness = k = 0` the training loop calls it
itself (today's synchronous loop). With k > 0 an `AsyncProducer` calls it on its own thread
while the learner updates, and the learner takes the batches in order with `get(step)`.

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

Weight push: the learner calls `push(params, version)` after every update; the producer's
`to_rollout` makes the rollout copy (a `jax.device_put` to the rollout mesh's shardings with
split meshes, a device-side copy when collocated, since the next update donates the train
state's buffers). A backend that serves its own weights (a versioned holder, e.g. JetStream's)
receives them through its `push(params)` before it samples with them, so every completion of
the step comes from that version; the producer records its own version number on them.

Teacher-forced passes (old log-probs for anchors or `recompute_old_logps`, reference
log-probs) run on the learner with its current params (`learner_batch`), so with k > 0 the
old log-probs are the policy at the start of the update (the PPO proximal policy) and the
sampler's become `behaviour_logps_BxT` (mismatch metrics, `objective.behaviour_correction`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from gjax import sharding
from gjax.experience import Groups, select_groups


@dataclasses.dataclass
class StepBatch:
    """One step's selected groups, the version they were sampled with, and host metrics."""

    step: int
    version: int
    groups: Groups
    metrics: dict[str, float]
    data_state: dict | None = None  # the data iterator's position after this batch


def collect_step(
    rollout, data_iter, params, ref_params, key, *, P: int, sampling, allgather=None
) -> StepBatch:
    """Rollout rounds until `select_groups` fills P groups (or the last allowed round).

    `sampling` is `config.sampling`; round r uses key `fold_in(key, r)`. In a multi-process
    run `P` is this process's share and `allgather` (gjax.multihost) makes every process
    decide on global counts. Returns the batch with `step`/`version` left at -1 (the caller
    knows them).
    """
    min_valid = 1.0 if sampling.dynamic else sampling.min_valid_fraction
    carried: Groups | None = None
    host_metrics: dict[str, float] = {}
    for round_ in range(sampling.max_rollouts_per_step):
        prompts = next(data_iter)
        res = rollout(params, ref_params, prompts, jax.random.fold_in(key, round_))
        host_metrics = {
            **res.metrics,
            **{
                k: v + host_metrics.get(k, 0.0)
                for k, v in res.metrics.items()
                if k.startswith("time/")
            },
        }
        candidates = res.groups if carried is None else Groups.concat([carried, res.groups])
        batch_groups, carried = select_groups(
            candidates,
            P,
            min_valid_fraction=min_valid,
            drop_zero_variance=sampling.dynamic,
            final_round=round_ == sampling.max_rollouts_per_step - 1,
            allgather=allgather,
        )
        if batch_groups is not None:
            break
    host_metrics["sampling/rollouts"] = round_ + 1
    return StepBatch(step=-1, version=-1, groups=batch_groups, metrics=host_metrics)


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


def learner_batch(steps, rollout, groups: Groups, params, ref_params) -> dict[str, jax.Array]:
    """The update's device batch from produced groups, with the teacher-forced passes done here.

    Old log-probs (anchors, or every row with `recompute_old_logps`) come from `params`, the
    learner's policy at the start of this update; with recomputation the sampler's log-probs
    go along as `behaviour_logps_BxT`. Reference log-probs come from `ref_params`.
    """
    batch = steps.put_batch(rollout.model_inputs(groups))
    if ref_params is not None:
        batch["ref_logps_BxT"] = steps.logps(ref_params, batch)
    if rollout.A > 0 or rollout.recompute_old:
        old_BxT = steps.logps(params, batch)
        P, G, T = groups.completion_ids_PxGxN.shape
        anchor_BxT = np.broadcast_to(groups.is_anchor_PxG.reshape(P * G, 1), (P * G, T))
        anchor_BxT = jax.device_put(np.ascontiguousarray(anchor_BxT), steps.batch_sharding)
        behaviour_BxT = jnp.where(anchor_BxT, old_BxT, batch["old_logps_BxT"])
        if rollout.recompute_old:
            batch["old_logps_BxT"] = old_BxT
            batch["behaviour_logps_BxT"] = behaviour_BxT
        else:
            batch["old_logps_BxT"] = behaviour_BxT
    return batch


class AsyncProducer:
    """Produces step batches on a thread, at most `max_staleness` versions behind the learner.

    produce(step, params, version) -> StepBatch runs one step's rollout (`collect_step`
    bound to the rollout, data iterator and ref params); it owns the data iterator while the
    producer runs. `to_rollout(params)` makes the rollout copy of pushed params; `context()`
    returns the context (mesh and sharding rules) the producer thread runs in.
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
        backend=None,
    ):
        self.k = max_staleness
        self.start, self.stop = start, stop
        self._produce = produce
        self._to_rollout = to_rollout
        self._context = context
        self._push_to_backend = getattr(backend, "push", None)
        self._cv = threading.Condition()
        self._params: dict[int, Any] = {}  # version -> rollout copy
        self._ready: dict[int, StepBatch] = {}  # step -> batch
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
        copy = self._to_rollout(params)
        with self._cv:
            self._params[version] = copy
            self._cv.notify_all()

    def get(self, step: int) -> StepBatch:
        """The batch of `step` (blocks); its `metrics` gain the learner's wait and the lag."""
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._ready and self._error is None:
                self._cv.wait()
            if step not in self._ready:  # batches made before a failure are still served
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

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------------ producer side

    def _run(self) -> None:
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
                    if self._push_to_backend is not None:
                        self._push_to_backend(params)
                    batch = self._produce(step, params, version)
                    batch.step, batch.version = step, version
                    tag_version(batch.groups, version)
                    batch.metrics["time/producer_wait_s"] = waited
                    with self._cv:
                        self._ready[step] = batch
                        self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised on the learner's thread
            with self._cv:
                self._error = e
                self._cv.notify_all()


@contextlib.contextmanager
def _on_mesh(mesh):
    with jax.set_mesh(mesh), sharding.use_rules():  # both are per thread
        yield


def start_producer(
    *,
    rollout,
    data_iter,
    params,
    base_key,
    config,
    start: int,
    train_mesh,
    rollout_mesh,
    backend=None,
) -> AsyncProducer:
    """An `AsyncProducer` for `gjax.train`: `collect_step` on the rollout mesh, step keys
    `fold_in(base_key, step)` as the synchronous loop uses, teacher-forced passes deferred to
    the learner (`learner_batch`), pushes copied (collocated) or resharded (split meshes)."""
    rollout.defer_teacher_forced = True
    if rollout_mesh is train_mesh:

        def to_rollout(p):
            return jax.tree.map(jnp.copy, p)  # the next update donates the learner's buffers
    else:
        shardings = sharding.param_shardings(params, rollout_mesh)

        def to_rollout(p):
            return jax.device_put(p, shardings)

        # The same key bits, replicated on the rollout devices (keys feed the sampler there).
        base_key = jax.device_put(base_key, jax.sharding.NamedSharding(rollout_mesh, PS()))

    def produce(step, rollout_params, version):
        del version
        batch = collect_step(
            rollout,
            data_iter,
            rollout_params,
            None,  # reference log-probs: on the learner
            jax.random.fold_in(base_key, step),
            P=config.rollout.prompts_per_step,
            sampling=config.sampling,
        )
        batch.data_state = dict(data_iter.state())
        return batch

    producer = AsyncProducer(
        produce,
        max_staleness=config.rollout.max_staleness,
        start=start,
        stop=config.train.steps,
        to_rollout=to_rollout,
        context=lambda: _on_mesh(rollout_mesh),
        backend=backend,
    )
    return producer.begin(params, dict(data_iter.state()))
