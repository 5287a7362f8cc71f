"""Multi-turn rows on the continuous decoder (`ContinuousDecoder.generate_episodes`): the one-step
`math` environment equals `generate` bit for bit; a row's later turn, decoded after its
observation re-entered its slot (KV kept), equals the static sampler on a full prefill of the
row's history; trajectories are token-exact with a policy-only mask; limits truncate and mark.

Token ids and text: the tests' "tokenizer" writes ids as decimal words ("12 30 5"), so the
environment reads exactly the ids the policy sampled and its observations are exact ids."""

import asyncio
import dataclasses
import math

import jax
import numpy as np
import pytest

from gjax.envs import EnvRunner, Step
from gjax.envs.environments import MathEnv
from gjax.experience import to_model_inputs
from gjax.learner import policy_logps
from gjax.rollout import SamplingParams, generate
from gjax.rollout.decoder import ContinuousDecoder
from gjax.rollout.turns import EnvTurns, trajectory_rewards
from tests.test_sampler import CFG, PARAMS, PROMPTS, S, left_pad, teacher_forced_logits

jax.config.update("jax_default_matmul_precision", "highest")

G, N = 2, 24
STOPS = (3, 7, 11)
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, stop_token_ids=STOPS, pad_token_id=63)
SAMPLED = dataclasses.replace(GREEDY, temperature=0.8, top_k=20)
TOKENS, MASK = left_pad(PROMPTS, S)


def encode(text):
    return [int(w) for w in text.split()]


def decode(ids):
    return " ".join(str(int(i)) for i in ids)


class ScriptEnv:
    """Each episode answers `row["obs"]` (one observation per turn, in order) until they run
    out, then is done with reward = the number of policy tokens it read; `row["truncate"]`:
    the last step is marked truncated. Records every text it was handed."""

    name = "script"

    def __init__(self):
        self.texts = {}

    def system_prompt(self):
        return ""

    def start(self, row):
        env, seen = self, self.texts.setdefault(row["problem"], [])

        class Episode:
            turn = 0

            async def step(self, text, *, length=None):
                seen.append((text, length))
                obs = row["obs"]
                self.turn += 1
                if self.turn <= len(obs):
                    return Step(obs[self.turn - 1], None, False, metrics={"env/turns": 1.0})
                reward = float(sum(len(t.split()) for t, _ in seen))
                return Step("", reward, True, row.get("truncate", False))

        del env
        return Episode()

    def stats(self):
        return {}

    def close(self):
        pass


def episodes(rows, sp=GREEDY, *, max_turns=4, turn_tokens=0, env=None, slots=3, **kw):
    env = env or ScriptEnv()
    dec = ContinuousDecoder(CFG, slots=slots, tokens_per_dispatch=4, **kw)
    with EnvRunner(env, max_in_flight=4) as runner:
        turns = EnvTurns(
            runner,
            rows,
            encode=encode,
            decode=decode,
            max_turns=max_turns,
            turn_tokens=turn_tokens,
        )
        out = dec.generate_episodes(
            PARAMS, TOKENS, MASK, jax.random.key(3), num_samples=G, sampling=sp, turns=turns
        )
    return out, dec.stats, env


def rows_with(obs_per_prompt, **extra):
    return [
        {"problem": f"p{i}", "answer": "7", "obs": o, **extra} for i, o in enumerate(obs_per_prompt)
    ]


