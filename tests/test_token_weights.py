"""Token weights (CW-GRPO Sec. 2.3, Clip-Cov, KL-Cov) against hand-computed values."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.objective.token_weights import TOKEN_WEIGHTS, compute_token_weights, token_covariance

KEY = jax.random.PRNGKey(0)


def _random_batch(seed=0, b=4, t=12):
    rng = np.random.default_rng(seed)
    lp = -rng.exponential(1.5, (b, t)).astype(np.float32)
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1).astype(np.float32)
    lengths = rng.integers(3, t + 1, size=b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    return jnp.asarray(lp), jnp.asarray(adv), jnp.asarray(mask)


# ----------------------------------------------------------------------------- CW-GRPO


def test_cw_gaussian_golden_with_padding():
    # Valid tokens: logp (-1, -2 | -3, -2), A (1, 1 | -1, -1). Means over valid tokens: -2, 0.
    # c = (1*1, 0*1, -1*-1, 0*-1) = (1, 0, 1, 0); mean 1/2, sigma = 1/2.
    # w = exp(-c^2 / (2 * 1/4)) = (e^-2, 1, e^-2, 1); w~ = w * 4 / (2 + 2 e^-2).
    lp = jnp.asarray([[-1.0, -2.0, 7.0], [-3.0, -2.0, -50.0]])
    adv = jnp.asarray([[1.0, 1.0, 9.0], [-1.0, -1.0, 9.0]])
    mask = jnp.asarray([[1, 1, 0], [1, 1, 0]], jnp.float32)
    out = TOKEN_WEIGHTS.get("cw_gaussian")(lp, adv, mask)
    lo, hi = 4 * math.exp(-2) / (2 + 2 * math.exp(-2)), 4 / (2 + 2 * math.exp(-2))
    np.testing.assert_allclose(out.w_BxT, [[lo, hi, 0.0], [lo, hi, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(out.metrics["w_mean"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["w_min"], lo, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["w_max"], hi, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["cov_std"], 0.5, rtol=1e-6)
    assert float(jnp.abs(out.kl_coef_BxT).sum()) == 0.0


# Two groups of G = 2 (T = 2, 9 marks padding). Group 0: logp (0, -1 | -2), A (1, 1 | -1);
# group 1: logp (-3, -3 | -1), A (.5, .5 | -.5).
CW_LP = jnp.asarray([[0.0, -1.0], [-2.0, 9.0], [-3.0, -3.0], [-1.0, 9.0]])
CW_ADV = jnp.asarray([1.0, -1.0, 0.5, -0.5])
CW_MASK = jnp.asarray([[1, 1], [1, 0], [1, 1], [1, 0]])


def test_cw_gaussian_per_group_golden():
    """CW-GRPO Sec. 2.3 per group (N = sum_{j=1..G} |o_j|), by hand.

    Group 0: mean logp -1, mean A 1/3; c = (1 * 2/3, 0, -1 * -4/3) = (2/3, 0, 4/3); mean 2/3,
    sigma^2 = 8/27, so c^2 / (2 sigma^2) = (3/4, 0, 3) and w~ = 3 (e^-.75, 1, e^-3) / S0 with
    S0 = 1 + e^-.75 + e^-3. Group 1: mean logp -7/3, mean A 1/6; c = (-2/9, -2/9, -8/9),
    sigma^2 = 8/81, exponents (1/4, 1/4, 4): w~ = 3 (e^-.25, e^-.25, e^-4) / S1.
    """
    out = TOKEN_WEIGHTS.get("cw_gaussian")(CW_LP, CW_ADV, CW_MASK, group_size=2)
    e = math.exp
    s0, s1 = 1 + e(-0.75) + e(-3), 2 * e(-0.25) + e(-4)
    want = [
        [3 * e(-0.75) / s0, 3 / s0],  # 0.93098, 1.97089
        [3 * e(-3) / s0, 0.0],  # 0.09812
        [3 * e(-0.25) / s1, 3 * e(-0.25) / s1],  # 1.48257
        [3 * e(-4) / s1, 0.0],  # 0.03487
    ]
    np.testing.assert_allclose(out.w_BxT, want, rtol=1e-6)
    w = np.asarray(out.w_BxT)
    assert w[:2].sum() / 3 == pytest.approx(1.0, rel=1e-6)  # mean 1 in EACH group
    assert w[2:].sum() / 3 == pytest.approx(1.0, rel=1e-6)
    assert float(out.metrics["cov_std"]) == pytest.approx(
        (math.sqrt(8 / 27) + math.sqrt(8 / 81)) / 2, rel=1e-6
    )


def test_cw_gaussian_batch_scope_is_the_whole_batch():
    """scope='batch' (the batch-wide reading): one set of statistics over all 6 tokens, so the
    groups' mean weights differ from 1 (0.804 and 1.196 here)."""
    out = TOKEN_WEIGHTS.get("cw_gaussian")(CW_LP, CW_ADV, CW_MASK, group_size=2, scope="batch")
    lp = np.array([0, -1, -2, -3, -3, -1.0])
    a = np.array([1, 1, -1, 0.5, 0.5, -0.5])
    c = (lp - lp.mean()) * (a - a.mean())
    w = np.exp(-(c**2) / (2 * c.var()))
    w = w * 6 / w.sum()
    got = np.asarray(out.w_BxT)[np.asarray(CW_MASK) > 0]
    np.testing.assert_allclose(got, w, rtol=1e-6)
    assert got[:3].mean() == pytest.approx(0.8039487, rel=1e-6)
    assert got[3:].mean() == pytest.approx(1.1960513, rel=1e-6)
    # No group_size: the whole batch is one group, whatever the scope.
    one = TOKEN_WEIGHTS.get("cw_gaussian")(CW_LP, CW_ADV, CW_MASK)
    np.testing.assert_array_equal(one.w_BxT, out.w_BxT)
    with pytest.raises(ValueError, match="scope"):
        TOKEN_WEIGHTS.get("cw_gaussian")(CW_LP, CW_ADV, CW_MASK, scope="prompt")
    with pytest.raises(ValueError, match="group_size"):
        TOKEN_WEIGHTS.get("cw_gaussian")(CW_LP, CW_ADV, CW_MASK, group_size=3)


