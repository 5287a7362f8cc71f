"""jit-compiled group sampler with a shared-prefix KV cache.

`generate(params, cfg, prompt_tokens_PxS, prompt_mask_PxS, rng, num_samples=G, sampling=sp)`
draws G completions for each of P prompts; rows are prompt-major (row b belongs to prompt
b // G, B = P*G).

How it runs (one XLA program, no Python per token):
1. Prefill: one forward over the P prompts (left-padded, mixed lengths; positions count from
   each prompt's first real token) gives the prompt KV cache `[L, P, K, S, Dh]` and each
   prompt's next-token logits. The cache is computed ONCE per prompt and never copied G
   times: decode queries are reshaped to `[P, G, ...]` and attend the prompt cache by
   broadcasting (see `gjax.models.transformer.decode_step`).
2. Decode: a `lax.while_loop` over new tokens with a preallocated per-sample cache
   `[B, K, N, Dh]` per layer (N = max_new_tokens), written in place one slot per step; the loop
   stops early once every row has emitted a stop token.

Returned per-token log-probs (`logps_BxN`), precisely: for temperature T > 0,
    logps[b, n] = log_softmax(logits[b, n] / T)[tokens[b, n]]
over the FULL vocabulary, i.e. before top-k/top-p truncation: the quantity the trainer's loss
recomputes by teacher forcing (log pi(y_n | x, y_<n) at temperature T). For greedy decoding
(T == 0) they are log_softmax(logits) (T = 1). Tokens are drawn from the top-k/top-p
truncated, renormalized softmax(logits / T). Entries after the stop token have mask 0,
logp 0 and token `pad_token_id`. The mask is 1 up to and including the stop token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gjax.models.config import ModelConfig
from gjax.models.transformer import (
    Params,
    decode_layers,
    decode_step,
    logits_from_hidden,
    prefill,
    split_layers,
)
from gjax.sharding import constrain


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings (hashable: a static jit argument).

    temperature: 0 means greedy (argmax). top_k: 0 disables. top_p: 1.0 disables (nucleus
    over softmax(logits / T) after top-k; tokens tied with the threshold logit are kept).
    stop_token_ids: a row finishes at the first of these it emits (e.g. the tokenizer's EOS
    ids); empty means always generate `max_new_tokens`. row_block = (i, n): the prompts given
    are block i of n equal blocks of a whole batch (a multi-process run's process-local
    rollout); each row's random draws are those of its row in the whole batch, so the rows
    come out as one sampler over the whole batch makes them.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    row_block: tuple[int, int] = (0, 1)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple, got {self.stop_token_ids!r}")
        i, n = self.row_block
        if not 0 <= i < n:
            raise ValueError(f"row_block (i, n) needs 0 <= i < n, got {self.row_block!r}")


class SampleOutput(NamedTuple):
    """Completions, B = P*G rows, prompt-major. See the module docstring for `logps_BxN`."""

    tokens_BxN: jax.Array  # int32
    mask_BxN: jax.Array  # int32, 1 up to and including the stop token
    logps_BxN: jax.Array  # f32, log_softmax(logits / T) at the sampled tokens, 0 where masked
    lengths_B: jax.Array  # int32, mask_BxN.sum(-1)
    # Serving backends only (None from the local sampler: every row valid, current params;
    # host arrays of this process's rows in a multi-process run):
    valid_B: jax.Array | None = None  # bool, False for a dropped request (no tokens)
    version_B: jax.Array | None = None  # int32, the policy version each row was sampled with


# Vocabulary block for two-level inverse-CDF sampling (V is padded up to a multiple).
_BLOCK = 128


def _truncate(scaled_BxV, sp: SamplingParams):
    """top-k / top-p: truncated tokens get -inf (ties with the threshold logit are kept)."""
    vocab = scaled_BxV.shape[-1]
    top_k = sp.top_k if 0 < sp.top_k < vocab else 0
    if not top_k and sp.top_p >= 1.0:
        return scaled_BxV
    if top_k:
        sorted_BxK = jax.lax.top_k(scaled_BxV, top_k)[0]  # descending
    else:
        sorted_BxK = -jnp.sort(-scaled_BxV, axis=-1)
    threshold_B = sorted_BxK[:, -1]
    if sp.top_p < 1.0:
        probs = jax.nn.softmax(sorted_BxK, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < sp.top_p
        n_keep = keep.sum(-1)
        threshold_B = jnp.take_along_axis(sorted_BxK, (n_keep - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(scaled_BxV >= threshold_B[:, None], scaled_BxV, -jnp.inf)


def _inverse_cdf_sample(logits_BxV, key, row_block=(0, 1)):
    """Exact categorical sampling from softmax(logits) with ONE uniform per row.

    Two-level inverse CDF: pick the vocabulary block whose cumulative mass first reaches
    u * total, then the token inside that block. Costs one exp pass plus a cumsum over
    V / 128 block sums and over 128 entries, instead of V Gumbel draws or a length-V cumsum
    (both slow on CPU). A zero-probability token (e.g. truncated by top-k) owns an empty CDF
    interval and is never drawn. The rows are block `row_block` = (i, n) of a batch of n * B
    rows: row b takes the uniform of row i * B + b of that batch. Returns (tokens_B, logsumexp_B
    of `logits_BxV`).
    """
    b, v = logits_BxV.shape
    nb = -(-v // _BLOCK)
    m_B = jnp.max(logits_BxV, axis=-1)
    e_BxV = jnp.exp(logits_BxV - m_B[:, None])
    if nb * _BLOCK != v:
        e_BxV = jnp.pad(e_BxV, ((0, 0), (0, nb * _BLOCK - v)))
    e_BxNbxC = e_BxV.reshape(b, nb, _BLOCK)
    block_cdf = jnp.cumsum(e_BxNbxC.sum(-1), axis=-1)
    total_B = block_cdf[:, -1]
    # u in (0, 1): x > 0, so the chosen block and token always carry positive mass.
    i, n = row_block
    u_nB = jax.random.uniform(key, (n * b,), minval=1e-12, maxval=1.0)
    x_B = jax.lax.dynamic_slice_in_dim(u_nB, i * b, b) * total_B
    j_B = jnp.minimum(jnp.sum(block_cdf < x_B[:, None], axis=-1), nb - 1)
    prev_B = jnp.where(
        j_B > 0, jnp.take_along_axis(block_cdf, jnp.maximum(j_B - 1, 0)[:, None], -1)[:, 0], 0.0
    )
    inner_cdf = jnp.cumsum(jnp.take_along_axis(e_BxNbxC, j_B[:, None, None], axis=1)[:, 0], -1)
    r_B = jnp.minimum(x_B - prev_B, inner_cdf[:, -1])  # rounding guard
    i_B = jnp.minimum(jnp.sum(inner_cdf < r_B[:, None], axis=-1), _BLOCK - 1)
    return (j_B * _BLOCK + i_B).astype(jnp.int32), m_B + jnp.log(total_B)


def _sample(logits_BxV, key, sp: SamplingParams):
    """Draws one token per row; returns (tokens_B, logps_B) with logps as in the module doc."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if sp.temperature == 0:
        tokens_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        scaled, lse_B = logits_BxV, jax.nn.logsumexp(logits_BxV, axis=-1)
    else:
        scaled = logits_BxV / sp.temperature
        truncated = _truncate(scaled, sp)
        tokens_B, lse_B = _inverse_cdf_sample(truncated, key, sp.row_block)
        if truncated is not scaled:  # log-probs are over the full (untruncated) vocabulary
            lse_B = jax.nn.logsumexp(scaled, axis=-1)
    picked_B = jnp.take_along_axis(scaled, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, picked_B - lse_B


def _generate(params, cfg, prompt_tokens_PxS, prompt_mask_PxS, rng, num_samples, sampling):
    sp = sampling
    p_, s_ = prompt_tokens_PxS.shape
    g_ = num_samples
    b_ = p_ * g_
    n_ = sp.max_new_tokens
    dtype = cfg.jnp_dtype
    mask_PxS = prompt_mask_PxS.astype(jnp.int32)
    positions_PxS = jnp.maximum(jnp.cumsum(mask_PxS, axis=-1) - 1, 0)
    prompt_len_P = mask_PxS.sum(-1)
    # Last real token (any padding side; left padding is the usual case).
    last_P = s_ - 1 - jnp.argmax(mask_PxS[:, ::-1], axis=-1)

    # 1. Prefill the P prompts once.
    hidden_PxSxD, prefix_k, prefix_v = prefill(
        params, cfg, prompt_tokens_PxS.astype(jnp.int32), positions_PxS, mask_PxS
    )
    kv_axes = ("batch", "kv_heads", "length", None)
    prefix_k = [constrain(a, kv_axes) for a in split_layers(prefix_k)]
    prefix_v = [constrain(a, kv_axes) for a in split_layers(prefix_v)]
    hidden_PxD = jnp.take_along_axis(hidden_PxSxD, last_P[:, None, None], axis=1)[:, 0]
    logits_BxV = jnp.repeat(logits_from_hidden(params, cfg, hidden_PxD), g_, axis=0)
    logits_BxV = constrain(logits_BxV, ("batch", "vocab"))
    token_B, logp_B = _sample(logits_BxV, jax.random.fold_in(rng, 0), sp)
    start_pos_B = jnp.repeat(prompt_len_P, g_)

    # 2. Decode with preallocated per-sample caches (one [B, K, N, Dh] array per layer, and
    # per-layer weights split once here, so the loop body never slices stacked arrays).
    layers = decode_layers(params, cfg)
    cache_shape = (b_, cfg.num_kv_heads, n_, cfg.head_dim)
    cache_k = [constrain(jnp.zeros(cache_shape, dtype), kv_axes) for _ in layers]
    cache_v = [constrain(jnp.zeros(cache_shape, dtype), kv_axes) for _ in layers]
    stop_ids = jnp.asarray(sp.stop_token_ids, jnp.int32)

    def cond(state):
        step, done_B = state[0], state[3]
        return (step < n_) & ~jnp.all(done_B)

    def body(state):
        step, token_B, logp_B, done_B, tokens, mask, logps, cache_k, cache_v = state
        alive_B = ~done_B
        token_B = jnp.where(alive_B, token_B, sp.pad_token_id)
        tokens = jax.lax.dynamic_update_slice(tokens, token_B[:, None], (0, step))
        mask = jax.lax.dynamic_update_slice(mask, alive_B.astype(jnp.int32)[:, None], (0, step))
        logps = jax.lax.dynamic_update_slice(
            logps, jnp.where(alive_B, logp_B, 0.0)[:, None], (0, step)
        )
        if sp.stop_token_ids:
            done_B = done_B | (alive_B & jnp.isin(token_B, stop_ids))
        hidden_BxD, cache_k, cache_v = decode_step(
            params,
            cfg,
            layers,
            token_B,
            start_pos_B + step,
            prefix_k,
            prefix_v,
            mask_PxS,
            cache_k,
            cache_v,
            step,
        )
        logits_BxV = logits_from_hidden(params, cfg, hidden_BxD)
        token_B, logp_B = _sample(logits_BxV, jax.random.fold_in(rng, step + 1), sp)
        return step + 1, token_B, logp_B, done_B, tokens, mask, logps, cache_k, cache_v

    state = (
        jnp.int32(0),
        token_B,
        logp_B,
        jnp.zeros((b_,), bool),
        jnp.full((b_, n_), sp.pad_token_id, jnp.int32),
        jnp.zeros((b_, n_), jnp.int32),
        jnp.zeros((b_, n_), jnp.float32),
        cache_k,
        cache_v,
    )
    state = jax.lax.while_loop(cond, body, state)
    tokens, mask, logps = state[4], state[5], state[6]
    return SampleOutput(tokens, mask, logps, mask.sum(-1))


_generate_jit = jax.jit(_generate, static_argnames=("cfg", "num_samples", "sampling"))


def generate(
    params: Params,
    cfg: ModelConfig,
    prompt_tokens_PxS,
    prompt_mask_PxS,
    rng,
    *,
    num_samples: int,
    sampling: SamplingParams,
) -> SampleOutput:
    """Samples `num_samples` completions per prompt (jit-compiled; see the module docstring).

    Args:
      params: the policy params (possibly sharded; the program follows their shardings).
      cfg: the model config (static).
      prompt_tokens_PxS: int prompt ids, normally left-padded; every row needs >= 1 real token.
      prompt_mask_PxS: 1 for real prompt tokens, 0 for padding.
      rng: a PRNG key; the same key gives the same output.
      num_samples: G, samples per prompt.
      sampling: `SamplingParams` (static).
    Returns:
      `SampleOutput` with B = P*G prompt-major rows and N = sampling.max_new_tokens columns.
    """
    if prompt_tokens_PxS.shape != prompt_mask_PxS.shape or prompt_tokens_PxS.ndim != 2:
        raise ValueError(
            f"prompt tokens {prompt_tokens_PxS.shape} and mask {prompt_mask_PxS.shape} must be "
            "the same [P, S] shape"
        )
    if not isinstance(num_samples, int) or num_samples <= 0:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    return _generate_jit(
        params,
        cfg,
        prompt_tokens_PxS,
        prompt_mask_PxS,
        rng,
        num_samples=num_samples,
        sampling=sampling,
    )
