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

import json

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


@TEMPLATES.register("chat")
def chat(problem: str, tokenizer=None) -> str:
    return _apply_chat_template("chat", tokenizer, [{"role": "user", "content": problem}])


@TEMPLATES.register("open_rs")
def open_rs(problem: str, tokenizer=None) -> str:
    messages = [
        {"role": "system", "content": OPEN_RS_SYSTEM},
        {"role": "user", "content": problem},
    ]
    return _apply_chat_template("open_rs", tokenizer, messages)


@TEMPLATES.register("plain")
def plain(problem: str, tokenizer=None) -> str:
    del tokenizer
    return f"{problem}\n"


def apply_template(name: str, problem: str, tokenizer=None) -> str:
    """``TEMPLATES.get(name)(problem, tokenizer)``; unknown names list the valid ones."""
    return TEMPLATES.get(name)(problem, tokenizer)


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