def test_cw_grpo_preset_and_config_weight_per_group():
    """The cw_grpo objective (and configs/cw_grpo.py) default to the paper's per-group scope:
    prepare on two groups gives mean weight 1 in each; scope='batch' does not."""
    from configs import cw_grpo
    from gjax.objective.loss import ObjectiveConfig, prepare

    assert cw_grpo.get_config().objective.token_weights_kwargs.scope == "group"
    rng = np.random.default_rng(0)
    lengths = np.array([2, 6, 3, 5, 6, 6, 1, 4])
    batch = {
        "targets_BxT": jnp.zeros((8, 6), jnp.int32),
        "loss_mask_BxT": jnp.asarray(np.arange(6)[None, :] < lengths[:, None]),
        "old_logps_BxT": jnp.asarray(-rng.exponential(1.5, (8, 6)), jnp.float32),
        "rewards_PxG": jnp.array([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]),
        "valid_PxG": jnp.ones((2, 4), bool),
    }
    for scope, per_group in (("group", True), ("batch", False)):
        cfg = ObjectiveConfig.preset("cw_grpo", kl_beta=0.0)
        if scope == "batch":
            cfg = cfg.replace(token_weights_kwargs={"scope": "batch"})
        prep, _ = prepare(batch, cfg)
        plain, _ = prepare(batch, cfg.replace(token_weights=None, token_weights_kwargs=()))
        m = np.asarray(prep["mask_BxT"]) > 0
        w = np.asarray(prep["adv_BxT"])[m] / np.asarray(plain["adv_BxT"])[m]
        g = np.repeat(np.arange(2), 4)[:, None].repeat(6, 1)[m]
        means = [w[g == k].mean() for k in range(2)]
        if per_group:
            np.testing.assert_allclose(means, [1.0, 1.0], rtol=1e-5)
        else:
            assert w.mean() == pytest.approx(1.0, rel=1e-5)
            assert abs(means[0] - 1.0) > 1e-2


