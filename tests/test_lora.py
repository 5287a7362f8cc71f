"""LoRA adapters (gjax.models.lora): the math, the tree, the sampler paths, the gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from gjax.models import lora
from gjax.models import transformer as tr
from gjax.rollout import SamplingParams, generate
from gjax.rollout.decoder import ContinuousDecoder
from tests.test_model import random_params, run, tiny_cfg
from tests.test_sampler import left_pad, teacher_forced_logits

jax.config.update("jax_default_matmul_precision", "highest")

ALL = ("q", "k", "v", "o", "gate", "up", "down")
BASE_CFG = tiny_cfg(vocab_size=64)
CFG = BASE_CFG.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
BASE = random_params(BASE_CFG)
TOKENS = np.random.RandomState(0).randint(0, 64, (2, 9))


def trained_adapters(cfg=CFG, seed=3, scale=0.3):
    """Adapters as after some training: B no longer zero."""
    adapters = lora.init_adapters(cfg, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    return jax.tree.map(lambda x: scale * jax.random.normal(next(keys), x.shape), adapters)


def test_adapter_tree_shapes_axes_and_counts():
    adapters = lora.init_adapters(CFG, jax.random.key(0))
    layers = adapters["layers"]
    assert set(adapters) == {"layers"} and set(layers) == {"attn", "mlp"}
    L, D, F, r = 2, 32, 48, 4
    assert layers["attn"]["q"]["lora_a"].shape == (L, D, r)
    assert layers["attn"]["q"]["lora_b"].shape == (L, r, 4 * 8)
    assert layers["attn"]["o"]["lora_a"].shape == (L, 4 * 8, r)
    assert layers["mlp"]["down"]["lora_b"].shape == (L, r, D)
    # A is random, B zero: the adapted model starts as the base.
    assert float(jnp.abs(layers["mlp"]["up"]["lora_a"]).max()) > 0
    assert all(float(jnp.abs(b).max()) == 0 for b in jax.tree.leaves(adapters)[1::2])
    # q,k,v,o,gate,up: in x r + r x out per layer
    q, kv = 4 * 8, 2 * 8
    per_layer = r * ((D + q) * 2 + (D + kv) * 2 + (D + F) * 3)
    assert lora.count(adapters) == L * per_layer
    axes = lora.adapter_logical_axes(CFG)["layers"]
    assert tuple(axes["attn"]["q"]["lora_a"]) == ("layers", "embed", None)
    assert tuple(axes["attn"]["q"]["lora_b"]) == ("layers", None, "q_heads")
    assert tuple(axes["mlp"]["down"]["lora_a"]) == ("layers", "mlp", None)


def test_split_and_merge_are_inverse_and_copy_nothing():
    adapters = trained_adapters()
    full = lora.merge(BASE, adapters)
    base, back = lora.split(full)
    assert jax.tree.structure(base) == jax.tree.structure(BASE)
    assert all(a is b for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(BASE)))
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)))
    assert lora.merge(None, BASE) is BASE  # full fine-tuning: the trained tree is the policy


def test_fresh_adapters_leave_the_base_model_bit_identical():
    full = lora.merge(BASE, lora.init_adapters(CFG, jax.random.key(0)))
    h_base, logits_base = run(BASE, BASE_CFG, TOKENS, return_logits=True)
    h, logits = run(full, CFG, TOKENS, return_logits=True)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_base))


QWEN3_CFG = tiny_cfg(
    model_type="qwen3", vocab_size=64, attention_bias=False, head_dim=16, num_heads=4
)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_forward_is_the_base_with_merged_kernels(family):
    """x W + s (x A) B == x (W + s A B): the low-rank forward against the merged model (on
    Qwen3 the adapted q and k pass through the per-head norms)."""
    base_cfg = BASE_CFG if family == "qwen2" else QWEN3_CFG
    cfg = base_cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
    base = BASE if family == "qwen2" else random_params(base_cfg)
    full = lora.merge(base, trained_adapters(cfg))
    _, logits = run(full, cfg, TOKENS, return_logits=True)
    _, merged_logits = run(lora.merged(full, cfg), base_cfg, TOKENS, return_logits=True)
    _, base_logits = run(base, base_cfg, TOKENS, return_logits=True)
    assert float(jnp.abs(logits - base_logits).max()) > 0.1  # the adapters act
    np.testing.assert_allclose(np.asarray(logits), np.asarray(merged_logits), atol=2e-5)


def test_targets_adapt_only_their_projections():
    cfg = BASE_CFG.replace(lora_rank=2, lora_alpha=2.0, lora_targets=("v", "down"))
    adapters = lora.init_adapters(cfg, jax.random.key(0))
    assert set(adapters["layers"]["attn"]) == {"v"}
    assert set(adapters["layers"]["mlp"]) == {"down"}


def test_samplers_decode_the_adapted_policy():
    """Static sampler and continuous decoder with adapters (merged per call) give the greedy
    tokens of the adapted model's full forward, and its log-probs."""
    full = lora.merge(BASE, trained_adapters())
    prompts = [[5, 9, 2, 33, 7], [41, 3]]
    tokens, mask = left_pad(prompts, 5)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, pad_token_id=63)
    tokens, mask, key = jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0)
    out = generate(full, CFG, tokens, mask, key, num_samples=2, sampling=sp)
    decoder = ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=2)
    cont = decoder.generate(full, tokens, mask, key, num_samples=2, sampling=sp)
    np.testing.assert_array_equal(np.asarray(cont.tokens_BxN), np.asarray(out.tokens_BxN))
    rep = lambda x: jnp.repeat(jnp.asarray(x), 2, axis=0)
    logits = teacher_forced_logits(full, CFG, rep(tokens), rep(mask), out.tokens_BxN, out.mask_BxN)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, -1)), np.asarray(out.tokens_BxN))
    base_out = generate(BASE, BASE_CFG, tokens, mask, key, num_samples=2, sampling=sp)
    assert (np.asarray(base_out.tokens_BxN) != np.asarray(out.tokens_BxN)).any()


