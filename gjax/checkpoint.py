"""Checkpoints: an orbax `CheckpointManager` over the train state plus a JSON sidecar.

One checkpoint at step k holds everything needed to continue exactly as if the run had never
stopped: the train state (params, optimizer state, step), and a JSON item `meta` with the data
iterator position, the host-side group buffers, the metrics history and a fingerprint of the
config fields that must not change across a resume, and a digest of the state's content
(`gjax.integrity`). Directories may be local or `gs://`. Saving is asynchronous (orbax's
background thread); `wait()` blocks until it is durable, `check()` surfaces a failed one.

What can go wrong, and what happens:
  * a state with non-finite values is never saved (`gjax.health.Diverged`, naming the last
    intact checkpoint);
  * a save that fails (disk full, file too large, unwritable path) raises `CheckpointSaveError`
    at the next `check()`, `save()` or `wait()`; the previous checkpoints stay intact (a
    synchronous save to object storage is first retried from scratch within
    `storage_timeout_s`: an outage loses the storage's upload sessions);
  * at restore, a checkpoint that does not decode, or decodes to other content than was
    saved (digest mismatch), or holds non-finite values, is skipped: the next older one is
    restored and the skipped ones are moved aside to `<dir>.damaged/<step>-<time>`, so the
    run can save those steps again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from gjax import integrity, paths
from gjax.errors import UserError
from gjax.health import Diverged

log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used (corrupt, or from another configuration)."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, file too large, unwritable path)."""


class CheckpointStorageTimeout(CheckpointSaveError):
    """A save that did not finish within the storage bound; its thread may still hang on the
    storage, so the process exits at once after the paragraph."""

    exit_now = True


