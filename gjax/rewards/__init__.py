"""Host-side rewards: the math-verify verifier, reward functions, judges, the async pipeline."""

from gjax.rewards.registry import (
    REWARDS,
    CombinedReward,
    RewardFunctionError,
    RewardResult,
    RewardSpec,
    build_reward,
    soft_overlong_penalty,
)
from gjax.rewards.rule_judge import RuleJudge  # registers the offline judge as "rule"
from gjax.rewards.verifier import EXTRACTORS, Verifier, VerifierConfig, extract_answer

__all__ = [
    "EXTRACTORS",
    "REWARDS",
    "CombinedReward",
    "RewardFunctionError",
    "RewardResult",
    "RewardSpec",
    "RuleJudge",
    "Verifier",
    "VerifierConfig",
    "build_reward",
    "extract_answer",
    "soft_overlong_penalty",
]
