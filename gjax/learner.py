"""The learner: the pure, jitted device steps of RL training and the batch they take.

  * `policy_logps` : teacher-forced per-token log-probs of completions (old / reference);
  * `update`       : `gjax.objective.prepare` on the full rollout batch, then
                     num_iterations x minibatches optax updates inside one jit (`lax.scan`),
                     each accumulating gradients over microbatches. Normalizers are global:
                     per minibatch when a rollout batch feeds several updates, never per
                     microbatch, so the update is independent of the accumulation split.
  * `Learner.batch`: a rollout's groups -> the update's device batch, with the teacher-forced
                     passes (old log-probs of anchors, reference log-probs) done on device.

Both trace under `sharding.sequence_rules()`: on a mesh with `mesh.seq` > 1 their token
axis is split over the sequence shards (ring attention; rollouts keep whole rows).

Array naming: `*_BxS` are full sequences (prompt ++ completion, S = S_prompt + T), `*_BxT`
are aligned with the T completion tokens (hidden[t] predicts targets[t]), `*_PxG` per sample.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from gjax import multihost, packing, sharding
from gjax import objective as obj
from gjax.experience import Groups, to_model_inputs
from gjax.models import lora
from gjax.models.config import ModelConfig
from gjax.models.transformer import forward, lm_head_kernel
from gjax.objective.aggregation import minibatch_scale_MxB
from gjax.objective.logprobs import token_logps, token_logps_BxT

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


def state_shardings(params, tx: optax.GradientTransformation, mesh) -> TrainState:
    """The train state's shardings for `params` (arrays or sharded `ShapeDtypeStruct`s):
    optimizer moments follow their parameters' (`optax.tree_utils.tree_map_params`);
    scalars (step, counts) are replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    opt_shardings = optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, params),
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def init_state(params, tx: optax.GradientTransformation, mesh) -> tuple[TrainState, TrainState]:
    """The initial train state and its shardings (`state_shardings`), built on the mesh
    (never on one device)."""
    shardings = state_shardings(params, tx, mesh)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=step, params=params, opt_state=opt_state), shardings


# ------------------------------------------------------------------------------ device steps


