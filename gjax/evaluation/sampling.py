"""n completions per problem, drawn in fixed-shape batches and scored by the verifier."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import numpy as np

from gjax import multihost
from gjax.data.prompts import PromptData, left_pad
from gjax.evaluation.metrics import Samples, answer_key
from gjax.metrics import interactive
from gjax.rollout import RolloutBackend, SamplingParams
from gjax.rollout.collect import ServingFailed


class Transfer(Protocol):
    """Whole batches between the host and the devices when several processes share a mesh:
    `put_full` takes the batch every process holds in full and returns the global array,
    `pull_full` returns a global row-sharded array in full on every process, `gather_rows`
    every process's rows of a host array, `block_of(n)` this process's rows of a whole batch
    of n (`gjax.multihost.RowTransfer` implements it)."""

    def put_full(self, x: np.ndarray) -> jax.Array: ...

    def pull_full(self, x: jax.Array) -> np.ndarray: ...

    def gather_rows(self, x: np.ndarray) -> np.ndarray: ...

    def block_of(self, n: int) -> slice: ...


def sample_and_score(
    backend: RolloutBackend,
    params,
    tokenizer,
    data: PromptData,
    verifier,
    *,
    num_samples: int,
    sampling: SamplingParams,
    rng: jax.Array,
    max_rows: int = 256,
    batch_shape: tuple[int, int] | None = None,
    width: int | None = None,
    progress: bool | str = False,
    transfer: Transfer | None = None,
) -> Samples:
    """Draws `num_samples` completions for every problem of `data` and scores them.

    Every call to the sampler has the same shape (P prompts x G samples, P a multiple of
    the device count, the last batch padded with repeats that are dropped), so it compiles
    once. `max_rows` bounds P x G per call; a problem's n samples span several calls when
    n > G. `batch_shape=(P, G)` and `width` (padded prompt length; default: the longest
    prompt, rounded up to 8) fix the shape instead, e.g. to the training rollout's so that
    its compiled program is reused. `progress`: a tqdm bar (its description, if a string),
    drawn only when stderr is a terminal (a redirected log gets no bars).
    `transfer` moves whole batches between host and devices in a multi-process run (every
    process samples every batch, the devices each decoding their rows; see `Transfer`, and
    the verifier's work is split over the processes); by default numpy arrays go in as they
    are.

    A serving backend's dropped requests (`valid_B` False: no tokens) score as wrong answers
    and are marked in `Samples.dropped_PxN` (`summarize` counts them); a call in which every
    request was dropped raises ServingFailed, as nothing was evaluated.
    """
    put = transfer.put_full if transfer is not None else (lambda x: x)
    pull = transfer.pull_full if transfer is not None else np.asarray
    n_problems, n = len(data), num_samples
    plan = plan_batches(data, n, max_rows=max_rows, batch_shape=batch_shape, width=width)
    g = plan.g
    texts: list[list[str]] = [[] for _ in range(n_problems)]
    lengths = np.zeros((n_problems, plan.samples), np.int32)
    truncated = np.zeros((n_problems, plan.samples), bool)
    dropped = np.zeros((n_problems, plan.samples), bool)
    bar = progress_bar(progress, n_problems * n)
    stop = set(sampling.stop_token_ids)
    for rows, ids_PxS, mask_PxS, call, key in plan.batches(data, rng):
        out = backend.generate(
            params, put(ids_PxS), put(mask_PxS), key, num_samples=g, sampling=sampling
        )
        tokens_BxN, lengths_B = pull(out.tokens_BxN), pull(out.lengths_B)
        dropped_B = _dropped(out.valid_B, len(lengths_B), transfer)
        if dropped_B.all():
            if bar is not None:
                bar.close()
            failure = getattr(backend, "failure", lambda: "")()
            raise ServingFailed(
                f"every request of a held-out evaluation batch was dropped "
                f"({len(dropped_B)} requests{'; ' + failure if failure else ''}): its "
                "figures would count every sample as a wrong answer, so none is reported. "
                "Start the server again (or fix config.rollout.server_address), then rerun."
            )
        decoded = tokenizer.batch_decode(
            [t[:m] for t, m in zip(tokens_BxN[: len(rows) * g], lengths_B)],
            skip_special_tokens=True,
        )
        for j, r in enumerate(rows):
            texts[r].extend(decoded[j * g : (j + 1) * g])
            cols = slice(call * g, (call + 1) * g)
            lengths[r, cols] = lengths_B[j * g : (j + 1) * g]
            last = tokens_BxN[j * g : (j + 1) * g][
                np.arange(g), np.maximum(lengths_B[j * g : (j + 1) * g] - 1, 0)
            ]
            truncated[r, cols] = ~np.isin(last, list(stop)) if stop else False
            dropped[r, cols] = dropped_B[j * g : (j + 1) * g]
        if bar is not None:
            bar.update(len(rows) * min(g, n - call * g))
    close_bar(bar)
    texts = [t[:n] for t in texts]
    lengths, truncated, dropped = lengths[:, :n], truncated[:, :n], dropped[:, :n]
    correct, keys = score_texts(texts, data, verifier)
    return Samples(texts, correct, lengths, truncated, keys, dropped)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How n samples of every problem are drawn: calls of P prompts x G samples (P a
    multiple of the device count), `calls_per_problem` calls per batch of prompts, prompts
    left-padded to `width`. The one batching of every held-out sampler (single completions
    here, episodes in `gjax.evaluation.episodes`): the same plan and rng give the same
    prompts, rows and keys."""

    p: int
    g: int
    calls_per_problem: int
    width: int

    @property
    def samples(self) -> int:
        """Columns drawn per problem (>= n: the last call's extra samples are dropped)."""
        return self.calls_per_problem * self.g

    def batches(self, data: PromptData, rng: jax.Array):
        """(rows, prompt ids_PxS, mask_PxS, call, key) of every sampler call, in order: `rows`
        the problems it answers (the batch padded with repeats of the last), `call` which of
        a batch's calls, key fold_in(fold_in(rng, first row), call)."""
        n_problems = len(data)
        for start in range(0, n_problems, self.p):
            rows = list(range(start, min(start + self.p, n_problems)))
            padded = rows + [rows[-1]] * (self.p - len(rows))
            ids_PxS, mask_PxS = left_pad(
                [data.prompt_ids[r] for r in padded], self.width, data.pad_id
            )
            for call in range(self.calls_per_problem):
                key = jax.random.fold_in(jax.random.fold_in(rng, start), call)
                yield rows, ids_PxS, mask_PxS, call, key


def plan_batches(
    data: PromptData,
    num_samples: int,
    *,
    max_rows: int = 256,
    batch_shape: tuple[int, int] | None = None,
    width: int | None = None,
) -> BatchPlan:
    """`sample_and_score`'s batching of `num_samples` per problem of `data` (its docstring)."""
    n_problems, n = len(data), num_samples
    devices = jax.device_count()
    if batch_shape is not None:
        p, g = batch_shape
    else:
        g = min(n, max(1, max_rows))
        p = min(max(1, max_rows // g), n_problems)  # prompts per call
    p = -(-p // devices) * devices  # the batch axis is sharded over the devices
    longest = max(len(x) for x in data.prompt_ids)
    width = width or -(-longest // 8) * 8
    if width < longest:
        raise ValueError(f"width {width} < the longest prompt ({longest} tokens)")
    return BatchPlan(p, g, -(-n // g), width)


def progress_bar(progress: bool | str, total: int):
    """A tqdm bar of `total` samples (described by `progress`, if a string), or None when
    `progress` is off or stderr is not a terminal."""
    if not (progress and interactive()):
        return None
    from tqdm import tqdm  # optional: the progress bar

    return tqdm(
        total=total,
        desc=progress if isinstance(progress, str) else "eval",
        unit="sample",
        dynamic_ncols=True,
        leave=False,
    )


def close_bar(bar) -> None:
    if bar is not None:
        bar.refresh()  # the last update may fall inside tqdm's redraw interval
        bar.close()


def score_texts(
    texts: list[list[str]], data: PromptData, verifier
) -> tuple[np.ndarray, list[list[str | None]]]:
    """(correct_PxN, answer keys) of n texts per problem of `data`: the verifier's score
    against each problem's answer, and each text's maj@k vote (`answer_key`)."""
    n_problems = len(texts)
    n = len(texts[0]) if texts else 0
    flat = [t for row in texts for t in row]
    golds = [a for a in data.answers for _ in range(n)]
    # Every process holds every text; each verifies its 1/H and the scores are all-gathered,
    # so the work is split and all processes report the same figures.
    correct = multihost.split_work(
        len(flat), lambda lo, hi: np.asarray(verifier.score(flat[lo:hi], golds[lo:hi]), np.float32)
    ).reshape(n_problems, n)
    extractors = getattr(getattr(verifier, "config", None), "extractors", ("boxed", "answer_tag"))
    keys = [[answer_key(t, extractors) for t in row] for row in texts]
    return correct, keys


def _dropped(valid_B, rows: int, transfer: Transfer | None) -> np.ndarray:
    """bool[rows]: the batch's dropped requests (none for a backend that cannot drop). A
    serving backend reports this process's rows in a multi-process run: gathered here."""
    if valid_B is None:
        return np.zeros((rows,), bool)
    valid = np.asarray(valid_B, bool).reshape(-1)
    if len(valid) != rows and transfer is not None:
        valid = np.asarray(transfer.gather_rows(valid), bool).reshape(-1)
    if len(valid) != rows:
        raise ValueError(f"valid_B has {len(valid)} rows, the batch {rows}")
    return ~valid
