"""Advantage estimators for GRPO-family RL: pure functions of rewards [P, G].

Every estimator has the signature::

    fn(rewards_PxG, valid_PxG, *, scores_PxG=None, is_anchor_PxG=None, **static_hparams)
        -> AdvantageOutput(adv_PxG, keep_PxG, metrics)

and is registered by name in ``ADVANTAGES`` (``grpo``, ``dapo``, ``dr_grpo``, ``gpg``,
``a_grae``, ``dagrpo``, ``pass_at_k``, ``rloo``, ``batch_norm``, ``w_reinforce``).
Hyperparameters are Python values (static under ``jit``); out-of-range values raise
``ValueError`` at trace time.

Conventions shared by all estimators
-------------------------------------
* Row ``p`` holds the ``G`` samples of prompt ``p`` (prompt-major, ``B = P * G``). A *group* is
  the set of VALID samples of one row. Off-policy anchors (DaGRPO / LUFFY) are ordinary members
  of their row: every estimator computes its statistics over the mixed group (DaGRPO eq. (11)).
* ``valid_PxG`` (bool, or numeric with nonzero = valid) marks real samples. A sample whose reward
  (or, for ``dagrpo``, judge score) is NaN/inf is treated as INVALID: it is dropped from every
  mean/std, gets advantage 0 and ``keep = False``, and is counted in ``metrics['nonfinite']``.
  Non-finite values therefore never reach the loss.
* ``keep_PxG`` = valid samples that survive the estimator's own masking (only ``dagrpo`` masks).
  ``adv_PxG`` is exactly 0 wherever ``keep_PxG`` is False.
* A group whose valid rewards are all equal (this includes groups with a single valid sample) is
  a *zero-variance group*: its advantages are set to exactly 0 (no ``0/0``, and no spurious
  ``+-1`` from rounding in ``(r - mean) / std`` when all rewards equal e.g. 0.1).
  ``metrics['zero_var_frac']`` is their fraction among groups with at least one valid sample.
* Statistics named "batch" or "global" (GPG alpha, A-GRAE omega_s, batch std) are plain ``jnp``
  reductions over the whole [P, G] array; under ``jit`` with sharded global arrays they are
  global across devices (GSPMD inserts the collectives), which the mesh tests check.
* Rewards of any finite float32 size: means and variances are taken of the rewards divided by
  their largest magnitude (``_scaled_moments``), so the normalised estimators give the same
  advantages for ``r`` and ``1e30 * r`` (squares of rewards above ~1.8e19 would overflow to
  inf and zero every advantage; sums near float32's max would give NaN). The unnormalised ones
  (``dr_grpo``, ``gpg`` with ``norm='none'``, ``rloo``) return centred rewards, finite for any
  finite rewards; their loss then has the rewards' scale.
* An all-invalid batch gives all-zero advantages, ``keep = False`` everywhere and finite metrics
  (guarded denominators).
* Standard deviation: POPULATION std (``ddof=0``, divide by the group size n) by default. This
  is the GRAE definition of A-GRAE eq. (17) under which Theorem 2 (sum |A| = 2 G sqrt(p(1-p)))
  and eq. (5) hold exactly; DeepSeekMath only says "std". TRL / verl use ``torch.std``, the
  SAMPLE std (``ddof=1``, divide by n - 1); pass ``ddof=1`` to reproduce them. For a binary group
  the two differ by the factor sqrt(n / (n - 1)) only.

Metrics (float32 scalars, full-batch statistics): ``adv_mean``, ``adv_std``, ``adv_min``,
``adv_max`` over kept samples; ``zero_var_frac``; ``num_valid``, ``num_kept``, ``nonfinite``,
``reward_mean`` (over valid samples); plus per-estimator entries (``alpha``, ``ass_scale``,
``masked_fraction``...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gjax.registry import Registry

ADVANTAGES: Registry[Callable[..., AdvantageOutput]] = Registry("advantage estimator")

# Judge-score gaps are compared with this slack so that decimal scores whose gap is exactly
# delta (e.g. 7.3 - 4.3 vs delta=3 in float32) count as ">= delta" as DaGRPO eqs. (8)-(9) intend.
_GAP_ATOL = 1e-5


class AdvantageOutput(NamedTuple):
    """``adv_PxG`` float32 advantages, ``keep_PxG`` bool sample mask, ``metrics`` scalars."""

    adv_PxG: jax.Array
    keep_PxG: jax.Array
    metrics: dict[str, jax.Array]


# --------------------------------------------------------------------------------------------
# Input checks and masked statistics
# --------------------------------------------------------------------------------------------


def _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG=None, is_anchor_PxG=None, min_g=2):
    """Trace-time validation; returns (rewards f32 with non-finite -> 0, valid bool, nonfinite)."""
    rewards_PxG = jnp.asarray(rewards_PxG)
    valid_PxG = jnp.asarray(valid_PxG)
    if rewards_PxG.ndim != 2:
        raise ValueError(
            f"{name}: rewards_PxG must be 2-D [prompts, G], got shape {rewards_PxG.shape}"
        )
    if not jnp.issubdtype(rewards_PxG.dtype, jnp.floating):
        raise TypeError(
            f"{name}: rewards_PxG must be a floating dtype, got {rewards_PxG.dtype}; "
            "cast with .astype(jnp.float32)"
        )
    if valid_PxG.shape != rewards_PxG.shape:
        raise ValueError(
            f"{name}: valid_PxG shape {valid_PxG.shape} != rewards_PxG shape {rewards_PxG.shape}"
        )
    g = rewards_PxG.shape[1]
    if g < min_g:
        raise ValueError(
            f"{name}: group-relative advantages need G >= {min_g} samples per prompt, got G={g}"
        )
    for arr_name, arr in (("scores_PxG", scores_PxG), ("is_anchor_PxG", is_anchor_PxG)):
        if arr is not None and jnp.shape(arr) != rewards_PxG.shape:
            raise ValueError(
                f"{name}: {arr_name} shape {jnp.shape(arr)} != rewards_PxG shape "
                f"{rewards_PxG.shape}"
            )
    r = rewards_PxG.astype(jnp.float32)
    finite = jnp.isfinite(r)
    given = valid_PxG.astype(bool) if valid_PxG.dtype == bool else valid_PxG != 0
    nonfinite = jnp.sum(given & ~finite)
    valid = given & finite
    r = jnp.where(valid, r, 0.0)
    return r, valid, nonfinite


def _masked_scale(x, mask, axis=None, keepdims=False):
    """max |x| over the masked entries (1 where there are none or all are 0): dividing by it
    puts every masked value in [-1, 1], so sums, squares and variances of the scaled values
    cannot overflow float32 for any finite input (rewards of 1e20 square to 1e40 = inf)."""
    s = jnp.max(jnp.where(mask, jnp.abs(x), 0.0), axis=axis, keepdims=keepdims)
    return jnp.where(s > 0, s, 1.0)


def _over(x, s):
    """``x / s`` for a positive ``s`` of any finite size. XLA may compute it as
    ``x * (1 / s)``, and ``1 / s`` is subnormal (flushed to 0 on CPU and TPU) for
    ``s > 2**126``: both are shrunk by 2**-64 first (exact, powers of two)."""
    f = jnp.where(s > 2.0**64, 2.0**-64, 1.0)
    return (x * f) / (s * f)


def _masked_mean(x, mask, axis=None, keepdims=False):
    n = jnp.sum(mask, axis=axis, keepdims=keepdims)
    s = _masked_scale(x, mask, axis=axis, keepdims=True)
    total = jnp.sum(jnp.where(mask, _over(x, s), 0.0), axis=axis, keepdims=keepdims)
    return _masked_scale(x, mask, axis=axis, keepdims=keepdims) * (total / jnp.maximum(n, 1))


def _scaled_moments(x, mask, ddof, axis=None):
    """``(s, mean, std)`` of ``x / s`` over the mask, ``s = _masked_scale`` (shapes kept along
    `axis`): the moments of any finite values without overflow; ``s * std`` is x's std."""
    s = _masked_scale(x, mask, axis=axis, keepdims=True)
    y = _over(x, s)
    n = jnp.sum(mask, axis=axis, keepdims=True)
    mean = jnp.sum(jnp.where(mask, y, 0.0), axis=axis, keepdims=True) / jnp.maximum(n, 1)
    ss = jnp.sum(jnp.where(mask, (y - mean) ** 2, 0.0), axis=axis, keepdims=True)
    return s, mean, jnp.sqrt(ss / jnp.maximum(n - ddof, 1))


