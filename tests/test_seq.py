"""Sequence shards (`mesh.seq`, ring attention): the packed update and the log-prob pass on
meshes that split every bin's tokens equal one device, forward and gradients (8 fake CPU
devices, conftest.py); and their validation."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from gjax import objective as obj
from gjax import packing, sharding
from gjax.learner import init_state, make_learner
from gjax.models import attention
from gjax.models.transformer import init_params
from tests.test_learner import CFG
from tests.test_packing import K, M, host_batch

PACK = packing.Packing(bins=8, length=28)  # 28 tokens a bin: 2 or 4 shards of 14 or 7


def assert_same_update(want, got, what):
    """Same metrics and params (the packing mesh test's tolerances: rtol = atol = 1e-6)."""
    (s0, m0), (s1, m1) = want, got
    assert set(m0) == set(m1), what
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, atol=1e-6, err_msg=f"{what}: {k}")
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(s0.params), jax.tree.leaves(s1.params), strict=True
    ):
        np.testing.assert_allclose(
            b, a, rtol=1e-6, atol=1e-6, err_msg=f"{what}: {jax.tree_util.keystr(path)}"
        )


def _run(mesh_shape, params, host, oc):
    """(log-probs, update) of the packed learner on a mesh of `mesh_shape` (the first
    prod(shape) devices), and whether its update program passes blocks round a ring."""
    n = int(np.prod(list(mesh_shape.values())))
    mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:n])
    tx = optax.sgd(1.0)  # new params = params - gradient: compares the gradients
    train_cfg = ml_collections.ConfigDict(
        dict(
            minibatches=M,
            microbatches=K,
            num_iterations=1,
            packing="packed",
            pack_bins=PACK.bins,
            pack_length=PACK.length,
        )
    )
    with jax.set_mesh(mesh), sharding.use_rules():
        placed = sharding.shard_params(jax.tree.map(jnp.copy, params), mesh)  # donated
        state, shardings = init_state(placed, tx, mesh)
        learner = make_learner(
            mesh=mesh,
            model_cfg=CFG,
            obj_cfg=oc,
            tx=tx,
            state_shardings=shardings,
            train_cfg=train_cfg,
        )
        batch = learner.transfer.put_batch(host)
        logps = learner.logps(state.params, batch)
        compiled = learner.update.lower(state, batch, jax.random.key(0)).compile()
        out = compiled(state, batch, jax.random.key(0))
    return jax.device_get(logps), jax.device_get(out), compiled.as_text()


@pytest.mark.slow  # three meshes, each compiles its update: 30-90 s on 2 cores
def test_sequence_shards_equal_one_device_forward_and_gradients():
    """seq = 4, and seq = 2 as data 2 x seq 2 x tensor 2: the reference log-probs and the
    whole update (GSPO with a KL term: per-sequence ratios from the bins' segment ids; loss,
    every metric, every parameter gradient) equal seq = 1 within the packing mesh test's
    tolerances. Rows are packed several to a bin, so segment ids mask across shards."""
    params = init_params(CFG, jax.random.key(4))
    host = host_batch(params, seed=5, pack=PACK, prompts=8)
    bins_B = host["pack_bin_B"] + (np.arange(len(host["pack_bin_B"])) % M) * PACK.bins
    assert np.bincount(bins_B[host["pack_len_B"] > 0]).max() >= 3  # really packs
    oc = obj.ObjectiveConfig.preset("gspo", kl_beta=0.04)
    ref_logps, ref, text = _run({"data": 1}, params, host, oc)
    assert "collective-permute" not in text
    assert float(ref[1]["loss/kl"]) > 0
    for shape in ({"seq": 4}, {"data": 2, "seq": 2, "tensor": 2}):
        logps, out, text = _run(shape, params, host, oc)
        assert "collective-permute" in text, shape  # the blocks went round the seq ring
        # and no device gathers a bin's whole width of hidden states or MLP activations
        widths = f"({CFG.hidden_size}|{CFG.intermediate_size})"
        full = re.compile(rf"= f32\[\d+,{PACK.length},{widths}\]\{{[^}}]*\}} all-gather\(")
        assert not full.search(text), (shape, full.search(text))
        np.testing.assert_allclose(logps, ref_logps, rtol=1e-6, atol=1e-6, err_msg=str(shape))
        assert_same_update(ref, out, str(shape))


