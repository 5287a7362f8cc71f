"""Paged KV for the continuous decoder (`rollout.kv_page_size` > 0; 0, the default, keeps
gjax.rollout.decoder's contiguous slots).

Instead of N cache columns per slot and a prompt region per group, every layer's KV lives in
one pool of fixed-size pages and each slot reads its row's through a page table:

    pages_k/pages_v  L x [K, Pg, page, Dh]   the pool (page 0: the null page, never allocated:
                                             free table entries and finished slots' writes;
                                             only zeros are written into it),
                                             heads major, as the paged-attention kernels' pools
    table_SxP        int32 [S, Q + N/page]   a row's pages in column order (Q = ceil(Sp / page))
    prompt_len_R, prompt_logits_RxV, region_S, n_S, limit_S, logits_SxV, done_S, keys_S
                     as in `SlotState` (a region here holds a group's prompt length and
                     logits only: its KV is in its prompt's pages)

A row is one left-aligned sequence: its prompt's Sq columns, then its own tokens, token n at
column Sq + n, at page table[c // page], offset c % page. So the columns a row has written are
a prefix, [0, Sq + n], and attention masks by length alone, as the paged-attention kernels do
(`paged_attention`). A group's prompt fills ceil(Sq / page) pages; its Sq // page full ones
are shared, read-only, by the group's rows; a partial last page (the "tail") is copied into
each row's first own page when the row first grows (`copy_pages`), since the row's tokens
continue it. `PagePool` is the host allocator: the scheduler (gjax.rollout.decoder.
_PagedSchedule, gjax.rollout.engine._PagedKV) gives each live row, before a dispatch, enough
pages for `tokens_per_dispatch` more tokens, frees a row's own pages when it ends, and frees a
group's prompt pages (refcounted: one reference per row holding them, one for the group)
after the group's last row. A multi-turn row's observation (`paged_reenter`) goes into pages
allocated for it before the call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gjax.models.config import ModelConfig
from gjax.models.transformer import (
    _MASK_VALUE,
    decode_layer_out,
    decode_qkv,
    logits_from_hidden,
    prefill,
    rms_norm,
    rope_cos_sin,
)

NULL_PAGE = 0  # never allocated: what a free table entry and a finished slot's write point at
# how a decode step reads its pages (`rollout.paged_attention`): XLA's gather, or JAX's own
# Pallas paged-attention kernel for the platform (run in interpret mode on a CPU: tests)
PAGED_ATTENTION = ("auto", "xla", "pallas_gpu", "pallas_tpu")


class PagedState(NamedTuple):
    """The paged decode state (see the module docstring)."""

    pages_k: list
    pages_v: list
    table_SxP: jax.Array
    prompt_len_R: jax.Array
    prompt_logits_RxV: jax.Array
    region_S: jax.Array
    n_S: jax.Array
    limit_S: jax.Array
    logits_SxV: jax.Array
    done_S: jax.Array
    keys_S: jax.Array


def prompt_pages(prompt_len: int, page_size: int) -> int:
    """Q: pages of one prompt of `prompt_len` columns."""
    return -(-prompt_len // page_size)


def shared_pages(prompt_len: int, page_size: int) -> int:
    """A prompt's full pages, shared by its group's rows (a partial last page is copied)."""
    return prompt_len // page_size


def own_pages(prompt_len: int, tokens: int, page_size: int) -> int:
    """The pages of its own that a row of `tokens` tokens after a `prompt_len`-token prompt
    holds: the table entries past its shared pages (the first one the prompt's tail's copy
    when `prompt_len` is not a whole number of pages)."""
    return -(-(prompt_len + tokens) // page_size) - shared_pages(prompt_len, page_size)


def min_pages(prompt_len: int, max_new: int, page_size: int) -> int:
    """The smallest pool that holds one row: its table's Q + N/page pages, its prompt's tail
    (the copied page's source), and the null page."""
    return prompt_pages(prompt_len, page_size) + max_new // page_size + (page_size > 1) + 1


def default_pages(slots: int, regions: int, prompt_len: int, max_new: int, page: int) -> int:
    """The default pool: the contiguous layout's KV (S slots of N own tokens, R regions of
    Q prompt pages), one page per slot for its prompt's tail's copy, and the null page, so no
    row ever waits or is preempted."""
    tail = slots if page > 1 else 0
    return slots * (max_new // page) + tail + regions * prompt_pages(prompt_len, page) + 1


def init_paged_state(
    cfg: ModelConfig, slots: int, regions: int, prompt_len: int, max_new: int, *, pages, page_size
) -> PagedState:
    """Empty state: every slot done (free), every table entry the null page, pages zero."""
    dtype, kv, dh = cfg.jnp_dtype, cfg.num_kv_heads, cfg.head_dim
    pool = lambda: [jnp.zeros((kv, pages, page_size, dh), dtype) for _ in range(cfg.num_layers)]
    width = prompt_pages(prompt_len, page_size) + max_new // page_size
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    return PagedState(
        pages_k=pool(),
        pages_v=pool(),
        table_SxP=jnp.full((slots, width), NULL_PAGE, jnp.int32),
        prompt_len_R=jnp.zeros((regions,), jnp.int32),
        prompt_logits_RxV=jnp.zeros((regions, cfg.vocab_size), jnp.float32),
        region_S=jnp.zeros((slots,), jnp.int32),
        n_S=jnp.zeros((slots,), jnp.int32),
        limit_S=jnp.zeros((slots,), jnp.int32),
        logits_SxV=jnp.zeros((slots, cfg.vocab_size), jnp.float32),
        done_S=jnp.ones((slots,), bool),
        keys_S=jnp.zeros((slots, *key_shape), jnp.uint32),
    )


class PagePool:
    """Host-side page allocator with reference counts. Page 0 (`NULL_PAGE`) is never handed
    out. `on_free(pages)`: called with the pages that a release frees (a debug hook: the tests
    write NaN into them)."""

    def __init__(self, num_pages: int, on_free: Callable[[list[int]], None] | None = None):
        if num_pages < 2:
            raise ValueError(
                f"a page pool needs >= 2 pages (one is the null page), got {num_pages}"
            )
        self.num_pages = num_pages
        self.refs = np.zeros((num_pages,), np.int32)
        self.free = list(range(1, num_pages))
        self.on_free = on_free
        self.peak_used = 0
        self.allocated = 0  # pages handed out, over the pool's life

    def available(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list[int]:
        """`n` free pages, each with one reference (the caller checks `available` first)."""
        if n > len(self.free):
            raise RuntimeError(f"page pool: {n} pages asked, {len(self.free)} free")
        got, self.free = self.free[:n], self.free[n:]
        self.refs[got] = 1
        self.allocated += n
        self.peak_used = max(self.peak_used, self.num_pages - 1 - len(self.free))
        return got

    def ref(self, pages) -> None:
        """One more reference to each of `pages` (a row reading its group's prompt pages)."""
        pages = list(pages)
        if pages and (self.refs[pages] <= 0).any():
            raise RuntimeError(f"page pool: referencing a free page in {pages}")
        self.refs[pages] += 1

    def release(self, pages) -> None:
        """One reference fewer to each of `pages`; those left with none are free again."""
        pages = list(pages)
        if not pages:
            return
        if (self.refs[pages] <= 0).any():
            raise RuntimeError(f"page pool: releasing a free page in {pages}")
        self.refs[pages] -= 1
        freed = [p for p in pages if self.refs[p] == 0]
        if freed:
            self.free.extend(freed)
            self.free.sort()
            if self.on_free is not None:
                self.on_free(freed)


def paged_prefill(params, cfg, state: PagedState, tokens_AxSp, mask_AxSp, region_A, pages_AxQ):
    """Prefills A (left-padded) prompts: their KV, left-aligned, into pages `pages_AxQ` (the
    first ceil(Sq / page) of a row used; the rest, and a padding entry's, the null page),
    their length and next-token logits into regions `region_A` (index R: padding, dropped)."""
    mask = mask_AxSp.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    hidden_AxSpxD, k, v = prefill(params, cfg, tokens_AxSp.astype(jnp.int32), positions, mask)
    last_A = tokens_AxSp.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
    hidden_AxD = jnp.take_along_axis(hidden_AxSpxD, last_A[:, None, None], axis=1)[:, 0]
    logits_AxV = logits_from_hidden(params, cfg, hidden_AxD)
    page = state.pages_k[0].shape[2]
    a_, q_ = pages_AxQ.shape
    sp_ = mask.shape[1]
    len_A = mask.sum(-1)
    # column j of the left-aligned prompt: column j + (Sp - Sq) of the left-padded one
    from_AxSp = (jnp.arange(sp_)[None, :] + (sp_ - len_A)[:, None]) % sp_

    def to_pages(x_AxKxSpxDh):  # -> [K, A*Q, page, Dh], the prompt's columns page by page
        _, kv_, _, dh = x_AxKxSpxDh.shape
        x = jnp.take_along_axis(x_AxKxSpxDh, from_AxSp[:, None, :, None], axis=2)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, q_ * page - sp_), (0, 0)))
        return x.transpose(1, 0, 2, 3).reshape(kv_, a_ * q_, page, dh)

    ids = pages_AxQ.reshape(-1)
    real = (ids != NULL_PAGE)[None, :, None, None]  # the null page is given zeros only
    put = lambda dst, src: dst.at[:, ids].set(jnp.where(real, to_pages(src), 0).astype(dst.dtype))
    reg = lambda dst, src: dst.at[region_A].set(src.astype(dst.dtype), mode="drop")
    return state._replace(
        pages_k=[put(d, k[i]) for i, d in enumerate(state.pages_k)],
        pages_v=[put(d, v[i]) for i, d in enumerate(state.pages_v)],
        prompt_len_R=reg(state.prompt_len_R, len_A),
        prompt_logits_RxV=reg(state.prompt_logits_RxV, logits_AxV),
    )