def _masked_std(x, mask, ddof, axis=None, keepdims=False):
    s, _, std = _scaled_moments(x, mask, ddof, axis=axis)
    out = s * std
    if keepdims:
        return out
    return jnp.squeeze(out, axis) if axis is not None else out.reshape(())


def _zero_var_groups(r, valid):
    """[P, 1] bool: the valid rewards of the row are all equal (incl. 0 or 1 valid samples)."""
    hi = jnp.max(jnp.where(valid, r, -jnp.inf), axis=1, keepdims=True)
    lo = jnp.min(jnp.where(valid, r, jnp.inf), axis=1, keepdims=True)
    return ~(hi > lo)


def _check_ddof_eps(name, ddof, eps):
    if ddof not in (0, 1):
        raise ValueError(f"{name}: ddof must be 0 (population std) or 1 (sample std), got {ddof}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")


def _check_choice(name, key, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: {key} must be one of {choices}, got {value!r}")


def _metrics(adv, keep, valid, r, zero_var, nonfinite, **extra):
    has_valid = jnp.any(valid, axis=1, keepdims=True)
    n_groups = jnp.sum(has_valid)
    n_keep = jnp.sum(keep)
    m = {
        "adv_mean": _masked_mean(adv, keep),
        "adv_std": _masked_std(adv, keep, ddof=0),
        "adv_min": jnp.where(n_keep > 0, jnp.min(jnp.where(keep, adv, jnp.inf)), 0.0),
        "adv_max": jnp.where(n_keep > 0, jnp.max(jnp.where(keep, adv, -jnp.inf)), 0.0),
        "zero_var_frac": jnp.sum(zero_var & has_valid) / jnp.maximum(n_groups, 1),
        "num_valid": jnp.sum(valid),
        "num_kept": n_keep,
        "nonfinite": nonfinite,
        "reward_mean": _masked_mean(r, valid),
    }
    m.update(extra)
    return {k: jnp.asarray(v, jnp.float32) for k, v in m.items()}


def _centered(r, valid, scale, eps, ddof):
    """Shared GRPO core: (r - group mean) / F with F per ``scale``; zero-variance groups -> 0.

    Computed on the rewards divided by their largest magnitude (the group's, or the batch's
    for ``scale='batch'``): ``(r - mean) / (std + eps) = (y - mean_y) / (std_y + eps / s)``
    with ``y = r / s``, the same number for rewards of any finite size (no ``(r - mean)**2``
    overflowing to inf and zeroing every advantage); ``'none'`` returns ``s * (y - mean_y)``.
    """
    zero_var = _zero_var_groups(r, valid)
    axis = None if scale == "batch" else 1
    s, mean_y, std_y = _scaled_moments(r, valid, ddof, axis=axis)
    if scale == "batch":  # the group mean is still subtracted, on the batch's scale
        group = jnp.sum(valid, axis=1, keepdims=True)
        mean_y = jnp.sum(jnp.where(valid, _over(r, s), 0.0), axis=1, keepdims=True)
        mean_y = mean_y / jnp.maximum(group, 1)
    centered_y = jnp.where(valid, _over(r, s) - mean_y, 0.0)
    if scale == "none":
        adv = centered_y * s
    else:
        denom = std_y + _over(jnp.float32(eps), s)
        adv = centered_y / jnp.where(denom > 0, denom, 1.0)
    adv = jnp.where(valid & ~zero_var, adv, 0.0)
    return adv, zero_var


# --------------------------------------------------------------------------------------------
# GRPO / DAPO / Dr.GRPO
# --------------------------------------------------------------------------------------------


@ADVANTAGES.register("grpo")
def grpo(
    rewards_PxG,
    valid_PxG,
    *,
    scores_PxG=None,
    is_anchor_PxG=None,
    scale: str = "group",
    eps: float = 1e-6,
    ddof: int = 0,
) -> AdvantageOutput:
    """GRPO (DeepSeekMath; A-GRAE eq. (3)): ``A_i = (r_i - mean_g(r)) / (F + eps)``.

    ``scale``: ``'group'`` F = std of the group's rewards (GRPO); ``'batch'`` F = std of all valid
    rewards in the global batch (the group mean is still subtracted; TRL ``scale_rewards='batch'``,
    "Lite PPO"); ``'none'`` F = 1 (Dr.GRPO).

    Which std: ``ddof=0`` POPULATION std (default), because that is GRAE as the A-GRAE paper
    defines it (eq. (17)) and the one under which its Theorem 2 and eq. (5) hold exactly (the
    tests pin them); DeepSeekMath just says "std". ``ddof=1`` gives the SAMPLE std that TRL and
    verl use (``torch.std``); for a binary group the two differ by sqrt(n / (n - 1)).
    Scores and anchor flags are unused (anchors are group members). ``eps`` guards the
    division; zero-variance groups get exactly 0.
    """
    name = "grpo"
    _check_choice(name, "scale", scale, ("group", "batch", "none"))
    _check_ddof_eps(name, ddof, eps)
    r, valid, nonfinite = _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG)
    adv, zero_var = _centered(r, valid, scale, eps, ddof)
    return AdvantageOutput(adv, valid, _metrics(adv, valid, valid, r, zero_var, nonfinite))


