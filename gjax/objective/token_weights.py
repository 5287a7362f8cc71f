"""Per-token weights from the token covariance between log-probs and advantages (no gradient).

Every entry of ``TOKEN_WEIGHTS`` has the signature::

    fn(logps_BxT, adv_BxT, loss_mask_BxT, *, rng=None, **static_hparams)
        -> TokenWeightOutput(w_BxT, kl_coef_BxT, metrics)

run ONCE on the full (global) batch before micro-batching:

* ``logps_BxT``: per-token log-probs of the policy at the start of the update (the trainer's
  recomputed ``old_logps_BxT``; equal to the current policy at the first iteration).
* ``adv_BxT``: per-token advantages (a per-sequence ``adv_B`` is broadcast over T).
* ``loss_mask_BxT``: 1 on completion tokens that are trained.

Outputs: ``w_BxT`` multiplies the advantage inside the policy-loss term (CW-GRPO:
``ratio * (w * A)``); it is 0 on padding. ``kl_coef_BxT`` is a per-token coefficient for the
KL-Cov penalty ``kl_coef * |logp - old_logp|`` (0 for every other method). Both are wrapped in
``stop_gradient`` (the inputs too): ``jax.grad`` through them is exactly zero.

Token covariance (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; CW-GRPO
Sec. 2.3)::

    c_t = (logp_t - mean(logp)) * (A_t - mean(A))

where both means run over valid tokens (token-weighted: a long response contributes more
tokens). CW-GRPO's means run over the G responses of one group with the normaliser
N = sum_{j=1..G} |o_j| (Sec. 2.3), so ``cw_gaussian`` computes its statistics and its
normaliser per group by default (``scope='group'``; ``'batch'`` takes the whole update batch).
Clip-Cov/KL-Cov take the whole batch, as Cui et al.'s reference code does (a masked mean over
the batch's response tokens). ``group_size`` (G, rows per group in the prompt-major batch) is
passed by ``prepare``; None means one group, the whole batch. Under ``jit`` with sharded arrays
these reductions are global (GSPMD).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gjax.registry import Registry

TOKEN_WEIGHTS: Registry[Callable[..., TokenWeightOutput]] = Registry("token weights")


class TokenWeightOutput(NamedTuple):
    """``w_BxT`` float32 advantage weights, ``kl_coef_BxT`` float32 KL-Cov coefficients."""

    w_BxT: jax.Array
    kl_coef_BxT: jax.Array
    metrics: dict[str, jax.Array]


def _check(name, logps_BxT, adv_BxT, loss_mask_BxT):
    logps_BxT = jnp.asarray(logps_BxT)
    adv = jnp.asarray(adv_BxT)
    mask = jnp.asarray(loss_mask_BxT)
    if logps_BxT.ndim != 2:
        raise ValueError(f"{name}: logps_BxT must be 2-D [B, T], got shape {logps_BxT.shape}")
    if mask.shape != logps_BxT.shape:
        raise ValueError(
            f"{name}: loss_mask_BxT shape {mask.shape} != logps_BxT shape {logps_BxT.shape}"
        )
    for arr_name, arr in (("logps_BxT", logps_BxT), ("adv_BxT", adv)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name}: {arr_name} must be floating, got {arr.dtype}")
    if adv.shape == logps_BxT.shape[:1]:
        adv = jnp.broadcast_to(adv[:, None], logps_BxT.shape)
    if adv.shape != logps_BxT.shape:
        raise ValueError(
            f"{name}: adv must be [B, T] {logps_BxT.shape} or [B] {logps_BxT.shape[:1]}, "
            f"got {adv.shape}"
        )
    valid = mask.astype(bool) if mask.dtype == bool else mask != 0
    logps = jax.lax.stop_gradient(logps_BxT.astype(jnp.float32))
    adv = jax.lax.stop_gradient(adv.astype(jnp.float32))
    # A non-finite log-prob or advantage would poison every weight through the means: such
    # tokens are excluded (weight 0) and counted in metrics['nonfinite_tokens'].
    finite = jnp.isfinite(logps) & jnp.isfinite(adv)
    nonfinite = jnp.sum(valid & ~finite)
    valid = valid & finite
    return jnp.where(valid, logps, 0.0), jnp.where(valid, adv, 0.0), valid, nonfinite


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def token_covariance(logps_BxT, adv_BxT, valid_BxT):
    """``c_t = (logp_t - mean logp)(A_t - mean A)``, means over valid tokens; 0 on padding."""
    dl = logps_BxT - _masked_mean(logps_BxT, valid_BxT)
    da = adv_BxT - _masked_mean(adv_BxT, valid_BxT)
    return jnp.where(valid_BxT, dl * da, 0.0)


# CW-GRPO Table 1 reads the spread of |c_t| at a few percentiles; `prepare` logs these for any
# objective (GRPO included) with `covariance_metrics` (the quantiles sort the batch's B*T values).
COV_QUANTILES = (0.5, 0.9, 0.99, 0.999)


def covariance_percentiles(logps_BxT, adv_BxT, valid_BxT, group_size=None) -> dict:
    """Percentiles of |c_t| over valid tokens (CW-GRPO Table 1's form), ``c_t`` with the means
    of each group of ``group_size`` rows (CW-GRPO Sec. 2.3; None: the whole batch):
    ``abs_p50`` ... ``abs_p99.9``, ``max``, ``min`` (signed extremes) and ``pos_fraction``
    (share of valid tokens with c > 0). All 0 without valid tokens."""
    valid_BxT = jnp.asarray(valid_BxT).astype(bool)
    b = valid_BxT.shape[0]
    rows = b // group_size if group_size else 1
    lp = _rows_of(jnp.asarray(logps_BxT, jnp.float32), rows)  # [K, N]: K groups
    a = _rows_of(jnp.asarray(adv_BxT, jnp.float32), rows)
    v = _rows_of(valid_BxT, rows)
    n_K1 = jnp.maximum(jnp.sum(v, 1, keepdims=True), 1)

    def centred(x):
        return x - jnp.sum(jnp.where(v, x, 0.0), 1, keepdims=True) / n_K1

    c = jnp.where(v, centred(lp) * centred(a), 0.0)
    has = jnp.any(v)
    qs = jnp.nanquantile(jnp.where(v, jnp.abs(c), jnp.nan).reshape(-1), jnp.array(COV_QUANTILES))
    m = {f"abs_p{100 * q:g}": qs[i] for i, q in enumerate(COV_QUANTILES)}
    m["max"] = jnp.max(jnp.where(v, c, -jnp.inf))
    m["min"] = jnp.min(jnp.where(v, c, jnp.inf))
    m["pos_fraction"] = jnp.sum(v & (c > 0)) / jnp.maximum(jnp.sum(v), 1)
    return {
        k: jax.lax.stop_gradient(jnp.where(has, jnp.asarray(x, jnp.float32), 0.0))
        for k, x in m.items()
    }


def _weight_metrics(w, valid, nonfinite, prefix="w", **extra):
    n = jnp.sum(valid)
    m = {
        f"{prefix}_min": jnp.where(n > 0, jnp.min(jnp.where(valid, w, jnp.inf)), 0.0),
        f"{prefix}_mean": _masked_mean(w, valid),
        f"{prefix}_max": jnp.where(n > 0, jnp.max(jnp.where(valid, w, -jnp.inf)), 0.0),
        "num_tokens": n,
        "nonfinite_tokens": nonfinite,
    }
    m.update(extra)
    return {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in m.items()}


def _out(w, kl, metrics):
    return TokenWeightOutput(jax.lax.stop_gradient(w), jax.lax.stop_gradient(kl), metrics)


def _count(ratio, n_valid):
    """max(floor(ratio * n), 1) as in Cui et al. (0 when there are no valid tokens).

    The (1 + 1e-6) guards float32 rounding of exact products like 2e-4 * 10000.
    """
    k = jnp.floor(ratio * n_valid.astype(jnp.float32) * (1.0 + 1e-6)).astype(jnp.int32)
    return jnp.where(n_valid > 0, jnp.maximum(k, 1), 0)


def _rank(key_N):
    """Rank of each entry in ascending order of ``key_N`` (stable: ties by index)."""
    order = jnp.argsort(key_N, stable=True)
    return jnp.zeros_like(order).at[order].set(jnp.arange(key_N.shape[0], dtype=order.dtype))


@TOKEN_WEIGHTS.register("none")
def none(logps_BxT, adv_BxT, loss_mask_BxT, *, rng=None, group_size=None) -> TokenWeightOutput:
    """Plain GRPO: weight 1 on valid tokens, 0 on padding; no KL-Cov term."""
    _, _, valid, nonfinite = _check("none", logps_BxT, adv_BxT, loss_mask_BxT)
    w = valid.astype(jnp.float32)
    return _out(w, jnp.zeros_like(w), _weight_metrics(w, valid, nonfinite))


CW_SCOPES = ("group", "batch")


def _rows_of(x_BxT, rows):
    """[B, T] -> [rows, B*T/rows]: each row one group's tokens (prompt-major batch)."""
    return x_BxT.reshape(rows, -1)


@TOKEN_WEIGHTS.register("cw_gaussian")
def cw_gaussian(
    logps_BxT, adv_BxT, loss_mask_BxT, *, rng=None, group_size=None, scope: str = "group"
) -> TokenWeightOutput:
    """CW-GRPO (Sec. 2.3) Gaussian-kernel advantage weights.

    Per group (``scope='group'``, the paper) or over the whole batch (``'batch'``): ``c_t`` the
    token covariance (module docstring), ``sigma = std(c)`` (population std over the valid
    tokens), ``w_t = exp(-c_t^2 / (2 sigma^2))`` and ``w~_t = w_t * N / sum_valid w`` with N the
    number of valid tokens (``N = sum_{j=1..G} |o_j|`` per group), so the mean weight is 1 in
    every group (over the batch with ``'batch'``); padding gets 0. Tokens with extreme |c| get
    the smallest weights. The exponent is shifted by its max before ``exp`` (cancels in the
    normalisation) so weights never underflow to an all-zero 0/0. ``sigma = 0`` (all c equal,
    e.g. a group with one reward) gives w = 1 on its valid tokens.
    metrics: ``w_min``/``w_mean``/``w_max`` over valid tokens, ``cov_mean`` (over valid tokens),
    ``cov_std`` (sigma, averaged over the groups with valid tokens).
    """
    if scope not in CW_SCOPES:
        raise ValueError(f"cw_gaussian: scope must be one of {CW_SCOPES}, got {scope!r}")
    logps, adv, valid, nonfinite = _check("cw_gaussian", logps_BxT, adv_BxT, loss_mask_BxT)
    b = logps.shape[0]
    if group_size is not None and (group_size < 1 or b % group_size):
        raise ValueError(f"cw_gaussian: group_size {group_size} does not divide B = {b}")
    rows = b // group_size if scope == "group" and group_size is not None else 1
    lp, a, v = (_rows_of(x, rows) for x in (logps, adv, valid))  # [K, N]: K groups

    def mean(x):  # masked mean along each group, [K, 1]
        return jnp.sum(jnp.where(v, x, 0.0), 1, keepdims=True) / jnp.maximum(
            jnp.sum(v, 1, keepdims=True), 1
        )

    c = jnp.where(v, (lp - mean(lp)) * (a - mean(a)), 0.0)
    sigma = jnp.sqrt(mean((c - mean(c)) ** 2))
    z = jnp.where(sigma > 0, -(c**2) / (2.0 * jnp.where(sigma > 0, sigma, 1.0) ** 2), 0.0)
    z = jnp.where(v, z, 0.0)
    z_max = jnp.max(jnp.where(v, z, -jnp.inf), 1, keepdims=True)
    z_max = jnp.where(jnp.isfinite(z_max), z_max, 0.0)
    w = jnp.where(v, jnp.exp(z - z_max), 0.0)
    n = jnp.sum(v, 1, keepdims=True).astype(jnp.float32)
    w = (w * (n / jnp.maximum(jnp.sum(w, 1, keepdims=True), 1e-30))).reshape(valid.shape)
    has = n[:, 0] > 0
    cov_std = jnp.sum(jnp.where(has, sigma[:, 0], 0.0)) / jnp.maximum(jnp.sum(has), 1)
    c_mean = _masked_mean(c.reshape(valid.shape), valid)
    return _out(
        w,
        jnp.zeros_like(w),
        _weight_metrics(w, valid, nonfinite, cov_mean=c_mean, cov_std=cov_std),
    )


@TOKEN_WEIGHTS.register("clip_cov")
def clip_cov(
    logps_BxT,
    adv_BxT,
    loss_mask_BxT,
    *,
    rng=None,
    group_size=None,
    ratio: float = 2e-4,
    omega_low: float = 1.0,
    omega_high: float = 5.0,
) -> TokenWeightOutput:
    """Clip-Cov (Cui et al. 2025): detach a random few tokens with covariance in a band.

    Candidates: valid tokens with ``omega_low < c_t < omega_high``. ``k = max(floor(ratio * N), 1)``
    of them (N = valid tokens in the global batch), chosen uniformly at random with ``rng``, get
    weight 0 (no policy-gradient term: "detached"); every other valid token gets 1, padding 0.
    Defaults are Cui et al.'s (ratio 2e-4, omega in (1, 5)), the CW-GRPO paper's Clip-Cov baseline
    (Table 2). Differences from their reference code: the covariance uses the log-probs at the
    start of the update (identical at the first iteration) and tokens that PPO's clip already
    zeroes are not excluded from the candidates (the ratio is unknown before the loss).
    metrics: ``clip_cov_fraction`` (detached / valid), ``clip_cov_candidates``, weight min/mean/max.
    """
    name = "clip_cov"
    if rng is None:
        raise ValueError(f"{name}: needs rng (a jax.random key) to pick the detached tokens")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name}: ratio must be in [0, 1], got {ratio}")
    if not omega_low < omega_high:
        raise ValueError(f"{name}: need omega_low < omega_high, got {omega_low}, {omega_high}")
    logps, adv, valid, nonfinite = _check(name, logps_BxT, adv_BxT, loss_mask_BxT)
    c = token_covariance(logps, adv, valid)
    cand = valid & (c > omega_low) & (c < omega_high)
    k = _count(ratio, jnp.sum(valid)) if ratio > 0 else jnp.zeros((), jnp.int32)
    u = jax.random.uniform(rng, c.shape)
    rank = _rank(jnp.where(cand, u, 2.0).reshape(-1)).reshape(c.shape)
    detached = cand & (rank < k)
    w = (valid & ~detached).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(valid), 1)
    return _out(
        w,
        jnp.zeros_like(w),
        _weight_metrics(
            w,
            valid,
            nonfinite,
            clip_cov_fraction=jnp.sum(detached) / n,
            clip_cov_candidates=jnp.sum(cand),
        ),
    )


