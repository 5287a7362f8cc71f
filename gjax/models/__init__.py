"""The policy model: `ModelConfig` and the Flax Qwen2/Llama/Qwen3 decoder."""

from gjax.models.config import ModelConfig
from gjax.models.hf_export import save_pretrained
from gjax.models.hf_import import load_pretrained, load_tokenizer
from gjax.models.transformer import (
    Transformer,
    abstract_params,
    decode_layers,
    decode_step,
    forward,
    init_params,
    lm_head_kernel,
    logits_from_hidden,
    param_logical_axes,
    prefill,
    split_layers,
)

__all__ = [
    "ModelConfig",
    "Transformer",
    "abstract_params",
    "decode_layers",
    "decode_step",
    "forward",
    "init_params",
    "lm_head_kernel",
    "load_pretrained",
    "load_tokenizer",
    "logits_from_hidden",
    "param_logical_axes",
    "prefill",
    "split_layers",
    "save_pretrained",
]
