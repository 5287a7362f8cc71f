"""The composed objective: advantages -> token weights -> per-token loss -> aggregation.

One pure function of the batch arrays, jit-compiled with the config static::

    loss, metrics = full_batch_loss(hidden_BxTxD, head_DxV, batch, cfg)

and the split API the trainer uses for gradient accumulation::

    prep, prep_metrics = prepare(batch, cfg, rng)                # once, on the GLOBAL batch
    for sl in micro_batches:                                     # slices along B
        loss_k, sums_k = micro_batch_loss(hidden_k, head, slice(batch, sl), slice(prep, sl), cfg)
    loss = sum(loss_k); metrics = {**prep_metrics, **finalize_metrics(sum(sums_k))}

(``split_micro_batches`` stacks equal micro-batches for a ``lax.scan`` instead of the loop.)
``rng`` is only needed by ``token_weights='clip_cov'`` (random choice of detached tokens).

Everything that needs the full batch (advantages, GPG alpha, A-GRAE omega_s, CW kernel
weights, the aggregation denominators) happens in ``prepare``; the result is a dict of arrays
whose leading axis is B, so slicing it along B with the batch is all a micro-batch needs. The
loss of a micro-batch is then a weighted sum over its tokens,

    L_k = sum_{(i,t) in k} w_{i,t} * ell_{i,t},
    ell = c * policy_loss(r, tau * A) + beta * KL_est(pi || pi_ref) + kl_cov * |log r|
          - entropy_coef * H,

with w from ``gjax.objective.aggregation`` times the estimator's keep mask, tau the token
weights (CW-GRPO / Clip-Cov) and c the behaviour-policy correction of the policy-gradient term
only (``gjax.objective.off_policy``; 1 without one). So sum_k L_k is the full-batch loss and
sum_k grad L_k its gradient, exactly, for any split across micro-batches or devices. ``ell``
is evaluated inside the fused LM-head kernel (``gjax.objective.logprobs``), which never
materialises [tokens x vocab] logits.

Batch keys (names fixed, see docs/architecture.md): ``targets_BxT`` (int), ``loss_mask_BxT``,
``old_logps_BxT``, ``rewards_PxG``, ``valid_PxG``, optional ``ref_logps_BxT`` (needed iff
kl_beta > 0), ``scores_PxG`` (DaGRPO judge scores), ``is_anchor_PxG`` (off-policy anchors),
``behaviour_logps_BxT`` (the sampler's log-probs when ``old_logps_BxT`` are the trainer's own:
mismatch metrics, and the ``behaviour_correction`` of ``gjax.objective.off_policy``).

Conventions (decisions where the papers are silent):
  * Sequence/token denominators count VALID samples (``valid_PxG`` and a finite reward), not
    the estimator's keep mask: masked samples (DaGRPO lambda) still count, as in DaGRPO
    eq. (13)'s 1/|G_mix|; they contribute zero loss. Invalid samples count nowhere.
  * Values at positions with loss_mask = 0 (padding) are ignored, even if NaN: targets,
    old/ref log-probs are sanitised there before use. Padding never changes loss or gradient.
  * An all-masked batch gives loss 0 and zero gradients (guarded denominators), never NaN.
  * Non-finite rewards make a sample invalid (counted in ``metrics['adv/nonfinite']``); a
    non-finite judge score makes the DaGRPO estimator drop the sample (A = 0, keep = False,
    also counted there), which then counts in the denominators like a masked sample.
  * The behaviour correction c (truncated IS weight or rejection mask) multiplies ONLY the
    policy-gradient term, and rejected / down-weighted tokens stay in every denominator, as in
    TRL (``importance_sampling_ratio`` times the clipped term, before ``beta * kl``; the
    normaliser is the completion mask) and verl's rollout IS weights. Why: c corrects the
    estimate of E_{pi_old}[r A grad log pi] for sampling from mu; the KL-to-reference and
    entropy terms are regularisers on the sampled tokens, and keeping the denominators fixed
    means a rejected token never rescales the rest of the batch.
  * Off-policy anchors: ``anchor_treatment='ratio'`` uses the same loss as on-policy samples
    with the ratio against ``old_logps_BxT``, which for anchor rows the trainer fills with the
    teacher-forced log-probs of the policy at the start of the update (there is no behaviour
    log-prob for an external demonstration); ``'luffy'`` replaces the ratio term on anchor
    tokens by LUFFY's shaped -f(pi) A, f(pi) = pi / (pi + gamma), without clipping.

Metrics. ``prepare`` returns full-batch scalars (``adv/*``: the estimator's metrics, e.g.
adv_mean/std/min/max, zero_var_frac, alpha (GPG), ass_scale (A-GRAE), masked_fraction (DaGRPO);
``tw/*``: token-weight metrics, e.g. CW kernel weight min/mean/max; ``count/*``: token and
sequence counts). ``micro_batch_loss`` returns micro-batch-ADDITIVE sums: ``loss/*`` (the
weighted loss parts pg, kl, kl_cov, entropy: these add up to the loss) and ``sum/*`` (plain
sums over the micro-batch's loss tokens: clip_low, clip_high, clip_dual, entropy, approx_kl,
ratio, tokens). ``finalize_metrics`` turns summed ``sum/*`` into means per token
(``clip_frac_low``, ``entropy``...).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gjax.objective import logprobs, off_policy, policy_losses
from gjax.objective.advantages import ADVANTAGES
from gjax.objective.aggregation import AGGREGATIONS, aggregation_weights
from gjax.objective.policy_losses import KL_ESTIMATORS, POLICY_LOSSES
from gjax.objective.token_weights import TOKEN_WEIGHTS, covariance_percentiles

Array = jax.Array
Batch = Mapping[str, Array]

ANCHOR_TREATMENTS = ("ratio", "luffy")


def _freeze(kwargs: Any) -> tuple[tuple[str, Any], ...]:
    if kwargs is None:
        return ()
    items = kwargs.items() if isinstance(kwargs, Mapping) else kwargs
    out = tuple(sorted((str(k), v) for k, v in items))
    hash(out)  # kwargs must be hashable: the config is a static jit argument
    return out


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Static (hashable) description of one GRPO-family objective.

    Attributes:
      advantage: name in ``ADVANTAGES`` (grpo, dapo, dr_grpo, gpg, a_grae, dagrpo, rloo, ...).
      advantage_kwargs: its static hyperparameters (a dict is accepted and frozen).
      token_weights: name in ``TOKEN_WEIGHTS`` (cw_gaussian, clip_cov, kl_cov) or None.
      token_weights_kwargs: its static hyperparameters.
      policy_loss: name in ``POLICY_LOSSES`` (ppo_clip, ratio, cispo, pg, gspo, luffy).
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] (DAPO clip-higher; for cispo
        the IS weight's, where eps_low = 1 means no lower bound).
      dual_clip: dual-clip constant c > 1 for A < 0 (ppo_clip only), or None.
      kl_beta, kl_estimator: coefficient and estimator (k1, k2, k3) of KL(pi || pi_ref).
      entropy_coef: entropy bonus coefficient (the loss subtracts entropy_coef * H).
      aggregation, aggregation_constant: name in ``AGGREGATIONS``; the Dr.GRPO constant (None
        means T, the padded completion length).
      temperature: log-probs are log_softmax(logits / temperature) (the sampling temperature).
      anchor_treatment: 'ratio' or 'luffy' (off-policy anchors, see module docstring).
      luffy_gamma: gamma of LUFFY's shaping f(pi) = pi / (pi + gamma).
      token_chunk, vocab_tile: kernel tile sizes (None: the kernel's defaults).
      lm_head_kernel: schedule of the fused loss kernel, a name in ``logprobs.KERNELS``
        ('auto': chosen per platform; 'reference': the first fixed one).
      behaviour_correction, behaviour_level, behaviour_cap: correction for the sampler's
        policy when ``behaviour_logps_BxT`` is in the batch ('none' | 'tis' | 'mask', at
        'token' or 'sequence' level, cap C; ``gjax.objective.off_policy``).
      covariance_metrics: log ``cov/*`` (``token_weights.covariance_percentiles``).
    """

    advantage: str = "grpo"
    advantage_kwargs: tuple[tuple[str, Any], ...] = ()
    token_weights: str | None = None
    token_weights_kwargs: tuple[tuple[str, Any], ...] = ()
    policy_loss: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "seq_mean_token_mean"
    aggregation_constant: float | None = None
    temperature: float = 1.0
    anchor_treatment: str = "ratio"
    luffy_gamma: float = 0.1
    token_chunk: int | None = None
    vocab_tile: int | None = None
    lm_head_kernel: str = "auto"
    behaviour_correction: str = "none"
    behaviour_level: str = "token"
    behaviour_cap: float = 2.0
    covariance_metrics: bool = False

    def __post_init__(self):
        object.__setattr__(self, "advantage_kwargs", _freeze(self.advantage_kwargs))
        object.__setattr__(self, "token_weights_kwargs", _freeze(self.token_weights_kwargs))
        ADVANTAGES.get(self.advantage)  # unknown names raise, listing the valid ones
        POLICY_LOSSES.get(self.policy_loss)
        KL_ESTIMATORS.get(self.kl_estimator)
        AGGREGATIONS.get(self.aggregation)
        if self.token_weights is not None:
            TOKEN_WEIGHTS.get(self.token_weights)
        off_policy.check_correction(
            self.behaviour_correction, self.behaviour_level, self.behaviour_cap
        )
        if self.lm_head_kernel not in logprobs.KERNELS:
            raise ValueError(
                f"lm_head_kernel must be one of {logprobs.KERNELS}, got {self.lm_head_kernel!r}"
            )
        if self.anchor_treatment not in ANCHOR_TREATMENTS:
            raise ValueError(
                f"anchor_treatment must be one of {ANCHOR_TREATMENTS}, got {self.anchor_treatment!r}"
            )
        policy_losses._check_eps(
            self.eps_low, self.eps_high, self.dual_clip, no_lower=self.policy_loss == "cispo"
        )
        if self.dual_clip is not None and self.policy_loss != "ppo_clip":
            raise ValueError(f"dual_clip applies to ppo_clip only, not {self.policy_loss!r}")
        for name in ("kl_beta", "entropy_coef"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not self.luffy_gamma > 0.0:
            raise ValueError(f"luffy_gamma must be > 0, got {self.luffy_gamma}")
        if self.aggregation_constant is not None and not self.aggregation_constant > 0:
            raise ValueError(f"aggregation_constant must be > 0, got {self.aggregation_constant}")
        if self.policy_loss == "gspo" and self.token_weights is not None:
            raise ValueError(
                "gspo uses a sequence-level ratio; per-token weights "
                f"({self.token_weights!r}) would break its exact per-token form"
            )

    @property
    def policy_loss_kwargs(self) -> dict[str, Any]:
        if self.policy_loss == "ppo_clip":
            return {"eps_low": self.eps_low, "eps_high": self.eps_high, "dual_clip": self.dual_clip}
        if self.policy_loss in ("gspo", "cispo"):
            return {"eps_low": self.eps_low, "eps_high": self.eps_high}
        if self.policy_loss == "luffy":
            return {"gamma": self.luffy_gamma}
        return {}

    def replace(self, **changes) -> ObjectiveConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides) -> ObjectiveConfig:
        """A named algorithm preset (see ``PRESETS``) with optional field overrides."""
        if name not in PRESETS:
            raise KeyError(f"unknown objective preset {name!r}; valid names: {', '.join(PRESETS)}")
        return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def _presets() -> dict[str, ObjectiveConfig]:
    c = ObjectiveConfig
    return {
        # DeepSeekMath GRPO: group-normalised advantages, PPO clip eps = 0.2, k3 KL with
        # beta = 0.04 against the reference, sequence-mean of token-means.
        "grpo": c(advantage="grpo", kl_beta=0.04, kl_estimator="k3"),
        # Dr.GRPO (Liu et al. 2025): no std, no length normalisation (token sum / constant
        # = max completion length; None -> T), no KL.
        "dr_grpo": c(advantage="dr_grpo", aggregation="seq_mean_token_sum_norm"),
        # DAPO (Yu et al. 2025): clip-higher eps_low = 0.2, eps_high = 0.28, token-level mean
        # over the global batch, no KL. Dynamic sampling / overlong shaping live in the loop.
        "dapo": c(advantage="dapo", eps_high=0.28, aggregation="token_mean"),
        # GPG (Chu et al.) eqs. (5)-(8): -logp * A, A = alpha (r - mean) (F_norm = 1, alpha
        # folded into A by the estimator), no ratio / clip / KL; eq. (5) divides each group's
        # token sum by the group's token count (aggregation='token_mean': one global count).
        "gpg": c(advantage="gpg", policy_loss="pg", aggregation="group_token_mean"),
        # A-GRAE Sec. 5.1 on GRPO: DDAS (eq. (12)) + ASS (eq. (13)) with alpha = 1 (math).
        "a_grae": c(
            advantage="a_grae",
            advantage_kwargs={"base": "grpo", "sample_level": "ddas", "group_level": "ass"},
        ),
        # DaGRPO Sec. 6: Dr.GRPO setting (no std, no length norm, no KL), delta = 3, judge
        # scores, off-policy anchors in the mixed group with the recomputed-ratio treatment.
        "dagrpo": c(
            advantage="dagrpo",
            advantage_kwargs={"delta": 3.0, "scale": "none"},
            aggregation="seq_mean_token_sum_norm",
        ),
        # CW-GRPO Sec. 2.3: GRPO with Gaussian covariance weights on the advantage, statistics
        # and normaliser per group (token_weights_kwargs={'scope': 'batch'}: over the batch).
        "cw_grpo": c(advantage="grpo", token_weights="cw_gaussian", kl_beta=0.04),
        # GSPO (Zheng et al. 2025): sequence-level ratio, clip range (3e-4, 4e-4), no KL.
        "gspo": c(advantage="grpo", policy_loss="gspo", eps_low=3e-4, eps_high=4e-4),
        # Clip-Cov / KL-Cov (Cui et al. 2025) on the DAPO-style token-mean loss, no ref KL.
        "clip_cov": c(advantage="grpo", token_weights="clip_cov", aggregation="token_mean"),
        # KL-Cov's surrogate is the unclipped -r A plus the penalty (Cui et al. Sec. 4; verl's
        # kl_cov loss): no PPO clip.
        "kl_cov": c(
            advantage="grpo", token_weights="kl_cov", policy_loss="ratio", aggregation="token_mean"
        ),
        # W-REINFORCE (Zhu et al. 2025): -logp * A with A = 0.1 (correct) / -1 (wrong).
        "w_reinforce": c(advantage="w_reinforce", policy_loss="pg", aggregation="token_mean"),
        # CISPO (MiniMax-M1 eqs. (4)-(5)): GRPO advantages, stop-gradient IS weight clipped
        # above only (eps_low = 1: no lower bound, as the paper), token-level mean, no KL.
        # The paper tunes eps_high without reporting it: 0.28 is DAPO's clip-higher value.
        "cispo": c(
            advantage="grpo",
            policy_loss="cispo",
            eps_low=1.0,
            eps_high=0.28,
            aggregation="token_mean",
        ),
        # Pass@k training (Chen et al. 2025, arXiv 2508.10751): the analytic pass@k group
        # advantage on the GRPO objective (only the advantage differs from "grpo"); k = 4.
        "pass_at_k": c(advantage="pass_at_k", advantage_kwargs={"k": 4}, kl_beta=0.04),
    }


