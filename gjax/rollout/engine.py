"""gjax's Flax decoder as a JetStream `Engine`: slot-based decode state, continuous batching.

JetStream's orchestrator drives three pure pieces over a fixed number of decode slots:
`prefill` (one request's prompt -> its KV cache and next-token logits, at a bucketed
length), `insert` (that prefix into a free slot) and `generate` (one token for every live
slot). A slot is freed as soon as its request ends, so with long-tailed response lengths the
decode batch stays full, where a static batch runs until its longest row ends.

Decode state (a pytree; `S` slots, `C` = max_prefill_length + max_new_tokens cache length):
    cache_k/cache_v L x [S, K, C, Dh]  keys (after RoPE) and values, prompt then generated
                                       (one buffer per layer: each is updated in place)
    lengths_S        tokens in the slot's cache (the next token's position)
    logits_SxV       f32 next-token logits (from prefill, then from each decode step)
    generated_S      tokens emitted so far;  done_S / active_S  finished / occupied
    keys_S           per-slot PRNG key data (fold_in(seed key, request serial))
    serial_S         the request's serial (prefill order), for log-prob bookkeeping

`generate` first samples each live slot's token from its stored logits, with the run's
`SamplingParams` and the log-prob definition of `gjax.rollout.sampler` (log_softmax(logits /
T) over the full vocabulary, T = 1 for greedy), then runs the decoder on the sampled tokens.
A slot finishes after emitting a stop id (which is returned, as in the local sampler) or
`max_new_tokens` tokens; JetStream sees it as `valid = 0` on the next step and frees it.
A slot whose logits are not finite emits `ERROR_TOKEN` (-2, valid) and finishes: the server
ends that request with an error status (`gjax.rollout.grpc_server`); no other slot reads it.

`insert` writes the whole cache row of its slot (the prompt's K/V, zeros after it), so what a
slot held before (a previous request's tokens, NaN from a failed one) never reaches the next:
attention gives masked positions probability 0, but 0 x NaN in a stale V would still be NaN.

Requests arrive with JetStream's BOS in front (its token path without a BOS is broken in
0.2.2: `pad_tokens` reads `.shape` of a list), so the tokenizer's `bos_id` is the sentinel
-1 and `prefill` drops that position: the model sees exactly the client's token ids.
G requests for the same prompt, arriving one after another, share one prefill computation.

Params reach the engine through a `ParamsHolder`: JetStream's threads read `params` once,
before their loops, so the holder is what they capture, and `swap` rebinds what it holds
between steps. Same shapes and shardings, so nothing recompiles.
"""

from __future__ import annotations

import collections
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from gjax.models.config import ModelConfig
from gjax.models.transformer import (
    _MASK_VALUE,
    _mlp,
    _qkv,
    apply_rope,
    logits_from_hidden,
    prefill,
    rms_norm,
    rope_cos_sin,
)
from gjax.rollout.jetstream_compat import jetstream
from gjax.rollout.sampler import SamplingParams, _sample

BOS_SENTINEL = -1
ERROR_TOKEN = -2  # a slot's logits were not finite: its request ends with an error
# JetStream's prefill buckets (token_utils.pad_tokens); max_prefill_length must be one.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# ResultTokens columns: JetStream reads [tokens | valid | lengths]; gjax's backend also reads
# the request serial, the token's index, its log-prob (f32 bits) and the params version.
_COLS = ("token", "valid", "length", "serial", "index", "logp_bits", "version")


def prefill_bucket(num_tokens: int) -> int:
    """Smallest JetStream bucket holding `num_tokens` (+1: the BOS slot JetStream adds)."""
    for b in PREFILL_BUCKETS:
        if b >= num_tokens + 1:
            return b
    raise ValueError(f"prompts of {num_tokens} tokens exceed JetStream's largest bucket")


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
    """One request's prompt cache. Deliberately not a pytree: JetStream deletes the arrays of
    every inserted prefix (`delete_pytree`), and G requests share these through the cache."""

    __slots__ = ("k", "v", "logits", "length", "serial", "rejected")

    def __init__(self, k, v, logits, length, serial, rejected=False):
        self.k, self.v, self.logits = k, v, logits
        self.length, self.serial, self.rejected = length, serial, rejected


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


