"""Advantage estimators against the papers: golden values computed by hand (derivations in the
comments), not re-derived from the code."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.objective.advantages import ADVANTAGES, AdvantageOutput, compute_advantages

S3 = math.sqrt(3.0)


def _binary_group(k, g=8):
    return jnp.asarray([[1.0] * k + [0.0] * (g - k)])


def _ones(r_or_shape):
    shape = r_or_shape if isinstance(r_or_shape, tuple) else jnp.shape(r_or_shape)
    return jnp.ones(shape, bool)


# ------------------------------------------------------------------------------------ GRPO


def test_grpo_golden_population_and_sample_std():
    # [1, 0, 0, 0]: mean 1/4, population std sqrt(3)/4 -> A = (sqrt 3, -1/sqrt 3 x3);
    # sample std sqrt(1/4) = 1/2 -> A = (3/2, -1/2 x3).
    r = jnp.asarray([[1.0, 0.0, 0.0, 0.0]])
    pop = ADVANTAGES.get("grpo")(r, _ones(r), eps=0.0).adv_PxG
    np.testing.assert_allclose(pop[0], [S3, -1 / S3, -1 / S3, -1 / S3], rtol=1e-6)
    smp = ADVANTAGES.get("grpo")(r, _ones(r), eps=0.0, ddof=1).adv_PxG
    np.testing.assert_allclose(smp[0], [1.5, -0.5, -0.5, -0.5], rtol=1e-6)


def test_grpo_batch_scale_and_dr_grpo():
    # rows [1,0] and [1,1,...]: batch rewards (1,0,1,1): mean 3/4, pop std sqrt(3)/4.
    r = jnp.asarray([[1.0, 0.0], [1.0, 1.0]])
    out = ADVANTAGES.get("grpo")(r, _ones(r), scale="batch", eps=0.0)
    np.testing.assert_allclose(out.adv_PxG, [[0.5 * 4 / S3, -0.5 * 4 / S3], [0, 0]], rtol=1e-6)
    dr = ADVANTAGES.get("dr_grpo")(r, _ones(r))
    np.testing.assert_allclose(dr.adv_PxG, [[0.5, -0.5], [0.0, 0.0]])
    np.testing.assert_allclose(dr.metrics["zero_var_frac"], 0.5)


def test_zero_variance_group_is_exactly_zero_even_with_rounding():
    # mean of eight 0.1's is not exactly 0.1 in float32; (r - mean)/std would be garbage.
    r = jnp.full((1, 8), 0.1)
    for name in ("grpo", "dapo", "dr_grpo", "gpg", "rloo", "a_grae"):
        out = compute_advantages(name, r, _ones(r))
        assert np.all(np.asarray(out.adv_PxG) == 0.0), name
        assert float(out.metrics["zero_var_frac"]) == 1.0


def test_rloo_matches_leave_one_out_by_hand():
    r = jnp.asarray([[1.0, 0.0, 0.5, 0.0], [2.0, 1.0, 0.0, 3.0]])
    valid = jnp.asarray([[True, True, True, False], [True, True, True, True]])
    # row 0, valid (1, 0, .5): 1 - .25 = .75, 0 - .75 = -.75, .5 - .5 = 0, invalid -> 0
    # row 1: 2 - 4/3, 1 - 5/3, 0 - 2, 3 - 1
    out = ADVANTAGES.get("rloo")(r, valid)
    np.testing.assert_allclose(
        out.adv_PxG, [[0.75, -0.75, 0.0, 0.0], [2 / 3, -2 / 3, -2.0, 2.0]], rtol=1e-6
    )


def test_batch_norm():
    r = jnp.asarray([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    out = ADVANTAGES.get("batch_norm")(r, _ones(r), baseline="none", eps=0.0)
    # batch mean 1/2, pop std 1/2 -> +-1
    np.testing.assert_allclose(out.adv_PxG, 2 * np.asarray(r) - 1, rtol=1e-6)
    grp = ADVANTAGES.get("batch_norm")(r, _ones(r), baseline="group", eps=0.0)
    # centred: (.75,-.25,-.25,-.25, .25,.25,.25,-.75): mean 0, pop std sqrt(1.5/8)
    sd = math.sqrt((0.75**2 * 2 + 0.25**2 * 6) / 8)
    expect = np.asarray([[0.75, -0.25, -0.25, -0.25], [0.25, 0.25, 0.25, -0.75]]) / sd
    np.testing.assert_allclose(grp.adv_PxG, expect, rtol=1e-6)
    one = ADVANTAGES.get("batch_norm")(jnp.asarray([[1.0], [0.0]]), _ones((2, 1)), baseline="none")
    np.testing.assert_allclose(one.adv_PxG[:, 0], [1.0, -1.0], rtol=1e-5)


# ---------------------------------------------------------------------------------- A-GRAE


@pytest.mark.parametrize("k", range(0, 9))
def test_agrae_theorem2_sum_abs_adv(k):
    # A-GRAE Theorem 2 (eq. (10)): sum |A| = 2 |G| sqrt(p (1 - p)), G = 8, p = k / 8.
    p = k / 8
    out = ADVANTAGES.get("grpo")(_binary_group(k), _ones((1, 8)), eps=0.0)
    np.testing.assert_allclose(
        float(jnp.sum(jnp.abs(out.adv_PxG))), 2 * 8 * math.sqrt(p * (1 - p)), atol=1e-5
    )


@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
def test_agrae_eq5_symmetry(k, name):
    # A-GRAE eq. (5): sum_{pos} |A| == sum_{neg} |A|.
    r = _binary_group(k)
    adv = np.asarray(compute_advantages(name, r, _ones(r)).adv_PxG)
    pos, neg = np.asarray(r) == 1, np.asarray(r) == 0
    np.testing.assert_allclose(np.abs(adv[pos]).sum(), np.abs(adv[neg]).sum(), rtol=1e-6)


@pytest.mark.parametrize("k", range(1, 8))
def test_agrae_table1_hard_and_easy_focused(k):
    # Table 1(b), gamma = 0.5: hard-focused sum |A*| = G sqrt(1 - p); easy-focused G sqrt(p).
    p = k / 8
    r = _binary_group(k)
    kw = dict(group_level="none", gamma=0.5, eps=0.0)
    hard = ADVANTAGES.get("a_grae")(r, _ones(r), sample_level="hard", **kw).adv_PxG
    easy = ADVANTAGES.get("a_grae")(r, _ones(r), sample_level="easy", **kw).adv_PxG
    np.testing.assert_allclose(float(jnp.abs(hard).sum()), 8 * math.sqrt(1 - p), rtol=1e-5)
    np.testing.assert_allclose(float(jnp.abs(easy).sum()), 8 * math.sqrt(p), rtol=1e-5)


def test_agrae_table1_group_level_variants():
    # Table 1(a), beta = 10 on [1, 0, 0, 0]: A_pos = sqrt 3, A_neg = -1/sqrt 3.
    r = jnp.asarray([[1.0, 0.0, 0.0, 0.0]])
    kw = dict(sample_level="none", beta=10.0, eps=0.0)
    pd = ADVANTAGES.get("a_grae")(r, _ones(r), group_level="positive_dominant", **kw).adv_PxG
    nd = ADVANTAGES.get("a_grae")(r, _ones(r), group_level="negative_dominant", **kw).adv_PxG
    np.testing.assert_allclose(pd[0], [10 * S3, -1 / S3, -1 / S3, -1 / S3], rtol=1e-6)
    np.testing.assert_allclose(nd[0], [S3 / 10, -1 / S3, -1 / S3, -1 / S3], rtol=1e-6)
    assert float(pd.sum()) > 0 > float(nd.sum())
    ctrl = ADVANTAGES.get("a_grae")(r, _ones(r), group_level="none", **kw).adv_PxG
    np.testing.assert_allclose(float(ctrl.sum()), 0.0, atol=1e-6)


# Batch for eqs. (11)-(13): groups [1,0,0,0] (p = 1/4), [1,1,1,0] (p = 3/4), [1,1,1,1] (p = 1).
# omega_s = 8 / 12 = 2/3 (eq. (11)).
# Group 1 GRPO: A+ = sqrt 3, A- = -1/sqrt 3.  DDAS factor (eq. (12)) at p = 1/4:
#   (1/3)/sqrt(1/4) + (1/6)/sqrt(3/4) = 2/3 + 1/(3 sqrt 3)
#   A+ = sqrt3 * 2/3 + 1/3 = 1.4880339;  A- = -(2/(3 sqrt 3) + 1/9) = -0.4960113
# Group 2 GRPO: A+ = 1/sqrt 3, A- = -sqrt 3.  DDAS factor at p = 3/4:
#   (1/3)/sqrt(3/4) + (1/6)/sqrt(1/4) = 2/(3 sqrt 3) + 1/3
#   A+ = 2/9 + 1/(3 sqrt 3) = 0.4146723;  A- = -(2/3 + 1/sqrt 3) = -1.2440169
# Group 3: p = 1, no rescaling, A = 0.
# ASS (eq. (13)) with alpha = 1: positives times min(1, omega_s / 1) = 2/3.
AGRAE_R = [[1.0, 0, 0, 0], [1.0, 1, 1, 0], [1.0, 1, 1, 1]]
G1P, G1N = S3 * 2 / 3 + 1 / 3, -(2 / (3 * S3) + 1 / 9)
G2P, G2N = 2 / 9 + 1 / (3 * S3), -(2 / 3 + 1 / S3)


def test_agrae_eq12_ddas_by_hand():
    r = jnp.asarray(AGRAE_R)
    out = ADVANTAGES.get("a_grae")(r, _ones(r), group_level="none", eps=0.0)
    expect = [[G1P, G1N, G1N, G1N], [G2P, G2P, G2P, G2N], [0, 0, 0, 0]]
    np.testing.assert_allclose(out.adv_PxG, expect, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out.metrics["reward_mean"], 2 / 3, rtol=1e-6)  # omega_s
    assert "omega_s" not in out.metrics  # one name for one figure


def test_agrae_eq13_full_by_hand():
    r = jnp.asarray(AGRAE_R)
    full = ADVANTAGES.get("a_grae")(r, _ones(r), alpha=1.0, eps=0.0).adv_PxG
    c = 2 / 3
    expect = [[c * G1P, G1N, G1N, G1N], [c * G2P, c * G2P, c * G2P, G2N], [0, 0, 0, 0]]
    np.testing.assert_allclose(full, expect, rtol=1e-6, atol=1e-7)
    m = ADVANTAGES.get("a_grae")(r, _ones(r), alpha=1.0).metrics
    np.testing.assert_allclose([m["reward_mean"], m["ass_scale"]], [c, c], rtol=1e-6)
    # alpha = 0.5 <= omega_s: min(1, 4/3) = 1 -> DDAS only.
    half = ADVANTAGES.get("a_grae")(r, _ones(r), alpha=0.5, eps=0.0).adv_PxG
    np.testing.assert_allclose(half[0], [G1P, G1N, G1N, G1N], rtol=1e-6)
    # group level only (ablation): sqrt3 * 2/3 for group 1's positive.
    grp = ADVANTAGES.get("a_grae")(r, _ones(r), sample_level="none", eps=0.0).adv_PxG
    np.testing.assert_allclose(grp[0], [S3 * c, -1 / S3, -1 / S3, -1 / S3], rtol=1e-6)


def test_agrae_composes_with_dr_grpo_and_dapo():
    r = jnp.asarray(AGRAE_R)
    # Dr.GRPO base: group 1 A+ = 3/4, A- = -1/4, times the p = 1/4 factor 2/3 + 1/(3 sqrt 3).
    f1 = 2 / 3 + 1 / (3 * S3)
    out = ADVANTAGES.get("a_grae")(r, _ones(r), base="dr_grpo", group_level="none").adv_PxG
    np.testing.assert_allclose(out[0], [0.75 * f1, -0.25 * f1, -0.25 * f1, -0.25 * f1], rtol=1e-6)
    a = ADVANTAGES.get("a_grae")(r, _ones(r), base="dapo").adv_PxG
    b = ADVANTAGES.get("a_grae")(r, _ones(r), base="grpo").adv_PxG
    np.testing.assert_array_equal(a, b)


def test_agrae_no_rescaling_at_p0_p1_nonbinary():
    # Rewards outside [0, 1]: p (clipped group mean) is 1 and 0 while the variance is non-zero:
    # factor 1, A = the base GRPO advantage (+-1); the out-of-range rewards are counted.
    r = jnp.asarray([[1.0, 2.0, 1.0, 2.0], [0.0, -1.0, 0.0, -1.0]])
    out = ADVANTAGES.get("a_grae")(r, _ones(r), group_level="none", eps=0.0)
    np.testing.assert_allclose(out.adv_PxG, [[-1, 1, -1, 1], [1, -1, 1, -1]], rtol=1e-6)
    assert float(out.metrics["rewards_outside_01"]) == 4.0


# ------------------------------------------------------------------------------------- GPG


def test_gpg_alpha_one_equal_group_of_four():
    # 4 groups of 4, one all-equal: B = 16, M = 4, alpha = 16 / 12.
    r = jnp.asarray([[1.0, 0, 0, 0], [1.0, 1, 0, 0], [1.0, 1, 1, 1], [0.0, 1, 0, 1]])
    out = ADVANTAGES.get("gpg")(r, _ones(r))
    np.testing.assert_allclose(out.metrics["alpha"], 4 / 3, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["gpg_valid_fraction"], 0.75, rtol=1e-6)
    np.testing.assert_allclose(out.adv_PxG[0], np.asarray([0.75, -0.25, -0.25, -0.25]) * 4 / 3)
    raw = ADVANTAGES.get("gpg")(r, _ones(r), fold_alpha=False)
    np.testing.assert_allclose(raw.adv_PxG[0], [0.75, -0.25, -0.25, -0.25])
    np.testing.assert_allclose(raw.metrics["alpha"], 4 / 3, rtol=1e-6)


def test_gpg_alpha_counts_valid_samples_only():
    # Row 2 is all-equal over its 3 valid samples; row 0 has one invalid sample.
    r = jnp.asarray([[1.0, 0, 0, 5.0], [1.0, 1, 0, 0], [1.0, 1, 1, 0.0]])
    v = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]], bool)
    out = ADVANTAGES.get("gpg")(r, v)
    np.testing.assert_allclose(out.metrics["alpha"], 10 / 7, rtol=1e-6)  # B = 10, M = 3
    np.testing.assert_allclose(out.adv_PxG[0], np.asarray([2 / 3, -1 / 3, -1 / 3, 0]) * 10 / 7)


def test_gpg_all_groups_equal_alpha_one_and_group_norm():
    r = jnp.asarray([[1.0, 1.0], [0.0, 0.0]])
    out = ADVANTAGES.get("gpg")(r, _ones(r))
    assert float(out.metrics["alpha"]) == 1.0 and np.all(np.asarray(out.adv_PxG) == 0)
    r2 = jnp.asarray([[1.0, 0.0], [1.0, 1.0]])
    g = ADVANTAGES.get("gpg")(r2, _ones(r2), norm="group", eps=0.0)  # (+-1) * alpha 2
    np.testing.assert_allclose(g.adv_PxG, [[2.0, -2.0], [0.0, 0.0]])


# ---------------------------------------------------------------------------------- DaGRPO


def _dag(r, s, anchors=None, valid=None, **kw):
    r = jnp.asarray(r, jnp.float32)
    v = _ones(r) if valid is None else jnp.asarray(valid, bool)
    a = None if anchors is None else jnp.asarray(anchors, bool)
    kw.setdefault("scale", "none")
    return ADVANTAGES.get("dagrpo")(
        r, v, scores_PxG=jnp.asarray(s, jnp.float32), is_anchor_PxG=a, **kw
    )


def test_dagrpo_borderline_pair_dropped():
    # A = (.5, .5, -.5, -.5); S_max- = 5, S_min+ = 6; delta 3:
    # 9 - 5 = 4 keep; 6 - 5 = 1 drop; 6 - 5 = 1 drop; 6 - 2 = 4 keep.
    out = _dag([[1, 1, 0, 0]], [[9, 6, 5, 2]], delta=3.0)
    np.testing.assert_array_equal(out.keep_PxG[0], [True, False, False, True])
    np.testing.assert_allclose(out.adv_PxG[0], [0.5, 0.0, 0.0, -0.5])
    np.testing.assert_allclose(out.metrics["masked_fraction"], 0.5)


@pytest.mark.parametrize(
    "scores,keep",
    [
        ([[8.0, 7.0, 5.0, 4.0]], [True, False, False, True]),  # gaps exactly 3 are kept
        ([[7.3, 7.0, 4.3, 4.0]], [True, False, False, True]),  # 7.3 - 4.3 == 3 in decimals
        ([[7.29, 7.0, 4.3, 4.0]], [False, False, False, True]),  # 2.99 < 3
    ],
)
def test_dagrpo_gap_exactly_delta(scores, keep):
    out = _dag([[1, 1, 0, 0]], scores, delta=3.0)
    np.testing.assert_array_equal(out.keep_PxG[0], keep)


def test_dagrpo_delta_zero_keeps_ordered_and_drops_inverted():
    out = _dag([[1, 1, 0, 0]], [[5, 5, 5, 1]], delta=0.0)  # S_min+ = S_max- = 5: all kept
    assert bool(jnp.all(out.keep_PxG))
    inv = _dag([[1, 1, 0, 0]], [[4, 9, 5, 1]], delta=0.0)  # 4 < S_max- = 5; 5 > S_min+ = 4
    np.testing.assert_array_equal(inv.keep_PxG[0], [False, True, False, True])


def test_dagrpo_low_scored_anchor_masked_high_scored_anchor_kept():
    # On-policy all wrong (scores 2, 2, 1), one correct anchor; Dr.GRPO advantages over G_mix:
    # anchor +3/4, the others -1/4.
    anchors = [[False, False, False, True]]
    low = _dag([[0, 0, 0, 1]], [[2, 2, 1, 3]], anchors, delta=3.0)
    # anchor: 3 - S_max- (2) = 1 < 3 -> masked; negatives: 3 - 2 = 1, 3 - 1 = 2 < 3 -> masked
    assert not bool(jnp.any(low.keep_PxG)) and float(jnp.abs(low.adv_PxG).sum()) == 0.0
    np.testing.assert_allclose(low.metrics["anchor_masked_fraction"], 1.0)
    np.testing.assert_allclose(low.metrics["anchor_fraction"], 0.25)
    high = _dag([[0, 0, 0, 1]], [[2, 2, 1, 9]], anchors, delta=3.0)
    assert bool(jnp.all(high.keep_PxG))
    np.testing.assert_allclose(high.adv_PxG[0], [-0.25, -0.25, -0.25, 0.75])
    np.testing.assert_allclose(high.metrics["anchor_masked_fraction"], 0.0)


def test_dagrpo_groups_without_positives_or_negatives():
    # All wrong / all right: A = 0, G+ and G- both empty, nothing is masked.
    out = _dag([[0, 0, 0, 0], [1, 1, 1, 1]], [[1, 9, 5, 2], [3, 3, 3, 3]], delta=3.0)
    assert bool(jnp.all(out.keep_PxG)) and float(jnp.abs(out.adv_PxG).sum()) == 0.0
    np.testing.assert_allclose(out.metrics["masked_fraction"], 0.0)
    np.testing.assert_allclose(out.metrics["zero_var_frac"], 1.0)


def test_dagrpo_eq12_group_scale_and_invalid_samples():
    # scale='group' on [1, 0, 0, 0]: A = (sqrt 3, -1/sqrt 3, ...); all gaps >= 3.
    out = _dag([[1, 0, 0, 0]], [[9, 5, 4, 3]], scale="group", eps=0.0, delta=3.0)
    np.testing.assert_allclose(out.adv_PxG[0], [S3, -1 / S3, -1 / S3, -1 / S3], rtol=1e-6)
    assert bool(jnp.all(out.keep_PxG))
    # scores (9, 7, 4, 3): 9 - S_max- (7) = 2 < 3 masks the positive, 9 - 7 = 2 masks the 7.
    out = _dag([[1, 0, 0, 0]], [[9, 7, 4, 3]], scale="group", eps=0.0, delta=3.0)
    np.testing.assert_allclose(out.adv_PxG[0], [0, 0, -1 / S3, -1 / S3], rtol=1e-6)
    np.testing.assert_array_equal(out.keep_PxG[0], [False, False, True, True])
    # a NaN score invalidates its sample: it leaves the mixed group and is counted.
    nan = _dag([[1, 0, 0, 0]], [[9, float("nan"), 4, 3]], delta=3.0)
    np.testing.assert_array_equal(nan.keep_PxG[0], [True, False, True, True])
    np.testing.assert_allclose(nan.adv_PxG[0], [2 / 3, 0, -1 / 3, -1 / 3], rtol=1e-6)
    assert float(nan.metrics["nonfinite"]) == 1.0
    assert float(nan.metrics["masked_fraction"]) == 0.0


# ------------------------------------------------------------------ metrics and bad input


def test_metrics_over_kept_samples():
    out = _dag([[1, 1, 0, 0]], [[9, 6, 5, 2]], delta=3.0)  # kept advs: .5, -.5
    m = out.metrics
    for key, val in dict(adv_mean=0.0, adv_std=0.5, adv_min=-0.5, adv_max=0.5).items():
        np.testing.assert_allclose(m[key], val, atol=1e-7)
    assert float(m["num_kept"]) == 2 and float(m["num_valid"]) == 4
    for name in ADVANTAGES:
        kw = {"scores_PxG": jnp.ones((2, 4))} if name == "dagrpo" else {}
        kw = {"k": 2} if name == "pass_at_k" else kw  # k < G = 4
        m = compute_advantages(name, jnp.asarray([[1.0, 0, 0, 0], [1.0] * 4]), _ones((2, 4)), **kw)
        assert {"adv_mean", "adv_std", "adv_min", "adv_max", "zero_var_frac"} <= set(m.metrics)
        assert all(v.shape == () and v.dtype == jnp.float32 for v in m.metrics.values())


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_nonfinite_rewards_become_invalid(name):
    r = jnp.asarray([[1.0, jnp.nan, 0.0, 0.0], [jnp.inf, 1.0, 0.0, 1.0]])
    kw = {"scores_PxG": jnp.full((2, 4), 5.0), "delta": 0.0} if name == "dagrpo" else {}
    kw = {"k": 2} if name == "pass_at_k" else kw  # k < G = 4
    out = compute_advantages(name, r, _ones(r), **kw)
    clean = jnp.asarray([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    valid = jnp.asarray([[1, 0, 1, 1], [0, 1, 1, 1]], bool)
    ref = compute_advantages(name, clean, valid, **kw)
    assert np.all(np.isfinite(out.adv_PxG))
    np.testing.assert_array_equal(out.keep_PxG, ref.keep_PxG)
    np.testing.assert_allclose(out.adv_PxG, ref.adv_PxG, rtol=1e-6)
    assert float(out.metrics["nonfinite"]) == 2.0
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_all_masked_batch_gives_zeros_and_finite_metrics(name):
    r = jnp.asarray([[1.0, 0.0, 0.0, 1.0]])
    kw = {"scores_PxG": jnp.full((1, 4), 5.0)} if name == "dagrpo" else {}
    kw = {"k": 2} if name == "pass_at_k" else kw  # k < G = 4
    out = compute_advantages(name, r, jnp.zeros((1, 4), bool), **kw)
    assert isinstance(out, AdvantageOutput)
    assert np.all(np.asarray(out.adv_PxG) == 0) and not bool(jnp.any(out.keep_PxG))
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


# batch_norm (baseline="none") and w_reinforce have no group baseline: G = 1 is valid there.
@pytest.mark.parametrize(
    "name", [n for n in ADVANTAGES.names() if n not in ("batch_norm", "w_reinforce")]
)
def test_group_of_one_is_an_error(name):
    with pytest.raises(ValueError, match="G >= 2"):
        s = jnp.ones((4, 1)) if name == "dagrpo" else None
        compute_advantages(name, jnp.ones((4, 1)), jnp.ones((4, 1), bool), scores_PxG=s)


def test_bad_inputs_raise_clear_errors():
    r, v = jnp.zeros((2, 4)), jnp.ones((2, 4), bool)
    with pytest.raises(TypeError, match="floating"):
        compute_advantages("grpo", jnp.zeros((2, 4), jnp.int32), v)
    with pytest.raises(ValueError, match="shape"):
        compute_advantages("grpo", r, jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="2-D"):
        compute_advantages("grpo", jnp.zeros(8), jnp.ones(8, bool))
    with pytest.raises(ValueError, match="scale"):
        compute_advantages("grpo", r, v, scale="global")
    with pytest.raises(ValueError, match="ddof"):
        compute_advantages("grpo", r, v, ddof=2)
    for alpha in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            compute_advantages("a_grae", r, v, alpha=alpha)
    with pytest.raises(ValueError, match="sample_level"):
        compute_advantages("a_grae", r, v, sample_level="medium")
    with pytest.raises(ValueError, match="base"):
        compute_advantages("a_grae", r, v, base="ppo")
    with pytest.raises(ValueError, match="scores"):
        compute_advantages("dagrpo", r, v)
    s = jnp.ones((2, 4))
    for delta in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="delta"):
            compute_advantages("dagrpo", r, v, scores_PxG=s, delta=delta)
    with pytest.raises(ValueError, match="scores_PxG shape"):
        compute_advantages("dagrpo", r, v, scores_PxG=jnp.ones((2, 3)))
    with pytest.raises(KeyError, match="valid names"):
        compute_advantages("ppo", r, v)
    with pytest.raises(TypeError):
        compute_advantages("grpo", r, v, alpha=1.0)  # unknown hparam for grpo


def test_every_estimator_jits_with_static_hparams():
    rng = np.random.default_rng(0)
    r = jnp.asarray(rng.random((2, 4)) < 0.4, jnp.float32)
    v = jnp.asarray(rng.random((2, 4)) < 0.9)
    s = jnp.asarray(rng.uniform(1, 10, (2, 4)), jnp.float32)
    for name in ADVANTAGES:
        kw = {"scores_PxG": s} if name == "dagrpo" else {}
        kw = {"k": 2} if name == "pass_at_k" else kw  # k < G = 4
        eager = compute_advantages(name, r, v, **kw)
        jitted = jax.jit(lambda r, v, kw=kw, name=name: compute_advantages(name, r, v, **kw))(r, v)
        np.testing.assert_allclose(eager.adv_PxG, jitted.adv_PxG, rtol=1e-6, atol=1e-7)
        assert eager.adv_PxG.dtype == jnp.float32 and eager.keep_PxG.dtype == jnp.bool_


# ------------------------------------------------------------------ properties (hypothesis)

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies


def _kw(name, scores):
    if name == "pass_at_k":
        return {"k": 2}  # k < G = 4
    return {"scores_PxG": jnp.asarray(scores)} if name == "dagrpo" else {}


@hyp.settings(max_examples=6, deadline=None, derandomize=True)
@hyp.given(
    r=st.lists(st.sampled_from([0.0, 0.0, 1.0, 0.5, 0.25]), min_size=12, max_size=12),
    v=st.lists(st.booleans(), min_size=12, max_size=12),
    s=st.lists(st.integers(1, 10), min_size=12, max_size=12),
    junk=st.sampled_from([0.0, 1.0, 7.0, float("nan")]),
    perm=st.permutations(range(4)),
)
def test_padding_samples_and_order_do_not_matter(r, v, s, junk, perm):
    """Extra invalid samples (any reward, even NaN) change nothing; permuting a group's samples
    permutes its advantages (every estimator is permutation-equivariant within a group)."""
    r = np.asarray(r, np.float32).reshape(3, 4)
    v = np.asarray(v).reshape(3, 4)
    s = np.asarray(s, np.float32).reshape(3, 4)
    pad = ((0, 0), (0, 2))
    r2, v2 = np.pad(r, pad, constant_values=junk), np.pad(v, pad, constant_values=False)
    s2 = np.pad(s, pad, constant_values=junk)
    for name in ADVANTAGES:
        base = compute_advantages(name, jnp.asarray(r), jnp.asarray(v), **_kw(name, s))
        padded = compute_advantages(name, jnp.asarray(r2), jnp.asarray(v2), **_kw(name, s2))
        np.testing.assert_allclose(padded.adv_PxG[:, :4], base.adv_PxG, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(padded.keep_PxG[:, :4], base.keep_PxG)
        assert np.all(np.asarray(padded.adv_PxG[:, 4:]) == 0)
        assert not np.any(np.asarray(padded.keep_PxG[:, 4:]))
        p = list(perm)
        permuted = compute_advantages(
            name, jnp.asarray(r[:, p]), jnp.asarray(v[:, p]), **_kw(name, s[:, p])
        )
        np.testing.assert_allclose(permuted.adv_PxG, base.adv_PxG[:, p], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- pass@k


def _pass_at_k_brute_force(r, v, k):
    """The definition (Chen et al. 2025, arXiv 2508.10751): every k-subgroup of the valid
    samples scores max(correct); normalise over subgroups; a sample's advantage is the mean
    over the subgroups that contain it. Plain Python over itertools.combinations."""
    import itertools

    out = np.zeros(r.shape)
    for p in range(r.shape[0]):
        idx = [i for i in range(r.shape[1]) if v[p, i]]
        subs = list(itertools.combinations(idx, min(k, len(idx))))
        if not idx:
            continue
        score = np.array([max(float(r[p, i] >= 0.5) for i in sub) for sub in subs])
        mean, std = score.mean(), score.std()
        if std == 0:
            continue
        for i in idx:
            out[p, i] = np.mean([(sc - mean) / std for sc, sub in zip(score, subs) if i in sub])
    return out


def test_pass_at_k_golden_by_hand():
    # [1, 0, 0, 0], k = 2: R = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2; A_pos = (1/2)/(1/2) = 1;
    # a negative is in C(3,1) = 3 subgroups, C(2,1) = 2 of them all-negative:
    # A_neg = (1 - 1/2 - 2/3) / (1/2) = -1/3.
    # [1, 1, 0, 0], k = 2: R = 1 - 1/6 = 5/6, sigma = sqrt(5)/6; A_pos = (1/6)/sigma = 1/sqrt(5);
    # A_neg = (1 - 5/6 - 1/3)/sigma = -1/sqrt(5). [1, 1, 1, 0]: every pair passes -> 0.
    r = jnp.asarray([[1.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = ADVANTAGES.get("pass_at_k")(r, _ones(r), k=2)
    s5 = 1 / math.sqrt(5)
    want = [[1, -1 / 3, -1 / 3, -1 / 3], [s5, s5, -s5, -s5], [0] * 4, [0] * 4, [0] * 4]
    np.testing.assert_allclose(out.adv_PxG, want, rtol=1e-6, atol=1e-7)
    # metrics: the mean unbiased pass@2 over the groups, and the all-zero groups.
    assert float(out.metrics["pass_at_k"]) == pytest.approx((0.5 + 5 / 6 + 1 + 0 + 1) / 5)
    assert float(out.metrics["zero_var_frac"]) == pytest.approx(3 / 5)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_pass_at_k_matches_subgroup_enumeration(k):
    rng = np.random.default_rng(k)
    r = (rng.random((6, 8)) < 0.4).astype(np.float32)
    v = rng.random((6, 8)) < 0.85
    v[0, :] = True
    v[1, 3:] = False  # 3 valid samples: k = min(k, n)
    out = ADVANTAGES.get("pass_at_k")(jnp.asarray(r), jnp.asarray(v), k=k)
    want = _pass_at_k_brute_force(r, v, k)
    np.testing.assert_allclose(out.adv_PxG, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.adv_PxG).sum(1), 0.0, atol=1e-5)  # mean zero


def test_pass_at_1_is_grpo():
    rng = np.random.default_rng(3)
    r = jnp.asarray((rng.random((5, 8)) < 0.5).astype(np.float32))
    v = jnp.asarray(rng.random((5, 8)) < 0.9)
    got = ADVANTAGES.get("pass_at_k")(r, v, k=1).adv_PxG
    np.testing.assert_allclose(got, ADVANTAGES.get("grpo")(r, v, eps=0.0).adv_PxG, rtol=1e-5)


def test_pass_at_k_bad_k_and_non_binary_rewards():
    r = jnp.asarray([[1.0, 0.0, 0.7, 0.0]])
    for k, match in ((0, "k must be an int >= 1"), (2.0, "k must be an int"), (5, "G = 4")):
        with pytest.raises(ValueError, match=match):
            ADVANTAGES.get("pass_at_k")(r, _ones(r), k=k)
    # k = G: the one subgroup is the whole group (brute force: all 0), refused as meaningless.
    np.testing.assert_array_equal(_pass_at_k_brute_force(np.asarray(r), np.ones((1, 4)), 4), 0)
    with pytest.raises(
        ValueError, match="k = 4 must be below the group size G = 4.*every advantage would be 0"
    ):
        ADVANTAGES.get("pass_at_k")(r, _ones(r), k=4)
    out = ADVANTAGES.get("pass_at_k")(r, _ones(r), k=2)
    assert float(out.metrics["rewards_not_binary"]) == 1.0  # 0.7 counts as correct (>= 0.5)
    np.testing.assert_allclose(
        out.adv_PxG, ADVANTAGES.get("pass_at_k")(jnp.asarray([[1.0, 0, 1, 0]]), _ones(r), k=2)[0]
    )


def test_w_reinforce_weights_positive_and_negative_samples():
    from gjax.objective.advantages import ADVANTAGES

    r = jnp.array([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    valid = jnp.array([[True, True, False], [True, True, True]])
    out = ADVANTAGES.get("w_reinforce")(r, valid, positive_weight=0.1)
    np.testing.assert_allclose(out.adv_PxG, [[0.1, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    with pytest.raises(ValueError, match="positive_weight"):
        ADVANTAGES.get("w_reinforce")(r, valid, positive_weight=-1.0)


# ------------------------------------------------------------------ rewards of any finite size

# Rows [s, 0, 0, 0], [s, s, 0, 0], [s, -s, 0, 0] at scales where (r - mean)**2 overflows
# float32 (1e20 -> 1e40) and where sums of rewards do (3e38 + 3e38).
_BIG = (1e20, 3e38)


def _rows(s):
    return jnp.asarray([[s, 0, 0, 0], [s, s, 0, 0], [s, -s, 0, 0]], jnp.float32)


@pytest.mark.parametrize("s", _BIG)
@pytest.mark.parametrize("name,kw", [("grpo", {}), ("dapo", {}), ("gpg", {"norm": "group"})])
def test_group_normalised_advantages_of_huge_rewards_are_the_scale_free_ones(name, kw, s):
    # By hand (population std, eps/s below float32's resolution): [1, 0, 0, 0]: mean 1/4,
    # std sqrt(3)/4 -> [sqrt(3), -1/sqrt(3) x 3]; [1, 1, 0, 0]: mean 1/2, std 1/2 -> +-1;
    # [1, -1, 0, 0]: mean 0, std sqrt(1/2) -> [sqrt(2), -sqrt(2), 0, 0]. Times s: the same.
    r3, r2 = math.sqrt(3), math.sqrt(2)
    want = [[r3, -1 / r3, -1 / r3, -1 / r3], [1, 1, -1, -1], [r2, -r2, 0, 0]]
    out = ADVANTAGES.get(name)(_rows(s), _ones(_rows(s)), **kw)
    if name == "gpg":  # alpha = B / (B - M) = 1 here (no zero-variance group)
        assert float(out.metrics["alpha"]) == 1.0
    np.testing.assert_allclose(out.adv_PxG, want, rtol=1e-6, atol=1e-7)
    assert all(np.isfinite(float(v)) for v in out.metrics.values()), out.metrics
    assert float(out.metrics["reward_mean"]) == pytest.approx(s / 4, rel=1e-6)  # 3 s / 12


@pytest.mark.parametrize("s", _BIG)
def test_batch_scaled_advantages_of_huge_rewards(s):
    # grpo scale='batch': the group means [1/4, 1/2, 0] subtracted, divided by the batch's
    # population std of [1,0,0,0,1,1,0,0,1,-1,0,0] (mean 1/4, E[r^2] = 5/12: var 17/48).
    # batch_norm (group baseline): the same centred values over their own batch std.
    centred = np.array([[3, -1, -1, -1], [2, 2, -2, -2], [4, -4, 0, 0]], np.float64) / 4
    out = ADVANTAGES.get("grpo")(_rows(s), _ones(_rows(s)), scale="batch")
    np.testing.assert_allclose(out.adv_PxG, centred * math.sqrt(48 / 17), rtol=1e-6, atol=1e-7)
    out = ADVANTAGES.get("batch_norm")(_rows(s), _ones(_rows(s)))
    want = (centred - centred.mean()) / centred.std()
    np.testing.assert_allclose(out.adv_PxG, want, rtol=1e-6, atol=1e-7)


def test_unnormalised_advantages_of_huge_rewards_are_the_centred_rewards():
    # Dr.GRPO: r - mean, exactly representable at 3e38 (no sum of rewards overflows).
    s = 3e38
    out = ADVANTAGES.get("dr_grpo")(_rows(s), _ones(_rows(s)))
    want = np.array([[3, -1, -1, -1], [2, 2, -2, -2], [4, -4, 0, 0]], np.float64) * s / 4
    np.testing.assert_allclose(out.adv_PxG, want, rtol=1e-6)
    assert np.isfinite(float(out.metrics["adv_std"]))
