"""Hugging Face checkpoints out: the gjax param tree -> safetensors, config and tokenizer.

    save_pretrained(params, cfg, "/out/step_1000", tokenizer="/ckpt/Qwen2.5-Math-1.5B")

Saving is loading in reverse (`gjax.models.hf_import`): one HF tensor at a time is gathered to
the host (per layer for the stacked params) and streamed into safetensors shards of at most
`max_shard_size` bytes, with `model.safetensors.index.json` when there is more than one shard;
process 0 writes. The HF name map is `gjax.models.hf_format`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from gjax.models import lora
from gjax.models.config import ModelConfig
from gjax.models.hf_format import (
    _ST_CODES,
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_FILES,
    Params,
    _Entry,
    _flatten,
    _hf_entries,
    _is_url,
    _path_tuple,
    _remote_path,
    param_shapes,
    resolve_dir,
)

# --------------------------------------------------------------------------------------------
# safetensors, written streaming


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
    chat_template: str | None = None,
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
      chat_template: Jinja written as the tokenizer's chat template (`chat_template.jinja`,
        which transformers reads before `tokenizer_config.json`'s); None keeps the tokenizer's.
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
    if chat_template is not None:
        _write_chat_template(local, chat_template)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(os.path.join(local, INDEX_FILE), index)
    if remote:
        _upload_dir(local, path)
        shutil.rmtree(local, ignore_errors=True)


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def peft_tensor_names(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], int, str]]:
    """`(PEFT name, gjax target path, layer, "lora_a" | "lora_b")` of each adapter tensor, in
    the order PEFT's `get_peft_model_state_dict` lists them (layer, then target)."""
    out = []
    for layer in range(cfg.num_layers):
        for target in cfg.lora_targets:
            prefix = f"base_model.model.model.layers.{layer}.{lora.HF_MODULES[target]}"
            path = ("layers", *lora.TARGET_PATHS[target])
            out.append((f"{prefix}.lora_A.weight", path, layer, "lora_a"))
            out.append((f"{prefix}.lora_B.weight", path, layer, "lora_b"))
    return out


def peft_adapter_config(cfg: ModelConfig, base_model_name_or_path: str | None) -> dict[str, Any]:
    """The `adapter_config.json` of `cfg`'s adapters: PEFT's LoRA computes
    y = x W + (lora_alpha / r) B(A(x)), gjax's x W + (alpha / rank) (x A) B."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "target_modules": [lora.HF_MODULES[t] for t in cfg.lora_targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapter(
    adapters: Params,
    cfg: ModelConfig,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None,
    tokenizer=None,
    dtype=None,
    chat_template: str | None = None,
) -> None:
    """Writes `adapters` (gjax's `lora_a` [L, in, r], `lora_b` [L, r, out] leaves, e.g.
    `gjax.models.lora.split(params)[1]`) as a PEFT LoRA adapter directory, local or gs://:
    `adapter_config.json` and `adapter_model.safetensors` (PEFT's names, A as [r, in] and B
    as [out, r]: torch `nn.Linear` weights), loadable by
    `peft.PeftModel.from_pretrained(base, path)` on the base of `cfg.without_lora()`; with
    the tokenizer (and `chat_template`) as in `save_pretrained`.
    """
    path = os.fspath(path)
    if not cfg.lora_rank:
        raise ValueError("save_peft_adapter needs a LoRA config (cfg.lora_rank > 0)")
    names = peft_tensor_names(cfg)

    def leaf(tree_path, kind):
        node = adapters
        for key in tree_path:
            node = node[key]
        return node[kind]

    out_dtype = {
        n: np.dtype(dtype) if dtype else np.dtype(leaf(p, k).dtype) for n, p, _, k in names
    }
    for name, dt in out_dtype.items():
        if dt not in _ST_CODES:
            raise ValueError(f"{name}: cannot write dtype {dt} to safetensors")
    specs = []
    for name, tree_path, _, kind in names:
        _, d_in, d_out = leaf(tree_path, kind).shape
        specs.append((name, (d_out, d_in), out_dtype[name]))  # [r, in] or [out, r]

    def fetch(i):
        name, tree_path, layer, kind = names[i]
        x = leaf(tree_path, kind)
        x = _take_layer(x, layer) if isinstance(x, jax.Array) else x[layer]
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        if jax.process_index() != 0:
            return None
        return np.ascontiguousarray(np.asarray(x).T, dtype=out_dtype[name])

    writer = jax.process_index() == 0
    remote = _is_url(path)
    local = tempfile.mkdtemp(prefix="gjax_peft_") if remote else path
    if writer:
        os.makedirs(local, exist_ok=True)
        _write_safetensors(os.path.join(local, PEFT_WEIGHTS), specs, fetch)
    else:
        for i in range(len(specs)):
            fetch(i)  # take part in the gathers
        return
    _write_json(os.path.join(local, PEFT_CONFIG), peft_adapter_config(cfg, base_model_name_or_path))
    if tokenizer is not None:
        _save_tokenizer(tokenizer, local)
    if chat_template is not None:
        _write_chat_template(local, chat_template)
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


def _write_chat_template(directory: str, template: str) -> None:
    """Makes `template` the chat template of the tokenizer saved in `directory`: the
    `chat_template.jinja` file, and `tokenizer_config.json`'s key where it has one (so no
    reader sees the old one)."""
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(template)
    config_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            config = json.load(f)
        if "chat_template" in config:
            config["chat_template"] = template
            _write_json(config_file, config)


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


__all__ = [
    "parse_size",
    "peft_adapter_config",
    "peft_tensor_names",
    "save_peft_adapter",
    "save_model_files",
    "save_pretrained",
    "source_generation_config",
]
