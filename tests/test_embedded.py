"""The committed embedded policy loads through the public paths exactly as it was trained."""

import json
import os

from transformers import AutoTokenizer

from gjax.data import synthetic
from gjax.data.templates import apply_template
from gjax.data.tokenizer import build_tokenizer
from gjax.embedded import resolve_model_path
from gjax.models import hf_io

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
    cfg, _ = hf_io.load_pretrained(PATH)
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    with open(os.path.join(PATH, "warmup.json")) as f:
        warmup = json.load(f)
    assert warmup["log"][-1]["heldout_accuracy"] < 0.5  # room left for RL
