"""One GRPO step, end to end: gjax vs TRL's `GRPOTrainer` (PyTorch CPU) on the same policy.

A step is: sample G completions for each of P prompts -> reward them with the accuracy
verifier -> (old/reference log-probs) -> GRPO loss -> one optimizer update. Both sides run

* the SAME policy: an HF-format tiny Qwen2 dir (the committed `gjax/assets/tiny_qwen2`, or
  `--policy DIR`; without either, one of the same architecture is written untrained to a temp
  dir with `scripts/make_tiny_policy.py`'s `model_config`: speed does not depend on weights);
* the SAME prompts: the embedded synthetic task, templated by gjax's data pipeline
  (`configs/grpo.py:tiny`'s `config.data`), the templated text handed to TRL as `prompt`;
* the SAME lengths and sampling: prompts of at most `max_prompt_len` tokens, exactly
  `max_new_tokens` new tokens per completion (EOS stopping disabled on both sides: gjax's
  sampler gets `stop_token_ids=()`, TRL's `generate` gets `min_new_tokens = max_new_tokens`,
  so every completion is full length and every token is in the loss on both sides), plain
  temperature sampling (T = 1, no top-k/top-p);
* the SAME objective: GRPO (group-std advantages, PPO clip 0.2/0.2, k3 KL with beta 0.04 to
  a frozen reference, per-sequence token mean: TRL `loss_type="grpo"`), one update per
  rollout batch (num_iterations 1), AdamW after global-norm clipping 1.0, float32;
* the SAME reward: gjax's math-verify `Verifier` (one process pool shared by both sides).

gjax's step is built from gjax's own pieces exactly as `gjax/train.py` builds it
(`make_learner` + `Rollout` + `select_groups` + `Learner.batch` + `Learner.update`), with the
step's outputs blocked on. TRL's step is timed with a `TrainerCallback` from
`on_step_begin` (before generation) to `on_step_end` (after the optimizer step).
Compile / warm-up steps are excluded on both sides (`--warmup` each); the medians of
`--repeats` timed steps count. The timed steps alternate (each TRL step is followed by a gjax
step, run from the TRL callback outside TRL's timing), so drifting contention on a shared
machine hits both sides alike; compare the ratio within one run. Process CPU time is reported
too (`*_cpu_s`; the verifier's worker processes are outside it on both sides), and the step
is broken down (gjax: sample / rollout incl. rewards / update incl. ref log-probs; TRL:
generate / reward).

    python benchmarks/train_step.py    # P=16 x G=8, 32 + 48 tokens; ~5 min on a busy 2-core CPU
    python benchmarks/train_step.py --compare-packing --length-dist pareto   # padded vs packed

Measured (embedded policy, idle 2-core CPU, two runs): gjax 1.23-1.31 s/step (sample
0.20-0.30, old+ref log-probs and rewards 0.21-0.26, update 0.76-0.80), TRL 1.08-1.27 s/step
(generate 0.35-0.48): speedup 0.88-0.97. At 0.8M parameters both sides are bound by the same
CPU matmuls; gjax's sampler is faster, its update slower. On a loaded machine TRL slows down
more than gjax (2.9-5.7x seen), so compare runs taken on an idle machine.

At scale, gjax alone (`--policy DIR --skip-trl --dtype bfloat16`): a Qwen2.5-Math-1.5B-shaped
policy (random weights, the character tokenizer) on one H100, P=16 x G=8, 32 + 512 tokens:
5.34 s/step (sample 1.93, old+ref log-probs and rewards 0.85, update 2.56).

FLOPs and MFU (gjax side; formulas in `gjax/flops.py`): each gjax step reports useful FLOPs
(6 x params x real tokens for the update, 2 x per teacher-forced pass -- here the reference's --,
plus causal attention over real tokens; real = prompt + completion tokens that are not padding)
and executed FLOPs (the padded shapes the code runs: B rows of max_prompt_len + max_new_tokens,
the attention implementation's score pairs (`flops.attention_pairs`), remat's recompute,
the fused loss's 3 or 4 head matmuls as its platform schedule runs them), for the learner
part (`update_s`: reference log-probs + update) and for the whole step (the sampler's prefill
and decode added). The summary gives their ratio, split in two: the padding waste
(`*_padding_waste`: executed without remat's recompute over useful, the model FLOPs of the
shapes run) and remat's factor on top (`*_recompute_factor`: hardware over those, HFU / MFU);
useful FLOP/s; MFU = useful FLOP/s / peak and HFU = executed FLOP/s / peak: a per-platform table (`gjax.flops.PEAK_FLOPS`, bf16 dense, times the
device count), on CPU a best-of-5 f32 2048^3 matmul measured in the same run, or
`--peak-flops`. It also compiles the update once more and puts XLA's cost analysis next to the
formula counted as XLA counts (a loop body once: one layer, one microbatch, one loss chunk).
`--length-dist pareto` cuts each completion to a Pareto length (mean <= T / 4) after sampling
(the sampler still runs all T steps), so the learner gets ragged rows; `--shape
qwen2-0.5b|qwen2-1.5b` builds an untrained policy of that Qwen2.5 size.

Measured on this shared 2-core CPU (other work ran beside it; load 1.2-2.3), embedded policy,
P=16 x G=8, 32 + 48 tokens:
* default (full length, with TRL): gjax 1.44 s/step, TRL 15.3 s (the load hit TRL hardest;
  not comparable to the idle figures above). Learner: 55.4 GFLOP useful, 84.6 executed
  (x1.53: prompts average 17 of 32 tokens, the full score matrix, remat, the 4th head matmul);
  whole step 66.2 vs 96.3 (x1.45); 49.2 useful GFLOP/s in the learner, MFU 0.34 (learner) /
  0.32 (step) against 143 GFLOP/s measured for the peak in that run.
* `--skip-trl --length-dist pareto`: completions average 10.8 of 48 tokens; 0.70 s/step;
  learner 23.0 GFLOP useful vs 84.6 executed (x3.67), step x3.74; 46.5 useful GFLOP/s, MFU
  0.10 / 0.08 against 460 GFLOP/s measured in that run.
The same matmul measured 143-460 GFLOP/s across runs, so on a shared CPU compare useful
FLOP/s, not MFU. XLA's count of the compiled update was 1.036x the formula's (the elementwise
ops and the optimizer it also counts).

`--compare-packing` times only the learner part (`Learner.batch`: the reference log-probs;
then the update) on the same rollout batches with padded and packed rows (`gjax.packing`),
alternating, from the same state; the packed bins are [J, S] with J the most any of the
batches needs, one static shape, or J per batch (auto); `--packing-modes` picks the modes. Measured 2026-11-25 on this shared 2-core CPU (load 4-6),
embedded policy, `--compare-packing --length-dist pareto --repeats 5`: P=16 x G=8, 32 + 48
tokens, 3541 real tokens per batch (prompts ~17, completions ~11 of 48 on average), padded
128 rows x 80 vs packed 48 bins x 80: update 0.96 s vs 0.26 s, 272 vs 74 us per real token
(3.7x; 2.3x in a run at load 13-21); reference log-probs 0.20 vs 0.09 s (2.2x). Update
executed / useful FLOPs: padded 3.88, packed 1.47 (remat 'full' included; without its
recompute 3.15 and 1.20: bins 89% full, and the dense [W x W] score matrix). Losses agree
to 2e-8. The first `auto` learner (J per batch rounded up to a quarter of the rows, now
`auto_quarter`) in a later run (load ~3): 52 us per real token vs padded 167 and fixed 41,
executed / useful 1.95 (J = 64 of 128 rows). 2026-11-26, same command, load ~12, four ways
side by side (every shape compiled before timing; the head counted as the CPU kernel runs
it, 3 matmuls): us per real token padded 455, auto_quarter 245, auto (the J ladder, the
default) 152, fixed 155 (3.0x padded); update executed / useful 3.86, 1.94, 1.46, 1.46
(without remat's recompute 3.14, 1.58, 1.19, 1.19); J = 64 quarter vs 48 ladder, one
compile each. What is left of auto's 1.46: remat 'full' +0.27, the dense [W x W] scores
+0.11 (5.6x the causal pairs within rows), empty bin slots +0.08 (1.084 tokens run per real
token); `run_tokens_per_real_token` and `attn_executed_over_useful` in the summary.

2026-11-26, same command, load 5-7 (the process got its cores: CPU time = wall), six ways
side by side, the same 5 timed batches (3541 real tokens median), `update_padding_waste`
(executed without remat / useful) x `update_recompute_factor` (remat 'full': 1.23, HFU /
MFU) = executed / useful:

    mode (attention, auto ladder)         us / real token   padding waste   x remat   J
    padded (xla)                          187               3.14            3.86      -
    packed, fixed J (xla)                  65               1.19            1.46      48
    auto_quarter (xla)                     87               1.58            1.94      64
    auto_coarse (xla, 8 per doubling)      65               1.18            1.45      48
    auto (xla, 16: the default)            66               1.16            1.42      46-48
    auto_blocked (xla_blocked, 16)         60               1.12            1.37      46-48

Update speed per real token over padded: auto 2.86x, auto_blocked 3.13x; auto_blocked over
auto, batch by batch: 0.94x wall, 0.95x CPU time (0.97x and 0.96x in another run; load 9-15
runs were too noisy to read). Losses agree to 3e-8. Compiles of the update: 3 for auto (J
46 and 48 met; the 8-step ladder met only 48). The padding waste target (<= 1.1) is not
reached at this shape: auto_blocked is 1.09-1.13 per batch. What remains (fractions of the
useful update): empty bin slots +0.04-0.07 (first-fit decreasing into W = 80 leaves ~5 % of
each bin empty: most rows are 18-30 tokens, three to a bin; 45-48 bins used where the token
count needs 43-44), attention +0.05 (xla_blocked runs 50 keys per bin token, 80 x 5/8,
against ~15 causal keys within a real token's own row: it still computes the pairs across
the rows sharing a bin; only a segment-aware kernel skips them), the head at [J, C] read
positions +0.01.

2026-11-26, later: rows packed by minimum bin slack (`packing.pack_rows`, now the default;
`*_ffd`: first-fit decreasing alone, the packer before), same command with `--packing-modes
padded,packed,auto_ffd,auto,auto_blocked_ffd,auto_blocked`, load 6-7 (the process got less
than its 2 cores: wall / CPU 1.2 for padded, so CPU time per real token is the steadier
figure); the same 5 timed batches, 3541 real tokens median:

    mode (attention, packer)         us / real token (CPU)   padding waste   x remat   J      bins used
    padded (xla)                     234 (194)               3.14            3.86      -      -
    auto_ffd (xla, FFD: old default)  70 (64)                1.16            1.42      46-48  45-47
    auto (xla, MBS: the default)      66 (62)                1.11            1.37      44-46  43-46
    auto_blocked_ffd (xla_blocked)    66 (62)                1.12            1.37      46-48  45-47
    auto_blocked (xla_blocked, MBS)   70 (61)                1.07            1.31      44-46  43-46

Batch by batch over auto_ffd, CPU time, median of 5 (four runs at load 6-7): auto 0.93-0.97x,
auto_blocked 0.93-0.95x; losses agree to 3e-8. `model.attention='xla_blocked'` meets the
<= 1.1 target (1.05-1.08 per batch); the default (dense) was 1.11 (1.09-1.12): empty bin slots +0.02
(1.018 tokens run per real token; the ladder rounds J up to even: 44 for 43 used), the dense
[W x W] scores +0.08, the head +0.01. The bin length (`--pack-lengths 96,160`): W = 96 gives
1.115 (xla) and 1.069 (xla_blocked) at the same wall time as 80; W = 160 gives 1.17 and 1.10,
1.12-1.15x auto_ffd's wall time with dense attention. Longer bins add cross-row attention
pairs faster than they save empty slots, so W stays S (`train.pack_length=0`).

2026-11-26, once the sampler's prefill ran the forward's implementation (prefill == forward
at 1e-6 under `xla_blocked` too): `--compare-packing --length-dist pareto --skip-trl`
(default modes, 3 timed batches, 3525-3614 real tokens), load 7.7-7.9. Padding waste:
auto_blocked (`xla_blocked`, opt-in) 1.05 (1.047-1.072 per batch), auto (dense `xla`, the
default) 1.09 (1.085-1.11), padded 3.14; us per real token 61 vs 63 (padded 199); auto_blocked
over auto batch by batch 0.86-0.97x wall, 0.94-0.98x CPU time.

Prints one JSON line per measurement; the LAST line is a JSON summary with `gjax_step_s`,
`trl_step_s`, `speedup` (TRL time / gjax time), the FLOP / MFU figures and the settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import common, grpo  # noqa: E402
from gjax import flops, multihost, packing, sharding  # noqa: E402
from gjax.config import validate  # noqa: E402
from gjax.data.builders import build_prompt_data  # noqa: E402
from gjax.data.iterator import PromptIterator  # noqa: E402
from gjax.embedded import resolve_model_path  # noqa: E402
from gjax.experience import select_groups, to_model_inputs  # noqa: E402
from gjax.learner import init_state, make_learner, make_optimizer  # noqa: E402
from gjax.models import attention, hf_export, hf_import  # noqa: E402
from gjax.rewards.pipeline import build_rewards  # noqa: E402
from gjax.rewards.verifier import Verifier  # noqa: E402
from gjax.rollout import LocalSampler  # noqa: E402
from gjax.rollout.collect import Rollout  # noqa: E402

EMBEDDED = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")
SHAPES = flops.QWEN2_SHAPES  # for `--shape` (random weights, the character tokenizer)
# `--compare-packing`'s "auto_coarse": the auto ladder before 2026-11-26 (8 values per doubling;
# 16 from then to 2026-12-01, now `packing.AUTO_STEPS` = 4: fewer compiles).
COARSE_STEPS = 8


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def make_config(args):
    """`configs/grpo.py:tiny` with the benchmark's sizes."""
    c = grpo.get_config("tiny")
    c.rollout.prompts_per_step = args.prompts
    c.rollout.num_samples = args.samples
    c.rollout.max_new_tokens = args.new_tokens
    c.rollout.temperature = args.temperature
    c.model.dtype = args.dtype
    c.data.max_prompt_len = args.prompt_len
    c.data.num_examples = max(args.prompts * (args.warmup + args.repeats) * 2, 256)
    c.optim.warmup_steps = 0
    c.reward.workers = args.reward_workers
    c.log.tensorboard = False
    c.log.progress = False
    c.train.microbatches = args.microbatches
    c.train.packing = "padded"  # the step as measured below; --compare-packing for packed
    return c


