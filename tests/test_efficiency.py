"""gjax.efficiency: the checks of compiled programs that need no accelerator (bytes of a decode
step, the KV cache updated in place, host syncs per decode dispatch and per training step,
the packed update's executed over useful FLOPs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from gjax import efficiency, sharding
from gjax import objective as obj
from gjax.learner import build_learner
from gjax.models import transformer as tr
from gjax.models.config import ModelConfig
from gjax.rollout.decoder import ContinuousDecoder
from gjax.rollout.sampler import SamplingParams
from tests.test_experience import make_groups
from tests.test_learner import CFG


def decode_cfg(**kw) -> ModelConfig:
    """A small Qwen2 whose decode step has the 1.5B shape's proportions where they matter:
    rows few against the hidden size, K < H, tied head."""
    dims = dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )
    dims.update(kw)
    return ModelConfig(
        model_type="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        dtype="float32",
        param_dtype="float32",
        max_position_embeddings=4096,
        **dims,
    )


def test_decode_step_bytes_over_ideal_and_where_the_rest_goes():
    got = efficiency.decode_step_bytes(
        decode_cfg(), slots=16, regions=4, prompt_len=32, max_new=64, tokens_per_dispatch=8
    )
    # The per-op split of the optimized HLO is XLA's own count, op by op.
    assert got["hlo_bytes"] == pytest.approx(got["bytes_accessed"], rel=0.01)
    assert got["ideal_bytes"] == got["weight_bytes"] + got["kv_bytes"]
    # As XLA counts: 2.1x the ideal at this shape (2.19x at the 1.5B shape): the KV write is
    # a scatter counted as reading and writing each layer's whole cache, the embedding
    # lookup a gather counted as reading the whole table. Neither is traffic: corrected,
    # 1.50x for a one-step dispatch, 1.37x per step at 8 steps per dispatch (1.37x / 1.25x at
    # the 1.5B shape, benchmarks/accelerator.py).
    assert 2.0 < got["bytes_over_ideal"] < 2.2
    assert 1.45 < got["touched_over_ideal"] < 1.55
    assert 1.3 < got["step_touched_over_ideal"] < 1.45
    over = {r["jax_op"].split("/")[-1]: r for r in got["counted_not_touched"][:2]}
    assert set(over) == {"scatter", "gather"}
    kv_layer = got["kv_bytes"] // 2 // 2  # own cache: half the KV state; k and v per layer
    per_layer = 16 * 2 * 64 * 64 * 4  # [S, K, N, Dh] f32
    assert over["scatter"]["count"] == 2 * 2 and over["scatter"]["bytes"] > 4 * 2 * per_layer
    assert kv_layer > per_layer  # (the prompt regions count in kv_bytes too)
    # The prompt KV is gathered per slot ([S, K, Sp, Dh] per layer, hoisted out of the step
    # loop): the largest op outside the loop, once per dispatch.
    outside = [r for r in got["most_touched"] if r["per"] == "dispatch"]
    assert outside and outside[0]["shape"] == "f32[16,2,32,64]" and "_take" in outside[0]["jax_op"]


def test_decode_step_updates_the_kv_cache_in_place():
    got = efficiency.decode_step_bytes(decode_cfg(), slots=8, regions=2, prompt_len=16, max_new=32)
    kv = got["kv_in_place"]
    assert kv["in_place"] and kv["cache_copies"] == []
    assert kv["cache_leaves"] == kv["cache_leaves_donated"] == 2 * 2  # k, v x 2 layers
    assert kv["cache_sized_writes_per_step"] == 4  # the scatters, each in place


def test_paged_decode_step_updates_the_pool_in_place_and_what_its_gather_costs():
    """The paged step (`kv_page_size`, gjax.rollout.pages) on the decoder's default pool (the
    contiguous layout's bytes): the pool is donated and written by in-place scatters only.
    Its bytes per step are 1.97x the ideal against the contiguous step's 1.39x at this shape:
    the attention reads each slot's pages through an XLA gather, which materialises the
    slot's columns every step ([K, S, Q*P + N, Dh] per layer: the keys, and the values with
    the columns past its length zeroed in the same fusion; the contiguous step gathers the
    prompt once per dispatch). These copies are what the Pallas paged-attention kernels
    (`rollout.paged_attention` on a GPU / TPU) save by reading the pool through the table;
    the heads-major pool makes the gather the only copy (no transposed keys)."""
    kw = dict(slots=16, regions=4, prompt_len=32, max_new=64, tokens_per_dispatch=8)
    contiguous = efficiency.decode_step_bytes(decode_cfg(), **kw)
    paged = efficiency.decode_step_bytes(decode_cfg(), kv_page_size=16, **kw)
    assert paged["kv_bytes"] == contiguous["kv_bytes"]  # 16 divides the prompt: same ideal
    kv = paged["kv_in_place"]
    assert kv["in_place"] and kv["cache_copies"] == []
    assert kv["cache_leaves"] == kv["cache_leaves_donated"] == 2 * 2  # pages_k, pages_v x 2
    assert kv["cache_sized_writes_per_step"] == 4
    assert 1.3 < contiguous["step_touched_over_ideal"] < 1.45
    assert 1.85 < paged["step_touched_over_ideal"] < 2.0
    gathered = "f32[2,16,96,64]"  # [K, S, C, Dh]: C = 2 prompt pages + 4 own pages of 16
    copies = {
        r["jax_op"].split("/")[-1]: r["count"]
        for r in paged["most_touched"]
        if r["shape"] == gathered and r["per"] == "step"
    }
    assert copies == {"gather": 2, "select_n": 2}  # keys, masked values; per layer


def test_in_place_check_fails_a_program_that_rewrites_or_keeps_the_cache():
    cache = jnp.zeros((4, 2, 16, 8), jnp.float32)
    new, i = jnp.ones((4, 2, 8), jnp.float32), jnp.int32(3)

    def scatter(cache_k, new_SxKxDh, i):
        return cache_k.at[:, :, i].set(new_SxKxDh)

    def select(cache_k, new_SxKxDh, i):  # rewrites every entry of the cache
        hit = (jnp.arange(16) == i)[None, None, :, None]
        return jnp.where(hit, new_SxKxDh[:, :, None], cache_k * 1.0001)

    def check(fn, donate):
        jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
        text = jitted.lower(cache, new, i).compile().as_text()
        return efficiency.kv_in_place(text, cache_prefixes=("cache_k",))

    assert check(scatter, donate=True)["in_place"]
    rewrite = check(select, donate=True)
    assert not rewrite["in_place"] and rewrite["cache_copies"]
    kept = check(scatter, donate=False)  # not donated: the output is a new buffer
    assert not kept["in_place"] and kept["cache_leaves_donated"] == 0


def test_host_syncs_sees_every_kind_of_fetch():
    x = jnp.arange(6.0) * 2
    fetches = {
        "np.asarray": lambda: np.asarray(x),
        "np.array": lambda: np.array(x),
        "float": lambda: float(x[1]),
        "bool": lambda: bool(x[1] > 0),
        "item": lambda: x[2].item(),
        "tolist": lambda: x.tolist(),
    }
    for what, fetch in fetches.items():
        syncs = efficiency.HostSyncs()
        with syncs():
            fetch()
        assert (syncs.syncs, syncs.transfers) == (1, 1), what
        assert syncs.implicit[0].startswith(__file__), what
    syncs = efficiency.HostSyncs()
    with syncs():
        jax.device_get((x * 2, x + 1, {"a": x - 1}))  # one sync, three arrays
        np.asarray(np.ones(3))  # host data: nothing fetched
    assert (syncs.syncs, syncs.transfers, syncs.implicit) == (1, 3, [])


def test_continuous_decoder_syncs_once_per_dispatch():
    cfg = decode_cfg(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1)
    cfg = cfg.replace(num_heads=2, num_kv_heads=1, head_dim=16)
    params = tr.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 64, (4, 5)).astype(np.int32)
    decoder = ContinuousDecoder(cfg, slots=4, tokens_per_dispatch=4)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0)
    limits = rng.randint(1, 17, 8)  # ragged: slots refill between dispatches
    decoder.generate(  # compiles
        params, tokens, np.ones_like(tokens), jax.random.key(0), num_samples=2, sampling=sp
    )
    syncs = efficiency.HostSyncs()
    with syncs():
        decoder.generate(
            params,
            tokens,
            np.ones_like(tokens),
            jax.random.key(1),
            num_samples=2,
            sampling=sp,
            max_tokens_B=limits,
        )
    st = decoder.stats
    assert st["dispatches"] >= 4 and st["prefill_calls"] >= 1
    # One device_get per dispatch (tokens, log-probs, live, steps, done: 5 arrays); none
    # for prefill or insert, none implicit.
    assert syncs.syncs == st["dispatches"] and syncs.implicit == []
    assert syncs.transfers == 5 * st["dispatches"]
    got = efficiency.decode_host_syncs(
        decoder, params, tokens, np.ones_like(tokens), jax.random.key(2), num_samples=2, sampling=sp
    )
    assert got["per_dispatch"] == 1.0


def test_training_step_syncs_once():
    config = common.tiny(common.base())
    config.rollout.prompts_per_step, config.rollout.num_samples = 4, 4
    mesh = sharding.make_mesh({"data": -1})
    params = sharding.shard_params(tr.init_params(CFG, jax.random.key(0)), mesh)
    oc = obj.ObjectiveConfig.preset("grpo")
    state, learner = build_learner(config, mesh=mesh, model_cfg=CFG, obj_cfg=oc, params=params)
    rng = np.random.default_rng(0)
    groups = make_groups(rng.integers(0, 2, (4, 4)).astype(np.float32), S=5, N=6)
    groups.completion_mask_PxGxN[..., 4:] = False
    groups.old_logps_PxGxN = np.full(groups.completion_ids_PxGxN.shape, -1.0, np.float32)
    ref = jax.tree.map(lambda x: x.copy(), params)  # as gjax.train: the update donates params
    got, _ = efficiency.train_step_host_syncs(learner, state, groups, ref, jax.random.key(0))
    # Learner.batch (packing plan on the host rows, reference log-probs), the update and
    # the Recorder's pull of the step's metrics: one sync, the pull.
    assert got["per_step"] == 1.0 and got["implicit"] == []
    assert got["arrays_fetched"] > 2 * 5  # every metric in that one pull


def test_packed_update_executed_over_useful():
    """The embedded policy's update on the README's packing setting (P=16 x G=8, prompts of
    13-21 of 32 tokens, Pareto completions of at most 48): the packed plan's padding waste."""
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        attention_bias=True,
        tie_word_embeddings=True,
        remat="full",
    )
    rng = np.random.default_rng(0)
    prompt_B = rng.integers(13, 22, 16).repeat(8)
    x_m = 48 / 8  # benchmarks/train_step.py's pareto_lengths
    comp_B = np.clip(np.floor(x_m * (1 + rng.pareto(2.0, 128))), 1, 48).astype(np.int64)
    got = {
        impl: efficiency.packed_update_flops(
            cfg,
            prompt_lengths_B=prompt_B,
            completion_lengths_B=comp_B,
            prompt_len=32,
            max_new=48,
            attention_impl=impl,
        )
        for impl in ("xla", "xla_blocked")
    }
    dense, blocked = got["xla"], got["xla_blocked"]
    assert dense["padded_padding_waste"] > 2.5  # rows padded to 80 tokens
    # Packed: 1.11 dense, 1.08 xla_blocked (the <= 1.1 target met by xla_blocked only;
    # README: 1.09-1.11 and 1.05-1.07 measured); remat "full" multiplies both by ~1.23.
    assert dense["packed_padding_waste"] < 1.12 and blocked["packed_padding_waste"] <= 1.1
    assert blocked["packed_padding_waste"] < dense["packed_padding_waste"]
    assert 1.2 < dense["packed_recompute_factor"] < 1.3
    assert dense["packed_executed_over_useful"] == pytest.approx(
        dense["packed_padding_waste"] * dense["packed_recompute_factor"]
    )
