"""Paged vs contiguous KV in the continuous decoder at equal KV bytes, on long-tailed lengths.

Workload: P prompts x G samples (mixed prompt lengths, left-padded to Sp), per-row lengths
forced (`max_tokens_B`, greedy, no stop ids) from a Pareto(1.5) tail scaled so the mean is
about N / 16 and clipped to [1, N] (the cap N is 16x that mean; the realised mean and
maximum are printed). KV budget M tokens
(`--kv-budget`, default 16 x (N + Sp)):
  contiguous  S slots of N columns and the decoder's default R prompt regions of Sp,
              S*N + R*Sp <= M (as benchmarks/rollout_backends.py sizes them);
  paged       the contiguous layout's KV bytes in pages of `--page` tokens (`kv_pages`, the
              null page one of them) and
              `--paged-slots` slots (default 8 S): a row holds pages for its tokens so far
              plus one dispatch, its group's prompt pages are shared.
Counted, not timed (a decode step reads the weights and the live KV once, whatever the row
count): decode steps, useful tokens per decode step, rows in flight (live row-steps per
decode step), rows preempted. The two decoders' greedy tokens are asserted equal (float32 CPU).
    python benchmarks/paged_kv.py            # ~1 min on 2 CPU cores
Measured (this default, CPU): contiguous 16 slots (4224 KV tokens), 12.4 rows in flight,
555 decode steps; paged (the same bytes: 264 pages of 16, 128 slots) 41.4 rows in flight,
166 steps: 3.3x, no row preempted, greedy tokens equal. `--kv-budget 2200`: 8 slots, 6.4 rows
vs 64 slots, 32.1 rows (5.0x; a row's copy of its prompt's last page is one page more).

    python benchmarks/paged_kv.py --engine   # the JetStream engine (in-process backend)

`--engine`: the same workload through JetStream's orchestrator on gjax's engine
(`gjax.rollout.engine`, the in-process backend; each request its own `max_tokens`): contiguous,
S slots of N and S regions of the prefill bucket Sb (the engine's layout: S*N + S*Sb <= M),
against paged at those KV bytes with `--paged-slots` slots. A request the pool cannot grow is
preempted (RESTART_TOKEN) and sent again by the client: `rows_preempted` counts them, and
their tokens decoded before the preemption are in the decode steps but not in the useful
tokens. Decode steps are the engine's own count over its generate calls.
Prints one JSON line per decoder and a summary line (the LAST line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_backends import add_model_args, model_config, random_prompts  # noqa: E402 - this folder

from gjax.models import transformer as tr  # noqa: E402
from gjax.rollout import SamplingParams  # noqa: E402
from gjax.rollout.decoder import ContinuousDecoder  # noqa: E402


def pareto_lengths(n: int, max_new: int, rng) -> np.ndarray:
    """Pareto(1.5) lengths with mean about max_new / 16, clipped to [1, max_new]."""
    raw = rng.pareto(1.5, n) + 1.0
    return np.clip(np.round(raw * max_new / 48), 1, max_new).astype(np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.set_defaults(vocab=512, hidden=64, mlp=128, layers=2, heads=4, kv_heads=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--kv-budget", type=int, default=0, help="KV tokens (0: 16 x (N + Sp))")
    ap.add_argument("--paged-slots", type=int, default=0, help="0: 8 x the contiguous slots")
    ap.add_argument("--tokens-per-dispatch", type=int, default=8)
    ap.add_argument("--engine", action="store_true", help="the JetStream engine, not the decoder")
    args = ap.parse_args()

    cfg = model_config(args)
    params = tr.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    p_, g_, n_, sp_len = args.prompts, args.samples, args.new_tokens, args.max_prompt
    tokens, mask = random_prompts(p_, sp_len, cfg.vocab_size, rng)
    lengths = pareto_lengths(p_ * g_, n_, rng)
    budget = args.kv_budget or 16 * (n_ + sp_len)

    def regions_for(s):
        return ContinuousDecoder(cfg, slots=s, tokens_per_dispatch=1).regions_for(g_)

    def kv_tokens_for(s):  # the contiguous layout: the decoder's, or the engine's
        if args.engine:  # S regions of the prefill bucket
            from gjax.rollout.buckets import prefill_bucket

            return s * (n_ + prefill_bucket(sp_len))
        return s * n_ + regions_for(s) * sp_len

    slots = 1
    while kv_tokens_for(slots + 1) <= budget:
        slots += 1
    contiguous_kv = kv_tokens_for(slots)
    pool = contiguous_kv // args.page  # the null page included: no more bytes than contiguous
    paged_slots = args.paged_slots or 8 * slots
    sp = SamplingParams(max_new_tokens=n_, temperature=0.0)
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    common = dict(tokens_per_dispatch=args.tokens_per_dispatch)
    if args.engine:
        return engine_runs(args, cfg, params, tokens, mask, lengths, slots, pool, paged_slots,
                           budget, contiguous_kv, kv_token_bytes)  # fmt: skip
    runs = {
        "contiguous": (ContinuousDecoder(cfg, slots=slots, **common), contiguous_kv),
        "paged": (
            ContinuousDecoder(
                cfg, slots=paged_slots, kv_page_size=args.page, kv_pages=pool, **common
            ),
            pool * args.page,
        ),
    }
    useful = int(lengths.sum())
    results, tokens_out = {}, {}
    for name, (dec, kv_tokens) in runs.items():
        out = dec.generate(
            params,
            tokens,
            mask,
            jax.random.key(0),
            num_samples=g_,
            sampling=sp,
            max_tokens_B=lengths,
        )
        assert np.array_equal(np.asarray(out.lengths_B), lengths)
        tokens_out[name] = np.asarray(out.tokens_BxN)
        st = dec.stats
        results[name] = {
            "what": name,
            "slots": st["slots"],
            "kv_tokens": kv_tokens,
            "kv_bytes": kv_tokens * kv_token_bytes,
            "decode_steps": st["decode_steps"],
            "useful_tokens_per_step": useful / st["decode_steps"],
            "rows_in_flight": st["slot_steps_live"] / st["decode_steps"],
            "rows_preempted": st.get("rows_preempted", 0),
            "kv_pages_peak": st.get("kv_pages_peak"),
        }
        print(json.dumps(results[name]), flush=True)
    c, p = results["contiguous"], results["paged"]
    ratio = {"rows_in_flight_paged_over_contiguous": p["rows_in_flight"] / c["rows_in_flight"]}
    print_summary(args, results, tokens_out, lengths, budget, ratio)


def engine_runs(args, cfg, params, tokens, mask, lengths, slots, pool, paged_slots, budget,
                contiguous_kv, kv_token_bytes):  # fmt: skip
    """`--engine`: the workload on the in-process JetStream backend, contiguous vs paged."""
    from gjax.rollout.jetstream_backend import JetStreamBackend

    g_, n_ = args.samples, args.new_tokens
    sp = SamplingParams(max_new_tokens=n_, temperature=0.0)
    useful = int(lengths.sum())
    results, tokens_out = {}, {}
    for name, kw, kv_tokens in (
        ("contiguous", dict(slots=slots), contiguous_kv),
        (
            "paged",
            dict(slots=paged_slots, kv_page_size=args.page, kv_pages=pool),
            pool * args.page,
        ),
    ):
        be = JetStreamBackend(
            cfg,
            params,
            sampling=sp,
            max_prompt_len=args.max_prompt,
            tokens_per_dispatch=args.tokens_per_dispatch,
            max_retries=1000,  # a preempted request is sent again
            backoff_s=0.001,
            **kw,
        )
        try:
            out = be.generate(params, tokens, mask, None, num_samples=g_, sampling=sp,
                              max_tokens_B=lengths)  # fmt: skip
            engine = be.engine
            assert np.array_equal(np.asarray(out.lengths_B), lengths)
            tokens_out[name] = np.asarray(out.tokens_BxN)
            stats = engine.kv_stats
            results[name] = {
                "what": f"engine_{name}",
                "slots": kw["slots"],
                "kv_tokens": kv_tokens,
                "kv_bytes": kv_tokens * kv_token_bytes,
                "decode_steps": engine.decode_steps,
                "useful_tokens_per_step": useful / engine.decode_steps,
                "rows_preempted": stats.get("requests_preempted", 0),
                "requests_retried": be.counters["retried"],
                "kv_pages_peak": stats.get("kv_pages_peak"),
            }
        finally:
            be.close()
        print(json.dumps(results[name]), flush=True)
    c, p = results["contiguous"], results["paged"]
    ratio = {"decode_steps_contiguous_over_paged": c["decode_steps"] / p["decode_steps"]}
    print_summary(args, results, tokens_out, lengths, budget, ratio,
                  backend="jetstream engine")  # fmt: skip


def print_summary(args, results, tokens_out, lengths, budget, ratio, **extra) -> None:
    """The summary line (the LAST line): the workload, the ratios, greedy tokens equal (on
    the CPU in float32 asserted: rounding cannot depend on the batch there)."""
    equal = bool(np.array_equal(tokens_out["paged"], tokens_out["contiguous"]))
    if jax.default_backend() == "cpu" and args.dtype == "float32":
        assert equal, "greedy tokens differ"
    c, p = results["contiguous"], results["paged"]
    summary = {
        "what": "summary",
        **extra,
        "requests": args.prompts * args.samples,
        "max_new_tokens": args.new_tokens,
        "page_size": args.page,
        "kv_budget_tokens": budget,
        "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()),
        "useful_tokens": int(lengths.sum()),
        **ratio,
        "useful_per_step_paged_over_contiguous": (
            p["useful_tokens_per_step"] / c["useful_tokens_per_step"]
        ),
        "greedy_tokens_equal": equal,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
