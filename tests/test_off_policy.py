"""Behaviour-policy correction (gjax.objective.off_policy) against a numpy reference, by hand,
and wired into `prepare` (loss weights and metrics)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.objective.loss import ObjectiveConfig, full_batch_loss, prepare
from gjax.objective.off_policy import behaviour_correction_BxT


def reference(old, beh, mask, mode, level, cap):
    """Plain numpy, loops over rows: the module docstring's formulas."""
    B, T = old.shape
    c = np.zeros((B, T))
    capped = masked = 0
    diffs, k3 = [], []
    for i in range(B):
        d = [old[i, t] - beh[i, t] for t in range(T) if mask[i, t]]
        seq_rho = math.exp(sum(d))
        for t in range(T):
            if not mask[i, t]:
                continue
            dt = old[i, t] - beh[i, t]
            diffs.append(abs(dt))
            k3.append(math.exp(dt) - 1 - dt)
            rho = seq_rho if level == "sequence" else math.exp(dt)
            if mode == "tis":
                c[i, t] = min(rho, cap)
                capped += rho > cap
            elif mode == "mask":
                keep = 1 / cap <= rho <= cap
                c[i, t] = float(keep)
                masked += not keep
            else:
                c[i, t] = 1.0
    n = len(diffs)
    return c, {
        "mismatch/abs_logp_diff_mean": sum(diffs) / n,
        "mismatch/abs_logp_diff_max": max(diffs),
        "mismatch/kl_k3": sum(k3) / n,
        "correction/capped_frac": capped / n,
        "correction/masked_frac": masked / n,
    }


def mismatched(seed=0, B=6, T=7):
    """Trainer log-probs, and sampler ones off by up to +-1.2 nats (some ratios beyond C=2)."""
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, (B, T)))
    beh = old + rng.uniform(-1.2, 1.2, (B, T))
    lengths = rng.integers(1, T + 1, B)
    mask = np.arange(T)[None] < lengths[:, None]
    beh[~mask] = np.nan  # padding garbage must not leak
    return old.astype(np.float32), beh.astype(np.float32), mask


