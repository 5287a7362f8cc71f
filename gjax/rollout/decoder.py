"""Slot-based continuous decoding: prompt KV once per group, several tokens per dispatch.

`ContinuousDecoder.generate` has the signature and the output of `gjax.rollout.sampler.generate`
(B = P*G prompt-major rows, the same log-prob definition and mask), but decodes with a fixed
number of slots S and an in-process scheduler: a request (one row) is admitted as soon as a slot
is free and evicted as soon as it emits a stop id or reaches its length, so with long-tailed
lengths the slots stay busy where a static batch waits for its longest row.

Device state (`SlotState`, a pytree; N = max_new_tokens, Sp = prompt width, R regions):
    cache_k/cache_v  L x [S, K, N, Dh]   each slot's generated keys (after RoPE) and values
    prompt_k/_v      L x [R, K, Sp, Dh]  prompt regions: a group's prompt KV, stored ONCE and
                                         read by all of its G slots (`region_S`)
    prompt_mask_RxSp, prompt_len_R, prompt_logits_RxV (next-token logits after the prompt)
    region_S, n_S (tokens emitted), limit_S, logits_SxV (f32 next-token logits; a step draws
    token n_S from them), done_S, keys_S (the row's key data)
Three jitted pieces: `_prefill` (up to A prompts per call into free regions), `_insert` (new
rows into free slots, starting from their region's logits) and `_dispatch` (up to
`tokens_per_dispatch` decode steps in one `lax.while_loop`, stopping each slot on its own;
one host sync per dispatch). `gjax.rollout.engine` (JetStream) runs on the same state and
`_dispatch`: `write_region` + `start_slots` are its insert.

The host side of one `generate` call is `_Schedule`, whose methods are the loop's named steps:
`admit` (rows into free slots, regions for new prompts), `prefill` (whole, or one chunk),
`insert`, `dispatch`, `collect` (a dispatch's tokens onto their rows), `retire` (free the
slots of rows that ended, a group's region after its last row), `outputs`. Multi-turn rows
(`generate_episodes`, gjax.rollout.turns) add two: `end_turns` (a turn that ended goes to its
environment; the slot waits, KV kept) and `reenter` (`_reenter`: the observation's tokens
appended to the waiting slot's own cache as a prefill chunk, then it decodes its next turn).
The trajectory (policy and environment tokens after the prompt) fits the N cache columns.

`kv_page_size` > 0 (gjax.rollout.pages, off by default) keeps the same loop on paged KV:
`_PagedSchedule` adds `grow` (a row's pages for the next dispatch) and replaces the prompt
regions' KV by a group's shared prompt pages.

Sampling keys are per row: token n of row b is drawn with fold_in(fold_in(rng, b), n), so a
row's completion does not depend on which slot, or which neighbours, it decoded with (exact
for greedy; sampled results equal the static sampler's in distribution, not draw for draw).
With `sampling.row_block = (i, n)` the rows are block i of a batch of n blocks and b counts
from the whole batch's first row, so each process's block draws what one process would.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gjax.models.config import ModelConfig
from gjax.models.transformer import (
    _MASK_VALUE,
    decode_layer_out,
    decode_layers,
    decode_qkv,
    logits_from_hidden,
    prefill,
    rms_norm,
    rope_cos_sin,
)
from gjax.rollout import pages
from gjax.rollout.sampler import SampleOutput, SamplingParams, _sample
from gjax.rollout.turns import EnvTurns, OneTurn, Trajectories


class SlotState(NamedTuple):
    """The decode state (see the module docstring)."""

    cache_k: list
    cache_v: list
    prompt_k: list
    prompt_v: list
    prompt_mask_RxSp: jax.Array
    prompt_len_R: jax.Array
    prompt_logits_RxV: jax.Array
    region_S: jax.Array
    n_S: jax.Array
    limit_S: jax.Array
    logits_SxV: jax.Array
    done_S: jax.Array
    keys_S: jax.Array


def init_state(cfg: ModelConfig, slots: int, regions: int, prompt_len: int, max_new: int):
    """Empty state: every slot done (free), every region zero."""
    dtype, kv, dh = cfg.jnp_dtype, cfg.num_kv_heads, cfg.head_dim
    own = lambda: [jnp.zeros((slots, kv, max_new, dh), dtype) for _ in range(cfg.num_layers)]
    pre = lambda: [jnp.zeros((regions, kv, prompt_len, dh), dtype) for _ in range(cfg.num_layers)]
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    return SlotState(
        cache_k=own(),
        cache_v=own(),
        prompt_k=pre(),
        prompt_v=pre(),
        prompt_mask_RxSp=jnp.zeros((regions, prompt_len), jnp.int32),
        prompt_len_R=jnp.zeros((regions,), jnp.int32),
        prompt_logits_RxV=jnp.zeros((regions, cfg.vocab_size), jnp.float32),
        region_S=jnp.zeros((slots,), jnp.int32),
        n_S=jnp.zeros((slots,), jnp.int32),
        limit_S=jnp.zeros((slots,), jnp.int32),
        logits_SxV=jnp.zeros((slots, cfg.vocab_size), jnp.float32),
        done_S=jnp.ones((slots,), bool),
        keys_S=jnp.zeros((slots, *key_shape), jnp.uint32),
    )


def _draw(logits_SxV, keys_S, index_S, sp: SamplingParams):
    """Token `index_S` of each slot's row, drawn with fold_in(row key, index)."""
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys_S), index_S)
    tok, logp = jax.vmap(lambda lg, k: _sample(lg[None], k, sp))(logits_SxV, keys)
    return tok[:, 0], logp[:, 0]


def write_region(state: SlotState, region_A, k, v, mask_AxSq, logits_AxV) -> SlotState:
    """Prompts' KV (`k`/`v`: L x [A, K, Sq, Dh], Sq <= Sp, zero-padded to Sp) into regions
    `region_A` (index R: a padding entry, dropped)."""
    sp_ = state.prompt_mask_RxSp.shape[1]
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, sp_ - x.shape[-1])])
    mask = mask_AxSq.astype(jnp.int32)
    put = lambda dst, src: dst.at[region_A].set(src.astype(dst.dtype), mode="drop")
    kv_pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, sp_ - x.shape[2]), (0, 0)))
    return state._replace(
        prompt_k=[put(d, kv_pad(k[i])) for i, d in enumerate(state.prompt_k)],
        prompt_v=[put(d, kv_pad(v[i])) for i, d in enumerate(state.prompt_v)],
        prompt_mask_RxSp=put(state.prompt_mask_RxSp, pad(mask)),
        prompt_len_R=put(state.prompt_len_R, mask.sum(-1)),
        prompt_logits_RxV=put(state.prompt_logits_RxV, logits_AxV),
    )


