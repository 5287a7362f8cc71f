"""Rollouts: the `RolloutBackend` protocol and the local jit sampler.

The trainer talks to a backend only through `generate(...) -> SampleOutput`, so a serving
engine (JetStream) can replace `LocalSampler` later without touching the training loop.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from gjax.models.config import ModelConfig
from gjax.rollout.sampler import SampleOutput, SamplingParams, generate


@runtime_checkable
class RolloutBackend(Protocol):
    """Draws G completions per prompt from the current policy params (B = P*G, prompt-major)."""

    def generate(
        self,
        params,
        prompt_tokens_PxS: jax.Array,
        prompt_mask_PxS: jax.Array,
        rng: jax.Array,
        *,
        num_samples: int,
        sampling: SamplingParams,
    ) -> SampleOutput: ...


class LocalSampler:
    """`RolloutBackend` running `gjax.rollout.sampler.generate` in-process on the mesh."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def generate(
        self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling
    ) -> SampleOutput:
        return generate(
            params,
            self.cfg,
            prompt_tokens_PxS,
            prompt_mask_PxS,
            rng,
            num_samples=num_samples,
            sampling=sampling,
        )


__all__ = ["LocalSampler", "RolloutBackend", "SampleOutput", "SamplingParams", "generate"]
