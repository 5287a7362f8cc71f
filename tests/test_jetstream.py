"""JetStream serving on CPU: the gjax Engine behind JetStream's own Driver, against the local
sampler and the trainer's teacher-forced log-probs, on the embedded policy."""

import jax
import numpy as np
import pytest

from configs import common
from gjax.data.loading import PromptIterator, build_prompt_data
from gjax.embedded import resolve_model_path
from gjax.models import hf_io
from gjax.rollout import LocalSampler, SamplingParams

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")


@pytest.fixture(scope="module")
def policy():
    path = resolve_model_path(common.EMBEDDED_POLICY)
    cfg, params = hf_io.load_pretrained(path, param_dtype="float32", dtype="float32")
    tok = hf_io.load_tokenizer(path)
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


@pytest.fixture(scope="module")
def backend(policy):
    cfg, params, tok, batch, eos, pad, config = policy
    be = jetstream_backend.JetStreamBackend(
        cfg,
        params,
        sampling=_sampling(eos, pad, 0.0),
        slots=4,
        max_prompt_len=config.data.max_prompt_len,
    )
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
