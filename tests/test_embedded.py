"""The committed embedded policy loads through the public paths exactly as it was trained."""

import json
import os

import jax
import numpy as np
from transformers import AutoTokenizer

from configs.common import EMBEDDED_TASK
from gjax.data import synthetic
from gjax.data.prompts import left_pad
from gjax.data.templates import apply_template
from gjax.data.tokenizer import build_tokenizer
from gjax.embedded import resolve_model_path
from gjax.models import hf_import
from gjax.rollout.sampler import SamplingParams, generate

PATH = resolve_model_path("embedded:tiny_qwen2")


def test_autotokenizer_of_the_checkpoint_matches_the_training_tokenizer():
    # AutoTokenizer picks Qwen2Tokenizer for a qwen2 checkpoint; it must give the same ids as
    # the tokenizer the policy was warmed up with (spaces and newlines included).
    auto, built = AutoTokenizer.from_pretrained(PATH), build_tokenizer()
    for p in synthetic.generate(20, "train", seed=3):
        text = apply_template("plain", p.problem) + p.demonstration
        assert auto(text)["input_ids"] == built(text)["input_ids"]
        assert auto.decode(auto(text)["input_ids"]) == text
    assert auto.eos_token_id == built.eos_token_id and auto.pad_token_id == built.pad_token_id


def test_checkpoint_is_small_and_documented():
    size = sum(os.path.getsize(os.path.join(PATH, f)) for f in os.listdir(PATH))
    assert size < 8 * 2**20
    cfg, _ = hf_import.load_pretrained(PATH)
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    with open(os.path.join(PATH, "warmup.json")) as f:
        warmup = json.load(f)
    assert {"heldout_accuracy", "worked_fraction"} <= set(warmup["log"][-1])


def test_policy_leaves_room_for_rl():
    # The warm-up mixes worked and bare answers (scripts/make_tiny_policy.py): sampled at the
    # tiny configs' temperature, the policy uses both styles (about half each), and working
    # the problem out is far more often right (measured: 68% vs 36%) -- the behaviour RL is
    # expected to discover.
    cfg, params = hf_import.load_pretrained(PATH)
    tok = build_tokenizer()
    task = synthetic.SyntheticConfig(**EMBEDDED_TASK)
    problems = synthetic.generate(128, "test", seed=11, config=task)
    prompts = [tok(apply_template("plain", p.problem))["input_ids"] for p in problems]
    ids_PxS, mask_PxS = left_pad([np.asarray(x) for x in prompts], 24, tok.pad_token_id)
    sampling = SamplingParams(
        max_new_tokens=32,
        temperature=0.7,
        stop_token_ids=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
    )
    G = 4
    out = generate(
        params, cfg, ids_PxS, mask_PxS, jax.random.key(0), num_samples=G, sampling=sampling
    )
    ids, n = np.asarray(out.tokens_BxN), np.asarray(out.lengths_B)
    texts = tok.batch_decode([r[:k] for r, k in zip(ids, n)], skip_special_tokens=True)
    answers = [problems[i // G].answer for i in range(len(texts))]
    correct = np.array([synthetic.extract_boxed(t) == a for t, a in zip(texts, answers)])
    worked = np.array([not t.startswith(synthetic.BOXED) for t in texts])
    assert 0.25 < worked.mean() < 0.75
    assert correct[worked].mean() > correct[~worked].mean() + 0.2
