"""The policy: a decoder-only transformer covering HF `Qwen2ForCausalLM`, `LlamaForCausalLM`
and dense `Qwen3ForCausalLM`.

Architecture (all three): token embedding -> L x [RMSNorm -> GQA self-attention with RoPE
(q/k/v bias when `attention_bias`, o too for Llama and Qwen3; Qwen3 RMSNorms each q and k head
over Dh before RoPE) -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm -> LM
head (tied to the embedding or not).

    rms_norm(x) = x / sqrt(mean(x^2) + eps) * scale                 (computed in f32)
    rope(x)[i]  = x[i] cos(p w_i) - x[i + Dh/2] sin(p w_i)           (HF "rotate_half" layout)
    w_i         = theta^(-2i / Dh), Llama-3 scaling remaps w_i by wavelength bands
    attn        = softmax(q k^T / sqrt(Dh) + mask) v,  query head h reads kv head h // (H / K)
    mlp(x)      = down(silu(gate(x)) * up(x))

Two entry points share the same math and the same parameter tree (docs/architecture.md):
- `Transformer` (flax.linen): the training/scoring forward over full sequences. Layers are one
  `nn.scan` over `Block` (params stacked on a leading `layers` axis; compile time flat in depth),
  optionally rematerialized per layer (`cfg.remat`). Params carry logical axis names.
- `prefill` / `decode_step`: pure functions over the same params used by the sampler
  (gjax/rollout/sampler.py) with an explicit KV cache (see their docstrings).

Attention masking uses `segment_ids` (0 = padding): token i attends token j iff j <= i (by
index), seg[i] == seg[j] and seg[j] != 0. Left padding, right padding and packing all work;
positions are explicit (a left-padded prompt counts positions from its first real token).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gjax import sharding
from gjax.models import attention, quant
from gjax.models.attention import MASK_VALUE as _MASK_VALUE  # noqa: F401 (decoders import it)
from gjax.models.config import ModelConfig, dtype_from_name

Params = dict[str, Any]

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


# --------------------------------------------------------------------------------------------
# Shared math (pure functions of arrays).
# --------------------------------------------------------------------------------------------


def rms_norm(x, scale, eps: float):
    """RMSNorm as HF computes it: normalize in f32, cast back, then multiply by the scale."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * x32.astype(dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies w_i = theta^(-2i/Dh), i < Dh/2, with Llama-3 band scaling if set."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    scaling = cfg.rope_scaling_dict
    if scaling:
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the
        # band in between interpolated smoothly (Llama 3 report, "rope scaling").
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions, cfg: ModelConfig):
    """cos/sin tables for integer `positions` (any shape ...) -> two [..., Dh/2] f32 arrays."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates x[..., H, Dh] (HF rotate_half layout); cos/sin are [..., Dh/2] without the H axis."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)


def lora_delta(x_NxI, a_IxR, b_RxO, scale: float, dtype):
    """LoRA's low-rank term (alpha / r) (x A) B (Hu et al. 2021, eq. (3)); x is [..., in]."""
    xa = jnp.dot(x_NxI, a_IxR.astype(dtype))
    return jnp.dot(xa, b_RxO.astype(dtype)) * jnp.asarray(scale, dtype)


def merged_kernel(p, cfg: ModelConfig):
    """A projection's effective kernel W + (alpha / r) A B (W alone without adapters; W
    dequantized from a quantized base), in the params' float dtype: what a merged export
    writes."""
    dtype = cfg.jnp_param_dtype if "kernel_scale" in p else p["kernel"].dtype
    if "lora_a" not in p:
        return quant.kernel(p, cfg, dtype)
    delta = jnp.matmul(p["lora_a"].astype(jnp.float32), p["lora_b"].astype(jnp.float32))
    w = quant.kernel(p, cfg, jnp.float32)
    return (w + cfg.lora_scale * delta).astype(dtype)


