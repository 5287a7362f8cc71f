"""Packed batches (gjax.packing) give the padded update's loss, metrics and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from gjax import objective as obj
from gjax import packing, sharding
from gjax.errors import ConfigError
from gjax.experience import Groups, to_model_inputs
from gjax.learner import (
    TrainState,
    init_state,
    make_learner,
    pack_minibatch,
    policy_logps,
    update,
)
from gjax.models.transformer import init_params
from tests.test_learner import CFG

P, G, S, N = 4, 4, 6, 7  # B = 16 rows of S + N = 13 tokens
M, K = 2, 2  # minibatches, microbatches
PACK = packing.Packing(bins=4, length=26)  # per minibatch: 8 rows in 2 x 2 bins of 26


def ragged_groups(seed=0, P=P):
    """Prompts of 2-6 tokens (left-padded), completions of 0-7 tokens, an invalid row, a
    truncated one, an anchor per group and judge scores: every field the objective reads."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, S + 1, P)
    prompt_mask = np.arange(S)[None] >= (S - prompt_len)[:, None]
    comp_len = rng.integers(1, N + 1, (P, G))
    comp_len[1, 2] = 0
    valid = np.ones((P, G), bool)
    valid[2, 1] = False
    truncated = np.zeros((P, G), bool)
    truncated[3, 0] = True
    anchor = np.zeros((P, G), bool)
    anchor[:, -1] = True
    return Groups(
        prompt_ids_PxS=rng.integers(2, 60, (P, S)).astype(np.int32),
        prompt_mask_PxS=prompt_mask,
        completion_ids_PxGxN=rng.integers(2, 60, (P, G, N)).astype(np.int32),
        completion_mask_PxGxN=np.arange(N)[None, None] < comp_len[..., None],
        truncated_PxG=truncated,
        is_anchor_PxG=anchor,
        rewards_PxG=rng.integers(0, 2, (P, G)).astype(np.float32),
        scores_PxG=rng.uniform(0, 10, (P, G)).astype(np.float32),
        valid_PxG=valid,
    )


def multi_turn_groups(seed=0):
    """`ragged_groups` as multi-turn rows: in each on-policy completion 1-2 environment tokens
    after its first 1-3 policy tokens (in the sequence, out of the loss mask); anchors are
    demonstrations, all policy-side."""
    g = ragged_groups(seed)
    rng = np.random.default_rng(seed + 7)
    start = rng.integers(1, 4, (P, G))[..., None]
    end = start + rng.integers(1, 3, (P, G))[..., None]
    n = np.arange(N)[None, None]
    inserted = (n >= start) & (n < end) & ~g.is_anchor_PxG[..., None]
    g.policy_mask_PxGxN = g.completion_mask_PxGxN & ~inserted
    return g


def host_batch(params, seed=0, pack=PACK, minibatches=M, prompts=P, groups=None):
    groups = ragged_groups(seed, prompts) if groups is None else groups
    x = to_model_inputs(groups, drop_truncated=True)
    x.update(
        packing.plan(
            packing.row_spans(x["segment_ids_BxS"], x["loss_mask_BxT"]),
            pack,
            s=x["input_ids_BxS"].shape[1],
            minibatches=minibatches,
            t=x["targets_BxT"].shape[1],
        )
    )
    x.update(packing.markers(x))
    rng = np.random.default_rng(seed + 1)
    logps = np.asarray(policy_logps(params, x, cfg=CFG, temperature=1.0))
    mask = x["loss_mask_BxT"]
    for k in ("old_logps_BxT", "ref_logps_BxT", "behaviour_logps_BxT"):
        x[k] = np.where(mask, logps + 0.3 * rng.standard_normal(logps.shape), 0.0).astype(
            np.float32
        )
    return x


