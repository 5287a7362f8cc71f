"""Host-side rollout groups: assembly into device batches, anchors, and group selection.

A rollout produces `Groups`: per prompt, G completions with their rewards, judge scores and
flags, as numpy arrays with a leading prompt axis `P`. Selection (DAPO dynamic sampling,
GPG's beta_th threshold) works on whole groups on the host; `to_model_inputs` lays a
selection out as the fixed-shape arrays the jitted steps consume, so shapes never change and
nothing recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass
class Groups:
    """Prompt-major rollout groups (numpy). Completion axes are right-padded to N tokens."""

    prompt_ids_PxS: np.ndarray  # int32, left-padded
    prompt_mask_PxS: np.ndarray  # bool
    completion_ids_PxGxN: np.ndarray  # int32, right-padded
    completion_mask_PxGxN: np.ndarray  # bool, 1 up to and including EOS
    truncated_PxG: np.ndarray  # bool: no EOS within N tokens
    is_anchor_PxG: np.ndarray  # bool: off-policy demonstration (DaGRPO anchor)
    rewards_PxG: np.ndarray  # float32
    scores_PxG: np.ndarray  # float32 judge scores in [1, 10], NaN = none
    valid_PxG: np.ndarray  # bool: the sample takes part in the loss
    old_logps_PxGxN: np.ndarray | None = None
    ref_logps_PxGxN: np.ndarray | None = None
    # int32 policy version each completion was sampled with (-1: anchor); None when the
    # backend does not serve versioned weights (the local sampler: always the current params)
    policy_version_PxG: np.ndarray | None = None
    # bool, multi-turn rows (gjax.rollout.turns): 1 on the policy's sampled tokens, 0 on the
    # environment's inserted ones (in the sequence, never a target of the loss); None: every
    # completion token is the policy's (single-turn)
    policy_mask_PxGxN: np.ndarray | None = None

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids_PxS.shape[0]

    def take(self, idx: np.ndarray) -> Groups:
        return Groups(
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx])
                for f in dataclasses.fields(self)
            }
        )

    @staticmethod
    def concat(parts: list[Groups]) -> Groups:
        out = {}
        for f in dataclasses.fields(Groups):
            vals = [getattr(p, f.name) for p in parts]
            out[f.name] = None if any(v is None for v in vals) else np.concatenate(vals)
        return Groups(**out)


def zero_variance_PxG(rewards_PxG: np.ndarray, valid_PxG: np.ndarray) -> np.ndarray:
    """Per group: True when all valid rewards are equal (the group carries no gradient)."""
    big = np.where(valid_PxG, rewards_PxG, np.inf).min(axis=1)
    small = np.where(valid_PxG, rewards_PxG, -np.inf).max(axis=1)
    return ~(small > big)


def select_groups(
    candidates: Groups,
    num_prompts: int,
    *,
    min_valid_fraction: float,
    drop_zero_variance: bool,
    final_round: bool,
    allgather: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[Groups | None, Groups]:
    """Picks `num_prompts` groups for one update, or carries the informative ones over.

    Informative groups (non-zero reward variance) come first. The batch is ready once their
    share reaches `min_valid_fraction` (GPG beta_th; DAPO dynamic sampling is 1.0), or on the
    final allowed round. Slots not filled by informative groups take zero-variance groups,
    which are invalidated when `drop_zero_variance` (DAPO drops them; GPG keeps them in B for
    alpha = B/(B-M), GPG eq. (8)). Returns (batch or None, groups to carry to the next round).

    Multi-host (`allgather`: this process's counts -> every process's, e.g.
    `gjax.multihost.allgather`): each process fills its own `num_prompts` slots from the
    groups it sampled (group data never crosses hosts), and the readiness decision is taken
    on the global share, sum over processes of min(informative, num_prompts) over all slots,
    so every process takes the same branch and runs the same number of rollout rounds.
    With one process this is the single-host rule exactly.
    """
    informative = ~zero_variance_PxG(candidates.rewards_PxG, candidates.valid_PxG)
    good = np.flatnonzero(informative)
    rest = np.flatnonzero(~informative)
    counts = np.asarray([[len(good), candidates.num_prompts]])
    if allgather is not None:
        counts = np.asarray(allgather(counts[0])).reshape(-1, 2)
    share = np.minimum(counts[:, 0], num_prompts).sum() / (num_prompts * len(counts))
    if share < min_valid_fraction and not final_round:
        return None, candidates.take(good)
    if (counts[:, 1] < num_prompts).any():
        return None, candidates.take(good)
    order = np.concatenate([good, rest])[:num_prompts]
    batch = candidates.take(order)
    if drop_zero_variance:
        filler = ~informative[order]
        batch.valid_PxG = batch.valid_PxG & ~filler[:, None]
    return batch, candidates.take(good[num_prompts:])


def append_anchors(
    groups_on: Groups, anchor_ids_PxAxN: np.ndarray, anchor_mask_PxAxN: np.ndarray
) -> Groups:
    """DaGRPO Sec. 5 (eqs. 11-12): off-policy demonstrations join each group as anchors.

    The mixed group is on-policy samples followed by A anchors; rewards and judge scores are
    filled in afterwards for the whole mixed group.
    """
    P, A, _ = anchor_ids_PxAxN.shape

    def cat(on, anchor):
        return np.concatenate([on, anchor], axis=1)

    zeros = np.zeros((P, A), np.float32)
    policy = groups_on.policy_mask_PxGxN
    return dataclasses.replace(
        groups_on,
        policy_mask_PxGxN=None if policy is None else cat(policy, anchor_mask_PxAxN),
        completion_ids_PxGxN=cat(groups_on.completion_ids_PxGxN, anchor_ids_PxAxN),
        completion_mask_PxGxN=cat(groups_on.completion_mask_PxGxN, anchor_mask_PxAxN),
        truncated_PxG=cat(groups_on.truncated_PxG, np.zeros((P, A), bool)),
        is_anchor_PxG=cat(groups_on.is_anchor_PxG, np.ones((P, A), bool)),
        rewards_PxG=cat(groups_on.rewards_PxG, zeros),
        scores_PxG=cat(groups_on.scores_PxG, zeros + np.nan),
        valid_PxG=cat(groups_on.valid_PxG, np.ones((P, A), bool)),
    )


def to_model_inputs(groups: Groups, *, drop_truncated: bool = False) -> dict[str, np.ndarray]:
    """Flattens groups to B = P*G sequences `prompt ++ completion` of length T = S + N.

    hidden[t] predicts token t+1, so the completion's N targets are predicted by positions
    S-1 .. S+N-2; the returned `targets_BxT`/`loss_mask_BxT` (T = N) are aligned with those
    positions. `drop_truncated` (DAPO overlong filtering) empties the loss mask of completions
    that hit the length limit without EOS: they count nowhere, but stay in their group's
    reward statistics. Multi-turn rows (`policy_mask_PxGxN`): the environment's tokens are
    in the sequence (attended, positions counted) and out of the loss mask.
    """
    P, G, N = groups.completion_ids_PxGxN.shape
    prompt_ids = np.repeat(groups.prompt_ids_PxS, G, axis=0)
    prompt_mask = np.repeat(groups.prompt_mask_PxS, G, axis=0)
    comp_ids = groups.completion_ids_PxGxN.reshape(P * G, N)
    comp_mask = groups.completion_mask_PxGxN.reshape(P * G, N)
    tokens = np.concatenate([prompt_ids, comp_ids], axis=1).astype(np.int32)
    mask = np.concatenate([prompt_mask, comp_mask], axis=1)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    # Completion padding after EOS stays in the segment (it is never a target), prompt
    # padding is segment 0 so nothing attends to it.
    segment_ids = np.concatenate([prompt_mask, np.ones_like(comp_mask)], axis=1).astype(np.int32)
    keep_B = groups.valid_PxG.reshape(P * G)
    if drop_truncated:
        keep_B = keep_B & ~groups.truncated_PxG.reshape(P * G)
    loss_mask = comp_mask & keep_B[:, None]
    if groups.policy_mask_PxGxN is not None:
        loss_mask = loss_mask & groups.policy_mask_PxGxN.reshape(P * G, N).astype(bool)
    out = {
        "input_ids_BxS": tokens,
        "positions_BxS": positions,
        "segment_ids_BxS": segment_ids,
        "targets_BxT": comp_ids.astype(np.int32),
        "loss_mask_BxT": loss_mask,
        "rewards_PxG": groups.rewards_PxG.astype(np.float32),
        "valid_PxG": groups.valid_PxG,
        "scores_PxG": groups.scores_PxG.astype(np.float32),
        "is_anchor_PxG": groups.is_anchor_PxG,
    }
    if groups.old_logps_PxGxN is not None:
        out["old_logps_BxT"] = groups.old_logps_PxGxN.reshape(P * G, N).astype(np.float32)
    if groups.ref_logps_PxGxN is not None:
        out["ref_logps_BxT"] = groups.ref_logps_PxGxN.reshape(P * G, N).astype(np.float32)
    return out