def _linear(p, x, cfg: ModelConfig):
    dtype = cfg.jnp_dtype
    if quant.direct(p):  # int8 / fp8 codes: (x @ codes) * scale, no float kernel
        y = quant.codes_dot(x, p["kernel"], p["kernel_scale"], dtype)
    else:
        y = jnp.dot(x, quant.kernel(p, cfg, dtype))
    if "lora_a" in p:
        y = y + lora_delta(x, p["lora_a"], p["lora_b"], cfg.lora_scale, dtype)
    if "bias" in p:
        y = y + p["bias"].astype(dtype)
    return y


def lm_head_kernel(params: Params, cfg: ModelConfig):
    """The LM head as a [D, V] kernel: the embedding transposed when tied, else `lm_head`."""
    if cfg.tie_word_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


# --------------------------------------------------------------------------------------------
# Flax modules (the training/scoring forward).
# --------------------------------------------------------------------------------------------


def _param(module: nn.Module, name: str, shape, axes, cfg: ModelConfig, init):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, cfg.jnp_param_dtype)


_normal = nn.initializers.normal(stddev=0.02)


class Linear(nn.Module):
    """y = x W (+ b) with W stored [in, out] (HF's [out, in] transposed) and logical axes."""

    cfg: ModelConfig
    features: int
    axes: tuple[str | None, str | None]
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dtype = cfg.jnp_dtype
        shape = (x.shape[-1], self.features)
        if cfg.base_quant == "none":
            kernel = _param(self, "kernel", shape, self.axes, cfg, _normal).astype(dtype)
        else:  # a frozen base stored quantized (QLoRA): codes and their scales
            codes = self.param(
                "kernel",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                shape,
                quant.code_dtype(cfg.base_quant),
            )
            scale = self.param(
                "kernel_scale",
                nn.with_logical_partitioning(nn.initializers.ones, (None, self.axes[1])),
                quant.scale_shape(*shape, cfg.base_quant),
                jnp.float32,
            )
            kernel = quant.dequantize(codes, scale, cfg.base_quant, dtype)
        # Tokens flattened to one axis: a plain 2-D matmul, whose backward XLA:CPU runs ~1.7x
        # faster than the [B, T, D] form's (measured on the MLP; same math everywhere). Not
        # with sequence shards: rows over data and tokens over seq do not flatten into one
        # sharded axis, XLA would gather every row's tokens first.
        if x.ndim == 3 and sharding.sequence_shards(x.shape[1]) > 1:
            x_NxI = x.astype(dtype)
        else:
            x_NxI = x.reshape(-1, x.shape[-1]).astype(dtype)
        y_NxF = jnp.dot(x_NxI, kernel)
        if self.name in cfg.lora_targets:  # LoRA: adapters beside the frozen kernel
            # PEFT's A: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(in)); B = 0: the adapted
            # model starts as the base.
            init_a = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
            a = self.param(
                "lora_a",
                nn.with_logical_partitioning(init_a, (self.axes[0], None)),
                (x.shape[-1], cfg.lora_rank),
                dtype_from_name(cfg.lora_dtype),
            )
            b = self.param(
                "lora_b",
                nn.with_logical_partitioning(nn.initializers.zeros, (None, self.axes[1])),
                (cfg.lora_rank, self.features),
                dtype_from_name(cfg.lora_dtype),
            )
            y_NxF = y_NxF + lora_delta(x_NxI, a, b, cfg.lora_scale, dtype)
        y = y_NxF.reshape(*x.shape[:-1], self.features)
        if self.use_bias:
            bias = _param(
                self, "bias", (self.features,), self.axes[1:], self.cfg, nn.initializers.zeros
            )
            y = y + bias.astype(dtype)
        return y


