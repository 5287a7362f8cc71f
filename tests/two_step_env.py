"""`two_step`: a test environment of exactly two turns, and `gjax.train` with it registered.

Every episode: the first turn gets an observation (" Check.") and 0.5, the second is scored by
the run's reward and ends it. The observation is short: trajectories fit the embedded config's
32 tokens. In-process tests register it for one test (`tests/test_train_episodes.py`'s
fixture); a subprocess runs `python -m tests.two_step_env --config=... --workdir=...`, which is
`python -m gjax.train` with `two_step` in the registry (tests/test_multihost.py)."""

from __future__ import annotations

import runpy

from gjax.envs.base import ENVIRONMENTS, Step
from gjax.envs.environments import score_turn

NAME = "two_step"


class TwoStepEnv:
    name = NAME

    def __init__(self, reward_fn):
        self.reward_fn = reward_fn

    def system_prompt(self):
        return ""

    def start(self, row):
        env = self

        class Episode:
            turn = 0

            async def step(self, text, *, length=None):
                self.turn += 1
                if self.turn == 1:
                    return Step(" Check.", 0.5, False)
                return Step("", await score_turn(env.reward_fn, row, text, length), True)

        return Episode()

    def stats(self):
        return {}

    def close(self):
        pass


def factory(config, *, reward_fn):
    del config
    return TwoStepEnv(reward_fn)


if __name__ == "__main__":
    ENVIRONMENTS.register(NAME)(factory)
    runpy.run_module("gjax.train", run_name="__main__", alter_sys=True)
