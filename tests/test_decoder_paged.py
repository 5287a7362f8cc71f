"""Paged KV in the continuous decoder (`kv_page_size` > 0, gjax.rollout.pages): greedy rows
equal the static sampler's and the contiguous slots', with pages shared, preempted rows and
pages reused; a freed page filled with NaN is never read; the pool's reference counts; bad
page arguments refused at validation."""

import dataclasses

import jax
import numpy as np
import pytest

from gjax.errors import ConfigError
from gjax.rollout.decoder import ContinuousDecoder
from gjax.rollout.pages import NULL_PAGE, PagePool
from tests.test_decoder import CFG, GREEDY, MASK, PARAMS, TOKENS, G, N, assert_same, decode

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def contiguous_greedy(static_greedy):
    out, _ = decode(steps=4)
    assert_same(out, static_greedy, atol=1e-5)
    return out


@pytest.fixture(scope="module")
def static_greedy():
    from gjax.rollout import generate

    out = generate(PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    return jax.tree.map(np.asarray, out)


@pytest.mark.slow
def test_paged_greedy_equals_static_and_contiguous(static_greedy, contiguous_greedy):
    """Pages of 4 (prompt: 2 shared pages, a row's tokens 2 more) with the contiguous layout's
    bytes; pages of 2 in a pool of 9 usable pages, below what 3 live rows need at once: rows
    are held back or preempted, decode again from their first token, the same rows."""
    paged, stats = decode(steps=4, kv_page_size=4)
    # slots x N/4, a tail copy per slot, regions x Q, the null page
    assert stats["kv_pages"] == 3 * 2 + 3 + 3 * 2 + 1
    assert_same(paged, static_greedy, atol=1e-5)  # the static sampler's tolerance
    # The same tokens; log-probs to the same tolerance, for the same reason: paged attention
    # reads the keys through the page table in another layout than a slot's contiguous cache,
    # so XLA:CPU reduces them in another order, which depends on the CPU's vector width:
    # equal to 1e-6 on the machines this ran on before, 1.4e-6 apart (8 float32 ulps of a
    # log-prob of -1.54) on an AVX2-only EPYC, 2026-12-02.
    assert_same(paged, contiguous_greedy, atol=1e-5)
    small, small_stats = decode(steps=4, kv_page_size=2, kv_pages=10)
    assert small_stats["rows_preempted"] > 0 and small_stats["kv_pages_peak"] <= 9
    assert_same(small, static_greedy, atol=1e-5)


def test_paged_sampled_rows_equal_contiguous():
    """Sampled (T = 1): a row's keys depend on its row and token index only, so the paged
    rows are the contiguous rows' draws (the logits agree to rounding)."""
    sp = dataclasses.replace(GREEDY, temperature=1.0)
    contiguous, _ = decode(steps=4, sp=sp, key=5)
    paged, _ = decode(steps=4, sp=sp, key=5, kv_page_size=4)
    assert_same(paged, contiguous, atol=1e-5)


def test_freed_pages_hold_nan_and_are_never_read(static_greedy):
    """Every freed page is filled with NaN (the debug hook) and later rows are given those
    pages (6 usable pages for 6 rows of 2 + groups of 2): outputs equal, log-probs finite."""
    out, stats = decode(steps=4, kv_page_size=4, kv_pages=7, poison_freed_pages=True)
    assert stats["pages_poisoned"] > 0
    assert stats["pages_allocated"] > 6  # pages handed out again after they were poisoned
    assert np.isfinite(out.logps_BxN).all()
    assert_same(out, static_greedy, atol=1e-5)


def test_page_pool_reference_counts():
    freed = []
    pool = PagePool(5, on_free=freed.extend)
    a = pool.alloc(2)
    assert NULL_PAGE not in a and pool.available() == 2
    pool.ref(a)  # a second row reads them
    pool.release(a)
    assert freed == [] and pool.available() == 2
    pool.release(a)
    assert freed == a and pool.available() == 4
    with pytest.raises(RuntimeError, match="free page"):
        pool.release(a)
    with pytest.raises(RuntimeError, match="asked"):
        pool.alloc(5)


def test_bad_page_arguments():
    with pytest.raises(ValueError, match="kv_page_size must be >= 0"):
        ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=4, kv_page_size=-1)
    with pytest.raises(ValueError, match="prefill_chunk must be 0"):
        ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=4, kv_page_size=4, prefill_chunk=2)
    with pytest.raises(ValueError, match=f"must divide max_new_tokens={N}"):
        decode(kv_page_size=3)
    with pytest.raises(ValueError, match="fewer than one row's"):
        decode(kv_page_size=4, kv_pages=4)