PRESETS: dict[str, ObjectiveConfig] = {}


# --------------------------------------------------------------------------------------------
# Input validation (trace time)
# --------------------------------------------------------------------------------------------

_REQUIRED_PREP = ("targets_BxT", "loss_mask_BxT", "old_logps_BxT", "rewards_PxG", "valid_PxG")


def _check_batch(batch: Batch, cfg: ObjectiveConfig) -> tuple[int, int, int]:
    missing = [k for k in _REQUIRED_PREP if k not in batch]
    if cfg.kl_beta > 0 and "ref_logps_BxT" not in batch:
        missing.append("ref_logps_BxT (kl_beta > 0)")
    if missing:
        raise KeyError(f"objective batch is missing {missing}; it has {sorted(batch)}")
    targets = batch["targets_BxT"]
    if targets.ndim != 2:
        raise ValueError(f"targets_BxT must be [B, T], got shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets_BxT must be integer token ids, got {targets.dtype}")
    b, t = targets.shape
    for k in ("loss_mask_BxT", "old_logps_BxT", "ref_logps_BxT", "behaviour_logps_BxT"):
        if k in batch and batch[k].shape != (b, t):
            raise ValueError(f"{k} shape {batch[k].shape} != targets_BxT shape {(b, t)}")
    for k in ("old_logps_BxT", "ref_logps_BxT"):
        if k in batch and not jnp.issubdtype(batch[k].dtype, jnp.floating):
            raise TypeError(f"{k} must be floating, got {batch[k].dtype}")
    rewards = batch["rewards_PxG"]
    if rewards.ndim != 2:
        raise ValueError(f"rewards_PxG must be [P, G], got shape {rewards.shape}")
    p, g = rewards.shape
    if p * g != b:
        raise ValueError(
            f"rewards_PxG {rewards.shape} gives P*G = {p * g} sequences but targets_BxT has B = {b}"
            " (B must be P*G, prompt-major)"
        )
    return p, g, t


