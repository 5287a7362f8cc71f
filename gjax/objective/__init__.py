"""The GRPO-family objective: advantages, token weights, policy losses, aggregation, kernel.

`loss` composes them (`prepare`, `micro_batch_loss`, `finalize_metrics`, and `full_batch_loss`
for one whole batch); the API is re-exported here.
"""

from gjax.objective.aggregation import AGGREGATIONS, aggregation_weights
from gjax.objective.loss import (
    PRESETS,
    ObjectiveConfig,
    finalize_metrics,
    full_batch_loss,
    micro_batch_loss,
    prepare,
    split_micro_batches,
)
from gjax.objective.policy_losses import KL_ESTIMATORS, POLICY_LOSSES

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "ObjectiveConfig",
    "aggregation_weights",
    "finalize_metrics",
    "full_batch_loss",
    "micro_batch_loss",
    "prepare",
    "split_micro_batches",
]
