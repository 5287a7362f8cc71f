"""The Flax decoder: masking, padding/packing invariance, heads, remat, dtypes, param layout."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.models import transformer as tr
from gjax.models.config import ModelConfig

jax.config.update("jax_default_matmul_precision", "highest")


def tiny_cfg(**kw):
    base = dict(
        model_type="qwen2",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
    )
    base.update(kw)
    return ModelConfig(**base)


def random_params(cfg, seed=0, scale=0.3):
    """Params with O(1) activations (the 0.02 init makes every logit nearly equal)."""
    params = tr.init_params(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for key, (path, x) in zip(keys, leaves):
        noise = jax.random.normal(key, x.shape, jnp.float32)
        is_norm = "scale" in jax.tree_util.keystr(path)
        out.append((1.0 + 0.1 * noise if is_norm else scale * noise).astype(x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def run(params, cfg, tokens, positions=None, segments=None, **kw):
    tokens = jnp.asarray(tokens)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    if segments is None:
        segments = jnp.ones_like(tokens)
    return _forward(params, cfg, tokens, jnp.asarray(positions), jnp.asarray(segments), **kw)


_forward = jax.jit(tr.forward, static_argnames=("cfg", "return_logits"))


CFG = tiny_cfg()
PARAMS = random_params(CFG)
TOKENS = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 9))


def test_param_tree_matches_contract():
    shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), tr.abstract_params(CFG))
    L, D, F, V = 2, 32, 48, 61
    assert shapes == {
        "embed": {"embedding": (V, D)},
        "layers": {
            "input_norm": {"scale": (L, D)},
            "attn": {
                "q": {"kernel": (L, D, 32), "bias": (L, 32)},
                "k": {"kernel": (L, D, 16), "bias": (L, 16)},
                "v": {"kernel": (L, D, 16), "bias": (L, 16)},
                "o": {"kernel": (L, 32, D)},
            },
            "post_attn_norm": {"scale": (L, D)},
            "mlp": {
                "gate": {"kernel": (L, D, F)},
                "up": {"kernel": (L, D, F)},
                "down": {"kernel": (L, F, D)},
            },
        },
        "final_norm": {"scale": (D,)},
        "lm_head": {"kernel": (D, V)},
    }
    llama = tr.abstract_params(
        tiny_cfg(model_type="llama", attention_bias=False, tie_word_embeddings=True)
    )
    assert "lm_head" not in llama and "bias" not in llama["layers"]["attn"]["q"]
    assert "q_norm" not in shapes["layers"]["attn"] and "q_norm" not in llama["layers"]["attn"]
    # Qwen3: per-head q/k norms over Dh (12 here, with H * Dh = 48 != D = 32); o bias too.
    qwen3 = tr.abstract_params(tiny_cfg(model_type="qwen3", head_dim=12))
    attn = jax.tree_util.tree_map(lambda x: tuple(x.shape), qwen3["layers"]["attn"])
    assert attn == {
        "q": {"kernel": (L, D, 48), "bias": (L, 48)},
        "k": {"kernel": (L, D, 24), "bias": (L, 24)},
        "v": {"kernel": (L, D, 24), "bias": (L, 24)},
        "o": {"kernel": (L, 48, D), "bias": (L, D)},
        "q_norm": {"scale": (L, 12)},
        "k_norm": {"scale": (L, 12)},
    }


def test_logical_axes():
    axes = tr.param_logical_axes(CFG)
    assert tuple(axes["embed"]["embedding"]) == ("vocab", "embed")
    assert tuple(axes["layers"]["attn"]["q"]["kernel"]) == ("layers", "embed", "q_heads")
    assert tuple(axes["layers"]["attn"]["k"]["bias"]) == ("layers", "kv_heads")
    assert tuple(axes["layers"]["attn"]["o"]["kernel"]) == ("layers", "q_heads", "embed")
    assert tuple(axes["layers"]["mlp"]["down"]["kernel"]) == ("layers", "mlp", "embed")
    assert tuple(axes["lm_head"]["kernel"]) == ("embed", "vocab")
    qwen3 = tr.param_logical_axes(tiny_cfg(model_type="qwen3"))["layers"]["attn"]
    assert tuple(qwen3["q_norm"]["scale"]) == tuple(qwen3["k_norm"]["scale"]) == ("layers", None)


def test_init_params_scale_and_dtype():
    params = tr.init_params(tiny_cfg(param_dtype="bfloat16"), jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    np.testing.assert_array_equal(np.asarray(params["final_norm"]["scale"], np.float32), 1.0)
    assert 0.01 < float(jnp.std(params["embed"]["embedding"].astype(jnp.float32))) < 0.03


def test_causal_masking():
    hidden = run(PARAMS, CFG, TOKENS)
    changed = TOKENS.copy()
    changed[:, 5:] = (changed[:, 5:] + 1) % CFG.vocab_size
    hidden2 = run(PARAMS, CFG, changed)
    np.testing.assert_allclose(hidden[:, :5], hidden2[:, :5], atol=1e-6)
    assert not np.allclose(hidden[:, 5:], hidden2[:, 5:], atol=1e-3)


def test_left_padding_invariance():
    alone = run(PARAMS, CFG, TOKENS[:1, :6])
    pad = 3
    tokens = np.concatenate([np.full((1, pad), 7), TOKENS[:1, :6]], axis=1)
    segments = np.concatenate([np.zeros((1, pad), int), np.ones((1, 6), int)], axis=1)
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0)
    padded = run(PARAMS, CFG, tokens, positions, segments)
    np.testing.assert_allclose(padded[:, pad:], alone, atol=2e-6)
    assert np.all(np.isfinite(np.asarray(padded)))


def test_segment_isolation_packing():
    a, b = TOKENS[0, :4], TOKENS[1, :5]
    packed = np.concatenate([a, b, [0, 0]])[None]
    segments = np.array([[1] * 4 + [2] * 5 + [0, 0]])
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0]])
    out = run(PARAMS, CFG, packed, positions, segments)
    np.testing.assert_allclose(out[:, :4], run(PARAMS, CFG, a[None]), atol=2e-6)
    np.testing.assert_allclose(out[:, 4:9], run(PARAMS, CFG, b[None]), atol=2e-6)


def test_tied_and_untied_heads():
    hidden, logits = run(PARAMS, CFG, TOKENS, return_logits=True)
    np.testing.assert_allclose(logits, hidden @ PARAMS["lm_head"]["kernel"], atol=1e-5)
    assert tr.lm_head_kernel(PARAMS, CFG) is PARAMS["lm_head"]["kernel"]
    tied = CFG.replace(tie_word_embeddings=True)
    tied_params = {k: v for k, v in PARAMS.items() if k != "lm_head"}
    hidden_t, logits_t = run(tied_params, tied, TOKENS, return_logits=True)
    np.testing.assert_allclose(hidden_t, hidden, atol=1e-6)
    np.testing.assert_allclose(logits_t, hidden @ PARAMS["embed"]["embedding"].T, atol=1e-5)
    np.testing.assert_array_equal(
        tr.lm_head_kernel(tied_params, tied), PARAMS["embed"]["embedding"].T
    )
    with pytest.raises(Exception, match="lm_head"):
        run(tied_params, CFG, TOKENS, return_logits=True)


@pytest.mark.parametrize(
    "policy",
    [
        "full",
        pytest.param("dots", marks=pytest.mark.slow),
        pytest.param("dots_with_no_batch_dims", marks=pytest.mark.slow),
    ],
)
def test_remat_same_values_and_grads(policy):
    segments = np.ones_like(TOKENS)
    segments[0, :2] = 0

    def loss(params, cfg):
        _, logits = run(params, cfg, TOKENS, segments=segments, return_logits=True)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * segments)

    grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    value, grads = grad_fn(PARAMS, CFG)
    value_r, grads_r = grad_fn(PARAMS, CFG.replace(remat=policy))
    np.testing.assert_allclose(value_r, value, rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads_r, grads)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    # The remat config really rematerializes (a checkpoint in the jaxpr), the default does not.
    jaxpr = str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(PARAMS, CFG.replace(remat=policy)))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    plain = str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(PARAMS, CFG))
    assert "checkpoint" not in plain and "remat" not in plain


def test_bf16_compute_runs_close_to_f32():
    cfg = CFG.replace(dtype="bfloat16")
    hidden, logits = run(PARAMS, cfg, TOKENS, return_logits=True)
    assert hidden.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    _, logits32 = run(PARAMS, CFG, TOKENS, return_logits=True)
    assert np.all(np.isfinite(np.asarray(logits)))
    # bf16 has ~3 significant digits; the logits are O(1).
    assert float(jnp.max(jnp.abs(logits - logits32))) < 0.15 * float(jnp.max(jnp.abs(logits32)))


@pytest.mark.parametrize(
    "impl, model_type",
    [("auto", "qwen2"), ("xla", "qwen2"), ("xla_blocked", "qwen2"), ("auto", "qwen3")],
)
def test_prefill_matches_forward_and_returns_cache(impl, model_type):
    """Prefill runs the forward's attention implementation (dense vs blocked: ~2e-6 apart);
    for Qwen3 it applies the per-head q/k norms as the forward does."""
    cfg = CFG.replace(attention=impl, model_type=model_type)
    params = PARAMS if model_type == "qwen2" else random_params(cfg, seed=6)
    segments = np.ones_like(TOKENS)
    segments[1, :3] = 0
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0)
    hidden = run(params, cfg, TOKENS, positions, segments)
    hidden_p, k, v = tr.prefill(
        params, cfg, jnp.asarray(TOKENS), jnp.asarray(positions), jnp.asarray(segments)
    )
    np.testing.assert_allclose(hidden_p, hidden, atol=1e-6)
    assert k.shape == v.shape == (2, 2, 2, 9, 8)  # [L, P, K, S, Dh]


def test_llama3_rope_scaling_bands():
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    cfg = tiny_cfg(model_type="llama", head_dim=16, rope_scaling=tuple(sorted(scaling.items())))
    plain = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    got = tr.rope_inv_freq(cfg)
    wavelen = 2 * math.pi / plain
    high_band = wavelen < 64 / 4  # short wavelengths: unchanged
    low_band = wavelen > 64 / 1  # long wavelengths: divided by the factor
    assert high_band.any() and low_band.any()
    np.testing.assert_allclose(got[high_band], plain[high_band], rtol=1e-6)
    np.testing.assert_allclose(got[low_band], plain[low_band] / 8, rtol=1e-6)
    mid = ~high_band & ~low_band
    assert np.all(got[mid] <= plain[mid]) and np.all(got[mid] >= plain[mid] / 8)
