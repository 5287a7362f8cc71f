"""Weights streamed over gRPC (`gjax.rollout.weight_stream`) to the JetStream server of
`gjax.serve` (in-process here, on 127.0.0.1): greedy tokens after a push equal the local
sampler's on the pushed params and carry the pushed version; an interrupted stream changes
nothing; a bf16 server gets bf16 bytes; a server that is down gets the version through the
push directory, and the two hand-offs never roll each other back."""

import itertools
import json

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.rollout import LocalSampler
from tests.test_jetstream import _sampling, policy  # noqa: F401 - shared fixture
from tests.test_jetstream_grpc import _free_port
from tests.test_train_e2e import env  # noqa: F401 - shared fixture

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")
from gjax.rollout import grpc_server, weight_push, weight_stream  # noqa: E402
from gjax.rollout.engine import Engine, ParamsHolder, prefill_bucket  # noqa: E402


def _noisy(params, seed, scale=0.3):
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
    keys = jax.tree.unflatten(jax.tree.structure(params), list(keys))
    return jax.tree.map(
        lambda x, k: x + scale * jax.random.normal(k, x.shape, x.dtype), params, keys
    )


@pytest.fixture(scope="module")
def served(policy):  # noqa: F811
    """A JetStream server (greedy) over the policy, version 0, on a free port."""
    cfg, params, tok, batch, eos, pad, config = policy
    sp = _sampling(eos, pad, 0.0)
    engine = Engine(
        cfg,
        ParamsHolder(params, version=0),
        sampling=sp,
        max_concurrent_decodes=8,
        max_prefill_length=prefill_bucket(config.data.max_prompt_len),
        record=False,
    )
    port = _free_port()
    server = grpc_server.Server(engine, "127.0.0.1", port)
    try:
        yield server, f"127.0.0.1:{port}", sp
    finally:
        server.stop()


def _client(policy, address, sp):  # noqa: F811
    """A rollout client of the server at `address` that pushes nothing itself."""
    config = policy[-1]
    return jetstream_backend.JetStreamGrpcBackend(
        address, max_prompt_len=config.data.max_prompt_len, server_sampling=sp, timeout_s=60
    )


def test_grpc_push_is_served_token_for_token(policy, served):  # noqa: F811
    cfg, params, tok, batch, eos, pad, config = policy
    server, address, sp = served
    args = (batch.prompt_ids_PxS, batch.prompt_mask_PxS, jax.random.key(0))
    new_params = _noisy(params, 1)
    want = LocalSampler(cfg).generate(new_params, *args, num_samples=2, sampling=sp)
    old = LocalSampler(cfg).generate(params, *args, num_samples=2, sampling=sp)
    assert not np.array_equal(np.asarray(want.tokens_BxN), np.asarray(old.tokens_BxN))

    v = server.engine.holder.version + 1
    pusher = weight_stream.GrpcWeightPusher(address, timeout_s=60, chunk_bytes=1 << 20)
    be = _client(policy, address, sp)
    be.weights = pusher
    out = be.generate(new_params, *args, num_samples=2, sampling=sp)
    np.testing.assert_array_equal(np.asarray(out.tokens_BxN), np.asarray(want.tokens_BxN))
    np.testing.assert_array_equal(np.asarray(out.version_B), v)
    assert server.engine.holder.version == v == be.version
    f32_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    m = be.metrics()
    assert m["rollout/push_bytes"] == f32_bytes and m["rollout/push_s"] > 0
    # A step without new params pushes nothing.
    be.generate(new_params, *args, num_samples=2, sampling=sp)
    assert be.metrics()["rollout/push_bytes"] == 0 and server.engine.holder.version == v
    # A server restarted from an empty push directory (version 0, the original params) is
    # noticed before the next batch and gets the params again.
    server.engine.holder.swap(params, version=0)
    again = be.generate(new_params, *args, num_samples=2, sampling=sp)
    np.testing.assert_array_equal(np.asarray(again.tokens_BxN), np.asarray(want.tokens_BxN))
    assert be.metrics()["rollout/push_bytes"] == f32_bytes
    assert server.engine.holder.version == v + 1 == be.version
    be.close()


