"""Hugging Face checkpoints in and out: safetensors <-> the gjax param tree, plus tokenizers.

    cfg, params = load_pretrained("/ckpt/Qwen2.5-Math-1.5B", mesh=mesh)  # or gs://..., hub id
    save_pretrained(params, cfg, "/out/step_1000", tokenizer="/ckpt/Qwen2.5-Math-1.5B")
    tokenizer = load_tokenizer("/ckpt/Qwen2.5-Math-1.5B")

Loading streams straight into (sharded) device arrays: the safetensors files are
memory-mapped and, param by param and device by device, only that device's slice is read
(only the pages under it), transposed from HF's `[out, in]` to our `[in, out]`, stacked over
layers for the scanned `L` axis, cast to the param dtype and put on its device before the
next slice is read. Host memory peaks at one device shard; no host copy of the model. Before a single weight is read, the checkpoint
is checked against the config (missing, unexpected and mis-shaped tensors, all listed at once)
and the mesh against the model dimensions.

Saving is the reverse: one HF tensor at a time is gathered to the host (per layer for the
stacked params) and streamed into safetensors shards of at most `max_shard_size` bytes, with
`model.safetensors.index.json` when there is more than one shard; process 0 writes.

HF name map (`model.layers.{l}.` prefix for per-layer tensors):

    embed/embedding           model.embed_tokens.weight           [V, D]
    layers/input_norm/scale   input_layernorm.weight              [D]
    layers/attn/{q,k,v}/kernel self_attn.{q,k,v}_proj.weight      [out, in] -> transposed
    layers/attn/{q,k,v}/bias  self_attn.{q,k,v}_proj.bias         (attention_bias only)
    layers/attn/o/kernel      self_attn.o_proj.weight             transposed
    layers/attn/o/bias        self_attn.o_proj.bias               (Llama attention_bias only)
    layers/post_attn_norm/scale post_attention_layernorm.weight
    layers/mlp/{gate,up,down}/kernel mlp.{gate,up,down}_proj.weight transposed
    final_norm/scale          model.norm.weight
    lm_head/kernel            lm_head.weight                      transposed; absent when tied
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from gjax import sharding as sharding_lib
from gjax.models.config import ModelConfig

Params = dict[str, Any]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_CHECKPOINT_FILES = ("config.json", "generation_config.json", INDEX_FILE)

# (our path inside one layer) -> (HF name after "model.layers.{l}.", transpose)
_LAYER_NAMES: dict[tuple[str, ...], tuple[str, bool]] = {
    ("input_norm", "scale"): ("input_layernorm.weight", False),
    ("attn", "q", "kernel"): ("self_attn.q_proj.weight", True),
    ("attn", "q", "bias"): ("self_attn.q_proj.bias", False),
    ("attn", "k", "kernel"): ("self_attn.k_proj.weight", True),
    ("attn", "k", "bias"): ("self_attn.k_proj.bias", False),
    ("attn", "v", "kernel"): ("self_attn.v_proj.weight", True),
    ("attn", "v", "bias"): ("self_attn.v_proj.bias", False),
    ("attn", "o", "kernel"): ("self_attn.o_proj.weight", True),
    ("attn", "o", "bias"): ("self_attn.o_proj.bias", False),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", True),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", True),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", True),
}
_TOP_NAMES: dict[tuple[str, ...], tuple[str, bool]] = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("lm_head", "kernel"): ("lm_head.weight", True),
}
# Tensors some checkpoints carry that the model does not use (recomputed RoPE tables).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


# --------------------------------------------------------------------------------------------
# The param layout and its HF names


def param_shapes(cfg: ModelConfig) -> Params:
    """The gjax param tree for `cfg` as shape tuples (docs/architecture.md)."""
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn: dict[str, Any] = {
        "q": {"kernel": (n, d, q)},
        "k": {"kernel": (n, d, kv)},
        "v": {"kernel": (n, d, kv)},
        "o": {"kernel": (n, q, d)},
    }
    if cfg.attention_bias:
        attn["q"]["bias"] = (n, q)
        attn["k"]["bias"] = (n, kv)
        attn["v"]["bias"] = (n, kv)
    if cfg.o_bias:
        attn["o"]["bias"] = (n, d)
    shapes: Params = {
        "embed": {"embedding": (v, d)},
        "layers": {
            "input_norm": {"scale": (n, d)},
            "attn": attn,
            "post_attn_norm": {"scale": (n, d)},
            "mlp": {
                "gate": {"kernel": (n, d, f)},
                "up": {"kernel": (n, d, f)},
                "down": {"kernel": (n, f, d)},
            },
        },
        "final_norm": {"scale": (d,)},
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = {"kernel": (d, v)}
    return shapes


class _Entry:
    """One HF tensor: its name, the param leaf it belongs to, and how it maps there."""

    __slots__ = ("name", "path", "layer", "transpose", "hf_shape")

    def __init__(self, name, path, layer, transpose, hf_shape):
        self.name, self.path, self.layer = name, path, layer
        self.transpose, self.hf_shape = transpose, hf_shape


def _hf_entries(cfg: ModelConfig) -> list[_Entry]:
    """All HF tensors of `cfg` in HF's usual order (embedding, layer by layer, norm, head)."""
    shapes = _flatten(param_shapes(cfg))

    def hf_shape(shape, transpose):
        return tuple(reversed(shape)) if transpose else tuple(shape)

    entries = [_Entry("model.embed_tokens.weight", ("embed", "embedding"), None, False, None)]
    for layer in range(cfg.num_layers):
        for sub, (name, transpose) in _LAYER_NAMES.items():
            path = ("layers", *sub)
            if path in shapes:
                entries.append(_Entry(f"model.layers.{layer}.{name}", path, layer, transpose, None))
    entries.append(_Entry("model.norm.weight", ("final_norm", "scale"), None, False, None))
    if not cfg.tie_word_embeddings:
        entries.append(_Entry("lm_head.weight", ("lm_head", "kernel"), None, True, None))
    for e in entries:
        shape = shapes[e.path][1:] if e.layer is not None else shapes[e.path]
        e.hf_shape = hf_shape(shape, e.transpose)
    return entries


