"""Rollout backends on a long-tailed workload: static batch vs JetStream continuous batching.

The same random Qwen2-shaped policy, the same prompts (P prompts x G samples, mixed prompt
lengths) and the same per-request response lengths go through:
  local           gjax's jit sampler: one static batch of P*G rows, decoding until its
                  longest row ends (with stops forced at the drawn lengths, the batch runs
                  max(lengths) steps; what a static batch does with real stop tokens);
  jetstream       the gjax Engine behind JetStream's own Driver, in this process, with
                  `--slots` decode slots; a slot is refilled as soon as its request ends;
  jetstream_grpc  the same engine behind JetStream's gRPC server (server_lib) on
                  127.0.0.1, driven by the gjax gRPC client (in this process, real sockets).
Response lengths are drawn once from a heavy-tailed (Pareto, shape 1.5) distribution, clipped
to [1, max_new_tokens] with mean <= max_new_tokens / 4, and forced identically for every
backend (JetStream's per-request `max_tokens`; the static batch runs max(lengths) steps).
Sampling is greedy with no stop ids, so every backend generates the same tokens.

Useful tokens/s = the sum of the drawn lengths (unpadded tokens) / wall time, median of
`--repeats` timed runs after a warm-up (compilation excluded).

    python benchmarks/rollout_backends.py           # 32 prompts x 8, 128 new tokens, 64 slots

Prints one JSON line per measurement; the LAST line is a JSON summary with each backend's
useful tokens/s and `continuous_over_static` (jetstream over local).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import jax
import numpy as np

from gjax.models import transformer as tr
from gjax.models.config import ModelConfig
from gjax.rollout import LocalSampler, SamplingParams


def emit(record):
    print(json.dumps(record), flush=True)


def draw_lengths(n: int, max_new: int, rng) -> np.ndarray:
    """Pareto(1.5) lengths, scaled so the clipped mean is about max_new / 8 (<= max_new / 4)."""
    raw = rng.pareto(1.5, n) + 1.0  # >= 1, heavy tail
    lengths = np.clip(np.round(raw * max_new / 24), 1, max_new).astype(np.int32)
    assert lengths.mean() <= max_new / 4, lengths.mean()
    return lengths


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-grpc", action="store_true")
    args = ap.parse_args()

    from gjax.rollout import jetstream_backend
    from gjax.serve import start_server

    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        attention_bias=True,
        tie_word_embeddings=True,
        dtype=args.dtype,
    )
    params = tr.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    p_, g_, n_ = args.prompts, args.samples, args.new_tokens
    plen = rng.randint(max(1, args.max_prompt // 3), args.max_prompt + 1, p_)
    tokens = np.zeros((p_, args.max_prompt), np.int32)
    mask = np.zeros_like(tokens)
    for i, n in enumerate(plen):  # left-padded
        tokens[i, -n:] = rng.randint(3, args.vocab, n)
        mask[i, -n:] = 1
    lengths = draw_lengths(p_ * g_, n_, rng)
    useful = int(lengths.sum())
    sp_static = SamplingParams(max_new_tokens=int(lengths.max()), temperature=0.0)
    sp = SamplingParams(max_new_tokens=n_, temperature=0.0)
    emit(
        {
            "what": "setup",
            "devices": str(jax.devices()),
            "params": int(sum(x.size for x in jax.tree.leaves(params))),
            "requests": p_ * g_,
            "slots": args.slots,
            "max_new_tokens": n_,
            "length_mean": float(lengths.mean()),
            "length_p50": float(np.median(lengths)),
            "length_p99": float(np.percentile(lengths, 99)),
            "length_max": int(lengths.max()),
            "useful_tokens": useful,
        }
    )

    local = LocalSampler(cfg)
    js = jetstream_backend.JetStreamBackend(
        cfg, params, sampling=sp, slots=args.slots, max_prompt_len=args.max_prompt
    )
    backends = {
        "local": lambda: local.generate(
            params, tokens, mask, jax.random.key(0), num_samples=g_, sampling=sp_static
        ),
        "jetstream": lambda: js.generate(
            params, tokens, mask, None, num_samples=g_, sampling=sp, max_tokens_B=lengths
        ),
    }
    server = grpc_be = None
    if not args.skip_grpc:
        engine = jetstream_backend.Engine(
            cfg,
            params,
            sampling=sp,
            max_concurrent_decodes=args.slots,
            max_prefill_length=js.max_prefill_length,
            record=False,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(engine, "127.0.0.1", port)
        grpc_be = jetstream_backend.JetStreamGrpcBackend(
            f"127.0.0.1:{port}", max_prompt_len=args.max_prompt, server_sampling=sp
        )
        grpc_be.push(params)  # no weight directory: the server keeps its params
        backends["jetstream_grpc"] = lambda: grpc_be.generate(
            params, tokens, mask, None, num_samples=g_, sampling=sp, max_tokens_B=lengths
        )

    reference = None
    summary = {"what": "summary", "useful_tokens": useful}
    for name, run in backends.items():
        t0 = time.perf_counter()
        out = jax.block_until_ready(run())
        emit({"what": "warmup", "backend": name, "seconds": time.perf_counter() - t0})
        got = np.asarray(out.tokens_BxN)
        got_len = np.asarray(out.lengths_B)
        if name == "local":
            reference = got
            got_len = lengths  # stops forced at the drawn lengths: tokens past them are padding
        else:  # the same greedy tokens, cut at the same lengths
            assert np.array_equal(got_len, lengths), name
            for b in range(len(lengths)):
                assert np.array_equal(got[b, : lengths[b]], reference[b, : lengths[b]]), (name, b)
        times = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - t0)
            emit({"what": "run", "backend": name, "repeat": r, "seconds": times[-1]})
        med = statistics.median(times)
        summary[f"{name}_seconds"] = med
        summary[f"{name}_useful_tokens_per_s"] = useful / med
    summary["continuous_over_static"] = (
        summary["jetstream_useful_tokens_per_s"] / summary["local_useful_tokens_per_s"]
    )
    if "jetstream_grpc_useful_tokens_per_s" in summary:
        summary["grpc_over_static"] = (
            summary["jetstream_grpc_useful_tokens_per_s"] / summary["local_useful_tokens_per_s"]
        )
    js.close()
    if grpc_be is not None:
        grpc_be.close()
        server.stop()
    emit(summary)


if __name__ == "__main__":
    main()