@pytest.mark.parametrize("tile", [attention.RING_TILE, 2])  # a block whole, in 2 tiles
def test_ring_attention_equals_dense_with_packed_segments(tile):
    """`attention.ring` on data 2 x seq 4 (GQA, two rows packed into a bin, padding) equals
    the dense masked attention at real queries, and so do the gradients; with 2-key score
    tiles too (blocks of 4 keys)."""
    rng = np.random.default_rng(0)
    b, t, h, kv, dh = 2, 16, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, dh)), jnp.float32) for n in (h, kv, kv))
    seg = jnp.asarray([[1] * 5 + [2] * 7 + [0] * 4, [0] * 3 + [1] * 13], jnp.int32)
    real = np.asarray(seg > 0)[..., None, None]

    def loss(q, k, v, attend=attention.attend):
        out = attend("xla", q, k, v, attention.layer_input("xla", seg))
        return jnp.sum(jnp.where(real, out, 0.0) ** 2), out

    def ring(impl, q, k, v, seg):
        return attention.ring(q, k, v, seg, tile=tile)

    (_, want), grads_want = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    assert attention.key_tile(4, tile) == min(tile, 4)
    mesh = sharding.make_mesh({"data": 2, "seq": 4})
    with jax.set_mesh(mesh), sharding.use_rules(sharding.sequence_rules()):
        assert sharding.sequence_shards(t) == 4 and sharding.sequence_shards(t + 2) == 1
        fn = jax.jit(
            jax.value_and_grad(functools.partial(loss, attend=ring), (0, 1, 2), has_aux=True)
        )
        (_, got), grads = fn(q, k, v)
        assert "collective-permute" in fn.lower(q, k, v).compile().as_text()
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-6)
    for g, gw in zip(grads, grads_want):
        np.testing.assert_allclose(g, gw, atol=1e-5, rtol=1e-5)


def _tiny(seq, **train):
    from configs import grpo

    c = grpo.get_config("tiny")  # rows of 24 + 32 = 56 tokens, packed into bins of 56
    c.mesh.seq = seq
    c.train.update(train)
    return c


def test_a_config_with_sequence_shards_validates():
    from gjax.config import validate

    assert validate(_tiny(4), 8) == {"data": 2, "fsdp": 1, "seq": 4, "tensor": 1}
    assert validate(_tiny(2, pack_length=64), 8)["seq"] == 2


@pytest.mark.parametrize(
    "seq, train, devices, match",
    [
        (3, {}, 8, r"config\.mesh\.seq: =3 does not divide the 8 devices"),
        (4, {"pack_length": 66}, 8, r"mesh\.seq: =4 does not divide train\.pack_length .* 66"),
        (
            3,
            {"packing": "padded"},
            6,
            r"mesh\.seq: =3 does not divide the row length .* 56.* multiple of 3",
        ),
    ],
)
def test_sequence_shards_that_do_not_divide_are_refused_at_validation(seq, train, devices, match):
    from gjax.config import validate
    from gjax.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        validate(_tiny(seq, **train), devices)
    assert "\n" not in str(e.value)  # one paragraph


def test_a_row_longer_than_the_models_positions_is_refused_at_validation():
    from gjax.config import check_length
    from gjax.errors import ConfigError

    c = _tiny(1)
    check_length(c, 56)
    with pytest.raises(ConfigError, match=r"24 \+ 32 = 56 tokens exceeds .*=48.* at most 48"):
        check_length(c, 48)


@pytest.mark.slow  # one update compile, 20-50 s on 2 busy cores
def test_the_planner_compiles_the_update_alone_with_sequence_shards():
    """gjax.plan with mesh.seq = 2 and rollout=False (--norollout): the update is compiled on
    the seq mesh, no rollout program (its figures 0)."""
    from gjax import plan
    from tests.test_plan import _config

    def temp(seq):
        config = _config(decoder="static")
        config.mesh.seq, config.mesh.data = seq, 2 // seq
        hf = plan._hf_of(config, None)
        rows, mesh = plan.make_plan(config, hf, jax.devices()[:2], modes=("full",), rollout=False)
        assert mesh["seq"] == seq
        assert all(rows[0].figures[k] == 0 for k in plan.NO_ROLLOUT)
        return rows[0].figures["update_temp"]

    assert temp(2) > 0
