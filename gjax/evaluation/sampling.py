"""n completions per problem, drawn in fixed-shape batches and scored by the verifier."""

from __future__ import annotations

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
    `pull_full` returns a global row-sharded array in full on every process
    (`gjax.multihost.RowTransfer` implements it)."""

    def put_full(self, x: np.ndarray) -> jax.Array: ...

    def pull_full(self, x: jax.Array) -> np.ndarray: ...

    def gather_rows(self, x: np.ndarray) -> np.ndarray: ...


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
    devices = jax.device_count()
    if batch_shape is not None:
        p, g = batch_shape
    else:
        g = min(n, max(1, max_rows))
        p = min(max(1, max_rows // g), n_problems)  # prompts per call
    p = -(-p // devices) * devices  # the batch axis is sharded over the devices
    calls_per_problem = -(-n // g)
    longest = max(len(x) for x in data.prompt_ids)
    width = width or -(-longest // 8) * 8
    if width < longest:
        raise ValueError(f"width {width} < the longest prompt ({longest} tokens)")
    texts: list[list[str]] = [[] for _ in range(n_problems)]
    lengths = np.zeros((n_problems, calls_per_problem * g), np.int32)
    truncated = np.zeros((n_problems, calls_per_problem * g), bool)
    dropped = np.zeros((n_problems, calls_per_problem * g), bool)
    bar = None
    if progress and interactive():
        from tqdm import tqdm  # optional: the progress bar

        bar = tqdm(
            total=n_problems * n,
            desc=progress if isinstance(progress, str) else "eval",
            unit="sample",
            dynamic_ncols=True,
            leave=False,
        )
    stop = set(sampling.stop_token_ids)
    for start in range(0, n_problems, p):
        rows = list(range(start, min(start + p, n_problems)))
        padded = rows + [rows[-1]] * (p - len(rows))
        ids_PxS, mask_PxS = left_pad([data.prompt_ids[r] for r in padded], width, data.pad_id)
        for call in range(calls_per_problem):
            key = jax.random.fold_in(jax.random.fold_in(rng, start), call)
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
    if bar is not None:
        bar.refresh()  # the last update may fall inside tqdm's redraw interval
        bar.close()
    texts = [t[:n] for t in texts]
    lengths, truncated, dropped = lengths[:, :n], truncated[:, :n], dropped[:, :n]
    flat = [t for row in texts for t in row]
    golds = [a for a in data.answers for _ in range(n)]
    # Every process holds every text; each verifies its 1/H and the scores are all-gathered,
    # so the work is split and all processes report the same figures.
    correct = multihost.split_work(
        len(flat), lambda lo, hi: np.asarray(verifier.score(flat[lo:hi], golds[lo:hi]), np.float32)
    ).reshape(n_problems, n)
    extractors = getattr(getattr(verifier, "config", None), "extractors", ("boxed", "answer_tag"))
    keys = [[answer_key(t, extractors) for t in row] for row in texts]
    return Samples(texts, correct, lengths, truncated, keys, dropped)


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
