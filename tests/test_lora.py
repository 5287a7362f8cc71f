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


def test_forward_is_the_base_with_merged_kernels():
    """x W + s (x A) B == x (W + s A B): the low-rank forward against the merged model."""
    full = lora.merge(BASE, trained_adapters())
    _, logits = run(full, CFG, TOKENS, return_logits=True)
    _, merged_logits = run(lora.merged(full, CFG), BASE_CFG, TOKENS, return_logits=True)
    _, base_logits = run(BASE, BASE_CFG, TOKENS, return_logits=True)
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
