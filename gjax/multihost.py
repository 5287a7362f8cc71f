"""Multi-controller runs: `jax.distributed` start-up and the few host-level exchanges.

Every process runs the same program on its own devices (no Pathways, no Ray). A rollout
batch's rows are split into contiguous blocks, one per process, in the order the mesh lays
the batch axes over the processes (`RowLayout`): each process loads, samples, decodes and
scores only its block, and the global arrays are assembled from the blocks with
`jax.make_array_from_process_local_data`. Host-level exchanges are few and small:
group-level arrays (`*_PxG`: rewards, scores, flags) and per-step host metrics are
all-gathered (`gather_rows`, `combine_metrics`), selection counts and the stop flag agree
through `allgather`. With one process every function here is the identity.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from gjax.errors import UserError


class DistributedError(UserError, RuntimeError):
    """A multi-process setup that cannot work (flags, environment or mesh)."""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize` from flags, else the environment, else auto-detection.

    On TPU VMs (and SLURM / Open MPI / Kubernetes) JAX finds all three by itself. Elsewhere
    give them as flags or as `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`.
    CPU collectives across processes go through gloo.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    given = [x is not None for x in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise DistributedError(
            "multi-process setup is incomplete: give all of --coordinator_address, "
            "--num_processes and --process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
            "JAX_PROCESS_ID), or none of them on a TPU VM, where JAX detects them; got "
            f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r}"
        )
    if all(given) and not 0 <= process_id < num_processes:
        raise DistributedError(
            f"--process_id={process_id} must be in [0, --num_processes={num_processes})"
        )
    # Cross-process collectives of the CPU backend (harmless where an accelerator runs them).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


def is_primary() -> bool:
    """Process 0 writes logs, metrics, summaries and run metadata (all processes save state)."""
    return jax.process_index() == 0


class RowLayout:
    """Which contiguous block of a batch's rows each process holds under `sharding`.

    `sharding` shards dimension 0 over the batch mesh axes; each process's devices must cover
    one contiguous block of rows of the same size, disjoint from the other processes' (true
    when the tensor axis stays within a host). `block` is this process's block index;
    `process_at[b]` the process holding block `b`.
    """

    def __init__(self, sharding: NamedSharding):
        self.sharding = sharding
        self.count = jax.process_count()
        rows = int(np.prod([sharding.mesh.shape[a] for a in _batch_axes(sharding)] or [1]))
        self.rows = rows  # devices the rows are split over
        if self.count == 1:
            self.block, self.process_at = 0, [0]
            return
        starts: dict[int, set[int]] = {}
        for device, index in sharding.devices_indices_map((rows,)).items():
            starts.setdefault(device.process_index, set()).add(index[0].indices(rows)[0])
        per = rows // self.count if rows % self.count == 0 else 0
        blocks = {}
        for proc, s in starts.items():
            first = min(s)
            ok = per > 0 and first % per == 0 and s == set(range(first, first + per))
            if not ok:
                break
            blocks[proc] = first // per
        if len(blocks) != self.count or len(set(blocks.values())) != self.count:
            raise DistributedError(
                f"the mesh {dict(sharding.mesh.shape)} does not give each of the {self.count} "
                "processes its own contiguous block of batch rows (the batch axes data*fsdp "
                f"= {rows} must be a multiple of the process count, and the tensor axis must "
                "stay within a host); change config.mesh"
            )
        self.block = blocks[jax.process_index()]
        self.process_at = [p for p, _ in sorted(blocks.items(), key=lambda kv: kv[1])]

    def check_rows(self, n: int, field: str) -> None:
        """Fails fast unless `n` rows split over the devices, each device's from one process."""
        if self.count > 1 and n % self.rows:
            raise DistributedError(
                f"{field}={n} must be a multiple of the data-parallel size {self.rows} "
                f"(mesh.data*mesh.fsdp) in a run of {self.count} processes, so that each "
                "device's rows come from one process"
            )


def _batch_axes(sharding: NamedSharding) -> tuple[str, ...]:
    first = sharding.spec[0] if len(sharding.spec) else None
    if first is None:
        return ()
    return (first,) if isinstance(first, str) else tuple(first)


