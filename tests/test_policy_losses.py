"""Golden values for the per-token policy losses, KL estimators and aggregation weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.objective import aggregation as agg
from gjax.objective import policy_losses as pl


def _f(x):
    return jnp.asarray(x, jnp.float32)


def _ppo_case(ratio, adv, **kw):
    logp = _f([math.log(ratio)])
    loss, aux = pl.ppo_clip(logp, _f([0.0]), _f([adv]), **kw)
    grad = jax.grad(lambda lp: pl.ppo_clip(lp, _f([0.0]), _f([adv]), **kw)[0].sum())(logp)
    return float(loss[0]), float(grad[0]), {k: float(v[0]) for k, v in aux.items()}


@pytest.mark.parametrize(
    "ratio,adv,want_loss,want_grad,flag",
    [
        # inside the clip range: loss -rA, d/dlogp = -rA
        (1.1, 2.0, -2.2, -2.2, None),
        (0.9, -1.0, 0.9, 0.9, None),
        # A > 0 above 1 + eps_high = 1.28: flat at -(1.28) A
        (1.5, 2.0, -2.56, 0.0, "clip_high"),
        # A > 0 below 1 - eps_low: pessimistic min keeps rA (gradient flows)
        (0.5, 2.0, -1.0, -1.0, None),
        # A < 0 below 1 - eps_low = 0.8: flat at 0.8 |A|
        (0.5, -1.0, 0.8, 0.0, "clip_low"),
        # A < 0 above 1 + eps_high: unclipped r|A| is larger and kept
        (2.0, -1.0, 2.0, 2.0, None),
    ],
)
def test_ppo_clip_golden(ratio, adv, want_loss, want_grad, flag):
    loss, grad, aux = _ppo_case(ratio, adv, eps_low=0.2, eps_high=0.28)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert grad == pytest.approx(want_grad, rel=1e-5, abs=1e-7)
    for name in ("clip_low", "clip_high", "clip_dual"):
        assert aux[name] == (1.0 if name == flag else 0.0)
    assert aux["ratio"] == pytest.approx(ratio, rel=1e-6)


def test_dual_clip_caps_negative_advantage():
    # A = -1, r = 5 > c = 3: loss capped at c|A| = 3 with zero gradient.
    loss, grad, aux = _ppo_case(5.0, -1.0, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and aux["clip_dual"] == 1.0
    # r = 2 < c: untouched (loss r|A| = 2, gradient r|A|).
    loss, grad, aux = _ppo_case(2.0, -1.0, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and aux["clip_dual"] == 0.0
    # Positive advantages are never dual-clipped.
    loss, grad, _ = _ppo_case(5.0, 1.0, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0


def test_bad_eps_raise():
    with pytest.raises(ValueError, match="eps_low"):
        pl.ppo_clip(_f([0.0]), _f([0.0]), _f([1.0]), eps_low=1.5)
    with pytest.raises(ValueError, match="dual_clip"):
        pl.ppo_clip(_f([0.0]), _f([0.0]), _f([1.0]), dual_clip=0.5)
    with pytest.raises(ValueError, match="gamma"):
        pl.luffy(_f([0.0]), _f([0.0]), _f([1.0]), gamma=0.0)


def test_ratio_never_overflows():
    loss, aux = pl.ppo_clip(_f([0.0]), _f([-1e4]), _f([-1.0]))
    assert np.isfinite(loss).all() and np.isfinite(aux["ratio"]).all()


def test_pg_is_minus_logp_times_adv():
    logp, adv = _f([-0.5, -2.0]), _f([1.5, -0.5])
    loss, _ = pl.pg(logp, _f([0.0, 0.0]), adv)
    np.testing.assert_allclose(loss, [0.75, -1.0], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: pl.pg(x, logp, adv)[0].sum())(logp), -adv)


def test_luffy_shaping_value_and_gradient():
    gamma, a = 0.1, 2.0
    logp = _f([math.log(0.3)])
    loss, _ = pl.luffy(logp, _f([0.0]), _f([a]), gamma=gamma)
    assert float(loss[0]) == pytest.approx(-a * 0.3 / 0.4, rel=1e-6)
    g = jax.grad(lambda x: pl.luffy(x, _f([0.0]), _f([a]), gamma=gamma)[0].sum())(logp)
    # d/dlogp [-A pi/(pi+g)] = -A g pi / (pi+g)^2
    assert float(g[0]) == pytest.approx(-a * gamma * 0.3 / 0.4**2, rel=1e-5)


def test_gspo_surrogate_value_and_gradient_match_sequence_objective():
    # One sequence of 3 tokens; GSPO objective L(s) with s = exp(mean(logp - old)).
    old = _f([-1.0, -0.5, -2.0])
    for delta, adv, eps in [(0.01, 1.0, 0.2), (-0.01, -1.0, 0.2), (0.5, 1.0, 0.2), (-0.5, -1, 0.2)]:
        logp = old + _f([delta, 2 * delta, 0.0])
        adv_t = jnp.full((3,), adv, jnp.float32)

        def exact(lp, adv_t=adv_t, eps=eps):
            s = jnp.exp(jnp.mean(lp - old))
            return jnp.maximum(-s * adv_t[0], -jnp.clip(s, 1 - eps, 1 + eps) * adv_t[0])

        def surrogate(lp, adv_t=adv_t, eps=eps):
            log_s = jax.lax.stop_gradient(jnp.mean(lp - old))
            loss, _ = pl.gspo(
                lp, old, adv_t, seq_log_ratio=jnp.full((3,), log_s), eps_low=eps, eps_high=eps
            )
            return (loss / 3.0).sum()  # seq-mean-token-mean weight 1/|y| for one sequence

        assert float(surrogate(logp)) == pytest.approx(float(exact(logp)), rel=1e-6)
        np.testing.assert_allclose(
            jax.grad(surrogate)(logp), jax.grad(exact)(logp), rtol=1e-6, atol=1e-8
        )


@pytest.mark.parametrize(
    "ratio,adv,eps_low,want_weight",
    [
        (1.1, 2.0, 1.0, 1.1),  # inside the range: weight r
        (1.5, 2.0, 1.0, 1.28),  # above 1 + eps_high: weight 1.28, the gradient stays
        (1.5, -1.0, 1.0, 1.28),  # either sign of A (PPO would zero A > 0 only)
        (0.1, -1.0, 1.0, 0.1),  # eps_low = 1: no lower bound (MiniMax-M1)
        (0.1, -1.0, 0.2, 0.8),  # a lower bound when asked
    ],
)
def test_cispo_golden(ratio, adv, eps_low, want_weight):
    """MiniMax-M1 eqs. (4)-(5): loss = -sg(clip(r)) A log pi, d/dlogp = -clip(r) A."""
    old = _f([math.log(0.2)])
    logp = old + math.log(ratio)

    def f(lp):
        return pl.cispo(lp, old, _f([adv]), eps_low=eps_low, eps_high=0.28)[0].sum()

    assert float(f(logp)) == pytest.approx(-want_weight * adv * float(logp[0]), rel=1e-5)
    assert float(jax.grad(f)(logp)[0]) == pytest.approx(-want_weight * adv, rel=1e-5)
    _, aux = pl.cispo(logp, old, _f([adv]), eps_low=eps_low, eps_high=0.28)
    assert float(aux["clip_high"][0]) == float(ratio > 1.28)
    assert float(aux["clip_low"][0]) == float(ratio < 1 - eps_low)


def test_cispo_matches_numpy_reference_and_its_gradient_is_the_clipped_weight():
    rng = np.random.default_rng(0)
    old = rng.normal(-2.0, 1.0, 64).astype(np.float32)
    logp = (old + rng.normal(0.0, 0.5, 64)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, 64).astype(np.float32)
    w = np.clip(np.exp(logp.astype(np.float64) - old), 1 - 0.2, 1 + 0.28)
    loss, _ = pl.cispo(_f(logp), _f(old), _f(adv), eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(loss, -w * adv * logp, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda x: pl.cispo(x, _f(old), _f(adv), eps_low=0.2, eps_high=0.28)[0].sum())
    np.testing.assert_allclose(g(_f(logp)), -w * adv, rtol=1e-5, atol=1e-7)
    # Not the gradient of the value with the weight differentiated (stop-gradient matters).
    full = jax.grad(lambda x: (-jnp.clip(jnp.exp(x - old), 0.8, 1.28) * adv * x).sum())
    assert not np.allclose(g(_f(logp)), full(_f(logp)), rtol=1e-3)
    with pytest.raises(ValueError, match=r"eps_low must be in \[0, 1\] \(1: no lower bound\)"):
        pl.cispo(_f([0.0]), _f([0.0]), _f([1.0]), eps_low=1.5)
    with pytest.raises(ValueError, match=r"eps_low must be in \[0, 1\)"):
        pl.ppo_clip(_f([0.0]), _f([0.0]), _f([1.0]), eps_low=1.0)


def test_ratio_loss_is_unclipped():
    logp, old, adv = _f([math.log(3.0), math.log(0.1)]), _f([0.0, 0.0]), _f([1.0, -2.0])
    loss, aux = pl.ratio_pg(logp, old, adv)
    np.testing.assert_allclose(loss, [-3.0, 0.2], rtol=1e-6)
    g = jax.grad(lambda x: pl.ratio_pg(x, old, adv)[0].sum())(logp)
    np.testing.assert_allclose(g, [-3.0, 0.2], rtol=1e-6)  # d(-rA)/dlogp = -rA
    assert float(aux["clip_high"].sum()) == 0.0


def test_abs_log_ratio_has_no_gradient_on_policy():
    """KL-Cov's |log pi - log pi_old|: value |x|, gradient sign(x), 0 at x = 0 (jnp.abs: +1)."""
    old = _f([-1.0, -1.0, -1.0])
    logp = old + _f([0.0, 0.3, -0.3])
    np.testing.assert_allclose(pl.abs_log_ratio(logp, old), [0.0, 0.3, 0.3], atol=1e-6)
    g = jax.grad(lambda x: pl.abs_log_ratio(x, old).sum())(logp)
    np.testing.assert_array_equal(g, [0.0, 1.0, -1.0])
    assert float(jax.grad(lambda x: jnp.abs(x - old).sum())(old)[0]) == 1.0  # the old bug