def start_slots(state: SlotState, slot_M, region_M, limit_M, keys_M) -> SlotState:
    """Starts rows in slots `slot_M` (index S: padding, dropped) from their region's logits;
    their own cache rows are zeroed (a stale NaN in V would survive a masked softmax weight
    of 0)."""
    put = lambda dst, src: dst.at[slot_M].set(src, mode="drop")
    zero = lambda c: c.at[slot_M].set(0, mode="drop")
    return state._replace(
        cache_k=[zero(c) for c in state.cache_k],
        cache_v=[zero(c) for c in state.cache_v],
        region_S=put(state.region_S, region_M),
        n_S=put(state.n_S, jnp.zeros_like(region_M)),
        limit_S=put(state.limit_S, limit_M),
        logits_SxV=put(state.logits_SxV, state.prompt_logits_RxV[region_M]),
        done_S=put(state.done_S, jnp.zeros(region_M.shape, bool)),
        keys_S=put(state.keys_S, keys_M),
    )


def _prefill(params, cfg, state: SlotState, tokens_AxSp, mask_AxSp, region_A):
    """Prefills A prompts into regions `region_A` (index R: a padding entry, dropped)."""
    mask = mask_AxSp.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    hidden_AxSpxD, k, v = prefill(params, cfg, tokens_AxSp.astype(jnp.int32), positions, mask)
    last_A = tokens_AxSp.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
    hidden_AxD = jnp.take_along_axis(hidden_AxSpxD, last_A[:, None, None], axis=1)[:, 0]
    logits_AxV = logits_from_hidden(params, cfg, hidden_AxD)
    return write_region(state, region_A, k, v, mask, logits_AxV)


def _insert(state: SlotState, rng, slot_M, region_M, row_M, limit_M):
    """Starts rows `row_M` (key fold_in(rng, row)) in slots `slot_M` (index S: padding)."""
    keys_M = jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(rng, r)))(row_M)
    return start_slots(state, slot_M, region_M, limit_M, keys_M)


def _prefill_chunk(params, cfg, layers, state: SlotState, tokens_AxC, start_A, mask_AxSp, region_A):
    """Columns [start, start + C) of A prompts (`mask_AxSp`: the whole prompt's mask, any
    padding side) into their regions: each column attends the region's earlier columns and
    itself under one softmax, and its K/V are written there. A prompt's next-token logits are
    written by the chunk holding its last real column. Chunks in order give the whole
    prompt's `_prefill` (chunked prefill: a long prompt does not stall the decode slots), to
    rounding: C queries at a traced offset against the region's keys are not a layout
    `attention.attend` takes, so this runs its own dense softmax whatever `model.attention`."""
    dtype, f32 = cfg.jnp_dtype, jnp.float32
    a_, c_ = tokens_AxC.shape
    sp_ = mask_AxSp.shape[1]
    h_, kv_, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    r_ = h_ // kv_
    mask = mask_AxSp.astype(jnp.int32)
    cols_AxC = start_A[:, None] + jnp.arange(c_)[None, :]
    pos_AxC = jnp.take_along_axis(jnp.maximum(jnp.cumsum(mask, -1) - 1, 0), cols_AxC, axis=1)
    # key column j is visible from query column i iff it is a real token and j <= i
    visible = mask.astype(bool)[:, None, :] & (
        jnp.arange(sp_)[None, None, :] <= cols_AxC[..., None]
    )
    visible_Ax1x1xCxSp = visible[:, None, None]
    rows_A1 = jnp.arange(a_)[:, None]
    x = jnp.take(params["embed"]["embedding"], tokens_AxC.reshape(-1), axis=0).astype(dtype)
    cos, sin = rope_cos_sin(pos_AxC.reshape(-1), cfg)
    prompt_k, prompt_v = list(state.prompt_k), list(state.prompt_v)
    for i, lp in enumerate(layers):
        q, k, v = decode_qkv(lp, x, cos, sin, cfg)  # [A*C, H|K, Dh]
        put = lambda cur, new: cur.at[rows_A1, :, cols_AxC].set(
            new.reshape(a_, c_, kv_, dh).astype(dtype)
        )
        k_AxKxSpxDh = put(jnp.take(prompt_k[i], region_A, axis=0, mode="clip"), k)
        v_AxKxSpxDh = put(jnp.take(prompt_v[i], region_A, axis=0, mode="clip"), v)
        prompt_k[i] = prompt_k[i].at[region_A].set(k_AxKxSpxDh, mode="drop")
        prompt_v[i] = prompt_v[i].at[region_A].set(v_AxKxSpxDh, mode="drop")
        q_AxKxRxCxDh = q.reshape(a_, c_, kv_, r_, dh).transpose(0, 2, 3, 1, 4)
        scores = jnp.einsum(
            "akrcd,aksd->akrcs", q_AxKxRxCxDh, k_AxKxSpxDh, preferred_element_type=f32
        )
        scores = jnp.where(visible_Ax1x1xCxSp, scores / math.sqrt(dh), _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("akrcs,aksd->ackrd", probs, v_AxKxSpxDh).reshape(a_ * c_, h_ * dh)
        x = decode_layer_out(lp, x, out, cfg)
    hidden_AxCxD = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps).reshape(a_, c_, -1)
    last_A = sp_ - 1 - jnp.argmax(mask[:, ::-1], axis=-1) - start_A
    holds_A = (last_A >= 0) & (last_A < c_)
    hidden_AxD = jnp.take_along_axis(hidden_AxCxD, jnp.clip(last_A, 0, c_ - 1)[:, None, None], 1)
    logits_AxV = logits_from_hidden(params, cfg, hidden_AxD[:, 0])
    old_AxV = jnp.take(state.prompt_logits_RxV, region_A, axis=0, mode="clip")
    put = lambda dst, src: dst.at[region_A].set(src.astype(dst.dtype), mode="drop")
    return state._replace(
        prompt_k=prompt_k,
        prompt_v=prompt_v,
        prompt_mask_RxSp=put(state.prompt_mask_RxSp, mask),
        prompt_len_R=put(state.prompt_len_R, mask.sum(-1)),
        prompt_logits_RxV=put(
            state.prompt_logits_RxV, jnp.where(holds_A[:, None], logits_AxV, old_AxV)
        ),
    )


