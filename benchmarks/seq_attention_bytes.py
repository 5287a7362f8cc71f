"""Communicated bytes per layer of the two sequence-parallel attention schemes, counted from
the compiled programs: why `mesh.seq` runs ring attention (gjax.models.attention.ring).

    python benchmarks/seq_attention_bytes.py [--tokens 8192] [--seqs 2,4,8]
        [--heads 12 --kv_heads 2 --head_dim 128]   # Qwen2.5-1.5B's attention (default)

One attention layer (one row of --tokens tokens, bf16 q / k / v, forward and backward) is
jitted on a mesh of `seq` fake CPU devices, token axis split over them, in two ways:
- ring: `gjax.models.attention.ring` (key / value / segment-id blocks passed round the ring,
  n - 1 collective-permutes each way);
- all-to-all (Ulysses): q, k, v all-to-all'd from token shards to head shards, the dense
  masked attention per device on whole rows, the output all-to-all'd back (KV heads repeated
  up to a multiple of seq first; impossible where seq does not divide the query heads).
It prints, per scheme and seq, the summed operand bytes of the compiled program's collective
ops (all-to-all, collective-permute, all-gather, all-reduce, reduce-scatter) per device, and
the bytes each device sends (an all-to-all keeps 1/n of its operand). Nothing is run.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(bf16|f16|f32|s32|u32|pred|s8|u8)\[([0-9,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Operand bytes of each kind of collective op in a compiled (per-device) HLO module: the
    result shapes' bytes (for these ops the operand's, gathers aside), summed per kind."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out[m.group(2)] += n * _DTYPE_BYTES[dtype]
    return out


def sent_bytes(counts: dict[str, int], n: int) -> int:
    """Bytes a device sends: all of a permute's operand, (n - 1) / n of an all-to-all's."""
    return (
        counts["collective-permute"]
        + counts["all-to-all"] * (n - 1) // n
        + sum(counts[k] for k in ("all-gather", "all-reduce", "reduce-scatter"))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seqs", default="2,4,8")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=128)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={max(seqs)}"
    )
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from gjax import sharding
    from gjax.models import attention

    t, h, kv, dh = args.tokens, args.heads, args.kv_heads, args.head_dim
    q = jax.ShapeDtypeStruct((1, t, h, dh), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, kv, dh), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def ulysses(q, k, v, seg, *, n):
        def per_device(q, k, v, seg):
            to_heads = functools.partial(
                jax.lax.all_to_all, axis_name="seq", split_axis=2, concat_axis=1, tiled=True
            )
            seg = jax.lax.all_gather(seg, "seq", axis=1, tiled=True)
            q, k, v = to_heads(q), to_heads(k), to_heads(v)
            out = attention.xla(q, k, v, attention.dense_mask(seg))
            return jax.lax.all_to_all(out, "seq", split_axis=1, concat_axis=2, tiled=True)

        r = n // kv if kv < n else 1  # KV heads up to a multiple of n
        k, v = (jnp.repeat(x, r, axis=2) for x in (k, v))
        spec = P(None, "seq", None, None)
        return jax.shard_map(
            per_device, in_specs=(spec, spec, spec, P(None, "seq")), out_specs=spec
        )(q, k, v, seg)

    def ring(q, k, v, seg, *, n):
        return attention.ring(q, k, v, seg)

    print(
        f"one attention layer, {t} tokens, {h} query / {kv} KV heads of {dh}, bf16; bytes per "
        "device (MiB): collective operands | sent"
    )
    print(
        f"{'scheme':<12} {'seq':>4} {'fwd operands':>13} {'fwd sent':>9} "
        f"{'fwd+bwd operands':>17} {'fwd+bwd sent':>13}"
    )
    for n in seqs:
        mesh = sharding.make_mesh({"seq": n}, jax.devices()[:n])
        for name, fn in (("ring", ring), ("all-to-all", ulysses)):
            if name == "all-to-all" and h % n:
                print(f"{name:<12} {n:>4}   (needs query heads {h} divisible by seq {n})")
                continue
            f = functools.partial(fn, n=n)

            def loss(q, k, v, seg, f=f):
                return jnp.sum(f(q, k, v, seg).astype(jnp.float32))

            with jax.set_mesh(mesh), sharding.use_rules(sharding.sequence_rules()):
                fwd = jax.jit(f).lower(q, k, k, seg).compile().as_text()
                bwd = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k, seg).compile().as_text()
            cf, cb = collective_bytes(fwd), collective_bytes(bwd)
            mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
            print(
                f"{name:<12} {n:>4} {mib(sum(cf.values())):>13} {mib(sent_bytes(cf, n)):>9} "
                f"{mib(sum(cb.values())):>17} {mib(sent_bytes(cb, n)):>13}"
            )


if __name__ == "__main__":
    main()
