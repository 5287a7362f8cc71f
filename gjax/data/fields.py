"""Where a field of a row lives: a column, a path into a nested column, an extracted answer.

A field spec (``data.problem_field``, ``data.answer_field``, ``data.demonstration_field``)::

    problem                      the column ``problem``
    reward_model.ground_truth    key ``ground_truth`` of the struct column ``reward_model``
    prompt[-1].content           ``content`` of the last turn of the list column ``prompt``
    boxed(solution)              the last ``\\boxed{...}`` of the column ``solution``

``name(path)`` applies an answer extractor of ``gjax.answers.EXTRACTORS``
(``boxed``, ``answer_tag``) to the text at ``path``. A path step that is missing (no such
key, an index out of range, a value of the wrong kind) or an extractor that finds nothing
gives ``None``: the row is malformed (``gjax.data.prompts`` skips and counts it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gjax.answers import EXTRACTORS

_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$")
_STEP = re.compile(r"\.([^.\[\]]+)|\[(-?\d+)\]")
_COLUMN = re.compile(r"^[^.\[\]()]+")


class FieldSpecError(ValueError):
    """A field spec that does not parse; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """A parsed field spec: the root ``column``, the ``steps`` into it, an ``extractor``."""

    text: str
    column: str
    steps: tuple[str | int, ...] = ()
    extractor: str | None = None

    def get(self, row: Mapping) -> Any:
        """The field's value in ``row``, or None where the path or the extractor finds none."""
        return self.resolve(row.get(self.column))

    def resolve(self, value: Any) -> Any:
        """The field's value given its root column's ``value``."""
        for step in self.steps:
            if isinstance(step, int):
                if not isinstance(value, Sequence) or isinstance(value, str):
                    return None
                if not -len(value) <= step < len(value):
                    return None
                value = value[step]
            else:
                if not isinstance(value, Mapping):
                    return None
                value = value.get(step)
        if self.extractor is not None:
            return EXTRACTORS.get(self.extractor)(value) if isinstance(value, str) else None
        return value


def parse(text: str) -> FieldSpec:
    """Parses a field spec (see the module docstring); a bad one raises FieldSpecError."""
    if not isinstance(text, str) or not text.strip():
        raise FieldSpecError(f"a field spec is a non-empty string, got {text!r}")
    extractor, path = None, text.strip()
    call = _CALL.match(path)
    if call:
        extractor, path = call.group(1), call.group(2).strip()
        if extractor not in EXTRACTORS.names():
            raise FieldSpecError(
                f"{text!r}: unknown extractor {extractor!r}; valid: {EXTRACTORS.names()}"
            )
    column = _COLUMN.match(path)
    if not column:
        raise FieldSpecError(
            f"{text!r}: a field spec starts with a column name, e.g. 'problem', "
            "'reward_model.ground_truth', 'prompt[-1].content' or 'boxed(solution)'"
        )
    steps, rest = [], path[column.end() :]
    while rest:
        step = _STEP.match(rest)
        if not step:
            raise FieldSpecError(
                f"{text!r}: cannot read {rest!r}; after the column come '.key' and '[index]' "
                "steps, e.g. 'prompt[-1].content'"
            )
        steps.append(step.group(1) if step.group(1) is not None else int(step.group(2)))
        rest = rest[step.end() :]
    return FieldSpec(text, column.group(0).strip(), tuple(steps), extractor)
