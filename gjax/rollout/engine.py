"""gjax's Flax decoder as a JetStream `Engine`: slot-based decode state, continuous batching.

JetStream's orchestrator drives three pure pieces over a fixed number of decode slots:
`prefill` (one request's prompt -> its KV and next-token logits, at a bucketed length),
`insert` (that prefix into a free slot) and `generate` (up to `tokens_per_dispatch` tokens for
every live slot). A slot is freed as soon as its request ends, so with long-tailed response
lengths the decode batch stays full, where a static batch runs until its longest row ends.

The decode state and step are `gjax.rollout.decoder`'s (one implementation): each slot holds
only its generated KV ([S, K, N, Dh] per layer, N = max_new_tokens); a prompt's KV lives in a
prompt region ([R, K, Sp, Dh], Sp = max_prefill_length, R = S so an insert always finds one),
written ONCE and read by every slot whose request has that prompt (same tokens, same params
version): the G requests of a group store their prompt once, not G times. Regions are counted
on the generate thread (the only one that inserts): a slot's region is released when the slot
is inserted again (JetStream reuses only finished slots). The state is a dict: the decoder's
`SlotState` fields plus `serial_S`.

`generate` is the decoder's `_dispatch`: each step draws each live slot's token from its stored
logits (`SamplingParams`, the log-prob definition of `gjax.rollout.sampler`: log_softmax(logits
/ T) over the full vocabulary, T = 1 for greedy), emits it and decodes it. JetStream 0.2.2 reads
a generate call's tokens per slot as "speculations" ([S, k] tokens and valid flags; a request
ends at its first invalid column), so k = `tokens_per_dispatch` tokens per call are served as
they are; its per-request `max_tokens` is checked only against the length column (the length
after the call's first token), so a request may get up to k - 1 tokens past its max_tokens:
clients cut them (`gjax.rollout.grpc_server`, `gjax.rollout.jetstream_backend`). A slot
finishes after emitting a stop id (which is returned, as in the local sampler) or
`max_new_tokens` tokens. A slot whose logits are not finite emits `ERROR_TOKEN` (-2, valid) and
finishes: the server ends that request with an error status (`gjax.rollout.grpc_server`); no
other slot reads it. `insert` zeroes its slot's own cache, so what a slot held before (a
previous request's tokens, NaN from a failed one) never reaches the next: attention gives
masked positions probability 0, but 0 x NaN in a stale V would still be NaN.

Paged KV (`kv_page_size` > 0): the state is `gjax.rollout.pages.PagedState` instead, a slot
reading its prompt's pages and its own through a page table, and `_PagedKV` keeps the pages on
the host: a slot's pages and region go back as soon as a call finds its request done (not at
its next insert), nothing is zeroed at insert (a row reads only what it has written), and a
request the pool cannot hold is preempted with RESTART_TOKEN (see `_PagedKV`).

Requests arrive with JetStream's BOS in front (its token path without a BOS is broken in
0.2.2: `pad_tokens` reads `.shape` of a list), so the tokenizer's `bos_id` is the sentinel
-1 and `prefill` drops that position: the model sees exactly the client's token ids.
G requests for the same prompt, arriving one after another, share one prefill computation.

Params reach the engine through a `ParamsHolder`: JetStream's threads read `params` once,
before their loops, so the holder is what they capture, and `swap` rebinds what it holds
between steps. Same shapes and shardings, so nothing recompiles. Slots live when a swap lands
(`rollout.weight_change`): 'finish' decodes on with the new params over the old prompt and
token KV (a partial rollout: each token's version and log-prob are in the records, so the
in-process backend's behaviour log-probs are the ones sampled with); 'restart' ends each such
slot with `RESTART_TOKEN` and its client sends the request again.

Memory: `generate` reads each params version's layers in the decode layout (`decode_layers`:
per layer, q|k|v and gate|up concatenated, in the compute dtype), built once per version and
kept: one more copy of the layer weights (0.5x the params for f32 params computing in bf16,
1x when they share a dtype). The previous version's copy is dropped before the new one is
built, so a swap holds at most the new params, the new copy and whatever still holds the old
params (the caller). Building it inside each `generate` call instead saves no peak memory (the
copy is then a temporary of every call) and cost 3-7% more CPU per token at 8 tokens per call,
25-31% at 1 (`benchmarks/engine_step.py`'s model, 32 slots).
"""

from __future__ import annotations

import collections
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from gjax.models.config import ModelConfig
from gjax.models.transformer import decode_layers, logits_from_hidden, prefill
from gjax.rollout import decoder, pages
from gjax.rollout.buckets import PREFILL_BUCKETS, prefill_bucket  # noqa: F401 - re-exported
from gjax.rollout.jetstream_compat import jetstream
from gjax.rollout.sampler import SamplingParams

