"""Raw rows of a data source: the built-in synthetic task, local or gs:// files, or the Hub.

    rows = load_rows("synthetic" | "path/to/file.jsonl|.parquet|.arrow|dir" | "hub/id", ...)

Bad input policy (the counts end up in ``PromptData.stats``): a JSON-lines line that is not
UTF-8 or not one JSON object -> ``DataError`` naming the file and line when ``strict=True``,
else a counted skip ``skipped_malformed``.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import glob
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence

from etils import epath

from gjax.data import synthetic as synthetic_lib
from gjax.errors import UserError
from gjax.models.hf_format import cache_dir

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


def looks_like_path(source: str) -> bool:
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
    import datasets  # deferred: a slow import, only for Hub/file sources

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


@contextlib.contextmanager
def _quiet_json_builder():
    """Silences datasets' JSON builder while it tries a file whole: on a malformed line it
    logs "Failed to load JSON from file ..." at ERROR level before raising, yet gjax then
    reads the file line by line and names (strict) or skips and counts (the default) the bad
    lines itself, so that line would report an error that is not one."""
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


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
    import datasets  # deferred: a slow import, only for Hub/file sources

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
        with _quiet_json_builder() if kind == "json" else contextlib.nullcontext():
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
    import datasets  # deferred: a slow import, only for Hub/file sources

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
    if looks_like_path(source):
        ds = _load_local(source, split, strict=strict, stats=stats)
    else:
        try:
            ds = datasets.load_dataset(source, subset, split=split)
        except Exception as err:
            raise _hub_error(source, err) from err
    if num_examples is not None:
        ds = ds.select(range(min(num_examples, len(ds))))
    return ds
