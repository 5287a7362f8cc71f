"""The tools' descriptions in a tool environment's prompts (env.tool_prompt): the chat
template's own `tools=` rendering where it has one, gjax's `# Tools` system block where it
has not, nothing for single-turn runs and the `math` environment, the spec <-> parser
round trip, and the config and prompt-length errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from gjax import schema
from gjax.data import builders, templates
from gjax.data.prompts import prepare_prompts, prepare_sharded_prompts
from gjax.data.tokenizer import build_tokenizer
from gjax.envs import TOOLS, ToolCall, build_tool, parse_tool_calls, prompt_tools
from gjax.envs.environments import check_config
from gjax.envs.tools import ToolError
from gjax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.path.join(ROOT, "tests", "data", "tiny_qwen3")

# The system part of Qwen2.5's / Qwen3's chat template when `tools` is given (the fixture's
# own template is plain ChatML, without it): written here in the form those templates use.
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [{"title": "Paris", "text": "Paris is the capital of France."}]


def _cfg(tmp_path, **env):
    cfg = schema.base()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(p) for p in CORPUS))
    cfg.env.search_corpus = str(corpus)
    for k, v in env.items():
        cfg.env[k] = v
    return cfg


def _qwen3_tools_tokenizer():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(QWEN3)
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    return tok


def test_every_tool_spec_round_trips_through_the_parser(tmp_path):
    cfg = _cfg(tmp_path, name="tool", tools="calculator,python,search")
    samples = {"expression": "2+3", "code": "print(2+3)", "query": "capital of France"}
    for name in TOOLS.names():
        tool = build_tool(name, cfg.env)
        try:
            spec = tool.schema()
            fn = spec["function"]
            assert spec["type"] == "function" and fn["name"] == name == tool.name
            params = fn["parameters"]
            assert params["type"] == "object" and set(params["required"]) <= set(
                params["properties"]
            )
            arguments = {p: samples[p] for p in params["properties"]}
            # The call as the prompt's instruction asks for it.
            text = f"<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': arguments})}\n"
            text += "</tool_call>"
            (call,) = parse_tool_calls(text)
            assert call == ToolCall(name, arguments)
            try:  # the tool takes the arguments its spec declares
                out = tool(call.arguments)
            except ToolError as e:
                pytest.fail(f"{name}: {e.kind}: {e}")
            assert out and "error" not in out
        finally:
            tool.close()


def test_qwen3_tokenizer_renders_the_tools_itself(tmp_path):
    tok = _qwen3_tools_tokenizer()
    assert templates.template_accepts_tools(tok)
    specs = prompt_tools(_cfg(tmp_path, name="tool", tools="calculator,search").env)
    prompt = templates.render_prompt("chat", "What is 2+3?", tok, specs)
    want = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        tools=specs,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == want
    sigs = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    assert f"<tools>\n{sigs}\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    # gjax's own block is the text the template renders (the fallback is equivalent).
    assert prompt.startswith(f"<|im_start|>system\n{templates.tools_system_block(specs)}<|im_end|>")
    # open_rs: its system text first, then the tools, in one system turn.
    rs = templates.render_prompt("open_rs", "Q", tok, specs)
    assert rs.startswith(f"<|im_start|>system\n{templates.OPEN_RS_SYSTEM}\n\n# Tools\n")


def test_embedded_tokenizer_gets_the_gjax_system_block(tmp_path):
    tok = build_tokenizer()
    assert not templates.template_accepts_tools(tok)
    specs = prompt_tools(_cfg(tmp_path, name="tool", tools="calculator").env)
    block = templates.tools_system_block(specs)
    assert block.startswith("# Tools\n") and json.dumps(specs[0]) in block
    chat = templates.render_prompt("chat", "1+2", tok, specs)
    assert chat == (
        f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\n1+2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # A text template: a system turn before it, or the block inside its own system turn.
    assert templates.render_prompt("plain", "1+2", tok, specs) == (
        f"<|im_start|>system\n{block}<|im_end|>\n1+2\n"
    )
    boxed = templates.render_prompt("qwen_boxed", "1+2", tok, specs)
    assert boxed == templates.qwen_boxed("1+2").replace(
        f"{templates.BOXED_INSTRUCTION}<|im_end|>",
        f"{templates.BOXED_INSTRUCTION}\n\n{block}<|im_end|>",
    )
    # Every character of the block is in the embedded vocabulary (no <|unk|>).
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids


def test_prompts_of_single_turn_math_and_none_are_unchanged(tmp_path):
    tok = build_tokenizer()
    rows = [{"problem": "1+2", "answer": "3"}, {"problem": "4*5", "answer": "20"}]
    for env in ({"name": ""}, {"name": "math"}, {"name": "tool", "tool_prompt": "none"}):
        assert prompt_tools(_cfg(tmp_path, **env).env) == []
    for template in ("plain", "chat", "qwen_boxed"):
        base = prepare_prompts(rows, tok, template=template, max_prompt_length=256)
        assert base.prompts == [templates.apply_template(template, r["problem"], tok) for r in rows]
        same = prepare_prompts(rows, tok, template=template, max_prompt_length=256, tools=())
        assert same.prompts == base.prompts
    specs = prompt_tools(_cfg(tmp_path, name="tool").env)
    data = prepare_prompts(rows, tok, template="chat", max_prompt_length=1024, tools=specs)
    assert all(p.startswith("<|im_start|>system\n# Tools\n") for p in data.prompts)
    # Training's sharded prompts template a batch's rows again, with the same tools.
    sharded = prepare_sharded_prompts(
        rows,
        tok,
        template="chat",
        max_prompt_length=1024,
        tools=specs,
        process_index=0,
        process_count=1,
        allgather=lambda x: x[None],
    )
    batch = sharded.take(np.arange(2), epoch=0)
    assert batch.prompts == data.prompts


def test_tool_prompt_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"env.tool_prompt='always'.*auto, none"):
        check_config(_cfg(tmp_path, name="tool", tool_prompt="always"))
    with pytest.raises(ConfigError, match=r"env.tool_prompt="):
        prompt_tools(_cfg(tmp_path, name="", tool_prompt="").env)


def test_a_tool_block_longer_than_the_prompt_budget_is_refused(tmp_path):
    tok = build_tokenizer()
    specs = prompt_tools(_cfg(tmp_path, name="tool", tools="calculator").env)
    data = {"template": "chat", "max_prompt_len": 1024}
    cost = builders.check_tool_prompt(data, tok, specs)
    empty = len(tok(templates.chat("", tok))["input_ids"])
    full = len(tok(templates.render_prompt("chat", "", tok, specs))["input_ids"])
    assert cost == full - empty > 300  # the calculator's block, in characters of this tokenizer
    with pytest.raises(ConfigError) as e:
        builders.check_tool_prompt({"template": "chat", "max_prompt_len": full}, tok, specs)
    msg = str(e.value)
    assert f"takes {full} prompt tokens" in msg and "max_prompt_len" in msg
    assert "env.tools" in msg and "tool_prompt='none'" in msg and "\n" not in msg
    assert builders.check_tool_prompt(data, tok, []) == 0


def test_training_and_heldout_prompts_carry_the_same_block(tmp_path):
    """What train._load_data builds for a tool run: both sets' prompts are the template's with
    the tools' block, the held-out episodes' prompts rendered as the training ones."""
    import importlib

    c = importlib.import_module("configs.grpo").get_config("tiny")
    c.env.name, c.data.max_prompt_len, c.data.heldout_size = "tool", 1024, 8
    c.data.num_examples = 64
    tok = build_tokenizer()
    specs = prompt_tools(c.env)
    data = builders.run_data_config(c)
    train = builders.build_sharded_prompts(
        data, tok, tools=specs, process_index=0, process_count=1, allgather=lambda x: x[None]
    )
    assert train.stats["skipped_too_long"] == 0
    held = builders.build_prompt_data(data, tok, heldout=True, tools=specs)
    plain = builders.build_prompt_data(data, tok, heldout=True)
    block = f"<|im_start|>system\n{templates.tools_system_block(specs)}<|im_end|>\n"
    assert held.prompts == [block + p for p in plain.prompts]
    batch = train.take(np.arange(4), epoch=0)
    assert [p.removeprefix(block) for p in batch.prompts] == [f"{q}\n" for q in batch.problems]
    assert all(p.startswith(block) for p in batch.prompts)
