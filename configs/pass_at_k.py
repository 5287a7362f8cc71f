"""Pass@k training (Chen et al. 2025, arXiv 2508.10751): the analytic pass@k group advantage.

Command (TPU v5p-64 class):
    python -m gjax.train --config=configs/pass_at_k.py --workdir=gs://BUCKET/runs/pass_at_k
Setup: the GRPO baseline's (A-GRAE Sec. 6: Qwen2.5-Math-7B on MATH, 1024 prompts x G=8,
mini-batch 256, lr 1e-6, PPO clip 0.2, k3 KL beta 0.04) with only the advantage changed: each
sample's advantage is the mean normalised pass@k reward of the k-subgroups that contain it
(gjax.objective.advantages.pass_at_k), k = 4. Expected (Chen et al.'s claim): pass@k at
large k above GRPO's, without losing pass@1; --config.objective.advantage_kwargs.k=1 is GRPO.

Embedded default (2-core CPU, a few minutes):
    python -m gjax.train --config=configs/pass_at_k.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "pass_at_k"
    c.objective = common.objective("pass_at_k")
    c = common.agrae_math_setup(c)
    if arg:
        c = common.embedded(c, arg)
    return c
