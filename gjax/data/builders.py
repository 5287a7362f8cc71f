"""Prompt data from ``config.data`` (keys of ``DATA_DEFAULTS``, as in ``configs/common.py``).

``build_prompt_iterator(config.data, tok, global_batch_size=P)`` for training (each host
templates its share, `ShardedPrompts`) and ``build_prompt_data(config.data, tok, heldout=True)``
for held-out evaluation: `load_rows` + `prepare_prompts` (+ `PromptIterator`) in one call.

The held-out set never holds training rows unless ``allow_heldout_overlap`` says so. It is

* ``heldout_fraction > 0``: a seeded sample of the training split's rows, removed from
  training (``heldout_seed``);
* ``heldout_source``: a benchmark of ``gjax.data.testsets`` (``math500``; ``math500=PATH``
  for a local copy in its format: its own split and columns), or another file / Hub id read
  with the training field map and ``heldout_split``;
* else ``heldout_split`` of ``source`` (a plain file has no splits: refused).

A training row whose problem text (whitespace-normalised) is a held-out problem is removed
from training too, and counted. `heldout_plan` says which case a config is, before loading;
the held-out `PromptData.origin` records the rows (summary.json).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gjax.data import fields as fields_lib
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
from gjax.data.templates import TEMPLATES, render_prompt
from gjax.data.testsets import BENCHMARKS
from gjax.errors import ConfigError

log = logging.getLogger(__name__)

# The ``config.data`` schema (the keys of ``configs/common.py``; missing keys take these).
DATA_DEFAULTS: dict[str, Any] = {
    "source": SYNTHETIC,  # "synthetic", a local file/dir/glob, or a Hub id
    "subset": None,  # Hub configuration name
    "split": "train",
    "heldout_split": "test",  # synthetic: "test" (alias "heldout")
    "heldout_source": "",  # "": source; a benchmark name (name=path: a copy); a file / Hub id
    "heldout_fraction": 0.0,  # > 0: held-out rows sampled from the training split, removed
    "heldout_seed": 0,  # seed of that sample
    "allow_heldout_overlap": False,  # evaluate on training rows knowingly
    "problem_field": "problem",  # field specs (gjax.data.fields): col, col.key, boxed(col)
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


@dataclasses.dataclass(frozen=True)
class HeldoutPlan:
    """Where a config's held-out set comes from, decided before anything loads."""

    source: str  # "synthetic", a path or a Hub id (a benchmark's id or its local copy)
    split: str | None  # None: carved from the training split (`fraction` > 0)
    subset: str | None
    fields: FieldMap
    benchmark: str | None  # the gjax.data.testsets name, if one
    fraction: float
    same_rows: str | None  # why its rows are the training rows by construction, or None


def heldout_plan(cfg: Mapping[str, Any]) -> HeldoutPlan:
    """The held-out set of ``cfg`` (a ``data_config`` dict); a contradictory config raises."""
    train_fields = _field_map(cfg)
    held = (cfg["heldout_source"] or "").strip()
    fraction = float(cfg["heldout_fraction"] or 0.0)
    if fraction > 0:
        if held:
            raise DataError(
                f"data.heldout_fraction={fraction} carves the held-out set out of data.source, "
                f"and data.heldout_source={held!r} names another one; set only one of them"
            )
        return HeldoutPlan(cfg["source"], None, cfg["subset"], train_fields, None, fraction, None)
    name, eq, copy = held.partition("=")
    if name.strip() in BENCHMARKS.names():
        b = BENCHMARKS.get(name.strip())
        source = copy.strip() or b.hub_id
        split, subset, fields, bench = (
            b.split,
            b.subset,
            FieldMap(b.problem_field, b.answer_field),
            b.name,
        )
    elif held:
        source, split, subset, bench = held, cfg["heldout_split"], None, None
        fields = FieldMap(train_fields.problem, train_fields.answer)
    else:
        source, split, subset, bench = cfg["source"], cfg["heldout_split"], cfg["subset"], None
        fields = train_fields
    same = _same_rows(cfg, source, split, subset)
    return HeldoutPlan(source, split, subset, fields, bench, 0.0, same)


