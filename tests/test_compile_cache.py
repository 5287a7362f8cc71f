"""gjax.train's persistent compilation cache (gjax.compile_cache): where it goes, that the
trainer turns it on by default before its first compile, and the repair of entries a
size-limited cache can no longer write past."""

import os
import subprocess
import sys

from gjax import compile_cache
from tests.user_env import PYTHONPATH as USER_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cache_directory_follows_the_setting_and_the_environment(tmp_path):
    home = os.path.expanduser("~")
    assert compile_cache.directory("default", {}) == (f"{home}/.cache/gjax/jax", True)
    xdg = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compile_cache.directory("default", xdg) == (f"{tmp_path}/gjax/jax", True)
    # jax's own variable wins over the default (empty: off), and leaves its settings to jax.
    env = {**xdg, "JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    assert compile_cache.directory("default", env) == ("/elsewhere", False)
    assert compile_cache.directory("default", {"JAX_COMPILATION_CACHE_DIR": ""}) == (None, False)
    # The config field: a path of its own (over the variable), or off.
    assert compile_cache.directory("~/c", env) == (f"{home}/c", True)
    assert compile_cache.directory("", env) == (None, True)


def test_repair_removes_the_entries_without_an_atime_file(tmp_path):
    for name in ("a-cache", "a-atime", "b-cache", "c-atime"):
        (tmp_path / name).write_bytes(b"x")
    assert compile_cache.repair(str(tmp_path)) == ["b-cache"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lockfile",
        "a-atime",
        "a-cache",
        "c-atime",
    ]
    assert compile_cache.repair(str(tmp_path / "missing")) == []


def _env(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION", "JAX_PERSISTENT"))
    }
    return {**env, "PYTHONPATH": USER_PATH, "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def test_gjax_train_turns_the_cache_on_by_default(tmp_path):
    """Without JAX_COMPILATION_CACHE_DIR (the suite sets one), `python -m gjax.train` caches
    in $XDG_CACHE_HOME/gjax/jax before anything compiles: a config error found at start
    (train.steps=0) leaves the directory made. In a process that compiles, the default
    writes every program there and the next process reads it back; '' turns it off."""
    cmd = [sys.executable, "-m", "gjax.train", "--config=configs/a_grae.py:tiny"]
    cmd += ["--config.train.steps=0", f"--workdir={tmp_path / 'wd'}"]
    cache = tmp_path / "xdg" / "gjax" / "jax"
    on = subprocess.run(
        cmd, env=_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert on.returncode == 2 and "train.steps" in on.stderr, on.stderr[-2000:]
    assert cache.is_dir()
    # What jax does with it: every program written (min compile time 0), size-limited (atime
    # files), and read back by the next process instead of compiled.
    code = (
        "import jax, jax.numpy as jnp; from gjax import compile_cache; "
        "print(compile_cache.enable('default')); "
        "print(float(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(()))))"
    )
    env = {**_env(tmp_path), "JAX_LOG_COMPILES": "1"}  # logs each cache hit and miss
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.splitlines()[0] == str(cache)
    assert "Persistent compilation cache hit" not in first.stderr
    entries = sorted(p.name for p in cache.iterdir())
    assert any(n.endswith("-cache") for n in entries) and any(n.endswith("-atime") for n in entries)
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Persistent compilation cache hit for 'jit__lambda'" in second.stderr
    code = code.replace("enable('default')", "enable(''), jax.config.jax_enable_compilation_cache")
    off = run()
    assert off.returncode == 0 and off.stdout.splitlines()[0] == "None False", off.stderr
    assert "Persistent compilation cache hit" not in off.stderr
