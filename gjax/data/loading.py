"""Prompt data: load rows, map fields, template, tokenize, filter, then iterate resumably.

Three steps, each usable alone::

    rows   = load_rows("synthetic" | "path/to/file.jsonl|.parquet|.arrow|dir" | "hub/id", ...)
    data   = prepare_prompts(rows, tokenizer, fields=FieldMap(...), template="plain",
                             max_prompt_length=32)
    it     = PromptIterator(data, global_batch_size=P, seed=0)
    batch  = next(it)          # PromptBatch: prompt_ids_PxS, prompt_mask_PxS, raw strings
    it.state()                 # {"epoch": 0, "index": P, ...}: store it in the checkpoint
    PromptIterator(data, global_batch_size=P, seed=0, state=saved)   # same next batches

or all at once from ``config.data`` (keys of ``DATA_DEFAULTS``, as in ``gjax/schema.py``):
``build_prompt_iterator(config.data, tok, global_batch_size=P)`` and
``build_prompt_data(config.data, tok, heldout=True)`` for held-out evaluation.

Bad input policy (the counts are in ``PromptData.stats``):

* a JSON-lines line that is not UTF-8 or not one JSON object -> ``DataError`` naming the
  file and line when ``strict=True``, else a counted skip ``skipped_malformed``;
* a mapped field missing from the columns -> ``DataError`` naming the field, the available
  columns and the config key to set (``data.<name>_field``);
* an empty / whitespace-only problem -> counted skip ``skipped_empty``;
* a malformed row (problem not a string; answer missing, empty or not a string/number;
  a mapped demonstration missing or not a string) -> counted skip ``skipped_malformed``,
  or ``DataError`` naming the row when ``strict=True``;
* a templated prompt longer than ``max_prompt_length`` tokens -> counted skip
  ``skipped_too_long``;
* nothing left after filtering -> ``DataError`` with the counts.

Order and sharding. Epoch ``e`` visits the kept rows in the order
``np.random.default_rng([seed, e]).permutation(n)`` (or in file order with
``shuffle=False``); global batch ``k`` is rows ``[k*P, (k+1)*P)`` of that order and host
``h`` of ``H`` takes its ``h``-th contiguous slice of ``P/H`` rows, so the hosts partition
every global batch. The incomplete last global batch of an epoch is dropped, so every host
runs the same number of steps.

Training builds ``ShardedPrompts`` instead of ``PromptData`` (``build_sharded_prompts``):
which rows pass the length filter is agreed by all-gathering one int a row after each host
templated a 1/H slice, and a host templates a batch's prompts only when its block takes them.
The batches are the same as ``PromptData``'s.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import glob
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gjax import multihost
from gjax.data import synthetic as synthetic_lib
from gjax.data.templates import TEMPLATES
from gjax.errors import ConfigError, UserError
from gjax.models.hf_io import cache_dir

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
# Default sizes of the built-in synthetic source when ``num_examples`` is not given.
SYNTHETIC_DEFAULT_SIZES = {"train": 8192, "test": 256}


class DataError(UserError, ValueError):
    """Bad data or data configuration; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Column names holding each field; ``demonstration=None`` means the data has none."""

    problem: str = "problem"
    answer: str = "answer"
    demonstration: str | None = None


# --------------------------------------------------------------------------- rows


def _hub_error(source: str, err: Exception) -> DataError:
    offline = any(os.environ.get(k) == "1" for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    hint = (
        "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1) and it is not in the local cache"
        if offline
        else "the Hub could not be reached or has no such dataset"
    )
    return DataError(
        f"could not load dataset {source!r} from the Hugging Face Hub: {hint} "
        f"({type(err).__name__}: {err}). Download it where there is internet and set "
        "data.source to the local .jsonl/.parquet/.arrow file or directory, or use "
        f"data.source='{SYNTHETIC}' for the built-in task."
    )


def _looks_like_path(source: str) -> bool:
    return (
        os.path.exists(source)
        or "://" in source
        or source.startswith(("/", "./", "../", "~"))
        or os.path.splitext(source)[1] in _FORMATS
        or any(c in source for c in "*?[")
    )


def _json_lines(files: Sequence[str], *, strict: bool, stats: dict | None):
    """The rows of JSON-lines files, read line by line: a line that is not UTF-8 or not one
    JSON object raises a DataError naming the file and line (``strict``) or is skipped and
    counted in ``stats["skipped_malformed"]``."""
    import datasets

    rows, bad = [], []
    for path in files:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8").rstrip("\r\n"))
                except UnicodeDecodeError as e:
                    why = f"byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8"
                except json.JSONDecodeError as e:
                    why = f"not valid JSON: {e.msg} at column {e.colno}"
                else:
                    if isinstance(row, dict):
                        rows.append(row)
                        continue
                    why = f"a JSON {type(row).__name__}, not an object"
                if strict:
                    raise DataError(
                        f"{path}, line {line_no} (row {line_no}): {why}. Fix the line, or set "
                        "data.strict=False to skip and count such rows."
                    )
                bad.append(f"{path}, line {line_no}: {why}")
    if bad:
        log.warning("skipped %d malformed line(s); the first: %s", len(bad), bad[0])
        if stats is not None:
            stats["skipped_malformed"] = stats.get("skipped_malformed", 0) + len(bad)
    if not rows:
        raise DataError(f"no readable rows in {list(files)[:5]}: {bad[:3]}")
    try:
        return datasets.Dataset.from_list(rows)
    except Exception as err:
        raise DataError(
            f"the rows of {list(files)[:5]} do not form one table: {type(err).__name__}: {err}"
        ) from err


def _is_utf8(path: str) -> bool:
    """Whether a file decodes as UTF-8, read in 16 MiB pieces (a corpus never held whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        try:
            while piece := f.read(16 << 20):
                decoder.decode(piece)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return False
    return True


def _remote_files(source: str) -> list[str]:
    """Local copies of the data files at a URL (gs://...): the file, a glob's matches, or a
    directory's files."""
    from etils import epath

    if any(c in source for c in "*?["):
        scheme, rest = source.split("://", 1)
        bucket, _, pattern = rest.partition("/")
        found = epath.Path(f"{scheme}://{bucket}").glob(pattern)
    else:
        p = epath.Path(source)
        found, dirs = ([], [p]) if p.is_dir() else ([p] if p.exists() else [], [])
        while dirs:  # a directory's files, subdirectories included
            for child in dirs.pop().iterdir():
                (dirs if child.is_dir() else found).append(child)
    urls = sorted(str(f) for f in found if os.path.splitext(f.name)[1] in _FORMATS)
    return [_cached_copy(url) for url in urls]


def _cached_copy(url: str) -> str:
    """A local copy of a remote data file under the gjax cache, refreshed when its size
    changes (datasets then reads it as any local file, also with HF_DATASETS_OFFLINE=1)."""
    import shutil

    from etils import epath

    scheme, rest = url.split("://", 1)
    target = os.path.join(cache_dir(), "remote", scheme, rest)
    src = epath.Path(url)
    if not (os.path.exists(target) and os.path.getsize(target) == src.stat().length):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with src.open("rb") as fin, open(target + ".partial", "wb") as fout:
            shutil.copyfileobj(fin, fout, length=16 << 20)
        os.replace(target + ".partial", target)
    return target


def _load_local(source: str, split: str, *, strict: bool = False, stats: dict | None = None):
    import datasets

    path = os.path.expanduser(source)
    if "://" in source:  # gs://: listed and copied to the local cache through epath/gcsfs
        files = _remote_files(source)
    elif os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"{source!r} has splits {sorted(ds)}, not {split!r}; set data.split"
                    )
                ds = ds[split]
            return ds
        files = sorted(
            f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f)
        )
        files = [f for f in files if os.path.splitext(f)[1] in _FORMATS]
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise DataError(
            f"no data files at {source!r}; expected a file or directory with one of "
            f"{sorted(_FORMATS)} (or a datasets.save_to_disk directory)"
        )
    kinds = {_FORMATS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(
            f"{source!r} must hold files of one format among {sorted(_FORMATS)}, got {files[:5]}"
        )
    kind = kinds.pop()
    if kind == "arrow":
        return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
    if kind == "json" and not all(_is_utf8(f) for f in files):
        # Arrow stores undecodable bytes and fails later, naming no file or row.
        return _json_lines(files, strict=strict, stats=stats)
    try:
        return datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as err:
        if kind == "json":  # find the bad line(s): name them, or skip and count them
            return _json_lines(files, strict=strict, stats=stats)
        raise DataError(
            f"could not read {source!r} as {kind}: {type(err).__name__}: {err}"
        ) from err


def load_rows(
    source: str,
    *,
    split: str = "train",
    subset: str | None = None,
    num_examples: int | None = None,
    seed: int = 0,
    synthetic: synthetic_lib.SyntheticConfig | Mapping | None = None,
    strict: bool = False,
    stats: dict | None = None,
):
    """Loads raw rows as a ``datasets.Dataset``.

    Args:
      source: ``"synthetic"`` (the built-in task), a local file / glob / directory
        (``.jsonl``, ``.json``, ``.parquet``, ``.arrow``, ``.csv`` or a ``save_to_disk``
        directory; ``split`` only picks a split of a saved ``DatasetDict``), or a Hub id.
      split: dataset split; for ``synthetic`` "train" or "test" (alias "heldout"), disjoint
        by construction.
      subset: the Hub configuration name (``load_dataset(source, subset)``).
      num_examples: keep the first ``num_examples`` rows (``synthetic``: how many to draw,
        default ``SYNTHETIC_DEFAULT_SIZES[split]``).
      seed: the synthetic stream's seed.
      synthetic: ``SyntheticConfig`` or a mapping of its fields (difficulty knobs).
      strict: a JSON-lines line that is not UTF-8 or not a JSON object raises (naming the file
        and line) instead of being skipped and counted in ``stats["skipped_malformed"]``.
      stats: a dict that receives those counts (``build_prompt_data`` merges them).
    """
    import datasets

    if num_examples is not None and num_examples <= 0:
        raise DataError(f"data.num_examples must be positive, got {num_examples}")
    if source == SYNTHETIC:
        if isinstance(synthetic, Mapping):
            valid = [f.name for f in dataclasses.fields(synthetic_lib.SyntheticConfig)]
            unknown = sorted(set(synthetic) - set(valid))
            if unknown:
                raise DataError(f"unknown data.synthetic keys {unknown}; valid: {valid}")
            synthetic = synthetic_lib.SyntheticConfig(**dict(synthetic))
        cfg = synthetic or synthetic_lib.SyntheticConfig()
        split = {"heldout": "test"}.get(split, split)
        if split not in synthetic_lib.SPLITS:
            raise DataError(
                f"synthetic data has splits {synthetic_lib.SPLITS} (alias 'heldout' for 'test'), "
                f"not {split!r}; set data.split / data.heldout_split"
            )
        num = num_examples or SYNTHETIC_DEFAULT_SIZES[split]
        problems = synthetic_lib.generate(num, split, seed=seed, config=cfg)
        return datasets.Dataset.from_list([p.as_dict() for p in problems])
    if _looks_like_path(source):
        ds = _load_local(source, split, strict=strict, stats=stats)
    else:
        try:
            ds = datasets.load_dataset(source, subset, split=split)
        except Exception as err:
            raise _hub_error(source, err) from err
    if num_examples is not None:
        ds = ds.select(range(min(num_examples, len(ds))))
    return ds


# --------------------------------------------------------------------------- prompts


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


def _check_columns(columns: Sequence[str], fields: FieldMap) -> None:
    for name in ("problem", "answer", "demonstration"):
        column = getattr(fields, name)
        if column is not None and column not in columns:
            raise DataError(
                f"the data has no column {column!r} for the {name} field; available columns: "
                f"{sorted(columns)}. Set data.{name}_field to one of them"
                + (' (or "" if the data has no demonstrations)' if name == "demonstration" else "")
            )


def _iter_mapped(rows, fields: FieldMap) -> Iterator[dict]:
    """Rows restricted to the mapped columns (column-wise from a ``datasets.Dataset``: fast)."""
    names = [c for c in (fields.problem, fields.answer, fields.demonstration) if c is not None]
    if hasattr(rows, "column_names"):
        columns = [rows[c] for c in names]
        for values in zip(*columns):
            yield dict(zip(names, values))
    else:
        for row in rows:
            if not isinstance(row, Mapping):
                raise DataError(f"rows must be mappings, got {type(row).__name__}: {row!r:.80}")
            yield row


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


def _check_inputs(rows, tokenizer, fields: FieldMap, template: str, max_prompt_length: int):
    """Fails fast on a bad length, tokenizer or field map; returns the template's renderer."""
    if max_prompt_length <= 0:
        raise DataError(f"data.max_prompt_len must be positive, got {max_prompt_length}")
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; set tokenizer.pad_token")
    render = TEMPLATES.get(template)
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
) -> PromptData:
    """Maps fields, applies the template, tokenizes and filters (see the module docstring).

    Args:
      rows: a ``datasets.Dataset`` or a list of dicts.
      tokenizer: a ``transformers`` tokenizer with a pad token.
      max_prompt_length: longest prompt kept, in tokens; also the padded width ``S``.
      strict: raise on a malformed row instead of skipping it.
      add_special_tokens: let the tokenizer add its BOS/EOS (the templates already hold
        whatever the model needs, so off by default).
    """
    render = _check_inputs(rows, tokenizer, fields, template, max_prompt_length)
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

    def __len__(self) -> int:
        return len(self.row_index)

    @property
    def has_demonstrations(self) -> bool:  # a mapped demonstration is non-empty on every row
        return self.fields.demonstration is not None

    def take(self, positions: np.ndarray, epoch: int) -> PromptBatch:
        render = TEMPLATES.get(self.template)
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
) -> ShardedPrompts:
    """`prepare_prompts`' filters and counts with each host templating only its share.

    ``allgather(x)`` stacks every host's ``x`` on a new leading axis in process order
    (default: ``gjax.multihost.allgather`` over ``jax.distributed``; every host must call
    this function). Errors (strict mode, nothing kept) are raised on every host alike,
    after the gather, so no host is left waiting in it.
    """
    render = _check_inputs(rows, tokenizer, fields, template, max_prompt_length)

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


