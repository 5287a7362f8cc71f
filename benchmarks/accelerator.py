"""Every accelerator figure in one command: its own ceilings, then timed stages, each with a
budget; one JSON and one markdown table (issue 35).

    python benchmarks/accelerator.py --json accel.json --markdown accel.md   # one GPU / TPU host
    python benchmarks/accelerator.py --tiny --json /tmp/a.json --markdown /tmp/a.md   # CPU (CI)

Made for a short loan of one H100 / H200 or one TPU host: the whole run stays inside
`--total-budget` seconds (default 450, under an 8-minute window). Each stage runs in a child
process of its own with its own time budget (`STAGES`, `--budgets name=seconds,...` to change
them): a stage over its budget is killed and recorded as skipped (with the figures it had
reported so far), a stage that fails (an exception, out of memory, a crash) is recorded with
its error, and the next one runs either way; a stage that no longer fits the total budget is
skipped, saying so. The JSON and the markdown are rewritten after every stage, so a run cut
short still leaves its figures. Children share a persistent compilation cache
(`gjax.compile_cache`, `--compilation-cache`), so a rerun compiles little.

Stages (the 1.5B shape is Qwen2.5-1.5B's, `gjax.flops.QWEN2_SHAPES`, random weights; bf16 on
an accelerator, f32 on the CPU, where XLA upcasts bf16):
  ceilings    bf16 matmul FLOP/s on a large square matmul (8192^2; --tiny 256^2) and the
              device's copy bandwidth (an elementwise pass over 1 GiB: 2 bytes moved per byte),
              next to the vendor tables (`gjax.flops.PEAK_FLOPS`, `PEAK_HBM_BW`). Every ratio
              below is against these measured ceilings (and the table where there is one).
  efficiency  the checks that need no accelerator (`gjax.efficiency`), always on the CPU
              (JAX_PLATFORMS=cpu): a decode step's bytes over the ideal at the 1.5B shape
              (f32, and int8 weights: their bytes over f32's), the KV cache updated in place, host syncs per decode dispatch and per
              training step, the packed update's executed over useful FLOPs.
  decode      (a) decode tokens/s and % of the HBM roofline (the ideal bytes of a step --
              weights + live KV, read once -- over its time, over the measured bandwidth):
              static sampler and continuous decoder, P x G rows of exactly N tokens; the
              continuous decoder again on int8 weights (`rollout.quantize=int8`: codes with
              per-channel scales read by the step's matmuls), its tokens/s over the float
              one's and its roofline against the int8 ideal bytes; then on paged KV (pages
              of 16, the default pool) through XLA's gather and, on a GPU / TPU, through the
              platform's Pallas paged-attention kernel (`rollout.paged_attention=auto`):
              each one's decode-step time over the contiguous step's (what decides paged KV
              as the default, issue 34).
  update      (b) the update (Learner.batch's reference log-probs + Learner.update) on the
              1.5B shape, packed (auto bins), Pareto completion lengths: MFU and HFU
              (`gjax.flops.learner_flops`), the padding waste and remat's factor.
  head        (c) the fused LM-head loss vs its matmul floor and vs the naive loss
              (`benchmarks/loss_kernels.py`'s JAX methods floor / fused / naive).
  step        (d) GRPO steps end to end (`benchmarks/async_pipeline.train_loop`: producer,
              rollout with the continuous decoder, a synthetic reward, Learner.batch,
              update) on the 1.5B shape: tokens/s per chip and the phase split (decode /
              prefill / learner / host).
  async       (e) the same steps with rollout.max_staleness = 1: steps/s over step's sync.

`--tiny`: tiny shapes everywhere, minutes at most on a busy 2-core CPU (tests/test_bench_smoke).
Output: the JSON (`--json`; schema in `stage_record` and `main`: top-level platform, device,
wall time, and per stage its status -- ok / skipped / failed --, budget, wall time, reason or
error, and figures) and the markdown table (`--markdown`; the README's accelerator tables are
this file). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (ROOT, HERE):  # gjax and configs; the sibling benchmarks whose pieces stages use
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gjax.errors import UserError, run_cli  # noqa: E402  (light: no jax import)

# name: (budget seconds, --tiny budget seconds). In order; the sum fits the default total.
STAGES = {
    "ceilings": (30, 60),
    "efficiency": (75, 90),  # CPU compiles of the 1.5B decode step: ~70 s on a busy 2-core box
    "decode": (100, 90),  # the paged rows last: cut first if the stage runs out
    "update": (85, 90),
    "head": (45, 60),
    "step": (80, 120),
    "async": (55, 120),
}
TOTAL_BUDGET = 450  # seconds: the whole run, inside an 8-minute window
TINY_TOTAL_BUDGET = 600
MIN_STAGE_S = 5.0  # a stage is not started with less than this left of the total
RESULT = "RESULT "  # a child's stdout line carrying its figures so far (the last one counts)
SCHEMA = 1

QUANT = "int8"  # rollout.quantize of the quantized decode rows (fp8 is refused on the CPU)

TINY_DIMS = dict(  # vocab >= the character tokenizer's 102 ids (the step stages' prompts)
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


# ------------------------------------------------------------------------------- parent


def parse_budgets(text: str) -> dict[str, float]:
    """`name=seconds,...` -> {name: seconds}; unknown names are a UserError."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in STAGES:
            raise UserError(
                f"--budgets: {part!r} is not NAME=SECONDS with NAME one of {list(STAGES)}"
            )
        try:
            out[name] = float(value)
        except ValueError:
            raise UserError(
                f"--budgets: {value!r} in {part!r} is not a number of seconds"
            ) from None
    return out