@pytest.mark.parametrize("mode", ["none", "tis", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_numpy_reference(mode, level):
    old, beh, mask = mismatched(seed=len(mode) + 10 * len(level))
    c, metrics = behaviour_correction_BxT(
        jnp.asarray(old), jnp.asarray(beh), jnp.asarray(mask), mode=mode, level=level, cap=2.0
    )
    c_ref, m_ref = reference(old, beh, mask, mode, level, 2.0)
    np.testing.assert_allclose(np.asarray(c), c_ref, rtol=1e-5, atol=1e-6)
    for k, v in metrics.items():
        np.testing.assert_allclose(float(v), m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if mode == "tis":
        assert 0 < m_ref["correction/capped_frac"] < 1  # the data exercises the cap
    if mode == "mask":
        assert 0 < m_ref["correction/masked_frac"] < 1


def test_hand_computed_token():
    # rho = 0.5 / 0.2 = 2.5 (capped at 2 / masked), 0.2 / 0.5 = 0.4 (kept as is / masked),
    # 0.3 / 0.3 = 1.
    old = jnp.log(jnp.array([[0.5, 0.2, 0.3]]))
    beh = jnp.log(jnp.array([[0.2, 0.5, 0.3]]))
    mask = jnp.array([[True, True, True]])
    c, m = behaviour_correction_BxT(old, beh, mask, mode="tis", cap=2.0)
    np.testing.assert_allclose(np.asarray(c), [[2.0, 0.4, 1.0]], rtol=1e-6)
    assert float(m["correction/capped_frac"]) == pytest.approx(1 / 3)
    l25 = math.log(2.5)
    assert float(m["mismatch/abs_logp_diff_mean"]) == pytest.approx(2 * l25 / 3, rel=1e-6)
    assert float(m["mismatch/abs_logp_diff_max"]) == pytest.approx(l25, rel=1e-6)
    # k3 = (2.5 - 1 - ln 2.5) + (0.4 - 1 + ln 2.5) + 0 = 0.9, over 3 tokens
    assert float(m["mismatch/kl_k3"]) == pytest.approx(0.3, rel=1e-5)
    c, m = behaviour_correction_BxT(old, beh, mask, mode="mask", cap=2.0)
    np.testing.assert_array_equal(np.asarray(c), [[0.0, 0.0, 1.0]])
    assert float(m["correction/masked_frac"]) == pytest.approx(2 / 3)


def test_hand_computed_sequence():
    # Row 0: ratios 2.5 and 0.4 multiply to 1.0: the sequence is on-policy as a whole.
    # Row 1: 1.5 * 1.6 = 2.4 > C = 2: every token of it is capped at 2 (or masked).
    old = jnp.log(jnp.array([[0.5, 0.2], [0.3, 0.8]]))
    beh = jnp.log(jnp.array([[0.2, 0.5], [0.2, 0.5]]))
    mask = jnp.ones((2, 2), bool)
    c, m = behaviour_correction_BxT(old, beh, mask, mode="tis", level="sequence", cap=2.0)
    np.testing.assert_allclose(np.asarray(c), [[1.0, 1.0], [2.0, 2.0]], rtol=1e-5)
    assert float(m["correction/capped_frac"]) == pytest.approx(0.5)
    c, _ = behaviour_correction_BxT(old, beh, mask, mode="mask", level="sequence", cap=2.0)
    np.testing.assert_array_equal(np.asarray(c), [[1.0, 1.0], [0.0, 0.0]])


def test_bad_settings_name_the_field():
    x = jnp.zeros((1, 1))
    with pytest.raises(ValueError, match="behaviour_correction"):
        behaviour_correction_BxT(x, x, x > -1, mode="clip")
    with pytest.raises(ValueError, match="behaviour_cap"):
        ObjectiveConfig(behaviour_correction="tis", behaviour_cap=1.0)
    with pytest.raises(ValueError, match="behaviour_level"):
        ObjectiveConfig(behaviour_level="group")


def _batch(old, beh, mask, P=2, G=3):
    rng = np.random.default_rng(1)
    b = {
        "targets_BxT": jnp.zeros(old.shape, jnp.int32),
        "loss_mask_BxT": jnp.asarray(mask),
        "old_logps_BxT": jnp.asarray(old),
        "rewards_PxG": jnp.asarray(rng.integers(0, 2, (P, G)).astype(np.float32)),
        "valid_PxG": jnp.ones((P, G), bool),
    }
    if beh is not None:
        b["behaviour_logps_BxT"] = jnp.asarray(beh)
    return b


@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_prepare_scales_loss_weights(mode):
    old, beh, mask = mismatched(seed=3)
    base = ObjectiveConfig(aggregation="token_mean")
    prep0, m0 = prepare(_batch(old, None, mask), base)
    prep, m = prepare(_batch(old, beh, mask), base.replace(behaviour_correction=mode))
    c_ref, ref = reference(old, beh, mask, mode, "token", 2.0)
    # c multiplies the policy-gradient term only (loss.py's docstring): its own array, and the
    # aggregation weights (which every term shares) are those without a correction.
    np.testing.assert_allclose(np.asarray(prep["pg_coef_BxT"]), c_ref, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(prep["weight_BxT"]), np.asarray(prep0["weight_BxT"]))
    assert "pg_coef_BxT" not in prep0
    # Corrected tokens still count in the denominators (the token-mean's 1/N is unchanged).
    np.testing.assert_array_equal(np.asarray(prep["mask_BxT"]), np.asarray(prep0["mask_BxT"]))
    assert float(m["mismatch/kl_k3"]) == pytest.approx(ref["mismatch/kl_k3"], rel=1e-5)
    assert "mismatch/kl_k3" not in m0


def test_prepare_none_reports_only():
    old, beh, mask = mismatched(seed=4)
    prep0, _ = prepare(_batch(old, None, mask), ObjectiveConfig())
    prep, m = prepare(_batch(old, beh, mask), ObjectiveConfig())
    np.testing.assert_array_equal(np.asarray(prep["weight_BxT"]), np.asarray(prep0["weight_BxT"]))
    assert float(m["mismatch/abs_logp_diff_max"]) > 0


def test_rejection_drops_only_the_policy_gradient_and_keeps_denominators():
    """The choice (loss.py docstring, as TRL / verl): a rejected token keeps its KL-to-reference
    gradient (multiplying every term would zero it) and the kept tokens' gradients are those
    without a correction (dropping rejected tokens from the denominators would scale them)."""
    P, G, T, D, V = 2, 3, 5, 4, 8
    k = jax.random.split(jax.random.key(0), 5)
    hidden = jax.random.normal(k[0], (P * G, T, D))
    head = jax.random.normal(k[1], (D, V))
    targets = jax.random.randint(k[2], (P * G, T), 0, V)
    logp = jnp.take_along_axis(jax.nn.log_softmax(hidden @ head), targets[..., None], -1)[..., 0]
    batch = {
        "targets_BxT": targets,
        "loss_mask_BxT": jnp.ones((P * G, T), bool),
        "old_logps_BxT": logp,
        "ref_logps_BxT": logp + 0.5 * jax.random.normal(k[3], logp.shape),
        "rewards_PxG": jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
        "valid_PxG": jnp.ones((P, G), bool),
    }
    beh = logp + jax.random.uniform(k[4], logp.shape, minval=-1.5, maxval=1.5)
    cfg = ObjectiveConfig(kl_beta=0.1, behaviour_correction="mask", aggregation="token_mean")

    grad_fn = jax.jit(jax.grad(lambda h, b: full_batch_loss(h, head, b, cfg)[0]))

    def g_hidden(b):
        return np.asarray(grad_fn(hidden, b))

    g_corr = g_hidden({**batch, "behaviour_logps_BxT": beh})
    g_plain = g_hidden(batch)
    g_kl_only = g_hidden({**batch, "rewards_PxG": jnp.ones((P, G))})  # A = 0: KL term alone
    rejected = np.abs(np.asarray(logp - beh)) > np.log(2.0)
    assert 0 < rejected.sum() < rejected.size
    np.testing.assert_allclose(g_corr[rejected], g_kl_only[rejected], rtol=1e-5, atol=1e-7)
    assert np.abs(g_kl_only[rejected]).max() > 1e-3
    np.testing.assert_allclose(g_corr[~rejected], g_plain[~rejected], rtol=1e-5, atol=1e-7)
