"""CISPO (MiniMax-M1, arXiv 2506.13585, eqs. (4)-(5)): clip the stop-gradient IS weight.

Command (TPU v5p-128 class):
    python -m gjax.train --config=configs/cispo.py --workdir=gs://BUCKET/runs/cispo
Setup: the DAPO config's (DAPO-Math-17k, 512 prompts x G=16, mini-batch 32 prompts so each
rollout batch feeds 16 off-policy updates, lr 1e-6, up to 20480 new tokens, no KL) with the
CISPO loss in place of DAPO's clipped one: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi,
token-level mean, eps_low = 1 (no lower bound, as MiniMax-M1), eps_high = 0.28 (the paper
tunes it without reporting the value), no dynamic sampling (MiniMax-M1 Sec. 3.1 compares
CISPO with DAPO under the same budget). MiniMax-M1's comparison used Qwen2.5-32B-base;
this config keeps the gjax 7B math model. Expected: MiniMax-M1 Fig. 2's claim, CISPO
matching DAPO's AIME 2024 accuracy in about half the steps.

Embedded default (2-core CPU, a few minutes):
    python -m gjax.train --config=configs/cispo.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "cispo"
    c.objective = common.objective("cispo")
    c = common.dapo_math_dataset(c)
    c.rollout.prompts_per_step = 512
    c.rollout.num_samples = 16
    c.rollout.max_new_tokens = 20480
    c.train.minibatches = 16
    c.train.steps = 400
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    if arg:
        c = common.embedded(c, arg)
    return c
