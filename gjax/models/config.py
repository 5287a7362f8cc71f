"""`ModelConfig`: the decoder's hyperparameters, read from and written to HF `config.json`.

Covers `Qwen2ForCausalLM` (q/k/v bias, tied or untied embeddings), `LlamaForCausalLM`
(including Llama-3 `rope_scaling`) and dense `Qwen3ForCausalLM` (per-head q/k RMSNorm,
`head_dim` independent of hidden / heads, no bias unless `attention_bias`). Anything else is
refused with the list of supported types, and so is any feature of these families gjax does
not implement (sliding-window layers, other RoPE scalings, other activations), by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3")
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' Qwen3Config default when config.json has no `head_dim` (not hidden / heads).
_QWEN3_HEAD_DIM = 128
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims")
# gjax.models.attention.IMPLEMENTATIONS (kept here: config imports no jax modules of its own).
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "xla_blocked", "cudnn", "pallas_gpu", "splash")
# The projections LoRA can adapt (gjax.models.lora), by the names the param tree gives them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# How a frozen base's projection kernels may be stored (QLoRA; gjax.models.quant).
BASE_QUANT = ("none", "int8", "int4", "nf4")

# Hugging Face (PEFT) module names, accepted for the same targets.
_LORA_HF_NAMES = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """`model.lora.targets` ("q,k,v,o,gate,up,down", PEFT's q_proj... too, or "all") -> the
    targets in LORA_TARGETS order. Raises ValueError naming an unknown one."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return LORA_TARGETS
    unknown = [n for n in names if n not in LORA_TARGETS and n not in _LORA_HF_NAMES]
    if unknown:
        raise ValueError(
            f"names no module: {unknown}; the projections LoRA can adapt are "
            f"{','.join(LORA_TARGETS)} (or PEFT's {','.join(_LORA_HF_NAMES)}, or 'all')"
        )
    chosen = {_LORA_HF_NAMES.get(n, n) for n in names}
    return tuple(t for t in LORA_TARGETS if t in chosen)


_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def dtype_from_name(name: str):
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture plus numerics. Frozen and hashable, so it can be a static jit argument."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Llama-3 style scaling as a sorted tuple of (key, value) pairs, or None (hashable).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2: True); Llama, Qwen3: q/k/v/o (o_bias)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Numerics (not part of the HF file).
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    remat: str = "none"
    attention: str = "auto"  # gjax.models.attention.IMPLEMENTATIONS
    # LoRA (gjax.models.lora; not part of the HF file): rank 0 is full fine-tuning. Each
    # projection named in `lora_targets` computes x W + (alpha / rank) (x A) B, A [in, rank]
    # and B [rank, out] (B starts at zero) stored in `lora_dtype` beside the frozen W.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_dtype: str = "float32"
    # The frozen base's projection kernels stored quantized (QLoRA; gjax.models.quant):
    # "kernel" holds the integer codes and "kernel_scale" their scales. "none": as loaded.
    base_quant: str = "none"

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # keep the config hashable
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; gjax supports {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {self.remat!r}; valid: {REMAT_POLICIES}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attention {self.attention!r}; valid: {ATTENTION_IMPLEMENTATIONS}"
            )
        dtype_from_name(self.param_dtype)
        dtype_from_name(self.dtype)
        dtype_from_name(self.lora_dtype)
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; valid: {LORA_TARGETS}")
        if self.lora_rank and not self.lora_targets:
            raise ValueError("ModelConfig.lora_rank > 0 needs at least one of lora_targets")
        if self.base_quant not in BASE_QUANT:
            raise ValueError(f"unknown base_quant {self.base_quant!r}; valid: {BASE_QUANT}")

    @property
    def jnp_dtype(self):
        return dtype_from_name(self.dtype)

    @property
    def jnp_param_dtype(self):
        return dtype_from_name(self.param_dtype)

    @property
    def lora_scale(self) -> float:
        """alpha / rank, the factor of every adapter's product (0 without LoRA)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def without_lora(self) -> ModelConfig:
        """The base model's config: the same architecture with no adapters (the reference)."""
        return dataclasses.replace(self, lora_rank=0, lora_alpha=0.0, lora_targets=())

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Builds a config from an HF `config.json` dict (unknown HF keys are ignored)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; gjax supports "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing}")
        num_heads = hf["num_attention_heads"]
        default_head_dim = (
            _QWEN3_HEAD_DIM if model_type == "qwen3" else hf["hidden_size"] // num_heads
        )
        head_dim = hf.get("head_dim") or default_head_dim
        scaling = hf.get("rope_scaling")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 may store rope here
        rope_theta = hf.get("rope_theta")
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type in (None, "default"):
                scaling = None
            elif rope_type != "llama3":
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}; gjax supports 'llama3' or none"
                )
            else:
                scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
                scaling["rope_type"] = rope_type
                needed = ("factor", "low_freq_factor", "high_freq_factor")
                needed += ("original_max_position_embeddings",)
                absent = [k for k in needed if k not in scaling]
                if absent:
                    raise ValueError(f"llama3 rope_scaling in config.json lacks {absent}")
                scaling = tuple(sorted(scaling.items()))
        unsupported = []
        if hf.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={hf['hidden_act']!r} (gjax implements 'silu')")
        if hf.get("mlp_bias"):
            unsupported.append("mlp_bias=true")
        if hf.get("use_sliding_window"):
            unsupported.append("use_sliding_window=true (sliding-window attention)")
        other_layers = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
        if other_layers:
            unsupported.append(
                f"layer_types {other_layers} (gjax implements 'full_attention' layers only)"
            )
        if unsupported:
            raise ValueError(f"config.json uses unsupported feature(s): {unsupported}")
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        kwargs = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # HF Qwen2 always has q/k/v biases (it ignores `attention_bias`).
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            valid = sorted(f.name for f in dataclasses.fields(cls))
            raise ValueError(f"unknown ModelConfig override(s) {unknown}; valid fields: {valid}")
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_pretrained_dir(cls, path: str, **overrides) -> ModelConfig:
        config_path = os.path.join(path, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        with open(config_path) as f:
            return cls.from_hf(json.load(f), **overrides)

    @property
    def o_bias(self) -> bool:
        """transformers' Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2's has none."""
        return self.model_type in ("llama", "qwen3") and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Qwen3: RMSNorm over the head dim of each query and key head, before RoPE."""
        return self.model_type == "qwen3"

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict for this architecture (loadable by transformers 5.x)."""
        arch = _ARCHITECTURES[self.model_type]
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "dtype": self.param_dtype,
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
            out["use_sliding_window"] = False
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            eos = list(self.eos_token_id)
            out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        return out