def test_interrupted_push_leaves_the_previous_version(policy, served):  # noqa: F811
    cfg, params, tok, batch, eos, pad, config = policy
    server, address, sp = served
    args = (batch.prompt_ids_PxS, batch.prompt_mask_PxS, jax.random.key(0))
    pusher = weight_stream.GrpcWeightPusher(address, timeout_s=60, chunk_bytes=1 << 20)
    base = _noisy(params, 2, 0.1)
    v = pusher.push(base)
    assert server.engine.holder.version == v
    before = server.engine.holder.params
    want = LocalSampler(cfg).generate(base, *args, num_samples=1, sampling=sp)
    bad = _noisy(params, 3)
    n = sum(1 for _ in pusher.messages(bad, v + 1))
    assert n > 4  # several chunks: the cut falls mid-stream

    def cut_by_error():
        yield from itertools.islice(pusher.messages(bad, v + 1), n // 2)
        raise ConnectionError("trainer died mid-push")

    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: itertools.islice(pusher.messages(bad, v + 1), n - 1),
        grpc.StatusCode.UNKNOWN: cut_by_error(),  # the client cancels the call
    }
    for code, stream in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            pusher._push_call(stream, timeout=60)
        assert err.value.code() == code, err.value
        assert server.engine.holder.version == v and server.engine.holder.params is before
    be = _client(policy, address, sp)
    out = be.generate(base, *args, num_samples=1, sampling=sp)  # same version: no push
    np.testing.assert_array_equal(np.asarray(out.tokens_BxN), np.asarray(want.tokens_BxN))
    be.close()
    # A full push afterwards goes through.
    assert pusher.push(bad) == v + 1 == server.engine.holder.version


def test_bf16_server_gets_bf16_bytes_and_wrong_shapes_are_refused(policy):  # noqa: F811
    cfg, params, *_ = policy
    holder = ParamsHolder(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), version=0)
    server = weight_stream.WeightServer(holder, "127.0.0.1:0")
    try:
        pusher = weight_stream.GrpcWeightPusher(f"127.0.0.1:{server.port}", timeout_s=60)
        new_params = _noisy(params, 4)
        assert pusher.push(new_params) == 1 == holder.version
        assert pusher.last_bytes == sum(x.nbytes for x in jax.tree.leaves(params)) // 2
        for got, sent in zip(jax.tree.leaves(holder.params), jax.tree.leaves(new_params)):
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got), np.asarray(sent.astype(jnp.bfloat16)))
        wrong = jax.tree.map(lambda x: x[..., :1], params)
        with pytest.raises(weight_stream.WeightSpecMismatch, match="do not match"):
            pusher.push(wrong)
        assert holder.version == 1
        reply = json.loads(pusher._spec_call(b"", timeout=10))
        assert reply["version"] == 1 and reply["leaves"][0][1] == "bfloat16"
    finally:
        server.stop()


def test_server_down_falls_back_to_the_directory(policy, tmp_path):  # noqa: F811
    cfg, params, *_ = policy
    holder = ParamsHolder(params, version=0)
    watcher = weight_push.WeightWatcher(tmp_path, holder, poll_s=0.05).start()
    port = _free_port()  # nothing listens there yet
    pusher = weight_stream.GrpcWeightPusher(
        f"127.0.0.1:{port}",
        fallback=weight_push.WeightPusher(tmp_path, ack_timeout_s=30),
        timeout_s=30,
    )
    server = None
    try:
        one = _noisy(params, 5)
        assert pusher.push(one) == 1 == holder.version == weight_push.latest_version(tmp_path)
        assert pusher.last_bytes == sum(x.nbytes for x in jax.tree.leaves(params))
        server = weight_stream.WeightServer(holder, f"127.0.0.1:{port}")
        two = _noisy(params, 6)
        assert pusher.push(two) == 2 == holder.version
        assert weight_push.latest_version(tmp_path) == 1  # the stream wrote no files
        watcher.load_latest()  # the older directory version does not roll back
        assert holder.version == 2
        np.testing.assert_array_equal(
            np.asarray(jax.tree.leaves(holder.params)[0]), np.asarray(jax.tree.leaves(two)[0])
        )
    finally:
        watcher.stop()
        if server is not None:
            server.stop()
        pusher.close()