ZERO = -1  # a fill's source: zeros


def fill_pages(state: PagedState, src_M, dst_M) -> PagedState:
    """Page dst_M[i] <- page src_M[i] in every layer's pool (a prompt's tail into a row's
    first own page), or zeros where src_M[i] is `ZERO` (a new page a kernel will read:
    `kernel_attention`); padding entries zero the null page."""
    keep_M = (src_M != ZERO)[None, :, None, None]
    src_M = jnp.maximum(src_M, 0)
    put = lambda pool: [p.at[:, dst_M].set(jnp.where(keep_M, p[:, src_M], 0)) for p in pool]
    return state._replace(pages_k=put(state.pages_k), pages_v=put(state.pages_v))


def new_page_fills(got: list[int], first: bool, tail: int | None, zero: bool) -> list:
    """The fills a row's newly allocated pages `got` need: the prompt's `tail` copied into
    the first when they are the row's first pages (`first`) and its prompt has one, and zeros
    into the rest where a kernel reads them (`zero`)."""
    fills, fresh = [], got
    if first and tail is not None:
        fills, fresh = [(tail, got[0])], got[1:]
    return fills + ([(ZERO, p) for p in fresh] if zero else [])


def fill_chunks(fills: list[tuple[int, int]], size: int) -> list[tuple[np.ndarray, ...]]:
    """(source, destination) page pairs as [size]-long int32 arrays for `fill_pages`, one
    pair of arrays per call (padding: zeros into the null page)."""
    out = []
    for i in range(0, len(fills), size):
        ids = np.full((2, size), NULL_PAGE, np.int32)
        ids[0] = ZERO
        chunk = np.asarray(fills[i : i + size], np.int32).reshape(-1, 2).T
        ids[:, : chunk.shape[1]] = chunk
        out.append((ids[0], ids[1]))
    return out