def test_spans_and_first_fit_decreasing():
    seg_BxS = np.array([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    loss_BxT = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], bool)
    # Row 0: tokens 2..3 (position S - T - 1 + 1 = 3 predicts target 1); row 1: no loss.
    np.testing.assert_array_equal(packing.row_spans(seg_BxS, loss_BxT), [[2, 2], [1, 0], [0, 5]])
    bin_R, offset_R, used = packing.first_fit_decreasing(np.array([3, 5, 0, 4, 2]), 3, 8)
    # Decreasing: 5 -> bin 0, 4 -> bin 1, 3 -> bin 0 (5 + 3 = 8), 2 -> bin 1.
    np.testing.assert_array_equal(bin_R, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(offset_R, [5, 0, 0, 0, 4])
    assert used == 2
    assert packing.first_fit_decreasing(np.array([9]), 3, 8)[0][0] == -1


def test_min_bin_slack_fills_the_gaps_first_fit_decreasing_leaves():
    # Bins of 10: first-fit decreasing puts 4 + 4 together and the 3s three to a bin (3 bins,
    # 9 + 8 + 3 tokens); minimum bin slack tops each 4 up with 3 + 3 (2 full bins).
    length_R = np.array([3, 4, 3, 3, 4, 3])
    assert packing.first_fit_decreasing(length_R, 6, 10)[2] == 3
    bin_R, offset_R, used = packing.min_bin_slack(length_R, 6, 10)
    assert used == 2
    # Longest first (row order on ties), then the first rows that fill the bin exactly.
    np.testing.assert_array_equal(bin_R, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(offset_R, [4, 0, 7, 4, 0, 7])
    assert packing.pack_rows(length_R, 6, 10)[2] == 2
    assert packing.pack_rows(length_R, 6, 10, "ffd")[2] == 3
    # A row longer than the bins, or too few bins: -1 for the rows left.
    assert packing.min_bin_slack(np.array([11, 2]), 2, 10)[0].tolist() == [-1, -1]
    assert packing.min_bin_slack(length_R, 1, 10)[0].tolist() == [0, 0, 0, -1, -1, -1]
    with pytest.raises(ValueError, match="packer"):
        packing.Packing(packer="bfd")


def test_pack_rows_keeps_first_fit_where_it_needs_fewer_bins():
    # Here first-fit decreasing needs 3 bins of 20 and minimum bin slack 4 (15 + 3 + 2
    # leaves 11 + 7 and 11 + 6 apart): the plan takes the fewer, so fixed bins that fit
    # before still fit.
    length_R = np.array([15, 11, 11, 7, 6, 4, 3, 2])
    assert packing.first_fit_decreasing(length_R, 8, 20)[2] == 3
    assert packing.min_bin_slack(length_R, 8, 20)[2] == 4
    assert packing.pack_rows(length_R, 8, 20)[2] == 3
    spans = np.stack([np.zeros(8, int), length_R], axis=1)
    plan = packing.plan(spans, packing.Packing(bins=3, length=20), s=20, minibatches=1)
    assert plan["pack_metrics"][0] == 3


def test_auto_bins_on_the_benchmark_lengths_need_fewer_bins_than_first_fit():
    # Row spans of one benchmarks/train_step.py batch (--length-dist pareto, 128 rows of
    # 32 + 48 tokens; spans 18-64): 3397 tokens, 43 bins of 80 at least. First-fit
    # decreasing needs 46 (rows of ~27 go two to a bin), minimum bin slack 43.
    span_N = [64, 55, 49, 43, 41, 39, 38, 37, 36, 35, 34, 32, 31, 30, 29, 28, 27, 26, 25]
    span_N += [24, 23, 22, 21, 20, 19, 18]
    count_N = [1, 2, 1, 1, 2, 2, 1, 2, 1, 1, 3, 5, 6, 3, 1, 10, 6, 18, 5, 7, 8, 12, 4, 4, 10, 12]
    length_R = np.repeat(span_N, count_N)
    assert len(length_R) == 128 and length_R.sum() == 3397
    spans = np.stack([np.zeros(128, int), length_R], axis=1)
    used = {}
    for packer in packing.PACKERS:
        pack = packing.Packing(bins=0, length=80, packer=packer)
        used[packer] = int(packing.plan(spans, pack, s=80, minibatches=1)["pack_metrics"][0])
    assert used == {"mbs": 43, "ffd": 46}


def test_rows_that_do_not_fit_stop_with_a_clear_error():
    spans = np.array([[0, 10], [0, 10], [0, 10], [0, 11]])
    # Minibatch 0 (rows 0, 2) fits one bin of 20, minibatch 1 (rows 1, 3) does not.
    with pytest.raises(ConfigError, match=r"minibatch 1 do not fit train.pack_bins=1 bins"):
        packing.plan(spans, packing.Packing(bins=1, length=20), s=12, minibatches=2)
    with pytest.raises(ConfigError, match="needs 4 bins of 12"):
        packing.plan(spans, packing.Packing(bins=1, length=12), s=12, minibatches=1)
    plan = packing.plan(spans, packing.Packing(bins=2, length=21), s=12, minibatches=1)
    np.testing.assert_array_equal(plan["pack_bin_B"], [0, 1, 1, 0])
    np.testing.assert_array_equal(plan["pack_offset_B"], [11, 0, 10, 0])
    with pytest.raises(ConfigError, match="train.packing must be one of"):
        packing.from_config(ml_collections.ConfigDict({"packing": "ragged", "microbatches": 1}))


def _preset(name):
    """A preset for these tests' groups of 4: pass@k's k below G (k = G is refused)."""
    if name == "pass_at_k":
        return obj.ObjectiveConfig.preset(name, advantage_kwargs={"k": 2})
    return obj.ObjectiveConfig.preset(name)


UPDATE_CASES = tuple(
    [(name, _preset(name)) for name in obj.PRESETS]
    + [  # the rest of the objective's per-token inputs: LUFFY anchors, entropy, behaviour
        (
            "luffy_entropy_tis",
            obj.ObjectiveConfig.preset(
                "dagrpo",
                anchor_treatment="luffy",
                entropy_coef=0.01,
                kl_beta=0.02,
                behaviour_correction="tis",
            ),
        ),
    ]
)


def _grad_sum(lr=1.0):
    """SGD whose state holds the sum of the gradients it applied (optax's trace, decay 1):
    `_assert_same` compares the parameters and that sum. A small `lr` keeps the second
    minibatch's gradient (taken after the first's step) well conditioned: at lr = 1 the step
    amplifies the float32 reordering of packed vs padded sums ~13x, to the tolerance's edge."""
    return optax.chain(optax.trace(decay=1.0), optax.scale(-lr))


def _updates(params, batch, cases, packs, lr=1.0):
    """Every case's update, padded and packed, in ONE compiled function (compile once)."""
    tx = _grad_sum(lr)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    out = {}
    for name, oc in cases:
        for pack in packs:
            out[name, pack is not None] = update(
                state,
                batch,
                jax.random.key(0),
                cfg=CFG,
                obj_cfg=oc,
                tx=tx,
                minibatches=M,
                microbatches=K,
                num_iterations=1,
                pack=pack,
            )
    return out


def _assert_same(padded, packed, what):
    (s0, m0), (s1, m1) = padded, packed
    assert set(m0) == set(m1) - {"pack/bins_used_max", "pack/fill"}, what
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, atol=1e-6, err_msg=f"{what}: {k}")
    trees = (s0.params, s0.opt_state), (s1.params, s1.opt_state)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(trees[0]), jax.tree.leaves(trees[1]), strict=True
    ):
        np.testing.assert_allclose(
            b, a, rtol=1e-6, atol=1e-6, err_msg=f"{what}: {jax.tree_util.keystr(path)}"
        )


