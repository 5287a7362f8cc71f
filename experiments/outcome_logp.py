"""Which samples does a policy find likely: its correct ones or its wrong ones?

    python -m experiments.outcome_logp [--study a_grae_variants] [--variant grpo] [--prompts 128]
        [--workdir RUN]

Samples G completions for the first training prompts of a study's config (its rollout
temperature, G and max_new_tokens; the base params, or a run's last checkpoint with
--workdir: its params, or with LoRA the base plus its adapters) and prints JSON: the mean
token log-prob and length of correct and of wrong samples, and the token-level covariance
of log-prob and the GRPO advantage within groups with both outcomes, split by the
advantage's sign. By Cui et al. (2025, eq. (3); CW-GRPO Sec. 2) a
policy-gradient step changes entropy by about -lr x Cov(log pi, A): tokens that are unlikely
and rewarded (negative covariance) raise it. Used by results/a_grae_variants/README.md.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from experiments import studies
from experiments.passk import restore_policy
from gjax import config_record, sharding
from gjax.config import resolve_mesh_shape
from gjax.data import builders as data_builders
from gjax.data.prompts import left_pad
from gjax.embedded import resolve_model_path
from gjax.errors import UserError, run_cli
from gjax.models import hf_import
from gjax.rewards.verifier import Verifier
from gjax.rollout import LocalSampler
from gjax.rollout.backend import rollout_sampling


def outcome_stats(logps_BxN, lengths_B, correct_B, *, group: int) -> dict:
    """The figures from sampled rows (prompt-major: G rows per prompt): per-token log-probs
    (entries past a row's length ignored), lengths and 0/1 correctness."""
    mask = np.arange(logps_BxN.shape[1])[None] < lengths_B[:, None]
    mean_logp = (logps_BxN * mask).sum(1) / np.maximum(lengths_B, 1)
    ok = correct_B > 0.5
    out = {
        "samples": int(len(correct_B)),
        "accuracy": float(ok.mean()),
        "token_logp_correct": float(mean_logp[ok].mean()) if ok.any() else None,
        "token_logp_wrong": float(mean_logp[~ok].mean()) if (~ok).any() else None,
        "length_correct": float(lengths_B[ok].mean()) if ok.any() else None,
        "length_wrong": float(lengths_B[~ok].mean()) if (~ok).any() else None,
    }
    # GRPO's advantage per row, within groups that have both outcomes (eq. (3) of GRPO).
    r = correct_B.reshape(-1, group)
    mixed = (r.std(1) > 0)[:, None]
    adv = np.where(mixed, (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6), 0)
    adv_tok = np.broadcast_to(adv.reshape(-1)[:, None], logps_BxN.shape)
    sel = mask & np.broadcast_to(mixed.repeat(group, 0).reshape(-1)[:, None], mask.shape)
    lp, a = logps_BxN[sel], adv_tok[sel]
    c = (lp - lp.mean()) * (a - a.mean())  # each token's term of Cov(log pi, A)
    out["mixed_groups"] = int(mixed.sum())
    out["cov_logp_adv"] = float(c.mean())
    out["cov_from_positive_adv"] = float(c[a > 0].sum() / len(c))
    out["cov_from_negative_adv"] = float(c[a < 0].sum() / len(c))
    return out


def _check_same_setup(config, workdir: str) -> None:
    """The run in `workdir` must have trained with the model, data and sampling this probe
    uses (those of --study/--variant/--seed): else its figures would describe another setup."""
    run = config_record.recorded(workdir)
    if run is None:
        raise UserError(f"{workdir} holds no run (no config.json): give a study run's workdir")
    keys = ("model.", "data.", "rollout.temperature", "rollout.top_k", "rollout.top_p",
            "rollout.num_samples", "rollout.max_new_tokens")  # fmt: skip
    differ = sorted(
        k for k in config_record.changes(run, config_record.flat(config)) if k.startswith(keys)
    )
    if differ:
        raise UserError(
            f"the run in {workdir} trained with other settings than --study/--variant/--seed "
            f"give ({', '.join(differ[:5])}): pass the run's own study, variant and seed"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", default="a_grae_variants")
    ap.add_argument("--variant", default="grpo")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="a run: its last checkpoint's params instead of the base")
    args = ap.parse_args(argv)
    study = studies.get(args.study)
    config = studies.build_config(study, study.variant(args.variant), args.seed)
    mesh = sharding.make_mesh(resolve_mesh_shape(config.mesh, jax.device_count()))
    with jax.set_mesh(mesh), sharding.use_rules():
        model_cfg, params, tok = hf_import.load_policy(
            resolve_model_path(config.model.path), config.model, mesh
        )
        if args.workdir:
            _check_same_setup(config, args.workdir)
            _, model_cfg, params = restore_policy(config, args.workdir, model_cfg, params, mesh)
        data = data_builders.build_prompt_data(data_builders.run_data_config(config), tok)
        n = min(args.prompts, len(data))
        n -= n % jax.device_count()
        g = config.rollout.num_samples
        sampling = rollout_sampling(config, model_cfg, tok)  # the training rollout's
        ids, mask = left_pad(data.prompt_ids[:n], config.data.max_prompt_len, data.pad_id)
        out = LocalSampler(model_cfg).generate(
            params, ids, mask, jax.random.key(args.seed), num_samples=g, sampling=sampling
        )
        tokens, lengths = np.asarray(out.tokens_BxN), np.asarray(out.lengths_B)
        logps = np.asarray(out.logps_BxN, np.float64)
        texts = tok.batch_decode([t[:m] for t, m in zip(tokens, lengths)], skip_special_tokens=True)
        golds = [a for a in data.answers[:n] for _ in range(g)]
        r = config.reward
        with Verifier(timeout_s=r.timeout_s, num_workers=r.workers) as verifier:
            correct = np.asarray(verifier.score(texts, golds), np.float64)
    stats = outcome_stats(logps, lengths, correct, group=g)
    print(json.dumps({"params": args.workdir or "base", "prompts": n, **stats}, indent=1))


if __name__ == "__main__":
    run_cli(main)
