"""Held-out pass@k at the end of a run against the base policy: n samples per held-out
problem with the final params and with the initial (base) params, k = 1..n (A-GRAE eq. (37)),
written to WORKDIR/passk.json (an earlier checkpoint's: passk_stepN.json, `passk_at_step`).

A multi-turn run's (config.env.name set) samples are episodes of its environment on a
continuous decoder of its rollout's shape, scored as the run's own held-out evaluation scores
them (gjax.evaluation.episodes: the verifier on the final policy turn of an episode the
environment ended), its prompts rendered with the tools they offer.

The base policy's figures depend only on the model, the held-out set and the sampling, not on
the variant; they are kept in `cache_dir` under a hash of those, so a study evaluates the base
once per seed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os

import jax
import numpy as np

from gjax import model_record, sharding
from gjax.checkpoint import Checkpointer
from gjax.config import resolve_mesh_shape
from gjax.data import builders as data_builders
from gjax.embedded import resolve_model_path
from gjax.envs import EnvRunner, build_env, prompt_tools
from gjax.errors import ConfigError
from gjax.evaluation.episodes import sample_episodes
from gjax.evaluation.metrics import pass_at_k
from gjax.evaluation.sampling import sample_and_score
from gjax.models import hf_import, lora
from gjax.rewards.functions import build_reward
from gjax.rewards.pipeline import reward_specs
from gjax.rewards.verifier import Verifier
from gjax.rollout import LocalSampler, SamplingParams
from gjax.rollout.backend import stop_and_pad
from gjax.rollout.factory import continuous_decoder
from gjax.rollout.turns import build_turns

PASSK_FILE = "passk.json"


def pass_at_ks(correct_P: np.ndarray, n: int) -> dict[str, float]:
    """{"pass@k": mean over problems} for k = 1..n from each problem's correct count."""
    return {
        f"pass@{k}": float(np.mean([pass_at_k(n, int(c), k) for c in correct_P]))
        for k in range(1, n + 1)
    }


@contextlib.contextmanager
def _samplers(config, verifier, tok):
    """(backend for a model config, scorer(backend, params, data, **kw) -> Samples): single
    completions, or episodes of the run's environment (its runner closed on exit)."""
    if not config.env.name:
        yield LocalSampler, functools.partial(sample_and_score, tokenizer=tok, verifier=verifier)
        return
    # The run's combined reward (the environment scores a final turn with it); no judge: an
    # episode's correctness is the verifier's alone.
    reward_fn = build_reward(reward_specs(config.reward.functions), verifier=verifier)
    with EnvRunner(build_env(config, reward_fn=reward_fn)) as runner:

        def episodes(backend, params, data, **kw):
            return sample_episodes(
                backend, params, tok, data, verifier,
                make_turns=lambda rows: build_turns(config, runner, rows, tok), **kw,
            )  # fmt: skip

        def backend(cfg):
            return LocalSampler(cfg, decoder=continuous_decoder(config.rollout, cfg))

        yield backend, episodes


def evaluate(
    config, workdir: str, *, num_samples: int, cache_dir: str, step: int | None = None
) -> dict:
    """Samples `num_samples` completions per held-out problem (the run's eval temperature and
    top-p) with the base params and with the last checkpoint's (or `step`'s); writes and
    returns passk.json (`passk_file(step)`)."""
    if config.env.name and jax.process_count() > 1:
        raise ConfigError(
            f"config.env.name={config.env.name!r}: experiments/passk.py samples a multi-turn "
            "run's episodes in one process; run it with one process"
        )
    n = num_samples
    base_key = _base_key(config, n)
    digest = _digest(base_key)
    base_path = os.path.join(cache_dir, f"base_{digest}.json")
    mesh = sharding.make_mesh(resolve_mesh_shape(config.mesh, jax.device_count()))
    with jax.set_mesh(mesh), sharding.use_rules():
        model_cfg, params, tok = hf_import.load_policy(
            resolve_model_path(config.model.path), config.model, mesh
        )
        heldout = heldout_prompts(config, tok)
        restored_step, final_cfg, final = restore_policy(
            config, workdir, model_cfg, params, mesh, step=step
        )
        eos, pad_id = stop_and_pad(model_cfg, tok)
        sampling = SamplingParams(
            max_new_tokens=config.rollout.max_new_tokens,
            temperature=config.eval.temperature,
            top_p=config.eval.top_p,
            stop_token_ids=eos,
            pad_token_id=pad_id,
        )
        rng = jax.random.fold_in(jax.random.key(config.seed), 0x9A55)
        r = config.reward
        with (
            Verifier(timeout_s=r.timeout_s, num_workers=r.workers) as verifier,
            _samplers(config, verifier, tok) as (make_backend, score),
        ):
            backends = {model_cfg: make_backend(model_cfg)}  # the base's, and a LoRA policy's
            backends.setdefault(final_cfg, make_backend(final_cfg))

            def correct_counts(p, cfg) -> list[int]:
                s = score(
                    backends[cfg], p, data=heldout, num_samples=n, sampling=sampling, rng=rng,
                    max_rows=config.eval.max_rows,
                )  # fmt: skip
                return s.correct_PxN.sum(-1).astype(int).tolist()

            base = read_result(base_path)
            if base is None:
                base = {"correct_counts": correct_counts(params, model_cfg), "key": base_key}
                _write(base_path, base)
            final_counts = correct_counts(final, final_cfg)
    out = result(
        base["correct_counts"],
        final_counts,
        n=n,
        step=int(restored_step),
        temperature=config.eval.temperature,
        top_p=config.eval.top_p,
        seed=config.seed,
        base_setup=base_setup(config),
    )
    _write(os.path.join(workdir, passk_file(step)), out)
    return out