def test_gradients_reach_only_the_adapters():
    """Differentiating through `merge(base, adapters)` gives a gradient tree of the adapters
    alone, equal to finite differences of the loss."""
    adapters = trained_adapters()

    def loss(adapters):
        _, logits = tr.forward(
            lora.merge(BASE, adapters),
            CFG,
            jnp.asarray(TOKENS),
            jnp.broadcast_to(jnp.arange(9), (2, 9)),
            jnp.ones((2, 9), jnp.int32),
            return_logits=True,
        )
        return jax.nn.log_softmax(logits)[..., 7].mean()

    grads = jax.grad(loss)(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    check_grads(loss, (adapters,), order=1, modes=("rev",))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(lora_rank=-1), "lora_rank must be an int >= 0"),
        (dict(lora_rank=4), "needs at least one of lora_targets"),
        (dict(lora_rank=4, lora_targets=("qkv",)), "unknown LoRA target"),
    ],
)
def test_bad_lora_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        BASE_CFG.replace(**bad)


# ------------------------------------------------------------------------ the learner


def lora_learner_setup():
    from tests.test_learner import CFG as LCFG

    cfg = LCFG.replace(lora_rank=4, lora_alpha=4.0, lora_targets=ALL)
    base = random_params(LCFG, seed=5)
    return LCFG, cfg, base, trained_adapters(cfg, seed=6, scale=0.1)


def run_lora_update(cfg, trained, frozen, batch, oc, tx, **kw):
    from tests.test_learner import run_update

    return run_update(trained, batch, oc, tx=tx, cfg=cfg, frozen=frozen, **kw)


