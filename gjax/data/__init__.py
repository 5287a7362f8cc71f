"""Prompt data: the embedded synthetic task, its tokenizer, templates and resumable loading."""

from gjax.data.loading import (
    DATA_DEFAULTS,
    DataError,
    FieldMap,
    PromptBatch,
    PromptData,
    PromptIterator,
    ShardedPrompts,
    build_prompt_data,
    build_prompt_iterator,
    build_sharded_prompts,
    data_config,
    encode_completions,
    left_pad,
    load_rows,
    prepare_prompts,
    prepare_sharded_prompts,
)
from gjax.data.synthetic import Problem, SyntheticConfig, generate, iter_problems
from gjax.data.templates import TEMPLATES, apply_template
from gjax.data.tokenizer import build_tokenizer, save_tokenizer

__all__ = [
    "DATA_DEFAULTS",
    "TEMPLATES",
    "DataError",
    "FieldMap",
    "Problem",
    "PromptBatch",
    "PromptData",
    "PromptIterator",
    "ShardedPrompts",
    "SyntheticConfig",
    "apply_template",
    "build_prompt_data",
    "build_prompt_iterator",
    "build_sharded_prompts",
    "build_tokenizer",
    "data_config",
    "encode_completions",
    "generate",
    "iter_problems",
    "left_pad",
    "load_rows",
    "prepare_prompts",
    "prepare_sharded_prompts",
    "save_tokenizer",
]