def _check_hidden(hidden_BxTxD: Array, head_DxV: Array, b: int, t: int) -> None:
    if hidden_BxTxD.ndim != 3 or hidden_BxTxD.shape[:2] != (b, t):
        raise ValueError(
            f"hidden_BxTxD shape {hidden_BxTxD.shape} does not match [B, T] = {(b, t)}"
        )
    if head_DxV.ndim != 2 or head_DxV.shape[0] != hidden_BxTxD.shape[2]:
        raise ValueError(
            f"head_DxV shape {head_DxV.shape} does not match hidden size D = {hidden_BxTxD.shape[2]}"
        )


# --------------------------------------------------------------------------------------------
# prepare: the full-batch part
# --------------------------------------------------------------------------------------------


def prepare(
    batch: Batch, cfg: ObjectiveConfig, rng: Array | None = None
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Full-batch preparation: advantages, token weights, aggregation weights and metrics.

    Must run on the GLOBAL batch (under jit with sharded arrays that is automatic).

    Returns ``(prep, metrics)``: ``prep`` maps names to arrays with leading axis B, to be
    sliced along B together with the batch for ``micro_batch_loss``:
      ``weight_BxT``  aggregation weight x keep (0 on padding / masked / invalid samples)
      ``mask_BxT``    loss tokens of valid samples (1/0 float; metric token set)
      ``adv_BxT``     per-token advantage times the token weights (CW / Clip-Cov)
      ``kl_coef_BxT`` per-token KL-Cov coefficient (only with token_weights='kl_cov')
      ``pg_coef_BxT`` behaviour correction c of the policy-gradient term (only with one)
      ``anchor_BxT``  off-policy anchor flag (only with anchor_treatment='luffy' and anchors)
    and ``metrics`` are full-batch scalars (``adv/*``, ``tw/*``, ``cov/*``, ``count/*``).
    """
    p, g, t = _check_batch(batch, cfg)
    b = p * g
    rewards_PxG = batch["rewards_PxG"]
    valid_PxG = batch["valid_PxG"]
    adv_out = ADVANTAGES.get(cfg.advantage)(
        rewards_PxG,
        valid_PxG,
        scores_PxG=batch.get("scores_PxG"),
        is_anchor_PxG=batch.get("is_anchor_PxG"),
        **dict(cfg.advantage_kwargs),
    )
    adv_B = adv_out.adv_PxG.reshape(b).astype(jnp.float32)
    keep_B = adv_out.keep_PxG.reshape(b).astype(bool)
    given_B = valid_PxG.reshape(b)
    given_B = given_B if given_B.dtype == bool else given_B != 0
    counted_B = given_B & jnp.isfinite(rewards_PxG.reshape(b))

    loss_mask_BxT = batch["loss_mask_BxT"]
    loss_mask_BxT = loss_mask_BxT if loss_mask_BxT.dtype == bool else loss_mask_BxT != 0
    mask_BxT = (loss_mask_BxT & counted_B[:, None]).astype(jnp.float32)
    group_B = jnp.arange(b, dtype=jnp.int32) // g  # prompt-major: row b is in group b // G
    agg_BxT = aggregation_weights(
        cfg.aggregation,
        loss_mask_BxT,
        counted_B,
        constant=cfg.aggregation_constant,
        group_B=group_B,
    )
    weight_BxT = agg_BxT * keep_B[:, None].astype(jnp.float32)
    prep = {"weight_BxT": weight_BxT, "mask_BxT": mask_BxT}
    off_metrics = {}
    if "behaviour_logps_BxT" in batch:  # the sampler's log-probs differ from old_logps_BxT
        coef_BxT, off_metrics = off_policy.behaviour_correction_BxT(
            batch["old_logps_BxT"],
            batch["behaviour_logps_BxT"],
            mask_BxT,
            mode=cfg.behaviour_correction,
            level=cfg.behaviour_level,
            cap=cfg.behaviour_cap,
        )
        if cfg.behaviour_correction != "none":  # the policy-gradient term only (docstring)
            prep["pg_coef_BxT"] = jax.lax.stop_gradient(coef_BxT)
    adv_BxT = jnp.broadcast_to(adv_B[:, None], (b, t)) * mask_BxT

    metrics = {f"adv/{k}": jnp.asarray(v, jnp.float32) for k, v in adv_out.metrics.items()}
    metrics.update(off_metrics)
    if cfg.covariance_metrics:  # CW-GRPO Table 1: |c_t| percentiles, for any objective
        cov_valid_BxT = (mask_BxT > 0) & keep_B[:, None]
        cov = covariance_percentiles(
            jnp.where(cov_valid_BxT, batch["old_logps_BxT"], 0.0), adv_BxT, cov_valid_BxT, g
        )
        metrics.update({f"cov/{k}": v for k, v in cov.items()})
    if cfg.token_weights is not None:
        old_BxT = jnp.where(mask_BxT > 0, batch["old_logps_BxT"], 0.0).astype(jnp.float32)
        tw_mask_BxT = mask_BxT * keep_B[:, None].astype(jnp.float32)
        if cfg.token_weights == "clip_cov" and rng is None:
            raise ValueError("token_weights='clip_cov' picks random tokens: pass rng=<jax key>")
        tw = TOKEN_WEIGHTS.get(cfg.token_weights)(
            old_BxT,
            adv_BxT,
            tw_mask_BxT,
            rng=rng,
            group_size=g,
            **dict(cfg.token_weights_kwargs),
        )
        adv_BxT = adv_BxT * jax.lax.stop_gradient(tw.w_BxT)
        if cfg.token_weights == "kl_cov":
            prep["kl_coef_BxT"] = jax.lax.stop_gradient(tw.kl_coef_BxT) * mask_BxT
        metrics.update({f"tw/{k}": jnp.asarray(v, jnp.float32) for k, v in tw.metrics.items()})
    prep["adv_BxT"] = adv_BxT
    if cfg.anchor_treatment == "luffy" and batch.get("is_anchor_PxG") is not None:
        anchor_B = batch["is_anchor_PxG"].reshape(b).astype(bool)
        prep["anchor_BxT"] = jnp.broadcast_to(anchor_B[:, None], (b, t)).astype(jnp.float32)

    metrics["count/loss_tokens"] = mask_BxT.sum()
    metrics["count/trained_tokens"] = (weight_BxT > 0).sum().astype(jnp.float32)
    metrics["count/sequences"] = (mask_BxT.sum(axis=1) > 0).sum().astype(jnp.float32)
    metrics["count/kept_sequences"] = ((weight_BxT > 0).sum(axis=1) > 0).sum().astype(jnp.float32)
    # (The rollout's mean completion length is `response/length_mean`; the trained batch's is
    # count/loss_tokens / count/sequences.)
    return prep, metrics


# --------------------------------------------------------------------------------------------
# micro_batch_loss: the per-token part, through the fused kernel
# --------------------------------------------------------------------------------------------

_AUX_SUMS = ("clip_low", "clip_high", "clip_dual", "ratio")


def make_token_loss_fn(cfg: ObjectiveConfig):
    """The elementwise ``token_loss_fn(logp, entropy, args) -> (loss_t, aux_t)`` for the kernel.

    ``args`` (no gradient; arrays of the token shape): ``weight`` (aggregation x keep),
    ``mask`` (metric tokens), ``adv`` (token-weighted advantage), ``old`` (old log-probs),
    and as configured ``ref`` (kl_beta > 0), ``kl_coef`` (KL-Cov), ``anchor`` (LUFFY),
    ``seq_log_ratio`` (GSPO), ``pg_coef`` (behaviour correction of the policy-gradient term).
    ``loss_t = weight * ell_t`` (module docstring); ``aux_t`` holds the per-token ``loss/*``
    parts and ``sum/*`` diagnostics that the kernel sums.
    """
    loss_fn = POLICY_LOSSES.get(cfg.policy_loss)
    loss_kwargs = cfg.policy_loss_kwargs
    kl_fn = KL_ESTIMATORS.get(cfg.kl_estimator)

    def token_loss_fn(logp, entropy, args):
        w, m, adv, old = args["weight"], args["mask"], args["adv"], args["old"]
        kwargs = dict(loss_kwargs)
        if cfg.policy_loss == "gspo":
            kwargs["seq_log_ratio"] = args["seq_log_ratio"]
        pg_t, aux = loss_fn(logp, old, adv, **kwargs)
        if "anchor" in args:  # LUFFY shaping on off-policy anchor tokens
            shaped_t, _ = policy_losses.luffy(logp, old, adv, gamma=cfg.luffy_gamma)
            pg_t = jnp.where(args["anchor"] > 0, shaped_t, pg_t)
        if "pg_coef" in args:  # behaviour correction: the policy-gradient term only
            pg_t = args["pg_coef"] * pg_t
        loss_pg = w * pg_t
        out = {"loss/pg": loss_pg}
        total = loss_pg
        if cfg.kl_beta > 0:
            loss_kl = w * (cfg.kl_beta * kl_fn(logp, args["ref"]))
            out["loss/kl"] = loss_kl
            total = total + loss_kl
        if "kl_coef" in args:  # KL-Cov (Cui et al. 2025): coef * |log pi - log pi_old|
            loss_kl_cov = w * (args["kl_coef"] * policy_losses.abs_log_ratio(logp, old))
            out["loss/kl_cov"] = loss_kl_cov
            total = total + loss_kl_cov
        if cfg.entropy_coef > 0:
            loss_ent = -w * (cfg.entropy_coef * entropy)
            out["loss/entropy"] = loss_ent
            total = total + loss_ent
        # Plain per-token diagnostics over the loss tokens (no gradient needed).
        lp = jax.lax.stop_gradient(logp)
        for k in _AUX_SUMS:
            out[f"sum/{k}"] = m * jax.lax.stop_gradient(aux[k])
        out["sum/entropy"] = m * jax.lax.stop_gradient(entropy)
        out["sum/approx_kl"] = m * policy_losses.approx_kl_old(lp, old)
        if cfg.kl_beta > 0:
            out["sum/ref_kl"] = m * kl_fn(lp, args["ref"])
        out["sum/logp"] = m * lp
        return total, out

    return token_loss_fn


def micro_batch_loss(
    hidden_BxTxD: Array,
    head_DxV: Array,
    mb: Batch,
    prep: Mapping[str, Array],
    cfg: ObjectiveConfig,
    *,
    segment_BxT: Array | None = None,
    num_segments: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Loss of one micro-batch (rows of the global batch) and its additive metric sums.

    ``mb`` needs ``targets_BxT``, ``old_logps_BxT`` (and ``ref_logps_BxT`` if kl_beta > 0);
    ``prep`` is ``prepare``'s output sliced to the same rows. The returned loss is this
    micro-batch's share of the global loss (global denominators), so losses and gradients of
    all micro-batches sum to the full-batch ones. Packed micro-batches (``gjax.packing``)
    pass bins as the [B, T] grid and ``segment_BxT`` (int in [0, num_segments)): which
    sequence each token is, for GSPO's per-sequence ratio; every other term is per token.
    """
    targets_BxT = mb["targets_BxT"]
    b, t = targets_BxT.shape
    _check_hidden(hidden_BxTxD, head_DxV, b, t)
    mask_BxT = prep["mask_BxT"]
    if mask_BxT.shape != (b, t):
        raise ValueError(f"prep arrays have shape {mask_BxT.shape}, micro-batch has {(b, t)}")
    live = mask_BxT > 0
    # Sanitise padding so garbage there (NaN log-probs, -100 targets) cannot leak in.
    targets_BxT = jnp.where(live, targets_BxT, 0)
    old_BxT = jnp.where(live, mb["old_logps_BxT"], 0.0).astype(jnp.float32)
    args = {
        "weight": prep["weight_BxT"],
        "mask": mask_BxT,
        "adv": prep["adv_BxT"],
        "old": old_BxT,
    }
    if cfg.kl_beta > 0:
        args["ref"] = jnp.where(live, mb["ref_logps_BxT"], 0.0).astype(jnp.float32)
    for k in ("kl_coef", "anchor", "pg_coef"):
        if f"{k}_BxT" in prep:
            args[k] = prep[f"{k}_BxT"]
    if cfg.policy_loss == "gspo":
        # Forward-only pass for GSPO's sequence ratio log s_i = mean_t (logp - old_logp): one
        # extra logits sweep (4 matmuls instead of the fused kernel's 3).
        logps_BxT, _ = logprobs.token_logps_BxT(
            jax.lax.stop_gradient(hidden_BxTxD),
            jax.lax.stop_gradient(head_DxV),
            targets_BxT,
            **_kernel_kwargs(cfg, fused=False, with_entropy=False),
        )
        logps_BxT = jax.lax.stop_gradient(logps_BxT)
        diff_BxT = mask_BxT * (logps_BxT - old_BxT)
        if segment_BxT is None:
            len_B = mask_BxT.sum(axis=1)
            log_s_B = diff_BxT.sum(axis=1) / jnp.maximum(len_B, 1.0)
            args["seq_log_ratio"] = jnp.broadcast_to(log_s_B[:, None], (b, t))
        else:
            seg_N = segment_BxT.reshape(-1)
            sum_Q = jax.ops.segment_sum(diff_BxT.reshape(-1), seg_N, num_segments)
            len_Q = jax.ops.segment_sum(mask_BxT.reshape(-1), seg_N, num_segments)
            args["seq_log_ratio"] = (sum_Q / jnp.maximum(len_Q, 1.0))[segment_BxT]

    loss, sums = logprobs.fused_token_loss_BxT(
        hidden_BxTxD,
        head_DxV,
        targets_BxT,
        make_token_loss_fn(cfg),
        args,
        **_kernel_kwargs(cfg),
    )
    sums = dict(sums)
    sums["sum/tokens"] = mask_BxT.sum()
    return loss, sums


def split_micro_batches(
    batch: Batch, prep: Mapping[str, Array], num: int
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Stack ``num`` equal micro-batches for ``lax.scan``: every ``*_BxT`` array of ``batch``
    (the ``*_PxG`` ones are full-batch inputs of ``prepare`` only) and every ``prep`` array
    is reshaped from [B, ...] to [num, B // num, ...] (contiguous rows per micro-batch)."""
    b = batch["targets_BxT"].shape[0]
    if num < 1 or b % num:
        raise ValueError(f"cannot split B = {b} sequences into {num} equal micro-batches")

    def split(x):
        return x.reshape((num, b // num) + x.shape[1:])

    mbs = {k: split(v) for k, v in batch.items() if k.endswith("_BxT")}
    return mbs, {k: split(v) for k, v in prep.items()}


def _kernel_kwargs(cfg: ObjectiveConfig, fused: bool = True, **extra) -> dict[str, Any]:
    kw: dict[str, Any] = {"temperature": cfg.temperature}
    if cfg.token_chunk is not None:
        kw["token_chunk"] = cfg.token_chunk
    if cfg.vocab_tile is not None and not fused:  # the fused pass sweeps full vocab rows
        kw["vocab_tile"] = cfg.vocab_tile
    if fused:
        kw["kernel"] = cfg.lm_head_kernel
    kw.update(extra)
    return kw


def finalize_metrics(sums: Mapping[str, Array]) -> dict[str, Array]:
    """Turn (micro-batch-summed) ``micro_batch_loss`` sums into per-token means.

    ``loss/*`` pass through (they are already the global weighted loss parts); each ``sum/x``
    becomes ``x`` = sum / number of loss tokens (clip fractions are ``clip_frac_low`` etc.).
    """
    n = jnp.maximum(sums["sum/tokens"], 1.0)
    out = {k: v for k, v in sums.items() if k.startswith("loss/")}
    for k in ("loss/kl", "loss/entropy"):  # same keys whatever the config (0 when off)
        out.setdefault(k, jnp.zeros((), jnp.float32))
    for k, v in sums.items():
        if k.startswith("sum/") and k != "sum/tokens":
            name = k[len("sum/") :]
            name = name.replace("clip_", "clip_frac_") if name.startswith("clip_") else name
            out[name] = v / n
    out["loss/total"] = sum(v for k, v in out.items() if k.startswith("loss/"))
    return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def full_batch_loss(
    hidden_BxTxD: Array,
    head_DxV: Array,
    batch: Batch,
    cfg: ObjectiveConfig,
    rng: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The composed objective on one (global) batch: ``(loss, metrics)``; jit, ``cfg`` static.

    Equivalent to ``prepare`` + ``micro_batch_loss`` on the whole batch + ``finalize_metrics``.
    Differentiate w.r.t. ``hidden_BxTxD`` / ``head_DxV`` (or the parameters producing them)
    with ``jax.grad(..., has_aux=True)``.
    """
    prep, metrics = prepare(batch, cfg, rng)
    loss, sums = micro_batch_loss(hidden_BxTxD, head_DxV, batch, prep, cfg)
    metrics = {**metrics, **finalize_metrics(sums)}
    return loss, metrics


PRESETS.update(_presets())
