"""Multi-turn episodes on the in-process JetStream engine (`gjax.rollout.jetstream_episodes`:
each turn one request, the row's whole history resent as token ids): greedy, the same
trajectories as the local continuous decoder with its KV kept across turns; token-exact rows
with a policy-only mask; the prefill the resending costs, counted; a dropped request makes
its row invalid; runs whose history a server cannot prefill are refused at validation.

The environment is tests/test_decoder_turns.py's `ScriptEnv` (observations are decimal token
ids, read and written exactly), on the embedded policy."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import common
from gjax.config import validate
from gjax.envs import EnvRunner, environments
from gjax.errors import ConfigError
from gjax.rollout import LocalSampler, SamplingParams
from gjax.rollout.buckets import served_prompt_len
from gjax.rollout.collect import ServingFailed
from gjax.rollout.decoder import ContinuousDecoder
from gjax.rollout.jetstream_episodes import generate_episodes
from gjax.rollout.sampler import SampleOutput
from gjax.rollout.turns import EnvTurns
from gjax.train import CONFIG_CHECKS
from tests.test_decoder_turns import ScriptEnv, decode, encode, rows_with
from tests.test_jetstream import engine_backend, policy  # noqa: F401 - policy: a fixture

jetstream_backend = pytest.importorskip("gjax.rollout.jetstream_backend")

G, N = 2, 32
OBS = [["12 30 5 9", "40 2"], ["8 8 8"], ["19 4", "1 1"]]  # turns per episode: 3, 2, 3


def _sampling(eos, pad, temperature):
    return SamplingParams(
        max_new_tokens=N, temperature=temperature, stop_token_ids=eos, pad_token_id=pad
    )


@pytest.fixture(scope="module")
def served(policy):  # noqa: F811
    be = engine_backend(policy, extra_prompt_len=N)  # `served_prompt_len` of such a run
    yield be
    be.close()


class CountEnv(ScriptEnv):
    """`ScriptEnv` with a reward of each episode's own: the policy tokens it read (ScriptEnv's
    counts every text its problem's episodes were handed, which depends on their order)."""

    def start(self, row):
        episode, seen = super().start(row), []
        step = episode.step

        async def own(text, *, length=None):
            seen.append(text)
            out = await step(text, length=length)
            if out.done:
                out = dataclasses.replace(out, reward=float(sum(len(t.split()) for t in seen)))
            return out

        episode.step = own
        return episode


def _turns(runner, rows, max_turns=4):
    return EnvTurns(runner, rows, encode=encode, decode=decode, max_turns=max_turns)


def _prompts(policy_fixture, p):
    _, _, _, batch, *_ = policy_fixture
    return batch.prompt_ids_PxS[:p], batch.prompt_mask_PxS[:p]


def test_greedy_served_episodes_equal_the_continuous_decoders(policy, served):  # noqa: F811
    """Greedy, three turns: resending each turn's history to the engine gives the local
    decoder's trajectories (its later turns decoded with the KV kept) token for token, the
    same turns, observations, limits and rewards, and log-probs to 1e-5; every turn's
    request carried the whole history."""
    cfg, params, tok, batch, eos, pad, _ = policy
    sp = _sampling(eos, pad, 0.0)
    ids, mask = _prompts(policy, len(OBS))
    rows = rows_with(OBS)
    with EnvRunner(CountEnv(), max_in_flight=4) as runner:
        local = LocalSampler(cfg, decoder=ContinuousDecoder(cfg, slots=3, tokens_per_dispatch=4))
        ref = local.generate_episodes(
            params, ids, mask, jax.random.key(0), num_samples=G, sampling=sp,
            turns=_turns(runner, rows),
        )  # fmt: skip
        ref_stats = dict(local.episode_stats())
    with EnvRunner(CountEnv(), max_in_flight=4) as runner:
        got = served.generate_episodes(
            params, ids, mask, None, num_samples=G, sampling=sp, turns=_turns(runner, rows)
        )
        stats = served.episode_stats()
    for name in ("tokens_BxN", "mask_BxN", "policy_mask_BxN", "lengths_B", "turns_B"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    assert got.observations == ref.observations and got.limit_B == ref.limit_B
    np.testing.assert_array_equal(got.reward_B, ref.reward_B)
    np.testing.assert_allclose(got.logps_BxN, ref.logps_BxN, atol=1e-5)
    assert (got.turns_B >= 2).all() and any(len(o) == 2 for o in got.observations)
    # Each turn's request: the prompt and the whole trajectory before the turn.
    prompt_B = np.repeat(np.asarray(mask).sum(-1), G)
    sent = 0
    for b in range(len(OBS) * G):
        starts = [0] + [  # where each later turn starts: after each observation
            int(i) + 1 for i in np.flatnonzero(np.diff(got.policy_mask_BxN[b]) == 1)
        ]
        sent += sum(int(prompt_B[b]) + s for s in starts)
    assert stats["env/prefill_tokens_per_episode_sent"] == pytest.approx(sent / (len(OBS) * G))
    assert stats["episode_waves"] == got.turns_B.max()
    assert stats["episode_requests"] == got.turns_B.sum()
    # against the decoder's KV kept (prompt once per group, then the observations)
    assert ref_stats["env/prefill_tokens_per_episode_kept"] < sent / (len(OBS) * G)
    assert served.metrics()["rollout/requests_dropped"] == 0.0


def test_sampled_served_episodes_are_token_exact(policy, served):  # noqa: F811
    """Sampled (T = 1): the environment read each turn's ids exactly as the engine sampled
    them, the inserted ids are the observations', the policy mask is 1 on sampled tokens
    only, and behaviour log-probs sit on policy tokens only."""
    cfg, params, tok, batch, eos, pad, _ = policy
    sp = _sampling(eos, pad, 1.0)
    ids, mask = _prompts(policy, len(OBS))
    env = ScriptEnv()
    with EnvRunner(env, max_in_flight=4) as runner:
        got = served.generate_episodes(
            params,
            ids,
            mask,
            None,
            num_samples=G,
            sampling=sp,
            turns=_turns(runner, rows_with(OBS)),
        )
    for b in range(len(OBS) * G):
        n = int(got.lengths_B[b])
        pol = got.policy_mask_BxN[b, :n].astype(bool)
        assert (got.mask_BxN[b, :n] == 1).all() and not got.mask_BxN[b, n:].any()
        assert (got.logps_BxN[b, :n][~pol] == 0).all() and (got.logps_BxN[b, :n][pol] < 0).all()
        inserted = got.tokens_BxN[b, :n][~pol].tolist()
        assert inserted == [i for o in got.observations[b] for i in o]
    seen = [t for texts in env.texts.values() for t, _ in texts]
    turns = []
    for b in range(len(OBS) * G):  # each policy run of a row, as the environment read it
        n, pol = int(got.lengths_B[b]), got.policy_mask_BxN[b]
        edges = np.flatnonzero(np.diff(np.r_[0, pol[:n], 0]))
        turns += [decode(got.tokens_BxN[b, s:e]) for s, e in zip(edges[::2], edges[1::2])]
    assert sorted(seen) == sorted(turns)


class _DropsRows:
    """A client whose `generate` drops the requests whose history has one of `drop_lens`
    tokens; every turn it plays is token 5, then the stop id 3."""

    def __init__(self, drop_lens, n: int):
        self.drop_lens, self.n = set(drop_lens), n

    def generate(self, params, hist, mask, rng, *, num_samples, sampling, max_tokens_B):
        b = hist.shape[0]
        tokens = np.zeros((b, self.n), np.int32)
        tokens[:, :2] = [5, 3]
        valid = ~np.isin(mask.sum(-1), list(self.drop_lens))
        m = np.zeros((b, self.n), np.int32)
        m[:, :2] = 1
        return SampleOutput(tokens, m, np.full((b, self.n), -0.5, np.float32), m.sum(-1), valid)

    def failure(self):
        return "the test's client dropped them"


DROP_SP = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=(3,), pad_token_id=0)
DROP_IDS = np.asarray([[0, 9, 9, 9], [4, 4, 4, 4]], np.int32)
DROP_MASK = np.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)


