"""The pure, jitted pieces of an RL step, and the host logic that feeds them.

Device side (jitted once each; explicit shardings; the train state is donated):
  * `policy_logps` : teacher-forced per-token log-probs of completions (old / reference);
  * `update`       : `gjax.objective.prepare` on the full rollout batch, then
                     num_iterations x minibatches optax updates inside one jit (`lax.scan`),
                     each accumulating gradients over microbatches. Normalizers are global:
                     per minibatch when a rollout batch feeds several updates, never per
                     microbatch, so the update is independent of the accumulation split.
Host side (`Rollout`): sample groups with the local sampler, decode, hand the texts to the
reward pipeline and compute old/ref log-probs on the device while rewards run.

Array naming: `*_BxS` are full sequences (prompt ++ completion, S = S_prompt + T), `*_BxT`
are aligned with the T completion tokens (hidden[t] predicts targets[t]), `*_PxG` per sample.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from gjax import multihost, sharding
from gjax import objective as obj
from gjax.experience import Groups, append_anchors, to_model_inputs
from gjax.models.config import ModelConfig
from gjax.models.transformer import forward, lm_head_kernel
from gjax.objective.aggregation import minibatch_scale_MxB
from gjax.objective.logprobs import token_logps_BxT
from gjax.rollout import LocalSampler, RolloutBackend, SamplingParams

# ----------------------------------------------------------------------------------- state


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def make_optimizer(
    optim, total_steps: int, updates_per_step: int = 1
) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW after global-norm clipping, with a linear warmup into constant or cosine.

    The schedule (returned) counts RL steps, as `optim.warmup_steps` and `total_steps` do;
    one RL step makes `updates_per_step` optimizer updates (minibatches x num_iterations),
    which all use that step's learning rate. Warmup over W steps gives step k (0-based) the
    rate lr * (k + 1) / W: the first step already learns (at lr / W) and step W - 1 reaches lr,
    so no step is spent at a rate of 0. Cosine then decays over the remaining steps, never to
    0 within the run.
    """
    warmup = max(int(optim.warmup_steps), 0)
    if optim.schedule == "cosine":
        # One step longer than the run, so the last step's rate is not 0.
        base = optax.warmup_cosine_decay_schedule(
            0.0, optim.lr, max(warmup, 1), max(total_steps, warmup) + 1
        )
    elif warmup:
        base = optax.linear_schedule(0.0, optim.lr, warmup)  # holds optim.lr afterwards
    else:
        base = optax.constant_schedule(optim.lr)

    def schedule(step):  # the rate at the end of optax's ramp step: step 0 gets lr / W, not 0
        return base(step + 1)

    def per_update(count):
        return schedule(count // updates_per_step)

    tx = optax.chain(
        optax.clip_by_global_norm(optim.clip_norm),
        optax.adamw(per_update, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay),
    )
    return tx, schedule


def init_state(params, tx: optax.GradientTransformation, mesh) -> tuple[TrainState, TrainState]:
    """The initial train state and its shardings, built on the mesh (never on one device).

    Optimizer moments follow their parameters' shardings (`optax.tree_utils.tree_map_params`);
    scalars (step, counts) are replicated.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    opt_shardings = optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, params),
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    return TrainState(step=step, params=params, opt_state=opt_state), shardings


# ------------------------------------------------------------------------------ device steps


def completion_hidden(params, cfg: ModelConfig, batch) -> jax.Array:
    """Final hidden states at the T positions that predict the completion tokens."""
    t = batch["targets_BxT"].shape[1]
    hidden_BxSxD = forward(
        params, cfg, batch["input_ids_BxS"], batch["positions_BxS"], batch["segment_ids_BxS"]
    )
    s = hidden_BxSxD.shape[1]
    return hidden_BxSxD[:, s - t - 1 : s - 1]


def policy_logps(params, batch, *, cfg: ModelConfig, temperature: float) -> jax.Array:
    """log pi(y_t | prompt, y_<t) / temperature-scaled, for every completion token; 0 on padding."""
    hidden_BxTxD = completion_hidden(params, cfg, batch)
    logps_BxT, _ = token_logps_BxT(
        hidden_BxTxD,
        lm_head_kernel(params, cfg),
        batch["targets_BxT"],
        temperature=temperature,
        with_entropy=False,
    )
    return jnp.where(batch["loss_mask_BxT"], logps_BxT, 0.0)


def split_rows(tree, n: int):
    """[B, ...] -> [n, B/n, ...] with row b in piece b % n (strided).

    Strided pieces keep every piece spread over all data-parallel devices when B is sharded
    contiguously; advantages are already per row, so groups may straddle pieces.
    """
    return jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), tree
    )


def minibatch_weight_scale(mask_MxBxT: jax.Array, aggregation: str) -> jax.Array:
    """Per-minibatch factor turning full-batch aggregation weights into minibatch ones.

    `prepare` normalizes by the full rollout batch (tokens for token_mean, valid sequences for
    the sequence modes); an update on minibatch m must normalize by m's own count, so its
    weights are scaled by count(full) / count(m). Exact for all three modes.
    """
    if aggregation == "token_mean":
        count_M = mask_MxBxT.sum(axis=(1, 2))
    else:
        count_M = (mask_MxBxT.sum(axis=2) > 0).sum(axis=1).astype(jnp.float32)
    return count_M.sum() / jnp.maximum(count_M, 1.0)


_BATCH_KEYS_FOR_LOSS = ("targets_BxT", "old_logps_BxT", "ref_logps_BxT")
_MODEL_KEYS = ("input_ids_BxS", "positions_BxS", "segment_ids_BxS")


def update(
    state: TrainState,
    batch: dict[str, jax.Array],
    rng: jax.Array,
    *,
    cfg: ModelConfig,
    obj_cfg: obj.ObjectiveConfig,
    tx: optax.GradientTransformation,
    minibatches: int,
    microbatches: int,
    num_iterations: int,
    schedule: Callable | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One RL update on a rollout batch: advantages once, then the optimizer updates.

    `schedule` (the optimizer's learning-rate schedule) only adds `optim/lr` to the metrics,
    computed here so the host never waits on the device for it.
    """
    prep, prep_metrics = obj.prepare(batch, obj_cfg, rng)  # reads only the keys it needs
    rows = {k: batch[k] for k in _MODEL_KEYS + _BATCH_KEYS_FOR_LOSS if k in batch}
    rows_M = split_rows(rows, minibatches)
    prep_M = split_rows(prep, minibatches)
    if obj_cfg.aggregation == "group_token_mean":  # per-row: groups straddle minibatches
        p, g = batch["rewards_PxG"].shape
        group_MxB = split_rows(jnp.arange(p * g, dtype=jnp.int32) // g, minibatches)
        prep_M["weight_BxT"] = (
            prep_M["weight_BxT"]
            * minibatch_scale_MxB(obj_cfg.aggregation, prep_M["mask_BxT"], group_MxB)[:, :, None]
        )
    else:
        scale_M = minibatch_weight_scale(prep_M["mask_BxT"], obj_cfg.aggregation)
        prep_M["weight_BxT"] = prep_M["weight_BxT"] * scale_M[:, None, None]

    def loss_fn(params, micro):
        mb, mprep = micro
        hidden_BxTxD = completion_hidden(params, cfg, mb)
        return obj.micro_batch_loss(hidden_BxTxD, lm_head_kernel(params, cfg), mb, mprep, obj_cfg)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one_update(carry, minibatch):
        params, opt_state = carry
        micro_K = split_rows(minibatch, microbatches)

        def accumulate(grads, micro):
            (_, sums), g = grad_fn(params, micro)
            return jax.tree.map(jnp.add, grads, g), sums

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, sums_K = jax.lax.scan(accumulate, zeros, micro_K)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), (grad_norm, jax.tree.map(lambda x: x.sum(0), sums_K))

    def one_pass(carry, _):  # one pass over the rollout batch (GRPO's mu passes in all)
        return jax.lax.scan(one_update, carry, (rows_M, prep_M))

    (params, opt_state), (gnorm_IxM, sums_IxM) = jax.lax.scan(
        one_pass, (state.params, state.opt_state), None, length=num_iterations
    )
    updates = minibatches * num_iterations
    policy = obj.finalize_metrics(jax.tree.map(lambda x: x.sum((0, 1)), sums_IxM))
    gnorm = gnorm_IxM.reshape(-1)
    metrics = {
        **prep_metrics,
        # Loss parts are per update (each minibatch is normalized on its own), averaged.
        **{k: v / updates for k, v in policy.items() if k.startswith("loss/")},
        **{f"policy/{k}": v for k, v in policy.items() if not k.startswith("loss/")},
        "optim/grad_norm": gnorm.mean(),
        "optim/grad_norm_max": gnorm.max(),
        "optim/updates": jnp.asarray(updates, jnp.float32),
    }
    if schedule is not None:
        metrics["optim/lr"] = schedule(state.step)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


# ------------------------------------------------------------------------------ jit builders


@dataclasses.dataclass
class Steps:
    """The jitted device functions of a run (compiled once each), and the batch layout.

    `layout` says which block of a batch's rows this process holds (`gjax.multihost`); with
    one process it holds them all and the host <-> device helpers below are plain transfers.
    """

    logps: Callable
    update: Callable
    batch_sharding: NamedSharding
    replicated: NamedSharding
    layout: multihost.RowLayout

    def put_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's host arrays -> the global batch on the devices.

        Per-sequence arrays (`*_BxS`, `*_BxT`: this process's rows) are assembled from every
        process's block and sharded over the batch axes; group-level arrays (`*_PxG`) are
        all-gathered and replicated, so advantages and every normalizer inside `update` are
        computed over the whole batch (GPG's alpha, A-GRAE's omega, token/sequence counts).
        """
        out = {}
        for k, v in arrays.items():
            if k.endswith(("_BxS", "_BxT")):
                out[k] = self.put_rows(v)
            elif k.endswith("_PxG"):
                out[k] = multihost.put_global(self.gather_rows(v), self.replicated.mesh)
            else:
                out[k] = multihost.put_global(v, self.replicated.mesh)
        return out

    def put_rows(self, x: np.ndarray) -> jax.Array:
        """This process's rows -> the global array sharded over the batch axes."""
        return multihost.put_rows(x, self.layout)

    def local_rows(self, x: jax.Array) -> np.ndarray:
        """A global row-sharded array -> this process's rows on the host."""
        return multihost.local_rows(x, self.layout)

    def gather_rows(self, x: np.ndarray) -> np.ndarray:
        """This process's rows of a host array -> every process's, in batch order."""
        return multihost.gather_rows(x, self.layout)

    def put_full(self, x: np.ndarray) -> jax.Array:
        """A whole batch every process holds (held-out prompts) -> the global array."""
        if self.layout.count == 1:
            return x
        per = x.shape[0] // self.layout.count
        return self.put_rows(x[self.layout.block * per : (self.layout.block + 1) * per])

    def pull_full(self, x: jax.Array) -> np.ndarray:
        """A global row-sharded array -> all of its rows on every process's host."""
        return self.gather_rows(self.local_rows(x))


def build_steps(
    *,
    mesh: jax.sharding.Mesh,
    cfg: ModelConfig,
    obj_cfg: obj.ObjectiveConfig,
    tx: optax.GradientTransformation,
    state_shardings: Any,
    train_cfg,
    schedule: Callable | None = None,
) -> Steps:
    batch_sharding = sharding.activation_sharding(mesh, ("batch",))
    replicated = NamedSharding(mesh, PartitionSpec())
    logps = jax.jit(
        functools.partial(policy_logps, cfg=cfg, temperature=obj_cfg.temperature),
        out_shardings=batch_sharding,
    )
    upd = jax.jit(
        functools.partial(
            update,
            cfg=cfg,
            obj_cfg=obj_cfg,
            tx=tx,
            minibatches=train_cfg.minibatches,
            microbatches=train_cfg.microbatches,
            num_iterations=train_cfg.num_iterations,
            schedule=schedule,
        ),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    return Steps(
        logps=logps,
        update=upd,
        batch_sharding=batch_sharding,
        replicated=replicated,
        layout=multihost.RowLayout(batch_sharding),
    )


def build_learner(
    config, *, mesh: jax.sharding.Mesh, cfg: ModelConfig, obj_cfg: obj.ObjectiveConfig, params
) -> tuple[TrainState, Steps]:
    """The fresh train state on `mesh` and the jitted steps of a run's `config`: the optimizer
    and its schedule over `config.train.steps` steps of minibatches x num_iterations updates.
    `gjax.train` builds its learner here, and so do the tools that drive a run by hand."""
    t = config.train
    tx, schedule = make_optimizer(
        config.optim, t.steps, updates_per_step=t.minibatches * t.num_iterations
    )
    state, state_shardings = init_state(params, tx, mesh)
    steps = build_steps(
        mesh=mesh,
        cfg=cfg,
        obj_cfg=obj_cfg,
        tx=tx,
        state_shardings=state_shardings,
        train_cfg=t,
        schedule=schedule,
    )
    return state, steps


# ------------------------------------------------------------------------------- host rollout


def _pad_rows(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.full((len(ids), width), pad_id, np.int32)
    mask = np.zeros((len(ids), width), bool)
    for i, row in enumerate(ids):
        row = row[:width]
        out[i, : len(row)] = row
        mask[i, : len(row)] = True
    return out, mask


@dataclasses.dataclass
class RolloutResult:
    groups: Groups
    metrics: dict[str, float]


class Rollout:
    """Samples groups for a prompt batch and scores them, overlapping host and device work.

    1. the jitted sampler generates G - A completions per prompt (A = DaGRPO anchors);
    2. completions are decoded and submitted to the reward pipeline (background thread);
    3. meanwhile the device computes old (and reference) log-probs of the mixed groups;
    4. rewards/scores are collected and written into the groups.

    With several processes each runs all four on its own block of prompts (the sampler and
    log-prob passes are one global program over everyone's rows; decoding and rewards stay
    on the host that owns the rows); only the metrics are computed over all rows.
    """

    def __init__(
        self,
        *,
        cfg: ModelConfig,
        tokenizer,
        pipeline,
        steps: Steps,
        config,
        backend: RolloutBackend | None = None,
    ):
        self.cfg = cfg
        self.backend = backend or LocalSampler(cfg)
        self.tok = tokenizer
        self.pipeline = pipeline
        self.steps = steps
        r = config.rollout
        self.G = r.num_samples
        self.A = config.anchors.per_group
        self.T = r.max_new_tokens
        eos = tuple(cfg.eos_token_id) or (tokenizer.eos_token_id,)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        self.eos = eos
        self.sampling = SamplingParams(
            max_new_tokens=self.T,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            stop_token_ids=eos,
            pad_token_id=self.pad_id,
        )
        s = config.sampling
        self.overlong_filter = s.overlong_filter
        self.overlong_buffer = s.overlong_buffer
        self.overlong_penalty = s.overlong_penalty
        # A backend whose replies carry no log-probs (JetStream over gRPC) needs the forward.
        self.recompute_old = config.rollout.recompute_old_logps or not getattr(
            self.backend, "returns_logps", True
        )
        # Set by gjax.rollout.pipeline's producer: old/ref log-probs are then computed by the
        # learner (`pipeline.learner_batch`), with its params at the start of the update.
        self.defer_teacher_forced = False

    def anchors(self, demonstrations: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """DaGRPO anchors: each prompt's demonstration (+ EOS) as A completions [P, A, T]."""
        ids = [
            self.tok(d, add_special_tokens=False)["input_ids"] + [self.eos[0]]
            for d in demonstrations
        ]
        tok, mask = _pad_rows(ids, self.T, self.pad_id)
        reps = lambda x: np.repeat(x[:, None], self.A, axis=1)
        return reps(tok), reps(mask)

    def __call__(self, params, ref_params, prompts, rng) -> RolloutResult:
        """One rollout batch; `ref_params` is the frozen reference (None: no KL, no ref pass)."""
        t0 = time.perf_counter()
        P = len(prompts)
        g_on = self.G - self.A
        # Several processes: each puts its block of the prompts into the global batch. One
        # process: host arrays, placed by the sampler's jit on the params' mesh (which is the
        # rollout mesh when gjax.rollout.pipeline gives rollouts devices of their own).
        put = self.steps.put_rows if self.steps.layout.count > 1 else np.asarray
        out = self.backend.generate(
            params,
            put(prompts.prompt_ids_PxS),
            put(prompts.prompt_mask_PxS),
            rng,
            num_samples=g_on,
            sampling=self.sampling,
        )
        tokens = self.steps.local_rows(out.tokens_BxN).reshape(P, g_on, self.T)
        mask = self.steps.local_rows(out.mask_BxN).astype(bool).reshape(P, g_on, self.T)
        t_sample = time.perf_counter() - t0
        truncated = ~np.any(mask & np.isin(tokens, self.eos), axis=2)
        groups = Groups(
            prompt_ids_PxS=np.asarray(prompts.prompt_ids_PxS, np.int32),
            prompt_mask_PxS=np.asarray(prompts.prompt_mask_PxS, bool),
            completion_ids_PxGxN=tokens,
            completion_mask_PxGxN=mask,
            truncated_PxG=truncated,
            is_anchor_PxG=np.zeros((P, g_on), bool),
            rewards_PxG=np.zeros((P, g_on), np.float32),
            scores_PxG=np.full((P, g_on), np.nan, np.float32),
            # A serving backend's dropped requests (retries exhausted) leave their group.
            valid_PxG=np.ones((P, g_on), bool)
            if out.valid_B is None
            else np.asarray(out.valid_B, bool).reshape(P, g_on),
        )
        if self.A:
            groups = append_anchors(groups, *self.anchors(prompts.demonstrations))
        if out.version_B is not None:
            groups.policy_version_PxG = np.concatenate(
                [np.asarray(out.version_B, np.int32).reshape(P, g_on), np.full((P, self.A), -1)],
                axis=1,
            ).astype(np.int32)
        P, G, T = groups.completion_ids_PxGxN.shape
        flat_ids = groups.completion_ids_PxGxN.reshape(P * G, T)
        flat_mask = groups.completion_mask_PxGxN.reshape(P * G, T)
        lengths = flat_mask.sum(1)
        texts = self.tok.batch_decode(
            [row[:n] for row, n in zip(flat_ids, lengths)], skip_special_tokens=True
        )
        rep = lambda xs: [x for x in xs for _ in range(G)]
        handle = self.pipeline.submit(
            rep(prompts.prompts),
            texts,
            rep(prompts.answers),
            rep(prompts.demonstrations) if self.pipeline.judge is not None else None,
            questions=rep(prompts.problems),
            completion_lengths=lengths,
        )
        # Device work overlapping the rewards: old (and reference) log-probs. The sampler's
        # own log-probs are the behaviour policy's, log_softmax(logits / T) of the same params
        # (see gjax.rollout.sampler), so on-policy rows need no second forward; anchors have
        # none and are teacher-forced (DaGRPO), as is everything when `recompute_old_logps`.
        on_logps = self.steps.local_rows(out.logps_BxN).reshape(P, g_on, self.T)
        need_old = (self.A > 0 or self.recompute_old) and not self.defer_teacher_forced
        ref_params = None if self.defer_teacher_forced else ref_params
        inputs = None
        if need_old or ref_params is not None:
            inputs = self.steps.put_batch(_model_and_targets(groups))
        old = self.steps.logps(params, inputs) if need_old else None
        ref = self.steps.logps(ref_params, inputs) if ref_params is not None else None
        res = handle.result()
        grouped = res.grouped(G)
        groups.rewards_PxG = grouped["rewards_PxG"].astype(np.float32)
        groups.valid_PxG = grouped["valid_PxG"] & groups.valid_PxG
        if "scores_PxG" in grouped:
            groups.scores_PxG = grouped["scores_PxG"].astype(np.float32)
        accuracy = groups.rewards_PxG.copy()
        if self.overlong_buffer:
            from gjax.rewards.functions import soft_overlong_penalty

            pen = soft_overlong_penalty(
                lengths, max_length=self.T, cache_length=self.overlong_buffer
            )
            groups.rewards_PxG = groups.rewards_PxG + self.overlong_penalty * pen.reshape(P, G)
        if old is None:
            pad = np.zeros((P, G - g_on, T), np.float32)  # anchors: filled by the learner
            groups.old_logps_PxGxN = np.concatenate([on_logps, pad], axis=1) if self.A else on_logps
        else:
            groups.old_logps_PxGxN = np.array(self.steps.local_rows(old)).reshape(P, G, T)
            if not self.recompute_old:
                groups.old_logps_PxGxN[:, :g_on] = on_logps
        if ref is not None:
            groups.ref_logps_PxGxN = np.asarray(self.steps.local_rows(ref)).reshape(P, G, T)
        # Metrics over every process's rows (one small all-gather; the identity on one host).
        per_sample = np.stack(
            [
                groups.rewards_PxG,
                accuracy,
                lengths.reshape(P, G),
                groups.truncated_PxG,
                groups.is_anchor_PxG,
                groups.scores_PxG,
            ],
            axis=-1,
        ).astype(np.float32)
        rewards_all, acc_all, len_all, trunc_all, anchor_all, scores_all = np.moveaxis(
            self.steps.gather_rows(per_sample), -1, 0
        )
        on = anchor_all == 0
        metrics = {
            "reward/mean": float(rewards_all[on].mean()),
            "reward/std": float(rewards_all[on].std()),
            "reward/accuracy": float(acc_all[on].mean()),
            "reward/all_solved_frac": float(np.all(acc_all >= 1, axis=1).mean()),
            "reward/all_unsolved_frac": float(np.all(acc_all <= 0, axis=1).mean()),
            "response/length_mean": float(len_all[on].mean()),
            "response/length_max": float(len_all[on].max()),
            "response/clipped_frac": float(trunc_all[on].mean()),
            "time/sample_s": t_sample,
            **(self.backend.metrics() if hasattr(self.backend, "metrics") else {}),
            # Per-batch figures only: process-lifetime counters would restart on a resume.
            **multihost.combine_metrics(
                {k: float(v) for k, v in res.metrics.items() if k != "rewards/batches"}
            ),
        }
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return RolloutResult(groups, metrics)

    def model_inputs(self, groups: Groups) -> dict[str, np.ndarray]:
        return to_model_inputs(groups, drop_truncated=self.overlong_filter)


def _model_and_targets(groups: Groups) -> dict[str, np.ndarray]:
    arrays = to_model_inputs(groups)
    return {k: arrays[k] for k in _MODEL_KEYS + ("targets_BxT", "loss_mask_BxT")}