def _same_rows(cfg, source: str, split: str, subset: str | None) -> str | None:
    if _where(source) != _where(cfg["source"]):
        return None
    if source == SYNTHETIC:
        alias = {"heldout": "test"}
        same = alias.get(split, split) == alias.get(cfg["split"], cfg["split"])
        return f"synthetic split {split!r} is data.split" if same else None
    path = os.path.expanduser(source)
    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    if looks_like_path(source) and not saved:
        return (
            f"{source!r} is a file (or files) with no splits, so data.heldout_split does not "
            "apply and both sets would be its rows"
        )
    if split == cfg["split"] and subset == cfg["subset"]:
        return f"data.heldout_split={split!r} is data.split of {source!r}"
    return None


def _where(source: str) -> str:
    if looks_like_path(source) and "://" not in source:
        return os.path.abspath(os.path.expanduser(source))
    return source


def overlap_message(reason: str) -> str:
    names = ", ".join(BENCHMARKS.names())
    return (
        f"config.data: the held-out set would be training rows ({reason}), so its accuracy "
        "would measure what was trained on. Give it rows of its own: "
        "data.heldout_fraction=0.05 (a seeded sample of data.source, removed from training; "
        f"data.heldout_seed picks it), or data.heldout_source=math500 (a benchmark: {names}; "
        "'name=PATH' reads a local copy), another file or a Hub id; or set "
        "data.allow_heldout_overlap=True to evaluate on training rows knowingly "
        "(summary.json then says so)."
    )


def check_config(config) -> None:
    """`config.data` can work (the template exists, the synthetic task is consistent, a local
    source matches a file, the field specs parse, the held-out set is not training rows
    unless allowed): raises ConfigError naming the field. A hook of `gjax.config.validate`,
    run before anything loads."""
    d = config.data
    if d.template not in TEMPLATES:
        raise ConfigError(
            f"config.data.template: unknown template {d.template!r}; valid: {sorted(TEMPLATES)}"
        )
    for name in ("problem_field", "answer_field", "demonstration_field"):
        spec = d[name]
        if name == "demonstration_field" and not spec:
            continue
        try:
            fields_lib.parse(spec)
        except fields_lib.FieldSpecError as e:
            raise ConfigError(f"config.data.{name}: {e}") from None
    if d.source == SYNTHETIC:
        try:
            synthetic_lib.SyntheticConfig(**d.synthetic.to_dict())
        except ValueError as e:
            raise ConfigError(f"config.data.synthetic: {e}") from None
    else:
        _check_local(d.source, "config.data.source")
    cfg = data_config(d)
    try:
        plan = heldout_plan(cfg)
    except DataError as e:
        raise ConfigError(f"config.data: {e}") from None
    if plan.source != d.source:
        _check_local(plan.source, "config.data.heldout_source")
    if plan.same_rows and not d.allow_heldout_overlap:
        raise ConfigError(overlap_message(plan.same_rows))


def _check_local(source: str, where: str) -> None:
    if (
        source != SYNTHETIC
        and looks_like_path(source)
        and "://" not in source
        and not glob.glob(os.path.expanduser(source))
    ):
        raise ConfigError(
            f"{where}: no file or directory matches {source!r} (relative to "
            f"{os.getcwd()}); give a local .jsonl/.parquet/.arrow file or directory, a Hub "
            "id, or 'synthetic'"
        )


def run_data_config(config) -> dict[str, Any]:
    """`config.data` as a run reads it: the demonstration column only where something uses it
    (DaGRPO anchors, `anchors.per_group > 0`, or an LLM judge's references); otherwise a
    source without that column is fine. `config`: the run's ConfigDict, or the dict its
    `config.json` holds (`gjax.eval` on a checkpoint reads the data as training did)."""
    run = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = dict(run["data"])
    judge = (run.get("reward") or {}).get("judge", "none")
    judge = judge.get("name", "none") if isinstance(judge, Mapping) else judge
    if not (run.get("anchors") or {}).get("per_group", 0) and judge == "none":
        d["demonstration_field"] = ""
    return d


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
    cfg: Mapping[str, Any] | None, tokenizer, *, heldout: bool = False, tools: Sequence = ()
) -> PromptData:
    """``load_rows`` + ``prepare_prompts`` for ``config.data`` (keys of ``DATA_DEFAULTS``).

    ``heldout=True`` builds the held-out set (`heldout_plan`: a carved sample, a
    ``heldout_source`` or ``heldout_split``; its first ``heldout_size`` rows, ``origin`` set)
    instead of the training set (first ``num_examples`` rows of ``split``, less the held-out
    rows). A held-out set of training rows raises unless ``allow_heldout_overlap``.
    ``tools``: the function specs every prompt describes (a tool environment's,
    gjax.envs.prompt_tools; `check_tool_prompt` first checks they leave room for a problem).
    """
    return _build(prepare_prompts, cfg, tokenizer, heldout=heldout, tools=tools)


