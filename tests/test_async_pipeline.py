"""Rollouts overlapping training (gjax.rollout.producer), driven through the production pieces
on the embedded policy: k = 1 keeps every batch within its version bound (DAPO dynamic
sampling on produced groups), and split rollout/train meshes (4 + 4 CPU devices, the
asynchronous producer at k = 0) train bit for bit like one mesh (the synchronous producer).

The loop below is `gjax.train`'s step loop with the same calls (producer.get, learner.batch,
learner.update, producer.push); the CLI path and the resume rule are covered by the slow
end-to-end tests at the bottom.
"""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import common
from gjax import schema, sharding
from gjax.data.builders import build_prompt_data
from gjax.data.iterator import PromptIterator
from gjax.embedded import resolve_model_path
from gjax.learner import build_learner
from gjax.metrics import to_host
from gjax.models import hf_import
from gjax.rewards.pipeline import build_rewards
from gjax.rewards.verifier import Verifier
from gjax.rollout import LocalSampler, collect, producer
from tests.test_experience import make_groups
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(algo="grpo", **rollout):
    c = common.tiny(common.base())
    if algo == "dapo":
        c.objective = common.objective("dapo")
        c.sampling.dynamic = True
    c.rollout.prompts_per_step, c.rollout.num_samples = 4, 4
    c.rollout.update(rollout)
    c.optim.lr, c.optim.warmup_steps = 3e-4, 0  # a visible change of params per step
    return c


@pytest.fixture(scope="module")
def verifier():
    v = Verifier(timeout_s=5.0, num_workers=1)
    yield v
    v.close()


def train(config, verifier, *, steps, devices, rollout_devices=0):
    """Returns (final params on host, per-step rows, per-step policy versions)."""
    shape = {"data": -1, "fsdp": 1, "tensor": 1}
    mesh, rollout_mesh = sharding.make_meshes(shape, rollout_devices, devices)
    with jax.set_mesh(mesh), sharding.use_rules():
        obj_cfg = common.to_objective_config(
            config.objective, rollout_temperature=config.rollout.temperature
        )
        path = resolve_model_path(config.model.path)
        cfg, params = hf_import.load_pretrained(
            path, mesh=mesh, param_dtype="float32", dtype="float32"
        )
        tok = hf_import.load_tokenizer(path)
        ref = jax.tree.map(lambda x: x.copy(), params) if obj_cfg.kl_beta > 0 else None
        data = build_prompt_data(config.data, tok)
        rewards = build_rewards(config, verifier)
        config.train.steps = steps
        state, learner = build_learner(
            config, mesh=mesh, model_cfg=cfg, obj_cfg=obj_cfg, params=params
        )
        it = PromptIterator(
            data,
            global_batch_size=config.rollout.prompts_per_step,
            seed=0,
            shuffle=True,
            process_index=0,
            process_count=1,
        )
        backend = LocalSampler(cfg)
        rollout = collect.Rollout(
            model_cfg=cfg,
            backend=backend,
            tokenizer=tok,
            rewards=rewards,
            transfer=learner.transfer,
            config=config,
        )
        base_key = jax.random.key(config.seed)
        prod = producer.make_producer(
            rollout=rollout,
            data_iter=it,
            params=state.params,
            base_key=base_key,
            config=config,
            start=0,
            train_mesh=mesh,
            rollout_mesh=rollout_mesh,
            backend=backend,
        )
        rows, versions = [], []
        for step in range(steps):
            key = jax.random.fold_in(base_key, step)
            got = prod.get(step)
            batch = learner.batch(got.groups, state.params, ref)
            state, metrics = learner.update(state, batch, jax.random.fold_in(key, 10_000))
            prod.push(state.params, step + 1)
            host = {k: v for k, v in got.metrics.items() if not k.startswith(("time/", "rew"))}
            rows.append({**to_host(metrics), **host, "reward/mean": got.metrics["reward/mean"]})
            versions.append(got.groups.policy_version_PxG)
        prod.close()
        rewards.close()
        return jax.device_get(state.params), rows, versions