def _micro_sum(w, h_K, mb_K, prep_K, oc, num_segments=None):
    """micro_batch_loss summed over K stacked microbatches (one `lax.scan` body), finalized."""

    def one(h, mb, mprep):
        seg = {}
        if num_segments:  # packed: bins are the rows of the grid, segments the sequences
            seg = {"segment_BxT": mb["segment_ids"], "num_segments": num_segments}
        return obj.micro_batch_loss(h, w, mb, mprep, oc, **seg)

    def body(acc, xs):
        return jax.tree.map(jnp.add, acc, one(*xs)), None

    shapes = jax.eval_shape(one, *jax.tree.map(lambda x: x[0], (h_K, mb_K, prep_K)))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    (loss, sums), _ = jax.lax.scan(body, zeros, (h_K, mb_K, prep_K))
    return loss, obj.finalize_metrics(sums)


def _losses(hidden_BxSxD, head_DxV, batch, cases):
    """Every case's objective over K microbatches of one minibatch, padded and packed, with
    gradients w.r.t. the final hidden states and the head; in ONE compiled function."""
    b, s = batch["input_ids_BxS"].shape
    t = batch["targets_BxT"].shape[1]
    keep = ("_BxS", "_BxT")
    rows = {k: v for k, v in batch.items() if k.endswith(keep) or k in packing.PLAN_KEYS}
    pack = packing.Packing(bins=PACK.bins * M, length=PACK.length)  # one minibatch
    dest_BxS = packing.destinations(rows, s, pack.bins, pack.length)
    out = {}
    for name, oc in cases:
        prep, prep_metrics = obj.prepare(batch, oc, jax.random.key(0))

        def padded(h_BxSxD, w, oc=oc, prep=prep):
            mb_K, prep_K = obj.split_micro_batches(batch, prep, K)
            h_K = h_BxSxD[:, s - t - 1 : s - 1].reshape(K, b // K, t, -1)
            return _micro_sum(w, h_K, mb_K, prep_K, oc)

        def packed(h_BxSxD, w, oc=oc, prep=prep):
            c = batch["pack_reads_C"].shape[0]  # the head at the read positions only
            inputs, mb_K, prep_K = pack_minibatch(
                rows, prep, bins=pack.bins, width=pack.length, microbatches=K, reads=c
            )
            h_N = packing.scatter(h_BxSxD, dest_BxS, pack.bins * pack.length)
            read_JxC = inputs["read_JxC"].reshape(pack.bins, c)
            h_JxCxD = packing.take_reads(h_N.reshape(pack.bins, pack.length, -1), read_JxC)
            h_K = h_JxCxD.reshape(K, pack.bins // K, c, -1)
            return _micro_sum(w, h_K, mb_K, prep_K, oc, num_segments=b + 1)

        for key, f in (("padded", padded), ("packed", packed)):
            (loss, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
                hidden_BxSxD, head_DxV
            )
            out[name, key] = (loss, {**prep_metrics, **metrics}, grads)
    return out


def test_packed_objective_equals_padded_for_every_preset():
    """Loss, every metric and the gradients of every preset (and LUFFY anchors, entropy,
    behaviour correction), over 2 microbatches of bins vs 2 of rows."""
    params = init_params(CFG, jax.random.key(1))
    host = host_batch(params, pack=packing.Packing(PACK.bins * M, PACK.length), minibatches=1)
    _assert_packed_objective_equals_padded(host)


def test_packed_objective_equals_padded_on_multi_turn_rows():
    """The same on multi-turn rows (gjax.rollout.turns): environment tokens between the
    policy's, attended and out of the loss mask, in every preset's advantage and aggregation
    (Dr.GRPO's constant, token means: the loss mask's counts, not the rows' lengths)."""
    params = init_params(CFG, jax.random.key(1))
    groups = multi_turn_groups()
    host = host_batch(
        params, pack=packing.Packing(PACK.bins * M, PACK.length), minibatches=1, groups=groups
    )
    inside = host["loss_mask_BxT"] == 0
    inside &= np.cumsum(host["loss_mask_BxT"], 1) > 0
    inside &= np.cumsum(host["loss_mask_BxT"][:, ::-1], 1)[:, ::-1] > 0
    assert inside.sum() >= 5  # environment tokens between policy tokens of one row
    _assert_packed_objective_equals_padded(host)


def test_packed_update_equals_padded_on_multi_turn_rows():
    """The whole update on multi-turn rows (model forward and backward: the environment's
    tokens attended inside the bins), packed vs padded, 2 minibatches x 2 microbatches: loss,
    every metric, every parameter gradient (summed over the minibatches, at lr 1e-2: see
    `_grad_sum`); GRPO and Dr.GRPO."""
    params = init_params(CFG, jax.random.key(4))
    host = host_batch(params, seed=2, groups=multi_turn_groups(2))
    cases = (("grpo", _preset("grpo")), ("dr_grpo", _preset("dr_grpo")))
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    out = jax.jit(_updates, static_argnums=(2, 3, 4))(params, batch, cases, (None, PACK), 1e-2)
    for name, _ in cases:
        assert float(out[name, False][1]["loss/total"]) != 0.0, name
        _assert_same(out[name, False], out[name, True], name)


def _assert_packed_objective_equals_padded(host):
    assert np.bincount(host["pack_bin_B"][host["pack_len_B"] > 0]).max() >= 3  # really packs
    assert (host["pack_len_B"] == 0).any()  # and leaves out rows without loss tokens
    assert host["pack_reads_C"].shape[0] < PACK.length  # the head skips prompt positions
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    k1, k2 = jax.random.split(jax.random.key(3))
    hidden_BxSxD = jax.random.normal(k1, (P * G, S + N, 8))
    head_DxV = 0.5 * jax.random.normal(k2, (8, CFG.vocab_size))
    out = jax.jit(_losses, static_argnums=3)(hidden_BxSxD, head_DxV, batch, UPDATE_CASES)
    for name, _ in UPDATE_CASES:
        (l0, m0, g0), (l1, m1, g1) = out[name, "padded"], out[name, "packed"]
        assert float(l0) != 0.0, name
        np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-6, err_msg=name)
        assert set(m0) == set(m1), name
        for k in m0:
            np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, atol=1e-6, err_msg=f"{name}: {k}")
        for a, b, what in zip(g0, g1, ("hidden", "head"), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6, err_msg=f"{name}: d{what}")


