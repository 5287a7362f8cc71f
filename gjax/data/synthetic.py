"""The embedded synthetic reasoning task: multi-step integer arithmetic with worked steps.

A problem is a chain of ``n`` binary operations over small non-negative integers, each
operation combining the running value with one new operand, on either side::

    problem        "Compute 3*((7+5)-4)."
    steps          ("7+5=12", "12-4=8", "3*8=24")
    demonstration  "7+5=12\\n12-4=8\\n3*8=24\\n\\boxed{24}"
    answer         "24"

Every intermediate value stays an integer in ``[0, max_value]`` (subtraction never goes
negative, division is exact), so each step line ``a op b = c`` is checkable by
:func:`parse_step` and chains from the problem (see :mod:`gjax.rewards.rule_judge`).

Determinism and splits. Candidate ``i`` of seed ``s`` is drawn from
``np.random.default_rng([s, i])`` alone, so the same ``(seed, index)`` always gives the same
problem. A problem belongs to the held-out split iff a stable hash (blake2b) of its
expression falls below ``heldout_fraction``: the split depends on the problem text only, so
train and test never share a problem, whatever the seeds or difficulty settings used to
draw them.

Difficulty. ``num_ops`` is drawn uniformly from ``[min_ops, max_ops]`` per problem and the
operands from ``[min_operand, max_operand]``, so one data set mixes easy one-step problems
with long chains whose intermediate values reach three digits. The defaults keep prompts
under ~28 characters and demonstrations under ~48 tokens with :mod:`gjax.data.tokenizer`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator
from fractions import Fraction

import numpy as np

SPLITS = ("train", "test")
OPS = "+-*/"
BOXED = "\\boxed{"


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Difficulty knobs of the synthetic task (all ranges inclusive)."""

    min_ops: int = 1
    max_ops: int = 4
    min_operand: int = 1
    max_operand: int = 9
    ops: str = "+-*"
    max_value: int = 999
    # Probability that a step puts the new operand on the left (``b op (expr)``).
    reverse_prob: float = 0.3
    heldout_fraction: float = 0.1

    def __post_init__(self):
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if not 0 <= self.min_operand <= self.max_operand <= self.max_value:
            raise ValueError(
                "need 0 <= min_operand <= max_operand <= max_value, got "
                f"{self.min_operand}, {self.max_operand}, {self.max_value}"
            )
        if (
            not self.ops
            or any(op not in OPS for op in self.ops)
            or len(set(self.ops)) != len(self.ops)
        ):
            raise ValueError(f"ops must be distinct characters from {OPS!r}, got {self.ops!r}")
        if not 0.0 <= self.reverse_prob <= 1.0:
            raise ValueError(f"reverse_prob must be in [0, 1], got {self.reverse_prob}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One synthetic example. ``steps`` are the demonstration's step lines, in order."""

    problem: str
    answer: str
    demonstration: str
    steps: tuple[str, ...]
    expression: str
    num_ops: int

    def as_dict(self) -> dict:
        return {
            "problem": self.problem,
            "answer": self.answer,
            "demonstration": self.demonstration,
            "steps": list(self.steps),
            "expression": self.expression,
            "num_ops": self.num_ops,
        }


# --------------------------------------------------------------------------- arithmetic


def apply_op(op: str, a: Fraction | int, b: Fraction | int) -> Fraction | None:
    """``a op b`` exactly; ``None`` for division by zero."""
    a, b = Fraction(a), Fraction(b)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return None if b == 0 else a / b
    raise ValueError(f"unknown operator {op!r}; valid: {OPS!r}")


def _valid_int(value: Fraction | None, max_value: int) -> bool:
    return value is not None and value.denominator == 1 and 0 <= value <= max_value


# --------------------------------------------------------------------------- parsing

# An expression tree: an int leaf, or (op, left, right).
Expr = int | tuple


_EXPR_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")


def parse_expression(text: str) -> Expr:
    """Parses ``+ - * /`` over non-negative integers with parentheses (usual precedence).

    Raises ``ValueError`` on anything else, naming the offending position.
    """
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"unexpected character {text[pos]!r} at {pos} in {text!r}")
        tokens.append(m.group(1))
        pos = m.end()
    if not tokens:
        raise ValueError("empty expression")
    i = 0

    def peek():
        return tokens[i] if i < len(tokens) else None

    def take():
        nonlocal i
        i += 1
        return tokens[i - 1]

    def atom():
        tok = peek()
        if tok is None:
            raise ValueError(f"expression {text!r} ends early")
        if tok == "(":
            take()
            node = additive()
            if peek() != ")":
                raise ValueError(f"missing ')' in {text!r}")
            take()
            return node
        if tok.isdigit():
            return int(take())
        raise ValueError(f"unexpected {tok!r} in {text!r}")

    def multiplicative():
        node = atom()
        while peek() in ("*", "/"):
            op = take()
            node = (op, node, atom())
        return node

    def additive():
        node = multiplicative()
        while peek() in ("+", "-"):
            op = take()
            node = (op, node, multiplicative())
        return node

    tree = additive()
    if i != len(tokens):
        raise ValueError(f"trailing {tokens[i]!r} in {text!r}")
    return tree


def evaluate(expr: Expr) -> Fraction:
    """Exact value of an expression tree; raises ``ZeroDivisionError`` on ``x/0``."""
    if isinstance(expr, int):
        return Fraction(expr)
    op, left, right = expr
    value = apply_op(op, evaluate(left), evaluate(right))
    if value is None:
        raise ZeroDivisionError(f"division by zero in {format_expression(expr)!r}")
    return value