BOS_SENTINEL = -1
ERROR_TOKEN = -2  # a slot's logits were not finite: its request ends with an error
RESTART_TOKEN = -3  # weight_change='restart': new weights landed; the request is sent again
# ResultTokens columns, k = tokens per generate call: JetStream reads [tokens k | valid k |
# length 1]; gjax's backend also reads [serial 1 | first token's index 1 | log-probs k (f32
# bits) | first token's version 1 | the other tokens' version 1 | the call's decode steps 1
# (every slot's row)]. A token's version is that of
# the params whose logits it was drawn from (its log-prob's): a call's first token comes from
# logits computed before it (the previous call's, or the prompt's at insert).


class ParamsHolder:
    """Versioned, swappable params. JetStream captures the holder; `swap` rebinds its content."""

    def __init__(self, params, version: int = 0):
        self._lock = threading.Lock()
        self._current = (params, version)

    def get(self):
        """(params, version), read atomically."""
        return self._current

    @property
    def params(self):
        return self._current[0]

    @property
    def version(self) -> int:
        return self._current[1]

    def swap(self, params, version: int | None = None) -> int:
        with self._lock:
            version = self._current[1] + 1 if version is None else int(version)
            self._current = (params, version)
        return version

    def swap_if_newer(self, params, version: int) -> bool:
        """Swaps in `params` as `version` unless that is not newer than what is held (two
        hand-offs, the push directory and the gRPC stream, may race)."""
        with self._lock:
            if int(version) <= self._current[1]:
                return False
            self._current = (params, int(version))
        return True


def _unwrap(params):
    return params.get() if isinstance(params, ParamsHolder) else (params, 0)


class _Prefix:
    """One request's prompt KV. Deliberately not a pytree: JetStream deletes the arrays of
    every inserted prefix (`delete_pytree`), and G requests share these through the cache.
    `key` (tokens, length, params version) names the prompt region it may share. `limit`: the
    request's max_tokens, which gjax's generate thread (`jetstream_compat.Driver`) sets before
    the insert, so its slot stops there (None: the engine's max_new_tokens). JetStream checks
    max_tokens itself but does not tell the engine, whose slot would decode on, unread (and,
    paged, hold pages), until its next insert."""

    __slots__ = ("k", "v", "logits", "length", "serial", "key", "version", "rejected", "limit")

    def __init__(self, k, v, logits, length, serial, key=None, version=0, rejected=False):
        self.k, self.v, self.logits = k, v, logits
        self.length, self.serial, self.key, self.rejected = length, serial, key, rejected
        self.version = version
        self.limit = None


class Tokenizer(jetstream.tokenizer_api.Tokenizer):
    """JetStream tokenizer over a Hugging Face one. Stops are the engine's job (the returned
    completion keeps its stop token, as gjax's sampler does), so `stop_tokens` is empty."""

    def __init__(self, hf_tokenizer, pad_id: int, eos_id: int, max_prefill_length: int):
        self.hf, self._pad, self._eos, self._max = hf_tokenizer, pad_id, eos_id, max_prefill_length

    def encode(self, s: str, **kwargs):
        ids = np.asarray(self.hf(s, add_special_tokens=False)["input_ids"], np.int32)
        return jetstream.token_utils.pad_tokens(
            ids,
            self.bos_id,
            self.pad_id,
            is_bos=kwargs.get("is_bos", True),
            max_prefill_length=self._max,
            jax_padding=kwargs.get("jax_padding", True),
        )

    def decode(self, token_ids, **kwargs) -> str:
        token_ids = [t for t in token_ids if t >= 0]  # ERROR_TOKEN has no text
        return "" if self.hf is None else self.hf.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return BOS_SENTINEL

    @property
    def stop_tokens(self) -> set[int]:
        return set()


