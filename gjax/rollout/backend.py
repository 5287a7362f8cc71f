"""The rollout backend seam: what samples completions for the trainer, declared whole.

A backend draws G completions per prompt from given params (`generate`), may serve its own
copy of the weights (`push`), reports per-batch serving figures (`metrics`) and holds
resources until `close`. `returns_logps` says whether `SampleOutput.logps_BxN` are the
behaviour policy's log-probs (the local sampler's and the in-process JetStream engine's are;
a gRPC reply carries token ids only, so the learner recomputes them by teacher forcing).

`gjax.rollout.factory.make_backend` chooses one from `config.rollout.backend` once, at set-up;
`stop_and_pad` and `rollout_sampling` here are the one definition of the run's stop ids, pad
id and sampling.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from gjax import multihost
from gjax.models.config import ModelConfig
from gjax.rollout.sampler import SampleOutput, SamplingParams, generate


@runtime_checkable
class RolloutBackend(Protocol):
    """Draws G completions per prompt from the policy (B = P*G rows, prompt-major)."""

    returns_logps: bool  # SampleOutput.logps_BxN are the behaviour policy's log-probs

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

    def push(self, params) -> int | None:
        """Serves `params` from now on (a backend holding weights of its own); returns the
        version it serves them as, or None where `generate`'s params are used directly."""
        ...

    def metrics(self, gather=multihost.allgather) -> dict[str, float]:
        """The last batch's serving figures, for the step's metrics row ({} if none); a
        backend whose figures are per process combines them through `gather` (the rollout's
        host exchange: `multihost.allgather`, or a producer thread's `KeyValueGather`)."""
        ...

    def failure(self) -> str:
        """Who failed the last batch's dropped requests and the last error, for a user's
        message ('' for a backend whose requests cannot be dropped)."""
        ...

    def close(self) -> None: ...


class LocalSampler:
    """`RolloutBackend` decoding in-process: `gjax.rollout.sampler.generate` (static, on the
    mesh), or with `decoder` a `gjax.rollout.decoder.ContinuousDecoder` (its `generate` has the
    same contract)."""

    returns_logps = True

    def __init__(self, cfg: ModelConfig, decoder=None):
        self.cfg = cfg
        self.decoder = decoder

    def generate(
        self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling
    ) -> SampleOutput:
        if self.decoder is not None:
            return self.decoder.generate(
                params,
                prompt_tokens_PxS,
                prompt_mask_PxS,
                rng,
                num_samples=num_samples,
                sampling=sampling,
            )
        return generate(
            params,
            self.cfg,
            prompt_tokens_PxS,
            prompt_mask_PxS,
            rng,
            num_samples=num_samples,
            sampling=sampling,
        )

    def push(self, params) -> None:
        del params  # `generate` samples with the params it is given

    def metrics(self, gather=multihost.allgather) -> dict[str, float]:
        del gather  # one process's figures (the continuous decoder runs in one process)
        st = self.decoder.stats if self.decoder is not None else {}
        if not st.get("decode_steps"):
            return {}
        return {
            "rollout/decode_steps": float(st["decode_steps"]),
            # live rows per slot and step: what continuous batching keeps near 1
            "rollout/slot_occupancy": st["slot_steps_live"] / (st["decode_steps"] * st["slots"]),
            "rollout/host_fraction": st["host_s"] / st["wall_s"],
        }

    def failure(self) -> str:
        return ""  # no request to drop: sampling errors are raised

    def close(self) -> None:
        pass


def stop_and_pad(cfg: ModelConfig, tokenizer) -> tuple[tuple[int, ...], int]:
    """(stop ids, pad id) of every rollout and evaluation: the model's EOS ids (its
    generation config's), else the tokenizer's; pad is the tokenizer's, else the first stop."""
    eos = tuple(cfg.eos_token_id) or (tokenizer.eos_token_id,)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return eos, pad


def rollout_sampling(config, model_cfg: ModelConfig, tokenizer) -> SamplingParams:
    """The training rollout's `SamplingParams` (`config.rollout`)."""
    eos, pad = stop_and_pad(model_cfg, tokenizer)
    r = config.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        stop_token_ids=eos,
        pad_token_id=pad,
    )
