"""Self-attention over packed rows: the one place an implementation is chosen per platform.

Every implementation computes the same masked GQA attention (`xla`): query i attends key j
iff j <= i, seg[i] == seg[j] and seg[j] != 0 (0 = padding). Outputs at padding queries are
unspecified (nothing reads them). Every whole-sequence forward runs the implementation chosen
here: the training / scoring `Transformer` and the sampler's `transformer.prefill` (the
static sampler, the continuous decoder and the JetStream engine), so prefill and forward
round alike. Decode steps (one query against a KV cache) and the decoder's chunked prefill
(a query chunk at a traced offset against a prompt region) run their own dense softmax.
Implementations (`model.attention`):

- "xla": dense masked attention; builds the [B, T, T] mask and the f32 [B, H, T, T] scores.
  The reference, and CPU's default.
- "xla_blocked": the same in `XLA_BLOCKS` static query chunks, chunk i only against keys
  [0, end of chunk i) (the causal mask empties the rest): T^2 (n + 1) / (2n) scores instead
  of T^2, static shapes, same mask. CPU's opt-in, where no flash kernel runs: padding waste
  1.05-1.07 vs dense's 1.09-1.11 on the packed update, 0.94-0.98x its CPU time per step
  (benchmarks/train_step.py). Not the default: its programs take longer to compile
  (a_grae.py:tiny, 120 steps, one run each at load 5-6: learner dispatch, mostly compiles,
  194 s vs 143 s; the run 290 s vs 241 s wall; steady steps 0.61 vs 0.56 s), which short CPU
  runs and the test suite feel more than the few % per step. Its rounding differs from
  "xla"'s (about 2e-6 in hidden states: summation lengths differ), and fully masked
  (padding) queries average fewer keys.
- "pallas_gpu": the Pallas Triton flash kernel (`jax.experimental.pallas.ops.gpu.attention
  .mha`, FlashAttention-2) with segment ids: [block x block] tiles, no [T x T] array; it
  skips the tiles above the diagonal (causal), not the ones masked by segment ids alone. KV
  heads are repeated to the query heads (the kernel has no GQA); T is padded to its block.
- "splash": Pallas TPU splash attention (`...ops.tpu.splash_attention`) with segment ids and
  a causal `MultiHeadMask` (GQA native); skips the tiles the causal mask empties. T is padded
  to a multiple of 128 (its lane width).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`. Its public API in jax
  0.10 takes no segment ids, only a boolean mask, which it turns into an additive [B, 1, T, T]
  bias (so a [T x T] array in HBM, though not the per-head f32 scores); `is_causal` lets it
  skip the upper tiles. bf16/f16 only. The packed ragged layout (q_offsets / kv_offsets) is
  only in jax's private cuDNN module, not used here.
- "auto": `AUTO` by platform (cpu: xla, gpu: pallas_gpu, tpu: splash).

Sequence shards (`mesh.seq` > 1: the update and the log-prob passes, whose rules put the
token axis on `seq`, `gjax.sharding.sequence_rules`): `ring` attention, whatever
`model.attention` says. Each device holds a contiguous block of T / n tokens of every row
(its queries and keys), and the key / value / segment-id blocks travel round the `seq` ring
(`lax.ppermute`, n - 1 hops), each met block merged into the queries' running softmax
(flash attention's online max and sum, f32). Blocks wholly above the causal diagonal are
skipped; segment ids mask across rows packed into a bin as everywhere else; batch and heads
stay split as the rules place them. Chosen over all-to-all head-sharded attention
(Ulysses) by communicated bytes per layer, counted from the compiled programs
(`benchmarks/seq_attention_bytes.py`): a GQA model sends its few KV heads round the ring,
fewer bytes than q, k, v and the output through two all-to-alls (Qwen2.5-1.5B: 12 query
heads, 2 KV heads), and it needs no head count divisible by n (12 heads and n = 8).
Each block is the xla math in tiles of `RING_TILE` keys (a [T/n x RING_TILE] f32 score
tile per head, recomputed in the backward pass: `jax.checkpoint`); no per-block Pallas
kernel is wired in yet.

The Pallas kernels are custom calls XLA cannot split: on a multi-device context mesh
(`jax.set_mesh`) `attend` runs them in a `jax.shard_map`, batch and heads split as
`gjax.sharding`'s rules place the activations (`sharded_specs`), so each device attends its
own rows and heads and no q / k / v is gathered.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gjax import sharding
from gjax.errors import ConfigError
from gjax.models.config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS

AUTO = {"cpu": "xla", "gpu": "pallas_gpu", "tpu": "splash"}
XLA_BLOCKS = 4  # "xla_blocked": query chunks per row
RING_TILE = 512  # ring attention: keys per score tile ([T / seq x RING_TILE] f32 per head)
# Platforms each implementation compiles for (xla: any).
PLATFORMS = {"cudnn": ("gpu",), "pallas_gpu": ("gpu",), "splash": ("tpu",)}
CUDNN_DTYPES = ("bfloat16", "float16")  # jax.nn.dot_product_attention(implementation="cudnn")
# Tiles (query and key block) each kernel runs with; FLOP counts use them (gjax.flops).
PALLAS_GPU_BLOCK, PALLAS_GPU_BWD_BLOCK, SPLASH_BLOCK, CUDNN_BLOCK = 128, 32, 128, 128
# A large negative finite value: fully masked rows (padding queries) give a uniform softmax
# instead of NaNs, so gradients through padded batches stay finite.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def resolve(name: str, platform: str, dtype: str | None = None) -> str:
    """The implementation `model.attention=name` runs on `platform` ("cpu", "gpu", "tpu"), for
    a model computing in `dtype` (checked when given: cuDNN's takes bf16/f16 only)."""
    if name not in IMPLEMENTATIONS:
        raise ConfigError(
            f"config.model.attention={name!r} is not an attention implementation: it must be "
            f"one of {IMPLEMENTATIONS} (auto: {AUTO})."
        )
    if name == "auto":
        return AUTO.get(platform, "xla")
    if name not in ("xla", "xla_blocked") and platform not in PLATFORMS[name]:
        raise ConfigError(
            f"config.model.attention={name!r} runs only on {PLATFORMS[name]}, and this run's "
            f"devices are {platform!r}. Set config.model.attention='auto' (here: "
            f"{AUTO.get(platform, 'xla')!r}) or 'xla'."
        )
    if name == "cudnn" and dtype is not None and dtype not in CUDNN_DTYPES:
        raise ConfigError(
            f"config.model.attention='cudnn' computes in {CUDNN_DTYPES} only, and "
            f"config.model.dtype={dtype!r}. Set config.model.dtype='bfloat16', or "
            f"config.model.attention='auto' (here: {AUTO.get(platform, 'xla')!r})."
        )
    return name


def platform_impl(name: str) -> str:
    """`resolve` on the default backend's platform (what a jitted forward runs on)."""
    return resolve(name, jax.default_backend())


def dense_mask(segment_ids_BxT):
    """[B, T, T] bool: causal (by index) within equal, nonzero segment ids."""
    t = segment_ids_BxT.shape[-1]
    causal_TxT = jnp.tril(jnp.ones((t, t), dtype=bool))
    seg_q = segment_ids_BxT[:, :, None]
    seg_k = segment_ids_BxT[:, None, :]
    return causal_TxT[None] & (seg_q == seg_k) & (seg_k != 0)


def xla(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS):
    """Grouped-query attention; scores and softmax in f32. Query head h uses kv head h // R."""
    b, t, h, dh = q_BxTxHxDh.shape
    kv = k_BxSxKxDh.shape[2]
    q = q_BxTxHxDh.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum(
        "btkrd,bskd->bkrts", q, k_BxSxKxDh, preferred_element_type=jnp.float32
    ) / math.sqrt(dh)
    scores = jnp.where(mask_BxTxS[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
    out = jnp.einsum("bkrts,bskd->btkrd", probs, v_BxSxKxDh)
    return out.reshape(b, t, h, dh)


def causal_blocks(t: int, blocks: int = XLA_BLOCKS) -> list[tuple[int, int]]:
    """`xla_blocked`'s static query chunks of a row of `t`: [(start, end)], `min(blocks, t)`
    near-equal ones; chunk (start, end) attends keys [0, end)."""
    n = max(1, min(blocks, t))
    bounds = [t * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def xla_blocked(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, mask_BxTxT, *, blocks=XLA_BLOCKS):
    """`xla` per query chunk (`causal_blocks`) against the keys up to the chunk's end: the
    keys after it are causally masked for every query in it, so the output is the same."""
    t = q_BxTxHxDh.shape[1]
    outs = [
        xla(
            q_BxTxHxDh[:, lo:hi],
            k_BxTxKxDh[:, :hi],
            v_BxTxKxDh[:, :hi],
            mask_BxTxT[:, lo:hi, :hi],
        )
        for lo, hi in causal_blocks(t, blocks)
    ]
    return jnp.concatenate(outs, axis=1)


def _pad_to(x, multiple: int, axis: int = 1):
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _pow2_block(t: int, cap: int) -> int:
    """The kernel's tile: `cap`, or for short rows the next power of two >= max(t, 16)."""
    return min(cap, max(16, 1 << (t - 1).bit_length()))


def pallas_gpu(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT, *, block=None, interpret=False):
    """Pallas Triton flash attention with segment ids (see the module docstring)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    b, t, h, dh = q_BxTxHxDh.shape
    r = h // k_BxTxKxDh.shape[2]
    bq = block or _pow2_block(t, PALLAS_GPU_BLOCK)
    bwd = min(PALLAS_GPU_BWD_BLOCK, bq)
    sizes = gpu_attention.BlockSizes(
        block_q=bq, block_k=bq, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd
    )
    k = jnp.repeat(k_BxTxKxDh, r, axis=2)  # query head h reads kv head h // r
    v = jnp.repeat(v_BxTxKxDh, r, axis=2)
    q, k, v, seg = (_pad_to(x, bq) for x in (q_BxTxHxDh, k, v, segment_ids_BxT))
    out = gpu_attention.mha(
        q,
        k,
        v,
        seg.astype(jnp.int32),
        sm_scale=1.0 / math.sqrt(dh),
        causal=True,
        block_sizes=sizes,
        interpret=interpret,
    )
    return out[:, :t]


@functools.lru_cache(maxsize=16)
def _splash_kernel(heads: int, t: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((t, t)) for _ in range(heads)])
    sizes = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # Built outside any trace (ensure_compile_time_eval is not enough inside flax's scan: the
    # tables leaked as tracers into the next trace): concrete, cacheable across traces.
    with jax.core.eval_context():
        return sa.make_splash_mha(
            mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
        )


def splash(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT, *, interpret=False):
    """Pallas TPU splash attention with segment ids (see the module docstring)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, dh = q_BxTxHxDh.shape
    q = _pad_to(q_BxTxHxDh / math.sqrt(dh), SPLASH_BLOCK).astype(q_BxTxHxDh.dtype)
    k, v, seg = (_pad_to(x, SPLASH_BLOCK) for x in (k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT))
    tp = q.shape[1]
    kernel = _splash_kernel(h, tp, SPLASH_BLOCK, interpret)
    seg = seg.astype(jnp.int32)
    # The kernel is per row with heads leading: [H, T, Dh].
    out_BxHxTxDh = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(
        q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), seg
    )
    return out_BxHxTxDh.swapaxes(1, 2)[:, :t]


def cudnn(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT, *, backend="cudnn"):
    """`jax.nn.dot_product_attention` with the segment mask (`backend`: "xla" to check the
    call's layout and mask where cuDNN cannot run)."""
    mask_Bx1xTxT = dense_mask(segment_ids_BxT)[:, None]
    return jax.nn.dot_product_attention(
        q_BxTxHxDh,
        k_BxTxKxDh,
        v_BxTxKxDh,
        mask=mask_Bx1xTxT,
        is_causal=True,
        implementation=backend,
    )


def layer_input(impl: str, segment_ids_BxT):
    """What every layer's `attend` takes, built once per forward: the dense mask for xla,
    the segment ids for the kernels and for `ring` (sequence shards)."""
    if sharding.sequence_shards(segment_ids_BxT.shape[-1]) > 1:
        return segment_ids_BxT
    return dense_mask(segment_ids_BxT) if impl in ("xla", "xla_blocked") else segment_ids_BxT


def shard_specs(mesh, q_shape, kv_heads: int, *, split_length: bool = False):
    """(q / k / v spec, segment-ids spec, repeat_kv): how a kernel runs per shard of `mesh`.
    Batch over the rules' `batch` axes and query heads over their `q_heads` axes, as
    `sharding.constrain` places the activations (each dropped where it does not divide);
    length and head dim whole (a kernel needs whole rows). GQA: KV heads split over the same
    axes as the query heads they serve when those divide them (shard i's query heads h read
    kv heads h // R, all in shard i); otherwise (or when the rules place `kv_heads`
    elsewhere) `repeat_kv`: k / v are repeated to the query heads first (correct, at the
    repeat's cost). `split_length` (ring attention): length over the rules' `length` axes."""
    batch, length, heads, _ = sharding.logical_to_spec(
        ("batch", "length", "q_heads", None), mesh=mesh, shape=q_shape, drop_indivisible=True
    )
    length = length if split_length else None
    kv_axes = sharding.logical_to_spec(("batch", "length", "kv_heads", None))[2]
    n = sharding.mesh_axis_size(mesh, heads)
    repeat_kv = n > 1 and (kv_heads % n != 0 or kv_axes != heads)
    return P(batch, length, heads, None), P(batch, length), repeat_kv


def key_tile(n: int, cap: int) -> int:
    """Keys per score tile of a ring block of `n` keys: the largest divisor of n <= cap."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _ring_shard(q_BxNxHxDh, k_BxNxKxDh, v_BxNxKxDh, seg_BxN, *, axis, shards: int, tile: int, vary):
    """One device's part of `ring`: its N = T / shards queries against every block of keys,
    the blocks passed on round the ring of `axis`, each block in tiles of `tile` keys;
    `vary`: the mesh axes q is split over."""
    b, n, h, dh = q_BxNxHxDh.shape
    kv = k_BxNxKxDh.shape[2]
    me = jax.lax.axis_index(axis)
    q_BxNxKxRxDh = q_BxNxHxDh.reshape(b, n, kv, h // kv, dh)
    q_pos_N = me * n + jnp.arange(n)
    to_next = [(i, (i + 1) % shards) for i in range(shards)]

    @jax.checkpoint  # the backward pass recomputes a tile's scores: no [N x N] residuals
    def merge_tile(carry, tile_in):
        k_BxCxKxDh, v_BxCxKxDh, seg_k_BxC, k_pos_C = tile_in
        out_BxKxRxNxDh, max_BxKxRxN, sum_BxKxRxN = carry
        mask_BxNxC = (
            (k_pos_C[None, None, :] <= q_pos_N[None, :, None])
            & (seg_BxN[:, :, None] == seg_k_BxC[:, None, :])
            & (seg_k_BxC[:, None, :] != 0)
        )
        scores = jnp.einsum(
            "bnkrd,bckd->bkrnc", q_BxNxKxRxDh, k_BxCxKxDh, preferred_element_type=jnp.float32
        ) / math.sqrt(dh)
        scores = jnp.where(mask_BxNxC[:, None, None], scores, MASK_VALUE)
        # The running max only steadies the exponentials (the result does not depend on it).
        new_max = jax.lax.stop_gradient(jnp.maximum(max_BxKxRxN, scores.max(-1)))
        e = jnp.exp(scores - new_max[..., None])
        rescale = jnp.exp(max_BxKxRxN - new_max)
        sum_BxKxRxN = rescale * sum_BxKxRxN + e.sum(-1)
        out_BxKxRxNxDh = rescale[..., None] * out_BxKxRxNxDh + jnp.einsum(
            "bkrnc,bckd->bkrnd",
            e.astype(v_BxCxKxDh.dtype),
            v_BxCxKxDh,
            preferred_element_type=jnp.float32,
        )
        return (out_BxKxRxNxDh, new_max, sum_BxKxRxN), None

    def merge(carry, k_BxNxKxDh, v_BxNxKxDh, seg_k_BxN, src):  # one block, tile by tile
        k_pos_N = src * n + jnp.arange(n)
        tiles = n // tile

        def split(x):  # [B, N, ...] -> [N / C, B, C, ...]
            return jnp.moveaxis(x.reshape(x.shape[0], tiles, tile, *x.shape[2:]), 1, 0)

        xs = (split(k_BxNxKxDh), split(v_BxNxKxDh), split(seg_k_BxN), k_pos_N.reshape(tiles, tile))
        return jax.lax.scan(merge_tile, carry, xs)[0]

    def merge_if_visible(carry, k, v, seg_k, src):  # blocks after ours are causally masked
        return jax.lax.cond(src <= me, merge, lambda c, *_: c, carry, k, v, seg_k, src)

    stats = jnp.full((b, kv, h // kv, n), MASK_VALUE, jnp.float32)
    carry = (jnp.zeros((b, kv, h // kv, n, dh), jnp.float32), stats, jnp.zeros_like(stats))
    carry = tuple(jax.lax.pcast(x, vary, to="varying") for x in carry)  # as q varies
    carry = merge(carry, k_BxNxKxDh, v_BxNxKxDh, seg_BxN, me)

    def hop(state, i):
        carry, blocks = state
        blocks = tuple(jax.lax.ppermute(x, axis, to_next) for x in blocks)
        carry = merge_if_visible(carry, *blocks, (me - i) % shards)
        return (carry, blocks), None

    blocks = (k_BxNxKxDh, v_BxNxKxDh, seg_BxN)
    # Unrolled (n - 1 hops): XLA may overlap each hop's permute with the previous block's
    # math, and the compiled program lists every permute (benchmarks/seq_attention_bytes.py).
    (carry, _), _ = jax.lax.scan(hop, (carry, blocks), jnp.arange(1, shards), unroll=True)
    out_BxKxRxNxDh, _, sum_BxKxRxN = carry
    out = out_BxKxRxNxDh / sum_BxKxRxN[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, n, h, dh).astype(q_BxNxHxDh.dtype)


def _spec_axes(spec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec names."""
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return tuple(axes)


def ring(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT, *, tile: int = RING_TILE):
    """Ring attention over the context mesh's sequence shards (module docstring): the same
    masked GQA attention as `xla`, from segment ids, without any device holding more than
    its T / n queries, two key / value blocks and one [T / n x `tile`] f32 score tile per
    head (`key_tile`: the largest divisor of T / n up to `tile`)."""
    mesh = jax.sharding.get_abstract_mesh()
    h, kv = q_BxTxHxDh.shape[2], k_BxTxKxDh.shape[2]
    spec, seg_spec, repeat_kv = shard_specs(mesh, q_BxTxHxDh.shape, kv, split_length=True)
    if repeat_kv:
        k_BxTxKxDh, v_BxTxKxDh = (jnp.repeat(x, h // kv, axis=2) for x in (k_BxTxKxDh, v_BxTxKxDh))
    axis = spec[1]
    shards = sharding.mesh_axis_size(mesh, axis)
    tile = key_tile(q_BxTxHxDh.shape[1] // shards, tile)
    per_shard = jax.shard_map(
        functools.partial(_ring_shard, axis=axis, shards=shards, tile=tile, vary=_spec_axes(spec)),
        mesh=mesh,
        in_specs=(spec, spec, spec, seg_spec),
        out_specs=spec,
    )
    return per_shard(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT)


def attend(impl: str, q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in, *, interpret=False):
    """Attention by a resolved implementation (`resolve`); `layer_in` from `layer_input`.
    The Pallas kernels run per shard of the context mesh, if any (module docstring);
    `interpret` runs them in Pallas' interpreter (tests on CPU). Sequence shards: `ring`."""
    if sharding.sequence_shards(q_BxTxHxDh.shape[1]) > 1:
        return ring(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in)
    if impl == "xla":
        return xla(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in)
    if impl == "xla_blocked":
        return xla_blocked(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in)
    if impl == "cudnn":  # jax partitions its cuDNN call itself (custom partitioning)
        return cudnn(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in)
    kernel = functools.partial(
        {"pallas_gpu": pallas_gpu, "splash": splash}[impl], interpret=interpret
    )
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in)
    h, kv = q_BxTxHxDh.shape[2], k_BxTxKxDh.shape[2]
    spec, seg_spec, repeat_kv = shard_specs(mesh, q_BxTxHxDh.shape, kv)
    if repeat_kv:
        k_BxTxKxDh, v_BxTxKxDh = (jnp.repeat(x, h // kv, axis=2) for x in (k_BxTxKxDh, v_BxTxKxDh))
    per_shard = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(spec, spec, spec, seg_spec),
        out_specs=spec,
        check_vma=False,  # pallas_call carries no varying-axes types
    )
    return per_shard(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, layer_in)
