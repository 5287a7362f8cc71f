"""Checkpoints: an orbax `CheckpointManager` over the train state plus a JSON sidecar.

One checkpoint at step k holds everything needed to continue exactly as if the run had never
stopped: the train state (params, optimizer state, step), and a JSON item `meta` with the data
iterator position, the host-side group buffers, the metrics history and a fingerprint of the
config fields that must not change across a resume. Directories may be local or `gs://`.
Saving is asynchronous (orbax's background thread); `wait()` blocks until it is durable.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from gjax import paths
from gjax.cli import UserError

log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used (corrupt, or from another configuration)."""


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

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def should_save(self, step: int) -> bool:
        """Periodic saves at multiples of the interval (orbax alone also saves the first step
        it sees: a wasted full-model write at step 1). Final and preemption saves are forced."""
        return self.save_interval_steps > 0 and step % self.save_interval_steps == 0

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self._mngr.save(step, args=args, force=force)

    def restore(
        self, abstract_state: Any, *, step: int | None = None, fingerprint: Mapping | None = None
    ) -> tuple[int, Any, dict[str, Any]]:
        """Restores the newest readable checkpoint (or `step`) into `abstract_state`'s shardings.

        A checkpoint that fails to read is reported and the next older one is tried, so one
        torn write never loses the run; a checkpoint written under a different configuration
        (see `fingerprint`) is refused with the differing fields named.
        """
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps or steps == [None]:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        failures = []
        for s in steps:
            try:
                meta = self._mngr.restore(
                    s, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                ).meta
            except Exception as e:  # report, then fall back to an older step
                failures.append(f"step {s}: {type(e).__name__}: {e}")
                log.error("checkpoint step %s in %s is unreadable (%s)", s, self.directory, e)
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
                failures.append(f"step {s}: {type(e).__name__}: {e}")
                log.error("checkpoint step %s in %s is unreadable (%s)", s, self.directory, e)
                continue
            if failures:
                log.warning("restored step %s after skipping unreadable checkpoints", s)
            return s, state, meta
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}:\n  "
            + "\n  ".join(failures)
            + "\nMove the damaged step directories aside or start a new --workdir."
        )

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
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