def test_update_trains_the_adapters_alone_with_the_full_models_gradient():
    """With the base frozen the update is the full-tree update restricted to the adapters:
    SGD(1) on (base, adapters) as one tree moves every leaf by its gradient; the LoRA
    update moves the adapters by the same amount and has no base in its state. Adam's state
    holds adapter-sized moments only."""
    import optax

    from gjax import objective as obj
    from tests.test_learner import batch_for

    base_cfg, cfg, base, adapters = lora_learner_setup()
    full = lora.merge(base, adapters)
    batch = batch_for(lora.merged(full, cfg), seed=1)  # old/ref log-probs near the policy
    oc = obj.ObjectiveConfig.preset("grpo")
    sgd = optax.sgd(1.0)
    whole, m_whole = run_lora_update(cfg, full, None, batch, oc, sgd)
    state, m = run_lora_update(cfg, adapters, base, batch, oc, sgd)
    assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
    moved_base, moved_adapters = lora.split(whole.params)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(moved_adapters)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(
        float(jnp.abs(a - b).max()) > 1e-4
        for a, b in zip(jax.tree.leaves(moved_base), jax.tree.leaves(base))
    ), "the full-tree update moves the base: the comparison can tell the two apart"
    np.testing.assert_allclose(m["loss/total"], m_whole["loss/total"], rtol=1e-6)
    assert float(m["optim/grad_norm"]) < float(m_whole["optim/grad_norm"])  # adapters only
    adam = optax.adamw(1e-3)
    n_adapters = lora.count(adapters)
    assert lora.count(adam.init(adapters)) == 2 * n_adapters + 1  # mu, nu, count
    assert n_adapters < lora.count(base) / 4


