"""Tokenizer, templates and prompt loading: files, field mapping, filters, sharding, resume."""

import json
import logging
import os

import datasets
import numpy as np
import pytest

from gjax.data import synthetic as syn
from gjax.data.builders import build_prompt_data, build_prompt_iterator
from gjax.data.iterator import PromptIterator
from gjax.data.prompts import (
    FieldMap,
    encode_completions,
    prepare_prompts,
    prepare_sharded_prompts,
)
from gjax.data.sources import DataError, load_rows
from gjax.data.templates import BOXED_INSTRUCTION, TEMPLATES, apply_template
from gjax.data.tokenizer import (
    CHARACTERS,
    EOS,
    IM_END,
    IM_START,
    PAD,
    build_tokenizer,
    save_tokenizer,
)
from tests.hosts import on_hosts


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rows():
    """Mapped under non-default column names, with a demonstration column."""
    probs = syn.generate(60, "train", seed=1)
    return [
        {"question": p.problem, "solution": int(p.answer), "ref": p.demonstration, "extra": i}
        for i, p in enumerate(probs)
    ]


FIELDS = FieldMap(problem="question", answer="solution", demonstration="ref")


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_every_character(tok):
    assert len(tok) < 128
    for ch in CHARACTERS:
        ids = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, repr(ch)
        assert tok.decode(ids) == ch
    text = "".join(CHARACTERS)
    assert tok.decode(tok(text)["input_ids"]) == text
    for p in syn.generate(50, seed=3):
        for s in (p.problem, p.demonstration):
            assert tok.decode(tok(s)["input_ids"]) == s
    boxed = tok("\\boxed{7}")["input_ids"]
    assert len(boxed) == 3  # "\boxed{" is one token
    for special in (PAD, EOS, IM_START, IM_END):
        assert len(tok(special)["input_ids"]) == 1
    assert tok.pad_token == PAD and tok.eos_token == EOS and tok.pad_token_id != tok.eos_token_id
    # Byte-level alphabet: a non-ASCII character is one <|unk|> per UTF-8 byte.
    assert tok.decode(tok("é")["input_ids"]) == tok.unk_token * len("é".encode())


def test_tokenizer_saves_and_loads_with_auto_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tok, str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).exists(), name
    special = json.loads((tmp_path / "special_tokens_map.json").read_text())
    assert special["eos_token"] == EOS and special["pad_token"] == PAD
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Compute ((7+5)*3)-4.\n7+5=12\n\\boxed{32}"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.eos_token_id == tok.eos_token_id and loaded.pad_token_id == tok.pad_token_id
    assert loaded.padding_side == "left"
    msgs = [{"role": "user", "content": "Compute 1+2."}]
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------- templates


