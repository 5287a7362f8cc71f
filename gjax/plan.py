"""Memory planner: what a run needs per device, and whether it fits a slice's chips.

    python -m gjax.plan --config=configs/grpo.py --slice=v5e-8 [--shape=qwen3-8b] \
        [--modes=full,lora,qlora] [--lora_rank=16] [--qlora=int8] [--margin=0.1] \
        [--json=plan.json] [--norollout] [--config.mesh.data=1 --config.mesh.fsdp=-1 ...]

No weight is read and nothing is allocated: the learner's update (the config's rollout batch
at its longest, its packing, remat, minibatches and microbatches) and the rollout step (the
config's decoder: the continuous decoder's per-layer weights, prefill and dispatch, or the
static sampler's whole program) are jitted for the slice's mesh on `jax.ShapeDtypeStruct`s
with their shardings, lowered and compiled on this machine's CPU (one fake CPU device per
chip), and `memory_analysis()` of each compiled program gives its per-device temporaries.
Parameter, optimizer, batch and KV bytes are the per-device shards of the abstract trees.
The whole model is compiled (the 8B update and rollout programs for 8 devices: about 2.5
minutes and 0.9 GB of memory on a 2-core machine; measured, a linear extrapolation from 2
and 3 layers put a 1.5B continuous decoder's temporaries at 1.6 GiB where the whole
model's compile gives 5.6, so none is offered).

`--norollout` plans the update alone (its rollout columns read 0): long-context tables
(`scripts/seq_plan.py`: the update at 8k-32k tokens with `--config.mesh.seq`, the sequence
shards of the update) need no decoder compiled at each length.

Per device a run holds the frozen base (LoRA), the trained params and their Adam state
throughout; on top of that either the update's batch and temporaries, or the rollout's
per-layer decode weights, decoder state (KV) and temporaries (rollouts share the train
mesh): peak = params + optimizer + max(update, rollout). It fits when the peak stays under
(1 - --margin) of the chip's HBM.

Rows (`--modes`): full (every parameter trained), lora (rank `model.lora.rank`, or
--lora_rank when the config trains every parameter; the base in `model.param_dtype`),
qlora (the same adapters on a base stored as `--qlora` says, `model.lora.quantize`: int8,
int4 or nf4 codes + f32 scales, `gjax.models.quant`; 4-bit codes count half a byte, as a
TPU packs them). Each row is compiled.

Caveats, also printed: these are XLA:CPU's buffer assignments, which fuse and schedule
differently from a TPU's or a GPU's; attention compiles as `model.attention` resolves on a
CPU (auto: xla, dense masked scores) where a TPU runs splash attention (no T x T scores), so
long rows' activations are overstated.

The chips' HBM (`CHIPS`) and the named model shapes (`SHAPES`, from the models' public
config.json files, as no hub is reachable here) are small strict registries; without
--shape the model's shape is `config.model.path`'s config.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from gjax import cli, packing, schema, sharding
from gjax import config as config_lib
from gjax.embedded import resolve_model_path
from gjax.errors import ConfigError, UserError
from gjax.experience import Groups, to_model_inputs
from gjax.learner import TrainState, make_learner, make_optimizer, state_shardings
from gjax.models import attention, hf_format, lora, transformer
from gjax.models.config import ModelConfig
from gjax.rollout import buckets, sampler
from gjax.rollout import decoder as dec
from gjax.rollout.factory import local_decoder

GiB, GB = 1 << 30, 10**9

# ------------------------------------------------------------------------------- registries


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: int
    platform: str  # where `model.attention=auto` resolves (gjax.models.attention.AUTO)
    source: str


# HBM per chip, from the vendors' pages.
CHIPS = {
    # cloud.google.com/tpu/docs/v5e: 16 GiB HBM2 per chip.
    "v5e": Chip(16 * GiB, "tpu", "cloud.google.com/tpu/docs/v5e (16 GiB per chip)"),
    # cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e per chip.
    "v5p": Chip(95 * GiB, "tpu", "cloud.google.com/tpu/docs/v5p (95 GiB per chip)"),
    # cloud.google.com/tpu/docs/v6e: 32 GiB HBM per chip (Trillium).
    "v6e": Chip(32 * GiB, "tpu", "cloud.google.com/tpu/docs/v6e (32 GiB per chip)"),
    # cloud.google.com/tpu/docs/v4: 32 GiB HBM2 per chip.
    "v4": Chip(32 * GiB, "tpu", "cloud.google.com/tpu/docs/v4 (32 GiB per chip)"),
    # nvidia.com/en-us/data-center/h100: 80 GB HBM3 (SXM).
    "h100": Chip(80 * GB, "gpu", "nvidia.com/en-us/data-center/h100 (80 GB, SXM)"),
    # nvidia.com/en-us/data-center/h200: 141 GB HBM3e.
    "h200": Chip(141 * GB, "gpu", "nvidia.com/en-us/data-center/h200 (141 GB)"),
}
# Slice name -> (chip, chips). TPU v4 / v5p names count TensorCores (two per chip: v5p-8 is
# 4 chips), v5e / v6e names count chips; a GPU host is `h200` (one) or `h200x8`.
SLICES: dict[str, tuple[str, int]] = {
    **{f"v5e-{n}": ("v5e", n) for n in (1, 4, 8, 16, 32, 64, 128, 256)},
    **{f"v6e-{n}": ("v6e", n) for n in (1, 4, 8, 16, 32, 64, 128, 256)},
    **{f"v5p-{n}": ("v5p", n // 2) for n in (8, 16, 32, 64, 128, 256)},
    **{f"v4-{n}": ("v4", n // 2) for n in (8, 16, 32, 64, 128)},
    **{g: (g, 1) for g in ("h100", "h200")},
    **{f"{g}x{n}": (g, n) for g in ("h100", "h200") for n in (2, 4, 8)},
}

# config.json fields of public checkpoints (huggingface.co/<id>/blob/main/config.json), as
# published on the model cards (no hub is reachable from where this table was written).
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8)
_QWEN3.update(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        **_QWEN3,
        **dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
        **dict(num_attention_heads=16, tie_word_embeddings=True),
    },
    "qwen3-1.7b": {  # Qwen/Qwen3-1.7B
        **_QWEN3,
        **dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
        **dict(num_attention_heads=16, tie_word_embeddings=True),
    },
    "qwen3-4b": {  # Qwen/Qwen3-4B
        **_QWEN3,
        **dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36),
        **dict(num_attention_heads=32, tie_word_embeddings=True),
    },
    "qwen3-8b": {  # Qwen/Qwen3-8B
        **_QWEN3,
        **dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36),
        **dict(num_attention_heads=32, tie_word_embeddings=False),
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B
        **_QWEN25,
        **dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28),
        **dict(num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
        "max_position_embeddings": 131072,
    },
    "qwen2.5-7b": {  # Qwen/Qwen2.5-7B
        **_QWEN25,
        **dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28),
        **dict(num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
        **dict(vocab_size=152064, max_position_embeddings=131072),
    },
}
MODES = ("full", "lora", "qlora")
QLORA = ("int8", "int4", "nf4")  # model.lora.quantize values of the qlora row


def get_slice(name: str) -> tuple[str, Chip, int]:
    if name not in SLICES:
        raise UserError(
            f"--slice={name!r} is not a known slice. Known: {', '.join(SLICES)} (TPU v4/v5p "
            "names count TensorCores, two per chip; v5e/v6e names count chips; GPUs: h100, "
            "h200, or h200x8 for a host of 8)."
        )
    chip, n = SLICES[name]
    return chip, CHIPS[chip], n


def get_shape(name: str) -> dict[str, Any]:
    if name not in SHAPES:
        raise UserError(
            f"--shape={name!r} is not a known model shape. Known: {', '.join(SHAPES)}; or "
            "leave --shape out to read the shape from config.model.path's config.json."
        )
    return dict(SHAPES[name])


# ---------------------------------------------------------------------------- byte counts


def tree_bytes(tree) -> int:
    """Per-device bytes of a tree of `ShapeDtypeStruct`s with shardings (the largest shard;
    a leaf without a sharding counts whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
        bits = jnp.iinfo(x.dtype).bits if jnp.issubdtype(x.dtype, jnp.integer) else None
        # 4-bit codes (QLoRA) count half a byte each: a TPU stores them packed
        total += math.ceil(int(np.prod(shape)) * (bits / 8 if bits else x.dtype.itemsize))
    return total


def with_shardings(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


# ---------------------------------------------------------------------------- the programs


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
    }


def worst_case_batch(config, mesh, dp: int):
    """The update's device batch as abstract arrays: every prompt and completion at its full
    length (the most tokens a step can bring), laid out and packed as `Learner.batch` does."""
    r = config.rollout
    p, g, s, n = r.prompts_per_step, r.num_samples, config.data.max_prompt_len, r.max_new_tokens
    groups = Groups(
        prompt_ids_PxS=np.zeros((p, s), np.int32),
        prompt_mask_PxS=np.ones((p, s), bool),
        completion_ids_PxGxN=np.zeros((p, g, n), np.int32),
        completion_mask_PxGxN=np.ones((p, g, n), bool),
        truncated_PxG=np.zeros((p, g), bool),
        is_anchor_PxG=np.zeros((p, g), bool),
        rewards_PxG=np.zeros((p, g), np.float32),
        scores_PxG=np.zeros((p, g), np.float32),
        valid_PxG=np.ones((p, g), bool),
        old_logps_PxGxN=np.zeros((p, g, n), np.float32),
    )
    host = to_model_inputs(groups)
    if config.objective.kl_beta > 0:  # the reference pass's output joins the batch
        host["ref_logps_BxT"] = np.zeros((p * g, n), np.float32)
    if config.rollout.recompute_old_logps and config.objective.behaviour_correction != "none":
        host["behaviour_logps_BxT"] = np.zeros((p * g, n), np.float32)
    pack = packing.from_config(config.train)
    if pack is not None:
        spans = packing.row_spans(host["segment_ids_BxS"], host["loss_mask_BxT"])
        t = config.train
        host.update(
            packing.plan(
                spans,
                pack,
                s=host["input_ids_BxS"].shape[1],
                minibatches=t.minibatches,
                microbatches=t.microbatches,
                shards=dp,
                t=None if pack.bins else n,
            )
        )
        host.update(packing.markers(host))
    rows = sharding.activation_sharding(mesh, ("batch",))
    replicated = NamedSharding(mesh, PartitionSpec())
    return {
        k: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=rows if k.endswith(("_BxS", "_BxT")) else replicated
        )
        for k, v in host.items()
    }


