"""Every config builds and validates; bad configs fail at start, naming the field."""

import importlib
import json
import math
import pathlib
import re

import ml_collections
import numpy as np
import pytest

from configs import common
from gjax import schema
from gjax.config import check_schema, resolve_mesh_shape
from gjax.config import validate as validate_core
from gjax.errors import ConfigError
from gjax.schema import Range, walk
from gjax.train import CONFIG_CHECKS


def validate(config, num_devices):
    """`gjax.config.validate` as training calls it: the core and every subsystem's hook."""
    return validate_core(config, num_devices, checks=CONFIG_CHECKS)


ALGOS = ("grpo", "dr_grpo", "dapo", "gpg", "a_grae", "dagrpo", "cw_grpo", "cispo", "pass_at_k")


@pytest.mark.parametrize("arg", [None, "tiny", "headroom", "tools"])
@pytest.mark.parametrize("algo", ALGOS)
def test_every_config_builds_and_validates(algo, arg):
    module = importlib.import_module(f"configs.{algo}")
    assert "python -m gjax.train --config=configs/" in module.__doc__
    c = module.get_config(arg)
    assert c.algo == algo
    if arg == "tools" and algo == "dagrpo":  # its judge scores and anchors are not episodes'
        with pytest.raises(ConfigError, match="multi-turn training is not available"):
            validate(c, num_devices=1)
        return
    validate(c, num_devices=8 if arg is None else 1)
    common.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
    if arg == "tiny":
        assert c.model.path == common.EMBEDDED_POLICY and c.data.source == "synthetic"
        # The embedded task's difficulty is set; every other task field stays overridable.
        assert {k: c.data.synthetic[k] for k in common.EMBEDDED_TASK} == common.EMBEDDED_TASK
        assert set(c.data.synthetic) == set(common.base().data.synthetic)
    if arg == "headroom":
        assert c.model.path == common.EMBEDDED_POLICY and c.data.source == "synthetic"
        assert {k: c.data.synthetic[k] for k in common.HEADROOM_TASK} == common.HEADROOM_TASK
    if arg == "tools":
        assert c.model.path == common.TOOL_POLICY and c.env.name == "tool"
        assert {k: c.data.synthetic[k] for k in common.TOOL_TASK} == common.TOOL_TASK


def test_paper_settings_are_the_defaults():
    from configs import a_grae, dagrpo, gpg

    a = a_grae.get_config()
    assert (a.rollout.num_samples, a.optim.lr, a.model.path) == (8, 1e-6, "Qwen/Qwen2.5-Math-7B")
    assert a.objective.advantage_kwargs.alpha == 1.0
    d = dagrpo.get_config()
    assert d.objective.advantage_kwargs.delta == 3.0 and d.train.steps == 500
    assert d.objective.advantage_kwargs.scale == "none"  # Dr.GRPO setting: no std
    assert d.objective.aggregation == "seq_mean_token_sum_norm" and d.objective.kl_beta == 0
    assert d.anchors.per_group == 1 and d.reward.judge.name == "openai"
    g = gpg.get_config()
    assert g.sampling.min_valid_fraction == 0.6 and g.objective.policy_loss == "pg"


def test_unknown_key_is_named():
    c = common.base()
    c.optim.learning_rate = 1.0
    with pytest.raises(
        ConfigError, match=r"'config\.optim\.learning_rate'.* config\.optim are: .*\blr\b"
    ):
        check_schema(c, common.base())


def test_wrong_type_is_named():
    # ConfigDicts built from base() are type-safe already; a config assembled by hand is not.
    c = ml_collections.ConfigDict({"rollout": {"num_samples": "eight"}})
    with pytest.raises(ConfigError, match=r"config\.rollout\.num_samples must be int"):
        check_schema(c, common.base())


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("rollout.num_samples", 1, r"rollout\.num_samples.*G >= 2"),
        ("rollout.prompts_per_step", 3, r"train\.minibatches"),
        ("train.microbatches", 3, r"train\.microbatches"),
        ("anchors.per_group", 8, r"anchors\.per_group"),
        ("rollout.top_p", 0.0, r"rollout\.top_p"),
        ("sampling.min_valid_fraction", 1.5, r"sampling\.min_valid_fraction"),
        ("reward.judge.name", "gpt", r"reward\.judge\.name"),
        ("reward.judge.on_missing", "skip", r"reward\.judge\.on_missing: must be keep\|drop\|fill"),
        ("eval.pass_k", "1,16", r"config\.eval\.pass_k"),
    ],
)
def test_bad_values_are_named(field, value, match):
    c = common.tiny(common.base())
    c.train.minibatches = 2
    _set(c, field, value)
    with pytest.raises(ConfigError, match=match):
        validate(c, 1)