def test_config_kv_page_size(static_greedy):
    from configs import common
    from gjax.rollout.factory import check_config, make_backend

    config = common.tiny(common.base())
    assert config.rollout.kv_page_size == 0  # off by default: the contiguous slots
    config.rollout.decoder, config.rollout.decode_slots = "continuous", 3
    config.rollout.tokens_per_dispatch, config.rollout.kv_page_size = 4, 4
    config.rollout.max_new_tokens = 64
    check_config(config)
    backend = make_backend(config, CFG, PARAMS)
    out = backend.generate(PARAMS, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    assert_same(jax.tree.map(np.asarray, out), static_greedy, atol=1e-5)
    assert backend.decoder.stats["kv_page_size"] == 4
    for fields, match in (
        ({"max_new_tokens": 66}, "must divide config.rollout.max_new_tokens=66"),
        ({"prefill_chunk": 8}, "prefill_chunk=8"),
        ({"decoder": "static"}, "rollout.decoder='static'"),
        # tiny's 24-token prompts: 6 pages of 4, 16 for 64 tokens, a partial last page's copy
        # (a shorter prompt's), the null page
        ({"kv_pages": 23}, "kv_pages=23 cannot hold one row: 23 pages of 4 tokens"),
        ({"kv_page_size": 0, "kv_pages": 40}, "kv_pages=40 sizes the paged KV pool, but"),
    ):
        bad = common.tiny(common.base())
        bad.rollout.kv_page_size = 4
        bad.rollout.max_new_tokens = 64
        bad.rollout.update(fields)
        with pytest.raises(ConfigError, match=match):
            check_config(bad)
    ok = common.tiny(common.base())
    ok.rollout.update(kv_page_size=4, max_new_tokens=64, kv_pages=24)
    check_config(ok)
    # the JetStream engine pages too (its prefill bucket, 32 for 24 tokens: 8 pages), and
    # prefill_chunk is the local decoder's alone
    ok.rollout.update(backend="jetstream", prefill_chunk=8, kv_pages=26)
    check_config(ok)
    ok.rollout.kv_pages = 25
    with pytest.raises(ConfigError, match="kv_pages=25 cannot hold one row: 25 pages"):
        check_config(ok)


@pytest.mark.slow  # compiles the re-entry programs (15-40 s on a busy 2-core CPU)
def test_paged_multi_turn_episodes_equal_contiguous():
    """Sampled, three turns (tests/test_decoder_turns.py's rows): observations re-enter into
    pages allocated for them (pages of 4, observations 2 columns per call); the trajectories
    are the contiguous decoder's: tokens, policy mask, turns, log-probs to rounding; again
    with every freed page filled with NaN."""
    from tests.test_decoder_turns import SAMPLED, THREE_TURNS, episodes

    ref, _, _ = episodes(THREE_TURNS, SAMPLED, observation_chunk=2)
    for kw in ({}, {"poison_freed_pages": True}):
        out, stats, _ = episodes(THREE_TURNS, SAMPLED, observation_chunk=2, kv_page_size=4, **kw)
        assert stats["rows_reentered"] > 0
        for name in ("tokens_BxN", "policy_mask_BxN", "lengths_B", "turns_B"):
            np.testing.assert_array_equal(getattr(out, name), getattr(ref, name))
        np.testing.assert_allclose(out.logps_BxN, ref.logps_BxN, atol=1e-5)
    assert stats["pages_poisoned"] > 0 and stats["pages_allocated"] > stats["kv_pages"] - 1