# --------------------------------------------------------------------------------------------
# safetensors, read through a memory map (any dtype, including bf16) and written streaming


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


def _write_safetensors(path: str, tensors: list[tuple[str, tuple, np.dtype]], fetch) -> None:
    """Writes tensors `(name, shape, dtype)` to `path`, calling `fetch(i)` for each array in
    turn, so only one tensor is on the host at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, (name, shape, dtype) in enumerate(tensors):
            array = fetch(i)
            if array is None:  # not process 0: gathered for collectives, nothing to write
                continue
            if array.shape != tuple(shape) or array.dtype != dtype:
                raise AssertionError(f"{name}: got {array.shape} {array.dtype}")
            f.write(np.ascontiguousarray(array).tobytes())


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
# Paths: local dirs, gs:// (or any etils.epath URL) and hub ids


def _is_url(path: str) -> bool:
    return "://" in path


def cache_dir() -> str:
    """Where remote checkpoints are copied (`$GJAX_CACHE`, default ~/.cache/gjax)."""
    return os.environ.get("GJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "gjax"))


def _wanted(name: str) -> bool:
    return name in _CHECKPOINT_FILES or name in TOKENIZER_FILES or name.endswith(".safetensors")


def _remote_path(url: str):
    """An `etils.epath.Path` for a URL (gs:// needs gcsfs: the `gcs` extra)."""
    from etils import epath

    return epath.Path(url)


def _copy_remote_dir(url: str) -> str:
    """Copies a remote checkpoint dir's useful files (config, weights, tokenizer) to the cache.

    Files already there with the same size are kept; cached files the remote dir no longer
    has are removed. Needs `etils[epath]` plus a filesystem
    for the scheme (gs://: `pip install gjax[gcs]`, i.e. gcsfs).
    """
    src = _remote_path(url)
    scheme, rest = url.split("://", 1)
    local = os.path.join(cache_dir(), "remote", scheme, rest.strip("/"))
    os.makedirs(local, exist_ok=True)
    try:
        children = list(src.iterdir())
    except Exception as e:  # noqa: BLE001 - any filesystem error: report with the fix
        raise FileNotFoundError(
            f"cannot list {url} ({type(e).__name__}: {e}); for gs:// paths install the gcs "
            f"extra (pip install 'gjax[gcs]') and check credentials"
        ) from e
    remote_names = {c.name for c in children}
    for name in os.listdir(local):  # files the remote dir no longer has (an old index...)
        if _wanted(name) and name not in remote_names:
            os.remove(os.path.join(local, name))
    for child in children:
        if not _wanted(child.name) or child.is_dir():
            continue
        target = os.path.join(local, child.name)
        size = child.stat().length
        if os.path.exists(target) and os.path.getsize(target) == size:
            continue
        tmp = target + ".partial"
        with child.open("rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, length=16 << 20)
        os.replace(tmp, target)
    return local


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_dir(path: str | os.PathLike) -> str:
    """A local directory holding the checkpoint at `path` (local dir, URL or hub id)."""
    path = os.fspath(path)
    if _is_url(path):
        return _copy_remote_dir(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"{path} is a file; pass the checkpoint directory")
    if not _HUB_ID.match(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    try:
        from huggingface_hub import snapshot_download

        patterns = [*_CHECKPOINT_FILES, *TOKENIZER_FILES, "*.safetensors"]
        return snapshot_download(repo_id=path, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth: one clear message
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        hint = " (HF_HUB_OFFLINE is set)" if offline else ""
        raise FileNotFoundError(
            f"{path!r} is not a local directory, and fetching it as a Hugging Face hub id "
            f"failed{hint}: {type(e).__name__}: {e}. Pass a local or gs:// checkpoint "
            f"directory, or go online."
        ) from e


# --------------------------------------------------------------------------------------------
# Loading


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def load_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """`ModelConfig` from a checkpoint dir (local, gs:// or hub id)."""
    return ModelConfig.from_pretrained_dir(resolve_dir(path), **overrides)


def load_policy(path: str, model_cfg, mesh: jax.sharding.Mesh):
    """`(cfg, params, tokenizer)` of a run's policy: `path` loaded as `config.model` asks
    (param dtype, compute dtype, remat), sharded on `mesh`. What train and serve both load."""
    cfg, params = load_pretrained(
        path,
        mesh=mesh,
        param_dtype=model_cfg.param_dtype,
        dtype=model_cfg.dtype,
        remat=model_cfg.remat,
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
    """Loads an HF `Qwen2ForCausalLM`/`LlamaForCausalLM` checkpoint as `(cfg, params)`.

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
# Saving


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not m:
        raise ValueError(f"bad max_shard_size {size!r}; use an int (bytes) or e.g. '5GB'")
    unit = m.group(2)
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0])
    return int(float(m.group(1)) * base**power)


@jax.jit
def _take_layer(x, layer):
    # The layer index is traced: one compile per leaf, not one per (leaf, layer).
    return jax.lax.dynamic_index_in_dim(x, layer, axis=0, keepdims=False)


def _fetch_hf(params: Params, e: _Entry, dtype) -> np.ndarray | None:
    """One HF tensor on the host (gathered across processes when needed); None off process 0."""
    leaf = params
    for key in e.path:
        leaf = leaf[key]
    if e.layer is not None:
        leaf = _take_layer(leaf, e.layer) if isinstance(leaf, jax.Array) else leaf[e.layer]
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        leaf = multihost_utils.process_allgather(leaf, tiled=True)
    if jax.process_index() != 0:
        return None
    array = np.asarray(leaf)
    if e.transpose:
        array = array.T
    return np.ascontiguousarray(array, dtype=dtype)


def _check_params(params: Params, cfg: ModelConfig) -> None:
    expected = _flatten(param_shapes(cfg))
    got = {
        _path_tuple(p): tuple(np.shape(x))
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    problems = [f"missing {'/'.join(p)}" for p in sorted(set(expected) - set(got))]
    problems += [f"unexpected {'/'.join(p)}" for p in sorted(set(got) - set(expected))]
    problems += [
        f"{'/'.join(p)}: shape {got[p]}, config expects {expected[p]}"
        for p in sorted(set(got) & set(expected))
        if got[p] != expected[p]
    ]
    if problems:
        raise ValueError("params do not match the config:\n  " + "\n  ".join(problems))


def save_pretrained(
    params: Params,
    cfg: ModelConfig,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_size: int | str = "5GB",
    dtype=None,
    generation_config: dict[str, Any] | None = None,
) -> None:
    """Writes an HF checkpoint loadable by `transformers.AutoModelForCausalLM.from_pretrained`.

    Args:
      params: the gjax param tree (sharded or not; gathered one HF tensor at a time).
      cfg: its config (written as `config.json` and `generation_config.json`).
      path: output dir, local or `gs://...` (written locally, then uploaded).
      tokenizer: None, a tokenizer dir (local/gs://, its tokenizer files are copied) or a
        tokenizer object with `save_pretrained`.
      max_shard_size: bytes per safetensors file (int or "5GB"/"500MiB"); more than one file
        adds `model.safetensors.index.json`. A tensor larger than this gets its own file.
      dtype: dtype to write (default: each param's own dtype, i.e. `cfg.param_dtype`).
      generation_config: extra `generation_config.json` fields (e.g. the source checkpoint's
        sampling defaults), merged over the bos/eos/pad ids taken from `cfg`.
    """
    path = os.fspath(path)
    _check_params(params, cfg)
    entries = _hf_entries(cfg)
    limit = parse_size(max_shard_size)
    leaf_dtype = {
        _path_tuple(p): np.dtype(x.dtype)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    out_dtype = {e.name: np.dtype(dtype) if dtype else leaf_dtype[e.path] for e in entries}
    for name, dt in out_dtype.items():
        if dt not in _ST_CODES:
            raise ValueError(f"{name}: cannot write dtype {dt} to safetensors")

    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = math.prod(e.hf_shape) * out_dtype[e.name].itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    n = len(shards)
    names = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )

    writer = jax.process_index() == 0
    remote = _is_url(path)
    local = tempfile.mkdtemp(prefix="gjax_export_") if remote else path
    if writer:
        os.makedirs(local, exist_ok=True)
        _remove_stale_weights(local, keep=names)
    total = 0
    weight_map = {}
    for file_name, shard in zip(names, shards):
        specs = [(e.name, e.hf_shape, out_dtype[e.name]) for e in shard]
        fetch = lambda i, shard=shard: _fetch_hf(params, shard[i], out_dtype[shard[i].name])
        if writer:
            _write_safetensors(os.path.join(local, file_name), specs, fetch)
        else:
            for i in range(len(shard)):
                fetch(i)  # take part in the gathers
        for e in shard:
            weight_map[e.name] = file_name
            total += math.prod(e.hf_shape) * out_dtype[e.name].itemsize
    if not writer:
        return

    saved_dtype = np.dtype(dtype).name if dtype else cfg.param_dtype
    _write_model_files(local, cfg, saved_dtype, tokenizer, generation_config)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(os.path.join(local, INDEX_FILE), index)
    if remote:
        _upload_dir(local, path)
        shutil.rmtree(local, ignore_errors=True)


def save_model_files(
    cfg: ModelConfig,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    generation_config: dict[str, Any] | None = None,
) -> None:
    """Writes everything of an HF checkpoint but its weights (local or gs://): `config.json`
    (for `cfg`), `generation_config.json` and the tokenizer (as in `save_pretrained`).

    Training records its policy's architecture and tokenizer with the run this way
    (`WORKDIR/model/`), so an export needs only the workdir, never the base model.
    """
    path = os.fspath(path)
    if jax.process_index() != 0:
        return
    remote = _is_url(path)
    local = tempfile.mkdtemp(prefix="gjax_model_") if remote else path
    os.makedirs(local, exist_ok=True)
    _write_model_files(local, cfg, cfg.param_dtype, tokenizer, generation_config)
    if remote:
        _upload_dir(local, path)
        shutil.rmtree(local, ignore_errors=True)


def source_generation_config(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint dir's `generation_config.json` (its sampling defaults), or {}."""
    file = os.path.join(resolve_dir(path), "generation_config.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def _write_model_files(local, cfg, saved_dtype, tokenizer, generation_config) -> None:
    hf_config = cfg.to_hf()
    hf_config["dtype"] = saved_dtype
    hf_config.pop("torch_dtype", None)
    _write_json(os.path.join(local, "config.json"), hf_config)
    gen = {**_generation_config(cfg), **(generation_config or {})}
    _write_json(os.path.join(local, "generation_config.json"), gen)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, local)


_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def _remove_stale_weights(directory: str, keep: list[str]) -> None:
    """Deletes weight files / index of an earlier export that this one would not overwrite
    (an old index next to a new single file would be read instead of it)."""
    for name in os.listdir(directory):
        if (name == INDEX_FILE or _WEIGHT_FILE.match(name)) and name not in keep:
            os.remove(os.path.join(directory, name))


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id:
        eos = list(cfg.eos_token_id)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_tokenizer(tokenizer, directory: str) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    src = resolve_dir(tokenizer)
    copied = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(src, n))]
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer} (looked for {TOKENIZER_FILES})")
    for name in copied:
        source, target = os.path.join(src, name), os.path.join(directory, name)
        if not (os.path.exists(target) and os.path.samefile(source, target)):
            shutil.copyfile(source, target)


def _upload_dir(local: str, url: str) -> None:
    dest = _remote_path(url)
    dest.mkdir(parents=True, exist_ok=True)
    names = set(os.listdir(local))
    try:  # GCS has no directories: a prefix with no objects yet cannot be listed
        earlier = list(dest.iterdir())
    except FileNotFoundError:
        earlier = []
    for child in earlier:  # weights of an earlier export that this one replaces
        if (child.name == INDEX_FILE or _WEIGHT_FILE.match(child.name)) and child.name not in names:
            child.unlink()
    for name in sorted(names):
        with open(os.path.join(local, name), "rb") as fin, (dest / name).open("wb") as fout:
            shutil.copyfileobj(fin, fout, length=16 << 20)


# --------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """`transformers.AutoTokenizer` from a checkpoint/tokenizer dir (local, gs:// or hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_dir(path), **kwargs)


# --------------------------------------------------------------------------------------------
# Helpers


def _path_tuple(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def _flatten(tree: Params, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def iter_hf_names(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, HF shape) of every tensor a checkpoint for `cfg` holds."""
    for e in _hf_entries(cfg):
        yield e.name, e.hf_shape


__all__ = [
    "Checkpoint",
    "SafetensorsFile",
    "cache_dir",
    "check_checkpoint",
    "iter_hf_names",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "param_shapes",
    "resolve_dir",
    "save_model_files",
    "save_pretrained",
    "source_generation_config",
]