def test_pass_at_k_needs_k_within_the_group():
    from configs import pass_at_k

    c = pass_at_k.get_config("tiny")
    c.objective.advantage_kwargs.k = 7  # < num_samples: fine
    validate(c, 1)
    for k in (8, 9):  # k = G: one subgroup, the whole group, all advantages 0
        c.objective.advantage_kwargs.k = k
        with pytest.raises(
            ConfigError, match=rf"advantage_kwargs\.k: .*\[1, num_samples=8\), got {k}.*0"
        ):
            validate(c, 1)


def test_mesh_resolution_and_errors():
    c = common.base()
    c.mesh.fsdp, c.mesh.tensor = 2, 2
    assert resolve_mesh_shape(c.mesh, 8) == {"data": 2, "fsdp": 2, "seq": 1, "tensor": 2}
    with pytest.raises(ConfigError, match=r"not divisible"):
        resolve_mesh_shape(c.mesh, 6)
    c.mesh.data = 3
    with pytest.raises(ConfigError, match=r"data\*fsdp\*seq\*tensor = 12"):
        resolve_mesh_shape(c.mesh, 8)


def test_batch_must_split_over_data_parallel_devices():
    c = common.tiny(common.base())
    c.rollout.prompts_per_step, c.rollout.num_samples = 1, 2  # 2 sequences on 4 devices
    with pytest.raises(ConfigError, match=r"data-parallel size 4"):
        validate(c, 4)


def test_objective_hyperparameters_are_checked():
    c = common.objective("a_grae")
    c.advantage_kwargs.alpha = 0.5  # a known one: fine
    assert (
        dict(common.to_objective_config(c, rollout_temperature=1.0).advantage_kwargs)["alpha"]
        == 0.5
    )
    c.advantage_kwargs.unlock()
    c.advantage_kwargs.alpah = 0.5
    with pytest.raises(ValueError, match=r"advantage_kwargs: \['alpah'\].*valid: .*'alpha'"):
        common.to_objective_config(c, rollout_temperature=1.0)
    with pytest.raises(ValueError, match=r"unknown objective field"):
        common.objective("grpo", eps=0.1)


def test_config_arg_is_checked():
    from configs import grpo

    with pytest.raises(ValueError, match=r"unknown config argument 'small'"):
        grpo.get_config("small")


# --------------------------------------------------------------------------- field table

PER_ESTIMATOR = ("objective.advantage_kwargs", "objective.token_weights_kwargs")


def _leaves():
    base = common.base()
    for path, value in walk(base):
        if path.startswith(PER_ESTIMATOR):
            continue
        holder, _, key = path.rpartition(".")
        parent = base
        for k in holder.split(".") if holder else ():
            parent = parent[k]
        yield path, value, parent.get_type(key)


def test_every_field_has_a_meaning_and_every_number_a_range():
    paths = {p for p, _, _ in _leaves()}
    assert sorted(paths - set(schema.FIELDS)) == [], "add these fields to gjax.schema.SCHEMA"
    assert sorted(set(schema.FIELDS) - paths - set(PER_ESTIMATOR)) == []
    for path, value, kind in _leaves():
        doc, valid = schema.FIELDS[path].doc, schema.FIELDS[path].valid
        assert doc.strip() and "\n" not in doc, path
        numeric = kind in (int, float) and not isinstance(value, bool)
        assert (valid is not None) == numeric, f"{path}: a number needs a Range, else None"
        if value is not None:  # every default lies in its range
            assert valid is None or value in valid, (path, value, str(valid))


def _bad_values(valid: Range):
    """Values just outside `valid` (and non-finite ones): each must be rejected."""
    lo_closed, lo, hi, hi_closed = valid._bounds()
    out = [math.nan]
    if math.isfinite(lo):
        out.append(lo if not lo_closed else lo - 1)
    if math.isfinite(hi):
        out.append(hi if not hi_closed else hi + 1)
    else:
        out.append(math.inf)
    return [v for v in out if v not in valid.also]