def stage_record(status: str, budget: float, wall: float, **fields) -> dict:
    """One stage's JSON record: status ok | skipped | failed, its budget and wall seconds,
    `reason` (skipped) or `error` (failed), and `figures` (what it measured; partial when
    it was stopped)."""
    return {"status": status, "budget_s": budget, "wall_s": round(wall, 2), **fields}


def run_child(name: str, budget: float, spec: dict, log) -> dict:
    """Runs stage `name` in a child process for at most `budget` seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if name == "efficiency":  # the CPU's compiled programs, whatever the host has
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--spec", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group: killed whole on time-out
    )
    try:
        out, err = proc.communicate(timeout=budget)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    wall = time.perf_counter() - t0
    figures = None
    for line in out.splitlines():
        if line.startswith(RESULT):
            figures = json.loads(line[len(RESULT) :])
    if err.strip():
        log(f"[{name}] stderr tail:\n{err[-1500:]}")
    if timed_out:
        return stage_record(
            "skipped",
            budget,
            wall,
            reason=f"over its budget of {budget:g} s: stopped"
            + (" (figures so far kept)" if figures else ""),
            figures=figures,
        )
    if proc.returncode != 0:
        # the exception's line: the last one of the traceback that is not indented
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith(" ")]
        return stage_record(
            "failed",
            budget,
            wall,
            error=f"exit {proc.returncode}: " + (lines[-1][:600] if lines else "no stderr"),
            figures=figures,
        )
    return stage_record("ok", budget, wall, figures=figures or {})


# What the markdown table shows per stage: (label, figures key, format).
TABLE = {
    "ceilings": [
        ("matmul bf16 TFLOP/s", "matmul_flops", "tera"),
        ("of table peak", "matmul_over_table", "pct"),
        ("copy GB/s", "copy_bytes_per_s", "giga"),
        ("of table HBM", "copy_over_table", "pct"),
    ],
    "efficiency": [
        ("decode bytes / ideal (XLA)", "decode_bytes_over_ideal", "x"),
        ("touched / ideal per step", "decode_step_touched_over_ideal", "x"),
        ("decode bytes int8 / f32 (XLA)", "decode_bytes_int8_over_float", "x"),
        ("ideal bytes int8 / f32", "decode_ideal_int8_over_float", "x"),
        ("KV in place", "kv_in_place", "bool"),
        ("host syncs / dispatch", "host_syncs_per_dispatch", "num"),
        ("host syncs / train step", "host_syncs_per_train_step", "num"),
        ("update executed / useful (packed)", "update_packed_executed_over_useful", "x"),
        ("padding waste (packed)", "update_packed_padding_waste", "x"),
    ],
    "decode": [
        ("static tok/s", "static_tokens_per_s", "num"),
        ("static roofline", "static_roofline", "pct"),
        ("continuous tok/s", "continuous_tokens_per_s", "num"),
        ("continuous roofline", "continuous_roofline", "pct"),
        ("int8 continuous tok/s", "int8_continuous_tokens_per_s", "num"),
        ("int8 continuous roofline", "int8_continuous_roofline", "pct"),
        ("int8 / float tok/s", "int8_over_float_tokens_per_s", "x"),
        ("paged (XLA gather) step / contiguous", "paged_xla_over_contiguous_step", "x"),
        ("paged (Pallas kernel) step / contiguous", "paged_kernel_over_contiguous_step", "x"),
    ],
    "update": [
        ("MFU", "mfu", "pct"),
        ("HFU", "hfu", "pct"),
        ("padding waste", "padding_waste", "x"),
        ("update s", "update_s", "num"),
    ],
    "head": [
        ("fused / floor", "fused_over_floor", "x"),
        ("naive / floor", "naive_over_floor", "x"),
        ("fused / naive", "fused_over_naive", "x"),
    ],
    "step": [
        ("step s", "step_s", "num"),
        ("tok/s/chip", "completion_tokens_per_s_per_chip", "num"),
        ("MFU (6N)", "step_mfu", "pct"),
        ("decode/prefill/learner/host", "phase_split", "text"),
    ],
    "async": [
        ("steps/s", "steps_per_s", "num"),
        ("k=1 over sync", "over_sync", "x"),
    ],
}


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bool":
        return "yes" if value else "no"
    if kind == "text":
        return str(value)
    if kind == "head":  # a note's first clause (the JSON has it whole)
        return str(value).split(":")[0]
    if not isinstance(value, (int, float)):
        return str(value)
    if kind == "pct":
        return f"{100 * value:.1f} %"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "tera":
        return f"{value / 1e12:.1f}"
    if kind == "giga":
        return f"{value / 1e9:.0f}"
    return f"{value:.4g}"


def markdown(report: dict) -> str:
    """The report as one markdown table: a row per stage, its status and main figures."""
    device = (
        f"{report['device_kind']} x {report['device_count']} ({report['platform']}"
        if report["device_kind"]
        else "no device stage ran (the efficiency checks run on the CPU"
    )
    lines = [
        f"Accelerator figures: {device}{', --tiny' if report['tiny'] else ''}), "
        f"{report['started']}, "
        f"{report['wall_s']:.0f} s (`python benchmarks/accelerator.py{report['flags']}`).",
        "",
        "| stage | status | s (budget) | figures |",
        "|---|---|---|---|",
    ]
    for name, rec in report["stages"].items():
        figs = rec.get("figures") or {}
        shown = [
            f"{label} {_fmt(figs.get(key), kind)}"
            for label, key, kind in TABLE[name]
            if key in figs
        ]
        status = rec["status"] + (
            f": {rec.get('reason') or rec.get('error')}" if rec["status"] != "ok" else ""
        )
        lines.append(
            f"| {name} | {status.replace('|', '/')} | {rec['wall_s']:.0f} ({rec['budget_s']:g}) "
            f"| {'; '.join(shown) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main_parent(args, log) -> dict:
    budgets = {n: float(b[1] if args.tiny else b[0]) for n, b in STAGES.items()}
    budgets.update(parse_budgets(args.budgets))
    stages = args.stages.split(",") if args.stages else list(STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise UserError(f"--stages: unknown {unknown}; the stages are {list(STAGES)}")
    total = args.total_budget or (TINY_TOTAL_BUDGET if args.tiny else TOTAL_BUDGET)
    t0 = time.perf_counter()
    report = {
        "what": "accelerator",
        "schema": SCHEMA,
        "tiny": args.tiny,
        "flags": "".join(  # what the run was asked (the output paths left out)
            f" {flag}" + (f" {value}" if value is not True else "")
            for flag, value in (
                ("--tiny", args.tiny),
                ("--stages", args.stages),
                ("--budgets", args.budgets),
                ("--total-budget", args.total_budget and f"{args.total_budget:g}"),
            )
            if value
        ),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": None,
        "device_kind": None,
        "device_count": None,
        "total_budget_s": total,
        "wall_s": 0.0,
        "stages": {},
    }
    for name in stages:
        left = total - (time.perf_counter() - t0)
        budget = budgets[name]
        if left < MIN_STAGE_S:
            rec = stage_record(
                "skipped",
                budget,
                0.0,
                reason=f"the run's total budget is spent ({left:.0f} s left)",
            )
        else:
            spec = {
                "tiny": args.tiny,
                "compilation_cache": args.compilation_cache,
                "prior": {n: r.get("figures") for n, r in report["stages"].items()},
            }
            log(f"[{name}] start (budget {min(budget, left):.0f} s)")
            rec = run_child(name, min(budget, left), spec, log)
            log(f"[{name}] {rec['status']} in {rec['wall_s']:.1f} s")
        report["stages"][name] = rec
        figs = rec.get("figures") or {}
        for key in ("platform", "device_kind", "device_count"):
            if report[key] is None and figs.get(key) is not None and name != "efficiency":
                report[key] = figs[key]
        report["wall_s"] = round(time.perf_counter() - t0, 1)
        write_outputs(report, args)
    return report


def write_outputs(report: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report))


# -------------------------------------------------------------------------------- child
# The stages import jax and gjax inside their functions: only a child may load them. The
# parent must stay light and never touch the device (a backend started there would hold the
# accelerator's memory the children need) so that it outlives a stuck or crashed stage.


class Child:
    """A stage's side: its figures so far, printed as one RESULT line each time they grow
    (the parent keeps the last, so a stage stopped on its budget keeps what it measured)."""

    def __init__(self, spec: dict):
        self.spec, self.tiny = spec, spec["tiny"]
        self.figures: dict = {}

    def put(self, **figures) -> None:
        self.figures.update(figures)
        print(RESULT + json.dumps(self.figures, default=_jsonable), flush=True)

    def attempt(self, key: str, fn) -> None:
        """`fn()`'s dict into the figures, or its error under `<key>_error`: one failed
        measurement is reported and the stage goes on."""
        try:
            self.put(**fn())
        except Exception as e:  # noqa: BLE001 (any failure is a figure: reported, next)
            self.put(**{f"{key}_error": f"{type(e).__name__}: {e}"[:400]})


def _jsonable(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def device_figures() -> dict:
    import jax

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
    }


def model_dims(tiny: bool) -> dict:
    from gjax.flops import QWEN2_SHAPES

    return TINY_DIMS if tiny else QWEN2_SHAPES["qwen2-1.5b"]


def compute_dtype() -> str:
    import jax

    # XLA:CPU runs bf16 through f32 converts (a decode step then copies its caches): f32 there.
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def ceilings(child: Child) -> dict:
    return child.spec["prior"].get("ceilings") or {}


def stage_ceilings(child: Child) -> None:
    import jax

    from gjax import flops

    child.put(**device_figures())
    n = 256 if child.tiny else 8192
    nbytes = (4 << 20) if child.tiny else (1 << 30)
    kind = jax.devices()[0].device_kind
    peak = flops.table_peak_flops(kind)
    bw = flops.table_hbm_bandwidth(kind)
    child.put(
        matmul_n=n,
        table_peak_flops=peak[0] if peak else None,
        table_peak_source=peak[1] if peak else "no table entry",
        table_hbm_bw=bw[0] if bw else None,
        table_hbm_source=bw[1] if bw else "no table entry",
    )

    def matmul():
        got = flops.measured_matmul_flops(n, repeats=10, dtype="bfloat16")
        return {"matmul_flops": got, "matmul_over_table": got / peak[0] if peak else None}

    def copy():
        got = flops.measured_copy_bandwidth(nbytes, repeats=10)
        return {
            "copy_bytes": nbytes,
            "copy_bytes_per_s": got,
            "copy_over_table": got / bw[0] if bw else None,
        }

    child.attempt("matmul", matmul)
    child.attempt("copy", copy)


def stage_efficiency(child: Child) -> None:
    import jax
    import numpy as np
    import rollout_backends
    import train_step

    from configs import common
    from gjax import efficiency, sharding
    from gjax.learner import build_learner
    from gjax.models import transformer as tr
    from gjax.rollout.decoder import ContinuousDecoder
    from gjax.rollout.sampler import SamplingParams

    child.put(platform_checked=jax.default_backend())
    slots, g, sp_len, n = (8, 2, 16, 32) if child.tiny else (64, 8, 256, 1024)
    cfg = rollout_backends.qwen2_config(model_dims(child.tiny), "float32")
    regions = ContinuousDecoder(cfg, slots=slots, tokens_per_dispatch=8).regions_for(g)

    def decode_bytes():
        got = efficiency.decode_step_bytes(
            cfg, slots=slots, regions=regions, prompt_len=sp_len, max_new=n, tokens_per_dispatch=8
        )
        return {
            "decode_bytes": got,
            "decode_bytes_over_ideal": got["bytes_over_ideal"],
            "decode_touched_over_ideal": got["touched_over_ideal"],
            "decode_step_touched_over_ideal": got["step_touched_over_ideal"],
            "kv_in_place": got["kv_in_place"]["in_place"],
        }

    def decode_bytes_int8():  # the same step on the sampler's int8 weights
        got = efficiency.decode_step_bytes(
            cfg,
            slots=slots,
            regions=regions,
            prompt_len=sp_len,
            max_new=n,
            tokens_per_dispatch=8,
            quantize=QUANT,
        )
        f32 = child.figures.get("decode_bytes") or {}
        return {
            "decode_bytes_int8": got,
            "decode_bytes_int8_over_float": (
                got["bytes_accessed"] / f32["bytes_accessed"] if f32 else None
            ),
            "decode_ideal_int8_over_float": (
                got["ideal_bytes"] / f32["ideal_bytes"] if f32 else None
            ),
            "decode_int8_bytes_over_ideal": got["bytes_over_ideal"],
            "decode_int8_convert_bytes": got["convert_touched_bytes"],
        }

    def decode_syncs():
        small = rollout_backends.qwen2_config(TINY_DIMS, "float32")
        params = tr.init_params(small, jax.random.key(0))
        dec = ContinuousDecoder(small, slots=4, tokens_per_dispatch=4)
        rng = np.random.RandomState(0)
        tokens = rng.randint(3, 100, (4, 6)).astype(np.int32)
        sp = SamplingParams(max_new_tokens=12, temperature=1.0)
        key = jax.random.key(0)
        dec.generate(params, tokens, np.ones_like(tokens), key, num_samples=2, sampling=sp)
        got = efficiency.decode_host_syncs(
            dec, params, tokens, np.ones_like(tokens), key, num_samples=2, sampling=sp
        )
        return {"decode_host_syncs": got, "host_syncs_per_dispatch": got["per_dispatch"]}

    def train_syncs():  # the tiny step's learner, whatever the mode (a CPU check)
        tiny = Child(dict(child.spec, tiny=True))
        c = step_config(tiny)
        small = step_model_cfg(tiny, c)
        mesh = sharding.make_mesh({"data": -1})
        params = sharding.shard_params(tr.init_params(small, jax.random.key(0)), mesh)
        oc = common.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
        state, learner = build_learner(c, mesh=mesh, model_cfg=small, obj_cfg=oc, params=params)
        r = c.rollout
        groups = random_groups(
            np.random.default_rng(0),
            r.prompts_per_step,
            r.num_samples,
            c.data.max_prompt_len,
            r.max_new_tokens,
            small.vocab_size,
        )
        ref = jax.tree.map(lambda x: x.copy(), params)
        got, _ = efficiency.train_step_host_syncs(learner, state, groups, ref, jax.random.key(0))
        return {"train_host_syncs": got, "host_syncs_per_train_step": got["per_step"]}

    def update_flops():
        p_, g_, sp2, n2 = (4, 4, 16, 32) if child.tiny else (16, 8, 256, 1024)
        big = cfg.replace(remat="full")
        rng = np.random.default_rng(0)
        prompt_B = rng.integers(sp2 // 2, sp2 + 1, p_).repeat(g_)
        comp_B = train_step.pareto_lengths(rng, p_ * g_, n2)
        out = {}
        for impl in ("xla", "xla_blocked"):
            got = efficiency.packed_update_flops(
                big,
                prompt_lengths_B=prompt_B,
                completion_lengths_B=comp_B,
                prompt_len=sp2,
                max_new=n2,
                attention_impl=impl,
            )
            out[f"update_flops_{impl}"] = got
        dense = out["update_flops_xla"]
        out["update_packed_executed_over_useful"] = dense["packed_executed_over_useful"]
        out["update_packed_padding_waste"] = dense["packed_padding_waste"]
        return out

    child.attempt("decode_bytes", decode_bytes)
    child.attempt("decode_syncs", decode_syncs)
    child.attempt("train_syncs", train_syncs)
    child.attempt("update_flops", update_flops)
    child.attempt("decode_bytes_int8", decode_bytes_int8)  # last: the other checks first


def random_groups(rng, p: int, g: int, s: int, n: int, vocab: int, completion_lengths=None):
    """Prompt-major rollout groups of random tokens: prompts of s/2..s tokens (left-padded),
    completions of `completion_lengths` (default: all n), 0/1 rewards, sampler log-probs."""
    import numpy as np

    from gjax.experience import Groups

    plen = rng.integers(max(1, s // 2), s + 1, p)
    clen = np.full(p * g, n) if completion_lengths is None else np.asarray(completion_lengths)
    return Groups(
        prompt_ids_PxS=rng.integers(3, vocab, (p, s)).astype(np.int32),
        prompt_mask_PxS=np.arange(s)[None] >= (s - plen)[:, None],
        completion_ids_PxGxN=rng.integers(3, vocab, (p, g, n)).astype(np.int32),
        completion_mask_PxGxN=(np.arange(n)[None] < clen[:, None]).reshape(p, g, n),
        truncated_PxG=np.zeros((p, g), bool),
        is_anchor_PxG=np.zeros((p, g), bool),
        rewards_PxG=rng.integers(0, 2, (p, g)).astype(np.float32),
        scores_PxG=np.full((p, g), np.nan, np.float32),
        valid_PxG=np.ones((p, g), bool),
        old_logps_PxGxN=np.full((p, g, n), -np.log(vocab), np.float32),
    )


def stage_decode(child: Child) -> None:
    import jax
    import numpy as np
    import rollout_backends

    from gjax.models import quant
    from gjax.models import transformer as tr
    from gjax.rollout import pages
    from gjax.rollout.decoder import ContinuousDecoder
    from gjax.rollout.sampler import SamplingParams, generate

    child.put(**device_figures())
    dtype = compute_dtype()
    cfg = rollout_backends.qwen2_config(model_dims(child.tiny), dtype)
    p_, g_, sp_len, n_ = (4, 2, 8, 16) if child.tiny else (8, 8, 128, 512)
    b_ = p_ * g_
    params = tr.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, cfg.vocab_size, (p_, sp_len)).astype(np.int32)
    mask = np.ones_like(tokens)
    sp = SamplingParams(max_new_tokens=n_, temperature=1.0)  # no stop ids: every row N long
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    # Ideal bytes of a step: the weights and the live KV once -- the P prompts' and each
    # row's tokens so far (1..N over its N steps); the same for both decoders here.
    live = rollout_backends.live_kv_tokens(np.full(b_, n_), n_) + p_ * sp_len
    step_bytes = weights + rollout_backends.kv_token_bytes(cfg) * live
    bw = ceilings(child).get("copy_bytes_per_s")
    child.put(
        dtype=dtype,
        rows=b_,
        prompt_len=sp_len,
        new_tokens=n_,
        weight_bytes=weights,
        ideal_step_bytes=step_bytes,
        bandwidth=bw,
        bandwidth_source="ceilings: measured copy" if bw else "none (ceilings did not run)",
    )
    repeats = 2

    def roofline(step_s):
        return step_bytes / step_s / bw if bw else None

    def static():
        def run():
            return generate(
                params, cfg, tokens, mask, jax.random.key(1), num_samples=g_, sampling=sp
            )

        _, secs = rollout_backends.timed(run, repeats)
        return {
            "static_s": secs,
            "static_tokens_per_s": b_ * n_ / secs,
            "static_step_ms": 1e3 * secs / n_,
            "static_roofline": roofline(secs / n_),
        }

    def decode(weights, **paged):
        """(seconds a call, the decoder's counters, seconds a decode step) of the continuous
        decoder on `weights` (float params or the int8 codes); `paged`: its paged-KV args."""
        dec = ContinuousDecoder(cfg, slots=b_, tokens_per_dispatch=8, **paged)

        def run():
            return dec.generate(
                weights, tokens, mask, jax.random.key(1), num_samples=g_, sampling=sp
            )

        _, secs = rollout_backends.timed(run, repeats)
        st = dec.stats
        return secs, st, st["dispatch_s"] / st["decode_steps"]

    def continuous():
        secs, st, step_s = decode(params)
        return {
            "continuous_s": secs,
            "continuous_tokens_per_s": b_ * n_ / secs,
            "continuous_step_ms": 1e3 * step_s,
            "continuous_roofline": roofline(step_s),
            "continuous_roofline_wall": roofline(secs / st["decode_steps"]),
            "continuous_host_fraction": st["host_s"] / st["wall_s"],
            "continuous_dispatches": st["dispatches"],
        }

    def quantized():  # the continuous decoder on the sampler's int8 weights
        qparams = jax.jit(quant.quantize_policy, static_argnums=1)(params, QUANT)
        q_weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(qparams))
        q_step_bytes = q_weights + rollout_backends.kv_token_bytes(cfg) * live
        secs, _, step_s = decode(qparams)
        float_tps = child.figures.get("continuous_tokens_per_s")
        return {
            "quantize": QUANT,
            "int8_weight_bytes": q_weights,
            "int8_continuous_s": secs,
            "int8_continuous_tokens_per_s": b_ * n_ / secs,
            "int8_continuous_step_ms": 1e3 * step_s,
            "int8_continuous_roofline": (q_step_bytes / step_s / bw) if bw else None,
            "int8_over_float_tokens_per_s": (b_ * n_ / secs / float_tps) if float_tps else None,
        }

    def paged(name, attention):  # the same rows on paged KV (the default pool: no preemption)
        def run():
            page = 8 if child.tiny else 16
            secs, st, step_s = decode(params, kv_page_size=page, paged_attention=attention)
            cont = child.figures.get("continuous_step_ms")
            return {
                f"paged_{name}_attention": pages.attention_for(attention),
                f"paged_{name}_tokens_per_s": b_ * n_ / secs,
                f"paged_{name}_step_ms": 1e3 * step_s,
                f"paged_{name}_over_contiguous_step": (1e3 * step_s / cont) if cont else None,
                f"paged_{name}_rows_preempted": st.get("rows_preempted", 0),
            }

        return run

    child.attempt("static", static)
    child.attempt("continuous", continuous)
    child.attempt("quantized", quantized)
    child.attempt("paged_xla", paged("xla", "xla"))
    if pages.attention_for("auto") != "xla":  # a GPU / TPU: its Pallas kernel
        child.attempt("paged_kernel", paged("kernel", "auto"))


def step_config(child: Child, *, staleness: int = 0):
    """`configs/common.tiny` on the 1.5B shape's rollout sizes (the embedded task's prompts,
    the synthetic reward), `rollout.max_staleness` = `staleness`. With --tiny the
    efficiency, update and step stages build the same learner on the same shapes, so the
    later stages find its programs in the compilation cache."""
    from configs import common

    c = common.tiny(common.base())
    # Rows of 13-21 prompt + N tokens in bins of 32 + N: one row per bin once N > 8, so the
    # packed update has one shape every step (no compile after the first).
    p_, g_, n_ = (2, 2, 12) if child.tiny else (16, 8, 512)
    c.rollout.prompts_per_step, c.rollout.num_samples, c.rollout.max_new_tokens = p_, g_, n_
    c.rollout.max_staleness = staleness
    c.data.max_prompt_len = 32  # the task's prompts are <= 21 tokens
    c.model.dtype = compute_dtype()
    c.reward.functions = SYNTHETIC_REWARD
    c.train.steps = SCHEDULE_STEPS  # the optimizer's schedule (and the producer's end)
    return c


SCHEDULE_STEPS = 100  # more than any stage runs


def step_model_cfg(child: Child, c):
    """The model of the learner stages: f32 params, `c`'s compute dtype and remat."""
    import rollout_backends

    return rollout_backends.qwen2_config(model_dims(child.tiny), c.model.dtype).replace(
        param_dtype="float32", remat=c.model.remat
    )