@ADVANTAGES.register("dapo")
def dapo(rewards_PxG, valid_PxG, *, scores_PxG=None, is_anchor_PxG=None, eps=1e-6, ddof=0):
    """DAPO advantages = GRPO group-normalised advantages. The rest of DAPO (clip-higher,
    token-mean aggregation, dynamic sampling, overlong shaping) lives in the loss and the loop."""
    return grpo(
        rewards_PxG,
        valid_PxG,
        scores_PxG=scores_PxG,
        is_anchor_PxG=is_anchor_PxG,
        scale="group",
        eps=eps,
        ddof=ddof,
    )


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards_PxG, valid_PxG, *, scores_PxG=None, is_anchor_PxG=None) -> AdvantageOutput:
    """Dr.GRPO (Liu et al. 2025): ``A_i = r_i - mean_g(r)`` (no std normalisation)."""
    return grpo(
        rewards_PxG, valid_PxG, scores_PxG=scores_PxG, is_anchor_PxG=is_anchor_PxG, scale="none"
    )


# --------------------------------------------------------------------------------------------
# GPG
# --------------------------------------------------------------------------------------------


@ADVANTAGES.register("gpg")
def gpg(
    rewards_PxG,
    valid_PxG,
    *,
    scores_PxG=None,
    is_anchor_PxG=None,
    norm: str = "none",
    fold_alpha: bool = True,
    eps: float = 1e-6,
    ddof: int = 0,
) -> AdvantageOutput:
    """GPG (Chu et al.), Sec. 2.2: ``A_i = alpha * (r_i - mean_g(r)) / F_norm``.

    GPG eq. (6): ``F_norm`` is ``norm='none'`` (F_norm = 1, the paper's main setting),
    ``'group'`` (group std, GRPO's) or ``'batch'`` (std over the global batch; Table 13).

    GPG eqs. (7)-(8), Appendix A: ``alpha = B / (B - M)`` with ``B`` the number of valid samples
    in the GLOBAL batch and ``M`` the number of valid samples in zero-variance groups (all rewards
    equal, so they carry no gradient). Computed with plain reductions over the whole array, it is
    global across devices under ``jit``/GSPMD (not per device). When every group is zero-variance
    (``B == M``) all advantages are 0 and alpha is reported as 1.

    ``fold_alpha=True`` (default) multiplies the advantages by alpha, so ``-logp * A`` with any
    aggregation is GPG's ``alpha * J_GPG`` (eq. (8)) with no loss-side change; with
    ``fold_alpha=False`` the advantages are unscaled: GPG without the correction (Table 1's
    ``alpha = 1`` rows; nothing downstream applies ``metrics['alpha']``).
    Either way ``metrics['alpha']`` and ``metrics['gpg_valid_fraction'] = (B - M) / B`` (= 1/alpha,
    compare with beta_th for GPG's resampling threshold, which belongs to the loop) are returned.
    """
    name = "gpg"
    _check_choice(name, "norm", norm, ("none", "group", "batch"))
    _check_ddof_eps(name, ddof, eps)
    r, valid, nonfinite = _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG)
    adv, zero_var = _centered(r, valid, norm, eps, ddof)
    b = jnp.sum(valid).astype(jnp.float32)
    m = jnp.sum(valid & zero_var).astype(jnp.float32)
    alpha = jnp.where(b - m > 0, b / jnp.maximum(b - m, 1.0), 1.0)
    if fold_alpha:
        adv = adv * alpha
    return AdvantageOutput(
        adv,
        valid,
        _metrics(
            adv,
            valid,
            valid,
            r,
            zero_var,
            nonfinite,
            alpha=alpha,
            gpg_valid_fraction=(b - m) / jnp.maximum(b, 1.0),
        ),
    )


