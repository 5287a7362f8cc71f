"""Prompt data: the embedded synthetic task, its tokenizer, templates and resumable loading.

Three steps, each usable alone::

    rows   = load_rows("synthetic" | "path/to/file.jsonl|.parquet|.arrow|dir" | "hub/id", ...)
    data   = prepare_prompts(rows, tokenizer, fields=FieldMap(...), template="plain",
                             max_prompt_length=32)
    it     = PromptIterator(data, global_batch_size=P, seed=0)

(`sources`, `prompts`, `iterator`), or all at once from ``config.data`` (`builders`):
``build_prompt_iterator(config.data, tok, global_batch_size=P)`` and
``build_prompt_data(config.data, tok, heldout=True)`` for held-out evaluation (a set that is
never training rows unless ``data.allow_heldout_overlap``: ``builders.heldout_plan``). Fields
are read through field specs (`fields`: ``problem``, ``reward_model.ground_truth``,
``prompt[-1].content``, ``boxed(solution)``).
"""

from gjax.data.builders import (
    DATA_DEFAULTS,
    build_prompt_data,
    build_prompt_iterator,
    build_sharded_prompts,
    data_config,
)
from gjax.data.iterator import PromptIterator
from gjax.data.prompts import (
    FieldMap,
    PromptBatch,
    PromptData,
    ShardedPrompts,
    encode_completions,
    left_pad,
    prepare_prompts,
    prepare_sharded_prompts,
)
from gjax.data.sources import DataError, load_rows
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