def _sequence_sharded(fn: Callable) -> Callable:
    """`fn` traced under `sharding.sequence_rules()`: its token axis over `mesh.seq`."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with sharding.use_rules(sharding.sequence_rules()):
            return fn(*args, **kwargs)

    return traced


def completion_hidden(params, cfg: ModelConfig, batch) -> jax.Array:
    """Final hidden states at the T positions that predict the completion tokens."""
    t = batch["targets_BxT"].shape[1]
    hidden_BxSxD = forward(
        params, cfg, batch["input_ids_BxS"], batch["positions_BxS"], batch["segment_ids_BxS"]
    )
    s = hidden_BxSxD.shape[1]
    return hidden_BxSxD[:, s - t - 1 : s - 1]


@_sequence_sharded
def policy_logps(
    params,
    batch,
    *,
    cfg: ModelConfig,
    temperature: float,
    pack: packing.Packing | None = None,
    minibatches: int = 1,
    shards: int = 1,
) -> jax.Array:
    """log pi(y_t | prompt, y_<t) / temperature-scaled, for every completion token; 0 on padding.

    `pack`: the rows run packed (each minibatch's rows in its own bins, as `update` packs
    them; the plan is in the batch), the log-probs come back in the rows' [B, T] layout.
    `shards`: the data-parallel devices the bins are split over; the head's token chunks are
    cut per device block of bins, so no chunk pads across devices (collective-permutes:
    see `packing.auto_bins`).
    """
    if pack is None:
        hidden_BxTxD = completion_hidden(params, cfg, batch)
        logps_BxT, _ = token_logps_BxT(
            hidden_BxTxD,
            lm_head_kernel(params, cfg),
            batch["targets_BxT"],
            temperature=temperature,
            with_entropy=False,
        )
        return jnp.where(batch["loss_mask_BxT"], logps_BxT, 0.0)
    b, s = batch["input_ids_BxS"].shape
    t = batch["targets_BxT"].shape[1]
    bins, width = pack.shape(b, s, minibatches, batch.get("pack_bins_J"))
    total = minibatches * bins  # minibatch m's bins are [m * bins, (m + 1) * bins)
    plan_B = {k: batch[k] for k in packing.PLAN_KEYS}
    plan_B["pack_bin_B"] = plan_B["pack_bin_B"] + (jnp.arange(b) % minibatches) * bins
    dest_BxS = packing.destinations(plan_B, s, total, width)
    n = total * width
    inputs = packing.pack_model_inputs(batch, dest_BxS, n)
    hidden_JxWxD = forward(
        params,
        cfg,
        inputs["input_ids"].reshape(total, width),
        inputs["positions"].reshape(total, width),
        inputs["segment_ids"].reshape(total, width),
    )
    dest_BxT = packing.completion_destinations(dest_BxS, t)
    targets_JxW = packing.scatter(batch["targets_BxT"], dest_BxT, n).reshape(total, width)
    if "pack_reads_C" in batch:  # the head at the read positions only
        read_JxC = packing.read_positions(dest_BxT, total, width, batch["pack_reads_C"].shape[0])
        hidden_JxWxD = packing.take_reads(hidden_JxWxD, read_JxC)
        targets_JxW = packing.take_reads(targets_JxW, read_JxC)
    head_DxV = lm_head_kernel(params, cfg)
    pieces = math.gcd(total, shards)  # contiguous blocks of bins, one per device
    seq = sharding.sequence_shards(hidden_JxWxD.shape[1])
    if seq > 1:  # and blocks of positions, one per sequence shard
        hidden_JxWxD, targets_JxW = (
            packing.shard_major(x, seq) for x in (hidden_JxWxD, targets_JxW)
        )
        pieces *= seq

    def head_logps(hidden_NxD, targets_N):
        return token_logps(
            hidden_NxD, head_DxV, targets_N, temperature=temperature, with_entropy=False
        )[0]

    logps_N = jax.vmap(head_logps)(
        hidden_JxWxD.reshape(pieces, -1, hidden_JxWxD.shape[-1]),
        targets_JxW.reshape(pieces, -1),
    ).reshape(-1)
    if seq > 1:
        logps_N = packing.from_shard_major(logps_N.reshape(seq * total, -1), seq).reshape(-1)
    if "pack_reads_C" in batch:  # back to the bins' [J, W] places
        rows_JxC = jnp.broadcast_to(jnp.arange(total)[:, None], read_JxC.shape)
        logps_JxW = jnp.zeros((total, width), logps_N.dtype)
        logps_N = logps_JxW.at[rows_JxC, read_JxC].set(logps_N.reshape(read_JxC.shape), mode="drop")
        logps_N = logps_N.reshape(n)
    return jnp.where(batch["loss_mask_BxT"], packing.gather(logps_N, dest_BxT), 0.0)


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


def pack_minibatch(rows, prep, *, bins: int, width: int, microbatches: int, reads=None):
    """One minibatch's rows and `prepare` arrays -> its microbatches of `bins` packed bins of
    `width` tokens: three dicts of [K, J/K, W] arrays (model inputs, loss inputs, prep), the
    loss ones under the objective's names (a bin is a row of the objective's [B, T] grid; its
    segment ids say which minibatch row each token belongs to). With `reads` (C, `plan`'s
    `pack_reads`) the loss inputs are [K, J/K, C], only the positions the loss reads
    (`packing.read_positions`, in `inputs["read_JxC"]`): the head runs there alone."""
    s = rows["input_ids_BxS"].shape[1]
    t = rows["targets_BxT"].shape[1]
    n = bins * width
    dest_RxS = packing.destinations(rows, s, bins, width)
    dest_RxT = packing.completion_destinations(dest_RxS, t)
    inputs = packing.pack_model_inputs(rows, dest_RxS, n)
    mb = {k: packing.scatter(rows[k], dest_RxT, n) for k in _BATCH_KEYS_FOR_LOSS if k in rows}
    mb["segment_ids"] = inputs["segment_ids"]
    mprep = {k: packing.scatter(v, dest_RxT, n) for k, v in prep.items()}
    inputs, mb, mprep = jax.tree.map(lambda x: x.reshape(bins, width), (inputs, mb, mprep))
    if reads is not None:
        read_JxC = packing.read_positions(dest_RxT, bins, width, reads)
        mb, mprep = jax.tree.map(lambda x: packing.take_reads(x, read_JxC), (mb, mprep))
        inputs["read_JxC"] = read_JxC

    def micro(x):  # [J, ...] -> [K, J / K, ...]: microbatches are contiguous bins
        return x.reshape(microbatches, bins // microbatches, *x.shape[1:])

    return jax.tree.map(micro, (inputs, mb, mprep))


@_sequence_sharded
def update(
    state: TrainState,
    batch: dict[str, jax.Array],
    rng: jax.Array,
    frozen=None,
    *,
    cfg: ModelConfig,
    obj_cfg: obj.ObjectiveConfig,
    tx: optax.GradientTransformation,
    minibatches: int,
    microbatches: int,
    num_iterations: int,
    schedule: Callable | None = None,
    pack: packing.Packing | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One RL update on a rollout batch: advantages once, then the optimizer updates.

    `schedule` (the optimizer's learning-rate schedule) only adds `optim/lr` to the metrics,
    computed here so the host never waits on the device for it. `pack`: the rows run packed
    into bins (`gjax.packing`; the plan is in the batch); same loss, metrics and gradients.
    `frozen`: LoRA's base (`gjax.models.lora`): `state.params` are then the adapters, the
    only leaves differentiated, updated and given optimizer state; None: full fine-tuning.
    """
    prep, prep_metrics = obj.prepare(batch, obj_cfg, rng)  # reads only the keys it needs
    keys = _MODEL_KEYS + _BATCH_KEYS_FOR_LOSS + (packing.PLAN_KEYS if pack else ())
    rows = {k: batch[k] for k in keys if k in batch}
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

    def loss_fn(trained, micro):
        mb, mprep = micro
        params = lora.merge(frozen, trained)
        hidden_BxTxD = completion_hidden(params, cfg, mb)
        return obj.micro_batch_loss(hidden_BxTxD, lm_head_kernel(params, cfg), mb, mprep, obj_cfg)

    def packed_loss_fn(trained, micro):
        inputs, mb, mprep = micro
        params = lora.merge(frozen, trained)
        hidden_JxWxD = forward(
            params, cfg, inputs["input_ids"], inputs["positions"], inputs["segment_ids"]
        )
        if "read_JxC" in inputs:  # the head at the read positions only
            hidden_JxWxD = packing.take_reads(hidden_JxWxD, inputs["read_JxC"])
        seq = sharding.sequence_shards(hidden_JxWxD.shape[1])
        if seq > 1:  # the loss is a sum over tokens: each sequence shard's own, first
            hidden_JxWxD, mb, mprep = jax.tree.map(
                lambda x: packing.shard_major(x, seq), (hidden_JxWxD, mb, mprep)
            )
        return obj.micro_batch_loss(
            hidden_JxWxD,
            lm_head_kernel(params, cfg),
            mb,
            mprep,
            obj_cfg,
            segment_BxT=mb["segment_ids"],
            num_segments=rows["targets_BxT"].shape[0] // minibatches + 1,
        )

    if pack is None:
        pieces_M = (rows_M, prep_M)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    else:  # packed once per minibatch: every pass and iteration reuses the bins
        b, s = rows["input_ids_BxS"].shape
        bins, width = pack.shape(b, s, minibatches, batch.get("pack_bins_J"))
        reads = batch["pack_reads_C"].shape[0] if "pack_reads_C" in batch else None
        pieces_M = jax.vmap(
            functools.partial(
                pack_minibatch, bins=bins, width=width, microbatches=microbatches, reads=reads
            )
        )(rows_M, prep_M)
        grad_fn = jax.value_and_grad(packed_loss_fn, has_aux=True)

    def one_update(carry, minibatch):
        params, opt_state = carry
        micro_K = minibatch if pack else split_rows(minibatch, microbatches)

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
        return jax.lax.scan(one_update, carry, pieces_M)

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
    if pack is not None and "pack_metrics" in batch:  # from the host plan
        metrics["pack/bins_used_max"] = batch["pack_metrics"][0]
        metrics["pack/fill"] = batch["pack_metrics"][1]
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


