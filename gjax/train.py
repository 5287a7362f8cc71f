"""gjax's training program.

    python -m gjax.train --config=configs/a_grae.py[:tiny] [--config.x.y=v ...] [--workdir=DIR]

`train(config, workdir)` reads top to bottom: config -> mesh -> model -> data -> rewards,
backend, learner (fresh or resumed) -> held-out eval -> one RL loop -> held-out eval and
summary. Each step asks the producer for its batch (`gjax.rollout.producer`: rollouts sampled,
scored and selected on this thread, or on their own thread up to k versions stale), makes the
learner's device batch (old/reference log-probs teacher-forced where needed), runs one jitted
update, hands the params back to the producer and writes the previous step's metrics.

SIGTERM or Ctrl-C (SIGINT) finishes the step, saves a checkpoint and exits with status 128 +
the signal's number (143, 130), so a supervisor sees an unfinished run; a second one exits at
once, unsaved. In a multi-process run a signal that reached one process stops them all (each
with that status; one that received none names the process that did). A rerun with the same
--workdir resumes exactly; one whose config changes training is refused at start unless
train.allow_config_change (`gjax.config_record`). A run stops at once (exit 2, one
paragraph) when training diverges or a checkpoint cannot be saved; the last intact
checkpoint is named and kept.

Faults end within bounded time, with one paragraph and exit status 2: a workdir holds one run
(`WORKDIR/.lock`, `gjax.runlock`); a multi-process start-up waits --peer_timeout_s for its
peers, saying so; a dead peer ends the survivors in about 20-40 s (`gjax.multihost`); a live
peer late to a collective (compiling under load) is waited for --collective_timeout_s, past
which every process stops (`collective_faults`); storage that fails or hangs is retried for
config.train.storage_timeout_s. Each names the last intact checkpoint where a run was under
way.
"""

from __future__ import annotations

import contextlib
import functools
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

from gjax import checkpoint as ckpt_lib
from gjax import (
    cli,
    compile_cache,
    config_record,
    model_record,
    multihost,
    paths,
    runlock,
    schema,
    sharding,
    wandb_log,
)
from gjax import stopping as stopping_lib
from gjax.config import check_model, validate
from gjax.data import builders as data_builders
from gjax.data.builders import build_prompt_data, build_sharded_prompts
from gjax.data.iterator import PromptIterator
from gjax.embedded import resolve_model_path
from gjax.envs import environments as envs_environments
from gjax.errors import ConfigError, format_user_error
from gjax.evaluation import episodes as eval_episodes
from gjax.evaluation import heldout as eval_lib
from gjax.health import CollapseWatch, Diverged
from gjax.learner import build_learner
from gjax.metrics import MetricsWriter, to_host, workdir_layout
from gjax.models import hf_import, lora
from gjax.rewards import pipeline as rewards_pipeline
from gjax.rewards.pipeline import build_rewards, build_verifier
from gjax.rollout import factory as rollout_factory
from gjax.rollout.collect import ServingFailed
from gjax.rollout.episodes import make_rollout
from gjax.rollout.factory import make_backend
from gjax.rollout.producer import make_producer

# The subsystems' config hooks `validate` asks, before anything loads or is written.
CONFIG_CHECKS = (
    data_builders.check_config,
    rewards_pipeline.check_config,
    eval_lib.check_config,
    rollout_factory.check_config,
    envs_environments.check_config,  # env.name != '' only where episodes are wired
    wandb_log.check_config,
)

log = logging.getLogger("gjax")


