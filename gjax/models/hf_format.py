"""The Hugging Face checkpoint format as gjax maps it: files, tensor names, dtypes, places.

The gjax param tree (`param_shapes`) and the HF tensor of each leaf (`iter_hf_names`), the
checkpoint's file names, the safetensors dtype codes, and where a checkpoint lives
(`resolve_dir`: a local dir, gs:// copied to `cache_dir()`, or a hub id). Reading is
`gjax.models.hf_import`'s, writing `gjax.models.hf_export`'s.

HF name map (`model.layers.{l}.` prefix for per-layer tensors):

    embed/embedding           model.embed_tokens.weight           [V, D]
    layers/input_norm/scale   input_layernorm.weight              [D]
    layers/attn/{q,k,v}/kernel self_attn.{q,k,v}_proj.weight      [out, in] -> transposed
    layers/attn/{q,k,v}/bias  self_attn.{q,k,v}_proj.bias         (attention_bias only)
    layers/attn/o/kernel      self_attn.o_proj.weight             transposed
    layers/attn/o/bias        self_attn.o_proj.bias               (Llama/Qwen3 attention_bias)
    layers/attn/{q,k}_norm/scale self_attn.{q,k}_norm.weight      [Dh] (Qwen3 only)
    layers/post_attn_norm/scale post_attention_layernorm.weight
    layers/mlp/{gate,up,down}/kernel mlp.{gate,up,down}_proj.weight transposed
    final_norm/scale          model.norm.weight
    lm_head/kernel            lm_head.weight                      transposed; absent when tied
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
from etils import epath

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
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False),
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
    if cfg.qk_norm:
        attn["q_norm"] = {"scale": (n, cfg.head_dim)}
        attn["k_norm"] = {"scale": (n, cfg.head_dim)}
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
        from huggingface_hub import snapshot_download  # deferred: only for Hub ids

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
    "cache_dir",
    "iter_hf_names",
    "param_shapes",
    "resolve_dir",
]