@TOKEN_WEIGHTS.register("kl_cov")
def kl_cov(
    logps_BxT,
    adv_BxT,
    loss_mask_BxT,
    *,
    rng=None,
    group_size=None,
    ratio: float = 2e-3,
    kl_coef: float = 1.0,
) -> TokenWeightOutput:
    """KL-Cov (Cui et al. 2025): a KL penalty on the top-k fraction of tokens by covariance.

    The ``k = max(floor(ratio * N), 1)`` valid tokens with the LARGEST (signed) covariance c_t get
    ``kl_coef_BxT = kl_coef``; the loss adds ``kl_coef_t * |logp_t - old_logp_t|`` to their
    policy loss (Cui et al.'s form), with no gradient at logp = old_logp
    (``policy_losses.abs_log_ratio``); the ``kl_cov`` preset's surrogate is the unclipped
    ``-r A`` (``ratio``), as Cui et al. and verl. ``w_BxT`` is 1 on valid tokens, 0 on
    padding. Defaults are Cui et al.'s for Qwen2.5-7B (k = 0.2% of tokens, coefficient 1);
    ties broken by position.
    metrics: ``kl_cov_fraction`` (selected / valid), weight min/mean/max.
    """
    name = "kl_cov"
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name}: ratio must be in [0, 1], got {ratio}")
    if not kl_coef >= 0.0:
        raise ValueError(f"{name}: kl_coef must be >= 0, got {kl_coef}")
    logps, adv, valid, nonfinite = _check(name, logps_BxT, adv_BxT, loss_mask_BxT)
    c = token_covariance(logps, adv, valid)
    k = _count(ratio, jnp.sum(valid)) if ratio > 0 else jnp.zeros((), jnp.int32)
    rank = _rank(jnp.where(valid, -c, jnp.inf).reshape(-1)).reshape(c.shape)
    selected = valid & (rank < k)
    w = valid.astype(jnp.float32)
    kl = jnp.where(selected, jnp.float32(kl_coef), 0.0)
    n = jnp.maximum(jnp.sum(valid), 1)
    return _out(w, kl, _weight_metrics(w, valid, nonfinite, kl_cov_fraction=jnp.sum(selected) / n))


def compute_token_weights(
    name: str, logps_BxT, adv_BxT, loss_mask_BxT, *, rng=None, **hparams
) -> TokenWeightOutput:
    """``TOKEN_WEIGHTS.get(name)(...)``: look up a token-weight method by name and run it."""
    return TOKEN_WEIGHTS.get(name)(logps_BxT, adv_BxT, loss_mask_BxT, rng=rng, **hparams)
