"""Prompts from rows: map fields, template, tokenize, filter; the containers batches come from.

    data = prepare_prompts(rows, tokenizer, fields=FieldMap(...), template="plain",
                           max_prompt_length=32)
    data.take(positions, epoch)   # PromptBatch: prompt_ids_PxS, prompt_mask_PxS, raw strings

Bad input policy (the counts are in ``PromptData.stats``):

* a mapped field missing from the columns -> ``DataError`` naming the field, the available
  columns and the config key to set (``data.<name>_field``);
* an empty / whitespace-only problem -> counted skip ``skipped_empty``;
* a malformed row (problem not a string; answer missing, empty or not a string/number;
  a mapped demonstration missing or not a string) -> counted skip ``skipped_malformed``,
  or ``DataError`` naming the row when ``strict=True``;
* a templated prompt longer than ``max_prompt_length`` tokens -> counted skip
  ``skipped_too_long``;
* nothing left after filtering -> ``DataError`` with the counts.

Training builds ``ShardedPrompts`` instead of ``PromptData`` (``prepare_sharded_prompts``):
which rows pass the length filter is agreed by all-gathering one int a row after each host
templated a 1/H slice, and a host templates a batch's prompts only when its block takes them.
The batches are the same as ``PromptData``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gjax import multihost
from gjax.data import fields as fields_lib
from gjax.data.sources import DataError
from gjax.data.templates import TEMPLATES, render_prompt


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Where each field lives, as field specs (``gjax.data.fields``: a column, a nested path
    like ``prompt[-1].content``, or ``boxed(solution)``); ``demonstration=None``: none."""

    problem: str = "problem"
    answer: str = "answer"
    demonstration: str | None = None


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """This host's ``P`` prompts: ids left-padded to ``S = max_prompt_length``."""

    prompt_ids_PxS: np.ndarray  # int32, pad_id on the left
    prompt_mask_PxS: np.ndarray  # int32, 1 on real tokens
    prompts: list[str]
    problems: list[str]
    answers: list[str]
    demonstrations: list[str]
    row_index_P: np.ndarray  # index of each prompt in the loaded rows
    epoch: int

    def __len__(self) -> int:
        return len(self.problems)


@dataclasses.dataclass
class PromptData:
    """Templated, tokenized prompts that passed the filters, in source order."""

    prompt_ids: list[np.ndarray]  # int32 token ids per prompt, unpadded
    prompts: list[str]  # templated prompt text
    problems: list[str]
    answers: list[str]
    demonstrations: list[str]  # "" where the data has none
    row_index: np.ndarray  # [n] index of each kept row in the loaded rows
    max_prompt_length: int
    pad_id: int
    stats: dict[str, int]
    # Where the rows came from (``gjax.data.builders``; the held-out set's goes to
    # summary.json): source, split, the source rows, what was removed from training.
    origin: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def has_demonstrations(self) -> bool:
        return any(self.demonstrations)

    def take(self, positions: np.ndarray, epoch: int) -> PromptBatch:
        """The prompts at `positions` (indices into the kept prompts) as a batch."""
        entries = [
            (
                self.problems[r],
                self.answers[r],
                self.demonstrations[r],
                self.prompts[r],
                self.prompt_ids[r],
            )
            for r in positions
        ]
        return _batch(
            entries, self.row_index[positions], self.max_prompt_length, self.pad_id, epoch
        )


def _specs(fields: FieldMap) -> list[fields_lib.FieldSpec]:
    """The parsed specs of the mapped fields (problem, answer[, demonstration])."""
    out = []
    for name in ("problem", "answer", "demonstration"):
        text = getattr(fields, name)
        if text is None:
            continue
        try:
            out.append(fields_lib.parse(text))
        except fields_lib.FieldSpecError as e:
            raise DataError(f"data.{name}_field: {e}") from None
    return out


def _check_columns(columns: Sequence[str], fields: FieldMap) -> None:
    for name, spec in zip(("problem", "answer", "demonstration"), _specs(fields)):
        if spec.column not in columns:
            raise DataError(
                f"the data has no column {spec.column!r} for the {name} field "
                f"({spec.text!r}); available columns: {sorted(columns)}. Set data.{name}_field "
                "to one of them (a nested value: 'col.key' or 'col[-1].key'; an answer inside a "
                "solution: 'boxed(col)')"
                + (' (or "" if the data has no demonstrations)' if name == "demonstration" else "")
            )


