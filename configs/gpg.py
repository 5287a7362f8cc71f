"""GPG (Chu et al.): plain policy gradient -log pi * A, alpha = B/(B-M), beta_th threshold.

Command (TPU v5p-64 class; the paper used 48 NPUs):
    python -m gjax.train --config=configs/gpg.py --workdir=gs://BUCKET/runs/gpg
Setup (GPG App. "Training setting on 7B"): Qwen2.5-Math-7B on the DAPO dataset, 144 prompts
x G=8 per batch, accuracy reward only, AdamW lr 1e-6 constant, weight decay 0.1,
beta_th = 0.6 (valid groups are carried over and accumulated until they make up 60% of a
batch), 1100 steps; no ratio, no clip, no KL, each group's loss over its own token count
(GPG eq. (5): objective.aggregation = "group_token_mean"; "token_mean" is one global count).
Expected: GPG Table 1's 7B row.

Embedded default (2-core CPU, a few minutes):
    python -m gjax.train --config=configs/gpg.py:tiny
"""

from configs import common


def get_config(arg=None):
    arg = common.get_arg(arg)
    c = common.base()
    c.algo = "gpg"
    c.objective = common.objective("gpg")
    c = common.dapo_math_dataset(c, heldout="math500")  # MATH-500: one of GPG Table 1's
    c.rollout.prompts_per_step = 144
    c.rollout.num_samples = 8
    c.rollout.max_new_tokens = 4096
    c.sampling.min_valid_fraction = 0.6
    c.sampling.max_rollouts_per_step = 4
    c.train.steps = 1100
    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.1
    if arg:
        c = common.embedded(c, arg)
    return c
