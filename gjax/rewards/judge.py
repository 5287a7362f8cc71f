"""LLM-as-a-judge scores S(o) in [1, 10] against a reference demonstration (DaGRPO eq. (7)).

    S(o_i) = F_judge(q, o_i, o_demo),  i = 1..G                      # DaGRPO eq. (7)

The judge grades a response against a reference on three dimensions: correctness of the final
answer, validity of the reasoning, completeness of the logical steps (DaGRPO Sec. 5).

`Judge` is the protocol every judge implements (the OpenAI-compatible `OpenAIJudge` below, the
offline rule judge in `gjax/rewards/rule_judge.py`, user judges):

    async def score(questions, responses, references) -> list[float | None]

batched, one entry per response, each a float in [1, 10] or `None` when no score arrived
(request failed after retries, reply unparseable). A judge never raises for one bad item;
what `None` means for training is decided by `resolve_missing_scores` (the failure policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

SCORE_MIN = 1.0
SCORE_MAX = 10.0


@runtime_checkable
class Judge(Protocol):
    """Scores responses in [SCORE_MIN, SCORE_MAX]; `None` = no score arrived for that item.

    Implementations must return a list of the same length as `responses`, never raise for a
    single item, and be safe to call concurrently from one event loop. Optional extras the
    pipeline uses when present: `stats() -> dict[str, float]` (cumulative counters) and
    `async aclose()`.
    """

    async def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
    ) -> list[float | None]: ...