# ---------------------------------------------------------------------------------- learner


@dataclasses.dataclass
class Learner:
    """The jitted device functions of a run (compiled once each) and the batch they take.

    `batch(groups, params, ref_params)` is the one place a rollout batch becomes the update's
    device batch, in every mode (synchronous, overlapped, split meshes, several processes):
    the teacher-forced passes run here, on the learner's devices, with the params the update
    starts from. Old log-probs are the sampler's (the behaviour policy's, at the same
    temperature; with k > 0 a version up to k updates older) for on-policy rows; anchors (DaGRPO) are teacher-forced, and so is every row
    with `recompute_old`, in which case the sampler's go along as `behaviour_logps_BxT`
    (mismatch metrics, `objective.behaviour_correction`) when the backend returned any.
    """

    logps: Callable
    update: Callable
    transfer: multihost.RowTransfer
    # LoRA: the frozen base (never donated) and the reference's log-probs (the base with
    # adapters off); None: full fine-tuning (the reference is a copy, `logps` scores it).
    frozen: Any = None
    ref_logps: Callable | None = None
    anchors: bool = False  # DaGRPO: groups end in teacher-forced demonstrations
    recompute_old: bool = False
    behaviour_logps: bool = True  # the backend returns the sampler's log-probs
    overlong_filter: bool = False  # DAPO: truncated completions get no loss
    pack: packing.Packing | None = None  # rows packed into bins (the plan is made here)
    minibatches: int = 1
    microbatches: int = 1

    def policy(self, trained):
        """The policy's whole param tree from the trained one (LoRA: base + adapters)."""
        return lora.merge(self.frozen, trained)

    def batch(self, groups: Groups, params, ref_params) -> dict[str, jax.Array]:
        """The update's device batch; `params` the whole policy (`policy(state.params)`),
        `ref_params` the reference's (LoRA: `frozen`), None: no KL term, no reference pass."""
        host = to_model_inputs(groups, drop_truncated=self.overlong_filter)
        if self.pack is not None:  # one plan from every process's rows, the same everywhere
            spans_Bx2 = self.transfer.gather_rows(
                packing.row_spans(host["segment_ids_BxS"], host["loss_mask_BxT"])
            )
            host.update(
                packing.plan(
                    spans_Bx2,
                    self.pack,
                    s=host["input_ids_BxS"].shape[1],
                    minibatches=self.minibatches,
                    microbatches=self.microbatches,
                    shards=self.transfer.layout.rows,  # auto J: even bins on every device
                    # auto bins: the head at the read positions (C joins J as a shape);
                    # fixed bins keep one compiled shape (the head at every position).
                    t=None if self.pack.bins else host["targets_BxT"].shape[1],
                )
            )
            # J (and C) as shapes (auto: one compile per distinct shape, never per step)
            host.update(packing.markers(host))
        batch = self.transfer.put_batch(host)
        if ref_params is not None:
            batch["ref_logps_BxT"] = (self.ref_logps or self.logps)(ref_params, batch)
        if self.anchors or self.recompute_old:
            old_BxT = self.logps(params, batch)
            # The whole batch's anchor flags are on the devices already (all-gathered, B rows
            # in batch order): anchors take the teacher-forced log-probs, the rest the sampler's.
            anchor_Bx1 = batch["is_anchor_PxG"].reshape(-1, 1)
            behaviour_BxT = jnp.where(anchor_Bx1, old_BxT, batch["old_logps_BxT"])
            if not self.recompute_old:
                batch["old_logps_BxT"] = behaviour_BxT
            else:
                batch["old_logps_BxT"] = old_BxT
                if self.behaviour_logps:
                    batch["behaviour_logps_BxT"] = behaviour_BxT
        return batch


