"""DAPO (Yu et al. 2025): clip-higher, token-mean loss, dynamic sampling, overlong shaping.

Command (TPU v5p-128 class):
    python -m gjax.train --config=configs/dapo.py --workdir=gs://BUCKET/runs/dapo
Setup (DAPO paper, on the 7B math model of the gjax targets): DAPO-Math-17k, eps_low 0.2,
eps_high 0.28, 512 prompts x G=16 per rollout batch, mini-batch 32 prompts (16 updates),
lr 1e-6 with 10 warmup steps, up to 20480 new tokens with a 4096-token soft overlong buffer,
dynamic sampling (resample until every group has non-zero reward variance), no KL.
Expected: AIME-style accuracy rising steadily without entropy collapse (DAPO Fig. 2).

Embedded default (2-core CPU, a few minutes):
    python -m gjax.train --config=configs/dapo.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "dapo"
    c.objective = common.objective("dapo")
    c = common.dapo_math_dataset(c)
    c.rollout.prompts_per_step = 512
    c.rollout.num_samples = 16
    c.rollout.max_new_tokens = 20480
    c.sampling.dynamic = True
    c.sampling.max_rollouts_per_step = 3
    c.sampling.overlong_filter = False
    c.sampling.overlong_buffer = 4096
    c.sampling.overlong_penalty = 1.0
    c.train.minibatches = 16
    c.train.steps = 400
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    if arg:
        c = common.embedded(c, arg)
        c.sampling.overlong_buffer = 8
    return c