def test_one_step_math_env_equals_generate_bit_for_bit():
    """env `math` (one step, scored, done) gives generate()'s rows, tokens and log-probs bit
    for bit, greedy and sampled; its rewards are the reward function's on the same texts."""

    def reward(prompts, completions, answers, **_):
        return [float(a in c.split()) for c, a in zip(completions, answers)]

    rows = [{"problem": f"p{i}", "answer": a} for i, a in enumerate(["7", "11", "3"])]
    for sp in (GREEDY, SAMPLED):
        dec = ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=4)
        ref = jax.tree.map(
            np.asarray,
            dec.generate(PARAMS, TOKENS, MASK, jax.random.key(3), num_samples=G, sampling=sp),
        )
        with EnvRunner(MathEnv(reward), max_in_flight=4) as runner:
            turns = EnvTurns(runner, rows, encode=encode, decode=decode, max_turns=1)
            out = dec.generate_episodes(
                PARAMS, TOKENS, MASK, jax.random.key(3), num_samples=G, sampling=sp, turns=turns
            )
        for name in ("tokens_BxN", "mask_BxN", "logps_BxN", "lengths_B"):
            a, b = getattr(out, name), getattr(ref, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        np.testing.assert_array_equal(out.policy_mask_BxN, ref.mask_BxN)
        np.testing.assert_array_equal(out.turns_B, np.ones(G * len(PROMPTS)))
        texts = [decode(t[:n]) for t, n in zip(ref.tokens_BxN, ref.lengths_B)]
        want = reward(None, texts, [r["answer"] for r in rows for _ in range(G)])
        np.testing.assert_array_equal(out.reward_B, np.asarray(want, np.float32))
        stopped = np.isin(ref.tokens_BxN, STOPS).any(1)
        assert out.limit_B == ["" if s else "tokens" for s in stopped]
        assert dec.stats.get("rows_reentered", 0) == 0 and dec.stats["env/tokens_inserted"] == 0


OBS = ["12 30 5 9", "40 2", "8 8 8 1 19"]


@pytest.fixture(scope="module")
def two_turns():
    return episodes(rows_with([[o] for o in OBS]))


def test_second_turn_with_kv_kept_equals_a_full_reprefill_of_the_history(two_turns):
    """Greedy: after turn 1 and the observation (appended to the slot: no re-prefill), turn 2
    decodes the same tokens as the static sampler prefilling the whole history as a prompt,
    and its log-probs to the static sampler's tolerance."""
    out, stats, _ = two_turns
    assert stats["rows_reentered"] == G * len(PROMPTS)
    histories, spans = [], []
    for b in range(G * len(PROMPTS)):
        prompt = PROMPTS[b // G]
        obs = out.observations[b][0]
        turn1 = int(np.flatnonzero(out.policy_mask_BxN[b] == 0)[0])  # first inserted token
        h = turn1 + len(obs)
        np.testing.assert_array_equal(out.tokens_BxN[b, turn1:h], obs)
        histories.append(list(prompt) + out.tokens_BxN[b, :h].tolist())
        spans.append((h, int(out.lengths_B[b])))
    assert all(n > h for h, n in spans), "every row decodes a second turn"
    width = max(map(len, histories))
    tok, mask = left_pad(histories, width)
    ref = generate(PARAMS, CFG, tok, mask, jax.random.key(0), num_samples=1, sampling=GREEDY)
    ref = jax.tree.map(np.asarray, ref)
    for b, (h, n) in enumerate(spans):
        k = n - h
        np.testing.assert_array_equal(out.tokens_BxN[b, h:n], ref.tokens_BxN[b, :k])
        np.testing.assert_allclose(out.logps_BxN[b, h:n], ref.logps_BxN[b, :k], atol=1e-5)
        if out.tokens_BxN[b, n - 1] in STOPS:  # the turn ended where the reference stops
            assert ref.lengths_B[b] == k
        else:
            assert n == N and out.limit_B[b] == "tokens"
    # what keeping the KV saves, per episode (prompt shared by the group's G rows)
    kept = stats["env/prefill_tokens_per_episode_kept"]
    again = stats["env/prefill_tokens_per_episode_reprefill"]
    print(f"prefill tokens per episode: KV kept {kept:.1f}, history re-prefilled {again:.1f}")
    assert kept < again


THREE_TURNS = rows_with([["12 30", "5 9 2"], ["40 2", "1"], ["8 8", "19 4 4"]])


@pytest.fixture(scope="module")
def three_turns_sampled():
    return THREE_TURNS, episodes(THREE_TURNS, SAMPLED)


def test_trajectories_are_token_exact_and_the_mask_covers_policy_tokens_only(three_turns_sampled):
    """Sampled, three turns: the environment read exactly the policy's ids of each turn; the
    inserted ids are the observations' ids; the policy mask is 1 on sampled tokens only; and
    the learner's teacher-forced log-probs over prompt ++ trajectory (the same ids, no
    decode-then-re-tokenize) equal the behaviour log-probs at the policy's positions."""
    rows, (out, _, env) = three_turns_sampled
    for b in range(G * len(PROMPTS)):
        n = int(out.lengths_B[b])
        pol = out.policy_mask_BxN[b, :n].astype(bool)
        assert (out.mask_BxN[b, :n] == 1).all() and (out.mask_BxN[b, n:] == 0).all()
        assert not out.policy_mask_BxN[b, n:].any()
        assert (out.logps_BxN[b, :n][~pol] == 0).all()
        runs = _runs(out, b)  # the trajectory: turns (policy runs) and observations
        turns = [ids for p, ids in runs if p]
        inserted = [ids for p, ids in runs if not p]
        assert (
            inserted
            == out.observations[b]
            == [encode(o) for o in rows[b // G]["obs"]][: len(inserted)]
        )
        assert len(turns) == out.turns_B[b]
    # what each episode was handed, in row order within a prompt: the policy's own ids
    for i, row in enumerate(rows):
        handed = env.texts[row["problem"]]
        mine = [[ids for p, ids in _runs(out, b) if p] for b in range(i * G, i * G + G)]
        assert sorted(t for t, _ in handed) == sorted(decode(ids) for m in mine for ids in m)
        assert sorted(n for _, n in handed) == sorted(len(ids) for m in mine for ids in m)
    rep = lambda x: np.repeat(x, G, axis=0)
    logits = teacher_forced_logits(
        PARAMS, CFG, rep(TOKENS), rep(MASK), out.tokens_BxN, out.mask_BxN
    )
    ref = np.asarray(jax.nn.log_softmax(logits / SAMPLED.temperature, axis=-1))
    ref = np.take_along_axis(ref, out.tokens_BxN[..., None], axis=-1)[..., 0]
    pol = out.policy_mask_BxN == 1
    assert (out.turns_B > 1).any()
    np.testing.assert_allclose(np.where(pol, out.logps_BxN, 0), np.where(pol, ref, 0), atol=1e-5)


@pytest.mark.slow  # every program compiled again for 2 slots (20-25 s cold on a busy 2-core CPU)
def test_trajectories_do_not_depend_on_slots_chunks_or_answer_timing(three_turns_sampled):
    """Per-row keys: the same sampled trajectories from 2 slots, chunked prompts and
    observations re-entering 2 columns per call (environment answers arriving at other
    points of the schedule)."""
    rows, (out, _, _) = three_turns_sampled
    other, stats, _ = episodes(rows, SAMPLED, slots=2, prefill_chunk=3, observation_chunk=2)
    assert stats["reenter_calls"] > stats["rows_reentered"] / 2  # some took several calls
    for name in ("tokens_BxN", "policy_mask_BxN", "lengths_B", "turns_B"):
        np.testing.assert_array_equal(getattr(other, name), getattr(out, name))
    np.testing.assert_allclose(other.logps_BxN, out.logps_BxN, atol=1e-5)


def _runs(out, b):
    n = int(out.lengths_B[b])
    runs, cur, kind = [], [], True
    for t, p in zip(out.tokens_BxN[b, :n].tolist(), out.policy_mask_BxN[b, :n].astype(bool)):
        if p != kind and cur:
            runs.append((kind, cur))
            cur = []
        kind = p
        cur.append(t)
    runs.append((kind, cur))
    return runs


def test_limits_truncate_and_mark():
    """Per prompt: an observation that does not fit the trajectory ('tokens', not inserted),
    an environment's own truncation ('env'), an episode that never ends (max_turns=3:
    'turns'); then a per-turn budget that cuts every turn ('turn_tokens')."""
    rows = [
        {"problem": "p0", "answer": "", "obs": [" ".join(["2"] * N)]},
        {"problem": "p1", "answer": "", "obs": ["9"], "truncate": True},
        {"problem": "p2", "answer": "", "obs": ["12 30"] * 9},
    ]
    out, stats, _ = episodes(rows, max_turns=3)
    by_prompt = [out.limit_B[i * G : i * G + G] for i in range(3)]
    assert by_prompt == [["tokens"] * G, ["env"] * G, ["turns"] * G]
    np.testing.assert_array_equal(out.turns_B, [1, 1, 2, 2, 3, 3])
    assert out.observations[0] == out.observations[1] == []  # too long: not inserted
    assert out.observations[4] == [[12, 30], [12, 30]]
    assert out.truncated_B.all() and stats["env/truncated"] == 6
    assert stats["env/truncated_turns"] == stats["env/truncated_tokens"] == G
    assert (out.lengths_B[4:] < N).all()  # 'turns', not the trajectory's budget
    # every turn ends at 1 token without a stop id (greedy's first stops come later)
    cut, stats, _ = episodes(rows_with([["1"], ["1"], ["1"]]), turn_tokens=1)
    first = out.tokens_BxN[:, :1]
    assert not np.isin(first, STOPS).any()
    assert cut.limit_B == ["turn_tokens"] * 6 and (cut.lengths_B == 1).all()
    np.testing.assert_array_equal(cut.tokens_BxN[:, :1], first)
    np.testing.assert_array_equal(cut.turns_B, np.ones(6))


def test_bad_arguments():
    with pytest.raises(ValueError, match="observation_chunk"):
        ContinuousDecoder(CFG, slots=1, tokens_per_dispatch=1, observation_chunk=0)
    with pytest.raises(ValueError, match="2 data rows for 3 prompts"):
        episodes(rows_with([["1"], ["1"]]))


def test_the_learner_reads_the_sampled_and_inserted_ids_and_masks_the_loss_to_the_policy(
    three_turns_sampled,
):
    """Trajectories -> Groups -> the learner's batch: its token ids are prompt ++ the
    trajectory's ids exactly (no decode-then-re-tokenize), the loss mask is the policy mask,
    and the learner's teacher-forced log-probs equal the behaviour log-probs there."""
    _, (out, _, _) = three_turns_sampled
    groups = out.groups(TOKENS, MASK)
    host = to_model_inputs(groups)
    np.testing.assert_array_equal(host["input_ids_BxS"][:, S:], out.tokens_BxN)
    np.testing.assert_array_equal(host["input_ids_BxS"][:, :S], np.repeat(TOKENS, G, axis=0))
    np.testing.assert_array_equal(host["targets_BxT"], out.tokens_BxN)
    np.testing.assert_array_equal(host["loss_mask_BxT"], out.policy_mask_BxN == 1)
    assert (out.mask_BxN > out.policy_mask_BxN).any()  # inserted tokens: in, not trained on
    np.testing.assert_array_equal(groups.rewards_PxG.reshape(-1), out.reward_B)
    assert groups.valid_PxG.all()
    keys = ("input_ids_BxS", "positions_BxS", "segment_ids_BxS", "targets_BxT", "loss_mask_BxT")
    learner_logps = jax.jit(policy_logps, static_argnames=("cfg", "temperature"))
    logps = learner_logps(
        PARAMS, {k: host[k] for k in keys}, cfg=CFG, temperature=SAMPLED.temperature
    )
    want = np.where(out.policy_mask_BxN == 1, out.logps_BxN, 0.0)
    np.testing.assert_allclose(np.asarray(logps), want, atol=1e-5)
    np.testing.assert_array_equal(host["old_logps_BxT"], out.logps_BxN)


class ToolLikeEnv(ScriptEnv):
    """ScriptEnv whose truncated last step also counts itself as the `tool` environment's
    steps do (`env/truncated`, `env/truncated_turns` in the step's metrics)."""

    def start(self, row):
        episode = super().start(row)
        step = episode.step

        async def counted(text, *, length=None):
            out = await step(text, length=length)
            if out.truncated:
                counts = {"env/truncated": 1.0, "env/truncated_turns": 1.0}
                out = dataclasses.replace(out, metrics={**out.metrics, **counts})
            return out

        episode.step = counted
        return episode


def test_step_counts_do_not_overwrite_the_batch_truncation_counts():
    """A step's own `env/truncated` (the tool environment's: steps it truncated) used to
    replace the batch's count of truncated trajectories in the stats (2 instead of 6 here)."""
    rows = [
        {"problem": "p0", "answer": "", "obs": [" ".join(["2"] * N)]},
        {"problem": "p1", "answer": "", "obs": ["9"], "truncate": True},
        {"problem": "p2", "answer": "", "obs": ["12 30"] * 9},
    ]
    out, stats, _ = episodes(rows, max_turns=3, env=ToolLikeEnv())
    assert out.truncated_B.all()
    assert stats["env/truncated"] == 6 and stats["env/truncated_env"] == G
    assert stats["env/truncated_turns"] == stats["env/truncated_tokens"] == G


def test_trajectory_rewards_sum_or_discount_the_turns():
    rewards = [[None, 1.0], [0.5, None, 2.0], [1.0, float("nan")], [], [None]]
    np.testing.assert_array_equal(
        trajectory_rewards(rewards, 1.0), np.float32([1.0, 2.5, np.nan, 0.0, 0.0])
    )
    # turn t weighs discount**t: a reward at the second turn counts half at 0.5
    np.testing.assert_array_equal(
        trajectory_rewards(rewards, 0.5), np.float32([0.5, 0.5 + 0.25 * 2.0, np.nan, 0.0, 0.0])
    )
    rng = np.random.default_rng(0)  # 1.0 is the plain sum bit for bit (the EnvTurns reward)
    many = [list(rng.standard_normal(5)) for _ in range(50)]
    want = np.float32([math.fsum(r) for r in many])
    np.testing.assert_array_equal(trajectory_rewards(many, 1.0), want)
    with pytest.raises(ValueError, match="discount must be in"):
        trajectory_rewards(rewards, 0.0)


def test_each_thread_reads_the_stats_of_its_own_last_call():
    """An asynchronous run decodes on one decoder from two threads: the producer's rollout
    (its `env/...` and `rollout/...` figures come from `dec.stats` after its call) and the
    loop thread's mid-run held-out evaluation. A call on one thread leaves the other's
    figures as they were."""
    import threading

    dec = ContinuousDecoder(CFG, slots=3, tokens_per_dispatch=4)
    key = jax.random.key(3)
    first, second = threading.Event(), threading.Event()
    seen = {}

    def producer():
        dec.generate(PARAMS, TOKENS, MASK, key, num_samples=G, sampling=GREEDY)
        seen["own"] = dict(dec.stats)
        first.set()
        second.wait(timeout=60)
        seen["after"] = dict(dec.stats)

    t = threading.Thread(target=producer)
    t.start()
    assert first.wait(timeout=60)
    dec.generate(PARAMS, TOKENS[:1], MASK[:1], key, num_samples=1, sampling=GREEDY)
    mine = dict(dec.stats)
    second.set()
    t.join(timeout=60)
    assert seen["own"]["prompts_prefilled"] == len(PROMPTS)
    assert mine["prompts_prefilled"] == 1
    assert seen["after"] == seen["own"]


class SleepEnv:
    """One step per episode, done at once with reward 1; rows with `sleep` wait that long."""

    name = "sleep"

    def system_prompt(self):
        return ""

    def start(self, row):
        class Episode:
            async def step(self, text, *, length=None):
                await asyncio.sleep(row.get("sleep", 0.0))
                return Step("", 1.0, True)

        return Episode()

    def stats(self):
        return {}

    def close(self):
        pass


def test_a_batchs_env_step_seconds_count_its_own_steps_only():
    """Another caller's step on the same runner (an asynchronous run's held-out episodes on
    the loop thread beside the producer's batch) is not in the batch's `env/step_s`."""
    rows = [{"problem": f"p{i}", "answer": "7"} for i in range(len(PROMPTS))]
    with EnvRunner(SleepEnv(), max_in_flight=4) as runner:
        turns = EnvTurns(runner, rows, encode=encode, decode=decode, max_turns=1)
        turns.bind(MASK, G, GREEDY)
        other = runner.start({"problem": "q", "answer": "7", "sleep": 0.5})
        runner.submit(other, "1 2").result(timeout=30)  # not this batch's
        turns.end_turn(0, np.array([1, STOPS[0]]))
        assert [b for b, _ in turns.answers(np.full(len(rows) * G, 2), block=True)] == [0]
        total = runner.stats()["env/step_s_sum"]
        own = turns.stats()["env/step_s"]
    assert total >= 0.5 > own
    assert own == sum(turns.step_seconds) and len(turns.step_seconds) == 1
