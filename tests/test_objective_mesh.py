"""The composed objective on an 8-device CPU mesh equals the single-device result.

Batch rows (B = P*G, prompt-major) and prompts (P) are sharded over a 'data' axis of 8 fake
devices with valid samples and zero-variance groups spread UNEVENLY over the shards, so any
per-device normaliser (GPG alpha, token / sequence counts, batch statistics) would differ
from the global one. Under jit with NamedSharding the plain jnp reductions are global.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from gjax.objective.loss import ObjectiveConfig, full_batch_loss

P, G, T, D, V = 8, 4, 4, 8, 16


def _batch():
    b = P * G
    k = jax.random.split(jax.random.key(11), 6)
    hidden = jax.random.normal(k[0], (b, T, D))
    head = 0.5 * jax.random.normal(k[1], (D, V))
    targets = jax.random.randint(k[2], (b, T), 0, V, jnp.int32)
    lengths = jax.random.randint(k[3], (b,), 1, T + 1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(hidden @ head, -1), targets[..., None], -1)[
        ..., 0
    ]
    # Shards hold one prompt each. Prompts 0-2: all equal rewards (zero-variance, GPG's M);
    # prompts 4-5 have mostly invalid samples; the rest are mixed.
    rewards = jnp.array(
        [
            [1, 1, 1, 1],
            [0, 0, 0, 0],
            [1, 1, 1, 1],
            [1, 0, 0, 1],
            [1, 0, 1, 0],
            [0, 1, 1, 1],
            [0, 0, 1, 0],
            [1, 1, 0, 1],
        ],
        jnp.float32,
    )
    valid = jnp.ones((P, G), bool).at[4, 1:].set(False).at[5, 2:].set(False).at[7, 0].set(False)
    batch = {
        "targets_BxT": targets,
        "loss_mask_BxT": jnp.arange(T)[None, :] < lengths[:, None],
        "old_logps_BxT": logp + 0.2 * jax.random.normal(k[4], (b, T)),
        "ref_logps_BxT": logp + 0.2 * jax.random.normal(k[5], (b, T)),
        "rewards_PxG": rewards,
        "valid_PxG": valid,
    }
    return hidden, head, batch


def _value_and_grad(hidden, head, batch, cfg):
    def f(h, w):
        return full_batch_loss(h, w, batch, cfg)

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, head)


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("gpg", {}),  # group_token_mean (GPG eq. (5)); GPG alpha over the global batch
        ("cw_grpo", {"kl_beta": 0.0}),  # CW weights: statistics per group
        ("grpo", {"entropy_coef": 0.01}),  # seq_mean_token_mean, k3 KL
        ("dr_grpo", {"aggregation_constant": 6.0}),  # seq_mean_token_sum_norm
    ],
)
def test_objective_on_mesh_equals_single_device(preset, overrides):
    assert len(jax.devices()) >= 8, "conftest.py should force 8 CPU devices"
    cfg = ObjectiveConfig.preset(preset, **overrides)
    hidden, head, batch = _batch()
    fn = functools.partial(_value_and_grad, cfg=cfg)

    dev0 = jax.devices()[0]
    single = jax.jit(fn)(*jax.device_put((hidden, head, batch), dev0))

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = NamedSharding(mesh, PS("data"))
    repl = NamedSharding(mesh, PS())
    batch_sh = {k: rows for k in batch}
    sharded_args = jax.device_put((hidden, head, batch), (rows, repl, batch_sh))
    assert len(sharded_args[2]["rewards_PxG"].sharding.device_set) == 8
    sharded = jax.jit(fn, in_shardings=(rows, repl, batch_sh))(*sharded_args)

    (loss1, m1), (gh1, gw1) = single
    (loss8, m8), (gh8, gw8) = sharded
    assert float(loss1) != 0.0
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gh8, gh1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gw8, gw1, rtol=1e-5, atol=1e-7)
    assert set(m8) == set(m1)
    for k in m1:
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    if preset == "gpg":
        # B = 26 valid samples; M = 13 in zero-variance groups (prompts 0-2, and prompt 4
        # whose single valid sample is a group of one).
        assert float(m8["adv/alpha"]) == pytest.approx(26 / (26 - 13), rel=1e-6)