def test_lora_update_is_the_same_for_any_microbatching():
    import optax

    from gjax import objective as obj
    from tests.test_learner import batch_for

    _, cfg, base, adapters = lora_learner_setup()
    batch = batch_for(lora.merged(lora.merge(base, adapters), cfg), seed=2)
    oc = obj.ObjectiveConfig.preset("dapo")
    s1, m1 = run_lora_update(cfg, adapters, base, batch, oc, optax.sgd(1.0))
    s4, m4 = run_lora_update(cfg, adapters, base, batch, oc, optax.sgd(1.0), microbatches=4)
    np.testing.assert_allclose(m1["optim/grad_norm"], m4["optim/grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lora_update_on_a_data_fsdp_tensor_mesh_equals_one_device():
    """Adapters sharded as their kernels (A's rows, B's columns) on a 2 x 2 x 2 mesh: the
    update, its log-probs and the reference's equal the single-device ones."""
    import ml_collections
    import optax

    from gjax import objective as obj
    from gjax import sharding
    from gjax.learner import init_state, make_learner
    from tests.test_learner import batch_for

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    _, cfg, base, adapters = lora_learner_setup()
    host = {
        k: np.asarray(v)
        for k, v in batch_for(lora.merged(lora.merge(base, adapters), cfg), P=8, seed=3).items()
    }
    oc = obj.ObjectiveConfig.preset("grpo")
    train_cfg = ml_collections.ConfigDict(dict(minibatches=2, microbatches=2, num_iterations=1))
    out = {}
    for shape in ({"data": 1, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 2, "tensor": 2}):
        devices = np.asarray(jax.devices()[: int(np.prod(list(shape.values())))])
        mesh = sharding.make_mesh(shape, devices=devices)
        with jax.set_mesh(mesh), sharding.use_rules():
            frozen = sharding.shard_params(jax.device_get(base), mesh)
            trained = jax.device_put(  # host copies: the update donates its state
                jax.device_get(adapters),
                sharding.param_shardings(lora.abstract_adapters(cfg), mesh),
            )
            tx = optax.adam(1e-2)
            state, shardings = init_state(trained, tx, mesh)
            learner = make_learner(
                mesh=mesh,
                model_cfg=cfg,
                obj_cfg=oc,
                tx=tx,
                state_shardings=shardings,
                train_cfg=train_cfg,
                frozen=frozen,
            )
            batch = learner.transfer.put_batch(host)
            ref = learner.ref_logps(frozen, batch)
            state, metrics = learner.update(state, batch, jax.random.key(0), frozen)
            out[shape["tensor"]] = jax.device_get((state.params, metrics["loss/total"], ref))
        if shape["tensor"] == 2:
            q_a = state.params["layers"]["attn"]["q"]["lora_a"]
            assert q_a.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
            q_b = state.params["layers"]["attn"]["q"]["lora_b"]
            assert q_b.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(out[2])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------------ QLoRA


@pytest.mark.parametrize("how, bits", [("int8", 8), ("int4", 4), ("nf4", 4)])
def test_quantized_kernels_round_trip_within_half_a_step(how, bits):
    """Codes * scale reproduce W within half a quantization step of its block (int codes:
    step = absmax / (2^(b-1) - 1)); nf4's step is its code book's widest gap (-1 to -0.696 of
    absmax: QLoRA App. E's NormalFloat4); the codes are stored in qwix's dtypes."""
    from gjax.models import quant

    w = jax.random.normal(jax.random.key(0), (2, 128, 48)) * jnp.linspace(0.1, 2.0, 48)
    codes, scale = quant.quantize(w, how)
    assert codes.dtype == quant.code_dtype(how) and codes.shape == w.shape
    blocks = 1 if how == "int8" else 128 // quant.BLOCK
    assert scale.shape == (2, blocks, 48) == (2, *quant.scale_shape(128, 48, how))
    back = quant.dequantize(codes, scale, how, jnp.float32)
    w_blocks = w.reshape(2, blocks, -1, 48)
    absmax = jnp.abs(w_blocks).max(axis=2, keepdims=True)
    err = jnp.abs(back.reshape(w_blocks.shape) - w_blocks)
    step = absmax / (2 ** (bits - 1) - 1) if how != "nf4" else (1 - 0.6961928) * absmax
    assert bool((err <= step / 2 + 1e-6).all()), float((err - step / 2).max())
    assert float(err.max()) > 0  # lossy: the test can tell codes from floats


def qlora_cfg(how):
    return CFG.replace(base_quant=how)


def quantized_base(cfg):
    from gjax import sharding
    from gjax.models import quant

    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    abstract = lora.split(tr.abstract_params(cfg))[0]
    base = jax.tree.map(lambda x: x.copy(), BASE)  # quantize_base deletes its sources
    return quant.quantize_base(base, cfg, sharding.param_shardings(abstract, mesh))


@pytest.mark.parametrize("how", ["int8", "nf4"])
def test_qlora_forward_is_the_dequantized_base_plus_adapters(how):
    """The quantized base's tree has the model's abstract layout (codes + scales) and 1/4
    (int8) or ~1/7 (nf4, with its scales) of the projections' f32 bytes; the forward with
    it equals the merged model of the dequantized base, and is close to the f32 base's."""
    from gjax.models import quant

    cfg = qlora_cfg(how)
    base = quantized_base(cfg)
    abstract = lora.split(tr.abstract_params(cfg))[0]
    assert jax.tree.structure(base) == jax.tree.structure(abstract)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(abstract)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    layers = [(g, n) for g, n in quant.PROJECTIONS]
    f32 = sum(BASE["layers"][g][n]["kernel"].size * 4 for g, n in layers)
    stored = quant.stored_bytes(
        [{k: base["layers"][g][n][k] for k in ("kernel", "kernel_scale")} for g, n in layers]
    )
    scales = sum(base["layers"][g][n]["kernel_scale"].size * 4 for g, n in layers)
    assert stored == f32 * (8 if how == "int8" else 4) // 32 + scales  # 1 or 1/2 byte a code
    full = lora.merge(base, trained_adapters(cfg))
    _, logits = run(full, cfg, TOKENS, return_logits=True)
    merged = lora.merged(full, cfg)
    assert "kernel_scale" not in merged["layers"]["mlp"]["up"]
    _, merged_logits = run(merged, BASE_CFG, TOKENS, return_logits=True)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(merged_logits), atol=2e-5)
    _, f32_logits = run(lora.merge(BASE, trained_adapters(cfg)), CFG, TOKENS, return_logits=True)
    gap = float(jnp.abs(logits - f32_logits).max())
    # int8 keeps the model (O(1) logits here); nf4's 16 codes are coarser than int8's 255.
    int8_gap = 0.5
    if how == "nf4":
        int8_base = quantized_base(qlora_cfg("int8"))
        _, int8_logits = run(
            lora.merge(int8_base, trained_adapters(cfg)),
            qlora_cfg("int8"),
            TOKENS,
            return_logits=True,
        )
        int8_gap = float(jnp.abs(int8_logits - f32_logits).max())
        assert gap > int8_gap, (gap, int8_gap)
    else:
        assert 0 < gap < int8_gap, gap


def test_a_4_bit_base_has_a_content_digest():
    """The hand-off's base record digests a quantized base (int4 / uint4 codes have no
    bitcast: their values are digested), and a changed code changes it."""
    cfg = qlora_cfg("nf4")
    base = quantized_base(cfg)
    digest = lora.base_digest(base)
    codes = base["layers"]["mlp"]["up"]["kernel"]
    changed = jax.tree.map(lambda x: x, base)
    bumped = ((codes[0, 0, 0].astype(jnp.int32) + 1) % 16).astype(codes.dtype)
    changed["layers"]["mlp"]["up"]["kernel"] = codes.at[0, 0, 0].set(bumped)
    assert digest != lora.base_digest(changed)


def test_samplers_decode_the_qlora_policy():
    cfg = qlora_cfg("int8")
    full = lora.merge(quantized_base(cfg), trained_adapters(cfg))
    tokens, mask = left_pad([[5, 9, 2, 33, 7], [41, 3]], 5)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, pad_token_id=63)
    tokens, mask, key = jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0)
    out = generate(full, cfg, tokens, mask, key, num_samples=2, sampling=sp)
    cont = ContinuousDecoder(cfg, slots=3, tokens_per_dispatch=2).generate(
        full, tokens, mask, key, num_samples=2, sampling=sp
    )
    np.testing.assert_array_equal(np.asarray(cont.tokens_BxN), np.asarray(out.tokens_BxN))
    rep = lambda x: jnp.repeat(jnp.asarray(x), 2, axis=0)
    logits = teacher_forced_logits(full, cfg, rep(tokens), rep(mask), out.tokens_BxN, out.mask_BxN)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, -1)), np.asarray(out.tokens_BxN))


