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
    at the next `check()`, `save()` or `wait()`; the previous checkpoints stay intact;
  * at restore, a checkpoint that does not decode, or decodes to other content than was
    saved (digest mismatch), or holds non-finite values, is skipped: the next older one is
    restored and the skipped ones are moved aside to `<dir>.damaged/<step>-<time>`, so the
    run can save those steps again.
"""

from __future__ import annotations

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


def fingerprint_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Fields whose values differ between a saved and the current fingerprint."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint has {saved.get(k)!r}, config has {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]


class Checkpointer:
    """Keep-last-N, periodic, asynchronous checkpoints of `(state, meta)`."""

    def __init__(
        self,
        directory: str | epath.Path,
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 50,
        async_save: bool = True,
    ):
        # Local paths absolute (orbax refuses relative ones), gs:// as given.
        self.directory = paths.resolve(directory)
        self.save_interval_steps = save_interval_steps
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
        try:
            saved = self._mngr.save(step, args=args, force=force)
        except Exception as e:
            raise self._save_failed(step, e) from e
        if saved:
            self._saving = step
        return saved

    def check(self) -> None:
        """Raises `CheckpointSaveError` if an asynchronous save has failed; never blocks on
        one still running. Cheap: call it every step, so a failure stops the run at once."""
        if self._saving is not None and not self._mngr.is_saving_in_progress():
            self.wait()

    def last_intact(self) -> str:
        """A sentence naming the newest complete checkpoint (for error messages)."""
        step = self._mngr.latest_step()
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
        self._mngr.reload()  # the failed step is not a checkpoint
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
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            raise self._save_failed(self._saving, e) from e
        finally:
            self._saving = None

    def close(self) -> None:
        self.wait()
        self._mngr.close()

    def restore_params(self, abstract_params: Any, *, step: int | None = None) -> tuple[int, Any]:
        """Only the policy params of the newest checkpoint (or `step`): what an export needs.

        The optimizer state (twice the params' size for Adam) is never read. Leaves of
        `abstract_params` are `jax.ShapeDtypeStruct`s; they land on their `sharding` (default:
        host memory, i.e. the CPU device, also on an accelerator machine).
        """
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}: the run has saved none yet")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; it has steps {steps}"
            )
        step = steps[-1] if step is None else step
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