def paged_insert(state: PagedState, rng, slot_M, region_M, row_M, limit_M) -> PagedState:
    """Starts rows `row_M` (key fold_in(rng, row)) in slots `slot_M` (index S: padding) from
    their region's logits. Their pages are not zeroed: what a row has not written is masked
    out of both the scores and the values it reads (`paged_slot_step`)."""
    keys_M = jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(rng, r)))(row_M)
    put = lambda dst, src: dst.at[slot_M].set(src, mode="drop")
    return state._replace(
        region_S=put(state.region_S, region_M),
        n_S=put(state.n_S, jnp.zeros_like(region_M)),
        limit_S=put(state.limit_S, limit_M),
        logits_SxV=put(state.logits_SxV, state.prompt_logits_RxV[region_M]),
        done_S=put(state.done_S, jnp.zeros(region_M.shape, bool)),
        keys_S=put(state.keys_S, keys_M),
    )


def gather_pages(pool_KxPgxPxDh, table_SxP):
    """A row's pages through its table, as one sequence per head: [K, S, P * page, Dh] (the
    pool's heads-major layout makes the reshape free)."""
    kv_, _, page, dh = pool_KxPgxPxDh.shape
    s_, p_ = table_SxP.shape
    # every table entry is a page of the pool (free ones the null page): no bounds select
    got = pool_KxPgxPxDh.at[:, table_SxP].get(mode="promise_in_bounds")
    return got.reshape(kv_, s_, p_ * page, dh)


