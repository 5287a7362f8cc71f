"""The tool-using variant of the embedded policy (scripts/make_tiny_tool_policy.py): its
tokenizer and chat template, the committed checkpoint, and the tool task's sizes."""

import importlib
import json
import os

import numpy as np
from transformers import AutoTokenizer

from configs.common import TOOL_TASK
from gjax.data import synthetic
from gjax.data.templates import render_prompt
from gjax.data.tokenizer import IM_END, TOOL_CHAT_TEMPLATE, TOOL_TOKENS, build_tokenizer
from gjax.embedded import resolve_model_path
from gjax.envs import prompt_tools, tool_calls
from gjax.models import hf_import

PATH = resolve_model_path("embedded:tiny_qwen2_tools")


def _config():
    return importlib.import_module("configs.grpo").get_config("tools")


def _episode_text(problem, expression=None) -> tuple[str, str]:
    """(the policy's call turn, the answer turn) of a two-turn calculator episode."""
    body = json.dumps(
        {"name": "calculator", "arguments": {"expression": expression or problem.expression}}
    )
    call = f"{tool_calls.OPEN}\n{body}\n{tool_calls.CLOSE}"
    return call, f"{synthetic.BOXED}{problem.answer}}}"


def test_tool_tokenizer_adds_the_four_tags_as_single_kept_tokens():
    plain, tok = build_tokenizer(), build_tokenizer(tools=True)
    assert len(plain) == 102 and len(tok) == 106
    assert tok.convert_tokens_to_ids(list(TOOL_TOKENS)) == [102, 103, 104, 105]
    text = '<tool_call>\n{"a": 1}\n</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 102 and ids[-1] == 103 and len(ids) == 2 + len(text) - 23
    # Not special: a decoded turn keeps them, so the environment can parse its calls.
    assert tok.decode(ids, skip_special_tokens=True) == text
    # The other ids are the embedded tokenizer's.
    sample = "Compute (3+4)*5.\n\\boxed{35}"
    assert tok(sample)["input_ids"] == plain(sample)["input_ids"]


def test_template_renders_an_episode_as_the_rollout_writes_its_tokens():
    """The chat template's rendering of a whole episode (prompt with tools, the assistant's
    tool call, the tool message, the answer) is the training prompt followed by exactly the
    trajectory the decoder samples and the environment inserts, token for token."""
    tok = build_tokenizer(tools=True)
    specs = prompt_tools(_config().env)
    for p in synthetic.generate(8, "test", seed=5, config=synthetic.SyntheticConfig(**TOOL_TASK)):
        call, answer = _episode_text(p)
        prompt = render_prompt("chat", p.problem, tok, tools=specs)
        assert prompt.startswith("<|im_start|>system\ntools: calculator(expression)<|im_end|>\n")
        trajectory = call + IM_END + tool_calls.tool_turn([p.answer]) + answer + IM_END
        messages = [
            {"role": "user", "content": p.problem},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "calculator",
                            "arguments": {"expression": p.expression},
                        },
                    }
                ],
            },
            {"role": "tool", "content": p.answer},
            {"role": "assistant", "content": answer},
        ]
        rendered = tok.apply_chat_template(messages, tools=specs, tokenize=False)
        assert rendered == prompt + trajectory + "\n"
        ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]
        assert ids(rendered) == ids(prompt) + ids(trajectory) + ids("\n")
        # Parsed back as the environment reads the policy's turn.
        (parsed,) = tool_calls.parse_tool_calls(call)
        assert parsed == tool_calls.ToolCall("calculator", {"expression": p.expression})
    # Without tools, and with a system message, the template is plain ChatML.
    assert render_prompt("chat", "Compute 1+2.", tok) == (
        "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n"
    )
    sys_first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = tok.apply_chat_template(sys_first, tools=specs, tokenize=False)
    assert out.startswith("<|im_start|>system\nBe brief.\ntools: calculator(expression)<|im_end|>")
    assert out.count("<|im_start|>system") == 1


