"""Shared config helpers. Each `configs/<algo>.py` starts from `base()` and states only what
its paper changes; `tiny(config)` shrinks any config to the embedded CPU default.

Every field lives here, so the schema is one page; `gjax.config.validate` checks it at start.
"""

from __future__ import annotations

import dataclasses

import ml_collections

# The policy committed with gjax (see scripts/make_tiny_policy.py) and its synthetic task's
# difficulty (gjax.data.synthetic.SyntheticConfig fields), shared by the warm-up script.
EMBEDDED_POLICY = "embedded:tiny_qwen2"
EMBEDDED_TASK = {"max_ops": 3, "max_value": 99}


_PLACEHOLDER_TYPES = {
    "token_weights": str,
    "dual_clip": float,
    "aggregation_constant": float,
    "token_chunk": int,
    "vocab_tile": int,
}


def objective(preset: str, **overrides) -> ml_collections.ConfigDict:
    """Every `gjax.objective.ObjectiveConfig` field, from a named preset plus overrides.

    Listing all fields (not just the changed ones) makes each one overridable from the
    command line with type checking, e.g. `--config.objective.eps_high=0.28`;
    `*_kwargs` become nested dicts (`--config.objective.advantage_kwargs.alpha=0.5`).
    """
    from gjax.objective import ObjectiveConfig

    fields = {}
    chosen = ObjectiveConfig.preset(preset)
    for f in dataclasses.fields(ObjectiveConfig):
        value = getattr(chosen, f.name)
        if f.name.endswith("_kwargs"):
            fn = f.name[: -len("_kwargs")]
            value = ml_collections.ConfigDict(
                {**hyperparameters(fn, getattr(chosen, fn)), **dict(value)}
            )
        elif value is None:
            value = ml_collections.config_dict.placeholder(_PLACEHOLDER_TYPES[f.name])
        fields[f.name] = value
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown objective field(s) {unknown}; valid: {sorted(fields)}")
    cfg = ml_collections.ConfigDict(fields)
    for k, v in overrides.items():
        if k.endswith("_kwargs"):
            cfg[k] = ml_collections.ConfigDict(dict(v))
        else:
            cfg[k] = v
    return cfg


_DATA_KWARGS = {"scores_PxG", "is_anchor_PxG", "rng"}


def hyperparameters(kind: str, name: str | None) -> dict:
    """The static keyword hyperparameters (with defaults) of an estimator or token weighting."""
    import inspect

    from gjax.objective.advantages import ADVANTAGES
    from gjax.objective.token_weights import TOKEN_WEIGHTS

    if name is None:
        return {}
    fn = {"advantage": ADVANTAGES, "token_weights": TOKEN_WEIGHTS}[kind].get(name)
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY
        and p.name not in _DATA_KWARGS
        and p.default is not inspect.Parameter.empty
    }


def to_objective_config(objective_cfg: ml_collections.ConfigDict):
    """ConfigDict -> the frozen `ObjectiveConfig` (its own validation names bad fields)."""
    from gjax.objective import ObjectiveConfig

    d = objective_cfg.to_dict()
    for kind in ("advantage", "token_weights"):
        valid = hyperparameters(kind, d[kind])
        unknown = sorted(set(d[f"{kind}_kwargs"]) - set(valid))
        if unknown:
            raise ValueError(
                f"config.objective.{kind}_kwargs: {unknown} are not hyperparameters of "
                f"{kind} {d[kind]!r}; valid: {sorted(valid)}"
            )
    return ObjectiveConfig(**d)


def data_defaults() -> dict:
    from gjax.data.loading import DATA_DEFAULTS

    d = dict(DATA_DEFAULTS)
    d["num_examples"] = ml_collections.config_dict.placeholder(int)
    from gjax.data.synthetic import SyntheticConfig

    d["synthetic"] = ml_collections.ConfigDict(dataclasses.asdict(SyntheticConfig()))
    return d