class RMSNorm(nn.Module):
    cfg: ModelConfig
    axes: tuple[str | None, ...] = ("embed",)  # the scale's logical axis ((None,): over Dh)

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", (x.shape[-1],), self.axes, self.cfg, nn.initializers.ones)
        return rms_norm(x, scale, self.cfg.rms_norm_eps)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, cos, sin, attn_in):
        cfg = self.cfg
        b, t, _ = x_BxTxD.shape
        h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        q = Linear(cfg, h * dh, ("embed", "q_heads"), bias, name="q")(x_BxTxD)
        key = Linear(cfg, k * dh, ("embed", "kv_heads"), bias, name="k")(x_BxTxD)
        val = Linear(cfg, k * dh, ("embed", "kv_heads"), bias, name="v")(x_BxTxD)
        q = nn.with_logical_constraint(q.reshape(b, t, h, dh), ("batch", "length", "q_heads", None))
        key = nn.with_logical_constraint(
            key.reshape(b, t, k, dh), ("batch", "length", "kv_heads", None)
        )
        val = nn.with_logical_constraint(
            val.reshape(b, t, k, dh), ("batch", "length", "kv_heads", None)
        )
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm over Dh, before RoPE
            q = RMSNorm(cfg, (None,), name="q_norm")(q)
            key = RMSNorm(cfg, (None,), name="k_norm")(key)
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        impl = attention.platform_impl(cfg.attention)
        out = attention.attend(impl, q, key, val, attn_in).reshape(b, t, h * dh)
        out = nn.with_logical_constraint(out, ("batch", "length", "q_heads"))
        return Linear(cfg, cfg.hidden_size, ("q_heads", "embed"), cfg.o_bias, name="o")(out)


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD):
        cfg = self.cfg
        f = cfg.intermediate_size
        gate = Linear(cfg, f, ("embed", "mlp"), name="gate")(x_BxTxD)
        up = Linear(cfg, f, ("embed", "mlp"), name="up")(x_BxTxD)
        act = nn.with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return Linear(cfg, cfg.hidden_size, ("mlp", "embed"), name="down")(act)


