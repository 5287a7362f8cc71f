"""The jit group sampler against the full no-cache forward (teacher forcing), and its statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from gjax import sharding
from gjax.data import prompts as prompts_lib
from gjax.models import transformer as tr
from gjax.rollout import LocalSampler, RolloutBackend, SamplingParams, generate
from tests.test_model import random_params, tiny_cfg  # O(1)-logit params, shared

jax.config.update("jax_default_matmul_precision", "highest")

CFG = tiny_cfg(vocab_size=64)


PARAMS = random_params(CFG)
# Three left-padded prompts of lengths 5, 2, 7.
PROMPTS = [[5, 9, 2, 33, 7], [41, 3], [8, 8, 1, 60, 12, 19, 4]]
S = 7


def left_pad(prompts, width):
    return prompts_lib.left_pad(prompts, width, pad_id=0)


@jax.jit(static_argnames=("cfg",))
def teacher_forced_logits(params, cfg, prompt_tokens_BxS, prompt_mask_BxS, tokens_BxN, mask_BxN):
    """Full no-cache forward over prompt + completion; logits predicting each completion token."""
    seq = jnp.concatenate([prompt_tokens_BxS, tokens_BxN], axis=1)
    seg = jnp.concatenate([prompt_mask_BxS, jnp.ones_like(mask_BxN)], axis=1)
    pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
    _, logits = tr.forward(params, cfg, seq, pos, seg, return_logits=True)
    s, n = prompt_tokens_BxS.shape[1], tokens_BxN.shape[1]
    return logits[:, s - 1 : s - 1 + n]  # logits[:, j] predicts tokens[:, j]


def greedy_reference(params, cfg, prompt, n):
    """Step-by-step argmax of the full forward over the prompt alone (no padding, no cache)."""
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, : len(prompt)] = prompt
    ones = jnp.ones((1, len(prompt)), jnp.int32)
    for j in range(n):
        logits = teacher_forced_logits(
            params,
            cfg,
            jnp.asarray(buf[:, : len(prompt)]),
            ones,
            jnp.asarray(buf[:, len(prompt) :]),
            jnp.ones((1, n), jnp.int32),
        )
        buf[0, len(prompt) + j] = int(jnp.argmax(logits[0, j]))
    return buf[0, len(prompt) :]


def test_greedy_equals_full_forward_argmax_on_padded_mixed_batch():
    tokens, mask = left_pad(PROMPTS, S)
    n = 6
    out = generate(
        PARAMS,
        CFG,
        tokens,
        mask,
        jax.random.key(0),
        num_samples=2,
        sampling=SamplingParams(max_new_tokens=n, temperature=0.0),
    )
    assert out.tokens_BxN.shape == (6, n)
    np.testing.assert_array_equal(out.mask_BxN, 1)
    for b in range(6):
        ref = greedy_reference(PARAMS, CFG, PROMPTS[b // 2], n)
        np.testing.assert_array_equal(out.tokens_BxN[b], ref, err_msg=f"row {b}")


def test_padded_batch_equals_each_prompt_alone():
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    tokens, mask = left_pad(PROMPTS[:2], 6)  # extra padding column on both
    batch = generate(PARAMS, CFG, tokens, mask, jax.random.key(0), num_samples=1, sampling=sp)
    for i, prompt in enumerate(PROMPTS[:2]):
        alone_t, alone_m = left_pad([prompt], len(prompt))
        alone = generate(
            PARAMS, CFG, alone_t, alone_m, jax.random.key(0), num_samples=1, sampling=sp
        )
        np.testing.assert_array_equal(batch.tokens_BxN[i], alone.tokens_BxN[0])
        np.testing.assert_allclose(batch.logps_BxN[i], alone.logps_BxN[0], atol=1e-5)


def test_logps_and_mask_match_teacher_forcing_with_stop_tokens():
    temperature, g, n = 0.8, 4, 10
    stop = (3, 7, 11)
    sp = SamplingParams(
        max_new_tokens=n, temperature=temperature, top_k=20, stop_token_ids=stop, pad_token_id=63
    )
    tokens, mask = left_pad(PROMPTS, S)
    out = generate(PARAMS, CFG, tokens, mask, jax.random.key(3), num_samples=g, sampling=sp)
    toks, m, logps = map(np.asarray, (out.tokens_BxN, out.mask_BxN, out.logps_BxN))
    # Mask: ones then zeros; a row shorter than N ends with a stop token; pads and 0 after it.
    lengths = m.sum(-1)
    np.testing.assert_array_equal(out.lengths_B, lengths)
    assert 0 < (lengths < n).sum() < len(lengths), "want both stopped and unfinished rows"
    for b in range(len(lengths)):
        k = lengths[b]
        np.testing.assert_array_equal(m[b], np.arange(n) < k)
        assert not np.isin(toks[b, : k - 1], stop).any()
        if k < n:
            assert toks[b, k - 1] in stop
            np.testing.assert_array_equal(toks[b, k:], 63)
            np.testing.assert_array_equal(logps[b, k:], 0.0)
    # logps = log_softmax(logits / T) of the full vocab at the sampled tokens (teacher forcing).
    rep = lambda x: jnp.repeat(x, g, axis=0)
    logits = teacher_forced_logits(
        PARAMS, CFG, rep(tokens), rep(mask), out.tokens_BxN, out.mask_BxN
    )
    ref = jax.nn.log_softmax(logits / temperature, axis=-1)
    ref = np.take_along_axis(np.asarray(ref), toks[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.where(m == 1, logps, 0), np.where(m == 1, ref, 0), atol=1e-5)
    # top-k: every sampled token is among the 20 most likely under the teacher-forced logits.
    rank = (np.asarray(logits) > np.take_along_axis(np.asarray(logits), toks[..., None], -1)).sum(
        -1
    )
    assert rank[m == 1].max() < 20


def test_llama_attention_bias_decode_matches_teacher_forcing():
    """Llama attention_bias: the decode step adds o_proj's bias as the full forward does."""
    cfg = CFG.replace(model_type="llama")  # tiny_cfg has attention_bias=True
    params = random_params(cfg, seed=4)
    assert "bias" in params["layers"]["attn"]["o"]
    tokens, mask = left_pad(PROMPTS, S)
    sp = SamplingParams(max_new_tokens=5, temperature=1.0)
    out = generate(params, cfg, tokens, mask, jax.random.key(1), num_samples=2, sampling=sp)
    rep = lambda x: jnp.repeat(x, 2, axis=0)
    logits = teacher_forced_logits(
        params, cfg, rep(tokens), rep(mask), out.tokens_BxN, out.mask_BxN
    )
    ref = jax.nn.log_softmax(logits, axis=-1)
    ref = np.take_along_axis(np.asarray(ref), np.asarray(out.tokens_BxN)[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logps_BxN, ref, atol=1e-5)


def test_qwen3_decode_matches_teacher_forcing():
    """Qwen3 (per-head q/k norms in decode_qkv; attention_bias on q/k/v and o): the decode
    step scores each sampled token as the full forward does."""
    cfg = CFG.replace(model_type="qwen3", head_dim=12)  # H * Dh = 48 != D = 32
    params = random_params(cfg, seed=7)
    assert "q_norm" in params["layers"]["attn"] and "bias" in params["layers"]["attn"]["o"]
    tokens, mask = left_pad(PROMPTS, S)
    sp = SamplingParams(max_new_tokens=5, temperature=1.0)
    out = generate(params, cfg, tokens, mask, jax.random.key(2), num_samples=2, sampling=sp)
    rep = lambda x: jnp.repeat(x, 2, axis=0)
    logits = teacher_forced_logits(
        params, cfg, rep(tokens), rep(mask), out.tokens_BxN, out.mask_BxN
    )
    ref = jax.nn.log_softmax(logits, axis=-1)
    ref = np.take_along_axis(np.asarray(ref), np.asarray(out.tokens_BxN)[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logps_BxN, ref, atol=1e-5)


def first_token_counts(sp, num, seed):
    tokens, mask = left_pad([[5, 9, 2, 13, 7]], 5)
    out = generate(
        SMALL_PARAMS, SMALL, tokens, mask, jax.random.key(seed), num_samples=num, sampling=sp
    )
    logits = teacher_forced_logits(
        SMALL_PARAMS, SMALL, tokens, mask, out.tokens_BxN[:1], out.mask_BxN[:1]
    )[0, 0]
    return np.bincount(np.asarray(out.tokens_BxN[:, 0]), minlength=SMALL.vocab_size), np.asarray(
        logits, np.float64
    )


SMALL = CFG.replace(vocab_size=16)
SMALL_PARAMS = random_params(SMALL, seed=5, scale=0.6)


def chi_square_pvalue(counts, probs):
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_sampled_frequencies_match_softmax_over_temperature():
    temperature, num = 0.7, 4000
    counts, logits = first_token_counts(SamplingParams(1, temperature=temperature), num, seed=0)
    probs = softmax(logits / temperature)
    assert probs.max() < 0.6 and (probs > 0.02).sum() >= 6, "test needs a spread distribution"
    assert chi_square_pvalue(counts, probs) > 1e-3
    # The test has power: the same counts reject the T = 1 distribution.
    assert chi_square_pvalue(counts, softmax(logits)) < 1e-6


def test_top_k_and_top_p_restrict_support():
    temperature, num = 1.0, 3000
    counts, logits = first_token_counts(SamplingParams(1, temperature=temperature, top_k=3), num, 1)
    probs = softmax(logits / temperature)
    top3 = np.argsort(-probs)[:3]
    truncated = np.where(np.isin(np.arange(len(probs)), top3), probs, 0.0)
    assert chi_square_pvalue(counts, truncated) > 1e-3

    top_p = 0.6
    counts, _ = first_token_counts(SamplingParams(1, temperature=temperature, top_p=top_p), num, 2)
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    nucleus = order[: int(np.searchsorted(cum, top_p) + 1)]  # smallest prefix with mass >= p
    assert 1 < len(nucleus) < len(probs)
    truncated = np.where(np.isin(np.arange(len(probs)), nucleus), probs, 0.0)
    assert chi_square_pvalue(counts, truncated) > 1e-3


def test_same_key_same_output_and_backend_protocol():
    tokens, mask = left_pad(PROMPTS, S)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9)
    backend = LocalSampler(CFG)
    assert isinstance(backend, RolloutBackend)
    a = backend.generate(PARAMS, tokens, mask, jax.random.key(7), num_samples=3, sampling=sp)
    b = backend.generate(PARAMS, tokens, mask, jax.random.key(7), num_samples=3, sampling=sp)
    c = backend.generate(PARAMS, tokens, mask, jax.random.key(8), num_samples=3, sampling=sp)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.tokens_BxN, c.tokens_BxN)
    # The G samples of one prompt differ (the prompt's cache is shared, the randomness is not).
    assert len({tuple(r) for r in np.asarray(a.tokens_BxN[:3])}) > 1