def test_cw_mean_one_and_extreme_covariance_smallest():
    lp, adv, mask = _random_batch(1)
    out = TOKEN_WEIGHTS.get("cw_gaussian")(lp, adv, mask)
    w, m = np.asarray(out.w_BxT), np.asarray(mask)
    np.testing.assert_allclose(w[m].mean(), 1.0, rtol=1e-6)
    assert np.all(w[~m] == 0.0)
    c = np.abs(np.asarray(token_covariance(lp, adv, mask)))[m]
    order = np.argsort(c)  # increasing |c| -> non-increasing weight
    assert np.all(np.diff(w[m][order]) <= 1e-7)
    assert w[m][np.argmax(c)] == w[m].min()


def test_cw_padding_values_and_extra_padding_do_not_change_weights():
    lp, adv, mask = _random_batch(2)
    base = TOKEN_WEIGHTS.get("cw_gaussian")(lp, adv, mask).w_BxT
    junk = jnp.where(mask, lp, jnp.nan), jnp.where(mask, adv, 1e6)
    pad = [(0, 0), (0, 5)]
    lp2, adv2 = jnp.pad(junk[0], pad, constant_values=3.0), jnp.pad(junk[1], pad)
    mask2 = jnp.pad(mask, pad)
    out = TOKEN_WEIGHTS.get("cw_gaussian")(lp2, adv2, mask2)
    np.testing.assert_allclose(out.w_BxT[:, :12], base, rtol=1e-6)
    assert np.all(np.asarray(out.w_BxT[:, 12:]) == 0.0)
    assert float(out.metrics["nonfinite_tokens"]) == 0.0


def test_per_sequence_adv_broadcasts():
    lp, adv, mask = _random_batch(3)
    a = TOKEN_WEIGHTS.get("cw_gaussian")(lp, adv, mask).w_BxT
    b = TOKEN_WEIGHTS.get("cw_gaussian")(lp, adv[:, 0], mask).w_BxT
    np.testing.assert_array_equal(a, b)


def test_cw_sigma_zero_gives_unit_weights():
    lp = jnp.full((2, 3), -1.0)  # all logp equal -> c = 0 everywhere
    out = TOKEN_WEIGHTS.get("cw_gaussian")(lp, jnp.ones((2, 3)), jnp.ones((2, 3)))
    np.testing.assert_allclose(out.w_BxT, 1.0)


@pytest.mark.parametrize("name", ["none", "cw_gaussian", "clip_cov", "kl_cov"])
def test_no_gradient_through_weights(name):
    lp, adv, mask = _random_batch(4)
    hp = {"clip_cov": {"ratio": 0.2, "omega_low": 0.0}, "kl_cov": {"ratio": 0.2}}.get(name, {})

    def f(lp, adv):
        out = compute_token_weights(name, lp, adv, mask, rng=KEY, **hp)
        return jnp.sum(out.w_BxT * 3.0) + jnp.sum(out.kl_coef_BxT**2)

    g_lp, g_adv = jax.grad(f, argnums=(0, 1))(lp, adv)
    assert np.all(np.asarray(g_lp) == 0.0) and np.all(np.asarray(g_adv) == 0.0)


# ------------------------------------------------------------------------ Clip-Cov / KL-Cov
# One row, logp deviations d and per-token advantages +-1 (both mean 0 over the 8 valid
# tokens), so c = d * A by hand. The 9th token is padding with an absurd logp.
D = [3.0, -2.5, 2.0, -1.5, 1.0, -0.5, 0.25, -1.75]
A = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
C = [3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.25, 1.75]
LP = jnp.asarray([[d - 2.0 for d in D] + [40.0]])
ADV = jnp.asarray([A + [-30.0]])
MASK = jnp.asarray([[1] * 8 + [0]])


def test_covariance_by_hand():
    np.testing.assert_allclose(token_covariance(LP, ADV, MASK.astype(bool)), [C + [0.0]])


