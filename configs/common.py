"""Shared config helpers. Each `configs/<algo>.py` starts from `base()` and states only what
its paper changes; `tiny(config)` shrinks any config to the embedded CPU default and
`headroom(config)` to the embedded task with room to learn (the studies'; `embedded(c, arg)`
picks one by the config argument, `configs/<algo>.py:tiny` or `:headroom`).

The schema (every field's default, meaning and range) is `gjax.schema`; `gjax.config.validate`
checks a config against it at start. This module composes it: the tiny mode, the papers'
dataset setups, and the names the configs use.
"""

from __future__ import annotations

import ml_collections

from gjax.schema import FIELDS, base, objective, to_objective_config

__all__ = [
    "EMBEDDED_POLICY",
    "EMBEDDED_TASK",
    "HEADROOM_TASK",
    "TOOL_POLICY",
    "TOOL_TASK",
    "FIELDS",
    "OPENR1_DEMONSTRATION_FIELD",
    "agrae_math_setup",
    "base",
    "dapo_math_dataset",
    "embedded",
    "get_arg",
    "headroom",
    "math_dataset",
    "objective",
    "openr1_dataset",
    "tiny",
    "to_objective_config",
    "tools",
]

# The policy committed with gjax (see scripts/make_tiny_policy.py) and its synthetic task's
# difficulty (gjax.data.synthetic.SyntheticConfig fields), shared by the warm-up script.
EMBEDDED_POLICY = "embedded:tiny_qwen2"
EMBEDDED_TASK = {"max_ops": 3, "max_value": 99}
# The task with headroom (issue 21): chains of 2-4 operations for the same policy, warmed up on
# chains of 1-3 (docs/embedded_policy.md, "The task with headroom").
HEADROOM_TASK = {"min_ops": 2, "max_ops": 4, "max_value": 99}
# The tool task (issue 33): chains of 2-6 operations with values up to 999, long enough that
# the policy cannot do them in its head, for the tool-using variant of the embedded policy
# (scripts/make_tiny_tool_policy.py), which can call a calculator.
TOOL_TASK = {"min_ops": 2, "max_ops": 6, "max_value": 999}


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The embedded default: the committed tiny Qwen2 on the synthetic task, on a CPU."""
    c.model.path = EMBEDDED_POLICY
    c.model.dtype = "float32"
    # Recomputing each layer in the backward is ~15% faster here than storing activations
    # (measured: fwd+bwd 0.93 s vs 1.07-1.22 s on 128 x 80 tokens).
    c.model.remat = "full"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.data.source = "synthetic"
    c.data.subset = None
    c.data.split = "train"
    c.data.heldout_source = ""  # the task's own held-out split, disjoint by construction
    c.data.heldout_split = "test"
    c.data.heldout_fraction = 0.0
    c.data.problem_field, c.data.answer_field = "problem", "answer"
    c.data.demonstration_field = "demonstration"
    c.data.template = "plain"
    c.reward.extractors = "boxed,answer_tag"  # the task's answers are \boxed{}
    c.data.synthetic.update(EMBEDDED_TASK)  # other task fields stay overridable
    c.data.max_prompt_len = 24  # the task's prompts are <= 21 tokens
    c.data.heldout_size = 256
    c.rollout.prompts_per_step = 16
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 32  # demonstrations are <= 28 tokens with EOS
    # Sampling at 0.7 (as CW-GRPO's Open-RS setup) keeps the tiny policy's groups informative
    # without flooding them with garbage; the loss scores at it too (objective.temperature).
    c.rollout.temperature = 0.7
    c.reward.workers = 1
    c.reward.timeout_s = 5.0
    # Measured (README, "First run"): grpo and a_grae move from 51% to 72-73% greedy
    # held-out accuracy within 40 steps at 3e-5 and at 1e-4 alike, and hold it to step 160.
    c.optim.lr = 3e-5
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.optim.clip_norm = 1.0
    c.train.steps = 120
    c.train.minibatches = 1
    c.checkpoint.every = 40
    # pass@k sampled as the rollouts are (T = 0.7, top-p 1): the evaluation then draws its
    # samples in the rollout's batch shape and reuses its compiled sampler (no compile added).
    c.eval.num_samples = 8
    c.eval.temperature = 0.7
    c.eval.top_p = 1.0
    c.eval.pass_k = "1,8"
    return c


def headroom(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The embedded task with headroom (issue 21; docs/embedded_policy.md): `tiny`'s policy on
    HEADROOM_TASK, chains of 2-4 operations where it was warmed up on 1-3. Its base pass@1 is
    about 0.2 (4-operation chains ~0.02) and answers are ~26 tokens, so algorithms can
    separate over a few hundred steps. Sized for the studies (experiments/README.md, "Cost")."""
    c = tiny(c)
    c.data.synthetic.update(HEADROOM_TASK)
    c.data.max_prompt_len = 32  # the task's prompts are <= 25 tokens
    c.rollout.max_new_tokens = 40  # demonstrations are <= 36 tokens with EOS
    # 1e-5 (tiny: 3e-5) spreads the switch to worked answers over ~100 steps.
    c.optim.lr = 1e-5
    # The pilot (docs/embedded_policy.md) gains until ~175 steps and holds from there to 240.
    c.train.steps = 200
    c.checkpoint.every = 100
    c.objective.covariance_metrics = True  # the studies read cov/* (CW-GRPO Table 1)
    return c