def fake_producer(k, *, fail_at=None, start=0, stop=7, error=None, seen=None, **kw):
    """An AsyncProducer over a fake rollout that records which params it was handed."""
    seen = [] if seen is None else seen

    def produce(step, params, version):
        if step == fail_at:
            raise error or ValueError("sampler exploded")
        seen.append((step, params["v"]))
        time.sleep(0.01)
        return collect.StepBatch(-1, -1, make_groups([[0.0, 1.0]]), {"time/rollout_s": 0.01})

    prod = producer.AsyncProducer(
        produce, max_staleness=k, start=start, stop=stop, to_rollout=lambda p: dict(p), **kw
    )
    return prod, seen


@pytest.mark.parametrize("k", [0, 1, 2])
def test_producer_schedule_and_bound(k):
    prod, seen = fake_producer(k)
    prod.begin({"v": 0}, None)
    for step in range(7):
        batch = prod.get(step)
        assert batch.version == max(step - k, 0) and step - batch.version <= k
        assert batch.groups.policy_version_PxG.tolist() == [[batch.version] * 2]
        assert batch.metrics["async/version_lag_max"] == step - batch.version
        time.sleep(0.005)  # the update
        prod.push({"v": step + 1}, step + 1)
    prod.close()
    # Each batch was sampled with exactly the params of its version, never a newer one.
    assert seen == [(j, max(j - k, 0)) for j in range(7)]


class _ServingBackend(LocalSampler):
    """Records each push: the version tag of the params and the thread it came from."""

    def __init__(self, served):
        super().__init__(None)
        self.served, self.pushes = served, []

    def push(self, params):
        self.pushes.append((params["v"], threading.current_thread().name, len(self.served)))


@pytest.mark.parametrize("learner_pushes", [False, True])
@pytest.mark.parametrize("k", [1, 2])
def test_a_serving_backend_gets_each_version_once_after_the_older_versions_steps(k, learner_pushes):
    """A backend that serves its own weights holds one version: v is pushed once, after every
    step of an older version (steps below v + k) was sampled and before the first of v's;
    on the producer thread, or (several processes) on the learner's."""
    seen = []
    backend = _ServingBackend(seen)
    prod, _ = fake_producer(k, seen=seen, backend=backend, learner_pushes=learner_pushes)
    prod.begin({"v": 0}, None)
    for step in range(7):
        assert prod.get(step).version == max(step - k, 0)
        prod.push({"v": step + 1}, step + 1)
    prod.close()
    assert seen == [(j, max(j - k, 0)) for j in range(7)]
    thread = "MainThread" if learner_pushes else "rollout-producer"
    # Versions 0 .. 6-k (the last one sampled), v once steps 0 .. v+k-1 had been sampled.
    assert backend.pushes == [(v, thread, 0 if v == 0 else v + k) for v in range(7 - k)]


def test_producer_error_reaches_the_learner():
    prod, _ = fake_producer(1, fail_at=2)
    prod.begin({"v": 0}, None)
    prod.get(0)
    prod.push({"v": 1}, 1)
    prod.get(1)
    prod.push({"v": 2}, 2)
    with pytest.raises(RuntimeError, match="sampler exploded"):
        prod.get(2)
    prod.close()


def test_producer_user_error_reaches_the_learner_as_itself():
    """A rollout's user error (e.g. a server that stays down) keeps its type and paragraph."""
    err = collect.ServingFailed("every rollout request failed")
    prod, _ = fake_producer(0, fail_at=1, error=err)
    prod.begin({"v": 0}, None)
    prod.get(0)
    prod.push({"v": 1}, 1)
    with pytest.raises(collect.ServingFailed) as got:
        prod.get(1)
    assert got.value is err
    prod.close()


