"""The JetStream engine on paged KV (`kv_page_size` > 0, gjax.rollout.pages): through JetStream's
own Driver (the in-process backend), greedy rows equal the contiguous engine's and the static
sampler's; a pool too small for every slot preempts requests (RESTART_TOKEN: the client sends
them again) and still returns the same rows; freed pages filled with NaN are never read."""

import dataclasses

import jax
import numpy as np
import pytest

from gjax.rollout import generate
from tests.test_decoder import GREEDY, MASK, TOKENS, G, N, assert_same
from tests.test_sampler import CFG, PARAMS, PROMPTS, S, left_pad

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")

jax.config.update("jax_default_matmul_precision", "highest")

PAGE = 2
RESTART = -3  # gjax.rollout.engine.RESTART_TOKEN (the engine imports JetStream)
LONG = dataclasses.replace(GREEDY, stop_token_ids=())  # every request decodes N tokens
# six prompts: more than the short pool's regions hold at once (cached prompts are evicted)
SIX = left_pad([*PROMPTS, [2, 4, 6], [13, 21, 34, 55], [50, 1, 9, 9, 9, 9]], S)


def serve(sampling=GREEDY, *, slots=3, steps=2, prompts=(TOKENS, MASK), **kv):
    """The rows of `prompts` x G from an in-process backend; its engine's kv_stats."""
    be = jetstream_backend.JetStreamBackend(
        CFG,
        PARAMS,
        sampling=sampling,
        slots=slots,
        max_prompt_len=S,
        tokens_per_dispatch=steps,
        max_retries=0,  # a preempted request is sent again outside the retry budget
        **kv,
    )
    try:
        out = be.generate(PARAMS, *prompts, None, num_samples=G, sampling=sampling)
        stats = {**be.engine.kv_stats, "pages_poisoned": be.engine.pages_poisoned}
        metrics = be.metrics()  # the step's rollout/ figures: the batch's preemptions
        if "requests_preempted" in stats:
            assert metrics["rollout/requests_preempted"] == stats["requests_preempted"]
            assert metrics["rollout/kv_pages_peak_max"] == stats["kv_pages_peak"]
        return jax.tree.map(np.asarray, out), stats, be.counters["retried"]
    finally:
        be.close()


@pytest.mark.parametrize("sampling", [GREEDY, LONG], ids=["stops", "no_stops"])
def test_paged_engine_equals_the_contiguous_engine_and_the_static_sampler(sampling):
    static = generate(
        PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=sampling
    )
    static = jax.tree.map(np.asarray, static)
    contiguous, none, _ = serve(sampling)
    assert none == {"pages_poisoned": 0}
    paged, stats, retried = serve(sampling, kv_page_size=PAGE)
    # One softmax over the row's gathered pages, not the contiguous step's prompt and own
    # blocks: float32 sums in another order (the local paged decoder's tolerance, 1e-5).
    assert_same(paged, contiguous, atol=1e-5)
    assert_same(paged, static, atol=1e-5)  # the static sampler's tolerance
    # the default pool, the contiguous layout's bytes: 3 slots x N / PAGE own pages, 3 regions
    # of the 16-token prefill bucket (8 pages each); a page per slot for its copy of its
    # prompt's partial last page, the null page; nothing preempted
    assert stats["kv_pages"] == 3 * N // PAGE + 3 + 3 * 8 + 1
    assert stats["requests_preempted"] == 0 and retried == 0
    assert 0 < stats["kv_pages_peak"] <= stats["kv_pages"] - 1


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("prompts", [(TOKENS, MASK), SIX], ids=["3_prompts", "6_prompts"])
def test_a_pool_short_of_pages_preempts_requests_and_returns_the_same_rows(prompts, poison):
    """6 slots on 25 pages (one request needs its prompt's 8 and its own 4): the engine
    preempts the youngest requests, their clients send them again, and every row equals the
    contiguous engine's (3 slots); with six prompts, cached prompts' pages are evicted for new
    ones too. With every freed page filled with NaN before the next call, no row reads one:
    the rows stay finite and equal."""
    contiguous, _, _ = serve(LONG, prompts=prompts)
    paged, stats, retried = serve(
        LONG, slots=6, kv_page_size=PAGE, kv_pages=25, poison_freed_pages=poison, prompts=prompts
    )
    assert stats["requests_preempted"] > 0 and retried >= stats["requests_preempted"]
    assert stats["kv_pages_peak"] <= 24
    assert (stats["pages_poisoned"] > stats["kv_pages"]) == poison  # every page, some twice
    assert_same(paged, contiguous, atol=1e-5)
    assert np.isfinite(paged.logps_BxN).all()


