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

GPG eq. (5) divides by the token count of each GROUP (then averages over prompts); gjax's
GPG preset uses the global token mean instead, which equals eq. (5) when groups have equal
token counts and keeps every normaliser global (the point of GPG's Appendix A).

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
def token_mean(loss_mask_BxT: Array, counted_B: Array | None = None, *, constant=None) -> Array:
    del constant
    m = _mask(loss_mask_BxT, counted_B)
    return m / jnp.maximum(m.sum(), 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_mask_BxT: Array, counted_B: Array | None = None, *, constant=None
) -> Array:
    del constant
    m = _mask(loss_mask_BxT, counted_B)
    len_B = m.sum(axis=1)
    n_seq = jnp.maximum((len_B > 0).sum().astype(jnp.float32), 1.0)
    return m / (n_seq * jnp.maximum(len_B, 1.0))[:, None]


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_mask_BxT: Array, counted_B: Array | None = None, *, constant: float | None = None
) -> Array:
    """``constant`` None means T, the padded completion length (the max generation length)."""
    m = _mask(loss_mask_BxT, counted_B)
    c = float(loss_mask_BxT.shape[1]) if constant is None else float(constant)
    if not c > 0:
        raise ValueError(f"seq_mean_token_sum_norm needs a constant > 0, got {constant}")
    n_seq = jnp.maximum((m.sum(axis=1) > 0).sum().astype(jnp.float32), 1.0)
    return m / (n_seq * c)


def aggregation_weights(
    mode: str,
    loss_mask_BxT: Array,
    counted_B: Array | None = None,
    *,
    constant: float | None = None,
) -> Array:
    """Per-token weights ``w_BxT`` (float32) of aggregation ``mode`` on the GLOBAL batch."""
    return AGGREGATIONS.get(mode)(loss_mask_BxT, counted_B, constant=constant)
