"""Threads standing in for the hosts of a multi-process run, for host-side exchanges."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np


def on_hosts(count, fn, *, returned=()):
    """`fn(process_index, allgather)` on `count` threads standing in for hosts, with an
    allgather that meets at a barrier as `jax.distributed`'s does; the per-host results (an
    exception of a type in `returned` is that host's result instead of being raised)."""
    barrier, slots = threading.Barrier(count, timeout=60), [None] * count

    def run(h):
        def allgather(x):
            slots[h] = np.asarray(x)
            barrier.wait()
            out = np.stack(slots)
            barrier.wait()
            return out

        try:
            return fn(h, allgather)
        except returned as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))
