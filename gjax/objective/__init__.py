"""The GRPO-family objective: advantages, token weights, policy losses, aggregation, kernel.

The composed function lives in the submodule of the same name:
``from gjax.objective.objective import objective`` (it is deliberately NOT re-exported here, so
that ``gjax.objective.objective`` stays the module). The rest of the API is re-exported.
"""

from gjax.objective.aggregation import AGGREGATIONS, aggregation_weights
from gjax.objective.objective import (
    PRESETS,
    ObjectiveConfig,
    finalize_metrics,
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
    "micro_batch_loss",
    "prepare",
    "split_micro_batches",
]
