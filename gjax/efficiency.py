"""Efficiency checks that need no accelerator: read from compiled programs on any backend.

Three figures, each a property of the program rather than of a chip (so the CPU can check
them in CI and `benchmarks/accelerator.py` reports them next to its timings):

* `decode_step_bytes`: the continuous decoder's decode step (`gjax.rollout.decoder`'s
  `_dispatch` at one step), compiled on abstract shapes: XLA's cost analysis `bytes accessed`
  over the ideal (every weight the step uses and the whole KV state, each read once), the
  per-op split of the optimized HLO (`hlo_op_bytes`) naming where the bytes beyond the ideal
  go, and `kv_in_place`: the cache is donated (input_output_alias) and no op but an in-place
  scatter produces a cache-sized buffer (no copy of the cache per step).
* `packed_update_flops`: the update's executed over useful FLOPs (`gjax.flops`) on a packed
  plan (`gjax.packing`) of ragged rows, split into the padding waste and remat's factor.
* `HostSyncs`: device -> host syncs in a region (each `jax.device_get`, and each implicit
  fetch: `np.asarray`, `float`, `bool` of a device array): a decode dispatch and a training
  step are each meant to have exactly one (`decode_host_syncs`, `train_step_host_syncs`).

How XLA counts bytes (`HloCostAnalysis`, summed over the instructions outside fused
computations, a while loop's body once): each instruction its operands plus its output. Two
of its counts are not traffic: a gather reads only the rows it gathers, not the whole table
it is given (the embedding lookup), and a scatter (or dynamic-update-slice) into a buffer
that is updated in place reads and writes only the updated entries, not the whole operand
and output (the KV write).
`hlo_op_bytes` reports both counts per op (`bytes` as XLA counts, `touched` with those two
corrected), and `decode_step_bytes` gives the ratio both ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import threading
from unittest import mock

import jax
import numpy as np
from jax._src import array as array_lib  # jax.Array's implementation: where a fetch goes

from gjax import flops, packing
from gjax.metrics import to_host
from gjax.models import quant
from gjax.models import transformer as tr
from gjax.models.config import ModelConfig
from gjax.rollout import decoder as dec
from gjax.rollout import pages as pg
from gjax.rollout.sampler import SamplingParams

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_NOT_COUNTED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_CONTROL = {"while", "conditional", "call"}  # their bodies' instructions are counted instead
_IN_PLACE = {"scatter", "dynamic-update-slice"}  # write into their first operand's buffer


def nbytes(tree) -> int:
    """Bytes of a pytree of arrays (or ShapeDtypeStructs)."""
    return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        total += (
            int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            * (_DTYPE_BYTES[dtype])
        )
    return total


def _bare(shape: str) -> str:
    """`f32[16,2,64]{2,1,0}` -> `f32[16,2,64]` (the layout dropped)."""
    return re.sub(r"\{[^}]*\}", "", shape).strip()


@dataclasses.dataclass(frozen=True)
class OpBytes:
    """One instruction of an optimized HLO module, outside fused computations."""

    computation: str
    in_loop: bool  # inside a while body (runs every step) or outside (once per call)
    name: str
    opcode: str
    op_name: str  # jax's metadata: which jax op it came from
    shape: str
    bytes: int  # operands + output, as XLA's cost analysis counts them
    touched: int  # the same with a gather's table and an in-place scatter's operand corrected


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    cur = None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            m = _COMP.match(line)
            cur = m.group(1) if m else None
            if cur:
                comps[cur] = []
        elif cur and "=" in line:
            comps[cur].append(line.strip())
    return comps


def hlo_op_bytes(hlo_text: str) -> list[OpBytes]:
    """Per-instruction bytes of an optimized HLO module (`compiled.as_text()`), the
    instructions of fused and reducer computations folded into their caller, as XLA's cost
    analysis counts them (their sum is its `bytes accessed`, to rounding)."""
    comps = _computations(hlo_text)
    fused = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo_text))
    # `in_loop`: the instruction sits in a while body itself (a loop nested in a body, or a
    # conditional's branches, would count as outside: the decode step has neither)
    loop_bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
    contains = {c: " ".join(lines) for c, lines in comps.items()}
    out = []
    for comp, lines in comps.items():
        if comp in fused:
            continue
        shapes: dict[str, str] = {}
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape, opcode, rest = m.groups()
            shapes[name] = shape
            if opcode in _NOT_COUNTED or opcode in _CONTROL:
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            op_bytes = [_shape_bytes(shapes.get(o, "")) for o in operands]
            out_bytes = _shape_bytes(shape)
            counted = sum(op_bytes) + out_bytes
            touched = counted
            called = re.search(r"calls=%([\w.\-]+)", rest)
            body = contains.get(called.group(1), "") if called else ""
            kinds = {opcode} | set(re.findall(r" ([a-z][\w\-]*)\(", body))
            first = _bare(shapes.get(operands[0], "")) if operands else ""
            if kinds & _IN_PLACE and first == _bare(shape) and len(op_bytes) > 1:
                # in place: reads the indices and updates, writes the updated entries
                touched = 2 * sum(op_bytes[1:])
            elif "gather" in kinds and op_bytes and max(op_bytes) > out_bytes:
                # reads the gathered rows of its table, not the whole table
                touched = counted - max(op_bytes) + out_bytes
            meta = re.search(r'op_name="([^"]*)"', line)
            out.append(
                OpBytes(
                    computation=comp,
                    in_loop=comp in loop_bodies,
                    name=name,
                    opcode=opcode,
                    op_name=meta.group(1) if meta else "",
                    shape=_bare(shape),
                    bytes=counted,
                    touched=touched,
                )
            )
    return out


def input_output_aliases(hlo_text: str) -> set[int]:
    """Entry parameter numbers that share a buffer with an output (donation)."""
    header = hlo_text.split("\n", 1)[0]
    m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
    return {int(p) for p in re.findall(r"\{[\d,]*\}: \((\d+),", m.group(1))} if m else set()


def entry_parameters(hlo_text: str) -> dict[str, int]:
    """{jax's name of an argument leaf (`state.cache_k[0]`): its entry parameter number}."""
    comps = _computations(hlo_text)
    entry = re.search(r"^ENTRY %([\w.\-]+)", hlo_text, re.M).group(1)
    found = {}
    for line in comps[entry]:
        m = re.search(r'parameter\((\d+)\).*op_name="([^"]*)"', line)
        if m:
            found[m.group(2)] = int(m.group(1))
    return found


def kv_in_place(hlo_text: str, cache_prefixes=("state.cache_k", "state.cache_v")) -> dict:
    """Whether the decode program updates its KV cache in place: every cache leaf is donated
    (aliased to an output) and no instruction but an in-place scatter produces a buffer of a
    cache leaf's shape (a copy, a select or a fusion rewriting the whole cache would)."""
    params = entry_parameters(hlo_text)
    cache = {n: p for n, p in params.items() if n.startswith(cache_prefixes)}
    aliased = input_output_aliases(hlo_text)
    comps = _computations(hlo_text)
    entry = re.search(r"^ENTRY %([\w.\-]+)", hlo_text, re.M).group(1)
    shapes = set()
    for line in comps[entry]:
        m = _INSTR.match(line)
        if (
            m
            and m.group(3) == "parameter"
            and int(re.search(r"parameter\((\d+)", line)[1]) in (cache.values())
        ):
            shapes.add(_bare(m.group(2)))
    writers = [o for o in hlo_op_bytes(hlo_text) if o.shape in shapes]
    copies = [o for o in writers if o.touched == o.bytes]  # not an in-place scatter
    return {
        "cache_leaves": len(cache),
        "cache_leaves_donated": sum(p in aliased for p in cache.values()),
        "cache_sized_writes_per_step": sum(o.in_loop for o in writers),
        "cache_copies": [f"{o.name} ({o.opcode}, {o.op_name})" for o in copies],
        "in_place": bool(cache) and all(p in aliased for p in cache.values()) and not copies,
    }


def _cost_bytes(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older jax: one dict per computation
        analysis = analysis[0]
    return float(analysis["bytes accessed"])


def _decode_state(cfg, slots, regions, prompt_len, max_new, kv_page_size):
    """The abstract decode state `decode_step_bytes` compiles on, the KV bytes of its ideal,
    the step function and the cache leaves' names: contiguous, or paged on the default pool
    (its null page and the slots' copies of their prompts' partial last pages left out of the
    ideal: the live KV is the contiguous layout's)."""
    if not kv_page_size:
        state = jax.eval_shape(lambda: dec.init_state(cfg, slots, regions, prompt_len, max_new))
        kv = nbytes((state.cache_k, state.cache_v, state.prompt_k, state.prompt_v))
        return state, kv, None, ("state.cache_k", "state.cache_v")
    if max_new % kv_page_size:
        raise ValueError(f"kv_page_size={kv_page_size} must divide max_new={max_new}")
    pool = pg.default_pages(slots, regions, prompt_len, max_new, kv_page_size)
    state = jax.eval_shape(
        lambda: pg.init_paged_state(
            cfg, slots, regions, prompt_len, max_new, pages=pool, page_size=kv_page_size
        )
    )
    tails = slots if kv_page_size > 1 else 0  # as `default_pages` counts them
    kv = nbytes((state.pages_k, state.pages_v)) * (pool - 1 - tails) // pool
    return state, kv, pg.paged_slot_step, ("state.pages_k", "state.pages_v")


def decode_step_bytes(
    cfg: ModelConfig,
    *,
    slots: int,
    regions: int,
    prompt_len: int,
    max_new: int,
    sampling=None,
    tokens_per_dispatch: int = 8,
    top: int = 8,
    quantize: str = "none",
    kv_page_size: int = 0,
) -> dict:
    """Bytes one continuous-decoder step accesses (XLA's cost analysis of `_dispatch` at one
    step, compiled on abstract shapes: nothing is allocated) over the ideal: the weights the
    step reads (the decode layers, the embedding / LM head, the final norm) plus the whole KV
    state (the slots' caches and the prompt regions: the worst step, every position live),
    each once. Ratios: XLA's count over the ideal (`bytes_over_ideal`), the bytes touched
    over it (`touched_over_ideal`: a one-step dispatch) and per step at `tokens_per_dispatch`
    steps per dispatch (`step_touched_over_ideal`: the ops outside the step loop, e.g. the
    loop-invariant ones XLA hoists, run once per dispatch). `top`: the ops with the most
    bytes counted beyond what they touch, and the most touched, by jax op; the in-place check
    of the cache (`kv_in_place`). `quantize` (int8 | fp8): the step on the sampler's
    quantized weights (`quant.quantize_policy`, as `rollout.quantize` serves them); the
    ideal then counts their codes and scales, and `convert_touched_bytes` the bytes of the
    step's dtype conversions (XLA:CPU converts each kernel's codes to a float copy before
    its dot; a GPU/TPU fuses the convert into the dot, so these bytes are not traffic
    there).

    `kv_page_size` P > 0: the paged step (`gjax.rollout.pages.paged_slot_step`) on the
    decoder's default pool (the contiguous layout's KV, S x N/P own pages and R x Q prompt
    pages, plus a page per slot for its copy of its prompt's partial last page and the null
    page); the ideal's KV is the first two (so equal to the contiguous ideal where P divides
    the prompt width), and `kv_in_place` checks the pool (`pages_k` / `pages_v`)."""
    sp = sampling or SamplingParams(max_new_tokens=max_new, temperature=1.0)
    params = jax.eval_shape(lambda: tr.init_params(cfg, jax.random.key(0)))
    if quantize != "none":
        params = jax.eval_shape(lambda p: quant.quantize_policy(p, quantize), params)
    layers = jax.eval_shape(lambda p: tr.decode_layers(p, cfg), params)
    state, kv, slot_step, cache = _decode_state(
        cfg, slots, regions, prompt_len, max_new, kv_page_size
    )
    compiled = dec._dispatch_jit.lower(
        params, cfg, layers, state, sp=sp, steps=1, slot_step=slot_step
    ).compile()
    text = compiled.as_text()
    counted = _cost_bytes(compiled)
    weights = nbytes(layers) + nbytes({k: v for k, v in params.items() if k != "layers"})
    ideal = weights + kv
    ops = hlo_op_bytes(text)
    parsed = sum(o.bytes for o in ops)
    touched = sum(o.touched for o in ops)
    step_touched = sum(o.touched for o in ops if o.in_loop)
    dispatch_touched = touched - step_touched

    def by_jax_op(key):
        groups: dict[tuple, list] = {}
        for o in ops:
            op = re.sub(r"^jit\(_dispatch\)/", "", o.op_name) or o.opcode
            groups.setdefault((op, o.shape, o.in_loop), []).append(o)
        rows = [
            {
                "jax_op": op,
                "shape": shape,
                "per": "step" if in_loop else "dispatch",
                "count": len(g),
                "bytes": sum(o.bytes for o in g),
                "touched": sum(o.touched for o in g),
            }
            for (op, shape, in_loop), g in groups.items()
        ]
        return sorted(rows, key=key, reverse=True)[:top]

    return {
        "shape": {
            "slots": slots,
            "regions": regions,
            "prompt_len": prompt_len,
            "max_new": max_new,
            "dtype": cfg.dtype,
            "quantize": quantize,
            "kv_page_size": kv_page_size,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
        },
        "bytes_accessed": counted,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "ideal_bytes": ideal,
        "bytes_over_ideal": counted / ideal,
        "hlo_bytes": parsed,  # this module's per-op sum: equals bytes_accessed to rounding
        "touched_bytes": touched,
        "touched_over_ideal": touched / ideal,
        "loop_touched_bytes": step_touched,  # every step
        "dispatch_touched_bytes": dispatch_touched,  # once per dispatch
        "tokens_per_dispatch": tokens_per_dispatch,
        "step_touched_over_ideal": (step_touched + dispatch_touched / tokens_per_dispatch) / ideal,
        "convert_touched_bytes": sum(o.touched for o in ops if "convert_element_type" in o.op_name),
        "counted_not_touched": by_jax_op(lambda r: r["bytes"] - r["touched"]),
        "most_touched": by_jax_op(lambda r: r["touched"]),
        "kv_in_place": kv_in_place(text, cache),
    }


class HostSyncs:
    """Counts device -> host syncs in a `with` block, on this thread: each `jax.device_get`
    call is one (its leaves' copies start together, then it waits once), and so is each
    implicit fetch of a device array outside one: `np.asarray` / `np.array` of it, `float()`,
    `int()`, `bool()`, `.item()`, `.tolist()`. `transfers` counts the arrays fetched,
    `implicit` where the implicit ones happened (file:line).

    jax's transfer guard (`jax.transfer_guard_device_to_host('disallow')`) cannot do this on
    the CPU: a CPU array's buffer is host memory, nothing is transferred and the guard never
    fires (checked: `np.asarray` of a jitted result passes under 'disallow'). So the count
    hooks what every fetch goes through: `jax.device_get`, `jax.Array._value` (the scalar
    conversions, `.tolist()`, `__array__`) and numpy's `asarray` / `array` (on the CPU numpy
    reads a jax array through the buffer protocol, without `_value`)."""

    def __init__(self):
        self.syncs = self.transfers = 0
        self.implicit: list[str] = []

    def _implicit(self, depth: int) -> None:
        self.transfers += 1
        self.syncs += 1
        frame = sys._getframe(depth)
        while frame and (
            frame.f_code.co_filename.startswith(_JAX_DIR) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back
        self.implicit.append(f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?")

    @contextlib.contextmanager
    def __call__(self):
        thread = threading.get_ident()
        real_get, real_value = jax.device_get, array_lib.ArrayImpl._value
        real_asarray, real_array = np.asarray, np.array
        busy = [False]  # inside a counted fetch: what it calls is part of it

        def mine():
            return threading.get_ident() == thread and not busy[0]

        def counted(fn, implicit):
            def wrapper(*args, **kwargs):
                if not mine():
                    return fn(*args, **kwargs)
                if implicit is None:  # jax.device_get
                    self.syncs += 1
                    self.transfers += sum(
                        isinstance(x, jax.Array) for x in jax.tree.leaves(args[0])
                    )
                elif isinstance(args[0], jax.Array):
                    self._implicit(implicit)
                busy[0] = True
                try:
                    return fn(*args, **kwargs)
                finally:
                    busy[0] = False

            return wrapper

        value = counted(real_value.fget, 3)
        with (
            mock.patch.object(jax, "device_get", counted(real_get, None)),
            mock.patch.object(array_lib.ArrayImpl, "_value", property(value)),
            mock.patch.object(np, "asarray", counted(real_asarray, 2)),
            mock.patch.object(np, "array", counted(real_array, 2)),
        ):
            yield self


_JAX_DIR = jax.__file__.rsplit("/", 1)[0]


def decode_host_syncs(decoder, params, tokens_PxS, mask_PxS, rng, *, num_samples, sampling):
    """Device -> host syncs of a `ContinuousDecoder.generate` call, per dispatch."""
    syncs = HostSyncs()
    with syncs():
        decoder.generate(
            params, tokens_PxS, mask_PxS, rng, num_samples=num_samples, sampling=sampling
        )
    dispatches = decoder.stats["dispatches"]
    return {
        "dispatches": dispatches,
        "host_syncs": syncs.syncs,
        "arrays_fetched": syncs.transfers,
        "implicit": sorted(set(syncs.implicit)),
        "per_dispatch": syncs.syncs / dispatches,
    }


def train_step_host_syncs(learner, state, groups, ref_params, key, steps: int = 2):
    """Device -> host syncs of the learner's part of a training step as `gjax.train` runs it:
    `Learner.batch` (host rows in, the reference log-probs), `Learner.update` and the step's
    metrics pulled to the host (`gjax.metrics.to_host`, the Recorder's one pull), per step.
    The first step (compiles) runs outside the count."""

    def step(state):
        batch = learner.batch(groups, learner.policy(state.params), ref_params)
        state, metrics = learner.update(state, batch, key)
        to_host(metrics)
        return state

    state = step(state)
    syncs = HostSyncs()
    with syncs():
        for _ in range(steps):
            state = step(state)
    return {
        "steps": steps,
        "host_syncs": syncs.syncs,
        "arrays_fetched": syncs.transfers,
        "implicit": sorted(set(syncs.implicit)),
        "per_step": syncs.syncs / steps,
    }, state


def packed_update_flops(
    cfg: ModelConfig,
    *,
    prompt_lengths_B,
    completion_lengths_B,
    prompt_len: int,
    max_new: int,
    attention_impl: str = "xla",
    minibatches: int = 1,
    microbatches: int = 1,
    platform: str = "cpu",
) -> dict:
    """The update's executed over useful FLOPs (`gjax.flops.learner_flops`) on the rows'
    packed plan as `Learner.batch` makes it (`gjax.packing.plan`, the default auto bins,
    head at the read positions), and padded: the padding waste (executed without remat's
    recompute over useful) and remat's factor (HFU / MFU)."""
    p_B = np.asarray(prompt_lengths_B, np.int64)
    c_B = np.asarray(completion_lengths_B, np.int64)
    s = prompt_len + max_new
    # Rows as `to_model_inputs` lays them out: prompt left-padded to prompt_len, then the
    # completion; targets completion-aligned (T = max_new).
    seg_BxS = np.zeros((len(p_B), s), np.int32)
    loss_BxT = np.zeros((len(p_B), max_new), np.float32)
    for b, (p, c) in enumerate(zip(p_B, c_B)):
        seg_BxS[b, prompt_len - p : prompt_len + c] = 1
        loss_BxT[b, :c] = 1
    spans_Bx2 = packing.row_spans(seg_BxS, loss_BxT)
    host = packing.plan(
        spans_Bx2,
        packing.Packing(),  # train.packing='packed' with its defaults: auto bins, W = S
        s=s,
        minibatches=minibatches,
        microbatches=microbatches,
        shards=1,
        t=max_new,
    )
    bins, reads = int(host["pack_bins"]), int(host["pack_reads"])
    common = dict(
        seq_lengths_B=p_B + c_B,
        completion_lengths_B=c_B,
        padded_len_S=s,
        padded_completion_len_T=max_new,
        extra_forwards=1,
        update_pieces=minibatches * microbatches,
        platform=platform,
        attention_impl=attention_impl,
    )
    out = {}
    for mode, extra in (
        ("packed", dict(packed_bins=bins * minibatches, pack_length=s, pack_reads=reads)),
        ("padded", {}),
    ):
        f = flops.learner_flops(cfg, **common, **extra)
        useful, executed = f["update_useful"], f["update_executed"]
        out[f"{mode}_executed_over_useful"] = executed / useful
        out[f"{mode}_padding_waste"] = (executed - f["update_recompute"]) / useful
        out[f"{mode}_recompute_factor"] = executed / (executed - f["update_recompute"])
    out.update(bins_J=bins, reads_C=reads, rows=len(p_B), real_tokens=int((p_B + c_B).sum()))
    return out
