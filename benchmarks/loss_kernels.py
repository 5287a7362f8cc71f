"""Is gjax's fused LM-head loss worth it here? One table: the fused objective vs the naive JAX
path, the bare matmul floor, Liger-Kernel's fused GRPO loss and a TRL-style PyTorch loss.

    python benchmarks/loss_kernels.py                        # 512 x 1536 x 151936, every method
    python benchmarks/loss_kernels.py --tokens 512,2048,8192 # sweep N: where fused overtakes
    python benchmarks/loss_kernels.py --full                 # the grid {512,1024} x 3 (D, V)
    python benchmarks/loss_kernels.py --cases 1024x2048x32000 --methods fused,floor,trl
    python benchmarks/loss_kernels.py --smoke                # CI: a toy case, seconds

The default run is one representative case (N = 512 tokens, hidden D = 1536, vocab V =
151,936: Qwen2.5-1.5B's head) and every method; it takes about 2.5 minutes on an idle 2-core
CPU (2 timed calls per method, each a forward+backward over 0.72 TFLOP of head matmuls;
estimated from its 216-231 s of CPU time on a loaded host, see below). The same command runs on an accelerator: JAX goes to its default backend,
torch to CUDA when it has it; every result names its platform and device.

Processes: the JAX methods share ONE child process (one import, the persistent compilation
cache `gjax.compile_cache` across methods and runs, `--compilation-cache` to choose it; its
memory measure, XLA's compiled memory analysis, does not need a process of its own); each
torch method gets its own child, since its measure on the CPU is the process's peak RSS.
Children run with MALLOC_MMAP_THRESHOLD_=1 MiB so large freed buffers leave the RSS.

Methods (all compute the loss and its gradients w.r.t. hidden [N, D] and head, f32, seed 0):
  floor  the bare LM-head matmul forward+backward: logits = h @ W, grad of sum(logits * c)
         with a fixed random cotangent c (3 matmuls, nothing else): the time to beat.
  fused  gjax.objective.loss (GRPO advantages, PPO-clip eps 0.2, token-mean aggregation) on
         gjax.objective.logprobs.fused_token_loss, kernel 'auto' (the platform's schedule in
         logprobs.FUSED_TILES: 3 or 4 matmuls, chunked, never the [N x V] logits), jax.grad.
  fused_ref  the same with lm_head_kernel='reference' (4 matmuls, 1024-token chunks).
  fused_3mm  fused_token_loss(store_logits=True, token_chunk=96), same loss: 3 matmuls, a
         [96 x V] logits buffer per chunk.
  naive  the same loss from materialized logits -> log_softmax -> gather, jax.grad.
  trl    TRL-style torch: logits = h @ W^T -> log_softmax -> gather -> PPO clip -> masked
         token mean, .backward() (materialized, like naive).
  liger  liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (beta 0, no reference model,
         loss_type 'dapo' = token mean, eps 0.2, torch.compile'd chunks; eager in --smoke).

Measures per method: `--reps` timed calls (default 2), medians, after a warm-up call for
torch (torch.compile and the allocator's first use happen in it); JAX compiles ahead of time
(`jit(...).lower(...).compile()`, `compile_s`) and allocates every call's buffers afresh, so
its first call is already a steady-state one and the default run spends no call on warm-up.
  wall s   the call's wall time; cpu s  this process's CPU time during it (all threads). On a
           shared machine CPU time is the steadier one (others' time slices do not count;
           their cache and memory-bandwidth pressure still does); on an idle one, wall.
  x floor  time / the floor method's time in the same run (wall and CPU).
  GFLOP/s  the head's useful matmul FLOPs (6 N D V: forward + backward) / wall time.
  mem MB   scratch: memory one step needs beyond its inputs and the gradients it returns.
           JAX: the compiled executable's memory_analysis().temp_size_in_bytes (XLA's
           scratch buffers). torch CPU: the peak RSS of the timed calls above the RSS before
           them (the previous call's gradients are resident before and freed at the start of
           each call, so they net out; autograd's saved tensors count); torch CUDA: the same
           with torch.cuda.max_memory_allocated. JAX's RSS is measured too (rss_mb in the
           JSON: peak above before, less the returned gradients' bytes), so that fused vs a
           torch peer on the CPU compares RSS with RSS.
Materialized methods whose memory would not fit (JAX: the compiled sizes; torch: 4 [N x V]
f32 arrays) against MemAvailable are skipped with a note instead of swapping the machine.

Output (stdout): the table first (platform and device, one row per method, then one verdict
line per peer: fused faster/slower, smaller/larger at this N), then one JSON line per
(case, method), and as the LAST line a JSON summary (ratios, the sweep's crossover, the
run's own wall and CPU time and the load average). Progress goes to stderr. With several
token counts at one (D, V), a sweep table says at which N fused overtakes each peer in time.

Measured 2026-12-01 (this repo's shared 2-core AVX-512 CPU host, jax 0.10.2, torch 2.13,
liger-kernel 0.8.5; the default run): 629 s wall, 231 s CPU (all processes) at load average
12-14, cold compilation cache, ~141 s estimated idle (the calls' 181 CPU s / 2 + the rest as
serial); 334 s wall, 216 s CPU at load 5.5-6, warm cache, ~127 s estimated idle. The first:
CPU s (x floor): floor 7.97, fused 8.63 (1.08), fused_ref 8.44 (1.06), fused_3mm 14.10
(1.77), naive 8.27 (1.04), trl 5.46 (0.69), liger 23.70 (2.97); scratch MB: fused 38 (XLA;
50 RSS), fused_3mm 115, naive 594 (XLA), trl 298, liger 920 (RSS). So on this CPU fused is
15.6x smaller than naive and 6x smaller than trl, 4 % / 37 % slower in CPU time at N = 512
(torch's CPU matmuls outrun XLA:CPU's: trl is below the JAX floor), 2.75x faster than Liger.
Earlier (2026-11-25, the grid at N = 512 and 1024, load 6-14): cpu x floor fused 1.16 /
1.24 / 1.02 / 1.15 (512x896x151936, 512x1536x151936, 512x2048x32000, 1024x2048x32000);
trl / fused cpu 1.34 / 1.24 / 1.63 / 1.64: the ranking against trl flipped between the two
days, so under heavy load even CPU time is not a load-free measure (cache, memory bandwidth
and SMT siblings are shared); rerun on an idle machine before reading the trl verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python benchmarks/loss_kernels.py` from anywhere: gjax.errors
    sys.path.insert(0, ROOT)

from gjax.errors import UserError, run_cli  # noqa: E402  (light: no jax import)

DEFAULT_CASE = (512, 1536, 151936)
FULL_TOKENS = (512, 1024)
FULL_DV = ((1536, 151936), (896, 151936), (2048, 32000))
SMOKE_CASE = (64, 32, 1024)
JAX_METHODS = ("floor", "fused", "fused_ref", "fused_3mm", "naive")
TORCH_METHODS = ("trl", "liger")
METHODS = JAX_METHODS + TORCH_METHODS
MATERIALIZED = ("naive", "trl")  # the peers that hold [N x V] logits
THREE_PASS_CHUNK = 96
EPS = 0.2
BATCH_ROWS = 4  # N tokens = 4 sequences of N / 4 tokens
FIT_FRACTION = 0.8  # of MemAvailable a materialized method may need before it is skipped


# ------------------------------------------------------------------ memory helpers


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _measure(step, reps: int, *, warmup: bool = True, device_peak=None) -> dict:
    """An optional warm-up call, then `reps` timed calls, the peak-RSS counter reset before
    them. `rss_mb`: their peak RSS above the RSS before them.

    `device_peak`: (reset, read) of an accelerator allocator's peak bytes (torch CUDA)."""
    import gc

    warmup_s = warmup_cpu = 0.0
    if warmup:
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        warmup_s, warmup_cpu = time.perf_counter() - t0, time.process_time() - c0
    gc.collect()
    rss0 = _status_kb("VmRSS")
    reset = _reset_peak_rss()
    base = device_peak[0]() if device_peak else None
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _status_kb("VmHWM")
    out = {
        "time_s": round(statistics.median(times), 4),
        "cpu_s": round(statistics.median(cpu), 4),
        "times_s": [round(t, 4) for t in times],
        "warmup_s": round(warmup_s, 3) if warmup else None,
        # all CPU time of the calls (warm-up included): the run's parallel part
        "calls_cpu_s": round(warmup_cpu + sum(cpu), 3),
        "rss_mb": round((peak - rss0) / 1024, 1) if reset else None,
    }
    if device_peak:
        out["device_mb"] = round((device_peak[1]() - base) / 2**20, 1)
    return out


