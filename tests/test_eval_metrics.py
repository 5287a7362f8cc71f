"""gjax.evaluation's estimators against hand-computed values: pass@k (A-GRAE eq. (37)), maj@k
(ties, abstentions, chunks), the summary and the markdown table."""

import itertools
import math
from fractions import Fraction

import ml_collections
import numpy as np
import pytest

from gjax.errors import ConfigError
from gjax.evaluation.heldout import HeldoutEval
from gjax.evaluation.metrics import (
    EvalError,
    Samples,
    answer_key,
    default_ks,
    maj_at_k,
    parse_ks,
    pass_at_k,
    summarize,
)
from gjax.evaluation.report import markdown_table


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 4, 5 / 6),  # 1 - C(7,4)/C(10,4) = 1 - 35/210
        (64, 1, 32, 0.5),  # 1 - C(63,32)/C(64,32) = 1 - 32/64
        (8, 3, 1, 3 / 8),  # k = 1: c / n
        (6, 0, 3, 0.0),  # c = 0: never
        (6, 6, 3, 1.0),  # c = n: always
        (6, 4, 3, 1.0),  # n - c < k: every k-subset holds a correct sample
        (5, 0, 5, 0.0),  # n = k, c = 0
        (5, 1, 5, 1.0),  # n = k, c > 0
    ],
)
def test_pass_at_k_hand_computed(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_is_the_binomial_ratio():
    for n in (1, 2, 7, 16, 33):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_maj_at_k_majority_abstentions_and_ties():
    # "5" twice, "7" once, one abstention: "5" wins.
    assert maj_at_k(["5", "5", "7", None], [1, 1, 0, 0], 4) == 1.0
    assert maj_at_k(["7", "7", "5", None], [0, 0, 1, 0], 4) == 0.0
    # A tie of one right and one wrong answer scores the mean of the tied answers.
    assert maj_at_k(["5", "7"], [1, 0], 2) == 0.5
    # 5:2, 7:2, 9:1 -> tie between 5 (right) and 7 (wrong); 9 (right) is not tied.
    assert maj_at_k(["5", "7", "9", "5", "7"], [1, 0, 1, 1, 0], 5) == 0.5
    # Three-way tie, one right.
    assert maj_at_k(["a", "b", "c"], [0, 1, 0], 3) == pytest.approx(1 / 3)
    # Nobody answered: 0.
    assert maj_at_k([None, None, None], [0, 0, 0], 3) == 0.0
    # Abstentions do not vote: the one answer given wins.
    assert maj_at_k([None, None, "3"], [0, 0, 1], 3) == 1.0


def test_maj_at_k_ties_do_not_depend_on_order():
    keys, correct = ["5", "7", "9", "5", "7", "9"], [1, 0, 0, 1, 0, 0]
    scores = [
        maj_at_k([keys[i] for i in p], [correct[i] for i in p], 6)
        for p in itertools.permutations(range(6))
    ]
    assert scores == [pytest.approx(1 / 3)] * len(scores)


def test_maj_at_k_averages_disjoint_chunks():
    # n = 5, k = 2: chunks (a, a) -> right, (b, c) -> tie of two wrong; the 5th is unused.
    keys, correct = ["a", "a", "b", "c", "a"], [1, 1, 0, 0, 1]
    assert maj_at_k(keys, correct, 2) == 0.5
    assert maj_at_k(keys, correct, 1) == pytest.approx(3 / 5)  # 5 chunks of 1: c / n
    with pytest.raises(ValueError):
        maj_at_k(keys, correct, 6)


def test_answer_key_normalizes_spelling_not_value():
    a = answer_key("so \\boxed{\\dfrac{1}{2}}.")
    assert a == answer_key("\\boxed{ \\frac{1}{2} }") == answer_key("\\boxed{\\tfrac{1}{2}.}")
    assert answer_key("\\boxed{\\left(1, 2\\right)}") == answer_key("\\boxed{(1,2)}")
    assert answer_key("\\boxed{0.5}") != a  # equal values written differently vote apart
    assert answer_key("no answer here") is None
    assert answer_key("<answer> 42 </answer>") == "42"


def _samples(correct, keys, lengths=None, truncated=None):
    correct = np.asarray(correct, np.float32)
    shape = correct.shape
    return Samples(
        texts=[[""] * shape[1] for _ in range(shape[0])],
        correct_PxN=correct,
        lengths_PxN=np.asarray(lengths if lengths is not None else np.ones(shape), np.int32),
        truncated_PxN=np.asarray(truncated if truncated is not None else np.zeros(shape), bool),
        keys=keys,
    )


def test_summarize_hand_computed():
    # Problem 0: 1 of 4 right; problem 1: 4 of 4; problem 2: 0 of 4 (one abstention).
    s = _samples(
        [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]],
        [["2", "3", "3", "4"], ["7", "7", "7", "7"], ["1", None, "1", "2"]],
        lengths=[[10, 20, 30, 40]] * 3,
        truncated=[[0, 0, 0, 1]] * 3,
    )
    m = summarize(s, [1, 2, 4])
    assert m["problems"] == 3 and m["n"] == 4
    assert m["avg@4"] == pytest.approx(5 / 12)
    assert m["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert m["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    # maj@2: p0 chunks (2,3) tie -> 0.5, (3,4) tie -> 0 => 0.25; p1 1; p2 (1) -> 0, (1,2) -> 0.
    assert m["maj@2"] == pytest.approx((0.25 + 1 + 0) / 3)
    # maj@4: p0 "3" wins (wrong) -> 0; p1 1; p2 "1" -> 0.
    assert m["maj@4"] == pytest.approx(1 / 3)
    assert m["no_answer"] == pytest.approx(1 / 12)
    assert m["truncated"] == pytest.approx(0.25)
    assert m["length_mean"] == pytest.approx(25.0)


def test_markdown_table_rows_and_columns():
    s = _samples([[1, 0], [1, 1]], [["1", "2"], ["3", "3"]])
    table = markdown_table({"aime24": {**summarize(s, [1, 2]), "greedy": 0.5}})
    lines = table.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:7] == ["benchmark", "problems", "n", "greedy", "avg@2", "pass@1", "pass@2"]
    assert head[7] == "maj@2" and head[-3:] == ["no_answer", "truncated", "length_mean"]
    row = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert row == {
        "benchmark": "aime24",
        "problems": "2",
        "n": "2",
        "greedy": "50.0",
        "avg@2": "75.0",
        "pass@1": "75.0",
        "pass@2": "100.0",
        "maj@2": "75.0",
        "no_answer": "0.0",
        "truncated": "0.0",
        "length_mean": "1.0",
    }


