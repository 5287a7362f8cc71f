"""Held-out evaluation over episodes (gjax.evaluation.episodes) on the embedded policy, in this
process: on the one-step `math` environment it equals the single-turn evaluation sample for
sample; on `tool` it runs episodes of the environment (its figures present, pass@k in range).
A small held-out set (6 problems, 4 samples each) on the local continuous decoder."""

import os

import jax
import ml_collections
import numpy as np
import pytest

from gjax.evaluation.episodes import FIGURES, EpisodeSampler, final_turn
from gjax.evaluation.heldout import HeldoutEval, SingleTurn, heldout_metrics
from gjax.rollout.turns import build_turns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "gjax", "assets", "tiny_qwen2")

needs_policy = pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="no embedded policy")

SETTINGS = HeldoutEval.from_config(
    ml_collections.ConfigDict(
        dict(num_samples=4, temperature=0.7, top_p=1.0, pass_k="1,4", max_rows=256)
    )
)


def config(**env):
    from configs import grpo

    c = grpo.get_config("tiny")
    c.data.heldout_size = 6
    c.rollout.prompts_per_step = 2
    c.rollout.num_samples = 4
    c.env.update(env)
    return c


@pytest.fixture(scope="module")
def verifier():
    from gjax.rewards.pipeline import build_verifier

    with build_verifier(config()) as v:
        yield v


@pytest.fixture(scope="module")
def run(verifier):
    """The pieces of a run that the held-out evaluation uses: the policy, its tokenizer, the
    held-out set, the verifier and reward function, the continuous decoder's backend."""
    from gjax.data.builders import build_prompt_data
    from gjax.models import hf_import
    from gjax.rewards.pipeline import build_rewards
    from gjax.rollout.factory import make_backend

    c = config()
    cfg, params = hf_import.load_pretrained(EMBEDDED)
    tok = hf_import.load_tokenizer(EMBEDDED)
    data = build_prompt_data(c.data, tok, heldout=True)
    with build_rewards(c, verifier) as rewards:
        backend = make_backend(c, cfg, params)
        yield dict(
            cfg=cfg,
            params=params,
            tok=tok,
            data=data,
            verifier=verifier,
            reward_fn=rewards.reward_fns["reward"],
            backend=backend,
        )
        backend.close()


@pytest.fixture
def episodes(run):
    """An EpisodeSampler on `config(**env)`'s environment, with the run's reward function."""
    from gjax.envs import EnvRunner, build_env

    runners = []

    def make(**env):
        c = config(**env)
        runner = EnvRunner(build_env(c, reward_fn=run["reward_fn"]))
        runners.append(runner)
        return EpisodeSampler(lambda rows: build_turns(c, runner, rows, run["tok"]))

    yield make
    for r in runners:
        r.close()


def evaluate(run, sampler, **kw):
    from gjax.rollout.backend import stop_and_pad

    eos, pad_id = stop_and_pad(run["cfg"], run["tok"])
    return heldout_metrics(
        run["backend"], run["params"], run["tok"], run["data"], run["verifier"], SETTINGS,
        max_new_tokens=config().rollout.max_new_tokens, eos=eos, pad_id=pad_id,
        sampler=sampler, **kw,
    )  # fmt: skip