def build_sharded_prompts(
    cfg: Mapping[str, Any] | None, tokenizer, *, tools: Sequence = (), **hosts: Any
) -> ShardedPrompts:
    """The training split of ``config.data`` as `ShardedPrompts`: each host templates its
    share. ``hosts``: `prepare_sharded_prompts`' process_index / process_count / allgather;
    ``tools`` as in `build_prompt_data`."""
    prepare = functools.partial(prepare_sharded_prompts, **hosts)
    return _build(prepare, cfg, tokenizer, heldout=False, tools=tools)


def check_tool_prompt(cfg: Mapping[str, Any], tokenizer, tools: Sequence) -> int:
    """The prompt tokens the tools' description costs (the prompt of an empty problem with
    `tools` less the one without); a ConfigError if that prompt alone does not fit in
    ``data.max_prompt_len`` with room for a problem."""
    if not tools:
        return 0
    cfg = data_config(cfg)
    limit, template = cfg["max_prompt_len"], cfg["template"]

    def length(specs) -> int:
        text = render_prompt(template, "", tokenizer, specs)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    with_tools = length(tools)
    if with_tools >= limit:
        names = ", ".join(s.get("function", s).get("name", "?") for s in tools)
        raise ConfigError(
            f"the tools' description ({names}) takes {with_tools} prompt tokens with "
            f"data.template={template!r}, leaving no room for a problem within "
            f"config.data.max_prompt_len={limit}. Raise config.data.max_prompt_len (the model must "
            "still fit data.max_prompt_len + rollout.max_new_tokens), use fewer "
            "config.env.tools, or set config.env.tool_prompt='none' to leave the tools out of "
            "the prompt."
        )
    return with_tools - length(())


def _field_map(cfg: Mapping[str, Any]) -> FieldMap:
    return FieldMap(cfg["problem_field"], cfg["answer_field"], cfg["demonstration_field"] or None)


def _load(cfg, source, *, split, subset, num_examples, stats):
    return load_rows(
        source,
        split=split,
        subset=subset,
        num_examples=num_examples,
        seed=cfg["synthetic_seed"],
        synthetic=cfg["synthetic"],
        strict=cfg["strict"],
        stats=stats,
    )


def _problems(rows, spec_text: str) -> list[str | None]:
    """Each row's problem text, whitespace-normalised (None where there is none)."""
    spec = fields_lib.parse(spec_text)
    if spec.column not in rows.column_names:  # prepare_prompts names the missing column
        return [None] * len(rows)
    values = (spec.resolve(v) for v in rows[spec.column])
    return [" ".join(v.split()) if isinstance(v, str) else None for v in values]


def _build(prepare, cfg, tokenizer, *, heldout: bool, tools: Sequence = ()):
    cfg = data_config(cfg)
    size_key = "heldout_size" if heldout else "num_examples"
    if cfg[size_key] is not None and cfg[size_key] <= 0:
        raise DataError(f"data.{size_key} must be positive, got {cfg[size_key]}")
    plan = heldout_plan(cfg)
    if heldout and plan.same_rows and not cfg["allow_heldout_overlap"]:
        raise DataError(overlap_message(plan.same_rows))
    sets = _load_sets(cfg, plan, heldout=heldout)
    rows, fields, stats = (
        (sets.held, plan.fields, sets.held_stats)
        if heldout
        else (sets.train, _field_map(cfg), sets.train_stats)
    )
    data = prepare(
        rows,
        tokenizer,
        fields=fields,
        template=cfg["template"],
        max_prompt_length=cfg["max_prompt_len"],
        strict=cfg["strict"],
        **({"tools": tuple(tools)} if tools else {}),
    )
    skipped = stats.get("skipped_malformed", 0)  # lines that never became rows
    data.stats["rows"] += skipped
    data.stats["skipped_malformed"] += skipped
    if heldout:
        data.origin = {
            "source": plan.source,
            "benchmark": plan.benchmark,
            "subset": plan.subset,
            "split": plan.split,  # None: carved out of data.split of data.source
            "carved": sets.carved,  # {fraction, seed, rows removed from training} or None
            "rows": sets.held_index[data.row_index].tolist(),  # row numbers in that split
            "training_rows_removed_as_duplicates": sets.removed,
            "overlap_allowed": bool(cfg["allow_heldout_overlap"]),
            "overlapping_training_rows": sets.overlap,
            "same_rows": plan.same_rows,
        }
        log.info("held-out set: %d problems of %s", len(data), _describe(plan))
    elif sets.removed:
        log.info("removed %d training row(s) whose problem is a held-out problem", sets.removed)
    return data