def _slot_step(params, cfg: ModelConfig, layers, state: SlotState, tokens_S):
    """One decoder step for every slot: token at position prompt_len + n, written at own cache
    index n. Each slot attends its region's prompt KV and its own cache n' <= n, under one
    softmax (the arithmetic of `gjax.models.transformer.decode_step`)."""
    dtype, f32, eps = cfg.jnp_dtype, jnp.float32, cfg.rms_norm_eps
    s_, n_ = tokens_S.shape[0], state.cache_k[0].shape[2]
    h_, kv_, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    r_, hq = h_ // kv_, h_ * dh
    scale = 1.0 / math.sqrt(dh)
    n_S = state.n_S
    write_S = jnp.minimum(n_S, n_ - 1)  # a finished slot (n == N) writes a dead entry
    slots = jnp.arange(s_)
    x = jnp.take(params["embed"]["embedding"], tokens_S, axis=0).astype(dtype)
    cos, sin = rope_cos_sin(state.prompt_len_R[state.region_S] + n_S, cfg)
    own_valid = (jnp.arange(n_)[None, :] <= n_S[:, None])[:, None, None, :]
    pre_valid = state.prompt_mask_RxSp[state.region_S].astype(bool)[:, None, None, :]
    cache_k, cache_v = list(state.cache_k), list(state.cache_v)
    for i, lp in enumerate(layers):
        q, k, v = decode_qkv(lp, x, cos, sin, cfg)
        cache_k[i] = cache_k[i].at[slots, :, write_S].set(k.astype(dtype))
        cache_v[i] = cache_v[i].at[slots, :, write_S].set(v.astype(dtype))
        pk = jnp.take(state.prompt_k[i], state.region_S, axis=0)  # [S, K, Sp, Dh]
        pv = jnp.take(state.prompt_v[i], state.region_S, axis=0)
        q_SxKxRxDh = q.reshape(s_, kv_, r_, dh)
        s_pre = jnp.einsum("skrd,skpd->skrp", q_SxKxRxDh, pk, preferred_element_type=f32)
        s_pre = jnp.where(pre_valid, s_pre * scale, _MASK_VALUE)
        s_own = jnp.einsum("skrd,sknd->skrn", q_SxKxRxDh, cache_k[i], preferred_element_type=f32)
        s_own = jnp.where(own_valid, s_own * scale, _MASK_VALUE)
        m = jnp.maximum(s_pre.max(-1), s_own.max(-1))[..., None]
        e_pre, e_own = jnp.exp(s_pre - m), jnp.exp(s_own - m)
        denom = e_pre.sum(-1) + e_own.sum(-1)
        out = jnp.einsum("skrp,skpd->skrd", e_pre.astype(dtype), pv)
        out = out + jnp.einsum("skrn,sknd->skrd", e_own.astype(dtype), cache_v[i])
        out = (out / denom[..., None].astype(dtype)).reshape(s_, hq)
        x = decode_layer_out(lp, x, out, cfg)
    hidden = rms_norm(x, params["final_norm"]["scale"], eps)
    return logits_from_hidden(params, cfg, hidden), cache_k, cache_v


def _reenter(params, cfg, layers, state: SlotState, slot_M, tokens_MxC, count_M, limit_M):
    """A turn's re-entry: the first `count_M` of `tokens_MxC` (the environment's tokens) are
    appended to the rows in slots `slot_M` (index S: padding, dropped) as one prefill chunk
    into their own caches, at indices n_S .. n_S + count - 1 (positions prompt_len + n): each
    column attends the region's prompt, the row's cache (its history: KV kept, not
    re-prefilled) and the chunk's earlier columns under one softmax. A row with count > 0
    takes the logits after its last column, n_S += count, the length limit `limit_M`, and is
    live again; its next drawn token is token n_S of the row (key fold_in(row key, n_S))."""
    dtype, f32 = cfg.jnp_dtype, jnp.float32
    m_, c_ = tokens_MxC.shape
    s_, n_ = state.n_S.shape[0], state.cache_k[0].shape[2]
    h_, kv_, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    r_ = h_ // kv_
    scale = 1.0 / math.sqrt(dh)
    slot_c = jnp.minimum(slot_M, s_ - 1)  # padding entries read slot S-1, write nothing
    region_M = state.region_S[slot_c]
    n0_M = state.n_S[slot_c]
    cols_MxC = n0_M[:, None] + jnp.arange(c_)[None, :]  # own-cache indices
    real_MxC = jnp.arange(c_)[None, :] < count_M[:, None]
    write_MxC = jnp.where(real_MxC & (slot_M[:, None] < s_), cols_MxC, n_)  # n_: dropped
    pos_MxC = state.prompt_len_R[region_M][:, None] + cols_MxC
    pre_valid = state.prompt_mask_RxSp[region_M].astype(bool)[:, None, None, None, :]
    own_valid = (jnp.arange(n_)[None, None, :] <= cols_MxC[..., None])[:, None, None]
    rows_M1 = slot_M[:, None]
    x = jnp.take(params["embed"]["embedding"], tokens_MxC.reshape(-1), axis=0).astype(dtype)
    cos, sin = rope_cos_sin(pos_MxC.reshape(-1), cfg)
    cache_k, cache_v = list(state.cache_k), list(state.cache_v)
    for i, lp in enumerate(layers):
        q, k, v = decode_qkv(lp, x, cos, sin, cfg)  # [M*C, H|K, Dh]
        put = lambda cur, new: cur.at[rows_M1, :, write_MxC].set(
            new.reshape(m_, c_, kv_, dh).astype(dtype), mode="drop"
        )
        cache_k[i], cache_v[i] = put(cache_k[i], k), put(cache_v[i], v)
        own_k = jnp.take(cache_k[i], slot_c, axis=0)  # [M, K, N, Dh], the chunk written
        own_v = jnp.take(cache_v[i], slot_c, axis=0)
        pk = jnp.take(state.prompt_k[i], region_M, axis=0)  # [M, K, Sp, Dh]
        pv = jnp.take(state.prompt_v[i], region_M, axis=0)
        q_MxKxRxCxDh = q.reshape(m_, c_, kv_, r_, dh).transpose(0, 2, 3, 1, 4)
        s_pre = jnp.einsum("mkrcd,mkpd->mkrcp", q_MxKxRxCxDh, pk, preferred_element_type=f32)
        s_pre = jnp.where(pre_valid, s_pre * scale, _MASK_VALUE)
        s_own = jnp.einsum("mkrcd,mknd->mkrcn", q_MxKxRxCxDh, own_k, preferred_element_type=f32)
        s_own = jnp.where(own_valid, s_own * scale, _MASK_VALUE)
        mx = jnp.maximum(s_pre.max(-1), s_own.max(-1))[..., None]
        e_pre, e_own = jnp.exp(s_pre - mx), jnp.exp(s_own - mx)
        denom = e_pre.sum(-1) + e_own.sum(-1)
        out = jnp.einsum("mkrcp,mkpd->mkrcd", e_pre.astype(dtype), pv)
        out = out + jnp.einsum("mkrcn,mknd->mkrcd", e_own.astype(dtype), own_v)
        out = out / denom[..., None].astype(dtype)
        out = out.transpose(0, 3, 1, 2, 4).reshape(m_ * c_, h_ * dh)
        x = decode_layer_out(lp, x, out, cfg)
    state = state._replace(cache_k=cache_k, cache_v=cache_v)
    return pages.reentry_result(params, cfg, state, x, slot_M, count_M, n0_M, limit_M)


