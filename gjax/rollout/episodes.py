"""Multi-turn training rollouts: the rollout's rows as episodes of `config.env`'s environment.

`EpisodeRollout` is `gjax.rollout.collect.Rollout` with its sampling and scoring steps
replaced: each data row's G rows are episodes (`LocalSampler.generate_episodes`, the
continuous decoder with KV kept across turns, `gjax.rollout.turns`; on a JetStream backend,
`gjax.rollout.jetstream_episodes`, each turn a request with the history resent), and the
environment's rewards replace the reward pipeline's. The rest is the single-turn rollout's:

  * the learner's rows are `Trajectories.groups`: prompt ++ every token after it, as sampled
    or as the environment inserted it (token-exact); the loss mask is the policy's tokens
    only (`Groups.policy_mask_PxGxN`); old log-probs are the behaviour log-probs of those
    tokens, so the old-logp / TIS machinery reads them as it reads the sampler's;
  * a trajectory's reward is sum_t env.discount**t * r_t over its steps (1.0: the sum; NaN,
    not computable, makes the sample invalid, as the pipeline's invalid rewards do), then
    DAPO's soft overlong shaping on the trajectory's length (every token after the prompt:
    what rollout.max_new_tokens bounds);
  * a row is truncated when a limit cut its episode (`turns`, `tokens`, `turn_tokens`, `env`).

On the one-step `math` environment this is today's single-turn rollout bit for bit: the same
tokens, log-probs, rewards, validity and truncation, so the same metrics and updates
(tests/test_train_episodes.py). Metrics added per step (`env/...`): turns per episode, tool
calls and tool errors by kind, truncations by limit, tokens inserted, prefill tokens per
episode (KV kept vs re-prefilled), environment step seconds (summed over episodes) and how
much of it decoding hid (`env/wait_s`: wall seconds the decoder had nothing to decode but
waited for steps; `env/step_overlap_frac` = 1 - wait_s / step_s).

Asynchronous runs (rollout.max_staleness = k > 0, on the train mesh or on mesh.rollout_devices)
call this rollout on the producer thread (gjax.rollout.producer) as they call the single-turn
one: step j's episodes are all decoded with the one version v(j) = max(j - k, start) the
schedule names, since the decoder takes its params once per `generate_episodes` call and the
producer pushes nothing into a call in flight. So an episode never spans versions: every token
of a trajectory, in every turn, comes from v(j), and the row's `policy_version_PxG` (set by the
producer, as for single completions) is the version of each of its policy tokens. The
environment's runner is driven from that thread (`EnvRunner.submit` hands the step to its
own event loop, thread-safe), and the held-out evaluation's episodes on the loop's thread use
the same runner concurrently (its counters are locked; each call's `EnvTurns` is its own).

Several processes (jax.distributed): each process rolls out the episodes of its own block of
the batch's prompts on its own devices, with the row keys of the whole batch (`row_block`), so
its rows equal those rows of a one-process run of the same global layout; each runs its own
environment runner. Synchronous: the prompts go in as the global batch and the local backend
decodes each process's block (`LocalSampler.generate_episodes`); asynchronous: the producer's
`process_local` rollout, as for single completions. The step's figures are over every
process's rows (`env/...` pooled by `multihost.pool_counts`: counts and seconds summed,
per-episode figures averaged) (tests/test_multihost.py).

`make_rollout` is what `gjax.train` calls: the single-turn `Rollout` for env.name = '', this
one otherwise (with the environment's runner closed by the run's exit stack).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from gjax import multihost
from gjax.envs import tools as tools_lib
from gjax.envs.environments import build_env
from gjax.envs.runner import EnvRunner
from gjax.errors import ConfigError
from gjax.experience import Groups
from gjax.rollout.backend import LocalSampler
from gjax.rollout.collect import Rollout, RolloutResult
from gjax.rollout.turns import Trajectories, build_turns, trajectory_rewards

# Tool counts as the environments name them (gjax.envs.environments) -> the step's metric name.
TOOL_METRICS = {
    "tools/calls": "env/tool_calls",
    "tools/errors": "env/tool_errors",
    **{f"tools/errors/{k}": f"env/tool_errors/{k}" for k in tools_lib.ERROR_KINDS},
}


class EpisodeRollout(Rollout):
    """A `Rollout` whose rows are episodes of an environment (see the module docstring)."""

    def __init__(self, *, runner: EnvRunner, **kwargs):
        super().__init__(**kwargs)
        config = kwargs["config"]
        backend = self.backend
        if isinstance(backend, LocalSampler) and backend.decoder is None:
            raise ConfigError(
                f"config.env.name={config.env.name!r}: the local backend rolls episodes out "
                "on its continuous decoder; use --config.rollout.decoder=continuous"
            )
        self.runner = runner
        self.config = config
        self.discount = float(config.env.discount)

    def __call__(self, params, prompts, rng) -> RolloutResult:
        t0 = time.perf_counter()
        traj = self._episodes(params, prompts, rng)
        t_sample = time.perf_counter() - t0
        groups = self.groups(traj, prompts)
        lengths = traj.lengths_B
        accuracy = groups.rewards_PxG.copy()
        self._shape_overlong(groups, lengths)
        gather = self.transfer.allgather
        metrics = {
            **self._metrics(groups, accuracy, lengths),
            # the policy's tokens only (the environment's are inserted, not sampled)
            "response/sampled_tokens": float(gather(traj.policy_mask_BxN.sum()).sum()),
            "time/sample_s": t_sample,
            **self.backend.metrics(gather),
            **reward_metrics(groups, accuracy, self.transfer.gather_rows),
            **env_metrics(self.backend.episode_stats(), gather),
        }
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return RolloutResult(groups, metrics)

    def _episodes(self, params, prompts, rng) -> Trajectories:
        """This process's episodes: its rows' `EnvTurns` on the decoder. Several processes
        on the loop's thread: the prompts go in as the global batch and each process decodes
        its own block on its own devices (`LocalSampler.generate_episodes`); on the async
        producer's thread (`process_local`) they are this process's host rows already."""
        rows = [
            {"problem": q, "answer": a, "prompt": p}
            for q, a, p in zip(prompts.problems, prompts.answers, prompts.prompts, strict=True)
        ]
        turns = build_turns(self.config, self.runner, rows, self.tok)
        put = self.transfer.sampler_rows
        return self.backend.generate_episodes(
            params,
            put(prompts.prompt_ids_PxS),
            put(prompts.prompt_mask_PxS),
            rng,
            num_samples=self.G,
            sampling=self.sampling,
            turns=turns,
        )

    def groups(self, traj: Trajectories, prompts) -> Groups:
        """The learner's rows, each trajectory's reward discounted by `env.discount`."""
        traj = traj._replace(reward_B=trajectory_rewards(traj.rewards, self.discount))
        return traj.groups(prompts.prompt_ids_PxS, prompts.prompt_mask_PxS)


def reward_metrics(groups: Groups, accuracy_PxG: np.ndarray, gather_rows=np.asarray):
    """The reward pipeline's batch figures for the environment's rewards (before shaping):
    `rewards/mean` over the valid samples, `rewards/valid_fraction`, `rewards/nonfinite`;
    over every process's rows (`gather_rows`: this process's rows -> the batch's)."""
    valid = np.asarray(gather_rows(groups.valid_PxG)).reshape(-1)
    rewards = np.asarray(gather_rows(accuracy_PxG)).reshape(-1)
    return {
        "rewards/valid_fraction": float(valid.mean()) if valid.size else 0.0,
        "rewards/nonfinite": float((~valid).sum()),
        "rewards/mean": float(rewards[valid].mean()) if valid.any() else 0.0,
    }