def fingerprint(config: ml_collections.ConfigDict, base_digest: str | None = None) -> dict:
    """Config fields a resumed run must share with the checkpoint it resumes; with LoRA also
    the adapters' shape and the frozen base's content (`gjax.models.lora.base_digest`)."""
    lora_fields = {}
    if config.model.lora.rank:
        lora_fields["model.lora"] = json.dumps(lora.as_record(config.model.lora), sort_keys=True)
        lora_fields["model.base_digest"] = base_digest
    return {
        "model.path": config.model.path,
        "algo": config.algo,
        "objective": json.dumps(
            schema.objective_as_trained(config.objective.to_dict(), config.rollout.temperature),
            sort_keys=True,
        ),
        "rollout.num_samples": config.rollout.num_samples,
        "rollout.prompts_per_step": config.rollout.prompts_per_step,
        "rollout.max_new_tokens": config.rollout.max_new_tokens,
        "data.source": config.data.source,
        "data.max_prompt_len": config.data.max_prompt_len,
        "anchors.per_group": config.anchors.per_group,
        "seed": config.seed,
        **lora_fields,
    }


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    F = flags.FLAGS
    config = F.config
    # Before the first compile: a rerun reads its programs back (gjax.compile_cache).
    compile_cache.enable(config.train.compilation_cache)
    # Local (relative or absolute) or gs://; every file below is written through epath.
    workdir = str(paths.resolve(F.workdir or os.path.join("workdirs", config.algo)))
    paths.require_backend(workdir, "--workdir")
    watch = None  # multi-process: ends this process when a peer dies (`_peer_failed`)
    if multihost.requested(F.jax_distributed, F.coordinator_address):  # flags or JAX_* env
        watch = multihost.initialize(
            F.coordinator_address,
            F.num_processes,
            F.process_id,
            peer_timeout_s=F.peer_timeout_s,
            collective_timeout_s=F.collective_timeout_s,
            on_peer_failure=functools.partial(_peer_failed, workdir),
        )
    if not multihost.is_primary():  # process 0 logs; the others only warn
        logging.getLogger().setLevel(logging.WARNING)
    with collective_faults(watch, workdir, F.collective_timeout_s):
        signum = train(config, workdir)
    if signum is not None:
        sys.exit(128 + signum)