# ------------------------------------------------------------------ inputs


def _numpy_inputs(n: int, d: int, v: int):
    import numpy as np

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((n, d), dtype=np.float32)
    head_DxV = (rng.standard_normal((d, v), dtype=np.float32) / np.sqrt(d)).astype(np.float32)
    targets = rng.integers(0, v, size=(n,)).astype(np.int32)
    # old log-probs near the current ones (so ratios straddle the clip range)
    old = (-np.log(v) + 0.1 * rng.standard_normal(n)).astype(np.float32)
    rewards = rng.standard_normal(BATCH_ROWS).astype(np.float32)
    # GRPO advantages of one group (population std, eps 1e-6), as gjax's 'grpo' computes them,
    # so that every method evaluates the same loss value.
    adv_rows = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).astype(np.float32)
    return hidden, head_DxV, targets, old, adv_rows, rewards


def head_flops(n: int, d: int, v: int) -> int:
    """Useful matmul FLOPs of the head's forward + backward: logits, dhidden, dhead."""
    return 6 * n * d * v


# ------------------------------------------------------------------ JAX worker


def _jax_loss_fns(n: int, d: int, v: int):
    """{method: (loss_fn, args)} for one case; inputs built once and shared."""
    import jax.numpy as jnp
    import numpy as np

    hidden_np, head_np, targets_np, old_np, adv_rows, rewards = _numpy_inputs(n, d, v)
    b, t = BATCH_ROWS, n // BATCH_ROWS
    hidden, head = jnp.asarray(hidden_np), jnp.asarray(head_np)
    del hidden_np, head_np
    targets, old = jnp.asarray(targets_np), jnp.asarray(old_np)
    adv_N = jnp.repeat(jnp.asarray(adv_rows), t)

    def make(method):
        import jax

        if method in ("fused", "fused_ref"):
            from gjax.objective.loss import ObjectiveConfig, full_batch_loss

            cfg = ObjectiveConfig(
                advantage="grpo",
                policy_loss="ppo_clip",
                aggregation="token_mean",
                lm_head_kernel="reference" if method == "fused_ref" else "auto",
            )
            batch = {  # one prompt group of B rows; rewards give non-zero GRPO advantages
                "targets_BxT": targets.reshape(b, t),
                "loss_mask_BxT": jnp.ones((b, t), jnp.float32),
                "old_logps_BxT": old.reshape(b, t),
                "rewards_PxG": jnp.asarray(rewards).reshape(1, b),
                "valid_PxG": jnp.ones((1, b), bool),
            }

            def loss_fn(h, w):
                return full_batch_loss(h.reshape(b, t, d), w, batch, cfg)[0]

            return loss_fn, (hidden, head)
        if method == "fused_3mm":
            from gjax.objective.logprobs import fused_token_loss

            def token_loss(logp, ent, a):
                ratio = jnp.exp(logp - a["old"])
                pg = -jnp.minimum(ratio * a["adv"], jnp.clip(ratio, 1 - EPS, 1 + EPS) * a["adv"])
                return pg / n, {}

            def loss_fn(h, w):
                args = {"old": old, "adv": adv_N}
                return fused_token_loss(
                    h, w, targets, token_loss, args, token_chunk=THREE_PASS_CHUNK, store_logits=True
                )[0]

            return loss_fn, (hidden, head)
        if method == "naive":

            def loss_fn(h, w):
                logp_NxV = jax.nn.log_softmax(h @ w, axis=-1)
                logp = jnp.take_along_axis(logp_NxV, targets[:, None], axis=1)[:, 0]
                ratio = jnp.exp(logp - old)
                pg = -jnp.minimum(ratio * adv_N, jnp.clip(ratio, 1 - EPS, 1 + EPS) * adv_N)
                return jnp.mean(pg)

            return loss_fn, (hidden, head)
        if method == "floor":
            rng = np.random.default_rng(1)
            cot = jnp.asarray(rng.standard_normal((n, v), dtype=np.float32))

            def loss_fn(h, w, c):
                return jnp.sum((h @ w) * c)

            return loss_fn, (hidden, head, cot)
        raise ValueError(method)

    return make