def _set(c, path, value):
    holder, _, key = path.rpartition(".")
    parent = c
    for k in holder.split(".") if holder else ():
        parent = parent[k]
    if parent.get_type(key) is int and isinstance(value, float):
        # ints cannot be nan/inf: far out instead
        value = int(value) if math.isfinite(value) else 2**62 if value > 0 else -(2**62)
    parent[key] = value
    return value


@pytest.mark.parametrize("path", [p for p, f in schema.FIELDS.items() if f.valid is not None])
def test_every_numeric_field_is_range_checked(path):
    valid = schema.FIELDS[path].valid
    for bad in _bad_values(valid):
        c = common.tiny(common.base())
        bad = _set(c, path, bad)
        if bad in valid:
            continue  # e.g. an int field's far-out stand-in for inf is still in [1, inf)
        with pytest.raises(ConfigError, match=rf"config\.{re.escape(path)}=.* out of range"):
            validate(c, 1)


@pytest.mark.parametrize(
    "path, value, match",
    [  # the cases (13.7): each passed validation before
        ("optim.clip_norm", -1.0, r"optim\.clip_norm=-1\.0 is out of range: it must be > 0"),
        ("checkpoint.keep", 0, r"checkpoint\.keep=0 .* >= 1"),
        ("log.eval_every", -1, r"log\.eval_every=-1 .* >= 0"),
        ("optim.warmup_steps", -3, r"optim\.warmup_steps=-3"),
        ("optim.b2", 1.5, r"optim\.b2=1\.5 .* in \[0, 1\)"),
        ("optim.b1", 1.0, r"optim\.b1=1\.0"),
        ("optim.lr", 1e39, r"optim\.lr=1e\+39 .* in \(0, 1\]"),
        ("optim.lr", math.inf, r"optim\.lr=inf"),
        ("data.heldout_size", 0, r"data\.heldout_size=0"),
        ("reward.timeout_s", 0.0, r"reward\.timeout_s=0\.0"),
        ("reward.workers", 0, r"reward\.workers=0"),
        ("mesh.data", 0, r"mesh\.data=0 .* >= 1 or -1"),
    ],
)
def test_harmful_values_are_rejected(path, value, match):
    c = common.tiny(common.base())
    _set(c, path, value)
    with pytest.raises(ConfigError, match=match):
        validate(c, 1)


@pytest.mark.parametrize(
    "path, value, match",
    [  # names checked in validate, before the model and the data load (13.6)
        ("reward.functions", "accuracy,formt", r"reward function 'formt'.*'format'"),
        ("reward.functions", "accuracy:heavy", r"weight of 'accuracy'"),
        ("reward.functions", "accuracy,overlong", r"retired.*config\.sampling\.overlong_buffer"),
        ("data.template", "qwen", r"data\.template: unknown template 'qwen'.*qwen_boxed"),
        ("rollout.backend", "vllm", r"rollout\.backend: must be one of \('local',"),
        ("rollout.weight_transfer", "nfs", r"rollout\.weight_transfer: must be one of \('dir"),
        ("rollout.decoder", "paged", r"rollout\.decoder: must be one of \('static',"),
        ("rollout.weight_change", "drop", r"rollout\.weight_change: must be one of \('finish'"),
        ("model.remat", "some", r"model\.remat"),
        ("model.dtype", "fp8", r"model\.dtype"),
        ("objective.advantage", "grpoo", r"config\.objective: unknown advantage estimator 'grpoo'"),
        ("objective.kl_estimator", "k4", r"config\.objective: .*'k4'"),
        ("data.source", "./no/such/file.jsonl", r"data\.source: no file or directory matches"),
        ("data.synthetic.min_ops", 5, r"data\.synthetic: need 1 <= min_ops <= max_ops"),
        ("data.heldout_split", "train", r"held-out set would be training rows"),
        ("data.answer_field", "boxd(solution)", r"data\.answer_field: .*unknown extractor"),
        ("data.problem_field", "prompt[x]", r"data\.problem_field: .*cannot read"),
        ("data.heldout_source", "aime24=./no/such.jsonl", r"data\.heldout_source: no file"),
    ],
)
def test_names_are_checked_before_anything_loads(path, value, match):
    c = common.tiny(common.base())
    _set(c, path, value)
    with pytest.raises(ConfigError, match=match):
        validate(c, 1)


