"""Config validation: fail at start, naming the field, before anything expensive happens.

`validate(config, num_devices, checks)` checks the structure against the schema
(`gjax.schema.base()`: an unknown or mistyped key names the valid ones, a renamed one its new
name), every numeric field against its `Range` in `gjax.schema.FIELDS`, the core names
(dtypes, remat, rollout backend, objective parts), mesh/batch divisibility and length
budgets, then asks each subsystem through its hook in `checks` (data, rewards, evaluation,
rollout backend: `check_config(config)`, raising `ConfigError`), all before the model and the
data load. It returns the resolved mesh shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import ml_collections

from gjax import packing, schema
from gjax.errors import ConfigError
from gjax.models import hf_format, hf_import, quant
from gjax.models.config import (
    ATTENTION_IMPLEMENTATIONS,
    BASE_QUANT,
    REMAT_POLICIES,
    parse_lora_targets,
)
from gjax.schema import FIELDS, unknown_field, walk

# A subsystem's config check: raises ConfigError naming the field (e.g.
# gjax.data.builders.check_config); the caller of `validate` passes those its run uses.
ConfigCheck = Callable[[ml_collections.ConfigDict], object]


def check_schema(config: ml_collections.ConfigDict, reference: ml_collections.ConfigDict) -> None:
    """Every key of `config` exists in `reference` (the schema's base) with a compatible type."""
    want = dict(walk(reference))
    for path, value in walk(config):
        if path.startswith(("objective.advantage_kwargs.", "objective.token_weights_kwargs.")):
            continue  # per-estimator; checked against its signature by to_objective_config
        if path not in want:
            raise unknown_field(path, want)
        ref = want[path]
        if ref is None or value is None:
            continue
        ok = isinstance(value, type(ref)) or (isinstance(ref, float) and isinstance(value, int))
        if isinstance(ref, bool) != isinstance(value, bool):
            ok = False
        if not ok:
            raise ConfigError(
                f"config.{path} must be {type(ref).__name__}, got {type(value).__name__} "
                f"({value!r})"
            )


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config.{field}: {msg}")


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    seq = mesh_cfg.get("seq", 1)  # a run recorded before mesh.seq existed: 1
    shape = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "seq": seq, "tensor": mesh_cfg.tensor}
    for axis, size in shape.items():
        _require(size == -1 or size >= 1, f"mesh.{axis}", f"must be >= 1 or -1, got {size}")
    _require(
        isinstance(seq, int) and seq >= 1 and num_devices % seq == 0,
        "mesh.seq",
        f"={seq} does not divide the {num_devices} devices of the train mesh: every row's "
        f"tokens are split over mesh.seq devices, and the other axes take the rest. Set "
        f"mesh.seq to a divisor of {num_devices} (1: whole rows on each device)",
    )
    fixed = 1
    for size in shape.values():
        fixed *= size if size > 0 else 1
    free = [a for a, s in shape.items() if s == -1]
    _require(len(free) <= 1, "mesh", f"at most one axis may be -1, got {free}")
    if free:
        _require(
            num_devices % fixed == 0,
            f"mesh.{free[0]}",
            f"{num_devices} devices are not divisible by the fixed axes' product {fixed}",
        )
        shape[free[0]] = num_devices // fixed
    total = shape["data"] * shape["fsdp"] * shape["seq"] * shape["tensor"]
    _require(
        total == num_devices,
        "mesh",
        f"data*fsdp*seq*tensor = {total} but {num_devices} devices are available",
    )
    return shape


def check_length(config: ml_collections.ConfigDict, max_position_embeddings: int) -> None:
    """A row (prompt + completion) within the model's positions."""
    S, T = config.data.max_prompt_len, config.rollout.max_new_tokens
    _require(
        max_position_embeddings >= S + T,
        "rollout.max_new_tokens",
        f"data.max_prompt_len + rollout.max_new_tokens = {S} + {T} = {S + T} tokens exceeds "
        f"the model's max_position_embeddings={max_position_embeddings}: positions past it "
        "were never trained (RoPE extrapolates badly). Lower rollout.max_new_tokens (or "
        f"data.max_prompt_len) so that they sum to at most {max_position_embeddings}",
    )