def plan_update(config, model_cfg, mesh, *, lora_on: bool) -> dict[str, int]:
    """The update's per-device bytes: frozen base, trained params, Adam state, batch, and
    the compiled program's temporaries. (The teacher-forced reference / old log-prob passes
    are programs of their own, forward only, smaller than the update; not compiled here.)"""
    obj_cfg = schema.to_objective_config(
        config.objective, rollout_temperature=config.rollout.temperature
    )
    t = config.train
    tx, schedule = make_optimizer(config.optim, t.steps, t.minibatches * t.num_iterations)
    whole = transformer.abstract_params(model_cfg)
    if lora_on:
        base, trained = lora.split(whole)
    else:
        base, trained = None, whole
    base = None if base is None else with_shardings(base, sharding.param_shardings(base, mesh))
    trained = with_shardings(trained, sharding.param_shardings(trained, mesh))
    shardings = state_shardings(trained, tx, mesh)
    replicated = shardings.step
    opt = with_shardings(jax.eval_shape(tx.init, trained), shardings.opt_state)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = TrainState(step=step, params=trained, opt_state=opt)
    dp = sharding.mesh_axis_size(mesh, sharding.current_rules()["batch"])
    learner = make_learner(
        mesh=mesh,
        model_cfg=model_cfg,
        obj_cfg=obj_cfg,
        tx=tx,
        state_shardings=shardings,
        train_cfg=t,
        schedule=schedule,
    )
    batch = worst_case_batch(config, mesh, dp)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    compiled = learner.update.lower(state, batch, key, base).compile()
    return {
        "base": 0 if base is None else tree_bytes(base),
        "trained": tree_bytes(trained),
        "optimizer": tree_bytes(opt) + tree_bytes(step),
        "batch": tree_bytes(batch),
        "update_temp": _memory(compiled)["temp"],
    }