def test_packed_learner_on_a_mesh_equals_padded_on_one_device():
    """make_learner with train.packing='packed' on a 4 x 2 (data x fsdp) mesh, 2 minibatches x
    2 microbatches: the reference log-probs and the whole update (model forward and backward:
    loss, every metric, every parameter gradient) equal the padded ones on one device. GSPO
    with a KL term: the per-sequence ratio comes from the bins' segments."""
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    params = init_params(CFG, jax.random.key(4))
    pack = packing.Packing(bins=8, length=26)
    host = host_batch(params, seed=5, pack=pack, prompts=8)  # 32 rows, 16 per minibatch
    bins_B = host["pack_bin_B"] + (np.arange(32) % M) * pack.bins
    assert np.bincount(bins_B[host["pack_len_B"] > 0]).max() >= 3
    oc = obj.ObjectiveConfig.preset("gspo", kl_beta=0.04)
    tx = _grad_sum()
    state, shardings = init_state(sharding.shard_params(params, mesh), tx, mesh)
    train_cfg = ml_collections.ConfigDict(
        dict(
            minibatches=M,
            microbatches=K,
            num_iterations=1,
            packing="packed",
            pack_bins=pack.bins,
            pack_length=pack.length,
        )
    )
    learner = make_learner(
        mesh=mesh, model_cfg=CFG, obj_cfg=oc, tx=tx, state_shardings=shardings, train_cfg=train_cfg
    )
    assert learner.pack == pack
    batch = learner.transfer.put_batch(host)
    np.testing.assert_allclose(
        learner.logps(state.params, batch),
        policy_logps(params, host, cfg=CFG, temperature=1.0),
        rtol=1e-6,
        atol=1e-6,
    )
    sharded = learner.update(state, batch, jax.random.key(0))
    single = jax.jit(_updates, static_argnums=(2, 3))(
        params, {k: jnp.asarray(v) for k, v in host.items()}, (("gspo", oc),), (None,)
    )
    assert float(single["gspo", False][1]["loss/kl"]) > 0
    # The plan's figures, to tune train.pack_bins by: bins used, token fill.
    used = max(len(set(host["pack_bin_B"][m::M][host["pack_len_B"][m::M] > 0])) for m in range(M))
    fill = host["pack_len_B"].sum() / (M * pack.bins * pack.length)
    assert float(sharded[1]["pack/bins_used_max"]) == used
    assert float(sharded[1]["pack/fill"]) == pytest.approx(fill)
    _assert_same(single["gspo", False], jax.device_get(sharded), "mesh")