def _dispatch(
    params,
    cfg,
    layers,
    state: SlotState,
    sp: SamplingParams,
    steps: int,
    error_token=None,
    slot_step=None,
):
    """Up to `steps` decode steps (fewer once every slot is done). A step draws each live
    slot's token n_S from its logits, emits it and decodes it. Returns the new state and, per
    slot and step, the token emitted, its log-prob and whether the slot was live, plus the
    number of steps run. `error_token`: a live slot whose logits are not finite emits it (log-prob
    0) and ends (the JetStream engine's failed request); None: no check."""
    s_ = state.n_S.shape[0]
    stop_ids = jnp.asarray(sp.stop_token_ids, jnp.int32)

    def cond(c):
        return (c[0] < steps) & ~jnp.all(c[1].done_S)

    def body(c):
        d, st, tok_SxD, logp_SxD, live_SxD = c
        live_S = ~st.done_S
        tok_S, logp_S = _draw(st.logits_SxV, st.keys_S, st.n_S, sp)
        done_S = st.done_S
        if error_token is not None:
            failed_S = live_S & ~jnp.all(jnp.isfinite(st.logits_SxV), axis=-1)
            tok_S = jnp.where(failed_S, error_token, tok_S)
            logp_S = jnp.where(failed_S, 0.0, logp_S)
            done_S = done_S | failed_S
        col = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None], (0, d))
        tok_SxD = col(tok_SxD, jnp.where(live_S, tok_S, sp.pad_token_id))
        logp_SxD = col(logp_SxD, jnp.where(live_S, logp_S, 0.0))
        live_SxD = col(live_SxD, live_S)
        n1_S = st.n_S + live_S
        done_S = done_S | (n1_S >= st.limit_S)
        if sp.stop_token_ids:
            done_S = done_S | (live_S & jnp.isin(tok_S, stop_ids))
        feed_S = jnp.where(live_S & (tok_S >= 0), tok_S, sp.pad_token_id)
        if slot_step is None:
            logits_SxV, cache_k, cache_v = _slot_step(params, cfg, layers, st, feed_S)
            st = st._replace(cache_k=cache_k, cache_v=cache_v)
        else:
            logits_SxV, st = slot_step(params, cfg, layers, st, feed_S)
        st = st._replace(
            n_S=n1_S,
            logits_SxV=logits_SxV.astype(jnp.float32),  # a done slot's are never read
            done_S=done_S,
        )
        return d + 1, st, tok_SxD, logp_SxD, live_SxD

    init = (
        jnp.int32(0),
        state,
        jnp.full((s_, steps), sp.pad_token_id, jnp.int32),
        jnp.zeros((s_, steps), jnp.float32),
        jnp.zeros((s_, steps), bool),
    )
    d, state, tok_SxD, logp_SxD, live_SxD = jax.lax.while_loop(cond, body, init)
    return state, tok_SxD, logp_SxD, live_SxD, d


_prefill_jit = jax.jit(_prefill, static_argnames=("cfg",), donate_argnames=("state",))
_insert_jit = jax.jit(_insert, donate_argnames=("state",))
_chunk_jit = jax.jit(_prefill_chunk, static_argnames=("cfg",), donate_argnames=("state",))
_dispatch_jit = jax.jit(
    _dispatch,
    static_argnames=("cfg", "sp", "steps", "error_token", "slot_step"),
    donate_argnames=("state",),
)
_reenter_jit = jax.jit(_reenter, static_argnames=("cfg",), donate_argnames=("state",))
_layers_jit = jax.jit(decode_layers, static_argnames=("cfg",))