def policy_dir(args, tmp: str) -> tuple[str, str]:
    """(HF dir, how it was made)."""
    if args.policy:
        return resolve_model_path(args.policy), "given"
    if args.shape is None and os.path.isdir(EMBEDDED):
        return EMBEDDED, "embedded (gjax/assets/tiny_qwen2)"
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_tiny_policy

    from gjax.data.tokenizer import build_tokenizer
    from gjax.models.transformer import init_params

    tok = build_tokenizer()
    cfg = shape_config(make_tiny_policy.model_config(tok), args.shape)
    made = f"untrained, {args.shape or 'make_tiny_policy.model_config'} shape"
    out = os.path.join(tmp, args.shape or "tiny_qwen2")
    hf_export.save_pretrained(init_params(cfg, jax.random.key(0)), cfg, out, tokenizer=tok)
    return out, made


def shape_config(tiny_cfg, shape: str | None):
    """`make_tiny_policy.model_config` resized to `SHAPES[shape]` (None: unchanged)."""
    if shape is None:
        return tiny_cfg
    return tiny_cfg.replace(**SHAPES[shape], max_position_embeddings=32768)


def pareto_lengths(rng: np.random.Generator, rows: int, max_len: int) -> np.ndarray:
    """Pareto(alpha 2, x_m = max_len / 8) lengths, floored and clipped to [1, max_len].

    Unclipped, the mean is alpha x_m / (alpha - 1) = max_len / 4; flooring and clipping only
    lower it (x_m >= 1 needs max_len >= 8).
    """
    x_m = max_len / 8
    lengths = np.floor(x_m * (1.0 + rng.pareto(2.0, rows))).astype(np.int32)
    return np.clip(lengths, 1, max_len)