def _jax_worker(spec: dict) -> None:
    """All JAX (case, method)s of the run in this one process; a RESULT line each."""
    import jax

    from gjax import compile_cache

    cache_dir = compile_cache.enable(spec["compilation_cache"])
    dev = jax.devices()[0]
    device = _cpu_model() if dev.platform == "cpu" else dev.device_kind
    for n, d, v in spec["cases"]:
        make = _jax_loss_fns(n, d, v)
        for method in spec["methods"]:
            row = {"tokens": n, "hidden": d, "vocab": v, "method": method, "framework": "jax"}
            row.update(platform=dev.platform, device=device, compilation_cache=cache_dir)
            row["pid"] = os.getpid()
            try:
                row.update(_jax_one(jax, make, method, spec["reps"], dev.platform))
            except Exception as e:  # one method's failure is its row, the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            print("RESULT " + json.dumps(row), flush=True)
        del make


def _jax_one(jax, make, method: str, reps: int, platform: str) -> dict:
    loss_fn, args = make(method)
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(*args).compile()
    out = {"compile_s": round(time.perf_counter() - t0, 3)}
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes if mem is not None else None
    out["temp_mb"] = round(temp / 2**20, 1) if temp is not None else None
    if platform == "cpu" and temp is not None:
        need = temp + mem.output_size_in_bytes
        avail = _mem_available_bytes()
        if avail is not None and need > FIT_FRACTION * avail:
            out["skipped"] = (
                f"needs {need / 2**30:.1f} GiB beyond its inputs, {avail / 2**30:.1f} GiB available"
            )
            return out
    holder = {}

    def step():
        holder["loss"] = jax.block_until_ready(compiled(*args))[0]

    # No warm-up call: the program is compiled ahead of time, and every call allocates its
    # buffers afresh (MALLOC_MMAP_THRESHOLD_), so the first call is a steady-state one.
    out.update(_measure(step, reps, warmup=False))
    out["loss"] = float(holder.pop("loss"))
    if out["rss_mb"] is not None and mem is not None:  # the returned gradients net out, as
        # for torch (whose previous gradients are resident before and freed in the call)
        out["rss_mb"] = round(out["rss_mb"] - mem.output_size_in_bytes / 2**20, 1)
    return out