class _PagedKV:
    """The paged engine's host bookkeeping (`kv_page_size` > 0; generate thread only): the page
    pool, each slot's page table (its prompt's full pages, then its own: the first a copy of
    the prompt's partial last page, made before the call that first writes it), which pages
    hold each region's prompt, and which requests end at the next `generate` call with
    RESTART_TOKEN.

    JetStream's orchestrator inserts a request whenever a slot is free and ends a request at
    the first column a call marks invalid, so a slot can neither wait for pages nor be held
    back from a call (the local decoder's `_PagedSchedule` does both). Where the pool runs
    short the engine preempts instead, as weight_change='restart' does: the request emits
    RESTART_TOKEN and ends, and its client sends it again (the in-process backend and the
    gRPC client retry it, within their deadline). A prompt's pages stay with its region while
    the region is cached (a later request with that prompt reads them, as with contiguous
    regions); regions no slot reads give their pages back first when the pool is short. Then
    `grow` gives each live request its pages for the call's tokens, oldest first, preempting
    the youngest until the oldest can grow; `room_for_prompt` preempts the request being
    inserted when even that leaves no room for its prompt. A request whose pages the pool
    holds is never preempted by the default pool (the contiguous layout's bytes)."""

    def __init__(self, engine: Engine, on_free=None, zero_new: bool = False):
        self.e = engine
        s_ = engine._slots
        self.pool = pages.PagePool(engine._num_pages, on_free=on_free)
        self.table_SxP = np.full((s_, engine._width), pages.NULL_PAGE, np.int32)
        self.own: list[list[int]] = [[] for _ in range(s_)]
        self.region_pages: dict[int, list[int]] = {}
        self.region_len: dict[int, int] = {}  # its prompt's length
        self.plen = [0] * s_  # the slot's prompt's length: its first own column
        self.tail: list[int | None] = [None] * s_  # its prompt's partial last page
        # (source, page) fills before the next call: a prompt's tail into a slot's first
        # page, and (a kernel reads its pages: pages.kernel_attention) zeros into new ones
        self.fills: list[tuple[int, int]] = []
        self.zero_new = zero_new
        self.live = [False] * s_  # inserted, not yet seen done
        self.limit = [0] * s_
        self.age = [0] * s_
        self.inserted = 0
        self.preempt_S = np.zeros((s_,), bool)  # end with RESTART_TOKEN at the next call
        self.preempted = 0

    def end(self, slot: int) -> None:
        """`slot`'s request is over (or preempted): its own pages freed, its region released."""
        self.fills = [f for f in self.fills if f[1] not in self.own[slot]]
        self.pool.release(self.own[slot])
        self.own[slot] = []
        self.table_SxP[slot] = pages.NULL_PAGE
        self.live[slot] = False
        self.e._release(slot)

    def _evict(self, need: int) -> bool:
        """Frees cached prompts' pages (regions no slot reads, least recently used first)
        until `need` pages are free; whether they are."""
        e = self.e
        idle = [r for r in self.region_pages if e._refs[r] == 0]
        for r in sorted(idle, key=e._last_use.__getitem__):
            if self.pool.available() >= need:
                break
            self.pool.release(self.region_pages.pop(r))
            self.region_len.pop(r)
            e._region_of.pop(e._region_key[r], None)
            e._region_key[r] = None
        return self.pool.available() >= need

    def room_for_prompt(self, prefix, slot: int) -> bool:
        """Whether `prefix`'s prompt has its pages (a cached region's, or free ones); if not,
        the request inserted in `slot` is preempted (RESTART_TOKEN at the next call)."""
        need = pages.prompt_pages(prefix.length, self.e._page)
        if prefix.key in self.e._region_of or self._evict(need):
            return True
        self.preempt_S[slot] = True
        self.preempted += 1
        return False

    def write_region(self, region: int, length: int) -> jax.Array:
        """The Q entries (ceil(length / page) pages, then the null page) that `region`'s new
        prompt of `length` tokens is written into (its old prompt's pages freed)."""
        self.pool.release(self.region_pages.pop(region, []))
        got = self.pool.alloc(pages.prompt_pages(length, self.e._page))  # room_for_prompt's
        self.region_pages[region], self.region_len[region] = got, length
        return jnp.asarray(got + [pages.NULL_PAGE] * (self.e._q - len(got)), jnp.int32)

    def start(self, slot: int, region: int, limit: int) -> None:
        length, page = self.region_len[region], self.e._page
        shared = pages.shared_pages(length, page)
        self.table_SxP[slot, :shared] = self.region_pages[region][:shared]
        self.plen[slot] = length
        self.tail[slot] = self.region_pages[region][-1] if length % page else None
        self.live[slot] = True
        self.limit[slot] = limit
        self.inserted += 1
        self.age[slot] = self.inserted

    def grow(self, state, version: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Before a call: the requests the device finished end here (their pages freed), and
        so do those the call ends for new weights (`version`: weight_change='restart', the
        params version of the call); each live one gets its pages for the call's tokens,
        oldest first, the youngest preempted while the oldest cannot grow (the prompt tails
        and zeros to fill into new pages: `take_fills`). Returns the call's (table, preempt
        mask). Reads n_S, done_S (and version_S) of the last call: one host sync per call."""
        n_S, done_S, version_S = jax.device_get((state["n_S"], state["done_S"], state["version_S"]))
        if version is not None:  # restarted by this call on the device: no pages needed
            done_S = done_S | (version_S != version)
        for s, live in enumerate(self.live):
            if live and done_S[s] and not self.preempt_S[s]:
                self.end(s)
        page, steps = self.e._page, self.e._steps
        while True:
            order = sorted(
                (s for s, live in enumerate(self.live) if live and not self.preempt_S[s]),
                key=self.age.__getitem__,
            )
            short = False
            for s in order:
                end = min(int(n_S[s]) + steps, self.limit[s])
                more = pages.own_pages(self.plen[s], end, page) - len(self.own[s])
                if more > 0 and not self._evict(more):
                    short = True
                    break
                if more > 0:
                    got = self.pool.alloc(more)
                    first = not self.own[s]
                    self.fills += pages.new_page_fills(got, first, self.tail[s], self.zero_new)
                    q0 = pages.shared_pages(self.plen[s], page) + len(self.own[s])
                    self.table_SxP[s, q0 : q0 + more] = got
                    self.own[s] += got
            if not short:
                break
            youngest = order[-1]  # the oldest alone always fits (the pool holds a request)
            self.end(youngest)
            self.preempt_S[youngest] = True
            self.preempted += 1
        preempt_S = jnp.asarray(self.preempt_S)
        self.preempt_S[:] = False  # this call ends them
        return jnp.asarray(self.table_SxP), preempt_S

    def take_fills(self) -> list:
        """The fills `grow` queued, as `fill_pages` arguments (one call per S pages)."""
        chunks, self.fills = pages.fill_chunks(self.fills, len(self.live)), []
        return chunks


class Engine(jetstream.engine_api.Engine):
    """JetStream Engine for gjax's decoder (see the module docstring).

    Args:
      cfg: the model config. params: params or a `ParamsHolder` (what `load_params` returns).
      sampling: the run's `SamplingParams`; `set_sampling` changes them between batches (each
        distinct setting compiles `generate` once). Its `max_new_tokens` is the cache budget.
      max_concurrent_decodes: decode slots. max_prefill_length: a JetStream bucket.
      seed: the engine's sampling key; request r samples with fold_in(key(seed), r).
      record: keep each step's ResultTokens for `drain_records` (log-probs, versions).
      tokens_per_dispatch: decode steps per `generate` call (one host sync each).
      weight_change: what a live slot does when `generate` finds params of another version
        than its prompt's: 'finish' (decode on with the new ones; each token's version and
        log-prob are recorded) or 'restart' (emit RESTART_TOKEN and end; the client sends
        the request again).
      kv_page_size: tokens per KV page (`gjax.rollout.pages`; 0: the contiguous slots);
        kv_pages: the pool's pages (None: the contiguous layout's bytes at these slots, so
        nothing is ever preempted); poison_freed_pages: a debug hook (tests): each freed
        page is filled with NaN before the next call reads the state. See `_PagedKV`.
        paged_attention: how a paged call reads its pages (`ContinuousDecoder`'s argument).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        sampling: SamplingParams,
        max_concurrent_decodes: int,
        max_prefill_length: int,
        mesh=None,
        tokenizer=None,
        seed: int = 0,
        record: bool = True,
        tokens_per_dispatch: int = 1,
        weight_change: str = "finish",
        kv_page_size: int = 0,
        kv_pages: int | None = None,
        paged_attention: str = "auto",
        poison_freed_pages: bool = False,
    ):
        if weight_change not in ("finish", "restart"):
            raise ValueError(f"weight_change must be 'finish' or 'restart', got {weight_change!r}")
        if tokens_per_dispatch < 1:
            raise ValueError(f"tokens_per_dispatch must be >= 1, got {tokens_per_dispatch}")
        if max_prefill_length not in PREFILL_BUCKETS:
            raise ValueError(
                f"max_prefill_length={max_prefill_length} must be one of JetStream's prefill "
                f"buckets {PREFILL_BUCKETS}"
            )
        self.cfg = cfg
        self.holder = params if isinstance(params, ParamsHolder) else ParamsHolder(params)
        self.max_new_tokens = sampling.max_new_tokens
        self.sampling = sampling
        self._slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self._mesh = mesh
        self._hf_tokenizer = tokenizer
        self._key = jax.random.key(seed)
        self._record = record
        self._records: collections.deque = collections.deque()
        self.decode_steps = 0  # decode steps of the calls drained (`drain_records`)
        self._next_serial = 0
        self._steps = tokens_per_dispatch
        self._restart = weight_change == "restart"
        self._page = kv_page_size
        self._paged_step = pages.SLOT_STEPS[pages.attention_for(paged_attention)]
        if kv_page_size:
            self._paged_shape(kv_page_size, kv_pages)
        self._poison = poison_freed_pages
        self.pages_poisoned = 0  # (the debug hook's count)
        self._kv: _PagedKV | None = None  # paged: the host's page bookkeeping (_regions_reset)
        self._prefix_cache = None  # (key, k, v, logits): the last prompt, for its G requests
        self._layers = (None, None)  # (params, decode_layers(params)): rebuilt on a swap
        self._regions_reset()
        self._prefill_jit = jax.jit(self._prefill_fn)
        self._region_jit = jax.jit(
            _paged_write_region if kv_page_size else _write_region, donate_argnums=(0,)
        )
        self._insert_jit = jax.jit(
            _paged_start_slot if kv_page_size else _start_slot, donate_argnums=(0,)
        )
        self._generate_jit = jax.jit(
            self._generate_fn, static_argnames=("sampling",), donate_argnums=(2,)
        )

    # --- sampling settings and bookkeeping ---------------------------------------------

    def set_sampling(self, sampling: SamplingParams) -> None:
        """The settings of the next requests (call between batches, with no slot live)."""
        if sampling.max_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"max_new_tokens={sampling.max_new_tokens} exceeds the engine's cache budget "
                f"{self.max_new_tokens}"
            )
        self.sampling = sampling

    @property
    def next_serial(self) -> int:
        """The serial the next prefill gets (prefills run in arrival order, one thread)."""
        return self._next_serial

    def drain_records(self) -> np.ndarray:
        """Rows [serial, index, token, logp_bits, version] of every valid token generated
        since the last drain (int32; logp_bits is the f32 log-prob's bit pattern; version: the
        params version of the logits the token was drawn from, as its log-prob is)."""
        k, out = self._steps, []
        while self._records:
            data = np.asarray(self._records.popleft())
            self.decode_steps += int(data[0, 3 * k + 5])
            valid = data[:, k : 2 * k] == 1
            s_, j = np.nonzero(valid)
            cols = [
                data[s_, 2 * k + 1],
                data[s_, 2 * k + 2] + j,
                data[s_, j],
                data[s_, 2 * k + 3 + j],
                np.where(j == 0, data[s_, 3 * k + 3], data[s_, 3 * k + 4]),
            ]
            out.append(np.stack(cols, axis=1))
        return np.concatenate(out).astype(np.int32) if out else np.zeros((0, 5), np.int32)

    def compile_count(self) -> int:
        """Compiled variants of prefill + insert + generate (a weight swap adds none)."""
        fns = (self._prefill_jit, self._region_jit, self._insert_jit, self._generate_jit)
        # (paged: the debug hook's NaN fill is not counted)
        return sum(f._cache_size() for f in fns)

    def _paged_shape(self, page: int, kv_pages: int | None) -> None:
        n_, s_ = self.max_new_tokens, self._slots
        if page < 0 or n_ % page:
            raise ValueError(
                f"kv_page_size={page} must divide max_new_tokens={n_} (a row's own tokens "
                "fill whole pages)"
            )
        self._q = pages.prompt_pages(self._max_prefill, page)
        self._width = self._q + n_ // page
        # the default pool: the contiguous layout's bytes (S slots of N, R = S regions of
        # the prefill bucket), a page per slot for its prompt's tail, and the null page: no
        # row is ever preempted
        self._num_pages = kv_pages or pages.default_pages(s_, s_, self._max_prefill, n_, page)
        need = pages.min_pages(self._max_prefill, n_, page)
        if self._num_pages < need:
            raise ValueError(
                f"kv_pages={self._num_pages} holds fewer than one request's {self._width} "
                f"pages ({self._q} of its prompt, {n_ // page} of its tokens), its prompt's "
                f"tail and the null page ({need})"
            )

    @property
    def kv_stats(self) -> dict[str, int]:
        """Paged KV: the pool's size and peak, pages handed out, requests preempted (ended
        with RESTART_TOKEN for their client to send again); {} on contiguous slots."""
        kv = self._kv
        if kv is None:
            return {}
        return {
            "kv_pages": self._num_pages,
            "kv_pages_peak": kv.pool.peak_used,
            "pages_allocated": kv.pool.allocated,
            "requests_preempted": kv.preempted,
        }

    # --- prompt regions (generate thread only) ------------------------------------------

    def _regions_reset(self):
        s = self._slots
        self._region_key: list = [None] * s  # the prompt each region holds
        self._region_of: dict = {}  # prompt key -> region holding it
        self._refs = [0] * s  # slots reading each region
        self._slot_region = [-1] * s
        self._last_use = [0] * s
        self.region_writes = 0  # prompts written into a region (the rest shared one)
        if self._page:
            self._poisoned: list[int] = []  # freed pages not yet filled with NaN (the hook)
            on_free = self._poisoned.extend if self._poison else None
            zero_new = self._paged_step is not pages.paged_slot_step  # a kernel reads pages
            self._kv = _PagedKV(self, on_free=on_free, zero_new=zero_new)

    def _region_for(self, prefix: _Prefix, slot: int) -> tuple[int, bool]:
        """(the region `slot` reads `prefix`'s prompt from, whether it must be written)."""
        self._release(slot)
        r = self._region_of.get(prefix.key)
        write = r is None
        if write:  # R = S and this slot released its region: one is free
            free = [i for i in range(self._slots) if self._refs[i] == 0]
            r = min(free, key=lambda i: (self._region_key[i] is not None, self._last_use[i]))
            self._region_of.pop(self._region_key[r], None)
            self._region_key[r] = prefix.key
            self._region_of[prefix.key] = r
            self.region_writes += 1
        self._refs[r] += 1
        self._slot_region[slot] = r
        self._last_use[r] = self._next_serial
        return r, write

    def _release(self, slot: int):
        r = self._slot_region[slot]
        if r >= 0:
            self._refs[r] -= 1
            self._slot_region[slot] = -1

    # --- the Engine API ----------------------------------------------------------------

    def load_params(self, *args, **kwargs) -> ParamsHolder:
        del args, kwargs
        return self.holder

    def init_decode_state(self, *args, **kwargs):
        """The decoder's `SlotState` (as a dict) + serial_S, version_S (the prompt's params
        version) and logits_version_S (that of the slot's stored logits); every slot free."""
        del args, kwargs
        s = self._slots
        self._regions_reset()
        if self._page:
            state = pages.init_paged_state(
                self.cfg,
                s,
                s,
                self._max_prefill,
                self.max_new_tokens,
                pages=self._num_pages,
                page_size=self._page,
            )
        else:
            state = decoder.init_state(self.cfg, s, s, self._max_prefill, self.max_new_tokens)
        zeros = lambda: jnp.zeros((s,), jnp.int32)  # separate buffers: all are donated
        return {
            **state._asdict(),
            "serial_S": zeros(),
            "version_S": zeros(),
            "logits_version_S": zeros(),
        }

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
        if existing_prefix is not None:
            raise NotImplementedError("gjax's engine does not continue from an existing prefix")
        params, version = _unwrap(params)
        serial = self._next_serial
        self._next_serial += 1
        tokens = np.asarray(padded_tokens, np.int32)
        if true_length > tokens.shape[-1]:
            # JetStream keeps the last max_prefill_length tokens of a longer request; a
            # truncated prompt would be sampled silently, so the request gets no tokens.
            jetstream.orchestrator.logging.error(
                "request %d: %d prompt tokens exceed max_prefill_length=%d; rejected",
                serial,
                true_length - 1,
                self._max_prefill,
            )
            return _Prefix(None, None, None, 0, serial, rejected=True)
        if tokens[0] == BOS_SENTINEL:  # JetStream's BOS: not part of the client's prompt
            tokens = np.concatenate([tokens[1:], tokens[-1:]])
            true_length -= 1
        key = (tokens.tobytes(), true_length, version)
        if self._prefix_cache is None or self._prefix_cache[0] != key:
            k, v, logits = self._prefill_jit(params, jnp.asarray(tokens), jnp.int32(true_length))
            self._prefix_cache = (key, k, v, logits)
        _, k, v, logits = self._prefix_cache
        return _Prefix(k, v, logits, true_length, serial, key=key, version=version)

    def insert(self, prefix: _Prefix, decode_state, slot: int):
        if self._page:
            self._kv.end(slot)  # its previous request's pages
        if prefix.rejected:
            self._release(slot)
            return _reject(self._poison_freed(decode_state), jnp.int32(slot))
        if self._page and not self._kv.room_for_prompt(prefix, slot):
            # preempted: done, and RESTART_TOKEN (recorded under its own serial) next call
            state = self._poison_freed(decode_state)
            return _preempted_jit(state, jnp.int32(slot), jnp.int32(prefix.serial))
        region, write = self._region_for(prefix, slot)
        where = (self._kv.write_region(region, prefix.length),) if self._page and write else ()
        # the hook's NaN goes into every page freed so far (some just handed out again)
        # before this prompt is written into its pages
        decode_state = self._poison_freed(decode_state)
        if write:
            decode_state = self._region_jit(
                decode_state,
                prefix.k,
                prefix.v,
                prefix.logits,
                jnp.int32(prefix.length),
                region,
                *where,
            )
        limit = self.sampling.max_new_tokens
        if prefix.limit is not None:
            limit = max(1, min(limit, int(prefix.limit)))
        if self._page:
            self._kv.start(slot, region, limit)
        key_data = jax.random.key_data(jax.random.fold_in(self._key, prefix.serial))
        return self._insert_jit(
            decode_state,
            jnp.int32(slot),
            jnp.int32(region),
            jnp.int32(limit),
            key_data,
            jnp.int32(prefix.serial),
            jnp.int32(prefix.version),
        )

    def generate(self, params, decode_state):
        params, version = _unwrap(params)
        if self._layers[0] is not params:  # per params version, not per call
            self._layers = (None, None)  # the old copy (and params) go before the new is built
            self._layers = (params, _layers_jit(params, cfg=self.cfg))
        paged = ()
        if self._page:  # each live request's pages for this call's tokens; the table, who ends
            paged = self._kv.grow(decode_state, version if self._restart else None)
            decode_state = self._poison_freed(decode_state)
            for src, dst in self._kv.take_fills():  # after the NaN fill: it reaches new pages
                decode_state = _fill_pages_jit(decode_state, src, dst)
        decode_state, data = self._generate_jit(
            params,
            self._layers[1],
            decode_state,
            jnp.int32(version),
            *paged,
            sampling=self.sampling,
        )
        if self._record:
            self._records.append(data)
        k = self._steps
        result = jetstream.engine_api.ResultTokens(
            data=data,
            tokens_idx=(0, k),
            valid_idx=(k, 2 * k),
            length_idx=(2 * k, 2 * k + 1),
            samples_per_slot=1,
        )
        return decode_state, result

    def _poison_freed(self, state):
        """poison_freed_pages: NaN into the pages freed since the last call (tests)."""
        if not self._poison or not self._poisoned:
            return state
        # padding: past the pool, dropped (the null page holds zeros only: a kernel reads it
        # past a row's length, pages.kernel_attention)
        ids = np.full((self._num_pages,), self._num_pages, np.int32)
        ids[: len(self._poisoned)] = self._poisoned
        self.pages_poisoned += len(self._poisoned)
        self._poisoned.clear()
        return _poison_jit(state, ids)

    def get_prefix_destination_sharding(self):
        return None  # interleaved mode only: prefill and generate share this engine

    def get_tokenizer(self):
        return jetstream.tokenizer_pb2.TokenizerParameters(path=getattr(self.cfg, "name", ""))

    def build_tokenizer(self, metadata):
        del metadata
        eos = self.sampling.stop_token_ids[0] if self.sampling.stop_token_ids else 0
        return Tokenizer(self._hf_tokenizer, self.sampling.pad_token_id, eos, self._max_prefill)

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def tokens_per_dispatch(self) -> int:
        return self._steps

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self):
        return self._mesh

    @property
    def colocated_cpus(self):
        return None

    # --- jitted pieces -----------------------------------------------------------------

    def _prefill_fn(self, params, tokens_S, true_length):
        s_ = tokens_S.shape[0]
        positions = jnp.arange(s_, dtype=jnp.int32)
        segment = (positions < true_length).astype(jnp.int32)
        hidden_1xSxD, k, v = prefill(
            params, self.cfg, tokens_S[None], positions[None], segment[None]
        )
        logits_V = logits_from_hidden(params, self.cfg, hidden_1xSxD[0, true_length - 1])
        return k[:, 0], v[:, 0], logits_V.astype(jnp.float32)  # k, v: [L, K, S, Dh]

    def _generate_fn(
        self, params, layers, state, version, table_SxP=None, preempt_S=None, *, sampling
    ):
        k = self._steps
        core = _core(state)
        n0_S = core.n_S
        restart_S = jnp.zeros_like(core.done_S)
        if self._restart:  # a slot started on other weights ends now, emitting RESTART_TOKEN
            restart_S = ~core.done_S & (state["version_S"] != version)
        if preempt_S is not None:  # paged: requests the pool cannot hold end the same way
            restart_S = restart_S | preempt_S
            core = core._replace(table_SxP=table_SxP)
        core = core._replace(done_S=core.done_S | restart_S)
        core, tok_SxK, logp_SxK, live_SxK, steps = decoder._dispatch(
            params,
            self.cfg,
            layers,
            core,
            sampling,
            k,
            error_token=ERROR_TOKEN,
            slot_step=self._paged_step if self._page else None,
        )
        if self._restart or self._page:
            tok_SxK = tok_SxK.at[:, 0].set(jnp.where(restart_S, RESTART_TOKEN, tok_SxK[:, 0]))
            live_SxK = live_SxK.at[:, 0].set(live_SxK[:, 0] | restart_S)
        col = lambda x: x[:, None].astype(jnp.int32)
        data = jnp.concatenate(
            [
                tok_SxK,
                live_SxK.astype(jnp.int32),
                col(n0_S + 1),  # JetStream's length check: the count after the first token
                col(state["serial_S"]),
                col(n0_S),
                jax.lax.bitcast_convert_type(logp_SxK.astype(jnp.float32), jnp.int32),
                col(state["logits_version_S"]),  # the first token's logits: computed before
                col(jnp.broadcast_to(version, n0_S.shape)),
                col(jnp.broadcast_to(steps, n0_S.shape)),  # decode steps the call ran
            ],
            axis=1,
        )
        stepped_S = live_SxK[:, 0]  # decoded at least once: its logits are `version`'s now
        logits_version_S = jnp.where(stepped_S, version, state["logits_version_S"])
        return {**state, **core._asdict(), "logits_version_S": logits_version_S}, data


