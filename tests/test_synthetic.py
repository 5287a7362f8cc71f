"""The embedded synthetic arithmetic task: determinism, disjoint splits, checkable steps."""

import ast
import operator
import re
from fractions import Fraction

import pytest

from gjax.data import synthetic as syn
from gjax.data.templates import apply_template
from gjax.data.tokenizer import build_tokenizer

_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _reference_eval(expression: str) -> Fraction:
    """Independent evaluator (Python's own parser), exact division."""

    def ev(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return ev(node.left) / ev(node.right)
        return _AST_OPS[type(node.op)](ev(node.left), ev(node.right))

    return ev(ast.parse(expression, mode="eval").body)


@pytest.fixture(scope="module")
def train():
    return syn.generate(1500, "train", seed=0)


def test_same_seed_same_data_other_seed_other_data():
    a = syn.generate(40, "train", seed=7)
    b = syn.generate(40, "train", seed=7)
    c = syn.generate(40, "train", seed=8)
    assert a == b
    assert [p.problem for p in a] != [p.problem for p in c]
    assert syn.candidate(3, 11) == syn.candidate(3, 11)


def test_brief_example_format():
    p = syn.make_problem(("-", ("*", ("+", 7, 5), 3), 4))
    assert p.problem == "Compute ((7+5)*3)-4."
    assert p.demonstration == "7+5=12\n12*3=36\n36-4=32\n\\boxed{32}"
    assert p.answer == "32" and p.steps == ("7+5=12", "12*3=36", "36-4=32") and p.num_ops == 3
    # An operand on the left of a compound expression.
    q = syn.make_problem(("*", 3, ("-", ("+", 7, 5), 4)))
    assert q.problem == "Compute 3*((7+5)-4)." and q.steps == ("7+5=12", "12-4=8", "3*8=24")


def test_splits_never_overlap(train):
    test = syn.generate(150, "test", seed=0)
    test_other_seed = syn.generate(150, "test", seed=5)
    hard = syn.SyntheticConfig(min_ops=1, max_ops=2, max_operand=5)
    train_other_cfg = syn.generate(500, "train", seed=1, config=hard)
    train_exprs = {p.expression for p in train} | {p.expression for p in train_other_cfg}
    test_exprs = {p.expression for p in test} | {p.expression for p in test_other_seed}
    assert not train_exprs & test_exprs
    assert all(syn.split_of(e) == "test" for e in test_exprs)
    # Held-out share of the candidate stream is close to heldout_fraction.
    cands = [syn.candidate(0, i).expression for i in range(2000)]
    share = sum(syn.split_of(e) == "test" for e in cands) / len(cands)
    assert 0.07 < share < 0.13


def test_every_demonstration_verifies(train):
    cfg = syn.SyntheticConfig()
    for p in train:
        truth = _reference_eval(p.expression)
        assert p.answer == str(truth) and truth.denominator == 1
        assert p.problem == f"Compute {p.expression}."
        assert len(p.steps) == p.num_ops
        assert p.demonstration == "\n".join(p.steps) + f"\n\\boxed{{{p.answer}}}"
        assert syn.extract_boxed(p.demonstration) == p.answer
        leaves = [int(t) for t in re.findall(r"\d+", p.expression)]
        produced = []
        for line in p.steps:
            a, op, b, c = syn.parse_step(line)
            assert syn.apply_op(op, a, b) == c, line
            assert 0 <= c <= cfg.max_value
            # Chaining: every operand is a problem number or an earlier step's result.
            assert a in produced or a in leaves, line
            assert b in produced or b in leaves, line
            produced.append(c)
        assert produced[-1] == int(p.answer)
        # The canonical text parses back to the same tree and value.
        tree = syn.parse_expression(p.expression)
        assert syn.format_expression(tree) == p.expression
        assert syn.evaluate(tree) == truth
        assert list(p.steps) == syn.solution_steps(tree)


def test_difficulty_spread_and_lengths(train):
    counts = {k: sum(p.num_ops == k for p in train) for k in range(1, 5)}
    assert all(c > 200 for c in counts.values()), counts
    assert any(int(p.answer) >= 100 for p in train)  # some long chains reach three digits
    tok = build_tokenizer()
    prompt_len = max(len(tok(apply_template("plain", p.problem))["input_ids"]) for p in train)
    demo_len = max(len(tok(p.demonstration)["input_ids"]) for p in train)
    assert prompt_len <= 32 and demo_len + 1 <= 48, (prompt_len, demo_len)  # +1: eos


def test_knobs_change_difficulty():
    easy = syn.generate(200, seed=0, config=syn.SyntheticConfig(min_ops=1, max_ops=1))
    assert all(p.num_ops == 1 for p in easy)
    hard = syn.generate(
        200, seed=0, config=syn.SyntheticConfig(min_ops=5, max_ops=5, max_operand=20)
    )
    assert all(p.num_ops == 5 for p in hard)
    assert max(int(t) for p in hard for t in re.findall(r"\d+", p.expression)) > 9


def test_division_is_exact():
    cfg = syn.SyntheticConfig(ops="+-*/", min_ops=2, max_ops=4)
    probs = syn.generate(300, seed=2, config=cfg)
    assert any("/" in p.expression for p in probs)
    for p in probs:
        assert _reference_eval(p.expression) == int(p.answer)
        for line in p.steps:
            a, op, b, c = syn.parse_step(line)
            assert syn.apply_op(op, a, b) == c


def test_unique_and_config_errors():
    probs = syn.generate(100, seed=0, config=syn.SyntheticConfig(max_ops=1), unique=True)
    assert len({p.expression for p in probs}) == 100
    with pytest.raises(ValueError, match="unique"):
        syn.generate(5, config=syn.SyntheticConfig(max_ops=1, max_operand=2, ops="+"), unique=True)
    with pytest.raises(ValueError, match="min_ops"):
        syn.SyntheticConfig(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="ops"):
        syn.SyntheticConfig(ops="+^")
    with pytest.raises(ValueError, match="split"):
        next(syn.iter_problems("validation"))


@pytest.mark.parametrize(
    "line, expected",
    [("7+5=12", (7, "+", 5, 12)), (" 12 * 3 = 36 ", (12, "*", 3, 36)), ("4-9=-5", (4, "-", 9, -5))],
)
def test_parse_step(line, expected):
    assert syn.parse_step(line) == expected


@pytest.mark.parametrize("line", ["7+5", "7+5=12=12", "a+b=c", "\\boxed{12}", "7++5=12", ""])
def test_parse_step_rejects(line):
    assert syn.parse_step(line) is None


def test_parse_expression_precedence_and_errors():
    assert syn.evaluate(syn.parse_expression("2+3*4")) == 14
    assert syn.evaluate(syn.parse_expression("(2+3)*4")) == 20
    assert syn.evaluate(syn.parse_expression("8-3-2")) == 3
    for bad in ["", "2+", "(2+3", "2+3)", "2^3", "x"]:
        with pytest.raises(ValueError):
            syn.parse_expression(bad)


def test_extract_boxed():
    assert syn.extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert syn.extract_boxed("no box") is None
    assert syn.extract_boxed("\\boxed{3} then \\boxed{unclosed") == "3"


# The task with headroom (configs.common.HEADROOM_TASK): chains of 2-4 operations, for a policy
# warmed up on chains of 1-3 (EMBEDDED_TASK).


@pytest.fixture(scope="module")
def headroom():
    from configs.common import HEADROOM_TASK

    return syn.SyntheticConfig(**HEADROOM_TASK)


def test_headroom_task_is_deterministic_and_split_by_text(headroom, train):
    a = syn.generate(300, "train", seed=3, config=headroom)
    assert a == syn.generate(300, "train", seed=3, config=headroom)
    assert [p.problem for p in a] != [
        p.problem for p in syn.generate(300, "train", seed=4, config=headroom)
    ]
    test = syn.generate(60, "test", seed=0, config=headroom)
    # The split is the text's: the same rule as the default task's, whatever config drew it.
    assert all(syn.split_of(p.expression) == "train" for p in a)
    assert all(syn.split_of(p.expression) == "test" for p in test)
    assert not {p.expression for p in test} & (
        {p.expression for p in a} | {p.expression for p in train}
    )


def test_headroom_task_is_harder_and_fits_its_config(headroom):
    from configs import common

    probs = syn.generate(800, "train", seed=0, config=headroom)
    counts = {k: sum(p.num_ops == k for p in probs) for k in range(1, 6)}
    # A third of the chains are longer than any the embedded policy was warmed up on.
    assert common.EMBEDDED_TASK["max_ops"] == 3
    assert counts[1] == counts[5] == 0 and all(counts[k] > 200 for k in range(2, 5)), counts
    for p in probs:  # every value stays in [0, max_value = 99]: long chains, small numbers
        assert all(0 <= syn.parse_step(s)[3] <= 99 for s in p.steps)
    tiny = syn.generate(800, "train", seed=0, config=syn.SyntheticConfig(**common.EMBEDDED_TASK))
    mean = lambda ps: sum(len(p.demonstration) for p in ps) / len(ps)  # noqa: E731
    assert mean(probs) > 1.25 * mean(tiny), (mean(probs), mean(tiny))  # ~31 vs ~23 chars
    # Its config holds every prompt and demonstration (+ eos), so no worked answer is cut.
    c = common.headroom(common.base())
    tok = build_tokenizer()
    prompt_len = max(len(tok(apply_template("plain", p.problem))["input_ids"]) for p in probs)
    demo_len = max(len(tok(p.demonstration)["input_ids"]) for p in probs)
    assert prompt_len <= c.data.max_prompt_len and demo_len + 1 <= c.rollout.max_new_tokens