SYNTHETIC_REWARD = "bench_parity"


def _register_reward():
    """A reward needing no verifier and varying within a group (random weights): the parity
    of the completion's crc32."""
    import zlib

    from gjax.rewards.functions import REWARDS

    @REWARDS.register(SYNTHETIC_REWARD)
    def parity(prompts, completions, answers, *, completion_lengths=None, **metadata):
        del prompts, answers, completion_lengths, metadata
        return [float(zlib.crc32(str(c).encode()) % 2) for c in completions]


def _flops_per_token(cfg) -> float:
    """Matmul FLOPs a completion token costs in a GRPO step (6N convention, attention left
    out): 2N sampling, 2N the reference's log-probs, 6N the update (N: matmul params)."""
    from gjax import flops

    n = cfg.num_layers * flops.layer_matmul_params(cfg) + flops.head_matmul_params(cfg)
    return 10.0 * n


def run_steps(child: Child, *, staleness: int, steps: int) -> dict:
    """Timed GRPO steps (`async_pipeline.train_loop`) on the 1.5B shape, random weights,
    every completion max_new_tokens long."""
    import async_pipeline
    import jax

    from gjax import sharding
    from gjax.data.tokenizer import build_tokenizer
    from gjax.models import transformer as tr
    from gjax.rewards.pipeline import build_rewards
    from gjax.rollout import factory

    _register_reward()
    c = step_config(child, staleness=staleness)
    cfg = step_model_cfg(child, c)
    mesh, rollout_mesh = sharding.make_meshes({"data": -1}, 0, jax.devices())  # collocated
    with jax.set_mesh(mesh), sharding.use_rules():
        params = sharding.shard_params(tr.init_params(cfg, jax.random.key(0)), mesh)
        ref = jax.tree.map(lambda x: x.copy(), params)
        tok = build_tokenizer()
        rewards = build_rewards(c, None)
        backend = factory.make_backend(c, cfg, params, mesh=mesh, tokenizer=tok)
        try:
            out = async_pipeline.train_loop(
                c,
                cfg=cfg,
                params=params,
                tokenizer=tok,
                rewards=rewards,
                mesh=mesh,
                rollout_mesh=rollout_mesh,
                backend=backend,
                steps=steps,
                ref_params=ref if c.objective.kl_beta else None,
                full_length=True,  # random weights: no stop, one shape per step
            )
        finally:
            rewards.close()
    out["decoder_stats"] = dict(backend.decoder.stats)
    out["config"] = {
        "P": c.rollout.prompts_per_step,
        "G": c.rollout.num_samples,
        "max_new_tokens": c.rollout.max_new_tokens,
        "decode_slots": c.rollout.decode_slots,
        "tokens_per_dispatch": c.rollout.tokens_per_dispatch,
        "kl_beta": float(c.objective.kl_beta),
        "dtype": c.model.dtype,
    }
    out["_pieces"] = (cfg, ref, backend, c)  # ref: a copy of the params (never donated)
    return out


