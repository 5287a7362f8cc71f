"""Is a train state sound: a content digest per array, and a count of its non-finite values.

A checkpoint stores the digest of the state it holds (computed on the device at save time);
a restore recomputes it and compares, so damage that still decodes (bit flips, overwritten
bytes in a data file) is caught rather than trained on. The digest of an array is

    sum_i bits(x_i) * (2 i + 1)   (mod 2**32)

over its elements in row-major order, with `bits` the element's bit pattern as an unsigned
integer. The weights are odd, so flipping any one bit of any element changes the sum; the
sum is modular integer arithmetic, so it is the same however the array is sharded, on one
host or many. It is one fused pass over the state, cheap next to writing it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _bits_u32(x: jax.Array) -> jax.Array:
    """The element bit patterns as uint32 (64-bit elements as two trailing uint32 words)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits < 8:
        # 4-bit codes (a QLoRA base) have no bitcast: their value, as a bit pattern.
        return (x.astype(jnp.int32) & (2 ** jnp.iinfo(x.dtype).bits - 1)).astype(jnp.uint32)
    bits = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return bits.astype(jnp.uint32)


def _array_digest(x: jax.Array) -> jax.Array:
    bits = _bits_u32(x)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):  # row-major position, mod 2**32
        iota = lax.broadcasted_iota(jnp.uint32, bits.shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[d]
    return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)


def _nonfinite(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)
    return jnp.zeros((), jnp.int32)


@jax.jit
def _inspect(leaves: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    return [_array_digest(x) for x in leaves], [_nonfinite(x) for x in leaves]


def inspect(state: Any) -> tuple[dict[str, int], dict[str, int]]:
    """`(digest, nonfinite)`: per array of `state` (keyed by its tree path), the content digest
    and the number of non-finite values. One jitted pass; only scalars come to the host."""
    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(state), strict=True)
    digests, bad = _inspect(list(leaves))
    keys = [jax.tree_util.keystr(p) for p in paths]

    def value(x) -> int:  # replicated scalars: this host's copy (also under multi-host)
        return int(np.asarray(x.addressable_data(0)))

    return (
        {k: value(d) for k, d in zip(keys, digests, strict=True)},
        {k: n for k, n in ((k, value(n)) for k, n in zip(keys, bad, strict=True)) if n},
    )


def num_values(state: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