def assert_same_params(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_k1_versions_within_bound_with_dynamic_sampling(verifier):
    config = tiny_config("dapo", max_staleness=1)
    config.sampling.max_rollouts_per_step = 2
    _, rows, versions = train(config, verifier, steps=3, devices=jax.devices()[:1])
    for step, (row, v) in enumerate(zip(rows, versions)):
        sampled = v[v >= 0]
        assert sampled.size == 16  # P x G, all sampled (no anchors)
        assert np.all(step - sampled <= 1) and np.all(sampled <= step)
        assert np.all(sampled == max(step - 1, 0))  # the deterministic schedule v(j)
        assert row["async/version_lag_max"] == step - max(step - 1, 0)
        assert 1 <= row["sampling/rollouts"] <= 2
    assert any(r["sampling/rollouts"] == 2 for r in rows) or all(
        r["adv/zero_var_frac"] == 0 for r in rows
    )


def test_split_meshes_train_like_one_mesh(verifier):
    """Train on 4 devices, sample on 4 others through the producer at k = 0; vs the
    synchronous loop with everything on the same 4 train devices: bit for bit."""
    devs = jax.devices()
    assert len(devs) == 8
    p_one, rows_one, _ = train(tiny_config(), verifier, steps=2, devices=devs[:4])
    p_split, rows_split, versions = train(
        tiny_config(), verifier, steps=2, devices=devs, rollout_devices=4
    )
    assert [int(v.max()) for v in versions] == [0, 1]  # k = 0: always the newest params
    assert_same_params(p_one, p_split)
    assert rows_one == [{k: r[k] for k in rows_one[0]} for r in rows_split]  # + async/*


# ------------------------------------------------------------------------------ end to end


def _cli(workdir, *extra, steps):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    # Later runs reuse the first one's compiled programs (the session's cache, conftest.py).
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=USER_PATH)  # no torch: tests/user_env.py
    cmd = [
        sys.executable,
        "-m",
        "gjax.train",
        "--config=configs/grpo.py:tiny",
        f"--workdir={workdir}",
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.num_samples=4",
        "--config.data.heldout_size=16",
        "--config.log.progress=False",
        "--config.log.tensorboard=False",
        "--config.checkpoint.async_save=False",
        "--config.rollout.max_staleness=1",
        f"--config.train.steps={steps}",
        *extra,
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.slow
def test_resume_at_k1_follows_the_documented_rule(tmp_path):
    """Uninterrupted 3 steps vs 2 steps + resume to 3: same rows up to the checkpoint; the
    first resumed batch is drawn from the restored params (lag 0 instead of 1; from step 4 on
    the schedules agree again); same prompts, same keys: the data position ends equal."""
    whole = _cli(tmp_path / "whole", steps=3)
    _cli(tmp_path / "cut", steps=2)
    resumed = _cli(tmp_path / "cut", steps=3)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    vol = ("time/", "throughput/", "rewards/")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(vol)}  # noqa: E731
    assert [strip(r) for r in resumed[:2]] == [strip(r) for r in whole[:2]]
    assert [r["async/version_lag_max"] for r in whole] == [0, 1, 1]
    assert [r["async/version_lag_max"] for r in resumed] == [0, 1, 0]
    import orbax.checkpoint as ocp

    def data_state(workdir):
        with ocp.CheckpointManager(workdir / "checkpoints", item_names=("state", "meta")) as m:
            meta = m.restore(3, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        return meta["data"]

    assert data_state(tmp_path / "whole") == data_state(tmp_path / "cut")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("mesh.rollout_devices", 8, "mesh.rollout_devices"),
        ("rollout.max_staleness", -1, "rollout.max_staleness"),
        ("objective.behaviour_correction", "tis", "recompute_old_logps=True"),
    ],
)
def test_config_errors_name_the_field(field, value, match):
    from gjax.config import validate
    from gjax.errors import ConfigError

    c = tiny_config()
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=match):
        validate(c, 8)