def _iter_mapped(rows, fields: FieldMap) -> Iterator[dict]:
    """Per row, each mapped field's spec -> its value (column-wise from a ``datasets.Dataset``:
    fast)."""
    specs = _specs(fields)
    if hasattr(rows, "column_names"):
        columns = [rows[s.column] for s in specs]
        for values in zip(*columns):
            yield {s.text: s.resolve(v) for s, v in zip(specs, values)}
    else:
        for row in rows:
            if not isinstance(row, Mapping):
                raise DataError(f"rows must be mappings, got {type(row).__name__}: {row!r:.80}")
            yield {s.text: s.get(row) for s in specs}


def _clean_row(row: Mapping, fields: FieldMap) -> tuple[str, str, str] | str:
    """(problem, answer, demonstration), or the reason the row is rejected."""
    problem = row.get(fields.problem)
    if not isinstance(problem, str):
        return f"malformed: {fields.problem!r} is {type(problem).__name__}, not a string"
    if not problem.strip():
        return "empty"
    answer = row.get(fields.answer)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"malformed: {fields.answer!r} is {type(answer).__name__}, not a string or number"
    answer = str(answer).strip()
    if not answer:
        return f"malformed: {fields.answer!r} is empty"
    demonstration = ""
    if fields.demonstration is not None:
        demonstration = row.get(fields.demonstration)
        if not isinstance(demonstration, str) or not demonstration.strip():
            return f"malformed: {fields.demonstration!r} is missing or not a non-empty string"
    return problem, answer, demonstration


def _renderer(template: str, tools: Sequence[Mapping[str, Any]]):
    """`fn(problem, tokenizer) -> prompt`: the template, telling the policy about `tools`
    (gjax.data.templates.render_prompt; none: the template itself)."""
    if not tools:
        return TEMPLATES.get(template)
    specs = tuple(tools)
    return lambda problem, tokenizer: render_prompt(template, problem, tokenizer, specs)


def _check_inputs(
    rows, tokenizer, fields: FieldMap, template: str, max_prompt_length: int, tools=()
):
    """Fails fast on a bad length, tokenizer or field map; returns the template's renderer."""
    if max_prompt_length <= 0:
        raise DataError(f"data.max_prompt_len must be positive, got {max_prompt_length}")
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; set tokenizer.pad_token")
    TEMPLATES.get(template)  # an unknown name lists the valid ones
    render = _renderer(template, tools)
    if hasattr(rows, "column_names"):
        columns = rows.column_names
    else:
        bad = next((r for r in rows if not isinstance(r, Mapping)), None)
        if bad is not None:
            raise DataError(f"rows must be mappings, got {type(bad).__name__}: {bad!r:.80}")
        columns = sorted({k for r in rows for k in r})
    _check_columns(columns, fields)
    return render


def _subset(rows, index) -> Any:
    """The rows at `index` (a range or int array), in that order, of a Dataset or a list."""
    if hasattr(rows, "select"):
        return rows.select(index)
    return [rows[int(i)] for i in index]


def _encode(rows, tokenizer, fields: FieldMap, render, add_special_tokens: bool) -> list:
    """Per row: ``(problem, answer, demonstration, prompt, ids)``, or why it is rejected."""
    cleaned = [_clean_row(row, fields) for row in _iter_mapped(rows, fields)]
    prompts = [render(c[0], tokenizer) for c in cleaned if not isinstance(c, str)]
    encoded = (
        tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"] if prompts else []
    )
    good = iter(zip(prompts, encoded))
    return [c if isinstance(c, str) else (*c, *next(good)) for c in cleaned]


# A row's outcome (`_code`): the templated prompt's length in tokens, or one of these.
_EMPTY, _MALFORMED = -1, -2


def _code(entry) -> int:
    if isinstance(entry, str):
        return _EMPTY if entry == "empty" else _MALFORMED
    return len(entry[4])


