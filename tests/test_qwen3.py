"""Qwen3 through gjax on the committed fixture tests/data/tiny_qwen3 (scripts/make_tiny_qwen3.py):
import, forward parity with transformers' Qwen3ForCausalLM, greedy tokens of the static
sampler == the continuous decoder (whole and chunked prefill) == the JetStream engine ==
transformers' own greedy `generate`, and an exact export round trip. The random-config
parity sweep is in tests/test_hf_io.py."""

import filecmp
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from gjax.models import hf_export, hf_format, hf_import
from gjax.models import transformer as T
from gjax.rollout import SamplingParams, generate
from gjax.rollout.decoder import ContinuousDecoder
from scripts import make_tiny_qwen3
from tests.test_decoder import assert_same
from tests.test_hf_io import TOL, _hf_logits, _max_diff_valid
from tests.test_sampler import left_pad

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_qwen3")
CFG, PARAMS = hf_import.load_pretrained(FIXTURE)
# Left-padded prompts of lengths 5, 2, 7 (no stop token among them), G samples each.
PROMPTS = [[5, 9, 2, 33, 7], [41, 3], [8, 8, 12, 60, 12, 19, 4]]
S, G, N = 7, 2, 8
TOKENS, MASK = left_pad(PROMPTS, S)
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, stop_token_ids=(), pad_token_id=0)