# --------------------------------------------------------------------------------------------
# A-GRAE
# --------------------------------------------------------------------------------------------

_AGRAE_BASES = {"grpo": "group", "dapo": "group", "dr_grpo": "none"}


@ADVANTAGES.register("a_grae")
def a_grae(
    rewards_PxG,
    valid_PxG,
    *,
    scores_PxG=None,
    is_anchor_PxG=None,
    base: str = "grpo",
    sample_level: str = "ddas",
    group_level: str = "ass",
    alpha: float = 1.0,
    beta: float = 10.0,
    gamma: float = 0.5,
    eps: float = 1e-6,
    ddof: int = 0,
) -> AdvantageOutput:
    """Asymmetric GRAE (A-GRAE, Sec. 5.1) on top of a base estimator.

    Base advantages ``A_i``: ``base='grpo'``/``'dapo'`` -> (r - mean)/(std + eps) (eq. (3)),
    ``'dr_grpo'`` -> r - mean. Rewards are assumed in [0, 1] (binary in the paper).

    omega_s (eq. (11)) = mean reward over all valid samples of the global batch (clipped to
    [0, 1] where used as a weight; the raw value is ``metrics['reward_mean']``). p = group success
    rate = mean valid reward of the group (= sum |r_i| / |G| for binary rewards), clipped to
    [0, 1]. As the paper prescribes, no rescaling happens at p in {0, 1}.

    Sample level, ``sample_level``:
      * ``'ddas'`` eq. (12): ``A <- (omega/2) A / sqrt(p) + ((1 - omega)/2) A / sqrt(1 - p)``
      * ``'hard'`` Table 1(b) hard-focused: ``A <- gamma A / sqrt(p)``   (sum |A| = G sqrt(1-p))
      * ``'easy'`` Table 1(b) easy-focused: ``A <- gamma A / sqrt(1 - p)`` (sum |A| = G sqrt(p))
      * ``'none'``
    Group level (applied after the sample level), ``group_level``:
      * ``'ass'`` eq. (13): ``A <- A * min(1, omega_s / alpha)`` for A > 0, with 0 < alpha <= 1
      * ``'positive_dominant'`` Table 1(a): ``A_pos <- beta A_pos``
      * ``'negative_dominant'`` Table 1(a): ``A_pos <- A_pos / beta``
      * ``'none'``
    The paper's ablations (Table 5) are ``group_level='none'`` (sample level only),
    ``sample_level='none'`` (group level only) and the defaults (full). Paper settings: alpha = 1
    for math, 0.5 for multimodal (App. C.2); beta = 10, gamma = 0.5 (Sec. 4.1).
    """
    name = "a_grae"
    _check_choice(name, "base", base, tuple(_AGRAE_BASES))
    _check_choice(name, "sample_level", sample_level, ("ddas", "hard", "easy", "none"))
    _check_choice(
        name, "group_level", group_level, ("ass", "positive_dominant", "negative_dominant", "none")
    )
    _check_ddof_eps(name, ddof, eps)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"{name}: ASS alpha must satisfy 0 < alpha <= 1 (eq. (13)), got {alpha}")
    if not beta > 0.0:
        raise ValueError(f"{name}: beta must be > 0, got {beta}")
    if not gamma > 0.0:
        raise ValueError(f"{name}: gamma must be > 0, got {gamma}")
    r, valid, nonfinite = _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG)
    adv, zero_var = _centered(r, valid, _AGRAE_BASES[base], eps, ddof)

    omega_raw = _masked_mean(r, valid)  # A-GRAE eq. (11)
    omega = jnp.clip(omega_raw, 0.0, 1.0)
    p = jnp.clip(_masked_mean(r, valid, axis=1, keepdims=True), 0.0, 1.0)
    interior = (p > 0.0) & (p < 1.0)
    p_safe = jnp.where(interior, p, 0.5)
    if sample_level == "ddas":  # A-GRAE eq. (12)
        factor = (omega / 2) / jnp.sqrt(p_safe) + ((1 - omega) / 2) / jnp.sqrt(1 - p_safe)
    elif sample_level == "hard":
        factor = gamma / jnp.sqrt(p_safe)
    elif sample_level == "easy":
        factor = gamma / jnp.sqrt(1 - p_safe)
    else:
        factor = jnp.ones_like(p_safe)
    adv = adv * jnp.where(interior, factor, 1.0)

    pos = adv > 0
    if group_level == "ass":  # A-GRAE eq. (13)
        adv = jnp.where(pos, adv * jnp.minimum(1.0, omega / alpha), adv)
    elif group_level == "positive_dominant":
        adv = jnp.where(pos, adv * beta, adv)
    elif group_level == "negative_dominant":
        adv = jnp.where(pos, adv / beta, adv)
    extra = {  # omega_s unclipped is metrics["reward_mean"], the same masked mean
        "rewards_outside_01": jnp.sum(valid & ((r < 0.0) | (r > 1.0))),
    }
    if group_level == "ass":
        extra["ass_scale"] = jnp.minimum(1.0, omega / alpha)
    return AdvantageOutput(adv, valid, _metrics(adv, valid, valid, r, zero_var, nonfinite, **extra))


