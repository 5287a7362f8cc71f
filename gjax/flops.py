"""Matmul FLOP counts of gjax's transformer passes, for MFU (benchmarks/train_step.py).

Only matmuls count (2 FLOPs per multiply-add); norms, RoPE, softmax, biases and the optimizer
are left out, as in the usual 6ND convention (PaLM, appendix B). Per layer and token a pass
costs 2 x `layer_matmul_params` (q, k, v, o, gate, up, down kernels); each position whose
logits are taken costs 2 x D x V (the LM head; the embedding lookup is a gather, 0 FLOPs);
each (query, key) pair costs 4 x H x Dh per layer (q k^T, then p v). A backward pass is twice
its forward (gradients with respect to activations and weights), attention's as its
implementation runs it (`attention_backward_flops`); `remat` adds what it
recomputes, and the update's fused loss kernel runs the head 3 or 4 times, as its schedule
for the platform says (`fused_head_matmuls`).

"Useful" counts real tokens only (6 x params x tokens for forward + backward, 2 x for a
forward, where params are the matmul weights a token passes through: the layer stack for
every real prompt + completion token, the head for real completion tokens only, the only
positions whose logits the learner takes), plus causal attention (the i-th real token of a
row attends i real keys). "Executed" counts the shapes the code runs: every row at the
padded length S, the head at all T completion slots (rows padded to the loss kernel's token
chunk), and the (query, key) pairs the attention implementation computes
(`attention_pairs`: XLA's dense [S x S] scores, or its causal query chunks; a flash kernel's
tiles on or below the diagonal; its backward's matmuls on its backward tiles,
`attention_backward_flops`); packed (`gjax.packing`), the bins'
[J, W] shape, with the head at every packed position, or with `pack_reads` C at the C
positions per bin the loss reads (`gjax.packing.read_positions`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from gjax.models import attention
from gjax.models.config import ModelConfig
from gjax.objective.logprobs import fused_schedule

# Qwen2.5 sizes (tied embeddings, q/k/v bias) for the benchmarks' `--shape` (random weights).
QWEN2_SHAPES = {
    "qwen2-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
    ),
    "qwen2-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
    ),
}


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Kernel weights of one decoder layer (attention q/k/v/o and the SwiGLU MLP)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q_o = 2 * d * cfg.num_heads * cfg.head_dim
    k_v = 2 * d * cfg.num_kv_heads * cfg.head_dim
    return q_o + k_v + 3 * d * f


def head_matmul_params(cfg: ModelConfig) -> int:
    return cfg.hidden_size * cfg.vocab_size


def forward_flops(cfg: ModelConfig, *, tokens: int, logit_tokens: int, attn_pairs: int) -> int:
    """One forward pass: the layer stack over `tokens` positions, the head at `logit_tokens`,
    attention over `attn_pairs` (query, key) pairs summed over rows."""
    stack = 2 * cfg.num_layers * layer_matmul_params(cfg) * tokens
    head = 2 * head_matmul_params(cfg) * logit_tokens
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attn_pairs
    return int(stack + head + attn)


def causal_pairs(lengths_B) -> int:
    """(query, key) pairs of causal attention over rows of `lengths_B` real tokens."""
    n_B = np.asarray(lengths_B, np.int64)
    return int((n_B * (n_B + 1) // 2).sum())


def _remat_flops(cfg: ModelConfig, *, tokens: int, attn_pairs: int) -> int:
    """Forward FLOPs a remat policy redoes in the backward (`gjax.models.transformer`).

    "full" recomputes what the layer's gradients read: q, k, v, gate, up and both attention
    einsums; the o and down projections' outputs are read by nothing, so JAX drops them.
    "dots_with_no_batch_dims" keeps the projections and redoes the attention einsums (they
    have a batch dim); "dots" and "none" keep every matmul output.
    """
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = 4 * cfg.num_layers * h * dh * attn_pairs
    if cfg.remat == "full":
        read = d * h * dh + 2 * d * k * dh + 2 * d * cfg.intermediate_size
        return 2 * cfg.num_layers * read * tokens + attn
    if cfg.remat == "dots_with_no_batch_dims":
        return attn
    return 0


def chunk_padded(rows: int, token_chunk: int) -> int:
    """Rows a chunked log-prob kernel runs: `rows` padded to a multiple of its chunk."""
    c = max(1, min(token_chunk, rows))
    return c * -(-rows // c)


def fused_head_matmuls(
    cfg: ModelConfig, token_chunk: int | None, kernel: str = "auto", platform: str = "cpu"
) -> tuple[int, int]:
    """(head matmuls per position, token chunk) of the update's fused loss kernel
    (`gjax.objective.logprobs.fused_schedule`): 3 when it stores the logits (logits,
    dhidden, dhead), else 4 (the logits again in the gradient sweep)."""
    store, chunk, _ = fused_schedule(
        cfg.vocab_size, kernel=kernel, token_chunk=token_chunk, platform=platform
    )
    return (3 if store else 4), chunk


def attention_pairs(impl: str, rows: int, length: int) -> int:
    """(query, key) pairs one forward of `impl` (resolved, `gjax.models.attention`) computes
    over `rows` rows of `length`: "xla" all [L x L]; "xla_blocked" each query chunk's keys
    up to its end (`attention.causal_blocks`); the flash kernels their [b x b] tiles on or
    below the diagonal of the row padded to b (none skips a tile for segment ids)."""
    if impl == "xla":
        return rows * length * length
    if impl == "xla_blocked":
        return rows * sum((hi - lo) * hi for lo, hi in attention.causal_blocks(length))
    if impl == "pallas_gpu":
        block = attention._pow2_block(length, attention.PALLAS_GPU_BLOCK)
    else:
        block = attention.SPLASH_BLOCK if impl == "splash" else attention.CUDNN_BLOCK
    return _causal_tile_pairs(rows, length, block)


def _causal_tile_pairs(rows: int, length: int, block: int) -> int:
    """Pairs in the [block x block] tiles on or below the diagonal of rows of `length`."""
    n = -(-length // block)
    return rows * block * block * n * (n + 1) // 2


def attention_backward_flops(cfg: ModelConfig, impl: str, rows: int, length: int) -> int:
    """Matmul FLOPs of the attention backward (all layers) of `impl` over `rows` of `length`.

    xla / xla_blocked: twice the forward's einsums on its pairs (they read the stored
    probabilities). pallas_gpu (jax's Triton `mha` backward) and splash (its separate dq and
    dkv kernels): a dK/dV sweep (q k^T, p^T dO, dO v^T, dS^T q) and a dQ sweep (q k^T,
    dO v^T, dS k), 7 matmuls of 2 x Dh per pair, on their backward tiles: pallas_gpu
    `PALLAS_GPU_BWD_BLOCK` wide over the row padded to the forward's tile, splash its 128.
    cudnn: the forward's tiles, twice the forward plus q k^T again (FlashAttention-2's count).
    """
    per_pair = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    if impl in ("xla", "xla_blocked"):
        return 4 * per_pair * attention_pairs(impl, rows, length)
    if impl == "pallas_gpu":
        block = attention._pow2_block(length, attention.PALLAS_GPU_BLOCK)
        padded = -(-length // block) * block
        bwd = min(attention.PALLAS_GPU_BWD_BLOCK, block)
        return 7 * per_pair * _causal_tile_pairs(rows, padded, bwd)
    if impl == "splash":
        return 7 * per_pair * attention_pairs(impl, rows, length)
    return 5 * per_pair * attention_pairs(impl, rows, length)


def learner_flops(
    cfg: ModelConfig,
    *,
    seq_lengths_B,
    completion_lengths_B,
    padded_len_S: int,
    padded_completion_len_T: int,
    extra_forwards: int,
    num_iterations: int = 1,
    update_pieces: int = 1,
    update_token_chunk: int | None = None,
    logps_token_chunk: int = 256,
    packed_bins: int = 0,
    pack_length: int = 0,
    pack_reads: int = 0,
    head_kernel: str = "auto",
    platform: str = "cpu",
    attention_impl: str = "xla",
) -> dict[str, int]:
    """Useful and executed FLOPs of a learner step on B rows `prompt ++ completion`.

    `seq_lengths_B`: real (non-padding) tokens per row; `completion_lengths_B`: real
    completion tokens per row; the rows run padded to `padded_len_S`, the head to
    `padded_completion_len_T`. `extra_forwards`: teacher-forced passes before the update
    (reference and/or old log-probs, `token_logps` with `logps_token_chunk`); the update makes
    `num_iterations` forward+backward passes over the batch in `update_pieces` (minibatches x
    microbatches) pieces, each through the fused loss kernel (`head_kernel`, its schedule on
    `platform`, `update_token_chunk` None: the schedule's). `attention_impl`: what runs
    (`gjax.models.attention.resolve`; `attention_pairs`). Useful counts the head as forward +
    backward (3 matmuls); executed as the kernel runs it.
    Packed (`gjax.packing`, `packed_bins` > 0 bins of `pack_length` in all): the passes run
    [bins, pack_length] instead of [B, S], and the head runs at every packed position, or
    with `pack_reads` > 0 at that many per bin (the positions the loss reads).
    `update_recompute`: the part of `update_executed` that is remat's recompute (hardware
    FLOPs, not model FLOPs: executed - recompute is the padding and layout waste alone).
    """
    rows = len(np.asarray(seq_lengths_B))
    real = int(np.sum(seq_lengths_B))
    fwd_useful = forward_flops(
        cfg,
        tokens=real,
        logit_tokens=int(np.sum(completion_lengths_B)),
        attn_pairs=causal_pairs(seq_lengths_B),
    )
    run_rows, run_len = (packed_bins, pack_length) if packed_bins else (rows, padded_len_S)
    tokens_x = run_rows * run_len
    pairs_x = attention_pairs(attention_impl, run_rows, run_len)
    stack_x = forward_flops(cfg, tokens=tokens_x, logit_tokens=0, attn_pairs=pairs_x)
    head_rows = rows * padded_completion_len_T
    if packed_bins:
        head_rows = packed_bins * (pack_reads or pack_length)
    logps_x = stack_x + forward_flops(
        cfg, tokens=0, logit_tokens=chunk_padded(head_rows, logps_token_chunk), attn_pairs=0
    )
    matmuls, chunk = fused_head_matmuls(cfg, update_token_chunk, head_kernel, platform)
    piece_rows = chunk_padded(head_rows // update_pieces, chunk)
    update_head_x = 2 * head_matmul_params(cfg) * matmuls * update_pieces * piece_rows
    attn_fwd_x = forward_flops(cfg, tokens=0, logit_tokens=0, attn_pairs=pairs_x)
    update_stack_x = (  # forward, backward (the layers' 2x, attention as it runs), remat
        3 * stack_x
        - 2 * attn_fwd_x
        + attention_backward_flops(cfg, attention_impl, run_rows, run_len)
        + _remat_flops(cfg, tokens=tokens_x, attn_pairs=pairs_x)
    )
    return {
        "real_tokens": real,
        "padded_tokens": tokens_x,
        "attn_pairs_useful": causal_pairs(seq_lengths_B),
        "attn_pairs_executed": pairs_x,
        "logps_useful": extra_forwards * fwd_useful,
        "logps_executed": extra_forwards * logps_x,
        "update_useful": 3 * num_iterations * fwd_useful,
        "update_stack_executed": num_iterations * update_stack_x,
        "update_head_executed": num_iterations * update_head_x,
        "update_executed": num_iterations * (update_stack_x + update_head_x),
        "update_recompute": num_iterations * _remat_flops(cfg, tokens=tokens_x, attn_pairs=pairs_x),
        "useful": (extra_forwards + 3 * num_iterations) * fwd_useful,
        "executed": extra_forwards * logps_x + num_iterations * (update_stack_x + update_head_x),
    }


def learner_step_shapes(train, obj_cfg, learner, groups, batch, *, extra_forwards: int) -> dict:
    """`learner_flops`' keyword arguments for `learner` (`gjax.learner.Learner`) training on
    the rollout batch `groups` (`gjax.rollout.Groups`) as the device `batch` it made of them
    (`Learner.batch`): the rows' lengths, the padded or packed shapes the passes run at (auto
    bins: this batch's J, and C where the head runs at the read positions only), the loss
    kernel's schedule from `obj_cfg` (`schema.to_objective_config`) and `train`
    (`config.train`). `extra_forwards`: the
    teacher-forced passes `Learner.batch` made (the reference's; the policy's own for anchors
    or recomputed old log-probs)."""
    packed = {}
    if learner.pack is not None:
        bins, width = learner.pack.shape(
            batch["input_ids_BxS"].shape[0],
            batch["input_ids_BxS"].shape[1],
            learner.minibatches,
            batch.get("pack_bins_J"),
        )
        packed = dict(packed_bins=bins * learner.minibatches, pack_length=width)
        if "pack_reads_C" in batch:
            packed["pack_reads"] = int(batch["pack_reads_C"].shape[0])
    p, g, n = groups.completion_mask_PxGxN.shape
    completion_B = groups.completion_mask_PxGxN.reshape(p * g, n).sum(-1)
    t, chunk = train, obj_cfg.token_chunk  # None: each kernel's default
    return dict(
        seq_lengths_B=np.repeat(groups.prompt_mask_PxS.sum(-1), g) + completion_B,
        completion_lengths_B=completion_B,
        padded_len_S=batch["input_ids_BxS"].shape[1],
        padded_completion_len_T=batch["targets_BxT"].shape[1],
        extra_forwards=extra_forwards,
        num_iterations=t.num_iterations,
        update_pieces=t.minibatches * t.microbatches,
        update_token_chunk=chunk,  # None: the fused schedule's for the platform
        logps_token_chunk=chunk or 256,
        head_kernel=obj_cfg.lm_head_kernel,
        platform=jax.default_backend(),
        **packed,
    )


def update_flops_as_xla_counts(
    cfg: ModelConfig,
    *,
    rows: int,
    padded_len_S: int,
    padded_completion_len_T: int,
    update_pieces: int = 1,
    update_token_chunk: int | None = None,
    head_kernel: str = "auto",
    platform: str = "cpu",
) -> int:
    """The update's executed FLOPs as XLA's cost analysis reports them (dense attention): it
    counts a while loop's body once, so one layer (the layer scan, forward and backward), one
    piece (the iteration / minibatch / microbatch scans) and one token chunk of the loss
    kernel. Its vocab-tile loop is counted once too: equal only while V fits one tile."""
    piece = rows // update_pieces
    one = learner_flops(
        cfg.replace(num_layers=1),
        seq_lengths_B=np.zeros(piece, np.int64),
        completion_lengths_B=np.zeros(piece, np.int64),
        padded_len_S=padded_len_S,
        padded_completion_len_T=padded_completion_len_T,
        extra_forwards=0,
    )
    matmuls, chunk = fused_head_matmuls(cfg, update_token_chunk, head_kernel, platform)
    chunk = max(1, min(chunk, piece * padded_completion_len_T))
    return one["update_stack_executed"] + 2 * head_matmul_params(cfg) * matmuls * chunk


def sampler_flops(
    cfg: ModelConfig,
    *,
    prompt_lengths_P,
    completion_lengths_B,
    padded_prompt_len_S: int,
    decode_steps_N: int,
    cache_len_N: int,
) -> dict[str, int]:
    """Useful and executed FLOPs of `gjax.rollout.sampler.generate` (B = P*G rows).

    Prefill runs once per prompt (head at its last position); each decode step runs all B
    rows (head included) against the whole [S] prompt cache and [N] own cache. Useful: the
    real prompt tokens once, each real completion token once, attending its real keys.
    """
    p_P = np.asarray(prompt_lengths_P, np.int64)
    c_B = np.asarray(completion_lengths_B, np.int64)
    rows, prompts = len(c_B), len(p_P)
    p_B = np.repeat(p_P, rows // prompts)
    # Completion token j (0-based) attends the p prompt keys and j + 1 own keys.
    decode_pairs = int((c_B * p_B).sum()) + causal_pairs(c_B)
    useful = forward_flops(
        cfg, tokens=int(p_P.sum()), logit_tokens=prompts, attn_pairs=causal_pairs(p_P)
    ) + forward_flops(
        cfg, tokens=int(c_B.sum()), logit_tokens=int(c_B.sum()), attn_pairs=decode_pairs
    )
    executed = forward_flops(
        cfg,
        tokens=prompts * padded_prompt_len_S,
        logit_tokens=prompts,
        attn_pairs=prompts * padded_prompt_len_S**2,
    ) + forward_flops(
        cfg,
        tokens=rows * decode_steps_N,
        logit_tokens=rows * decode_steps_N,
        attn_pairs=rows * decode_steps_N * (padded_prompt_len_S + cache_len_N),
    )
    return {"useful": useful, "executed": executed}


# Dense bf16 peak FLOP/s per chip (vendor figures), matched in order against a lower-cased
# `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite", "TPU v5", "TPU v4").
PEAK_FLOPS = (
    (("h100", "h200"), 989e12, "H100/H200 bf16 dense"),
    (("a100",), 312e12, "A100 bf16 dense"),
    (("v5 lite", "v5e"), 197e12, "TPU v5e bf16"),
    (("v5p", "tpu v5"), 459e12, "TPU v5p bf16"),
    (("v4",), 275e12, "TPU v4 bf16"),
)


def table_peak_flops(device_kind: str) -> tuple[float, str] | None:
    """(peak FLOP/s of one chip, its name) for a known accelerator, else None."""
    kind = device_kind.lower()
    for keys, peak, name in PEAK_FLOPS:
        if any(k in kind for k in keys):
            return peak, name
    return None


# HBM bandwidth per chip, bytes/s (vendor figures), matched like `PEAK_FLOPS`.
PEAK_HBM_BW = (
    (("h200",), 4.8e12, "H200 HBM3e"),
    (("h100",), 3.35e12, "H100 SXM HBM3"),
    (("a100",), 2.0e12, "A100 80GB HBM2e"),
    (("v5 lite", "v5e"), 0.819e12, "TPU v5e HBM2"),
    (("v5p", "tpu v5"), 2.765e12, "TPU v5p HBM2e"),
    (("v4",), 1.2e12, "TPU v4 HBM2"),
)


def table_hbm_bandwidth(device_kind: str) -> tuple[float, str] | None:
    """(HBM bytes/s of one chip, its name) for a known accelerator, else None."""
    kind = device_kind.lower()
    for keys, bw, name in PEAK_HBM_BW:
        if any(k in kind for k in keys):
            return bw, name
    return None


# Measured ceilings (benchmarks: the CPU's peak, and an accelerator's own against its table).


def _best_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiles
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measured_matmul_flops(n: int = 2048, repeats: int = 5, dtype="float32") -> float:
    """FLOP/s of the best of `repeats` [n x n] @ [n x n] matmuls in `dtype` on the default
    device (jit, one device)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    return 2 * n**3 / _best_time(jax.jit(lambda x, y: x @ y), (a, b), repeats)


def measured_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` elementwise passes over an f32 array of `nbytes`
    (x + 1: each element read once and written once, so 2 x nbytes move) on the default
    device: the memory bandwidth a decode step can reach."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    return 2 * x.size * 4 / _best_time(jax.jit(lambda v: v + 1), (x,), repeats)
