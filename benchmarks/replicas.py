"""Per-batch rollout overhead of the multi-replica gRPC client vs one server.

A random Qwen2-shaped policy is served by JetStream gRPC servers on 127.0.0.1 (in this
process, real sockets), and the same batch (P prompts x G samples, greedy, fixed lengths) is
sampled through `JetStreamGrpcBackend`:
  one          one server, one address (the one-replica path);
  same_two     the same server under two addresses (127.0.0.1 and localhost): the replica
               pool's own cost (picking, counting, two channels) at the same serving capacity;
  two          two servers, one address each (on one CPU they share its cores: capacity
               does not double here; on separate slices it would).
The variants run interleaved, `--repeats` times each after a warm-up; medians are reported,
with ratios to `one` side by side. The LAST line is a JSON summary.

    python benchmarks/replicas.py      # 16 prompts x 4, 32 new tokens, 32 slots
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
from gjax.rollout import SamplingParams


def emit(record):
    print(json.dumps(record), flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from gjax.rollout import jetstream_backend
    from gjax.serve import start_server

    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        attention_bias=True,
        tie_word_embeddings=True,
        dtype="float32",
    )
    params = tr.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    p_, g_, n_ = args.prompts, args.samples, args.new_tokens
    tokens = rng.randint(3, args.vocab, (p_, args.max_prompt)).astype(np.int32)
    mask = np.ones_like(tokens)
    sp = SamplingParams(max_new_tokens=n_, temperature=0.0)
    max_prefill = jetstream_backend.prefill_bucket(args.max_prompt)
    servers, ports = [], []
    for _ in range(2):
        engine = jetstream_backend.Engine(
            cfg,
            params,
            sampling=sp,
            max_concurrent_decodes=args.slots,
            max_prefill_length=max_prefill,
            record=False,
        )
        ports.append(_port())
        servers.append(start_server(engine, "127.0.0.1", ports[-1]))
    clients = {
        "one": [f"127.0.0.1:{ports[0]}"],
        "same_two": [f"127.0.0.1:{ports[0]}", f"localhost:{ports[0]}"],
        "two": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
    }
    backends = {
        name: jetstream_backend.JetStreamGrpcBackend(
            addresses, max_prompt_len=args.max_prompt, server_sampling=sp
        )
        for name, addresses in clients.items()
    }
    emit(
        {
            "what": "setup",
            "params": int(sum(x.size for x in jax.tree.leaves(params))),
            "requests": p_ * g_,
            "new_tokens": n_,
            "slots": args.slots,
            "devices": str(jax.devices()),
        }
    )
    run = lambda be: be.generate(params, tokens, mask, None, num_samples=g_, sampling=sp)
    reference = None
    for name, be in backends.items():
        be.push(params)  # no weight directory: the servers keep their params
        out = run(be)  # warm-up (compiles on first use)
        got = np.asarray(out.tokens_BxN)
        reference = got if reference is None else reference
        assert np.asarray(out.valid_B).all() and np.array_equal(got, reference), name
    times = {name: [] for name in backends}
    for r in range(args.repeats):
        for name, be in backends.items():
            t0 = time.perf_counter()
            run(be)
            times[name].append(time.perf_counter() - t0)
            emit({"what": "run", "variant": name, "repeat": r, "seconds": times[name][-1]})
    summary = {"what": "summary", "requests": p_ * g_, "new_tokens": n_}
    for name in backends:
        summary[f"{name}_seconds"] = statistics.median(times[name])
    for name in ("same_two", "two"):
        summary[f"{name}_over_one"] = summary[f"{name}_seconds"] / summary["one_seconds"]
    summary["replica_requests_two"] = {
        k: v for k, v in backends["two"].pool.metrics().items() if k.endswith("/requests")
    }
    for be in backends.values():
        be.close()
    for s in servers:
        s.stop()
    emit(summary)


if __name__ == "__main__":
    main()
