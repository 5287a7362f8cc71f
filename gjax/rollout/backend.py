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

import dataclasses
import functools
from typing import Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from gjax import multihost, sharding
from gjax.models import lora, quant
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
    same contract).

    `quantize` (`rollout.quantize`: none | int8 | fp8): the sampler decodes a quantized copy
    of the params it is given (`quant.quantize_policy`: projection codes with per-output-
    channel scales, consumed by the prefill and decode matmuls directly), made once per
    version (a push, or the first `generate` with new params; a LoRA policy's frozen base
    once, its float adapters added on top). The learner keeps its float params, so the
    sampled log-probs are the quantized behaviour policy's (`objective.behaviour_correction`).
    """

    returns_logps = True

    def __init__(self, cfg: ModelConfig, decoder=None, quantize: str = "none"):
        self.cfg = cfg
        self.decoder = decoder
        self.quantize = quantize
        self._local_base = None  # (key, this process's copy of a LoRA policy's frozen base)
        self._quantized = None  # (source leaves, their quantized copy): the served version

    def _served(self, params):
        """What the sampler decodes: `params`, or their quantized copy (made once per tree:
        the same leaves give the same copy)."""
        if self.quantize == "none":
            return params
        base, adapters = lora.split(params)
        source = jax.tree.leaves(base)
        held = self._quantized
        if (
            held is None
            or len(held[0]) != len(source)
            or any(a is not b for a, b in zip(held[0], source))
        ):
            self._quantized = None  # the old copy goes before the new one is made
            self._quantized = (source, _quantize_jit(base, self.quantize))
        served = self._quantized[1]
        return lora.merge(served, adapters) if adapters else served

    def generate(
        self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling
    ) -> SampleOutput:
        params = self._served(params)
        if self.decoder is not None and _spans_processes(prompt_tokens_PxS):
            return self._process_rows(
                params, prompt_tokens_PxS, prompt_mask_PxS, rng, num_samples, sampling
            )
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

    def generate_episodes(
        self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling, turns
    ):
        """Multi-turn rows (`gjax.rollout.turns.Trajectories`): each row an episode of
        `turns`' environment on the continuous decoder (`ContinuousDecoder.generate_episodes`),
        on the served (possibly quantized) params, as `generate`. Host prompts: this process's
        rows. Global row-sharded prompts (several processes, the loop's thread): each process
        decodes its own block on its own devices (`_on_process_devices`), and `turns` are that
        block's episodes; the trajectories returned are this process's rows, on the host.
        Here only with the continuous decoder (`gjax.envs.check_config` refuses the static
        sampler); the JetStream clients have their own (the history resent each turn)."""
        if self.decoder is None:
            raise ValueError("generate_episodes needs the continuous decoder (rollout.decoder)")
        params = self._served(params)
        decode = functools.partial(
            self.decoder.generate_episodes, num_samples=num_samples, turns=turns
        )
        if _spans_processes(prompt_tokens_PxS):
            _, traj = self._on_process_devices(
                decode, params, prompt_tokens_PxS, prompt_mask_PxS, rng, sampling
            )
            return traj
        return decode(params, prompt_tokens_PxS, prompt_mask_PxS, rng, sampling=sampling)

    def episode_stats(self) -> dict[str, float]:
        """This thread's last `generate_episodes` batch's figures (the decoder's stats)."""
        return self.decoder.stats

    def _process_rows(self, params, tokens_PxS, mask_PxS, rng, num_samples, sampling):
        """The continuous decoder on global row-sharded prompts (several processes, the loop's
        thread), each process its own block (`_on_process_devices`); the rows go back as
        global arrays sharded like the prompts."""
        decode = functools.partial(self.decoder.generate, num_samples=num_samples)
        layout, out = self._on_process_devices(decode, params, tokens_PxS, mask_PxS, rng, sampling)
        return SampleOutput(*(multihost.put_rows(np.asarray(x), layout) for x in out[:4]))

    def _on_process_devices(self, decode, params, tokens_PxS, mask_PxS, rng, sampling):
        """(layout, `decode(params, tokens, mask, rng, sampling=...)` on this process's block
        of the global row-sharded prompts, on its own devices of their mesh): the params as
        `sharding.process_local_copy` makes them (sharded over this process's part of an axis
        the processes split, never a whole copy per device), this process's copy of the
        replicated key, and row keys of the whole batch (`row_block`), so the rows equal one
        process's with that layout."""
        layout = multihost.RowLayout(tokens_PxS.sharding)
        mesh = tokens_PxS.sharding.mesh
        local_mesh = sharding.process_mesh(mesh)
        local_params = self._process_local(params, mesh, local_mesh)
        with jax.set_mesh(local_mesh), sharding.use_rules():
            out = decode(
                local_params,
                multihost.local_rows(tokens_PxS, layout),
                multihost.local_rows(mask_PxS, layout),
                jax.device_put(rng.addressable_data(0), NamedSharding(local_mesh, PS())),
                sampling=dataclasses.replace(sampling, row_block=(layout.block, layout.count)),
            )
        return layout, out

    def _process_local(self, params, mesh, local_mesh):
        """`sharding.process_local_copy` of `params`; a LoRA policy's frozen base is copied
        once (while its arrays are the same), its adapters on every call. Every process makes
        the same copies in the same order (the base's identity changes on all of them alike)."""
        copy = sharding.process_local_copy(mesh, local_mesh)
        base, adapters = lora.split(params)
        if not adapters:
            return copy(params)
        key = (mesh, tuple(id(x) for x in jax.tree.leaves(base)))
        if self._local_base is None or self._local_base[0] != key:
            self._local_base = None  # the old copy goes before the new one is made
            self._local_base = (key, copy(base))
        return lora.merge(self._local_base[1], copy(adapters))

    def push(self, params) -> None:
        # `generate` samples with the params it is given (quantized here once per version)
        self._served(params)

    def metrics(self, gather=multihost.allgather) -> dict[str, float]:
        st = self.decoder.stats if self.decoder is not None else {}
        if not st.get("decode_steps"):
            return {}
        # Every process decodes its own rows: steps are the slowest's, the fractions pooled.
        keys = ("decode_steps", "slot_steps_live", "slots", "host_s", "wall_s")
        steps_H, live_H, slots_H, host_H, wall_H = gather(np.array([st[k] for k in keys])).T
        return {
            "rollout/decode_steps": float(steps_H.max()),
            # live rows per slot and step: what continuous batching keeps near 1
            "rollout/slot_occupancy": float(live_H.sum() / (steps_H * slots_H).sum()),
            "time/decode_host_fraction": float(host_H.sum() / wall_H.sum()),
        }

    def failure(self) -> str:
        return ""  # no request to drop: sampling errors are raised

    def close(self) -> None:
        pass


_quantize_jit = jax.jit(quant.quantize_policy, static_argnums=1)


def _spans_processes(x) -> bool:
    """`x` is a global array with rows on other processes' devices (a multi-process batch)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


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