def plan_rollout(config, model_cfg, mesh) -> dict[str, int]:
    """The rollout's per-device bytes beyond the params, for the config's decoder: KV (the
    slot state, or the static sampler's caches), the per-layer decode weights and the
    compiled programs' temporaries.

    The continuous decoder's slot state is made unsharded (`decoder.init_state`, outside
    jit): every device holds all of it, whatever the mesh."""
    r = config.rollout
    p, g, s, n = r.prompts_per_step, r.num_samples, config.data.max_prompt_len, r.max_new_tokens
    whole = transformer.abstract_params(model_cfg)
    params = with_shardings(whole, sharding.param_shardings(whole, mesh))
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    sp = sampler.SamplingParams(
        max_new_tokens=n, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p
    )
    if r.backend != "local" or local_decoder(r.decoder) == "continuous":
        slots = r.decode_slots
        d = dec.ContinuousDecoder(model_cfg, slots=slots, tokens_per_dispatch=r.tokens_per_dispatch)
        regions = d.regions_for(g)
        if r.backend == "jetstream":  # the in-process engine: a region per slot, its bucket
            # wide (a multi-turn run's holds a turn's whole history: `served_prompt_len`)
            regions, s = slots, buckets.prefill_bucket(buckets.served_prompt_len(config))
        a = max(1, -(-slots // g))  # prompts per prefill call (the decoder's default)
        state = jax.eval_shape(lambda: dec.init_state(model_cfg, slots, regions, s, n))
        state = with_shardings(state, jax.tree.map(lambda _: replicated, state))
        kv = [*state.cache_k, *state.cache_v, *state.prompt_k, *state.prompt_v]
        out = {"kv": tree_bytes(kv), "decode_state": tree_bytes(state)}
        if r.kv_page_size and r.kv_pages:  # paged, a pool of its own size (the default pool
            # has the contiguous layout's bytes, as above); the programs' temporaries are
            # the contiguous ones'
            page_bytes = tree_bytes(state.cache_k[:1]) // (slots * n) * r.kv_page_size
            pool = 2 * model_cfg.num_layers * r.kv_pages * page_bytes
            out["decode_state"] += pool - out["kv"]
            out["kv"] = pool
        layers_c = dec._layers_jit.lower(params, cfg=model_cfg).compile()
        layers = with_shardings(
            jax.eval_shape(functools.partial(transformer.decode_layers, cfg=model_cfg), params),
            layers_c.output_shardings,
        )
        tokens = jax.ShapeDtypeStruct((a, s), jnp.int32, sharding=replicated)
        region = jax.ShapeDtypeStruct((a,), jnp.int32, sharding=replicated)
        prefill_c = dec._prefill_jit.lower(params, model_cfg, state, tokens, tokens, region)
        dispatch_c = dec._dispatch_jit.lower(
            params, model_cfg, layers, state, sp=sp, steps=r.tokens_per_dispatch
        )
        # one program at a time: building the decode weights, a prefill, a dispatch
        programs = (layers_c, prefill_c.compile(), dispatch_c.compile())
        out["decode_weights"] = tree_bytes(layers)
        out["rollout_temp"] = max(_memory(c)["temp"] for c in programs)
        return out
    # The static sampler: one program; its caches and per-layer weights are temporaries.
    dtype = jnp.dtype(model_cfg.jnp_dtype).itemsize
    kv_axes = ("batch", "kv_heads", "length", None)
    per_layer = 0
    for rows, length in ((p, s), (p * g, n)):
        shape = (rows, model_cfg.num_kv_heads, length, model_cfg.head_dim)
        spec = sharding.activation_sharding(mesh, kv_axes, shape=shape)
        per_layer += math.prod(spec.shard_shape(shape)) * dtype * 2
    tokens = jax.ShapeDtypeStruct((p, s), jnp.int32, sharding=replicated)
    compiled = sampler._generate_jit.lower(
        params, model_cfg, tokens, tokens, key, num_samples=g, sampling=sp
    ).compile()
    mem = _memory(compiled)
    return {
        "kv": per_layer * model_cfg.num_layers,
        "decode_state": 0,
        "decode_weights": 0,  # inside the program's temp
        "rollout_temp": mem["temp"] + mem["output"],
    }


# ------------------------------------------------------------------------------ the plan


@dataclasses.dataclass
class Row:
    mode: str
    figures: dict[str, int]
    what: str = ""  # e.g. "base int8 + rank-16 adapters"

    @property
    def persistent(self) -> int:
        f = self.figures
        return f["base"] + f["trained"] + f["optimizer"]

    @property
    def update(self) -> int:
        return self.figures["batch"] + self.figures["update_temp"]

    @property
    def rollout(self) -> int:
        f = self.figures
        return f["decode_weights"] + f["decode_state"] + f["rollout_temp"]

    @property
    def peak(self) -> int:
        return self.persistent + max(self.update, self.rollout)


def mode_config(config, mode: str, lora_rank: int, qlora: str):
    """`config` for a row: full trains every parameter, lora / qlora rank-r adapters (the
    config's rank, else `lora_rank`), qlora's base stored as `qlora` says."""
    c = config.copy_and_resolve_references()
    c.model.lora.quantize = qlora if mode == "qlora" else "none"
    if mode == "full":
        c.model.lora.rank = 0
    elif not c.model.lora.rank:
        c.model.lora.rank = lora_rank
    return c


def model_config(config, hf: dict[str, Any], num_layers: int | None = None):
    """The run's `ModelConfig` (numerics from `config.model`, LoRA from `model.lora`)."""
    m = config.model
    try:
        cfg = ModelConfig.from_hf(
            hf,
            param_dtype=m.param_dtype,
            dtype=m.dtype,
            remat=m.remat,
            attention=attention.resolve(m.attention, "cpu", m.dtype),
        )
    except ValueError as e:
        raise ConfigError(f"the model shape: {e}") from None
    if num_layers is not None:
        cfg = cfg.replace(num_layers=num_layers)
    return lora.configure(cfg, m.lora)


NO_ROLLOUT = {"kv": 0, "decode_state": 0, "decode_weights": 0, "rollout_temp": 0}


def measure(config, hf, mesh, *, lora_on: bool, rollout: bool = True) -> dict[str, int]:
    """Per-device figures of one row, the whole model compiled (`rollout=False`: the update
    only, the rollout's figures 0)."""
    cfg = model_config(config, hf)
    return {
        **plan_update(config, cfg, mesh, lora_on=lora_on),
        **(plan_rollout(config, cfg, mesh) if rollout else NO_ROLLOUT),
    }


def make_plan(
    config,
    hf: dict[str, Any],
    devices,
    *,
    modes=MODES,
    lora_rank: int = 16,
    qlora: str = "int8",
    rollout: bool = True,
) -> tuple[list[Row], dict[str, int]]:
    """The rows of `modes` for `config` on a mesh over `devices` (see the module docstring),
    and the mesh's shape."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UserError(f"--modes={','.join(modes)}: unknown {unknown}; valid: {', '.join(MODES)}.")
    if qlora not in QLORA:
        raise UserError(f"--qlora={qlora!r}: valid: {', '.join(QLORA)}.")
    shape = config_lib.resolve_mesh_shape(config.mesh, len(devices))
    mesh = sharding.make_mesh(shape, devices)
    rows: list[Row] = []
    with jax.set_mesh(mesh), sharding.use_rules():
        for mode in modes:
            c = mode_config(config, mode, lora_rank, qlora)
            if mode == "qlora":
                config_lib.check_lora(c)  # the quantization package is there
            cfg = model_config(c, hf)
            try:
                sharding.validate_model_sharding(cfg, mesh)
            except ValueError as e:
                msg = f"{e}\n(set --config.mesh.* to a mesh the model divides)"
                raise ConfigError(msg) from None
            m = c.model
            if mode == "full":
                what = f"every parameter trained, {m.param_dtype}"
            else:
                base = m.lora.quantize if mode == "qlora" else m.param_dtype
                what = f"base {base} + rank-{m.lora.rank} adapters ({m.lora.dtype})"
            figures = measure(c, hf, mesh, lora_on=mode != "full", rollout=rollout)
            rows.append(Row(mode, figures, what))
    return rows, shape


# ------------------------------------------------------------------------------ reporting

COLUMNS = (  # (figure, header)
    ("base", "base"),
    ("trained", "trained"),
    ("optimizer", "optim"),
    ("batch", "batch"),
    ("update_temp", "upd.tmp"),
    ("decode_weights", "dec.w"),
    ("kv", "KV"),
    ("rollout_temp", "roll.tmp"),
)


def budget(chip: Chip, margin: float) -> int:
    return int(chip.hbm_bytes * (1 - margin))


def table(rows: list[Row], chip: Chip, margin: float) -> str:
    """The rows as a text table, per device, in GiB (MiB for a chip under 1 GiB)."""
    unit, name = (GiB, "GiB") if chip.hbm_bytes >= GiB else (1 << 20, "MiB")
    fmt = lambda n: f"{n / unit:.2f}"  # noqa: E731
    limit = budget(chip, margin)
    head = f"{'mode':<6}" + "".join(f" {h:>8}" for _, h in COLUMNS)
    head += f" {'peak':>8}  fits {fmt(limit)} {name}?"
    lines = [f"{name} per device", head, "-" * len(head)]
    for row in rows:
        verdict = "fits" if row.peak <= limit else "does not fit"
        cells = "".join(f" {fmt(row.figures[k]):>8}" for k, _ in COLUMNS)
        lines.append(f"{row.mode:<6}{cells} {fmt(row.peak):>8}  {verdict}")
    return "\n".join(lines)


def notes(rows: list[Row], config, chip: Chip) -> list[str]:
    out = []
    for row in rows:
        out.append(f"  {row.mode}: {row.what}")
    out.append(
        "  peak = base + trained + optim + max(batch + upd.tmp, dec.w + decoder state + "
        "roll.tmp); KV is part of the decoder state (continuous decoder: unsharded, whole on "
        "every device) or of roll.tmp (static sampler)."
    )
    out.append(
        "  XLA:CPU buffer assignment (a TPU or GPU compile fuses and schedules differently); "
        f"attention compiled as model.attention={config.model.attention!r} resolves on CPU "
        f"(auto: xla, dense T x T scores; on the chip auto runs "
        f"{attention.AUTO.get(chip.platform, 'xla')}), which overstates long rows' activations."
    )
    return out


def report(
    rows: list[Row],
    *,
    slice_name,
    chip_name,
    chip,
    n,
    mesh,
    shape_name,
    config,
    margin,
    rollout: bool = True,
):
    """The plan as a JSON-able dict (what --json writes)."""
    limit = budget(chip, margin)
    r, t, m = config.rollout, config.train, config.model
    return {
        "slice": slice_name,
        "chip": chip_name,
        "chips": n,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "hbm_source": chip.source,
        "margin": margin,
        "budget_bytes": limit,
        "shape": shape_name,
        "mesh": mesh,
        "run": {
            "prompts_per_step": r.prompts_per_step,
            "num_samples": r.num_samples,
            "max_prompt_len": config.data.max_prompt_len,
            "max_new_tokens": r.max_new_tokens,
            "decoder": r.decoder,
            "decode_slots": r.decode_slots,
            "packing": t.packing,
            "minibatches": t.minibatches,
            "microbatches": t.microbatches,
            "remat": m.remat,
            "dtype": m.dtype,
            "param_dtype": m.param_dtype,
            "attention": m.attention,
            "seq": config.mesh.seq,
            "rollout_planned": rollout,
        },
        "rows": [
            {
                "mode": row.mode,
                "what": row.what,
                **{f"{k}_bytes": v for k, v in row.figures.items()},
                "peak_bytes": row.peak,
                "fits": row.peak <= limit,
            }
            for row in rows
        ],
    }


# -------------------------------------------------------------------------------- command


def _hf_of(config, shape_name: str | None) -> dict[str, Any]:
    if shape_name:
        return get_shape(shape_name)

    try:
        local = hf_format.resolve_dir(resolve_model_path(config.model.path))
        with open(os.path.join(local, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"config.model.path={config.model.path!r}: no readable config.json ({e}). Give a "
            f"local checkpoint directory, or --shape= one of {', '.join(SHAPES)}."
        ) from None


def _devices(n: int):
    """`n` devices for the plan: fake CPU devices, asked for before jax starts a backend."""
    with contextlib.suppress(RuntimeError):  # a backend already started (in-process callers)
        jax.config.update("jax_num_cpu_devices", n)
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise UserError(
            f"the plan needs {n} CPU devices and this process has {len(devices)}: run it as a "
            f"command (python -m gjax.plan), or with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n}."
        )
    return devices[:n]


def main(argv) -> None:
    del argv
    F = flags.FLAGS
    if F.config is None:
        raise UserError("--config is required, e.g. --config=configs/grpo.py")
    if F.slice is None:
        raise UserError(f"--slice is required: one of {', '.join(SLICES)}")
    chip_name, chip, n = get_slice(F.slice)
    if not 0 <= F.margin < 1:
        raise UserError(f"--margin={F.margin}: must be in [0, 1)")
    config = F.config
    devices = _devices(n)  # first: anything below may start jax's backend
    config_lib.validate(config, n)  # the run's own checks, for the slice's device count
    hf = _hf_of(config, F.shape)
    if "max_position_embeddings" in hf:  # a row within the model's positions
        config_lib.check_length(config, int(hf["max_position_embeddings"]))
    rows, mesh = make_plan(
        config,
        hf,
        devices,
        modes=tuple(F.modes),
        lora_rank=F.lora_rank,
        qlora=F.qlora,
        rollout=F.rollout,
    )
    shape_name = F.shape or config.model.path
    print(
        f"{shape_name} on {F.slice} ({n} x {chip_name}, {chip.hbm_bytes / GiB:.2f} GiB each, "
        f"{F.margin:.0%} kept free), mesh {mesh}"
    )
    print(table(rows, chip, F.margin))
    print("\n".join(notes(rows, config, chip)))
    if not F.rollout:
        print("  --norollout: the update alone; the rollout columns are not planned (0).")
    if F.json:
        rep = report(
            rows,
            slice_name=F.slice,
            chip_name=chip_name,
            chip=chip,
            n=n,
            mesh=mesh,
            shape_name=shape_name,
            config=config,
            margin=F.margin,
            rollout=F.rollout,
        )
        with open(F.json, "w") as f:
            json.dump(rep, f, indent=2)


def _define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "a config file (configs/*.py[:arg])")
    flags.DEFINE_string("slice", None, f"the slice to plan for: {', '.join(SLICES)}")
    flags.DEFINE_string(
        "shape", None, f"a named model shape ({', '.join(SHAPES)}; default: model.path's)"
    )
    flags.DEFINE_list("modes", list(MODES), "rows: full, lora, qlora")
    flags.DEFINE_integer("lora_rank", 16, "the lora/qlora rows' rank when model.lora.rank is 0")
    flags.DEFINE_enum("qlora", "int8", QLORA, "the qlora row's base: model.lora.quantize")
    flags.DEFINE_float("margin", 0.1, "share of each chip's HBM kept free (runtime, fragmentation)")
    flags.DEFINE_string("json", None, "also write the plan as JSON to this path")
    flags.DEFINE_bool("rollout", True, "also plan the rollout programs (--norollout: the update)")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
