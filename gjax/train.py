"""gjax's training program.

    python -m gjax.train --config=configs/a_grae.py[:tiny] [--config.x.y=v ...] [--workdir=DIR]

main() reads top to bottom: config -> mesh -> model -> data -> rewards -> state (fresh or
resumed) -> held-out eval -> the RL loop -> held-out eval -> summary. Each RL step:
rollout (sampler; rewards on the host overlap old/ref log-probs on the device) -> group
selection (DAPO dynamic sampling / GPG beta_th) -> one jitted update -> metrics pulled one
step late. SIGTERM or Ctrl-C (SIGINT) finishes the step, saves a checkpoint and exits with
status 128 + the signal's number (143, 130), so a supervisor sees an unfinished run; a second
one exits at once, unsaved. A rerun with the same --workdir resumes exactly. A run stops at
once (exit 2, one paragraph) when training diverges or a checkpoint cannot be saved; the last
intact checkpoint is named and kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from configs import common
from gjax import checkpoint as ckpt_lib
from gjax import cli, model_record, multihost, paths, sharding
from gjax import stopping as stopping_lib
from gjax.config import ConfigError, check_model, validate
from gjax.data.builders import build_prompt_data, build_sharded_prompts
from gjax.data.iterator import PromptIterator
from gjax.embedded import resolve_model_path
from gjax.evaluation import heldout as eval_lib
from gjax.health import CollapseWatch, Diverged
from gjax.metrics import MetricsWriter, to_host, workdir_layout
from gjax.models import hf_import as hf_io
from gjax.rewards.pipeline import build_rewards
from gjax.rewards.verifier import Verifier
from gjax.rollout import LocalSampler, RolloutBackend
from gjax.rollout import pipeline as rollout_pipeline
from gjax.trainer import Rollout, build_learner

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/<algo>.py[:arg]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Output dir (local or gs://); resumes if it has checkpoints. Default: workdirs/<algo>.",
)
_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed",
    False,
    "Multi-process run: jax.distributed.initialize() (auto-detected on TPU VMs; elsewhere "
    "give the three flags below or JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID).",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (implies --jax_distributed)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")

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


def make_backend(
    config, cfg, params=None, *, mesh=None, workdir=None, tokenizer=None
) -> RolloutBackend:
    if config.rollout.backend == "local":
        return LocalSampler(cfg)
    if jax.process_count() > 1:
        raise ConfigError(
            f"config.rollout.backend={config.rollout.backend!r} serves one process's rollouts; "
            "a multi-process run samples with 'local' (each host its own rows)"
        )
    try:
        from gjax.rollout import jetstream_backend
    except ImportError as e:
        raise ConfigError(
            f"config.rollout.backend={config.rollout.backend!r} needs JetStream ({e}); install "
            "it with `pip install --no-deps google-jetstream==0.2.2` on top of the test extra "
            "(or `pip install -e '.[jetstream]'`, which also pulls TensorFlow), or use 'local'"
        ) from e
    return jetstream_backend.from_config(
        config, cfg, params, mesh=mesh, workdir=workdir, tokenizer=tokenizer
    )


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if _DISTRIBUTED.value or _COORDINATOR.value:
        multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if not multihost.is_primary():  # process 0 logs; the others only warn
        logging.getLogger().setLevel(logging.WARNING)
    config = _CONFIG.value
    # Local (relative or absolute) or gs://; every file below is written through epath.
    workdir = str(paths.resolve(_WORKDIR.value or os.path.join("workdirs", config.algo)))

    # --- config -------------------------------------------------------------------------
    mesh_shape = validate(config, jax.device_count())
    # The policy's config.json: found, supported, long enough; no weight is read yet.
    model_path = check_model(config, resolve_model_path(config.model.path))
    obj_cfg = common.to_objective_config(config.objective)
    eval_settings = eval_lib.HeldoutEval.from_config(config.eval)
    try:
        if multihost.is_primary():
            paths.write_text(
                os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2)
            )
    except Exception as e:  # any filesystem's error (local, gcsfs): report it as the user's
        hint = " (gs:// needs the gcs extra and credentials)" if paths.is_url(workdir) else ""
        raise ConfigError(
            f"--workdir {workdir!r} is not writable{hint}: {type(e).__name__}: {e}"
        ) from e

    # --- mesh ---------------------------------------------------------------------------
    mesh, rollout_mesh = sharding.make_meshes(mesh_shape, config.mesh.rollout_devices)
    log.info("mesh %s over %d devices", mesh_shape, jax.device_count())
    # Jitted functions traced from here on see the mesh and the logical-axis rules, so the
    # model's activation sharding constraints take effect.
    scope = contextlib.ExitStack()
    scope.enter_context(jax.set_mesh(mesh))
    scope.enter_context(sharding.use_rules())

    # --- model --------------------------------------------------------------------------
    cfg, params, tok = hf_io.load_policy(model_path, config.model, mesh)
    if multihost.is_primary():
        model_record.save(workdir, cfg, model_path)  # WORKDIR/model: what an export needs
    T = config.rollout.max_new_tokens
    # A frozen copy of the initial policy, kept only when the objective has a KL term.
    ref_params = jax.tree.map(lambda x: x.copy(), params) if obj_cfg.kl_beta > 0 else None

    # --- data ---------------------------------------------------------------------------
    P = config.rollout.prompts_per_step
    train_data = build_sharded_prompts(config.data, tok)  # each process templates its share
    heldout = build_prompt_data(config.data, tok, heldout=True)
    if config.anchors.per_group and not train_data.has_demonstrations:
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
    state, steps = build_learner(config, mesh=mesh, cfg=cfg, obj_cfg=obj_cfg, params=params)
    steps.layout.check_rows(P, "config.rollout.prompts_per_step")
    checkpointer = ckpt_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.checkpoint.keep,
        save_interval_steps=config.checkpoint.every,
        async_save=config.checkpoint.async_save,
    )
    meta = {"data": None, "history": [], "heldout_accuracy_before": None}
    if checkpointer.latest_step() is not None:
        _, state, meta = checkpointer.restore(
            state, fingerprint=fingerprint(config), move_damaged=multihost.is_primary()
        )
        log.info("resumed from step %d in %s", int(state.step), workdir)
    start = int(state.step)
    if start >= config.train.steps and multihost.is_primary():
        print(
            f"{workdir} is already at step {start} >= train.steps={config.train.steps}: nothing "
            "to train (raise --config.train.steps to train further).",
            flush=True,
        )
    data_iter = PromptIterator(  # this process's block of every global batch
        train_data,
        global_batch_size=P,
        seed=config.data.shuffle_seed,
        shuffle=config.data.shuffle,
        state=meta["data"],
        process_index=steps.layout.block,
        process_count=steps.layout.count,
    )
    backend = make_backend(config, cfg, state.params, mesh=mesh, workdir=workdir, tokenizer=tok)
    rollout = Rollout(
        cfg=cfg, backend=backend, tokenizer=tok, pipeline=pipeline, steps=steps, config=config
    )

    def evaluate(params) -> dict[str, float]:
        """Greedy held-out accuracy and pass@k (gjax.eval), with its own progress bar."""
        return eval_lib.heldout_metrics(
            backend,
            params,
            tok,
            heldout,
            verifier,
            eval_settings,
            max_new_tokens=T,
            eos=rollout.eos,
            pad_id=rollout.pad_id,
            greedy_temperature=config.rollout.eval_temperature,
            seed=config.seed,
            rollout_sampling=rollout.sampling,
            rollout_shape=(P, config.rollout.num_samples - config.anchors.per_group),
            progress=config.log.progress and multihost.is_primary(),
            transfer=steps,
        )

    # From here on SIGTERM / Ctrl-C stop the run at the end of a step, with a checkpoint.
    stop = {"signal": None}
    stopping_lib.install(stop)

    # --- held-out accuracy before training ----------------------------------------------
    if meta["heldout_accuracy_before"] is None:
        meta["heldout_before"] = evaluate(state.params)
        meta["heldout_accuracy_before"] = meta["heldout_before"]["eval/heldout_accuracy"]
    before = meta.get("heldout_before") or {
        "eval/heldout_accuracy": meta["heldout_accuracy_before"]
    }
    log.info("held-out before: %s", _fmt_eval(before))

    # --- the RL loop --------------------------------------------------------------------
    writer = None  # process 0 writes metrics; every process computes the same rows
    if multihost.is_primary():
        writer = MetricsWriter(
            workdir,
            total_steps=config.train.steps,
            start_step=start,
            tensorboard=config.log.tensorboard,
            progress=config.log.progress,
            history=meta["history"],
        )
    watch = CollapseWatch(cfg.vocab_size)
    base_key = jax.random.key(config.seed)
    s = config.sampling
    pending = None  # (step, device metrics, host metrics): written one step late
    history = meta["history"]
    stopping = False  # agreed by every process: a signal may reach only one host
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
        if step == start and (stopping := multihost.any_process(stop["signal"] is not None)):
            break  # arrived before this run trained a step: nothing new to save
        checkpointer.check()  # a failed (asynchronous) save stops the run here, at once
        t0 = time.perf_counter()
        key = jax.random.fold_in(base_key, step)
        if producer is None:
            produced = rollout_pipeline.collect_step(
                rollout,
                data_iter,
                state.params,
                ref_params,
                key,
                P=data_iter.local_batch_size,  # this process's slots of the P
                sampling=s,
                allgather=multihost.allgather,
            )
        else:
            produced = producer.get(step)
        batch_groups, host_metrics = produced.groups, produced.metrics
        t_learn = time.perf_counter()
        # Before the update is dispatched (a host exchange after it would wait for it).
        num_tokens = multihost.allgather(batch_groups.completion_mask_PxGxN.sum()).sum()
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
            history.append(_finish(writer, watch, checkpointer, *pending, config=config))
        host_metrics["time/learner_dispatch_s"] = time.perf_counter() - t_learn
        host_metrics["time/step_s"] = time.perf_counter() - t0
        host_metrics["throughput/tokens_per_s"] = float(num_tokens / host_metrics["time/step_s"])
        pending = (step + 1, metrics, host_metrics)
        eval_now = config.log.eval_every and (step + 1) % config.log.eval_every == 0
        last = step + 1 == config.train.steps
        stopping = multihost.any_process(stop["signal"] is not None)  # all stop, or none
        save_now = checkpointer.should_save(step + 1) or stopping or last
        if save_now or eval_now:
            if eval_now:
                host_metrics.update(evaluate(state.params))
            history.append(_finish(writer, watch, checkpointer, *pending, config=config))
            pending = None
        if save_now:
            if writer is not None:  # the metrics a resume keeps are durable before their checkpoint
                writer.flush()
            data_state = data_iter.state() if producer is None else producer.data_state()
            meta.update(data=data_state, history=history, fingerprint=fingerprint(config))
            checkpointer.save(step + 1, state, meta, force=True)
        if stopping:
            break
    if producer is not None:
        producer.close()
    checkpointer.wait()
    if writer is not None:  # ends the progress bar's line: what follows has lines of its own
        writer.close()
    trained = int(state.step)
    signum = stop["signal"] or signal.SIGTERM  # a host that saw none stops with the others
    if stopping:
        name = signal.Signals(signum).name
        saved = f"checkpoint at step {trained} saved" if trained > start else "nothing new to save"
        print(
            f"{name}: stopped at step {trained}, {saved} in {checkpointer.directory}; "
            f"exit status {128 + signum}. Rerun the same command to resume.",
            file=sys.stderr,
            flush=True,
        )
    else:
        # --- held-out accuracy after training (every process samples; process 0 writes) --
        summary_path = os.path.join(workdir, "summary.json")
        summary = _read_json(summary_path) if trained == start else None
        stale = summary is None or summary.get("steps") != trained  # else: still true, kept
        if multihost.any_process(stale):  # every process evaluates, or none
            after = evaluate(state.params)
            summary = {
                "algo": config.algo,
                "steps": trained,  # what the model was trained for, whatever train.steps says
                "heldout_size": len(heldout),
                "heldout_accuracy_before": meta["heldout_accuracy_before"],
                "heldout_accuracy_after": after["eval/heldout_accuracy"],
                **_pass_at_k(before, "before"),
                **_pass_at_k(after, "after"),
            }
            if multihost.is_primary():
                paths.write_text(summary_path, json.dumps(summary, indent=2))
    if not stopping and multihost.is_primary():
        print(
            f"\nheld-out accuracy after {trained} steps: "
            f"{summary['heldout_accuracy_before']:.3f} -> {summary['heldout_accuracy_after']:.3f} "
            f"({summary['heldout_size']} problems)\n"
            + workdir_layout(
                workdir,
                checkpoint_steps=checkpointer.all_steps(),
                tensorboard=config.log.tensorboard,
            ),
            flush=True,
        )
    checkpointer.close()
    pipeline.close()
    verifier.close()
    if hasattr(backend, "close"):
        backend.close()
    scope.close()
    if stopping:
        sys.exit(128 + signum)


def _read_json(path: str) -> dict | None:
    try:
        return json.loads(paths.resolve(path).read_text())
    except (OSError, ValueError):
        return None


def _fmt_eval(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('eval/heldout_')} {v:.3f}" for k, v in metrics.items())


def _pass_at_k(metrics: dict[str, float], when: str) -> dict[str, float]:
    """`eval/heldout_pass@k` -> summary keys `heldout_pass@k_<when>` (config.eval sampling)."""
    return {
        f"{k.removeprefix('eval/')}_{when}": v
        for k, v in metrics.items()
        if k.startswith("eval/heldout_pass@")
    }


def _finish(
    writer: MetricsWriter | None,
    watch: CollapseWatch,
    checkpointer: ckpt_lib.Checkpointer,
    step: int,
    device_metrics,
    host_metrics,
    *,
    config: ml_collections.ConfigDict,
) -> dict:
    """Pulls a step's device metrics, checks them, writes them; returns the row."""
    row = {**to_host(device_metrics), **host_metrics}
    bad = [k for k in ("loss/total", "optim/grad_norm") if not np.isfinite(row.get(k, 0.0))]
    if bad and not config.train.allow_nonfinite:
        checkpointer.wait()  # so the checkpoint named below is complete
        raise Diverged(
            f"step {step}: non-finite {bad} ({ {k: row[k] for k in bad} }). "
            f"{checkpointer.last_intact()} Lower optim.lr (now {config.optim.lr:g}), check "
            "the rewards, or set --config.train.allow_nonfinite=True to continue anyway."
        )
    if writer is not None:
        writer.write(step, row)
        if collapsed := watch(step, row):
            writer.warn(collapsed)
    return {"step": step, **{k: v for k, v in row.items() if not k.startswith("time/")}}


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    cli.run(main)
