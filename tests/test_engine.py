"""The JetStream engine on the decoder's core (tiny model, JetStream's own Driver): equal to the
static sampler for any tokens per generate call, a group's prompt KV written once, per-request
max_tokens kept when a call emits several tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from gjax.rollout import generate
from tests.test_decoder import GREEDY, MASK, TOKENS, G, N, assert_same
from tests.test_sampler import CFG, PARAMS, S

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")

jax.config.update("jax_default_matmul_precision", "highest")


def serve(steps, caps=()):
    """The rows of TOKENS x G from a JetStreamBackend with `steps` tokens per generate call,
    then with each per-request max_tokens list in `caps`; and its engine."""
    be = jetstream_backend.JetStreamBackend(
        CFG, PARAMS, sampling=GREEDY, slots=3, max_prompt_len=S, tokens_per_dispatch=steps
    )
    try:
        outs = [
            be.generate(PARAMS, TOKENS, MASK, None, num_samples=G, sampling=GREEDY, max_tokens_B=c)
            for c in (None, *caps)
        ]
        return [jax.tree.map(np.asarray, o) for o in outs], be.engine
    finally:
        be.close()


def test_engine_equals_static_for_any_tokens_per_call_and_writes_each_prompt_once():
    static = generate(PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    static = jax.tree.map(np.asarray, static)
    (one,), engine = serve(steps=1)
    assert_same(one, static, atol=1e-5)  # the static sampler's tolerance
    # The G requests of a prompt (placed one after another) share one region.
    assert engine.region_writes == len(TOKENS)
    state = engine.init_decode_state()
    # Prompt KV: one [K, Sp, Dh] region per group, none per slot (was G x [K, Sp + N, Dh]).
    assert state["prompt_k"][0].shape[2] == engine.max_prefill_length
    assert state["cache_k"][0].shape[2] == N
    # Per-request max_tokens below what a call emits: each row is the full row's prefix.
    caps = np.asarray([1, 2, 3, 5, 8, 6], np.int32)
    (four, capped), engine4 = serve(steps=4, caps=(caps,))
    assert engine4.tokens_per_dispatch == 4
    assert_same(four, one, atol=1e-6)
    lengths = np.minimum(one.lengths_B, caps)
    np.testing.assert_array_equal(capped.lengths_B, lengths)
    keep = np.arange(N)[None] < lengths[:, None]
    np.testing.assert_array_equal(capped.tokens_BxN[keep], one.tokens_BxN[keep])
    np.testing.assert_allclose(capped.logps_BxN[keep], one.logps_BxN[keep], atol=1e-6)


def _decode_with_a_push(
    weight_change, push_after=2, calls=8, steps=1, prefill_early=False, **engine_kw
):
    """Two prompts' requests in slots 0, 1 (engine API, no threads, `steps` tokens per generate
    call); new weights swapped in after `push_after` generate calls; then a third request
    (prefilled before the swap if `prefill_early`, on the old weights). Returns (each call's
    first token [calls, S], its valid flag [calls, S], the engine's records)."""
    from gjax.rollout import engine as eng

    engine = eng.Engine(
        CFG,
        PARAMS,
        sampling=dataclasses.replace(GREEDY, stop_token_ids=()),  # every request runs N
        max_concurrent_decodes=3,
        max_prefill_length=eng.prefill_bucket(S),
        weight_change=weight_change,
        tokens_per_dispatch=steps,
        **engine_kw,
    )
    new = jax.tree.map(lambda x: x * 1.5, PARAMS)

    def prefill(p):
        ids = np.asarray(TOKENS[p])[np.asarray(MASK[p], bool)]
        padded = np.zeros((engine.max_prefill_length,), np.int32)
        padded[: len(ids)] = ids
        return engine.prefill(params=engine.holder, padded_tokens=padded, true_length=len(ids))

    state = engine.insert(prefill(1), engine.insert(prefill(0), engine.init_decode_state(), 0), 1)
    early = prefill(2) if prefill_early else None
    out = []
    for c in range(calls):
        if c == push_after:
            engine.holder.swap(new)
            state = engine.insert(early or prefill(2), state, 2)
        state, result = engine.generate(engine.holder, state)
        out.append(np.asarray(result.data)[:, [0, steps]])
    out = np.stack(out)
    return out[..., 0], out[..., 1], engine.drain_records()


@pytest.mark.parametrize("weight_change", ["finish", "restart"])
def test_weights_changing_between_generate_calls(weight_change):
    """finish: in-flight requests decode on with the new weights (their tokens up to the first
    one drawn from new logits equal the run without a push, the rest differ); each token is
    recorded with the version of the logits it was drawn from (its log-prob's), so the first
    token of the call after the swap (drawn from logits the old weights computed) and the first
    token of a request prefilled on the old weights are the old version; restart: they end at
    once with RESTART_TOKEN; a request started after the push decodes either way."""
    from gjax.rollout import engine as eng

    finish = weight_change == "finish"
    k = 2 if finish else 1  # tokens per call: a call's first token vs the others
    base_tok, base_valid, base_rec = _decode_with_a_push("finish", push_after=99, steps=k)
    tok, valid, records = _decode_with_a_push(weight_change, steps=k, prefill_early=finish)
    np.testing.assert_array_equal(tok[:2, :2], base_tok[:2, :2])  # before the push
    live = slice(2, 2 + N // k)  # the new request's calls (N tokens)
    assert valid[live, 2].all() and (tok[live, 2] >= 0).all()  # the new request decodes
    if finish:
        assert valid[:, :2].sum() == base_valid[:, :2].sum()  # nothing cut short
        np.testing.assert_array_equal(tok[2, :2], base_tok[2, :2])  # drawn from old logits
        assert not np.array_equal(tok[3:, :2], base_tok[3:, :2])
        for serial in (0, 1):
            rows = records[records[:, 0] == serial]
            np.testing.assert_array_equal(rows[:, 1], np.arange(len(rows)))  # token index
            base = base_rec[base_rec[:, 0] == serial]
            old = 2 * k + 1  # the push lands after 2 calls; one more token from old logits
            np.testing.assert_array_equal(rows[:old, 2:4], base[:old, 2:4])  # token, logp bits
            np.testing.assert_array_equal(rows[:, 4], np.arange(len(rows)) >= old)  # version
        rows = records[records[:, 0] == 2]  # prefilled on v0, inserted after the swap
        np.testing.assert_array_equal(rows[:, 4], np.arange(len(rows)) >= 1)
    else:
        assert tok[2, :2].tolist() == [eng.RESTART_TOKEN] * 2 and valid[2, :2].all()
        assert not valid[3:, :2].any()


def test_a_failure_past_max_tokens_does_not_fail_the_request():
    """A generate call emits k tokens and JetStream checks max_tokens once per call: an
    ERROR_TOKEN / RESTART_TOKEN among the columns past a request's max_tokens (discarded) does
    not fail it, in the gRPC servicer and in the backends' client; within them it does. The
    servicer runs over a fake JetStream orchestrator (JetStream's side of the edge)."""
    import asyncio

    from gjax.rollout import engine as eng
    from gjax.rollout import grpc_server
    from gjax.rollout.jetstream_compat import jetstream

    pb = jetstream.jetstream_pb2
    sample = lambda ids: pb.DecodeResponse.StreamContent.Sample(token_ids=ids)
    reply = lambda ids: pb.DecodeResponse(
        stream_content=pb.DecodeResponse.StreamContent(samples=[sample(ids)])
    )
    calls = [[5, 6], [7, eng.ERROR_TOKEN], [eng.RESTART_TOKEN, 9]]  # k = 2 per call

    class Upstream(jetstream.orchestrator.LLMOrchestrator):
        def __init__(self, driver):
            del driver

        async def Decode(self, request, context=None):  # noqa: N802
            for ids in calls:
                yield reply(ids)

    class Servicer(grpc_server.Servicer, Upstream):  # super().Decode in the servicer: Upstream
        pass

    engine = eng.Engine(
        CFG, PARAMS, sampling=GREEDY, max_concurrent_decodes=1, max_prefill_length=16
    )
    servicer = Servicer(None, engine)

    def decode(max_tokens):
        req = pb.DecodeRequest(
            token_content=pb.DecodeRequest.TokenContent(token_ids=[1, 2]), max_tokens=max_tokens
        )

        async def run():
            return [
                list(s.token_ids)
                async for r in servicer.Decode(req)
                for s in r.stream_content.samples
            ]

        return asyncio.run(run())

    assert decode(3) == [[5, 6], [7]]
    with pytest.raises(ValueError, match="INTERNAL"):
        decode(4)
    responses = [reply(ids) for ids in calls]
    assert jetstream_backend._token_ids(responses, 3) == [5, 6, 7]
    with pytest.raises(RuntimeError, match="non-finite"):
        jetstream_backend._token_ids(responses, 4)
    with pytest.raises(jetstream_backend.Restarted, match="restarted this request"):
        jetstream_backend._token_ids(responses[:1] + responses[2:], 3)


def test_a_swap_holds_one_decode_layout_copy(monkeypatch):
    """The decode-layout copy of the layers (`decode_layers`) is built once per params
    version, and the old version's copy is gone before the new one is built (was: both live
    at a swap, with the old params). Watched through weak references to each copy's arrays."""
    import weakref

    from gjax.rollout import engine as eng

    copies, seen, build = [], [], eng._layers_jit

    def spy(params, cfg):
        seen.append([sum(r() is not None for r in c) for c in copies])  # live arrays per copy
        layers = build(params, cfg=cfg)
        copies.append([weakref.ref(x) for x in jax.tree.leaves(layers)])
        return layers

    monkeypatch.setattr(eng, "_layers_jit", spy)
    engine = eng.Engine(
        CFG, PARAMS, sampling=GREEDY, max_concurrent_decodes=1, max_prefill_length=16
    )
    state = engine.init_decode_state()
    for c in range(3):
        if c == 2:
            engine.holder.swap(jax.tree.map(lambda x: x * 1.5, PARAMS))
        state, _ = engine.generate(engine.holder, state)
    assert seen == [[], [0]]  # built once per version, never beside the old copy
    assert [sum(r() is not None for r in c) for c in copies] == [0, len(copies[1])]
