"""Regenerates the README's "What fits where" table with `python -m gjax.plan`.

    python scripts/readme_plan.py [--shapes qwen3-8b,qwen2.5-1.5b] [--slices v5e-8,v5p-8,h200]
        [--root workdirs/readme_plan]

Runs the planner once per (shape, slice) with the run below (`RUN`: configs/grpo.py's
objective with a rollout batch a v5e-8 can hold: 64 prompts x 8 samples, prompts up to 512
tokens, completions up to 1024, 16 microbatches, the mesh fully sharded), each writing
`ROOT/<shape>_<slice>.json`, then prints the markdown table (peak GiB per device, and
whether it fits) on stdout. About 25 minutes on a 2-core CPU (each run compiles the full and
the LoRA programs of the whole model for the slice's devices).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = (
    "--config=configs/grpo.py",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=-1",
    "--config.rollout.prompts_per_step=64",
    "--config.rollout.num_samples=8",
    "--config.data.max_prompt_len=512",
    "--config.rollout.max_new_tokens=1024",
    "--config.train.minibatches=1",
    "--config.train.microbatches=16",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-8b,qwen2.5-1.5b")
    parser.add_argument("--slices", default="v5e-8,v5p-8,h200")
    parser.add_argument("--root", default=os.path.join(ROOT, "workdirs", "readme_plan"))
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=True)
    shapes, slices = args.shapes.split(","), args.slices.split(",")
    plans = {}
    for shape in shapes:
        for name in slices:
            out = os.path.join(args.root, f"{shape}_{name}.json")
            if not os.path.exists(out):
                cmd = [sys.executable, "-m", "gjax.plan", *RUN, f"--shape={shape}"]
                cmd += [f"--slice={name}", f"--json={out}"]
                print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
            with open(out) as f:
                plans[shape, name] = json.load(f)
    print(table(plans, shapes, slices))


def table(plans: dict, shapes: list[str], slices: list[str]) -> str:
    def cell(plan, mode):
        row = next(r for r in plan["rows"] if r["mode"] == mode)
        verdict = "fits" if row["fits"] else "**does not fit**"
        return f"{row['peak_bytes'] / 2**30:.1f} GiB, {verdict}"

    head = ["model", "mode"] + [
        f"{s} ({plans[shapes[0], s]['chips']} x {plans[shapes[0], s]['hbm_bytes_per_chip'] / 2**30:.0f} GiB)"
        for s in slices
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in shapes:
        for mode in ("full", "lora", "qlora"):
            cells = [cell(plans[shape, s], mode) for s in slices]
            lines.append(f"| {shape} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
