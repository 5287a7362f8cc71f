"""The jitted update: accumulation-invariant, minibatch-normalized, compiled once, sharded."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import common
from gjax import objective as obj
from gjax import sharding
from gjax.experience import to_model_inputs
from gjax.learner import (
    TrainState,
    init_state,
    make_learner,
    make_optimizer,
    policy_logps,
    update,
)
from gjax.models.transformer import init_params
from tests.test_experience import make_groups
from tests.test_model import tiny_cfg

CFG = tiny_cfg(
    vocab_size=64,
    intermediate_size=64,
    attention_bias=False,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def optim(lr=1e-2):
    """The config schema's optimizer section (configs.common.base), unclipped, constant lr."""
    o = common.base().optim
    o.lr, o.clip_norm, o.warmup_steps, o.schedule = lr, 1e9, 0, "constant"
    return o


def test_schedule_counts_rl_steps_not_optimizer_updates():
    # 4 updates per RL step (e.g. 2 minibatches x 2 iterations), warmup over 2 RL steps: the
    # rate applied by each update is the rate of its RL step, and that is what is reported.
    oc = optim(lr=1e-2)
    oc.warmup_steps = 2
    # Betas that are powers of 2 keep Adam's bias correction exact in float32 (with 0.999,
    # 1 - 0.999**2 loses ~3e-5 to cancellation), so each applied step is exactly the rate.
    oc.b1 = oc.b2 = 0.5
    tx, schedule = make_optimizer(oc, 10, updates_per_step=4)
    params = {"w": jnp.zeros(())}
    opt_state = tx.init(params)
    applied = []
    for _ in range(12):
        # Constant gradients: Adam's bias-corrected step is exactly -lr.
        updates, opt_state = tx.update({"w": jnp.ones(())}, opt_state, params)
        applied.append(-float(updates["w"]))
    # Warmup over 2 steps: step 0 learns at lr/2 (not 0), step 1 reaches lr.
    want = [5e-3] * 4 + [1e-2] * 8
    np.testing.assert_allclose(applied, want, rtol=1e-5, atol=1e-12)
    assert [float(schedule(s)) for s in range(3)] == pytest.approx([5e-3, 1e-2, 1e-2])


def test_warmup_and_cosine_never_spend_a_step_at_rate_zero():
    oc = optim(lr=1e-2)
    oc.warmup_steps, oc.schedule = 4, "cosine"
    _, schedule = make_optimizer(oc, 10)
    rates = [float(schedule(s)) for s in range(10)]
    assert rates[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])  # lr * (k + 1) / 4
    # Then cos decay over the 7 steps after the peak: 1e-2 * (1 + cos(pi * j / 7)) / 2.
    want = [1e-2 * (1 + np.cos(np.pi * j / 7)) / 2 for j in range(1, 7)]
    assert rates[4:] == pytest.approx(want)
    assert rates[-1] > 0
    oc.warmup_steps = 0
    assert float(make_optimizer(oc, 10)[1](0)) == pytest.approx(1e-2)


def batch_for(params, P=4, G=4, seed=0):
    rng = np.random.default_rng(seed)
    groups = make_groups(rng.integers(0, 2, (P, G)).astype(np.float32), S=5, N=6, seed=seed)
    groups.completion_mask_PxGxN[..., rng.integers(2, 6) :] = False  # ragged lengths
    groups.completion_mask_PxGxN[0, 0, 3:] = False
    x = to_model_inputs(groups)
    x = {k: jnp.asarray(v) for k, v in x.items()}
    # Old and reference policies off the current one, so ratios clip and the KL term counts.
    logps = policy_logps(params, x, cfg=CFG, temperature=1.0)
    mask = x["loss_mask_BxT"]
    x["old_logps_BxT"] = jnp.where(mask, logps + 0.3 * rng.standard_normal(logps.shape), 0.0)
    x["ref_logps_BxT"] = jnp.where(mask, logps + 0.3 * rng.standard_normal(logps.shape), 0.0)
    return x


