"""Training's held-out evaluation: greedy accuracy and pass@k on the held-out split."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import jax

from gjax.data.prompts import PromptData
from gjax.errors import ConfigError
from gjax.evaluation.metrics import EvalError, Samples, parse_ks, summarize
from gjax.evaluation.sampling import Transfer, sample_and_score
from gjax.rollout import RolloutBackend, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HeldoutEval:
    """`config.eval` of a training run: what its held-out evaluation samples and reports."""

    num_samples: int  # n per problem for pass@k (0: greedy accuracy only)
    temperature: float
    top_p: float
    ks: tuple[int, ...]
    max_rows: int

    @classmethod
    def from_config(cls, eval_cfg) -> HeldoutEval:
        n = int(eval_cfg.num_samples)
        if n < 0:
            raise ConfigError(f"config.eval.num_samples must be >= 0, got {n}")
        if eval_cfg.max_rows < 1:
            raise ConfigError(f"config.eval.max_rows must be >= 1, got {eval_cfg.max_rows}")
        if n and not (eval_cfg.temperature > 0 and 0 < eval_cfg.top_p <= 1):
            raise ConfigError(
                "config.eval.temperature must be > 0 and config.eval.top_p in (0, 1] when "
                f"config.eval.num_samples > 0; got {eval_cfg.temperature}, {eval_cfg.top_p}"
            )
        try:
            ks = tuple(parse_ks(eval_cfg.pass_k, n, where="config.eval.pass_k")) if n else ()
        except EvalError as e:
            raise ConfigError(str(e)) from e
        return cls(n, float(eval_cfg.temperature), float(eval_cfg.top_p), ks, eval_cfg.max_rows)


class HeldoutSampler(Protocol):
    """What a held-out evaluation draws and scores its samples with, declared whole:
    `sample` has `sample_and_score`'s signature and contract (n scored samples per problem,
    the same batching and keys), `figures` are the extra figures of a call's samples, named
    without a prefix (`turns_mean`, ...; {} for single completions)."""

    def sample(self, backend, params, tokenizer, data, verifier, **kwargs) -> Samples: ...

    def figures(self, samples: Samples) -> dict[str, float]: ...


class SingleTurn:
    """Single completions (`sample_and_score`): a run without an environment (env.name '')."""

    def sample(self, backend, params, tokenizer, data, verifier, **kwargs) -> Samples:
        return sample_and_score(backend, params, tokenizer, data, verifier, **kwargs)

    def figures(self, samples: Samples) -> dict[str, float]:
        return {}


def check_config(config) -> None:
    """`config.eval` can work (pass@k against num_samples, the sampling): a hook of
    `gjax.config.validate`; raises ConfigError naming the field."""
    HeldoutEval.from_config(config.eval)


def heldout_metrics(
    backend: RolloutBackend,
    params,
    tokenizer,
    data: PromptData,
    verifier,
    settings: HeldoutEval,
    *,
    max_new_tokens: int,
    eos: tuple[int, ...],
    pad_id: int,
    greedy_temperature: float = 0.0,
    seed: int = 0,
    rollout_sampling: SamplingParams | None = None,
    rollout_shape: tuple[int, int] | None = None,
    progress: bool = False,
    transfer: Transfer | None = None,
    sampler: HeldoutSampler | None = None,
) -> dict[str, float]:
    """Training's held-out figures: ``eval/heldout_accuracy`` (one completion per problem at
    `greedy_temperature`, 0 = greedy) and, when ``settings.num_samples`` > 0,
    ``eval/heldout_pass@k`` for each k (n samples at the settings' temperature and top-p).

    When the pass@k sampling equals the training rollout's (`rollout_sampling`), the samples
    are drawn in the rollout's batch shape (`rollout_shape` = (P, G), prompts padded to
    ``data.max_prompt_length`` as the rollouts are): the sampler's compiled program is the
    rollout's own, so the evaluation adds no compilation to the run.

    A serving backend's dropped requests count as wrong answers and are reported:
    ``eval/heldout_dropped`` (greedy completions) and ``eval/heldout_sampled_dropped``
    (pass@k samples), present only when some were dropped, and a warning; a batch whose
    requests were all dropped raises ServingFailed (`sample_and_score`).

    `sampler` draws and scores the samples: single completions (`SingleTurn`, the default),
    or a multi-turn run's episodes (`gjax.evaluation.episodes.EpisodeSampler`), whose
    figures are added as ``eval/heldout_<name>`` (greedy) and ``eval/heldout_sampled_<name>``
    (the pass@k samples)."""
    sampler = sampler if sampler is not None else SingleTurn()
    rng = jax.random.fold_in(jax.random.key(seed), 0xE7A1)
    greedy = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=greedy_temperature,
        stop_token_ids=eos,
        pad_token_id=pad_id,
    )
    s = sampler.sample(
        backend,
        params,
        tokenizer,
        data,
        verifier,
        num_samples=1,
        sampling=greedy,
        rng=rng,
        max_rows=settings.max_rows,
        progress="eval greedy" if progress else False,
        transfer=transfer,
    )
    out = {"eval/heldout_accuracy": float(s.correct_PxN.mean())}
    _count_dropped(out, "eval/heldout_dropped", s, "greedy completions")
    out.update({f"eval/heldout_{k}": v for k, v in sampler.figures(s).items()})
    if settings.num_samples:
        sampled = dataclasses.replace(
            greedy, temperature=settings.temperature, top_p=settings.top_p
        )
        shared = rollout_shape is not None and sampled == rollout_sampling
        s = sampler.sample(
            backend,
            params,
            tokenizer,
            data,
            verifier,
            num_samples=settings.num_samples,
            sampling=sampled,
            rng=jax.random.fold_in(rng, 1),
            max_rows=settings.max_rows,
            batch_shape=rollout_shape if shared else None,
            width=data.max_prompt_length if shared else None,
            progress=f"eval pass@{settings.ks[-1]}" if progress else False,
            transfer=transfer,
        )
        for k, v in summarize(s, settings.ks).items():
            if k.startswith("pass@"):
                out[f"eval/heldout_{k}"] = v
        _count_dropped(out, "eval/heldout_sampled_dropped", s, "pass@k samples")
        out.update({f"eval/heldout_sampled_{k}": v for k, v in sampler.figures(s).items()})
    return out


def _count_dropped(out: dict, key: str, samples, what: str) -> None:
    if samples.dropped_PxN is None or not samples.dropped_PxN.any():
        return
    count, total = int(samples.dropped_PxN.sum()), samples.dropped_PxN.size
    out[key] = float(count)
    log.warning(
        "held-out evaluation: %d of %d %s were dropped by the server and count as wrong answers",
        count,
        total,
        what,
    )
