"""Packed batches: the rows `prompt ++ completion` of a minibatch laid end to end in bins.

Padded, every row runs at the batch's full length S; packed, each row's span (its first real
token up to the position that predicts its last loss token) is copied into one of J bins of
W tokens by minimum bin slack (`pack_rows`), so the model runs on [J, W] instead of [B, S].
J and W are static (`Packing`); a batch whose rows do not fit is a clear error (`plan`).
With J = 0 (auto, the default) each batch takes the fewest bins it needs rounded up on a ladder of
`AUTO_STEPS` values per doubling (`auto_bins`: under 1/5 of the bins empty); the update
reads the chosen J from the shape of the batch's `pack_bins_J` marker; auto bins also run
the LM head only at the C positions per bin whose log-probs the loss reads
(`read_positions`; C from the plan on `READ_STEPS` values per doubling, `pack_reads_C`
marker), not at the prompts'; auto J splits evenly over the data-parallel devices
(`auto_bins`). A run compiles one update per (J, C) it meets: the ladders are coarse so that
it meets few (a need that stays within a factor of two meets at most AUTO_STEPS + 1 values of
J and READ_STEPS + 1 of C). The README's command meets 4, where 16 values per doubling and C
a multiple of W / 8 made it 21 (4-7 s of compile each on an idle 2-core CPU, more than the
emptier bins cost: 135 s of CPU time for the whole command instead of 230 s; pack/fill 0.78
instead of 0.83).
Positions are the rows' own (they restart in every row) and each row is its own segment
(its padding stays segment 0; a row holds one sequence, as
`gjax.experience.to_model_inputs` builds them), so attention never crosses rows.

The plan is made on the host from the whole batch's row lengths (`plan`: per row its span
start and length, its bin and its offset there) and applied on the device (`destinations`,
`scatter`, `gather`). Rows are packed per minibatch (`split_rows`' strided rows: row b in
minibatch b % M), and bins are split contiguously into the microbatches, so a minibatch's
rows and every global normaliser are what the padded update uses; only the token layout
differs. Packed shape letters: J bins, W bin length.
"""

from __future__ import annotations

import bisect
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gjax.errors import ConfigError

MODES = ("padded", "packed")
PLAN_KEYS = ("pack_start_B", "pack_len_B", "pack_bin_B", "pack_offset_B")
AUTO_STEPS = 4  # auto bins: J on {4..7} x 2^e (J < 8: exact), at most R rows
READ_STEPS = 2  # auto bins' C: on {2, 3} x 2^e (C < 4: exact), at most W
AUTO_SHAPES = 4  # rounding="quarter": J in {R/4, R/2, 3R/4, R} (R rows per minibatch)
ROUNDINGS = ("ladder", "quarter")
PACKERS = ("mbs", "ffd")  # `pack_rows`


@dataclasses.dataclass(frozen=True)
class Packing:
    """Bin shape: `bins` per minibatch (0: auto, chosen per batch by `plan`, at most one per
    row, which always fits) of `length` tokens (0: the batch's padded row length S).
    `rounding` of auto bins (`auto_bins`): "ladder" (`steps` values per doubling), or
    "quarter" (the first auto: up to a quarter of the rows; kept for
    benchmarks/train_step.py's comparison). `packer` (`pack_rows`): "mbs" (the default) or
    "ffd" (first-fit decreasing alone, kept for the same comparison)."""

    bins: int = 0
    length: int = 0
    rounding: str = "ladder"
    steps: int = AUTO_STEPS
    packer: str = "mbs"

    def __post_init__(self):
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown auto-bin rounding {self.rounding!r}; valid: {ROUNDINGS}")
        if self.packer not in PACKERS:
            raise ValueError(f"unknown packer {self.packer!r}; valid: {PACKERS}")

    def shape(self, rows: int, s: int, minibatches: int, marker_J=None) -> tuple[int, int]:
        """(J bins per minibatch, W tokens per bin) for `rows` rows of length `s`; auto bins
        are the `pack_bins_J` marker's length (without one: one bin per row)."""
        if self.bins:
            bins = self.bins
        else:
            bins = rows // minibatches if marker_J is None else marker_J.shape[0]
        return bins, (self.length or s)


