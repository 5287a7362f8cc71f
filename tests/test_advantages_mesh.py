"""Global-batch statistics on an 8-device CPU mesh equal the single-device values.

GPG Appendix A: alpha = B / (B - M) must be computed over the global batch, not per device.
Here the valid samples and the zero-variance groups are spread unevenly over the shards, so
per-device alphas differ from the global one (checked), while the sharded jit must reproduce
the single-device alpha and advantages.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from gjax.objective.advantages import ADVANTAGES, compute_advantages
from gjax.objective.token_weights import compute_token_weights

N_DEV = 8
P_, G_ = 16, 4


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < N_DEV:
        pytest.skip("needs 8 (fake CPU) devices; see tests/conftest.py")
    return Mesh(np.asarray(jax.devices()[:N_DEV]), ("data",))


def _uneven_batch():
    rng = np.random.default_rng(0)
    r = (rng.random((P_, G_)) < 0.5).astype(np.float32)
    r[:5] = 1.0  # zero-variance groups crowd the first three shards
    r[5] = [1, 0, 1, 0]
    valid = np.ones((P_, G_), bool)
    valid[8:] = rng.random((8, G_)) < 0.6  # the last four shards lose samples
    valid[15] = False  # one fully invalid group
    scores = rng.uniform(1, 10, (P_, G_)).astype(np.float32)
    anchors = np.zeros((P_, G_), bool)
    anchors[:, -1] = True
    return r, valid, scores, anchors


def _alpha_np(r, valid):
    """GPG eq. (7) by hand: B valid samples, M of them in groups whose rewards are all equal."""
    b = int(valid.sum())
    m = sum(
        int(valid[p].sum())
        for p in range(r.shape[0])
        if valid[p].any() and len(set(r[p][valid[p]].tolist())) == 1
    )
    return b / (b - m) if b > m else 1.0


@pytest.mark.parametrize(
    "name,hp",
    [
        ("gpg", {}),
        ("a_grae", {}),
        ("grpo", {"scale": "batch"}),
        ("dagrpo", {"delta": 3.0}),
        ("pass_at_k", {"k": 3}),
    ],
)
def test_sharded_equals_single_device(mesh, name, hp):
    r, valid, scores, anchors = _uneven_batch()
    sh = NamedSharding(mesh, PS("data", None))

    def fn(r, v, s, a):
        return compute_advantages(name, r, v, scores_PxG=s, is_anchor_PxG=a, **hp)

    args = [jnp.asarray(x) for x in (r, valid, scores, anchors)]
    single = jax.jit(fn)(*args)
    sharded_args = [jax.device_put(x, sh) for x in args]
    assert len(sharded_args[0].sharding.device_set) == N_DEV
    sharded = jax.jit(fn, in_shardings=(sh,) * 4)(*sharded_args)
    np.testing.assert_allclose(sharded.adv_PxG, single.adv_PxG, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(sharded.keep_PxG, single.keep_PxG)
    assert set(sharded.metrics) == set(single.metrics)
    for k in single.metrics:
        # atol: adv_mean is ~1e-9 either way (a sum of +-A in a different order)
        np.testing.assert_allclose(
            sharded.metrics[k], single.metrics[k], rtol=1e-6, atol=1e-7, err_msg=k
        )


def test_gpg_alpha_is_global_not_per_device(mesh):
    r, valid, _, _ = _uneven_batch()
    sh = NamedSharding(mesh, PS("data", None))
    fn = jax.jit(lambda r, v: ADVANTAGES.get("gpg")(r, v), in_shardings=(sh, sh))
    out = fn(jax.device_put(jnp.asarray(r), sh), jax.device_put(jnp.asarray(valid), sh))
    alpha = _alpha_np(r, valid)
    np.testing.assert_allclose(out.metrics["alpha"], alpha, rtol=1e-7)
    # A per-device alpha (each shard's own B / (B - M)) would differ from the global one.
    per_dev = [_alpha_np(r[2 * d : 2 * d + 2], valid[2 * d : 2 * d + 2]) for d in range(N_DEV)]
    assert any(abs(a - alpha) > 1e-3 for a in per_dev)


@pytest.mark.parametrize("name", ["cw_gaussian", "clip_cov"])
def test_token_weights_sharded_equals_single_device(mesh, name):
    rng = np.random.default_rng(1)
    b, t = 16, 8
    lp = jnp.asarray(-rng.exponential(1.5, (b, t)), jnp.float32)
    adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), t, 1), jnp.float32)
    lengths = np.r_[np.full(8, t), rng.integers(1, 4, 8)]  # ragged: the last shards are short
    mask = jnp.asarray(np.arange(t)[None] < lengths[:, None])
    hp = {"clip_cov": {"omega_low": 0.0, "ratio": 0.1}, "kl_cov": {"ratio": 0.1}}.get(name, {})

    def fn(lp, adv, mask, key):
        return compute_token_weights(name, lp, adv, mask, rng=key, **hp)

    key = jax.random.PRNGKey(3)
    single = jax.jit(fn)(lp, adv, mask, key)
    sh = NamedSharding(mesh, PS("data", None))
    rep = NamedSharding(mesh, PS())
    put = [jax.device_put(x, sh) for x in (lp, adv, mask)]
    sharded = jax.jit(fn, in_shardings=(sh, sh, sh, rep))(*put, jax.device_put(key, rep))
    np.testing.assert_allclose(sharded.w_BxT, single.w_BxT, rtol=1e-5)
    np.testing.assert_array_equal(sharded.kl_coef_BxT, single.kl_coef_BxT)
    if name == "cw_gaussian":  # mean weight 1 over the valid tokens of the GLOBAL batch
        np.testing.assert_allclose(jnp.sum(sharded.w_BxT) / jnp.sum(mask), 1.0, rtol=1e-6)