def test_auto_bins_round_up_to_a_quarter_of_the_rows():
    # rounding="quarter" (the first auto). 16 rows, 2 microbatches: quantum 4; J in {4..16}.
    quarter = [packing.auto_bins(u, 16, 2, "quarter") for u in (0, 1, 4, 5, 9, 16)]
    assert quarter == [4, 4, 4, 8, 12, 16]
    # 6 rows, 4 microbatches: quantum ceil(6 / 4) = 2 -> 4 (a multiple of K), capped at 6.
    assert [packing.auto_bins(u, 6, 4, "quarter") for u in (1, 4, 5)] == [4, 4, 6]
    spans = np.array([[0, 5], [0, 5], [0, 5], [0, 5], [0, 12], [0, 3], [0, 3], [0, 3]])
    pack = packing.Packing(bins=0, length=12, rounding="quarter")
    plan = packing.plan(spans, pack, s=12, minibatches=1)
    # First-fit decreasing: 12 | 5 5 | 5 3 3 | 3 -> 4 bins used of 8 rows: J = 4 (quantum 2).
    assert plan["pack_bins"] == 4 and plan["pack_metrics"][0] == 4
    assert plan["pack_bin_B"].max() < 4


def test_auto_bins_ladder_bounds_the_shapes_a_run_compiles():
    """The default ladder: exact below 8, then m x 2^e with m in {4..7}, a multiple of K,
    <= rows: fewer than 1/5 of the bins empty, and a need that stays within a factor of two
    meets at most 5 values. C (the head's positions per bin) on {2, 3} x 2^e, <= W. The
    README command's needs (67-116 bins of 128 rows, every C 28-32) meet 4 x 1 shapes; the
    ladder before (16 values per doubling, C a multiple of W / 8) met 13 x 2 and compiled
    21 updates."""
    used = (0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 45, 65, 80, 81, 97, 113, 128)
    got = [packing.auto_bins(u, 128, 1) for u in used]
    assert got == [1, 1, 7, 8, 10, 16, 16, 20, 32, 40, 48, 80, 80, 96, 112, 128, 128]
    assert [packing.auto_bins(u, 128, 4) for u in (1, 7, 17, 45)] == [4, 8, 20, 48]
    assert packing.auto_bins(100, 96, 1) == 96
    for u in range(1, 2049):  # fewer than 1/5 of the bins empty
        j = packing.auto_bins(u, 4096, 1)
        assert u <= j and (j - u) * 5 < j
    for lo in range(1, 1025):  # a need within [lo, 2 lo]: at most 5 bin counts
        assert len({packing.auto_bins(u, 4096, 1) for u in range(lo, 2 * lo + 1)}) <= 5
    assert {packing.auto_bins(u, 128, 1) for u in range(67, 117)} == {80, 96, 112, 128}
    # C: at most 3 values within a factor of two, fewer than 1/3 of the positions unread.
    for lo in range(1, 513):
        reads = {min(packing.ladder(r, packing.READ_STEPS), 4096) for r in range(lo, 2 * lo + 1)}
        assert len(reads) <= 3
    for r in range(1, 4097):
        c = packing.ladder(r, packing.READ_STEPS)
        assert r <= c and (c - r) * 3 < c
    assert {packing.ladder(r, packing.READ_STEPS) for r in range(28, 33)} == {32}
    # The finer ladders, as `steps` gives them (16: the default before 2026-12-01).
    coarse = [packing.auto_bins(u, 128, 1, steps=8) for u in (17, 33, 45, 65)]
    assert coarse == [18, 36, 48, 72]
    assert len({packing.auto_bins(u, 128, 1, steps=16) for u in range(67, 117)}) == 13
    spans = np.array([[0, 5], [0, 5], [0, 5], [0, 5], [0, 12], [0, 3], [0, 3], [0, 3]])
    plan = packing.plan(spans, packing.Packing(bins=0, length=12), s=12, minibatches=1)
    assert plan["pack_bins"] == 4  # 4 used: exact
    with pytest.raises(ValueError, match="rounding"):
        packing.Packing(rounding="half")