class ParetoStop:
    """A `RolloutBackend` around another that stops each completion at a Pareto length.

    A stop rule applied to the sampler's output (gjax's sampler is unchanged and still runs
    all `max_new_tokens` steps): tokens past the row's length become padding, out of the mask
    and the log-probs, as if the row had stopped there, so the learner sees ragged rows.
    """

    def __init__(self, inner, seed: int = 0):
        self.inner = inner
        self.returns_logps = inner.returns_logps
        self.rng = np.random.default_rng(seed)

    def generate(self, params, prompt_tokens_PxS, prompt_mask_PxS, rng, *, num_samples, sampling):
        out = self.inner.generate(
            params,
            prompt_tokens_PxS,
            prompt_mask_PxS,
            rng,
            num_samples=num_samples,
            sampling=sampling,
        )
        mask_BxN = np.asarray(out.mask_BxN)
        b, n = mask_BxN.shape
        keep_BxN = np.arange(n)[None] < pareto_lengths(self.rng, b, n)[:, None]
        mask_BxN = (mask_BxN * keep_BxN).astype(np.int32)
        return out._replace(
            tokens_BxN=np.where(keep_BxN, np.asarray(out.tokens_BxN), sampling.pad_token_id),
            mask_BxN=mask_BxN,
            logps_BxN=np.where(keep_BxN, np.asarray(out.logps_BxN), 0.0).astype(np.float32),
            lengths_B=mask_BxN.sum(-1).astype(np.int32),
        )

    def push(self, params) -> None:
        self.inner.push(params)

    def metrics(self, gather=multihost.allgather) -> dict[str, float]:
        return self.inner.metrics(gather)

    def failure(self) -> str:
        return self.inner.failure()

    def close(self) -> None:
        self.inner.close()


