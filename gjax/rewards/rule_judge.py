"""An offline rule-based judge for the embedded synthetic arithmetic task (DaGRPO eq. (7)).

DaGRPO scores each response S(o) in [1, 10] against a reference on the correctness of the
final answer, the validity of the reasoning and the completeness of the steps (Sec. 5,
eq. (7)). For the synthetic task (:mod:`gjax.data.synthetic`) all three are checkable, so
this judge computes them exactly instead of asking an LLM:

    S(o) = 1 + w_step * m / max(K, n) + w_ans * [answer correct]      (w_step + w_ans = 9)

* ``K``: operations in the problem (nodes of its expression tree: the steps a full solution
  needs).
* ``n``: step attempts in the response: non-empty lines that contain ``=`` and no
  ``\\boxed{`` (tags such as ``<think>`` count as line breaks).
* ``m``: valid steps: attempts that parse as ``a op b = c`` (:func:`parse_step`), are
  arithmetically right (``c == a op b`` exactly), and compute a node of the problem whose
  operands are the problem's numbers or results of earlier valid steps (operand order free
  for ``+`` and ``*``; each node counts once). A step built on a wrong earlier result is
  not valid: errors propagate, as in a chained derivation.
* answer correct: the last ``\\boxed{...}`` (else the last ``<answer>...</answer>``) is a
  number equal to the problem's value.

Defaults ``w_step = 5, w_ans = 4``: a perfect solution scores 10, a correct answer with no
steps 5, every step right but a wrong boxed answer 6, garbage 1. So with DaGRPO's
``delta = 3`` a complete correct solution (10) is distinct from a typical wrong one (<= 6).

``noise_std > 0`` adds a stated noise model, for studies that need scores which are not a
function of correctness: ``S'(o) = clip(S(o) + sigma * z, 1, 10)`` with ``z ~ N(0, 1)`` drawn
from a generator seeded by ``noise_seed`` and the item's text (question, response, reference),
so the same item always gets the same score (a judge at temperature 0) and runs reproduce.

The problem comes from the question text (the longest arithmetic expression in it that
parses, so templated prompts work). If the question holds none, the reference demonstration
stands in: its step lines are the nodes (matched in any order, without the chaining check)
and its boxed answer the answer. With neither, the item is unscorable: ``None``.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from gjax.data.synthetic import (
    BOXED,
    apply_op,
    evaluate,
    extract_boxed,
    parse_expression,
    parse_step,
)
from gjax.rewards.judge import JUDGES, SCORE_MAX, SCORE_MIN

_COMMUTATIVE = "+*"
_EXPR_CANDIDATE = re.compile(r"[\d+\-*/() ]*\d[\d+\-*/() ]*")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_TAG = re.compile(r"</?[A-Za-z_]{1,20}>")
_NUMBER = re.compile(r"^[+-]?\d{1,30}(?:/\d{1,30}|\.\d{1,30})?$")


class _Node:
    __slots__ = ("op", "a", "b", "c", "children")

    def __init__(self, op: str, a: Fraction, b: Fraction, c: Fraction, children: tuple[int, ...]):
        self.op, self.a, self.b, self.c, self.children = op, a, b, c, children


def _tree_nodes(expr) -> list[_Node]:
    """Post-order nodes of an expression tree, with child-node indices for chaining."""
    nodes: list[_Node] = []

    def walk(e) -> tuple[Fraction, int | None]:
        if isinstance(e, int):
            return Fraction(e), None
        op, left, right = e
        (a, ia), (b, ib) = walk(left), walk(right)
        c = apply_op(op, a, b)
        if c is None:
            raise ZeroDivisionError
        nodes.append(_Node(op, a, b, c, tuple(i for i in (ia, ib) if i is not None)))
        return c, len(nodes) - 1

    walk(expr)
    return nodes


def find_expression(question: str):
    """The longest arithmetic expression in ``question`` that parses (with >= 1 operator)."""
    best, best_len = None, 0
    for m in _EXPR_CANDIDATE.finditer(question):
        text = m.group(0).strip()
        if len(text) <= best_len or not any(op in text for op in "+-*/"):
            continue
        try:
            expr = parse_expression(text)
            evaluate(expr)
        except (ValueError, ZeroDivisionError):
            continue
        if not isinstance(expr, int):
            best, best_len = expr, len(text)
    return best


def parse_number(text: str | None) -> Fraction | None:
    """``"32"``, ``"-4"``, ``"1/2"``, ``"0.5"`` -> exact value; anything else -> ``None``."""
    if text is None:
        return None
    text = text.strip().replace(" ", "")
    if not _NUMBER.match(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(response: str) -> Fraction | None:
    """The value in the last ``\\boxed{}``, else in the last ``<answer></answer>``."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return parse_number(boxed)
    tags = _ANSWER_TAG.findall(response)
    return parse_number(tags[-1]) if tags else None


def _step_attempts(response: str) -> list[str]:
    # Tags (``<think>``, ``</answer>``, ...) separate lines, so R1-style output parses too.
    return [
        line.strip()
        for line in _TAG.sub("\n", response).splitlines()
        if "=" in line and BOXED not in line and line.strip()
    ]


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + "\n" + text[-half:]