@contextlib.contextmanager
def collective_faults(watch, workdir: str, timeout_s: int):
    """A failed cross-process operation inside -> one paragraph and exit 2, never a traceback.

    A collective fails at once when a peer dies (gloo): the watch then finds that peer dead
    and ends this process with its paragraph (`_peer_failed`). With every peer alive (one was
    slower than `timeout_s` to join, e.g. compiling under load, or the processes run different
    programs) it is a `multihost.CollectiveFailed` naming the last intact checkpoint. `watch`
    None (one process): errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if watch is None or not multihost.collective_failed(e):
            raise
        watch.await_verdict()  # a dead peer ends the process here, with its own paragraph
        raise multihost.CollectiveFailed(
            f"a cross-process operation failed on process {jax.process_index()} while every "
            f"process of this run is still alive ({multihost.first_line(e)}). Most likely "
            f"another process took longer than --collective_timeout_s={timeout_s} to reach it "
            "(compiling, loading or saving on a slow or overloaded host), or the processes run "
            "different code or configs. " + _last_intact_now(workdir) + " Start every "
            "process again with the same command to resume (with a larger "
            "--collective_timeout_s if one host is that slow)."
        ) from None


def train(config: ml_collections.ConfigDict, workdir: str) -> int | None:
    """Trains (or resumes) the run of `config` in `workdir`; returns the number of the signal
    that stopped it early (SIGTERM / SIGINT, checkpoint saved), or None once it is done."""
    with contextlib.ExitStack() as scope:  # closed in reverse order, on errors too
        return _train(config, workdir, scope)


def _train(config: ml_collections.ConfigDict, workdir: str, scope: contextlib.ExitStack):
    # --- config -------------------------------------------------------------------------
    mesh_shape = validate(config, jax.device_count(), checks=CONFIG_CHECKS)
    # The policy's config.json: found, supported, long enough; no weight is read yet.
    model_path = check_model(config, resolve_model_path(config.model.path))
    obj_cfg = schema.to_objective_config(
        config.objective, rollout_temperature=config.rollout.temperature
    )
    eval_settings = eval_lib.HeldoutEval.from_config(config.eval)
    scope.enter_context(runlock.hold(workdir))  # one run (process set) per workdir
    checkpointer = _checkpointer(config, workdir)
    config_diff = _check_config_record(config, workdir, checkpointer)  # None: a fresh run

    # --- mesh ---------------------------------------------------------------------------
    mesh, rollout_mesh = sharding.make_meshes(mesh_shape, config.mesh.rollout_devices)
    log.info("mesh %s over %d devices", mesh_shape, jax.device_count())
    # Jitted functions traced from here on see the mesh and the logical-axis rules, so the
    # model's activation sharding constraints take effect.
    scope.enter_context(jax.set_mesh(mesh))
    scope.enter_context(sharding.use_rules())

    # --- model --------------------------------------------------------------------------
    model_cfg, params, tok = hf_import.load_policy(model_path, config.model, mesh)
    if multihost.is_primary():
        model_record.save(workdir, model_cfg, model_path)  # WORKDIR/model: what an export needs
    # LoRA (model.lora.rank > 0): the loaded weights become the frozen base and `params` the
    # fresh adapters; `policy(params)` is the whole tree that samples and scores (a union).
    # The checkpoints record the base's content as loaded (before a QLoRA quantization).
    base_digest = lora.base_digest(params) if config.model.lora.rank else None
    run_fingerprint = fingerprint(config, base_digest)
    model_cfg, frozen, params = lora.attach(
        model_cfg, params, config.model.lora, mesh, jax.random.key(config.seed)
    )
    policy = functools.partial(lora.merge, frozen)
    # The KL reference, kept only when the objective has a KL term: a frozen copy of the
    # initial policy, or with LoRA the base itself (adapters off, no second copy).
    ref_params = None
    if obj_cfg.kl_beta > 0:
        ref_params = frozen if frozen is not None else jax.tree.map(lambda x: x.copy(), params)

    # --- data ---------------------------------------------------------------------------
    train_data, heldout = _load_data(config, tok)

    # --- rewards, backend, learner: fresh or resumed ------------------------------------
    verifier = scope.enter_context(build_verifier(config))
    rewards = scope.enter_context(build_rewards(config, verifier))
    backend = make_backend(
        config, model_cfg, policy(params), mesh=mesh, workdir=workdir, tokenizer=tok
    )
    scope.callback(backend.close)
    state, learner = build_learner(
        config,
        mesh=mesh,
        model_cfg=model_cfg,
        obj_cfg=obj_cfg,
        params=params,
        frozen=frozen,
        behaviour_logps=backend.returns_logps,
    )
    state, meta = _restore(config, workdir, checkpointer, state, run_fingerprint)
    start = int(state.step)
    if config_diff is not None:
        _write_record(workdir, config_record.resumed, workdir, config, start, config_diff)
    data_iter = _prompt_iterator(config, train_data, learner.transfer.layout, meta["data"])
    rollout = make_rollout(  # env.name set: its episodes (gjax.rollout.episodes)
        config,
        scope,
        model_cfg=model_cfg,
        backend=backend,
        tokenizer=tok,
        rewards=rewards,
        transfer=learner.transfer,
    )
    eval_backend = rollout_factory.evaluation_backend(config, backend, model_cfg)
    eval_sampler = eval_episodes.heldout_sampler(config, rollout, tok)  # env.name: episodes
    evaluate = functools.partial(
        _evaluate, config, eval_settings, eval_backend, tok, heldout, verifier, rollout, learner,
        eval_sampler,
    )  # fmt: skip

    # From here on SIGTERM / Ctrl-C stop the run at the end of a step, with a checkpoint.
    stop = {"signal": None}
    scope.callback(stopping_lib.install(stop))

    _heldout_before(
        meta, evaluate, policy(state.params)
    )  # evaluated once, printed at each (re)start

    # --- the RL loop --------------------------------------------------------------------
    wandb_sink = _wandb_sink(config, workdir, start, scope)  # process 0, log.wandb_project
    recorder = Recorder(
        config, workdir, checkpointer, meta["history"], start, model_cfg.vocab_size, wandb_sink
    )
    base_key = jax.random.key(config.seed)
    producer = make_producer(
        rollout=rollout,
        data_iter=data_iter,
        params=policy(state.params),
        base_key=base_key,
        config=config,
        start=start,
        train_mesh=mesh,
        rollout_mesh=rollout_mesh,
        backend=backend,
        frozen=frozen,  # LoRA: the base goes to the rollout devices once
    )
    scope.callback(producer.close)  # on errors too: before the backend and rewards close
    stopping = False  # agreed by every process: a signal may reach only one host
    stopped_by = (None, None)  # (signal, the process that received it), agreed by all
    budget = SampledBudget(config.train.max_sampled_tokens, meta["history"])
    for step in range(start, config.train.steps):
        if step == start:
            stopped_by = multihost.stop_signal(stop["signal"])
            if stopping := stopped_by[0] is not None:
                break  # arrived before this run trained a step: nothing new to save
            if budget.spent(start, resumed=True):
                break  # a resume of a run that ended at its budget: nothing to train
        checkpointer.check()  # a failed (asynchronous) save stops the run here, at once
        t0 = time.perf_counter()
        produced = _produce(producer, step, checkpointer, recorder)
        t_learn = time.perf_counter()
        # Before the update is dispatched (a host exchange after it would wait for it).
        num_tokens = multihost.allgather(produced.groups.completion_mask_PxGxN.sum()).sum()
        batch = learner.batch(produced.groups, policy(state.params), ref_params)
        key = jax.random.fold_in(jax.random.fold_in(base_key, step), 10_000)
        state, metrics = learner.update(state, batch, key, frozen)
        producer.push(policy(state.params), step + 1)
        recorder.write()  # the previous step's row: pulled to the host one step late
        host_metrics = produced.metrics
        host_metrics["time/learner_dispatch_s"] = time.perf_counter() - t_learn
        host_metrics["time/step_s"] = time.perf_counter() - t0
        host_metrics["throughput/tokens_per_s"] = float(num_tokens / host_metrics["time/step_s"])
        recorder.add(step + 1, metrics, host_metrics)
        stopped_by = multihost.stop_signal(stop["signal"])  # all stop, or none
        stopping = stopped_by[0] is not None
        budget.add(host_metrics)  # the same gathered count on every process: all end, or none
        last = step + 1 == config.train.steps or budget.spent(step + 1)
        if config.log.eval_every and (step + 1) % config.log.eval_every == 0:
            host_metrics.update(
                _evaluate_mid_run(evaluate, policy(state.params), step, checkpointer, recorder)
            )
            recorder.write()
        if checkpointer.should_save(step + 1) or stopping or last:
            _save(checkpointer, step + 1, state, meta, recorder, producer, run_fingerprint)
        if stopping or last:
            break
    producer.close()
    checkpointer.wait()
    recorder.close()  # ends the progress bar's line: what follows has lines of its own

    # --- finish: held-out accuracy after training, or the stop's message -----------------
    # Its own signal where this process received one; else the first process's that did.
    signum = (stop["signal"] or stopped_by[0]) if stopping else None
    if signum is None:
        after = functools.partial(evaluate, policy(state.params))
        _finish(config, workdir, checkpointer, state, start, meta, heldout, after, wandb_sink)
    else:
        by = None if stop["signal"] is not None else stopped_by[1]  # None: this process
        _stopped(signum, checkpointer, int(state.step), start, by=by)
    checkpointer.close()
    if wandb_sink is not None:
        wandb_sink.close(
            exit_code=0 if signum is None else 128 + signum, preempted=signum is not None
        )
    return signum


class SampledBudget:
    """`train.max_sampled_tokens`: a run ends, as at its last step, after the step whose
    sampled tokens summed from the run's first step reach the budget (0: none), so runs of
    algorithms that sample more per step (DAPO's dynamic sampling, GPG's beta_th rounds) can
    be compared at equal sampling cost. The sum is kept in the checkpoint with the run's
    history (each row's `response/sampled_tokens`, every rollout round's), so a resume
    counts on from it."""

    def __init__(self, tokens: int, history: list[dict]):
        self.tokens = int(tokens)
        self.sampled = sum(float(r.get(SAMPLED, 0.0)) for r in history)

    def add(self, host_metrics: dict[str, float]) -> None:
        if self.tokens:
            self.sampled += float(host_metrics[SAMPLED])  # every rollout reports it

    def spent(self, step: int, *, resumed: bool = False) -> bool:
        """The budget is reached (after `step` steps); says so once, on process 0 (`resumed`:
        before this run trained a step)."""
        if not self.tokens or self.sampled < self.tokens:
            return False
        if multihost.is_primary():
            then = (
                "nothing to train (raise --config.train.max_sampled_tokens to train further)."
                if resumed
                else "training ends here."
            )
            print(
                f"step {step}: {self.sampled:.0f} sampled tokens >= train.max_sampled_tokens="
                f"{self.tokens}: {then}",
                flush=True,
            )
        return True


SAMPLED = "response/sampled_tokens"


def _wandb_sink(config, workdir: str, start: int, scope: contextlib.ExitStack):
    """The run's Weights & Biases sink (`gjax.wandb_log`) on process 0 with
    log.wandb_project, else None; a run that ends in an error closes it with exit code 1."""
    if not (wandb_log.enabled(config) and multihost.is_primary()):
        return None
    sink = wandb_log.WandbSink(config, workdir, start_step=start)

    def close_on_error(exc_type, exc, tb):
        if exc_type is not None:
            sink.close(exit_code=1)  # (a finished run closed it already: then a no-op)

    scope.push(close_on_error)
    return sink


def _check_config_record(config, workdir: str, checkpointer) -> dict | None:
    """A fresh run records its config (None); a resume's config is checked against the
    workdir's record (gjax.config_record): a change to training is refused here, before
    anything loads, unless train.allow_config_change; returns the accepted changes."""
    if checkpointer.latest_step() is None:
        _write_record(workdir, config_record.write, workdir, config)
        return None
    # model.lora whole: rank 0 <-> r > 0 changes the state's tree, not only its values.
    return config_record.check(workdir, config, [*fingerprint(config), "model.lora"])


def _write_record(workdir: str, write, *args) -> None:
    """`write(*args)`, a gjax.config_record writer, on process 0; an unwritable workdir is the
    user's error."""
    try:
        if multihost.is_primary():
            write(*args)
    except Exception as e:  # any filesystem's error (local, gcsfs): report it as the user's
        hint = " (gs:// needs the gcs extra and credentials)" if paths.is_url(workdir) else ""
        raise ConfigError(
            f"--workdir {workdir!r} is not writable{hint}: {type(e).__name__}: {e}"
        ) from e