def _filter(codes: np.ndarray, max_prompt_length: int, *, strict: bool, reason):
    """``(kept row indices, counts)`` from the rows' codes; with ``strict``, a DataError naming
    the first malformed row (``reason(i)`` says what is wrong with row ``i``). An empty
    templated prompt counts as too long."""
    malformed = np.flatnonzero(codes == _MALFORMED)
    if strict and malformed.size:
        i = int(malformed[0])
        raise DataError(f"row {i}: {reason(i)}; fix the data or set data.strict=False")
    keep = np.flatnonzero((codes > 0) & (codes <= max_prompt_length))
    stats = {
        "rows": len(codes),
        "skipped_empty": int((codes == _EMPTY).sum()),
        "skipped_malformed": len(malformed),
        "skipped_too_long": int((codes >= 0).sum()) - len(keep),
        "kept": len(keep),
    }
    if not len(keep):
        raise DataError(
            f"no prompts left after filtering: {stats}. Check data.*_field, data.template and "
            f"data.max_prompt_len={max_prompt_length}"
        )
    return keep, stats


def _batch(entries: list, index: np.ndarray, width: int, pad_id: int, epoch: int) -> PromptBatch:
    """A `PromptBatch` of `_encode` entries (all kept), rows `index` of the loaded rows."""
    ids, mask = left_pad([np.asarray(e[4], np.int32) for e in entries], width, pad_id)
    return PromptBatch(
        prompt_ids_PxS=ids,
        prompt_mask_PxS=mask,
        prompts=[e[3] for e in entries],
        problems=[e[0] for e in entries],
        answers=[e[1] for e in entries],
        demonstrations=[e[2] for e in entries],
        row_index_P=np.asarray(index, np.int64),
        epoch=epoch,
    )


def prepare_prompts(
    rows,
    tokenizer,
    *,
    fields: FieldMap = FieldMap(),
    template: str = "plain",
    max_prompt_length: int,
    strict: bool = False,
    add_special_tokens: bool = False,
    tools: Sequence[Mapping[str, Any]] = (),
) -> PromptData:
    """Maps fields, applies the template, tokenizes and filters (see the module docstring).

    Args:
      rows: a ``datasets.Dataset`` or a list of dicts.
      tokenizer: a ``transformers`` tokenizer with a pad token.
      max_prompt_length: longest prompt kept, in tokens; also the padded width ``S``.
      strict: raise on a malformed row instead of skipping it.
      add_special_tokens: let the tokenizer add its BOS/EOS (the templates already hold
        whatever the model needs, so off by default).
      tools: JSON-schema function specs the prompts describe to the policy (a tool
        environment's; gjax.data.templates.render_prompt); empty: the template alone.
    """
    render = _check_inputs(rows, tokenizer, fields, template, max_prompt_length, tools)
    entries = _encode(rows, tokenizer, fields, render, add_special_tokens)
    codes = np.asarray([_code(e) for e in entries], np.int64)
    keep, stats = _filter(codes, max_prompt_length, strict=strict, reason=entries.__getitem__)
    kept = [entries[j] for j in keep]
    return PromptData(
        prompt_ids=[np.asarray(e[4], np.int32) for e in kept],
        prompts=[e[3] for e in kept],
        problems=[e[0] for e in kept],
        answers=[e[1] for e in kept],
        demonstrations=[e[2] for e in kept],
        row_index=keep.astype(np.int64),
        max_prompt_length=max_prompt_length,
        pad_id=int(tokenizer.pad_token_id),
        stats=stats,
    )