def test_kl_estimators_golden():
    # logp = log 0.5, ref = log 0.25: log rho = log 0.5
    logp, ref = _f([math.log(0.5)]), _f([math.log(0.25)])
    lr = math.log(0.5)
    assert float(pl.KL_ESTIMATORS.get("k1")(logp, ref)[0]) == pytest.approx(-lr, rel=1e-6)
    assert float(pl.KL_ESTIMATORS.get("k2")(logp, ref)[0]) == pytest.approx(0.5 * lr * lr, rel=1e-6)
    assert float(pl.KL_ESTIMATORS.get("k3")(logp, ref)[0]) == pytest.approx(0.5 - 1 - lr, rel=1e-6)
    # All vanish at pi = pi_ref; k2/k3 are non-negative.
    for name in pl.KL_ESTIMATORS:
        assert float(pl.KL_ESTIMATORS.get(name)(ref, ref)[0]) == 0.0
    x = jnp.linspace(-3, 3, 13)
    assert (pl.kl_k2(x, -x) >= 0).all() and (pl.kl_k3(x, -x) >= 0).all()


def test_registries_are_strict():
    assert pl.POLICY_LOSSES.names() == ["cispo", "gspo", "luffy", "pg", "ppo_clip", "ratio"]
    assert pl.KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(KeyError, match="valid names"):
        pl.POLICY_LOSSES.get("ppo")