def _load_data(config, tok):
    """The training prompts (each process templates its share) and the held-out set."""
    data_cfg = data_builders.run_data_config(config)
    # A tool environment's prompts describe its tools; held-out episodes get the same prompts.
    tools = envs_environments.prompt_tools(config.env)
    if tools:
        cost = data_builders.check_tool_prompt(data_cfg, tok, tools)
        log.info("prompts describe the tools %s: %d prompt tokens", config.env.tools, cost)
    train_data = build_sharded_prompts(data_cfg, tok, tools=tools)
    heldout = build_prompt_data(data_cfg, tok, heldout=True, tools=tools)
    if config.anchors.per_group and not train_data.has_demonstrations:
        raise ConfigError(
            "config.anchors.per_group > 0 needs demonstrations: set "
            "config.data.demonstration_field to the column holding them"
        )
    log.info(
        "data: %d train prompts, %d held-out (%s)", len(train_data), len(heldout), train_data.stats
    )
    return train_data, heldout


def _prompt_iterator(config, train_data, layout, state) -> PromptIterator:
    """This process's block of every global batch of prompts, from `state` (a resume)."""
    return PromptIterator(
        train_data,
        global_batch_size=config.rollout.prompts_per_step,
        seed=config.data.shuffle_seed,
        shuffle=config.data.shuffle,
        state=state,
        process_index=layout.block,
        process_count=layout.count,
    )


