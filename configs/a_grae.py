"""A-GRAE: asymmetric group-relative advantages (DDAS eq. (12) + ASS eq. (13)) on GRPO.

Command (TPU v5p-64 class; the paper used 8 x H200):
    python -m gjax.train --config=configs/a_grae.py --workdir=gs://BUCKET/runs/a_grae
Setup (A-GRAE Sec. 6 / App. C.2): Qwen2.5-Math-7B on MATH, G=8, batch 1024 prompts,
mini-batch 256 (4 updates per rollout), lr 1e-6, alpha=1 (math), temperature 1.0, up to 2048
new tokens, 20 epochs, binary accuracy reward, "\\boxed{}" system prompt. Expected: the
paper's Table 2 A-GRAE row (about +2-4 points pass@1 over GRPO on MATH-500/AMC23).
Ablations are plain overrides: --config.objective.advantage_kwargs.group_level=none (sample
level only), ...sample_level=none (group level only).

Embedded default (about 2 minutes on an idle 2-core CPU; prints held-out accuracy before and
after; the README's table, from scripts/readme_results.py, has each config's time):
    python -m gjax.train --config=configs/a_grae.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "a_grae"
    c.objective = common.objective("a_grae")
    c = common.agrae_math_setup(c)
    if arg:
        c = common.embedded(c, arg)
    return c
