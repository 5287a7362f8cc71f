"""Scaling of one RL step over devices and processes: `python -m gjax.train` as users run it.

Every point is a real training run (`configs/grpo.py:tiny` with a ~20M-parameter Qwen2-shaped
policy of random weights and the embedded character tokenizer, written once to a temp dir):
1, 2, 4 and 8 devices in one process, and the largest device count split over 2 processes
(`jax.distributed` on 127.0.0.1, gloo collectives on CPU), each with the batch data-sharded
(`mesh.data = n`) and fsdp-sharded (`mesh.fsdp = n`: parameters and optimizer state sharded
too). The global batch is fixed (P prompts x G samples, strong scaling). A point's step time
is the median of `time/step_s` (rollout: sample + old log-probs + rewards, then the update
dispatch; the update overlaps the next rollout) over the steps after `--warmup`, from the
run's own `metrics.jsonl`.

    python benchmarks/scaling.py                  # ~20M params, P=8 x G=4, 24 + 32 tokens
    python benchmarks/scaling.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
        --intermediate 4864 --devices 1,2,4,8     # a 0.5B-shaped policy (accelerators)

On CPU the devices are `--xla_force_host_platform_device_count` slices of one host and share
its cores, so the ideal speedup is min(n, cores), not n: `efficiency` is speedup / n and
`core_efficiency` speedup / min(n, cores); `cores` is in every line. Two-process points also
give `vs_one_process` (one-process time / two-process time at the same device count and mesh).

Prints one JSON line per point; the LAST line is a JSON summary (settings, cores, parameter
count, and per mesh the step times and efficiencies by device count).

Measured once (`--warmup 1 --steps 2 --new-tokens 16`, 20.5M params, a 2-core CPU shared
with other jobs at load average 11-16, so noisy): step time on 1/2/4/8 devices, data
17.8/11.3/8.4/8.3 s, fsdp 3.6/5.0/5.9/9.4 s. The two 1-device points run the same program,
so their 5x gap is the machine's contention, not gjax. 8 devices as 2 processes x 4: 7.9 s
(data) and 7.2 s (fsdp), 1.05x and 1.30x the one-process time. Fake CPU devices share the
host's cores, so these figures say little about scaling on accelerators.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def write_policy(args, out: str) -> int:
    """A random-weight Qwen2-shaped policy with the embedded tokenizer; returns its size."""
    import jax

    from gjax.data.tokenizer import build_tokenizer
    from gjax.models import hf_export
    from gjax.models.config import ModelConfig
    from gjax.models.transformer import init_params

    tok = build_tokenizer()
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
    )
    params = init_params(cfg, jax.random.key(0))
    hf_export.save_pretrained(params, cfg, out, tokenizer=tok)
    return int(sum(x.size for x in jax.tree.leaves(params)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_point(args, policy, workdir, *, devices, processes, mesh) -> dict:
    """One training run; returns the median step time and its parts (seconds)."""
    local = devices // processes
    axes = {"data": ("-1", "1"), "fsdp": ("1", "-1")}[mesh]
    cmd = [
        sys.executable,
        "-m",
        "gjax.train",
        "--config=configs/grpo.py:tiny",
        f"--workdir={workdir}",
        f"--config.model.path={policy}",
        f"--config.mesh.data={axes[0]}",
        f"--config.mesh.fsdp={axes[1]}",
        f"--config.train.steps={args.warmup + args.steps}",
        f"--config.rollout.prompts_per_step={args.prompts}",
        f"--config.rollout.num_samples={args.samples}",
        f"--config.rollout.max_new_tokens={args.new_tokens}",
        "--config.data.heldout_size=8",
        "--config.checkpoint.every=100000",
        "--config.checkpoint.async_save=False",
        "--config.log.progress=False",
        "--config.log.tensorboard=False",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local}"
    if processes > 1:
        port = free_port()
        extra = [
            [
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={processes}",
                f"--process_id={i}",
            ]
            for i in range(processes)
        ]
    else:
        extra = [[]]
    procs = [
        subprocess.Popen(
            cmd + e, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for e in extra
    ]
    outs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(
                f"run failed (devices={devices}, processes={processes}):\n{out[-4000:]}"
            )
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][args.warmup :]
    med = lambda k: statistics.median(r[k] for r in rows)
    return {
        "step_s": med("time/step_s"),
        "sample_s": med("time/sample_s"),
        "rollout_s": med("time/rollout_s"),
        "tokens_per_s": med("throughput/tokens_per_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--devices", default="1,2,4,8", help="device counts (one process each)")
    ap.add_argument("--processes", type=int, default=2, help="processes for the largest count")
    ap.add_argument("--meshes", default="data,fsdp")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded (compilation)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    args = ap.parse_args()
    counts = [int(n) for n in args.devices.split(",")]
    n_cores = cores()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = os.path.join(tmp, "policy")
        n_params = write_policy(args, policy)
        points = [(m, n, 1) for m in args.meshes.split(",") for n in counts]
        if args.processes > 1:
            points += [(m, max(counts), args.processes) for m in args.meshes.split(",")]
        for i, (mesh, n, procs) in enumerate(points):
            got = run_point(
                args, policy, os.path.join(tmp, f"run{i}"), devices=n, processes=procs, mesh=mesh
            )
            base = results.get((mesh, 1, 1), got)["step_s"]
            speedup = base / got["step_s"]
            rec = {
                "mesh": mesh,
                "devices": n,
                "processes": procs,
                **got,
                "speedup": speedup,
                "efficiency": speedup / n,
                "core_efficiency": speedup / min(n, n_cores),
                "cores": n_cores,
            }
            if procs > 1 and (mesh, n, 1) in results:
                rec["vs_one_process"] = results[(mesh, n, 1)]["step_s"] / got["step_s"]
            results[(mesh, n, procs)] = rec
            emit(rec)
    summary = {
        "summary": "scaling",
        "params": n_params,
        "cores": n_cores,
        "batch": f"{args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens",
        "timed_steps": args.steps,
    }
    for (mesh, n, procs), rec in results.items():
        key = f"{mesh}/{n}dev" + (f"/{procs}proc" if procs > 1 else "")
        summary[key] = {k: round(rec[k], 4) for k in ("step_s", "speedup", "core_efficiency")}
        if "vs_one_process" in rec:
            summary[key]["vs_one_process"] = round(rec["vs_one_process"], 4)
    emit(summary)


if __name__ == "__main__":
    main()
