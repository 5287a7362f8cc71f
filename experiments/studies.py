"""The studies: each a list of variants, each variant a config preset plus overrides (a
study's own overrides, shared by its variants, go first).

A variant names a `configs/<module>.py` and its argument (`headroom`: the embedded task with
room to learn, `configs.common.headroom`; `tiny`: the fast embedded task), an
optional objective preset that replaces `config.objective` whole (`gjax.schema.objective`),
and dotted-path overrides applied after it. `build_config` makes the run config of one
(variant, seed); an override of a field the config lacks is an error, never a new field.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

import ml_collections

from gjax import schema
from gjax.errors import ConfigError

# Held-out pass@k after training: n samples per problem (k = 1..n), as A-GRAE Fig. 2.
PASSK_SAMPLES = 64
SMOKE_PASSK_SAMPLES = 4

# How much a variant's intervention acted, as `experiments.aggregate` records it per run in
# runs.json: the key -> (what it counts, the factor to a percentage).
SHARES = {
    "clipped_pct": ("tokens", 1.0),  # the clip's share of loss tokens, already in %
    "adv/masked_fraction": ("samples", 100.0),  # DaGRPO's masked / valid samples
}


# GPG Table 15's row A: GRPO's group-std advantage, no alpha correction, no beta_th threshold.
ROW_A = {
    "objective.advantage_kwargs.norm": "group",
    "objective.advantage_kwargs.fold_alpha": False,
    "sampling.min_valid_fraction": 0.0,
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # a directory name: letters, digits, '_', '-', '.'
    config: str  # a module of configs/ ("grpo"), loaded with `arg`
    doc: str
    objective: str | None = None  # an objective preset replacing config.objective
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    arg: str = "headroom"
    # What the variant adds that may act on few samples or tokens, each with the runs.json key
    # (of `SHARES`) measuring the share it acted on: ("the masks", "adv/masked_fraction").
    # Under 5 % the aggregation calls it "not exercised".
    acts: tuple[tuple[str, str], ...] = ()
    # The variant of the study this one is paired against (None: the study's first), where
    # its question is against another arm (DAPO's clip-higher alone: DAPO with it and
    # without).
    versus: str | None = None

    def __post_init__(self):
        for what, key in self.acts:
            if key not in SHARES:
                raise ConfigError(
                    f"variant {self.name!r}: {what!r} is measured by {key!r}, which runs.json "
                    f"does not record; the measures: {', '.join(SHARES)}"
                )


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    claim: str  # what the paper says, in one line (the README states it in full)
    variants: tuple[Variant, ...]
    # Overrides every variant of the study shares, applied before each variant's own.
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Held-out samples per problem of the final and base pass@k (experiments/passk.py).
    passk_samples: int = PASSK_SAMPLES

    def __post_init__(self):
        names = [v.name for v in self.variants]
        versus = {v.name: v.versus for v in self.variants if v.versus is not None}
        for name, ref in versus.items():
            if ref not in names or ref == name:
                raise ConfigError(
                    f"study {self.name!r}: variant {name!r} is paired against {ref!r}, "
                    f"which is not another of its variants ({', '.join(names)})"
                )
            seen = {name}
            while ref in versus:  # a chain of references ends at an arm paired with none
                if ref in seen:
                    raise ConfigError(
                        f"study {self.name!r}: the variants paired against each other "
                        f"({', '.join(sorted(seen))}) form a cycle; pair one against the "
                        "study's first"
                    )
                seen.add(ref)
                ref = versus[ref]

    def reference(self, name: str) -> str:
        """The variant `name` is paired against."""
        return self.variant(name).versus or self.variants[0].name

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise ConfigError(
            f"study {self.name!r} has no variant {name!r}; its variants: "
            f"{', '.join(v.name for v in self.variants)}"
        )


def _agrae(name: str, sample_level: str, group_level: str, doc: str) -> Variant:
    kw = "objective.advantage_kwargs"
    return Variant(
        name,
        "a_grae",
        doc,
        overrides={f"{kw}.sample_level": sample_level, f"{kw}.group_level": group_level},
    )


_MASKS = (("the masks", "adv/masked_fraction"),)  # DaGRPO's indistinct-pair masks
# all_algorithms' matched budget: its GRPO arm's sampled tokens over 200 steps, 443.4k-448.1k
# over 5 seeds (mean 445.1k); DAPO's and GPG's arms sampled 2.9x and 2.4x that.
MATCHED_TOKENS = 445_000
# The headline table's arms (all_algorithms), each its own preset, and their shared
# setup: off-policy, as A-GRAE App. C.2 and GSPO (four mini-batch updates per rollout
# batch): the ratios leave 1 and the clips act (experiments/README.md, "Off-policy updates").
_HEADLINE = (
    Variant("grpo", "grpo", "GRPO (DeepSeekMath), k3 KL 0.04"),
    Variant("dr_grpo", "dr_grpo", "Dr.GRPO: no std, token sum / constant"),
    Variant(
        "dapo",
        "dapo",
        "DAPO: clip-higher, token mean, dynamic sampling, overlong",
        acts=(("the clip (eps_high 0.28)", "clipped_pct"),),
    ),
    Variant(
        "gspo",
        "grpo",
        "GSPO: sequence-level ratio and clip",
        objective="gspo",
        acts=(("the sequence clip", "clipped_pct"),),
    ),
    Variant("gpg", "gpg", "GPG: -logp * A, alpha = B/(B-M), beta_th 0.6"),
    Variant("a_grae", "a_grae", "A-GRAE: DDAS eq. (12) + ASS eq. (13)"),
    Variant("cw_grpo", "cw_grpo", "CW-GRPO: Gaussian covariance token weights"),
    Variant(
        "dagrpo",
        "dagrpo",
        "DaGRPO: delta 3, one anchor per group, rule judge",
        acts=_MASKS,
    ),
    Variant(
        "cispo",
        "cispo",
        "CISPO: clipped IS weight, stop-gradient (MiniMax-M1)",
        acts=(("the IS-weight clip", "clipped_pct"),),
    ),
    Variant("pass_at_k", "pass_at_k", "pass@k advantage, k = 4 (Chen et al. 2025)"),
)
_HEADLINE_OVERRIDES = {"train.minibatches": 4}
# Issue 37 item 5: each of these arms at a third and three times the task's rate (1e-5,
# `configs.common.headroom`, tuned on GRPO); all_algorithms' seed 0 is the middle point.
LR_SWEEP = (3e-6, 3e-5)
_LR_SWEPT = ("grpo", "gpg", "a_grae", "cw_grpo", "dagrpo")


_STUDIES = (
    Study(
        "all_algorithms",
        "every algorithm on one task: held-out pass@1 over steps, pass@k at the end against the "
        "base policy, entropy, response length and grad norm over steps",
        (
            *_HEADLINE,
            # Issue 37 item 4: the arms that sample more per step, stopped at GRPO's sampling
            # cost instead of its step count (`train.max_sampled_tokens`).
            *(
                Variant(
                    f"{algo}_matched",
                    algo,
                    f"{doc}, stopped at GRPO's sampled tokens ({MATCHED_TOKENS:,})",
                    overrides={"train.max_sampled_tokens": MATCHED_TOKENS},
                    acts=acts,
                )
                for algo, doc, acts in (
                    ("dapo", "DAPO", (("the clip (eps_high 0.28)", "clipped_pct"),)),
                    ("gpg", "GPG", ()),
                )
            ),
            # Issue 37 item 3: DAPO's clip-higher in isolation (DAPO Sec. 3.1), and A-GRAE on
            # its other two bases (`_AGRAE_BASES`; the paper's Table 3), each paired against
            # the arm it changes.
            Variant(
                "dapo_eps_high_0.2",
                "dapo",
                "DAPO without clip-higher: eps_high = eps_low = 0.2",
                overrides={"objective.eps_high": 0.2},
                acts=(("the clip (eps_high 0.2)", "clipped_pct"),),
                versus="dapo",
            ),
            *(
                Variant(
                    f"a_grae_on_{base}",
                    base,
                    f"{name} with A-GRAE's advantages on its base (DDAS eq. (12) + ASS eq. (13))",
                    overrides={
                        "objective.advantage": "a_grae",
                        "objective.advantage_kwargs": {
                            "base": base,
                            "sample_level": "ddas",
                            "group_level": "ass",
                        },
                    },
                    versus=base,
                )
                for base, name in (("dapo", "DAPO"), ("dr_grpo", "Dr.GRPO"))
            ),
        ),
        overrides=_HEADLINE_OVERRIDES,
    ),
    # Issue 37 item 5: the learning rate swept per method, seed 0, so that no headline verdict
    # rests on a rate picked for GRPO alone (as lora_lr_sweep picks each LoRA rank's).
    #   python -m experiments.run all_algorithms_lr --seeds 1
    Study(
        "all_algorithms_lr",
        "none: each headline method's final held-out pass@1 at lr 3e-6 and 3e-5, beside "
        "all_algorithms' seed 0 at 1e-5",
        tuple(
            dataclasses.replace(
                v,
                name=f"{v.name}_lr{lr:g}",
                doc=f"{v.doc}; lr {lr:g}",
                overrides={**v.overrides, "optim.lr": lr},
                versus=None,
            )
            for v in _HEADLINE
            if v.name in _LR_SWEPT
            for lr in LR_SWEEP
        ),
        overrides=_HEADLINE_OVERRIDES,
    ),
    Study(
        "a_grae_variants",
        "A-GRAE Sec. 4 / Table 1 / Table 5: negative-dominant beats GRPO on pass@k at large k; "
        "hard- vs easy-focused has no universal winner; DDAS + ASS improves on both parts",
        (
            _agrae("grpo", "none", "none", "GRPO advantages (no reshaping), same setup"),
            _agrae("positive_dominant", "none", "positive_dominant", "Table 1(a): A+ x beta"),
            _agrae("negative_dominant", "none", "negative_dominant", "Table 1(a): A+ / beta"),
            _agrae("easy_focused", "easy", "none", "Table 1(b): A gamma / sqrt(1 - p)"),
            _agrae("hard_focused", "hard", "none", "Table 1(b): A gamma / sqrt(p)"),
            _agrae("ddas_only", "ddas", "none", "Table 5: sample level only (eq. (12))"),
            _agrae("ass_only", "none", "ass", "Table 5: group level only (eq. (13))"),
            _agrae("a_grae", "ddas", "ass", "A-GRAE: DDAS + ASS"),
            # A check, not the paper's: with A+ x 10 the global-norm clip at 1.0 cuts every
            # step (grad norm ~3.6 where GRPO's is ~0.8); this arm lifts the clip.
            Variant(
                "positive_dominant_no_clip",
                "a_grae",
                "positive-dominant without the grad-norm clip (optim.clip_norm 1e9)",
                overrides={
                    "objective.advantage_kwargs.sample_level": "none",
                    "objective.advantage_kwargs.group_level": "positive_dominant",
                    "optim.clip_norm": 1e9,
                },
            ),
        ),
    ),
    Study(
        "cw_grpo_vs_grpo",
        "CW-GRPO Fig. 1 / Table 1: GRPO's entropy is unstable; covariance weights keep it at a "
        "reasonable level and improve accuracy",
        (
            Variant("grpo", "cw_grpo", "GRPO in CW-GRPO's setup", objective="grpo"),
            Variant("cw_grpo", "cw_grpo", "CW-GRPO: Gaussian covariance weights (scope group)"),
            # Issue 37 item 3: CW-GRPO's Table 2 baseline, Clip-Cov (Cui et al. 2025), as GRPO
            # plus its token weights in this setup (the KL and the loss as the grpo arm's).
            Variant(
                "clip_cov",
                "cw_grpo",
                "GRPO with Clip-Cov: high-covariance tokens detached (Cui et al. 2025)",
                objective="grpo",
                overrides={"objective.token_weights": "clip_cov"},
            ),
        ),
    ),
    Study(
        "dagrpo",
        "DaGRPO Sec. 5 and 7: masking indistinct pairs removes conflicting gradients (fewer grad-norm "
        "spikes) and prevents length / entropy collapse; ablations on delta, anchors, ratio",
        (
            Variant(
                "dr_grpo",
                "dagrpo",
                "the Dr.GRPO setting DaGRPO builds on: no masks, no anchors, no judge",
                objective="dr_grpo",
                overrides={"anchors.per_group": 0, "reward.judge.name": "none"},
            ),
            *(
                Variant(
                    f"delta_{d}",
                    "dagrpo",
                    f"delta = {d} (eqs. (8)-(9)), one anchor per group of 8",
                    overrides={"objective.advantage_kwargs.delta": float(d)},
                    acts=_MASKS,
                )
                for d in (1, 3, 5)
            ),
            Variant(
                "no_anchors",
                "dagrpo",
                "delta = 3 without off-policy anchors",
                overrides={"anchors.per_group": 0},
                acts=_MASKS,
            ),
            *(
                Variant(
                    f"anchors_{a}",
                    "dagrpo",
                    f"delta = 3, {a} anchors per group of 8 (anchor ratio {a}/8)",
                    overrides={"anchors.per_group": a},
                    acts=_MASKS,
                )
                for a in (2, 4)
            ),
            # Issue 37 item 3: the anchors' LUFFY-style loss (pi / (pi + gamma) shaping, no
            # clip), against the same anchors under the ratio loss.
            Variant(
                "luffy_anchors",
                "dagrpo",
                "delta = 3, one anchor per group, LUFFY's shaped loss on the anchors (gamma 0.1)",
                overrides={"objective.anchor_treatment": "luffy"},
                acts=_MASKS,
                versus="delta_3",
            ),
            # Issue 37 item 3: the masks alone (no anchors) over delta 1-8 (3: `no_anchors`),
            # and under a judge whose scores are not a function of correctness: the rule
            # judge with Gaussian noise of std 2 on its 1-10 scale (`reward.judge.noise_std`).
            *(
                Variant(
                    f"masks_delta_{d:g}",
                    "dagrpo",
                    f"delta = {d:g}, no anchors: the masks alone",
                    overrides={"anchors.per_group": 0, "objective.advantage_kwargs.delta": d},
                    acts=_MASKS,
                )
                for d in (1.0, 5.0, 8.0)
            ),
            *(
                Variant(
                    f"noisy_masks_delta_{d:g}",
                    "dagrpo",
                    f"delta = {d:g}, no anchors, the rule judge's scores + N(0, 2^2)",
                    overrides={
                        "anchors.per_group": 0,
                        "objective.advantage_kwargs.delta": d,
                        "reward.judge.noise_std": 2.0,
                    },
                    acts=_MASKS,
                )
                for d in (3.0, 5.0)
            ),
        ),
        # DaGRPO's own setup (000_* Sec. 6, configs/dagrpo.py): two updates per rollout batch.
        overrides={"train.minibatches": 2},
    ),
    Study(
        "gpg",
        "GPG Tables 1, 13-15: plain policy gradient matches or beats GRPO at lower cost; the "
        "alpha = B/(B-M) correction and the beta_th threshold matter",
        (
            Variant("grpo", "grpo", "GRPO (compare at equal sampled tokens: figure x axis)"),
            Variant("gpg", "gpg", "GPG: alpha on, beta_th 0.6"),
            Variant(
                "gpg_no_alpha",
                "gpg",
                "GPG without the alpha correction (eq. (8))",
                overrides={"objective.advantage_kwargs.fold_alpha": False},
            ),
            *(
                Variant(
                    f"gpg_beta_th_{b}",
                    "gpg",
                    f"GPG with beta_th = {b}",
                    overrides={"sampling.min_valid_fraction": b},
                )
                for b in (0.0, 0.8)
            ),
            # Table 1's rows B vs C (alpha off / on, no threshold): at beta_th 0 alpha spans
            # 1.6-3.2 as in the paper's Fig. 2; at 0.6 it stays within 1-1.6.
            Variant(
                "gpg_beta_th_0.0_no_alpha",
                "gpg",
                "GPG with beta_th = 0.0, without the alpha correction",
                overrides={
                    "sampling.min_valid_fraction": 0.0,
                    "objective.advantage_kwargs.fold_alpha": False,
                },
            ),
            # Table 15's row A, "PG + group reward": F_norm = the group's std, alpha = 1, no
            # threshold (GRPO's advantage under GPG's loss: no ratio, clip or KL), and Table
            # 11's group sizes on it ("wo AGE"; its G = 8 row is row A's 45.3). The prompts per
            # step stay 16, so G = 4 samples half the tokens of G = 8 and G = 16 twice.
            Variant("gpg_row_a", "gpg", "GPG row A: F_norm = group std, alpha 1", overrides=ROW_A),
            *(
                Variant(
                    f"gpg_row_a_g{g}",
                    "gpg",
                    f"GPG row A with G = {g} samples per prompt",
                    overrides={**ROW_A, "rollout.num_samples": g},
                    versus="gpg_row_a",
                )
                for g in (4, 16)
            ),
        ),
    ),
    # Issue 32 item 7, step 1: each LoRA rank's learning rate (LoRA wants a higher one than
    # full fine-tuning: "LoRA Without Regret", Schulman et al. 2025, about 10x at alpha 32 and
    # 1/r scaling). GRPO on :headroom (full fine-tuning's lr there: 1e-5), one seed; the rate
    # with the best final held-out pass@1 per rank goes into the `lora` study.
    Study(
        "lora_lr_sweep",
        "none: picks each LoRA rank's learning rate for the `lora` study (5x, 15x, 50x the "
        "full fine-tuning rate)",
        tuple(
            Variant(
                f"lora_r{rank}_lr{lr:g}",
                "grpo",
                f"GRPO with rank-{rank} LoRA (alpha 32, all 7 projections) at lr {lr:g}",
                overrides={"model.lora.rank": rank, "optim.lr": lr},
            )
            for rank in (1, 8, 32)
            for lr in (5e-5, 1.5e-4, 5e-4)
        ),
    ),
    # Issue 32 item 7, step 2: LoRA against full fine-tuning, 5 seeds, each rank at the rate
    # the sweep picked (final held-out pass@1, seed 0: r1 1.5e-4 0.374, r8 5e-4 0.384, r32
    # 1.5e-4 0.384; full fine-tuning's 1e-5 is the task's tuned rate). The LoRA variants' overrides
    # equal the sweep's, so its seed-0 runs are this study's seed 0.
    Study(
        "lora",
        "LoRA Without Regret (Schulman et al. 2025): for RL, LoRA down to rank 1 learns as well "
        "as full fine-tuning, at about 10x its learning rate",
        (
            Variant("full", "grpo", "GRPO, every parameter trained (lr 1e-5)"),
            *(
                Variant(
                    f"lora_r{rank}_lr{lr:g}",  # the sweep's names: its runs are seed 0
                    "grpo",
                    f"GRPO with rank-{rank} LoRA (alpha 32, all 7 projections) at lr {lr:g}",
                    overrides={"model.lora.rank": rank, "optim.lr": lr},
                )
                for rank, lr in ((1, 1.5e-4), (8, 5e-4), (32, 1.5e-4))
            ),
        ),
    ),
    # Issue 35 item 3: quantized rollouts. GRPO on :headroom with the sampler on bf16
    # weights vs on int8 codes (per-output-channel scales; the learner in its own dtype),
    # 3 seeds each; the int8 variant's TIS correction is on by default (rollout.quantize
    # resolves objective.behaviour_correction 'auto' to tis) and its runs report the
    # behaviour-vs-learner mismatch (mismatch/abs_logp_diff_mean, mismatch/kl_k3) per step.
    # Command (run 2026-12-02, results/quant_rollouts: ~25-35 min a run beside other jobs):
    #   python -m experiments.run quant_rollouts --seeds 3
    #   python -m experiments.aggregate quant_rollouts
    # Expected: int8's held-out pass@1 curve within the seeds' spread of bf16's.
    Study(
        "quant_rollouts",
        "none (issue 35 item 3): GRPO with int8 rollouts learns the embedded task within seed "
        "noise of bf16 rollouts, with the mismatch reported and TIS on",
        (
            Variant(
                "bf16_rollouts",
                "grpo",
                "GRPO, the sampler on the policy's bf16 weights",
                overrides={"model.dtype": "bfloat16"},
            ),
            Variant(
                "int8_rollouts",
                "grpo",
                "GRPO, the sampler on int8 codes of the policy (TIS on by default)",
                overrides={"model.dtype": "bfloat16", "rollout.quantize": "int8"},
            ),
        ),
    ),
    # Issue 33 item 6: RL with a calculator against RL without, on the tool task (configs'
    # `:tools`: chains of 2-6 operations, values to 999) from the same tool-using variant of
    # the embedded policy (scripts/make_tiny_tool_policy.py). `tool`'s rollouts are episodes
    # of the `tool` environment (the sandboxed calculator; held-out pass@k over episodes);
    # `no_tool`'s are single completions of prompts that offer no tools.
    #   python -m experiments.run tool_use --seeds 5
    #   python -m experiments.aggregate tool_use
    Study(
        "tool_use",
        "none (issue 33 item 6): with a calculator, RL learns long chains the policy cannot do "
        "in its head; without one it cannot",
        (
            Variant("tool", "grpo", "GRPO on calculator episodes", arg="tools"),
            Variant(
                "no_tool",
                "grpo",
                "GRPO on single completions, no tools offered",
                arg="tools",
                overrides={"env.name": ""},
            ),
        ),
        # An episode costs ~4x a headroom completion (a call, the tool's turn, the answer)
        # and each arm has its own base: pass@16, not 64, keeps a run under ~25 minutes.
        passk_samples=16,
    ),
    # CI's smoke study (tests/test_experiments.py): two cheap variants.
    Study(
        "smoke",
        "none: the runner's and the aggregation's smoke test",
        (
            Variant("grpo", "grpo", "GRPO", arg="tiny"),
            Variant("dr_grpo", "dr_grpo", "Dr.GRPO", arg="tiny"),
        ),
    ),
)

STUDIES: dict[str, Study] = {s.name: s for s in _STUDIES}


def get(name: str) -> Study:
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; the studies: {', '.join(STUDIES)}")
    return STUDIES[name]


def passk_samples(smoke: bool, study: Study | None = None) -> int:
    """The final and base pass@k's samples per problem: the study's (default 64), or the
    smoke evaluations'."""
    if smoke:
        return SMOKE_PASSK_SAMPLES
    return study.passk_samples if study is not None else PASSK_SAMPLES