# --------------------------------------------------------------------------------------------
# DaGRPO
# --------------------------------------------------------------------------------------------


@ADVANTAGES.register("dagrpo")
def dagrpo(
    rewards_PxG,
    valid_PxG,
    *,
    scores_PxG=None,
    is_anchor_PxG=None,
    delta: float = 3.0,
    scale: str = "group",
    eps: float = 1e-6,
    ddof: int = 0,
) -> AdvantageOutput:
    """DaGRPO (Sec. 5): mixed-group advantages with distinctiveness-aware masks.

    Each row is the mixed group G_mix = G_on U G_off (eq. (11)); ``is_anchor_PxG`` marks the
    off-policy anchors (only used for metrics: anchors and on-policy samples are treated alike,
    as eq. (13) prescribes). Advantages over the mixed group, eq. (12): ``scale='group'`` divides
    by the mixed-group std (eq. (12)); ``scale='none'`` is the Dr.GRPO setting of the paper's
    experiments (Sec. 6: no std, delta = 3, binary reward).

    With G+ = {A > 0}, G- = {A < 0} over the valid samples of the group and judge scores S in
    [1, 10] (eq. (7)), S_max- = max_{G-} S, S_min+ = min_{G+} S:
      lambda+(j) = 1[S_j - S_max- >= delta]  (eq. (8)),  lambda-(k) = 1[S_min+ - S_k >= delta]
      (eq. (9)). The gap comparison allows a 1e-5 float slack so a gap of exactly delta passes.
    Masked samples get A = 0 and ``keep = False`` (eq. (13)). Samples with A = 0 are in neither
    set and are kept (they contribute nothing). Eq. (13) keeps the 1/|G_mix| normaliser, i.e.
    masked samples still count in the denominator: the aggregation should count ``valid_PxG``
    (not ``keep_PxG``) in sequence denominators to match it.

    Groups without positives or without negatives: with mean-centred advantages G+ is empty iff
    G- is empty iff the group is zero-variance, in which case every A is already 0 and nothing
    is masked (an empty set gives S_max- = -inf / S_min+ = +inf, so the other mask is all ones).

    Samples whose score is NaN/inf are invalid (dropped from the mixed group; counted in
    ``nonfinite``). ``delta >= 0`` is required. metrics: ``masked_fraction`` (masked / valid),
    ``anchor_fraction``, ``anchor_masked_fraction`` (masked anchors / valid anchors).
    """
    name = "dagrpo"
    _check_choice(name, "scale", scale, ("group", "none"))
    _check_ddof_eps(name, ddof, eps)
    if not (delta >= 0.0 and delta < float("inf")):
        raise ValueError(f"{name}: delta must be a finite number >= 0, got {delta}")
    if scores_PxG is None:
        raise ValueError(f"{name}: needs judge scores_PxG (DaGRPO eq. (7)); got None")
    scores_PxG = jnp.asarray(scores_PxG)
    if not jnp.issubdtype(scores_PxG.dtype, jnp.floating):
        raise TypeError(f"{name}: scores_PxG must be floating, got {scores_PxG.dtype}")
    r, valid, nonfinite = _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG)
    s = scores_PxG.astype(jnp.float32)
    bad_score = valid & ~jnp.isfinite(s)
    nonfinite = nonfinite + jnp.sum(bad_score)
    valid = valid & ~bad_score
    r = jnp.where(valid, r, 0.0)
    s = jnp.where(valid, s, 0.0)

    adv, zero_var = _centered(r, valid, scale, eps, ddof)  # DaGRPO eq. (12)
    pos = valid & (adv > 0)
    neg = valid & (adv < 0)
    s_max_neg = jnp.max(jnp.where(neg, s, -jnp.inf), axis=1, keepdims=True)
    s_min_pos = jnp.min(jnp.where(pos, s, jnp.inf), axis=1, keepdims=True)
    lam_pos = (s - s_max_neg) >= delta - _GAP_ATOL  # eq. (8)
    lam_neg = (s_min_pos - s) >= delta - _GAP_ATOL  # eq. (9)
    keep = valid & jnp.where(pos, lam_pos, jnp.where(neg, lam_neg, True))
    adv = jnp.where(keep, adv, 0.0)  # eq. (13)

    n_valid = jnp.sum(valid)
    masked = valid & ~keep
    if is_anchor_PxG is None:
        anchor = jnp.zeros_like(valid)
    else:
        anchor = jnp.asarray(is_anchor_PxG).astype(bool) & valid
    n_anchor = jnp.sum(anchor)
    return AdvantageOutput(
        adv,
        keep,
        _metrics(
            adv,
            keep,
            valid,
            r,
            zero_var,
            nonfinite,
            masked_fraction=jnp.sum(masked) / jnp.maximum(n_valid, 1),
            anchor_fraction=n_anchor / jnp.maximum(n_valid, 1),
            anchor_masked_fraction=jnp.sum(masked & anchor) / jnp.maximum(n_anchor, 1),
        ),
    )


