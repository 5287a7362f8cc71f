"""`PromptIterator`: deterministic, per-host sharded, resumable batches of prompts.

    it    = PromptIterator(data, global_batch_size=P, seed=0)
    batch = next(it)          # PromptBatch: prompt_ids_PxS, prompt_mask_PxS, raw strings
    it.state()                # {"epoch": 0, "index": P, ...}: store it in the checkpoint
    PromptIterator(data, global_batch_size=P, seed=0, state=saved)   # same next batches

Order and sharding. Epoch ``e`` visits the kept rows in the order
``np.random.default_rng([seed, e]).permutation(n)`` (or in file order with
``shuffle=False``); global batch ``k`` is rows ``[k*P, (k+1)*P)`` of that order and host
``h`` of ``H`` takes its ``h``-th contiguous slice of ``P/H`` rows, so the hosts partition
every global batch. The incomplete last global batch of an epoch is dropped, so every host
runs the same number of steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from gjax.data.prompts import PromptBatch, PromptData, ShardedPrompts
from gjax.data.sources import DataError


class PromptIterator(Iterator[PromptBatch]):
    """Deterministic, per-host sharded, resumable batches of prompts (see module docstring).

    ``state()`` is a small dict ``{"epoch", "index", "num_rows", "seed"}`` (``index`` counts
    global rows consumed in the epoch); passing it back as ``state=`` continues with exactly
    the batches the saved iterator would have produced next.
    """

    def __init__(
        self,
        data: PromptData | ShardedPrompts,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        num_epochs: int | None = None,
        state: Mapping[str, Any] | None = None,
    ):
        if process_index is None or process_count is None:
            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise DataError(
                f"need 0 <= process_index < process_count, got {process_index}, {process_count}"
            )
        if global_batch_size <= 0 or global_batch_size % process_count:
            raise DataError(
                f"the global prompt batch size ({global_batch_size}) must be a positive multiple "
                f"of the process count ({process_count})"
            )
        if global_batch_size > len(data):
            raise DataError(
                f"the global prompt batch size ({global_batch_size}) exceeds the {len(data)} "
                f"prompts kept ({data.stats}); use more data or a smaller batch"
            )
        if num_epochs is not None and num_epochs <= 0:
            raise DataError(f"num_epochs must be positive or None, got {num_epochs}")
        self.data = data
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.num_epochs = num_epochs
        self.steps_per_epoch = len(data) // global_batch_size
        self._epoch, self._index = 0, 0
        self._order_epoch, self._order = -1, None
        if state is not None:
            self.restore(state)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = len(self.data)
            self._order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def state(self) -> dict[str, int]:
        return {
            "epoch": self._epoch,
            "index": self._index,
            "num_rows": len(self.data),
            "seed": self.seed,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        missing = {"epoch", "index"} - set(state)
        if missing:
            raise DataError(f"data state {dict(state)} lacks {sorted(missing)}")
        for key, mine in (("num_rows", len(self.data)), ("seed", self.seed)):
            if key in state and int(state[key]) != mine:
                raise DataError(
                    f"the saved data position was taken with {key}={int(state[key])}, this run has "
                    f"{key}={mine}: the checkpoint belongs to a different data configuration"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.data) or index % self.global_batch_size:
            raise DataError(
                f"invalid data position {dict(state)} for {len(self.data)} rows and global batch "
                f"size {self.global_batch_size}"
            )
        self._epoch, self._index = epoch, index

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptBatch:
        if self._index + self.global_batch_size > len(self.data):
            self._epoch, self._index = self._epoch + 1, 0
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        order = self._epoch_order(self._epoch)
        start = self._index + self.process_index * self.local_batch_size
        rows = order[start : start + self.local_batch_size]
        epoch = self._epoch
        self._index += self.global_batch_size
        return self.data.take(rows, epoch)
