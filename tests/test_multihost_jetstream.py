"""Multi-host x JetStream x async: two trainer processes (gloo) sampling from two `gjax.serve`
replicas at rollout.max_staleness = 1 train exactly as one process sampling from one server at
k = 1, while one replica is SIGKILLed mid-run; and multi-turn episodes
(gjax.rollout.jetstream_episodes) on two processes train as on one, at k = 0 and k = 1.

Sampling is deterministic (top_k = 1), so which replica serves a request does not change its
tokens. Each trainer process's producer thread sends its own rows' requests and exchanges only
through jax's key-value store; each new version is pushed by the loop's thread of every process
(a collective: orbax's save into the push directory both replicas watch), once the producer has
sampled every step of the older version, and every process waits until each replica serves it.
The killed replica's requests go to the other one: nothing is dropped.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.test_multihost import (
    ARGS,
    EMBEDDED,
    EPISODE_VOLATILE,
    ROOT,
    _assert_same_run,
    _env,
    _free_port,
    _rows,
    _state,
)

pytest.importorskip("gjax.rollout.replicas")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built"),
]

# Greedy-equivalent sampling on the server and in the trainer's config (they must agree),
# and one anchor per group (the demonstration) so that groups differ and the update moves.
SAMPLING = ["--config.rollout.top_k=1", "--config.anchors.per_group=1"]
# No test reads the summary: the held-out evaluation is greedy only (pass@k's 8 samples of
# each problem, served top_k = 1 by the servers, would be 8 copies of one decode).
STEPS = 4  # k = 1: versions 0, 0, 1, 2 (three pushes; the kill falls between the last two)


def _serve(port: int, push_dir, log_path, extra=()) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gjax.serve",
        ARGS[0],
        *SAMPLING,
        *extra,
        f"--config.rollout.server_address=127.0.0.1:{port}",
        f"--config.rollout.push_dir={push_dir}",
        "--config.rollout.decode_slots=8",
        f"--workdir={push_dir}",
    ]
    with open(log_path, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=_env(1), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _start_servers(tmp_path, push_dirs, extra=()) -> tuple[list, list, list[str]]:
    """(servers, their logs, addresses): one `gjax.serve` per push dir, each ready."""
    ports = [_free_port() for _ in push_dirs]
    logs = [tmp_path / f"serve{i}.log" for i in range(len(push_dirs))]
    servers = [_serve(port, d, log, extra) for port, d, log in zip(ports, push_dirs, logs)]
    try:
        deadline = time.monotonic() + 300
        for proc, log in zip(servers, logs):
            _wait_ready(proc, log, deadline)
    except BaseException:
        _kill(servers)
        raise
    return servers, logs, [f"127.0.0.1:{p}" for p in ports]


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _wait_ready(proc, log_path, deadline):
    while "gjax.serve: ready" not in log_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.2)


def _train(
    workdir,
    addresses: list[str],
    processes: int,
    *,
    steps=STEPS,
    k=1,
    sampling=SAMPLING,
    module="gjax.train",
) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", module, f"--workdir={workdir}", *ARGS, *sampling]
    cmd += [
        f"--config.train.steps={steps}",
        "--config.rollout.backend=jetstream_grpc",
        f"--config.rollout.server_addresses={','.join(addresses)}",
        "--config.rollout.request_timeout_s=120",
        f"--config.rollout.max_staleness={k}",
        "--config.eval.num_samples=0",
    ]
    if processes == 1:
        return [
            subprocess.Popen(
                cmd,
                env=_env(8),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        ]
    port = _free_port()
    return [
        subprocess.Popen(
            [
                *cmd,
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            env=_env(4),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _read(trainers) -> tuple[list[list[str]], list[threading.Thread]]:
    """Each trainer's output lines as they come (a thread each: no pipe fills up)."""
    outs = [[] for _ in trainers]
    readers = [
        threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout), daemon=True)
        for p, o in zip(trainers, outs)
    ]
    for t in readers:
        t.start()
    return outs, readers


def _wait_all(trainers, outs, readers, deadline_s: float = 600) -> None:
    """Every trainer exits 0 (or the test fails with its output's tail)."""
    for p in trainers:
        p.wait(timeout=deadline_s)
    for t in readers:
        t.join(30)
    for p, o in zip(trainers, outs):
        assert p.returncode == 0, "".join(o)[-6000:]


def _without_serving(rows):
    """Rows without the serving figures that differ between the layouts (per-replica
    counts, push seconds, retries after the kill); dropped rows and versions are kept."""
    keep = ("rollout/requests_dropped", "rollout/policy_version")
    return [{k: v for k, v in r.items() if not k.startswith("rollout/") or k in keep} for r in rows]


