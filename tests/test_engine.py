"""The JetStream engine on the decoder's core (tiny model, JetStream's own Driver): equal to the
static sampler for any tokens per generate call, a group's prompt KV written once, per-request
max_tokens kept when a call emits several tokens."""

import jax
import numpy as np
import pytest

from gjax.rollout import generate
from tests.test_decoder import GREEDY, MASK, TOKENS, G, N, assert_same
from tests.test_sampler import CFG, PARAMS, S

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")

jax.config.update("jax_default_matmul_precision", "highest")


def serve(steps, max_tokens_B=None):
    be = jetstream_backend.JetStreamBackend(
        CFG, PARAMS, sampling=GREEDY, slots=3, max_prompt_len=S, tokens_per_dispatch=steps
    )
    try:
        out = be.generate(
            PARAMS, TOKENS, MASK, None, num_samples=G, sampling=GREEDY, max_tokens_B=max_tokens_B
        )
        return jax.tree.map(np.asarray, out), be.engine
    finally:
        be.close()


def test_engine_equals_static_for_any_tokens_per_call_and_writes_each_prompt_once():
    static = generate(PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    static = jax.tree.map(np.asarray, static)
    one, engine = serve(steps=1)
    assert_same(one, static, atol=1e-5)  # the static sampler's tolerance
    # The G requests of a prompt (placed one after another) share one region.
    assert engine.region_writes == len(TOKENS)
    state = engine.init_decode_state()
    # Prompt KV: one [K, Sp, Dh] region per group, none per slot (was G x [K, Sp + N, Dh]).
    assert state["prompt_k"][0].shape[2] == engine.max_prefill_length
    assert state["cache_k"][0].shape[2] == N
    four, engine4 = serve(steps=4)
    assert engine4.tokens_per_dispatch == 4
    assert_same(four, one, atol=1e-6)
    # Per-request max_tokens, below what a call emits: each row is the full row's prefix.
    caps = np.asarray([1, 2, 3, 5, 8, 6], np.int32)
    capped, _ = serve(steps=4, max_tokens_B=caps)
    lengths = np.minimum(one.lengths_B, caps)
    np.testing.assert_array_equal(capped.lengths_B, lengths)
    keep = np.arange(N)[None] < lengths[:, None]
    np.testing.assert_array_equal(capped.tokens_BxN[keep], one.tokens_BxN[keep])
    np.testing.assert_allclose(capped.logps_BxN[keep], one.logps_BxN[keep], atol=1e-6)