def paged_attention(q_SxKxRxDh, pages_k, pages_v, table_SxP, length_S, dtype):
    """One query per slot against the first `length_S` columns of its row's pages, gathered
    through the page table (an XLA gather). Columns past the length weigh 0 and their values
    are zeroed, so a page's stale or NaN entries never reach the output. Heads lead both
    operands of both matmuls (batch dims k, s), so neither needs a transposed copy of the
    gathered keys."""
    k_KxSxCxDh = gather_pages(pages_k, table_SxP)
    v_KxSxCxDh = gather_pages(pages_v, table_SxP)
    valid_SxC = jnp.arange(k_KxSxCxDh.shape[2])[None, :] < length_S[:, None]
    v_KxSxCxDh = jnp.where(valid_SxC[None, :, :, None], v_KxSxCxDh, 0)
    q_KxSxRxDh = q_SxKxRxDh.transpose(1, 0, 2, 3)
    scores = jnp.einsum(
        "ksrd,kscd->ksrc", q_KxSxRxDh, k_KxSxCxDh, preferred_element_type=jnp.float32
    )
    scale = 1.0 / math.sqrt(q_SxKxRxDh.shape[-1])
    scores = jnp.where(valid_SxC[None, :, None, :], scores * scale, _MASK_VALUE)
    m = scores.max(-1, keepdims=True)
    e = jnp.exp(scores - m)
    out = jnp.einsum("ksrc,kscd->ksrd", e.astype(dtype), v_KxSxCxDh)
    out = out / e.sum(-1)[..., None].astype(dtype)
    return out.transpose(1, 0, 2, 3)


def attention_for(name: str, platform: str | None = None) -> str:
    """`rollout.paged_attention` resolved on `platform` (default: JAX's backend): 'auto' is
    the platform's Pallas kernel on a GPU or TPU and XLA's gather elsewhere."""
    if name not in PAGED_ATTENTION:
        raise ValueError(f"paged_attention must be one of {PAGED_ATTENTION}, got {name!r}")
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    return {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "xla")


def _padded_table(table_SxP, multiple: int):
    """The table with null entries appended to a multiple of `multiple` pages (the kernels'
    blocks; past a row's length, so never read)."""
    extra = -table_SxP.shape[1] % multiple
    return jnp.pad(table_SxP, ((0, 0), (0, extra)), constant_values=NULL_PAGE)