def _drop_run(drop_lens):
    with EnvRunner(ScriptEnv(), max_in_flight=4) as runner:
        rows = rows_with([["7 7"], ["7 7"]])
        return generate_episodes(
            _DropsRows(drop_lens, 16), None, DROP_IDS, DROP_MASK, num_samples=2,
            sampling=DROP_SP, turns=_turns(runner, rows),
        )  # fmt: skip


def test_a_dropped_turn_makes_its_row_invalid():
    """A row whose first turn's request is dropped (prompt 0: 3 tokens) ends unscored
    (reward NaN: the learner's invalid sample); so does one dropped on its second turn
    (prompt 1's history: 4 + 2 + 2 = 8 tokens), its first turn and observation kept; the
    others play their episodes out."""
    traj, stats = _drop_run({3})
    assert np.isnan(traj.reward_B[:2]).all() and np.isfinite(traj.reward_B[2:]).all()
    assert traj.turns_B.tolist() == [0, 0, 2, 2] and stats["episode_requests_dropped"] == 2
    assert traj.groups(DROP_IDS, DROP_MASK).valid_PxG.tolist() == [[False, False], [True, True]]
    traj, stats = _drop_run({8})  # prompt 1's rows on their second turn
    assert np.isfinite(traj.reward_B[:2]).all() and np.isnan(traj.reward_B[2:]).all()
    assert traj.turns_B.tolist() == [2, 2, 1, 1] and stats["episode_requests_dropped"] == 2
    assert traj.lengths_B.tolist() == [6, 6, 4, 4]  # turn 5 3, obs 7 7 (and turn 5 3)
    np.testing.assert_array_equal(traj.tokens_BxN[2, :4], [5, 3, 7, 7])
    np.testing.assert_array_equal(traj.policy_mask_BxN[2, :5], [1, 1, 0, 0, 0])


def test_a_wave_with_every_request_dropped_stops_the_run():
    """The server answered none of a wave's requests: `ServingFailed` (the run stops, naming
    the failure), not a batch of invalid rows trained on."""
    with pytest.raises(ServingFailed, match="every request of turn wave 1 .4 requests. failed"):
        _drop_run({3, 4})


def test_served_episodes_are_validated():
    """A JetStream multi-turn run validates with the trainer's checks; its servers prefill
    prompt + trajectory (`served_prompt_len`); one whose history passes JetStream's largest
    prefill bucket is refused in one paragraph (several processes: tests/test_envs.py)."""
    c = common.tiny(common.base())
    c.env.name, c.rollout.backend = "math", "jetstream"
    validate(c, 1, checks=CONFIG_CHECKS)  # one process, a history the buckets hold
    assert served_prompt_len(c) == c.data.max_prompt_len + c.rollout.max_new_tokens
    c.rollout.max_new_tokens = 32768
    with pytest.raises(ConfigError, match="largest prefill bucket"):
        environments.check_config(c)
    c.env.name = ""
    assert served_prompt_len(c) == c.data.max_prompt_len  # single-turn: the prompt alone