# ------------------------------------------------------------------ torch worker


def _torch_worker(spec: dict) -> None:
    """One torch (case, method) in this process (its RSS is the measure); one RESULT line."""
    import torch

    (n, d, v), method = spec["cases"][0], spec["methods"][0]
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:  # f32 matmuls as JAX runs them by default on the GPU (TF32 inputs, f32 sums)
        torch.backends.cuda.matmul.allow_tf32 = True
    row = {"tokens": n, "hidden": d, "vocab": v, "method": method, "framework": "torch"}
    row.update(
        platform="gpu" if cuda else "cpu",
        device=torch.cuda.get_device_name(0) if cuda else _cpu_model(),
        torch_threads=torch.get_num_threads(),
        pid=os.getpid(),
    )
    need = 4 * n * v * 4  # logits, log-softmax, and their gradients, f32
    avail = _mem_available_bytes()
    if method == "trl" and not cuda and avail is not None and need > FIT_FRACTION * avail:
        row["skipped"] = (
            f"needs ~{need / 2**30:.1f} GiB ([N x V] f32 x 4), {avail / 2**30:.1f} GiB available"
        )
        print("RESULT " + json.dumps(row), flush=True)
        return
    try:
        row.update(_torch_one(torch, dev, method, n, d, v, spec["reps"], spec["smoke"]))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    print("RESULT " + json.dumps(row), flush=True)


