"""The final answer of a completion: pure, linear-time string scans.

Extractors (``VerifierConfig.extractors`` names them, tried in order, the first hit wins):
  * ``"boxed"``: the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, or the
    brace-less ``\\boxed 5`` form (up to the next whitespace or ``$``, trailing ``.,;:``
    dropped);
  * ``"answer_tag"``: the content of the last ``<answer>...</answer>`` pair;
  * ``"answer_line"``: the rest of the line after the last ``Answer:`` (any case), the
    form DAPO's prompts ask for, read as DAPO's reward reads it;
  * ``"regex"``: group 1 (or the whole match) of the last match of ``answer_regex``;
  * ``"math_verify"``: the whole response, left to math-verify's own extraction.

The verifier's workers run them on every item (gjax/rewards/verifier.py); evaluation's maj@k
votes with them (gjax/evaluation/metrics.py); data field specs such as ``boxed(solution)``
read answers out of a dataset's columns with them (gjax/data/fields.py). A leaf module, so
that rewards and data both use it without depending on each other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from gjax.registry import Registry

Extractor = Callable[[str], "str | None"]
EXTRACTORS: Registry[Extractor] = Registry("answer extractor")

_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)


def _brace_matches(text: str) -> dict[int, int]:
    """``{index of '{': index of its matching '}'}`` in one linear pass.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` never open or close a
    group. Linear time matters: responses are untrusted, and a quadratic scan over thousands
    of unbalanced ``\\boxed{`` would burn a worker until its deadline.
    """
    stack: list[int] = []
    match: dict[int, int] = {}
    for m in _BRACE_TOKEN_RE.finditer(text):
        c = m.group()
        if c == "{":
            stack.append(m.start())
        elif c == "}" and stack:
            match[stack.pop()] = m.start()
    return match


@EXTRACTORS.register("boxed")
def extract_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces) or ``\\boxed x`` content.

    Scans backwards over occurrences of the commands, so a truncated (unbalanced) last box
    falls back to the previous complete one.
    """
    starts = []
    matches = None
    for cmd in _BOXED_COMMANDS:
        pos = text.find(cmd)
        while pos != -1:
            starts.append((pos, cmd))
            pos = text.find(cmd, pos + 1)
    for pos, cmd in sorted(starts, reverse=True):
        j = pos + len(cmd)
        if j < len(text) and text[j].isalpha():  # e.g. \boxedfoo: another command
            continue
        k = j
        while k < len(text) and text[k] in " \t":
            k += 1
        if k < len(text) and text[k] == "{":
            if matches is None:
                matches = _brace_matches(text)
            close = matches.get(k)
            if close is not None:
                return text[k + 1 : close].strip()
        elif k > j and k < len(text):  # "\boxed 5.": to whitespace or '$', minus punctuation
            end = k
            while end < len(text) and not text[end].isspace() and text[end] != "$":
                end += 1
            content = text[k:end].rstrip(".,;:")
            if content:
                return content
    return None


@EXTRACTORS.register("answer_tag")
def extract_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair (stripped)."""
    close = text.rfind("</answer>")
    if close == -1:
        return None
    open_ = text.rfind("<answer>", 0, close)
    if open_ == -1:
        return None
    return text[open_ + len("<answer>") : close].strip()


_ANSWER_LINE_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # DAPO's pattern


@EXTRACTORS.register("answer_line")
def extract_answer_line(text: str) -> str | None:
    """What follows the LAST ``Answer:`` (case-insensitive) to the end of that line (or of the
    next, when nothing follows on its own), stripped of whitespace, markdown bold and a final
    period: DAPO's answer format (its prompts end
    "The last line of your response should be of the form Answer: $Answer"; its reward,
    verl's ``math_dapo``, reads the last match of ``(?i)Answer\\s*:\\s*([^\\n]+)``)."""
    last = None
    for last in _ANSWER_LINE_RE.finditer(text):  # noqa: B007 (we want the last one)
        pass
    if last is None:
        return None
    return last.group(1).strip().strip("*").strip().removesuffix(".").strip() or None


@EXTRACTORS.register("math_verify")
def extract_whole(text: str) -> str | None:
    """The whole response: math-verify's own extraction (last LaTeX/expression) decides."""
    return text


def extract_regex(text: str, pattern: re.Pattern[str]) -> str | None:
    """Group 1 (or the whole match when the pattern has no group) of the LAST match."""
    last = None
    for last in pattern.finditer(text):  # noqa: B007 (we want the last one)
        pass
    if last is None:
        return None
    return (last.group(1) if pattern.groups else last.group(0)).strip()


def extract_answer(
    text: str, extractors: Sequence[str], answer_regex: re.Pattern[str] | None = None
) -> tuple[str | None, str | None]:
    """``(answer, extractor name)`` from the first extractor that finds one, else (None, None)."""
    for name in extractors:
        if name == "regex":
            if answer_regex is None:
                raise ValueError("extractor 'regex' needs VerifierConfig.answer_regex")
            ans = extract_regex(text, answer_regex)
        else:
            ans = EXTRACTORS.get(name)(text)
        if ans:
            return ans, name
    return None, None
