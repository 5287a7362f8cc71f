"""The composed objective: against a naive materialised-logits reference, micro-batch
additivity, padding invariance, every preset, GPG / A-GRAE theory on a softmax bandit, bad input.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gjax.objective import aggregation
from gjax.objective.advantages import ADVANTAGES
from gjax.objective.loss import (
    PRESETS,
    ObjectiveConfig,
    finalize_metrics,
    full_batch_loss,
    make_token_loss_fn,
    micro_batch_loss,
    prepare,
    split_micro_batches,
)
from gjax.objective.token_weights import TOKEN_WEIGHTS

P, G, T, D, V = 3, 4, 5, 8, 16
RNG = jax.random.key(7)


def make_batch(seed=0, p=P, g=G, t=T, d=D, v=V, stale=0.3, lengths=None):
    """A random rollout batch; old/ref log-probs are the true ones plus noise (ratio != 1)."""
    k = jax.random.split(jax.random.key(seed), 8)
    b = p * g
    hidden = jax.random.normal(k[0], (b, t, d), jnp.float32)
    head = 0.5 * jax.random.normal(k[1], (d, v), jnp.float32)
    targets = jax.random.randint(k[2], (b, t), 0, v, jnp.int32)
    if lengths is None:
        lengths = jax.random.randint(k[3], (b,), 1, t + 1)
    mask = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]
    logp = jnp.take_along_axis(jax.nn.log_softmax(hidden @ head, -1), targets[..., None], -1)[
        ..., 0
    ]
    batch = {
        "targets_BxT": targets,
        "loss_mask_BxT": mask,
        "old_logps_BxT": logp + stale * jax.random.normal(k[4], (b, t)),
        "ref_logps_BxT": logp + stale * jax.random.normal(k[5], (b, t)),
        "rewards_PxG": jax.random.bernoulli(k[6], 0.5, (p, g)).astype(jnp.float32),
        "valid_PxG": jnp.ones((p, g), bool),
        "scores_PxG": jax.random.uniform(k[7], (p, g), minval=1.0, maxval=10.0),
        "is_anchor_PxG": jnp.zeros((p, g), bool).at[:, -1].set(True),
    }
    return hidden, head, batch


@functools.partial(jax.jit, static_argnames=("cfg",))
def _grads(hidden, head, batch, rng, cfg):
    def f(h, w):
        return full_batch_loss(h, w, batch, cfg, rng)

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, head)


def grads(cfg, hidden, head, batch, rng=None):
    (loss, metrics), g = _grads(hidden, head, batch, rng, cfg=cfg)
    return loss, metrics, g


# ------------------------------------------------------------------ naive reference


def naive_objective(hidden, head, batch, cfg, rng=None):
    """Materialised logits + direct formulas, written independently of loss.py."""
    logits = hidden @ head / cfg.temperature
    logsm = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logsm, batch["targets_BxT"][..., None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logsm) * logsm, -1)
    out = ADVANTAGES.get(cfg.advantage)(
        batch["rewards_PxG"],
        batch["valid_PxG"],
        scores_PxG=batch.get("scores_PxG"),
        is_anchor_PxG=batch.get("is_anchor_PxG"),
        **dict(cfg.advantage_kwargs),
    )
    b, t = logp.shape
    adv = out.adv_PxG.reshape(b)[:, None] * jnp.ones((1, t))
    keep = out.keep_PxG.reshape(b)[:, None]
    valid = (
        batch["valid_PxG"].reshape(b)[:, None]
        & jnp.isfinite(batch["rewards_PxG"]).reshape(b)[:, None]
    )
    m = batch["loss_mask_BxT"] & valid
    mf = m.astype(jnp.float32)
    old = jnp.where(m, batch["old_logps_BxT"], 0.0)
    lens = mf.sum(1, keepdims=True)
    nseq = jnp.maximum((lens > 0).sum(), 1.0)
    if cfg.aggregation == "token_mean":
        w = mf / jnp.maximum(mf.sum(), 1.0)
    elif cfg.aggregation == "seq_mean_token_mean":
        w = mf / (nseq * jnp.maximum(lens, 1.0))
    elif cfg.aggregation == "group_token_mean":  # GPG eq. (5), groups = G consecutive rows
        g = batch["rewards_PxG"].shape[1]
        n_g = jnp.repeat(lens.reshape(-1, g).sum(1), g)[:, None]
        ngrp = jnp.maximum((n_g[::g] > 0).sum(), 1.0)
        w = mf / (ngrp * jnp.maximum(n_g, 1.0))
    else:
        c = t if cfg.aggregation_constant is None else cfg.aggregation_constant
        w = mf / (nseq * c)
    w = w * keep
    kl_coef = 0.0
    if cfg.token_weights is not None:
        tw = TOKEN_WEIGHTS.get(cfg.token_weights)(
            old,
            adv * mf,
            mf * keep,
            rng=rng,
            group_size=batch["rewards_PxG"].shape[1],
            **dict(cfg.token_weights_kwargs),
        )
        adv = adv * tw.w_BxT
        kl_coef = tw.kl_coef_BxT
    r = jnp.exp(logp - old)
    if cfg.policy_loss == "ppo_clip":
        pg = jnp.maximum(-r * adv, -jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
        if cfg.dual_clip is not None:
            pg = jnp.where(adv < 0, jnp.minimum(pg, -cfg.dual_clip * adv), pg)
    elif cfg.policy_loss == "pg":
        pg = -logp * adv
    elif cfg.policy_loss == "ratio":
        pg = -r * adv
    elif cfg.policy_loss == "cispo":  # MiniMax-M1 eqs. (4)-(5)
        pg = -jax.lax.stop_gradient(jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high)) * adv * logp
    elif cfg.policy_loss == "gspo":
        # Differentiable sequence ratio: the GSPO objective itself, not a surrogate.
        s = jnp.exp((mf * (logp - old)).sum(1, keepdims=True) / jnp.maximum(lens, 1.0))
        pg = jnp.maximum(-s * adv, -jnp.clip(s, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    if cfg.anchor_treatment == "luffy":
        pi = jnp.exp(logp)
        anchor = batch["is_anchor_PxG"].reshape(b)[:, None]
        pg = jnp.where(anchor, -pi / (pi + cfg.luffy_gamma) * adv, pg)
    total = pg
    if cfg.kl_beta > 0:
        lr = jnp.where(m, batch["ref_logps_BxT"], 0.0) - logp
        total = total + cfg.kl_beta * (jnp.exp(lr) - 1 - lr)
    # |log r| with no gradient at 0 (Cui et al.'s penalty; jnp.abs would give +1 there)
    x = logp - old
    total = total + kl_coef * x * jnp.sign(jax.lax.stop_gradient(x)) - cfg.entropy_coef * ent
    return jnp.sum(w * total)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _naive_grads(hidden, head, batch, rng, cfg):
    return jax.value_and_grad(naive_objective, argnums=(0, 1))(hidden, head, batch, cfg, rng)


def naive_grads(cfg, hidden, head, batch, rng=None):
    return _naive_grads(hidden, head, batch, rng, cfg=cfg)


def assert_close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# ------------------------------------------------------------------ presets vs naive

# KL and entropy switched on for some presets so every loss part is exercised somewhere.
CASES = {
    "grpo": {},
    "dr_grpo": {"entropy_coef": 0.01},
    "dapo": {"dual_clip": 3.0},
    "gpg": {},
    "a_grae": {"kl_beta": 0.1, "kl_estimator": "k3"},
    "dagrpo": {},
    "dagrpo_luffy": {"anchor_treatment": "luffy"},
    "cw_grpo": {"temperature": 0.7},
    "gspo": {"eps_low": 0.05, "eps_high": 0.08},
    "clip_cov": {"token_weights_kwargs": {"ratio": 0.2, "omega_low": -10.0, "omega_high": 10.0}},
    "kl_cov": {"token_weights_kwargs": {"ratio": 0.2}},
    "cispo": {"eps_high": 0.1},
    "pass_at_k": {"advantage_kwargs": {"k": 2}},
}


EXTRA_METRICS = {
    "gpg": ["adv/alpha"],
    "a_grae": ["adv/ass_scale"],
    "dagrpo": ["adv/masked_fraction"],
    "cw_grpo": ["tw/w_min", "tw/w_mean", "tw/w_max"],
    "kl_cov": ["loss/kl_cov"],
    "pass_at_k": ["adv/pass_at_k"],
}
FAST_CASES = ("grpo", "gspo", "dagrpo_luffy")


@pytest.mark.parametrize(
    "case",
    [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)],
)
def test_every_preset_matches_naive_reference(case):
    name = case.split("_luffy")[0]
    cfg = ObjectiveConfig.preset(name, **CASES[case])
    hidden, head, batch = make_batch(seed=len(case))
    loss, metrics, (gh, gw) = grads(cfg, hidden, head, batch, RNG)
    ref_loss, (rh, rw) = naive_grads(cfg, hidden, head, batch, RNG)
    assert np.isfinite(float(loss)) and float(loss) != 0.0
    assert_close(loss, ref_loss)
    assert_close(gh, rh)
    assert_close(gw, rw)
    assert_close(metrics["loss/total"], loss)
    for k, v in metrics.items():
        assert np.isfinite(np.asarray(v)).all(), k
    want = {"loss/pg", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl",
            "entropy", "ratio", "adv/adv_mean", "adv/adv_std", "adv/adv_min", "adv/adv_max",
            "adv/zero_var_frac", "count/loss_tokens", "count/sequences"}  # fmt: skip
    want |= set(EXTRA_METRICS.get(name, ()))
    want |= {"loss/kl"} if cfg.kl_beta > 0 else set()
    want |= {"loss/entropy"} if cfg.entropy_coef > 0 else set()
    assert want <= set(metrics), want - set(metrics)
    if name == "cw_grpo":
        assert float(metrics["tw/w_mean"]) == pytest.approx(1.0, rel=1e-5)


def test_presets_cover_the_trainer_algorithms():
    want = {"grpo", "dr_grpo", "dapo", "gpg", "a_grae", "dagrpo", "cw_grpo", "gspo", "clip_cov",
            "kl_cov", "cispo", "pass_at_k"}  # fmt: skip
    assert want <= set(PRESETS)
    assert ObjectiveConfig.preset("dapo").eps_high == 0.28
    assert ObjectiveConfig.preset("dapo", eps_high=0.3).eps_high == 0.3
    with pytest.raises(KeyError, match="valid names"):
        ObjectiveConfig.preset("ppo")


def test_config_is_hashable_and_static():
    a = ObjectiveConfig(advantage_kwargs={"scale": "batch"})
    b = ObjectiveConfig(advantage_kwargs=(("scale", "batch"),))
    assert a == b and hash(a) == hash(b)
    hidden, head, batch = make_batch()
    l1, _ = full_batch_loss(hidden, head, batch, a)
    l2, _ = full_batch_loss(hidden, head, batch, b)
    assert float(l1) == float(l2)


def test_clip_fraction_metrics_by_hand():
    # One token per sequence, ratios chosen to land on each branch.
    cfg = ObjectiveConfig(advantage="dr_grpo", eps_low=0.2, eps_high=0.2, aggregation="token_mean")
    hidden, head, batch = make_batch(p=1, g=4, t=1, lengths=[1, 1, 1, 1])
    batch["rewards_PxG"] = jnp.array([[1.0, 1.0, 0.0, 0.0]])  # A = +.5, +.5, -.5, -.5
    logp = jnp.take_along_axis(
        jax.nn.log_softmax(hidden @ head, -1), batch["targets_BxT"][..., None], -1
    )[..., 0]
    # ratios: 2 (clip high), 1, 0.5 (clip low), 1
    batch["old_logps_BxT"] = logp - jnp.log(jnp.array([[2.0], [1.0], [0.5], [1.0]]))
    _, m = full_batch_loss(hidden, head, batch, cfg)
    assert float(m["clip_frac_high"]) == pytest.approx(0.25)
    assert float(m["clip_frac_low"]) == pytest.approx(0.25)
    assert float(m["ratio"]) == pytest.approx((2 + 1 + 0.5 + 1) / 4, rel=1e-5)


# ------------------------------------------------------------------ micro-batch additivity


@functools.partial(jax.jit, static_argnames=("cfg",))
def _mb_grads(hidden, head, mb, prep, cfg):
    f = functools.partial(micro_batch_loss, cfg=cfg)
    return jax.value_and_grad(lambda h, w: f(h, w, mb, prep), argnums=(0, 1), has_aux=True)(
        hidden, head
    )


@pytest.mark.parametrize("mode", aggregation.AGGREGATIONS.names())
def test_micro_batches_add_up_to_full_batch(mode):
    cfg = ObjectiveConfig(advantage="grpo", aggregation=mode, kl_beta=0.05, entropy_coef=0.01)
    hidden, head, batch = make_batch(seed=3)
    loss, metrics, (gh, gw) = grads(cfg, hidden, head, batch)
    prep, _ = jax.jit(prepare, static_argnums=1)(batch, cfg)
    bounds = [0, 4, 8, P * G]  # 3 micro-batches (uneven splits: the mesh tests)
    tot_loss, tot_gw, tot_sums, gh_parts = 0.0, 0.0, None, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mb = {k: v[lo:hi] for k, v in batch.items() if k.endswith("BxT")}
        pr = {k: v[lo:hi] for k, v in prep.items()}

        (l_k, sums), (gh_k, gw_k) = _mb_grads(hidden[lo:hi], head, mb, pr, cfg=cfg)
        tot_loss += l_k
        tot_gw += gw_k
        gh_parts.append(gh_k)
        tot_sums = sums if tot_sums is None else jax.tree.map(jnp.add, tot_sums, sums)
    assert_close(tot_loss, loss)
    assert_close(tot_gw, gw)
    assert_close(jnp.concatenate(gh_parts), gh)
    fin = finalize_metrics(tot_sums)
    for k, v in fin.items():
        assert_close(v, metrics[k])


def test_scanned_gradient_accumulation_matches_full_batch():
    """The trainer pattern: prepare once, lax.scan over stacked micro-batches, sum grads."""
    cfg = ObjectiveConfig.preset("dapo", kl_beta=0.02)
    hidden, head, batch = make_batch(seed=5)
    loss, metrics, (gh, gw) = grads(cfg, hidden, head, batch)

    @jax.jit
    def accumulate(hidden, head, batch):
        prep, prep_metrics = prepare(batch, cfg)
        mbs, preps = split_micro_batches(batch, prep, 3)
        hs = hidden.reshape((3, -1) + hidden.shape[1:])

        def step(carry, xs):
            h, mb, pr = xs
            (l, sums), (g_h, g_w) = jax.value_and_grad(
                lambda h, w: micro_batch_loss(h, w, mb, pr, cfg), (0, 1), has_aux=True
            )(h, head)
            loss, acc_w, acc_sums = carry
            return (loss + l, acc_w + g_w, jax.tree.map(jnp.add, acc_sums, sums)), g_h

        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype),
            jax.eval_shape(lambda: micro_batch_loss(hs[0], head, *jax.tree.map(
                lambda x: x[0], (mbs, preps)), cfg)[1]),
        )  # fmt: skip
        (loss, g_w, sums), g_h = jax.lax.scan(
            step, (jnp.zeros(()), jnp.zeros_like(head), zeros), (hs, mbs, preps)
        )
        return loss, g_h.reshape(hidden.shape), g_w, {**prep_metrics, **finalize_metrics(sums)}

    loss_acc, gh_acc, gw_acc, m_acc = accumulate(hidden, head, batch)
    assert_close(loss_acc, loss)
    assert_close(gh_acc, gh)
    assert_close(gw_acc, gw)
    for k, v in metrics.items():
        assert_close(m_acc[k], v)
    with pytest.raises(ValueError, match="equal micro-batches"):
        split_micro_batches(batch, {}, 5)


# ------------------------------------------------------------------ padding invariance


def _pad_tokens(hidden, batch, extra, rng_seed):
    """Append `extra` padded positions full of garbage (NaN log-probs, -100 targets)."""
    k = jax.random.key(rng_seed)
    b = hidden.shape[0]
    hidden = jnp.concatenate([hidden, jax.random.normal(k, (b, extra, hidden.shape[2]))], 1)
    out = dict(batch)
    out["targets_BxT"] = jnp.concatenate(
        [batch["targets_BxT"], jnp.full((b, extra), -100, jnp.int32)], 1
    )
    out["loss_mask_BxT"] = jnp.concatenate([batch["loss_mask_BxT"], jnp.zeros((b, extra), bool)], 1)
    for key in ("old_logps_BxT", "ref_logps_BxT"):
        out[key] = jnp.concatenate([batch[key], jnp.full((b, extra), jnp.nan)], 1)
    return hidden, out


def _add_invalid_samples(hidden, batch, extra_g):
    """Append `extra_g` invalid samples to every group (keeping the prompt-major layout)."""
    p, g = batch["rewards_PxG"].shape
    b, t, d = hidden.shape

    def widen(x, fill):
        x = x.reshape((p, g) + x.shape[1:])
        pad = jnp.full((p, extra_g) + x.shape[2:], fill, x.dtype)
        x = jnp.concatenate([x, pad], 1)
        return x.reshape((p * (g + extra_g),) + x.shape[2:])

    out = {
        "targets_BxT": widen(batch["targets_BxT"], 3),
        "loss_mask_BxT": widen(batch["loss_mask_BxT"], True),  # real-looking tokens...
        "old_logps_BxT": widen(batch["old_logps_BxT"], -1.0),
        "ref_logps_BxT": widen(batch["ref_logps_BxT"], -1.0),
        "rewards_PxG": jnp.concatenate([batch["rewards_PxG"], jnp.full((p, extra_g), 1.0)], 1),
        "valid_PxG": jnp.concatenate(
            [batch["valid_PxG"], jnp.zeros((p, extra_g), bool)],
            1,  # ...of invalid samples
        ),
    }
    return widen(hidden, 0.3), out, g + extra_g


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    preset=st.sampled_from(["grpo", "dapo", "dr_grpo", "gspo", "cw_grpo"]),
    extra=st.sampled_from([2]),
    seed=st.integers(0, 1000),
)
def test_padding_never_changes_loss_or_gradients(preset, extra, seed):
    cfg = ObjectiveConfig.preset(preset, aggregation_constant=float(T))
    hidden, head, batch = make_batch(seed=seed)
    for k in ("scores_PxG", "is_anchor_PxG"):
        batch.pop(k)
    loss, _, (gh, gw) = grads(cfg, hidden, head, batch)
    # Extra padded positions with garbage in them.
    hidden2, batch2 = _pad_tokens(hidden, batch, extra, seed)
    loss2, m2, (gh2, gw2) = grads(cfg, hidden2, head, batch2)
    assert_close(loss2, loss)
    assert_close(gw2, gw)
    assert_close(gh2[:, :T], gh)
    assert np.all(np.asarray(gh2[:, T:]) == 0.0)
    assert all(np.isfinite(np.asarray(v)).all() for v in m2.values())
    # Extra invalid samples in every group.
    hidden3, batch3, g3 = _add_invalid_samples(hidden, batch, extra)
    loss3, _, (gh3, gw3) = grads(cfg, hidden3, head, batch3)
    assert_close(loss3, loss)
    assert_close(gw3, gw)
    gh3 = gh3.reshape(P, g3, T, D)
    assert_close(gh3[:, :G].reshape(P * G, T, D), gh)
    assert np.all(np.asarray(gh3[:, G:]) == 0.0)


# ------------------------------------------------------------------ softmax bandit theory


def bandit(actions, rewards, n_actions=6, seed=0):
    """A softmax bandit through the kernel: one token per sample, D = 1, head = logits h."""
    h = jax.random.normal(jax.random.key(seed), (1, n_actions))
    g = len(actions)
    hidden = jnp.ones((g, 1, 1))
    targets = jnp.asarray(actions, jnp.int32)[:, None]
    logp = jax.nn.log_softmax(h[0])[targets]
    batch = {
        "targets_BxT": targets,
        "loss_mask_BxT": jnp.ones((g, 1), bool),
        "old_logps_BxT": logp,  # on-policy: ratio exactly 1
        "rewards_PxG": jnp.asarray(rewards, jnp.float32)[None, :],
        "valid_PxG": jnp.ones((1, g), bool),
    }
    return hidden, h, batch


def test_gpg_gradient_is_the_reinforce_estimator():
    actions, rewards = [0, 2, 2, 5, 1], [1.0, 0.0, 1.0, 0.0, 0.0]
    hidden, h, batch = bandit(actions, rewards)
    cfg = ObjectiveConfig.preset("gpg")
    (_, metrics), g_h = jax.value_and_grad(
        lambda w: full_batch_loss(hidden, w, batch, cfg), has_aux=True
    )(h)
    # REINFORCE by hand: A_i = alpha (r_i - mean r), alpha = B/(B-M) = 1 (no zero-var group);
    # token-mean over 5 one-token samples; grad of -(1/N) sum A_i log pi(a_i) w.r.t. logits
    # is -(1/N) sum A_i (e_{a_i} - pi).
    r = np.asarray(rewards)
    a = r - r.mean()
    pi = np.asarray(jax.nn.softmax(h[0]))
    want = -np.mean([a_i * (np.eye(6)[k] - pi) for a_i, k in zip(a, actions)], axis=0)
    assert float(metrics["adv/alpha"]) == 1.0
    assert_close(g_h[0], want, 1e-6)


def test_kl_cov_on_policy_gives_exactly_the_policy_gradient():
    """Cui et al.'s penalty |log pi - log pi_old| has no gradient on-policy (jnp.abs gave +1:
    selected tokens were pushed down by the KL coefficient); off-policy it adds coef sign(x)."""
    cfg = ObjectiveConfig.preset("kl_cov")
    assert cfg.policy_loss == "ratio"  # Cui et al. / verl: no PPO clip under KL-Cov
    fn = make_token_loss_fn(cfg)
    logp = jnp.array([-1.0, -2.0, -0.5, -3.0])
    args = {"weight": jnp.full(4, 0.25), "mask": jnp.ones(4), "adv": jnp.array([1.0, -1, 2, 0])}

    def grad(old, coef):
        def f(x):
            return fn(x, jnp.zeros(4), {**args, "old": old, "kl_coef": coef})[0].sum()

        return np.asarray(jax.grad(f)(logp))

    pg = -0.25 * np.array([1.0, -1, 2, 0])  # -w r A at r = 1
    np.testing.assert_array_equal(grad(logp, jnp.ones(4)), grad(logp, jnp.zeros(4)))
    np.testing.assert_allclose(grad(logp, jnp.ones(4)), pg, rtol=1e-6)
    off = logp - jnp.array([0.1, -0.1, 0.1, -0.1])  # log r = +-0.1
    r = np.exp([0.1, -0.1, 0.1, -0.1])
    want = -0.25 * r * np.array([1.0, -1, 2, 0]) + 0.25 * np.array([1.0, -1, 1, -1])
    np.testing.assert_allclose(grad(off, jnp.ones(4)), want, rtol=1e-5)
    # Through the whole objective on a softmax bandit, exactly on-policy, every token selected.
    actions, rewards = [0, 2, 2, 5, 1], [1.0, 0.0, 1.0, 0.0, 0.0]
    hidden, h, batch = bandit(actions, rewards)

    def g_h(c):
        return jax.grad(lambda w: full_batch_loss(hidden, w, batch, c)[0])(h)

    all_tokens = cfg.replace(token_weights_kwargs={"ratio": 1.0, "kl_coef": 1.0})
    r = np.asarray(rewards)
    a = (r - r.mean()) / (r.std() + 1e-6)
    pi = np.asarray(jax.nn.softmax(h[0]))
    want = -np.mean([a_i * (np.eye(6)[k] - pi) for a_i, k in zip(a, actions)], axis=0)
    assert_close(g_h(all_tokens)[0], want, 1e-6)


def test_gpg_alpha_scales_gradient_with_zero_variance_groups():
    # Two prompts: the first all-correct (zero variance, M = 3), the second mixed. B = 6.
    hidden = jnp.ones((6, 1, 1))
    h = jax.random.normal(jax.random.key(1), (1, 4))
    actions = jnp.array([[0], [1], [2], [3], [0], [1]], jnp.int32)
    logp = jax.nn.log_softmax(h[0])[actions]
    batch = {
        "targets_BxT": actions,
        "loss_mask_BxT": jnp.ones((6, 1), bool),
        "old_logps_BxT": logp,
        "rewards_PxG": jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        "valid_PxG": jnp.ones((2, 3), bool),
    }
    cfg = ObjectiveConfig.preset("gpg")
    (loss, m), g_h = jax.value_and_grad(
        lambda w: full_batch_loss(hidden, w, batch, cfg), has_aux=True
    )(h)
    alpha = 6 / (6 - 3)
    a = alpha * np.array([0, 0, 0, 2 / 3, -1 / 3, -1 / 3])
    pi = np.asarray(jax.nn.softmax(h[0]))
    acts = [0, 1, 2, 3, 0, 1]
    want = -np.mean([a_i * (np.eye(4)[k] - pi) for a_i, k in zip(a, acts)], axis=0)
    want_loss = -np.mean(a * np.log(pi[acts]))
    assert float(m["adv/alpha"]) == pytest.approx(alpha)
    assert_close(loss, want_loss, 1e-6)
    assert_close(g_h[0], want, 1e-6)


def test_gpg_preset_is_eq5_per_group_token_mean():
    """GPG eq. (5) by hand on a softmax bandit with unequal group token counts (4 and 3).

    pi = (.1, .2, .3, .4); group 0: rewards (1, 0) -> A = (.5, -.5), |o| = 1, 3; group 1:
    rewards (0, 1) -> A = (-.5, .5), |o| = 2, 1 (alpha = 1: no zero-variance group). Loss
    -A log pi(a) per token: group 0 (-.5 ln .4 + .5 (ln .1 + ln .2 + ln .3)) / 4, group 1
    (.5 * 2 ln .4 - .5 ln .1) / 3, their mean -0.2233146 (one global token mean: -0.2664072).
    """
    h = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    actions = jnp.array([[3, 0, 0], [0, 1, 2], [3, 3, 0], [0, 0, 0]], jnp.int32)
    mask = jnp.arange(3)[None, :] < jnp.array([1, 3, 2, 1])[:, None]
    batch = {
        "targets_BxT": actions,
        "loss_mask_BxT": mask,
        "old_logps_BxT": jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4]))[actions],
        "rewards_PxG": jnp.array([[1.0, 0.0], [0.0, 1.0]]),
        "valid_PxG": jnp.ones((2, 2), bool),
    }
    hidden = jnp.ones((4, 3, 1))
    cfg = ObjectiveConfig.preset("gpg")
    assert cfg.aggregation == "group_token_mean"
    ln = math.log
    g0 = (-0.5 * ln(0.4) + 0.5 * (ln(0.1) + ln(0.2) + ln(0.3))) / 4
    g1 = (0.5 * 2 * ln(0.4) - 0.5 * ln(0.1)) / 3
    loss, _ = full_batch_loss(hidden, h, batch, cfg)
    assert float(loss) == pytest.approx((g0 + g1) / 2, rel=1e-6)
    assert float(loss) == pytest.approx(-0.2233146, rel=1e-6)
    loss_tok, _ = full_batch_loss(hidden, h, batch, cfg.replace(aggregation="token_mean"))
    assert float(loss_tok) == pytest.approx(-0.2664072, rel=1e-6)


@pytest.mark.parametrize("cfg_name", ["grpo", "a_grae"])
def test_agrae_theorem1_logit_update_in_behaviour_space(cfg_name):
    """A-GRAE Theorem 1 (eq. (6)): one SGD step on the logits h of a softmax over behaviours.

    gjax's loss with seq-mean-token-mean over G one-token samples and ratio 1 is
    L = -(1/G) sum_i A_i log pi(b_i), so dL/dh_j = -(1/G) (S_j - C pi_j) with S_j the summed
    advantage of samples equal to b_j and C = sum_i A_i. One step h <- h - lr dL/dh gives
        Delta h_j = (lr / G) (1[b_j in G] S_j - C pi_j)
    i.e. the theorem with eta = lr / G (the aggregation scale): unsampled logits move by
    -(lr/G) C pi_j, and not at all when C = 0 (GRPO's zero-sum advantages).
    """
    actions = [0, 0, 3, 1, 3, 0]  # behaviours 2, 4, 5 unsampled
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # p = 0.5 for the group
    hidden, h, batch = bandit(actions, rewards, n_actions=6, seed=3)
    # A second prompt (all but one wrong) makes omega_s < 1, so A-GRAE's ASS (eq. (13),
    # alpha = 1) shrinks the first group's positive advantages and C != 0 there; for GRPO
    # C stays 0. The second prompt's samples get hidden state 0, so their logits are 0 whatever
    # h is and they add no gradient to h: the update of h is the first group's alone.
    if cfg_name == "a_grae":
        cfg = ObjectiveConfig.preset("a_grae")
    else:
        cfg = ObjectiveConfig.preset("grpo", kl_beta=0.0)
    batch["rewards_PxG"] = jnp.array([rewards, [1.0, 0, 0, 0, 0, 0]])
    g = len(actions)
    hidden = jnp.concatenate([hidden, jnp.zeros((g, 1, 1))])
    batch["targets_BxT"] = jnp.concatenate([batch["targets_BxT"], batch["targets_BxT"]])
    batch["loss_mask_BxT"] = jnp.ones((2 * g, 1), bool)
    batch["valid_PxG"] = jnp.ones((2, g), bool)
    logp2 = jnp.full((g, 1), -math.log(6.0))  # uniform softmax at zero logits
    batch["old_logps_BxT"] = jnp.concatenate([batch["old_logps_BxT"], logp2])
    prep, _ = jax.jit(prepare, static_argnums=1)(batch, cfg)
    adv = np.asarray(prep["adv_BxT"][:g, 0])
    c = adv.sum()
    if cfg_name == "grpo":
        assert abs(c) < 1e-6
    else:
        assert abs(c) > 1e-3
    lr = 0.5
    g_h = jax.grad(lambda w: full_batch_loss(hidden, w, batch, cfg)[0])(h)
    delta = -lr * np.asarray(g_h[0])
    pi = np.asarray(jax.nn.softmax(h[0]))
    n_seq = 2 * g  # seq-mean over both prompts' sequences
    s = np.zeros(6)
    for a_i, k in zip(adv, actions):
        s[k] += a_i
    want = (lr / n_seq) * (s - c * pi)
    assert_close(delta, want, 1e-6)
    unsampled = [2, 4, 5]
    assert_close(delta[unsampled], -(lr / n_seq) * c * pi[unsampled], 1e-6)
    if cfg_name == "grpo":
        assert np.all(np.abs(delta[unsampled]) < 1e-7)
    else:  # ASS shrinks positives: C < 0, unsampled behaviours gain (A-GRAE eq. (36))
        assert c < 0 and np.all(delta[unsampled] > 0)


# ------------------------------------------------------------------ bad input


def test_all_masked_batch_gives_zero_loss_and_zero_grad():
    hidden, head, batch = make_batch()
    batch["loss_mask_BxT"] = jnp.zeros_like(batch["loss_mask_BxT"])
    for name in ("grpo", "dapo"):
        loss, m, (gh, gw) = grads(ObjectiveConfig.preset(name), hidden, head, batch)
        assert float(loss) == 0.0
        assert not np.any(np.asarray(gh)) and not np.any(np.asarray(gw))
        assert all(np.isfinite(np.asarray(v)).all() for v in m.values())


def test_all_invalid_batch_gives_zero_loss():
    hidden, head, batch = make_batch()
    batch["valid_PxG"] = jnp.zeros_like(batch["valid_PxG"])
    loss, m, (gh, gw) = grads(ObjectiveConfig.preset("grpo"), hidden, head, batch)
    assert float(loss) == 0.0 and not np.any(np.asarray(gw))
    assert float(m["count/sequences"]) == 0.0


def test_nonfinite_rewards_make_samples_invalid():
    hidden, head, batch = make_batch()
    bad = dict(batch)
    bad["rewards_PxG"] = batch["rewards_PxG"].at[0, 1].set(jnp.nan).at[2, 0].set(jnp.inf)
    ref = dict(batch)
    ref["valid_PxG"] = batch["valid_PxG"].at[0, 1].set(False).at[2, 0].set(False)
    cfg = ObjectiveConfig.preset("dapo")
    loss, m, (_, gw) = grads(cfg, hidden, head, bad)
    loss_ref, _, (_, gw_ref) = grads(cfg, hidden, head, ref)
    assert np.isfinite(float(loss))
    assert_close(loss, loss_ref)
    assert_close(gw, gw_ref)
    assert float(m["adv/nonfinite"]) == 2.0
    # A non-finite judge score: the DaGRPO estimator drops the sample (A = 0, keep = False);
    # it still counts in the denominators like a masked sample; the loss stays finite.
    bad = dict(batch, scores_PxG=batch["scores_PxG"].at[1, 2].set(jnp.nan))
    loss, m, (gh, gw) = grads(ObjectiveConfig.preset("dagrpo"), hidden, head, bad)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(gw)).all()
    assert float(m["adv/nonfinite"]) == 1.0


def test_shape_and_dtype_errors():
    hidden, head, batch = make_batch()
    cfg = ObjectiveConfig.preset("grpo")
    b = dict(batch)
    del b["old_logps_BxT"]
    with pytest.raises(KeyError, match="old_logps_BxT"):
        full_batch_loss(hidden, head, b, cfg)
    b = dict(batch)
    del b["ref_logps_BxT"]
    with pytest.raises(KeyError, match="ref_logps_BxT"):
        full_batch_loss(hidden, head, b, cfg)  # kl_beta > 0 needs the reference
    full_batch_loss(hidden, head, b, cfg.replace(kl_beta=0.0))  # ...and only then
    b = dict(batch, rewards_PxG=batch["rewards_PxG"].reshape(G, P)[:, :2])
    with pytest.raises(ValueError, match="P\\*G"):
        full_batch_loss(hidden, head, b, cfg)
    b = dict(batch, old_logps_BxT=batch["old_logps_BxT"][:, :-1])
    with pytest.raises(ValueError, match="old_logps_BxT shape"):
        full_batch_loss(hidden, head, b, cfg)
    b = dict(batch, targets_BxT=batch["targets_BxT"].astype(jnp.float32))
    with pytest.raises(TypeError, match="integer"):
        full_batch_loss(hidden, head, b, cfg)
    with pytest.raises(ValueError, match="hidden_BxTxD"):
        full_batch_loss(hidden[:, :-1], head, batch, cfg)
    with pytest.raises(ValueError, match="head_DxV"):
        full_batch_loss(hidden, head[:-1], batch, cfg)
    # G = 1: group-relative advantages are undefined.
    h1, w1, b1 = make_batch(p=4, g=1)
    with pytest.raises(ValueError, match="G >= 2"):
        full_batch_loss(h1, w1, b1, cfg)


def test_config_errors():
    with pytest.raises(KeyError, match="valid names"):
        ObjectiveConfig(advantage="ppo")
    with pytest.raises(KeyError, match="valid names"):
        ObjectiveConfig(aggregation="mean")
    with pytest.raises(KeyError, match="valid names"):
        ObjectiveConfig(token_weights="cw")
    with pytest.raises(ValueError, match="eps_low"):
        ObjectiveConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="kl_beta"):
        ObjectiveConfig(kl_beta=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        ObjectiveConfig(temperature=0.0)
    with pytest.raises(ValueError, match="anchor_treatment"):
        ObjectiveConfig(anchor_treatment="sft")
    with pytest.raises(ValueError, match="gspo"):
        ObjectiveConfig(policy_loss="gspo", token_weights="cw_gaussian")
    with pytest.raises(ValueError, match="dual_clip"):
        ObjectiveConfig(policy_loss="pg", dual_clip=3.0)
    with pytest.raises(TypeError):
        ObjectiveConfig(advantage_kwargs={"x": [1, 2]})  # unhashable static kwargs
    # Out-of-range estimator hyperparameters fail at trace time.
    hidden, head, batch = make_batch()
    with pytest.raises(ValueError, match="delta"):
        full_batch_loss(
            hidden, head, batch, ObjectiveConfig.preset("dagrpo", advantage_kwargs={"delta": -1.0})
        )
    with pytest.raises(ValueError, match="alpha"):
        full_batch_loss(
            hidden, head, batch, ObjectiveConfig.preset("a_grae", advantage_kwargs={"alpha": 2.0})
        )
    with pytest.raises(ValueError, match="rng"):
        full_batch_loss(hidden, head, batch, ObjectiveConfig.preset("clip_cov"))


# ------------------------------------------------------------------ peer parity (Liger-Kernel)

LIGER_CASES = [
    ("grpo", {"loss_type": "grpo"}, {}),  # seq-mean-token-mean + k3 KL (beta 0.04)
    ("grpo", {"loss_type": "grpo"}, {"temperature": 0.7}),
    ("dapo", {"loss_type": "dapo"}, {}),  # token mean, clip-higher
    ("dr_grpo", {"loss_type": "dr_grpo", "max_completion_length": T}, {}),
    ("gspo", {"loss_type": "grpo", "importance_sampling_level": "sequence"},
     {"eps_low": 0.05, "eps_high": 0.08}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("preset,liger_kw,overrides", LIGER_CASES)
def test_matches_liger_fused_linear_grpo_loss(preset, liger_kw, overrides):
    """Loss and gradients equal Liger-Kernel's LigerFusedLinearGRPOLoss (TRL semantics) on the
    same inputs: an independent implementation of the aggregation modes, clip-higher, the k3
    KL, temperature and GSPO's sequence-level ratio."""
    torch = pytest.importorskip("torch")
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    cfg = ObjectiveConfig.preset(preset, **overrides)
    hidden, head, batch = make_batch(seed=2, stale=0.1)
    for k in ("scores_PxG", "is_anchor_PxG"):
        batch.pop(k)
    loss, _, (gh, gw) = grads(cfg, hidden, head, batch)
    prep, _ = jax.jit(prepare, static_argnums=1)(batch, cfg)
    adv_B = np.asarray(prep["adv_BxT"][:, 0])  # same advantages in both (all lengths >= 1)
    peer = liger.LigerFusedLinearGRPOLoss(
        beta=cfg.kl_beta,
        compiled=False,
        use_ref_model=cfg.kl_beta > 0,
        epsilon_low=cfg.eps_low,
        epsilon_high=cfg.eps_high,
        temperature=cfg.temperature,
        **liger_kw,
    )
    x = torch.tensor(np.asarray(hidden), requires_grad=True)
    w = torch.tensor(np.asarray(head).T.copy(), requires_grad=True)  # torch Linear: [V, D]
    out = peer(
        x,
        w,
        torch.tensor(np.asarray(batch["targets_BxT"]).astype(np.int64)),
        torch.tensor(np.asarray(batch["loss_mask_BxT"]).astype(np.int64)),
        torch.tensor(adv_B),
        ref_per_token_logps=torch.tensor(np.asarray(batch["ref_logps_BxT"])),
        old_per_token_logps=torch.tensor(np.asarray(batch["old_logps_BxT"])),
    )
    peer_loss = out[0] if isinstance(out, tuple) else out
    peer_loss.backward()
    assert_close(loss, peer_loss.detach().numpy())
    assert_close(gh, x.grad.numpy())
    assert_close(gw, w.grad.numpy().T)
