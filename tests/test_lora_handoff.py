"""Adapter-only hand-off (gjax.rollout.handoff): a LoRA run's pushes move only the adapters,
to the in-process rollout devices (the producer) and to a server (push directory, gRPC
stream), and a server on another base or other adapter settings refuses a push by name."""

import json
import types

import jax
import numpy as np
import pytest

from gjax import schema, sharding
from gjax.models import lora
from gjax.rollout import collect, producer
from gjax.rollout.engine import ParamsHolder
from gjax.rollout.handoff import Handoff, HandoffMismatch, adapter_record
from gjax.rollout.weight_push import (
    ADAPTER_META,
    WeightPusher,
    WeightWatcher,
    served_version,
    version_dir,
)
from tests.test_experience import make_groups
from tests.test_lora import BASE, CFG, trained_adapters


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def placed_base(mesh):
    return jax.device_put(BASE, sharding.param_shardings(BASE, mesh))


def test_split_meshes_place_the_base_once_and_push_only_adapters(monkeypatch):
    """`mesh.rollout_devices` > 0 (4 + 4 CPU devices): the producer's rollout copy of each
    version holds the same base arrays on the rollout devices (placed once, at the start), and
    the pushed version's adapters, moved there."""
    train_mesh, rollout_mesh = sharding.make_meshes(
        {"data": -1, "fsdp": 1, "tensor": 1}, 4, jax.devices()[:8]
    )
    seen = {}

    def fake_collect(rollout, data_iter, params, key, **kw):  # what the sampler is handed
        seen[len(seen)] = params
        return collect.StepBatch(-1, -1, make_groups([[0.0, 1.0]]), {}, data_state={})

    monkeypatch.setattr(producer, "collect_step", fake_collect)
    config = schema.base()
    config.train.steps = 2
    with jax.set_mesh(train_mesh), sharding.use_rules():
        base = placed_base(train_mesh)
        shardings = sharding.param_shardings(lora.abstract_adapters(CFG), train_mesh)
        v0 = jax.device_put(trained_adapters(seed=1), shardings)
        v1 = jax.device_put(trained_adapters(seed=2), shardings)
        prod = producer.make_producer(
            rollout=types.SimpleNamespace(transfer=types.SimpleNamespace(allgather=None)),
            data_iter=types.SimpleNamespace(local_batch_size=1, state=lambda: {}),
            params=lora.merge(base, v0),
            base_key=jax.random.key(0),
            config=config,
            start=0,
            train_mesh=train_mesh,
            rollout_mesh=rollout_mesh,
            backend=None,
            frozen=base,
        )
        prod.get(0)
        prod.push(lora.merge(base, v1), 1)
        prod.get(1)
        prod.close()
    rollout_devices = set(rollout_mesh.devices.flat)
    (base0, a0), (base1, a1) = (lora.split(seen[i]) for i in (0, 1))
    assert all(x is y for x, y in zip(jax.tree.leaves(base0), jax.tree.leaves(base1)))
    for x in jax.tree.leaves(seen[1]):
        assert x.sharding.device_set == rollout_devices
    for got, want in ((a0, v0), (a1, v1)):
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # What one push moves: the adapters only.
    assert nbytes(a1) < 0.5 * nbytes(base1)


def server(tmp_path, *, rank=4, base=None):
    """A server's side: the holder (base + initial adapters) and its `Handoff`."""
    cfg = CFG.replace(lora_rank=rank)
    base = BASE if base is None else base
    adapters = lora.init_adapters(cfg, jax.random.key(0))
    holder = ParamsHolder(lora.merge(base, adapters), version=0)
    return holder, Handoff(adapter_record(cfg, base), base)


def test_a_directory_push_writes_the_adapters_and_their_record_only(tmp_path):
    root = tmp_path / "push"
    holder, served = server(tmp_path)
    trainer = Handoff(adapter_record(CFG, BASE))
    pusher = WeightPusher(root, ack_timeout_s=30, handoff=trainer)
    watcher = WeightWatcher(root, holder, poll_s=0.05, handoff=served).start()
    adapters = trained_adapters()
    try:
        assert pusher.push(lora.merge(BASE, adapters), 1) == 1
    finally:
        watcher.stop()
    assert pusher.last_bytes == nbytes(adapters) < 0.2 * nbytes(BASE)
    written = sum(f.stat().st_size for f in version_dir(root, 1).rglob("*") if f.is_file())
    assert written < nbytes(adapters) + 64 * 1024  # orbax's metadata, no base
    record = json.loads((version_dir(root, 1) / ADAPTER_META).read_text())
    assert record == trainer.record and record["rank"] == 4
    assert holder.version == 1 and served_version(root) == 1
    got_base, got = lora.split(holder.params)
    assert all(x is y for x, y in zip(jax.tree.leaves(got_base), jax.tree.leaves(BASE)))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(adapters)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "other, words",
    [
        ("base", "trained on another base"),
        ("rank", "rank 4"),
        ("full", "full weights"),
    ],
)
def test_a_server_refuses_another_bases_adapters_by_name(tmp_path, other, words):
    """The watcher refuses the version (REFUSED), and the trainer waiting for it raises the
    paragraph; the server keeps serving version 0."""
    root = tmp_path / "push"
    if other == "base":
        moved = jax.tree.map(lambda x: x + 1.0, BASE)
        holder, served = server(tmp_path, base=moved)
    elif other == "rank":
        holder, served = server(tmp_path, rank=2)
    else:
        holder, served = ParamsHolder(BASE), Handoff()
    watcher = WeightWatcher(root, holder, poll_s=0.05, handoff=served).start()
    pusher = WeightPusher(root, ack_timeout_s=30, handoff=Handoff(adapter_record(CFG, BASE)))
    try:
        with pytest.raises(HandoffMismatch, match=words) as e:
            pusher.push(lora.merge(BASE, trained_adapters()), 1)
    finally:
        watcher.stop()
    assert "refused weight version 1" in str(e.value) and "gjax.serve" in str(e.value)
    assert holder.version == 0 and served_version(root) == 0