def test_benchmark_smoke():
    """benchmarks/weight_push.py at a toy size: JSON lines, consistent bytes and summary; the
    adapter push of the 1.5B shape."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "benchmarks/weight_push.py", "--sizes=0.01", "--repeats=1"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    paths = ["memcpy", "directory", "grpc", "grpc_bf16", "adapters", None]
    assert [r.get("path") for r in rows] == paths
    by = {r["path"]: r for r in rows[1:-1]}
    assert by["directory"]["bytes"] == by["grpc"]["bytes"] == 2 * by["grpc_bf16"]["bytes"]
    assert by["grpc"]["bytes"] == pytest.approx(0.01e9, abs=4)
    ratio = rows[-1]["directory_over_grpc"]["0.01"]
    assert ratio == pytest.approx(by["directory"]["s_per_gb"] / by["grpc"]["s_per_gb"], rel=0.01)
    assert set(rows[-1]["predicted_push_s_bf16_server"]) == {"1.5B", "8B"}
    # The LoRA push (rank 16, all 7 targets, f32) on the 1.5B shape: per layer r x (in + out)
    # for q, k, v, o (D=1536, K*Dh=256), gate, up and down (F=8960); 28 layers.
    adapters = by["adapters"]
    d, kv, f = 1536, 256, 8960
    per_layer = 16 * (2 * (d + d) + 2 * (d + kv) + 3 * (d + f))
    assert adapters["bytes"] == 28 * per_layer * 4 == 73_859_072
    assert adapters["full_bytes"] == 6_174_857_216  # Qwen2.5-1.5B's 1.544e9 params, f32
    assert adapters["bytes_fraction"] == pytest.approx(0.01196, abs=1e-5)
    assert 0 < adapters["grpc_s"] < adapters["full_grpc_s_predicted"]
    assert 0 < adapters["directory_s"] < adapters["full_directory_s_predicted"]
    assert rows[-1]["adapter_over_full_bytes"] == adapters["bytes_fraction"]


@pytest.mark.slow
def test_trainer_streams_its_weights_to_gjax_serve(env, tmp_path):  # noqa: F811
    """`--config.rollout.weight_transfer=grpc`: every step's update reaches a real
    `gjax.serve` over the stream (bytes counted in the metrics), none through the directory."""
    from tests.test_jetstream_grpc import _start_server, _stop
    from tests.test_train_e2e import rows, run

    wd, port = tmp_path / "run", _free_port()
    proc = _start_server(port, wd)
    try:
        run(
            "configs/grpo.py:tiny",
            wd,
            env,
            "--config.train.steps=2",
            "--config.rollout.backend=jetstream_grpc",
            f"--config.rollout.server_address=127.0.0.1:{port}",
            "--config.rollout.weight_transfer=grpc",
            # The push is the subject: greedy held-out only, not pass@k's 8 samples of each
            # held-out problem through the server (twice 128 requests, no figure read here).
            "--config.eval.num_samples=0",
        )
    finally:
        _stop(proc)
    got = rows(wd)
    assert [r["rollout/policy_version"] for r in got] == [1, 2]
    assert all(r["rollout/push_bytes"] > 0 and r["rollout/push_s"] > 0 for r in got), got
    assert weight_push.latest_version(wd / "push") is None  # no fallback was needed
