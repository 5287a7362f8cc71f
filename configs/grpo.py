"""GRPO (DeepSeekMath) baseline, in A-GRAE's experimental setup.

Command (TPU v5p-64 / v4-64 class, ~1 day for 20 epochs of MATH):
    python -m gjax.train --config=configs/grpo.py --workdir=gs://BUCKET/runs/grpo
Setup (A-GRAE Sec. 6 / App. C.2, its GRPO baseline): Qwen2.5-Math-7B on MATH train (7.5k),
system prompt "Please reason step by step, and put your final answer within \\boxed{}.",
1024 prompts x G=8 per rollout batch, mini-batch 256 prompts (4 updates), lr 1e-6,
temperature 1.0, up to 2048 new tokens, 20 epochs (~146 steps), binary accuracy reward,
PPO clip 0.2, k3 KL beta 0.04 to the initial policy. Expected: MATH-500 pass@1 in the high
70s, the paper's GRPO row of Table 2.

Embedded default (about 2 minutes on an idle 2-core CPU; prints held-out accuracy before and
after; the README's table, from scripts/readme_results.py, has each config's time):
    python -m gjax.train --config=configs/grpo.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "grpo"
    c.objective = common.objective("grpo")
    c = common.agrae_math_setup(c)
    if arg:
        c = common.embedded(c, arg)
    return c
