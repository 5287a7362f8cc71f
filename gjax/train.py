"""gjax's training program.

    python -m gjax.train --config=configs/a_grae.py[:tiny] [--config.x.y=v ...] [--workdir=DIR]

main() reads top to bottom: config -> mesh -> model -> data -> rewards -> state (fresh or
resumed) -> held-out eval -> the RL loop -> held-out eval -> summary. Each RL step:
rollout (sampler; rewards on the host overlap old/ref log-probs on the device) -> group
selection (DAPO dynamic sampling / GPG beta_th) -> one jitted update -> metrics pulled one
step late. SIGTERM saves a checkpoint and exits cleanly; a rerun with the same --workdir
resumes exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time

import jax
import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from configs import common
from gjax import checkpoint as ckpt_lib
from gjax import cli, sharding
from gjax.config import ConfigError, validate
from gjax.data.loading import PromptIterator, build_prompt_data
from gjax.embedded import resolve_model_path
from gjax.metrics import MetricsWriter, to_host
from gjax.models import hf_io
from gjax.rewards.pipeline import RewardPipeline
from gjax.rewards.registry import RewardSpec, build_reward
from gjax.rewards.verifier import Verifier
from gjax.rollout import LocalSampler, RolloutBackend, SamplingParams
from gjax.rollout import pipeline as rollout_pipeline
from gjax.trainer import Rollout, build_steps, init_state, make_optimizer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/<algo>.py[:arg]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Output dir (local or gs://); resumes if it has checkpoints. Default: workdirs/<algo>.",
)
_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed", False, "Call jax.distributed.initialize() (multi-host TPU VMs)."
)

log = logging.getLogger("gjax")


def fingerprint(config: ml_collections.ConfigDict) -> dict:
    """Config fields a resumed run must share with the checkpoint it resumes."""
    return {
        "model.path": config.model.path,
        "algo": config.algo,
        "objective": json.dumps(config.objective.to_dict(), sort_keys=True),
        "rollout.num_samples": config.rollout.num_samples,
        "rollout.prompts_per_step": config.rollout.prompts_per_step,
        "rollout.max_new_tokens": config.rollout.max_new_tokens,
        "data.source": config.data.source,
        "data.max_prompt_len": config.data.max_prompt_len,
        "anchors.per_group": config.anchors.per_group,
        "seed": config.seed,
    }


def make_backend(config, cfg) -> RolloutBackend:
    if config.rollout.backend == "local":
        return LocalSampler(cfg)
    raise ConfigError(
        f"config.rollout.backend={config.rollout.backend!r} is not available in this version; "
        "use 'local' (the jit sampler)"
    )


def evaluate(
    backend, params, tok, data, verifier, *, max_new_tokens, eos, pad_id, temperature, batch=128
) -> float:
    """pass@1 on held-out prompts (greedy at temperature 0), scored by the verifier."""
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_token_ids=eos,
        pad_token_id=pad_id,
    )
    batch = min(batch, len(data))
    it = PromptIterator(
        data, global_batch_size=batch, shuffle=False, num_epochs=1, process_index=0, process_count=1
    )
    correct, total = 0.0, 0
    for prompts in it:
        out = backend.generate(
            params,
            prompts.prompt_ids_PxS,
            prompts.prompt_mask_PxS,
            jax.random.key(0),
            num_samples=1,
            sampling=sampling,
        )
        ids, lengths = np.asarray(out.tokens_BxN), np.asarray(out.lengths_B)
        texts = tok.batch_decode([r[:n] for r, n in zip(ids, lengths)], skip_special_tokens=True)
        correct += float(verifier.score(texts, prompts.answers).sum())
        total += len(texts)
    return correct / max(total, 1)


def build_rewards(config, verifier) -> RewardPipeline:
    specs = []
    for item in config.reward.functions.split(","):
        name, _, weight = item.strip().partition(":")
        specs.append(RewardSpec(name, float(weight) if weight else 1.0))
    reward = build_reward(specs, verifier=verifier)
    judge = None
    if config.reward.judge == "rule":
        from gjax.rewards.rule_judge import RuleJudge

        judge = RuleJudge()
    elif config.reward.judge == "openai":
        from gjax.rewards.judge import OpenAIJudge

        r = config.reward
        judge = OpenAIJudge(
            base_url=r.judge_base_url,
            model=r.judge_model,
            api_key_env=r.judge_api_key_env,
            max_concurrency=r.judge_concurrency,
            timeout_s=r.judge_timeout_s,
            max_retries=r.judge_max_retries,
        )
    return RewardPipeline(
        {"reward": reward},
        judge=judge,
        on_missing=config.reward.judge_on_missing,
        fill_value=config.reward.judge_fill_score,
    )


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not flags.FLAGS["verbosity"].present:
        # orbax logs every save step by step (INFO, through absl); --verbosity=0 shows it.
        logging.getLogger("absl").setLevel(logging.WARNING)
    if _DISTRIBUTED.value:
        jax.distributed.initialize()
    config = _CONFIG.value
    workdir = _WORKDIR.value or os.path.join("workdirs", config.algo)
    if "://" not in workdir:
        workdir = os.path.abspath(workdir)  # orbax needs absolute paths

    # --- config -------------------------------------------------------------------------
    mesh_shape = validate(config, jax.device_count())
    obj_cfg = common.to_objective_config(config.objective)
    try:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    except OSError as e:
        raise ConfigError(f"--workdir {workdir!r} is not writable: {e}") from e

    # --- mesh ---------------------------------------------------------------------------
    mesh, rollout_mesh = sharding.make_meshes(mesh_shape, config.mesh.rollout_devices)
    log.info("mesh %s over %d devices", mesh_shape, jax.device_count())
    # Jitted functions traced from here on see the mesh and the logical-axis rules, so the
    # model's activation sharding constraints take effect.
    scope = contextlib.ExitStack()
    scope.enter_context(jax.set_mesh(mesh))
    scope.enter_context(sharding.use_rules())

    # --- model --------------------------------------------------------------------------
    model_path = resolve_model_path(config.model.path)
    cfg, params = hf_io.load_pretrained(
        model_path,
        mesh=mesh,
        param_dtype=config.model.param_dtype,
        dtype=config.model.dtype,
        remat=config.model.remat,
    )
    tok = hf_io.load_tokenizer(model_path)
    S, T = config.data.max_prompt_len, config.rollout.max_new_tokens
    if cfg.max_position_embeddings < S + T:
        raise ConfigError(
            f"config.data.max_prompt_len + config.rollout.max_new_tokens = {S + T} exceeds the "
            f"model's max_position_embeddings={cfg.max_position_embeddings}"
        )
    # A frozen copy of the initial policy, kept only when the objective has a KL term.
    ref_params = jax.tree.map(lambda x: x.copy(), params) if obj_cfg.kl_beta > 0 else None

    # --- data ---------------------------------------------------------------------------
    P = config.rollout.prompts_per_step
    train_data = build_prompt_data(config.data, tok)
    heldout = build_prompt_data(config.data, tok, heldout=True)
    if config.anchors.per_group and not any(train_data.demonstrations):
        raise ConfigError(
            "config.anchors.per_group > 0 needs demonstrations: set "
            "config.data.demonstration_field to the column holding them"
        )
    log.info(
        "data: %d train prompts, %d held-out (%s)", len(train_data), len(heldout), train_data.stats
    )

    # --- rewards ------------------------------------------------------------------------
    verifier = Verifier(timeout_s=config.reward.timeout_s, num_workers=config.reward.workers)
    pipeline = build_rewards(config, verifier)

    # --- state: fresh or resumed --------------------------------------------------------
    tx, schedule = make_optimizer(
        config.optim,
        config.train.steps,
        updates_per_step=config.train.minibatches * config.train.num_iterations,
    )
    state, state_shardings = init_state(params, tx, mesh)
    steps = build_steps(
        mesh=mesh,
        cfg=cfg,
        obj_cfg=obj_cfg,
        tx=tx,
        state_shardings=state_shardings,
        train_cfg=config.train,
        schedule=schedule,
    )
    checkpointer = ckpt_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.checkpoint.keep,
        save_interval_steps=config.checkpoint.every,
        async_save=config.checkpoint.async_save,
    )
    meta = {"data": None, "history": [], "heldout_accuracy_before": None}
    if checkpointer.latest_step() is not None:
        _, state, meta = checkpointer.restore(state, fingerprint=fingerprint(config))
        log.info("resumed from step %d in %s", int(state.step), workdir)
    start = int(state.step)
    data_iter = PromptIterator(
        train_data,
        global_batch_size=P,
        seed=config.data.shuffle_seed,
        shuffle=config.data.shuffle,
        state=meta["data"],
    )
    backend = make_backend(config, cfg)
    rollout = Rollout(
        cfg=cfg, backend=backend, tokenizer=tok, pipeline=pipeline, steps=steps, config=config
    )
    eval_kw = dict(
        max_new_tokens=T,
        eos=rollout.eos,
        pad_id=rollout.pad_id,
        temperature=config.rollout.eval_temperature,
    )

    # --- held-out accuracy before training ----------------------------------------------
    if meta["heldout_accuracy_before"] is None:
        meta["heldout_accuracy_before"] = evaluate(
            backend, state.params, tok, heldout, verifier, **eval_kw
        )
    log.info("held-out accuracy before: %.3f", meta["heldout_accuracy_before"])

    # --- the RL loop --------------------------------------------------------------------
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    writer = MetricsWriter(
        workdir,
        total_steps=config.train.steps,
        start_step=start,
        tensorboard=config.log.tensorboard,
        progress=config.log.progress,
    )
    base_key = jax.random.key(config.seed)
    s = config.sampling
    pending = None  # (step, device metrics, host metrics): written one step late
    history = meta["history"]
    producer = None  # rollouts on their own thread (and mesh): gjax.rollout.pipeline
    if config.rollout.max_staleness > 0 or rollout_mesh is not mesh:
        producer = rollout_pipeline.start_producer(
            rollout=rollout,
            data_iter=data_iter,
            params=state.params,
            base_key=base_key,
            config=config,
            start=start,
            train_mesh=mesh,
            rollout_mesh=rollout_mesh,
            backend=backend,
        )
    for step in range(start, config.train.steps):
        t0 = time.perf_counter()
        key = jax.random.fold_in(base_key, step)
        if producer is None:
            produced = rollout_pipeline.collect_step(
                rollout, data_iter, state.params, ref_params, key, P=P, sampling=s
            )
        else:
            produced = producer.get(step)
        batch_groups, host_metrics = produced.groups, produced.metrics
        t_learn = time.perf_counter()
        if producer is None:
            batch = steps.put_batch(rollout.model_inputs(batch_groups))
        else:
            batch = rollout_pipeline.learner_batch(
                steps, rollout, batch_groups, state.params, ref_params
            )
        state, metrics = steps.update(state, batch, jax.random.fold_in(key, 10_000))
        if producer is not None:
            producer.push(state.params, step + 1)
        if pending is not None:
            history.append(_finish(writer, *pending, allow_nonfinite=config.train.allow_nonfinite))
        host_metrics["time/learner_dispatch_s"] = time.perf_counter() - t_learn
        host_metrics["time/step_s"] = time.perf_counter() - t0
        host_metrics["throughput/tokens_per_s"] = float(
            batch_groups.completion_mask_PxGxN.sum() / host_metrics["time/step_s"]
        )
        pending = (step + 1, metrics, host_metrics)
        eval_now = config.log.eval_every and (step + 1) % config.log.eval_every == 0
        last = step + 1 == config.train.steps
        save_now = checkpointer.should_save(step + 1) or bool(stop["signal"]) or last
        if save_now or eval_now:
            if eval_now:
                host_metrics["eval/heldout_accuracy"] = evaluate(
                    backend, state.params, tok, heldout, verifier, **eval_kw
                )
            history.append(_finish(writer, *pending, allow_nonfinite=config.train.allow_nonfinite))
            pending = None
        if save_now:
            data_state = data_iter.state() if producer is None else producer.data_state()
            meta.update(data=data_state, history=history, fingerprint=fingerprint(config))
            checkpointer.save(step + 1, state, meta, force=True)
        if stop["signal"]:
            log.warning("signal %s: checkpoint at step %d saved; exiting", stop["signal"], step + 1)
            break
    if producer is not None:
        producer.close()
    checkpointer.wait()
    if not stop["signal"]:
        # --- held-out accuracy after training -------------------------------------------
        after = evaluate(backend, state.params, tok, heldout, verifier, **eval_kw)
        summary = {
            "algo": config.algo,
            "steps": config.train.steps,
            "heldout_size": len(heldout),
            "heldout_accuracy_before": meta["heldout_accuracy_before"],
            "heldout_accuracy_after": after,
        }
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(
            f"held-out accuracy: before {summary['heldout_accuracy_before']:.3f} -> "
            f"after {after:.3f} ({len(heldout)} problems); summary: "
            f"{os.path.join(workdir, 'summary.json')}"
        )
    writer.close()
    checkpointer.close()
    pipeline.close()
    verifier.close()
    scope.close()


def _finish(
    writer: MetricsWriter, step: int, device_metrics, host_metrics, *, allow_nonfinite: bool
) -> dict:
    """Pulls a step's device metrics, checks them, writes them; returns the row."""
    row = {**to_host(device_metrics), **host_metrics}
    bad = [k for k in ("loss/total", "optim/grad_norm") if not np.isfinite(row.get(k, 0.0))]
    if bad and not allow_nonfinite:
        raise FloatingPointError(
            f"step {step}: non-finite {bad} ({ {k: row[k] for k in bad} }); the last checkpoint "
            "is intact. Lower optim.lr, check the rewards, or set "
            "--config.train.allow_nonfinite=True to continue anyway."
        )
    writer.write(step, row)
    return {"step": step, **{k: v for k, v in row.items() if not k.startswith("time/")}}


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    cli.run(main)
