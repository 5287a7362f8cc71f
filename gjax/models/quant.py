"""A frozen base stored quantized (QLoRA: Dettmers et al. 2023), through qwix's arrays.

Each projection kernel W [.., in, out] of the base (q, k, v, o, gate, up, down; the
embedding, the LM head and the norms stay as loaded, as in QLoRA) is stored as integer codes
`kernel` and scales `kernel_scale`, with W ~ codes * scale:

    int8  per output channel          scale [.., 1, out]        (absmax / 127)
    int4  per block of 64 inputs       scale [.., in / 64, out]  (absmax / 7)
    nf4   per block of 64 inputs       scale [.., in / 64, out]  (NormalFloat4 codes, QLoRA
                                                                  Sec. 3; absmax scaling)

(a block is the whole input axis when 64 does not divide it). The quantization and
dequantization are qwix's (`qwix._src.core.qarray`: the calibration, the rounding, the nf4
code book); gjax keeps codes and scales as two plain leaves of its param tree, so sharding,
trees and tests see ordinary arrays. A matmul dequantizes its kernel to the compute dtype
first (`dequantize`): the forward, the prefill and the decode layers all do.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gjax.models.config import ModelConfig

Params = dict[str, Any]
BLOCK = 64  # QLoRA's block size for the 4-bit codes
_QTYPE = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}
PROJECTIONS = (("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"))
PROJECTIONS += (("mlp", "gate"), ("mlp", "up"), ("mlp", "down"))


def _qarray():
    # qwix is optional (the `qlora` extra): only a quantized base needs it.
    from qwix._src.core import qarray

    return qarray


def available() -> bool:
    try:
        _qarray()
    except ImportError:
        return False
    return True


def _blocked(in_size: int, how: str) -> bool:
    return how != "int8" and in_size % BLOCK == 0


def quantize(kernel: jax.Array, how: str) -> tuple[jax.Array, jax.Array]:
    """`(codes, scale)` of a kernel [.., in, out]: scales per output column (and per block of
    the input axis for the 4-bit codes), in float32."""
    nd = kernel.ndim
    channels = tuple(range(nd - 2)) + (nd - 1,)
    tiles = {nd - 2: BLOCK} if _blocked(kernel.shape[-2], how) else {}
    q = _qarray().quantize_api(
        kernel.astype(jnp.float32), _QTYPE[how], channelwise_axes=channels, tiled_axes=tiles
    )
    return q.qvalue, q.scale


def dequantize(codes: jax.Array, scale: jax.Array, how: str, dtype) -> jax.Array:
    """The kernel codes * scale (broadcast per block), in `dtype`."""
    qarray = _qarray()
    return qarray.dequantize(qarray.QArray(codes, scale, None, _QTYPE[how])).astype(dtype)


def kernel(p: Params, cfg: ModelConfig, dtype) -> jax.Array:
    """A projection's kernel in `dtype`: dequantized when the base is stored quantized."""
    if "kernel_scale" in p:
        return dequantize(p["kernel"], p["kernel_scale"], cfg.base_quant, dtype)
    return p["kernel"].astype(dtype)


# The storage dtype of the codes qwix writes (nf4's are 4-bit indices into its code book).
_CODE_DTYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": jnp.uint4}


def code_dtype(how: str):
    return _CODE_DTYPES[how]


def scale_shape(in_size: int, out_size: int, how: str) -> tuple[int, int]:
    blocks = in_size // BLOCK if _blocked(in_size, how) else 1
    return blocks, out_size


def quantize_base(base: Params, cfg: ModelConfig, shardings: Params) -> Params:
    """The base with its projection kernels quantized as `cfg.base_quant` says, placed with
    `shardings` (a tree like the result's). One kernel at a time: each source kernel is
    deleted once its codes exist, so the peak is the base plus one kernel's codes."""
    out = jax.tree.map(lambda x: x, base)  # new dicts, same arrays
    for group, name in PROJECTIONS:
        p = out["layers"][group][name]
        target = shardings["layers"][group][name]
        fn = jax.jit(
            lambda w: quantize(w, cfg.base_quant),
            out_shardings=(target["kernel"], target["kernel_scale"]),
        )
        source = p["kernel"]
        p["kernel"], p["kernel_scale"] = fn(source)
        source.delete()
    return out


def stored_bytes(params: Params) -> int:
    """Bytes the tree holds (4-bit codes counted as half a byte each)."""
    total = 0
    for x in jax.tree.leaves(params):
        bits = jnp.iinfo(x.dtype).bits if jnp.issubdtype(x.dtype, jnp.integer) else None
        total += x.size * (bits / 8 if bits else x.dtype.itemsize)
    return int(total)