def auto_bins(
    used: int,
    rows: int,
    microbatches: int,
    rounding: str = "ladder",
    shards: int = 1,
    steps: int = AUTO_STEPS,
) -> int:
    """Auto J for a minibatch of `rows` rows whose fullest plan used `used` bins, at most
    `rows` and a multiple of `microbatches` x `shards` (each microbatch's bins split evenly
    over the `shards` data-parallel devices; `rows` itself when that exceeds it). "ladder":
    `used` rounded up to m x 2^e with m in [s, 2s) (`steps` s values per doubling; exact
    below 2s; `ladder`), so fewer than 1/(s + 1) of the bins are empty (before the rounding
    to the devices) and a need within a factor of two meets at most s + 1 values (one
    compile each). "quarter": up to
    a multiple of ceil(rows / AUTO_SHAPES): at most 4 shapes, up to a quarter of the rows
    empty.

    Uneven bins (J / K not a multiple of `shards`) make GSPMD pad the bins axis and move
    the pads with collective-permutes; on CPU over several processes (gloo) XLA runs a
    program's independent collective-permutes concurrently on one message slot, so they
    can take each other's messages (a "14336 vs 224 bytes" abort, or silently swapped
    data when the sizes agree)."""
    quantum = microbatches * shards
    if rounding == "ladder":
        j = ladder(max(used, 1), steps)
        return min(-(-j // quantum) * quantum, rows)
    size = -(-rows // AUTO_SHAPES)
    size = -(-size // quantum) * quantum
    return min(max(-(-used // size), 1) * size, rows)


def ladder(n: int, steps: int) -> int:
    """`n` >= 1 rounded up to m x 2^e with m in [steps, 2 steps) (exact below 2 steps):
    `steps` values per doubling, fewer than 1/(steps + 1) of the result above `n`."""
    step = max(1, (1 << (n.bit_length() - 1)) // steps)
    return -(-n // step) * step


def check_fixed_bins(bins: int, microbatches: int, shards: int, processes: int) -> None:
    """A fixed `train.pack_bins` on several processes must split evenly over the microbatches
    x data-parallel devices (`auto_bins` does so itself): uneven bins make XLA move their
    padding with collective-permutes, which gloo can mix up between processes (see
    `auto_bins`). On one process they cost only the permutes."""
    quantum = microbatches * shards
    if bins and processes > 1 and bins % quantum:
        raise ConfigError(
            f"train.pack_bins={bins} does not split evenly over train.microbatches="
            f"{microbatches} x {shards} data-parallel devices on {processes} processes: set "
            f"it to a multiple of {quantum} (e.g. {-(-bins // quantum) * quantum}), or 0 (auto)"
        )


def from_config(train_cfg) -> Packing | None:
    """`config.train`'s packing (None: padded rows; so is a hand-built train config
    without the packing fields)."""
    mode = getattr(train_cfg, "packing", "padded")
    bins, length = getattr(train_cfg, "pack_bins", 0), getattr(train_cfg, "pack_length", 0)
    if mode not in MODES:
        raise ConfigError(f"config.train.packing must be one of {MODES}, got {mode!r}")
    if mode == "padded":
        return None
    if bins % train_cfg.microbatches:
        raise ConfigError(
            f"config.train.pack_bins={bins} must be a multiple of "
            f"config.train.microbatches={train_cfg.microbatches} (microbatches are bins)"
        )
    return Packing(bins=int(bins), length=int(length))


def row_spans(segment_ids_BxS: np.ndarray, loss_mask_BxT: np.ndarray) -> np.ndarray:
    """[B, 2] (start, length) of the tokens each row runs on: from its first real token to
    the position predicting its last loss token (hidden[s] predicts token s + 1); a row
    without loss tokens has length 0 and is not packed."""
    s, t = segment_ids_BxS.shape[1], loss_mask_BxT.shape[1]
    start_B = np.argmax(segment_ids_BxS != 0, axis=1)
    has_loss_B = loss_mask_BxT.any(axis=1)
    last_B = t - 1 - np.argmax(loss_mask_BxT[:, ::-1], axis=1)
    end_B = s - t + last_B  # exclusive: position s - t - 1 + last predicts target `last`
    length_B = np.where(has_loss_B, np.maximum(end_B - start_B, 0), 0)
    return np.stack([start_B, length_B], axis=1).astype(np.int32)


def first_fit_decreasing(length_R: np.ndarray, bins: int, width: int):
    """(bin_R, offset_R, bins used) by first-fit decreasing; bin -1 where a row fits nowhere
    (longer than `width`, or `bins` are full). Ties keep row order (deterministic)."""
    fill = np.zeros(bins, np.int64)
    bin_R = np.zeros(len(length_R), np.int32)
    offset_R = np.zeros(len(length_R), np.int32)
    for r in np.argsort(-length_R, kind="stable"):
        n = int(length_R[r])
        if n == 0:
            continue
        fits = np.flatnonzero(fill + n <= width)
        if not fits.size:
            bin_R[r] = -1
            continue
        k = int(fits[0])
        bin_R[r], offset_R[r] = k, fill[k]
        fill[k] += n
    return bin_R, offset_R, int((fill > 0).sum())


def min_bin_slack(length_R: np.ndarray, bins: int, width: int):
    """(bin_R, offset_R, bins used) by minimum bin slack (Gupta & Ho 1999, as in Fleszar &
    Hindi 2002's MBS'): bin by bin, the longest row left, then the subset of the rows left
    that fills the rest of the bin most (`_fullest_subset`); bin -1 for every row left once the
    longest of them fits no bin (`pack_rows` then keeps first-fit's plan where that fits).
    Where first-fit decreasing leaves a gap no single short row fills (rows of ~27 tokens:
    two to a bin of 80), this finds the combinations that do. Deterministic (ties keep row
    order); at most one subset-sum pass over the rows left per bin (about 60 ms for 1024
    rows into bins of 8192)."""
    rows = [int(r) for r in np.argsort(-length_R, kind="stable") if length_R[r] > 0]
    lens = [int(length_R[r]) for r in rows]  # non-increasing
    neg = [-n for n in lens]  # non-decreasing, for bisect
    bin_R = np.zeros(len(length_R), np.int32)
    offset_R = np.zeros(len(length_R), np.int32)
    used = 0
    while rows:
        if used >= bins or lens[0] > width:
            bin_R[rows] = -1
            break
        room = width - lens[0]
        fits = bisect.bisect_left(neg, -room, 1)  # the rows after the first that fit
        offset = 0
        placed = [0, *_fullest_subset(lens, fits, room)]
        for i in placed:
            bin_R[rows[i]], offset_R[rows[i]] = used, offset
            offset += lens[i]
        for i in reversed(placed):
            del rows[i], lens[i], neg[i]
        used += 1
    return bin_R, offset_R, used


def _fullest_subset(lens: list[int], start: int, room: int) -> list[int]:
    """Indices >= `start` of `lens` (non-increasing) whose sum is the largest <= `room`: 0/1
    subset sums as the bits of an int, each item kept with the sums reached before it, so
    walking back from the best sum takes an item only where the sum needs it. Stops at an
    exact fill; skips an item that reaches no new sum (and its equal-length followers)."""
    below = (1 << (room + 1)) - 1
    reached, steps, prev, grew = 1, [], 0, True
    for i in range(start, len(lens)):
        n = lens[i]
        if n == prev and not grew:
            continue
        new = (reached << n) & below
        prev, grew = n, (new | reached) != reached
        if grew:
            steps.append((i, reached))
            reached |= new
            if reached >> room:
                break
    total, out = reached.bit_length() - 1, []
    for i, before in reversed(steps):
        if not (before >> total) & 1:
            out.append(i)
            total -= lens[i]
    return out[::-1]


def pack_rows(length_R: np.ndarray, bins: int, width: int, packer: str = "mbs"):
    """(bin_R, offset_R, bins used) of `packer`: "mbs" the fewer bins of `min_bin_slack` and
    `first_fit_decreasing` (MBS on a tie; so a plan that fit before still fits), "ffd"
    first-fit decreasing alone (the packer before 2026-11-26; benchmarks' comparison)."""
    ffd = first_fit_decreasing(length_R, bins, width)
    if packer == "ffd":
        return ffd
    mbs = min_bin_slack(length_R, bins, width)
    fits = lambda plan: not (plan[0] < 0).any()  # noqa: E731
    if fits(mbs) and (not fits(ffd) or mbs[2] <= ffd[2]):
        return mbs
    return ffd


def plan(
    spans_Bx2: np.ndarray,
    packing: Packing,
    *,
    s: int,
    minibatches: int,
    microbatches: int = 1,
    shards: int = 1,
    t: int | None = None,
) -> dict:
    """The host plan of a whole batch (`PLAN_KEYS`, [B] int32 each), `pack_metrics`: the
    most bins a minibatch used and the fraction of bin tokens filled (f32 [2], to tune
    `train.pack_bins` by), and `pack_bins`: J (an int; `auto_bins` when `packing.bins` is 0,
    over `shards` data-parallel devices).
    With `t` (completion length T), `pack_reads`: C, the most positions of one bin whose
    log-probs the loss reads (`read_counts`), rounded up on the ladder of `READ_STEPS`
    values per doubling (`ladder`; <= W), so few compiles.
    Every process computes the same plan from the all-gathered spans. Raises ConfigError when
    rows do not fit."""
    b = len(spans_Bx2)
    bins, width = packing.shape(b, s, minibatches)
    start_B, length_B = spans_Bx2[:, 0], spans_Bx2[:, 1]
    bin_B = np.zeros(b, np.int32)
    offset_B = np.zeros(b, np.int32)
    most = 0
    for m in range(minibatches):
        rows = np.arange(m, b, minibatches)
        bin_R, offset_R, used = pack_rows(length_B[rows], bins, width, packing.packer)
        most = max(most, used)
        if (bin_R < 0).any():
            _, _, need = pack_rows(length_B[rows], len(rows), max(width, s), packing.packer)
            raise ConfigError(
                f"train.packing='packed': the rows of minibatch {m} do not fit "
                f"train.pack_bins={bins} bins of train.pack_length={width} tokens (longest "
                f"row {int(length_B[rows].max())} tokens, {int(length_B[rows].sum())} in "
                f"all; packing them needs {need} bins of {max(width, s)}). Raise "
                "train.pack_bins (0: auto, as many as each batch needs) or train.pack_length, "
                "or set train.packing='padded'."
            )
        bin_B[rows], offset_B[rows] = bin_R, offset_R
    if not packing.bins:  # the packers fill bins 0.. in order: the plan fits in `most`
        bins = auto_bins(
            most, b // minibatches, microbatches, packing.rounding, shards, packing.steps
        )
    out = dict(zip(PLAN_KEYS, (start_B, length_B, bin_B, offset_B), strict=True))
    fill = length_B.sum() / (minibatches * bins * width)
    out["pack_metrics"] = np.array([most, fill], np.float32)
    out["pack_bins"] = bins
    if t is not None:
        reads_B = read_counts(spans_Bx2, s=s, t=t)
        per_bin = np.bincount((np.arange(b) % minibatches) * bins + bin_B, reads_B)
        # C on READ_STEPS values per doubling: fewer than 1/3 of the head's positions unread
        out["pack_reads"] = min(ladder(max(int(per_bin.max(initial=0)), 1), READ_STEPS), width)
    return out


def read_counts(spans_Bx2: np.ndarray, *, s: int, t: int) -> np.ndarray:
    """[B] how many of each row's packed positions predict a completion target (those
    whose log-probs the loss reads): its span's part from position S - T - 1 on."""
    start_B, length_B = spans_Bx2[:, 0], spans_Bx2[:, 1]
    return np.maximum(start_B + length_B - np.maximum(start_B, s - t - 1), 0) * (length_B > 0)


def markers(plan_: dict) -> dict:
    """The plan's static sizes as the shapes of int8 marker arrays (what a jitted update
    reads; one compile per distinct size): `pack_bins_J` and, if planned, `pack_reads_C`."""
    out = {"pack_bins_J": np.zeros(plan_.pop("pack_bins"), np.int8)}
    if "pack_reads" in plan_:
        out["pack_reads_C"] = np.zeros(plan_.pop("pack_reads"), np.int8)
    return out


# ------------------------------------------------------------------------------ on device


def destinations(plan_B: dict, s: int, bins: int, width: int) -> jax.Array:
    """[R, S] flat index into the [J * W] packed tokens of each padded position; J * W
    (out of range: dropped by `scatter`, filled by `gather`) where a position is not packed."""
    j_RxS = jnp.arange(s, dtype=jnp.int32)[None, :] - plan_B["pack_start_B"][:, None]
    inside = (j_RxS >= 0) & (j_RxS < plan_B["pack_len_B"][:, None])
    base_R = plan_B["pack_bin_B"] * width + plan_B["pack_offset_B"]
    return jnp.where(inside, base_R[:, None] + j_RxS, bins * width)


def scatter(x_RxU: jax.Array, dest_RxU: jax.Array, n: int) -> jax.Array:
    """Rows' values to their packed places: [R, U, ...] -> [n, ...], 0 where none lands."""
    flat = x_RxU.reshape((-1,) + x_RxU.shape[2:])
    zeros_N = jnp.zeros((n,) + x_RxU.shape[2:], x_RxU.dtype)
    return zeros_N.at[dest_RxU.reshape(-1)].set(flat, mode="drop")


def gather(x_N: jax.Array, dest_RxU: jax.Array) -> jax.Array:
    """Packed values back to the rows: [n] -> [R, U], 0 where a position is not packed."""
    return jnp.take(x_N, dest_RxU, axis=0, mode="fill", fill_value=0)


def pack_model_inputs(rows: dict, dest_RxS: jax.Array, n: int) -> dict:
    """The model's packed inputs [n]: ids, positions (the rows' own) and segment ids
    (row r is segment r + 1; its padding stays 0)."""
    r = rows["segment_ids_BxS"].shape[0]
    seg_RxS = jnp.where(
        rows["segment_ids_BxS"] != 0, jnp.arange(1, r + 1, dtype=jnp.int32)[:, None], 0
    )
    return {
        "input_ids": scatter(rows["input_ids_BxS"], dest_RxS, n),
        "positions": scatter(rows["positions_BxS"], dest_RxS, n),
        "segment_ids": scatter(seg_RxS, dest_RxS, n),
    }


def read_positions(dest_RxT: jax.Array, bins: int, width: int, reads: int) -> jax.Array:
    """[J, C] the positions in each bin (ascending) whose log-probs the loss reads (each
    row's completion places, `completion_destinations`), padded with W (out of range) to
    C = `reads` (>= every bin's count: `plan`'s `pack_reads`)."""
    n = bins * width
    read_JxW = scatter(jnp.ones(dest_RxT.shape, bool), dest_RxT, n).reshape(bins, width)
    return jax.vmap(lambda r: jnp.nonzero(r, size=reads, fill_value=width)[0])(read_JxW)


def take_reads(x_JxW: jax.Array, read_JxC: jax.Array) -> jax.Array:
    """[J, W, ...] -> [J, C, ...] at the read positions; 0 at the padding ones."""
    idx = read_JxC.reshape(read_JxC.shape + (1,) * (x_JxW.ndim - 2))
    return jnp.take_along_axis(x_JxW, idx, axis=1, mode="fill", fill_value=0)


def shard_major(x_JxC: jax.Array, shards: int) -> jax.Array:
    """[J, C, ...] -> [shards * J, C / shards, ...]: each bin's C positions cut into `shards`
    blocks, the blocks of shard s first (rows s * J + j). With the positions split over
    `shards` devices (`mesh.seq`) and the bins over others, the flattened tokens are then
    one block per device, so a token-chunked head (`objective.logprobs`) runs per shard."""
    j, c = x_JxC.shape[:2]
    x = x_JxC.reshape(j, shards, c // shards, *x_JxC.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(shards * j, c // shards, *x_JxC.shape[2:])


def from_shard_major(x_SJxCs: jax.Array, shards: int) -> jax.Array:
    """The inverse of `shard_major`."""
    sj, cs = x_SJxCs.shape[:2]
    x = x_SJxCs.reshape(shards, sj // shards, cs, *x_SJxCs.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(sj // shards, shards * cs, *x_SJxCs.shape[2:])


def completion_destinations(dest_RxS: jax.Array, t: int) -> jax.Array:
    """[R, T]: the packed place of the position predicting each completion target."""
    s = dest_RxS.shape[1]
    return dest_RxS[:, s - t - 1 : s - 1]
