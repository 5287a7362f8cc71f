"""CW-GRPO: GRPO with Gaussian covariance token weights (CW-GRPO Sec. 2.3).

Command (TPU v5e-16 class):
    python -m gjax.train --config=configs/cw_grpo.py --workdir=gs://BUCKET/runs/cw_grpo
Setup (CW-GRPO App. C, Table 5): DeepSeek-R1-Distill-Qwen-1.5B on Open-RS (7k problems),
lr 1e-6 with 10% warmup, 100 steps, G=12 generations, temperature 0.7, prompts up to 512
tokens, completions up to 4096, 16 prompts per step with 4 gradient-accumulation
microbatches, k3 KL beta 0.04. Expected: Table 2's "GRPO + Gaussian Reweight" 1.5B row
(about 55 average over the five math benchmarks).

Embedded default (2-core CPU, a few minutes):
    python -m gjax.train --config=configs/cw_grpo.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "cw_grpo"
    c.objective = common.objective("cw_grpo")
    # Sec. 2.3: covariance statistics and the normaliser N = sum_j |o_j| per group of G;
    # "batch" reads them over the whole update batch instead.
    c.objective.token_weights_kwargs.scope = "group"
    c.model.path = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    # Open-RS (knoveleng/open-rs: problem, solution, answer, level; 7k rows, train split only).
    # Held out: MATH-500, one of the five benchmarks CW-GRPO and Open-RS report.
    c.data.source = "knoveleng/open-rs"
    c.data.problem_field = "problem"
    c.data.answer_field = "answer"
    # Open-RS's prompt (CW-GRPO App. B) through the model's own chat template, as Open-RS
    # applied it: think/answer tags and the answer in \boxed{} (the default extractors).
    c.data.template = "open_rs"
    c.data.heldout_source = "math500"
    c.rollout.prompts_per_step = 16
    c.rollout.num_samples = 12
    c.rollout.temperature = 0.7
    c.rollout.max_new_tokens = 4096
    c.train.microbatches = 4
    c.train.steps = 100
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    if arg:
        c = common.embedded(c, arg)
    return c
