"""Builds the tool-using variant of the embedded policy: `tiny_qwen2` warmed up further on
chat prompts, some of which offer a calculator, over the tool task's long chains.

    # the committed policy: learn to call (copying the expression), then call less often
    python scripts/make_tiny_tool_policy.py --steps 1200 --call_fraction 0.8 --lr 2e-3 \
        --eval_every 200 --out /tmp/tools_phase1
    python scripts/make_tiny_tool_policy.py --base /tmp/tools_phase1 --steps 200 \
        --call_fraction 0.15 --lr 5e-4 --eval_every 50

Starts from the committed `gjax/assets/tiny_qwen2` (its weights; the padding rows 102-105 of
its embedding become the tool tags of `build_tokenizer(tools=True)`) and trains on the tool
task (`configs.common.TOOL_TASK`: chains of 2-6 operations, values up to 999, where the
embedded policy's 4-operation pass@1 is ~0.02). Prompts are rendered by the variant's own chat
template (`TOOL_CHAT_TEMPLATE`, through `gjax.envs.prompt_tools`, so they are the prompts
`gjax.train` builds for `env.name='tool'`); half of them offer the calculator. Targets:

* a prompt without tools: the worked demonstration or the bare boxed answer (half each);
* a prompt with the calculator: with probability `--call_fraction` a two-turn episode (the
  call `<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>`, the
  environment's turn with the value, exactly as `gjax.envs.tool_calls.tool_turn` writes it,
  then the boxed value), else the same worked / bare answers.

The environment's tokens are inputs only (the loss covers the policy's tokens), as in RL.
Copying a 20-character expression into the call is what the 4-layer policy learns slowly
(at call fraction 0.3 and 400 steps, 6 % of its calls copied the expression; at 0.8, 49 % by
step 400 and 89 % by step 600), so the committed policy is made in two runs: the first
teaches the call with `--call_fraction 0.8`, the second (`--base` the first) lowers it to
0.15, so that RL with tools has a behaviour to discover from its own samples (call the tool
on a long chain) rather than knowledge to add, as the embedded policy's worked / bare mix
does (scripts/make_tiny_policy.py). A run from a `--base` that has a warmup.json keeps that
log under "base_warmup".

`warmup.json` logs, every `--eval_every` steps, greedy episodes on the first 256 test problems
of seed `--seed` + 2: with tools offered (the share of first turns that call the calculator,
of calls that copy the problem's expression, of episodes answered right) and without (the
share answered right), each also by chain length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_tiny_policy import sft_step  # noqa: E402

from configs.common import TOOL_TASK  # noqa: E402
from gjax.data import synthetic  # noqa: E402
from gjax.data.prompts import left_pad  # noqa: E402
from gjax.data.tokenizer import IM_END, build_tokenizer  # noqa: E402
from gjax.envs import tool_calls  # noqa: E402
from gjax.models import hf_export, hf_import  # noqa: E402
from gjax.rollout.sampler import SamplingParams, generate  # noqa: E402

PROMPT_LEN, TRAJECTORY_LEN = 96, 128  # the `tools` config's max_prompt_len, max_new_tokens


def calculator_spec() -> dict:
    """The calculator's function spec, as `gjax.train` renders it for `env.name='tool'`."""
    import configs.grpo  # noqa: PLC0415
    from gjax.envs import prompt_tools  # noqa: PLC0415

    c = configs.grpo.get_config("tiny")
    c.env.name, c.env.tools = "tool", "calculator"
    (spec,) = prompt_tools(c.env)
    return spec