def test_tool_task_fits_the_tools_config():
    """Every prompt of the tool task fits data.max_prompt_len and a two-turn calculator
    episode (the longest trajectory the warm-up teaches) fits rollout.max_new_tokens; both
    together fit the model's positions."""
    c = _config()
    tok = build_tokenizer(tools=True)
    specs = prompt_tools(c.env)
    task = synthetic.SyntheticConfig(**TOOL_TASK)
    problems = synthetic.generate(2000, "train", seed=1, config=task)
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    prompts = [n(render_prompt("chat", p.problem, tok, tools=specs)) for p in problems]
    trajectories = []
    for p in problems:
        call, answer = _episode_text(p)
        trajectories.append(n(call + IM_END + tool_calls.tool_turn([p.answer]) + answer + IM_END))
    worked = [n(p.demonstration + IM_END) for p in problems]
    assert max(prompts) <= c.data.max_prompt_len
    assert max(max(trajectories), max(worked)) <= c.rollout.max_new_tokens
    cfg = hf_import.load_config(PATH)
    assert c.data.max_prompt_len + c.rollout.max_new_tokens <= cfg.max_position_embeddings
    assert {p.num_ops for p in problems} == set(range(2, 7))
    assert np.mean([p.num_ops >= 4 for p in problems]) > 0.5


def test_checkpoint_carries_the_tool_tokenizer_and_template():
    size = sum(os.path.getsize(os.path.join(PATH, f)) for f in os.listdir(PATH))
    assert size < 8 * 2**20
    auto, built = AutoTokenizer.from_pretrained(PATH), build_tokenizer(tools=True)
    assert auto.chat_template == TOOL_CHAT_TEMPLATE
    p = synthetic.generate(1, "test", seed=3, config=synthetic.SyntheticConfig(**TOOL_TASK))[0]
    call, answer = _episode_text(p)
    text = render_prompt("chat", p.problem, built, tools=prompt_tools(_config().env)) + call
    assert auto(text)["input_ids"] == built(text)["input_ids"]
    cfg = hf_import.load_config(PATH)
    # A chat turn ends with <|im_end|>, listed first as in Qwen2.5-Instruct.
    assert tuple(cfg.eos_token_id) == (built.convert_tokens_to_ids(IM_END), built.eos_token_id)
    with open(os.path.join(PATH, "warmup.json")) as f:
        last = json.load(f)["log"][-1]
    assert {"call_fraction", "copied_fraction", "tools_accuracy", "no_tools_accuracy"} <= set(last)


def test_policy_leaves_room_for_rl_with_the_tool():
    """Sampled as the study's runs sample it (T = 0.7, episodes of the `tool` environment with
    the sandboxed calculator, through experiments/passk.py's episode path): the policy calls
    the calculator on a minority of episodes, and an episode that calls it is right far more
    often than one that does not -- the behaviour RL with tools can discover."""
    import jax

    from experiments import passk
    from gjax.data.builders import build_prompt_data, run_data_config
    from gjax.rewards.verifier import Verifier
    from gjax.rollout import SamplingParams

    c = _config()
    c.data.heldout_size = 64
    model_cfg, params = hf_import.load_pretrained(PATH)
    tok = hf_import.load_tokenizer(PATH)
    data = build_prompt_data(run_data_config(c), tok, heldout=True, tools=prompt_tools(c.env))
    sampling = SamplingParams(
        max_new_tokens=c.rollout.max_new_tokens,
        temperature=0.7,
        stop_token_ids=tuple(model_cfg.eos_token_id),
        pad_token_id=tok.pad_token_id,
    )
    with (
        Verifier(timeout_s=5.0, num_workers=1) as verifier,
        passk._samplers(c, verifier, tok) as (make_backend, score),
    ):
        s = score(
            make_backend(model_cfg), params, data=data, num_samples=4, sampling=sampling,
            rng=jax.random.key(0),
        )  # fmt: skip
    called = s.tool_calls_PxN > 0
    assert 0.05 < called.mean() < 0.6, called.mean()
    right = s.correct_PxN.astype(bool)
    assert right[called].mean() > right[~called].mean() + 0.3