def test_a_block_of_rows_samples_as_in_the_whole_batch():
    """row_block = (1, 2): the second half of the prompts, sampled alone, gets the rows the
    whole batch gets (a multi-process run's process-local rollout), not the first half's
    random draws."""
    import dataclasses

    tokens, mask = left_pad(PROMPTS + [[17, 2, 2, 9]], S)
    sp = SamplingParams(max_new_tokens=5, temperature=0.9, stop_token_ids=(3,))
    key = jax.random.key(3)
    whole = generate(PARAMS, CFG, tokens, mask, key, num_samples=2, sampling=sp)
    block = dataclasses.replace(sp, row_block=(1, 2))
    part = generate(PARAMS, CFG, tokens[2:], mask[2:], key, num_samples=2, sampling=block)
    np.testing.assert_array_equal(part.tokens_BxN, whole.tokens_BxN[4:])
    np.testing.assert_array_equal(part.mask_BxN, whole.mask_BxN[4:])
    np.testing.assert_allclose(part.logps_BxN, whole.logps_BxN[4:], atol=1e-5)
    assert not np.array_equal(part.tokens_BxN, whole.tokens_BxN[:4])  # other draws
    with pytest.raises(ValueError, match="row_block"):
        SamplingParams(4, row_block=(2, 2))