def _torch_one(torch, dev, method, n, d, v, reps, smoke) -> dict:
    torch.manual_seed(0)
    hidden_np, head_np, targets_np, old_np, adv_rows, _ = _numpy_inputs(n, d, v)
    b, t = BATCH_ROWS, n // BATCH_ROWS
    hidden = torch.from_numpy(hidden_np).reshape(b, t, d).to(dev).requires_grad_(True)
    weight_VxD = torch.from_numpy(head_np.T.copy()).to(dev).requires_grad_(True)  # Linear layout
    del hidden_np, head_np
    targets = torch.from_numpy(targets_np).long().reshape(b, t).to(dev)
    old = torch.from_numpy(old_np).reshape(b, t).to(dev)
    adv_B = torch.from_numpy(adv_rows).to(dev)
    mask = torch.ones(b, t, device=dev)

    if method == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_mod = LigerFusedLinearGRPOLoss(
            beta=0.0,
            use_ref_model=False,
            epsilon_low=EPS,
            epsilon_high=EPS,
            loss_type="dapo",
            compiled=not smoke,
        )

        def loss_fn():
            out = loss_mod(hidden, weight_VxD, targets, mask, adv_B, old_per_token_logps=old)
            return out[0] if isinstance(out, tuple) else out

    elif method == "trl":

        def loss_fn():
            logits = hidden @ weight_VxD.T
            logp = torch.log_softmax(logits.float(), dim=-1)
            logp = torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logp - old)
            adv = adv_B[:, None]
            pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv)
            return (pg * mask).sum() / mask.sum()

    else:
        raise ValueError(method)

    holder = {}

    def step():
        hidden.grad = None
        weight_VxD.grad = None
        loss = loss_fn()
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        holder["loss"] = float(loss.detach())

    device_peak = None
    if dev.type == "cuda":

        def reset():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()

        device_peak = (reset, torch.cuda.max_memory_allocated)
    out = _measure(step, reps, device_peak=device_peak)
    out["loss"] = holder["loss"]
    return out


# ------------------------------------------------------------------ driver


def _child(kind: str, spec: dict, timeout: float, on_row) -> list[dict]:
    """Runs a worker child; its RESULT rows (each also passed to `on_row` as it arrives)."""
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # big buffers go back to the OS on free
    # No JAX_PLATFORMS default: the worker runs where jax's default backend is (an
    # accelerator when there is one; a forced "cpu" here once timed an H100 run on its host).
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(spec)]
    rows, tail = [], []
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import threading

    def drain_stderr():
        for line in p.stderr:
            tail.append(line.rstrip())
            del tail[:-5]

    th = threading.Thread(target=drain_stderr, daemon=True)
    th.start()
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        for line in p.stdout:
            if line.startswith("RESULT "):
                row = json.loads(line[len("RESULT ") :])
                rows.append(row)
                on_row(row)
        p.wait()
    finally:
        timer.cancel()
    th.join(timeout=5)
    if p.returncode != 0:  # rows it did not reach: an error each
        why = f"timeout after {timeout:.0f}s" if p.returncode == -9 else " | ".join(tail)[-400:]
        done = {(r["tokens"], r["hidden"], r["vocab"], r["method"]) for r in rows}
        for n, d, v in spec["cases"]:
            for m in spec["methods"]:
                if (n, d, v, m) not in done:
                    row = {"tokens": n, "hidden": d, "vocab": v, "method": m, "error": why}
                    rows.append(row)
                    on_row(row)
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def _mem(r):
    """(MB, what) of a row's memory measure for the table."""
    if r.get("framework") == "jax":
        return r.get("temp_mb"), "XLA temp"
    if r.get("device_mb") is not None:
        return r.get("device_mb"), "CUDA alloc"
    return r.get("rss_mb"), "RSS"


def _common_memory(a: dict, b: dict):
    """(a MB, b MB, measure) for two rows on one measure both have, or None."""
    if a.get("framework") == b.get("framework") == "jax":
        return a.get("temp_mb"), b.get("temp_mb"), "XLA temp"
    if b.get("device_mb") is not None:  # torch on CUDA: allocator scratch vs XLA's
        return a.get("temp_mb"), b.get("device_mb"), "XLA temp vs CUDA alloc"
    if a.get("platform") == "cpu" and b.get("platform") == "cpu":
        return a.get("rss_mb"), b.get("rss_mb"), "RSS"
    return None


