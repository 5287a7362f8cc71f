"""The one place where sharding is decided: the device mesh and logical-axis rules.

Model code names *logical* axes only (`vocab, embed, q_heads, kv_heads, mlp, layers, batch,
length`); the rules below map each to a mesh axis (`data, fsdp, seq, tensor`), a tuple of mesh
axes, or `None` (replicated). Rules are plain data (a dict), so a config can carry its own:

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    validate_model_sharding(cfg, mesh)                    # before any weight is touched
    shardings = param_shardings(abstract_params, mesh)    # tree of NamedSharding
    params = sharded_init(lambda rng: init_params(cfg, rng), rng, mesh)

Inside jit, `constrain(x, ("batch", "length", "embed"))` pins an activation's layout on the
context mesh (`jax.set_mesh(mesh)`); without a context mesh it is a no-op, so the same model
code runs unsharded.

Mapping a tuple of logical axes follows flax (`nn.logical_to_mesh_axes`): rules apply in
order and a mesh axis shards at most one dimension, so with the default rules activations
`("batch", "length", "embed")` become `P(("data", "fsdp"), None, None)` while the weight
`("embed", "mlp")` becomes `P(("fsdp", "seq"), "tensor")`: parameters are sharded over the
sequence shards as over fsdp (`param_shardings` leaves `seq` out where it has size 1, so
with seq = 1 that is `P("fsdp", "tensor")`). `use_rules` also installs the rules for
flax's `nn.with_logical_constraint`, which the model uses for its activations.

The `seq` axis (`mesh.seq`, context parallelism) shards the token axis of the update's and
the log-prob passes' activations: they run under `sequence_rules()` (`length -> seq`), and
attention across the shards is ring attention (`gjax.models.attention.ring`). Everything
else (rollouts, decoding) runs under the default rules, `length` unsharded: on a mesh with
seq > 1 the rollouts treat the seq devices as copies of their row shard.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "seq", "tensor")

LOGICAL_AXES = ("vocab", "embed", "q_heads", "kv_heads", "mlp", "layers", "batch", "length")

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "embed": ("fsdp", "seq"),  # params over fsdp x seq (ZeRO over the sequence shards too)
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,
}
# The update's and the log-prob passes' rules: the token axis over `seq` (`sequence_rules`).
SEQ_RULES: dict[str, MeshAxes] = {"length": "seq"}

# --------------------------------------------------------------------------------------------
# Mesh


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes `(data, fsdp, seq, tensor)`; axes left out of `shape` have size 1.

    One axis may be -1: it takes whatever the device count leaves. The product must equal the
    number of devices (all of `jax.devices()` unless `devices` is given).
    """
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axes {unknown}; valid axes: {list(MESH_AXES)}")
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(shape.get(name, 1)) for name in MESH_AXES]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got shape {dict(shape)}")
    bad = [f"{n}={s}" for n, s in zip(MESH_AXES, sizes) if s <= 0 and s != -1]
    if bad:
        raise ValueError(f"mesh axis sizes must be positive (or one -1), got {bad}")
    if fill:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devices) % rest:
            raise ValueError(
                f"mesh shape {dict(shape)}: the fixed axes (product {rest}) do not divide the "
                f"{len(devices)} devices"
            )
        sizes[fill[0]] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh shape {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but "
            f"{len(devices)} are available; make the product of the axis sizes equal "
            f"{len(devices)}"
        )
    device_array = device_grid(sizes, devices)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(sizes: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    """`devices` laid out as an array of shape `sizes` (axes `data, fsdp, seq, tensor`,
    ordered by increasing traffic), following the interconnect where there is one to follow.

    - CPU: the order given (fake host devices have no topology; tests rely on the order).
    - One TPU slice (or GPUs): `mesh_utils.create_device_mesh`, which maps the axes onto the
      ICI torus, the busiest (`tensor`) first, splitting a physical axis only when no exact
      mapping exists.
    - Several slices (devices carry distinct `slice_index`es): `create_hybrid_device_mesh`;
      the slices, joined by the slower DCN, split the outermost axis they divide (`data`, else
      `fsdp`), as MaxText's `dcn_data_parallelism` does; each slice's part follows its torus.

    A multi-process run also needs each process's devices to hold one contiguous block of the
    batch rows (`multihost.RowLayout`). Where the torus order breaks that (a host's chips are
    a 2x2 tile, not a run of the flattened torus), the hosts become the outer granules
    instead: each host's devices follow its own ICI, hosts are laid out in process order.
    """
    sizes = [int(s) for s in sizes]
    devices = list(devices)
    if devices[0].platform == "cpu":
        return np.asarray(devices, dtype=object).reshape(sizes)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:
        dcn = _outer_split(sizes, len(slices), "slices")
        grid = _follow_links(
            mesh_utils.create_hybrid_device_mesh,
            [s // k for s, k in zip(sizes, dcn)],
            dcn,
            devices,
        )
    else:
        grid = _follow_links(mesh_utils.create_device_mesh, sizes, devices)
    processes = {d.process_index for d in devices}
    if len(processes) > 1 and (grid is None or not _rows_per_process_contiguous(grid)):
        grid = _host_major_grid(sizes, devices, len(processes))
    if grid is None:
        log.warning("the mesh %s does not follow the interconnect; using device order", sizes)
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return grid


def _follow_links(create: Callable[..., np.ndarray], *args, **kwargs) -> np.ndarray | None:
    """`create(*args)` (a `mesh_utils` constructor), or None where the devices do not form a
    whole torus (a subset with holes: `AssertionError`, or no mapping: `NotImplementedError`)."""
    try:
        return create(*args, allow_split_physical_axes=True, **kwargs)
    except (AssertionError, NotImplementedError) as e:
        log.info("mesh_utils.%s: %s", create.__name__, e)
        return None


def _host_major_grid(sizes: list[int], devices: list[Any], n: int) -> np.ndarray | None:
    """Hosts as the outer granules (in process order), each host's devices on its own ICI;
    None where that cannot give each host a contiguous block of rows."""
    try:
        hosts = _outer_split(sizes, n, "processes")
    except ValueError:  # device order; multihost.RowLayout says what to change if it fails
        return None
    grid = _follow_links(
        mesh_utils.create_hybrid_device_mesh,
        [s // k for s, k in zip(sizes, hosts)],
        hosts,
        devices,
        process_is_granule=True,
    )
    return grid if grid is not None and _rows_per_process_contiguous(grid) else None


def _outer_split(sizes: Sequence[int], n: int, what: str) -> list[int]:
    """How `n` granules (slices, hosts) split the axes: the whole of `data` if `n` divides
    it, else `data` fully and the rest of `n` on `fsdp`; never `tensor` (the busiest axis).
    Keeps each granule's share of the batch rows (`data x fsdp`, row-major) contiguous."""
    data, fsdp = sizes[:2]
    rest = [1] * (len(sizes) - 2)
    if data % n == 0:
        return [n, 1, *rest]
    if n % data == 0 and fsdp % (n // data) == 0:
        return [data, n // data, *rest]
    raise ValueError(
        f"the mesh {dict(zip(MESH_AXES, sizes))} cannot be split over {n} {what}: make "
        f"mesh.data a multiple of {n}, or mesh.data a divisor of {n} and mesh.fsdp a "
        f"multiple of the rest (the seq and tensor axes stay within one of the {what})"
    )


def _rows_per_process_contiguous(grid: np.ndarray) -> bool:
    """Each batch row (a `data, fsdp` position) on one process, each process's rows a run."""
    rows = grid.reshape(grid.shape[0] * grid.shape[1], -1)
    owner = []
    for row in rows:
        procs = {d.process_index for d in row}
        if len(procs) != 1:
            return False
        owner.append(procs.pop())
    runs = [p for i, p in enumerate(owner) if i == 0 or owner[i - 1] != p]
    return len(runs) == len(set(runs))


def make_meshes(
    shape: Mapping[str, int], rollout_devices: int = 0, devices: Sequence[jax.Device] | None = None
) -> tuple[Mesh, Mesh]:
    """(train mesh, rollout mesh): one mesh for both (collocated) or disjoint device sets.

    With `rollout_devices = n > 0` each of the H processes gives its last n / H devices to
    rollouts and the rest to the train mesh of `shape`. The rollout mesh is this process's
    rollout devices (one process: the last n); its `tensor` axis is the train mesh's (so a
    weight push reshards only over data-parallel copies) and its `data` axis takes the rest
    (rollouts want whole replicas, not FSDP shards). Weight pushes are `jax.device_put`s from
    one to the other; within a host they move device to device.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not rollout_devices:
        mesh = make_mesh(shape, None if devices == list(jax.devices()) else devices)
        return mesh, mesh
    hosts = sorted({d.process_index for d in devices})
    local = {h: [d for d in devices if d.process_index == h] for h in hosts}
    per = rollout_devices // len(hosts)
    if per * len(hosts) != rollout_devices or not all(0 < per < len(v) for v in local.values()):
        raise ValueError(
            f"rollout_devices={rollout_devices} must leave devices for training on each of "
            f"the {len(hosts)} processes and split evenly over them "
            f"(0 < rollout_devices / {len(hosts)} < {min(len(v) for v in local.values())})"
        )
    rollout = {d for v in local.values() for d in v[-per:]}
    train = make_mesh(shape, [d for d in devices if d not in rollout])
    rollout_shape = {"data": -1, "tensor": int(train.shape["tensor"])}
    return train, make_mesh(rollout_shape, local[jax.process_index()][-per:])


def process_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of `mesh` as a mesh of their own: the sub-grid they form (a
    process holds a contiguous block of batch rows, `multihost.RowLayout`, so a block of
    `data` x `fsdp` positions), same axes, same order. An axis the processes do not split
    keeps its size, so a param sharded over it has the same shard on each device as in
    `mesh`."""
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
    n = len(MESH_AXES)
    index = [np.flatnonzero(mine.any(axis=tuple(a for a in range(n) if a != i))) for i in range(n)]
    block = np.ix_(*index)
    if not mine[block].all():
        raise ValueError(f"this process's devices of the mesh {dict(mesh.shape)} are no block")
    grid = mesh.devices[block]
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _blocks(grid: np.ndarray, local_shape: Sequence[int]) -> np.ndarray:
    """`grid` cut into aligned blocks of `local_shape`: [blocks, *local_shape], the blocks in
    row-major order of their positions, each block's entries in grid order."""
    outer = [n // k for n, k in zip(grid.shape, local_shape)]
    split = grid.reshape([x for f, k in zip(outer, local_shape) for x in (f, k)])
    ndim = len(outer)
    split = split.transpose([2 * i for i in range(ndim)] + [2 * i + 1 for i in range(ndim)])
    return split.reshape(-1, *local_shape)


def process_blocks(owner: np.ndarray, local_shape: Sequence[int]) -> tuple[int, ...] | None:
    """How many processes split each mesh axis (1: not split), from `owner` (each mesh
    position's process index) and one process's block shape; None unless every process holds
    one aligned block of that shape, so that each split axis of size n factors into
    (n / local, local) with each process's devices at one outer position."""
    if any(n % k for n, k in zip(owner.shape, local_shape)):
        return None
    blocks = _blocks(owner, local_shape).reshape(
        math.prod(owner.shape) // math.prod(local_shape), -1
    )
    one_owner = (blocks == blocks[:, :1]).all()
    if not one_owner or len(set(blocks[:, 0].tolist())) != len(blocks):
        return None
    return tuple(n // k for n, k in zip(owner.shape, local_shape))


def host_factored_mesh(mesh: Mesh, outer: Sequence[int]) -> Mesh:
    """`mesh`'s devices, same order, with each split axis `a` factored into `a_procs` (the
    processes, outer) and `a` (the local part): a PartitionSpec of `mesh` on this mesh shards
    over each process's own devices only and is replicated over the processes."""
    names, shape = [], []
    for axis, f in zip(MESH_AXES, outer):
        if f > 1:
            names.append(f"{axis}_procs")
            shape.append(f)
        names.append(axis)
        shape.append(mesh.shape[axis] // f)
    grid = mesh.devices.reshape(shape)
    return Mesh(grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))


@functools.lru_cache(maxsize=256)
def _identity_to(target: NamedSharding) -> Callable[[Any], Any]:
    return jax.jit(lambda a: a, out_shardings=target)


_warned: set[tuple] = set()


def process_local_copy(train_mesh, local_mesh) -> Callable[[Any], Any]:
    """Params of a multi-process run -> arrays of `local_mesh` (this process's devices of the
    train mesh, `process_mesh`) with the train mesh's PartitionSpecs, so that a process-local
    sampler (the async producer's thread, the continuous decoder) runs no program over other
    processes' devices and samples with the train layout. A param sharded over an axis the
    processes split (e.g. `fsdp` over hosts) stays sharded over this process's part of it:
    each device holds 1 / local size of it, never the whole param; the copy is one all-gather
    over the processes (`host_factored_mesh`). Where the processes' blocks do not factor the
    mesh, such params are replicated on every local device instead (a warning says so).
    Called on the loop's thread, where the copy is a program in the loop's order like every
    other."""
    split = {a for a in MESH_AXES if local_mesh.shape[a] != train_mesh.shape[a]}
    owner = np.vectorize(lambda d: d.process_index)(train_mesh.devices)
    outer = process_blocks(owner, [local_mesh.shape[a] for a in MESH_AXES]) if split else None
    factored = None
    if outer is not None:
        factored = host_factored_mesh(train_mesh, outer)
        blocks = _blocks(train_mesh.devices, local_mesh.devices.shape)
        if not any(np.array_equal(b, local_mesh.devices) for b in blocks):  # every process
            raise ValueError(f"{local_mesh} is not a block of {train_mesh} (`process_mesh`)")
    if split and factored is None:
        key = (tuple(train_mesh.shape.items()), tuple(local_mesh.shape.items()))
        if key not in _warned:
            _warned.add(key)
            log.warning(
                "the processes' devices do not factor the mesh %s into equal blocks: params "
                "sharded over %s are replicated on each process's devices for rollouts "
                "(more memory per device)",
                dict(train_mesh.shape),
                sorted(split),
            )

    def kept(entry):  # one PartitionSpec entry without the axes split over processes
        axes = [a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in split]
        return None if not axes or axes == [None] else axes[0] if len(axes) == 1 else tuple(axes)

    def copy(x):
        spec = x.sharding.spec
        local_spec = P(*(kept(e) for e in spec))
        if local_spec == spec:  # a copy: the next update donates the learner's buffers
            y = jax.numpy.copy(x)
        elif factored is not None:  # sharded over this process's part of the split axes
            y, local_spec = _identity_to(NamedSharding(factored, spec))(x), spec
        else:  # replicated over the split axes: gathered over the processes
            y = _identity_to(NamedSharding(train_mesh, local_spec))(x)
        shards = [s.data for s in y.addressable_shards]  # the same blocks on the same devices
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(local_mesh, local_spec), shards
        )

    return lambda params: jax.tree.map(copy, params)


def mesh_axis_size(mesh: Mesh | jax.sharding.AbstractMesh, axes: MeshAxes) -> int:
    """Product of the sizes of `axes` in `mesh` (1 for None)."""
    return math.prod(mesh.shape[a] for a in _as_tuple(axes))


# --------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec

_local = threading.local()


@contextlib.contextmanager
def use_rules(rules: Rules | None = None) -> Iterator[None]:
    """Makes `rules` (default: `DEFAULT_RULES`) current for this context.

    Covers gjax's own helpers (`constrain`, `logical_to_spec`, ...) and flax's
    `nn.with_logical_constraint` inside the model. Combine with `jax.set_mesh(mesh)`.
    """
    checked = check_rules(DEFAULT_RULES if rules is None else rules)
    previous = getattr(_local, "rules", None)
    _local.rules = checked
    try:
        with nn.logical_axis_rules(tuple(checked.items())):
            yield
    finally:
        _local.rules = previous


def current_rules() -> dict[str, MeshAxes]:
    return getattr(_local, "rules", None) or DEFAULT_RULES


def sequence_rules(rules: Rules | None = None) -> dict[str, MeshAxes]:
    """`rules` (default: the current ones) with the token axis over `seq` (`SEQ_RULES`): the
    rules the update and the log-prob passes trace under (module docstring)."""
    return {**check_rules(current_rules() if rules is None else rules), **SEQ_RULES}


def sequence_shards(length: int | None = None) -> int:
    """How many shards the current rules cut the token axis (`length`) into on the context
    mesh: 1 without a mesh or where it stays whole; with `length`, also 1 where the shards do
    not divide it (as `constrain` drops them)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    n = mesh_axis_size(mesh, current_rules().get("length"))
    return 1 if length is not None and length % n else n


def check_rules(rules: Rules) -> dict[str, MeshAxes]:
    """Validates a rules mapping (known logical and mesh axis names) and returns it as a dict."""
    if not isinstance(rules, Mapping):
        rules = dict(rules)  # a sequence of (logical, mesh) pairs
    out: dict[str, MeshAxes] = {}
    for logical, target in rules.items():
        for axis in _as_tuple(target):
            if axis not in MESH_AXES:
                raise ValueError(
                    f"sharding rule {logical!r} -> {target!r} names unknown mesh axis {axis!r}; "
                    f"valid mesh axes: {list(MESH_AXES)}"
                )
        out[logical] = tuple(target) if isinstance(target, list) else target
    return out


def flax_rules(rules: Rules | None = None) -> tuple[tuple[str, MeshAxes], ...]:
    """The rules as flax's `(logical, mesh_axes)` pairs (for `nn.logical_axis_rules`)."""
    rules = current_rules() if rules is None else rules
    return tuple(check_rules(rules).items())


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules | None = None,
    *,
    mesh: Mesh | jax.sharding.AbstractMesh | None = None,
    shape: Sequence[int] | None = None,
    drop_indivisible: bool = False,
) -> P:
    """Maps logical axis names to a `PartitionSpec` (flax's semantics, plus strictness).

    Rules apply in their order: a logical axis takes its rule's mesh axes unless one of them
    is already taken by another dimension of the same array, in which case that dimension is
    replicated. An unknown logical name is an error listing the known ones. With `mesh`,
    `shape` and `drop_indivisible=True`, a dimension whose mesh axes do not divide it is
    replicated instead (activations, whose sizes vary); for parameters divisibility is
    checked, not patched (see `param_shardings`).
    """
    rules = current_rules() if rules is None else rules
    for name in logical_axes:
        if name is not None and name not in rules:
            raise KeyError(
                f"no sharding rule for logical axis {name!r}; rules cover {sorted(rules)}"
            )
    spec = list(nn.logical_to_mesh_axes(tuple(logical_axes), flax_rules(rules)))
    if drop_indivisible and mesh is not None and shape is not None:
        spec = [
            axes if shape[dim] % mesh_axis_size(mesh, axes) == 0 else None
            for dim, axes in enumerate(spec)
        ]
    return P(*spec)


# --------------------------------------------------------------------------------------------
# Parameters

# Logical axes of each parameter of the per-layer block (without the leading `layers` axis)
# and of the top-level tensors; the layout is the contract in docs/architecture.md.
_LAYER_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("input_norm", "scale"): ("embed",),
    ("post_attn_norm", "scale"): ("embed",),
    ("attn", "q", "kernel"): ("embed", "q_heads"),
    ("attn", "q", "bias"): ("q_heads",),
    ("attn", "k", "kernel"): ("embed", "kv_heads"),
    ("attn", "k", "bias"): ("kv_heads",),
    ("attn", "v", "kernel"): ("embed", "kv_heads"),
    ("attn", "v", "bias"): ("kv_heads",),
    ("attn", "o", "kernel"): ("q_heads", "embed"),
    ("attn", "o", "bias"): ("embed",),  # Llama / Qwen3 attention_bias only
    ("attn", "q_norm", "scale"): (None,),  # Qwen3: per-head norms over Dh, replicated
    ("attn", "k_norm", "scale"): (None,),
    ("mlp", "gate", "kernel"): ("embed", "mlp"),
    ("mlp", "up", "kernel"): ("embed", "mlp"),
    ("mlp", "down", "kernel"): ("mlp", "embed"),
}
_TOP_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("final_norm", "scale"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}


def logical_axes_for_path(path: Sequence[str]) -> tuple[str | None, ...]:
    """Logical axes of the parameter at `path` (e.g. `("layers", "attn", "q", "kernel")`)."""
    path = tuple(path)
    if path in _TOP_AXES:
        return _TOP_AXES[path]
    if path[:1] == ("layers",) and path[1:] in _LAYER_AXES:
        return ("layers", *_LAYER_AXES[path[1:]])
    kernel = _LAYER_AXES.get((*path[1:-1], "kernel")) if path[:1] == ("layers",) else None
    if kernel is not None and path[-1] == "kernel_scale":  # QLoRA: [L, blocks, out]
        return ("layers", None, kernel[1])
    if kernel is not None and path[-1] == "lora_a":  # LoRA A [in, r]: sharded as W's rows
        return ("layers", kernel[0], None)
    if kernel is not None and path[-1] == "lora_b":  # LoRA B [r, out]: as W's columns
        return ("layers", None, kernel[1])
    known = sorted("/".join(p) for p in _TOP_AXES) + sorted(
        "layers/" + "/".join(p) for p in _LAYER_AXES
    )
    raise KeyError(
        f"parameter {'/'.join(path)!r} is not in the gjax param layout "
        f"(docs/architecture.md); known parameters: {known}"
    )


def path_str(path) -> str:
    return "/".join(_key_name(k) for k in path)


def param_logical_axes(params: Any) -> Any:
    """Tree of logical-axis tuples, same structure as `params`.

    Leaves boxed by flax's logical partitioning (`nn.LogicallyPartitioned`) use their own
    names; plain arrays (or `ShapeDtypeStruct`s) are looked up by path.
    """

    def axes(path, leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            names = tuple(leaf.names)
            shape = np.shape(leaf.value)
        else:
            names = logical_axes_for_path([_key_name(k) for k in path])
            shape = leaf.shape
        if len(names) != len(shape):
            raise ValueError(
                f"parameter {path_str(path)!r} has shape {tuple(shape)} but logical axes "
                f"{names} (rank mismatch)"
            )
        return _Axes(names)

    tree = jax.tree_util.tree_map_with_path(
        axes, params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    return jax.tree.map(lambda a: a.names, tree, is_leaf=lambda x: isinstance(x, _Axes))


def param_shardings(params: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Tree of `NamedSharding` for `params` (arrays, `ShapeDtypeStruct`s or boxed leaves).

    Every dimension must be divisible by the mesh axes its logical axis maps to; all
    violations are reported at once, naming the tensor, the dimension and the mesh axis.
    """
    rules = check_rules(current_rules() if rules is None else rules)
    unboxed = nn.unbox(params) if _has_boxes(params) else params
    logical = param_logical_axes(params)
    problems: list[str] = []

    def sharding(path, leaf, names):
        spec = _without_unit_axes(logical_to_spec(names, rules), mesh)
        for dim, (axes, size) in enumerate(zip(spec, leaf.shape)):
            n = mesh_axis_size(mesh, axes)
            if size % n:
                problems.append(
                    f"{path_str(path)}: dim {dim} (size {size}, logical axis {names[dim]!r}) "
                    f"is not divisible by mesh axis {axes!r} (size {n})"
                )
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(
        sharding, unboxed, logical, is_leaf=lambda x: isinstance(x, tuple)
    )
    if problems:
        raise ValueError(
            "mesh does not divide these parameters (change the mesh shape or the rules):\n  "
            + "\n  ".join(problems)
        )
    return out


# ModelConfig field behind each logical axis, checked against the mesh before any weight
# is loaded or initialized.
_AXIS_FIELDS = {
    "vocab": ("vocab_size",),
    "embed": ("hidden_size",),
    "q_heads": ("num_heads",),
    "kv_heads": ("num_kv_heads",),
    "mlp": ("intermediate_size",),
    "layers": ("num_layers",),
}


def _without_unit_axes(spec: P, mesh) -> P:
    """`spec` without `seq` where it has size 1 (the same layout, spelled as before the seq
    axis existed: params' specs on a mesh without sequence shards stay as they were)."""

    def entry(e):
        axes = tuple(a for a in _as_tuple(e) if a != "seq" or mesh.shape[a] > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return P(*(entry(e) for e in spec))


def validate_model_sharding(cfg, mesh: Mesh, rules: Rules | None = None) -> None:
    """Raises if the mesh does not divide a model dimension, naming the config field and axis.

    Heads are checked as head counts (sharding `H*Dh` columns across a head boundary would be
    legal for the array but wrong for attention).
    """
    rules = check_rules(current_rules() if rules is None else rules)
    problems = []
    for logical, fields in _AXIS_FIELDS.items():
        axes = rules.get(logical)
        n = mesh_axis_size(mesh, axes)
        for field in fields:
            value = getattr(cfg, field)
            if value % n:
                problems.append(
                    f"ModelConfig.{field}={value} is not divisible by mesh axis {axes!r} "
                    f"(size {n}) that logical axis {logical!r} maps to"
                )
    if problems:
        raise ValueError(
            "mesh "
            + str(dict(mesh.shape))
            + " does not fit the model (change the mesh shape or the rules):\n  "
            + "\n  ".join(problems)
        )


def shard_params(params: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Places existing (e.g. host) params on `mesh` as the rules say."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def sharded_init(
    init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh, rules: Rules | None = None
) -> Any:
    """Runs `init_fn(rng)` under jit with sharded outputs: no full copy on one device first."""
    abstract = jax.eval_shape(init_fn, rng)
    shardings = param_shardings(abstract, mesh, rules)
    return jax.jit(init_fn, out_shardings=shardings)(rng)


# --------------------------------------------------------------------------------------------
# Activations


def activation_sharding(
    mesh: Mesh, logical_axes: Sequence[str | None], rules: Rules | None = None, shape=None
) -> NamedSharding:
    """`NamedSharding` for an activation (e.g. jit in/out shardings of a token batch).

    With `shape`, mesh axes that do not divide their dimension are dropped.
    """
    spec = logical_to_spec(
        logical_axes, rules, mesh=mesh, shape=shape, drop_indivisible=shape is not None
    )
    return NamedSharding(mesh, spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules | None = None):
    """`with_sharding_constraint` by logical axes on the context mesh; no-op without one.

    Mesh axes that do not divide a dimension are dropped (e.g. a batch of 1 while decoding).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {x.shape}")
    spec = logical_to_spec(logical_axes, rules, mesh=mesh, shape=x.shape, drop_indivisible=True)
    return jax.lax.with_sharding_constraint(x, spec)


# --------------------------------------------------------------------------------------------
# Helpers


class _Axes:
    """Opaque leaf wrapper so tuples of axis names survive tree_map as single leaves."""

    __slots__ = ("names",)

    def __init__(self, names):
        self.names = names


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _has_boxes(tree) -> bool:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    return any(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)