def _base_key(config, n: int) -> dict:
    """What the base policy's samples depend on (the cache's key)."""
    key = {
        "model": [config.model.path, config.model.dtype, config.model.param_dtype],
        "data": data_builders.run_data_config(config),
        "sampling": [config.rollout.max_new_tokens, config.eval.temperature, config.eval.top_p],
        "n": n,
        "seed": config.seed,
    }
    if config.env.name:  # episodes: the environment is part of the sampling
        key["env"] = config.env.to_dict()
    return key


def base_setup(config) -> str:
    """The base policy's setup, which arms of a study that share it share their base row by
    (experiments.aggregate.base_groups): its samples' key less what varies by seed (the
    sampling seed, the training data's shuffle) or does not reach the held-out prompts (the
    demonstration column)."""
    key = _base_key(config, 0)
    del key["n"], key["seed"]
    key["data"] = {
        k: v for k, v in key["data"].items() if k not in ("shuffle_seed", "demonstration_field")
    }
    return _digest(key)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def heldout_prompts(config, tokenizer):
    """The run's held-out prompts, in the order `correct_counts` lists them (with the tools
    they offer, as the run renders them)."""
    return data_builders.build_prompt_data(
        data_builders.run_data_config(config),
        tokenizer,
        heldout=True,
        tools=prompt_tools(config.env),
    )


def restore_policy(config, workdir: str, model_cfg, params, mesh, *, step: int | None = None):
    """(step, model config, params) of the policy a run's last checkpoint (or `step`'s)
    holds: the params themselves, or with LoRA the base plus the saved adapters
    (`gjax.model_record.restore_lora`, digest-checked)."""
    if not config.model.lora.rank:
        restored, final = restore_run_params(params, workdir, step=step)
        return restored, model_cfg, final
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        restored, cfg, adapters, base = model_record.restore_lora(
            ckpt, model_cfg, config.model.to_dict(), step, mesh
        )
    finally:
        ckpt.close()
    return restored, cfg, lora.merge(base, adapters)


def restore_run_params(like, workdir: str, *, step: int | None = None) -> tuple[int, object]:
    """(step, params) of a run's last checkpoint (or `step`'s), on the shardings of `like`."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        return ckpt.restore_params(abstract, step=step)
    finally:
        ckpt.close()


def passk_file(step: int | None) -> str:
    """The run's own pass@k (its last checkpoint) or that of an earlier checkpoint."""
    return PASSK_FILE if step is None else f"passk_step{step}.json"


def result(base_counts, final_counts, *, n: int, **settings) -> dict:
    """passk.json: each problem's correct count of n and pass@k for k = 1..n, base and final."""
    return {
        "n": n,
        "problems": len(final_counts),
        **settings,
        "base": {"correct_counts": list(base_counts), **pass_at_ks(np.asarray(base_counts), n)},
        "final": {"correct_counts": list(final_counts), **pass_at_ks(np.asarray(final_counts), n)},
    }


def read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, obj: dict) -> None:
    """Whole or not at all: another worker may read it at any time."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
