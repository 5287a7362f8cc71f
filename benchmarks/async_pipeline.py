"""Rollouts overlapping training: steps/s and tokens/s for max_staleness k = 0, 1, 2,
collocated and on split rollout/train meshes.

    python benchmarks/async_pipeline.py [--devices 2] [--steps 6] [--prompts 8] [--samples 8]
        [--new-tokens 32] [--iterations 1] [--ks 0,1,2]

Each run trains the embedded policy (gjax/assets/tiny_qwen2) on the synthetic task through
the production pieces of `gjax.train`'s loop (`make_producer`, `producer.get`,
`learner.batch`, the jitted update, `producer.push`), after one warm-up step that compiles
everything.
Per run one JSON line: steps/s, completion tokens/s, mean rollout and update times, the
learner-idle fraction (time the learner waited for data / wall) and the rollout-idle fraction
(time the producer waited for weights / wall; for the synchronous loop, the update's share,
during which nothing samples). The last line is the summary with the ratios against k = 0
collocated. `--iterations` (GRPO's mu) makes the update heavier, to balance it with the
rollout. Split meshes use `--devices` fake CPU devices (half for rollouts); on a CPU those
share the same cores, so the overlap is bounded by the cores: on a 2-core machine with two
busy threads it cannot exceed what the second core adds. On an accelerator the devices are
real and the split is the deployment shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2, help="fake CPU devices (split: half each)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (after 1 warm-up)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument("--no-split", action="store_true")
    return ap.parse_args()


if __name__ == "__main__":  # fake devices before jax loads (an importer has its own)
    ARGS = parse()
    if ARGS.devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={ARGS.devices}"
        ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import common  # noqa: E402
from gjax import sharding  # noqa: E402
from gjax.data.builders import build_prompt_data  # noqa: E402
from gjax.data.iterator import PromptIterator  # noqa: E402
from gjax.embedded import resolve_model_path  # noqa: E402
from gjax.learner import build_learner  # noqa: E402
from gjax.models import hf_import  # noqa: E402
from gjax.rewards.pipeline import build_rewards  # noqa: E402
from gjax.rewards.verifier import Verifier  # noqa: E402
from gjax.rollout import LocalSampler  # noqa: E402
from gjax.rollout.collect import Rollout  # noqa: E402
from gjax.rollout.producer import AsyncProducer, make_producer  # noqa: E402


def config(k: int):
    c = common.tiny(common.base())
    c.rollout.prompts_per_step, c.rollout.num_samples = ARGS.prompts, ARGS.samples
    c.rollout.max_new_tokens = ARGS.new_tokens
    c.rollout.max_staleness = k
    c.train.num_iterations = ARGS.iterations
    c.train.steps = ARGS.steps + 1 + k  # the producer keeps sampling through the timed window
    c.objective.kl_beta = 0.0  # no reference pass: rollout vs update only
    return c


def run(k: int, split: bool, verifier) -> dict:
    """One run on the embedded policy: max_staleness k, collocated or on split meshes."""
    c = config(k)
    devices = jax.devices()
    n_roll = len(devices) // 2 if split else 0
    mesh, rollout_mesh = sharding.make_meshes({"data": -1}, n_roll, devices)
    with jax.set_mesh(mesh), sharding.use_rules():
        path = resolve_model_path(c.model.path)
        cfg, params = hf_import.load_pretrained(
            path, mesh=mesh, param_dtype="float32", dtype="float32"
        )
        tok = hf_import.load_tokenizer(path)
        rewards = build_rewards(c, verifier)
        out = train_loop(
            c,
            cfg=cfg,
            params=params,
            tokenizer=tok,
            rewards=rewards,
            mesh=mesh,
            rollout_mesh=rollout_mesh,
            backend=LocalSampler(cfg),
            steps=ARGS.steps,
        )
        rewards.close()
    out.pop("per_step")
    return {
        "what": "run",
        "k": k,
        "placement": "split" if split else "collocated",
        "train_devices": len(devices) - n_roll,
        "rollout_devices": n_roll or len(devices),
        **out,
    }


def train_loop(
    c,
    *,
    cfg,
    params,
    tokenizer,
    rewards,
    mesh,
    rollout_mesh,
    backend,
    steps: int,
    ref_params=None,
    full_length: bool = False,
) -> dict:
    """`steps` timed steps of `gjax.train`'s loop (after one that compiles everything) through
    its production pieces: `make_producer` (config `c`'s max_staleness), `producer.get`,
    `learner.batch` (`ref_params`: the reference's, None: no reference pass), the jitted
    update, `producer.push`. `full_length`: no stop ids (every completion max_new_tokens
    long: the same shapes every step, so nothing compiles after the first). Returns steps/s, completion tokens/s, the idle fractions and,
    per timed step, where its time went (`per_step`: the wait for the batch, the rollout's
    own sample / rollout times, the learner's, the step's)."""
    obj_cfg = common.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
    state, learner = build_learner(c, mesh=mesh, model_cfg=cfg, obj_cfg=obj_cfg, params=params)
    it = PromptIterator(
        build_prompt_data(c.data, tokenizer),
        global_batch_size=c.rollout.prompts_per_step,
        seed=0,
        process_index=0,
        process_count=1,
    )
    rollout = Rollout(
        model_cfg=cfg,
        backend=backend,
        tokenizer=tokenizer,
        rewards=rewards,
        transfer=learner.transfer,
        config=c,
    )
    if full_length:
        rollout.sampling = dataclasses.replace(rollout.sampling, stop_token_ids=())
    base_key = jax.random.key(c.seed)
    producer = make_producer(
        rollout=rollout,
        data_iter=it,
        params=state.params,
        base_key=base_key,
        config=c,
        start=0,
        train_mesh=mesh,
        rollout_mesh=rollout_mesh,
        backend=backend,
    )
    overlapped = isinstance(producer, AsyncProducer)
    acc = {"learner_idle": 0.0, "rollout_idle": 0.0, "tokens": 0, "per_step": []}
    t_start = None
    try:
        for step in range(steps + 1):
            if step == 1:  # step 0 compiled everything
                t_start = time.perf_counter()
                acc.update(learner_idle=0.0, rollout_idle=0.0, tokens=0, per_step=[])
            key = jax.random.fold_in(base_key, step)
            t0 = time.perf_counter()
            got = producer.get(step)  # synchronous: the rollout itself; else the wait for it
            t1 = time.perf_counter()
            acc["learner_idle"] += t1 - t0
            batch = learner.batch(got.groups, state.params, ref_params)
            state, metrics = learner.update(state, batch, jax.random.fold_in(key, 10_000))
            producer.push(state.params, step + 1)
            jax.block_until_ready(metrics)
            t2 = time.perf_counter()
            if not overlapped:  # nothing samples during the update
                acc["rollout_idle"] += t2 - t1
            tokens = int(got.groups.completion_mask_PxGxN.sum())
            acc["tokens"] += tokens
            acc["per_step"].append(
                {
                    "get_s": t1 - t0,
                    "sample_s": got.metrics["time/sample_s"],
                    "rollout_s": got.metrics["time/rollout_s"],
                    "learner_s": t2 - t1,
                    "step_s": t2 - t0,
                    "completion_tokens": tokens,
                    "prompt_tokens": int(got.groups.prompt_mask_PxS.sum()) * c.rollout.num_samples,
                }
            )
        t_end = time.perf_counter()
    finally:
        producer.close()
    wall = t_end - t_start
    if overlapped:  # producer waits for weights, clipped to the timed window
        acc["rollout_idle"] = sum(
            max(0.0, min(b, t_end) - max(a, t_start)) for a, b in producer.wait_intervals
        )
    per = acc["per_step"]
    return {
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "tokens_per_s": acc["tokens"] / wall,
        "rollout_s_mean": float(np.mean([r["rollout_s"] for r in per[1:] or per])),
        "update_s_mean": float(np.mean([r["learner_s"] for r in per])),
        "learner_idle_frac": acc["learner_idle"] / wall,
        "rollout_idle_frac": acc["rollout_idle"] / wall,
        "per_step": per,
    }


def main():
    ks = [int(x) for x in ARGS.ks.split(",")]
    print(
        json.dumps(
            {
                "what": "setup",
                "devices": jax.device_count(),
                "platform": jax.devices()[0].platform,
                "cpu_count": os.cpu_count(),
                "P": ARGS.prompts,
                "G": ARGS.samples,
                "max_new_tokens": ARGS.new_tokens,
                "num_iterations": ARGS.iterations,
            }
        ),
        flush=True,
    )
    verifier = Verifier(timeout_s=5.0, num_workers=1)
    results = {}
    placements = [False] + ([] if ARGS.no_split or jax.device_count() < 2 else [True])
    for split in placements:
        for k in ks:
            r = run(k, split, verifier)
            results[(r["placement"], k)] = r
            print(json.dumps(r), flush=True)
    verifier.close()
    base = results[("collocated", ks[0])]["steps_per_s"]
    summary = {"what": "summary", "baseline": f"collocated k={ks[0]}"}
    for (placement, k), r in results.items():
        summary[f"{placement}_k{k}_steps_per_s"] = r["steps_per_s"]
        summary[f"{placement}_k{k}_over_baseline"] = r["steps_per_s"] / base
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
