"""`python -m gjax.serve` (JetStream's gRPC server) driven by `JetStreamGrpcBackend` on
127.0.0.1: greedy tokens equal the local sampler's, a server killed mid-batch and restarted is
survived through retries, a server that stays down costs dropped (masked) rows, not the step,
and pushed weights are served."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from gjax.rollout import LocalSampler
from tests.test_jetstream import _sampling, policy  # noqa: F401 - shared fixture

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")
from gjax.rollout.weight_push import WeightPusher  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, workdir) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gjax.serve",
            "--config=configs/grpo.py:tiny",
            f"--config.rollout.server_address=127.0.0.1:{port}",
            "--config.rollout.decode_slots=8",
            "--sampling=eval",
            f"--workdir={workdir}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "gjax.serve: ready" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines[-30:]))


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_grpc_serving_greedy_kill_restart_and_push(policy, tmp_path):  # noqa: F811
    cfg, params, tok, batch, eos, pad, config = policy
    sp = _sampling(eos, pad, 0.0)
    port = _free_port()
    args = (batch.prompt_ids_PxS, batch.prompt_mask_PxS, jax.random.key(0))
    local = LocalSampler(cfg).generate(params, *args, num_samples=2, sampling=sp)
    want = np.asarray(local.tokens_BxN)
    proc = _start_server(port, tmp_path)
    try:
        be = jetstream_backend.JetStreamGrpcBackend(
            f"127.0.0.1:{port}",
            max_prompt_len=config.data.max_prompt_len,
            server_sampling=sp,
            timeout_s=60,
            max_retries=7,
            backoff_s=0.5,
        )
        out = be.generate(params, *args, num_samples=2, sampling=sp)
        np.testing.assert_array_equal(np.asarray(out.tokens_BxN), want)
        assert np.asarray(out.valid_B).all() and not be.returns_logps

        # Killed between batches (SIGKILL); the next batch is sent while it is down and
        # completes through retries once it is restarted.
        proc.kill()
        proc.wait()
        result = {}
        worker = threading.Thread(
            target=lambda: result.update(out=be.generate(params, *args, num_samples=2, sampling=sp))
        )
        worker.start()
        proc = _start_server(port, tmp_path)
        worker.join(300)
        np.testing.assert_array_equal(np.asarray(result["out"].tokens_BxN), want)
        assert np.asarray(result["out"].valid_B).all()
        assert be.counters["retried"] > 0 and be.counters["dropped"] == 0

        # Pushed weights are what the server samples with from the next batch on.
        be.weights = WeightPusher(tmp_path / "push", ack_timeout_s=60)
        new_params = jax.tree.map(
            lambda x: x + 0.3 * jax.random.normal(jax.random.key(x.size), x.shape, x.dtype),
            params,
        )
        new_local = LocalSampler(cfg).generate(new_params, *args, num_samples=2, sampling=sp)
        assert not np.array_equal(np.asarray(new_local.tokens_BxN), want)
        pushed = be.generate(new_params, *args, num_samples=2, sampling=sp)
        np.testing.assert_array_equal(
            np.asarray(pushed.tokens_BxN), np.asarray(new_local.tokens_BxN)
        )
        np.testing.assert_array_equal(np.asarray(pushed.version_B), 1)

        # A server that stays down: rows dropped (valid False) and counted, no exception.
        _stop(proc)
        be.max_retries, be.backoff_s = 1, 0.1
        down = be.generate(new_params, *args, num_samples=2, sampling=sp)
        assert not np.asarray(down.valid_B).any() and np.asarray(down.lengths_B).sum() == 0
        assert be.metrics()["rollout/requests_dropped"] == len(down.valid_B)
        be.close()
    finally:
        _stop(proc)
