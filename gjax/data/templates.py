"""Prompt templates, registered by name: ``problem text -> prompt text``.

=============  ==============================================================================
name           prompt
=============  ==============================================================================
``qwen_boxed`` Qwen2.5-Math CoT (A-GRAE App. C; GPG App. "System Prompt for Qwen 7B"): ChatML
               with the system line "Please reason step by step, and put your final answer
               within \\boxed{}." then the problem as the user turn.
``dapo``       DAPO's prompt (DAPO-Math-17k's rows): ChatML, one user turn, the problem inside
               DAPO's instruction "... The last line of your response should be of the form
               Answer: $Answer ..." (a problem that carries it, as DAPO-Math-17k's do, is kept
               as it is; another, e.g. a held-out benchmark's, is wrapped in it). No system
               turn: Qwen's default one asks for \\boxed{}. Read by the ``answer_line``
               extractor, as DAPO's reward reads it.
``open_rs``    Open-RS's prompt (CW-GRPO App. B): the tokenizer's own chat template with the
               R1 think/answer system prompt that also asks for the answer in \\boxed{}
               (``OPEN_RS_SYSTEM``), then the problem as the user turn.
``r1``         The DeepSeek-R1-Zero think/answer template (GPG App., "System Prompt for
               Reasoning"): reasoning in ``<think> </think>``, answer in ``<answer> </answer>``;
               the prompt ends with ``Assistant: <think>``.
``chat``       The tokenizer's own chat template, one user turn, generation prompt added.
``plain``      ``"{problem}\\n"``: the compact prompt of the embedded synthetic task.
=============  ==============================================================================

Each template is ``fn(problem: str, tokenizer) -> str``; only ``chat`` and ``open_rs`` use the
tokenizer. Add your own with ``@TEMPLATES.register("name")``.

``CHAT_TEMPLATES[name]`` is the same template as a Hugging Face chat template (Jinja), which
``gjax.export`` writes with the checkpoint: ``tokenizer.apply_chat_template([{"role": "user",
"content": problem}], tokenize=False, add_generation_prompt=True)`` then gives exactly the
training prompt. ``chat`` and ``open_rs`` have none (the tokenizer's own template is kept);
give your own template one to have its exports match.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from gjax.registry import Registry

TEMPLATES: Registry = Registry("prompt template")

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

R1_SYSTEM = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
    "process here </think> <answer> answer here </answer>."
)

# DAPO-Math-17k's prompt around each problem (DAPO's instruction; its reward reads "Answer:").
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'

# Open-RS's system prompt, the one CW-GRPO trains with (App. B, Fig. 4).
OPEN_RS_SYSTEM = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer, and put your final answer within \\boxed{} . The "
    "reasoning process and answer are enclosed within <think> </think> and <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here "
    "</answer>. Note that respond by English, NOT use other languages."
)


@TEMPLATES.register("qwen_boxed")
def qwen_boxed(problem: str, tokenizer=None) -> str:
    del tokenizer
    return (
        f"<|im_start|>system\n{BOXED_INSTRUCTION}<|im_end|>\n"
        f"<|im_start|>user\n{problem}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def dapo_instruction(problem: str) -> str:
    """`problem` inside DAPO's instruction, unless it carries it already."""
    if DAPO_PREFIX in problem:
        return problem
    return f"{DAPO_PREFIX}\n\n{problem}\n\n{DAPO_SUFFIX}"


@TEMPLATES.register("dapo")
def dapo(problem: str, tokenizer=None) -> str:
    del tokenizer
    return f"<|im_start|>user\n{dapo_instruction(problem)}<|im_end|>\n<|im_start|>assistant\n"


@TEMPLATES.register("r1")
def r1(problem: str, tokenizer=None) -> str:
    del tokenizer
    return f"{R1_SYSTEM} User: {problem} Assistant: <think>"


