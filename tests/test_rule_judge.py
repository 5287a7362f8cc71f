"""The rule judge: hand-made responses scored by the documented formula."""

import asyncio

import pytest

from gjax.data import synthetic as syn
from gjax.data.templates import apply_template
from gjax.rewards.judge import JUDGES, Judge, make_judge
from gjax.rewards.rule_judge import RuleJudge, find_expression, parse_number

Q = "Compute ((7+5)*3)-4."
REF = "7+5=12\n12*3=36\n36-4=32\n\\boxed{32}"


def _score(judge, q, r, ref=REF):
    return asyncio.run(judge.score([q], [r], [ref]))[0]


# score = 1 + 5 * valid / max(K, attempts) + 4 * [answer correct], K = 3 here.
@pytest.mark.parametrize(
    "response, expected",
    [
        (REF, 10.0),  # perfect
        ("5+7=12\n3*12=36\n36-4=32\n\\boxed{32}", 10.0),  # commuted operands are fine
        ("7 + 5 = 12\n12 * 3 = 36\n36 - 4 = 32\nso \\boxed{ 32 }", 10.0),  # spacing
        ("7+5=12\n12*3=35\n35-4=31\n\\boxed{31}", 1 + 5 / 3),  # one wrong step propagates
        ("7+5=12\n12*3=36\n36-4=31\n\\boxed{31}", 1 + 5 * 2 / 3),  # last step wrong
        ("7+5=12\n12*3=36\n36-4=32\n\\boxed{33}", 6.0),  # steps right, answer wrong
        ("\\boxed{32}", 5.0),  # right answer, no steps
        ("7+5=12\n\\boxed{32}", 1 + 5 / 3 + 4),  # incomplete steps
        ("7+5=12\n12*3=36\n36-4=32\n1+1=2\n2+2=5\n\\boxed{32}", 1 + 5 * 3 / 5 + 4),  # extra
        ("12*3=36\n7+5=12\n36-4=32\n\\boxed{32}", 1 + 5 / 3 + 4),  # 12 used before computed
        ("7-5=2\n2*3=6\n6-4=2\n\\boxed{2}", 1.0),  # right arithmetic, wrong problem
        ("7+5=12=12\n\\boxed{32}", 1 + 0 + 4),  # malformed step attempt
        ("<think>7+5=12\n12*3=36\n36-4=32</think><answer>32</answer>", 10.0),  # R1 format
        ("asdf }{ \\boxed{ ((( 7+5", 1.0),  # garbage
        ("", 1.0),
    ],
)
def test_hand_made_responses(response, expected):
    assert _score(RuleJudge(), Q, response) == pytest.approx(expected)


def test_details_and_weights():
    d = RuleJudge().details(Q, "7+5=12\n12*3=35\n\\boxed{35}")
    assert d == {
        "score": pytest.approx(1 + 5 / 3),
        "valid_steps": 1,
        "step_attempts": 2,
        "needed_steps": 3,
        "answer_correct": False,
    }
    j = RuleJudge(step_weight=9.0, answer_weight=0.0)
    assert _score(j, Q, "\\boxed{32}") == 1.0 and _score(j, Q, REF) == 10.0
    with pytest.raises(ValueError, match="must be 9"):
        RuleJudge(step_weight=5.0, answer_weight=5.0)
    with pytest.raises(ValueError, match=">= 0"):
        RuleJudge(step_weight=10.0, answer_weight=-1.0)


def test_every_synthetic_demonstration_scores_ten_and_answers_alone_five():
    judge = RuleJudge()
    cfg = syn.SyntheticConfig(ops="+-*/", max_ops=5)
    probs = syn.generate(200, seed=9, config=cfg)
    qs = [p.problem for p in probs]
    refs = [p.demonstration for p in probs]
    assert asyncio.run(judge.score(qs, refs, refs)) == [10.0] * len(probs)
    answers = [f"\\boxed{{{p.answer}}}" for p in probs]
    assert asyncio.run(judge.score(qs, answers, refs)) == [5.0] * len(probs)


def test_templated_question_and_reference_fallback():
    judge = RuleJudge()
    for name in ("plain", "qwen_boxed", "r1"):
        assert _score(judge, apply_template(name, Q), REF) == 10.0
    # No expression in the question: the reference's steps and answer stand in.
    assert _score(judge, "Solve the task.", REF) == 10.0
    assert _score(judge, "Solve the task.", "\\boxed{32}") == 5.0
    assert _score(judge, "Solve the task.", "7+5=12\n\\boxed{30}") == pytest.approx(1 + 5 / 3)
    # Neither: unscorable -> None (the judge failure policy decides), counted.
    assert _score(judge, "Solve the task.", REF, ref="") is None
    assert judge.stats()["unscorable"] == 1.0