def test_final_turn_is_the_last_run_of_policy_tokens():
    tokens = np.arange(10, 20)
    mask = np.array([1, 1, 0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(final_turn(tokens, mask, 7), [14, 15, 16])
    np.testing.assert_array_equal(final_turn(tokens, mask, 5), [14])  # its length bounds it
    np.testing.assert_array_equal(final_turn(tokens, np.ones(10), 4), [10, 11, 12, 13])
    assert final_turn(tokens, np.zeros(10), 10).size == 0


@needs_policy
def test_math_env_episodes_equal_the_single_turn_evaluation(run, episodes, monkeypatch):
    """Same prompts, same keys -> the same samples, scores and pass@k, greedy and sampled,
    in the evaluation's own batch shape and in the rollout's."""
    from gjax.evaluation import episodes as episodes_lib
    from gjax.evaluation import heldout as heldout_lib

    drawn = {"single": [], "episodes": []}
    for name, module, fn in (
        ("single", heldout_lib, "sample_and_score"),
        ("episodes", episodes_lib, "sample_episodes"),
    ):
        real = getattr(module, fn)

        def record(*a, _real=real, _name=name, **kw):
            out = _real(*a, **kw)
            drawn[_name].append(out)
            return out

        monkeypatch.setattr(module, fn, record)
    math_env = episodes(name="math")
    rollout = _sampled(run)
    for kw in ({}, dict(rollout_sampling=rollout, rollout_shape=(2, 4))):
        single = evaluate(run, SingleTurn(), **kw)
        multi = evaluate(run, math_env, **kw)
        assert {k: multi[k] for k in single} == single  # exact, not approximate
        assert set(multi) - set(single) == {
            f"eval/heldout_{p}{k}" for p in ("", "sampled_") for k in FIGURES
        }
        assert multi["eval/heldout_turns_mean"] == multi["eval/heldout_sampled_turns_mean"] == 1
        assert multi["eval/heldout_tool_calls_mean"] == 0
        assert 0 < single["eval/heldout_pass@1"] < single["eval/heldout_pass@4"] < 1
    assert len(drawn["single"]) == len(drawn["episodes"]) == 4  # greedy, sampled; twice
    for a, b in zip(drawn["single"], drawn["episodes"], strict=True):
        assert a.texts == b.texts
        for field in ("correct_PxN", "lengths_PxN", "truncated_PxN"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert a.keys == b.keys
        np.testing.assert_array_equal(b.turns_PxN, 1)


def _sampled(run):
    """The sampling a rollout of `config()` draws with (rollout.temperature 0.7, top-p 1)."""
    from gjax.rollout.backend import stop_and_pad
    from gjax.rollout.sampler import SamplingParams

    eos, pad_id = stop_and_pad(run["cfg"], run["tok"])
    return SamplingParams(
        max_new_tokens=config().rollout.max_new_tokens,
        temperature=SETTINGS.temperature,
        top_p=SETTINGS.top_p,
        stop_token_ids=eos,
        pad_token_id=pad_id,
    )


@needs_policy
def test_tool_env_evaluation_runs_episodes(run, episodes):
    """The `tool` environment with the calculator: every figure is there and in range; the
    embedded policy was never taught tool calls, so its episodes answer in one turn and
    score as its single completions do (the tool env's final turn is verified alike)."""
    tool = episodes(name="tool", tools="calculator")
    m = evaluate(run, tool)
    single = evaluate(run, SingleTurn())
    for p in ("", "sampled_"):
        assert 1 <= m[f"eval/heldout_{p}turns_mean"] <= config().env.max_turns
        assert m[f"eval/heldout_{p}tool_calls_mean"] >= 0
        assert 0 <= m[f"eval/heldout_{p}truncated_frac"] <= 1
    assert 0 <= m["eval/heldout_pass@1"] <= m["eval/heldout_pass@4"] <= 1
    assert 0 <= m["eval/heldout_accuracy"] <= 1
    assert m["eval/heldout_accuracy"] == single["eval/heldout_accuracy"]


@pytest.mark.parametrize("name", ["tool", "math", ""])
def test_gjax_eval_refuses_checkpoints_of_multi_turn_runs(tmp_path, name):
    """gjax.eval samples single completions: a run on a multi-turn environment is refused in
    one paragraph (its CLI prints it, exit 2); the one-step `math` and single-turn runs pass."""
    import json

    from gjax import eval as ev
    from gjax.errors import format_user_error
    from gjax.evaluation.metrics import EvalError

    wd = tmp_path / "run"
    (wd / "checkpoints").mkdir(parents=True)
    run = config(name=name).to_dict()
    run["model"]["path"] = EMBEDDED
    (wd / "config.json").write_text(json.dumps(run))
    for flag in ("--checkpoint", "--write_lm_eval_task"):
        if name in ("math", ""):
            assert ev._model_and_run(str(wd), None)[1]["env"]["name"] == name
            continue
        with pytest.raises(EvalError) as err:
            if flag == "--checkpoint":
                ev._model_and_run(str(wd), None)
            else:
                ev.write_lm_eval_tasks(str(tmp_path / "tasks"), checkpoint=str(wd))
        msg = str(err.value)
        assert "'tool' environment" in msg and "--model=DIR" in msg and "\n" not in msg
        printed = format_user_error(err.value).strip()  # what the CLI prints: one paragraph
        assert printed.startswith("gjax: --checkpoint=") and "\n\n" not in printed
    assert not (tmp_path / "tasks").exists()


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class CallOrAnswer:
    """A test tokenizer for a random policy: a turn whose first id is even reads as a
    calculator call (6*7), one whose first id is odd as the answer \\boxed{42}; every
    observation encodes as [20, 22] (and is recorded). With every odd id a stop id, a turn
    ends at its first odd id, so the random policy's episodes mix calls and answers."""

    def __init__(self):
        self.observations = []

    def decode(self, ids, skip_special_tokens=True):
        ids = [int(i) for i in ids]
        return "" if not ids else CALL if ids[0] % 2 == 0 else "\\boxed{42}"

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [self.decode(s) for s in seqs]

    def __call__(self, text, add_special_tokens=False):
        self.observations.append(text)
        return {"input_ids": [20, 22]}


def test_tool_episodes_count_calls_and_score_the_final_turn(verifier):
    """Multi-turn episodes of the real `tool` environment (calculator in its sandbox) on a
    random policy: turns and tool calls are counted per episode, and an episode is scored by
    its final turn (a call-then-answer episode is correct; one that ran out of turns while
    calling, env.max_turns, is truncated and wrong)."""
    from gjax.data.prompts import PromptData
    from gjax.envs import EnvRunner, ToolEnv, build_tool
    from gjax.evaluation.episodes import sample_episodes
    from gjax.rollout import LocalSampler, SamplingParams
    from gjax.rollout.decoder import ContinuousDecoder
    from gjax.rollout.turns import EnvTurns
    from tests.test_sampler import CFG, PARAMS, PROMPTS

    tok = CallOrAnswer()
    data = PromptData(
        prompt_ids=[np.asarray(p, np.int32) for p in PROMPTS],
        prompts=[f"p{i}" for i in range(3)],
        problems=[f"p{i}" for i in range(3)],
        answers=["42"] * 3,
        demonstrations=[""] * 3,
        row_index=np.arange(3),
        max_prompt_length=8,
        pad_id=0,
        stats={},
    )
    reward = lambda prompts, completions, answers, **_: [  # noqa: E731
        float("42" in c) for c in completions
    ]
    env = ToolEnv(reward, [build_tool("calculator", config().env)], max_turns=3)
    backend = LocalSampler(CFG, decoder=ContinuousDecoder(CFG, slots=4, tokens_per_dispatch=4))
    sampling = SamplingParams(
        max_new_tokens=32, temperature=1.0, stop_token_ids=tuple(range(1, 64, 2)), pad_token_id=0
    )
    n = 4
    with EnvRunner(env) as runner:
        s = sample_episodes(
            backend, PARAMS, tok, data, verifier, num_samples=n, sampling=sampling,
            rng=jax.random.key(0), max_rows=8,
            make_turns=lambda rows: EnvTurns(
                runner, rows, encode=lambda t: tok(t)["input_ids"], decode=tok.decode, max_turns=3
            ),
        )  # fmt: skip
    assert s.correct_PxN.shape == s.turns_PxN.shape == (3, n)
    assert (s.tool_errors_PxN == 0).all()
    assert any("<tool_response>\n42\n</tool_response>" in o for o in tok.observations)
    answered = s.correct_PxN == 1
    # A call-then-answer episode: correct, one call per turn before its last.
    np.testing.assert_array_equal(answered, ~s.truncated_PxN)
    np.testing.assert_array_equal(s.tool_calls_PxN[answered], s.turns_PxN[answered] - 1)
    # Calling to the end: env.max_turns ended it (truncated), its last turn's call not run.
    assert (s.turns_PxN[~answered] == 3).all() and (s.tool_calls_PxN[~answered] == 2).all()
    assert [t == "\\boxed{42}" for row in s.texts for t in row] == list(answered.reshape(-1))
    assert (s.turns_PxN > 1).any() and answered.any()  # multi-turn episodes, some correct
    figures = EpisodeSampler(None).figures(s)
    assert figures["turns_mean"] == s.turns_PxN.mean() > 1
    assert figures["tool_calls_mean"] == s.tool_calls_PxN.mean() > 0


def test_quantized_multi_turn_run_evaluates_on_a_float_continuous_decoder():
    """rollout.quantize: held-out evaluation samples the float policy (a static sampler for a
    single-turn run); a multi-turn run's episodes need a continuous decoder: it gets its own."""
    from gjax.rollout import LocalSampler
    from gjax.rollout.factory import evaluation_backend, make_backend
    from tests.test_sampler import CFG

    for name in ("", "math"):
        c = config(name=name)
        c.rollout.quantize = "int8"
        backend = make_backend(c, CFG, None)
        assert backend.quantize == "int8" and backend.decoder is not None
        got = evaluation_backend(c, backend, CFG)
        assert isinstance(got, LocalSampler) and got.quantize == "none"
        assert (got.decoder is not None) == bool(name)