# Per-episode figures: the mean over processes (each holds as many episodes); the rest of a
# batch's `env/...` figures are counts and seconds, summed.
PER_EPISODE = (
    "env/turns_per_episode",
    "env/prefill_tokens_per_episode_kept",
    "env/prefill_tokens_per_episode_reprefill",
    "env/prefill_tokens_per_episode_sent",
)


def env_metrics(stats, gather=multihost.allgather) -> dict[str, float]:
    """A batch's `env/...` figures from the decoder's stats of its `generate_episodes` (which
    carry `EnvTurns.stats()`), over every process (`gather`; `multihost.pool_counts`): the
    environment's tool counts renamed (every error kind, 0 where none), the rest of the
    episode figures as they are, and the overlap of environment steps with decoding (pooled:
    1 - every process's decoder waits over every process's step seconds)."""
    out = {k: float(v) for k, v in stats.items() if k.startswith("env/")}
    out.update({new: float(stats.get(old, 0.0)) for old, new in TOOL_METRICS.items()})
    out["env/wait_s"] = float(stats.get("env_wait_s", 0.0))
    out = multihost.pool_counts(out, means=PER_EPISODE, gather=gather)
    step_s, wait_s = out.get("env/step_s", 0.0), out["env/wait_s"]
    out["env/step_overlap_frac"] = max(0.0, 1.0 - wait_s / step_s) if step_s > 0 else 1.0
    return out


def make_rollout(config, scope: contextlib.ExitStack, *, rewards, **kwargs) -> Rollout:
    """The run's rollout: `Rollout` (single-turn, env.name = '') or `EpisodeRollout` on the
    environment `config.env` names, built with the run's reward function (the reward
    pipeline's `CombinedReward`: the `math` environment scores a turn as the pipeline scores
    the same completion). kwargs: `Rollout`'s."""
    if not config.env.name:
        return Rollout(rewards=rewards, config=config, **kwargs)
    env = build_env(config, reward_fn=rewards.reward_fns["reward"])
    runner = EnvRunner(env, max_in_flight=config.env.max_in_flight)
    scope.callback(runner.close)
    return EpisodeRollout(runner=runner, rewards=rewards, config=config, **kwargs)