_forward = jax.jit(T.forward, static_argnums=1, static_argnames="return_logits")


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def static_greedy():
    out = generate(PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    return jax.tree.map(np.asarray, out)


def test_fixture_is_the_scripts_output(tmp_path):
    """The committed files are exactly what scripts/make_tiny_qwen3.py writes (deterministic)."""
    make_tiny_qwen3.write(str(tmp_path))
    names = sorted(os.listdir(FIXTURE))
    assert names == sorted(os.listdir(tmp_path))
    _, mismatch, errors = filecmp.cmpfiles(FIXTURE, str(tmp_path), names, shallow=False)
    assert mismatch == errors == [], "regenerate: python scripts/make_tiny_qwen3.py"
    assert os.path.getsize(os.path.join(FIXTURE, hf_format.SINGLE_FILE)) < 500_000


def test_import_is_qwen3_shaped():
    assert CFG == make_tiny_qwen3.CONFIG
    assert CFG.model_type == "qwen3" and CFG.qk_norm and not CFG.attention_bias
    assert CFG.head_dim * CFG.num_heads != CFG.hidden_size  # 32 x 4 vs 64
    attn = PARAMS["layers"]["attn"]
    assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (2, 32)
    assert attn["q"]["kernel"].shape == (2, 64, 128) and attn["k"]["kernel"].shape == (2, 64, 64)
    assert all("bias" not in attn[n] for n in "qkvo")
    assert "lm_head" in PARAMS  # untied
    want = make_tiny_qwen3.random_params(CFG)
    jax.tree.map(np.testing.assert_array_equal, PARAMS, want)
    tok = hf_import.load_tokenizer(FIXTURE)
    assert tok.eos_token_id == 1 and len(tok) <= CFG.vocab_size


def test_forward_parity_with_transformers(hf_model):
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, size=(3, 24))
    mask = np.ones_like(tokens)
    mask[0, :7] = 0  # left padding
    mask[1, 18:] = 0  # right padding
    tokens = np.where(mask == 1, tokens, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = _hf_logits(hf_model, tokens, mask, positions)
    _, got = _forward(
        PARAMS,
        CFG,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        return_logits=True,
    )
    assert np.abs(ref).max() > 1.0  # O(1) logits: the comparison is not between near-zeros
    assert _max_diff_valid(np.asarray(got), ref, mask) <= TOL
    # The q/k norms matter: without them the logits are far off.
    plain = CFG.replace(model_type="llama")
    no_norm = {**PARAMS, "layers": {**PARAMS["layers"]}}
    no_norm["layers"]["attn"] = {
        k: v for k, v in PARAMS["layers"]["attn"].items() if not k.endswith("_norm")
    }
    _, off = _forward(
        no_norm,
        plain,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        return_logits=True,
    )
    assert _max_diff_valid(np.asarray(off), ref, mask) > 100 * TOL


def test_prefill_and_decode_match_the_forward(static_greedy):
    """The sampler's cache path (prefill + decode_qkv with the q/k norms) scores its own tokens
    as the full forward does (teacher forcing), and greedy decoding takes their argmax."""
    from tests.test_sampler import teacher_forced_logits

    rep = lambda x: jnp.repeat(x, G, axis=0)
    out = static_greedy
    logits = teacher_forced_logits(
        PARAMS, CFG, rep(TOKENS), rep(MASK), jnp.asarray(out.tokens_BxN), jnp.asarray(out.mask_BxN)
    )
    logits = np.asarray(logits)
    assert out.mask_BxN.all()  # no stop tokens: every row runs N
    np.testing.assert_array_equal(out.tokens_BxN, logits.argmax(-1))
    ref = np.take_along_axis(jax.nn.log_softmax(logits, -1), out.tokens_BxN[..., None], -1)
    np.testing.assert_allclose(out.logps_BxN, ref[..., 0], atol=1e-5)
    top2 = np.sort(logits, -1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3  # no near-ties: the argmax is stable


def test_greedy_equals_transformers_generate(hf_model, static_greedy):
    for p, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=N,
                min_new_tokens=N,
                do_sample=False,
                pad_token_id=0,
            )
        hf_tokens = out[0, len(prompt) :].numpy()
        np.testing.assert_array_equal(static_greedy.tokens_BxN[p * G], hf_tokens)
        np.testing.assert_array_equal(static_greedy.tokens_BxN[p * G + 1], hf_tokens)


@pytest.mark.parametrize("prefill_chunk", [0, 3])
def test_continuous_decoder_equals_static(static_greedy, prefill_chunk):
    dec = ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=4, prefill_chunk=prefill_chunk)
    out = dec.generate(PARAMS, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    assert dec.stats["dispatches"] > 1
    assert_same(jax.tree.map(np.asarray, out), static_greedy, atol=1e-5)  # the sampler's tolerance


def test_jetstream_engine_equals_static(static_greedy):
    jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")
    be = jetstream_backend.JetStreamBackend(
        CFG, PARAMS, sampling=GREEDY, slots=3, max_prompt_len=S, tokens_per_dispatch=2
    )
    try:
        out = be.generate(PARAMS, TOKENS, MASK, None, num_samples=G, sampling=GREEDY)
    finally:
        be.close()
    assert_same(jax.tree.map(np.asarray, out), static_greedy, atol=1e-5)


def test_export_round_trip_is_exact(hf_model, tmp_path):
    """gjax's export of the loaded fixture is the fixture, byte for byte; transformers reads
    every tensor of it unchanged, and gjax reads back the same params (also from shards)."""
    out = str(tmp_path / "export")
    hf_export.save_pretrained(PARAMS, CFG, out, tokenizer=FIXTURE)
    for name in ("config.json", hf_format.SINGLE_FILE):
        assert filecmp.cmp(os.path.join(FIXTURE, name), os.path.join(out, name), shallow=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref_state, back_state = hf_model.state_dict(), back.state_dict()
    assert set(back_state) == set(ref_state)
    assert {"model.layers.1.self_attn.q_norm.weight", "lm_head.weight"} <= set(back_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(back_state[key], value, rtol=0, atol=0, msg=key)
    sharded = str(tmp_path / "sharded")
    hf_export.save_pretrained(PARAMS, CFG, sharded, max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, hf_format.INDEX_FILE))
    for directory in (out, sharded):
        cfg2, params2 = hf_import.load_pretrained(directory)
        assert cfg2 == CFG
        jax.tree.map(np.testing.assert_array_equal, PARAMS, params2)