def _checkpointer(config, workdir: str) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.checkpoint.keep,
        save_interval_steps=config.checkpoint.every,
        async_save=config.checkpoint.async_save,
        storage_timeout_s=config.train.storage_timeout_s,
    )


def _restore(config, workdir: str, checkpointer, state, run_fingerprint: dict):
    """The latest intact checkpoint's state and meta (or the fresh state and empty meta)."""
    meta = {"data": None, "history": [], "heldout_accuracy_before": None}
    if checkpointer.latest_step() is not None:
        _, state, meta = checkpointer.restore(
            state, fingerprint=run_fingerprint, move_damaged=multihost.is_primary()
        )
        log.info("resumed from step %d in %s", int(state.step), workdir)
    start = int(state.step)
    if start >= config.train.steps and multihost.is_primary():
        print(
            f"{workdir} is already at step {start} >= train.steps={config.train.steps}: nothing "
            "to train (raise --config.train.steps to train further).",
            flush=True,
        )
    return state, meta


def _evaluate(config, settings, backend, tok, heldout, verifier, rollout, learner, sampler, params):
    """Greedy held-out accuracy and pass@k (gjax.eval), with its own progress bar (on a
    terminal); a multi-turn run's over episodes of its environment (`sampler`,
    gjax.evaluation.episodes)."""
    return eval_lib.heldout_metrics(
        backend,
        params,
        tok,
        heldout,
        verifier,
        settings,
        max_new_tokens=config.rollout.max_new_tokens,
        eos=rollout.eos,
        pad_id=rollout.pad_id,
        greedy_temperature=config.eval.greedy_temperature,
        seed=config.seed,
        rollout_sampling=rollout.sampling,
        rollout_shape=(config.rollout.prompts_per_step, rollout.G - rollout.A),
        progress=config.log.progress and multihost.is_primary(),
        transfer=learner.transfer,
        sampler=sampler,
    )


