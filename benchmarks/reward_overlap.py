"""Serial vs overlapped reward step: host rewards + judge || device log-probs.

    python benchmarks/reward_overlap.py [--batch 16] [--judge-latency 0.1] [--steps 4]

One "step" = rewards for a rollout batch (the math-verify verifier through the reward registry
and an `OpenAIJudge` over real HTTP against the scripted local server of tests/judge_server.py,
each request taking `--judge-latency` s) and a jitted device computation standing in for the
old/ref log-probs. Serial: rewards, then device. Overlapped: `submit`, device work,
`result()`. Prints one JSON line: mean times per step, the speedup serial/overlapped and the
ideal (reward + device) / max(reward, device). Every step uses fresh completions so the
judge's cache never hits. CPU-only; numbers on a shared 2-core box are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gjax.rewards.judge import OpenAIJudge  # noqa: E402
from gjax.rewards.pipeline import RewardPipeline  # noqa: E402
from tests.judge_server import JudgeServer  # noqa: E402


def make_device_fn(dim: int, iters: int):
    @jax.jit
    def logps(x):
        for _ in range(iters):
            x = jnp.tanh(x @ x.T / dim) @ x
        return jax.nn.log_softmax(x, axis=-1)

    return logps


def calibrate(target_s: float, dim: int = 256) -> tuple:
    """A device function taking roughly `target_s` seconds."""
    x = jnp.ones((dim, dim), jnp.float32) / dim
    iters = 4
    while True:
        fn = make_device_fn(dim, iters)
        fn(x).block_until_ready()
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        dt = time.perf_counter() - t0
        if dt >= target_s or iters >= 4096:
            return fn, x
        iters = max(iters + 1, int(iters * min(4.0, target_s / max(dt, 1e-4))))


def batch(step: int, size: int):
    prompts = [f"Compute {i}+{step}." for i in range(size)]
    completions = [
        f"{i}+{step}={i + step}\n\\boxed{{{i + step + (i % 3 == 0)}}}" for i in range(size)
    ]
    answers = [str(i + step) for i in range(size)]
    refs = [f"{i}+{step}={i + step}\n\\boxed{{{i + step}}}" for i in range(size)]
    return prompts, completions, answers, refs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--judge-latency", type=float, default=0.1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-verifier", action="store_true", help="exact-match reward instead")
    args = ap.parse_args()

    verifier = None
    if args.no_verifier:

        def reward(prompts, completions, answers, *, completion_lengths, **metadata):
            return [float(c.endswith(f"{{{a}}}")) for c, a in zip(completions, answers)]

    else:
        from gjax.rewards.functions import build_reward
        from gjax.rewards.verifier import Verifier

        verifier = Verifier()
        reward = build_reward([{"name": "accuracy"}], verifier=verifier)

    with JudgeServer(default=f"sleep:{args.judge_latency}|score:7") as server:
        judge = OpenAIJudge(
            model="bench-judge",
            base_url=server.base_url,
            api_key="bench",
            max_concurrency=args.concurrency,
            timeout_s=30,
        )
        with RewardPipeline({"accuracy": reward}, judge=judge) as pipe:
            step = 0

            def rewards_only():
                nonlocal step
                step += 1
                t0 = time.perf_counter()
                pipe.submit(*batch(step, args.batch)[:3], batch(step, args.batch)[3]).result()
                return time.perf_counter() - t0

            rewards_only()  # warm up the client, the verifier pool, the loop
            reward_s = float(np.median([rewards_only() for _ in range(2)]))
            device_fn, x = calibrate(reward_s)
            t0 = time.perf_counter()
            device_fn(x).block_until_ready()
            device_s = time.perf_counter() - t0

            serial, overlapped, frac, wait = [], [], [], []
            for _ in range(args.steps):
                step += 1
                p, c, a, r = batch(step, args.batch)
                t0 = time.perf_counter()
                pipe.submit(p, c, a, r).result()
                device_fn(x).block_until_ready()
                serial.append(time.perf_counter() - t0)

                step += 1
                p, c, a, r = batch(step, args.batch)
                t0 = time.perf_counter()
                handle = pipe.submit(p, c, a, r)
                device_fn(x).block_until_ready()
                res = handle.result()
                overlapped.append(time.perf_counter() - t0)
                frac.append(res.metrics["rewards/overlap_frac"])
                wait.append(res.metrics["rewards/wait_s"])
            stats = judge.stats()
    if verifier is not None:
        verifier.close()

    serial_s, overlapped_s = float(np.mean(serial)), float(np.mean(overlapped))
    print(
        json.dumps(
            {
                "benchmark": "reward_overlap",
                "batch": args.batch,
                "judge_latency_s": args.judge_latency,
                "judge_concurrency": args.concurrency,
                "verifier": not args.no_verifier,
                "reward_s": round(reward_s, 4),
                "device_s": round(device_s, 4),
                "serial_step_s": round(serial_s, 4),
                "overlapped_step_s": round(overlapped_s, 4),
                "speedup": round(serial_s / overlapped_s, 3),
                "ideal_speedup": round((reward_s + device_s) / max(reward_s, device_s), 3),
                "overlap_frac_mean": round(float(np.mean(frac)), 3),
                "wait_s_mean": round(float(np.mean(wait)), 4),
                "judge_calls": int(stats["calls"]),
                "judge_cache_hits": int(stats["cache_hits"]),
                "jax_backend": jax.default_backend(),
            }
        )
    )


if __name__ == "__main__":
    main()
