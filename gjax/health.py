"""Is training still going anywhere: divergence stops the run, a finite collapse is warned of.

Divergence (a non-finite loss, gradient norm or train state) raises `Diverged`, whose message
names the last checkpoint that is really intact. A collapse with finite numbers (a policy
uniform over the vocabulary, or zero reward with a zero gradient, step after step) trains
on without learning and ends with exit status 0, so `CollapseWatch` says so once, loudly
(it returns the warning; the caller shows it, e.g. above the progress bar).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gjax.errors import UserError


class Diverged(UserError, FloatingPointError):
    """Training produced non-finite numbers; nothing non-finite was saved."""


class CollapseWatch:
    """Warns once after `patience` consecutive steps that look collapsed.

    A step looks collapsed when the policy's mean token entropy is within 2% of ln V (the
    entropy of the uniform distribution over the vocabulary: the model no longer prefers
    any token), or when the reward and the gradient norm are both exactly 0 (nothing to
    learn from, nothing learned).
    """

    def __init__(self, vocab_size: int, patience: int = 3):
        self.max_entropy = math.log(vocab_size)
        self.patience = patience
        self.run: list[int] = []
        self.warned = False

    def __call__(self, step: int, row: Mapping[str, float]) -> str | None:
        entropy = row.get("policy/entropy")
        uniform = entropy is not None and entropy >= 0.98 * self.max_entropy
        dead = row.get("optim/grad_norm") == 0.0 and row.get("reward/mean") == 0.0
        self.run = [*self.run, step] if (uniform or dead) else []
        if self.warned or len(self.run) < self.patience:
            return None
        self.warned = True
        why = (
            f"the policy's entropy is {entropy:.3g} nats, ln V = {self.max_entropy:.3g}: "
            "uniform over the vocabulary"
            if uniform
            else "reward 0 and gradient norm exactly 0: nothing is learned"
        )
        msg = (
            f"steps {self.run[0]}-{step}: training has collapsed ({why}). The numbers are "
            "finite but the run no longer learns; lower optim.lr (a rate too high for the "
            "model is the usual cause) or check the rewards, and start a new --workdir."
        )
        return msg
