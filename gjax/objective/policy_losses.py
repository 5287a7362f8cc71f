"""Per-token policy losses and KL estimators (elementwise; usable inside the fused kernel).

Every function here maps per-token arrays of one common shape (``[N]`` inside the kernel,
``[B, T]`` elsewhere) to a per-token loss of the same shape plus a dict of per-token
diagnostics. Nothing is reduced: aggregation (``gjax.objective.aggregation``) supplies the
per-token weights with global denominators, and ``gjax.objective.loss`` multiplies and
sums. Losses are to be *minimised* (the negative of the papers' objectives J).

Notation: ``logp`` = log pi_theta(o_t | q, o_<t) (differentiated), ``old_logp`` = log
pi_old (the policy that sampled, or for off-policy anchors the trainer's teacher-forced
recomputation at the start of the update), ``adv`` = the (token-weighted) advantage,
r = exp(logp - old_logp) the importance ratio.

Registries:
  POLICY_LOSSES: ``ppo_clip``, ``ratio``, ``cispo``, ``pg``, ``gspo``, ``luffy``.
  KL_ESTIMATORS: ``k1``, ``k2``, ``k3`` (Schulman's estimators of KL(pi_theta || pi_ref)).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gjax.registry import Registry

Array = jax.Array
LossOut = tuple[Array, dict[str, Array]]

POLICY_LOSSES: Registry[Callable[..., LossOut]] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[[Array, Array], Array]] = Registry("KL estimator")

# Log-ratios are clamped before exp so that a stale or corrupted old log-prob can never turn
# the ratio into inf (and the loss into NaN). At |log r| = 20 every clipped loss is already on
# its flat branch, so the clamp changes nothing that trains.
MAX_LOG_RATIO = 20.0


def _ratio(logp: Array, old_logp: Array) -> tuple[Array, Array]:
    log_ratio = jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.exp(log_ratio), log_ratio


def _check_eps(
    eps_low: float, eps_high: float, dual_clip: float | None = None, *, no_lower: bool = False
) -> None:
    """``no_lower``: eps_low = 1 is allowed and means no lower bound (CISPO's IS weight)."""
    if not (0.0 <= eps_low < 1.0 or (no_lower and eps_low == 1.0)):
        interval = "[0, 1] (1: no lower bound)" if no_lower else "[0, 1)"
        raise ValueError(f"eps_low must be in {interval}, got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip c must be > 1 (Ye et al. 2020 use c = 3), got {dual_clip}")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp: Array,
    old_logp: Array,
    adv: Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> LossOut:
    """PPO clipped surrogate with DAPO clip-higher and optional dual-clip.

    loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)          (PPO; DAPO eq. (10))
    dual-clip (A < 0 only): loss_t = min(loss_t, -c A) = min(loss_t, c |A|)  (Ye et al. 2020)

    The flat (zero-gradient) branches are reported per token as 0/1 diagnostics:
    ``clip_low`` (A < 0 and r < 1 - eps_low), ``clip_high`` (A > 0 and r > 1 + eps_high),
    ``clip_dual`` (A < 0 and r > c). ``ratio`` is r itself.
    """
    _check_eps(eps_low, eps_high, dual_clip)
    ratio, _ = _ratio(logp, old_logp)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(-ratio * adv, -clipped * adv)
    neg = adv < 0
    clip_low = neg & (ratio < 1.0 - eps_low)
    clip_high = (adv > 0) & (ratio > 1.0 + eps_high)
    if dual_clip is not None:
        cap = -dual_clip * adv
        clip_dual = neg & (loss > cap)
        loss = jnp.where(neg, jnp.minimum(loss, cap), loss)
    else:
        clip_dual = jnp.zeros_like(clip_low)
    aux = {
        "clip_low": clip_low.astype(logp.dtype),
        "clip_high": clip_high.astype(logp.dtype),
        "clip_dual": clip_dual.astype(logp.dtype),
        "ratio": ratio,
    }
    return loss, aux


@POLICY_LOSSES.register("ratio")
def ratio_pg(logp: Array, old_logp: Array, adv: Array) -> LossOut:
    """Unclipped importance-weighted surrogate: loss_t = -r A, gradient -r A grad log pi.

    The surrogate of Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs",
    Sec. 4): KL-Cov adds its penalty to it instead of PPO's clip (verl's ``kl_cov`` loss too).
    """
    ratio, _ = _ratio(logp, old_logp)
    zeros = jnp.zeros_like(logp)
    aux = {"clip_low": zeros, "clip_high": zeros, "clip_dual": zeros, "ratio": ratio}
    return -ratio * adv, aux


@POLICY_LOSSES.register("cispo")
def cispo(
    logp: Array,
    old_logp: Array,
    adv: Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> LossOut:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. (4)-(5)): clip the IS weight, not the update.

    J = E[ 1/sum_i |o_i| sum_i sum_t sg(r^_{i,t}) A_{i,t} log pi_theta(o_{i,t}) ]     (4)
    r^_{i,t} = clip(r_{i,t}, 1 - eps_low^IS, 1 + eps_high^IS)                     (5)

    so loss_t = -sg(r^) A log pi and d loss_t / d logp = -r^ A: every token keeps a gradient
    (PPO's clip zeroes it), with the weight r^ bounded. The 1/sum|o_i| is the token_mean
    aggregation. eps_low = 1 (the default) puts no lower bound on the weight, as the paper does
    ("setting eps_low^IS to a large value"). ``clip_low`` / ``clip_high`` flag tokens whose
    weight was clipped (either sign of A).
    """
    _check_eps(eps_low, eps_high, no_lower=True)
    ratio, _ = _ratio(logp, old_logp)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    aux = {
        "clip_low": (ratio < 1.0 - eps_low).astype(logp.dtype),
        "clip_high": (ratio > 1.0 + eps_high).astype(logp.dtype),
        "clip_dual": jnp.zeros_like(logp),
        "ratio": ratio,
    }
    return -weight * adv * logp, aux


def abs_log_ratio(logp: Array, old_logp: Array) -> Array:
    """|logp - old_logp| with gradient sign(logp - old_logp), which is 0 on-policy.

    KL-Cov's penalty (Cui et al. 2025). ``jnp.abs`` takes the subgradient +1 at 0, which would
    push selected tokens down by the KL coefficient exactly on-policy; the paper's penalty (and
    verl's torch ``abs``) gives no gradient there.
    """
    x = logp - old_logp
    return x * jnp.sign(jax.lax.stop_gradient(x))


@POLICY_LOSSES.register("pg")
def pg(logp: Array, old_logp: Array, adv: Array) -> LossOut:
    """Plain policy gradient of GPG: loss_t = -log pi_theta(o_t) * A.   (GPG eq. (5))

    No ratio, no clipping, no KL: the gradient is exactly the REINFORCE estimator
    -A grad log pi. ``old_logp`` is unused (kept for a uniform signature); the ratio is
    still reported as a diagnostic of how far the policy moved.
    """
    ratio, _ = _ratio(logp, old_logp)
    zeros = jnp.zeros_like(logp)
    aux = {"clip_low": zeros, "clip_high": zeros, "clip_dual": zeros, "ratio": ratio}
    return -logp * adv, aux


@POLICY_LOSSES.register("gspo")
def gspo(
    logp: Array,
    old_logp: Array,
    adv: Array,
    *,
    seq_log_ratio: Array,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> LossOut:
    """GSPO sequence-level clipped surrogate, written per token.   (GSPO, Zheng et al. 2025)

    GSPO: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t (logp_t - old_logp_t)),
          L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i).

    ``seq_log_ratio`` is log s_i broadcast to every token of sequence i, computed by a
    forward-only pass (a constant here). The per-token surrogate

        loss_t = L_i + dL_i/dlog s_i * (logp_t - stop_gradient(logp_t))

    has value L_i and d loss_t / d logp_t = dL_i/dlog s_i, with dL_i/dlog s_i = -A_i s_i
    on the unclipped branch and 0 on the clipped one. Since d log s_i / d logp_t = 1/|y_i|,
    for any per-token weight w_t that is constant within a sequence (every aggregation mode)
    sum_t w_t loss_t has exactly the value and gradient of sum_i (sum_t w_t) L_i(s_i):
    GSPO's objective under that aggregation (seq-mean-token-mean gives the paper's 1/G mean).
    """
    _check_eps(eps_low, eps_high)
    log_s = jnp.clip(seq_log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    s = jnp.exp(log_s)
    s_clip = jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high)
    unclipped_val = -s * adv
    seq_loss = jnp.maximum(unclipped_val, -s_clip * adv)
    # Which branch max() takes: the unclipped one unless the clipped one is strictly larger.
    on_unclipped = unclipped_val >= -s_clip * adv
    dloss_dlog_s = jnp.where(on_unclipped, -adv * s, 0.0)
    loss = seq_loss + dloss_dlog_s * (logp - jax.lax.stop_gradient(logp))
    aux = {
        "clip_low": ((adv < 0) & (s < 1.0 - eps_low)).astype(logp.dtype),
        "clip_high": ((adv > 0) & (s > 1.0 + eps_high)).astype(logp.dtype),
        "clip_dual": jnp.zeros_like(logp),
        "ratio": s,
    }
    return loss, aux


@POLICY_LOSSES.register("luffy")
def luffy(logp: Array, old_logp: Array, adv: Array, *, gamma: float = 0.1) -> LossOut:
    """LUFFY policy shaping for off-policy tokens: loss_t = -f(pi_theta(o_t)) * A,
    f(pi) = pi / (pi + gamma), with no clipping.   (LUFFY, Yan et al. 2025, Sec. 3)

    LUFFY replaces the (unknown) behaviour-policy ratio by f(pi), whose gradient
    f'(pi) grad pi = gamma pi / (pi + gamma)^2 * grad log pi keeps learning signal on
    low-probability expert tokens instead of letting them be ignored. ``old_logp`` is
    unused (the ratio vs it is reported as a diagnostic).
    """
    if not gamma > 0:
        raise ValueError(f"LUFFY shaping gamma must be > 0, got {gamma}")
    pi = jnp.exp(logp)
    ratio, _ = _ratio(logp, old_logp)
    zeros = jnp.zeros_like(logp)
    aux = {"clip_low": zeros, "clip_high": zeros, "clip_dual": zeros, "ratio": ratio}
    return -(pi / (pi + gamma)) * adv, aux


# ----------------------------------------------------------------------------------------
# KL(pi_theta || pi_ref) per-token estimators (Schulman 2020, "Approximating KL divergence").
# With log rho = ref_logp - logp (tokens sampled from pi_theta):
#   k1 = -log rho                 unbiased, can be negative
#   k2 = (log rho)^2 / 2          biased, low variance, >= 0
#   k3 = rho - 1 - log rho        unbiased, >= 0; GRPO's choice (DeepSeekMath eq. (4);
#                                 A-GRAE eq. (2))
# The log-ratio is clamped to +-MAX_LOG_RATIO before exp (k3) for the same reason as above.
# ----------------------------------------------------------------------------------------


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Array, ref_logp: Array) -> Array:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Array, ref_logp: Array) -> Array:
    return 0.5 * jnp.square(ref_logp - logp)


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Array, ref_logp: Array) -> Array:
    log_rho = jnp.clip(ref_logp - logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.exp(log_rho) - 1.0 - log_rho


def approx_kl_old(logp: Array, old_logp: Array) -> Array:
    """k3 estimate of KL(pi_old || pi_theta) per token, the usual "approx_kl" diagnostic."""
    return kl_k3(old_logp, logp)