def test_clip_cov_detaches_k_random_tokens_inside_band():
    # Band (1, 5) strictly: c in {3, 2.5, 2, 1.5, 1.75} -> tokens {0, 1, 2, 3, 7}.
    # ratio 0.25: k = floor(0.25 * 8) = 2 detached tokens.
    band = {0, 1, 2, 3, 7}
    seen = set()
    for seed in range(12):
        out = TOKEN_WEIGHTS.get("clip_cov")(
            LP, ADV, MASK, rng=jax.random.PRNGKey(seed), ratio=0.25, omega_low=1.0, omega_high=5.0
        )
        w = np.asarray(out.w_BxT[0])
        zero = set(np.flatnonzero(w[:8] == 0.0).tolist())
        assert len(zero) == 2 and zero <= band
        assert w[8] == 0.0 and np.all(w[:8][[i for i in range(8) if i not in zero]] == 1.0)
        np.testing.assert_allclose(out.metrics["clip_cov_fraction"], 2 / 8)
        assert float(out.metrics["clip_cov_candidates"]) == 5
        seen |= zero
    assert seen == band  # the choice is random over the whole band


def test_clip_cov_count_floor_and_minimum_one():
    kw = dict(rng=KEY, omega_low=1.0, omega_high=5.0)
    tiny = TOKEN_WEIGHTS.get("clip_cov")(LP, ADV, MASK, ratio=1e-4, **kw)  # max(floor(8e-4), 1)
    assert int(jnp.sum(tiny.w_BxT[0, :8] == 0)) == 1
    full = TOKEN_WEIGHTS.get("clip_cov")(LP, ADV, MASK, ratio=1.0, **kw)  # k = 8 > 5 candidates
    np.testing.assert_array_equal(full.w_BxT[0], [0, 0, 0, 0, 1, 1, 1, 0, 0])
    same = TOKEN_WEIGHTS.get("clip_cov")(LP, ADV, MASK, ratio=0.25, **kw)
    again = TOKEN_WEIGHTS.get("clip_cov")(LP, ADV, MASK, ratio=0.25, **kw)
    np.testing.assert_array_equal(same.w_BxT, again.w_BxT)  # deterministic given the key


@pytest.mark.parametrize(
    "ratio,selected", [(0.25, [0, 1]), (0.375, [0, 1, 2]), (0.5, [0, 1, 2, 7]), (1e-4, [0])]
)
def test_kl_cov_top_k_by_covariance(ratio, selected):
    out = TOKEN_WEIGHTS.get("kl_cov")(LP, ADV, MASK, ratio=ratio, kl_coef=0.7)
    expect = np.zeros(9, np.float32)
    expect[selected] = 0.7
    np.testing.assert_allclose(out.kl_coef_BxT[0], expect)
    np.testing.assert_array_equal(out.w_BxT[0], [1] * 8 + [0])
    np.testing.assert_allclose(out.metrics["kl_cov_fraction"], len(selected) / 8)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("name", TOKEN_WEIGHTS.names())
def test_all_masked_and_nonfinite_tokens(name):
    lp, adv, mask = _random_batch(5)
    out = compute_token_weights(name, lp, adv, jnp.zeros_like(mask), rng=KEY)
    assert np.all(np.asarray(out.w_BxT) == 0) and np.all(np.asarray(out.kl_coef_BxT) == 0)
    assert all(np.isfinite(float(v)) for v in out.metrics.values())
    # A NaN logp on a valid token: that token is dropped (weight 0) and counted.
    bad = lp.at[0, 0].set(jnp.nan)
    out = compute_token_weights(name, bad, adv, mask, rng=KEY)
    ref = compute_token_weights(name, lp, adv, mask.at[0, 0].set(False), rng=KEY)
    np.testing.assert_allclose(out.w_BxT, ref.w_BxT, rtol=1e-6)
    assert float(out.metrics["nonfinite_tokens"]) == 1.0