# --------------------------------------------------------------------------------------------
# Pass@k training
# --------------------------------------------------------------------------------------------


def _binom_ratio(top, bottom, m, k_max):
    """C(top, m) / C(bottom, m) = prod_{j < m} (top - j) / (bottom - j), elementwise; 0 when
    top < m. ``m <= k_max`` (a Python int: the product runs over j < k_max, masked)."""
    j = jnp.arange(k_max, dtype=jnp.float32)
    f = jnp.clip(top[..., None] - j, 0.0, None) / jnp.maximum(bottom[..., None] - j, 1.0)
    return jnp.prod(jnp.where(j < m[..., None], f, 1.0), axis=-1)


@ADVANTAGES.register("pass_at_k")
def pass_at_k(
    rewards_PxG, valid_PxG, *, scores_PxG=None, is_anchor_PxG=None, k: int = 4
) -> AdvantageOutput:
    """Pass@k training advantages, the analytic form of Chen et al. 2025 ("Pass@k Training for
    Adaptively Balancing Exploration and Exploitation", arXiv 2508.10751, Sec. 3's analytical
    derivation), for binary rewards.

    The group's n valid samples (n_neg incorrect) form C(n, k) subgroups of k; a subgroup's
    reward is 1 iff it holds a correct sample (its pass@k), normalised over the subgroups as
    GRPO does, and a sample's advantage is the mean over the subgroups that contain it:

        R = 1 - C(n_neg, k) / C(n, k)            (the group's unbiased pass@k, A-GRAE eq. (37))
        sigma = sqrt(R (1 - R))
        A_pos = (1 - R) / sigma
        A_neg = (1 - R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / sigma

    k = 1 is GRPO with the population std and eps = 0. Groups with no correct sample, or with
    fewer than k incorrect ones (every subgroup passes), get 0. A group with n < k valid
    samples uses k = n. ``k >= G`` is refused: the one subgroup is the whole group and every
    advantage is 0 by construction. Chosen over verl's GRPO_PASSK (best sample gets r_max - r_second,
    the rest 0), which for binary rewards is 0 whenever two samples are correct and only
    targets k = G. A sample is correct iff its reward >= 0.5; ``metrics['rewards_not_binary']``
    counts valid rewards outside {0, 1}; ``metrics['pass_at_k']`` is the mean R over groups;
    ``zero_var_frac`` counts the groups whose advantages are all 0 (sigma = 0).
    """
    name = "pass_at_k"
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"{name}: k must be an int >= 1, got {k!r}")
    r, valid, nonfinite = _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG)
    if k >= r.shape[1]:
        raise ValueError(
            f"{name}: k = {k} must be below the group size G = {r.shape[1]}: with k >= G the "
            "only subgroup is the whole group, whose pass@k has no spread to normalise, so "
            "every advantage would be 0 (nothing trains); use k <= G - 1 (or raise G)"
        )
    correct = valid & (r >= 0.5)
    n = jnp.sum(valid, axis=1).astype(jnp.float32)
    n_neg = n - jnp.sum(correct, axis=1).astype(jnp.float32)
    m = jnp.minimum(jnp.float32(k), n)
    group_pass = 1.0 - _binom_ratio(n_neg, n, m, k)
    neg_pass = 1.0 - _binom_ratio(n_neg - 1.0, n - 1.0, m - 1.0, k)
    var = group_pass * (1.0 - group_pass)
    informative = var > 0
    sigma = jnp.sqrt(jnp.where(informative, var, 1.0))
    a_pos = (1.0 - group_pass) / sigma
    a_neg = (neg_pass - group_pass) / sigma
    adv = jnp.where(
        valid & informative[:, None], jnp.where(correct, a_pos[:, None], a_neg[:, None]), 0.0
    )
    has = n > 0
    extra = {
        "pass_at_k": jnp.sum(jnp.where(has, group_pass, 0.0)) / jnp.maximum(jnp.sum(has), 1),
        "rewards_not_binary": jnp.sum(valid & (r != 0.0) & (r != 1.0)),
    }
    zero_var = ~informative[:, None]
    return AdvantageOutput(adv, valid, _metrics(adv, valid, valid, r, zero_var, nonfinite, **extra))