def test_several_processes_overlap_rollouts_on_the_train_mesh_with_the_local_sampler(
    monkeypatch,
):
    """Two processes (the count faked: jax's runtime is the edge): k = 1 is valid on the train
    mesh, with the local sampler or gjax.serve replicas, and on rollout devices that split
    evenly over the processes (each keeping mesh.tensor)."""
    from gjax import config as config_lib
    from gjax.errors import ConfigError

    monkeypatch.setattr(config_lib.jax, "process_count", lambda: 2)
    c = tiny_config(max_staleness=1)
    config_lib.validate(c, 8)
    c.mesh.rollout_devices = 4
    config_lib.validate(c, 8)
    for n_roll, tensor in ((3, 1), (2, 2)):
        c.mesh.rollout_devices, c.mesh.tensor = n_roll, tensor
        with pytest.raises(ConfigError, match="mesh.rollout_devices.*each of the 2 processes"):
            config_lib.validate(c, 8)
    c.mesh.rollout_devices, c.mesh.tensor, c.rollout.backend = 0, 1, "jetstream_grpc"
    config_lib.validate(c, 8)


def test_split_mesh_shapes():
    train_mesh, roll = sharding.make_meshes({"data": -1, "tensor": 2}, 4, jax.devices())
    assert dict(train_mesh.shape) == {"data": 2, "fsdp": 1, "seq": 1, "tensor": 2}
    assert dict(roll.shape) == {"data": 2, "fsdp": 1, "seq": 1, "tensor": 2}
    assert not set(train_mesh.devices.flat) & set(roll.devices.flat)
    c = tiny_config()
    c.mesh.rollout_devices = 4
    from gjax.config import validate

    assert validate(c, 8) == {"data": 4, "fsdp": 1, "seq": 1, "tensor": 1}  # the train mesh


def test_learner_batch_teacher_forces_anchors_and_recomputation():
    """Anchors' old log-probs (and with recompute_old_logps every row's) come from the
    learner's params; the sampler's go along as behaviour_logps_BxT when recomputed, unless
    the backend returned none (JetStream over gRPC)."""
    import dataclasses

    from gjax import objective as obj
    from gjax.experience import to_model_inputs
    from gjax.learner import policy_logps
    from gjax.models.transformer import init_params
    from tests.test_model import tiny_cfg

    cfg = tiny_cfg(vocab_size=64, intermediate_size=64, max_position_embeddings=64)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    with jax.set_mesh(mesh), sharding.use_rules():
        params = sharding.shard_params(init_params(cfg, jax.random.key(0)), mesh)
        config = common.base()
        config.anchors.per_group = 1
        _, learner = build_learner(
            config, mesh=mesh, model_cfg=cfg, obj_cfg=obj.ObjectiveConfig(), params=params
        )
        assert learner.anchors and not learner.recompute_old
        groups = make_groups([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], S=3, N=4)
        groups.is_anchor_PxG[:, 2] = True
        sampler_PxGxN = np.full((2, 3, 4), -0.5, np.float32)
        groups.old_logps_PxGxN = sampler_PxGxN.copy()
        inputs = {k: jax.numpy.asarray(v) for k, v in to_model_inputs(groups).items()}
        tf_BxT = np.asarray(policy_logps(params, inputs, cfg=cfg, temperature=1.0))
        anchor_B = groups.is_anchor_PxG.reshape(-1)
        want_beh = np.where(anchor_B[:, None], tf_BxT, sampler_PxGxN.reshape(6, 4))
        assert np.all(tf_BxT[anchor_B] != -0.5)
        for recompute, behaviour in ((False, True), (True, True), (True, False)):
            mode = dataclasses.replace(learner, recompute_old=recompute, behaviour_logps=behaviour)
            batch = mode.batch(groups, params, None)
            old = np.asarray(batch["old_logps_BxT"])
            if recompute:
                np.testing.assert_allclose(old, tf_BxT, rtol=1e-6)
            else:
                np.testing.assert_allclose(old, want_beh, rtol=1e-6)
            if recompute and behaviour:
                beh = np.asarray(batch["behaviour_logps_BxT"])
                np.testing.assert_allclose(beh, want_beh, rtol=1e-6)
            else:
                assert "behaviour_logps_BxT" not in batch