def fingerprint_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Fields whose values differ between a saved and the current fingerprint; a field holding
    a JSON object (the objective's settings) is compared key by key, naming only the keys that
    differ."""
    out = []
    for k in sorted(set(saved) | set(current)):
        old, new = saved.get(k), current.get(k)
        if old == new:
            continue
        old_obj, new_obj = _json_object(old), _json_object(new)
        if old_obj is None or new_obj is None:
            out.append(f"{k}: checkpoint has {old!r}, config has {new!r}")
            continue
        out.extend(
            f"{k}.{sub}: checkpoint has {old_obj.get(sub)!r}, config has {new_obj.get(sub)!r}"
            for sub in sorted(set(old_obj) | set(new_obj))
            if old_obj.get(sub) != new_obj.get(sub)
        )
    return out


def _json_object(value: Any) -> dict | None:
    if not isinstance(value, str) or not value.startswith("{"):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


class Checkpointer:
    """Keep-last-N, periodic, asynchronous checkpoints of `(state, meta)`."""

    def __init__(
        self,
        directory: str | epath.Path,
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 50,
        async_save: bool = True,
        storage_timeout_s: float | None = None,
    ):
        # Local paths absolute (orbax refuses relative ones), gs:// as given.
        self.directory = paths.resolve(directory)
        self.save_interval_steps = save_interval_steps
        self.storage_timeout_s = storage_timeout_s  # None: wait for storage as long as it takes
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        self.damaged_directory = self.directory.parent / f"{self.directory.name}.damaged"
        self._saving: int | None = None  # the step of the last save started

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def should_save(self, step: int) -> bool:
        """Periodic saves at multiples of the interval (orbax alone also saves the first step
        it sees: a wasted full-model write at step 1). Final and preemption saves are forced."""
        return self.save_interval_steps > 0 and step % self.save_interval_steps == 0

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Saves `(state, meta)` at `step`, with the state's content digest in `meta`.

        Raises `Diverged` (nothing saved) if the state holds a non-finite value, and
        `CheckpointSaveError` if this or an earlier asynchronous save failed.
        """
        self.check()
        digest, nonfinite = integrity.inspect(state)
        if nonfinite:
            total, bad = integrity.num_values(state), sum(nonfinite.values())
            first = next(iter(nonfinite))
            raise Diverged(
                f"step {step}: the train state holds {bad:,} non-finite values of {total:,} "
                f"({len(nonfinite)} arrays, e.g. {first}); it was not saved. "
                f"{self.last_intact()} Training diverged: lower optim.lr (or raise "
                "optim.warmup_steps), check the rewards, and rerun."
            )
        meta = {**meta, "content": digest}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if self._saving is not None:
            self.wait()  # orbax would wait for the previous save inside `save`, unbounded
        try:
            if paths.is_url(self.directory):
                saved = self._save_remote(step, args, force)
            else:
                saved = self._mngr.save(step, args=args, force=force)
        except CheckpointSaveError:
            raise
        except Exception as e:
            raise self._save_failed(step, e) from e
        if saved:
            self._saving = step
        return saved

    def _save_remote(self, step: int, args: Any, force: bool) -> bool:
        """A save to object storage, bounded by `storage_timeout_s` in all (a save that hangs
        counts too). A try that fails (the storage went away and came back: its upload
        sessions are lost) is started again from scratch with backoff (1 s, doubling, at most
        30 s) while time is left, after deleting what it wrote. One process only: in a
        multi-process save every process must retry together, so there the first failure
        stops the run (the last intact checkpoint named)."""
        start, delay, tries = time.monotonic(), 1.0, 0
        bound = self.storage_timeout_s
        while True:
            tries += 1
            left = None if bound is None else max(bound - (time.monotonic() - start), 0.1)
            try:
                return self._bounded(
                    lambda: self._mngr.save(step, args=args, force=force), step, left
                )
            except CheckpointSaveError:
                raise
            except Exception as e:
                left = None if bound is None else bound - (time.monotonic() - start)
                if jax.process_count() > 1 or (left is not None and left <= delay):
                    raise
                reason = (str(e).strip().splitlines() or [""])[0][:200]
                log.warning(
                    "saving the checkpoint of step %s failed (try %d: %s: %s); retrying in %.0f s",
                    *(step, tries, type(e).__name__, reason, delay),
                )
            time.sleep(delay)
            delay = min(2 * delay, 30.0)
            left = None if bound is None else max(bound - (time.monotonic() - start), 0.1)
            if self._bounded(lambda: self._discard_unfinished(step), step, left):
                return True  # the failed try had committed the step (it failed after that)

    def _discard_unfinished(self, step: int) -> bool:
        """Deletes what a failed save of `step` left in storage (never a committed step) and
        re-reads the listing, so the next try writes the step anew. True if the step turns
        out to be committed (the try failed after its commit, e.g. deleting an old step)."""
        try:
            self._mngr.reload()
            if step in self._mngr.all_steps():
                return True
            partial = self.directory / str(step)
            if partial.exists():
                partial.rmtree()
        except Exception as e:  # storage still failing: the next try fails and says so
            log.warning("could not clear the unfinished step %s in %s: %s", step, self.directory, e)
        return False

    def check(self) -> None:
        """Raises `CheckpointSaveError` if an asynchronous save has failed; never blocks on
        one still running. Cheap: call it every step, so a failure stops the run at once."""
        if self._saving is not None and not self._mngr.is_saving_in_progress():
            self.wait()

    def last_intact(self) -> str:
        """A sentence naming the newest complete checkpoint (for error messages); a save still
        in flight does not count. Reads no storage."""
        pending = self._saving if self._mngr.is_saving_in_progress() else None
        step = max((s for s in self._mngr.all_steps() if s != pending), default=None)
        if step is None:
            return f"No checkpoint has been saved in {self.directory}; a rerun starts afresh."
        return (
            f"The last intact checkpoint is step {step} in {self.directory}; a rerun with the "
            "same --workdir resumes from it."
        )

    def _save_failed(self, step: int | None, err: BaseException) -> CheckpointSaveError:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if len(reason) > 240:  # storage errors name every layer; the cause comes last
            reason = "..." + reason[-240:]
        try:  # the failed step is not a checkpoint
            paths.bounded(self._mngr.reload, min(30.0, self.storage_timeout_s or 30.0))
        except Exception as e:  # storage still failing: the listing known before the save
            log.warning("could not re-read %s after the failed save: %s", self.directory, e)
        return CheckpointSaveError(
            f"saving the checkpoint of step {step} in {self.directory} failed: {reason}. "
            f"The run stopped. {self.last_intact()} Free disk space or fix the directory first."
        )

    def restore(
        self,
        abstract_state: Any,
        *,
        step: int | None = None,
        fingerprint: Mapping | None = None,
        move_damaged: bool = False,
    ) -> tuple[int, Any, dict[str, Any]]:
        """Restores the newest sound checkpoint (or `step`) into `abstract_state`'s shardings.

        A checkpoint that fails to read, whose content differs from its digest, or that holds
        non-finite values is reported and the next older one is tried, so one torn write or
        one damaged file never loses the run. With `move_damaged` (a run that will save those
        steps again), once an older one restores, the damaged ones are moved aside
        (`damaged_directory`); readers (export) leave the directory as it is. A checkpoint written under a different
        configuration (see `fingerprint`) is refused with the differing fields named.
        """
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps or steps == [None]:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        failures, damaged = [], []

        def skip(s, why):
            failures.append(f"step {s}: {why}")
            damaged.append(s)
            log.error("checkpoint step %s in %s is damaged (%s)", s, self.directory, why)

        for s in steps:
            try:
                meta = self._mngr.restore(
                    s, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                ).meta
            except Exception as e:  # report, then fall back to an older step
                skip(s, f"unreadable: {type(e).__name__}: {e}")
                continue
            if fingerprint is not None:
                diff = fingerprint_mismatch(meta.get("fingerprint", {}), fingerprint)
                if diff:
                    raise CheckpointError(
                        f"the checkpoint in {self.directory} (step {s}) was written by a different "
                        "configuration:\n  " + "\n  ".join(diff) + "\nUse a new --workdir, or "
                        "restore the original config values."
                    )
            target = jax.tree.map(
                lambda x: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "shape") else x,
                abstract_state,
            )
            try:
                state = self._mngr.restore(
                    s, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
                ).state
            except Exception as e:
                skip(s, f"unreadable: {type(e).__name__}: {e}")
                continue
            problem = _verify(state, meta.pop("content", None))
            if problem:
                skip(s, problem)
                continue
            if damaged:
                if move_damaged:
                    self._move_aside(damaged)
                log.warning("restored step %s after skipping damaged checkpoints", s)
            return s, state, meta
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}:\n  "
            + "\n  ".join(failures)
            + "\nMove the damaged step directories aside or start a new --workdir."
        )

    def _move_aside(self, steps: list[int]) -> None:
        """Moves skipped steps to `damaged_directory`, so this run can save those steps."""
        if jax.process_index() == 0:
            self.damaged_directory.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for s in steps:
                dst = self.damaged_directory / f"{s}-{stamp}"
                try:
                    (self.directory / str(s)).rename(dst)
                except OSError as e:  # the run would fail later, saving that step again
                    raise CheckpointError(
                        f"checkpoint step {s} in {self.directory} is damaged and could not be "
                        f"moved aside to {dst} ({e}); move or delete it, then rerun."
                    ) from e
                log.warning("moved the damaged checkpoint of step %s aside to %s", s, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("gjax_checkpoint_move_aside")
        self._mngr.reload()

    def wait(self) -> None:
        """Blocks until the save in flight is durable (at most `storage_timeout_s`)."""
        try:
            self._bounded(self._mngr.wait_until_finished, self._saving)
        except CheckpointStorageTimeout:
            raise  # still in flight
        except Exception as e:
            step, self._saving = self._saving, None
            raise self._save_failed(step, e) from e
        self._saving = None

    def _bounded(self, fn, step: int | None, timeout_s: float | None = None):
        """`fn()`, or `CheckpointStorageTimeout` once it ran `timeout_s` (default
        `storage_timeout_s`; the save retries storage errors with backoff underneath:
        tensorstore's gcs driver)."""
        if self.storage_timeout_s is None:
            return fn()
        try:
            return paths.bounded(fn, timeout_s or self.storage_timeout_s)
        except TimeoutError:
            raise CheckpointStorageTimeout(
                f"saving the checkpoint of step {step} in {self.directory} did not finish "
                f"within config.train.storage_timeout_s={self.storage_timeout_s:g} s: the "
                f"storage is unreachable or too slow, so the run stopped. {self.last_intact()} "
                "The unfinished step is not used."
            ) from None

    def close(self) -> None:
        self.wait()
        self._mngr.close()

    def _pick(self, step: int | None) -> tuple[int, list[int]]:
        """`(step, all steps)`: `step`, or the newest when None; a missing one is refused."""
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}: the run has saved none yet")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; it has steps {steps}"
            )
        return (steps[-1] if step is None else step), steps

    def restore_meta(self, *, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """The `meta` item (data position, history, fingerprint) of the newest checkpoint (or
        `step`), without reading its state: what an export checks before loading weights."""
        step, steps = self._pick(step)
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointError(
                f"the checkpoint of step {step} in {self.directory} could not be read "
                f"({type(e).__name__}: {e}); the run has steps {steps}: pick another with --step"
            ) from e
        return step, meta.meta

    def restore_params(self, abstract_params: Any, *, step: int | None = None) -> tuple[int, Any]:
        """Only the policy params of the newest checkpoint (or `step`): what an export needs.

        The optimizer state (twice the params' size for Adam) is never read. Leaves of
        `abstract_params` are `jax.ShapeDtypeStruct`s; they land on their `sharding` (default:
        host memory, i.e. the CPU device, also on an accelerator machine).
        """
        step, steps = self._pick(step)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(dtype=x.dtype, sharding=x.sharding or device),
            abstract_params,
        )
        args = ocp.args.PyTreeRestore(
            item={"params": abstract_params},
            restore_args={"params": restore_args},
            partial_restore=True,
        )
        try:
            state = self._mngr.restore(step, args=ocp.args.Composite(state=args)).state
        except Exception as e:
            raise CheckpointError(
                f"the checkpoint of step {step} in {self.directory} could not be read "
                f"({type(e).__name__}: {e}); the run has steps {steps}: pick another with --step"
            ) from e
        return step, state["params"]


