"""The update's per-device memory at length, with sequence shards (`mesh.seq`): the README's
"Long responses" table, through `python -m gjax.plan --norollout`.

    python scripts/seq_plan.py [--tokens 8192,16384,32768] [--seqs 1,2,4,8]
        [--shape qwen2.5-1.5b] [--slice v5e-8] [--root workdirs/seq_plan]

One GRPO step (`RUN`: configs/grpo.py's objective, 8 prompts x 8 samples, every row at its
full length: a 512-token prompt and a completion filling the rest of --tokens) packed one
row to a bin, full remat, the mesh fsdp x seq over the slice's chips (data 1), microbatches
so that each data-parallel group of `seq` devices holds one bin per microbatch: per device
T / seq tokens of activations. For each (tokens, seq) cell the planner compiles the update
of the whole model on fake CPU devices (`memory_analysis()`) and writes
ROOT/<shape>_<slice>_<tokens>_seq<seq>.json; the table (GiB per device: trained params +
Adam, the batch, the update's temporaries, the peak) goes to stdout. A cell takes minutes
on a 2-core CPU (the attention's compile grows with T / seq); existing JSONs are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, ROWS = 512, 64  # tokens of each row's prompt; rows per step (8 prompts x 8 samples)
RUN = (
    "--config=configs/grpo.py",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=-1",
    "--config.rollout.prompts_per_step=8",
    "--config.rollout.num_samples=8",
    f"--config.data.max_prompt_len={PROMPT}",
    "--config.train.minibatches=1",
    "--config.train.packing=packed",
    f"--config.train.pack_bins={ROWS}",
    "--config.model.remat=full",
    "--modes=full",
    "--norollout",
)
GiB = 1 << 30


def cell_args(tokens: int, seq: int, chips: int) -> list[str]:
    """The planner's flags for one cell: a bin per microbatch per data-parallel group."""
    return [
        f"--config.rollout.max_new_tokens={tokens - PROMPT}",
        f"--config.mesh.seq={seq}",
        f"--config.train.microbatches={ROWS // (chips // seq)}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384,32768")
    parser.add_argument("--seqs", default="1,2,4,8")
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--slice", default="v5e-8")
    parser.add_argument("--chips", type=int, default=8, help="the slice's chips")
    parser.add_argument("--root", default=os.path.join(ROOT, "workdirs", "seq_plan"))
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    plans = {}
    for t in tokens:
        for n in seqs:
            out = os.path.join(args.root, f"{args.shape}_{args.slice}_{t}_seq{n}.json")
            if not os.path.exists(out):
                cmd = [sys.executable, "-m", "gjax.plan", *RUN, *cell_args(t, n, args.chips)]
                cmd += [f"--shape={args.shape}", f"--slice={args.slice}", f"--json={out}"]
                print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
            with open(out) as f:
                plans[t, n] = json.load(f)["rows"][0]
    print(table(plans, tokens, seqs))


def table(plans: dict, tokens: list[int], seqs: list[int]) -> str:
    """Markdown: one row per (tokens, seq), GiB per device."""
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    lines = [
        "| tokens / row | seq | params + Adam | batch | update temporaries | peak |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in tokens:
        for n in seqs:
            if (t, n) not in plans:
                continue
            r = plans[t, n]
            persistent = r["base_bytes"] + r["trained_bytes"] + r["optimizer_bytes"]
            lines.append(
                f"| {t} | {n} | {g(persistent)} | {g(r['batch_bytes'])} | "
                f"{g(r['update_temp_bytes'])} | {g(r['peak_bytes'])} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