def call_text(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"{tool_calls.OPEN}\n{body}\n{tool_calls.CLOSE}"


class Encoder:
    def __init__(self, tok, spec):
        self.tok, self.spec = tok, spec
        self.end = tok.convert_tokens_to_ids(IM_END)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, problem, with_tools: bool) -> list[int]:
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": problem.problem}],
            tools=[self.spec] if with_tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.ids(text)

    def trajectory(self, problem, style: str) -> tuple[list[int], list[bool]]:
        """(tokens, policy-token mask) after the prompt; style: call | worked | bare."""
        if style == "call":
            parts = [
                (self.ids(call_text(problem.expression)) + [self.end], True),
                (self.ids(tool_calls.tool_turn([problem.answer])), False),
                (self.ids(f"{synthetic.BOXED}{problem.answer}}}") + [self.end], True),
            ]
        else:
            text = (
                problem.demonstration
                if style == "worked"
                else (f"{synthetic.BOXED}{problem.answer}}}")
            )
            parts = [(self.ids(text) + [self.end], True)]
        ids = [i for p, _ in parts for i in p]
        mask = [m for p, m in parts for _ in p]
        return ids, mask

    def batch(self, problems, with_tools, styles) -> dict:
        prompts = [self.prompt(p, w) for p, w in zip(problems, with_tools)]
        if max(map(len, prompts)) > PROMPT_LEN:
            raise ValueError(f"a prompt of {max(map(len, prompts))} tokens > {PROMPT_LEN}")
        p_ids, p_mask = left_pad(
            [np.asarray(x) for x in prompts], PROMPT_LEN, self.tok.pad_token_id
        )
        t_ids = np.full((len(problems), TRAJECTORY_LEN), self.tok.pad_token_id, np.int32)
        t_valid = np.zeros((len(problems), TRAJECTORY_LEN), bool)
        t_loss = np.zeros((len(problems), TRAJECTORY_LEN), bool)
        for i, (p, s) in enumerate(zip(problems, styles)):
            ids, mask = self.trajectory(p, s)
            if len(ids) > TRAJECTORY_LEN:
                raise ValueError(f"a {s} trajectory of {len(ids)} tokens > {TRAJECTORY_LEN}")
            t_ids[i, : len(ids)], t_valid[i, : len(ids)], t_loss[i, : len(ids)] = ids, True, mask
        ids = np.concatenate([p_ids, t_ids], 1)
        valid = np.concatenate([p_mask.astype(bool), t_valid], 1)
        pos = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
        seg = np.concatenate([p_mask, np.ones_like(t_valid)], 1).astype(np.int32)
        return dict(ids=ids, pos=pos, seg=seg, targets=t_ids, tmask=t_loss)


def _generate(params, cfg, enc, prompts, max_new):
    p_ids, p_mask = left_pad([np.asarray(x) for x in prompts], max(map(len, prompts)), 0)
    sp = SamplingParams(
        max_new_tokens=max_new,
        temperature=0.0,
        stop_token_ids=tuple(cfg.eos_token_id),
        pad_token_id=enc.tok.pad_token_id,
    )
    out = generate(params, cfg, p_ids, p_mask, jax.random.key(0), num_samples=1, sampling=sp)
    ids, n = np.asarray(out.tokens_BxN), np.asarray(out.lengths_B)
    return [[int(t) for t in r[:k]] for r, k in zip(ids, n)]


def _value(call) -> str:
    """What the calculator answers a well-formed call with (the script's own evaluator of the
    task's +-* grammar; the study's runs use the sandboxed tool)."""
    if isinstance(call, tool_calls.MalformedCall) or call.name != "calculator":
        return "error"
    try:
        return str(synthetic.evaluate(synthetic.parse_expression(call.arguments["expression"])))
    except Exception:  # noqa: BLE001
        return "error"


