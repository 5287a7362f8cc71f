"""Dr.GRPO (Liu et al. 2025): no std normalization, token sums over a constant, no KL.

Command (TPU v5p-64 class):
    python -m gjax.train --config=configs/dr_grpo.py --workdir=gs://BUCKET/runs/dr_grpo
Setup (the "Dr.GRPO setting" DaGRPO Sec. 6 trains its baselines in): Qwen2.5-Math-7B on
OpenR1-Math-46k-8192, G=8, 128 prompts per rollout batch, update batch 64 prompts (2 updates),
lr 1e-6, temperature 1.0, up to 8192 new tokens, 500 steps, binary reward, no KL.
Expected: DaGRPO's GRPO-family baseline rows (Table 1).

Embedded default (2-core CPU, a few minutes):
    python -m gjax.train --config=configs/dr_grpo.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "dr_grpo"
    c.objective = common.objective("dr_grpo")
    c = common.openr1_dataset(c)
    c.rollout.prompts_per_step = 128
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 8192
    c.train.minibatches = 2
    c.train.steps = 500
    c.optim.lr = 1e-6
    if arg:
        c = common.embedded(c, arg)
    return c