# ------------------------------------------------------------------------------------- gjax


class GjaxStep:
    """The body of `gjax.train.main`'s RL loop for one step (one rollout round)."""

    def __init__(self, config, path: str, verifier: Verifier, data, length_dist: str = "full"):
        mesh_shape = validate(config, jax.device_count())
        self.mesh = sharding.make_mesh(mesh_shape)
        self.obj_cfg = obj_cfg = common.to_objective_config(
            config.objective, rollout_temperature=config.rollout.temperature
        )
        self.train_cfg = config.train
        self.cfg, params = hf_import.load_pretrained(
            path,
            mesh=self.mesh,
            param_dtype=config.model.param_dtype,
            dtype=config.model.dtype,
            remat=config.model.remat,
            attention=config.model.attention,
        )
        self.tok = hf_import.load_tokenizer(path)
        self.ref_params = jax.tree.map(lambda x: x.copy(), params)
        t = config.train
        tx, _ = make_optimizer(config.optim, t.steps, t.minibatches * t.num_iterations)
        self.state, state_shardings = init_state(params, tx, self.mesh)
        self.make_learner = functools.partial(
            make_learner,
            mesh=self.mesh,
            model_cfg=self.cfg,
            obj_cfg=obj_cfg,
            tx=tx,
            state_shardings=state_shardings,
        )
        self.learner = self.make_learner(train_cfg=config.train)
        self.pipeline = build_rewards(config, verifier)
        backend = LocalSampler(self.cfg)
        if length_dist == "pareto":
            backend = ParetoStop(backend, seed=config.seed)
        self.rollout = Rollout(
            model_cfg=self.cfg,
            backend=backend,
            tokenizer=self.tok,
            rewards=self.pipeline,
            transfer=self.learner.transfer,
            config=config,
        )
        # Full-length completions (no EOS stop), as on the TRL side.
        self.rollout.sampling = dataclasses.replace(self.rollout.sampling, stop_token_ids=())
        self.P = config.rollout.prompts_per_step
        # Teacher-forced passes in `Learner.batch`: the reference's, and the policy's own
        # when old log-probs are recomputed (never here: the sampler's are used).
        self.extra_forwards = 1 + int(self.learner.anchors or self.learner.recompute_old)
        # What the model runs: executed attention FLOPs depend on it (flops.attention_pairs).
        self.attention_impl = attention.platform_impl(self.cfg.attention)
        self.last_batch = None
        self.data_iter = PromptIterator(data, global_batch_size=self.P, seed=0, shuffle=True)
        self.base_key = jax.random.key(config.seed)
        self.i = 0

    def __call__(self) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        key = jax.random.fold_in(self.base_key, self.i)
        self.i += 1
        res = self.rollout(self.state.params, next(self.data_iter), key)
        groups, _ = select_groups(
            res.groups, self.P, min_valid_fraction=0.0, drop_zero_variance=False, final_round=True
        )
        t1 = time.perf_counter()
        batch = self.learner.batch(groups, self.state.params, self.ref_params)
        self.state, metrics = self.learner.update(
            self.state, batch, jax.random.fold_in(key, 10_000)
        )
        jax.block_until_ready((self.state, metrics))
        t2 = time.perf_counter()
        self.last_batch = batch
        lengths = groups.completion_mask_PxGxN.sum(-1)
        return {
            **self.flops(groups, batch),
            "step_s": t2 - t0,
            "step_cpu_s": time.process_time() - c0,
            "sample_s": res.metrics["time/sample_s"],
            "rollout_s": res.metrics["time/rollout_s"],
            "update_s": t2 - t1,
            "reward_mean": res.metrics["reward/mean"],
            "completion_tokens": int(lengths.sum()),
            "loss": float(metrics["loss/total"]) if "loss/total" in metrics else None,
        }

    def flops(self, groups, batch, learner=None, attention_impl=None) -> dict:
        """Useful and executed FLOPs of this step's learner part and of the whole step
        (`attention_impl`: what `learner`'s model runs, if not this step's)."""
        learner = learner or self.learner
        shapes = flops.learner_step_shapes(
            self.train_cfg, self.obj_cfg, learner, groups, batch,
            extra_forwards=self.extra_forwards,
        )  # fmt: skip
        shapes["attention_impl"] = attention_impl or self.attention_impl
        p, g, n = groups.completion_mask_PxGxN.shape
        prompt_P = groups.prompt_mask_PxS.sum(-1)
        completion_B = groups.completion_mask_PxGxN.reshape(p * g, n).sum(-1)
        learner = flops.learner_flops(self.cfg, **shapes)
        # No stop tokens: the sampler's decode loop runs all max_new_tokens steps.
        assert self.rollout.sampling.stop_token_ids == ()
        steps = self.rollout.sampling.max_new_tokens
        sampler = flops.sampler_flops(
            self.cfg,
            prompt_lengths_P=prompt_P,
            completion_lengths_B=completion_B,
            padded_prompt_len_S=groups.prompt_ids_PxS.shape[1],
            decode_steps_N=steps,
            cache_len_N=steps,
        )
        return {
            "real_tokens": learner["real_tokens"],
            "padded_tokens": learner["padded_tokens"],
            "attn_pairs_useful": learner["attn_pairs_useful"],
            "attn_pairs_executed": learner["attn_pairs_executed"],
            "learner_useful_flops": learner["useful"],
            "learner_executed_flops": learner["executed"],
            "update_useful_flops": learner["update_useful"],
            "update_executed_flops": learner["update_executed"],
            # Remat's recompute: hardware FLOPs (HFU counts them), not model FLOPs (MFU).
            "update_recompute_flops": learner["update_recompute"],
            "step_useful_flops": learner["useful"] + sampler["useful"],
            "step_executed_flops": learner["executed"] + sampler["executed"],
        }

    def xla_update_check(self) -> dict:
        """XLA's FLOP count of the compiled update next to the formula's, for the last batch.

        XLA's cost analysis counts a while-loop body once, so the formula is taken as it does
        (`flops.update_flops_as_xla_counts`); XLA also counts elementwise ops, which the
        formula leaves out.
        """
        batch = self.last_batch
        try:
            compiled = self.learner.update.lower(self.state, batch, self.base_key).compile()
            analysis = compiled.cost_analysis()
            if isinstance(analysis, list):  # older jax: one dict per computation
                analysis = analysis[0]
            xla = float(analysis["flops"])
        except Exception as e:  # noqa: BLE001 (a backend without cost analysis)
            return {"xla_update_flops": None, "xla_update_note": f"unavailable: {e!r}"[:200]}
        b, t = batch["targets_BxT"].shape
        formula = flops.update_flops_as_xla_counts(
            self.cfg,
            rows=b,
            padded_len_S=batch["input_ids_BxS"].shape[1],
            padded_completion_len_T=t,
            update_pieces=self.train_cfg.minibatches * self.train_cfg.microbatches,
            update_token_chunk=self.obj_cfg.token_chunk,
            head_kernel=self.obj_cfg.lm_head_kernel,
            platform=jax.default_backend(),
        )
        return {
            "xla_update_flops": xla,
            "update_executed_flops_as_xla_counts": formula,
            "xla_over_formula": xla / formula,
            "xla_update_note": "XLA counts a loop body once: one layer, piece and token chunk",
        }

    def close(self):
        self.pipeline.close()


