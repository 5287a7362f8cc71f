"""The run config's schema: every field once, with its default, meaning and valid range.

`SCHEMA` declares each field of a run's `config` as a `Field(default, doc, valid)`: the
default `base()` starts from, the one line `--help` and `--print_config` print (gjax.cli), and
for a number the `Range` that `gjax.config.validate` enforces. `configs/<algo>.py` compose it:
`base()`, then what their paper changes. A new field is one line here.

Objective fields take their defaults from `gjax.objective.ObjectiveConfig`'s presets (`PRESET`);
`objective.*_kwargs` are per-estimator (their docstrings define them). A field renamed in a
release keeps its old name in `RENAMED`: the unknown-field error then names the new one.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
from typing import Any

import ml_collections

from gjax.data.synthetic import SyntheticConfig
from gjax.errors import ConfigError
from gjax.objective import ObjectiveConfig
from gjax.objective.advantages import ADVANTAGES
from gjax.objective.token_weights import TOKEN_WEIGHTS


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric field, written as an interval: `Range("(0, 1]")`.

    `inf` closes an unbounded side; `also` lists values allowed besides the interval (e.g.
    `-1` for "all remaining devices"). Every value must be finite; `None` is allowed only for
    fields whose default is `None` (a placeholder meaning "off" or "all").
    """

    interval: str
    also: tuple = ()

    def _bounds(self) -> tuple[bool, float, float, bool]:
        m = re.fullmatch(r"([\[(])\s*(-?inf|[^,]+?)\s*,\s*(-?inf|[^,]+?)\s*([\])])", self.interval)
        if not m:
            raise ValueError(f"bad interval {self.interval!r}; write e.g. '[0, 1)' or '(0, inf)'")
        return m[1] == "[", float(m[2]), float(m[3]), m[4] == "]"

    def __post_init__(self):
        self._bounds()

    def __contains__(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if value in self.also:
            return True
        lo_closed, lo, hi, hi_closed = self._bounds()
        return (
            math.isfinite(value)
            and (lo <= value if lo_closed else lo < value)
            and (value <= hi if hi_closed else value < hi)
        )

    def __str__(self) -> str:
        lo_closed, lo, hi, hi_closed = self._bounds()
        if math.isinf(hi):
            text = f"{'>=' if lo_closed else '>'} {_num(lo)}"
        else:
            text = f"in {self.interval}"
        return text + "".join(f" or {_num(a)}" for a in self.also)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class _Preset:
    def __repr__(self) -> str:
        return "PRESET"


PRESET = _Preset()  # the default comes from the objective preset (`objective(name)`)


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: its default, its one-line meaning and, for a number, its Range.

    `kind` is the type of a field whose default is `None` (an unset placeholder: off / all).
    """

    default: Any
    doc: str
    valid: Range | None = None
    kind: type | None = None


_NONNEG, _POS, _COUNT = Range("[0, inf)"), Range("(0, inf)"), Range("[1, inf)")
_SEED, _PROB = Range("[0, 2147483648)"), Range("[0, 1]")
_AXIS = Range("[1, inf)", also=(-1,))
_TEMPERATURE = Range("(0, 100]")
_SYNTHETIC = SyntheticConfig()

# The whole config, section by section, in the order --help prints it.
SCHEMA: dict[str, Any] = {
    "seed": Field(0, "seed of the model's sampling and update randomness", _SEED),
    "algo": Field(
        "grpo", "name of the run in logs and the default workdir (the math is in objective)"
    ),
    "model": {
        "path": Field(
            "Qwen/Qwen2.5-Math-7B",
            "policy to train: local dir, gs:// dir, Hub id, or embedded:tiny_qwen2",
        ),
        "dtype": Field("bfloat16", "compute dtype: float32 | bfloat16 | float16"),
        "param_dtype": Field("float32", "dtype of the trained parameters and optimizer state"),
        "remat": Field(
            "full", "layer recomputation in the backward: none|full|dots|dots_with_no_batch_dims"
        ),
        "attention": Field(
            "auto",
            "attention implementation: auto (cpu: xla, gpu: pallas_gpu, tpu: splash) | xla "
            "(dense masked) | xla_blocked (xla in causal query chunks) | pallas_gpu | splash | "
            "cudnn (gjax.models.attention; the training forward and the sampler's prefill)",
        ),
        # gjax.models.lora: adapters beside a frozen base; the reference is the base.
        "lora": {
            "rank": Field(
                0, "LoRA rank: 0 trains every parameter; r > 0 trains rank-r adapters only", _NONNEG
            ),
            "alpha": Field(
                32.0, "LoRA alpha: the adapters' product is scaled by alpha / rank", _POS
            ),
            "targets": Field(
                "q,k,v,o,gate,up,down",
                "comma list of projections to adapt (q,k,v,o,gate,up,down; PEFT names; all)",
            ),
            "dtype": Field("float32", "dtype of the adapters and their optimizer state"),
            "quantize": Field(
                "none",
                "QLoRA: store the frozen base's projections as none | int8 | int4 | nf4 "
                "(gjax.models.quant, through qwix: the qlora extra)",
            ),
        },
    },
    "mesh": {
        "data": Field(-1, "devices on the data axis (-1: all not used by the other axes)", _AXIS),
        "fsdp": Field(
            1, "devices on the fully sharded data-parallel axis (-1: all the rest)", _AXIS
        ),
        "tensor": Field(1, "devices on the tensor-parallel axis (-1: all the rest)", _AXIS),
        # Context parallelism: the update's and the log-prob passes' token axis over `seq`
        # devices (ring attention, gjax.models.attention.ring); rollouts keep whole rows.
        "seq": Field(
            1,
            "devices each row's tokens are split over in the update and the log-prob passes "
            "(ring attention; divides the bin / row length; rollouts are unaffected)",
            _COUNT,
        ),
        # The train mesh (data x fsdp x tensor) then spans the other devices; with H processes
        # each gives its last rollout_devices / H (gjax.sharding.make_meshes).
        "rollout_devices": Field(
            0, "devices of their own for rollouts (0: rollouts share the train mesh)", _NONNEG
        ),
    },
    # gjax.data.builders.DATA_DEFAULTS has the same keys (the library's defaults).
    "data": {
        "source": Field(
            "DigitalLearningGmbH/MATH-lighteval",
            "prompts: 'synthetic', a local .jsonl/.parquet/.arrow file or dir, or a Hub id",
        ),
        "subset": Field(None, "Hub dataset configuration name (None: the default)", kind=str),
        "split": Field("train", "split of the training prompts"),
        # The held-out set is never training rows unless allow_heldout_overlap says so:
        # gjax.data.builders.heldout_plan (a plain file has no splits: fraction or source).
        "heldout_source": Field(
            "math500",
            "held-out set: '' (data.source's heldout_split), a benchmark of "
            "gjax.data.testsets (math500, aime24, ...; name=PATH: a local copy), a file or Hub id",
        ),
        "heldout_split": Field(
            "test",
            "split of the held-out set when heldout_source is '' or a file / Hub id",
        ),
        "heldout_fraction": Field(
            0.0,
            "> 0: hold out this fraction of the training split's rows (seeded; removed from "
            "training) instead of heldout_source",
            Range("[0, 1)"),
        ),
        "heldout_seed": Field(0, "seed of the heldout_fraction sample", _SEED),
        "allow_heldout_overlap": Field(
            False, "allow a held-out set of training rows (refused otherwise; summary says so)"
        ),
        # Field specs (gjax.data.fields): 'col', 'col.key', 'col[-1].key', 'boxed(col)'.
        "problem_field": Field(
            "problem", "field spec of the problem: a column, 'col.key', 'col[-1].key'"
        ),
        "answer_field": Field(
            "boxed(solution)",
            "field spec of the reference answer; 'boxed(col)': the last \\boxed{} of col",
        ),
        "demonstration_field": Field(
            "", "field spec of a worked solution ('': none; DaGRPO anchors)"
        ),
        "template": Field("qwen_boxed", "prompt template, a name in gjax.data.templates.TEMPLATES"),
        "max_prompt_len": Field(
            512, "longest prompt in tokens; longer ones are skipped and counted", _COUNT
        ),
        "shuffle": Field(True, "shuffle the training prompts each epoch"),
        "shuffle_seed": Field(0, "seed of the per-epoch shuffle", _SEED),
        "num_examples": Field(
            None, "training rows to load (None: all; synthetic: 8192)", _COUNT, kind=int
        ),
        "heldout_size": Field(500, "held-out rows to evaluate on", _COUNT),
        "strict": Field(False, "stop at a malformed row instead of skipping and counting it"),
        "synthetic": {  # defaults: gjax.data.synthetic.SyntheticConfig
            "min_ops": Field(
                _SYNTHETIC.min_ops, "synthetic task: fewest operations per problem", _COUNT
            ),
            "max_ops": Field(
                _SYNTHETIC.max_ops, "synthetic task: most operations per problem", _COUNT
            ),
            "min_operand": Field(
                _SYNTHETIC.min_operand, "synthetic task: smallest operand", _NONNEG
            ),
            "max_operand": Field(
                _SYNTHETIC.max_operand, "synthetic task: largest operand", _NONNEG
            ),
            "ops": Field(
                _SYNTHETIC.ops, "synthetic task: operators to draw from (a subset of +-*)"
            ),
            "max_value": Field(
                _SYNTHETIC.max_value, "synthetic task: largest intermediate value", _NONNEG
            ),
            "reverse_prob": Field(
                _SYNTHETIC.reverse_prob,
                "synthetic task: chance a step puts the operand on the left",
                _PROB,
            ),
            "heldout_fraction": Field(
                _SYNTHETIC.heldout_fraction,
                "synthetic task: fraction of expressions held out",
                Range("(0, 1)"),
            ),
        },
        "synthetic_seed": Field(0, "seed of the synthetic problem stream", _SEED),
    },
    "rollout": {
        "backend": Field(
            "local",
            "what samples completions: local (jit sampler) | jetstream (in-process) | "
            "jetstream_grpc",
        ),
        "decode_slots": Field(
            64,
            "jetstream* and decoder=continuous: concurrent decode slots (continuous batching)",
            _COUNT,
        ),
        "decoder": Field(
            "auto",
            "local: continuous (decode_slots slots, each refilled as soon as its row ends; a "
            "prompt's KV held once for its G rows; several processes: each its own rows, "
            "drawn as one process draws them) | static (one batch per step, decoded until its "
            "longest row ends; other draws of the same distribution; the tests' reference) | "
            "auto (local: continuous, on any number of processes; jetstream*: their own "
            "continuous batching). A resume may change it (it changes draws, not the state)",
        ),
        "tokens_per_dispatch": Field(
            8,
            "decoder=continuous and jetstream*: decode steps per jitted call (one host sync "
            "each; a slot freed inside a call is refilled at its end)",
            _COUNT,
        ),
        "prefill_chunk": Field(
            0,
            "decoder=continuous: prompt columns prefilled per loop turn, between decode "
            "dispatches, so a long prompt does not stall decoding (0: each prompt whole)",
            _NONNEG,
        ),
        "kv_page_size": Field(
            0,
            "tokens per KV page (gjax.rollout.pages: pages allocated as a row grows and "
            "freed when it ends, a group's prompt pages shared by its rows, a page table per "
            "slot; divides max_new_tokens; whole prefill) for the local continuous decoder and "
            "the JetStream engine (in-process, and gjax.serve's) | 0: each slot a contiguous "
            "max_new_tokens cache (the default)",
            _NONNEG,
        ),
        "kv_pages": Field(
            0,
            "kv_page_size > 0: pages in the pool (0: the contiguous layout's KV bytes at "
            "decode_slots, so no row ever waits; fewer pages, or more slots on the same "
            "pages, hold more rows in flight when lengths are long-tailed: the local decoder "
            "holds a row back or preempts it, the JetStream engine preempts it and its client "
            "sends it again)",
            _NONNEG,
        ),
        "paged_attention": Field(
            "auto",
            "kv_page_size > 0: how a decode step reads a row's pages | auto (the platform's "
            "Pallas paged-attention kernel on a GPU or TPU, XLA's gather on a CPU) | xla | "
            "pallas_gpu | pallas_tpu (on a CPU: Pallas's interpret mode, slow; tests)",
        ),
        "weight_change": Field(
            "finish",
            "jetstream*: requests decoding when new weights land (between generate calls): "
            "finish (on the new weights: a partial rollout; in-process each token's version "
            "and behaviour log-prob are recorded) | restart (ended, sent again on the new "
            "weights)",
        ),
        "server_address": Field(
            "127.0.0.1:9000", "jetstream_grpc: host:port that `python -m gjax.serve` binds"
        ),
        "server_addresses": Field(
            "",
            "jetstream_grpc: replicas 'HOST:PORT,HOST:PORT,...' (each request goes to the live "
            "one with the fewest outstanding; '': server_address alone; when set, "
            "server_address is left at its default or is one of them)",
        ),
        "request_timeout_s": Field(
            600.0,
            "jetstream*: deadline of a batch of requests, retries included, seconds (a "
            "server that is down is waited for this long; a rollout whose requests all failed "
            "is tried again only within it)",
            Range("(0, 86400]"),
        ),
        "max_retries": Field(
            3,
            "jetstream*: retries of a failed request (backoff; a server that is down is waited for)",
            _NONNEG,
        ),
        "push_dir": Field(
            "",
            "jetstream_grpc: where pushed weights go, local or gs:// ('': WORKDIR/push; "
            "several hosts: a path every trainer process and replica reaches)",
        ),
        "weight_transfer": Field(
            "directory",
            "jetstream_grpc: how new weights reach the server: directory (orbax files in "
            "push_dir) | grpc (streamed to server_address in the server's dtype; push_dir "
            "stays the fallback and restart path)",
        ),
        "quantize": Field(
            "none",
            "backend local: the sampler decodes int8 (or fp8, where the platform has it) "
            "codes of the policy's projections with per-output-channel scales, quantized "
            "after each push (gjax.models.quant, through qwix); the learner keeps its float "
            "params: none | int8 | fp8. Not none: objective.behaviour_correction 'auto' "
            "resolves to tis (rollout.recompute_old_logps on)",
        ),
        "prompts_per_step": Field(128, "P: prompts per rollout batch (global)", _COUNT),
        "num_samples": Field(
            8,
            "G: completions per prompt (group-relative advantages need G >= 2)",
            Range("[2, inf)"),
        ),
        "max_new_tokens": Field(2048, "longest completion in tokens", _COUNT),
        "temperature": Field(
            1.0, "sampling temperature (the loss scores at the same one)", _TEMPERATURE
        ),
        "top_p": Field(1.0, "nucleus sampling mass (1: off)", Range("(0, 1]")),
        "top_k": Field(0, "sample among the k likeliest tokens (0: off)", _NONNEG),
        # The sampler's own log-probs are the behaviour policy's (same params, same
        # temperature); recompute when its numerics differ (e.g. a serving engine in another
        # dtype). Anchors are always teacher-forced.
        "recompute_old_logps": Field(
            False, "recompute old log-probs teacher-forced instead of the sampler's"
        ),
        # Schedule and resume rule: gjax.rollout.producer.
        "max_staleness": Field(
            0,
            "k: a trained-on sample is at most k policy versions old (0: synchronous loop)",
            Range("[0, 16]"),
        ),
    },
    "objective": {  # gjax.objective.ObjectiveConfig
        "advantage": Field(
            PRESET, "advantage estimator, a name in gjax.objective.advantages.ADVANTAGES"
        ),
        "advantage_kwargs": Field(
            PRESET, "hyperparameters of the advantage estimator (see its docstring)"
        ),
        "token_weights": Field(
            PRESET, "per-token weighting (cw_gaussian, clip_cov, kl_cov; None: off)", kind=str
        ),
        "token_weights_kwargs": Field(
            PRESET, "hyperparameters of the token weighting (see its docstring)"
        ),
        "policy_loss": Field(
            PRESET, "per-token surrogate: ppo_clip | ratio | cispo | pg | gspo | luffy"
        ),
        "eps_low": Field(
            PRESET,
            "PPO clip range below 1: ratio >= 1 - eps_low (cispo: 1 = no lower bound)",
            Range("[0, 1]"),
        ),
        "eps_high": Field(
            PRESET, "PPO clip range above 1: ratio <= 1 + eps_high (DAPO clip-higher)", _NONNEG
        ),
        "dual_clip": Field(
            PRESET,
            "dual-clip constant c > 1 for negative advantages (None: off)",
            Range("(1, inf)"),
            kind=float,
        ),
        "kl_beta": Field(
            PRESET,
            "weight of the KL penalty to the frozen initial policy (0: no reference)",
            _NONNEG,
        ),
        "kl_estimator": Field(PRESET, "KL estimator: k1 | k2 | k3"),
        "entropy_coef": Field(PRESET, "weight of the entropy bonus", _NONNEG),
        "aggregation": Field(
            PRESET, "how token losses become one number (gjax.objective.aggregation)"
        ),
        "aggregation_constant": Field(
            PRESET, "Dr.GRPO's constant denominator (None: max_new_tokens)", _POS, kind=float
        ),
        "temperature": Field(
            None,
            "temperature of the scored log-probs (None: rollout.temperature, which a set value "
            "must equal)",
            _TEMPERATURE,
            kind=float,
        ),
        "anchor_treatment": Field(PRESET, "loss on DaGRPO anchors: ratio | luffy"),
        "luffy_gamma": Field(PRESET, "LUFFY's shaping gamma in pi / (pi + gamma)", _POS),
        "behaviour_correction": Field(
            PRESET,
            "sampler/trainer mismatch correction: none | tis (truncated IS) | mask | auto "
            "(the default: tis when rollout.quantize is not none, else none; resolved at "
            "validation)",
        ),
        "behaviour_level": Field(PRESET, "where the correction ratio is taken: token | sequence"),
        "behaviour_cap": Field(
            PRESET, "C: tis caps the ratio at C, mask keeps [1/C, C]", Range("(1, inf)")
        ),
        "token_chunk": Field(
            PRESET, "tokens per chunk of the log-prob kernel (None: its default)", _COUNT, kind=int
        ),
        "vocab_tile": Field(
            PRESET, "vocabulary tile of the log-prob kernel (None: its default)", _COUNT, kind=int
        ),
        "lm_head_kernel": Field(
            PRESET,
            "schedule of the fused LM-head loss: auto (per platform, gjax.objective.logprobs."
            "FUSED_TILES) | reference (4 matmuls, 1024-token chunks)",
        ),
        "covariance_metrics": Field(
            False,
            "log cov/*: percentiles of |cov(log-prob, advantage)| per token, CW-GRPO Table 1's "
            "form, for any objective (sorts the batch's tokens each step; on in the studies)",
        ),
    },
    "anchors": {
        "per_group": Field(0, "DaGRPO: demonstrations mixed into each group of G", _NONNEG),
    },
    "sampling": {
        "dynamic": Field(
            False, "DAPO: drop zero-variance groups and resample until the batch is full"
        ),
        "max_rollouts_per_step": Field(3, "most rollout rounds per step when resampling", _COUNT),
        "min_valid_fraction": Field(
            0.0, "GPG beta_th: carry valid groups over while below this fraction", _PROB
        ),
        "overlong_filter": Field(False, "DAPO: truncated completions get no loss"),
        # The one way to shape rewards by length (DAPO eq. (13)): added to the rewards after
        # `reward/accuracy` is measured (gjax.rewards.functions.soft_overlong_penalty).
        "overlong_buffer": Field(
            0, "DAPO soft overlong punishment length L_cache in tokens (0: off)", _NONNEG
        ),
        "overlong_penalty": Field(
            1.0, "DAPO soft overlong punishment at the length limit (its weight)", _NONNEG
        ),
    },
    "reward": {
        "functions": Field("accuracy", "comma list of name[:weight] from gjax.rewards.REWARDS"),
        "extractors": Field(
            "boxed,answer_tag",
            "comma list of the answer extractors the verifier tries in order (gjax.answers: "
            "boxed | answer_tag | answer_line | math_verify); the format the prompt asks for",
        ),
        "timeout_s": Field(5.0, "verifier deadline per completion, seconds", Range("(0, 3600]")),
        "workers": Field(2, "verifier worker processes", Range("[1, 1024]")),
        "judge": {  # gjax.rewards.judge
            "name": Field("none", "LLM judge of the responses: none | openai | rule"),
            "base_url": Field(
                "https://api.openai.com/v1", "OpenAI-compatible endpoint of the judge"
            ),
            "model": Field("gpt-4o", "judge model name"),
            "api_key_env": Field(
                "OPENAI_API_KEY", "environment variable holding the judge's API key (not the key)"
            ),
            "concurrency": Field(32, "most judge requests in flight", _COUNT),
            "timeout_s": Field(60.0, "judge request timeout, seconds", _POS),
            "max_retries": Field(4, "retries of a failed judge request", _NONNEG),
            "on_missing": Field("keep", "a sample the judge did not score: keep | drop | fill"),
            "fill_score": Field(
                5.5,
                "score given to unscored samples under 'fill' (judge scale 1-10)",
                Range("[1, 10]"),
            ),
            "out_of_range": Field("clamp", "a judge score outside [1, 10]: clamp | reject"),
            "noise_std": Field(
                0.0,
                "rule judge only: Gaussian noise of this std on each score, clipped to [1, 10] "
                "and seeded by config.seed and the item (scores not a function of correctness)",
                _NONNEG,
            ),
            "max_missing_fraction": Field(
                0.5, "a batch with a larger fraction of judge scores missing counts as bad", _PROB
            ),
            "max_missing_steps": Field(
                3, "stop the run after this many bad judge batches in a row (0: never)", _NONNEG
            ),
        },
    },
    # gjax.envs: multi-turn environments and tools, rolled out by the continuous decoder
    # (gjax.rollout.turns) or JetStream (gjax.rollout.jetstream_episodes) and trained on by
    # gjax.rollout.episodes (gjax.envs.check_config refuses the paths without episodes).
    "env": {
        "name": Field(
            "",
            "multi-turn environment (gjax.envs.ENVIRONMENTS: math | tool); '' single-turn",
        ),
        "max_turns": Field(4, "policy turns per episode; a longer one is truncated", _COUNT),
        "discount": Field(
            1.0,
            "a trajectory's reward: sum over its turns t = 0, 1, ... of discount**t * r_t "
            "(1.0: the plain sum of the per-turn rewards)",
            Range("(0, 1]"),
        ),
        "turn_tokens": Field(
            0,
            "new tokens per policy turn; a turn reaching it without a stop id ends its episode, "
            "truncated (0: the trajectory's budget, rollout.max_new_tokens, which bounds every "
            "policy and environment token after the prompt)",
            _NONNEG,
        ),
        "max_tool_calls": Field(
            8, "tool calls per episode; a turn that passes it truncates the episode", _NONNEG
        ),
        "tools": Field(
            "calculator", "comma list of the tool environment's tools: calculator|python|search"
        ),
        "tool_prompt": Field(
            "auto",
            "auto: a tool environment's prompts describe its tools (the chat template's "
            "tools= where it takes them, else gjax's `# Tools` system block); none: they do not",
        ),
        "tool_timeout_s": Field(
            5.0, "wall-clock limit of one sandboxed tool call, seconds", Range("(0, 600]")
        ),
        "tool_memory_mb": Field(
            512, "address-space limit of a sandboxed tool call's process, MiB", Range("[16, inf)")
        ),
        "tool_output_chars": Field(
            4096, "longest tool output the policy sees; longer is an 'output' error", _COUNT
        ),
        "tool_workers": Field(2, "tool calls (sandbox processes) running at once", _COUNT),
        "max_in_flight": Field(256, "episode steps running at once (gjax.envs.EnvRunner)", _COUNT),
        "search_corpus": Field(
            "", 'JSONL of {"title", "text"} passages for the search tool (local or gs://)'
        ),
        "search_top_k": Field(3, "passages the search tool returns", _COUNT),
        "search_passage_chars": Field(
            500, "characters of each returned passage (the rest is cut)", _COUNT
        ),
    },
    "optim": {
        "lr": Field(1e-6, "peak learning rate (AdamW)", Range("(0, 1]")),
        "warmup_steps": Field(0, "steps of linear warmup from 0 to lr", _NONNEG),
        "schedule": Field("constant", "learning rate after warmup: constant | cosine"),
        "weight_decay": Field(0.0, "AdamW decoupled weight decay", _NONNEG),
        "b1": Field(0.9, "AdamW first-moment decay", Range("[0, 1)")),
        "b2": Field(0.999, "AdamW second-moment decay", Range("[0, 1)")),
        "clip_norm": Field(
            1.0, "global gradient-norm clip threshold (a large value: no clipping)", _POS
        ),
    },
    "train": {
        "steps": Field(500, "RL steps (rollout batches) to train", _COUNT),
        "max_sampled_tokens": Field(
            0,
            "end training after the step at which the run's sampled tokens (metric "
            "response/sampled_tokens summed over its steps, resumes included) reach N, as at "
            "train.steps, which stays the upper bound (0: no budget): runs compared at a "
            "matched sampling cost (a cosine schedule still decays over train.steps)",
            _NONNEG,
        ),
        "minibatches": Field(1, "optimizer updates per rollout batch per pass", _COUNT),
        "num_iterations": Field(1, "passes over each rollout batch (GRPO's mu)", _COUNT),
        "microbatches": Field(1, "gradient accumulation pieces per minibatch", _COUNT),
        "packing": Field(
            "packed",
            "how the learner lays out rows: packed (each minibatch's rows end to end in "
            "pack_bins bins of pack_length tokens; microbatches are bins) | padded (every row "
            "at the batch's full length); same loss and gradients",
        ),
        "pack_bins": Field(
            0,
            "bins per minibatch when packed (0: auto, the fewest each batch needs rounded up "
            "to 4 values per doubling (under 1/5 of the bins empty), then to a multiple of "
            "microbatches x the data-parallel devices, and the LM head runs only at the "
            "positions per bin the loss reads (2 values per doubling); one compile per shape "
            "a run meets, a few (metric pack/fill: the bins' tokens that are rows); "
            "N: always N bins, the head at every position, one compile, a "
            "batch whose rows do not fit stops with an error, and on several processes N must "
            "be a multiple of microbatches x the data-parallel devices; "
            "metric pack/bins_used_max: what batches needed)",
            _NONNEG,
        ),
        "pack_length": Field(
            0, "tokens per bin when packed (0: the padded row length, prompt + completion)", _NONNEG
        ),
        "allow_nonfinite": Field(
            False, "go on after a non-finite loss or gradient norm instead of stopping"
        ),
        "allow_config_change": Field(
            False,
            "resume a workdir with changed training fields (recorded in config_history.jsonl; "
            "refused otherwise)",
        ),
        "storage_timeout_s": Field(
            300.0,
            "seconds a workdir write (metrics upload, checkpoint save) may keep failing or "
            "hang, retried with backoff, before the run stops naming its last checkpoint",
            _POS,
        ),
        "compilation_cache": Field(
            "default",
            "persistent XLA compilation cache directory (a rerun reads its programs back "
            "instead of compiling): default ($JAX_COMPILATION_CACHE_DIR if set, empty: off; "
            "else $XDG_CACHE_HOME/gjax/jax or ~/.cache/gjax/jax) | a path | '' (off)",
        ),
    },
    "checkpoint": {
        "every": Field(
            50, "save a checkpoint every N steps (and at the end or on SIGTERM)", _COUNT
        ),
        "keep": Field(3, "newest checkpoints kept on disk", _COUNT),
        "async_save": Field(True, "write checkpoints in the background"),
    },
    "log": {
        "tensorboard": Field(True, "write TensorBoard events next to metrics.jsonl"),
        "progress": Field(True, "show a progress bar"),
        "eval_every": Field(
            0, "held-out evaluation every N steps (0: only before and after)", _NONNEG
        ),
        # Weights & Biases (gjax.wandb_log; `pip install wandb`): the series, config,
        # held-out table and curves; a resume continues the same wandb run.
        "wandb_project": Field("", "wandb project to log the run to (empty: wandb off)"),
        "wandb_entity": Field("", "wandb entity (user or team; empty: wandb's default)"),
        "wandb_name": Field("", "wandb run name (empty: wandb picks one)"),
        "wandb_tags": Field("", "comma list of wandb tags, e.g. 'grpo,tiny'"),
        "wandb_mode": Field(
            "", "online | offline | disabled (empty: wandb's default, WANDB_MODE or online)"
        ),
    },
    # Held-out evaluation (gjax.eval): greedy accuracy (eval/heldout_accuracy) plus pass@k
    # from n samples at the papers' evaluation sampling (A-GRAE App. C.2).
    "eval": {
        "greedy_temperature": Field(
            0.0,
            "temperature of the held-out accuracy eval/heldout_accuracy (0: greedy)",
            Range("[0, 100]"),
        ),
        "num_samples": Field(
            8, "n samples per held-out problem for pass@k (0: greedy only)", _NONNEG
        ),
        "temperature": Field(
            0.6, "pass@k sampling temperature (A-GRAE App. C.2: 0.6)", _TEMPERATURE
        ),
        "top_p": Field(0.95, "pass@k nucleus mass (A-GRAE App. C.2: 0.95)", Range("(0, 1]")),
        "pass_k": Field(
            "1,8", "comma list of k logged as eval/heldout_pass@k (each <= num_samples)"
        ),
        "max_rows": Field(
            256, "sequences per sampler call during evaluation (bounds memory)", _COUNT
        ),
    },
}

# Fields renamed in a release -> their new names; one release on, the old names go.
RENAMED = {
    "rollout.eval_temperature": "eval.greedy_temperature",
    "reward.judge": "reward.judge.name",
    **{
        f"reward.judge_{key}": f"reward.judge.{key}"
        for key in (
            "base_url",
            "model",
            "api_key_env",
            "concurrency",
            "timeout_s",
            "max_retries",
            "on_missing",
            "fill_score",
            "out_of_range",
            "max_missing_fraction",
            "max_missing_steps",
        )
    },
}


def _flatten(section: dict, prefix: str = ""):
    for key, item in section.items():
        if isinstance(item, dict):
            yield from _flatten(item, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", item


# Every field, by its dotted path, in the schema's order.
FIELDS: dict[str, Field] = dict(_flatten(SCHEMA))


# --------------------------------------------------------------------------- objective

_DATA_KWARGS = {"scores_PxG", "is_anchor_PxG", "rng", "group_size"}


def hyperparameters(kind: str, name: str | None) -> dict:
    """The static keyword hyperparameters (with defaults) of an estimator or token weighting."""
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


def objective(preset: str, **overrides) -> ml_collections.ConfigDict:
    """Every `gjax.objective.ObjectiveConfig` field, from a named preset plus overrides.

    Listing all fields (not just the changed ones) makes each one overridable from the
    command line with type checking, e.g. `--config.objective.eps_high=0.28`;
    `*_kwargs` become nested dicts (`--config.objective.advantage_kwargs.alpha=0.5`).
    """
    fields = {}
    chosen = ObjectiveConfig.preset(preset)
    for f in dataclasses.fields(ObjectiveConfig):
        value = getattr(chosen, f.name)
        if f.name.endswith("_kwargs"):
            fn = f.name[: -len("_kwargs")]
            value = ml_collections.ConfigDict(
                {**hyperparameters(fn, getattr(chosen, fn)), **dict(value)}
            )
        elif value is None or f.name == "temperature":  # temperature: rollout's by default
            value = ml_collections.config_dict.placeholder(SCHEMA["objective"][f.name].kind)
        elif f.name == "behaviour_correction" and value == "none":
            value = AUTO_CORRECTION  # resolved with the rollout (`resolve_behaviour_correction`)
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


AUTO_CORRECTION = "auto"  # objective.behaviour_correction left to the rollout's quantization


def resolve_behaviour_correction(config: ml_collections.ConfigDict) -> None:
    """Resolves `objective.behaviour_correction='auto'` in place (at validation): quantized
    rollouts (`rollout.quantize` not none) sample a behaviour policy other than the learner's,
    so their default is tis (truncated IS at `behaviour_cap`) with the learner's own old
    log-probs (`rollout.recompute_old_logps=True`); otherwise none. A correction the user set
    (none | tis | mask) is kept."""
    if config.objective.behaviour_correction != AUTO_CORRECTION:
        return
    quantized = config.rollout.get("quantize", "none") != "none"
    config.objective.behaviour_correction = "tis" if quantized else "none"
    if quantized:
        config.rollout.recompute_old_logps = True


def objective_as_trained(objective: dict, rollout_temperature: float) -> dict:
    """config.objective's fields as the loss uses them: an unset temperature is the rollout's
    (the loss scores at the sampling temperature); an unresolved 'auto' correction is none
    (`resolve_behaviour_correction` resolves it at validation)."""
    if objective.get("behaviour_correction") == AUTO_CORRECTION:
        objective = {**objective, "behaviour_correction": "none"}
    if objective["temperature"] is None:
        return {**objective, "temperature": rollout_temperature}
    return objective


def to_objective_config(
    objective_cfg: ml_collections.ConfigDict, *, rollout_temperature: float
) -> ObjectiveConfig:
    """ConfigDict -> the frozen `ObjectiveConfig` (its own validation names bad fields); an
    unset temperature is `rollout_temperature` (the loss scores at the sampling one)."""
    d = objective_as_trained(objective_cfg.to_dict(), rollout_temperature)
    for kind in ("advantage", "token_weights"):
        valid = hyperparameters(kind, d[kind])
        unknown = sorted(set(d[f"{kind}_kwargs"]) - set(valid))
        if unknown:
            raise ValueError(
                f"config.objective.{kind}_kwargs: {unknown} are not hyperparameters of "
                f"{kind} {d[kind]!r}; valid: {sorted(valid)}"
            )
    return ObjectiveConfig(**d)


# --------------------------------------------------------------------------- base config


def _build(section: dict) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    for key, item in section.items():
        if isinstance(item, dict):
            c[key] = _build(item)
        elif item.default is None:
            c[key] = ml_collections.config_dict.placeholder(item.kind)
        else:
            c[key] = item.default
    return c


def base() -> ml_collections.ConfigDict:
    """Every field at its default (GRPO's objective): what `configs/<algo>.py` start from."""
    c = _build({k: v for k, v in SCHEMA.items() if k != "objective"})
    c.objective = objective("grpo")
    return c


# --------------------------------------------------------------------------- field names


def walk(cfg: ml_collections.ConfigDict, prefix: str = ""):
    """(dotted path, value) of every leaf of `cfg`."""
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            yield from walk(value, path + ".")
        else:
            yield path, value


def server_addresses(rollout) -> list[str]:
    """The `gjax.serve` replicas a jetstream_grpc run samples from: `rollout.server_addresses`
    split on commas, or `[rollout.server_address]` when it is empty. Raises ConfigError on an
    address that is not HOST:PORT, a repeated one, or a `server_address` set to another one."""
    listed = rollout.get("server_addresses", "")
    if isinstance(listed, str):
        listed = [a.strip() for a in listed.split(",") if a.strip()]
    one = rollout.server_address
    if not listed:
        listed = [one]
    elif one != SCHEMA["rollout"]["server_address"].default and one not in listed:
        raise ConfigError(
            f"config.rollout.server_address={one!r} is not one of "
            f"config.rollout.server_addresses={','.join(listed)!r}: server_addresses lists "
            "every replica and replaces server_address. Leave server_address unset, or add it "
            "to the list."
        )
    for a in listed:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"config.rollout.server_addresses: {a!r} must be HOST:PORT (e.g. 127.0.0.1:9000)"
            )
    if len(set(listed)) != len(listed):
        raise ConfigError(
            f"config.rollout.server_addresses={','.join(listed)!r} names a replica twice"
        )
    return list(listed)


def unknown_field(path: str, known, how: str = "") -> ConfigError:
    """The error for `config.<path>`, not among the `known` leaf paths: a renamed field names
    its new name; otherwise it names the deepest section that exists, the closest valid names
    there and all of that section's fields."""
    if path in RENAMED:
        return ConfigError(
            f"config.{path}{how} was renamed: set config.{RENAMED[path]} instead (the old name "
            "is refused from this release on). Run with --help to see every field."
        )
    known = set(known)
    sections = {""} | {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
    parts = path.split(".")
    depth = max(i for i in range(len(parts)) if ".".join(parts[:i]) in sections)
    section = ".".join(parts[:depth])
    prefix = f"{section}." if section else ""
    children = sorted(
        {k[len(prefix) :].split(".")[0] for k in known | sections if k.startswith(prefix) and k}
        - {""}
    )
    close = difflib.get_close_matches(parts[depth], children, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(f'config.{prefix}{c}') for c in close)}?"
    where = f"config.{section}" if section else "config"
    return ConfigError(
        f"unknown config field 'config.{path}'{how}.{hint if close else ''} The fields of "
        f"{where} are: {', '.join(children)}. Run with --help to see every field and its meaning."
    )
