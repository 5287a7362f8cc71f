"""Evaluation benchmarks: a small strict registry of the papers' math test sets.

Each entry (``gjax.data.testsets``; training's ``data.heldout_source`` names them too) says
where the set lives on the Hugging Face Hub (id, split) and which columns hold the problem
and the final answer, as the papers' evaluations read them (DaGRPO Sec. 6, GPG Tables 3-4,
CW-GRPO App. A Table 4, A-GRAE App. C.2):

==================  ===============================  =====  ======================  =====
name                hub id                           split  problem / answer        size
==================  ===============================  =====  ======================  =====
``math500``         HuggingFaceH4/MATH-500           test   problem / answer          500
``aime24``          HuggingFaceH4/aime_2024          train  problem / answer           30
``aime25``          math-ai/aime25                   test   problem / answer           30
``amc23``           knoveleng/AMC-23                 train  problem / answer           40
``minerva``         knoveleng/Minerva-Math           train  problem / solution        272
``olympiadbench``   knoveleng/OlympiadBench          train  question / answer         675
``heldout``         the embedded synthetic task's held-out split (offline; no download)
==================  ===============================  =====  ======================  =====

(Minerva-Math's ``solution`` column holds the short final answer.) ``num_samples`` is the
papers' default n per problem: 32 on the 30-40-problem sets (avg@32, DaGRPO Sec. 6), 4 on
the larger ones (A-GRAE App. C.2).

A benchmark is named alone (``aime24``: loaded from the Hub) or with a local copy in its own
format (``aime24=/data/aime24.jsonl``: a ``.jsonl``/``.json``/``.parquet``/``.arrow``/
``.csv`` file, glob or directory, read by ``gjax.data.sources.load_rows``). Nothing is
filtered away: a problem whose prompt is too long is an error, not a silent skip, since a
skipped problem changes the score.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gjax.data.builders import build_prompt_data, data_config
from gjax.data.prompts import FieldMap, PromptData, prepare_prompts
from gjax.data.sources import DataError, load_rows
from gjax.data.testsets import BENCHMARKS, HELDOUT, HELDOUT_NUM_SAMPLES, Benchmark

__all__ = [
    "BENCHMARKS",
    "HELDOUT",
    "HELDOUT_NUM_SAMPLES",
    "Benchmark",
    "BenchmarkSpec",
    "default_num_samples",
    "load_benchmark",
    "parse_specs",
    "source_of",
]


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """One item of ``--benchmarks``: a registered name and, optionally, a local copy."""

    name: str
    path: str | None = None


def parse_specs(text: str) -> list[BenchmarkSpec]:
    """``"math500,aime24=/data/aime24.jsonl,heldout"`` -> specs; unknown or repeated names
    raise a ``DataError`` naming the valid ones."""
    specs, seen = [], set()
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, path = item.partition("=")
        name, path = name.strip(), path.strip() or None
        if name != HELDOUT and name not in BENCHMARKS:
            raise DataError(
                f"--benchmarks: unknown benchmark {name!r}; valid: "
                f"{', '.join([*BENCHMARKS.names(), HELDOUT])} (a local copy: name=path)"
            )
        if name == HELDOUT and path:
            raise DataError(
                f"--benchmarks: {HELDOUT!r} is the run's own held-out split and takes no path"
            )
        if name in seen:
            raise DataError(f"--benchmarks: {name!r} is listed twice")
        seen.add(name)
        specs.append(BenchmarkSpec(name, path))
    if not specs:
        raise DataError(
            "--benchmarks is empty; name one or more of "
            f"{', '.join([*BENCHMARKS.names(), HELDOUT])}"
        )
    return specs


def load_benchmark(
    spec: BenchmarkSpec,
    tokenizer,
    *,
    template: str,
    max_prompt_len: int,
    heldout_data: Mapping[str, Any] | None = None,
) -> PromptData:
    """The benchmark's prompts, templated and tokenized, every row kept.

    ``heldout_data`` is the ``config.data`` whose held-out split ``heldout`` means (the
    run's own, or the embedded task's); its template is used for ``heldout``.
    """
    if spec.name == HELDOUT:
        cfg = data_config(heldout_data)
        cfg["max_prompt_len"] = max(cfg["max_prompt_len"], max_prompt_len)
        data = build_prompt_data(cfg, tokenizer, heldout=True)
    else:
        b = BENCHMARKS.get(spec.name)
        try:
            rows = load_rows(spec.path or b.hub_id, split=b.split, subset=b.subset)
        except DataError as e:
            if spec.path:
                raise
            raise DataError(
                f"benchmark {spec.name!r}: {b.hub_id} could not be loaded from the Hugging Face "
                f"Hub ({e.__cause__ or e}). Where there is internet, save it with "
                f"`datasets.load_dataset({b.hub_id!r}, split={b.split!r}).to_json("
                f"'{spec.name}.jsonl')` and pass --benchmarks={spec.name}={spec.name}.jsonl"
            ) from e
        missing = [f for f in (b.problem_field, b.answer_field) if f not in rows.column_names]
        if missing:
            raise DataError(
                f"benchmark {spec.name!r} ({spec.path or b.hub_id}) has no column(s) {missing} "
                f"(columns: {rows.column_names}); a copy must keep the format of {b.hub_id}: "
                f"the problem in {b.problem_field!r}, the answer in {b.answer_field!r}"
            )
        data = prepare_prompts(
            rows,
            tokenizer,
            fields=FieldMap(b.problem_field, b.answer_field),
            template=template,
            max_prompt_length=max_prompt_len,
        )
    dropped = data.stats["rows"] - data.stats["kept"]
    if dropped:
        raise DataError(
            f"benchmark {spec.name!r}{f' ({spec.path})' if spec.path else ''}: {dropped} of "
            f"{data.stats['rows']} problems cannot be evaluated ({data.stats}); every problem "
            "counts in the score, so fix the rows or raise --max_prompt_len"
        )
    return data


def source_of(name: str) -> str:
    """Where a registered benchmark is read from when no local copy is given."""
    return "config.data held-out split" if name == HELDOUT else BENCHMARKS.get(name).hub_id


def default_num_samples(name: str) -> int:
    return HELDOUT_NUM_SAMPLES if name == HELDOUT else BENCHMARKS.get(name).num_samples