# -------------------------------------------------------------------------------------- TRL


def compare_packing(args, config, path: str, verifier: Verifier, data) -> None:
    """`--compare-packing`: the learner part (`Learner.batch`: reference log-probs; then the
    update) on the same rollout batches, padded and packed, alternating (the order flips each
    batch), from the same state. Bins: W = the padded row length S (`--pack-lengths`: auto and
    auto_blocked at other W too); "packed": J per minibatch the most that any of the batches
    needs (`packing.pack_rows`, rounded up to a multiple of microbatches), one static shape;
    "auto" (`train.pack_bins=0`, the default): J per batch on `packing.auto_bins`' ladder,
    dense `xla` attention (CPU's default); "auto_blocked": the same with `xla_blocked`;
    "auto_quarter": the first auto (J rounded up to a quarter of the rows); "*_ffd": packed by
    first-fit decreasing alone (the packer before minimum bin slack). Every batch runs once
    untimed in every mode first, so each shape's compile is outside the timings (the compiles
    are counted)."""
    config.train.packing = "padded"
    step = GjaxStep(config, path, verifier, data, length_dist=args.length_dist)
    t = config.train
    batches = []
    for i in range(args.warmup + args.repeats):
        res = step.rollout(
            step.state.params, next(step.data_iter), jax.random.fold_in(step.base_key, i)
        )
        groups, _ = select_groups(
            res.groups, step.P, min_valid_fraction=0.0, drop_zero_variance=False, final_round=True
        )
        batches.append(groups)
    need, s = 0, 0
    for groups in batches:
        host = to_model_inputs(groups)
        spans_Bx2 = packing.row_spans(host["segment_ids_BxS"], host["loss_mask_BxT"])
        s = host["input_ids_BxS"].shape[1]
        for m in range(t.minibatches):
            rows = spans_Bx2[m :: t.minibatches, 1]
            need = max(need, packing.pack_rows(rows, len(rows), s)[2])
    bins = -(-need // t.microbatches) * t.microbatches
    packed_cfg = config.train.copy_and_resolve_references()
    packed_cfg.packing, packed_cfg.pack_bins, packed_cfg.pack_length = "packed", bins, s
    auto_cfg = config.train.copy_and_resolve_references()  # the default: bins chosen per batch
    auto_cfg.packing, auto_cfg.pack_bins, auto_cfg.pack_length = "packed", 0, 0
    # Each mode: (train config, attention, auto rounding, ladder steps, packer); the
    # attention is named, so a mode means the same whatever `model.attention='auto'` picks.
    ladder = ("ladder", packing.AUTO_STEPS)
    modes = {
        "padded": (config.train, "xla", None, None, None),
        "packed": (packed_cfg, "xla", None, None, None),
        "auto_quarter": (auto_cfg, "xla", "quarter", None, "mbs"),
        "auto_coarse": (auto_cfg, "xla", "ladder", COARSE_STEPS, "mbs"),
        "auto": (auto_cfg, "xla", *ladder, "mbs"),  # the default on CPU
        # The same with the causal-blocked XLA attention (`model.attention='xla_blocked'`).
        "auto_blocked": (auto_cfg, "xla_blocked", *ladder, "mbs"),
        # Both with the packer before 2026-11-26 (first-fit decreasing alone).
        "auto_ffd": (auto_cfg, "xla", *ladder, "ffd"),
        "auto_blocked_ffd": (auto_cfg, "xla_blocked", *ladder, "ffd"),
    }
    for width in args.pack_lengths:  # auto and auto_blocked at other bin lengths W
        w_cfg = auto_cfg.copy_and_resolve_references()
        w_cfg.pack_length = width
        modes[f"auto_w{width}"] = (w_cfg, "xla", *ladder, "mbs")
        modes[f"auto_blocked_w{width}"] = (w_cfg, "xla_blocked", *ladder, "mbs")
        args.packing_modes += [f"auto_w{width}", f"auto_blocked_w{width}"]
    unknown = set(args.packing_modes) - set(modes)
    if unknown or "padded" not in args.packing_modes:
        raise SystemExit(f"--packing-modes: padded and any of {list(modes)}, got {unknown}")
    learners, impls = {}, {}
    for mode in (m for m in modes if m in args.packing_modes):  # each its own jit
        train_cfg, impls[mode], rounding, steps, packer = modes[mode]
        learner = step.make_learner(
            train_cfg=train_cfg, model_cfg=step.cfg.replace(attention=impls[mode])
        )
        if rounding is not None:
            pack = dataclasses.replace(learner.pack, rounding=rounding, steps=steps, packer=packer)
            learner = dataclasses.replace(learner, pack=pack)
        learners[mode] = learner
    for groups in batches:  # compile every shape first (untimed)
        for learner in learners.values():
            state = jax.tree.map(lambda x: x.copy(), step.state)
            batch = learner.batch(groups, state.params, step.ref_params)
            jax.block_until_ready(learner.update(state, batch, jax.random.key(0)))
    recs = {mode: [] for mode in learners}
    n = len(learners)
    for i, groups in enumerate(batches):
        order = list(learners)[i % n :] + list(learners)[: i % n]  # rotated: none always first
        for mode in order:
            learner = learners[mode]
            state = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), step.state))
            t0 = time.perf_counter()
            batch = jax.block_until_ready(learner.batch(groups, state.params, step.ref_params))
            t1, c1 = time.perf_counter(), time.process_time()
            new_state, metrics = learner.update(state, batch, jax.random.key(i))
            jax.block_until_ready((new_state, metrics))
            t2, c2 = time.perf_counter(), time.process_time()
            rec = {
                **step.flops(groups, batch, learner, impls[mode]),
                "bins_J": int(batch["pack_bins_J"].shape[0]) if "pack_bins_J" in batch else None,
                # The most bins a minibatch's rows took (before auto J's rounding).
                "bins_used": int(batch["pack_metrics"][0]) if "pack_metrics" in batch else None,
                "logps_s": t1 - t0,
                "update_s": t2 - t1,
                "update_cpu_s": c2 - c1,  # this process's CPU time: less load-sensitive
                "loss": float(metrics["loss/total"]),
                "grad_norm": float(metrics["optim/grad_norm"]),
            }
            emit({"what": "packing_step", "mode": mode, "timed": i >= args.warmup, **rec})
            if i >= args.warmup:
                recs[mode].append(rec)
    med = lambda mode, k: statistics.median(r[k] for r in recs[mode])  # noqa: E731
    summary = {}
    for mode in learners:
        real = med(mode, "real_tokens")
        summary[mode] = {
            "update_s": med(mode, "update_s"),
            "logps_s": med(mode, "logps_s"),
            "update_us_per_real_token": 1e6
            * statistics.median(r["update_s"] / r["real_tokens"] for r in recs[mode]),
            "update_cpu_us_per_real_token": 1e6
            * statistics.median(r["update_cpu_s"] / r["real_tokens"] for r in recs[mode]),
            "update_executed_over_useful": statistics.median(
                r["update_executed_flops"] / r["update_useful_flops"] for r in recs[mode]
            ),
            # The padding and layout waste alone (model FLOPs at the shapes run, MFU's
            # view), and remat's factor on top (hardware FLOPs over those: HFU / MFU).
            "update_padding_waste": statistics.median(
                (r["update_executed_flops"] - r["update_recompute_flops"])
                / r["update_useful_flops"]
                for r in recs[mode]
            ),
            "update_recompute_factor": statistics.median(
                r["update_executed_flops"]
                / (r["update_executed_flops"] - r["update_recompute_flops"])
                for r in recs[mode]
            ),
            "learner_executed_over_useful": statistics.median(
                r["learner_executed_flops"] / r["learner_useful_flops"] for r in recs[mode]
            ),
            "real_tokens": real,
            # Where executed exceeds useful: tokens run per real token (padding or empty bin
            # slots), attention pairs computed per causal pair over real tokens.
            "run_tokens_per_real_token": statistics.median(
                r["padded_tokens"] / r["real_tokens"] for r in recs[mode]
            ),
            "attn_executed_over_useful": statistics.median(
                r["attn_pairs_executed"] / r["attn_pairs_useful"] for r in recs[mode]
            ),
            "bins_J": sorted({r["bins_J"] for r in recs[mode] if r["bins_J"] is not None}),
            "bins_used": [r["bins_used"] for r in recs[mode]],
            "pack_length_W": (learners[mode].pack.length or s) if learners[mode].pack else None,
            "packer": learners[mode].pack.packer if learners[mode].pack else None,
        }
    pad = summary["padded"]
    emit(
        {
            "what": "packing_summary",
            **{f"{mode}_{k}": v for mode, d in summary.items() for k, v in d.items()},
            **{
                f"{mode}_update_speedup_per_real_token": (
                    pad["update_us_per_real_token"] / d["update_us_per_real_token"]
                )
                for mode, d in summary.items()
            },
            **{
                f"{mode}_logps_speedup": pad["logps_s"] / d["logps_s"]
                for mode, d in summary.items()
            },
            **{f"{mode}_update_compiles": x.update._cache_size() for mode, x in learners.items()},
            "attention": impls,
            "ladder_steps": dict(auto_coarse=COARSE_STEPS, default=packing.AUTO_STEPS),
            "default": dict(
                attention=attention.platform_impl("auto"), ladder_steps=packing.AUTO_STEPS
            ),
            "remat": step.cfg.remat,
            "load_avg_1min": os.getloadavg()[0],
            "max_loss_diff": max(
                abs(a["loss"] - b["loss"])
                for other in learners
                for a, b in zip(recs["padded"], recs[other])
            ),
            "packed_shape": f"{t.minibatches} minibatches x {bins} bins x {s} tokens",
            "modes": list(learners),
            "padded_shape": f"{step.P * config.rollout.num_samples} rows x {s} tokens",
            "batches_timed": args.repeats,
            "P": args.prompts,
            "G": args.samples,
            "max_prompt_len": args.prompt_len,
            "max_new_tokens": args.new_tokens,
            "length_dist": args.length_dist,
            "train": {k: t[k] for k in ("minibatches", "microbatches", "num_iterations")},
        }
    )
    step.close()