def check_sequence_shards(config: ml_collections.ConfigDict, seq: int) -> None:
    """`mesh.seq` divides the length the update's rows run at: the bin (`train.pack_length`,
    0: the padded row) when packed, the padded row (prompt + completion) otherwise."""
    if seq == 1:
        return
    t = config.train
    row = config.data.max_prompt_len + config.rollout.max_new_tokens
    if t.packing == "packed" and t.pack_length:
        length, what = t.pack_length, "train.pack_length (the tokens of a packed bin)"
        fix = f"set train.pack_length to a multiple of {seq}"
    else:
        length = row
        what = "the row length data.max_prompt_len + rollout.max_new_tokens" + (
            " (a packed bin's length with train.pack_length=0)" if t.packing == "packed" else ""
        )
        fix = f"make data.max_prompt_len + rollout.max_new_tokens a multiple of {seq}" + (
            f", or set train.pack_length to a multiple of {seq}" if t.packing == "packed" else ""
        )
    _require(
        length % seq == 0,
        "mesh.seq",
        f"={seq} does not divide {what}, {length}: each of the {seq} sequence shards takes "
        f"an equal block of a row's tokens. Change mesh.seq, or {fix}",
    )


# Rollout backends `gjax.rollout.factory.make_backend` builds; a new backend adds its name here.
ROLLOUT_BACKENDS = ("local", "jetstream", "jetstream_grpc")
ROLLOUT_DECODERS = ("static", "continuous", "auto")  # backend 'local' only
WEIGHT_CHANGES = ("finish", "restart")  # jetstream*: in-flight requests on a weight swap
WEIGHT_TRANSFERS = ("directory", "grpc")
DTYPES = ("float32", "bfloat16", "float16")