def _produce(producer, step: int, checkpointer, recorder):
    """Step `step`'s batch from the producer; a rollout whose requests all failed stops the
    run here, before anything trains on it, naming the last intact checkpoint. The previous
    step trained: its row (queued one step late) is written first."""
    try:
        return producer.get(step)
    except ServingFailed as e:
        recorder.flush()
        checkpointer.wait()  # so the checkpoint named below is complete
        raise ServingFailed(
            f"step {step + 1}: {e} {checkpointer.last_intact()} Start the server again "
            "(or fix config.rollout.server_address), then rerun the same command."
        ) from e


def _evaluate_mid_run(evaluate, params, step: int, checkpointer, recorder) -> dict:
    """The held-out figures after step `step` + 1 (`log.eval_every`); an evaluation whose
    requests were all dropped stops the run as a rollout's would: the trained step's row is
    written first and the last intact checkpoint named."""
    try:
        return evaluate(params)
    except ServingFailed as e:
        recorder.flush()
        checkpointer.wait()
        raise ServingFailed(f"step {step + 1}: {e} {checkpointer.last_intact()}") from e


def _heldout_before(meta: dict, evaluate, params) -> None:
    """Held-out figures before training: evaluated by a fresh run, kept in `meta` (and so in
    every checkpoint), printed as a result line (stdout, process 0)."""
    if meta["heldout_accuracy_before"] is None:
        meta["heldout_before"] = evaluate(params)
        meta["heldout_accuracy_before"] = meta["heldout_before"]["eval/heldout_accuracy"]
    if multihost.is_primary():  # a result: a plain line on stdout, as the summary at the end
        print(f"held-out before: {_fmt_eval(_before(meta))}", flush=True)


def _save(checkpointer, step: int, state, meta: dict, recorder, producer, run_fingerprint) -> None:
    """The checkpoint of `step` (just trained); its metrics are durable before it is."""
    recorder.flush()
    meta.update(data=producer.data_state(), history=recorder.history, fingerprint=run_fingerprint)
    checkpointer.save(step, state, meta, force=True)


def _before(meta: dict) -> dict[str, float]:
    return meta.get("heldout_before") or {"eval/heldout_accuracy": meta["heldout_accuracy_before"]}