def test_unknown_field_names_the_deepest_section_and_close_matches():
    from gjax.schema import unknown_field

    known = dict(walk(common.base()))
    msg = str(unknown_field("train.stepz", known))
    assert (
        "'config.train.steps'" in msg
        and "config.train are: allow_config_change, allow_nonfinite" in msg
    )
    msg = str(unknown_field("trian.steps", known))
    assert "Did you mean 'config.train'" in msg and "The fields of config are: algo" in msg


def test_range_parses_and_prints():
    assert str(Range("[1, inf)")) == ">= 1" and str(Range("(0, 1]")) == "in (0, 1]"
    assert str(Range("[1, inf)", also=(-1,))) == ">= 1 or -1"
    r = Range("[0, 1)")
    assert 0 in r and 0.5 in r and 1 not in r and math.nan not in r and True not in r
    with pytest.raises(ValueError, match="bad interval"):
        Range("0..1")


def test_model_path_and_lengths_are_checked_before_any_weight_loads(tmp_path):
    from gjax.config import check_model
    from gjax.embedded import resolve_model_path

    c = common.tiny(common.base())
    c.model.path = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"config\.model\.path='.*nope': .*does not exist"):
        check_model(c, c.model.path)
    c = common.tiny(common.base())
    try:
        local = resolve_model_path(c.model.path)
    except ConfigError:
        pytest.skip("embedded policy not built")
    assert check_model(c, local) == local
    c.rollout.max_new_tokens = 10**6
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens.*max_position_embeddings"):
        check_model(c, local)


@pytest.mark.parametrize(
    "old, new",
    [
        ("reward.judge_model", "reward.judge.model"),
        ("reward.judge_api_key_env", "reward.judge.api_key_env"),
        ("rollout.eval_temperature", "eval.greedy_temperature"),
    ],
)
def test_a_renamed_field_is_refused_with_its_new_name(old, new):
    c = common.tiny(common.base())
    section, key = old.split(".")
    c[section][key] = 0.0 if "temperature" in key else "x"
    with pytest.raises(ConfigError, match=rf"config\.{re.escape(old)} was renamed: .*{new}"):
        validate(c, 1)
    # The old flat `reward.judge`, now the judge's section: a str where a section is.
    c = ml_collections.ConfigDict({"reward": {"judge": "openai"}})
    with pytest.raises(ConfigError, match=r"config\.reward\.judge was renamed.*judge\.name"):
        check_schema(c, common.base())


def test_schema_declares_each_field_once_and_base_is_built_from_it():
    base = common.base()
    for path, field in schema.FIELDS.items():
        if field.default is schema.PRESET:
            continue  # the objective's defaults come from ObjectiveConfig's presets
        holder, _, key = path.rpartition(".")
        parent = base
        for k in holder.split(".") if holder else ():
            parent = parent[k]
        assert parent[key] == field.default, path
    # The objective's section lists exactly ObjectiveConfig's fields.
    import dataclasses

    from gjax.objective import ObjectiveConfig

    assert set(schema.SCHEMA["objective"]) == {f.name for f in dataclasses.fields(ObjectiveConfig)}
    # config.data has the library's keys (gjax.data.builders.DATA_DEFAULTS): one set of names.
    from gjax.data.builders import DATA_DEFAULTS

    assert set(schema.SCHEMA["data"]) == set(DATA_DEFAULTS)
    # A renamed field's new name exists, and its old one is gone.
    for old, new in schema.RENAMED.items():
        assert new in schema.FIELDS and old not in schema.FIELDS, old


# --------------------------------------------------------------------------- paper datasets

DATA = pathlib.Path(__file__).parent / "data"
# Each paper config's training set (a Hub id that exists today) and held-out benchmark, with
# a fixture in tests/data/ shaped like the real rows, and the answers its field map must read.
PAPER_DATA = {
    "a_grae": ("DigitalLearningGmbH/MATH-lighteval", "math_lighteval_train.jsonl", "math500"),
    "grpo": ("DigitalLearningGmbH/MATH-lighteval", "math_lighteval_train.jsonl", "math500"),
    "dagrpo": ("Elliott/Openr1-Math-46k-8192", "openr1_math_46k_8192_train.jsonl", "math500"),
    "dr_grpo": ("Elliott/Openr1-Math-46k-8192", "openr1_math_46k_8192_train.jsonl", "math500"),
    "dapo": (
        "open-r1/DAPO-Math-17k-Processed",
        "dapo_math_17k_processed_all_train.jsonl",
        "aime24",
    ),
    "gpg": (
        "open-r1/DAPO-Math-17k-Processed",
        "dapo_math_17k_processed_all_train.jsonl",
        "math500",
    ),
    "cw_grpo": ("knoveleng/open-rs", "open_rs_train.jsonl", "math500"),
}
ANSWERS = {
    "math_lighteval_train.jsonl": ["17", "8", "\\frac{3}{4}", "6"],  # the last \\boxed{}
    "openr1_math_46k_8192_train.jsonl": ["60", "81", "12"],
    "dapo_math_17k_processed_all_train.jsonl": ["55", "12", "1024"],
    "open_rs_train.jsonl": ["80", "8", "720"],
}
BENCHMARK_COPIES = {
    "math500": ("math500_test.jsonl", ["23", "7", "4"]),
    "aime24": ("aime_2024_train.jsonl", ["050", "208"]),
}