def test_templates(tok):
    assert set(TEMPLATES.names()) >= {"qwen_boxed", "r1", "chat", "plain"}
    q = apply_template("qwen_boxed", "What is 1+1?")
    assert q.startswith("<|im_start|>system\n" + BOXED_INSTRUCTION)
    assert "<|im_start|>user\nWhat is 1+1?<|im_end|>" in q and q.endswith("<|im_start|>assistant\n")
    assert BOXED_INSTRUCTION.endswith("put your final answer within \\boxed{}.")
    r = apply_template("r1", "What is 1+1?")
    assert "<think> </think> and <answer> </answer>" in r and r.endswith("Assistant: <think>")
    assert (
        apply_template("chat", "hi", tok)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert apply_template("plain", "Compute 1+2.") == "Compute 1+2.\n"
    with pytest.raises(ValueError, match="chat_template"):
        apply_template("chat", "hi", None)
    with pytest.raises(KeyError, match="plain"):
        apply_template("nope", "hi")
    # The templates' text is all in the task alphabet: no unknown tokens.
    for name in ("qwen_boxed", "r1", "chat", "plain"):
        assert tok.unk_token_id not in tok(apply_template(name, "Compute 1+2.", tok))["input_ids"]


# --------------------------------------------------------------------------- loading


def _check_mapped(data, rows):
    assert data.stats["kept"] == len(rows) == len(data)
    assert data.problems == [r["question"] for r in rows]
    assert data.answers == [str(r["solution"]) for r in rows]
    assert data.demonstrations == [r["ref"] for r in rows]
    assert data.prompts[0] == rows[0]["question"] + "\n"


def test_load_jsonl_with_field_mapping(tok, rows, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_rows(str(path))
    data = prepare_prompts(ds, tok, fields=FIELDS, max_prompt_length=32)
    _check_mapped(data, rows)


def test_load_parquet_and_arrow_with_field_mapping(tok, rows, tmp_path):
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    data = prepare_prompts(
        load_rows(str(tmp_path / "train.parquet")), tok, fields=FIELDS, max_prompt_length=32
    )
    _check_mapped(data, rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    data = prepare_prompts(
        load_rows(str(tmp_path / "saved")), tok, fields=FIELDS, max_prompt_length=32
    )
    _check_mapped(data, rows)
    arrow = sorted(f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow"))
    data = prepare_prompts(
        load_rows(str(tmp_path / "saved" / arrow[0])),
        tok,
        fields=FIELDS,
        max_prompt_length=32,
    )
    _check_mapped(data, rows)


def test_synthetic_source_and_config(tok):
    import ml_collections

    cfg = {
        "num_examples": 40,
        "synthetic": {"max_ops": 2},
        "synthetic_seed": 3,
        "demonstration_field": "demonstration",
    }
    data = build_prompt_data(cfg, tok)
    expected = syn.generate(40, "train", seed=3, config=syn.SyntheticConfig(max_ops=2))
    assert data.problems == [p.problem for p in expected]
    assert data.demonstrations == [p.demonstration for p in expected]
    assert data.answers == [p.answer for p in expected]
    for alias in ("test", "heldout"):
        held = build_prompt_data(
            {**cfg, "heldout_split": alias, "heldout_size": 20}, tok, heldout=True
        )
        assert len(held) == 20 and not set(held.problems) & set(data.problems)
    # The lead's configs/common.py schema, as a ConfigDict.
    cd = ml_collections.ConfigDict(
        {
            "source": "synthetic",
            "template": "plain",
            "max_prompt_len": 32,
            "num_examples": 16,
            "shuffle_seed": 5,
            "demonstration_field": "",
        }
    )
    it = build_prompt_iterator(cd, tok, global_batch_size=8, process_index=0, process_count=1)
    assert it.state()["seed"] == 5 and len(it.data) == 16 and next(it).demonstrations == [""] * 8
    with pytest.raises(DataError, match="valid:.*max_prompt_len"):
        build_prompt_data({"max_prompt_length": 3}, tok)
    with pytest.raises(DataError, match="splits"):
        build_prompt_data({"split": "validation"}, tok)
    with pytest.raises(DataError, match="valid:.*max_ops"):
        build_prompt_data({"synthetic": {"max_opps": 3}}, tok)


def test_length_filter_is_counted(tok):
    rows = [{"problem": "Compute 1+2.", "answer": "3"}, {"problem": "x" * 40, "answer": "1"}] * 3
    data = prepare_prompts(rows, tok, max_prompt_length=20)
    assert data.stats["skipped_too_long"] == 3 and data.stats["kept"] == 3
    assert all(len(ids) <= 20 for ids in data.prompt_ids)
    assert data.row_index.tolist() == [0, 2, 4]
    # The limit is in tokens of the templated prompt, inclusive.
    n = len(tok(apply_template("plain", "Compute 1+2."))["input_ids"])
    assert prepare_prompts(rows[:1], tok, max_prompt_length=n).stats["kept"] == 1
    with pytest.raises(DataError, match="no prompts left"):
        prepare_prompts(rows[:1], tok, max_prompt_length=n - 1)


def test_missing_field_names_field_columns_and_key(tok, rows):
    with pytest.raises(DataError) as err:
        prepare_prompts(rows, tok, max_prompt_length=32)  # default "problem" column
    msg = str(err.value)
    assert "'problem'" in msg and "'question'" in msg and "data.problem_field" in msg
    with pytest.raises(DataError, match="data.demonstration_field"):
        prepare_prompts(
            rows, tok, fields=FieldMap("question", "solution", "demo"), max_prompt_length=32
        )


def test_bad_rows_are_counted_or_raise_when_strict(tok):
    rows = [
        {"problem": "Compute 1+2.", "answer": "3"},
        {"problem": "   ", "answer": "1"},  # empty
        {"problem": None, "answer": "1"},  # malformed
        {"problem": "Compute 2+2.", "answer": ""},  # malformed
        {"problem": "Compute 2+3.", "answer": 5},  # fine: numeric answer
        {"problem": "Compute 3+3."},  # malformed: no answer
    ]
    data = prepare_prompts(rows, tok, max_prompt_length=32)
    assert data.stats == {
        "rows": 6,
        "skipped_empty": 1,
        "skipped_malformed": 3,
        "skipped_too_long": 0,
        "kept": 2,
    }
    assert data.answers == ["3", "5"]
    with pytest.raises(DataError, match=r"row 2: .*'problem'"):
        prepare_prompts(rows, tok, max_prompt_length=32, strict=True)
    with pytest.raises(DataError, match="mappings"):
        prepare_prompts(["not a dict"], tok, max_prompt_length=32)


def test_hub_offline_gives_clear_error():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by conftest: no network in tests
    with pytest.raises(DataError, match="data.source"):
        load_rows("no-such-org/no-such-dataset")


def test_missing_local_file_gives_clear_error(tmp_path):
    with pytest.raises(DataError, match="no data files"):
        load_rows(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- iteration


@pytest.fixture(scope="module")
def data(tok):
    return build_prompt_data({"num_examples": 50}, tok)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return (
        np.array_equal(a.prompt_ids_PxS, b.prompt_ids_PxS)
        and np.array_equal(a.prompt_mask_PxS, b.prompt_mask_PxS)
        and a.problems == b.problems
        and a.answers == b.answers
        and a.demonstrations == b.demonstrations
        and a.epoch == b.epoch
    )


def test_batches_are_left_padded(data):
    batch = next(PromptIterator(data, global_batch_size=8, process_index=0, process_count=1))
    assert batch.prompt_ids_PxS.shape == batch.prompt_mask_PxS.shape == (8, data.max_prompt_length)
    assert batch.prompt_ids_PxS.dtype == np.int32
    for ids, mask, row in zip(batch.prompt_ids_PxS, batch.prompt_mask_PxS, batch.row_index_P):
        n = int(mask.sum())
        assert mask[-n:].all() and not mask[:-n].any()
        assert (ids[:-n] == data.pad_id).all()
        assert ids[-n:].tolist() == data.prompt_ids[row].tolist()


def test_shuffle_is_deterministic_per_epoch(data):
    it = PromptIterator(data, global_batch_size=10, seed=4, process_index=0, process_count=1)
    batches = _take(it, 10)  # 5 per epoch
    again = _take(
        PromptIterator(data, global_batch_size=10, seed=4, process_index=0, process_count=1), 10
    )
    assert all(_same(a, b) for a, b in zip(batches, again))
    epoch0 = np.concatenate([b.row_index_P for b in batches[:5]])
    epoch1 = np.concatenate([b.row_index_P for b in batches[5:]])
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))  # each epoch visits every row
    assert epoch0.tolist() != epoch1.tolist() and [b.epoch for b in batches] == [0] * 5 + [1] * 5
    other = next(
        PromptIterator(data, global_batch_size=10, seed=5, process_index=0, process_count=1)
    )
    assert other.row_index_P.tolist() != batches[0].row_index_P.tolist()
    ordered = next(
        PromptIterator(data, global_batch_size=10, shuffle=False, process_index=0, process_count=1)
    )
    assert ordered.row_index_P.tolist() == list(range(10))


def test_per_host_sharding_partitions_each_global_batch(data):
    whole = _take(
        PromptIterator(data, global_batch_size=12, seed=1, process_index=0, process_count=1), 6
    )
    hosts = [
        _take(
            PromptIterator(data, global_batch_size=12, seed=1, process_index=h, process_count=4), 6
        )
        for h in range(4)
    ]
    for k, batch in enumerate(whole):
        parts = [hosts[h][k] for h in range(4)]
        assert all(len(p) == 3 for p in parts)
        joined = np.concatenate([p.row_index_P for p in parts])
        assert joined.tolist() == batch.row_index_P.tolist()  # disjoint, in order, complete
        assert np.array_equal(
            np.concatenate([p.prompt_ids_PxS for p in parts]), batch.prompt_ids_PxS
        )
    with pytest.raises(DataError, match="multiple of the process count"):
        PromptIterator(data, global_batch_size=10, process_index=0, process_count=4)


def test_resume_from_saved_state_yields_the_same_batches(data):
    it = PromptIterator(data, global_batch_size=8, seed=2, process_index=1, process_count=2)
    _take(it, 5)  # 6 batches per epoch: the next ones cross into epoch 1
    state = json.loads(json.dumps(it.state()))  # survives a JSON checkpoint
    assert state == {"epoch": 0, "index": 40, "num_rows": 50, "seed": 2}
    expected = _take(it, 4)
    resumed = PromptIterator(
        data, global_batch_size=8, seed=2, process_index=1, process_count=2, state=state
    )
    got = _take(resumed, 4)
    assert all(_same(a, b) for a, b in zip(expected, got))
    assert [b.epoch for b in got] == [0, 1, 1, 1]
    with pytest.raises(DataError, match="different data configuration"):
        PromptIterator(
            data, global_batch_size=8, seed=3, process_index=1, process_count=2, state=state
        )
    with pytest.raises(DataError, match="invalid data position"):
        PromptIterator(
            data,
            global_batch_size=8,
            seed=2,
            process_index=1,
            process_count=2,
            state={"epoch": 0, "index": 3},
        )


def test_num_epochs_stops(data):
    it = PromptIterator(data, global_batch_size=25, num_epochs=2, process_index=0, process_count=1)
    assert len(list(it)) == 4


def test_encode_completions(tok):
    demos = ["7+5=12\n\\boxed{12}", "1+1=2\n\\boxed{2}" * 5]
    ids, mask, truncated = encode_completions(tok, demos, max_length=16)
    assert ids.shape == mask.shape == (2, 16) and ids.dtype == np.int32 and truncated == 1
    n = len(tok(demos[0])["input_ids"]) + 1
    assert mask[0].tolist() == [1] * n + [0] * (16 - n)
    assert ids[0, n - 1] == tok.eos_token_id and (ids[0, n:] == tok.pad_token_id).all()
    assert tok.decode(ids[0, : n - 1]) == demos[0]
    assert mask[1].all() and tok.eos_token_id not in ids[1].tolist()


@pytest.mark.parametrize(
    "bad_line, why",
    [
        (b'{"problem": "caf\xe9 1+1", "answer": "2"}', r"byte 0xe9 at column 17 is not UTF-8"),
        (b'{"problem": "1+1", "answer": ', r"not valid JSON: Expecting value at column 30"),
        (b'["1+1", "2"]', r"a JSON list, not an object"),
    ],
)
def test_bad_jsonl_line_names_file_and_row_or_is_skipped_and_counted(
    tok, tmp_path, bad_line, why, caplog, capfd
):
    path = tmp_path / "data.jsonl"
    good = [
        json.dumps({"problem": f"Compute {i}+1.", "answer": str(i + 1)}).encode() for i in range(3)
    ]
    path.write_bytes(b"\n".join([good[0], bad_line, good[1], b"", good[2]]) + b"\n")
    cfg = {"source": str(path), "split": "train"}
    with pytest.raises(DataError, match=rf"{path}, line 2 \(row 2\): {why}.*data\.strict=False"):
        build_prompt_data({**cfg, "strict": True}, tok)
    data = build_prompt_data(cfg, tok)  # strict=False: skipped like other bad rows
    assert data.stats == {
        "rows": 4,
        "skipped_empty": 0,
        "skipped_malformed": 1,
        "skipped_too_long": 0,
        "kept": 3,
    }
    assert data.problems == [f"Compute {i}+1." for i in range(3)]
    # datasets' JSON builder, tried first, logs the line as an ERROR before gjax reads the file
    # line by line: a skipped line is reported once, by gjax, as the warning above.
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]
    assert "Failed to load JSON" not in capfd.readouterr().err


def test_heldout_size_is_reported_under_its_own_name(tok):
    with pytest.raises(DataError, match=r"data\.heldout_size must be positive, got 0"):
        build_prompt_data({"heldout_size": 0}, tok, heldout=True)


# --------------------------------------------------------------------------- field specs


def test_field_specs_read_columns_nested_values_and_boxed_answers():
    from gjax.data.fields import FieldSpecError, parse

    row = {
        "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        "reward_model": {"ground_truth": "7"},
        "solution": "so $x = \\boxed{\\frac{1}{2}}$, not \\boxed{3}? No: \\boxed{4}.",
    }
    assert parse("prompt[-1].content").get(row) == "Q"
    assert parse("prompt[0].content").get(row) == "S"
    assert parse("reward_model.ground_truth").get(row) == "7"
    assert parse("boxed(solution)").get(row) == "4"  # the last one
    assert parse(" boxed( solution ) ").get(row) == "4"
    for missing in ("prompt[2].content", "reward_model.answer", "solution[0]", "nope"):
        assert parse(missing).get(row) is None, missing
    assert parse("boxed(reward_model)").get(row) is None  # not text: nothing extracted
    for bad, match in [
        ("boxd(solution)", "unknown extractor 'boxd'"),
        ("prompt[x]", "cannot read"),
        ("prompt..content", "cannot read"),
        ("", "non-empty"),
    ]:
        with pytest.raises(FieldSpecError, match=match):
            parse(bad)


def test_rows_without_a_boxed_answer_are_counted_as_malformed(tok):
    rows = [
        {"problem": "One?", "solution": "It is \\boxed{1}."},
        {"problem": "Two?", "solution": "It is 2."},  # no \\boxed{}: no answer
    ]
    fields = FieldMap("problem", "boxed(solution)")
    data = prepare_prompts(rows, tok, fields=fields, max_prompt_length=32)
    assert data.answers == ["1"] and data.stats["skipped_malformed"] == 1
    with pytest.raises(DataError, match=r"no column 'answer' for the answer field"):
        prepare_prompts(
            rows, tok, fields=FieldMap("problem", "boxed(answer)"), max_prompt_length=32
        )


# --------------------------------------------------------------------------- held-out sets


def _numbered_file(path, n, offset=0):
    lines = [json.dumps({"question": f"Compute {i} + {i}.", "solution": 2 * i}) for i in range(n)]
    path.write_text("".join(line + "\n" for line in lines[offset:]))
    return str(path)


def _file_cfg(path, **kw):
    return {"source": path, "problem_field": "question", "answer_field": "solution", **kw}


def test_a_plain_file_is_not_its_own_heldout_set(tok, tmp_path):
    cfg = _file_cfg(_numbered_file(tmp_path / "d.jsonl", 20))
    with pytest.raises(DataError, match=r"held-out set would be training rows.*no splits"):
        build_prompt_data(cfg, tok, heldout=True)
    assert len(build_prompt_data(cfg, tok)) == 20  # the training set alone is fine
    held = build_prompt_data({**cfg, "allow_heldout_overlap": True}, tok, heldout=True)
    assert len(held) == 20 and held.origin["overlap_allowed"]
    assert (
        held.origin["overlapping_training_rows"] == 20 and "no splits" in held.origin["same_rows"]
    )


def test_heldout_fraction_carves_a_seeded_sample_out_of_training(tok, tmp_path):
    cfg = _file_cfg(_numbered_file(tmp_path / "d.jsonl", 40), heldout_fraction=0.25)
    train = build_prompt_data(cfg, tok)
    held = build_prompt_data(cfg, tok, heldout=True)
    assert (len(train), len(held)) == (30, 10)
    assert not set(train.problems) & set(held.problems)
    assert sorted(train.problems + held.problems) == sorted(
        f"Compute {i} + {i}." for i in range(40)
    )
    rows = held.origin["rows"]
    assert held.problems == [f"Compute {i} + {i}." for i in rows] and rows == sorted(rows)
    assert held.origin["carved"] == {"fraction": 0.25, "seed": 0, "rows_removed": 10}
    assert held.origin["split"] is None and held.origin["training_rows_removed_as_duplicates"] == 0
    again = build_prompt_data(cfg, tok, heldout=True)
    assert again.problems == held.problems  # deterministic
    other = build_prompt_data({**cfg, "heldout_seed": 1}, tok, heldout=True)
    assert other.problems != held.problems
    capped = build_prompt_data({**cfg, "heldout_size": 4}, tok, heldout=True)
    assert len(capped) == 4 and set(capped.problems) <= set(held.problems)
    assert build_prompt_data({**cfg, "heldout_size": 4}, tok).problems == train.problems
    with pytest.raises(DataError, match=r"heldout_fraction=0.001 of 40 training rows holds out 0"):
        build_prompt_data({**cfg, "heldout_fraction": 0.001}, tok)


def test_training_rows_that_repeat_a_heldout_problem_are_removed(tok, tmp_path):
    train_path = _numbered_file(tmp_path / "train.jsonl", 20)
    held_path = tmp_path / "held.jsonl"  # two training problems (spaced apart) and three new
    held_rows = [{"question": "Compute  3 +\t3.", "solution": 6}, {"question": "Compute 9 + 9."}]
    held_rows[1]["solution"] = 18
    held_rows += [{"question": f"Compute {i} + {i}.", "solution": 2 * i} for i in (50, 51, 52)]
    held_path.write_text("".join(json.dumps(r) + "\n" for r in held_rows))
    cfg = _file_cfg(train_path, heldout_source=str(held_path))
    train = build_prompt_data(cfg, tok)
    assert len(train) == 18 and "Compute 3 + 3." not in train.problems
    held = build_prompt_data(cfg, tok, heldout=True)
    assert len(held) == 5 and held.origin["training_rows_removed_as_duplicates"] == 2
    assert held.origin["source"] == str(held_path) and held.origin["rows"] == [0, 1, 2, 3, 4]
    allowed = {**cfg, "allow_heldout_overlap": True}
    assert len(build_prompt_data(allowed, tok)) == 20
    held = build_prompt_data(allowed, tok, heldout=True)
    assert held.origin["overlapping_training_rows"] == 2 and held.origin["overlap_allowed"]


def test_synthetic_heldout_split_is_disjoint_and_recorded(tok):
    cfg = {"num_examples": 300, "heldout_size": 40}
    train = build_prompt_data(cfg, tok)
    held = build_prompt_data(cfg, tok, heldout=True)
    assert len(train) == 300 and not set(train.problems) & set(held.problems)
    assert held.origin["split"] == "test" and held.origin["source"] == "synthetic"
    assert held.origin["rows"] == list(range(len(held)))
    with pytest.raises(DataError, match="synthetic split 'train' is data.split"):
        build_prompt_data({**cfg, "heldout_split": "train"}, tok, heldout=True)


# --------------------------------------------------------------------------- sharded templating


class _CountingTokenizer:
    """The tokenizer, counting the texts it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.texts = tok, 0

    def __call__(self, texts, **kwargs):
        self.texts += len(texts)
        return self.tok(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _on_hosts(count, fn):
    """`tests.hosts.on_hosts`, a host's DataError its result."""
    return on_hosts(count, fn, returned=DataError)


def _messy_rows():
    """Synthetic problems with empty, malformed and too-long rows spread through them."""
    out = []
    for i, p in enumerate(syn.generate(61, "train", seed=4)):
        row = {"problem": p.problem, "answer": p.answer}
        if i % 7 == 3:
            row["problem"] = "  "
        elif i % 11 == 5:
            row["answer"] = None
        elif i % 5 == 1:
            row["problem"] = p.problem + " Think." * 6
        out.append(row)
    return out


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("as_dataset", [False, True])
def test_sharded_prompts_give_the_same_batches_with_each_host_templating_its_share(
    tok, count, as_dataset
):
    rows = _messy_rows()
    rows = datasets.Dataset.from_list(rows) if as_dataset else rows
    whole = prepare_prompts(rows, tok, max_prompt_length=24)
    assert min(whole.stats[k] for k in whole.stats) > 0  # every filter is exercised
    P, steps = 6, 12  # 12 steps cross an epoch boundary (whole holds ~40 prompts)

    def host(h, allgather):
        counting = _CountingTokenizer(tok)
        data = prepare_sharded_prompts(
            rows,
            counting,
            max_prompt_length=24,
            process_index=h,
            process_count=count,
            allgather=allgather,
        )
        built = counting.texts
        it = PromptIterator(data, global_batch_size=P, seed=7, process_index=h, process_count=count)
        return data, built, _take(it, steps), counting.texts - built

    want = _take(
        PromptIterator(whole, global_batch_size=P, seed=7, process_index=0, process_count=1), steps
    )
    results = _on_hosts(count, host)
    for h, (data, built, got, taken) in enumerate(results):
        assert data.stats == whole.stats and data.row_index.tolist() == whole.row_index.tolist()
        assert 0 < built <= -(-len(rows) // count)  # only its slice was templated at start
        assert taken == steps * P // count  # then only the prompts of its own blocks
        for k, batch in enumerate(got):
            block = slice(h * P // count, (h + 1) * P // count)
            assert batch.row_index_P.tolist() == want[k].row_index_P[block].tolist()
            assert np.array_equal(batch.prompt_ids_PxS, want[k].prompt_ids_PxS[block])
            assert np.array_equal(batch.prompt_mask_PxS, want[k].prompt_mask_PxS[block])
            assert batch.prompts == want[k].prompts[block]
            assert batch.answers == want[k].answers[block] and batch.epoch == want[k].epoch


def test_sharded_prompts_raise_the_same_error_on_every_host(tok):
    """A host that finds nothing wrong in its own slice still raises (after the gather), so
    no host is left waiting in a collective while another has stopped."""
    rows = [{"problem": p.problem, "answer": p.answer} for p in syn.generate(60, "train", seed=4)]
    rows[40]["answer"] = None  # in the second host's slice

    def build(strict, max_prompt_length):
        return _on_hosts(
            2,
            lambda h, gather: prepare_sharded_prompts(
                rows, tok, max_prompt_length=max_prompt_length, strict=strict,
                process_index=h, process_count=2, allgather=gather,
            ),
        )  # fmt: skip

    errors = build(strict=True, max_prompt_length=24)
    assert all(isinstance(e, DataError) for e in errors), errors
    assert [str(e) for e in errors] == [
        "row 40: malformed: 'answer' is NoneType, not a string or number; fix the data or set "
        "data.strict=False"
    ] * 2
    with pytest.raises(DataError) as eager:
        prepare_prompts(rows, tok, max_prompt_length=24, strict=True)
    assert str(eager.value) == str(errors[0])
    errors = build(strict=False, max_prompt_length=1)  # nothing kept
    assert all(isinstance(e, DataError) and "no prompts left" in str(e) for e in errors), errors
    assert str(errors[0]) == str(errors[1])


def test_own_data_needs_demonstrations_only_for_anchors_or_a_judge(tok, tmp_path):
    """A tiny config on a file without a demonstration column: a run without anchors or a
    judge reads it (tiny() maps data.demonstration_field for the synthetic task); anchors
    (DaGRPO) or a judge's references still need the column."""
    from configs import dagrpo, grpo
    from gjax.data.builders import run_data_config

    path = tmp_path / "own.jsonl"
    path.write_text(
        "".join(
            json.dumps({"problem": f"Compute {i}+1.", "answer": str(i + 1)}) + "\n"
            for i in range(40)
        )
    )

    def config(module, **changes):
        c = module.get_config("tiny")
        c.data.source, c.data.heldout_fraction = str(path), 0.25
        for key, value in changes.items():
            section, name = key.split("__")
            c[section][name] = value
        return c

    c = config(grpo)
    assert c.data.demonstration_field == "demonstration"
    data = build_prompt_data(run_data_config(c), tok)
    held = build_prompt_data(run_data_config(c), tok, heldout=True)
    assert (len(data), len(held)) == (30, 10) and data.demonstrations == [""] * 30
    for c in (config(grpo, anchors__per_group=1), config(dagrpo)):
        with pytest.raises(DataError, match="data.demonstration_field"):
            build_prompt_data(run_data_config(c), tok)
    c = config(grpo)
    c.reward.judge.name = "rule"
    with pytest.raises(DataError, match="data.demonstration_field"):
        build_prompt_data(run_data_config(c), tok)