def _apply_chat_template(name: str, tokenizer, messages: list[dict[str, str]]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"template {name!r} needs a tokenizer with a chat_template; pick another template "
            f"(valid: {', '.join(TEMPLATES.names())}) or use a chat tokenizer"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _chat_messages(problem: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": problem}]


def _open_rs_messages(problem: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": OPEN_RS_SYSTEM},
        {"role": "user", "content": problem},
    ]


# The templates that render through the tokenizer's own chat template: name -> messages.
CHAT_MESSAGE_TEMPLATES = {"chat": _chat_messages, "open_rs": _open_rs_messages}


@TEMPLATES.register("chat")
def chat(problem: str, tokenizer=None) -> str:
    return _apply_chat_template("chat", tokenizer, _chat_messages(problem))


@TEMPLATES.register("open_rs")
def open_rs(problem: str, tokenizer=None) -> str:
    return _apply_chat_template("open_rs", tokenizer, _open_rs_messages(problem))


@TEMPLATES.register("plain")
def plain(problem: str, tokenizer=None) -> str:
    del tokenizer
    return f"{problem}\n"


def apply_template(name: str, problem: str, tokenizer=None) -> str:
    """``TEMPLATES.get(name)(problem, tokenizer)``; unknown names list the valid ones."""
    return TEMPLATES.get(name)(problem, tokenizer)


# --------------------------------------------------------------------------- tools


def tools_system_block(specs: Sequence[Mapping[str, Any]]) -> str:
    """The `# Tools` part Qwen2.5's and Qwen3's templates append to the system message when
    tools are given: the function signatures inside `<tools></tools>`, one JSON per line (as
    the templates' `tojson` writes them), and how to call them."""
    sigs = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in specs)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{sigs}\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_accepts_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable (Qwen2.5's and Qwen3's
    do: they render the `# Tools` block themselves); False without a chat template."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str) or not source:
        return False
    return _reads_tools(source)


@functools.lru_cache(maxsize=16)
def _reads_tools(source: str) -> bool:
    """`template_accepts_tools` of one template source (parsed once: a data set renders every
    prompt through it, and parsing costs ~9 ms, 180x the rendering)."""
    import jinja2  # noqa: PLC0415 (transformers' dependency; only a tool prompt needs it)
    from jinja2 import meta  # noqa: PLC0415

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:
        return "tools" in source  # transformers' own extensions (generation tags): by name


def _with_system(messages: list[dict[str, str]], block: str) -> list[dict[str, str]]:
    """`block` at the end of the system message (as Qwen's templates place `# Tools`), or as
    the system message where there is none."""
    if messages and messages[0]["role"] == "system":
        head = {"role": "system", "content": messages[0]["content"] + "\n\n" + block}
        return [head, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


_SYSTEM_OPEN, _TURN_END = "<|im_start|>system\n", "<|im_end|>\n"


def render_prompt(
    name: str, problem: str, tokenizer=None, tools: Sequence[Mapping[str, Any]] = ()
) -> str:
    """The template `name`'s prompt for `problem`, telling the policy about `tools` (JSON-schema
    function specs; none: exactly `apply_template`).

    * `chat` / `open_rs` with a chat template that reads `tools` (Qwen2.5, Qwen3): the
      tokenizer renders them, ``apply_chat_template(messages, tools=specs)``;
    * `chat` / `open_rs` with a template that does not (the embedded ChatML one): the system
      message carries `tools_system_block(specs)` (after the template's own system text);
    * a text template (`plain`, `qwen_boxed`, `dapo`, `r1`, your own): the same block goes at
      the end of the prompt's leading ChatML system turn, or before the prompt as a ChatML
      system turn ``<|im_start|>system\n{block}<|im_end|>\n`` where it has none.
    """
    if not tools:
        return apply_template(name, problem, tokenizer)
    specs = [dict(s) for s in tools]
    if name in CHAT_MESSAGE_TEMPLATES:
        messages = CHAT_MESSAGE_TEMPLATES[name](problem)
        if template_accepts_tools(tokenizer):
            return tokenizer.apply_chat_template(
                messages, tools=specs, tokenize=False, add_generation_prompt=True
            )
        return _apply_chat_template(
            name, tokenizer, _with_system(messages, tools_system_block(specs))
        )
    text = apply_template(name, problem, tokenizer)
    block = tools_system_block(specs)
    if text.startswith(_SYSTEM_OPEN) and _TURN_END in text:
        end = text.index(_TURN_END)
        return f"{text[:end]}\n\n{block}{text[end:]}"
    return f"{_SYSTEM_OPEN}{block}{_TURN_END}{text}"


def _jinja(text: str) -> str:
    """A Jinja expression printing `text` (Jinja unescapes string literals as Python does)."""
    return "{{ " + json.dumps(text) + " }}"


def _turns(system: str, user: tuple[str, str], assistant: str) -> str:
    """A chat template: `system`, then each user turn between `user`'s prefix and suffix and
    each assistant turn after `assistant`, then `assistant` as the generation prompt."""
    return (
        _jinja(system)
        + "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        + _jinja(assistant)
        + "{{ m['content'] }}{% else %}"
        + _jinja(user[0])
        + "{{ m['content'] }}"
        + _jinja(user[1])
        + "{% endif %}{% endfor %}{% if add_generation_prompt %}"
        + _jinja(assistant)
        + "{% endif %}"
    )


CHAT_TEMPLATES: dict[str, str] = {
    # ChatML; a conversation without a system turn gets the boxed instruction as its system.
    "qwen_boxed": (
        "{% if messages[0]['role'] != 'system' %}"
        + _jinja(f"<|im_start|>system\n{BOXED_INSTRUCTION}<|im_end|>\n")
        + "{% endif %}{% for m in messages %}"
        + "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        + "{% endfor %}{% if add_generation_prompt %}"
        + _jinja("<|im_start|>assistant\n")
        + "{% endif %}"
    ),
    # ChatML; each user turn inside DAPO's instruction unless it carries it (`dapo`).
    "dapo": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        + "{% if m['role'] == 'user' and not ("
        + json.dumps(DAPO_PREFIX)
        + " in m['content']) %}"
        + _jinja(DAPO_PREFIX + "\n\n")
        + "{{ m['content'] }}"
        + _jinja("\n\n" + DAPO_SUFFIX)
        + "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        + "{% if add_generation_prompt %}"
        + _jinja("<|im_start|>assistant\n")
        + "{% endif %}"
    ),
    "r1": _turns(R1_SYSTEM, (" User: ", ""), " Assistant: <think>"),
    "plain": _turns("", ("", "\n"), ""),
}
