"""The JetStream engine's decode cost per token against the static sampler's, at equal rows.

Static: `gjax.rollout.sampler.generate` on B = P x G rows (greedy, no stop ids, so every row
runs N tokens); its decode cost per token is (time(N) - time(1)) / (B x (N - 1)), prefill
removed. Engine: `gjax.rollout.engine.Engine` with S = B slots, all live, timed over `generate`
calls in steady state (each call `--tokens-per-dispatch` tokens per slot, one host sync, as
JetStream's generate thread runs it); cost per token = call time / (S x k). Times are process
CPU seconds (all threads; steadier than wall time on a shared machine), in interleaved rounds;
the median of the rounds' ratios (ratios, not absolute times, carry over).
`--old-engine PATH` also times another engine.py (e.g. the previous commit's) the same way.

    python benchmarks/engine_step.py                 # the rollout benchmark's 4.2M model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_backends import add_model_args, model_config  # noqa: E402 - this folder, not a package

from gjax.models import transformer as tr
from gjax.rollout import SamplingParams, generate

CLOCK = time.process_time  # CPU seconds of every thread: steadier than wall on a shared machine


def once(fn) -> float:
    t0 = CLOCK()
    jax.block_until_ready(fn())
    return CLOCK() - t0


def engine_run(module, cfg, params, prompts, sp, steps, calls):
    """A function timing `calls` generate calls of `module.Engine` with every slot live
    (slots filled, untimed, before each)."""
    kw = {"tokens_per_dispatch": steps} if steps > 1 else {}
    engine = module.Engine(
        cfg,
        params,
        sampling=sp,
        max_concurrent_decodes=len(prompts),
        max_prefill_length=module.prefill_bucket(max(len(p) for p in prompts)),
        **kw,
    )

    def fresh():
        state = engine.init_decode_state()
        for slot, ids in enumerate(prompts):
            padded = np.zeros((engine.max_prefill_length,), np.int32)
            padded[: len(ids)] = ids
            prefix = engine.prefill(params=params, padded_tokens=padded, true_length=len(ids))
            state = engine.insert(prefix, state, slot)
        return jax.block_until_ready(state)

    def run() -> float:
        state, out = fresh(), None
        t0 = CLOCK()
        for _ in range(calls):
            state, out = engine.generate(params, state)
        np.asarray(out.data)  # the host sync JetStream's detokenize thread does
        return CLOCK() - t0

    run()  # compiles
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tokens-per-dispatch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--old-engine", default="")
    args = ap.parse_args()

    cfg = model_config(args)
    params = tr.init_params(cfg, jax.random.key(0))
    p_, g_, n_ = args.prompts, args.samples, args.new_tokens
    rng = np.random.default_rng(0)
    tokens_PxS = rng.integers(1, cfg.vocab_size, (p_, args.prompt_len)).astype(np.int32)
    mask_PxS = np.ones_like(tokens_PxS)
    sp = SamplingParams(max_new_tokens=n_, temperature=0.0, stop_token_ids=(), pad_token_id=0)

    def static(n):
        s = SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(), pad_token_id=0)
        return lambda: (
            generate(
                params,
                cfg,
                jnp.asarray(tokens_PxS),
                jnp.asarray(mask_PxS),
                jax.random.key(0),
                num_samples=g_,
                sampling=s,
            ).tokens_BxN
        )

    b_ = p_ * g_
    full, one = static(n_), static(1)
    once(full), once(one)  # compile
    prompts = [tokens_PxS[b // g_] for b in range(b_)]
    k_ = args.tokens_per_dispatch
    calls = (n_ - 1) // k_  # every call with every slot live
    from gjax.rollout import engine as new_engine

    runs = {
        f"engine_k{k}": (engine_run(new_engine, cfg, params, prompts, sp, k, calls * k_ // k), k)
        for k in sorted({1, k_})
    }
    if args.old_engine:
        spec = importlib.util.spec_from_file_location("old_engine", args.old_engine)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        runs["old_engine"] = (engine_run(old, cfg, params, prompts, sp, 1, calls * k_), 1)
    # Interleaved rounds (a loaded machine drifts): each round's ratios, then their median.
    ratios = {name: [] for name in runs}
    static_tok = []
    for _ in range(args.repeats):
        static_tok.append((once(full) - once(one)) / (b_ * (n_ - 1)))
        for name, (run, _) in runs.items():
            ratios[name].append(run() / (calls * k_ * b_) / static_tok[-1])
    rec = {"rows": b_, "new_tokens": n_, "static_cpu_s_per_token": statistics.median(static_tok)}
    rec.update({f"{name}_over_static": statistics.median(r) for name, r in ratios.items()})
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
