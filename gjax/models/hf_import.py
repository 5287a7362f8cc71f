"""Hugging Face checkpoints in: safetensors -> the gjax param tree, plus config and tokenizer.

    cfg, params = load_pretrained("/ckpt/Qwen2.5-Math-1.5B", mesh=mesh)  # or gs://..., hub id
    tokenizer = load_tokenizer("/ckpt/Qwen2.5-Math-1.5B")

Loading streams straight into (sharded) device arrays: the safetensors files are
memory-mapped and, param by param and device by device, only that device's slice is read
(only the pages under it), transposed from HF's `[out, in]` to our `[in, out]`, stacked over
layers for the scanned `L` axis, cast to the param dtype and put on its device before the
next slice is read. Host memory peaks at one device shard; no host copy of the model. Before
a single weight is read, the checkpoint is checked against the config (missing, unexpected
and mis-shaped tensors, all listed at once) and the mesh against the model dimensions.
The HF name map is `gjax.models.hf_format`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from gjax import sharding as sharding_lib
from gjax.models import attention
from gjax.models.config import ModelConfig
from gjax.models.hf_format import (
    _ST_DTYPES,
    INDEX_FILE,
    SINGLE_FILE,
    Params,
    _Entry,
    _hf_entries,
    _path_tuple,
    param_shapes,
    resolve_dir,
)

# Tensors some checkpoints carry that the model does not use (recomputed RoPE tables).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


# --------------------------------------------------------------------------------------------
# safetensors, read through a memory map (any dtype, including bf16)


class SafetensorsFile:
    """A memory-mapped `.safetensors` file: `tensor(name)` is a lazy numpy view.

    Slicing the view reads only the pages under the slice, so a device shard costs its own
    bytes, not the whole tensor's.
    """

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(header_len))
            except ValueError as e:
                raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + header_len
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            code = info["dtype"]
            if code not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {code}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            dtype = _ST_DTYPES[code]
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{path}: tensor {name!r} byte range does not match its shape")
            self.tensors[name] = (dtype, shape, begin, end)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def tensor(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self.tensors[name]
        raw = self._map[self._start + begin : self._start + end]
        return raw.view(dtype).reshape(shape)


# --------------------------------------------------------------------------------------------
# Checkpoint directory


class Checkpoint:
    """The safetensors tensors of a local checkpoint dir, by name (single file or sharded)."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path} has no 'weight_map'")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
            weight_map = None
        if not files:
            present = sorted(os.listdir(directory))
            raise FileNotFoundError(
                f"no safetensors weights in {directory} (found {present}); gjax reads "
                f"{SINGLE_FILE} or sharded files with {INDEX_FILE}"
            )
        missing_files = [n for n in files if not os.path.exists(os.path.join(directory, n))]
        if missing_files:
            raise FileNotFoundError(
                f"{INDEX_FILE} in {directory} lists shard files that do not exist: {missing_files}"
            )
        self.files = {n: SafetensorsFile(os.path.join(directory, n)) for n in files}
        self.location: dict[str, SafetensorsFile] = {}
        duplicated = []
        for st in self.files.values():
            for name in st.tensors:
                if name in self.location:
                    duplicated.append(name)
                self.location[name] = st
        if duplicated:
            raise ValueError(f"tensors stored in more than one file in {directory}: {duplicated}")
        if weight_map is not None:
            wrong = sorted(
                name
                for name, n in weight_map.items()
                if name not in self.location or self.location[name].path != self.files[n].path
            )
            if wrong:
                raise ValueError(
                    f"{INDEX_FILE} in {directory} maps tensors to files that do not hold "
                    f"them: {wrong}"
                )

    def names(self) -> list[str]:
        return sorted(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.location[name].shape(name)

    def tensor(self, name: str) -> np.ndarray:
        return self.location[name].tensor(name)


def check_checkpoint(ckpt: Checkpoint, cfg: ModelConfig) -> None:
    """Raises one error listing every missing, unexpected and mis-shaped tensor."""
    expected = {e.name: e.hf_shape for e in _hf_entries(cfg)}
    present = set(ckpt.names())
    missing = sorted(set(expected) - present)
    unexpected = sorted(
        n
        for n in present - set(expected)
        if not _IGNORED.match(n) and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    misshaped = [
        f"{n}: checkpoint {ckpt.shape(n)}, config expects {expected[n]}"
        for n in sorted(present & set(expected))
        if tuple(ckpt.shape(n)) != expected[n]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}):\n    " + "\n    ".join(misshaped))
    if problems:
        raise ValueError(
            f"checkpoint {ckpt.directory} does not match its config "
            f"(model_type={cfg.model_type!r}, {cfg.num_layers} layers, "
            f"tie_word_embeddings={cfg.tie_word_embeddings}, "
            f"attention_bias={cfg.attention_bias}); nothing was loaded:\n  " + "\n  ".join(problems)
        )


# --------------------------------------------------------------------------------------------
# Loading


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def load_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """`ModelConfig` from a checkpoint dir (local, gs:// or hub id)."""
    return ModelConfig.from_pretrained_dir(resolve_dir(path), **overrides)


def load_policy(path: str, model_cfg, mesh: jax.sharding.Mesh):
    """`(cfg, params, tokenizer)` of a run's policy: `path` loaded as `config.model` asks
    (param dtype, compute dtype, remat, attention), sharded on `mesh`. What train and serve
    both load. An attention implementation the mesh's platform (or the compute dtype) cannot
    run is a ConfigError."""
    attention.resolve(
        model_cfg.get("attention", "auto"), mesh.devices.flat[0].platform, model_cfg.dtype
    )
    cfg, params = load_pretrained(
        path,
        mesh=mesh,
        param_dtype=model_cfg.param_dtype,
        dtype=model_cfg.dtype,
        remat=model_cfg.remat,
        attention=model_cfg.get("attention", "auto"),
    )
    return cfg, params, load_tokenizer(path)


def load_pretrained(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding_lib.Rules | None = None,
    param_dtype=None,
    **cfg_overrides,
) -> tuple[ModelConfig, Params]:
    """Loads an HF `Qwen2ForCausalLM` / `LlamaForCausalLM` / `Qwen3ForCausalLM` checkpoint.

    Args:
      path: checkpoint dir: local, `gs://...` (copied to `cache_dir()` first) or a hub id.
      mesh: place params sharded on this mesh by `rules` (default `DEFAULT_RULES`); without
        a mesh they go to the first device.
      param_dtype: dtype of the loaded params (e.g. "bfloat16"); default `cfg.param_dtype`.
      **cfg_overrides: `ModelConfig` fields to override (e.g. `dtype="bfloat16"`, `remat=`).

    The checkpoint and mesh are validated before any weight is read; tensors then stream one
    at a time, each device reading only its own slice.
    """
    local = resolve_dir(path)
    cfg = ModelConfig.from_pretrained_dir(local, **cfg_overrides)
    if param_dtype is not None:
        cfg = cfg.replace(param_dtype=_dtype_name(param_dtype))
    dtype = np.dtype(cfg.jnp_param_dtype)
    shapes = param_shapes(cfg)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    if mesh is not None:
        sharding_lib.validate_model_sharding(cfg, mesh, rules)
        shardings = sharding_lib.param_shardings(abstract, mesh, rules)
    else:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    ckpt = Checkpoint(local)
    check_checkpoint(ckpt, cfg)

    by_path: dict[tuple[str, ...], list[_Entry]] = {}
    for e in _hf_entries(cfg):
        by_path.setdefault(e.path, []).append(e)

    def load_leaf(path, leaf, sharding):
        entries = by_path[_path_tuple(path)]
        return _assemble(leaf.shape, sharding, lambda i: _read_slice(ckpt, entries, i, dtype))

    params = jax.tree_util.tree_map_with_path(load_leaf, abstract, shardings)
    return cfg, params


def _assemble(shape, sharding, read) -> jax.Array:
    """A global array built shard by shard: each distinct slice is read once, put on its
    device, and dropped from the host before the next is read (devices holding a replica
    get a device-to-device copy), so host memory peaks at one shard."""
    placed: dict[tuple, jax.Array] = {}
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(sl.indices(n) for sl, n in zip(index, shape))
        if key in placed:
            shards.append(jax.device_put(placed[key], device))
        else:
            placed[key] = jax.device_put(read(index), device)
            shards.append(placed[key])
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _read_slice(ckpt: Checkpoint, entries: list[_Entry], index: tuple, dtype) -> np.ndarray:
    """The `index` slice of one param leaf, read from its HF tensor(s)."""
    if entries[0].layer is None:
        (e,) = entries
        return _read_hf(ckpt, e, index, dtype)
    layers = range(len(entries))[index[0]]
    pieces = [_read_hf(ckpt, entries[layer], index[1:], dtype) for layer in layers]
    return np.stack(pieces, axis=0)


def _read_hf(ckpt: Checkpoint, e: _Entry, index: tuple, dtype) -> np.ndarray:
    view = ckpt.tensor(e.name)
    piece = view[tuple(reversed(index))].T if e.transpose else view[tuple(index)]
    # Always a fresh C-ordered copy: a device array must never alias the file's memory map
    # (CPU device_put can be zero-copy, and the file may be overwritten by a later export).
    return np.array(piece, dtype=dtype, order="C", copy=True)


# --------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """`transformers.AutoTokenizer` from a checkpoint/tokenizer dir (local, gs:// or hub id)."""
    from transformers import AutoTokenizer  # deferred: a slow import, only for the tokenizer

    return AutoTokenizer.from_pretrained(resolve_dir(path), **kwargs)


__all__ = [
    "Checkpoint",
    "SafetensorsFile",
    "check_checkpoint",
    "load_config",
    "load_policy",
    "load_pretrained",
    "load_tokenizer",
]