def test_decode_keeps_a_small_adapter_update_in_bf16():
    """The decode step adds the low-rank term as the learner does: in bf16, an update of
    ~0.1 % of W (a LoRA run's first steps) keeps its effect. (Merged into a bf16 kernel it
    rounded away: the sampler's values were off by about the update itself.)"""
    cfg = CFG.replace(dtype="bfloat16")
    full = lora.merge(BASE, trained_adapters(cfg, scale=0.01))
    x = jax.random.normal(jax.random.key(7), (5, 32)).astype(jnp.bfloat16)
    zeros = jnp.zeros((5,), jnp.int32)
    cos, sin = tr.rope_cos_sin(zeros, cfg)
    _, _, v_decode = tr.decode_qkv(tr.decode_layers(full, cfg)[0], x, cos, sin, cfg)

    def learner_v(params, cfg):  # the training forward's v projection of layer 0
        p0 = jax.tree.map(lambda a: a[0], params["layers"])
        h = tr.rms_norm(x, p0["input_norm"]["scale"], cfg.rms_norm_eps)
        return tr._qkv(p0["attn"], h, cfg)[2].reshape(5, -1)

    v_learner = learner_v(full, cfg)
    effect = v_learner.astype(jnp.float32) - learner_v(BASE, BASE_CFG.replace(dtype="bfloat16"))
    rel_update = float(
        jnp.abs(
            tr.merged_kernel(full["layers"]["attn"]["v"], cfg)
            - BASE["layers"]["attn"]["v"]["kernel"]
        ).mean()
        / jnp.abs(BASE["layers"]["attn"]["v"]["kernel"]).mean()
    )
    assert rel_update < 0.01, rel_update  # a small update, as early in training
    err = jnp.abs(v_decode.reshape(5, -1).astype(jnp.float32) - v_learner.astype(jnp.float32))
    assert float(err.max()) <= 0.05 * float(jnp.abs(effect).max()), (err.max(), effect.max())