class ContinuousDecoder:
    """Continuous batching over `slots` decode slots, in this process (see the module doc).

    Args:
      cfg: the model config. slots: S, rows decoding at once.
      tokens_per_dispatch: decode steps per jitted call (one host sync each); a slot freed
        inside a dispatch is refilled at its end.
      prompt_regions: R, prompts whose KV is held at once (None: 4 * ceil(S / G), at most S;
        a group holds its region until its last row ends, so long tails need R > S / G).
      prefill_batch: prompts per prefill call (None: ceil(S / G)).
      share_prompt: False gives every row a region of its own (the G-copies layout; tests).
      prefill_chunk: 0 prefills a prompt whole before its rows decode; C > 0 prefills C
        columns of up to A prompts per loop turn, between dispatches, so a long prompt does
        not stall the decoding slots (prompts left-padded to a multiple of C).
      observation_chunk: columns of one re-entry call (`generate_episodes`: an environment's
        tokens appended to waiting rows' slots; a longer observation takes several calls).
      kv_page_size: 0 (default) keeps the contiguous slots; P > 0 holds the KV in pages of P
        tokens (gjax.rollout.pages: a page table per slot, pages allocated as a row grows,
        a group's prompt pages shared); P divides max_new_tokens. Whole prefill.
      kv_pages: the page pool (None: the KV bytes of the contiguous layout, slots * N/P pages
        of tokens and its default regions' prompt pages, plus a page per slot for its copy
        of its prompt's partial last page and the null page).
      paged_attention: how a paged step reads its pages (`gjax.rollout.pages.
        PAGED_ATTENTION`): 'auto' (the platform's Pallas kernel on a GPU / TPU, XLA's
        gather on a CPU), 'xla', 'pallas_gpu', 'pallas_tpu' (interpret mode on a CPU).
      poison_freed_pages: a debug hook: every page freed is filled with NaN (tests: no row
        reads a page after it is freed).

    `stats`: the counters of this thread's last `generate` / `generate_episodes` call (per
    thread: an asynchronous run's producer thread and the loop thread's mid-run held-out
    evaluation decode on one decoder, and each reads its own call's figures).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        slots: int,
        tokens_per_dispatch: int,
        prompt_regions: int | None = None,
        prefill_batch: int | None = None,
        share_prompt: bool = True,
        prefill_chunk: int = 0,
        observation_chunk: int = 32,
        kv_page_size: int = 0,
        kv_pages: int | None = None,
        paged_attention: str = "auto",
        poison_freed_pages: bool = False,
    ):
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        if observation_chunk <= 0:
            raise ValueError(f"observation_chunk must be > 0, got {observation_chunk}")
        if slots <= 0 or tokens_per_dispatch <= 0:
            raise ValueError(
                f"slots ({slots}) and tokens_per_dispatch ({tokens_per_dispatch}) must be > 0"
            )
        if kv_page_size < 0:
            raise ValueError(f"kv_page_size must be >= 0, got {kv_page_size}")
        if kv_page_size and prefill_chunk:
            raise ValueError(
                f"kv_page_size={kv_page_size} (paged KV) prefills each prompt whole: "
                f"prefill_chunk must be 0, got {prefill_chunk}"
            )
        if kv_pages is not None and kv_pages < 2:
            raise ValueError(f"kv_pages must be >= 2 (one is the null page), got {kv_pages}")
        if prompt_regions is not None and prompt_regions <= 0:
            raise ValueError(f"prompt_regions must be > 0, got {prompt_regions}")
        self.cfg, self.slots, self.steps = cfg, slots, tokens_per_dispatch
        self.prompt_regions, self.prefill_batch = prompt_regions, prefill_batch
        self.share_prompt = share_prompt
        self.prefill_chunk = prefill_chunk
        self.observation_chunk = observation_chunk
        self.kv_page_size, self.kv_pages = kv_page_size, kv_pages
        self.paged_attention = pages.attention_for(paged_attention)  # resolved: fails fast
        self.poison_freed_pages = poison_freed_pages
        self._local = threading.local()

    @property
    def stats(self) -> dict[str, float]:
        return getattr(self._local, "stats", {})

    @stats.setter
    def stats(self, value: dict[str, float]) -> None:
        self._local.stats = value

    def regions_for(self, num_samples: int) -> int:
        """R for groups of `num_samples` rows."""
        if not self.share_prompt:
            return self.slots
        if self.prompt_regions is not None:
            return self.prompt_regions
        return min(self.slots, 4 * -(-self.slots // num_samples))

    def generate(
        self,
        params,
        prompt_tokens_PxS,
        prompt_mask_PxS,
        rng,
        *,
        num_samples: int,
        sampling: SamplingParams,
        max_tokens_B=None,
        order=None,
    ) -> SampleOutput:
        """`gjax.rollout.sampler.generate`'s contract. `max_tokens_B`: per-row length limits
        (<= max_new_tokens; benchmarks); `order`: the rows' admission order (default 0..B-1).

        One turn per row (`_run` has the loop's steps)."""
        run = self._run(
            params,
            prompt_tokens_PxS,
            prompt_mask_PxS,
            rng,
            num_samples,
            sampling,
            OneTurn(),
            max_tokens_B=max_tokens_B,
            order=order,
        )
        return run.outputs()

    def generate_episodes(
        self,
        params,
        prompt_tokens_PxS,
        prompt_mask_PxS,
        rng,
        *,
        num_samples: int,
        sampling: SamplingParams,
        turns: EnvTurns,
    ) -> Trajectories:
        """Multi-turn rows: each row is an episode of `turns`' environment
        (`gjax.rollout.turns`). A row's turn ends at a stop id or its turn's limit; its
        episode steps on the environment's runner while the other slots decode; if the
        episode goes on, the observation's ids re-enter the row's slot (KV kept) and it
        decodes its next turn. The first turn of each row is drawn exactly as `generate`
        draws it (same keys: token n of row b with fold_in(fold_in(rng, b), n))."""
        run = self._run(
            params, prompt_tokens_PxS, prompt_mask_PxS, rng, num_samples, sampling, turns
        )
        out = run.outputs()
        return turns.trajectories(
            out.tokens_BxN, out.mask_BxN, run.out_policy, out.logps_BxN, out.lengths_B
        )

    def _run(self, params, tokens_PxS, mask_PxS, rng, g_, sp, turns, max_tokens_B=None, order=None):
        """One loop turn: admit rows into free slots, prefill (whole prompts, or one chunk),
        insert the admitted rows, re-enter the rows whose environment answered, decode a
        dispatch, collect its tokens, end the turns that ended, and retire the rows that are
        finished (their slots, and a group's region after its last row)."""
        t_start = time.perf_counter()
        run = (_PagedSchedule if self.kv_page_size else _Schedule)(
            self,
            params,
            tokens_PxS,
            mask_PxS,
            rng,
            g_,
            sp,
            turns,
            max_tokens_B=max_tokens_B,
            order=order,
        )
        while run.finished < run.rows:
            new_prompts, admits = run.admit()
            run.check_progress(admits)
            t0 = time.perf_counter()
            admits += run.prefill(new_prompts)
            run.insert(admits)
            run.reenter()
            if not run.decoding():  # only prefills in flight, or rows just retired by `reenter`
                continue
            run.grow()
            step = run.dispatch(t0)
            run.retire(run.end_turns(run.collect(step)))
        self.stats = run.final_stats(time.perf_counter() - t_start)
        return run


class _Dispatched(NamedTuple):
    """One dispatch's host copy: per slot and step the token, its log-prob and whether the
    slot was live; the slots done at its end."""

    tok_SxD: np.ndarray
    logp_SxD: np.ndarray
    live_SxD: np.ndarray
    done_S: np.ndarray


class _Schedule:
    """The host side of one `ContinuousDecoder.generate` (or `generate_episodes`) call: the
    queue of rows, which row each slot decodes (or holds while its environment steps), which
    region each group's prompt holds, the rows' outputs so far, and the device state; its
    methods are the loop's named steps."""

    def __init__(
        self,
        dec: ContinuousDecoder,
        params,
        prompt_tokens_PxS,
        prompt_mask_PxS,
        rng,
        g_,
        sp,
        turns,
        *,
        max_tokens_B,
        order,
    ):
        self.dec, self.params, self.rng, self.g_, self.sp = dec, params, rng, g_, sp
        self.turns = turns
        self.cfg, self.s_ = dec.cfg, dec.slots
        tokens_PxS = np.asarray(prompt_tokens_PxS, np.int32)
        mask_PxS = np.asarray(prompt_mask_PxS, np.int32)
        if tokens_PxS.shape != mask_PxS.shape or tokens_PxS.ndim != 2:
            raise ValueError(
                f"prompt tokens {tokens_PxS.shape} and mask {mask_PxS.shape} must be the same "
                "[P, S] shape"
            )
        self.chunk_ = dec.prefill_chunk
        if self.chunk_ and tokens_PxS.shape[1] % self.chunk_:
            extra = self.chunk_ - tokens_PxS.shape[1] % self.chunk_
            tokens_PxS = np.pad(tokens_PxS, ((0, 0), (extra, 0)))  # masked columns
            mask_PxS = np.pad(mask_PxS, ((0, 0), (extra, 0)))
        self.tokens_PxS, self.mask_PxS = tokens_PxS, mask_PxS
        p_, self.sp_len = tokens_PxS.shape
        self.rows, self.n_ = b_, n_ = p_ * g_, sp.max_new_tokens
        s_ = self.s_
        limits = np.full((b_,), n_, np.int32) if max_tokens_B is None else np.asarray(max_tokens_B)
        if limits.shape != (b_,) or limits.min() < 1 or limits.max() > n_:
            raise ValueError(f"max_tokens_B must be {b_} ints in [1, {n_}]")
        turns.bind(mask_PxS, g_, sp)
        self.limits = turns.first_limits(limits)
        self.r_ = dec.regions_for(g_)
        self.row0 = sp.row_block[0] * b_  # these rows' index in the whole batch: their keys
        self.draw_sp = dataclasses.replace(sp, row_block=(0, 1))  # one key per row, not block
        self.a_ = dec.prefill_batch or max(1, -(-s_ // g_))
        self.group = (lambda b: b // g_) if dec.share_prompt else (lambda b: b)
        self.rows_left = collections.Counter(self.group(b) for b in range(b_))

        self.layers = _layers_jit(self.params, cfg=self.cfg)
        self.slot_step = None  # `_dispatch`'s step: the contiguous slots'
        self.reenter_fn = _reenter_jit
        self.stalled: set = set()  # paged: slots held back from a dispatch, short of pages
        self.state = self.init_device_state()
        self.out_tok = np.full((b_, n_), sp.pad_token_id, np.int32)
        self.out_logp = np.zeros((b_, n_), np.float32)
        self.out_len = np.zeros((b_,), np.int32)
        self.out_policy = np.zeros((b_, n_), bool)  # sampled by the policy (not inserted)
        self.turn_start = np.zeros((b_,), np.int32)
        self.waiting: set = set()  # slots whose row's environment step is in flight
        queue = list(range(b_) if order is None else order)
        if sorted(queue) != list(range(b_)):
            raise ValueError(f"order must be a permutation of range({b_})")
        self.queue = queue
        self.free_slots, self.free_regions = list(range(s_)), list(range(self.r_))
        self.region_of: dict[int, int] = {}
        self.slot_row = [-1] * s_
        self.stats = collections.Counter()
        self.t_device = 0.0
        self.finished = 0
        self.ready: set = set()  # groups whose region is prefilled
        self.pending: list = []  # chunked prefill: [prompt, region, group, next column]

    def init_device_state(self):
        return init_state(self.cfg, self.s_, self.r_, self.sp_len, self.n_)

    # --- the loop's steps -------------------------------------------------------------

    def admit(self):
        """Rows in order into free slots, skipping a row whose prompt needs a region while
        none is free (or, chunked, whose region is still being prefilled). Returns the new
        prompts (prompt, region) and the admitted rows (slot, region, row key, limit)."""
        new_prompts, admits, waiting = [], [], []
        for b in self.queue:
            if not self.free_slots:
                waiting.append(b)
                continue
            g = self.group(b)
            if g not in self.region_of:
                if not self.free_regions:
                    waiting.append(b)
                    continue
                self.region_of[g] = self.free_regions.pop(0)
                new_prompts.append((b // self.g_, self.region_of[g]))
                if not self.chunk_:
                    self.ready.add(g)
                else:
                    self.pending.append([b // self.g_, self.region_of[g], g, 0])
            if g not in self.ready:
                waiting.append(b)
                continue
            s = self.free_slots.pop(0)
            self.slot_row[s] = b
            admits.append((s, self.region_of[g], self.row0 + b, self.limits[b]))
        self.queue = waiting
        return new_prompts, admits

    def idle(self) -> bool:
        """No slot holds a row."""
        return all(r < 0 for r in self.slot_row)

    def decoding(self) -> bool:
        """Some slot holds a row that decodes (not waiting for its environment)."""
        return any(r >= 0 and s not in self.waiting for s, r in enumerate(self.slot_row))

    def check_progress(self, admits) -> None:
        if self.idle() and not self.pending and not admits:
            raise RuntimeError(f"continuous decoder: {len(self.queue)} rows and no live slot")

    def prefill(self, new_prompts) -> list:
        """Whole prompts (every new one, A per call), or chunked one chunk of up to A pending
        prompts; returns the rows admitted once a chunk completes their prompt."""
        if not self.chunk_:
            self.prefill_whole(new_prompts)
            return []
        if self.pending:  # one chunk, then decode: prefill never stalls it
            self.prefill_next_chunk()
            return self.admit()[1]
        return []

    def prefill_whole(self, new_prompts) -> None:
        a_, r_ = self.a_, self.r_
        for i in range(0, len(new_prompts), a_):
            chunk = new_prompts[i : i + a_]
            idx = [p for p, _ in chunk] + [chunk[0][0]] * (a_ - len(chunk))
            reg = [r for _, r in chunk] + [r_] * (a_ - len(chunk))
            self.state = _prefill_jit(
                self.params,
                self.cfg,
                self.state,
                self.tokens_PxS[idx],
                self.mask_PxS[idx],
                np.asarray(reg, np.int32),
            )
            self.stats["prefill_calls"] += 1
            self.stats["prompts_prefilled"] += len(chunk)

    def prefill_next_chunk(self) -> None:
        """Columns [c, c + C) of up to A pending prompts; a prompt whose last chunk this is
        makes its group ready."""
        a_, chunk_, pending = self.a_, self.chunk_, self.pending
        part = pending[:a_]
        fill = part + [[part[0][0], self.r_, -1, 0]] * (a_ - len(part))
        idx = np.asarray([e[0] for e in fill])
        start = np.asarray([e[3] for e in fill], np.int32)
        cols = start[:, None] + np.arange(chunk_)[None, :]
        self.state = _chunk_jit(
            self.params,
            self.cfg,
            self.layers,
            self.state,
            np.take_along_axis(self.tokens_PxS[idx], cols, axis=1),
            start,
            self.mask_PxS[idx],
            np.asarray([e[1] for e in fill], np.int32),
        )
        self.stats["prefill_calls"] += 1
        for e in part:
            e[3] += chunk_
            if e[3] >= self.sp_len:
                self.ready.add(e[2])
                self.stats["prompts_prefilled"] += 1
        pending[:] = [e for e in pending if e[3] < self.sp_len]

    def insert(self, admits) -> None:
        """Starts the admitted rows in their slots (S entries, padded)."""
        if admits:
            pad = [(self.s_, 0, 0, 1)] * (self.s_ - len(admits))
            cols = np.asarray(admits + pad, np.int32).T
            self.state = _insert_jit(self.state, self.rng, *cols)

    def grow(self) -> None:
        """Before a dispatch: the contiguous slots hold all N columns already."""

    def dispatch(self, t0: float) -> _Dispatched:
        """Up to `tokens_per_dispatch` decode steps of every live slot; one host sync."""
        self.stats["dispatches_beside_prefill"] += bool(self.pending)
        t1 = time.perf_counter()
        self.state, tok, logp, live, d = _dispatch_jit(
            self.params,
            self.cfg,
            self.layers,
            self.state,
            sp=self.draw_sp,
            steps=self.dec.steps,
            slot_step=self.slot_step,
        )
        tok, logp, live, d, done = jax.device_get((tok, logp, live, d, self.state.done_S))
        self.t_device += time.perf_counter() - t1
        self.stats["admit_s"] += t1 - t0
        self.stats["dispatches"] += 1
        self.stats["decode_steps"] += int(d)
        self.stats["slot_steps_live"] += int(live.sum())
        return _Dispatched(tok, logp, live, done)

    def collect(self, step: _Dispatched) -> list[int]:
        """Appends each live slot's tokens to its row; returns the slots whose row ended."""
        ended = []
        for s in range(self.s_):
            b = self.slot_row[s]
            # free, done and waiting for its environment, or (paged) held back for pages
            if b < 0 or s in self.waiting or s in self.stalled:
                continue
            k = int(step.live_SxD[s].sum())
            n = self.out_len[b]
            self.out_tok[b, n : n + k] = step.tok_SxD[s, :k]
            self.out_logp[b, n : n + k] = step.logp_SxD[s, :k]
            self.out_policy[b, n : n + k] = True
            self.out_len[b] += k
            if step.done_S[s]:
                ended.append(s)
        return ended

    def end_turns(self, slots) -> list[int]:
        """Hands each ended turn to `turns`; returns the slots whose row is finished (the
        others wait for their environment's answer)."""
        finished = []
        for s in slots:
            b = self.slot_row[s]
            ids = self.out_tok[b, self.turn_start[b] : self.out_len[b]]
            if self.turns.end_turn(b, ids):
                finished.append(s)
            else:
                self.waiting.add(s)
        return finished

    def reenter(self) -> None:
        """Rows whose environment answered: a finished episode's row retires; the others
        get the observation's ids appended to their slot (`_reenter`, C columns per call, all
        such rows at once) and decode their next turn. Waits for an answer only when no slot
        decodes and no prompt is being prefilled."""
        block = bool(self.waiting) and not self.decoding() and not self.pending
        t0 = time.perf_counter()
        answers = self.turns.answers(self.out_len, block=block)
        if block:
            self.stats["env_wait_s"] += time.perf_counter() - t0
        if not answers:
            return
        slot_of = {b: s for s, b in enumerate(self.slot_row) if b >= 0}
        done, entries = [], []
        for b, ids in answers:
            s = slot_of[b]
            self.waiting.discard(s)
            if ids is None:
                done.append(s)
                continue
            n, m = int(self.out_len[b]), len(ids)
            self.out_tok[b, n : n + m] = ids
            self.out_len[b] = self.turn_start[b] = n + m
            entries.append((s, ids, self.turns.turn_limit(n + m)))
        self.retire(done)
        if entries:
            self.reenter_rows(entries)

    def reenter_rows(self, entries) -> None:
        """`entries` (slot, observation ids, next turn's limit): the ids into the slots,
        C columns per call."""
        s_, c_ = self.s_, self.dec.observation_chunk
        slot_M = np.full((s_,), s_, np.int32)
        limit_M = np.zeros((s_,), np.int32)
        ids_MxW = np.zeros((s_, max(len(e[1]) for e in entries)), np.int32)
        count_M = np.zeros((s_,), np.int32)
        for i, (s, ids, limit) in enumerate(entries):
            slot_M[i], limit_M[i], count_M[i] = s, limit, len(ids)
            ids_MxW[i, : len(ids)] = ids
        for c0 in range(0, ids_MxW.shape[1], c_):
            cols = np.zeros((s_, c_), np.int32)
            part = ids_MxW[:, c0 : c0 + c_]
            cols[:, : part.shape[1]] = part
            self.state = self.reenter_fn(
                self.params,
                self.cfg,
                self.layers,
                self.state,
                slot_M,
                cols,
                np.clip(count_M - c0, 0, c_).astype(np.int32),
                limit_M,
            )
            self.stats["reenter_calls"] += 1
        self.stats["rows_reentered"] += len(entries)

    def retire(self, slots) -> None:
        """Frees `slots` (their rows are finished) and, after a group's last row, its region;
        the free slots stay in order (admission takes the lowest)."""
        for s in slots:
            b = self.slot_row[s]
            self.slot_row[s] = -1
            self.free_slots.append(s)
            self.finished += 1
            g = self.group(b)
            self.rows_left[g] -= 1
            if self.rows_left[g] == 0:
                self.free_regions.append(self.region_of.pop(g))
        self.free_slots.sort()

    # --- the results ------------------------------------------------------------------

    def outputs(self) -> SampleOutput:
        mask = (np.arange(self.n_)[None, :] < self.out_len[:, None]).astype(np.int32)
        return SampleOutput(
            jnp.asarray(self.out_tok),
            jnp.asarray(mask),
            jnp.asarray(self.out_logp),
            jnp.asarray(self.out_len),
        )

    def final_stats(self, wall: float) -> dict[str, float]:
        st = self.stats
        return {
            **st,
            **self.turns.stats(),
            "useful_tokens": int(self.out_len.sum()),
            "wall_s": wall,
            "dispatch_s": self.t_device,
            "host_s": wall - self.t_device - st["admit_s"],
            "regions": self.r_,
            "slots": self.s_,
        }


class _PagedSchedule(_Schedule):
    """`_Schedule` on paged KV (`kv_page_size` > 0, gjax.rollout.pages): a group's prompt gets
    ceil(Sq / page) pages when its first row is admitted (one reference for the group, one per
    row), a row gets its own pages in `grow`, before each dispatch, for `tokens_per_dispatch`
    more tokens (the first a copy of its prompt's partial last page), and `retire` releases
    them. A row is admitted only while the pool can also give every live row its next pages.
    A live row that cannot grow is held back from the dispatch (`stalled`: done on the device,
    its logits and pages kept); if every row is held back, the youngest is preempted: its
    pages freed, it is decoded again from its first token later (the same tokens: its keys
    depend only on its row index and token index)."""

    def __init__(self, dec: ContinuousDecoder, *args, **kw):
        self.page = dec.kv_page_size
        super().__init__(dec, *args, **kw)
        page, n_ = self.page, self.n_
        if n_ % page:
            raise ValueError(
                f"kv_page_size={page} must divide max_new_tokens={n_} (a row's own tokens "
                "fill whole pages)"
            )
        self.q_ = pages.prompt_pages(self.sp_len, page)
        self.width = self.q_ + n_ // page
        self.slot_step = pages.SLOT_STEPS[dec.paged_attention]
        self.reenter_fn = pages.paged_reenter_jit
        self.plen_P = self.mask_PxS.sum(-1)  # each prompt's length: its rows' first column
        self.limit_of = [0] * self.s_  # the slot's row's length limit (its turn's)
        self.table_SxP = np.full((self.s_, self.width), pages.NULL_PAGE, np.int32)
        self.own_pages: list[list[int]] = [[] for _ in range(self.s_)]
        self.group_pages: dict[int, list[int]] = {}
        # (source, page) fills before the next dispatch: a prompt's tail into a row's first
        # page, and (a kernel reads its pages: pages.kernel_attention) zeros into new ones
        self.fills: list[tuple[int, int]] = []
        self.zero_new = dec.paged_attention != "xla"
        self.admitted_at = [0] * self.s_
        self.admissions = 0
        on_free = self.poison if dec.poison_freed_pages else None
        self.pool = pages.PagePool(self.num_pages, on_free=on_free)
        need = pages.min_pages(self.sp_len, n_, page)
        if self.num_pages < need:
            raise ValueError(
                f"kv_pages={self.num_pages} holds fewer than one row's {self.width} pages "
                f"({self.q_} of its prompt, {n_ // page} of its tokens), its prompt's tail "
                f"and the null page ({need})"
            )

    def init_device_state(self):
        # the default pool: the contiguous layout's bytes (S slots of N, its R = self.r_
        # regions of the prompt width), plus the null page
        self.num_pages = self.dec.kv_pages or pages.default_pages(
            self.s_, self.r_, self.sp_len, self.n_, self.page
        )
        # a region holds a prompt's mask, length and logits only; keeping the contiguous R
        # keeps the default pool sufficient: no row is ever held back or preempted
        return pages.init_paged_state(
            self.cfg,
            self.s_,
            self.r_,
            self.sp_len,
            self.n_,
            pages=self.num_pages,
            page_size=self.page,
        )

    def poison(self, freed) -> None:
        ids = np.full((self.num_pages,), self.num_pages, np.int32)  # padding: dropped
        ids[: len(freed)] = freed
        self.state = pages.poison_jit(self.state, ids)
        self.stats["pages_poisoned"] += len(freed)

    def plen(self, s: int) -> int:
        """Slot `s`'s row's prompt length."""
        return int(self.plen_P[self.slot_row[s] // self.g_])

    def pages_for(self, s: int) -> int:
        """Own pages slot `s`'s row needs for the next dispatch."""
        b = self.slot_row[s]
        end = min(int(self.out_len[b]) + self.dec.steps, self.limit_of[s])
        return pages.own_pages(self.plen(s), end, self.page)

    def grow_to(self, s: int, own: int) -> None:
        """Slot `s`'s row holds `own` own pages (the pool has them); the first, if its prompt
        ends inside a page, is to be a copy of that page, the others zeros where a kernel
        reads them (`flush_fills`)."""
        more = own - len(self.own_pages[s])
        if more > 0:
            got = self.pool.alloc(more)
            plen = self.plen(s)
            tail = self.group_pages[self.group(self.slot_row[s])][-1] if plen % self.page else None
            self.fills += pages.new_page_fills(got, not self.own_pages[s], tail, self.zero_new)
            n0 = pages.shared_pages(plen, self.page) + len(self.own_pages[s])
            self.table_SxP[s, n0 : n0 + more] = got
            self.own_pages[s] += got

    def flush_fills(self) -> None:
        """The fills `grow_to` queued, into the device's pool (one call per S pages)."""
        for src, dst in pages.fill_chunks(self.fills, self.s_):
            self.state = pages.fill_pages_jit(self.state, src, dst)
        self.fills = []

    def growth_need(self) -> int:
        return sum(
            max(0, self.pages_for(s) - len(self.own_pages[s]))
            for s, b in enumerate(self.slot_row)
            if b >= 0 and s not in self.waiting
        )

    def admit(self):
        new_prompts, admits, waiting = [], [], []
        spare = self.pool.available() - self.growth_need()
        for b in self.queue:
            g = self.group(b)
            plen = int(self.plen_P[b // self.g_])
            first = pages.own_pages(plen, min(self.dec.steps, int(self.limits[b])), self.page)
            new_group = g not in self.region_of
            prompt = pages.prompt_pages(plen, self.page)
            need = first + (prompt if new_group else 0)
            if (
                not self.free_slots
                or self.stalled
                or need > spare
                or (new_group and not self.free_regions)
            ):
                waiting.append(b)
                continue
            if new_group:
                self.region_of[g] = self.free_regions.pop(0)
                self.group_pages[g] = self.pool.alloc(prompt)  # the group's reference
                new_prompts.append((b // self.g_, self.region_of[g], self.group_pages[g]))
            spare -= need
            s = self.free_slots.pop(0)
            self.slot_row[s] = b
            self.pool.ref(self.group_pages[g])  # the row's reference
            shared = pages.shared_pages(plen, self.page)
            self.table_SxP[s, :shared] = self.group_pages[g][:shared]
            self.admissions += 1
            self.admitted_at[s] = self.admissions
            self.limit_of[s] = int(self.limits[b])
            admits.append((s, self.region_of[g], self.row0 + b, self.limits[b]))
        self.queue = waiting
        return new_prompts, admits

    def prefill_whole(self, new_prompts) -> None:
        a_, r_ = self.a_, self.r_
        for i in range(0, len(new_prompts), a_):
            chunk = new_prompts[i : i + a_]
            pad = a_ - len(chunk)
            idx = [p for p, _, _ in chunk] + [chunk[0][0]] * pad
            reg = [r for _, r, _ in chunk] + [r_] * pad
            ids = [q + [pages.NULL_PAGE] * (self.q_ - len(q)) for _, _, q in chunk]
            ids += [[pages.NULL_PAGE] * self.q_] * pad
            self.state = pages.paged_prefill_jit(
                self.params,
                self.cfg,
                self.state,
                self.tokens_PxS[idx],
                self.mask_PxS[idx],
                np.asarray(reg, np.int32),
                np.asarray(ids, np.int32),
            )
            self.stats["prefill_calls"] += 1
            self.stats["prompts_prefilled"] += len(chunk)

    def insert(self, admits) -> None:
        if admits:
            pad = [(self.s_, 0, 0, 1)] * (self.s_ - len(admits))
            cols = np.asarray(admits + pad, np.int32).T
            self.state = pages.paged_insert_jit(self.state, self.rng, *cols)

    def grow(self) -> None:
        """Each live row's pages for the next dispatch, oldest row first; a row the pool
        cannot serve is held back, and if all are, the youngest rows are preempted until the
        oldest can grow (a row in its first turn only: a later turn's environment has
        stepped). Then the table and which slots run go to the device."""
        while True:
            live = self.live_by_age()
            self.stalled = set()
            for s in live:
                if self.pages_for(s) - len(self.own_pages[s]) > self.pool.available():
                    self.stalled.add(s)
                else:
                    self.grow_to(s, self.pages_for(s))
            if not live or len(self.stalled) < len(live):
                break
            self.preempt_youngest(f"{len(live)} live rows' next pages")
        self.flush_fills()
        self.stats["slots_stalled"] += len(self.stalled)
        done_S = np.asarray(
            [b < 0 or s in self.stalled or s in self.waiting for s, b in enumerate(self.slot_row)]
        )
        self.state = self.state._replace(
            table_SxP=jnp.asarray(self.table_SxP), done_S=jnp.asarray(done_S)
        )

    def live_by_age(self) -> list[int]:
        """Slots whose row decodes (not waiting for its environment), oldest first."""
        live = [s for s, b in enumerate(self.slot_row) if b >= 0 and s not in self.waiting]
        return sorted(live, key=self.admitted_at.__getitem__)

    def preempt_youngest(self, what: str) -> None:
        """Preempts the youngest decoding row still in its first turn; none: the pool is too
        small for `what`."""
        first_turn = [s for s in self.live_by_age() if self.turn_start[self.slot_row[s]] == 0]
        if not first_turn:
            raise RuntimeError(
                f"continuous decoder: kv_pages={self.num_pages} cannot hold {what} and no row "
                "in its first turn can be preempted (a later turn's environment has stepped); "
                "give the decoder more pages (kv_pages) or fewer slots"
            )
        self.preempt(first_turn[-1])

    def reenter_rows(self, entries) -> None:
        """Pages for each observation (the row's own pages to its end), preempting first-turn
        rows if the pool is short; then the observation goes into them."""
        for s, ids, limit in entries:
            own = pages.own_pages(self.plen(s), int(self.out_len[self.slot_row[s]]), self.page)
            while own - len(self.own_pages[s]) > self.pool.available():
                self.preempt_youngest(f"an observation of {len(ids)} tokens")
            self.grow_to(s, own)
            self.limit_of[s] = int(limit)
        self.flush_fills()
        self.state = self.state._replace(table_SxP=jnp.asarray(self.table_SxP))
        super().reenter_rows(entries)

    def release_slot(self, s: int) -> None:
        """The pages slot `s`'s row holds: its own, and its reference to its group's."""
        self.fills = [f for f in self.fills if f[1] not in self.own_pages[s]]
        self.pool.release(self.own_pages[s])
        self.own_pages[s] = []
        self.pool.release(self.group_pages[self.group(self.slot_row[s])])
        self.table_SxP[s] = pages.NULL_PAGE

    def preempt(self, s: int) -> None:
        """Frees slot `s` and its pages; its row goes back to the queue's head, from token 0."""
        b = self.slot_row[s]
        self.release_slot(s)
        self.slot_row[s] = -1
        self.free_slots.append(s)
        self.free_slots.sort()
        self.out_tok[b] = self.sp.pad_token_id
        self.out_logp[b] = 0.0
        self.out_policy[b] = False
        self.out_len[b] = 0
        self.queue.insert(0, b)
        self.stats["rows_preempted"] += 1

    def retire(self, slots) -> None:
        for s in slots:
            self.release_slot(s)
        super().retire(slots)
        for g in [g for g in self.group_pages if g not in self.region_of]:
            self.pool.release(self.group_pages.pop(g))  # the group's reference: its last row

    def final_stats(self, wall: float) -> dict[str, float]:
        return {
            **super().final_stats(wall),
            "kv_page_size": self.page,
            "kv_pages": self.num_pages,
            "kv_pages_peak": self.pool.peak_used,
            "pages_allocated": self.pool.allocated,
        }