# --------------------------------------------------------------------------------------------
# Extras: RLOO, batch-normalised
# --------------------------------------------------------------------------------------------


@ADVANTAGES.register("rloo")
def rloo(rewards_PxG, valid_PxG, *, scores_PxG=None, is_anchor_PxG=None) -> AdvantageOutput:
    """RLOO (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g(r))``
    with n the number of valid samples of the group (groups with n < 2 get 0)."""
    name = "rloo"
    r, valid, nonfinite = _check_inputs(name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG)
    adv, zero_var = _centered(r, valid, "none", 0.0, 0)
    n = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.float32)
    adv = adv * jnp.where(n > 1, n / jnp.maximum(n - 1, 1), 0.0)
    return AdvantageOutput(adv, valid, _metrics(adv, valid, valid, r, zero_var, nonfinite))


@ADVANTAGES.register("batch_norm")
def batch_norm(
    rewards_PxG,
    valid_PxG,
    *,
    scores_PxG=None,
    is_anchor_PxG=None,
    baseline: str = "group",
    eps: float = 1e-6,
    ddof: int = 0,
) -> AdvantageOutput:
    """Batch-normalised advantages (REINFORCE++ style), global over the batch.

    ``baseline='group'`` (REINFORCE++-baseline): ``A' = r - mean_g(r)`` (zero-variance groups
    -> 0), then ``A = (A' - mean_B(A')) / (std_B(A') + eps)`` over all valid samples.
    ``baseline='none'``: ``A = (r - mean_B(r)) / (std_B(r) + eps)`` (allows G = 1).
    """
    name = "batch_norm"
    _check_choice(name, "baseline", baseline, ("group", "none"))
    _check_ddof_eps(name, ddof, eps)
    min_g = 2 if baseline == "group" else 1
    r, valid, nonfinite = _check_inputs(
        name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG, min_g=min_g
    )
    zero_var = _zero_var_groups(r, valid)
    if baseline == "group":
        x, _ = _centered(r, valid, "none", 0.0, 0)
    else:
        x = r
    mean = _masked_mean(x, valid)
    std = _masked_std(x, valid, ddof)
    denom = std + eps
    adv = jnp.where(valid & (std > 0), _over(x - mean, jnp.where(denom > 0, denom, 1.0)), 0.0)
    return AdvantageOutput(adv, valid, _metrics(adv, valid, valid, r, zero_var, nonfinite))