def _get(config: ml_collections.ConfigDict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


def check_ranges(config: ml_collections.ConfigDict, reference: ml_collections.ConfigDict) -> None:
    """Every numeric field with a `Range` in `gjax.schema.FIELDS` lies in it."""
    for path, field in FIELDS.items():
        if field.valid is None:
            continue
        value = _get(config, path)
        if value is None and _get(reference, path) is None:
            continue  # a placeholder left unset: off / all
        if value not in field.valid:
            raise ConfigError(
                f"config.{path}={value!r} is out of range: it must be {field.valid}. Set "
                f"--config.{path} to a value {field.valid} (the field: {field.doc})."
            )


def check_lora(config: ml_collections.ConfigDict) -> None:
    """`model.lora`: its targets name modules, its dtype exists."""
    lora_cfg = config.model.lora
    _require(
        isinstance(lora_cfg.rank, int),
        "model.lora.rank",
        f"must be an integer (0: no LoRA), got {lora_cfg.rank!r}",
    )
    _require(
        lora_cfg.dtype in DTYPES,
        "model.lora.dtype",
        f"must be one of {DTYPES}, got {lora_cfg.dtype!r}",
    )
    quantize = lora_cfg.get("quantize", "none")
    _require(
        quantize in BASE_QUANT,
        "model.lora.quantize",
        f"must be one of {BASE_QUANT}, got {quantize!r}",
    )
    if lora_cfg.rank == 0:
        _require(
            quantize == "none",
            "model.lora.quantize",
            f"={quantize!r} quantizes a frozen base, and without LoRA nothing would train: "
            "set model.lora.rank > 0 (QLoRA) or model.lora.quantize=none",
        )
        return
    _require(
        quantize == "none" or quant.available(),
        "model.lora.quantize",
        f"={quantize!r} needs the qwix package (its quantized arrays), which is not "
        "installed: pip install 'gjax[qlora]' (or pip install qwix), or set "
        "model.lora.quantize=none",
    )
    try:
        targets = parse_lora_targets(lora_cfg.targets)
    except ValueError as e:
        raise ConfigError(f"config.model.lora.targets={lora_cfg.targets!r} {e}.") from None
    _require(
        bool(targets),
        "model.lora.targets",
        f"is empty, so rank {lora_cfg.rank} adapts nothing: list the projections to adapt "
        "(e.g. q,k,v,o,gate,up,down) or set model.lora.rank=0 for full fine-tuning",
    )


def check_names(config: ml_collections.ConfigDict) -> None:
    """The core's names: dtypes, remat policy, rollout backend, objective parts."""
    m = config.model
    for name in ("dtype", "param_dtype"):
        _require(m[name] in DTYPES, f"model.{name}", f"must be one of {DTYPES}, got {m[name]!r}")
    check_lora(config)
    _require(
        m.remat in REMAT_POLICIES,
        "model.remat",
        f"must be one of {REMAT_POLICIES}, got {m.remat!r}",
    )
    _require(
        m.get("attention", "auto") in ATTENTION_IMPLEMENTATIONS,
        "model.attention",
        f"must be one of {ATTENTION_IMPLEMENTATIONS}, got {m.get('attention')!r}",
    )
    _require(
        config.rollout.backend in ROLLOUT_BACKENDS,
        "rollout.backend",
        f"must be one of {ROLLOUT_BACKENDS}, got {config.rollout.backend!r}",
    )
    _require(
        config.rollout.decoder in ROLLOUT_DECODERS,
        "rollout.decoder",
        f"must be one of {ROLLOUT_DECODERS}, got {config.rollout.decoder!r}",
    )
    _require(
        config.rollout.weight_change in WEIGHT_CHANGES,
        "rollout.weight_change",
        f"must be one of {WEIGHT_CHANGES}, got {config.rollout.weight_change!r}",
    )
    _require(
        config.rollout.decoder != "continuous" or config.rollout.backend == "local",
        "rollout.decoder",
        f"'continuous' is the local backend's decoder; rollout.backend="
        f"{config.rollout.backend!r} batches continuously on its own: leave decoder 'auto'",
    )
    _require(
        config.rollout.weight_transfer in WEIGHT_TRANSFERS,
        "rollout.weight_transfer",
        f"must be one of {WEIGHT_TRANSFERS}, got {config.rollout.weight_transfer!r}",
    )
    check_rollout_quantize(config)
    try:
        schema.to_objective_config(config.objective, rollout_temperature=config.rollout.temperature)
    except (ValueError, KeyError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(
            msg if msg.startswith("config.") else f"config.objective: {msg}"
        ) from None


def fp8_supported(platform: str | None = None) -> tuple[bool, str]:
    """Whether this platform's matmuls take fp8 (e4m3) operands, and if not why (a phrase).
    CUDA GPUs from compute capability 8.9 (Ada, Hopper and later) have fp8 tensor cores;
    the CPU and other platforms are refused rather than emulated."""
    platform = platform or jax.default_backend()
    if platform == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", "0")
        if tuple(int(x) for x in str(cc).split(".")[:2]) >= (8, 9):
            return True, ""
        return False, f"this GPU (compute capability {cc}) has no fp8 matmul (8.9+ does)"
    return False, f"the {platform} platform has no fp8 matmul gjax uses"


def check_rollout_quantize(config: ml_collections.ConfigDict) -> None:
    """`rollout.quantize`: a known name, the local backend, a float base, fp8 only where the
    platform has it, qwix installed."""
    how = config.rollout.quantize
    _require(
        how in quant.ROLLOUT_QUANT,
        "rollout.quantize",
        f"={how!r} is not a rollout quantization: use one of {quant.ROLLOUT_QUANT} (none "
        "samples with the learner's float weights)",
    )
    if how == "none":
        return
    _require(
        config.rollout.backend == "local",
        "rollout.quantize",
        f"={how!r} quantizes the local sampler's weights, but rollout.backend="
        f"{config.rollout.backend!r} serves its own: use --config.rollout.backend=local or "
        "rollout.quantize=none",
    )
    base = config.model.lora.get("quantize", "none")
    _require(
        base == "none",
        "rollout.quantize",
        f"={how!r} quantizes a float policy, but model.lora.quantize={base!r} already stores "
        "the base quantized (the sampler reads those codes as the learner does): set "
        "rollout.quantize=none",
    )
    if how == "fp8":
        ok, why = fp8_supported()
        _require(
            ok,
            "rollout.quantize",
            f"='fp8' is refused here: {why}. Use rollout.quantize=int8 (any platform) or run "
            "on a GPU with fp8 tensor cores (compute capability 8.9+)",
        )
    _require(
        quant.available(),
        "rollout.quantize",
        f"={how!r} needs the qwix package (its quantized arrays), which is not installed: "
        "pip install 'gjax[qlora]' (or pip install qwix), or set rollout.quantize=none",
    )


def check_model(config: ml_collections.ConfigDict, path: str) -> str:
    """The local directory of the policy at `path` (from `config.model.path`), after checking
    that its config.json exists, is supported and fits the run's lengths; no weight is read."""
    try:
        local = hf_format.resolve_dir(path)
        cfg = hf_import.load_config(local)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"config.model.path={config.model.path!r}: {e}. Set config.model.path to a local or "
            "gs:// checkpoint directory, a Hugging Face hub id, or embedded:tiny_qwen2."
        ) from None
    check_length(config, cfg.max_position_embeddings)
    return local


def validate(
    config: ml_collections.ConfigDict, num_devices: int, checks: Sequence[ConfigCheck] = ()
) -> dict[str, int]:
    """Checks `config` whole (the core here, each subsystem through its hook in `checks`);
    returns the train mesh's shape. Raises ConfigError naming the first bad field."""
    reference = schema.base()
    check_schema(config, reference)
    check_ranges(config, reference)
    schema.resolve_behaviour_correction(config)
    check_names(config)
    n_roll = config.mesh.rollout_devices
    _require(
        n_roll < num_devices,
        "mesh.rollout_devices",
        f"must be in [0, {num_devices}) (0: rollouts share the train mesh), got {n_roll}",
    )
    mesh = resolve_mesh_shape(config.mesh, num_devices - n_roll)
    processes = jax.process_count()
    _require(
        processes == 1 or (n_roll % processes == 0 and n_roll // processes % mesh["tensor"] == 0),
        "mesh.rollout_devices",
        f"each of the {processes} processes samples on its own share of the rollout devices "
        f"(gjax.sharding.make_meshes), which keeps mesh.tensor={mesh['tensor']}: make "
        f"{n_roll} a multiple of {processes} * {mesh['tensor']}",
    )
    r, t, s = config.rollout, config.train, config.sampling
    _require(
        config.anchors.per_group < r.num_samples,
        "anchors.per_group",
        f"must be in [0, num_samples={r.num_samples}), got {config.anchors.per_group}",
    )
    if config.objective.advantage == "pass_at_k":  # subgroups of k out of the G samples
        k = config.objective.advantage_kwargs.get("k")
        _require(
            isinstance(k, int) and 1 <= k < r.num_samples,
            "objective.advantage_kwargs.k",
            f"pass@k subgroups need an int k in [1, num_samples={r.num_samples}), got {k!r}: "
            "with k = num_samples the one subgroup is the whole group and every advantage is "
            "0 (Chen et al. 2025's normalisation over subgroups has nothing to compare)",
        )
    data_parallel = mesh["data"] * mesh["fsdp"]
    per_update = t.minibatches * t.microbatches
    _require(
        r.prompts_per_step % t.minibatches == 0,
        "train.minibatches",
        f"prompts_per_step={r.prompts_per_step} is not divisible by minibatches={t.minibatches}",
    )
    seqs = r.prompts_per_step * r.num_samples
    _require(
        seqs % (per_update * data_parallel) == 0,
        "train.microbatches",
        f"the {seqs} sequences per step (prompts_per_step*num_samples) must split evenly "
        f"into minibatches*microbatches={per_update} pieces of a size divisible by the "
        f"data-parallel size {data_parallel} (mesh.data*mesh.fsdp)",
    )
    _require(
        n_roll == 0 or n_roll % mesh["tensor"] == 0,
        "mesh.rollout_devices",
        f"the rollout mesh keeps mesh.tensor={mesh['tensor']}, which must divide {n_roll}",
    )
    _require(
        config.objective.behaviour_correction == "none" or r.recompute_old_logps,
        "objective.behaviour_correction",
        "corrects the sampler against the trainer's own old log-probs: set "
        "--config.rollout.recompute_old_logps=True",
    )
    _require(
        config.objective.behaviour_correction == "none" or r.backend != "jetstream_grpc",
        "objective.behaviour_correction",
        "needs the sampler's log-probs, which rollout.backend='jetstream_grpc' does not "
        "return (its replies carry token ids only): use backend 'local' or 'jetstream', or "
        "behaviour_correction='none'",
    )
    _require(
        config.objective.temperature in (None, r.temperature),
        "objective.temperature",
        f"the loss must score log_softmax(logits / T) at the sampling temperature: got "
        f"{config.objective.temperature} but rollout.temperature = {r.temperature} (leave "
        "objective.temperature unset: it follows rollout.temperature)",
    )
    _require(
        s.overlong_buffer < r.max_new_tokens,
        "sampling.overlong_buffer",
        f"must be in [0, max_new_tokens={r.max_new_tokens}), got {s.overlong_buffer}",
    )
    _require(
        config.optim.schedule in ("constant", "cosine"), "optim.schedule", "must be constant|cosine"
    )
    _require(t.packing in ("padded", "packed"), "train.packing", "must be padded|packed")
    _require(
        t.pack_bins % t.microbatches == 0,
        "train.pack_bins",
        f"must be a multiple of train.microbatches={t.microbatches} (microbatches are bins), "
        f"got {t.pack_bins}",
    )
    if t.packing == "packed":  # at start, not after the model is loaded (make_learner)
        packing.check_fixed_bins(t.pack_bins, t.microbatches, data_parallel, processes)
    check_sequence_shards(config, mesh["seq"])
    for check in checks:
        check(config)
    return mesh