# --------------------------------------------------------------------------- iteration


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


class PromptIterator(Iterator[PromptBatch]):
    """Deterministic, per-host sharded, resumable batches of prompts (see module docstring).

    ``state()`` is a small dict ``{"epoch", "index", "num_rows", "seed"}`` (``index`` counts
    global rows consumed in the epoch); passing it back as ``state=`` continues with exactly
    the batches the saved iterator would have produced next.
    """

    def __init__(
        self,
        data: PromptData | ShardedPrompts,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        num_epochs: int | None = None,
        state: Mapping[str, Any] | None = None,
    ):
        if process_index is None or process_count is None:
            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise DataError(
                f"need 0 <= process_index < process_count, got {process_index}, {process_count}"
            )
        if global_batch_size <= 0 or global_batch_size % process_count:
            raise DataError(
                f"the global prompt batch size ({global_batch_size}) must be a positive multiple "
                f"of the process count ({process_count})"
            )
        if global_batch_size > len(data):
            raise DataError(
                f"the global prompt batch size ({global_batch_size}) exceeds the {len(data)} "
                f"prompts kept ({data.stats}); use more data or a smaller batch"
            )
        if num_epochs is not None and num_epochs <= 0:
            raise DataError(f"num_epochs must be positive or None, got {num_epochs}")
        self.data = data
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.num_epochs = num_epochs
        self.steps_per_epoch = len(data) // global_batch_size
        self._epoch, self._index = 0, 0
        self._order_epoch, self._order = -1, None
        if state is not None:
            self.restore(state)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = len(self.data)
            self._order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def state(self) -> dict[str, int]:
        return {
            "epoch": self._epoch,
            "index": self._index,
            "num_rows": len(self.data),
            "seed": self.seed,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        missing = {"epoch", "index"} - set(state)
        if missing:
            raise DataError(f"data state {dict(state)} lacks {sorted(missing)}")
        for key, mine in (("num_rows", len(self.data)), ("seed", self.seed)):
            if key in state and int(state[key]) != mine:
                raise DataError(
                    f"the saved data position was taken with {key}={int(state[key])}, this run has "
                    f"{key}={mine}: the checkpoint belongs to a different data configuration"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.data) or index % self.global_batch_size:
            raise DataError(
                f"invalid data position {dict(state)} for {len(self.data)} rows and global batch "
                f"size {self.global_batch_size}"
            )
        self._epoch, self._index = epoch, index

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptBatch:
        if self._index + self.global_batch_size > len(self.data):
            self._epoch, self._index = self._epoch + 1, 0
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        order = self._epoch_order(self._epoch)
        start = self._index + self.process_index * self.local_batch_size
        rows = order[start : start + self.local_batch_size]
        epoch = self._epoch
        self._index += self.global_batch_size
        return self.data.take(rows, epoch)


# --------------------------------------------------------------------------- from a config

# The library's defaults of ``config.data`` (the keys of its section in ``gjax/schema.py``).
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
        _looks_like_path(d.source)
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