class Engine(jetstream.engine_api.Engine):
    """JetStream Engine for gjax's decoder (see the module docstring).

    Args:
      cfg: the model config. params: params or a `ParamsHolder` (what `load_params` returns).
      sampling: the run's `SamplingParams`; `set_sampling` changes them between batches (each
        distinct setting compiles `generate` once). Its `max_new_tokens` is the cache budget.
      max_concurrent_decodes: decode slots. max_prefill_length: a JetStream bucket.
      seed: the engine's sampling key; request r samples with fold_in(key(seed), r).
      record: keep each step's ResultTokens for `drain_records` (log-probs, versions).
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
    ):
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
        self._next_serial = 0
        self._prefix_cache = None  # (key, k, v, logits): the last prompt, for its G requests
        self._prefill_jit = jax.jit(self._prefill_fn)
        self._insert_jit = jax.jit(self._insert_fn, donate_argnums=(0,))
        self._generate_jit = jax.jit(
            self._generate_fn, static_argnames=("sampling",), donate_argnums=(1,)
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
        since the last drain (int32; logp_bits is the f32 log-prob's bit pattern)."""
        out = []
        while self._records:
            data = np.asarray(self._records.popleft())
            data = data[data[:, 1] == 1]
            out.append(data[:, [3, 4, 0, 5, 6]])
        return np.concatenate(out) if out else np.zeros((0, 5), np.int32)

    def compile_count(self) -> int:
        """Compiled variants of prefill + insert + generate (a weight swap adds none)."""
        return sum(
            f._cache_size() for f in (self._prefill_jit, self._insert_jit, self._generate_jit)
        )

    # --- the Engine API ----------------------------------------------------------------

    def load_params(self, *args, **kwargs) -> ParamsHolder:
        del args, kwargs
        return self.holder

    def init_decode_state(self, *args, **kwargs):
        del args, kwargs
        c, s = self.cfg, self._slots
        cache = (s, c.num_kv_heads, self._max_prefill + self.max_new_tokens, c.head_dim)
        return {
            "cache_k": [jnp.zeros(cache, c.jnp_dtype) for _ in range(c.num_layers)],
            "cache_v": [jnp.zeros(cache, c.jnp_dtype) for _ in range(c.num_layers)],
            "lengths_S": jnp.zeros((s,), jnp.int32),
            "logits_SxV": jnp.zeros((s, c.vocab_size), jnp.float32),
            "generated_S": jnp.zeros((s,), jnp.int32),
            "done_S": jnp.ones((s,), bool),
            "active_S": jnp.zeros((s,), bool),
            "keys_S": jnp.zeros((s, *jax.random.key_data(self._key).shape), jnp.uint32),
            "serial_S": jnp.zeros((s,), jnp.int32),
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
        return _Prefix(k, v, logits, true_length, serial)

    def insert(self, prefix: _Prefix, decode_state, slot: int):
        if prefix.rejected:
            return self._reject(decode_state, slot)
        key_data = jax.random.key_data(jax.random.fold_in(self._key, prefix.serial))
        return self._insert_jit(
            decode_state,
            prefix.k,
            prefix.v,
            prefix.logits,
            jnp.int32(prefix.length),
            jnp.int32(slot),
            key_data,
            jnp.int32(prefix.serial),
        )

    def generate(self, params, decode_state):
        params, version = _unwrap(params)
        decode_state, data = self._generate_jit(
            params, decode_state, jnp.int32(version), sampling=self.sampling
        )
        if self._record:
            self._records.append(data)
        result = jetstream.engine_api.ResultTokens(
            data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )
        return decode_state, result

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

    def _insert_fn(self, state, k_LxKxSxDh, v_LxKxSxDh, logits_V, length, slot, key_data, serial):
        at = (slot, 0, 0, 0)
        # The slot's whole row: the prompt, then zeros over whatever the slot held before.
        tail = ((0, 0), (0, state["cache_k"][0].shape[2] - k_LxKxSxDh.shape[2]), (0, 0))
        row = lambda x, c: jnp.pad(x.astype(c.dtype), tail)[None]
        state = dict(state)
        state["cache_k"] = [
            jax.lax.dynamic_update_slice(c, row(k_LxKxSxDh[i], c), at)
            for i, c in enumerate(state["cache_k"])
        ]
        state["cache_v"] = [
            jax.lax.dynamic_update_slice(c, row(v_LxKxSxDh[i], c), at)
            for i, c in enumerate(state["cache_v"])
        ]
        state["lengths_S"] = state["lengths_S"].at[slot].set(length)
        state["logits_SxV"] = state["logits_SxV"].at[slot].set(logits_V)
        state["generated_S"] = state["generated_S"].at[slot].set(0)
        state["done_S"] = state["done_S"].at[slot].set(False)
        state["active_S"] = state["active_S"].at[slot].set(True)
        state["keys_S"] = state["keys_S"].at[slot].set(key_data)
        state["serial_S"] = state["serial_S"].at[slot].set(serial)
        return state

    def _reject(self, state, slot):
        state = dict(state)
        state["active_S"] = state["active_S"].at[slot].set(True)
        state["done_S"] = state["done_S"].at[slot].set(True)
        return state

    def _decode(self, params, state, tokens_S):
        """One decoder step for every slot: token at position lengths_S, cache written there."""
        cfg, dtype = self.cfg, self.cfg.jnp_dtype
        s_, c_ = tokens_S.shape[0], state["cache_k"][0].shape[2]
        kv_, r_, dh = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        pos_S = jnp.minimum(state["lengths_S"], c_ - 1)
        slots = jnp.arange(s_)
        x = jnp.take(params["embed"]["embedding"], tokens_S[:, None], axis=0).astype(dtype)
        cos, sin = rope_cos_sin(pos_S[:, None], cfg)
        visible_SxC = jnp.arange(c_)[None, :] <= pos_S[:, None]
        cache_k, cache_v = list(state["cache_k"]), list(state["cache_v"])
        for i in range(cfg.num_layers):
            lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
            h = rms_norm(x, lp["input_norm"]["scale"], cfg.rms_norm_eps)
            q, k, v = _qkv(lp["attn"], h, cfg, dtype)  # [S, 1, H|K, Dh]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache_k[i] = cache_k[i].at[slots, :, pos_S].set(k[:, 0].astype(cache_k[i].dtype))
            cache_v[i] = cache_v[i].at[slots, :, pos_S].set(v[:, 0].astype(cache_v[i].dtype))
            q_SxKxRxDh = q[:, 0].reshape(s_, kv_, r_, dh)
            scores = jnp.einsum(
                "skrd,skcd->skrc", q_SxKxRxDh, cache_k[i], preferred_element_type=jnp.float32
            ) / math.sqrt(dh)
            scores = jnp.where(visible_SxC[:, None, None], scores, _MASK_VALUE)
            probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
            att = jnp.einsum("skrc,skcd->skrd", probs, cache_v[i]).reshape(s_, 1, -1)
            x = x + jnp.dot(att, lp["attn"]["o"]["kernel"].astype(dtype))
            h = rms_norm(x, lp["post_attn_norm"]["scale"], cfg.rms_norm_eps)
            x = x + _mlp(lp["mlp"], h, dtype)
        hidden = rms_norm(x[:, 0], params["final_norm"]["scale"], cfg.rms_norm_eps)
        return logits_from_hidden(params, cfg, hidden), cache_k, cache_v

    def _generate_fn(self, params, state, version, *, sampling: SamplingParams):
        sp = sampling
        alive_S = state["active_S"] & ~state["done_S"]
        keys = jax.vmap(jax.random.fold_in)(
            jax.random.wrap_key_data(state["keys_S"]), state["generated_S"]
        )
        token_S, logp_S = jax.vmap(lambda lg, k: _sample(lg[None], k, sp))(
            state["logits_SxV"], keys
        )
        token_S, logp_S = token_S[:, 0], logp_S[:, 0]
        token_S = jnp.where(alive_S, token_S, sp.pad_token_id)
        logp_S = jnp.where(alive_S, logp_S, 0.0)
        index_S = state["generated_S"]
        generated_S = index_S + alive_S
        done_S = state["done_S"] | (alive_S & (generated_S >= sp.max_new_tokens))
        if sp.stop_token_ids:
            stop = jnp.asarray(sp.stop_token_ids, jnp.int32)
            done_S = done_S | (alive_S & jnp.isin(token_S, stop))
        failed_S = alive_S & ~jnp.all(jnp.isfinite(state["logits_SxV"]), axis=-1)
        done_S = done_S | failed_S
        logits, cache_k, cache_v = self._decode(
            params, state, jnp.where(failed_S, sp.pad_token_id, token_S)
        )
        token_S = jnp.where(failed_S, ERROR_TOKEN, token_S)
        logp_S = jnp.where(failed_S, 0.0, logp_S)
        state = dict(state)
        state.update(
            cache_k=cache_k,
            cache_v=cache_v,
            lengths_S=state["lengths_S"] + alive_S,
            logits_SxV=jnp.where(alive_S[:, None], logits, state["logits_SxV"]),
            generated_S=generated_S,
            done_S=done_S,
        )
        data = jnp.stack(
            [
                token_S,
                alive_S.astype(jnp.int32),
                generated_S,
                state["serial_S"],
                index_S,
                jax.lax.bitcast_convert_type(logp_S.astype(jnp.float32), jnp.int32),
                jnp.broadcast_to(version, token_S.shape),
            ],
            axis=1,
        ).astype(jnp.int32)
        return state, data
