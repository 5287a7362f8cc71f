"""Weight hand-off to a `gjax.serve` server: the push directory vs the gRPC stream, in s/GB.

For each size (GB of f32 params, in `--leaf_mb` leaves of random values) it times, in this
process on the CPU backend:
* directory: what `rollout.weight_transfer='directory'` does per push: an orbax
  StandardCheckpointer save to a local directory, then `weight_push.restore` onto the served
  params' shapes (the server's load), without the LATEST/SERVED polling;
* grpc: `weight_stream.GrpcWeightPusher.push` to a `WeightServer` on 127.0.0.1 (the same
  receiver `gjax.serve` runs): stream, server-side assembly, placement and swap, until the ack;
* grpc_bf16: the same to a server holding bf16 params (the trainer casts; half the bytes).
The floor is one memcpy of the same bytes (numpy copy, measured in the same run); `x_floor`
is how many memcpys each path costs.

Then the adapter push of a LoRA run (`gjax.rollout.handoff`; `--adapter_rank`, default 16, on
all 7 targets, f32 adapters; 0 skips it) on the `--shape` (default qwen2-1.5b, random values):
the same two paths with what a LoRA push sends, the adapters only (the gRPC server a
`Handoff` of the same record, restoring onto its adapters), against the full-weight push of
that shape: its bytes exact (f32, from the abstract params), its seconds predicted from the
largest size's s/GB (the full 1.5B tree, 6.2 GB f32, is more than this box holds three times).

    python benchmarks/weight_push.py                     # 0.1, 0.5, 1, 2 GB; ~3 min, ~10 GB RAM
    python benchmarks/weight_push.py --sizes=0.05 --repeats=1   # smoke

Prints one JSON line per measurement, then a summary line with the directory/grpc ratio per
size and the predicted push seconds of 1.5B and 8B policies in bf16 (3 and 16 GB) from the
largest size's s/GB. The server shares the process (and the GIL) with the trainer here; on
separate hosts the gRPC figure is bounded by the network instead.

Measured 2026-11-25 on the shared 2-core CPU box (other jobs running, load ~3-4: noisy), two
runs of the defaults. Floor (memcpy): 0.053-0.055 s/GB. s/GB (x floor) at 0.1 / 0.5 / 1 / 2 GB:
  directory  2.6 / 2.9-3.0 / 2.6-3.8 / 2.6-9.8   (48-72x; 186x at 2 GB in the loaded run)
  grpc       1.05-1.2 / 0.76-1.9 / 1.3-1.5 / 1.4-4.0   (14-37x; 75x at 2 GB loaded)
  grpc_bf16  1.2-1.7 / 1.2-1.9 / 1.2 / 1.1-2.2 per bf16 GB (21-42x)
directory/grpc 1.5-3.8x (median ~2.3x). Predicted push of a bf16 server's weights from an f32
trainer (quieter run): 1.5B directory 16 s vs grpc 3.4 s; 8B 85 s vs 18 s. Both paths sit
~15-70x above memcpy: the directory pays orbax/tensorstore writes and reads; the stream pays
gRPC's copies into and out of its buffers (Python, one core each side) and the placement.

The adapter push, measured 2026-12-01 (`--sizes=0.25,1 --repeats=2`, the same box at load
~17): rank 16 on all 7 targets of the 1.5B shape is 73.9 MB (f32) against 6.17 GB for the full
f32 weights: 1.20 % of the bytes (1.2 % and not below 1 %: Qwen2.5-1.5B's 28 layers carry
r (in + out) = 659k adapter values each against 1.54e9 params in all). 0.26 s streamed and
1.34 s through the directory, against 33.6 s and 250.6 s predicted for the full push at the
1 GB s/GB (0.8 % and 0.5 % of the seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from gjax.flops import QWEN2_SHAPES
from gjax.models import lora, transformer
from gjax.models.config import LORA_TARGETS, ModelConfig
from gjax.rollout import weight_push, weight_stream
from gjax.rollout.engine import ParamsHolder
from gjax.rollout.handoff import Handoff

GB = 1e9


def make_params(gb: float, leaf_mb: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    total, leaf = int(gb * GB) // 4, int(leaf_mb * 2**20) // 4
    sizes = [leaf] * (total // leaf) + ([total % leaf] if total % leaf else [])
    return {
        f"w{i:04d}": jnp.asarray(rng.standard_normal(n, dtype=np.float32))
        for i, n in enumerate(sizes)
    }


def memcpy_s_per_gb(repeats: int) -> float:
    src = np.random.default_rng(1).standard_normal(int(0.25 * GB) // 4, dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return min(times[1:]) / (src.nbytes / GB)


def time_directory(params, like, root: epath.Path, version: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(weight_push.version_dir(root, version).resolve(), params, force=True)
    t1 = time.perf_counter()
    restored = weight_push.restore(root, version, like)
    jax.block_until_ready(restored)
    t2 = time.perf_counter()
    weight_push.version_dir(root, version).rmtree()
    return t1 - t0, t2 - t1


def time_grpc(params, like, chunk_mb: float, repeats: int, record=None) -> tuple[float, int]:
    """`record`: an adapter push's (both sides' `Handoff`; the server holds no base here, so
    it serves the adapters tree itself: the merge with a base is a dict union, no work)."""
    holder = ParamsHolder(like, version=0)
    server = weight_stream.WeightServer(holder, "127.0.0.1:0", Handoff(record))
    pusher = weight_stream.GrpcWeightPusher(
        f"127.0.0.1:{server.port}", chunk_bytes=int(chunk_mb * 2**20), handoff=Handoff(record)
    )
    try:
        pusher.spec()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pusher.push(params)
            jax.block_until_ready(holder.params)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), pusher.last_bytes
    finally:
        pusher.close()
        server.stop()


def adapter_case(shape: str, rank: int, repeats: int, chunk_mb: float, full_s_per_gb):
    """The LoRA adapter push on `shape` vs its full-weight push: one JSON line."""
    cfg = ModelConfig(
        model_type="qwen2",
        **QWEN2_SHAPES[shape],
        tie_word_embeddings=True,
        attention_bias=True,
        lora_rank=rank,
        lora_alpha=2.0 * rank,
        lora_targets=LORA_TARGETS,
    )
    full_bytes = sum(
        x.size * 4 for x in jax.tree.leaves(transformer.abstract_params(cfg.without_lora()))
    )
    abstract = lora.abstract_adapters(cfg)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(abstract))))
    adapters = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), abstract)
    record = {
        "rank": rank,
        "alpha": cfg.lora_alpha,
        "targets": list(cfg.lora_targets),
        "base_digest": f"benchmark-{shape}",
    }
    nbytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    like = jax.tree.map(jnp.zeros_like, adapters)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [time_directory(adapters, like, epath.Path(tmp), v + 1) for v in range(repeats)]
    directory_s = statistics.median(r[0] + r[1] for r in runs)
    grpc_s, sent = time_grpc(adapters, like, chunk_mb, repeats, record)
    assert sent == nbytes
    return {
        "path": "adapters",
        "shape": shape,
        "rank": rank,
        "targets": list(cfg.lora_targets),
        "bytes": nbytes,
        "full_bytes": full_bytes,
        "bytes_fraction": round(nbytes / full_bytes, 5),
        "directory_s": round(directory_s, 4),
        "grpc_s": round(grpc_s, 4),
        # The full push of the same shape at the measured s/GB of the largest size.
        "full_directory_s_predicted": round(full_s_per_gb["directory"] * full_bytes / GB, 2),
        "full_grpc_s_predicted": round(full_s_per_gb["grpc"] * full_bytes / GB, 2),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.1,0.5,1,2", help="GB of f32 params, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--leaf_mb", type=float, default=64.0)
    ap.add_argument("--chunk_mb", type=float, default=weight_stream.CHUNK_BYTES / 2**20)
    ap.add_argument("--shape", default="qwen2-1.5b", choices=sorted(QWEN2_SHAPES))
    ap.add_argument("--adapter_rank", type=int, default=16, help="0: no adapter case")
    args = ap.parse_args()
    floor = memcpy_s_per_gb(max(args.repeats, 3))
    print(json.dumps({"path": "memcpy", "s_per_gb": round(floor, 4)}), flush=True)
    results = {}
    for gb in [float(s) for s in args.sizes.split(",")]:
        params = make_params(gb, args.leaf_mb)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        like = jax.tree.map(jnp.zeros_like, params)
        with tempfile.TemporaryDirectory() as tmp:
            runs = [
                time_directory(params, like, epath.Path(tmp), v + 1) for v in range(args.repeats)
            ]
        save_s = statistics.median(r[0] for r in runs)
        load_s = statistics.median(r[1] for r in runs)
        grpc_s, sent = time_grpc(params, like, args.chunk_mb, args.repeats)
        like16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), like)
        bf16_s, sent16 = time_grpc(params, like16, args.chunk_mb, args.repeats)
        rows = {
            "directory": dict(s=save_s + load_s, bytes=nbytes, save_s=save_s, load_s=load_s),
            "grpc": dict(s=grpc_s, bytes=sent),
            "grpc_bf16": dict(s=bf16_s, bytes=sent16),
        }
        for path, row in rows.items():
            s_per_gb = row["s"] / (row["bytes"] / GB)
            results[(gb, path)] = s_per_gb
            out = {"path": path, "f32_gb": gb, **{k: round(v, 4) for k, v in row.items()}}
            out.update(s_per_gb=round(s_per_gb, 4), x_floor=round(s_per_gb / floor, 2))
            print(json.dumps(out), flush=True)
        del params, like, like16
    sizes = sorted({gb for gb, _ in results})
    top = sizes[-1]
    adapter = None
    if args.adapter_rank:
        full = {p: results[(top, p)] for p in ("directory", "grpc")}
        adapter = adapter_case(args.shape, args.adapter_rank, args.repeats, args.chunk_mb, full)
        print(json.dumps(adapter), flush=True)
    print(
        json.dumps(
            {
                "summary": True,
                "memcpy_s_per_gb": round(floor, 4),
                "directory_over_grpc": {
                    str(gb): round(results[(gb, "directory")] / results[(gb, "grpc")], 2)
                    for gb in sizes
                },
                # A bf16 server fed by an f32 trainer, at the largest size's s/GB: the
                # directory saves the trainer's f32 params (4 bytes a parameter), the stream
                # sends bf16 (2 bytes a parameter).
                "predicted_push_s_bf16_server": {
                    name: {
                        "directory": round(results[(top, "directory")] * n * 4 / GB, 1),
                        "grpc": round(results[(top, "grpc_bf16")] * n * 2 / GB, 1),
                    }
                    for name, n in (("1.5B", 1.5e9), ("8B", 8e9))
                },
                **(
                    {}
                    if adapter is None
                    else {
                        "adapter_over_full_bytes": adapter["bytes_fraction"],
                        "adapter_over_full_s": {
                            p: round(adapter[f"{p}_s"] / adapter[f"full_{p}_s_predicted"], 5)
                            for p in ("directory", "grpc")
                        },
                    }
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
