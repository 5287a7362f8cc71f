"""Host-side rewards: the math-verify verifier, reward functions, judges, the async pipeline."""

from gjax.answers import EXTRACTORS, extract_answer
from gjax.rewards.functions import (
    REWARDS,
    CombinedReward,
    RewardFunctionError,
    RewardResult,
    RewardSpec,
    build_reward,
    soft_overlong_penalty,
)
from gjax.rewards.judge import (
    JUDGES,
    Judge,
    OpenAIJudge,
    make_judge,
    parse_score,
    resolve_missing_scores,
)
from gjax.rewards.pipeline import (
    PipelineResult,
    RewardHandle,
    RewardPipeline,
    RewardPipelineError,
)
from gjax.rewards.rule_judge import RuleJudge  # registers the offline judge as "rule"
from gjax.rewards.verifier import Verifier, VerifierConfig

__all__ = [
    "JUDGES",
    "Judge",
    "OpenAIJudge",
    "PipelineResult",
    "RewardHandle",
    "RewardPipeline",
    "RewardPipelineError",
    "make_judge",
    "parse_score",
    "resolve_missing_scores",
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
