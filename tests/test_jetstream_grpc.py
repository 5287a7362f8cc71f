"""`python -m gjax.serve` (JetStream's gRPC server) driven by `JetStreamGrpcBackend` on
127.0.0.1: greedy tokens equal the local sampler's, a server killed mid-batch and restarted is
survived through retries and used within a second of its ready line, a server that stays down costs dropped (masked) rows, not the step,
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
from tests.test_train_e2e import env  # noqa: F401 - shared fixture

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")
from gjax.rollout.weight_push import WeightPusher  # noqa: E402
from tests.user_env import PYTHONPATH as USER_PATH  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cmd(port: int, workdir) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gjax.serve",
        "--config=configs/grpo.py:tiny",
        f"--config.rollout.server_address=127.0.0.1:{port}",
        "--config.rollout.decode_slots=8",
        "--sampling=eval",
        f"--workdir={workdir}",
    ]


_ENV = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def _start_server(port: int, workdir) -> subprocess.Popen:
    """A server on 127.0.0.1:port; `proc.ready_at` is when its ready line was read."""
    proc = subprocess.Popen(
        _server_cmd(port, workdir),
        env={**os.environ, "PYTHONPATH": USER_PATH, **_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "gjax.serve: ready" in line:
            proc.ready_at = time.monotonic()
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

        # Killed mid-batch (SIGKILL while its requests are in flight on the frozen server),
        # restarted on the same port 3 s later: the failed requests are retried, wait for the
        # new server and are served within about a second of its ready line.
        one = (batch.prompt_ids_PxS[:1], batch.prompt_mask_PxS[:1], jax.random.key(0))
        result = {}

        def client():
            result["one"] = be.generate(params, *one, num_samples=1, sampling=sp)
            result["first_at"] = time.monotonic()
            result["out"] = be.generate(params, *args, num_samples=2, sampling=sp)

        proc.send_signal(signal.SIGSTOP)
        worker = threading.Thread(target=client)
        worker.start()
        time.sleep(1.0)  # the request is sent and waits on the frozen server
        proc.kill()
        proc.wait()
        time.sleep(3.0)
        proc = _start_server(port, tmp_path)
        worker.join(300)
        delay = result["first_at"] - proc.ready_at
        print(f"first request served {delay:.2f} s after the restarted server was ready")
        assert delay < 2.0
        np.testing.assert_array_equal(np.asarray(result["one"].tokens_BxN), want[:1])
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
        be.max_retries, be.backoff_s, be.timeout_s = 1, 0.1, 3.0
        down = be.generate(new_params, *args, num_samples=2, sampling=sp)
        assert not np.asarray(down.valid_B).any() and np.asarray(down.lengths_B).sum() == 0
        assert be.metrics()["rollout/requests_dropped"] == len(down.valid_B)
        be.close()
    finally:
        _stop(proc)


def _decode(stub, request, timeout=60) -> list[int]:
    return [
        t
        for r in stub.Decode(request, timeout=timeout)
        for s in r.stream_content.samples
        for t in s.token_ids
    ]


def test_no_request_poisons_the_server(policy, tmp_path):  # noqa: F811
    """Bad requests (each case, interleaved with good ones, one by one and all at once) get
    INVALID_ARGUMENT with what was wrong; the good ones' greedy tokens equal the local
    sampler's. A request whose logits are non-finite (NaN weights pushed) ends with INTERNAL,
    and the next good request is exact again. A second server on the same port does not start.
    Through JetStream's own gRPC stubs, against a real `gjax.serve` on 127.0.0.1."""
    import concurrent.futures

    import grpc

    from gjax.rollout.jetstream_compat import jetstream

    pb = jetstream.jetstream_pb2
    cfg, params, tok, batch, eos, pad, config = policy
    sp = _sampling(eos, pad, 0.0)
    local = LocalSampler(cfg).generate(
        params,
        batch.prompt_ids_PxS,
        batch.prompt_mask_PxS,
        jax.random.key(0),
        num_samples=1,
        sampling=sp,
    )
    tokens, mask = np.asarray(local.tokens_BxN), np.asarray(local.mask_BxN).astype(bool)
    want = [tokens[i][mask[i]].tolist() for i in range(len(tokens))]
    prompts = [
        np.asarray(batch.prompt_ids_PxS[i])[np.asarray(batch.prompt_mask_PxS[i], bool)].tolist()
        for i in range(len(want))
    ]
    good = [
        pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=p), max_tokens=32)
        for p in prompts
    ]
    ids = lambda t, n=32: pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=t), max_tokens=n
    )
    bad = [
        (ids([]), "prompt is empty"),
        (ids([5] * 32), "takes at most 31"),
        (ids([1, cfg.vocab_size, 2]), f"[0, {cfg.vocab_size})"),
        (ids([1, -3, 2]), f"[0, {cfg.vocab_size})"),
        (ids(prompts[0], 0), "max_tokens=0"),
        (ids(prompts[0], -1), "max_tokens=-1"),
        (ids(prompts[0], 33), "max_tokens=33"),
        (pb.DecodeRequest(max_tokens=8), "no content"),
    ]

    def check_bad(request, words):
        with pytest.raises(grpc.RpcError) as err:
            _decode(stub, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert words in err.value.details(), err.value.details()

    port = _free_port()
    proc = _start_server(port, tmp_path)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = jetstream.jetstream_pb2_grpc.OrchestratorStub(channel)
        # One by one: bad, good, bad, good, ...
        t_bad = []
        for i, (request, words) in enumerate(bad):
            t0 = time.perf_counter()
            check_bad(request, words)
            t_bad.append(time.perf_counter() - t0)
            assert _decode(stub, good[i % len(good)]) == want[i % len(good)]
        print(f"bad request answered in {1e3 * np.mean(t_bad):.1f} ms (mean of {len(t_bad)})")

        # All at once, bad and good interleaved, twice round the slots.
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            calls = []
            for i in range(2 * len(bad)):
                request, words = bad[i % len(bad)]
                calls.append(pool.submit(check_bad, request, words))
                j = i % len(good)
                calls.append(pool.submit(lambda j=j: _decode(stub, good[j]) == want[j]))
            assert all(c.result() in (None, True) for c in calls)
            assert sum(c.result() is True for c in calls) == 2 * len(bad)

        # Non-finite logits: an error status, then the server is exact again.
        pusher = WeightPusher(tmp_path / "push", ack_timeout_s=60)
        pusher.push(jax.tree.map(lambda x: x * np.nan, params))
        with pytest.raises(grpc.RpcError) as err:
            _decode(stub, good[0])
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "non-finite logits" in err.value.details()
        pusher.push(params)
        assert [_decode(stub, g) for g in good] == want

        # A second server on the same port: one paragraph, a nonzero exit, no traceback.
        second = subprocess.run(
            _server_cmd(port, tmp_path / "second"),
            env={**os.environ, "PYTHONPATH": USER_PATH, **_ENV},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"cannot bind 127.0.0.1:{port}" in second.stderr
        assert "Traceback" not in second.stderr and "ready" not in second.stdout
        assert _decode(stub, good[1]) == want[1]  # the first one still serves
        channel.close()
    finally:
        _stop(proc)


def test_a_server_on_a_taken_port_is_refused_before_loading_and_writes_nothing(tmp_path):
    """Another process listens on the port: gjax.serve is refused with one paragraph before
    the model loads (seconds, not the minute a paper model takes), and writes nothing in the
    push directory it shares with the running server (no SERVED)."""
    push = tmp_path / "push"
    push.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [*_server_cmd(port, tmp_path), f"--config.rollout.push_dir={push}"],
            env={**os.environ, "PYTHONPATH": USER_PATH, **_ENV},
            capture_output=True,
            text=True,
            timeout=300,
        )
        wall = time.monotonic() - t0
    err = " ".join(proc.stderr.split())  # the paragraph, unwrapped
    assert proc.returncode == 2, err[-3000:]
    assert f"cannot bind 127.0.0.1:{port} (Address already in use)" in err
    assert "Traceback" not in err and "ready" not in proc.stdout
    assert err.count("cannot bind") == 1
    assert "gjax.serve: JetStream on" not in err and "serving policy version" not in err
    assert sorted(p.name for p in push.iterdir()) == []  # no SERVED, nothing else
    assert wall < 60, wall  # start-up and imports only: nothing loaded or compiled


def test_a_step_whose_requests_all_fail_stops_the_run(env, tmp_path):  # noqa: F811
    """With no server answering, every request of the step's rollout is dropped on each of
    its tries: the run stops (exit 2) with one paragraph naming the server and the last intact
    checkpoint, before any update: no metrics row, checkpoint or pushed version for it."""
    from gjax.rollout.weight_push import latest_version
    from tests.test_train_e2e import command, rows, run

    wd = tmp_path / "run"
    greedy = "--config.eval.num_samples=0"  # no pass@k samples: no figure of them is read
    # Checkpoint 1, from local rollouts.
    run("configs/grpo.py:tiny", wd, env, "--config.train.steps=1", greedy)
    port = _free_port()  # nothing listens there
    proc = subprocess.run(
        command(
            "configs/grpo.py:tiny",
            wd,
            greedy,
            "--config.train.steps=3",
            "--config.rollout.backend=jetstream_grpc",
            f"--config.rollout.server_address=127.0.0.1:{port}",
            "--config.rollout.request_timeout_s=1",
            "--config.train.allow_config_change=True",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = " ".join(proc.stderr.split())  # the paragraph, unwrapped
    assert proc.returncode == 2, proc.stdout[-3000:] + err[-6000:]
    assert "Traceback" not in err, err[-6000:]
    # Each try waits for the absent server until its deadline (request_timeout_s=1): the
    # first try spends it, so the rollout is not tried again.
    assert "failed on 1 try of the same rollout" in err
    assert f"gjax.serve server at 127.0.0.1:{port}" in err
    assert "The last intact checkpoint is step 1" in err
    assert [r["step"] for r in rows(wd)] == [1]
    assert sorted(p.name for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert latest_version(wd / "push") == 1  # the weights it started with; no update pushed
