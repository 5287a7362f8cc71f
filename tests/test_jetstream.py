"""JetStream serving on CPU: the gjax Engine behind JetStream's own Driver, against the local
sampler and the trainer's teacher-forced log-probs, on the embedded policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from gjax.data.builders import build_prompt_data
from gjax.data.iterator import PromptIterator
from gjax.embedded import resolve_model_path
from gjax.models import hf_import
from gjax.rollout import LocalSampler, SamplingParams

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")


@pytest.fixture(scope="module")
def policy():
    path = resolve_model_path(common.EMBEDDED_POLICY)
    cfg, params = hf_import.load_pretrained(path, param_dtype="float32", dtype="float32")
    tok = hf_import.load_tokenizer(path)
    config = common.tiny(common.base())
    data = build_prompt_data(config.data, tok, heldout=True)
    it = PromptIterator(
        data, global_batch_size=6, shuffle=False, num_epochs=1, process_index=0, process_count=1
    )
    batch = next(it)
    eos = tuple(cfg.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return cfg, params, tok, batch, eos, pad, config


def _sampling(eos, pad, temperature, n=32):
    return SamplingParams(
        max_new_tokens=n, temperature=temperature, stop_token_ids=eos, pad_token_id=pad
    )


def engine_backend(policy, extra_prompt_len: int = 0):
    """The in-process engine on the embedded policy, 4 slots, greedy, prefilling prompts of
    data.max_prompt_len + `extra_prompt_len` (a multi-turn run's history: + max_new_tokens)."""
    cfg, params, tok, batch, eos, pad, config = policy
    return jetstream_backend.JetStreamBackend(
        cfg,
        params,
        sampling=_sampling(eos, pad, 0.0),
        slots=4,
        max_prompt_len=config.data.max_prompt_len + extra_prompt_len,
    )


@pytest.fixture(scope="module")
def backend(policy):
    be = engine_backend(policy)
    yield be
    be.close()


def test_greedy_in_process_equals_local_sampler(policy, backend):
    cfg, params, tok, batch, eos, pad, _ = policy
    sp = _sampling(eos, pad, 0.0)
    args = (params, batch.prompt_ids_PxS, batch.prompt_mask_PxS, jax.random.key(0))
    local = LocalSampler(cfg).generate(*args, num_samples=2, sampling=sp)
    served = backend.generate(*args, num_samples=2, sampling=sp)
    np.testing.assert_array_equal(np.asarray(served.tokens_BxN), np.asarray(local.tokens_BxN))
    np.testing.assert_array_equal(np.asarray(served.mask_BxN), np.asarray(local.mask_BxN))
    np.testing.assert_allclose(np.asarray(served.logps_BxN), np.asarray(local.logps_BxN), atol=1e-5)
    assert np.asarray(served.valid_B).all()


def test_sampled_logps_equal_teacher_forced(policy, backend):
    """T = 0.7 with top-k: the engine's log-probs are log_softmax(logits / T) of the trainer's
    full forward at the sampled tokens (gjax.rollout.sampler's definition), to 1e-5."""
    from tests.test_sampler import teacher_forced_logits

    cfg, params, tok, batch, eos, pad, _ = policy
    sp = SamplingParams(
        max_new_tokens=24, temperature=0.7, top_k=20, stop_token_ids=eos, pad_token_id=pad
    )
    out = backend.generate(
        params, batch.prompt_ids_PxS, batch.prompt_mask_PxS, None, num_samples=2, sampling=sp
    )
    tokens, mask = np.asarray(out.tokens_BxN), np.asarray(out.mask_BxN)
    assert mask.sum() > 40 and np.isin(tokens[mask == 1], eos).any()
    rep = lambda x: np.repeat(np.asarray(x), 2, axis=0)
    logits = teacher_forced_logits(
        params,
        cfg,
        rep(batch.prompt_ids_PxS),
        rep(batch.prompt_mask_PxS).astype(np.int32),
        tokens,
        mask,
    )
    ref = jax.nn.log_softmax(np.asarray(logits) / 0.7, axis=-1)
    ref = np.take_along_axis(np.asarray(ref), tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logps_BxN), np.where(mask == 1, ref, 0.0), atol=1e-5)


def test_prompt_longer_than_max_prefill_length_is_a_clear_error(policy, backend):
    cfg, params, tok, batch, eos, pad, _ = policy
    long_ids = np.full((1, backend.max_prefill_length), 7, np.int32)
    with pytest.raises(jetstream_backend.PromptTooLong, match="max_prefill_length=32"):
        backend.generate(
            params,
            long_ids,
            np.ones_like(long_ids),
            None,
            num_samples=1,
            sampling=_sampling(eos, pad, 0.0),
        )