def test_protocol_registry_and_batch():
    judge = make_judge("rule", {"step_weight": 6.0, "answer_weight": 3.0})
    assert isinstance(judge, Judge) and isinstance(judge, RuleJudge) and "rule" in JUDGES
    scores = asyncio.run(judge.score([Q, Q, Q], [REF, "\\boxed{32}", "nope"], [REF] * 3))
    assert scores == [10.0, 4.0, 1.0]
    assert all(1.0 <= s <= 10.0 for s in scores)
    stats = judge.stats()
    assert stats["calls"] == 1.0 and stats["items"] == 3.0 and stats["answer_correct"] == 2.0
    with pytest.raises(ValueError, match="differ in length"):
        asyncio.run(judge.score([Q], [REF, REF], [REF]))


def test_pathological_responses_are_bounded():
    judge = RuleJudge(max_chars=4096)
    huge_number = "9" * 100_000
    cases = [
        "7+5=12\n" * 200_000 + "\\boxed{32}",  # 1.4 MB of repeated steps
        f"{huge_number}+1={huge_number}\n\\boxed{{{huge_number}}}",
        "\\boxed{" * 10_000,
        "{" * 50_000 + "}" * 50_000,
        "=" * 100_000,
    ]
    for response in cases:
        score = _score(judge, Q, response)
        assert score is not None and 1.0 <= score <= 10.0
    # Repeating a valid step earns it once: 1 valid out of many attempts.
    assert _score(judge, Q, "7+5=12\n" * 50 + "\\boxed{32}") == pytest.approx(1 + 5 / 50 + 4)


def test_helpers():
    assert find_expression("<|im_start|>user\nCompute 3*((7+5)-4).<|im_end|>") == (
        "*",
        3,
        ("-", ("+", 7, 5), 4),
    )
    assert find_expression("no arithmetic 42 here") is None
    assert parse_number(" -4 ") == -4 and parse_number("1/2") == parse_number("0.5")
    assert parse_number("\\frac{1}{2}") is None and parse_number("1" * 100) is None


def test_noise_model_is_seeded_per_item_clipped_and_unbiased_inside_the_range():
    """`noise_std`: S' = clip(S + sigma z, 1, 10), z a function of the seed and the item."""
    exact, noisy = RuleJudge(), RuleJudge(noise_std=1.0, noise_seed=3)
    mid = "7+5=12\n12*3=36\n36-4=32\n\\boxed{33}"  # exact score 6: far from both bounds
    assert _score(exact, Q, mid) == 6.0
    same = [_score(RuleJudge(noise_std=1.0, noise_seed=3), Q, mid) for _ in range(2)]
    assert same[0] == same[1] == _score(noisy, Q, mid) != 6.0  # per item, reproducible
    assert _score(RuleJudge(noise_std=1.0, noise_seed=4), Q, mid) != same[0]  # the seed counts
    # Over many items (the reference text varies the draw): mean 6, std 1, nothing clipped.
    draws = [noisy.score_one(Q, mid, f"{REF}\n{i}") for i in range(4000)]
    assert abs(sum(draws) / 4000 - 6.0) < 4 * 1 / 4000**0.5
    assert 0.95 < (sum((d - 6.0) ** 2 for d in draws) / 4000) ** 0.5 < 1.05
    # A perfect answer (10) under large noise: clipped to [1, 10], never beyond.
    big = [RuleJudge(noise_std=5.0, noise_seed=i).score_one(Q, REF) for i in range(200)]
    assert min(big) >= 1.0 and max(big) == 10.0 and min(big) < 5.0
    with pytest.raises(ValueError, match="noise_std"):
        RuleJudge(noise_std=-1.0)


def test_noise_std_reaches_the_rule_judge_and_is_refused_for_another():
    from configs import dagrpo
    from gjax.errors import ConfigError
    from gjax.rewards.judge import check_config
    from gjax.rewards.pipeline import build_rewards

    c = dagrpo.get_config("tiny")
    c.reward.judge.noise_std, c.seed = 1.5, 7
    c.reward.functions = "format"  # needs no verifier processes
    check_config(c.reward.judge)
    with build_rewards(c, None) as rewards:
        assert (rewards.judge.noise_std, rewards.judge.noise_seed) == (1.5, 7)
    c.reward.judge.name = "openai"
    with pytest.raises(ConfigError, match=r"noise_std=1.5: the noise model is the rule judge"):
        check_config(c.reward.judge)