def prefill_seconds(cfg, params, decoder, c) -> float:
    """One blocked prefill call of the decoder at the step's shapes (the step's own calls
    run asynchronously, inside the dispatches' waits)."""
    import statistics

    import jax
    import numpy as np

    from gjax.rollout import decoder as dec

    g_, s_ = c.rollout.num_samples, decoder.slots
    a_ = decoder.prefill_batch or max(1, -(-s_ // g_))
    r_ = decoder.regions_for(g_)
    sp_len, n_ = c.data.max_prompt_len, c.rollout.max_new_tokens
    tokens = np.full((a_, sp_len), 3, np.int32)
    regions = np.arange(a_, dtype=np.int32) % r_
    times = []
    for _ in range(3):
        state = dec.init_state(cfg, s_, r_, sp_len, n_)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        jax.block_until_ready(
            dec._prefill_jit(params, cfg, state, tokens, np.ones_like(tokens), regions)
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def stage_step(child: Child) -> None:
    import statistics

    import jax

    child.put(**device_figures())
    out = run_steps(child, staleness=0, steps=1 if child.tiny else 2)
    cfg, params, backend, c = out.pop("_pieces")
    per = out["per_step"]
    med = lambda k: statistics.median(r[k] for r in per)  # noqa: E731
    st = out["decoder_stats"]  # the last step's generate
    chips = jax.device_count()
    step_s = med("step_s")
    figures = {
        k: out[k] for k in ("steps", "steps_per_s", "tokens_per_s", "config", "decoder_stats")
    }
    figures.update(
        step_s=step_s,
        sample_s=med("sample_s"),
        learner_s=med("learner_s"),
        completion_tokens=med("completion_tokens"),
        completion_tokens_per_s_per_chip=med("completion_tokens") / step_s / chips,
        total_tokens_per_s_per_chip=(med("completion_tokens") + med("prompt_tokens"))
        / step_s
        / chips,
    )
    peak = (ceilings(child).get("table_peak_flops") or ceilings(child).get("matmul_flops")) or None
    if peak:
        figures["step_mfu"] = (
            _flops_per_token(cfg) * med("completion_tokens") / step_s / (peak * chips)
        )
        figures["step_mfu_note"] = "10N FLOPs per completion token (sample + ref + update)"
    child.put(**figures)

    def phases():  # the last timed step's (the decoder's counters are its generate's)
        last = per[-1]
        prefill = st.get("prefill_calls", 0) * prefill_seconds(cfg, params, backend.decoder, c)
        decode = max(st["dispatch_s"] - prefill, 0.0)
        learner = last["learner_s"]
        host = max(last["step_s"] - decode - prefill - learner, 0.0)
        split = {"decode": decode, "prefill": prefill, "learner": learner, "host": host}
        return {
            "phases_step_s": last["step_s"],
            "phases_s": split,
            "phase_split": " / ".join(f"{100 * v / last['step_s']:.0f}%" for v in split.values()),
            "prefill_note": "prefill calls x one blocked prefill call at the step's shapes",
        }

    child.attempt("phases", phases)


def stage_async(child: Child) -> None:
    child.put(**device_figures())
    out = run_steps(child, staleness=1, steps=2 if child.tiny else 3)
    out.pop("_pieces")
    sync = (child.spec["prior"].get("step") or {}).get("steps_per_s")
    child.put(
        steps=out["steps"],
        steps_per_s=out["steps_per_s"],
        tokens_per_s=out["tokens_per_s"],
        learner_idle_frac=out["learner_idle_frac"],
        rollout_idle_frac=out["rollout_idle_frac"],
        sync_steps_per_s=sync,
        over_sync=out["steps_per_s"] / sync if sync else None,
        over_sync_note=None if sync else "no sync figure: stage step did not finish",
    )


def stage_update(child: Child) -> None:
    import statistics

    import jax
    import numpy as np
    import train_step

    from configs import common
    from gjax import flops, sharding
    from gjax.learner import build_learner
    from gjax.models import attention
    from gjax.models import transformer as tr

    child.put(**device_figures())
    c = step_config(child)  # --tiny: the step stage's learner and shapes
    if not child.tiny:  # the 1.5B shape's update at long completions
        c.rollout.prompts_per_step, c.rollout.num_samples = 16, 8
        c.data.max_prompt_len, c.rollout.max_new_tokens = 256, 1024
    p_, g_ = c.rollout.prompts_per_step, c.rollout.num_samples
    sp_len, n_ = c.data.max_prompt_len, c.rollout.max_new_tokens
    c.train.packing = "packed"  # auto bins, the head at the read positions
    dtype = c.model.dtype
    cfg = step_model_cfg(child, c)
    obj_cfg = common.to_objective_config(c.objective, rollout_temperature=c.rollout.temperature)
    mesh = sharding.make_mesh({"data": -1})
    rng = np.random.default_rng(0)
    # Pareto completions (mean <= N / 4); --tiny: full length (the step stage's shapes)
    lengths = train_step.pareto_lengths(rng, p_ * g_, n_) if not child.tiny else None
    groups = random_groups(rng, p_, g_, sp_len, n_, cfg.vocab_size, completion_lengths=lengths)
    with jax.set_mesh(mesh), sharding.use_rules():
        params = sharding.shard_params(tr.init_params(cfg, jax.random.key(0)), mesh)
        ref = jax.tree.map(lambda x: x.copy(), params)
        state, learner = build_learner(c, mesh=mesh, model_cfg=cfg, obj_cfg=obj_cfg, params=params)
        times = []
        for i in range(3):  # the first compiles; the same batch shape after it
            t0 = time.perf_counter()
            batch = jax.block_until_ready(learner.batch(groups, state.params, ref))
            t1 = time.perf_counter()
            state, metrics = learner.update(state, batch, jax.random.key(i))
            jax.block_until_ready(metrics)
            times.append((t1 - t0, time.perf_counter() - t1))
    logps_s = statistics.median(t[0] for t in times[1:])
    update_s = statistics.median(t[1] for t in times[1:])
    t = c.train
    chunk = obj_cfg.token_chunk
    comp_B = groups.completion_mask_PxGxN.reshape(p_ * g_, -1).sum(-1)
    shapes = dict(
        seq_lengths_B=np.repeat(groups.prompt_mask_PxS.sum(-1), g_) + comp_B,
        completion_lengths_B=comp_B,
        padded_len_S=batch["input_ids_BxS"].shape[1],
        padded_completion_len_T=batch["targets_BxT"].shape[1],
        extra_forwards=1,
        num_iterations=t.num_iterations,
        update_pieces=t.minibatches * t.microbatches,
        update_token_chunk=chunk,
        logps_token_chunk=chunk or 256,
        head_kernel=obj_cfg.lm_head_kernel,
        platform=jax.default_backend(),
        attention_impl=attention.platform_impl(cfg.attention),
        packed_bins=int(batch["pack_bins_J"].shape[0]) * t.minibatches,
        pack_length=int(batch["input_ids_BxS"].shape[1]),
        pack_reads=int(batch["pack_reads_C"].shape[0]) if "pack_reads_C" in batch else 0,
    )
    f = flops.learner_flops(cfg, **shapes)
    chips = jax.device_count()
    peak = ceilings(child).get("table_peak_flops") or ceilings(child).get("matmul_flops")
    peak_source = (
        "table" if ceilings(child).get("table_peak_flops") else "measured matmul (ceilings)"
    )
    useful, executed = f["update_useful"], f["update_executed"]
    child.put(
        dtype=dtype,
        rows=p_ * g_,
        real_tokens=f["real_tokens"],
        bins_J=shapes["packed_bins"],
        reads_C=shapes["pack_reads"],
        attention=shapes["attention_impl"],
        logps_s=logps_s,
        update_s=update_s,
        update_useful_flops=useful,
        update_executed_flops=executed,
        padding_waste=(executed - f["update_recompute"]) / useful,
        recompute_factor=executed / (executed - f["update_recompute"]),
        peak_flops=peak * chips if peak else None,
        peak_source=peak_source,
        mfu=useful / update_s / (peak * chips) if peak else None,
        hfu=executed / update_s / (peak * chips) if peak else None,
        learner_mfu=f["useful"] / (logps_s + update_s) / (peak * chips) if peak else None,
        loss=float(metrics["loss/total"]) if "loss/total" in metrics else None,
    )


def stage_head(child: Child) -> None:
    import jax
    import loss_kernels

    child.put(**device_figures())
    n, d, v = loss_kernels.SMOKE_CASE if child.tiny else (4096, 1536, 151936)
    make = loss_kernels._jax_loss_fns(n, d, v)
    platform = jax.devices()[0].platform
    rows = {}
    for method in ("floor", "fused", "naive"):
        try:
            rows[method] = loss_kernels._jax_one(jax, make, method, 2, platform)
        except Exception as e:  # noqa: BLE001 (one method's failure is its row)
            rows[method] = {"error": f"{type(e).__name__}: {e}"[:300]}
        child.put(case={"tokens": n, "hidden": d, "vocab": v}, methods=rows)
    t = {m: r.get("time_s") for m, r in rows.items()}
    ratio = lambda a, b: t[a] / t[b] if t.get(a) and t.get(b) else None  # noqa: E731
    matmul = ceilings(child).get("matmul_flops")
    child.put(
        fused_over_floor=ratio("fused", "floor"),
        naive_over_floor=ratio("naive", "floor"),
        fused_over_naive=ratio("fused", "naive"),
        floor_flops_per_s=loss_kernels.head_flops(n, d, v) / t["floor"] if t.get("floor") else None,
        floor_over_matmul_ceiling=(
            loss_kernels.head_flops(n, d, v) / t["floor"] / matmul
            if t.get("floor") and matmul
            else None
        ),
        inputs_dtype="float32 (loss_kernels' inputs)",
    )


CHILD_STAGES = {
    "ceilings": stage_ceilings,
    "efficiency": stage_efficiency,
    "decode": stage_decode,
    "update": stage_update,
    "head": stage_head,
    "step": stage_step,
    "async": stage_async,
}


def main_child(args) -> None:
    from gjax import compile_cache

    spec = json.loads(args.spec)
    compile_cache.enable(spec["compilation_cache"])
    CHILD_STAGES[args.child](Child(spec))


# --------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="accelerator.json", help="the report's JSON path")
    ap.add_argument("--markdown", default="accelerator.md", help="the markdown table's path")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke run (CI)")
    ap.add_argument(
        "--stages", default="", help=f"comma list, in order (default all: {list(STAGES)})"
    )
    ap.add_argument(
        "--budgets", default="", help="NAME=SECONDS,...: stage budgets other than `STAGES`'"
    )
    ap.add_argument(
        "--total-budget", type=float, default=0, help="seconds for the whole run (0: default)"
    )
    ap.add_argument(
        "--compilation-cache",
        default="default",
        help="gjax.compile_cache setting shared by the stages ('' off)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.child:
        main_child(args)
        return
    report = main_parent(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(markdown(report), end="")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_cli(main)