def evaluate(params, cfg, enc, problems) -> dict:
    """Greedy episodes with tools offered (two turns at most) and single turns without."""
    dec = lambda ids: enc.tok.decode(ids, skip_special_tokens=True)
    right = lambda text, p: synthetic.extract_boxed(text) == p.answer
    ops = np.array([p.num_ops for p in problems])
    prompts = [enc.prompt(p, True) for p in problems]
    first = _generate(params, cfg, enc, prompts, TRAJECTORY_LEN)
    calls = [tool_calls.parse_tool_calls(dec(t)) for t in first]
    called = np.array([bool(c) for c in calls])
    copied = np.array(
        [
            bool(c)
            and isinstance(c[0], tool_calls.ToolCall)
            and c[0].arguments.get("expression") == p.expression
            for c, p in zip(calls, problems)
        ]
    )
    final = [dec(t) for t in first]
    again = [i for i in range(len(problems)) if called[i]]
    if again:
        histories = [
            prompts[i] + first[i] + enc.ids(tool_calls.tool_turn([_value(calls[i][0])]))
            for i in again
        ]
        room = PROMPT_LEN + TRAJECTORY_LEN - max(map(len, histories))
        for i, t in zip(again, _generate(params, cfg, enc, histories, max(room, 1))):
            final[i] = dec(t)
    tools_right = np.array([right(t, p) for t, p in zip(final, problems)])
    plain = _generate(params, cfg, enc, [enc.prompt(p, False) for p in problems], TRAJECTORY_LEN)
    plain_right = np.array([right(dec(t), p) for t, p in zip(plain, problems)])
    out = {
        "call_fraction": float(called.mean()),
        "copied_fraction": float(copied[called].mean()) if called.any() else 0.0,
        "tools_accuracy": float(tools_right.mean()),
        "no_tools_accuracy": float(plain_right.mean()),
    }
    for n in sorted(set(ops)):
        sel = ops == n
        out[f"ops={n}"] = {
            "call_fraction": float(called[sel].mean()),
            "tools_accuracy": float(tools_right[sel].mean()),
            "no_tools_accuracy": float(plain_right[sel].mean()),
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=os.path.join("gjax", "assets", "tiny_qwen2"))
    ap.add_argument("--out", default=os.path.join("gjax", "assets", "tiny_qwen2_tools"))
    ap.add_argument("--steps", type=int, default=400, help="length of the lr schedule")
    ap.add_argument("--tools_fraction", type=float, default=0.5, help="prompts offering tools")
    ap.add_argument(
        "--call_fraction",
        type=float,
        default=0.3,
        help="share of the tool-offering prompts whose target calls the calculator",
    )
    ap.add_argument("--bare_fraction", type=float, default=0.5, help="of the answers not calling")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval_every", type=int, default=100)
    args = ap.parse_args()

    tok = build_tokenizer(tools=True)
    base_cfg, params = hf_import.load_pretrained(args.base)
    if len(tok) > base_cfg.vocab_size:
        raise SystemExit(
            f"{args.base}: vocab {base_cfg.vocab_size} < the tool tokenizer's {len(tok)}"
        )
    end = tok.convert_tokens_to_ids(IM_END)
    # A chat turn ends with <|im_end|> (Qwen2.5-Instruct's generation config lists it first).
    cfg = base_cfg.replace(eos_token_id=(end, tok.eos_token_id))
    enc = Encoder(tok, calculator_spec())
    task = synthetic.SyntheticConfig(**TOOL_TASK)
    train = synthetic.generate(args.steps * args.batch, "train", seed=args.seed + 1, config=task)
    heldout = synthetic.generate(256, "test", seed=args.seed + 2, config=task)
    rng = np.random.default_rng(args.seed + 3)
    with_tools = rng.random(len(train)) < args.tools_fraction
    calls = with_tools & (rng.random(len(train)) < args.call_fraction)
    bare = rng.random(len(train)) < args.bare_fraction
    styles = np.where(calls, "call", np.where(bare, "bare", "worked"))
    tx, step = sft_step(cfg, args.lr, args.steps)
    opt = tx.init(params)

    t0 = time.time()
    log = [{"step": 0, **evaluate(params, cfg, enc, heldout)}]
    print(json.dumps(log[-1]), flush=True)
    for i in range(args.steps):
        rows = slice(i * args.batch, (i + 1) * args.batch)
        b = enc.batch(train[rows], with_tools[rows], styles[rows])
        params, opt, loss = step(params, opt, b)
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            log.append({"step": i + 1, "loss": float(loss), **evaluate(params, cfg, enc, heldout)})
            print(json.dumps({**log[-1], "elapsed_s": round(time.time() - t0, 1)}), flush=True)
    hf_export.save_pretrained(params, cfg, args.out, tokenizer=tok)
    record = {"args": vars(args), "log": log}
    try:
        with open(os.path.join(args.base, "warmup.json")) as f:
            base_log = json.load(f)
        if "call_fraction" in base_log["log"][-1]:  # the base is a tool warm-up's: keep it
            record["base_warmup"] = base_log
    except OSError:
        pass
    with open(os.path.join(args.out, "warmup.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