def build_learner(
    config,
    *,
    mesh: jax.sharding.Mesh,
    model_cfg: ModelConfig,
    obj_cfg: obj.ObjectiveConfig,
    params,
    frozen=None,
    behaviour_logps: bool = True,
) -> tuple[TrainState, Learner]:
    """The fresh train state on `mesh` and the learner of a run's `config`: the optimizer and
    its schedule over `config.train.steps` steps of minibatches x num_iterations updates.
    `params` are what trains (LoRA: the adapters, with the base as `frozen`).
    `behaviour_logps`: whether the rollout backend returns the sampler's log-probs (if not,
    old log-probs are always recomputed). `gjax.train` builds its learner here, and so do
    the tools that drive a run by hand."""
    t = config.train
    tx, schedule = make_optimizer(
        config.optim, t.steps, updates_per_step=t.minibatches * t.num_iterations
    )
    state, state_shardings = init_state(params, tx, mesh)
    learner = make_learner(
        mesh=mesh,
        model_cfg=model_cfg,
        obj_cfg=obj_cfg,
        tx=tx,
        state_shardings=state_shardings,
        train_cfg=t,
        schedule=schedule,
        anchors=config.anchors.per_group > 0,
        recompute_old=config.rollout.recompute_old_logps or not behaviour_logps,
        behaviour_logps=behaviour_logps,
        overlong_filter=config.sampling.overlong_filter,
        frozen=frozen,
    )
    learner.transfer.layout.check_rows(
        config.rollout.prompts_per_step, "config.rollout.prompts_per_step"
    )
    return state, learner