@pytest.fixture(scope="module")
def tok():
    from gjax.data.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.mark.parametrize("algo", sorted(PAPER_DATA))
def test_paper_config_reads_its_dataset_and_a_heldout_set_of_its_own(algo, tok):
    """The config's own data settings, pointed at a fixture shaped like its real rows."""
    from gjax.data.builders import build_prompt_data

    hub_id, fixture, bench = PAPER_DATA[algo]
    c = importlib.import_module(f"configs.{algo}").get_config()
    assert (c.data.source, c.data.heldout_source) == (hub_id, bench)
    validate(c, num_devices=8)  # the held-out set is not training rows: accepted
    copy, held_answers = BENCHMARK_COPIES[bench]
    c.data.source, c.data.subset = str(DATA / fixture), None
    c.data.heldout_source = f"{bench}={DATA / copy}"
    c.data.max_prompt_len = 4096  # the test tokenizer has a token per character
    validate(c, num_devices=8)
    train = build_prompt_data(c.data, tok)
    assert train.answers == ANSWERS[fixture] and train.stats["kept"] == len(ANSWERS[fixture])
    assert all(p.strip() and not p.startswith("Your task") for p in train.problems)
    if algo == "dagrpo":  # the R1 solution turn is the anchor
        assert all(d.startswith("<think>") for d in train.demonstrations)
    held = build_prompt_data(c.data, tok, heldout=True)
    assert held.answers == held_answers
    assert held.origin["benchmark"] == bench and held.origin["source"] == str(DATA / copy)
    assert held.origin["rows"] == list(range(len(held_answers)))
    assert held.origin["training_rows_removed_as_duplicates"] == 0
    assert not held.origin["overlap_allowed"] and held.origin["same_rows"] is None


def test_original_dapo_rows_read_through_nested_field_specs(tok):
    from gjax.data.builders import build_prompt_data

    cfg = {
        "source": str(DATA / "dapo_math_17k_train.jsonl"),
        "problem_field": "prompt[0].content",
        "answer_field": "reward_model.ground_truth",
        "heldout_source": f"aime24={DATA / 'aime_2024_train.jsonl'}",
        "max_prompt_len": 2048,
    }
    data = build_prompt_data(cfg, tok)
    assert data.answers == ["55", "12", "1024", "55"]  # the original repeats its rows
    assert data.problems[0].startswith("Solve the following math problem step by step.")


def test_heldout_overlap_is_refused_in_one_paragraph_unless_allowed():
    for algo in ("dagrpo", "dapo", "cw_grpo"):  # formerly heldout_split="train"
        c = importlib.import_module(f"configs.{algo}").get_config()
        c.data.heldout_source = ""
        c.data.heldout_split = "train"
        with pytest.raises(ConfigError, match="held-out set would be training rows") as e:
            validate(c, 8)
        assert "\n" not in str(e.value) and "allow_heldout_overlap" in str(e.value)
        c.data.allow_heldout_overlap = True
        validate(c, 8)
    c = common.base()
    c.data.source = str(DATA / "math_lighteval_train.jsonl")  # a file has no splits
    c.data.heldout_source = ""
    with pytest.raises(ConfigError, match="no splits"):
        validate(c, 8)
    c.data.heldout_fraction = 0.25  # a seeded sample of its own
    validate(c, 8)
    c.data.heldout_source = "math500"
    with pytest.raises(ConfigError, match="set only one of them"):
        validate(c, 8)