@pytest.mark.slow
def test_sharded_generation_matches_single_device():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    prompts = PROMPTS + [[17, 2, 2, 9]]
    tokens, mask = left_pad(prompts, S)
    sp = SamplingParams(max_new_tokens=5, temperature=0.9, stop_token_ids=(3,))
    ref = generate(PARAMS, CFG, tokens, mask, jax.random.key(1), num_samples=2, sampling=sp)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh), sharding.use_rules():
        params = sharding.shard_params(PARAMS, mesh)
        batch = sharding.activation_sharding(mesh, ("batch", "length"))
        out = generate(
            params,
            CFG,
            jax.device_put(tokens, batch),
            jax.device_put(mask, batch),
            jax.random.key(1),
            num_samples=2,
            sampling=sp,
        )
    assert len(out.tokens_BxN.sharding.device_set) == 8
    np.testing.assert_array_equal(out.tokens_BxN, ref.tokens_BxN)
    np.testing.assert_array_equal(out.mask_BxN, ref.mask_BxN)
    np.testing.assert_allclose(out.logps_BxN, ref.logps_BxN, atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(4, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(0)
    tokens, mask = left_pad(PROMPTS, S)
    with pytest.raises(ValueError, match="same"):
        generate(
            PARAMS,
            CFG,
            tokens,
            mask[:, :3],
            jax.random.key(0),
            num_samples=1,
            sampling=SamplingParams(2),
        )


@pytest.mark.slow
def test_bf16_generation_runs():
    cfg = CFG.replace(model_type="llama", attention_bias=False, dtype="bfloat16")
    params = random_params(cfg.replace(attention_bias=True), seed=2)
    params["layers"]["attn"] = {
        name: {"kernel": w["kernel"]} for name, w in params["layers"]["attn"].items()
    }
    tokens, mask = left_pad(PROMPTS, S)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=8, top_p=0.9)
    out = generate(params, cfg, tokens, mask, jax.random.key(0), num_samples=2, sampling=sp)
    assert out.tokens_BxN.shape == (6, 4) and out.logps_BxN.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out.logps_BxN))) and np.all(out.logps_BxN <= 0)
    assert np.all((out.tokens_BxN >= 0) & (out.tokens_BxN < cfg.vocab_size))