def _core(state) -> decoder.SlotState | pages.PagedState:
    cls = pages.PagedState if "table_SxP" in state else decoder.SlotState
    return cls(**{f: state[f] for f in cls._fields})


def _write_region(state, k_LxKxSxDh, v_LxKxSxDh, logits_V, length, region):
    """One prompt's KV (a bucket of Sq <= Sp positions, right-padded) into `region`."""
    mask = (jnp.arange(k_LxKxSxDh.shape[2]) < length)[None]
    core = decoder.write_region(
        _core(state), region[None], k_LxKxSxDh[:, None], v_LxKxSxDh[:, None], mask, logits_V[None]
    )
    return {**state, **core._asdict()}


def _start_slot(state, slot, region, limit, key_data, serial, version):
    core = decoder.start_slots(_core(state), slot[None], region[None], limit[None], key_data[None])
    return {
        **core._asdict(),
        "serial_S": state["serial_S"].at[slot].set(serial),
        "version_S": state["version_S"].at[slot].set(version),
        "logits_version_S": state["logits_version_S"].at[slot].set(version),
    }


def _paged_write_region(state, k_LxKxSxDh, v_LxKxSxDh, logits_V, length, region, pages_Q):
    """`_write_region` on pages: the prompt's KV into its pages `pages_Q` (Q entries, those
    past its length the null page), its length and logits into `region`."""
    core = _core(state)
    page = core.pages_k[0].shape[2]
    kv_, sq_, dh = k_LxKxSxDh.shape[1:]
    q_ = pages_Q.shape[0]

    def to_pages(x_KxSqxDh):  # -> [K, Q, page, Dh]
        x = jnp.pad(x_KxSqxDh, ((0, 0), (0, q_ * page - sq_), (0, 0)))
        return x.reshape(kv_, q_, page, dh)

    real = (pages_Q != pages.NULL_PAGE)[None, :, None, None]  # the null page: zeros only
    put = lambda dst, src: dst.at[:, pages_Q].set(
        jnp.where(real, to_pages(src), 0).astype(dst.dtype)
    )
    core = core._replace(
        pages_k=[put(d, k_LxKxSxDh[i]) for i, d in enumerate(core.pages_k)],
        pages_v=[put(d, v_LxKxSxDh[i]) for i, d in enumerate(core.pages_v)],
        prompt_len_R=core.prompt_len_R.at[region].set(length),
        prompt_logits_RxV=core.prompt_logits_RxV.at[region].set(logits_V),
    )
    return {**state, **core._asdict()}