@pytest.mark.parametrize("algo", ALGOS)
def test_the_loss_scores_at_the_rollout_temperature_from_one_flag(algo):
    """objective.temperature is unset by default and follows rollout.temperature: one flag
    changes both; the configs' own temperatures reach the loss unchanged (and the checkpoint
    fingerprint holds the resolved value, as before the field followed)."""
    from gjax.train import fingerprint

    for arg, want in ((None, 0.7 if algo == "cw_grpo" else 1.0), ("tiny", 0.7)):
        c = importlib.import_module(f"configs.{algo}").get_config(arg)
        assert c.objective.temperature is None and c.rollout.temperature == want
        obj = common.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
        assert obj.temperature == want
        assert json.loads(fingerprint(c)["objective"])["temperature"] == want
    c.rollout.temperature = 0.5  # the one flag
    validate(c, 1)
    assert common.to_objective_config(c.objective, rollout_temperature=0.5).temperature == 0.5
    assert json.loads(fingerprint(c)["objective"])["temperature"] == 0.5
    c.objective.temperature = 0.5  # set explicitly to the same: fine
    validate(c, 1)
    c.objective.temperature = 0.9  # explicitly different: refused, naming both
    with pytest.raises(ConfigError, match=r"objective\.temperature.*0\.9.*rollout\.temperature"):
        validate(c, 1)


def test_continuous_decoder_is_the_local_backends_only():
    c = common.tiny(common.base())
    c.rollout.backend, c.rollout.decoder = "jetstream", "continuous"
    with pytest.raises(ConfigError, match=r"rollout\.decoder: 'continuous' is the local backend"):
        validate(c, 1)
    c.rollout.decoder = "auto"  # the default: a serving backend batches on its own
    validate(c, 1)


# ------------------------------------------------------------------ answer format and reward


def _answer_in_the_asked_format(prompt: str, answer: str) -> str:
    """A correct response written exactly as `prompt` asks: DAPO's "Answer: ..." last line,
    \\boxed{} inside <answer> tags (Open-RS), or \\boxed{} alone. A prompt asking for two
    formats that exclude each other fails here."""
    asks_line = "Answer: $Answer" in prompt
    asks_boxed = "\\boxed{}" in prompt
    asks_tags = "<answer> answer here </answer>" in prompt
    assert asks_line or asks_boxed or asks_tags, f"the prompt asks for no answer format: {prompt!r}"
    assert not (asks_line and (asks_boxed or asks_tags)), (
        f"the prompt asks both for DAPO's 'Answer:' line and for \\boxed{{}}/<answer>: {prompt!r}"
    )
    if asks_line:
        return f"Working through it step by step, the result is {answer}.\nAnswer: {answer}"
    if asks_tags:
        boxed = f"\\boxed{{{answer}}}" if asks_boxed else answer
        return f"<think> reasoning process here </think> <answer> {boxed} </answer>"
    return f"Working through it step by step, the final answer is $\\boxed{{{answer}}}$."


@pytest.fixture(scope="module")
def chat_tok():
    """A tokenizer with a chat template (the embedded policy's, ChatML), for `open_rs`."""
    from gjax.embedded import resolve_model_path
    from gjax.models import hf_import

    return hf_import.load_tokenizer(resolve_model_path(common.EMBEDDED_POLICY))


@pytest.fixture(scope="module")
def verifiers():
    """The run's verifier per extractor list (`build_verifier`), started once per list."""
    from gjax.rewards.pipeline import build_verifier

    made = {}

    def get(config):
        key = config.reward.extractors
        if key not in made:
            config = ml_collections.ConfigDict(config.to_dict())
            config.reward.workers = 1
            made[key] = build_verifier(config).__enter__()
        return made[key]

    yield get
    for v in made.values():
        v.close()