@dataclasses.dataclass
class _Sets:
    """The loaded rows of both sets (`None`: not needed for the set being built)."""

    train: Any = None
    held: Any = None
    held_index: np.ndarray | None = None  # each held-out row's number in its split
    train_stats: dict = dataclasses.field(default_factory=dict)
    held_stats: dict = dataclasses.field(default_factory=dict)
    carved: dict | None = None
    overlap: int = 0  # training rows whose problem is a held-out problem
    removed: int = 0  # of those, removed from training


def _load_sets(cfg, plan: HeldoutPlan, *, heldout: bool) -> _Sets:
    """Training rows (less the held-out ones) and held-out rows, as far as the set being
    built needs them: the training set is checked against a held-out set of another origin."""
    sets = _Sets()
    if not (heldout and plan.same_rows):
        sets.train = _load(
            cfg,
            cfg["source"],
            split=cfg["split"],
            subset=cfg["subset"],
            num_examples=cfg["num_examples"],
            stats=sets.train_stats,
        )
    if plan.fraction > 0:
        _carve(sets, plan, cfg)
    elif heldout or not plan.same_rows:
        try:
            sets.held = _load(
                cfg,
                plan.source,
                split=plan.split,
                subset=plan.subset,
                num_examples=cfg["heldout_size"],
                stats=sets.held_stats,
            )
        except DataError as e:
            raise DataError(f"the held-out set ({_describe(plan)}): {e}") from e
        sets.held_index = np.arange(len(sets.held))
    if plan.same_rows:
        sets.overlap = len(sets.held) if sets.held is not None else 0
    elif sets.train is not None and sets.held is not None:
        held_problems = set(_problems(sets.held, plan.fields.problem)) - {None}
        repeated = np.asarray(
            [p in held_problems for p in _problems(sets.train, cfg["problem_field"])], bool
        )
        sets.overlap = int(repeated.sum())
        if sets.overlap and not cfg["allow_heldout_overlap"]:
            sets.train = sets.train.select(np.flatnonzero(~repeated))
            sets.removed = sets.overlap
    return sets


def _carve(sets: _Sets, plan: HeldoutPlan, cfg) -> None:
    """Moves a seeded ``plan.fraction`` of the training rows to the held-out set (its first
    ``heldout_size`` are evaluated; all of them leave training)."""
    n = len(sets.train)
    k = int(round(plan.fraction * n))
    if not 1 <= k < n:
        raise DataError(
            f"data.heldout_fraction={plan.fraction} of {n} training rows holds out {k}; "
            "choose a fraction that leaves at least one row on each side"
        )
    perm = np.random.default_rng(cfg["heldout_seed"]).permutation(n)
    sets.held_index = np.sort(perm[: min(k, cfg["heldout_size"])])
    sets.held = sets.train.select(sets.held_index)
    sets.train = sets.train.select(np.sort(perm[k:]))
    sets.carved = {"fraction": plan.fraction, "seed": cfg["heldout_seed"], "rows_removed": k}


def _describe(plan: HeldoutPlan) -> str:
    if plan.split is None:
        return f"{plan.source}, a {plan.fraction:g} sample of the training split"
    name = f"benchmark {plan.benchmark!r}: " if plan.benchmark else ""
    subset = f" ({plan.subset})" if plan.subset else ""
    return f"{name}{plan.source}{subset}, split {plan.split!r}"


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