def test_a_grpc_push_streams_the_adapters_only(tmp_path):
    from gjax.rollout.weight_stream import GrpcWeightPusher, WeightServer
    from tests.test_jetstream_grpc import _free_port

    port = _free_port()
    holder, served = server(tmp_path)
    srv = WeightServer(holder, f"127.0.0.1:{port}", served)
    adapters = trained_adapters()
    try:
        pusher = GrpcWeightPusher(
            f"127.0.0.1:{port}", timeout_s=30, handoff=Handoff(adapter_record(CFG, BASE))
        )
        assert pusher.push(lora.merge(BASE, adapters), 1) == 1
        assert pusher.last_bytes == nbytes(adapters)
        got_base, got = lora.split(holder.params)
        assert all(x is y for x, y in zip(jax.tree.leaves(got_base), jax.tree.leaves(BASE)))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(adapters)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # A trainer of another rank is refused before it sends anything.
        cfg2 = CFG.replace(lora_rank=2)
        other = GrpcWeightPusher(
            f"127.0.0.1:{port}", timeout_s=30, handoff=Handoff(adapter_record(cfg2, BASE))
        )
        a2 = lora.init_adapters(cfg2, jax.random.key(0))
        with pytest.raises(HandoffMismatch, match="rank 2.*rank 4"):
            other.push(lora.merge(BASE, a2), 2)
        assert holder.version == 1
        pusher.close()
        other.close()
    finally:
        srv.stop()


def test_several_processes_copy_a_lora_base_to_their_devices_once(monkeypatch):
    """The continuous decoder of a multi-process run samples on each process's own copy of the
    params (`sharding.process_local_copy`, an all-gather): with LoRA the base is copied on the
    first call only, the adapters on every call."""
    from gjax.rollout.backend import LocalSampler

    copied = []

    def counting_copy(train_mesh, local_mesh):
        def copy(tree):
            copied.append(sum(x.nbytes for x in jax.tree.leaves(tree)))
            return jax.tree.map(lambda x: x + 0, tree)

        return copy

    monkeypatch.setattr(sharding, "process_local_copy", counting_copy)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    sampler = LocalSampler(CFG)
    first = sampler._process_local(lora.merge(BASE, trained_adapters(seed=1)), mesh, mesh)
    second = sampler._process_local(lora.merge(BASE, trained_adapters(seed=2)), mesh, mesh)
    adapter_bytes = nbytes(trained_adapters())
    assert copied == [nbytes(BASE), adapter_bytes, adapter_bytes]
    b1, b2 = lora.split(first)[0], lora.split(second)[0]
    assert all(x is y for x, y in zip(jax.tree.leaves(b1), jax.tree.leaves(b2)))
    for x, y in zip(
        jax.tree.leaves(lora.split(second)[1]), jax.tree.leaves(trained_adapters(seed=2))
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Full fine-tuning: the whole tree, every call.
    copied.clear()
    LocalSampler(CFG.without_lora())._process_local(BASE, mesh, mesh)
    assert copied == [nbytes(BASE)]


def test_replica_weights_stop_with_the_refusal_of_a_replica_on_another_base(tmp_path):
    """A LoRA trainer's directory push to a replica serving full weights (or another base):
    the replica writes why it refused, and the trainer's wait for it ends at once with that
    paragraph instead of waiting out the acknowledgement time-out."""
    import time

    pytest.importorskip("gjax.rollout.jetstream_compat")
    from gjax.rollout.replicas import ReplicaPool, ReplicaWeights
    from gjax.rollout.weight_stream import WeightServer
    from tests.test_jetstream_grpc import _free_port

    root, port = tmp_path / "push", _free_port()
    holder = ParamsHolder(BASE)  # a full-weight server
    srv = WeightServer(holder, f"127.0.0.1:{port}")
    watcher = WeightWatcher(root, holder, poll_s=0.05).start()
    trainer = Handoff(adapter_record(CFG, BASE))
    pool = ReplicaPool([f"127.0.0.1:{port}"])
    weights = ReplicaWeights(
        pool,
        WeightPusher(root, handoff=trainer),
        stream=False,
        ack_timeout_s=120,
        handoff=trainer,
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(HandoffMismatch, match="carries LoRA adapters.*takes full weights"):
            weights.push(lora.merge(BASE, trained_adapters()))
        assert time.monotonic() - t0 < 30
        assert holder.version == 0
    finally:
        weights.close()
        pool.close()
        watcher.stop()
        srv.stop()