def _finish(
    config, workdir, checkpointer, state, start, meta, heldout, evaluate, wandb_sink=None
) -> None:
    """Held-out accuracy after training (every process samples; process 0 writes, and logs
    the held-out table and the curves to wandb); `evaluate()` evaluates the trained policy."""
    trained = int(state.step)
    summary_path = os.path.join(workdir, "summary.json")
    summary = _read_json(summary_path) if trained == start else None
    stale = summary is None or summary.get("steps") != trained  # else: still true, kept
    if multihost.any_process(stale):  # every process evaluates, or none
        after = evaluate()
        summary = {
            "algo": config.algo,
            "steps": trained,  # what the model was trained for, whatever train.steps says
            "heldout_size": len(heldout),
            "heldout_accuracy_before": meta["heldout_accuracy_before"],
            "heldout_accuracy_after": after["eval/heldout_accuracy"],
            **_pass_at_k(_before(meta), "before"),
            **_pass_at_k(after, "after"),
            **_episode_figures(_before(meta), "before"),  # a multi-turn run's only
            **_episode_figures(after, "after"),
            # Which rows were held out, from where, and what left training for it
            # (gjax.data.builders: the held-out PromptData's origin).
            "heldout": heldout.origin,
        }
        if multihost.is_primary():
            paths.write_text(summary_path, json.dumps(summary, indent=2))
        if wandb_sink is not None:
            from gjax import plot  # on use: matplotlib

            wandb_sink.heldout(trained, _before(meta), after)
            wandb_sink.curves(trained, lambda png: plot.plot_runs([workdir], png))
    if multihost.is_primary():
        print(
            f"\nheld-out accuracy after {trained} steps: "
            f"{summary['heldout_accuracy_before']:.3f} -> {summary['heldout_accuracy_after']:.3f} "
            f"({summary['heldout_size']} problems)\n"
            + workdir_layout(
                workdir,
                checkpoint_steps=checkpointer.all_steps(),
                tensorboard=config.log.tensorboard,
                wandb=wandb_sink is not None and wandb_sink.run is not None,
            ),
            flush=True,
        )


def _stopped(signum: int, checkpointer, trained: int, start: int, by: int | None = None) -> None:
    """The stop's line (stderr). `by`: the process that received the signal, where this one
    received none (its peer's signal stopped the whole run)."""
    name = signal.Signals(signum).name
    saved = f"checkpoint at step {trained} saved" if trained > start else "nothing new to save"
    here = jax.process_index()
    what = name if by is None else f"process {by} received {name} (process {here} received none)"
    print(
        f"{what}: stopped at step {trained}, {saved} in {checkpointer.directory}; "
        f"exit status {128 + signum}. Rerun the same command to resume.",
        file=sys.stderr,
        flush=True,
    )


def _peer_failed(workdir: str, reason: str) -> None:
    """A peer process died (`multihost.PeerWatch`, on its thread): one paragraph, exit 2 at
    once; the collectives this process waits in would never return."""
    runlock.release_all()
    err = multihost.DistributedError(
        f"another process of this run stopped responding ({reason}: killed, crashed, or its "
        "host lost), so this one cannot go on and exits. "
        + _last_intact_now(workdir)
        + " Start every process again with the same command to resume."
    )
    print(format_user_error(err), file=sys.stderr, flush=True)
    os._exit(2)


def _last_intact_now(workdir: str) -> str:
    """The last intact checkpoint from a listing, within 10 s (storage may be down too)."""
    directory = os.path.join(workdir, "checkpoints")
    try:
        return paths.bounded(lambda: ckpt_lib.last_intact_in(directory), 10.0)
    except TimeoutError:
        return f"The newest intact checkpoint in {directory} is where a rerun resumes."


def _read_json(path: str) -> dict | None:
    try:
        return json.loads(paths.resolve(path).read_text())
    except (OSError, ValueError):
        return None


def _fmt_eval(metrics: dict[str, float]) -> str:
    """`accuracy 0.512, pass@1 0.400, ...`; a count of dropped requests (a serving backend's,
    scored as wrong answers) follows the figures it lowers."""
    parts = []
    for k, v in metrics.items():
        name = k.removeprefix("eval/heldout_")
        if name == "dropped":
            parts[0] += f" ({int(v)} requests dropped, counted as wrong)"
        elif name == "sampled_dropped":
            parts[-1] += f" ({int(v)} samples dropped, counted as wrong)"
        else:
            parts.append(f"{name} {v:.3f}")
    return ", ".join(parts)


def _pass_at_k(metrics: dict[str, float], when: str) -> dict[str, float]:
    """`eval/heldout_pass@k` -> summary keys `heldout_pass@k_<when>` (config.eval sampling)."""
    return {
        f"{k.removeprefix('eval/')}_{when}": v
        for k, v in metrics.items()
        if k.startswith("eval/heldout_pass@")
    }