def test_auto_bins_learner_equals_padded_and_compiles_once_per_bin_count():
    """make_learner with train.pack_bins=0 (auto): the batch carries J as the shape of its
    `pack_bins_J` marker, J is below one bin per row, and the update equals the padded one."""
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    params = init_params(CFG, jax.random.key(6))
    oc = obj.ObjectiveConfig.preset("grpo", kl_beta=0.04)
    tx = _grad_sum()
    learners = {}
    for mode in ("padded", "packed"):
        train_cfg = ml_collections.ConfigDict(
            dict(
                minibatches=M,
                microbatches=K,
                num_iterations=1,
                packing=mode,
                pack_bins=0,
                pack_length=2 * (S + N),
            )
        )
        state, shardings = init_state(params, tx, mesh)
        learners[mode] = make_learner(
            mesh=mesh,
            model_cfg=CFG,
            obj_cfg=oc,
            tx=tx,
            state_shardings=shardings,
            train_cfg=train_cfg,
        )
    packed = learners["packed"]
    assert packed.pack == packing.Packing(bins=0, length=26) and packed.microbatches == K
    out, shapes = {}, set()
    for seed in (7, 8, 9):  # three batches: one compile per distinct J (and row shape)
        groups = ragged_groups(seed)
        rng = np.random.default_rng(seed)  # sampler log-probs: the ratio is not 1
        old = -rng.uniform(0.5, 3.0, groups.completion_ids_PxGxN.shape).astype(np.float32)
        groups = dataclasses.replace(groups, old_logps_PxGxN=old)
        for mode, learner in learners.items():
            state, _ = init_state(jax.tree.map(jnp.copy, params), tx, mesh)  # donated
            batch = learner.batch(groups, state.params, state.params)
            out[mode] = jax.device_get(learner.update(state, batch, jax.random.key(0)))
        rows = P * G // M
        assert batch["pack_bins_J"].shape[0] < rows  # auto: fewer bins than rows
        assert batch["pack_reads_C"].shape[0] < 26  # and the head skips prompt positions
        shapes.add(
            (batch["pack_bins_J"].shape, batch["pack_reads_C"].shape, batch["input_ids_BxS"].shape)
        )
        assert out["packed"][1]["pack/bins_used_max"] <= batch["pack_bins_J"].shape[0]
        _assert_same(out["padded"], out["packed"], f"auto bins, seed {seed}")
    assert packed.update._cache_size() == len(shapes) < 3