def base() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.algo = "grpo"  # a name for logs; the math is in c.objective

    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen2.5-Math-7B"  # local dir, gs:// dir, hub id, or EMBEDDED_POLICY
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"
    c.model.remat = "full"  # none | full | dots | dots_with_no_batch_dims

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: all devices not used by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    # Devices of their own for rollouts (0: collocated, rollouts share the train mesh); the
    # train mesh (data x fsdp x tensor) then spans the other devices (gjax.sharding.make_meshes).
    c.mesh.rollout_devices = 0

    # Fields and defaults: gjax.data.loading.DATA_DEFAULTS (source: hub id, local
    # jsonl/parquet/arrow file or dir, or "synthetic"; field mapping; template; length filter).
    c.data = ml_collections.ConfigDict(data_defaults())
    c.data.source = "hendrycks/competition_math"
    c.data.split = "train"
    c.data.heldout_split = "test"
    c.data.template = "qwen_boxed"
    c.data.max_prompt_len = 512
    c.data.heldout_size = 500

    c.rollout = ml_collections.ConfigDict()
    c.rollout.backend = "local"  # local (gjax sampler); jetstream arrives with its issue
    c.rollout.prompts_per_step = 128  # P: prompts per rollout batch (global)
    c.rollout.num_samples = 8  # G
    c.rollout.max_new_tokens = 2048
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0  # 0 = off
    c.rollout.eval_temperature = 0.0  # held-out evaluation: greedy
    # Old log-probs: the sampler's own (same params and temperature: the behaviour policy)
    # or a teacher-forced recomputation (set when the sampler's numerics differ, e.g. a
    # serving engine in another dtype). Anchors are always teacher-forced.
    c.rollout.recompute_old_logps = False
    # k: rollouts overlap training, sampled from params at most k updates old (0: the
    # synchronous loop). Schedule and resume rule: gjax.rollout.pipeline.
    c.rollout.max_staleness = 0

    c.objective = objective("grpo")

    c.anchors = ml_collections.ConfigDict()
    c.anchors.per_group = 0  # DaGRPO: demonstrations mixed into each group of G

    c.sampling = ml_collections.ConfigDict()
    c.sampling.dynamic = False  # DAPO: drop zero-variance groups, resample until full
    c.sampling.max_rollouts_per_step = 3  # cap on resampling rounds
    c.sampling.min_valid_fraction = 0.0  # GPG beta_th: carry valid groups over below this
    c.sampling.overlong_filter = False  # DAPO: truncated completions get no loss
    c.sampling.overlong_buffer = 0  # DAPO soft overlong punishment length (0 = off)
    c.sampling.overlong_penalty = 1.0

    c.reward = ml_collections.ConfigDict()
    c.reward.functions = "accuracy"  # comma list of name[:weight], from gjax.rewards.REWARDS
    c.reward.timeout_s = 5.0  # per-item verifier deadline
    c.reward.workers = 2
    c.reward.judge = "none"  # none | openai | rule
    c.reward.judge_base_url = "https://api.openai.com/v1"
    c.reward.judge_model = "gpt-4o"
    c.reward.judge_api_key_env = "OPENAI_API_KEY"
    c.reward.judge_concurrency = 32
    c.reward.judge_timeout_s = 60.0
    c.reward.judge_max_retries = 4
    c.reward.judge_on_missing = "keep"  # keep | drop | fill (gjax.rewards.judge)
    c.reward.judge_fill_score = 5.5

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 0
    c.optim.schedule = "constant"  # constant | cosine
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.clip_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 500
    c.train.minibatches = 1  # optimizer updates per rollout batch (per iteration)
    c.train.num_iterations = 1  # passes over each rollout batch (mu in GRPO)
    c.train.microbatches = 1  # gradient accumulation inside a minibatch
    c.train.allow_nonfinite = False  # raise on a non-finite loss/grad norm unless set

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 50
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True
    c.log.progress = True
    c.log.eval_every = 0  # held-out eval every N steps (0: only before and after)
    return c


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The embedded default: the committed tiny Qwen2 on the synthetic task, on a CPU."""
    c.model.path = EMBEDDED_POLICY
    c.model.dtype = "float32"
    # Recomputing each layer in the backward is ~15% faster here than storing activations
    # (measured: fwd+bwd 0.93 s vs 1.07-1.22 s on 128 x 80 tokens).
    c.model.remat = "full"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.data.source = "synthetic"
    c.data.split = "train"
    c.data.heldout_split = "test"
    c.data.problem_field, c.data.answer_field = "problem", "answer"
    c.data.demonstration_field = "demonstration"
    c.data.template = "plain"
    c.data.synthetic.update(EMBEDDED_TASK)  # other task fields stay overridable
    c.data.max_prompt_len = 24  # the task's prompts are <= 21 tokens
    c.data.heldout_size = 256
    c.rollout.prompts_per_step = 16
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 32  # demonstrations are <= 28 tokens with EOS
    # Sampling at 0.7 (as CW-GRPO's Open-RS setup) keeps the tiny policy's groups informative
    # without flooding them with garbage; the loss uses the same temperature.
    c.rollout.temperature = 0.7
    c.objective.temperature = 0.7
    c.reward.workers = 1
    c.reward.timeout_s = 5.0
    # Measured (README, "Embedded default"): grpo and a_grae move from 51% to 72-73% greedy
    # held-out accuracy within 40 steps at 3e-5 and at 1e-4 alike, and hold it to step 160.
    c.optim.lr = 3e-5
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.optim.clip_norm = 1.0
    c.train.steps = 120
    c.train.minibatches = 1
    c.checkpoint.every = 40
    return c


# Training sets the papers use, with their field names (the model is the same 7B math model).


def agrae_math_setup(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A-GRAE Sec. 6 / App. C.2 (its GRPO baseline shares it): Qwen2.5-Math-7B on MATH train
    (7.5k) with the boxed system prompt; 1024 prompts x G=8 per rollout batch, mini-batch 256
    (4 updates), up to 2048 new tokens, lr 1e-6, 20 epochs (~146 steps)."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    c.data.source = "hendrycks/competition_math"
    c.data.template = "qwen_boxed"
    c.rollout.prompts_per_step = 1024
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 2048
    c.train.minibatches = 4
    c.train.steps = 146
    c.optim.lr = 1e-6
    return c


def openr1_dataset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DaGRPO Sec. 6: OpenR1-Math-46k-8192 (DeepSeek-R1 demonstrations) on Qwen2.5-Math-7B."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    c.data.source = "Elliott/Openr1-Math-46k-8192"
    c.data.problem_field, c.data.answer_field = "prompt", "answer"
    c.data.template = "qwen_boxed"
    c.data.max_prompt_len = 1024
    c.data.heldout_split = "train"
    return c


def dapo_math_dataset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DAPO-Math-17k (DAPO; GPG's 7B setting) on Qwen2.5-Math-7B."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    c.data.source = "BytedTsinghua-SIA/DAPO-Math-17k"
    c.data.problem_field, c.data.answer_field = "prompt", "solution"
    c.data.template = "qwen_boxed"
    c.data.max_prompt_len = 2048
    c.data.heldout_split = "train"
    return c


def get_arg(arg: str | None) -> str:
    valid = ("", "tiny")
    arg = arg or ""
    if arg not in valid:
        raise ValueError(f"unknown config argument {arg!r}; valid: {valid}")
    return arg