def _episode_figures(metrics: dict[str, float], when: str) -> dict[str, float]:
    """A multi-turn run's episode figures (gjax.evaluation.episodes: `eval/heldout_turns_mean`,
    ...; none in a single-turn run) -> summary keys `heldout_turns_mean_<when>`, ..."""
    names = {f"eval/heldout_{p}{k}" for p in ("", "sampled_") for k in eval_episodes.FIGURES}
    return {f"{k.removeprefix('eval/')}_{when}": v for k, v in metrics.items() if k in names}


class Recorder:
    """A step's metrics, pulled to the host one step late (the device runs ahead), checked
    for divergence and written by process 0; `history` is what a checkpoint keeps."""

    def __init__(
        self, config, workdir, checkpointer, history, start: int, vocab_size: int, wandb=None
    ):
        self.config, self.checkpointer, self.history = config, checkpointer, history
        self.writer = None  # process 0 writes metrics; every process computes the same rows
        if multihost.is_primary():
            self.writer = MetricsWriter(
                workdir,
                total_steps=config.train.steps,
                start_step=start,
                tensorboard=config.log.tensorboard,
                progress=config.log.progress,
                history=history,
                storage_timeout_s=config.train.storage_timeout_s,
                last_intact=checkpointer.last_intact,
                wandb=wandb,
            )
        self.watch = CollapseWatch(vocab_size)
        self.pending = None  # (step, device metrics, host metrics)

    def add(self, step: int, device_metrics, host_metrics: dict[str, float]) -> None:
        """Queues a step's metrics; `write` pulls them (waiting for that step's update)."""
        self.write()
        self.pending = (step, device_metrics, host_metrics)

    def write(self) -> None:
        """Writes the queued step's row, if any."""
        if self.pending is not None:
            self.history.append(self._write(*self.pending))
            self.pending = None

    def flush(self) -> None:
        """Writes the queued row and makes the file durable (before a checkpoint)."""
        self.write()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _write(self, step: int, device_metrics, host_metrics) -> dict:
        row = {**to_host(device_metrics), **host_metrics}
        bad = [k for k in ("loss/total", "optim/grad_norm") if not np.isfinite(row.get(k, 0.0))]
        config = self.config
        if bad and not config.train.allow_nonfinite:
            self.checkpointer.wait()  # so the checkpoint named below is complete
            raise Diverged(
                f"step {step}: non-finite {bad} ({ {k: row[k] for k in bad} }). "
                f"{self.checkpointer.last_intact()} Lower optim.lr (now {config.optim.lr:g}), "
                "check the rewards, or set --config.train.allow_nonfinite=True to continue anyway."
            )
        if self.writer is not None:
            self.writer.write(step, row)
            if collapsed := self.watch(step, row):
                self.writer.warn(collapsed)
        return {"step": step, **{k: v for k, v in row.items() if not k.startswith("time/")}}


def _define_flags() -> None:
    """The program's flags, defined only when run as one (tests import this module)."""
    config_flags.DEFINE_config_file(
        "config", None, "Config file (configs/<algo>.py[:arg]).", lock_config=True
    )
    flags.DEFINE_string(
        "workdir",
        None,
        "Output dir (local or gs://); resumes if it has checkpoints. Default: workdirs/<algo>.",
    )
    flags.DEFINE_bool(
        "jax_distributed",
        False,
        "Multi-process run: jax.distributed.initialize() (auto-detected on TPU VMs; elsewhere "
        "give the three flags below or JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID).",
    )
    flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0 (implies --jax_distributed)."
    )
    flags.DEFINE_integer("num_processes", None, "Processes in the run.")
    flags.DEFINE_integer("process_id", None, "This process's index.")
    flags.DEFINE_integer(
        "peer_timeout_s",
        multihost.PEER_TIMEOUT_S,
        "Multi-process start-up: seconds to wait for every process to join before giving up.",
    )
    flags.DEFINE_integer(
        "collective_timeout_s",
        multihost.COLLECTIVE_TIMEOUT_S,
        "Multi-process CPU runs: seconds a cross-process collective waits for a live peer "
        "(e.g. one still compiling) before the run stops; a dead peer is found within ~30 s.",
    )
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