def run_trl(args, config, path: str, verifier: Verifier, data, between=None) -> list[dict]:
    """TRL's timed steps; `between(i)` runs after step i (outside its timing)."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = args.prompts * (args.trl_warmup + args.repeats)
    dataset = datasets.Dataset.from_dict(
        {"prompt": list(data.prompts[:n]), "answer": list(data.answers[:n])}
    )

    parts = {"generate_s": 0.0, "reward_s": 0.0}  # TRL's step broken down, reset per step

    def accuracy(completions, answer, **kwargs):
        t0 = time.perf_counter()
        out = verifier.score(completions, answer).tolist()
        parts["reward_s"] += time.perf_counter() - t0
        return out

    o = config.objective
    beta = float(o.kl_beta)
    steps = args.trl_warmup + args.repeats
    with tempfile.TemporaryDirectory() as out:
        trl_args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts * args.samples,  # completions, = P*G
            gradient_accumulation_steps=1,
            num_generations=args.samples,
            max_completion_length=args.new_tokens,
            generation_kwargs={"min_new_tokens": args.new_tokens},  # no EOS: full length
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            beta=beta,
            epsilon=float(o.eps_low),
            epsilon_high=float(o.eps_high),
            loss_type="grpo",  # per-sequence token mean = gjax seq_mean_token_mean
            scale_rewards="group",
            num_iterations=1,
            learning_rate=float(config.optim.lr),
            adam_beta1=float(config.optim.b1),
            adam_beta2=float(config.optim.b2),
            weight_decay=float(config.optim.weight_decay),
            max_grad_norm=float(config.optim.clip_norm),
            lr_scheduler_type="constant",
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            bf16=False,
            fp16=False,
            use_cpu=True,
            use_vllm=False,
            gradient_checkpointing=False,
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
            log_completions=False,
        )
        times: list[dict] = []

        class Timer(transformers.TrainerCallback):
            """Wall and process-CPU time from before generation to after the optimizer step."""

            def on_step_begin(self, a, state, control, **kw):
                parts.update(generate_s=0.0, reward_s=0.0)
                self.t0, self.c0 = time.perf_counter(), time.process_time()

            def on_step_end(self, a, state, control, **kw):
                times.append(
                    {
                        "step_s": time.perf_counter() - self.t0,
                        "step_cpu_s": time.process_time() - self.c0,
                        **parts,
                    }
                )
                if between is not None:
                    between(len(times) - 1)

            def on_log(self, a, state, control, logs=None, **kw):
                if logs and "reward" in logs and times:
                    times[-1]["reward_mean"] = logs.get("reward")
                    times[-1]["completion_len"] = logs.get("completions/mean_length")
                    times[-1]["loss"] = logs.get("loss")

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=accuracy,
            args=trl_args,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[Timer()],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # keep stdout JSON-only
        generate = trainer._generate_single_turn  # TRL 1.16's local generation path

        def timed_generate(*a, **kw):
            t0 = time.perf_counter()
            out = generate(*a, **kw)
            parts["generate_s"] += time.perf_counter() - t0
            return out

        trainer._generate_single_turn = timed_generate
        trainer.train()
    return times


# -------------------------------------------------------------------------------------- MFU


def peak_flops(given: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s of all devices, where it came from)."""
    if given:
        return given, "--peak-flops"
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return flops.measured_matmul_flops(), (
            "measured in this run: best of 5 f32 2048^3 matmuls (jit, all cores of this CPU)"
        )
    found = flops.table_peak_flops(dev.device_kind)
    if found is None:
        return None, f"unknown device kind {dev.device_kind!r}: pass --peak-flops"
    peak, name = found
    return peak * jax.device_count(), f"table: {name} x {jax.device_count()} device(s)"


