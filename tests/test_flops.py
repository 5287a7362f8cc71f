"""gjax.flops: hand-computed counts for a tiny config, and XLA's own count of a dense forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gjax import flops
from gjax.models.config import ModelConfig
from gjax.models.transformer import forward, init_params


def tiny(**kw) -> ModelConfig:
    # D=8, F=16, V=10, L=2, H=2, K=1, Dh=4.
    base = dict(
        model_type="qwen2",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    return ModelConfig(**{**base, **kw})


def test_params_and_forward_by_hand():
    cfg = tiny()
    # q, o: 8*2*4 each = 128; k, v: 8*1*4 each = 64; MLP 3*8*16 = 384.
    assert flops.layer_matmul_params(cfg) == 576
    assert flops.head_matmul_params(cfg) == 80
    # 2*L*576*5 + 2*80*2 + 4*L*H*Dh*15 = 11520 + 320 + 960.
    assert flops.forward_flops(cfg, tokens=5, logit_tokens=2, attn_pairs=15) == 12800
    assert flops.causal_pairs([3, 5]) == 6 + 15


def test_learner_flops_by_hand():
    cfg = tiny()
    kw = dict(
        seq_lengths_B=[3, 5],
        completion_lengths_B=[1, 2],
        padded_len_S=6,
        padded_completion_len_T=3,
        extra_forwards=1,
        head_kernel="reference",  # 4 head matmuls in the update, 1024-row chunks
    )
    got = flops.learner_flops(cfg, **kw)
    # Useful forward: 2*2*576*8 + 2*80*3 + 64*21 = 18432 + 480 + 1344 = 20256.
    # Executed stack: 2*2*576*12 + 64*(2*36) = 27648 + 4608 = 32256; head rows 2*3 = 6 (one
    # chunk): 2*80*6 = 960 per matmul, 1 in the log-prob pass, 4 in the fused loss.
    assert got["real_tokens"] == 8 and got["padded_tokens"] == 12
    assert got["logps_useful"] == 20256 and got["logps_executed"] == 32256 + 960
    assert got["update_useful"] == 3 * 20256
    assert got["update_executed"] == 3 * 32256 + 4 * 960
    assert got["useful"] == 4 * 20256
    assert got["executed"] == 4 * 32256 + 5 * 960
    # Full remat redoes q, k, v, gate, up (8*8 + 2*8*4 + 2*8*16 = 384 per layer and token) and
    # attention: 2*2*384*12 + 4608. Two iterations double the update, not the log-prob pass.
    full = flops.learner_flops(cfg.replace(remat="full"), **{**kw, "num_iterations": 2})
    assert full["update_executed"] == 2 * (3 * 32256 + 18432 + 4608 + 4 * 960)
    assert full["update_useful"] == 6 * 20256 and full["logps_executed"] == 32256 + 960
    assert full["update_recompute"] == 2 * (18432 + 4608) and got["update_recompute"] == 0
    assert flops.learner_flops(cfg.replace(remat="dots"), **kw) == got
    # Chunks pad the head rows: 6 rows in chunks of 4 run 8; two pieces of 3 rows in chunks
    # of 2 run 2 x 4.
    chunked = flops.learner_flops(cfg, **kw, logps_token_chunk=4, update_token_chunk=2)
    assert chunked["logps_executed"] == 32256 + 2 * 80 * 8
    halves = flops.learner_flops(cfg, **kw, update_pieces=2, update_token_chunk=2)
    assert halves["update_head_executed"] == 4 * 2 * 80 * 2 * 4
    # Packed into 1 bin of 8: the stack runs 8 tokens (2*2*576*8 + 64*64 = 22528) and the head
    # every packed position (8 rows: 2*80*8 = 1280 per matmul); useful is unchanged.
    packed = flops.learner_flops(cfg, **kw, packed_bins=1, pack_length=8)
    assert packed["padded_tokens"] == 8 and packed["useful"] == got["useful"]
    assert packed["logps_executed"] == 22528 + 1280
    assert packed["update_executed"] == 3 * 22528 + 4 * 1280
    # With the head at the 3 positions per bin the loss reads (2*80*3 = 480 per matmul).
    reads = flops.learner_flops(cfg, **kw, packed_bins=1, pack_length=8, pack_reads=3)
    assert reads["logps_executed"] == 22528 + 480
    assert reads["update_executed"] == 3 * 22528 + 4 * 480
    # As XLA counts: one layer (stack 2*576*12 + 32*72 = 16128, x3), one piece, one chunk.
    assert (
        flops.update_flops_as_xla_counts(
            cfg,
            rows=2,
            padded_len_S=6,
            padded_completion_len_T=3,
            update_pieces=1,
            head_kernel="reference",
        )
        == 3 * 16128 + 4 * 960
    )


def test_head_matmuls_and_attention_pairs_as_they_run():
    cfg = tiny()
    kw = dict(
        seq_lengths_B=[3, 5],
        completion_lengths_B=[1, 2],
        padded_len_S=6,
        padded_completion_len_T=3,
        extra_forwards=0,
    )
    ref = flops.learner_flops(cfg, **kw, head_kernel="reference")
    # The auto schedule on CPU stores V = 10 logits: 3 head matmuls (2*80*6 each), not 4.
    auto = flops.learner_flops(cfg, **kw)
    assert ref["update_head_executed"] - auto["update_head_executed"] == 960
    assert flops.fused_head_matmuls(cfg, None) == (3, 1024)
    # V = 151936 on CPU: 96 stored rows are too few, so 4 matmuls in 1024-row chunks.
    assert flops.fused_head_matmuls(cfg.replace(vocab_size=151936), None) == (4, 1024)
    # Executed pairs: XLA all 6 x 6 per row; Pallas GPU one 16 x 16 tile per row (a row of 6
    # padded to 16); 300 tokens in 128-tiles: 3 tiles a side, 6 on or below the diagonal.
    assert flops.attention_pairs("xla", 2, 6) == 72
    assert flops.attention_pairs("pallas_gpu", 2, 6) == 2 * 256
    assert flops.attention_pairs("splash", 1, 300) == 6 * 128 * 128
    assert flops.attention_pairs("pallas_gpu", 1, 300) == 6 * 128 * 128
    # XLA in 4 causal query chunks of 2 (a row of 8): keys up to each chunk's end, 2 x (2 +
    # 4 + 6 + 8) = 40 = 64 x 5/8; a row of 6 in chunks (0, 1), (1, 3), (3, 4), (4, 6):
    # 1 + 2 x 3 + 4 + 2 x 6 = 23. No backward recompute (it reads the stored probabilities).
    assert flops.attention_pairs("xla_blocked", 2, 8) == 80
    assert flops.attention_pairs("xla_blocked", 1, 6) == 23
    blocked = flops.learner_flops(cfg, **kw, attention_impl="xla_blocked")
    assert auto["update_stack_executed"] - blocked["update_stack_executed"] == 3 * 64 * (72 - 46)
    # A flash kernel's backward: a dK/dV sweep (q k^T, p^T dO, dO v^T, dS^T q) and a dQ
    # sweep (q k^T, dO v^T, dS k), 7 matmuls of 2*Dh per pair and layer and head (2*L*H*Dh =
    # 32): 224 per pair on its tiles (here the forward's 16); XLA's backward 2 x 64.
    flash = flops.learner_flops(cfg, **kw, attention_impl="pallas_gpu")
    assert flash["update_stack_executed"] - auto["update_stack_executed"] == (
        64 * (512 - 72) + 224 * 512 - 128 * 72
    )
    # The Pallas GPU backward runs 32-wide tiles, the forward 128-wide ones: a row of 300
    # padded to 384 is 12 x 12 tiles of 32, 78 on or below the diagonal (79872 pairs, not
    # the forward's 98304).
    assert flops.attention_backward_flops(cfg, "pallas_gpu", 1, 300) == 224 * 78 * 32 * 32
    assert flops.attention_backward_flops(cfg, "splash", 1, 300) == 224 * 6 * 128 * 128
    assert flops.attention_backward_flops(cfg, "xla", 2, 6) == 128 * 72
    assert flops.attention_backward_flops(cfg, "cudnn", 1, 300) == 160 * 6 * 128 * 128


def test_sampler_flops_by_hand():
    # P=2 prompts of 2 and 3 real tokens (S=4), G=2, completions of 1, 2, 0, 3 (N=3).
    got = flops.sampler_flops(
        tiny(),
        prompt_lengths_P=[2, 3],
        completion_lengths_B=[1, 2, 0, 3],
        padded_prompt_len_S=4,
        decode_steps_N=3,
        cache_len_N=3,
    )
    # Prefill useful: 2304*5 + 160*2 + 64*(3+6) = 12416. Decode useful: 6 tokens, 6 logits,
    # pairs sum(c*p) + sum(c(c+1)/2) = 15 + 10: 13824 + 960 + 1600 = 16384.
    assert got["useful"] == 12416 + 16384
    # Prefill executed: 8 tokens, 2 logits, 2*16 pairs = 18432 + 320 + 2048; decode: 12 rows x
    # steps, 12 logits, 12*(4+3) pairs = 27648 + 1920 + 5376.
    assert got["executed"] == 20800 + 34944


def test_forward_flops_match_xla_cost_analysis():
    # One layer: XLA's cost analysis counts a while-loop body (the layer scan) once.
    cfg = tiny(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    b, s = 4, 16
    params = init_params(cfg, jax.random.key(0))
    ids_BxS = jnp.zeros((b, s), jnp.int32)
    f = jax.jit(lambda p, i: forward(p, cfg, i, i, jnp.ones_like(i), return_logits=True)[1])
    analysis = f.lower(params, ids_BxS).compile().cost_analysis()
    if isinstance(analysis, list):  # older jax: one dict per computation
        analysis = analysis[0]
    xla = analysis["flops"]
    ours = flops.forward_flops(cfg, tokens=b * s, logit_tokens=b * s, attn_pairs=b * s * s)
    # XLA counts every matmul exactly, plus ~1 FLOP per element of the elementwise ops the
    # formula leaves out (RMSNorm, RoPE, masking, softmax, SiLU, biases): 2.9% more here,
    # where a score costs 4*Dh = 64 matmul FLOPs and a token 2*(36864 + D*V) = 86k. So XLA is
    # never below the formula and at most 5% above it.
    assert ours <= xla <= 1.05 * ours


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v5", 459e12),
        ("TPU v4", 275e12),
    ],
)
def test_peak_table(kind, peak):
    assert flops.table_peak_flops(kind)[0] == peak


def test_peak_table_unknown():
    assert flops.table_peak_flops("cpu") is None