def test_auto_bins_split_evenly_over_the_devices_and_compile_without_permutes():
    """Auto J is a multiple of K x the data-parallel devices (`shards`), so GSPMD splits the
    bins evenly: the packed update and log-prob programs (the head at the read positions)
    on a 4-device data mesh hold no collective-permute. Uneven bins (J = 22 on 4 devices, the
    old plan) padded the bins axis and moved the pads by collective-permutes, which XLA:CPU
    runs concurrently on one gloo slot: two processes aborted ("14336 vs 224 bytes")."""
    assert [packing.auto_bins(u, 128, 2, shards=4) for u in (1, 9, 17, 22)] == [8, 16, 24, 24]
    assert packing.auto_bins(5, 12, 2, shards=8) == 12  # at most one bin per row
    assert packing.auto_bins(5, 32, 1, "quarter", shards=4) == 8
    mesh = sharding.make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:4])
    params = init_params(CFG, jax.random.key(4))
    oc = obj.ObjectiveConfig.preset("grpo", kl_beta=0.04)
    tx = optax.sgd(1.0)
    train_cfg = ml_collections.ConfigDict(
        dict(minibatches=1, microbatches=1, num_iterations=1, packing="packed", pack_bins=0)
    )
    groups = ragged_groups(0, P=8)  # 32 rows, 17 bins used: J = 20 (18 before)
    old = -np.random.default_rng(5).uniform(0.5, 3.0, groups.completion_ids_PxGxN.shape)
    groups = dataclasses.replace(groups, old_logps_PxGxN=old.astype(np.float32))
    with jax.set_mesh(mesh), sharding.use_rules():
        state, shardings = init_state(sharding.shard_params(params, mesh), tx, mesh)
        learner = make_learner(
            mesh=mesh,
            model_cfg=CFG,
            obj_cfg=oc,
            tx=tx,
            state_shardings=shardings,
            train_cfg=train_cfg,
        )
        batch = learner.batch(groups, state.params, state.params)
        used = int(batch["pack_metrics"][0])
        assert packing.auto_bins(used, 32, 1, steps=16) % 4  # the old plan: uneven
        assert batch["pack_bins_J"].shape[0] % 4 == 0 and "pack_reads_C" in batch
        programs = {
            "update": learner.update.lower(state, batch, jax.random.key(0)),
            "logps": learner.logps.lower(state.params, batch),
        }
        for name, lowered in programs.items():
            assert "collective-permute" not in lowered.compile().as_text(), name


