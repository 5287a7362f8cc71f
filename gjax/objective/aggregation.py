"""Loss aggregation as per-token weights with GLOBAL denominators.

Every aggregation mode is written as a weight w_{i,t} per token, computed once on the full
(global) batch before micro-batching, so that the loss is a plain weighted sum

    L = sum_{i,t} w_{i,t} * loss_{i,t}

and the losses (and gradients) of any split of the batch into micro-batches, devices or
accumulation steps add up to the full-batch value exactly. Normalising per micro-batch,
the bug class this avoids, changes the objective with the micro-batch size.

With m_{i,t} = loss_mask * counted_i (counted_i: sequence i exists and counts in the
denominators), |o_i| = sum_t m_{i,t}, n_seq = #{i : |o_i| > 0} and n_tok = sum |o_i|:

  token_mean                w = m / n_tok               DAPO eq. (8); GPG (see below)
  seq_mean_token_mean       w = m / (n_seq |o_i|)       GRPO (DeepSeekMath eq. (3))
  seq_mean_token_sum_norm   w = m / (n_seq * C)         Dr.GRPO (Liu et al. 2025): C constant,
                                                        the maximum completion length
  group_token_mean          w = m / (n_grp * N_g(i))    GPG eq. (5): N_g = sum_{j in g} |o_j|,
                                                        the token count of i's group g, and
                                                        n_grp = #{g : N_g > 0} (the expectation
                                                        over prompts is a mean over groups)

``group_B`` (int, [B]) names each row's group (prompt): ``prepare`` passes ``b // G`` for the
prompt-major batch; only group_token_mean reads it. With equal group token counts it equals
token_mean. The weights are still global (n_grp and every N_g are full-batch counts), so
micro-batches and meshes add up exactly as for the other modes.

Denominators are guarded (max(., 1)), so an all-masked batch gives all-zero weights: loss 0
and zero gradient, never NaN. Under jit with sharded global arrays the sums below are global
(GSPMD inserts the cross-device reductions), so weights are identical on any mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gjax.registry import Registry

Array = jax.Array

AGGREGATIONS: Registry[Callable[..., Array]] = Registry("aggregation")


def _mask(loss_mask_BxT: Array, counted_B: Array | None) -> Array:
    if loss_mask_BxT.ndim != 2:
        raise ValueError(f"loss_mask_BxT must be [B, T], got shape {loss_mask_BxT.shape}")
    m = loss_mask_BxT.astype(jnp.float32)
    if counted_B is not None:
        if counted_B.shape != loss_mask_BxT.shape[:1]:
            raise ValueError(
                f"counted_B shape {counted_B.shape} does not match batch {loss_mask_BxT.shape[:1]}"
            )
        m = m * counted_B.astype(jnp.float32)[:, None]
    return m


@AGGREGATIONS.register("token_mean")
def token_mean(
    loss_mask_BxT: Array, counted_B: Array | None = None, *, constant=None, group_B=None
) -> Array:
    del constant, group_B
    m = _mask(loss_mask_BxT, counted_B)
    return m / jnp.maximum(m.sum(), 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_mask_BxT: Array, counted_B: Array | None = None, *, constant=None, group_B=None
) -> Array:
    del constant, group_B
    m = _mask(loss_mask_BxT, counted_B)
    len_B = m.sum(axis=1)
    n_seq = jnp.maximum((len_B > 0).sum().astype(jnp.float32), 1.0)
    return m / (n_seq * jnp.maximum(len_B, 1.0))[:, None]


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_mask_BxT: Array,
    counted_B: Array | None = None,
    *,
    constant: float | None = None,
    group_B=None,
) -> Array:
    """``constant`` None means T, the padded completion length (the max generation length)."""
    del group_B
    m = _mask(loss_mask_BxT, counted_B)
    c = float(loss_mask_BxT.shape[1]) if constant is None else float(constant)
    if not c > 0:
        raise ValueError(f"seq_mean_token_sum_norm needs a constant > 0, got {constant}")
    n_seq = jnp.maximum((m.sum(axis=1) > 0).sum().astype(jnp.float32), 1.0)
    return m / (n_seq * c)


@AGGREGATIONS.register("group_token_mean")
def group_token_mean(
    loss_mask_BxT: Array, counted_B: Array | None = None, *, constant=None, group_B=None
) -> Array:
    """GPG eq. (5): each group's token sum over its own token count, averaged over groups."""
    del constant
    if group_B is None:
        raise ValueError("group_token_mean needs group_B, the group (prompt) index of each row")
    m = _mask(loss_mask_BxT, counted_B)
    group_B = jnp.asarray(group_B)
    if group_B.shape != m.shape[:1]:
        raise ValueError(f"group_B shape {group_B.shape} does not match batch {m.shape[:1]}")
    b = m.shape[0]
    # Dense ids in [0, B) whatever the labels (a minibatch holds a subset of the groups).
    _, dense_B = jnp.unique(group_B, return_inverse=True, size=b)
    dense_B = dense_B.reshape(b)
    tokens_g = jax.ops.segment_sum(m.sum(axis=1), dense_B, num_segments=b)  # N_g
    n_grp = jnp.maximum((tokens_g > 0).sum().astype(jnp.float32), 1.0)
    return m / (n_grp * jnp.maximum(tokens_g[dense_B], 1.0))[:, None]


def aggregation_weights(
    mode: str,
    loss_mask_BxT: Array,
    counted_B: Array | None = None,
    *,
    constant: float | None = None,
    group_B: Array | None = None,
) -> Array:
    """Per-token weights ``w_BxT`` (float32) of aggregation ``mode`` on the GLOBAL batch."""
    return AGGREGATIONS.get(mode)(loss_mask_BxT, counted_B, constant=constant, group_B=group_B)


def minibatch_scale_MxB(
    mode: str,
    mask_MxBxT: Array,
    group_MxB: Array,
    *,
    constant: float | None = None,
) -> Array:
    """Per-row factor turning full-batch weights into those of each minibatch ALONE.

    ``mask_MxBxT``: the counted loss tokens of the rows of each of M minibatches; ``group_MxB``
    their group indices. Every mode's weight is the row's mask times a per-row factor, so the
    ratio of a row's weight sums (minibatch alone / full batch) is that factor; rows without
    tokens get 1 (their weights are 0 anyway). A group split over minibatches is, in each
    minibatch, the group of its rows there (GPG eq. (5) on the minibatch).
    """
    m, bm, t = mask_MxBxT.shape
    full_BxT = aggregation_weights(
        mode, mask_MxBxT.reshape(m * bm, t), constant=constant, group_B=group_MxB.reshape(-1)
    )
    alone_MxBxT = jax.vmap(
        lambda mask, grp: aggregation_weights(mode, mask, constant=constant, group_B=grp)
    )(mask_MxBxT, group_MxB)
    full_MxB = full_BxT.sum(axis=1).reshape(m, bm)
    alone_MxB = alone_MxBxT.sum(axis=2)
    return jnp.where(full_MxB > 0, alone_MxB / jnp.where(full_MxB > 0, full_MxB, 1.0), 1.0)