def test_two_processes_two_replicas_at_k1_equal_one_process_one_server_with_a_replica_killed(
    tmp_path,
):
    ref, two = tmp_path / "one", tmp_path / "two"
    servers, logs, addresses = _start_servers(tmp_path, [ref / "push", two / "push", two / "push"])
    trainers = []
    try:
        trainers = _train(ref, addresses[:1], 1) + _train(two, addresses[1:], 2)
        outs, readers = _read(trainers)
        deadline = time.monotonic() + 300
        # SIGKILL replica 1 of the two-process run once it serves version 2 (the first update's
        # params): mid-run, with steps 3 and 4 still to sample and version 3 to push.
        while "serving policy version 2" not in logs[2].read_text():
            assert all(p.poll() is None for p in trainers[1:]), "".join(outs[1])[-4000:]
            assert time.monotonic() < deadline, "".join(outs[1])[-4000:]
            time.sleep(0.05)
        servers[2].send_signal(signal.SIGKILL)
        _wait_all(trainers, outs, readers)
    finally:
        _kill([*trainers, *servers])
    ref_rows, two_rows = _rows(ref), _rows(two)
    assert [r["step"] for r in two_rows] == list(range(1, STEPS + 1))
    assert [r["async/version_lag_max"] for r in two_rows] == [0, 1, 1, 1]  # v(j) = max(j-1, 0)
    assert [r["rollout/policy_version"] for r in two_rows] == [1, 1, 2, 3]  # one push each
    assert all(r["rollout/requests_dropped"] == 0 for r in two_rows + ref_rows)
    # Both replicas served the first step; the killed one nothing after its failure was seen.
    assert two_rows[0]["rollout/replica0/requests"] > 0
    assert two_rows[0]["rollout/replica1/requests"] > 0
    assert sum(r["rollout/replica1/failures"] for r in two_rows) > 0
    assert two_rows[-1]["rollout/replica1/requests"] == 0
    # A dead replica is not waited for at a push (request_timeout_s=120).
    assert all(r["rollout/push_s"] < 60 for r in two_rows[1:]), two_rows
    _assert_same_run(
        _without_serving(ref_rows),
        _without_serving(two_rows),
        _state(ref, STEPS),
        _state(two, STEPS),
        updates=STEPS,
    )
    print(json.dumps({k: v for k, v in two_rows[-1].items() if k.startswith("rollout/")}))


# Multi-turn (tests/two_step_env.py: two turns, an observation inserted after the first).
# Greedy (top_k = 1) makes a group's episodes equal, so its advantages are 0; the entropy bonus
# gives the update a gradient that depends on every row (the learner's log-probs of them all).
EPISODES = [
    "--config.rollout.top_k=1",
    "--config.env.name=two_step",
    "--config.env.max_turns=2",
    "--config.objective.entropy_coef=0.01",
]


@pytest.mark.parametrize("k", [0, 1])
def test_two_processes_train_jetstream_episodes_as_one(tmp_path, k):
    """Episodes on `gjax.serve` (each turn a request with the history resent): two trainer
    processes, each playing its own rows' episodes through its own client, train as one
    process on its own server, to `_assert_same_run` (the env/ figures pooled over both);
    synchronously (k = 0: the global batch's rows, each process its block) and at k = 1 (the
    producer's process-local rows). The servers size their prefill bucket for a turn's
    history (`served_prompt_len`: env.name set)."""
    ref, two = tmp_path / "one", tmp_path / "two"
    # the servers' bucket: prompt + trajectory (env.name set)
    servers, _, addresses = _start_servers(tmp_path, [ref / "push", two / "push"], EPISODES[1:3])
    trainers = []
    try:
        run = lambda wd, address, n: _train(  # noqa: E731
            wd, [address], n, steps=2, k=k, sampling=EPISODES, module="tests.two_step_env"
        )
        trainers = run(ref, addresses[0], 1) + run(two, addresses[1], 2)
        _wait_all(trainers, *_read(trainers))
    finally:
        _kill([*trainers, *servers])
    ref_rows, two_rows = _rows(ref), _rows(two)
    assert [r["step"] for r in two_rows] == [1, 2]
    for r in two_rows:  # every process's episodes: two turns each (a few cut at 32 tokens)
        assert 1.5 < r["env/turns_per_episode"] <= 2.0 and r["env/tokens_inserted"] > 0
        assert r["rollout/requests_dropped"] == 0 and r["optim/grad_norm"] > 0  # (entropy's)
        assert r["env/prefill_tokens_per_episode_sent"] > r["env/prefill_tokens_per_episode_kept"]
    _assert_same_run(
        _without_serving(ref_rows),
        _without_serving(two_rows),
        _state(ref, 2),
        _state(two, 2),
        updates=2,
        volatile=EPISODE_VOLATILE,
    )
    assert json.loads((two / "summary.json").read_text()) == json.loads(
        (ref / "summary.json").read_text()
    )