def test_plan_counts_the_positions_the_loss_reads_per_bin():
    """S = 12, T = 5: positions 6.. predict completion targets. Rows 0 and 2 share bin 0
    (5 + 5 read positions), row 1 (all prompt) is alone in bin 1: 10 read, C = 12 on the
    ladder of 2 values per doubling (8, 12, 16); the markers carry J and C as shapes."""
    spans = np.array([[2, 9], [0, 4], [5, 6], [0, 0]], np.int32)
    np.testing.assert_array_equal(packing.read_counts(spans, s=12, t=5), [5, 0, 5, 0])
    plan = packing.plan(spans, packing.Packing(bins=2, length=16), s=12, minibatches=1, t=5)
    np.testing.assert_array_equal(plan["pack_bin_B"][:3], [0, 1, 0])
    assert plan["pack_reads"] == 12
    marks = packing.markers(plan)
    assert marks["pack_bins_J"].shape == (2,) and marks["pack_reads_C"].shape == (12,)
    assert "pack_bins" not in plan and "pack_reads" not in plan
    spans[1] = [0, 11]  # row 1 reads 5 too: the fullest bin still reads 10
    assert (
        packing.plan(spans, packing.Packing(bins=2, length=16), s=12, minibatches=1, t=5)[
            "pack_reads"
        ]
        == 12
    )


def test_a_fixed_bin_count_must_split_evenly_over_the_devices_of_several_processes():
    packing.check_fixed_bins(0, 2, 4, processes=2)  # auto: even by construction
    packing.check_fixed_bins(24, 2, 4, processes=2)
    packing.check_fixed_bins(22, 2, 4, processes=1)  # one process: only the permutes' cost
    with pytest.raises(ConfigError, match=r"train.pack_bins=22 .* multiple of 8 \(e.g. 24\)"):
        packing.check_fixed_bins(22, 2, 4, processes=2)


def test_several_processes_refuse_an_uneven_fixed_bin_count_at_start(monkeypatch):
    """`gjax.config.validate` (before any model is loaded) refuses train.pack_bins that does
    not split over microbatches x data-parallel devices on several processes (the count
    faked: jax's runtime is the edge)."""
    from configs import common
    from gjax import config as config_lib

    c = common.tiny(common.base())
    c.train.packing, c.train.pack_bins, c.mesh.data = "packed", 6, 4
    config_lib.validate(c, 4)  # one process: allowed (the permutes cost time only)
    monkeypatch.setattr(config_lib.jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"train.pack_bins=6 .* multiple of 4 \(e.g. 8\)"):
        config_lib.validate(c, 4)
    c.train.pack_bins = 8
    config_lib.validate(c, 4)