def test_paged_engine_refuses_a_page_size_or_pool_that_cannot_work():
    from gjax.rollout import engine as eng

    kw = dict(sampling=GREEDY, max_concurrent_decodes=2, max_prefill_length=16)
    with pytest.raises(ValueError, match="must divide max_new_tokens=8"):
        eng.Engine(CFG, PARAMS, kv_page_size=3, **kw)
    with pytest.raises(ValueError, match="holds fewer than one request's 12 pages"):
        eng.Engine(CFG, PARAMS, kv_page_size=PAGE, kv_pages=12, **kw)


def test_a_restarted_request_is_sent_again_at_once_outside_the_retry_budget(monkeypatch):
    """`_send`: a request ended by RESTART_TOKEN (`Restarted`; over gRPC, ABORTED) goes again
    with the next round, without a backoff and however often, while a fault backs off and
    counts against max_retries; both count as retried."""
    import concurrent.futures

    answers = {0: ["restart"] * 5 + ["ok"], 1: ["fault", "fault", "ok"], 2: ["ok"]}

    class Client(jetstream_backend._JetStreamClient):
        def _submit(self, request, deadline):
            fut = concurrent.futures.Future()
            what = answers[request].pop(0)
            if what == "ok":
                fut.set_result([request])
            else:
                err = jetstream_backend.Restarted("r") if what == "restart" else OSError("f")
                fut.set_exception(err)
            return fut

    client = Client(max_prefill_length=16, timeout_s=30.0, max_retries=2, backoff_s=0.2)
    waits = []
    monkeypatch.setattr(jetstream_backend.time, "sleep", waits.append)
    rows, retried, dropped = client._send([0, 1, 2])
    assert sorted(rows) == [0, 1, 2] and dropped == 0
    assert retried == 5 + 2  # request 0 five times, request 1 twice
    assert waits == pytest.approx([0.2, 0.4], abs=1e-9)  # the two faults' backoffs only
    answers.update({0: ["restart", "ok"], 1: ["fault"] * 3})
    client.max_retries = 1
    rows, retried, dropped = client._send([0, 1])
    assert sorted(rows) == [0] and dropped == 1  # the fault's one retry spent
    assert waits[2:] == pytest.approx([0.2], abs=1e-9)


def test_requests_restarted_for_new_weights_give_their_pages_back_first():
    """The engine API driven by hand (tests/test_engine.py: two requests, new weights after 2
    calls, then a third request). Paged with the default pool: the same tokens, valid flags
    and records as contiguous, both ways (finish, restart). On 16 pages (15 usable; prompts
    of 5, 2 and 7 tokens in pages of 2): the two requests' prompts (3 + 1 pages) and first 4
    tokens (3 + 2 own pages, request 0's first a copy of its prompt's last page), 13 with
    the third's prompt (4), leave 2: 'finish' has the two grow by a page each and preempts
    the third (its first call needs 2: RESTART_TOKEN); 'restart' ends the two in that call,
    so their pages go back first and the third decodes as on contiguous slots."""
    from tests.test_engine import _decode_with_a_push

    def same(paged, ref):  # tokens, valid flags, records; log-probs to the paged tolerance
        (tok, valid, rec), (tok0, valid0, rec0) = paged, ref
        np.testing.assert_array_equal(tok, tok0)
        np.testing.assert_array_equal(valid, valid0)
        cols = [0, 1, 2, 4]  # serial, index, token, version
        np.testing.assert_array_equal(rec[:, cols], rec0[:, cols])
        logp = lambda r: r[:, 3].view(np.float32)  # noqa: E731
        np.testing.assert_allclose(logp(rec), logp(rec0), atol=1e-5)

    for weight_change in ("finish", "restart"):
        ref = _decode_with_a_push(weight_change, steps=2)
        same(_decode_with_a_push(weight_change, steps=2, kv_page_size=PAGE), ref)
    restart = _decode_with_a_push("restart", steps=2, kv_page_size=PAGE, kv_pages=16)
    same(restart, _decode_with_a_push("restart", steps=2))
    tok, valid, _ = _decode_with_a_push("finish", steps=2, kv_page_size=PAGE, kv_pages=16)
    assert tok[2, 2] == RESTART and valid[2, 2] and not valid[3:, 2].any()