def verdict(fused: dict, peer: dict) -> str:
    """One line: fused against `peer` in time (wall, CPU) and memory, at this case."""
    name = peer["method"]
    if "time_s" not in fused:
        return f"vs {name}: fused has no time ({fused.get('error') or fused.get('skipped')})"
    if "time_s" not in peer:
        why = peer.get("skipped") or peer.get("error") or "not run"
        return f"vs {name}: {name} has no time ({why})"
    wall = peer["time_s"] / fused["time_s"]  # > 1: fused is faster
    cpu = _ratio(peer.get("cpu_s"), fused.get("cpu_s"))
    word = "faster" if wall > 1 else "slower"
    parts = [f"vs {name}: fused is {word} ({wall:.2f}x {name}'s speed in wall time"]
    if cpu is not None:
        cword = "faster" if cpu > 1 else "slower"
        parts[-1] += f", {cpu:.2f}x in CPU time" + ("" if cword == word else f": {cword}")
    parts[-1] += ")"
    mem = _common_memory(fused, peer)
    if mem and mem[0] and mem[1]:
        f_mb, p_mb, what = mem
        if 0.9 <= p_mb / f_mb <= 1.1:
            parts.append(f"about the same memory ({what} {f_mb} vs {p_mb} MB)")
        elif p_mb > f_mb:
            parts.append(f"smaller ({p_mb / f_mb:.1f}x less memory, {what} {f_mb} vs {p_mb} MB)")
        else:
            parts.append(f"larger ({f_mb / p_mb:.1f}x more memory, {what} {f_mb} vs {p_mb} MB)")
    else:
        parts.append("memory not comparable")
    line = ", ".join(parts) + f", at N = {fused['tokens']}"
    if fused.get("platform") != peer.get("platform"):
        line += f" (different platforms: {fused.get('platform')} vs {peer.get('platform')})"
    return line


