"""ModelConfig: HF config.json in and out (checked against transformers' own config classes)."""

import json

import pytest
import transformers

from gjax.models.config import ModelConfig

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _qwen2_hf(**kw):
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=3,
        eos_token_id=[4, 5],
    )
    base.update(kw)
    return transformers.Qwen2Config(**base).to_dict()


def _llama_hf(**kw):
    base = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE),
        eos_token_id=7,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base).to_dict()


def _qwen3_hf(**kw):
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=256,
        rope_theta=1e6,
        tie_word_embeddings=True,
        eos_token_id=5,
    )
    base.update(kw)
    return transformers.Qwen3Config(**base).to_dict()


def test_qwen2_from_transformers_config():
    cfg = ModelConfig.from_hf(_qwen2_hf())
    assert cfg.model_type == "qwen2"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (96, 32, 64)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and cfg.attention_bias
    assert cfg.bos_token_id == 3 and cfg.eos_token_id == (4, 5)


def test_llama3_rope_scaling_and_explicit_head_dim():
    cfg = ModelConfig.from_hf(_llama_hf())
    assert cfg.head_dim == 16 and cfg.num_heads * cfg.head_dim != cfg.hidden_size
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling_dict == LLAMA3_ROPE
    assert not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.eos_token_id == (7,)
    hash(cfg)  # usable as a static jit argument


def test_qwen3_head_dim_norms_and_bias():
    cfg = ModelConfig.from_hf(_qwen3_hf())
    assert cfg.model_type == "qwen3" and cfg.qk_norm
    assert cfg.head_dim == 24 and cfg.num_heads * cfg.head_dim != cfg.hidden_size
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 1)
    assert not cfg.attention_bias and not cfg.o_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    biased = ModelConfig.from_hf(_qwen3_hf(attention_bias=True, tie_word_embeddings=False))
    assert biased.attention_bias and biased.o_bias and not biased.tie_word_embeddings
    # No head_dim in config.json: transformers' Qwen3 default (128), not hidden / heads.
    hf = {k: v for k, v in _qwen3_hf().items() if k != "head_dim"}
    assert ModelConfig.from_hf(hf).head_dim == transformers.Qwen3Config().head_dim == 128
    assert not ModelConfig.from_hf(_qwen2_hf()).qk_norm
    assert not ModelConfig.from_hf(_llama_hf()).qk_norm


@pytest.mark.parametrize("make", [_qwen2_hf, _llama_hf, _qwen3_hf])
def test_round_trip_through_transformers(make):
    cfg = ModelConfig.from_hf(make())
    hf = cfg.to_hf()
    json.dumps(hf)  # serializable as config.json
    assert ModelConfig.from_hf(hf) == cfg
    # transformers reads our dict back to the same architecture.
    cls = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
    }[cfg.model_type]
    again = ModelConfig.from_hf(cls.from_dict(hf).to_dict())
    assert again == cfg


def test_legacy_rope_scaling_forms():
    # Old-style `rope_scaling` with "type" instead of "rope_type", top-level rope_theta.
    hf = {
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 10000.0,
        "rope_scaling": {k if k != "rope_type" else "type": v for k, v in LLAMA3_ROPE.items()},
    }
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_scaling_dict == LLAMA3_ROPE
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
    assert cfg.to_hf()["rope_scaling"]["rope_type"] == "llama3"
    # A "default" scaling is no scaling.
    hf["rope_scaling"] = {"rope_type": "default"}
    assert ModelConfig.from_hf(hf).rope_scaling is None


def test_overrides_and_dict_rope_scaling():
    cfg = ModelConfig.from_hf(_qwen2_hf(), param_dtype="bfloat16", remat="full")
    assert cfg.param_dtype == "bfloat16" and cfg.remat == "full"
    direct = cfg.replace(model_type="llama", rope_scaling=dict(LLAMA3_ROPE))
    assert isinstance(direct.rope_scaling, tuple)
    hash(direct)


@pytest.mark.parametrize(
    "hf, match",
    [
        ({**_qwen2_hf(), "model_type": "mistral"}, r"unsupported model_type 'mistral'.*qwen2"),
        ({k: v for k, v in _qwen2_hf().items() if k != "hidden_size"}, r"\['hidden_size'\]"),
        (
            {**_llama_hf(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            r"unsupported rope_scaling type 'yarn'",
        ),
        ({**_llama_hf(), "hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({**_llama_hf(), "mlp_bias": True}, r"mlp_bias"),
        ({**_qwen2_hf(), "use_sliding_window": True}, r"use_sliding_window"),
        ({**_qwen3_hf(), "model_type": "qwen3_moe"}, r"unsupported model_type 'qwen3_moe'"),
        ({**_qwen3_hf(), "use_sliding_window": True}, r"use_sliding_window=true"),
        (
            {**_qwen3_hf(), "layer_types": ["full_attention", "sliding_attention"]},
            r"layer_types \['sliding_attention'\] \(gjax implements 'full_attention'",
        ),
        (
            {**_qwen3_hf(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            r"unsupported rope_scaling type 'yarn'",
        ),
        ({**_qwen2_hf(), "num_key_value_heads": 3}, r"num_heads=4 is not a multiple of"),
        (
            {**_llama_hf(), "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            r"lacks \['low_freq_factor', 'high_freq_factor'",
        ),
    ],
)
def test_from_hf_errors(hf, match):
    if "rope_parameters" in hf and "rope_scaling" in hf:
        hf.pop("rope_scaling")
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_unknown_override_lists_valid_fields():
    with pytest.raises(ValueError, match=r"unknown ModelConfig override\(s\) \['num_experts'\]"):
        ModelConfig.from_hf(_qwen2_hf(), num_experts=8)


def test_bad_field_values():
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        ModelConfig.from_hf(_qwen2_hf(), vocab_size=0)
    with pytest.raises(ValueError, match="unknown remat policy 'sometimes'"):
        ModelConfig.from_hf(_qwen2_hf(), remat="sometimes")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        ModelConfig.from_hf(_qwen2_hf(), dtype="float8")


def test_from_pretrained_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_llama_hf()))
    assert ModelConfig.from_pretrained_dir(str(tmp_path), dtype="bfloat16").dtype == "bfloat16"