@dataclasses.dataclass
class ShardedPrompts:
    """The training prompts, with no host holding (or templating) them all.

    Which rows pass the filters depends on their templated length, and every host must agree
    on it to cut the same global batches. So each of the H hosts cleans, templates and
    tokenizes one contiguous 1/H slice of the loaded rows, once, and the hosts all-gather the
    per-row outcome (one int a row); `row_index` (the kept rows) and `stats` are then the same
    on every host. A batch's prompts are templated and tokenized again by the host whose
    block takes them (`take`: P/H rows a step), so a host holds only the loaded rows
    (memory-mapped Arrow for a ``datasets.Dataset``) and its own batches. The batches are
    exactly `PromptData`'s for the same rows (`PromptIterator` takes either).
    """

    rows: Any  # the loaded rows: a datasets.Dataset or a list of dicts
    row_index: np.ndarray  # [n] index of each kept row in `rows`, the same on every host
    tokenizer: Any
    fields: FieldMap
    template: str
    add_special_tokens: bool
    max_prompt_length: int
    pad_id: int
    stats: dict[str, int]
    tools: tuple = ()  # the function specs the prompts describe (render_prompt)

    def __len__(self) -> int:
        return len(self.row_index)

    @property
    def has_demonstrations(self) -> bool:  # a mapped demonstration is non-empty on every row
        return self.fields.demonstration is not None

    def take(self, positions: np.ndarray, epoch: int) -> PromptBatch:
        render = _renderer(self.template, self.tools)
        index = self.row_index[positions]
        entries = _encode(
            _subset(self.rows, index), self.tokenizer, self.fields, render, self.add_special_tokens
        )
        bad = [(i, e) for i, e in zip(index, entries) if isinstance(e, str)]
        if bad:  # the rows changed under the run, or templating is not deterministic: a bug
            raise AssertionError(f"kept row {bad[0][0]} no longer passes the filters: {bad[0][1]}")
        return _batch(entries, index, self.max_prompt_length, self.pad_id, epoch)


def prepare_sharded_prompts(
    rows,
    tokenizer,
    *,
    fields: FieldMap = FieldMap(),
    template: str = "plain",
    max_prompt_length: int,
    strict: bool = False,
    add_special_tokens: bool = False,
    process_index: int | None = None,
    process_count: int | None = None,
    allgather=None,
    tools: Sequence[Mapping[str, Any]] = (),
) -> ShardedPrompts:
    """`prepare_prompts`' filters and counts with each host templating only its share.

    ``allgather(x)`` stacks every host's ``x`` on a new leading axis in process order
    (default: ``gjax.multihost.allgather`` over ``jax.distributed``; every host must call
    this function). Errors (strict mode, nothing kept) are raised on every host alike,
    after the gather, so no host is left waiting in it.
    """
    render = _check_inputs(rows, tokenizer, fields, template, max_prompt_length, tools)

    def codes_of(lo, hi):
        entries = _encode(
            _subset(rows, range(lo, hi)), tokenizer, fields, render, add_special_tokens
        )
        return np.asarray([_code(e) for e in entries], np.int64)

    hosts = {"index": process_index, "count": process_count}
    codes = multihost.split_work(
        len(rows), codes_of, **hosts, gather=allgather or multihost.allgather
    )

    def reason(i):
        return _clean_row(next(_iter_mapped(_subset(rows, [i]), fields)), fields)

    keep, stats = _filter(codes, max_prompt_length, strict=strict, reason=reason)
    return ShardedPrompts(
        rows=rows,
        row_index=keep.astype(np.int64),
        tokenizer=tokenizer,
        fields=fields,
        template=template,
        add_special_tokens=add_special_tokens,
        max_prompt_length=max_prompt_length,
        pad_id=int(tokenizer.pad_token_id),
        stats=stats,
        tools=tuple(tools),
    )


def left_pad(seqs: Sequence[np.ndarray], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids_PxS, mask_PxS)``: sequences right-aligned in ``width`` columns, int32."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
        if len(s) > width:
            raise DataError(f"sequence of length {len(s)} does not fit width {width}")
        if len(s):
            ids[r, width - len(s) :] = s
            mask[r, width - len(s) :] = 1
    return ids, mask


def encode_completions(
    tokenizer, texts: Sequence[str], max_length: int, *, add_eos: bool = True
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids_BxT, mask_BxT, num_truncated)``: completions (e.g. demonstrations used as
    DaGRPO anchors or SFT targets) right-padded to ``T = max_length``, int32.

    ``add_eos`` appends the tokenizer's eos; a completion longer than ``max_length`` keeps its
    first ``max_length`` tokens (eos lost) and is counted in ``num_truncated``.
    """
    if max_length <= 0:
        raise DataError(f"max_length must be positive, got {max_length}")
    if add_eos and tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; set tokenizer.eos_token")
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
    ids = np.full((len(encoded), max_length), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(encoded), max_length), np.int32)
    truncated = 0
    for r, seq in enumerate(encoded):
        seq = list(seq) + ([tokenizer.eos_token_id] if add_eos else [])
        truncated += len(seq) > max_length
        seq = seq[:max_length]
        ids[r, : len(seq)] = seq
        mask[r, : len(seq)] = 1
    return ids, mask, truncated
