"""Behaviour-policy correction: the sampler that drew a batch is not the trainer's policy.

Two gaps separate the policy mu that sampled a completion (the rollout engine) from the policy
pi_old the PPO ratio is taken against (the trainer's params at the start of the update):
staleness (with `rollout.max_staleness = k > 0` a batch may come from params up to k
updates old) and numerics (a serving engine in another dtype or kernel). With the trainer's
own recomputed log-probs ``old_logps_BxT`` (log pi_old) and the sampler's
``behaviour_logps_BxT`` (log mu), per token

    log rho_{i,t} = log pi_old(y_{i,t} | x_i, y_{i,<t}) - log mu(y_{i,t} | x_i, y_{i,<t}),

or, at sequence level, the whole completion's likelihood ratio broadcast over its tokens

    log rho_i = sum_t log rho_{i,t}.

The policy-gradient term is E_mu[...] of what should be E_{pi_old}[...], so each token's
policy-gradient term (only that: not the KL-to-reference, KL-Cov or entropy terms) is
multiplied by a stop-gradient coefficient c (Ionides 2008 truncated importance sampling; Yao
et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training", use it
token-level with C = 2 for the vLLM/FSDP mismatch):

    'tis'  : c = min(rho, C)                  (truncated importance sampling; bias <= C-capped)
    'mask' : c = 1[1/C <= rho <= C]           (rejection: drop tokens/sequences far off-policy)
    'none' : c = 1                            (only the mismatch metrics below are reported)

Masked or down-weighted tokens keep counting in the aggregation denominators (the same rule
as DaGRPO's masked samples, `gjax.objective.loss`), so the correction never rescales the
rest of the batch. Both choices follow TRL (the IS ratio multiplies the clipped term before
``beta * kl`` is added; the normaliser is the completion mask) and verl's rollout IS
weights (they multiply the policy-gradient losses); `gjax.objective.loss` says why.
Log-ratios are clamped to +-MAX_LOG_RATIO before exp, as the PPO ratio is.

Metrics, over the loss tokens (``mask_BxT``):
  ``mismatch/abs_logp_diff_mean``, ``mismatch/abs_logp_diff_max``: |log rho_{i,t}|;
  ``mismatch/kl_k3``: mean of rho - 1 - log rho, Schulman's k3 estimate of KL(mu || pi_old)
    from samples of mu (unbiased: E_mu[rho] = 1), always >= 0;
  ``correction/capped_frac`` ('tis': tokens whose rho > C), ``correction/masked_frac``
    ('mask': tokens outside [1/C, C]); sequence level counts every token of such a sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gjax.objective.policy_losses import MAX_LOG_RATIO

Array = jax.Array

CORRECTIONS = ("none", "tis", "mask")
LEVELS = ("token", "sequence")


def check_correction(mode: str, level: str, cap: float) -> None:
    if mode not in CORRECTIONS:
        raise ValueError(f"behaviour_correction must be one of {CORRECTIONS}, got {mode!r}")
    if level not in LEVELS:
        raise ValueError(f"behaviour_level must be one of {LEVELS}, got {level!r}")
    if not cap > 1.0:
        raise ValueError(f"behaviour_cap C must be > 1 (ratios are kept in [1/C, C]), got {cap}")


def behaviour_correction_BxT(
    old_logps_BxT: Array,
    behaviour_logps_BxT: Array,
    mask_BxT: Array,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
) -> tuple[Array, dict[str, Array]]:
    """Per-token loss-weight coefficients c_BxT (stop-gradient) and the mismatch metrics.

    Args:
      old_logps_BxT: log pi_old, the trainer's log-probs of the sampled tokens.
      behaviour_logps_BxT: log mu, the sampler's log-probs of the same tokens.
      mask_BxT: loss tokens (bool or 0/1); values elsewhere are ignored (even NaN).
      mode, level, cap: see the module docstring.
    Returns:
      (c_BxT, metrics): c is 0 off the mask; metrics are scalars (module docstring).

    Example: old = log 0.5, behaviour = log 0.2 gives rho = 2.5; 'tis' with C = 2 weighs the
    token 2.0, 'mask' drops it, and |delta log p| = log 2.5 = 0.916.
    """
    check_correction(mode, level, cap)
    m_BxT = (mask_BxT if mask_BxT.dtype == bool else mask_BxT != 0).astype(jnp.float32)
    live = m_BxT > 0
    diff_BxT = jnp.where(live, old_logps_BxT - behaviour_logps_BxT, 0.0).astype(jnp.float32)
    diff_BxT = jax.lax.stop_gradient(diff_BxT)
    n = jnp.maximum(m_BxT.sum(), 1.0)
    tok_log_rho = jnp.clip(diff_BxT, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    tok_rho = jnp.exp(tok_log_rho)
    metrics = {
        "mismatch/abs_logp_diff_mean": jnp.abs(diff_BxT).sum() / n,
        "mismatch/abs_logp_diff_max": jnp.abs(diff_BxT).max(),
        "mismatch/kl_k3": (m_BxT * (tok_rho - 1.0 - tok_log_rho)).sum() / n,
    }
    if level == "sequence":
        log_rho_B = jnp.clip(diff_BxT.sum(axis=1), -MAX_LOG_RATIO, MAX_LOG_RATIO)
        log_rho_BxT = jnp.broadcast_to(log_rho_B[:, None], diff_BxT.shape)
    else:
        log_rho_BxT = tok_log_rho
    rho_BxT = jnp.exp(log_rho_BxT)
    log_cap = jnp.log(jnp.float32(cap))
    if mode == "tis":
        capped = log_rho_BxT > log_cap
        c_BxT = jnp.minimum(rho_BxT, jnp.float32(cap))
        metrics["correction/capped_frac"] = (m_BxT * capped).sum() / n
    elif mode == "mask":
        outside = jnp.abs(log_rho_BxT) > log_cap
        c_BxT = jnp.where(outside, 0.0, 1.0)
        metrics["correction/masked_frac"] = (m_BxT * outside).sum() / n
    else:
        c_BxT = jnp.ones_like(rho_BxT)
    return c_BxT * m_BxT, metrics