@ADVANTAGES.register("w_reinforce")
def w_reinforce(
    rewards_PxG,
    valid_PxG,
    *,
    scores_PxG=None,
    is_anchor_PxG=None,
    positive_weight: float = 0.1,
    threshold: float = 0.5,
) -> AdvantageOutput:
    """W-REINFORCE (Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement"):
    no baseline; ``A = lambda`` for a correct sample (``r >= threshold``), ``A = -1`` otherwise,
    with ``lambda = positive_weight`` (0.1 in the paper) down-weighting positive reinforcement.
    Use with the plain policy-gradient loss (preset ``w_reinforce``). Allows G = 1.
    """
    name = "w_reinforce"
    if not positive_weight >= 0.0:
        raise ValueError(f"{name}: positive_weight must be >= 0, got {positive_weight}")
    r, valid, nonfinite = _check_inputs(
        name, rewards_PxG, valid_PxG, scores_PxG, is_anchor_PxG, min_g=1
    )
    adv = jnp.where(valid, jnp.where(r >= threshold, positive_weight, -1.0), 0.0)
    zero_var = _zero_var_groups(r, valid)
    return AdvantageOutput(adv, valid, _metrics(adv, valid, valid, r, zero_var, nonfinite))


def compute_advantages(
    name: str, rewards_PxG, valid_PxG, *, scores_PxG=None, is_anchor_PxG=None, **hparams
) -> AdvantageOutput:
    """``ADVANTAGES.get(name)(...)``: look up an estimator by name and run it."""
    return ADVANTAGES.get(name)(
        rewards_PxG, valid_PxG, scores_PxG=scores_PxG, is_anchor_PxG=is_anchor_PxG, **hparams
    )
