"""Chunked LM-head log-prob / entropy kernels that never materialize [N x V] logits.

Two entry points (plus [B, T] conveniences):

* `token_logps(hidden_NxD, head_DxV, targets_N)` -> `(logps_N, entropy_N)`.
  Tokens are processed in chunks of `token_chunk` rows; inside a chunk the vocabulary is
  swept in tiles of `vocab_tile` columns with an online (running-max) log-sum-exp, so the
  largest temporary is [token_chunk x vocab_tile]. Differentiable through a custom VJP that
  recomputes the logits tile by tile in the backward pass (residuals: lse_N, entropy_N).

* `fused_token_loss(hidden_NxD, head_DxV, targets_N, token_loss_fn, token_args)` ->
  `(loss, aux_sums)` with `loss = sum_t token_loss_fn(logp_t, H_t, args_t)[0]`. The gradient
  w.r.t. hidden and head is computed INSIDE the forward chunk loop (Liger-style): per token
  chunk, softmax statistics (lse, logp, entropy) -> dloss/dlogp, dloss/dH (by `jax.grad` of the
  elementwise `token_loss_fn`) -> dlogits -> dhidden and dhead (accumulated in f32, in place,
  vocab tile by vocab tile). The residuals are the gradients themselves; the backward pass
  only scales them by the incoming cotangent. Two schedules (`store_logits`):
    - True, 3 matmuls (the floor): one logits matmul per chunk kept as a [C x V] f32 buffer,
      swept for the statistics and again for the gradient tiles. Memory ~C x V x 4 bytes.
    - False, 4 matmuls: the statistics sweep computes logits tile by tile, the gradient
      sweep recomputes them; only [C x vocab_tile] tiles exist, so C can be large.
  The 3-matmul schedule pays off only with large C: every chunk costs a read-modify-write of
  the whole f32 [D x V] head gradient, and small C means skinny matmuls (K = C in h^T dz).
  `FUSED_TILES` picks per platform: 3 matmuls when a [C x V] buffer within the platform's
  budget holds enough rows (on the CPU, V <= 32768), else 4 (kernel="reference" keeps the
  first fixed schedule: always 4 matmuls, C = 1024).

Math, with z = h W / tau (tau = temperature), p = softmax(z), lse = logsumexp(z):
    logp_t = z_{t, y_t} - lse_t
    H_t    = -sum_v p_v log p_v = lse_t - E_p[z]          (computed as log s - E_p[z - m])
    d logp_t / dz_v = 1[v = y_t] - p_v
    d H_t    / dz_v = p_v (E_p[z] - z_v)
    dh = (dz / tau) W^T,   dW = h^T (dz / tau).

Online log-sum-exp over vocab tiles (running max m, s = sum exp(z - m),
r = sum exp(z - m) (z - m)); when the max moves from m to m' with a = exp(m - m'):
    s' = a s + sum exp(z - m'),   r' = a (r + s (m - m')) + sum exp(z - m')(z - m'),
and finally lse = m + log s, H = log s - r / s.

Dtypes: f32 and bf16 hidden/head are accepted; logits, softmax statistics, log-probs,
entropies and the head-gradient accumulator are f32. For bf16 inputs the dlogits are cast to
bf16 before the two gradient matmuls (f32 accumulation), as mixed-precision backward passes do.
Returned gradients have the input dtypes; returned log-probs/entropies/losses are f32.

Targets: `targets_N` must be in [0, V) where the loss uses them. An out-of-range target (e.g. a
-1 padding id) never gathers out of bounds: it selects no column, so its logp is the finite but
meaningless `-lse`; mask such positions through `token_args` (e.g. multiply by `loss_mask`).

Token layout and sharding: N is padded to a multiple of the chunk with zero rows (masked out
of the loss and all sums) and laid out as [C, n_chunks] (token i = c * n_chunks + k), i.e.
chunk k holds the strided tokens {k, k + n_chunks, ...}. Under jit with `hidden` sharded over
the data axes on N, the chunk axis C therefore stays sharded and every chunk keeps all data
shards busy. A head sharded over 'tensor' on V works unchanged: GSPMD turns the vocab
reductions into cross-device reductions; with FSDP on D it may all-gather the head per chunk.
The loops are `lax.scan`s, so compile time does not grow with N or V.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "FUSED_TILES",
    "KERNELS",
    "default_token_chunk",
    "fused_schedule",
    "fused_token_loss",
    "fused_token_loss_BxT",
    "token_logps",
    "token_logps_BxT",
]

TokenLossFn = Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

_F32 = jnp.float32
# Budget (elements) for one [token_chunk x V] f32 array in the fused loss: 2**24 elements =
# 64 MiB; the fused chunk body holds about three such arrays at its peak.
_FUSED_CHUNK_ELEMENTS = 2**24


# The fused kernel's schedule per platform: the one place its tile sizes are chosen.
# The 3-matmul schedule (store_logits) runs when a [C x V] f32 logits buffer of
# `logits_budget` elements holds at least `min_stored_rows` rows (C: as many as fit, at most
# `max_stored_rows`); below that its matmuls are too skinny and its per-chunk [D x V]
# head-gradient update too frequent, and the 4-matmul schedule with `chunk` rows runs.
# cpu: measured with benchmarks/loss_kernels.py (2-core AVX-512 host, jax 0.10.2): stored
# 512-row chunks are ~10 % faster than the 4-matmul schedule at V = 32000; 96-row ones are
# ~1.8x slower at V = 151936. gpu / tpu: not measured (no accelerator); a 1 GiB buffer.
FUSED_TILES = {
    "cpu": dict(
        logits_budget=2**24, min_stored_rows=512, max_stored_rows=1024, chunk=1024, vocab_tile=4096
    ),
    "gpu": dict(
        logits_budget=2**28, min_stored_rows=512, max_stored_rows=4096, chunk=4096, vocab_tile=4096
    ),
    "tpu": dict(
        logits_budget=2**28, min_stored_rows=512, max_stored_rows=4096, chunk=4096, vocab_tile=4096
    ),
}
# "auto": the schedule FUSED_TILES picks for the platform; "reference": the fixed schedule
# gjax shipped first (4 matmuls, 1024-row chunks, 4096-column tiles), kept to compare against.
KERNELS = ("auto", "reference")


def fused_schedule(
    vocab_size: int,
    *,
    kernel: str = "auto",
    token_chunk: int | None = None,
    vocab_tile: int | None = None,
    store_logits: bool | None = None,
    platform: str | None = None,
) -> tuple[bool, int, int]:
    """(store_logits, token_chunk, vocab_tile) of `fused_token_loss`; arguments given win."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown LM-head kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    v = max(int(vocab_size), 1)
    if kernel == "reference":
        store = bool(store_logits)
        if token_chunk is None:
            token_chunk = default_token_chunk(v) if store else 1024
        return store, int(token_chunk), int(4096 if vocab_tile is None else vocab_tile)
    tiles = FUSED_TILES.get(platform or jax.default_backend(), FUSED_TILES["gpu"])
    fit = min(tiles["max_stored_rows"], tiles["logits_budget"] // v // 16 * 16)
    if store_logits is None:
        rows = fit if token_chunk is None else int(token_chunk)
        store_logits = tiles["min_stored_rows"] <= rows and rows * v <= tiles["logits_budget"]
    if token_chunk is None:
        token_chunk = max(fit, 16) if store_logits else tiles["chunk"]
    if vocab_tile is None:
        vocab_tile = tiles["vocab_tile"]
    return bool(store_logits), int(token_chunk), int(vocab_tile)


def default_token_chunk(vocab_size: int) -> int:
    """Token chunk for `fused_token_loss`: a [chunk x V] f32 array of about 64 MiB.

    A multiple of 16 (so it divides evenly over data shards), between 16 and 1024.
    """
    chunk = _FUSED_CHUNK_ELEMENTS // max(int(vocab_size), 1)
    return int(min(1024, max(16, chunk // 16 * 16)))


# ----------------------------------------------------------------------------- helpers


def _check_inputs(hidden_NxD, head_DxV, targets_N, temperature, token_chunk):
    if hidden_NxD.ndim != 2:
        raise ValueError(f"hidden_NxD must be [N, D], got shape {hidden_NxD.shape}")
    if head_DxV.ndim != 2:
        raise ValueError(f"head_DxV must be [D, V], got shape {head_DxV.shape}")
    if hidden_NxD.shape[1] != head_DxV.shape[0]:
        raise ValueError(
            f"hidden dim mismatch: hidden_NxD {hidden_NxD.shape} vs head_DxV {head_DxV.shape}"
        )
    if targets_N.shape != hidden_NxD.shape[:1]:
        raise ValueError(
            f"targets_N must be [N]={hidden_NxD.shape[:1]}, got shape {targets_N.shape}"
        )
    if not jnp.issubdtype(targets_N.dtype, jnp.integer):
        raise ValueError(f"targets_N must be integer token ids, got dtype {targets_N.dtype}")
    for name, x in (("hidden_NxD", hidden_NxD), ("head_DxV", head_DxV)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if token_chunk is not None and int(token_chunk) < 1:
        raise ValueError(f"token_chunk must be >= 1, got {token_chunk}")


def _chunk_layout(n: int, token_chunk: int) -> tuple[int, int]:
    """(chunk rows C, number of chunks) for n tokens."""
    c = max(1, min(int(token_chunk), n))
    return c, -(-n // c)


def _to_chunks(x, c: int, n_chunks: int):
    """[N, ...] -> [n_chunks, C, ...], zero-padded; token i = c_idx * n_chunks + k."""
    n = x.shape[0]
    pad = c * n_chunks - n
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return jnp.swapaxes(x.reshape((c, n_chunks) + x.shape[1:]), 0, 1)


def _from_chunks(x, n: int):
    """Inverse of `_to_chunks`: [n_chunks, C, ...] -> [N, ...]."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((-1,) + x.shape[2:])[:n]


def _matmul_dtype(hidden, head):
    return jnp.promote_types(hidden.dtype, head.dtype)


def _logits(h_CxD, w_DxV, inv_temp):
    z = lax.dot_general(h_CxD, w_DxV, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    return z * inv_temp if inv_temp != 1.0 else z


def _grad_matmuls(h_CxD, w_DxV, dz_CxV, mm_dtype):
    """dh = dz W^T  [C, D] and dW = h^T dz  [D, V], f32 accumulation."""
    dz = dz_CxV.astype(mm_dtype)
    dh = lax.dot_general(dz, w_DxV, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
    dw = lax.dot_general(h_CxD, dz, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
    return dh, dw


# ----------------------------------------------------------- token_logps (vocab tiles)


def _vocab_tiles(v: int, vocab_tile: int) -> tuple[int, int, int]:
    """(tile width, number of full tiles, remainder width)."""
    t = max(1, min(int(vocab_tile), v))
    return t, v // t, v % t


def _tile_stats_update(state, z_CxT, targets_C, col_offset):
    """One online log-sum-exp step over a vocab tile; state = (m, s, r, z_tgt)."""
    m, s, r, z_tgt = state
    m_new = jnp.maximum(m, jnp.max(z_CxT, axis=-1))
    a = jnp.exp(m - m_new)
    zc = z_CxT - m_new[:, None]
    e = jnp.exp(zc)
    s_new = a * s + jnp.sum(e, axis=-1)
    r_new = a * (r + s * (m - m_new)) + jnp.sum(e * zc, axis=-1)
    cols = lax.broadcasted_iota(jnp.int32, z_CxT.shape, 1) + col_offset
    z_tgt = z_tgt + jnp.sum(jnp.where(cols == targets_C[:, None], z_CxT, 0.0), axis=-1)
    return m_new, s_new, r_new, z_tgt


def _sweep_tiles(w_DxV, tile, n_full, rem, body, carry):
    """Runs body(carry, w_DxT, col_offset) over the full vocab tiles (scan) and the remainder."""
    if n_full:

        def step(carry, j):
            off = j * tile
            w = lax.dynamic_slice_in_dim(w_DxV, off, tile, axis=1)
            return body(carry, w, off), None

        carry, _ = lax.scan(step, carry, jnp.arange(n_full, dtype=jnp.int32))
    if rem:
        off = n_full * tile
        carry = body(carry, w_DxV[:, off:], off)
    return carry


def _logps_forward(hidden_NxD, head_DxV, targets_N, inv_temp, token_chunk, vocab_tile):
    n = hidden_NxD.shape[0]
    c, n_chunks = _chunk_layout(n, token_chunk)
    tile, n_full, rem = _vocab_tiles(head_DxV.shape[1], vocab_tile)
    h_KxCxD = _to_chunks(hidden_NxD, c, n_chunks)
    t_KxC = _to_chunks(targets_N.astype(jnp.int32), c, n_chunks)

    def chunk(_, xs):
        h, t = xs
        # Tiles of the head: logits exist only as [C x vocab_tile] tiles.
        lse, ent, _, z_tgt = _online_stats(
            head_DxV, t, lambda w: _logits(h, w, inv_temp), vocab_tile
        )
        return None, (z_tgt - lse, ent, lse)

    _, (logp, ent, lse) = lax.scan(chunk, None, (h_KxCxD, t_KxC))
    return _from_chunks(logp, n), _from_chunks(ent, n), _from_chunks(lse, n)


def _logps_backward(
    hidden_NxD,
    head_DxV,
    targets_N,
    lse_N,
    ent_N,
    g_logp_N,
    g_ent_N,
    inv_temp,
    token_chunk,
    vocab_tile,
):
    n, d = hidden_NxD.shape
    c, n_chunks = _chunk_layout(n, token_chunk)
    tile, n_full, rem = _vocab_tiles(head_DxV.shape[1], vocab_tile)
    mm_dtype = _matmul_dtype(hidden_NxD, head_DxV)
    ch = functools.partial(_to_chunks, c=c, n_chunks=n_chunks)
    # Padded rows get zero cotangents, hence zero dlogits.
    xs = (
        ch(hidden_NxD),
        ch(targets_N.astype(jnp.int32)),
        ch(lse_N),
        ch(ent_N),
        ch(g_logp_N.astype(_F32)),
        None if g_ent_N is None else ch(g_ent_N.astype(_F32)),
    )

    def chunk(dw_DxV, xs):
        h, t, lse, ent, g_logp, g_ent = xs
        mean_z = lse - ent  # E_p[z]

        def body(carry, w, off):
            dh, dw_acc = carry
            z = _logits(h, w, inv_temp)
            p = jnp.exp(z - lse[:, None])
            cols = lax.broadcasted_iota(jnp.int32, z.shape, 1) + off
            dz = g_logp[:, None] * ((cols == t[:, None]).astype(_F32) - p)
            if g_ent is not None:
                dz = dz + g_ent[:, None] * p * (mean_z[:, None] - z)
            dh_t, dw_t = _grad_matmuls(h, w, dz * inv_temp, mm_dtype)
            width = w.shape[1]
            dw_old = lax.dynamic_slice_in_dim(dw_acc, off, width, axis=1)
            dw_acc = lax.dynamic_update_slice_in_dim(dw_acc, dw_old + dw_t, off, axis=1)
            return dh + dh_t, dw_acc

        dh, dw_DxV = _sweep_tiles(
            head_DxV, tile, n_full, rem, body, (jnp.zeros((c, d), _F32), dw_DxV)
        )
        return dw_DxV, dh

    dw_DxV, dh_KxCxD = lax.scan(chunk, jnp.zeros(head_DxV.shape, _F32), xs)
    dh_NxD = _from_chunks(dh_KxCxD, n)
    return dh_NxD.astype(hidden_NxD.dtype), dw_DxV.astype(head_DxV.dtype)


def token_logps(
    hidden_NxD: jax.Array,
    head_DxV: jax.Array,
    targets_N: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    token_chunk: int = 256,
    vocab_tile: int = 8192,
) -> tuple[jax.Array, jax.Array | None]:
    """Per-token log-probs (and entropies) of `targets_N` under softmax(hidden @ head / tau).

    logp_t = log softmax(h_t W / tau)[y_t],   H_t = -sum_v p_tv log p_tv,
    computed with an online log-sum-exp over vocab tiles inside token chunks; the largest
    temporary is [token_chunk x vocab_tile] (f32). Differentiable w.r.t. hidden and head by a
    custom VJP that recomputes the logits tile by tile (residuals are [N] vectors only).

    Args:
      hidden_NxD: final hidden states, f32 or bf16.
      head_DxV: LM head (for tied embeddings pass `embedding.T`).
      targets_N: int token ids; position t scores targets_N[t]. Out-of-range ids give a
        finite logp (`-lse`) and must be masked by the caller.
      temperature: static tau > 0; logits are divided by it (the sampler's temperature).
      with_entropy: also return the entropy H_t; otherwise the second output is None.
      token_chunk, vocab_tile: static tile sizes (any N, V; ragged edges are handled).

    Returns:
      (logps_N, entropy_N or None), f32.
    """
    _check_inputs(hidden_NxD, head_DxV, targets_N, temperature, token_chunk)
    if int(vocab_tile) < 1:
        raise ValueError(f"vocab_tile must be >= 1, got {vocab_tile}")
    inv_temp = 1.0 / float(temperature)
    kw = dict(inv_temp=inv_temp, token_chunk=int(token_chunk), vocab_tile=int(vocab_tile))

    @jax.custom_vjp
    def f(h, w, t):
        logp, ent, _ = _logps_forward(h, w, t, **kw)
        return logp, ent

    def f_fwd(h, w, t):
        logp, ent, lse = _logps_forward(h, w, t, **kw)
        return (logp, ent), (h, w, t, lse, ent)

    def f_bwd(res, g):
        h, w, t, lse, ent = res
        g_logp, g_ent = g
        dh, dw = _logps_backward(h, w, t, lse, ent, g_logp, g_ent if with_entropy else None, **kw)
        return dh, dw, None

    f.defvjp(f_fwd, f_bwd)
    logp_N, ent_N = f(hidden_NxD, head_DxV, targets_N)
    return logp_N, (ent_N if with_entropy else None)


# ------------------------------------------------------ fused_token_loss (full rows)


def _check_token_args(token_args, n):
    for leaf in jax.tree.leaves(token_args):
        if jnp.shape(leaf)[:1] != (n,):
            raise ValueError(
                f"every token_args leaf must have leading dim N={n}, got shape {jnp.shape(leaf)}"
            )


def _online_stats(x_RxV, targets_R, tile_fn, vocab_tile):
    """Online log-sum-exp over column tiles: (lse, entropy, E_p[z], z_target) per row, where
    tile_fn(x_tile) gives the logits of a tile. Only [R x tile] temporaries besides x."""
    r = targets_R.shape[0]
    tile, n_full, rem = _vocab_tiles(x_RxV.shape[1], vocab_tile)

    def body(state, x, off):
        return _tile_stats_update(state, tile_fn(x), targets_R, off)

    init = (jnp.full((r,), jnp.finfo(_F32).min, _F32),) + (jnp.zeros((r,), _F32),) * 3
    m, s, rr, z_tgt = _sweep_tiles(x_RxV, tile, n_full, rem, body, init)
    log_s = jnp.log(s)
    return m + log_s, log_s - rr / s, m + rr / s, z_tgt


def _grad_sweep(h_CxD, w_DxV, z_fn, targets_C, lse_C, a_C, b_C, g_C, dw_DxV, tile, mm_dtype):
    """dlogits dz = g 1[v = y] + exp(z - lse) (a - b z) tile by tile, and its two matmuls
    dh = dz W^T, dW += h^T dz: dz exists only as [C x tile] tiles and dW is updated in place
    (one h^T dz matmul would allocate a second [D x V] f32 buffer)."""
    tile, n_full, rem = _vocab_tiles(w_DxV.shape[1], tile)

    def body(carry, w, off):
        dh, dw_acc = carry
        width = w.shape[1]
        z = z_fn(w, off)
        cols = lax.broadcasted_iota(jnp.int32, z.shape, 1) + off
        dz = jnp.exp(z - lse_C[:, None]) * (a_C[:, None] - b_C[:, None] * z)
        dz = dz + jnp.where(cols == targets_C[:, None], g_C[:, None], 0.0)
        dh_t, dw_t = _grad_matmuls(h_CxD, w, dz, mm_dtype)
        dw_old = lax.dynamic_slice_in_dim(dw_acc, off, width, axis=1)
        return dh + dh_t, lax.dynamic_update_slice_in_dim(dw_acc, dw_old + dw_t, off, axis=1)

    dh0 = jnp.zeros((h_CxD.shape[0], w_DxV.shape[0]), _F32)
    return _sweep_tiles(w_DxV, tile, n_full, rem, body, (dh0, dw_DxV))


def _fused_scan(
    hidden_NxD,
    head_DxV,
    targets_N,
    token_loss_fn,
    token_args,
    inv_temp,
    c,
    vocab_tile,
    store_logits,
    with_grad,
):
    n = hidden_NxD.shape[0]
    c, n_chunks = _chunk_layout(n, c)
    mm_dtype = _matmul_dtype(hidden_NxD, head_DxV)
    ch = functools.partial(_to_chunks, c=c, n_chunks=n_chunks)
    valid = ch(jnp.ones((n,), jnp.bool_))
    xs = (ch(hidden_NxD), ch(targets_N.astype(jnp.int32)), jax.tree.map(ch, token_args), valid)

    def chunk_loss(logp, ent, args, valid):
        loss_t, aux_t = token_loss_fn(logp, ent, args)
        loss_t = jnp.asarray(loss_t)
        if loss_t.shape != logp.shape:
            raise ValueError(
                f"token_loss_fn must be elementwise: loss_t shape {loss_t.shape} != {logp.shape}"
            )
        aux = jax.tree.map(lambda a: jnp.sum(jnp.where(valid, a, 0.0), dtype=_F32), aux_t)
        return jnp.sum(jnp.where(valid, loss_t, 0.0), dtype=_F32), aux

    def chunk(carry, xs):
        h, t, args, vld = xs
        if store_logits:  # 3 matmuls; the [C x V] logits are the only big buffer
            z_CxV = _logits(h, head_DxV, inv_temp)
            lse, ent, mean_z, z_tgt = _online_stats(z_CxV, t, lambda x: x, vocab_tile)

            def z_fn(w, off):
                return lax.dynamic_slice_in_dim(z_CxV, off, w.shape[1], axis=1)

        else:  # 4 matmuls; logits exist only as [C x vocab_tile] tiles (computed twice)

            def z_fn(w, off):
                return _logits(h, w, inv_temp)

            lse, ent, mean_z, z_tgt = _online_stats(head_DxV, t, lambda w: z_fn(w, 0), vocab_tile)
        logp = z_tgt - lse
        if not with_grad:
            loss_c, aux_c = chunk_loss(logp, ent, args, vld)
            loss, aux = carry
            return (loss + loss_c, jax.tree.map(jnp.add, aux, aux_c)), None
        (loss_c, aux_c), (g_logp, g_ent) = jax.value_and_grad(
            chunk_loss, argnums=(0, 1), has_aux=True
        )(logp, ent, args, vld)
        # dz_v = g_logp 1[v = y] + p_v (-g_logp + g_ent (E_p[z] - z_v)), all times 1/tau.
        a = (g_ent * mean_z - g_logp) * inv_temp
        b = g_ent * inv_temp
        loss, aux, dw_acc = carry
        dh, dw_acc = _grad_sweep(
            h, head_DxV, z_fn, t, lse, a, b, g_logp * inv_temp, dw_acc, vocab_tile, mm_dtype
        )
        carry = (loss + loss_c, jax.tree.map(jnp.add, aux, aux_c), dw_acc)
        return carry, dh.astype(hidden_NxD.dtype)

    # Aux structure/dtypes from an abstract evaluation of one chunk.
    sample = jax.tree.map(lambda x: x[0], xs)
    aux_shape = jax.eval_shape(
        lambda s: chunk_loss(jnp.zeros((c,), _F32), jnp.zeros((c,), _F32), s[2], s[3])[1],
        sample,
    )
    aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape)
    loss0 = jnp.zeros((), _F32)
    if not with_grad:
        (loss, aux), _ = lax.scan(chunk, (loss0, aux0), xs)
        return loss, aux
    (loss, aux, dw), dh_KxCxD = lax.scan(chunk, (loss0, aux0, jnp.zeros(head_DxV.shape, _F32)), xs)
    return loss, aux, _from_chunks(dh_KxCxD, n), dw


def fused_token_loss(
    hidden_NxD: jax.Array,
    head_DxV: jax.Array,
    targets_N: jax.Array,
    token_loss_fn: TokenLossFn,
    token_args: Any,
    *,
    temperature: float = 1.0,
    token_chunk: int | None = None,
    vocab_tile: int | None = None,
    store_logits: bool | None = None,
    kernel: str = "auto",
) -> tuple[jax.Array, Any]:
    """Sum over tokens of an elementwise loss of (logp_t, H_t), gradients fused in the forward.

        loss = sum_t loss_t,   (loss_t, aux_t) = token_loss_fn(logp_t, H_t, args_t)

    `token_loss_fn(logp_C, entropy_C, args) -> (loss_C, aux)` is applied to chunks of C tokens
    and must be ELEMENTWISE over tokens (no mixing across positions): its per-token gradient
    is taken with `jax.grad` of the chunk sum. `aux` is a pytree of [C] arrays; its token sums
    come back as `aux_sums` (metrics; no gradient flows through them). `token_args` is a pytree
    of [N, ...] arrays passed chunk-wise to `token_loss_fn`; it carries no gradient (pass
    advantages, old/ref log-probs, masks and aggregation weights here, never as closures over
    traced values).

    The custom VJP does all the backward work in the forward pass (3 or 4 matmuls per chunk,
    see `store_logits` and the module docstring) and stores the gradients as residuals; the
    backward pass multiplies them by the cotangent of `loss`. Without differentiation only the
    statistics sweep runs (1 matmul).

    Args:
      hidden_NxD, head_DxV, targets_N, temperature: as in `token_logps`.
      token_loss_fn: elementwise per-token loss, see above.
      token_args: pytree of arrays with leading dim N.
      token_chunk: static rows per chunk (None: see `kernel`).
      vocab_tile: static column tile of the sweeps: dhead is accumulated tile by tile in
        place (no second [D x V] buffer); the other temporaries are [chunk x vocab_tile].
      store_logits: False: 4 matmuls, logits computed twice tile by tile, memory ~a few
        chunk x vocab_tile x 4 bytes. True: 3 matmuls, the [chunk x V] f32 logits of a chunk
        are kept for the gradient sweep. None: see `kernel`.
      kernel: how unset schedule arguments are chosen (`fused_schedule`). "auto": per
        platform (`FUSED_TILES`): 3 matmuls when the logits buffer holds enough rows, else 4.
        "reference": 4 matmuls, 1024-row chunks (`default_token_chunk(V)` rows if
        store_logits), 4096-column tiles.
      Besides the temporaries, the f32 head-gradient accumulator [D x V] is live (it becomes
      the returned gradient; for f32 heads XLA aliases it to the output).

    Returns:
      (loss, aux_sums): f32 scalar and the pytree of summed aux values.
    """
    store_logits, token_chunk, vocab_tile = fused_schedule(
        head_DxV.shape[-1],
        kernel=kernel,
        token_chunk=token_chunk,
        vocab_tile=vocab_tile,
        store_logits=store_logits,
    )
    _check_inputs(hidden_NxD, head_DxV, targets_N, temperature, token_chunk)
    _check_token_args(token_args, hidden_NxD.shape[0])
    run = functools.partial(
        _fused_scan,
        token_loss_fn=token_loss_fn,
        inv_temp=1.0 / float(temperature),
        c=int(token_chunk),
        vocab_tile=int(vocab_tile),
        store_logits=bool(store_logits),
    )

    @jax.custom_vjp
    def f(h, w, t, args):
        return run(h, w, t, token_args=args, with_grad=False)

    def f_fwd(h, w, t, args):
        loss, aux, dh, dw = run(h, w, t, token_args=args, with_grad=True)
        return (loss, aux), (dh, dw)

    def f_bwd(res, g):
        dh, dw = res
        g_loss = g[0]
        dh = (dh * g_loss.astype(dh.dtype)).astype(hidden_NxD.dtype)
        dw = (dw * g_loss).astype(head_DxV.dtype)
        return dh, dw, None, None

    f.defvjp(f_fwd, f_bwd)
    return f(hidden_NxD, head_DxV, targets_N, token_args)


# ---------------------------------------------------------------- [B, T] conveniences


def token_logps_BxT(
    hidden_BxTxD: jax.Array,
    head_DxV: jax.Array,
    targets_BxT: jax.Array,
    **kwargs,
) -> tuple[jax.Array, jax.Array | None]:
    """`token_logps` on [B, T] batches: returns (logps_BxT, entropy_BxT or None)."""
    if hidden_BxTxD.ndim != 3 or hidden_BxTxD.shape[:2] != targets_BxT.shape:
        raise ValueError(
            f"expected hidden [B, T, D] and targets [B, T], got {hidden_BxTxD.shape} and "
            f"{targets_BxT.shape}"
        )
    b, t, d = hidden_BxTxD.shape
    logp_N, ent_N = token_logps(
        hidden_BxTxD.reshape(b * t, d), head_DxV, targets_BxT.reshape(b * t), **kwargs
    )
    return logp_N.reshape(b, t), None if ent_N is None else ent_N.reshape(b, t)


def fused_token_loss_BxT(
    hidden_BxTxD: jax.Array,
    head_DxV: jax.Array,
    targets_BxT: jax.Array,
    token_loss_fn: TokenLossFn,
    token_args: Any,
    **kwargs,
) -> tuple[jax.Array, Any]:
    """`fused_token_loss` on [B, T] batches; `token_args` leaves are [B, T, ...].

    `token_loss_fn` still sees flat chunks of tokens ([C] arrays), not [B, T].
    """
    if hidden_BxTxD.ndim != 3 or hidden_BxTxD.shape[:2] != targets_BxT.shape:
        raise ValueError(
            f"expected hidden [B, T, D] and targets [B, T], got {hidden_BxTxD.shape} and "
            f"{targets_BxT.shape}"
        )
    b, t, d = hidden_BxTxD.shape
    for leaf in jax.tree.leaves(token_args):
        if jnp.shape(leaf)[:2] != (b, t):
            raise ValueError(
                f"every token_args leaf must have leading dims [B, T]={(b, t)}, got "
                f"{jnp.shape(leaf)}"
            )
    args_N = jax.tree.map(lambda a: jnp.reshape(a, (b * t,) + jnp.shape(a)[2:]), token_args)
    return fused_token_loss(
        hidden_BxTxD.reshape(b * t, d),
        head_DxV,
        targets_BxT.reshape(b * t),
        token_loss_fn,
        args_N,
        **kwargs,
    )