@pytest.mark.parametrize("algo", ALGOS)
def test_an_answer_in_the_format_the_prompt_asks_for_scores_one(algo, chat_tok, verifiers):
    """Each paper config's final prompt (its template on its dataset's rows and on its
    held-out benchmark's), answered correctly in exactly the format that prompt asks for,
    scores 1 through the run's reward path (`build_verifier`, `build_rewards`)."""
    from gjax.data.builders import build_prompt_data
    from gjax.rewards.pipeline import build_rewards

    also = {"pass_at_k": PAPER_DATA["grpo"], "cispo": PAPER_DATA["dapo"]}  # the same setups
    _, fixture, bench = {**PAPER_DATA, **also}[algo]
    c = importlib.import_module(f"configs.{algo}").get_config()
    c.data.max_prompt_len = 4096  # the embedded tokenizer has a token per character
    c.data.source, c.data.subset = str(DATA / fixture), None
    c.data.heldout_source = f"{bench}={DATA / BENCHMARK_COPIES[bench][0]}"
    c.reward.judge.name = "none"  # DaGRPO's judge scores against the demonstration, not here
    validate(c, num_devices=8)
    train = build_prompt_data(c.data, chat_tok)
    held = build_prompt_data(c.data, chat_tok, heldout=True)
    prompts = train.prompts + held.prompts
    answers = train.answers + held.answers
    completions = [_answer_in_the_asked_format(p, a) for p, a in zip(prompts, answers)]
    with build_rewards(c, verifiers(c)) as rewards:
        result = rewards.submit(prompts, completions, answers).result(timeout=60)
    assert result.valid.all()
    assert c.reward.functions == "accuracy"
    np.testing.assert_array_equal(result.rewards, np.ones(len(prompts)))
    # A bare \boxed{} answer to DAPO's "Answer:" prompt is not what it asked for: DAPO's
    # reward scores it 0, and so does this config's.
    if "Answer: $Answer" in prompts[0]:
        boxed = [f"so it is $\\boxed{{{a}}}$." for a in answers]
        with build_rewards(c, verifiers(c)) as rewards:
            result = rewards.submit(prompts, boxed, answers).result(timeout=60)
        np.testing.assert_array_equal(result.rewards, np.zeros(len(prompts)))


def test_cw_grpo_prompts_go_through_the_chat_models_template(chat_tok):
    """CW-GRPO trains a chat model (DeepSeek-R1-Distill) on Open-RS's prompt, which Open-RS
    applies through the tokenizer's chat template (CW-GRPO App. B): its system turn, then the
    problem as the user turn; not the raw R1-Zero text completion."""
    from configs import cw_grpo
    from gjax.data.templates import OPEN_RS_SYSTEM, apply_template

    c = cw_grpo.get_config()
    prompt = apply_template(c.data.template, "What is $9 \\cdot 9 - 1$?", chat_tok)
    turns = [
        {"role": "system", "content": OPEN_RS_SYSTEM},
        {"role": "user", "content": "What is $9 \\cdot 9 - 1$?"},
    ]
    assert prompt == chat_tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


# --------------------------------------------------------------------- the README's own data


def test_readme_own_data_example_validates_and_reads_its_example_row(tmp_path, chat_tok):
    """The README's own-data command, as written, on the README's example JSONL row: the
    config validates (the first stage of `gjax.train`) and the row's answer is read."""
    import shlex

    from gjax.data.builders import build_prompt_data

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("Your own problems as a JSONL file") :]
    row = re.search(r"```json\n(.*?)\n```", section, re.DOTALL).group(1)
    cmd = re.search(r"```bash\n(.*?)\n```", section, re.DOTALL).group(1)
    argv = shlex.split(cmd.replace("\\\n", " "))
    assert argv[:4] == ["python", "-m", "gjax.train", "--config=configs/grpo.py"], argv
    more = [
        {"problem": f"What is ${i} + 1$?", "solution": f"$\\boxed{{{i + 1}}}$"} for i in range(39)
    ]
    (tmp_path / "mine.jsonl").write_text("\n".join([row, *map(json.dumps, more)]) + "\n")
    from configs import grpo

    c = grpo.get_config()
    for arg in argv[4:]:
        key, _, value = arg.removeprefix("--").partition("=")
        if key == "workdir":
            continue
        path = key.removeprefix("config.")
        old = c
        for k in path.split("."):
            old = old[k]
        value = str(tmp_path / value) if path == "data.source" else value
        _set(c, path, type(old)(value))
    assert c.model.path == "Qwen/Qwen2.5-Math-7B"  # the README says it trains the 7B model
    validate(c, num_devices=64)
    c.data.max_prompt_len = 4096  # the test tokenizer has a token per character
    train = build_prompt_data(c.data, chat_tok)
    held = build_prompt_data(c.data, chat_tok, heldout=True)
    assert len(held) == 2 and len(train) == 38  # 5% of 40 rows held out, removed from training
    answers = dict(zip(train.problems + held.problems, train.answers + held.answers))
    assert answers[json.loads(row)["problem"]] == "17"