def format_expression(expr: Expr) -> str:
    """Canonical text: compound operands are always parenthesised, leaves never."""
    if isinstance(expr, int):
        return str(expr)
    op, left, right = expr

    def operand(e):
        return str(e) if isinstance(e, int) else f"({format_expression(e)})"

    return f"{operand(left)}{op}{operand(right)}"


def _fmt_value(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def solution_steps(expr: Expr) -> list[str]:
    """The worked steps ``"a op b=c"`` of an expression, innermost first (post-order)."""
    steps: list[str] = []

    def walk(e) -> Fraction:
        if isinstance(e, int):
            return Fraction(e)
        op, left, right = e
        a, b = walk(left), walk(right)
        c = apply_op(op, a, b)
        if c is None:
            raise ZeroDivisionError(f"division by zero in {format_expression(e)!r}")
        steps.append(f"{_fmt_value(a)}{op}{_fmt_value(b)}={_fmt_value(c)}")
        return c

    walk(expr)
    return steps


_STEP = re.compile(r"^\s*(\d+)\s*([-+*/])\s*(\d+)\s*=\s*(-?\d+)\s*$")


def parse_step(line: str) -> tuple[int, str, int, int] | None:
    """``"12*3=36"`` -> ``(12, "*", 3, 36)``; ``None`` if the line is not a step."""
    m = _STEP.match(line)
    if not m:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))


_BRACES = re.compile(r"\\boxed\{|[{}]")


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` with balanced braces, or ``None``.

    One pass with a stack of open braces (linear even for pathological nesting).
    """
    stack: list[tuple[int, bool]] = []  # (content start, opened by \boxed{)
    best: tuple[int, int] | None = None
    for m in _BRACES.finditer(text):
        tok = m.group(0)
        if tok == "}":
            if stack:
                begin, boxed = stack.pop()
                if boxed and (best is None or begin > best[0]):
                    best = (begin, m.start())
        else:
            stack.append((m.end(), tok != "{"))
    return None if best is None else text[best[0] : best[1]].strip()


# --------------------------------------------------------------------------- generation


def split_of(expression: str, heldout_fraction: float = SyntheticConfig.heldout_fraction) -> str:
    """``"test"`` iff the expression's stable hash falls below ``heldout_fraction``."""
    digest = hashlib.blake2b(expression.encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2.0**64
    return "test" if u < heldout_fraction else "train"


def _draw_expression(rng: np.random.Generator, cfg: SyntheticConfig) -> Expr:
    num_ops = int(rng.integers(cfg.min_ops, cfg.max_ops + 1))
    expr: Expr = int(rng.integers(cfg.min_operand, cfg.max_operand + 1))
    value = Fraction(expr)
    for _ in range(num_ops):
        for _attempt in range(64):
            op = cfg.ops[int(rng.integers(len(cfg.ops)))]
            b = int(rng.integers(cfg.min_operand, cfg.max_operand + 1))
            reverse = bool(rng.random() < cfg.reverse_prob)
            new = apply_op(op, b, value) if reverse else apply_op(op, value, b)
            if _valid_int(new, cfg.max_value):
                break
        else:  # Rare: enumerate every valid move and pick one (still deterministic).
            moves = [
                (op, b, rev)
                for op in cfg.ops
                for b in range(cfg.min_operand, cfg.max_operand + 1)
                for rev in (False, True)
                if _valid_int(
                    apply_op(op, b, value) if rev else apply_op(op, value, b), cfg.max_value
                )
            ]
            if not moves:
                raise ValueError(f"no valid operation from value {value} under {cfg}")
            op, b, reverse = moves[int(rng.integers(len(moves)))]
            new = apply_op(op, b, value) if reverse else apply_op(op, value, b)
        expr = (op, b, expr) if reverse else (op, expr, b)
        value = new
    return expr


def make_problem(expr: Expr) -> Problem:
    """The full example (problem text, steps, demonstration, answer) for an expression."""
    expression = format_expression(expr)
    steps = tuple(solution_steps(expr))
    answer = _fmt_value(evaluate(expr))
    demonstration = "\n".join(steps) + f"\n{BOXED}{answer}}}"
    num_ops = len(steps)
    return Problem(f"Compute {expression}.", answer, demonstration, steps, expression, num_ops)


def candidate(seed: int, index: int, cfg: SyntheticConfig = SyntheticConfig()) -> Problem:
    """Candidate ``index`` of the stream for ``seed`` (before the train/test split)."""
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be non-negative, got {seed}, {index}")
    return make_problem(_draw_expression(np.random.default_rng([seed, index]), cfg))


def iter_problems(
    split: str = "train", *, seed: int = 0, config: SyntheticConfig = SyntheticConfig()
) -> Iterator[Problem]:
    """Infinite deterministic stream of the problems of ``split`` ("train" or "test")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    index = 0
    while True:
        p = candidate(seed, index, config)
        index += 1
        if split_of(p.expression, config.heldout_fraction) == split:
            yield p


def generate(
    num: int,
    split: str = "train",
    *,
    seed: int = 0,
    config: SyntheticConfig = SyntheticConfig(),
    unique: bool = False,
) -> list[Problem]:
    """The first ``num`` problems of ``split``; ``unique`` drops repeated expressions.

    With ``unique`` the stream may run dry for tiny configs (few distinct expressions): after
    ``100 * num + 1000`` candidates without enough new ones this raises rather than loop forever.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    out: list[Problem] = []
    seen: set[str] = set()
    for tried, p in enumerate(iter_problems(split, seed=seed, config=config)):
        if len(out) == num:
            break
        if tried > 100 * num + 1000:
            raise ValueError(
                f"only {len(out)} unique {split} problems after {tried} draws; widen {config}"
            )
        if unique:
            if p.expression in seen:
                continue
            seen.add(p.expression)
        out.append(p)
    return out
