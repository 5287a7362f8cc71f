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
trees and tests see ordinary arrays. The training forward dequantizes its kernel to the
compute dtype first (`dequantize`); the sampler's prefill and decode matmuls consume int8
(and fp8) codes directly (`codes_dot`: y = (x @ codes) * scale, per output channel, the
codes cast at the matmul; the 4-bit codes are dequantized first, their scales being per
block of the contraction axis).

Quantized rollouts (`rollout.quantize`, `quantize_policy`): the sampler's copy of a float
policy has the same projections stored as int8 (or fp8) codes with per-output-channel scales,
while the learner keeps its own float params.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gjax.models.config import ModelConfig

Params = dict[str, Any]
BLOCK = 64  # QLoRA's block size for the 4-bit codes
_QTYPE = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4", "fp8": jnp.float8_e4m3fn}
ROLLOUT_QUANT = ("none", "int8", "fp8")  # rollout.quantize: the sampler's weights
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
    """A projection's kernel in `dtype`: dequantized when it is stored quantized."""
    del cfg  # the codes' dtype says how they were quantized (`how_of`)
    if "kernel_scale" in p:
        return dequantize(p["kernel"], p["kernel_scale"], how_of(p["kernel"]), dtype)
    return p["kernel"].astype(dtype)


# The storage dtype of the codes qwix writes (nf4's are 4-bit indices into its code book).
_CODE_DTYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": jnp.uint4, "fp8": jnp.float8_e4m3fn}
# Codes whose scales are per output channel only: a matmul may consume them directly.
_DIRECT = ("int8", "fp8")


def how_of(codes: jax.Array) -> str:
    """How codes of this dtype were quantized (the dtypes of `_CODE_DTYPES` are distinct)."""
    for how, dt in _CODE_DTYPES.items():
        if codes.dtype == jnp.dtype(dt):
            return how
    raise ValueError(f"no quantization stores codes as {codes.dtype}")


def direct(p: Params) -> bool:
    """Whether projection `p` is stored as codes a matmul consumes directly (`codes_dot`)."""
    return "kernel_scale" in p and how_of(p["kernel"]) in _DIRECT


def codes_dot(x_NxI: jax.Array, codes_IxO: jax.Array, scale_1xO: jax.Array, dtype) -> jax.Array:
    """x @ (codes * scale) computed as (x @ codes) * scale, exact for per-output-channel
    scales: the codes are cast to `dtype` at the matmul (XLA on GPU/TPU fuses the convert
    into the dot, so a decode step reads the 1-byte codes, not a float kernel), accumulated
    in f32, scaled per output column and returned in `dtype`. x is [..., in]."""
    y = jnp.dot(x_NxI.astype(dtype), codes_IxO.astype(dtype), preferred_element_type=jnp.float32)
    return (y * scale_1xO.reshape(-1)).astype(dtype)


def quantize_policy(params: Params, how: str) -> Params:
    """The sampler's copy of a float policy (`rollout.quantize`): every projection kernel of
    `params["layers"]` (q, k, v, o, gate, up, down; stacked [L, in, out]) as `how` codes
    (int8 | fp8) and per-output-channel f32 scales [L, 1, out], through qwix (`quantize`);
    the embedding, the LM head, norms, biases and LoRA adapters stay as they are (as QLoRA
    keeps them). A projection already stored quantized (a QLoRA base) is left as it is.
    Jit it (the learner's params are not copied to the host)."""
    if how not in _DIRECT:
        raise ValueError(f"rollout quantization is one of {_DIRECT}, got {how!r}")
    out = jax.tree.map(lambda x: x, params)  # new dicts, same arrays
    for group, name in PROJECTIONS:
        p = out["layers"][group][name]
        if "kernel_scale" not in p:
            p["kernel"], p["kernel_scale"] = quantize(p["kernel"], how)
    return out


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