def last_intact_in(directory: str | epath.Path) -> str:
    """`Checkpointer.last_intact`'s sentence from a listing of `directory` alone (no orbax
    manager, no collective): for a process that must exit now (a peer died, storage is down).
    A step is committed once renamed from orbax's temporary name (local) or once its
    `commit_success.txt` exists (gs://)."""
    d = paths.resolve(directory)
    try:
        steps = sorted((int(p.name) for p in d.iterdir() if p.name.isdigit()), reverse=True)
        if paths.is_url(d):
            steps = [s for s in steps if (d / str(s) / "commit_success.txt").exists()]
    except FileNotFoundError:
        steps = []
    except Exception as e:  # storage unreachable: say where to look instead
        return (
            f"The checkpoints in {d} could not be listed ({type(e).__name__}); a rerun with the "
            "same --workdir resumes from the newest intact one there."
        )
    if not steps:
        return f"No checkpoint has been saved in {d}; a rerun starts afresh."
    return (
        f"The last intact checkpoint is step {steps[0]} in {d}; a rerun with the same "
        "--workdir resumes from it."
    )


def _verify(state: Any, saved_digest: Mapping[str, int] | None) -> str | None:
    """Why a restored state is not what was saved (None if it is)."""
    digest, nonfinite = integrity.inspect(state)
    if saved_digest is not None:
        differ = [k for k in digest if saved_digest.get(k) != digest[k]]
        if differ or set(saved_digest) != set(digest):
            first = (differ or sorted(set(saved_digest) ^ set(digest)))[0]
            return (
                f"content differs from what was saved in {max(len(differ), 1)} arrays "
                f"(e.g. {first}): the files were changed or damaged after the save"
            )
    if nonfinite:
        return (
            f"holds {sum(nonfinite.values()):,} non-finite values (e.g. in {next(iter(nonfinite))})"
        )
    return None