def kernel_attention(q_SxKxRxDh, pages_k, pages_v, table_SxP, length_S, dtype, *, kernel):
    """`paged_attention` through JAX's Pallas paged-attention kernel (`kernel`: pallas_gpu,
    jax.experimental.pallas.ops.gpu.paged_attention; pallas_tpu, ...ops.tpu.paged_attention),
    which reads each row's first `length_S` columns straight from the pool through the table,
    blockwise with an online softmax: no gathered copy. Both take q pre-scaled by 1/sqrt(Dh);
    the TPU kernel reads K and V in bfloat16. On a CPU the kernel runs in Pallas's interpret
    mode (the tests' equality check; slow).

    A kernel multiplies a masked column's value by weight 0 (and the TPU kernel adds the mask
    to its score), so a stale NaN or inf there would reach the output, where the XLA path
    selects it away: the schedulers zero each new page for a kernel (`fill_pages`)."""
    s_, kv_, r_, dh = q_SxKxRxDh.shape
    q_SxHxDh = (q_SxKxRxDh * (1.0 / math.sqrt(dh))).astype(dtype).reshape(s_, kv_ * r_, dh)
    length_S = length_S.astype(jnp.int32)
    p_ = table_SxP.shape[1]
    on_cpu = jax.default_backend() == "cpu"
    if kernel == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu

        # k_splits partitions of the table, each in blocks of a power-of-two page count (a
        # Triton block); the partitions past a row's length do nothing
        splits = 16
        block = min(8, 1 << max(0, math.ceil(math.log2(-(-p_ // splits)))))
        out = gpu.paged_attention(
            q_SxHxDh,
            pages_k,
            pages_v,
            _padded_table(table_SxP, splits * block),
            length_S,
            k_splits=splits,
            pages_per_compute_block=block,
            interpret=on_cpu,
        )
    elif kernel == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu

        block = min(8, p_)
        call = functools.partial(
            tpu, q_SxHxDh, pages_k, pages_v, length_S, _padded_table(table_SxP, block)
        )
        if on_cpu:
            with pltpu.force_tpu_interpret_mode():
                out = call(pages_per_compute_block=block)
        else:
            out = call(pages_per_compute_block=block)
    else:
        raise ValueError(f"no paged-attention kernel {kernel!r}")
    return out.reshape(s_, kv_, r_, dh).astype(dtype)


def paged_slot_step(params, cfg: ModelConfig, layers, state: PagedState, tokens_S, attention="xla"):
    """`decoder._slot_step` on pages: token n_S of each live slot is written at column
    c = Sq + n of its row (page table[c // page], offset c % page; a done slot writes the
    null page) and every slot attends its columns [0, c] under one softmax, through XLA's
    gather (`attention` 'xla') or a Pallas kernel (`kernel_attention`). Returns the next
    logits (a done slot keeps its own: a slot paused for pages resumes from them) and the
    state with the new pages."""
    dtype, eps = cfg.jnp_dtype, cfg.rms_norm_eps
    s_, p_ = state.table_SxP.shape
    page = state.pages_k[0].shape[2]
    h_, kv_, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    col_S = state.prompt_len_R[state.region_S] + state.n_S
    at_S = jnp.minimum(col_S // page, p_ - 1)
    write_page_S = jnp.where(
        state.done_S, NULL_PAGE, jnp.take_along_axis(state.table_SxP, at_S[:, None], 1)[:, 0]
    )
    write_off_S = col_S % page
    x = jnp.take(params["embed"]["embedding"], tokens_S, axis=0).astype(dtype)
    cos, sin = rope_cos_sin(col_S, cfg)
    read = paged_attention
    if attention != "xla":
        read = functools.partial(kernel_attention, kernel=attention)
    pages_k, pages_v = list(state.pages_k), list(state.pages_v)
    for i, lp in enumerate(layers):
        q, k, v = decode_qkv(lp, x, cos, sin, cfg)
        # a done slot writes zeros into the null page: it holds zeros only, so a kernel
        # reading it past a row's length (a block's last pages) multiplies 0 by 0
        put = lambda pool, new_SxKxDh: pool.at[:, write_page_S, write_off_S].set(
            jnp.where(state.done_S[:, None, None], 0, new_SxKxDh).transpose(1, 0, 2).astype(dtype)
        )
        pages_k[i], pages_v[i] = put(pages_k[i], k), put(pages_v[i], v)
        out = read(
            q.reshape(s_, kv_, h_ // kv_, dh),
            pages_k[i],
            pages_v[i],
            state.table_SxP,
            col_S + 1,
            dtype,
        )
        x = decode_layer_out(lp, x, out.reshape(s_, h_ * dh), cfg)
    hidden = rms_norm(x, params["final_norm"]["scale"], eps)
    logits_SxV = logits_from_hidden(params, cfg, hidden).astype(jnp.float32)
    logits_SxV = jnp.where(state.done_S[:, None], state.logits_SxV, logits_SxV)
    return logits_SxV, state._replace(pages_k=pages_k, pages_v=pages_v)


# one step function per resolved `paged_attention` (the decoder's dispatch takes the step as
# a static argument: the same object each time, so one compilation per shape)
SLOT_STEPS = {
    "xla": paged_slot_step,
    "pallas_gpu": functools.partial(paged_slot_step, attention="pallas_gpu"),
    "pallas_tpu": functools.partial(paged_slot_step, attention="pallas_tpu"),
}


def _poison(state: PagedState, pages_M) -> PagedState:
    """NaN into pages `pages_M` (the debug hook; padding: an index past the pool, dropped)."""
    nan = lambda pool: [p.at[:, pages_M].set(jnp.nan, mode="drop") for p in pool]
    return state._replace(pages_k=nan(state.pages_k), pages_v=nan(state.pages_v))


paged_prefill_jit = jax.jit(paged_prefill, static_argnames=("cfg",), donate_argnames=("state",))
paged_insert_jit = jax.jit(paged_insert, donate_argnames=("state",))
poison_jit = jax.jit(_poison, donate_argnames=("state",))
fill_pages_jit = jax.jit(fill_pages, donate_argnames=("state",))


def paged_reenter(params, cfg, layers, state: PagedState, slot_M, tokens_MxC, count_M, limit_M):
    """`decoder._reenter` on pages: the first `count_M` of `tokens_MxC` (an environment's
    tokens) are appended to the rows in slots `slot_M` (index S: padding, dropped) at own
    indices n_S .. n_S + count - 1 (columns Sq + n), into the pages their table already holds
    for them; each column attends the row's columns up to its own under one softmax. A row with count > 0 takes the logits after its last column,
    n_S += count, the limit `limit_M`, and is live again."""
    dtype, f32 = cfg.jnp_dtype, jnp.float32
    m_, c_ = tokens_MxC.shape
    s_, p_ = state.table_SxP.shape
    page = state.pages_k[0].shape[2]
    h_, kv_, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    r_ = h_ // kv_
    slot_c = jnp.minimum(slot_M, s_ - 1)  # padding entries read slot S-1, write nothing
    table_MxP = state.table_SxP[slot_c]
    n0_M = state.n_S[slot_c]
    len_M = state.prompt_len_R[state.region_S[slot_c]]
    own_MxC = n0_M[:, None] + jnp.arange(c_)[None, :]  # own indices of the chunk's columns
    col_MxC = len_M[:, None] + own_MxC  # their columns in the row
    real_MxC = (jnp.arange(c_)[None, :] < count_M[:, None]) & (slot_M[:, None] < s_)
    at_MxC = jnp.minimum(col_MxC // page, p_ - 1)
    page_MxC = jnp.where(real_MxC, jnp.take_along_axis(table_MxP, at_MxC, 1), NULL_PAGE)
    off_MxC = col_MxC % page
    # a column is read if written: the row's prompt and history, and the chunk's real columns
    # up to the query's (a padding query reads the real ones only: no unwritten column is
    # ever valid); a prefix of the row's columns, as in `paged_slot_step`
    last_MxC = jnp.minimum(own_MxC, (n0_M + count_M - 1)[:, None])
    end_MxC = len_M[:, None] + jnp.maximum(last_MxC, n0_M[:, None] - 1)  # the last column read
    valid_MxCxW = jnp.arange(p_ * page)[None, None, :] <= end_MxC[..., None]
    x = jnp.take(params["embed"]["embedding"], tokens_MxC.reshape(-1), axis=0).astype(dtype)
    cos, sin = rope_cos_sin(col_MxC.reshape(-1), cfg)
    pages_k, pages_v = list(state.pages_k), list(state.pages_v)
    scale = 1.0 / math.sqrt(dh)
    for i, lp in enumerate(layers):
        q, k, v = decode_qkv(lp, x, cos, sin, cfg)  # [M*C, H|K, Dh]
        put = lambda pool, new: pool.at[:, page_MxC, off_MxC].set(  # padding: null page, 0
            jnp.where(real_MxC[..., None, None], new.reshape(m_, c_, kv_, dh), 0)
            .transpose(2, 0, 1, 3)
            .astype(dtype)
        )
        pages_k[i], pages_v[i] = put(pages_k[i], k), put(pages_v[i], v)
        k_KxMxWxDh = gather_pages(pages_k[i], table_MxP)
        v_KxMxWxDh = gather_pages(pages_v[i], table_MxP)
        q_KxMxRxCxDh = q.reshape(m_, c_, kv_, r_, dh).transpose(2, 0, 3, 1, 4)
        scores = jnp.einsum(
            "kmrcd,kmwd->kmrcw", q_KxMxRxCxDh, k_KxMxWxDh, preferred_element_type=f32
        )
        valid = valid_MxCxW[None, :, None]
        scores = jnp.where(valid, scores * scale, _MASK_VALUE)
        e = jnp.exp(scores - scores.max(-1, keepdims=True))
        e = jnp.where(valid, e, 0.0)  # a stale column's value never meets a nonzero weight
        v_KxMxWxDh = jnp.where(valid_MxCxW.any(1)[None, :, :, None], v_KxMxWxDh, 0)
        out = jnp.einsum("kmrcw,kmwd->kmrcd", e.astype(dtype), v_KxMxWxDh)
        out = out / e.sum(-1)[..., None].astype(dtype)
        x = decode_layer_out(lp, x, out.transpose(1, 3, 0, 2, 4).reshape(m_ * c_, h_ * dh), cfg)
    state = state._replace(pages_k=pages_k, pages_v=pages_v)
    return reentry_result(params, cfg, state, x, slot_M, count_M, n0_M, limit_M)


def reentry_result(params, cfg, state, x, slot_M, count_M, n0_M, limit_M):
    """The end of a re-entry chunk (`decoder._reenter`, `paged_reenter`), on either state
    (its K/V already written): `x` [M*C, D] the chunk's last hidden states; a row with
    count > 0 takes the logits after its last column, n_S = n0 + count, its limit, and is
    live again; a row with count 0 (or slot S: padding) is left as it was."""
    m_, s_ = slot_M.shape[0], state.n_S.shape[0]
    c_ = x.shape[0] // m_
    hidden_MxCxD = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps).reshape(m_, c_, -1)
    last_M = jnp.clip(count_M - 1, 0, c_ - 1)
    hidden_MxD = jnp.take_along_axis(hidden_MxCxD, last_M[:, None, None], axis=1)[:, 0]
    logits_MxV = logits_from_hidden(params, cfg, hidden_MxD).astype(jnp.float32)
    slot_w = jnp.where(count_M > 0, slot_M, s_)  # a row with no tokens this call: unchanged
    put = lambda dst, src: dst.at[slot_w].set(src, mode="drop")
    return state._replace(
        n_S=put(state.n_S, n0_M + count_M),
        limit_S=put(state.limit_S, limit_M),
        logits_SxV=put(state.logits_SxV, logits_MxV),
        done_S=put(state.done_S, jnp.zeros(slot_M.shape, bool)),
    )


paged_reenter_jit = jax.jit(paged_reenter, static_argnames=("cfg",), donate_argnames=("state",))