def allgather(x) -> np.ndarray:
    """Every process's `x` stacked on a new leading axis, in process order."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def split_work(n: int, work, *, index=None, count=None, gather=allgather) -> np.ndarray:
    """`work(lo, hi)` (values for items `[lo, hi)`) on each process's contiguous 1/H share of
    `n` items; every process gets all `n` values, in item order. `index` / `count` default to
    this process's; `gather` is `allgather`'s stand-in for tests. Every process must call it."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if count == 1:
        return np.asarray(work(0, n))
    chunk = -(-n // count)
    lo, hi = min(n, index * chunk), min(n, (index + 1) * chunk)
    values = np.asarray(work(lo, hi))  # called on an empty share too: same dtype everywhere
    local = np.zeros(chunk, values.dtype)  # padding past `n`, cut below
    local[: hi - lo] = values
    return np.asarray(gather(local)).reshape(-1)[:n]


def gather_rows(x: np.ndarray, layout: RowLayout) -> np.ndarray:
    """This process's rows -> all rows of the batch, blocks in mesh order (host arrays)."""
    if layout.count == 1:
        return np.asarray(x)
    parts = allgather(x)
    return np.concatenate([parts[p] for p in layout.process_at])


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is set on any (e.g. a SIGTERM seen by one host)."""
    return bool(allgather(np.asarray(bool(flag))).any())


def combine_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Per-process host metrics -> one global figure each, the same on every process.

    Times (`*_s`, `*latency*`) take the slowest process (it gates the step); means and
    fractions (`*mean*`, `*frac*`, `*std*`) the mean over processes (each process holds the
    same number of rows); everything else is a count and is summed. Every process must report
    the same keys.
    """
    if jax.process_count() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    sig = allgather(np.asarray([len(keys), zlib.crc32("\n".join(keys).encode())], np.int64))
    if not (sig == sig[0]).all():
        raise DistributedError(
            "processes report different host metric keys; they must run the same config"
        )
    values = allgather(np.asarray([float(metrics[k]) for k in keys], np.float64))
    out = {}
    for i, k in enumerate(keys):
        col = values[:, i]
        if k.endswith("_s") or "latency" in k or "_s_" in k:
            out[k] = float(col.max())
        elif any(w in k for w in ("mean", "frac", "std")):
            out[k] = float(col.mean())
        else:
            out[k] = float(col.sum())
    return out


def put_rows(x: np.ndarray, layout: RowLayout) -> jax.Array:
    """This process's rows (block `layout.block`) -> the global array, sharded by rows."""
    global_shape = (x.shape[0] * layout.count, *x.shape[1:])
    if global_shape[0] % layout.rows:
        if layout.count == 1:  # too few rows to shard: replicate (the model code copes)
            return put_global(x, layout.sharding.mesh)
        raise DistributedError(
            f"{global_shape[0]} rows cannot be split over the {layout.rows} data-parallel "
            f"devices (mesh.data*mesh.fsdp) of {layout.count} processes; make "
            "config.rollout.prompts_per_step a multiple of the data-parallel size"
        )
    return jax.make_array_from_process_local_data(layout.sharding, np.asarray(x), global_shape)


def put_global(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array every process holds in full -> a replicated global array."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_process_local_data(replicated, np.asarray(x), np.shape(x))


def local_rows(x: jax.Array, layout: RowLayout) -> np.ndarray:
    """A global row-major array -> this process's block of rows as a host array."""
    if layout.count == 1:
        return np.asarray(x)
    x = jax.device_put(x, layout.sharding)  # a no-op when already laid out by rows
    n = x.shape[0]
    pieces = {s.index[0].indices(n)[0]: s.data for s in x.addressable_shards}
    return np.concatenate([np.asarray(pieces[k]) for k in sorted(pieces)])


class RowTransfer:
    """A batch's rows between this process's host and the global arrays on the mesh.

    Per-sequence arrays (`*_BxS`, `*_BxT`) hold this process's block of rows (`layout`);
    group-level arrays (`*_PxG`) are all-gathered and replicated, so every normalizer of the
    update is computed over the whole batch. With one process these are plain transfers.
    """

    def __init__(self, batch_sharding: NamedSharding):
        self.layout = RowLayout(batch_sharding)
        self.batch_sharding = batch_sharding
        self.replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())

    def put_batch(self, arrays: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's host arrays -> the global batch on the devices."""
        out = {}
        for k, v in arrays.items():
            if k.endswith(("_BxS", "_BxT")):
                out[k] = self.put_rows(v)
            elif k.endswith("_PxG"):
                out[k] = put_global(self.gather_rows(v), self.replicated.mesh)
            else:
                out[k] = put_global(v, self.replicated.mesh)
        return out

    def put_rows(self, x: np.ndarray) -> jax.Array:
        """This process's rows -> the global array sharded over the batch axes."""
        return put_rows(x, self.layout)

    def local_rows(self, x: jax.Array) -> np.ndarray:
        """A global row-sharded array -> this process's rows on the host."""
        return local_rows(x, self.layout)

    def gather_rows(self, x: np.ndarray) -> np.ndarray:
        """This process's rows of a host array -> every process's, in batch order."""
        return gather_rows(x, self.layout)

    def put_full(self, x: np.ndarray) -> jax.Array:
        """A whole batch every process holds (held-out prompts) -> the global array."""
        if self.layout.count == 1:
            return x
        per = x.shape[0] // self.layout.count
        return self.put_rows(x[self.layout.block * per : (self.layout.block + 1) * per])

    def pull_full(self, x: jax.Array) -> np.ndarray:
        """A global row-sharded array -> all of its rows on every process's host."""
        return self.gather_rows(self.local_rows(x))