def test_bad_inputs_raise():
    lp, adv, mask = _random_batch(6)
    with pytest.raises(ValueError, match="loss_mask_BxT shape"):
        compute_token_weights("cw_gaussian", lp, adv, mask[:, :5])
    with pytest.raises(ValueError, match="adv must be"):
        compute_token_weights("cw_gaussian", lp, adv[:2], mask)
    with pytest.raises(TypeError, match="floating"):
        compute_token_weights("cw_gaussian", lp.astype(jnp.int32), adv, mask)
    with pytest.raises(ValueError, match="2-D"):
        compute_token_weights("cw_gaussian", lp[0], adv[0], mask[0])
    with pytest.raises(ValueError, match="rng"):
        compute_token_weights("clip_cov", lp, adv, mask)
    with pytest.raises(ValueError, match="ratio"):
        compute_token_weights("kl_cov", lp, adv, mask, ratio=1.5)
    with pytest.raises(ValueError, match="omega_low"):
        compute_token_weights("clip_cov", lp, adv, mask, rng=KEY, omega_low=5.0, omega_high=1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_token_weights("kl_cov", lp, adv, mask, kl_coef=-1.0)
    with pytest.raises(KeyError, match="valid names"):
        compute_token_weights("gaussian", lp, adv, mask)


def test_jit_matches_eager():
    lp, adv, mask = _random_batch(7)
    for name in TOKEN_WEIGHTS:
        eager = compute_token_weights(name, lp, adv, mask, rng=KEY)
        jitted = jax.jit(
            lambda lp, a, m, k, name=name: compute_token_weights(name, lp, a, m, rng=k)
        )
        out = jitted(lp, adv, mask, KEY)
        np.testing.assert_allclose(out.w_BxT, eager.w_BxT, rtol=1e-6)
        np.testing.assert_allclose(out.kl_coef_BxT, eager.kl_coef_BxT)


# ----------------------------------------------------------- covariance percentiles (Table 1)


def test_covariance_percentiles_match_numpy_per_group():
    """CW-GRPO Table 1's view: |c_t| quantiles with each group's own means (Sec. 2.3)."""
    from gjax.objective.token_weights import COV_QUANTILES
    from gjax.objective.token_weights import covariance_percentiles as cp

    covariance_percentiles = jax.jit(cp, static_argnames="group_size")
    lp, adv, mask = _random_batch(seed=3, b=8, t=12)
    adv = adv * jnp.asarray(np.random.default_rng(4).normal(size=(8, 1)), jnp.float32)
    got = covariance_percentiles(lp, adv, mask, group_size=4)
    lp_, adv_, m_ = (np.asarray(x, np.float64) for x in (lp, adv, mask))
    cs = []
    for k in range(2):  # two groups of four rows, each centred on its own valid tokens
        rows = slice(4 * k, 4 * k + 4)
        v = m_[rows] > 0
        l, a = lp_[rows][v], adv_[rows][v]
        cs.append((l - l.mean()) * (a - a.mean()))
    c = np.concatenate(cs)
    for q in COV_QUANTILES:
        np.testing.assert_allclose(got[f"abs_p{100 * q:g}"], np.quantile(np.abs(c), q), rtol=1e-5)
    np.testing.assert_allclose([got["max"], got["min"]], [c.max(), c.min()], rtol=1e-5)
    np.testing.assert_allclose(got["pos_fraction"], np.mean(c > 0), rtol=1e-6)
    # One group's means differ from the batch's: the statistics would change without grouping.
    whole = covariance_percentiles(lp, adv, mask)
    assert not np.isclose(whole["max"], got["max"])
    empty = covariance_percentiles(lp, adv, jnp.zeros_like(mask))
    assert all(float(v) == 0.0 for v in empty.values())


def test_prepare_logs_covariance_percentiles_for_plain_grpo():
    from gjax.objective.loss import ObjectiveConfig, prepare

    lp, adv, mask = _random_batch(seed=5, b=8, t=6)
    rewards = jnp.asarray([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    batch = {
        "targets_BxT": jnp.zeros((8, 6), jnp.int32),
        "loss_mask_BxT": mask,
        "old_logps_BxT": lp,
        "ref_logps_BxT": lp,
        "rewards_PxG": rewards,
        "valid_PxG": jnp.ones((2, 4), bool),
    }
    grpo = ObjectiveConfig.preset("grpo")
    _, metrics = jax.jit(prepare, static_argnums=1)(batch, grpo)
    assert not any(k.startswith("cov/") for k in metrics)  # off unless asked for
    on = dataclasses.replace(grpo, covariance_metrics=True)
    _, metrics = jax.jit(prepare, static_argnums=1)(batch, on)
    assert 0.0 < metrics["cov/abs_p50"] <= metrics["cov/abs_p99.9"]
    assert metrics["cov/min"] < 0.0 < metrics["cov/max"]
