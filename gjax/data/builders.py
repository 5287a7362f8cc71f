"""Prompt data from ``config.data`` (keys of ``DATA_DEFAULTS``, as in ``configs/common.py``).

``build_prompt_iterator(config.data, tok, global_batch_size=P)`` for training (each host
templates its share, `ShardedPrompts`) and ``build_prompt_data(config.data, tok, heldout=True)``
for held-out evaluation: `load_rows` + `prepare_prompts` (+ `PromptIterator`) in one call.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Mapping
from typing import Any

from gjax.data import synthetic as synthetic_lib
from gjax.data.iterator import PromptIterator
from gjax.data.prompts import (
    FieldMap,
    PromptData,
    ShardedPrompts,
    prepare_prompts,
    prepare_sharded_prompts,
)
from gjax.data.sources import SYNTHETIC, DataError, load_rows, looks_like_path
from gjax.data.templates import TEMPLATES
from gjax.errors import ConfigError

# The ``config.data`` schema (the keys of ``configs/common.py``; missing keys take these).
DATA_DEFAULTS: dict[str, Any] = {
    "source": SYNTHETIC,  # "synthetic", a local file/dir/glob, or a Hub id
    "subset": None,  # Hub configuration name
    "split": "train",
    "heldout_split": "test",  # synthetic: "test" (alias "heldout")
    "problem_field": "problem",
    "answer_field": "answer",
    "demonstration_field": "",  # "" or None: the data has no demonstrations
    "template": "plain",  # a name in gjax.data.templates.TEMPLATES
    "max_prompt_len": 32,  # tokens; longer prompts are skipped (counted)
    "shuffle": True,
    "shuffle_seed": 0,
    "num_examples": None,  # rows of the train split (None: all; synthetic: 8192)
    "heldout_size": 256,  # rows of the held-out split
    "strict": False,  # raise on malformed rows instead of skipping them
    "synthetic": {},  # SyntheticConfig overrides (difficulty knobs)
    "synthetic_seed": 0,  # seed of the synthetic problem stream
}


def check_config(config) -> None:
    """`config.data` can work (the template exists, the synthetic task is consistent, a local
    source matches a file): raises ConfigError naming the field. A hook of
    `gjax.config.validate`, run before anything loads."""
    d = config.data
    if d.template not in TEMPLATES:
        raise ConfigError(
            f"config.data.template: unknown template {d.template!r}; valid: {sorted(TEMPLATES)}"
        )
    if d.source == SYNTHETIC:
        try:
            synthetic_lib.SyntheticConfig(**d.synthetic.to_dict())
        except ValueError as e:
            raise ConfigError(f"config.data.synthetic: {e}") from None
    elif (
        looks_like_path(d.source)
        and "://" not in d.source
        and not glob.glob(os.path.expanduser(d.source))
    ):
        raise ConfigError(
            f"config.data.source: no file or directory matches {d.source!r} (relative to "
            f"{os.getcwd()}); give a local .jsonl/.parquet/.arrow file or directory, a Hub "
            "id, or 'synthetic'"
        )


def data_config(cfg: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``DATA_DEFAULTS`` updated by ``cfg`` (a dict or ``ConfigDict``); unknown keys raise."""
    cfg = dict((cfg.to_dict() if hasattr(cfg, "to_dict") else cfg) or {})
    unknown = set(cfg) - set(DATA_DEFAULTS)
    if unknown:
        raise DataError(
            f"unknown data config keys {sorted(unknown)}; valid: {sorted(DATA_DEFAULTS)}"
        )
    return {**DATA_DEFAULTS, **cfg}


def build_prompt_data(
    cfg: Mapping[str, Any] | None, tokenizer, *, heldout: bool = False
) -> PromptData:
    """``load_rows`` + ``prepare_prompts`` for ``config.data`` (keys of ``DATA_DEFAULTS``).

    ``heldout=True`` loads ``heldout_split`` (first ``heldout_size`` rows) instead of ``split``
    (first ``num_examples`` rows).
    """
    return _build(prepare_prompts, cfg, tokenizer, heldout=heldout)


def build_sharded_prompts(cfg: Mapping[str, Any] | None, tokenizer, **hosts: Any) -> ShardedPrompts:
    """The training split of ``config.data`` as `ShardedPrompts`: each host templates its
    share. ``hosts``: `prepare_sharded_prompts`' process_index / process_count / allgather."""
    prepare = functools.partial(prepare_sharded_prompts, **hosts)
    return _build(prepare, cfg, tokenizer, heldout=False)


def _build(prepare, cfg, tokenizer, *, heldout: bool):
    cfg = data_config(cfg)
    demonstration = cfg["demonstration_field"] or None
    size_key = "heldout_size" if heldout else "num_examples"
    if cfg[size_key] is not None and cfg[size_key] <= 0:
        raise DataError(f"data.{size_key} must be positive, got {cfg[size_key]}")
    load_stats: dict[str, int] = {}
    rows = load_rows(
        cfg["source"],
        split=cfg["heldout_split"] if heldout else cfg["split"],
        subset=cfg["subset"],
        num_examples=cfg["heldout_size"] if heldout else cfg["num_examples"],
        seed=cfg["synthetic_seed"],
        synthetic=cfg["synthetic"],
        strict=cfg["strict"],
        stats=load_stats,
    )
    data = prepare(
        rows,
        tokenizer,
        fields=FieldMap(cfg["problem_field"], cfg["answer_field"], demonstration),
        template=cfg["template"],
        max_prompt_length=cfg["max_prompt_len"],
        strict=cfg["strict"],
    )
    skipped = load_stats.get("skipped_malformed", 0)  # lines that never became rows
    data.stats["rows"] += skipped
    data.stats["skipped_malformed"] += skipped
    return data


def build_prompt_iterator(
    cfg: Mapping[str, Any] | None,
    tokenizer,
    *,
    global_batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
    allgather=None,
    state: Mapping[str, Any] | None = None,
) -> PromptIterator:
    """The training iterator for ``config.data``: ``build_sharded_prompts`` +
    ``PromptIterator``, this host's block of every global batch."""
    hosts = {"process_index": process_index, "process_count": process_count}
    data = build_sharded_prompts(cfg, tokenizer, **hosts, allgather=allgather)
    cfg = data_config(cfg)
    return PromptIterator(
        data,
        global_batch_size=global_batch_size,
        seed=cfg["shuffle_seed"],
        shuffle=cfg["shuffle"],
        state=state,
        **hosts,
    )