def test_weight_push_changes_generations_without_recompiling(policy):
    """After a push, greedy tokens are the new policy's (known to differ from the old one's);
    the swap goes through the ParamsHolder the orchestrator captured: no new compilation."""
    cfg, params, tok, batch, eos, pad, config = policy
    sp = _sampling(eos, pad, 0.0)
    be = jetstream_backend.JetStreamBackend(
        cfg, params, sampling=sp, slots=4, max_prompt_len=config.data.max_prompt_len
    )
    try:
        args = (batch.prompt_ids_PxS, batch.prompt_mask_PxS, None)
        before = be.generate(params, *args, num_samples=1, sampling=sp)
        compiled = be.engine.compile_count()
        noise = jax.tree.map(
            lambda x, k: 0.3 * jax.random.normal(k, x.shape, x.dtype),
            params,
            jax.tree.unflatten(
                jax.tree.structure(params),
                list(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params)))),
            ),
        )
        new_params = jax.tree.map(lambda x, n: x + n, params, noise)
        local_new = LocalSampler(cfg).generate(
            new_params, *args[:2], jax.random.key(0), num_samples=1, sampling=sp
        )
        assert not np.array_equal(np.asarray(local_new.tokens_BxN), np.asarray(before.tokens_BxN))
        after = be.generate(new_params, *args, num_samples=1, sampling=sp)
        np.testing.assert_array_equal(
            np.asarray(after.tokens_BxN), np.asarray(local_new.tokens_BxN)
        )
        assert be.engine.compile_count() == compiled
        np.testing.assert_array_equal(np.asarray(before.version_B), 0)
        np.testing.assert_array_equal(np.asarray(after.version_B), 1)
        assert be.metrics()["rollout/version_lag_max"] == 0.0
    finally:
        be.close()


def _engine_tokens(engine, state, prompts, steps, poison=None):
    """Greedy tokens [steps, S] of `prompts` inserted into slots 0.. of `state` (the engine
    API without JetStream's threads); `poison(state)` runs after the inserts."""
    from gjax.rollout import engine as eng

    for slot, ids in enumerate(prompts):
        padded, n = eng.jetstream.token_utils.pad_tokens(
            np.asarray(ids, np.int32),
            eng.BOS_SENTINEL,
            0,
            max_prefill_length=engine.max_prefill_length,
            jax_padding=False,
        )
        prefix = engine.prefill(params=engine.holder, padded_tokens=padded, true_length=n)
        state = engine.insert(prefix, state, slot)
    if poison is not None:
        state = poison(state)
    out = []
    for _ in range(steps):
        state, result = engine.generate(engine.holder, state)
        out.append(np.asarray(result.data)[:, :2])
    return np.stack(out)  # [steps, S, (token, valid)]


def test_slot_contents_never_reach_the_next_request(policy):
    """A slot whose cache holds NaN beyond the prompt (left by a failed request) decodes the
    same tokens as a clean slot; a slot with non-finite logits emits ERROR_TOKEN once and
    ends, and the other slots' tokens are unchanged."""
    from gjax.rollout import engine as eng

    cfg, params, tok, batch, eos, pad, config = policy
    engine = eng.Engine(
        cfg,
        params,
        sampling=_sampling(eos, pad, 0.0, n=12),
        max_concurrent_decodes=2,
        max_prefill_length=eng.prefill_bucket(config.data.max_prompt_len),
    )
    prompts = [
        np.asarray(batch.prompt_ids_PxS[i])[np.asarray(batch.prompt_mask_PxS[i], bool)]
        for i in range(2)
    ]
    clean = _engine_tokens(engine, engine.init_decode_state(), prompts, 12)
    assert clean[0, :, 1].all() and (clean[:, :, 0] >= 0).all()  # both slots decoded

    def nan_everywhere(state):
        state = dict(state)
        for name in ("cache_k", "cache_v"):
            state[name] = [jnp.full_like(c, jnp.nan) for c in state[name]]
        return state

    # A decode state with NaN in every cache position (as a failed request leaves it), then
    # the same prompts inserted: the tokens are the clean slots'.
    poisoned = nan_everywhere(engine.init_decode_state())
    np.testing.assert_array_equal(_engine_tokens(engine, poisoned, prompts, 12), clean)

    # Non-finite logits in slot 0 only: it emits ERROR_TOKEN, then nothing; slot 1 is clean.
    def nan_logits(state):
        state = dict(state)
        state["logits_SxV"] = state["logits_SxV"].at[0].set(jnp.nan)
        return state

    failed = _engine_tokens(engine, engine.init_decode_state(), prompts, 12, poison=nan_logits)
    assert failed[0, 0].tolist() == [eng.ERROR_TOKEN, 1] and not failed[1:, 0, 1].any()
    np.testing.assert_array_equal(failed[:, 1], clean[:, 1])
