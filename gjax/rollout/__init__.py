"""Rollouts: the backend seam and the local jit sampler (`backend.py`, `sampler.py`), the
host orchestrator of a step's batch (`collect.py`), the producer the training loop asks for
batches (`producer.py`), and the JetStream engine, backends and weight push."""

from gjax.rollout.backend import LocalSampler, RolloutBackend
from gjax.rollout.sampler import SampleOutput, SamplingParams, generate

__all__ = ["LocalSampler", "RolloutBackend", "SampleOutput", "SamplingParams", "generate"]