TOOL_POLICY = "embedded:tiny_qwen2_tools"


def tools(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The tool task (issue 33; docs/embedded_policy.md, "The tool task"): the tool-using
    variant of the embedded policy on TOOL_TASK as episodes of the `tool` environment with a
    sandboxed calculator, the prompts rendered by the variant's chat template (its tools line,
    not the ~760-token `# Tools` block). `env.name = ''` on it is the same policy and task
    without tools: single-turn chat prompts that offer none."""
    c = headroom(c)
    c.model.path = TOOL_POLICY
    c.data.synthetic.update(TOOL_TASK)
    c.data.template = "chat"
    c.data.max_prompt_len = 96  # <= 85 tokens with the tools line
    c.rollout.max_new_tokens = 128  # a call, the tool's turn and the answer: <= 115 tokens
    c.env.name, c.env.tools = "tool", "calculator"
    c.env.max_turns = 3  # a call, then the answer (and one more call or a retry)
    c.env.max_tool_calls = 2
    return c


EMBEDDED = {"tiny": tiny, "headroom": headroom, "tools": tools}


def embedded(c: ml_collections.ConfigDict, arg: str) -> ml_collections.ConfigDict:
    """A config's embedded variant by name (`configs/<algo>.py:tiny`, `...:headroom`)."""
    return EMBEDDED[arg](c)


# Training sets the papers use, with their real column names (field specs: gjax.data.fields),
# and a held-out set of their own: MATH-500 for MATH-trained runs, else the paper's benchmark.
# Each schema is mirrored by a fixture in tests/data/ that tests/test_configs.py loads.


def agrae_math_setup(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A-GRAE Sec. 6 / App. C.2 (its GRPO baseline shares it): Qwen2.5-Math-7B on MATH train
    (7.5k) with the boxed system prompt; 1024 prompts x G=8 per rollout batch, mini-batch 256
    (4 updates), up to 2048 new tokens, lr 1e-6, 20 epochs (~146 steps). Held out: MATH-500
    (test problems; MATH train holds none of them)."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    math_dataset(c)
    c.data.template = "qwen_boxed"
    c.rollout.prompts_per_step = 1024
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 2048
    c.train.minibatches = 4
    c.train.steps = 146
    c.optim.lr = 1e-6
    return c


def math_dataset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """MATH train (Hendrycks et al.) as DigitalLearningGmbH/MATH-lighteval keeps it (columns
    problem, level, type, solution; 7,500 train / 5,000 test rows): the answer is the last
    \\boxed{} of `solution`. `hendrycks/competition_math` left the Hub in January 2025."""
    c.data.source = "DigitalLearningGmbH/MATH-lighteval"
    c.data.subset = None
    c.data.split = "train"
    c.data.problem_field, c.data.answer_field = "problem", "boxed(solution)"
    c.data.heldout_source = "math500"
    return c


def openr1_dataset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DaGRPO Sec. 6: OpenR1-Math-46k-8192 (DeepSeek-R1 demonstrations) on Qwen2.5-Math-7B.
    Its rows (LUFFY's verl format): `prompt` [system turn, user turn with the problem],
    `target` [the R1 solution turn], `reward_model.ground_truth`. Held out: MATH-500, one of
    the paper's math benchmarks."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    c.data.source = "Elliott/Openr1-Math-46k-8192"
    c.data.problem_field = "prompt[-1].content"
    c.data.answer_field = "reward_model.ground_truth"
    c.data.template = "qwen_boxed"
    c.data.max_prompt_len = 1024
    c.data.heldout_source = "math500"
    return c


OPENR1_DEMONSTRATION_FIELD = "target[-1].content"


def dapo_math_dataset(
    c: ml_collections.ConfigDict, heldout: str = "aime24"
) -> ml_collections.ConfigDict:
    """DAPO-Math-17k (DAPO; GPG's 7B setting) on Qwen2.5-Math-7B, as open-r1's deduplicated
    copy keeps it (subset "all": 17k rows, `prompt` the problem with DAPO's instruction as
    one string, `solution` its ground truth; the original repeats each row ~100 times with the
    prompt as a chat list: problem_field="prompt[0].content",
    answer_field="reward_model.ground_truth" read it). Held out: AIME 2024, DAPO's benchmark.
    Prompt and reward are DAPO's: the instruction asks for a last line "Answer: $Answer"
    (template `dapo`), the verifier reads it (extractor `answer_line`)."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    c.data.source = "open-r1/DAPO-Math-17k-Processed"
    c.data.subset = "all"
    c.data.problem_field, c.data.answer_field = "prompt", "solution"
    # The prompts ask for DAPO's "Answer: ..." last line, and DAPO's reward reads it: the
    # `dapo` template adds no \boxed{} system line (and wraps held-out problems in DAPO's
    # instruction), `answer_line` reads that line.
    c.data.template = "dapo"
    c.reward.extractors = "answer_line"
    c.data.max_prompt_len = 2048
    c.data.heldout_source = heldout
    return c


def get_arg(arg: str | None) -> str:
    valid = ("", *EMBEDDED)
    arg = arg or ""
    if arg not in valid:
        raise ValueError(f"unknown config argument {arg!r}; valid: {valid}")
    return arg