def build_config(
    study: Study,
    variant: Variant,
    seed: int,
    *,
    steps: int | None = None,
    eval_every: int | None = None,
    smoke: bool = False,
) -> ml_collections.ConfigDict:
    """The run config of a study's (variant, seed): the preset, the study's overrides then the
    variant's, the seed (of the model's randomness and of the data order; the held-out set
    stays fixed), and the study's logging. `smoke` shrinks the evaluations to seconds (16
    held-out problems, greedy)."""
    c = importlib.import_module(f"configs.{variant.config}").get_config(variant.arg)
    if variant.objective is not None:  # the preset's objective; the task's logging stays
        covariance_metrics = c.objective.covariance_metrics
        c.objective = schema.objective(variant.objective)
        c.objective.covariance_metrics = covariance_metrics
    c.lock()  # an override of a missing field raises instead of adding one
    for path, value in study.overrides.items():
        _set(c, path, value, f"study {study.name!r}")
    for path, value in variant.overrides.items():
        _set(c, path, value, f"variant {variant.name!r}")
    c.seed = seed
    c.data.shuffle_seed = seed
    c.algo = variant.name
    if steps is not None:
        c.train.steps = steps
    c.log.progress = False  # workers log to files
    c.log.tensorboard = False
    # About 8 held-out evaluations a run (none in a smoke run): each samples the held-out set
    # (256 problems x eval.num_samples), so more would cost as much as the training.
    if eval_every is None:
        eval_every = 0 if smoke else max(1, c.train.steps // 8)
    c.log.eval_every = eval_every
    if smoke:  # greedy held-out accuracy of 16 problems before and after, nothing sampled
        c.data.heldout_size = 16
        c.eval.num_samples = 0
        c.checkpoint.async_save = False
    # As validation resolves it, so a run's recorded config.json compares equal (run.plan).
    schema.resolve_behaviour_correction(c)
    return c


def _set(c: ml_collections.ConfigDict, path: str, value, where: str) -> None:
    *parents, leaf = path.split(".")
    node = c
    try:
        for p in parents:
            node = node[p]
        node[leaf] = value
    except (KeyError, AttributeError, TypeError) as e:
        raise ConfigError(
            f"{where}: cannot set config.{path} = {value!r} ({e}); a study may only "
            "set fields the config has (gjax/schema.py)"
        ) from e