def test_aggregation_weights_golden():
    mask = _f([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    counted = jnp.array([True, True, True])
    w = agg.aggregation_weights("token_mean", mask, counted)
    np.testing.assert_allclose(w, mask / 4.0)
    w = agg.aggregation_weights("seq_mean_token_mean", mask, counted)
    np.testing.assert_allclose(w, mask * _f([[1 / 6], [1 / 2], [0]]))
    w = agg.aggregation_weights("seq_mean_token_sum_norm", mask, counted, constant=8)
    np.testing.assert_allclose(w, mask / 16.0)
    w = agg.aggregation_weights("seq_mean_token_sum_norm", mask, counted)  # C = T = 4
    np.testing.assert_allclose(w, mask / 8.0)
    # An uncounted sequence drops out of numerator and denominators.
    w = agg.aggregation_weights("token_mean", mask, jnp.array([True, False, True]))
    np.testing.assert_allclose(w, mask * _f([[1], [0], [0]]) / 3.0)


@pytest.mark.parametrize("mode", agg.AGGREGATIONS.names())
def test_all_masked_aggregation_is_zero_not_nan(mode):
    w = agg.aggregation_weights(
        mode, jnp.zeros((2, 3)), jnp.ones((2,), bool), group_B=jnp.array([0, 0])
    )
    assert np.array_equal(w, np.zeros((2, 3)))


def test_group_token_mean_is_gpg_eq5_by_hand():
    """GPG eq. (5): each group's token sum over ITS token count, then the mean over groups.

    Group 0: |o| = 1, 3 (N_0 = 4); group 1: |o| = 2, 1 (N_1 = 3). Per-token losses are
    constant per sequence: 2 | -1 || 1 | 0.5. Eq. (5): ((2 - 3) / 4 + (2 + 0.5) / 3) / 2
    = (-0.25 + 0.8333...) / 2 = 0.2916...; one global token mean: (-1 + 2.5) / 7 = 0.2142...
    """
    mask = jnp.arange(3)[None, :] < jnp.array([1, 3, 2, 1])[:, None]
    ell = _f([[2.0], [-1.0], [1.0], [0.5]]) * jnp.ones((1, 3))
    w = agg.aggregation_weights("group_token_mean", mask, group_B=jnp.array([0, 0, 1, 1]))
    np.testing.assert_allclose(w, mask * _f([[1 / 8], [1 / 8], [1 / 6], [1 / 6]]), rtol=1e-7)
    np.testing.assert_allclose(jnp.sum(w * ell), (-0.25 + 2.5 / 3) / 2, rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(w * ell), 0.2916667, rtol=1e-6)
    tok = agg.aggregation_weights("token_mean", mask)
    np.testing.assert_allclose(jnp.sum(tok * ell), 1.5 / 7, rtol=1e-6)
    # Labels are names only; an uncounted sequence leaves its group's count; an emptied group
    # leaves the mean over groups.
    w2 = agg.aggregation_weights("group_token_mean", mask, group_B=jnp.array([9, 9, 4, 4]))
    np.testing.assert_array_equal(w2, w)
    w3 = agg.aggregation_weights(
        "group_token_mean",
        mask,
        jnp.array([True, False, True, True]),
        group_B=jnp.array([0, 0, 1, 1]),
    )
    np.testing.assert_allclose(w3, mask * _f([[1 / 2], [0], [1 / 6], [1 / 6]]), rtol=1e-7)
    w4 = agg.aggregation_weights(
        "group_token_mean",
        mask,
        jnp.array([False, False, True, True]),
        group_B=jnp.array([0, 0, 1, 1]),
    )
    np.testing.assert_allclose(w4, mask * _f([[0], [0], [1 / 3], [1 / 3]]), rtol=1e-7)
    with pytest.raises(ValueError, match="group_B"):
        agg.aggregation_weights("group_token_mean", mask)


def test_aggregation_bad_input():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        agg.aggregation_weights("token_mean", jnp.ones((3,)))
    with pytest.raises(ValueError, match="constant"):
        agg.aggregation_weights("seq_mean_token_sum_norm", jnp.ones((2, 3)), constant=0.0)
    with pytest.raises(KeyError, match="valid names"):
        agg.aggregation_weights("seq_mean", jnp.ones((2, 3)))