def case_table(rows: list[dict]) -> str:
    """The table of one case: a header line, a row per method, a verdict per peer."""
    n, d, v = rows[0]["tokens"], rows[0]["hidden"], rows[0]["vocab"]
    by = {r["method"]: r for r in rows}
    floor = by.get("floor", {})
    where = sorted({f"{r.get('framework')}: {r.get('platform')} ({r.get('device')})" for r in rows})
    lines = [
        f"## N = {n} tokens x D = {d} x V = {v}: head {head_flops(n, d, v) / 1e9:.0f} GFLOP "
        "(forward + backward), f32",
        "platform: " + "; ".join(where),
        "",
        "| method | wall s | cpu s | wall x floor | cpu x floor | GFLOP/s | mem MB | mem measure "
        "| note |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ts = r.get("time_s")
        mb, what = _mem(r)
        note = r.get("error") or r.get("skipped") or ""
        gf = head_flops(n, d, v) / ts / 1e9 if ts else None
        lines.append(
            f"| {r['method']} | {_fmt(ts, 3)} | {_fmt(r.get('cpu_s'), 3)} | "
            f"{_fmt(_ratio(ts, floor.get('time_s')))} | "
            f"{_fmt(_ratio(r.get('cpu_s'), floor.get('cpu_s')))} | {'-' if gf is None else f'{gf:.3g}'} | "
            f"{'-' if mb is None else mb} | {what} | {note} |"
        )
    fused = by.get("fused")
    if fused:
        lines.append("")
        lines += [verdict(fused, r) for r in rows if r["method"] not in ("fused", "floor")]
    return "\n".join(lines)


def crossover(rows: list[dict], peer: str, key: str = "time_s"):
    """The smallest swept N (at one D, V) from which on fused's `key` stays <= `peer`'s; None
    when it never does within the sweep (or a point is missing)."""
    by = {(r["tokens"], r["method"]): r for r in rows}
    ns = sorted({r["tokens"] for r in rows})
    found = None
    for n in reversed(ns):
        f, p = by.get((n, "fused"), {}).get(key), by.get((n, peer), {}).get(key)
        if f is None or p is None or f > p:
            break
        found = n
    return found


def sweep_table(rows: list[dict]) -> str:
    """Fused vs each peer over N at one (D, V): time ratios and the crossover points."""
    ns = sorted({r["tokens"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    peers = [m for m in methods if m not in ("fused", "floor")]
    by = {(r["tokens"], r["method"]): r for r in rows}
    lines = [
        f"## sweep over N at D = {rows[0]['hidden']} x V = {rows[0]['vocab']}: peer time / "
        "fused time (> 1: fused faster), wall (cpu)",
        "",
        "| N | fused wall s | " + " | ".join(peers) + " |",
        "|---:|---:|" + "---:|" * len(peers),
    ]
    for n in ns:
        f = by.get((n, "fused"), {})
        cells = []
        for m in peers:
            p = by.get((n, m), {})
            w, c = _ratio(p.get("time_s"), f.get("time_s")), _ratio(p.get("cpu_s"), f.get("cpu_s"))
            cells.append(f"{_fmt(w)} ({_fmt(c)})" if w else (p.get("skipped") and "skipped" or "-"))
        lines.append(f"| {n} | {_fmt(f.get('time_s'), 3)} | " + " | ".join(cells) + " |")
    lines.append("")
    for m in peers:
        w, c = crossover(rows, m), crossover(rows, m, "cpu_s")
        say = lambda x: f"from N = {x} on" if x else "not within the swept N"  # noqa: E731
        lines.append(f"fused overtakes {m}: wall {say(w)}, cpu {say(c)}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    by = {(r["tokens"], r["hidden"], r["vocab"], r["method"]): r for r in rows}
    cases = sorted({(r["tokens"], r["hidden"], r["vocab"]) for r in rows})

    def ratios(num, den, key="time_s", only_vocab=None):
        out = []
        for c in cases:
            if only_vocab and c[2] != only_vocab:
                continue
            a, b = by.get(c + (num,), {}).get(key), by.get(c + (den,), {}).get(key)
            if a and b:
                out.append(round(a / b, 4))
        return out

    fo, fo_cpu = ratios("fused", "floor"), ratios("fused", "floor", "cpu_s")
    mem = ratios("naive", "fused", "temp_mb", 151936)
    out = {
        "summary": True,
        "cases": [list(c) for c in cases],
        "fused_over_floor": fo,
        "fused_over_floor_cpu": fo_cpu,
        "worst_fused_over_floor": max(fo) if fo else None,
        "worst_fused_over_floor_cpu": max(fo_cpu) if fo_cpu else None,
        "naive_over_fused_memory_at_vocab_151936": min(mem) if mem else None,
    }
    for peer in ("naive", "trl", "liger", "fused_ref", "fused_3mm"):
        out[f"speedup_vs_{peer}"] = ratios(peer, "fused")
        out[f"speedup_vs_{peer}_cpu"] = ratios(peer, "fused", "cpu_s")
    dv = {(c[1], c[2]) for c in cases}
    if len(dv) == 1 and len(cases) > 1:
        out["crossover_N"] = {
            m: {"wall": crossover(rows, m), "cpu": crossover(rows, m, "cpu_s")}
            for m in METHODS
            if m not in ("fused", "floor") and any(r["method"] == m for r in rows)
        }
    return out


def report_blocks(rows: list[dict]) -> list[str]:
    """The text before the JSON lines: a table per case, by (D, V) then N, and a sweep table
    per (D, V) with several N. Sorts `rows` the same way (methods in METHODS order)."""
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["hidden"], r["vocab"], r["tokens"], order[r["method"]]))
    blocks = []
    cases = sorted({(r["hidden"], r["vocab"], r["tokens"]) for r in rows})
    for d, v, n in cases:
        blocks.append(
            case_table([r for r in rows if (r["hidden"], r["vocab"], r["tokens"]) == (d, v, n)])
        )
    for dv in sorted({(r["hidden"], r["vocab"]) for r in rows}):
        at = [r for r in rows if (r["hidden"], r["vocab"]) == dv]
        if len({r["tokens"] for r in at}) > 1 and any(r["method"] == "fused" for r in at):
            blocks.append(sweep_table(at))
    return blocks


def _parse_cases(text: str) -> list[tuple[int, int, int]]:
    cases = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UserError(
                f"--cases: {item!r} is not N x D x V (three positive integers joined by 'x', "
                "e.g. 512x1536x151936); give a comma-separated list of them."
            )
        cases.append(tuple(int(p) for p in parts))
    return cases


def _parse_ints(flag: str, values: list[str]) -> list[int]:
    out = []
    for item in ",".join(values).replace(" ", ",").split(","):
        if not item:
            continue
        if not item.isdigit() or int(item) <= 0:
            raise UserError(f"{flag}: {item!r} is not a positive integer; e.g. {flag} 512,2048.")
        out.append(int(item))
    return out


def _plan(args) -> tuple[list, list[str], int]:
    """(cases, methods, reps) the flags ask for."""
    n0, d0, v0 = SMOKE_CASE if args.smoke else DEFAULT_CASE
    d = args.hidden or d0
    v = args.vocab or v0
    if args.cases:
        cases = _parse_cases(args.cases)
    elif args.full:
        cases = [(n, dd, vv) for n in FULL_TOKENS for dd, vv in FULL_DV]
    elif args.tokens:
        cases = [(n, d, v) for n in _parse_ints("--tokens", args.tokens)]
    else:
        cases = [(n0, d, v)]
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise UserError(
            f"--methods: unknown {', '.join(unknown) or '(none given)'}; valid: "
            f"{', '.join(METHODS)} (comma-separated)."
        )
    for n, _, _ in cases:
        if n % BATCH_ROWS:
            raise UserError(
                f"tokens must be a multiple of {BATCH_ROWS} (the loss sees {BATCH_ROWS} rows of "
                f"N / {BATCH_ROWS} tokens), got {n}; e.g. --tokens {n - n % BATCH_ROWS or 4}."
            )
    reps = (1 if args.smoke else 2) if args.reps is None else args.reps
    if reps < 1:
        raise UserError(f"--reps must be >= 1, got {reps}.")
    return cases, [m for m in METHODS if m in methods], reps


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", nargs="+", help="token counts N, e.g. 512,2048,8192 (a sweep)")
    ap.add_argument("--hidden", type=int, help=f"D for --tokens (default {DEFAULT_CASE[1]})")
    ap.add_argument("--vocab", type=int, help=f"V for --tokens (default {DEFAULT_CASE[2]})")
    ap.add_argument("--cases", help="NxDxV triples, comma-separated; overrides --tokens")
    ap.add_argument("--full", action="store_true", help="the grid {512,1024} x 3 (D, V)")
    ap.add_argument("--smoke", action="store_true", help=f"CI: {SMOKE_CASE}, 1 rep, eager Liger")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=None, help="timed calls per method (default 2)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per (case, method)")
    ap.add_argument(
        "--compilation-cache",
        default="default",
        help="JAX's persistent cache: 'default' (gjax.compile_cache's), a directory, '' off",
    )
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    cases, methods, reps = _plan(args)

    t0, load0 = time.perf_counter(), os.getloadavg()
    c0 = time.process_time()
    base = {"reps": reps, "compilation_cache": args.compilation_cache, "smoke": args.smoke}

    def progress(row):
        what = (
            row.get("error")
            or row.get("skipped")
            or (f"wall {row.get('time_s')} s, cpu {row.get('cpu_s')} s")
        )
        print(
            f"[loss_kernels] {row['tokens']}x{row['hidden']}x{row['vocab']} {row['method']}: "
            f"{what}",
            file=sys.stderr,
            flush=True,
        )

    rows = []
    jax_methods = [m for m in methods if m in JAX_METHODS]
    if jax_methods:
        spec = {**base, "cases": cases, "methods": jax_methods}
        rows += _child("jax", spec, args.timeout * len(cases) * len(jax_methods), progress)
    for n, d, v in cases:
        for m in (m for m in methods if m in TORCH_METHODS):
            spec = {**base, "cases": [(n, d, v)], "methods": [m]}
            rows += _child("torch", spec, args.timeout, progress)

    blocks = report_blocks(rows)  # sorts rows
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 + ru.ru_utime + ru.ru_stime
    cores = os.cpu_count() or 1
    # On an idle machine the calls (matmuls on every core) take their CPU time / cores; the
    # rest (imports, compiles, input set-up: mostly one thread) is counted as serial.
    calls = sum(r.get("calls_cpu_s") or 0 for r in rows)
    run = {
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "cores": cores,
        "load_avg_1m_start": round(load0[0], 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "calls_cpu_s": round(calls, 1),
        "idle_wall_estimate_s": round(calls / cores + max(cpu - calls, 0), 1),
    }
    blocks.append(
        f"run: wall {run['wall_s']} s, CPU {run['cpu_s']} s (all processes), load average "
        f"{run['load_avg_1m_start']} -> {run['load_avg_1m_end']} on {cores} cores; on an idle "
        f"machine about {run['idle_wall_estimate_s']} s (the calls' {run['calls_cpu_s']} CPU s "
        "/ cores + the rest as serial)"
    )
    print("\n\n".join(blocks), flush=True)
    print("", flush=True)
    for r in rows:
        print(json.dumps(r), flush=True)
    print(json.dumps({**summary(rows), "run": run}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        spec = json.loads(sys.argv[3])
        (_jax_worker if sys.argv[2] == "jax" else _torch_worker)(spec)
    else:
        run_cli(main)