def _paged_start_slot(state, slot, region, limit, key_data, serial, version):
    """`_start_slot` on pages: nothing to zero (a row's pages are read only where written)."""
    put = lambda name, x: state[name].at[slot].set(x)
    return {
        **state,
        "region_S": put("region_S", region),
        "n_S": put("n_S", 0),
        "limit_S": put("limit_S", limit),
        "logits_SxV": put("logits_SxV", state["prompt_logits_RxV"][region]),
        "done_S": put("done_S", False),
        "keys_S": put("keys_S", key_data),
        "serial_S": put("serial_S", serial),
        "version_S": put("version_S", version),
        "logits_version_S": put("logits_version_S", version),
    }


@functools.partial(jax.jit, donate_argnums=(0,))
def _preempted_jit(state, slot, serial):
    """A request preempted at insert: its slot done at token 0, under the request's serial."""
    return {
        **state,
        "done_S": state["done_S"].at[slot].set(True),
        "n_S": state["n_S"].at[slot].set(0),
        "serial_S": state["serial_S"].at[slot].set(serial),
    }


@functools.partial(jax.jit, donate_argnums=(0,))
def _fill_pages_jit(state, src_M, dst_M):
    core = pages.fill_pages(_core(state), src_M, dst_M)
    return {**state, **core._asdict()}


@functools.partial(jax.jit, donate_argnums=(0,))
def _poison_jit(state, pages_M):
    core = pages._poison(_core(state), pages_M)
    return {**state, **core._asdict()}


def _reject(state, slot):
    """A rejected request's slot: done at once (JetStream sees valid = 0 and frees it)."""
    return {**state, "done_S": state["done_S"].at[slot].set(True)}


_layers_jit = jax.jit(decode_layers, static_argnames=("cfg",))