def test_ks_defaults_and_validation():
    assert default_ks(1) == [1]
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(12) == [1, 2, 4, 8, 12]
    assert parse_ks("4,1,4", 8) == [1, 4]
    with pytest.raises(EvalError, match="k=\\[16\\] outside 1..n=8"):
        parse_ks("1,16", 8)
    with pytest.raises(EvalError, match="comma-separated"):
        parse_ks("1,x", 8)


def _eval_cfg(**kw):
    d = dict(num_samples=4, temperature=0.6, top_p=0.95, pass_k="1,4", max_rows=64)
    return ml_collections.ConfigDict({**d, **kw})


def test_heldout_eval_config():
    s = HeldoutEval.from_config(_eval_cfg())
    assert (s.num_samples, s.ks, s.temperature, s.top_p) == (4, (1, 4), 0.6, 0.95)
    assert HeldoutEval.from_config(_eval_cfg(num_samples=0, pass_k="1,64")).ks == ()
    with pytest.raises(ConfigError, match="config.eval.pass_k"):
        HeldoutEval.from_config(_eval_cfg(pass_k="1,8"))
    with pytest.raises(ConfigError, match="config.eval.num_samples"):
        HeldoutEval.from_config(_eval_cfg(num_samples=-1))
    with pytest.raises(ConfigError, match="config.eval.temperature"):
        HeldoutEval.from_config(_eval_cfg(temperature=0.0))