class Block(nn.Module):
    """One pre-norm decoder layer; scanned over depth (carry = the residual stream)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, cos, sin, attn_in):
        cfg = self.cfg
        h = RMSNorm(cfg, name="input_norm")(x_BxTxD)
        x_BxTxD = x_BxTxD + Attention(cfg, name="attn")(h, cos, sin, attn_in)
        h = RMSNorm(cfg, name="post_attn_norm")(x_BxTxD)
        x_BxTxD = x_BxTxD + MLP(cfg, name="mlp")(h)
        x_BxTxD = nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed"))
        return x_BxTxD, None


class Transformer(nn.Module):
    """Decoder over full sequences. Returns final-normed `hidden_BxTxD` (and `logits_BxTxV`).

    Call: `Transformer(cfg).apply({"params": params}, tokens_BxT, positions_BxT,
    segment_ids_BxT, return_logits=False)`; logits are computed in f32.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT, *, return_logits=False):
        cfg = self.cfg
        dtype = cfg.jnp_dtype
        embedding_VxD = Embed(cfg, name="embed")()
        x_BxTxD = jnp.take(embedding_VxD, tokens_BxT, axis=0).astype(dtype)
        x_BxTxD = nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed"))
        cos, sin = rope_cos_sin(positions_BxT, cfg)
        # The dense mask (xla) or the segment ids (kernels), per `cfg.attention`.
        attn_in = attention.layer_input(attention.platform_impl(cfg.attention), segment_ids_BxT)

        block = Block
        if cfg.remat != "none":
            block = nn.remat(block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x_BxTxD, _ = stack(cfg, name="layers")(x_BxTxD, cos, sin, attn_in)
        hidden_BxTxD = RMSNorm(cfg, name="final_norm")(x_BxTxD)
        if not return_logits:
            return hidden_BxTxD
        if cfg.tie_word_embeddings:
            head_DxV = embedding_VxD.T
        else:
            head_DxV = Head(cfg, name="lm_head")()
        logits_BxTxV = jnp.einsum(
            "btd,dv->btv", hidden_BxTxD, head_DxV.astype(dtype), preferred_element_type=jnp.float32
        )
        logits_BxTxV = nn.with_logical_constraint(logits_BxTxV, ("batch", "length", "vocab"))
        return hidden_BxTxD, logits_BxTxV


class Embed(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        return _param(
            self, "embedding", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg, _normal
        )


class Head(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        return _param(
            self, "kernel", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg, _normal
        )


# --------------------------------------------------------------------------------------------
# Params: init, abstract shapes, logical axes.
# --------------------------------------------------------------------------------------------


def _dummy_inputs():
    tokens = jnp.zeros((1, 1), jnp.int32)
    return tokens, tokens, jnp.ones((1, 1), jnp.int32)


def _boxed_init(cfg: ModelConfig, rng):
    model = Transformer(cfg)
    return model.init(rng, *_dummy_inputs(), return_logits=True)["params"]


def init_params(cfg: ModelConfig, rng) -> Params:
    """Random params (normal(0.02) kernels, unit norms, zero biases) as a plain dict tree."""
    return _init_jit(cfg, rng)


@jax.jit(static_argnums=0)
def _init_jit(cfg: ModelConfig, rng) -> Params:
    return nn.meta.unbox(_boxed_init(cfg, rng))


def abstract_params(cfg: ModelConfig) -> Params:
    """The param tree as `jax.ShapeDtypeStruct`s (no allocation), for sharded init/loading."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def param_logical_axes(cfg: ModelConfig) -> Params:
    """The param tree with each leaf a `PartitionSpec` of logical axis names.

    e.g. `layers/attn/q/kernel -> P("layers", "embed", "q_heads")`. gjax/sharding.py maps
    logical names to mesh axes; the model only names them.
    """
    boxed = jax.eval_shape(lambda: _boxed_init(cfg, jax.random.key(0)))
    return nn.get_partition_spec(boxed)


def forward(params: Params, cfg: ModelConfig, tokens_BxT, positions_BxT, segment_ids_BxT, **kw):
    """Functional shorthand for `Transformer(cfg).apply({"params": params}, ...)`."""
    return Transformer(cfg).apply(
        {"params": params}, tokens_BxT, positions_BxT, segment_ids_BxT, **kw
    )


# --------------------------------------------------------------------------------------------
# Cache-aware path for the sampler (pure functions over the same params).
# --------------------------------------------------------------------------------------------


def _qkv(attn_p, h, cfg: ModelConfig):
    lead = h.shape[:-1]
    q = _linear(attn_p["q"], h, cfg).reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = _linear(attn_p["k"], h, cfg).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(attn_p["v"], h, cfg).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, attn_p["q_norm"]["scale"], cfg.rms_norm_eps)
        k = rms_norm(k, attn_p["k_norm"]["scale"], cfg.rms_norm_eps)
    return q, k, v


def _mlp(mlp_p, h, cfg: ModelConfig):
    gate = _linear(mlp_p["gate"], h, cfg)
    up = _linear(mlp_p["up"], h, cfg)
    return _linear(mlp_p["down"], jax.nn.silu(gate) * up, cfg)


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden_xD):
    """f32 logits [..., V] from final-normed hidden states [..., D]."""
    head_DxV = lm_head_kernel(params, cfg).astype(cfg.jnp_dtype)
    return jnp.einsum("...d,dv->...v", hidden_xD, head_DxV, preferred_element_type=jnp.float32)


def prefill(params: Params, cfg: ModelConfig, tokens_PxS, positions_PxS, segment_ids_PxS):
    """Full forward over prompts that also returns their KV cache.

    Returns `(hidden_PxSxD, k_LxPxKxSxDh, v_LxPxKxSxDh)`; keys are stored after RoPE, so a
    decode step never re-rotates the cache. The cache is laid out [.., K, S, Dh] so decode
    attention is a plain batched matmul over (P, K). Same math as `Transformer` (tested), and
    the same attention implementation (`cfg.attention`, resolved as the forward resolves it),
    so prefill and the training forward round alike.
    """
    dtype = cfg.jnp_dtype
    eps = cfg.rms_norm_eps
    x = jnp.take(params["embed"]["embedding"], tokens_PxS, axis=0).astype(dtype)
    cos, sin = rope_cos_sin(positions_PxS, cfg)
    impl = attention.platform_impl(cfg.attention)
    attn_in = attention.layer_input(impl, segment_ids_PxS)

    def layer(x, lp):
        h = rms_norm(x, lp["input_norm"]["scale"], eps)
        q, k, v = _qkv(lp["attn"], h, cfg)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        att = attention.attend(impl, q, k, v, attn_in)
        x = x + _linear(lp["attn"]["o"], att.reshape(*att.shape[:2], -1), cfg)
        h = rms_norm(x, lp["post_attn_norm"]["scale"], eps)
        x = x + _mlp(lp["mlp"], h, cfg)
        return x, (k.swapaxes(1, 2), v.swapaxes(1, 2))

    x, (k_cache, v_cache) = jax.lax.scan(layer, x, params["layers"])
    hidden = rms_norm(x, params["final_norm"]["scale"], eps)
    return hidden, k_cache, v_cache


def split_layers(stacked):
    """Per-layer views [tree_i for i < L] of a tree stacked on a leading L axis."""
    n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(n)]


def decode_layers(params: Params, cfg: ModelConfig) -> list[Params]:
    """Per-layer weights in the decode step's layout, built once per `generate` call.

    Splitting the stacked L axis outside the decode loop means each step reads every
    layer's weights in place (a scan over stacked weights copies each layer's slice every
    step); fusing q|k|v and gate|up into one kernel each gives two wide matmuls instead of
    five narrow ones per layer (the decode batch is small, so matmul count matters on CPU).
    LoRA adapters stay low-rank (`lora`: name -> (A, B) in the compute dtype), added to
    their slice of the fused product in the step as the learner adds them: merged into a
    bf16 kernel, an update much smaller than W would round away (an adapter moving W by
    ~0.1 % kept ~0 of its effect), so the sampler would not sample the policy it trains.
    Projections stored as int8 / fp8 codes with per-output-channel scales (quantized
    rollouts, an int8 QLoRA base) stay codes: `qkv` etc. are the fused codes and `qkv_scale`
    etc. their fused scales [1, F], which `fused_dot` applies after the matmul; a 4-bit base
    is dequantized here, once per call.
    """
    dtype = cfg.jnp_dtype
    out = []
    for lp in split_layers(params["layers"]):
        attn, mlp = lp["attn"], lp["mlp"]
        layer = {
            "input_norm": lp["input_norm"]["scale"],
            "post_attn_norm": lp["post_attn_norm"]["scale"],
        }
        fused = (("qkv", [attn[n] for n in "qkv"]), ("o", [attn["o"]]))
        fused += (("gate_up", [mlp["gate"], mlp["up"]]), ("down", [mlp["down"]]))
        for key, ps in fused:
            if all(quant.direct(p) for p in ps):
                layer[key] = jnp.concatenate([p["kernel"] for p in ps], axis=-1)
                layer[f"{key}_scale"] = jnp.concatenate([p["kernel_scale"] for p in ps], -1)
            else:
                w = [quant.kernel(p, cfg, dtype) for p in ps]
                layer[key] = jnp.concatenate(w, axis=-1).astype(dtype)
        if cfg.attention_bias:
            layer["qkv_bias"] = jnp.concatenate([attn[n]["bias"] for n in "qkv"]).astype(dtype)
        if cfg.o_bias:
            layer["o_bias"] = attn["o"]["bias"].astype(dtype)
        if cfg.qk_norm:
            layer["q_norm"] = attn["q_norm"]["scale"]
            layer["k_norm"] = attn["k_norm"]["scale"]
        adapters = {
            n: (p["lora_a"].astype(dtype), p["lora_b"].astype(dtype))
            for n, p in [*attn.items(), *mlp.items()]
            if isinstance(p, dict) and "lora_a" in p
        }
        if adapters:
            layer["lora"] = adapters
        out.append(layer)
    return out


def fused_dot(lp: Params, name: str, x_BxI):
    """x @ the layer's fused kernel `name` (`decode_layers`): a plain matmul, or with codes
    `(x @ codes) * scale` (`quant.codes_dot`)."""
    if f"{name}_scale" in lp:
        return quant.codes_dot(x_BxI, lp[name], lp[f"{name}_scale"], x_BxI.dtype)
    return jnp.dot(x_BxI, lp[name])


def _add_lora(lp: Params, y_BxF, x_BxI, names_widths, cfg: ModelConfig):
    """y with each adapted projection's low-rank term added to its slice of the fused
    product (`names_widths`: the fused projections in order, with their output widths)."""
    start = 0
    for name, width in names_widths:
        if name in lp.get("lora", {}):
            a, b = lp["lora"][name]
            delta = lora_delta(x_BxI, a, b, cfg.lora_scale, y_BxF.dtype)
            y_BxF = y_BxF.at[:, start : start + width].add(delta)
        start += width
    return y_BxF


def decode_qkv(lp: Params, x_BxD, cos, sin, cfg: ModelConfig):
    """One decode token's query, key and value per row ([B, H, Dh], [B, K, Dh] twice) from a
    layer's weights (`decode_layers`): input norm, fused QKV (+ bias), the per-head q/k norms
    (Qwen3), RoPE on q and k."""
    b_, dh = x_BxD.shape[0], cfg.head_dim
    hq, hkv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    h_BxD = rms_norm(x_BxD, lp["input_norm"], cfg.rms_norm_eps)
    qkv = _add_lora(
        lp, fused_dot(lp, "qkv", h_BxD), h_BxD, (("q", hq), ("k", hkv), ("v", hkv)), cfg
    )
    if "qkv_bias" in lp:
        qkv = qkv + lp["qkv_bias"]
    q = qkv[:, :hq].reshape(b_, cfg.num_heads, dh)
    k = qkv[:, hq : hq + hkv].reshape(b_, cfg.num_kv_heads, dh)
    v = qkv[:, hq + hkv :].reshape(b_, cfg.num_kv_heads, dh)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def decode_layer_out(lp: Params, x_BxD, attn_BxHDh, cfg: ModelConfig):
    """The rest of a decode layer after attention: output projection (+ bias) into the
    residual, post-attention norm, SwiGLU MLP into the residual."""
    o = _add_lora(lp, fused_dot(lp, "o", attn_BxHDh), attn_BxHDh, (("o", lp["o"].shape[1]),), cfg)
    x_BxD = x_BxD + (o + lp["o_bias"] if "o_bias" in lp else o)
    h_BxD = rms_norm(x_BxD, lp["post_attn_norm"], cfg.rms_norm_eps)
    f_ = lp["gate_up"].shape[-1] // 2
    gate_up = _add_lora(lp, fused_dot(lp, "gate_up", h_BxD), h_BxD, (("gate", f_), ("up", f_)), cfg)
    act = jax.nn.silu(gate_up[:, :f_]) * gate_up[:, f_:]
    return x_BxD + _add_lora(lp, fused_dot(lp, "down", act), act, (("down", x_BxD.shape[1]),), cfg)


def decode_step(
    params: Params,
    cfg: ModelConfig,
    layers: list[Params],
    tokens_B,
    positions_B,
    prefix_k: list,
    prefix_v: list,
    prefix_mask_PxS,
    cache_k: list,
    cache_v: list,
    step,
):
    """One token for B = P*G sequences (prompt-major) given a shared prompt cache.

    Args:
      params: the full param tree (embedding, final norm, head); `layers` its per-layer
        weights from `decode_layers(params, cfg)`.
      prefix_k/prefix_v: per layer `[P, K, S, Dh]` prompt keys/values (from `prefill`).
      cache_k/cache_v: per layer `[B, K, N, Dh]` per-sample caches; slot `step` is written.
    Each sequence b attends (i) the prefix cache of its prompt p = b // G, never copied G
    times: the G*R query heads of a prompt sharing kv head k form one [G*R, Dh] block against
    that prompt's [S, Dh] keys; (ii) its own cache slots n <= `step` (this token included).
    One softmax spans both parts (a shared max). Returns `(hidden_BxD, cache_k, cache_v)`.
    """
    dtype = cfg.jnp_dtype
    f32 = jnp.float32
    eps = cfg.rms_norm_eps
    p_, s_ = prefix_mask_PxS.shape
    b_ = tokens_B.shape[0]
    g_ = b_ // p_
    n_ = cache_k[0].shape[2]
    h_, kv_, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    r_ = h_ // kv_
    scale = 1.0 / math.sqrt(dh)
    x = jnp.take(params["embed"]["embedding"], tokens_B, axis=0).astype(dtype)
    cos, sin = rope_cos_sin(positions_B, cfg)
    own_valid_N = jnp.arange(n_) <= step
    prefix_valid_Px1x1xS = prefix_mask_PxS.astype(bool)[:, None, None, :]

    def to_prefix_layout(a_BxKxRx_):  # [B, K, R, ...] -> [P, K, G*R, ...]
        a = a_BxKxRx_.reshape(p_, g_, kv_, r_, *a_BxKxRx_.shape[3:])
        return jnp.swapaxes(a, 1, 2).reshape(p_, kv_, g_ * r_, *a.shape[4:])

    def from_prefix_layout(a_PxKxGRx_):  # [P, K, G*R, ...] -> [B, K, R, ...]
        a = a_PxKxGRx_.reshape(p_, kv_, g_, r_, *a_PxKxGRx_.shape[3:])
        return jnp.swapaxes(a, 1, 2).reshape(b_, kv_, r_, *a.shape[4:])

    cache_k, cache_v = list(cache_k), list(cache_v)
    for i, lp in enumerate(layers):
        q, k, v = decode_qkv(lp, x, cos, sin, cfg)
        at = (0, 0, step, 0)
        cache_k[i] = jax.lax.dynamic_update_slice(cache_k[i], k[:, :, None].astype(dtype), at)
        cache_v[i] = jax.lax.dynamic_update_slice(cache_v[i], v[:, :, None].astype(dtype), at)
        q_BxKxRxDh = q.reshape(b_, kv_, r_, dh)
        s_pre = jnp.einsum(
            "pkqd,pksd->pkqs", to_prefix_layout(q_BxKxRxDh), prefix_k[i], preferred_element_type=f32
        )
        s_pre = jnp.where(prefix_valid_Px1x1xS, s_pre * scale, _MASK_VALUE)
        s_own = jnp.einsum("bkrd,bknd->bkrn", q_BxKxRxDh, cache_k[i], preferred_element_type=f32)
        s_own = jnp.where(own_valid_N, s_own * scale, _MASK_VALUE)
        m_BxKxR = jnp.maximum(from_prefix_layout(s_pre.max(-1)), s_own.max(-1))
        e_pre = jnp.exp(s_pre - to_prefix_layout(m_BxKxR)[..., None])
        e_own = jnp.exp(s_own - m_BxKxR[..., None])
        denom = from_prefix_layout(e_pre.sum(-1)) + e_own.sum(-1)
        out = from_prefix_layout(jnp.einsum("pkqs,pksd->pkqd", e_pre.astype(dtype), prefix_v[i]))
        out = out + jnp.einsum("bkrn,bknd->bkrd", e_own.astype(dtype), cache_v[i])
        out = (out / denom[..., None].astype(dtype)).reshape(b_, h_ * dh)
        x = decode_layer_out(lp, x, out, cfg)
    hidden = rms_norm(x, params["final_norm"]["scale"], eps)
    return hidden, cache_k, cache_v
