"""The continuous decoder against the static sampler: greedy token for token, log-probs to the
sampler's tolerance, independent of admission order, dispatch size and prompt-KV sharing; the
scheduler refills a slot as soon as its row ends; sampled log-probs and frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.rollout import SamplingParams, generate
from gjax.rollout.decoder import ContinuousDecoder
from tests.test_sampler import (
    CFG,
    PARAMS,
    PROMPTS,
    SMALL,
    SMALL_PARAMS,
    S,
    chi_square_pvalue,
    left_pad,
    softmax,
    teacher_forced_logits,
)

jax.config.update("jax_default_matmul_precision", "highest")

G, N = 2, 8
GREEDY = SamplingParams(
    max_new_tokens=N, temperature=0.0, stop_token_ids=(3, 7, 11), pad_token_id=63
)
TOKENS, MASK = left_pad(PROMPTS, S)


def decode(slots=3, steps=4, sp=GREEDY, key=0, **kw):
    gen_kw = {k: kw.pop(k) for k in ("order", "max_tokens_B") if k in kw}
    dec = ContinuousDecoder(CFG, slots=slots, tokens_per_dispatch=steps, **kw)
    out = dec.generate(
        PARAMS, TOKENS, MASK, jax.random.key(key), num_samples=G, sampling=sp, **gen_kw
    )
    return jax.tree.map(np.asarray, out), dec.stats


@pytest.fixture(scope="module")
def static_greedy():
    out = generate(PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    out = jax.tree.map(np.asarray, out)
    assert 0 < (out.lengths_B < N).sum() < len(out.lengths_B), "want stopped and full rows"
    return out


def assert_same(a, b, atol):
    np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN)
    np.testing.assert_array_equal(a.mask_BxN, b.mask_BxN)
    np.testing.assert_array_equal(a.lengths_B, b.lengths_B)
    np.testing.assert_allclose(a.logps_BxN, b.logps_BxN, atol=atol)


def test_greedy_equals_static_for_any_order_dispatch_size_and_sharing(static_greedy):
    # 3 slots for 6 rows: every slot is refilled at least once.
    base, stats = decode(steps=4)
    assert stats["dispatches"] > 1 and stats["prompts_prefilled"] == len(PROMPTS)
    assert_same(base, static_greedy, atol=1e-5)  # the static sampler's tolerance
    # Admission order, one token per dispatch, a row per region: the same rows, bit for bit
    # up to float reassociation.
    assert_same(decode(steps=4, order=[5, 2, 0, 4, 1, 3])[0], base, atol=1e-6)
    one, one_stats = decode(steps=1)
    assert one_stats["dispatches"] == one_stats["decode_steps"] > stats["dispatches"]
    assert_same(one, base, atol=1e-6)
    unshared, unshared_stats = decode(steps=4, share_prompt=False)
    assert unshared_stats["prompts_prefilled"] == G * len(PROMPTS)
    assert_same(unshared, base, atol=1e-6)


def test_fewer_prompt_regions_than_slots_give_the_same_rows():
    """R < S: a row whose prompt has no region waits (admission control) and decodes the same
    tokens as with a region per slot (R = S, the default at S = 3, G = 2). R = 1, below
    ceil(S / G) = 2: one group at a time, so two of the 3 slots at most (one compile, ~5 s)."""
    base, base_stats = decode(steps=4)
    assert base_stats["regions"] == base_stats["slots"] == 3
    out, stats = decode(steps=4, prompt_regions=1)
    assert stats["regions"] == 1 and stats["prompts_prefilled"] == len(PROMPTS)
    assert_same(out, base, atol=1e-6)
    assert stats["slot_steps_live"] == base_stats["slot_steps_live"]
    assert stats["decode_steps"] > base_stats["decode_steps"]  # rows waited for the region


def refill_steps(lengths, slots):
    """Decode steps when a row starts on the step after one ends (rows in order)."""
    free_at = [0] * slots
    for n in lengths:
        s = int(np.argmin(free_at))
        free_at[s] += n
    return max(free_at)


def test_slot_refilled_as_soon_as_its_row_ends(static_greedy):
    limits = np.array([1, 8, 2, 2, 3, 1], np.int32)
    lengths = np.minimum(limits, static_greedy.lengths_B)  # a stop token may end a row first
    out, stats = decode(steps=1, max_tokens_B=limits)
    np.testing.assert_array_equal(out.lengths_B, lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(out.tokens_BxN[b, :n], static_greedy.tokens_BxN[b, :n])
    # Waves of 3 rows (a static batch) would take longer: the test can tell the two apart.
    waves = sum(lengths[i : i + 3].max() for i in range(0, len(lengths), 3))
    assert refill_steps(lengths, 3) < waves
    assert stats["decode_steps"] == refill_steps(lengths, 3)
    assert stats["slot_steps_live"] == stats["useful_tokens"] == lengths.sum()


def test_sampled_logps_equal_teacher_forcing():
    sp = SamplingParams(
        max_new_tokens=N, temperature=0.8, top_k=20, stop_token_ids=(3, 7, 11), pad_token_id=63
    )
    out, _ = decode(sp=sp, key=3)
    again, _ = decode(sp=sp, key=3, order=[3, 1, 5, 0, 2, 4], steps=1)
    assert_same(again, out, atol=1e-6)  # per-row keys: the draws do not depend on the slot
    rep = lambda x: jnp.repeat(x, G, axis=0)
    logits = teacher_forced_logits(
        PARAMS, CFG, rep(TOKENS), rep(MASK), out.tokens_BxN, out.mask_BxN
    )
    ref = np.asarray(jax.nn.log_softmax(logits / sp.temperature, axis=-1))
    ref = np.take_along_axis(ref, out.tokens_BxN[..., None], axis=-1)[..., 0]
    m = out.mask_BxN == 1
    assert (out.lengths_B < N).any()
    np.testing.assert_allclose(np.where(m, out.logps_BxN, 0), np.where(m, ref, 0), atol=1e-5)


def test_sampled_first_token_frequencies_match_softmax():
    temperature, num = 0.7, 2048
    tokens, mask = left_pad([[5, 9, 2, 13, 7]], 5)
    dec = ContinuousDecoder(SMALL, slots=256, tokens_per_dispatch=1)
    sp = SamplingParams(1, temperature=temperature)
    out = dec.generate(SMALL_PARAMS, tokens, mask, jax.random.key(0), num_samples=num, sampling=sp)
    counts = np.bincount(np.asarray(out.tokens_BxN[:, 0]), minlength=SMALL.vocab_size)
    logits = teacher_forced_logits(
        SMALL_PARAMS, SMALL, tokens, mask, out.tokens_BxN[:1], out.mask_BxN[:1]
    )[0, 0]
    probs = softmax(np.asarray(logits, np.float64) / temperature)
    assert chi_square_pvalue(counts, probs) > 1e-3
    assert chi_square_pvalue(counts, softmax(np.asarray(logits, np.float64))) < 1e-6


def test_bad_arguments():
    with pytest.raises(ValueError, match="slots"):
        ContinuousDecoder(CFG, slots=0, tokens_per_dispatch=1)
    with pytest.raises(ValueError, match="max_tokens_B"):
        decode(max_tokens_B=np.full(6, N + 1))
    with pytest.raises(ValueError, match="permutation"):
        decode(order=[0, 1, 2])


def test_local_backend_decodes_continuously_from_the_config(static_greedy):
    from configs import common
    from gjax.rollout.factory import make_backend

    config = common.tiny(common.base())
    config.rollout.decoder, config.rollout.decode_slots = "continuous", 3
    config.rollout.tokens_per_dispatch = 4
    backend = make_backend(config, CFG, PARAMS)
    assert backend.metrics() == {}
    out = backend.generate(PARAMS, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    assert_same(jax.tree.map(np.asarray, out), static_greedy, atol=1e-5)
    m = backend.metrics()
    assert m["rollout/decode_steps"] >= static_greedy.lengths_B.max()
    assert 0 < m["rollout/slot_occupancy"] <= 1 and 0 <= m["time/decode_host_fraction"] < 1


def test_a_row_block_draws_its_rows_of_the_whole_batch():
    """sampling.row_block=(1, 2) (a process's own rows in a multi-process run): the second
    prompt alone draws what it draws in the batch of both; as block 0 it draws other tokens."""
    import dataclasses

    sp = dataclasses.replace(GREEDY, temperature=1.0)
    dec = ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=4)

    def run(rows, block):
        sp_ = dataclasses.replace(sp, row_block=block)
        out = dec.generate(
            PARAMS, TOKENS[rows], MASK[rows], jax.random.key(3), num_samples=G, sampling=sp_
        )
        return jax.tree.map(np.asarray, out)

    both, second = run(slice(0, 2), (0, 1)), run(slice(1, 2), (1, 2))
    np.testing.assert_array_equal(second.tokens_BxN, both.tokens_BxN[G:])
    np.testing.assert_allclose(second.logps_BxN, both.logps_BxN[G:], atol=1e-6)
    assert (run(slice(1, 2), (0, 2)).tokens_BxN != both.tokens_BxN[G:]).any()


def test_the_default_decoder_is_continuous():
    from configs import common
    from gjax.rollout.factory import local_decoder, make_backend

    config = common.tiny(common.base())
    assert config.rollout.decoder == "auto"
    assert isinstance(make_backend(config, CFG, PARAMS).decoder, ContinuousDecoder)
    assert [local_decoder(d) for d in ("auto", "continuous", "static")] == [
        "continuous",
        "continuous",
        "static",
    ]
    config.rollout.decoder = "static"  # the reference sampler, by name
    assert make_backend(config, CFG, PARAMS).decoder is None


def test_chunked_prefill_equals_whole_prefill_and_decodes_beside_it(static_greedy):
    """rollout.prefill_chunk=3: prompts prefilled 3 columns per loop turn (7 -> 9 columns,
    left-padded) give the whole prefill's rows; dispatches run while a prompt is still being
    prefilled."""
    from configs import common
    from gjax.rollout.factory import make_backend

    config = common.tiny(common.base())
    config.rollout.decoder, config.rollout.decode_slots = "continuous", 3
    config.rollout.tokens_per_dispatch, config.rollout.prefill_chunk = 4, 3
    backend = make_backend(config, CFG, PARAMS)
    out = backend.generate(PARAMS, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    chunked, stats = jax.tree.map(np.asarray, out), backend.decoder.stats
    assert stats["prompts_prefilled"] == len(PROMPTS)
    assert stats["dispatches_beside_prefill"] > 0
    assert_same(chunked, static_greedy, atol=1e-5)  # the static sampler's tolerance
    whole, _ = decode(steps=4)  # compiled by the first test
    assert_same(chunked, whole, atol=1e-5)
