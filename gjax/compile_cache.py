"""The persistent XLA compilation cache `gjax.train` keeps by default.

A run compiles its programs (sampler, log-prob passes, one update per packed bin shape) once;
with the cache a rerun, a resume or another run of the same shapes reads them back instead
(the cached executable is the one a compile produces, so the run is bit-identical).

`train.compilation_cache` says where (`directory`): "default" is $JAX_COMPILATION_CACHE_DIR
when that is set (jax's own variable; set empty, it turns the cache off), else
$XDG_CACHE_HOME/gjax/jax (~/.cache/gjax/jax without XDG_CACHE_HOME); a path is that
directory; "" turns the cache off. Where gjax picks the directory (every case but jax's own
variable, whose companions JAX_COMPILATION_CACHE_MAX_SIZE etc. then apply as jax reads them)
it caches every program (the embedded run's sub-second ones add up) and bounds the directory
to `MAX_SIZE` bytes, least recently used entries evicted.

A size-limited cache keeps one `-atime` file per entry, and jax scans them all before each
write: one entry without its atime file (a process killed between the two writes, or a writer
without a size limit in the same directory) makes every later write fail with a warning, so
every run compiles everything again. `enable` removes such entries first (`repair`), under
jax's own lock (experiments/run.py repairs its shared cache the same way).
"""

from __future__ import annotations

import contextlib
import logging
import os

import jax

log = logging.getLogger(__name__)

ENV = "JAX_COMPILATION_CACHE_DIR"
DEFAULT = "default"
MAX_SIZE = 4 << 30  # bytes; the embedded run's programs take ~30 MB


def default_directory(environ=os.environ) -> str:
    """$XDG_CACHE_HOME/gjax/jax, or ~/.cache/gjax/jax."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gjax", "jax")


def directory(setting: str, environ=os.environ) -> tuple[str | None, bool]:
    """(the cache directory or None for no cache, whether gjax chose it) for the
    `train.compilation_cache` value `setting` (module docstring)."""
    if setting == DEFAULT:
        if ENV in environ:  # the user's own choice, empty: off
            return (environ[ENV] or None), False
        return default_directory(environ), True
    return (os.path.expanduser(setting) if setting else None), True


def enable(setting: str, environ=os.environ) -> str | None:
    """Turns the persistent cache on (or off) for this process's compiles from here on, as
    `setting` says; returns the directory (None: off). Call before the first compile."""
    path, chosen = directory(setting, environ)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if chosen:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # jax's size limit needs filelock (a dependency of datasets and huggingface_hub)
        jax.config.update("jax_compilation_cache_max_size", MAX_SIZE if _has_filelock() else -1)
    if "://" in path:  # gs:// and the like: jax reads and writes it through etils.epath
        return path
    try:
        os.makedirs(path, exist_ok=True)
        if jax.config.jax_compilation_cache_max_size > 0 and (removed := repair(path)):
            log.warning(
                "compilation cache %s: removed %d entries without an atime file (they would "
                "stop every later write to it)",
                path,
                len(removed),
            )
    except OSError as e:  # an unwritable cache costs compile time, never the run
        log.warning("compilation cache %s unusable (%s): compiling without it", path, e)
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    return path


def _has_filelock() -> bool:
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True


def repair(path: str, lock_timeout_s: float = 60) -> list[str]:
    """Removes the entries of the size-limited cache in `path` that have a `-cache` file but
    no `-atime` file (module docstring); returns their file names. Holds jax's lock."""
    import filelock  # jax's own lock for a size-limited cache (jax/_src/lru_cache.py)

    removed = []
    lock = filelock.FileLock(os.path.join(path, ".lockfile"), timeout=lock_timeout_s)
    with contextlib.suppress(FileNotFoundError), lock:
        names = set(os.listdir(path))
        for name in sorted(names):
            key = name.removesuffix("-cache")
            if key != name and f"{key}-atime" not in names:
                os.remove(os.path.join(path, name))
                removed.append(name)
    return removed
