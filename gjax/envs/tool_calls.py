"""Tool calls in the Qwen2.5 / Hermes format: strict parsing of the policy's text, and the
environment's reply in the chat template's form.

The policy calls a tool by writing, anywhere in its turn,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    </tool_call>

(Qwen2.5's chat template renders an assistant tool call exactly so, and its system block asks
for it: `{"name": <function-name>, "arguments": <args-json-object>}` inside `<tool_call>` tags).
A call is well formed only if the text between the tags is one JSON object with exactly two
keys: `name`, a non-empty string, and `arguments`, an object; no duplicate keys, no NaN or
Infinity. Anything else (bad JSON, other keys, a `<tool_call>` never closed, one opened inside
another, a `</tool_call>` with no opening) is a `MalformedCall`, which the environment turns
into an error the policy sees, never an exception.

The reply: Qwen2.5's template renders each `tool` message as `\\n<tool_response>\\n` + content +
`\\n</tool_response>`, consecutive ones inside one `<|im_start|>user ... <|im_end|>\\n` turn.
`tool_turn` returns that turn plus the header of the policy's next turn
(`<|im_start|>assistant\\n`), starting with the `\\n` that follows the `<|im_end|>` ending the
policy's turn (the sampled stop token belongs to the policy's text, not to this one).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gjax.data import templates

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG_RE = re.compile(r"</?tool_call>")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A tool-call block that is not a well-formed call; `reason` says what was wrong."""

    text: str
    reason: str


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate key(s) {dup}")
    return dict(pairs)


def parse_call(body: str) -> ToolCall | MalformedCall:
    """The text between `<tool_call>` and `</tool_call>` as a call, strictly."""
    try:
        obj = json.loads(body, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return MalformedCall(body, f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return MalformedCall(body, f"a JSON {type(obj).__name__}, not an object")
    if set(obj) != {"name", "arguments"}:
        return MalformedCall(body, f'keys {sorted(obj)}; a call has exactly "name" and "arguments"')
    name, arguments = obj["name"], obj["arguments"]
    if not isinstance(name, str) or not name.strip():
        return MalformedCall(body, '"name" must be a non-empty string')
    if not isinstance(arguments, dict):
        return MalformedCall(body, f'"arguments" must be an object, not {type(arguments).__name__}')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every tool-call block of a policy turn, in order (empty: the turn calls no tool)."""
    out: list[ToolCall | MalformedCall] = []
    start = None  # index just past the open tag of the block being read
    for m in _TAG_RE.finditer(text):
        if m.group() == OPEN:
            if start is not None:
                out.append(
                    MalformedCall(text[start : m.start()], "<tool_call> opened inside another")
                )
            start = m.end()
        elif start is None:
            out.append(MalformedCall("", "</tool_call> without an opening <tool_call>"))
        else:
            out.append(parse_call(text[start : m.start()]))
            start = None
    if start is not None:
        out.append(MalformedCall(text[start:], "<tool_call> never closed"))
    return out


def tool_response(content: str) -> str:
    """One tool's reply as Qwen2.5's template renders a `tool` message's content."""
    return f"\n<tool_response>\n{content}\n</tool_response>"


def tool_turn(responses: Sequence[str]) -> str:
    """The environment's turn after a policy turn that ended with `<|im_end|>`: the user turn
    holding the tool responses (in call order), then the header of the policy's next turn."""
    body = "".join(tool_response(r) for r in responses)
    return f"\n<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n"


# The system prompt's `# Tools` block: gjax.data.templates renders prompts, so it lives there.
tools_system_block = templates.tools_system_block