def test_behaviour_correction_needs_a_backend_that_returns_logps():
    from gjax.config import validate
    from gjax.errors import ConfigError

    c = tiny_config()
    c.rollout.recompute_old_logps = True
    c.objective.behaviour_correction = "tis"
    validate(c, 8)  # the local sampler returns them
    c.rollout.backend = "jetstream_grpc"
    with pytest.raises(ConfigError, match="token ids only"):
        validate(c, 8)


class _DroppingSampler(LocalSampler):
    """A serving backend whose first `drop` batches lose every request at once (a server
    that rejects them); later batches are the local sampler's."""

    def __init__(self, cfg, drop: int):
        super().__init__(cfg)
        self.drop, self.calls = drop, 0

    def generate(self, *args, **kw):
        out = super().generate(*args, **kw)
        self.calls += 1
        return out._replace(valid_B=np.full(out.tokens_BxN.shape[0], self.calls > self.drop))

    def failure(self) -> str:
        return "last error: INVALID_ARGUMENT; served by a test server"


@pytest.mark.parametrize("drop", [collect.ALL_DROPPED_RETRIES, collect.ALL_DROPPED_RETRIES + 1])
def test_a_rollout_whose_requests_all_drop_is_tried_again_then_stops(drop, verifier):
    """Every request dropped at once: the rollout is tried again (ALL_DROPPED_RETRIES more
    times within the request deadline); still nothing: ServingFailed, one paragraph naming
    the backend, before anything trains on the empty rollout."""
    config = tiny_config()
    path = resolve_model_path(config.model.path)
    cfg, params = hf_import.load_pretrained(path, param_dtype="float32", dtype="float32")
    tok = hf_import.load_tokenizer(path)
    mesh, _ = sharding.make_meshes({"data": 1, "fsdp": 1, "tensor": 1}, 0, jax.devices()[:1])
    with jax.set_mesh(mesh), sharding.use_rules():
        obj_cfg = common.to_objective_config(config.objective, rollout_temperature=1.0)
        _, learner = build_learner(config, mesh=mesh, model_cfg=cfg, obj_cfg=obj_cfg, params=params)
        backend = _DroppingSampler(cfg, drop)
        rollout = collect.Rollout(
            model_cfg=cfg,
            backend=backend,
            tokenizer=tok,
            rewards=build_rewards(config, verifier),
            transfer=learner.transfer,
            config=config,
        )
        data = build_prompt_data(config.data, tok)
        it = PromptIterator(data, global_batch_size=config.rollout.prompts_per_step, seed=0)
        prompts, key = next(it), jax.random.key(0)
        if drop <= collect.ALL_DROPPED_RETRIES:
            res = rollout(params, prompts, key)
            assert backend.calls == drop + 1 and res.groups.valid_PxG.all()
        else:
            with pytest.raises(collect.ServingFailed) as err:
                rollout(params, prompts, key)
            tries = collect.ALL_DROPPED_RETRIES + 1
            assert backend.calls == tries
            msg = str(err.value)
            assert f"failed on {tries} tries of the same rollout" in msg
            assert "INVALID_ARGUMENT; served by a test server" in msg and "\n" not in msg


@pytest.mark.parametrize("k", [0, 1])
def test_async_runs_evaluate_off_a_serving_backend(k):
    """A mid-run held-out evaluation must not push new weights to a server whose async
    requests are in flight: with k > 0 a serving backend's runs evaluate in-process."""
    from gjax.rollout.backend import LocalSampler
    from gjax.rollout.factory import evaluation_backend

    c = schema.base()
    c.rollout.max_staleness = k
    model_cfg = object()
    local, served = LocalSampler(model_cfg), object()  # any backend that is not in-process
    assert evaluation_backend(c, local, model_cfg) is local
    chosen = evaluation_backend(c, served, model_cfg)
    if k == 0:  # sampling and evaluation take turns on the loop's thread
        assert chosen is served
    else:
        assert isinstance(chosen, LocalSampler) and chosen.cfg is model_cfg