def make_learner(
    *,
    mesh: jax.sharding.Mesh,
    model_cfg: ModelConfig,
    obj_cfg: obj.ObjectiveConfig,
    tx: optax.GradientTransformation,
    state_shardings: Any,
    train_cfg,
    schedule: Callable | None = None,
    **options,
) -> Learner:
    """`Learner` with `policy_logps` and `update` jitted for `mesh` (options: its flags)."""
    batch_sharding = sharding.activation_sharding(mesh, ("batch",))
    replicated = NamedSharding(mesh, PartitionSpec())
    pack = packing.from_config(train_cfg)
    transfer = multihost.RowTransfer(batch_sharding)
    if pack is not None:
        packing.check_fixed_bins(
            pack.bins, train_cfg.microbatches, transfer.layout.rows, jax.process_count()
        )

    def jit_logps(cfg):
        return jax.jit(
            functools.partial(
                policy_logps,
                cfg=cfg,
                temperature=obj_cfg.temperature,
                pack=pack,
                minibatches=train_cfg.minibatches,
                shards=transfer.layout.rows,
            ),
            out_shardings=batch_sharding,
        )

    logps = jit_logps(model_cfg)
    if lora.enabled(model_cfg):  # the reference: the frozen base, adapters off
        options["ref_logps"] = jit_logps(model_cfg.without_lora())
    upd = jax.jit(
        functools.partial(
            update,
            cfg=model_cfg,
            obj_cfg=obj_cfg,
            tx=tx,
            minibatches=train_cfg.minibatches,
            microbatches=train_cfg.microbatches,
            num_iterations=train_cfg.num_iterations,
            schedule=schedule,
            pack=pack,
        ),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    return Learner(
        logps=logps,
        update=upd,
        transfer=transfer,
        pack=pack,
        minibatches=train_cfg.minibatches,
        microbatches=train_cfg.microbatches,
        **options,
    )