# ------------------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default=None, help="HF policy dir (default: embedded or untrained)")
    ap.add_argument("--prompts", type=int, default=16, help="P prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=32, help="max_prompt_len S")
    ap.add_argument("--new-tokens", type=int, default=48, help="max_new_tokens T")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", help="gjax compute dtype (TRL runs float32)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed gjax steps (compile)")
    ap.add_argument("--trl-warmup", type=int, default=1, help="untimed TRL steps")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per engine")
    ap.add_argument("--reward-workers", type=int, default=1)
    ap.add_argument("--skip-trl", action="store_true", help="only time gjax")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="untrained Qwen2.5-sized policy"
    )
    ap.add_argument(
        "--length-dist",
        choices=("full", "pareto"),
        default="full",
        help="completion lengths: all max_new_tokens, or Pareto with mean <= max_new_tokens / 4",
    )
    ap.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU")
    ap.add_argument(
        "--compare-packing",
        action="store_true",
        help="only the learner part, padded vs packed rows on the same batches (no TRL)",
    )
    ap.add_argument("--microbatches", type=int, default=1, help="config.train.microbatches")
    ap.add_argument(
        "--packing-modes",
        type=lambda x: x.split(","),
        default="padded,packed,auto_quarter,auto_coarse,auto,auto_blocked,auto_ffd",
        help="--compare-packing's modes, comma-separated (padded always)",
    )
    ap.add_argument(
        "--pack-lengths",
        type=lambda x: [int(w) for w in x.split(",") if w],
        default=[],
        help="--compare-packing: also auto and auto_blocked at these bin lengths W (modes "
        "auto_wW, auto_blocked_wW; the others run W = S)",
    )
    args = ap.parse_args()
    if args.shape and args.policy:
        ap.error("--shape builds its own policy: give --shape or --policy, not both")
    if args.length_dist == "pareto" and args.new_tokens < 8:
        ap.error(f"--length-dist pareto needs --new-tokens >= 8, got {args.new_tokens}")

    config = make_config(args)
    if args.compare_packing:
        with (
            tempfile.TemporaryDirectory() as tmp,
            Verifier(timeout_s=config.reward.timeout_s, num_workers=1) as verifier,
        ):
            path, _ = policy_dir(args, tmp)
            data = build_prompt_data(config.data, hf_import.load_tokenizer(path))
            compare_packing(args, config, path, verifier, data)
        return
    import torch

    with (
        tempfile.TemporaryDirectory() as tmp,
        Verifier(timeout_s=config.reward.timeout_s, num_workers=config.reward.workers) as verifier,
    ):
        path, made = policy_dir(args, tmp)
        t0 = time.perf_counter()
        data = build_prompt_data(config.data, hf_import.load_tokenizer(path))
        gjax_step = GjaxStep(config, path, verifier, data, length_dist=args.length_dist)
        settings = {
            "policy": made,
            "params": int(sum(x.size for x in jax.tree.leaves(gjax_step.state.params))),
            "P": args.prompts,
            "G": args.samples,
            "B": args.prompts * args.samples,
            "max_prompt_len": args.prompt_len,
            "max_new_tokens": args.new_tokens,
            "eos_stop": False,
            "length_dist": args.length_dist,
            "temperature": args.temperature,
            "objective": "grpo (ppo_clip 0.2, k3 KL beta 0.04, seq_mean_token_mean)",
            "prompt_tokens_mean": float(np.mean([len(x) for x in data.prompt_ids])),
            "jax_devices": jax.device_count(),
            "torch_threads": torch.get_num_threads(),
        }
        emit({"what": "setup", **settings, "gjax_setup_s": time.perf_counter() - t0})

        def gjax_round(n_warm, n_timed, phase):
            out = []
            for i in range(n_warm + n_timed):
                rec = gjax_step()
                timed = i >= n_warm
                emit({"what": "gjax_step", "phase": phase, "timed": timed, **rec})
                if timed:
                    out.append(rec)
            return out

        # Warm-up (compiles) first; then each timed TRL step is followed by a timed gjax step,
        # so both engines see the same (drifting) load of a shared machine.
        gjax_round(args.warmup, 0, "warmup")
        gjax_times, trl_times = [], []

        def interleaved_gjax_step(trl_index):
            if trl_index >= args.trl_warmup:
                gjax_times.extend(gjax_round(0, 1, "interleaved"))

        if args.skip_trl:
            gjax_times = gjax_round(0, args.repeats, "alone")
        else:
            recs = run_trl(args, config, path, verifier, data, between=interleaved_gjax_step)
            for i, rec in enumerate(recs):
                timed = i >= args.trl_warmup
                emit({"what": "trl_step", "timed": timed, **rec})
                if timed:
                    trl_times.append(rec)
        compiles = {
            "update": gjax_step.learner.update._cache_size(),
            "logps": gjax_step.learner.logps._cache_size(),
        }
        xla_check = gjax_step.xla_update_check()
        gjax_step.close()
    peak, peak_source = peak_flops(args.peak_flops)

    med = lambda recs, k: statistics.median(r[k] for r in recs) if recs else None

    def rate(flops_key, time_key):  # median over the timed steps of useful FLOP/s
        if not gjax_times:
            return None
        return statistics.median(r[flops_key] / r[time_key] for r in gjax_times)

    def mfu(flops_key, time_key):
        return rate(flops_key, time_key) / peak if (gjax_times and peak) else None

    mean = lambda k: float(np.mean([r[k] for r in gjax_times])) if gjax_times else None
    mfu_fields = {
        "gjax_completion_len_mean": (
            mean("completion_tokens") / (args.prompts * args.samples) if gjax_times else None
        ),
        "gjax_real_tokens": mean("real_tokens"),
        "gjax_padded_tokens": mean("padded_tokens"),
        "learner_useful_flops": mean("learner_useful_flops"),
        "learner_executed_flops": mean("learner_executed_flops"),
        "learner_executed_over_useful": (
            mean("learner_executed_flops") / mean("learner_useful_flops") if gjax_times else None
        ),
        # Split: the padding waste (executed without remat's recompute over useful) and
        # remat's factor on top (hardware over model FLOPs at the shapes run: HFU / MFU).
        "learner_padding_waste": (
            (mean("learner_executed_flops") - mean("update_recompute_flops"))
            / mean("learner_useful_flops")
            if gjax_times
            else None
        ),
        "learner_recompute_factor": (
            mean("learner_executed_flops")
            / (mean("learner_executed_flops") - mean("update_recompute_flops"))
            if gjax_times
            else None
        ),
        "learner_useful_flops_per_s": rate("learner_useful_flops", "update_s"),
        "learner_mfu": mfu("learner_useful_flops", "update_s"),
        # Hardware FLOPs utilisation: every FLOP run (padding and recompute included).
        "learner_hfu": mfu("learner_executed_flops", "update_s"),
        "step_useful_flops": mean("step_useful_flops"),
        "step_executed_flops": mean("step_executed_flops"),
        "step_executed_over_useful": (
            mean("step_executed_flops") / mean("step_useful_flops") if gjax_times else None
        ),
        "step_useful_flops_per_s": rate("step_useful_flops", "step_s"),
        "step_mfu": mfu("step_useful_flops", "step_s"),
        **xla_check,
        "peak_flops": peak,
        "peak_source": peak_source,
    }
    g = med(gjax_times, "step_s")
    t = med(trl_times, "step_s")
    emit(
        {
            "what": "summary",
            "gjax_step_s": g,
            "trl_step_s": t,
            "speedup": (t / g) if (t and g) else None,
            # Each TRL step over the gjax step run right after it (same load), median.
            "speedup_pairwise": (
                statistics.median(a["step_s"] / b["step_s"] for a, b in zip(trl_times, gjax_times))
                if (trl_times and len(trl_times) == len(gjax_times))
                else None
            ),
            "gjax_step_cpu_s": med(gjax_times, "step_cpu_s"),
            "trl_step_cpu_s": med(trl_times, "step_cpu_s"),
            "speedup_cpu": (
                med(trl_times, "step_cpu_s") / med(gjax_times, "step_cpu_s")
                if (trl_times and gjax_times)
                else None
            ),
            "gjax_sample_s": med(gjax_times, "sample_s"),
            "gjax_rollout_s": med(gjax_times, "rollout_s"),
            "gjax_update_s": med(gjax_times, "update_s"),
            "trl_generate_s": med(trl_times, "generate_s"),
            "trl_reward_s": med(trl_times, "reward_s"),
            "gjax_update_compiles": compiles["update"],
            "gjax_logps_compiles": compiles["logps"],
            "gjax_steps_timed": len(gjax_times),
            **mfu_fields,
            "trl_steps_timed": len(trl_times),
            **settings,
        }
    )


if __name__ == "__main__":
    main()