def run_update(
    params,
    batch,
    obj_cfg,
    *,
    minibatches=1,
    microbatches=1,
    iterations=1,
    tx=None,
    cfg=CFG,
    frozen=None,
):
    """One jitted update of `params` (LoRA: the adapters, with the base as `frozen`)."""
    tx = tx or optax.sgd(1.0)  # params - grads: compares gradients, not Adam's sign-like step
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    fn = jax.jit(
        functools.partial(
            update,
            cfg=cfg,
            obj_cfg=obj_cfg,
            tx=tx,
            minibatches=minibatches,
            microbatches=microbatches,
            num_iterations=iterations,
        )
    )
    return fn(state, batch, jax.random.key(0), frozen)


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr_grpo"])  # the three aggregations
def test_microbatching_does_not_change_the_update(preset):
    params = init_params(CFG, jax.random.key(1))
    batch = batch_for(params)
    oc = obj.ObjectiveConfig.preset(preset)
    s1, m1 = run_update(params, batch, oc, microbatches=1)
    s4, m4 = run_update(params, batch, oc, microbatches=4)
    # The batch exercises clipping (and the KL term where the preset has one).
    assert float(m1["policy/clip_frac_low"]) + float(m1["policy/clip_frac_high"]) > 0
    assert (float(m1["loss/kl"]) > 0) == (oc.kl_beta > 0)
    np.testing.assert_allclose(m1["optim/grad_norm"], m4["optim/grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(m1["loss/total"], m4["loss/total"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_behaviour_correction_reaches_the_update_and_microbatches_exactly():
    """prepare's pg_coef_BxT (the correction of the policy-gradient term) is sliced with the
    rows: 4 micro-batches give the 1-micro-batch update (some ratios are capped)."""
    params = init_params(CFG, jax.random.key(1))
    batch = batch_for(params)
    rng = np.random.default_rng(5)
    noise = rng.uniform(-1.2, 1.2, batch["old_logps_BxT"].shape).astype(np.float32)
    batch["behaviour_logps_BxT"] = batch["old_logps_BxT"] + noise
    oc = obj.ObjectiveConfig.preset("grpo").replace(behaviour_correction="tis")
    s1, m1 = run_update(params, batch, oc, microbatches=1)
    s4, m4 = run_update(params, batch, oc, microbatches=4)
    assert float(m1["correction/capped_frac"]) > 0
    # The correction reaches the update: without it the gradient differs (the micro-batch
    # comparison below holds whether or not pg_coef_BxT is applied).
    _, m0 = run_update(params, batch, oc.replace(behaviour_correction="none"), microbatches=1)
    assert abs(float(m0["optim/grad_norm"]) - float(m1["optim/grad_norm"])) > 1e-3 * float(
        m0["optim/grad_norm"]
    )
    np.testing.assert_allclose(m1["optim/grad_norm"], m4["optim/grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "aggregation",
    ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "group_token_mean"],
)
def test_each_minibatch_is_normalized_on_its_own(aggregation):
    """Two minibatches = two updates whose losses equal the objective on each half alone."""
    params = init_params(CFG, jax.random.key(2))
    batch = batch_for(params, seed=3)
    oc = obj.ObjectiveConfig.preset("dapo").replace(aggregation=aggregation)
    _, metrics = run_update(params, batch, oc, minibatches=2, tx=optax.sgd(0.0))
    # Reference: advantages from the full batch, aggregation over each strided half.
    prep, _ = obj.prepare({k: v for k, v in batch.items() if not k.endswith("_BxS")}, oc)
    losses = []
    for m in range(2):
        rows = {k: v[m::2] for k, v in batch.items() if k.endswith(("_BxS", "_BxT"))}
        sub_prep = {k: v[m::2] for k, v in prep.items()}
        mask = sub_prep["mask_BxT"]
        group_B = (jnp.arange(16) // 4)[m::2]  # a group's rows in this half are its group here
        sub_prep["weight_BxT"] = obj.AGGREGATIONS.get(aggregation)(
            mask, constant=oc.aggregation_constant, group_B=group_B
        ) * (sub_prep["weight_BxT"] > 0)
        from gjax.learner import completion_hidden
        from gjax.models.transformer import lm_head_kernel

        hidden = completion_hidden(params, CFG, rows)
        loss, _ = obj.micro_batch_loss(hidden, lm_head_kernel(params, CFG), rows, sub_prep, oc)
        losses.append(loss)
    np.testing.assert_allclose(metrics["loss/total"], np.mean(losses), rtol=1e-5, atol=1e-7)


def test_update_compiles_once_and_runs_sharded():
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    params = sharding.shard_params(init_params(CFG, jax.random.key(0)), mesh)
    oc = obj.ObjectiveConfig.preset("grpo")
    oc_warm = optim()
    oc_warm.warmup_steps = 2
    tx, schedule = make_optimizer(oc_warm, 10, updates_per_step=4)  # 2 minibatches x 2 passes
    state, shardings = init_state(params, tx, mesh)
    train_cfg = ml_collections.ConfigDict(dict(minibatches=2, microbatches=2, num_iterations=2))
    learner = make_learner(
        mesh=mesh,
        model_cfg=CFG,
        obj_cfg=oc,
        tx=tx,
        state_shardings=shardings,
        train_cfg=train_cfg,
        schedule=schedule,
    )
    for i in range(3):
        host = batch_for(jax.device_get(state.params), P=8, G=4, seed=i)
        batch = learner.transfer.put_batch({k: np.asarray(v) for k, v in host.items()})
        state, metrics = learner.update(state, batch, jax.random.key(i))
        assert np.isfinite(float(metrics["loss/total"]))
        # The learning rate of this step's updates: linear warmup lr/2, then lr.
        assert float(metrics["optim/lr"]) == pytest.approx([5e-3, 1e-2, 1e-2][i])
    assert int(state.step) == 3
    assert learner.update._cache_size() == 1, "the update recompiled after the first step"
    q = state.params["layers"]["attn"]["q"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