@JUDGES.register("rule")
class RuleJudge:
    """The rule judge (module docstring has the formula); implements the ``Judge`` protocol.

    Args:
      step_weight, answer_weight: ``w_step``, ``w_ans``; non-negative, summing to 9 so that
        scores span [1, 10].
      max_chars: longer responses are judged on their first and last ``max_chars / 2``
        characters (bounds the work on pathological outputs).
      noise_std, noise_seed: the noise model of the module docstring (0: exact scores).
    """

    def __init__(
        self,
        step_weight: float = 5.0,
        answer_weight: float = 4.0,
        max_chars: int = 8192,
        noise_std: float = 0.0,
        noise_seed: int = 0,
    ):
        if step_weight < 0 or answer_weight < 0:
            raise ValueError(f"weights must be >= 0, got {step_weight}, {answer_weight}")
        if abs(step_weight + answer_weight - (SCORE_MAX - SCORE_MIN)) > 1e-9:
            raise ValueError(
                f"step_weight + answer_weight must be {SCORE_MAX - SCORE_MIN} so scores span "
                f"[{SCORE_MIN}, {SCORE_MAX}], got {step_weight} + {answer_weight}"
            )
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        if not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        self.noise_std, self.noise_seed = float(noise_std), int(noise_seed)
        self.step_weight = float(step_weight)
        self.answer_weight = float(answer_weight)
        self.max_chars = int(max_chars)
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "items": 0, "unscorable": 0, "answer_correct": 0}

    def details(self, question: str, response: str, reference: str = "") -> dict | None:
        """``{"score", "valid_steps" (m), "step_attempts" (n), "needed_steps" (K),
        "answer_correct"}`` for one item, or ``None`` if it cannot be scored."""
        if not isinstance(response, str):
            response = ""
        response = _clip(response, self.max_chars)
        expr = find_expression(question) if isinstance(question, str) else None
        chained = expr is not None
        if chained:
            nodes = _tree_nodes(expr)
            truth = evaluate(expr)
        else:
            reference = reference if isinstance(reference, str) else ""
            nodes = []
            for line in _step_attempts(reference):
                step = parse_step(line)
                if step is not None:
                    a, op, b, c = step
                    nodes.append(_Node(op, Fraction(a), Fraction(b), Fraction(c), ()))
            truth = final_answer(reference)
            if truth is None:
                return None

        attempts = _step_attempts(response)
        done = [False] * len(nodes)
        valid = 0
        for line in attempts:
            step = parse_step(line)
            if step is None:
                continue
            a, op, b, c = (Fraction(step[0]), step[1], Fraction(step[2]), Fraction(step[3]))
            if apply_op(op, a, b) != c:
                continue
            for i, node in enumerate(nodes):
                if done[i] or node.op != op or node.c != c:
                    continue
                same = (node.a, node.b) == (a, b)
                swapped = op in _COMMUTATIVE and (node.b, node.a) == (a, b)
                if (same or swapped) and all(done[j] for j in node.children):
                    done[i] = True
                    valid += 1
                    break
        needed = len(nodes)
        denom = max(needed, len(attempts))
        frac = valid / denom if denom else 1.0
        correct = final_answer(response) == truth
        score = SCORE_MIN + self.step_weight * frac + self.answer_weight * float(correct)
        if self.noise_std > 0:
            score += self.noise_std * self._noise(question, response, reference)
        return {
            "score": min(max(score, SCORE_MIN), SCORE_MAX),
            "valid_steps": valid,
            "step_attempts": len(attempts),
            "needed_steps": needed,
            "answer_correct": correct,
        }

    def _noise(self, *texts: str) -> float:
        """One standard normal draw, a function of `noise_seed` and the item's texts."""
        h = hashlib.blake2b(str(self.noise_seed).encode(), digest_size=8)
        for t in texts:
            h.update(b"\0" + (t if isinstance(t, str) else "").encode("utf-8", "replace"))
        return float(np.random.default_rng(int.from_bytes(h.digest(), "little")).normal())

    def score_one(self, question: str, response: str, reference: str = "") -> float | None:
        d = self.details(question, response, reference)
        return None if d is None else d["score"]

    async def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
    ) -> list[float | None]:
        """Scores each response in [1, 10]; ``None`` where the problem cannot be recovered."""
        if not len(questions) == len(responses) == len(references):
            raise ValueError(
                f"questions, responses and references differ in length: "
                f"{len(questions)}, {len(responses)}, {len(references)}"
            )
        out: list[float | None] = []
        correct = 0
        for q, r, ref in zip(questions, responses, references):
            d = self.details(q, r, ref)
            out.append(None if d is None else d["score"])
            correct += bool(d and d["answer_correct"])
        with self._lock:
            self._counts["calls"] += 1
            self._counts["items"] += len(out)
            self._counts["unscorable"] += sum(s is None for s in out)
            self._counts["answer_correct"] += correct
        return out

    def stats(self) -> dict[str, float]:
        """Cumulative counters: calls, items, unscorable (``None``), answer_correct."""
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}

    def __repr__(self) -> str:
        return (
            f"RuleJudge(step_weight={self.step_weight}, answer_weight={self.answer_weight}, "
            f"max_chars={self.max_chars}, noise_std={self.noise_std})"
        )
