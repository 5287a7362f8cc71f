"""HF weights in and out: parity with transformers (PyTorch CPU, test-only) and bad input.

Tiny random Qwen2 (q/k/v bias; tied and untied), Llama (GQA, Llama-3 rope scaling; and
attention_bias=true, which biases q/k/v/o) and Qwen3 (per-head q/k norms; ten random
configs) models are built by transformers itself, saved with `save_pretrained` (single file and sharded with
an index), loaded by gjax and compared on padded batches; then exported by gjax and loaded
back by transformers.
"""

import copy
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from gjax import sharding
from gjax.models import hf_export, hf_format, hf_import
from gjax.models import transformer as T
from gjax.models.config import ModelConfig

TOL = 1e-4  # max abs logit difference in f32 (issue 2)

_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
HF_CONFIGS = {
    "qwen2_tied": lambda: transformers.Qwen2Config(
        **_COMMON, tie_word_embeddings=True, rope_theta=10000.0
    ),
    "qwen2_untied": lambda: transformers.Qwen2Config(
        **_COMMON, tie_word_embeddings=False, rope_theta=1e6
    ),
    "llama3": lambda: transformers.LlamaConfig(
        **{**_COMMON, "num_attention_heads": 8, "head_dim": 8},  # GQA 8 -> 2
        tie_word_embeddings=False,
        rope_theta=500000.0,
        # Short original context so the scaling bands touch the positions tested.
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # attention_bias=true: transformers' Llama puts a bias on q/k/v AND o_proj.
    "llama_bias": lambda: transformers.LlamaConfig(
        **_COMMON, tie_word_embeddings=True, attention_bias=True, rope_theta=10000.0
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (HF init leaves biases 0 and norms 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (torch model, single-file dir, sharded dir)."""
    out = {}
    for seed, (name, make) in enumerate(HF_CONFIGS.items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(make()).eval()
        _randomize(model, seed)
        single = str(tmp_path_factory.mktemp(name + "_single"))
        sharded = str(tmp_path_factory.mktemp(name + "_sharded"))
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="20KB")
        out[name] = (model, single, sharded)
    return out


def _padded_batch():
    """Left-padded, right-padded and full rows. Returns tokens, mask, positions (all [B, T])."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 96, size=(3, 24))
    mask = np.ones_like(tokens)
    mask[0, :7] = 0  # left padding
    mask[1, 18:] = 0  # right padding
    tokens = np.where(mask == 1, tokens, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, mask, positions


def _hf_logits(model, tokens, mask, positions):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def _gjax_logits(params, cfg, tokens, mask, positions):
    _, logits = _forward(
        params,
        cfg,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        return_logits=True,
    )
    return np.asarray(logits)


def _max_diff_valid(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


_forward = jax.jit(T.forward, static_argnums=1, static_argnames="return_logits")


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_load_parity_with_transformers(hf_models, name):
    model, single, sharded = hf_models[name]
    cfg, params = hf_import.load_pretrained(single)
    assert cfg.tie_word_embeddings == (name in ("qwen2_tied", "llama_bias"))
    assert ("lm_head" in params) == (not cfg.tie_word_embeddings)
    assert cfg.attention_bias == (name.startswith("qwen2") or name == "llama_bias")
    assert ("bias" in params["layers"]["attn"]["o"]) == (name == "llama_bias")
    sharding.param_logical_axes(params)  # every loaded tensor has a sharding rule
    if name == "llama3":
        assert cfg.rope_scaling_dict["rope_type"] == "llama3"
    # Structure and shapes are exactly the model's own param tree.
    abstract = T.abstract_params(cfg)
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    for a, p in zip(jax.tree.leaves(abstract), jax.tree.leaves(params)):
        assert a.shape == p.shape and a.dtype == p.dtype

    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(model, tokens, mask, positions)
    got = _gjax_logits(params, cfg, tokens, mask, positions)
    assert _max_diff_valid(got, ref, mask) <= TOL

    # The sharded files + index (written by transformers) give exactly the same params.
    assert os.path.exists(os.path.join(sharded, hf_format.INDEX_FILE))
    cfg_sharded, params_sharded = hf_import.load_pretrained(sharded)
    assert cfg_sharded == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params_sharded)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_export_loads_in_transformers(hf_models, tmp_path, name):
    model, single, _ = hf_models[name]
    cfg, params = hf_import.load_pretrained(single)
    out = str(tmp_path / "export")
    hf_export.save_pretrained(
        params, cfg, out, max_shard_size="16KB", generation_config={"temperature": 0.7}
    )
    files = sorted(os.listdir(out))
    assert hf_format.INDEX_FILE in files and "config.json" in files
    assert "generation_config.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    with open(os.path.join(out, hf_format.INDEX_FILE)) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == {n for n, _ in hf_format.iter_hf_names(cfg)}

    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.generation_config.temperature == 0.7
    assert back.generation_config.eos_token_id == model.generation_config.eos_token_id
    # Every tensor survives the trip bit for bit ...
    ref_state, back_state = model.state_dict(), back.state_dict()
    for key, value in ref_state.items():
        torch.testing.assert_close(back_state[key], value, rtol=0, atol=0, msg=key)
    # ... so the logits agree too, and with gjax's own.
    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(model, tokens, mask, positions)
    exported = _hf_logits(back, tokens, mask, positions)
    assert _max_diff_valid(exported, ref, mask) <= TOL
    # And gjax reads its own export.
    cfg2, params2 = hf_import.load_pretrained(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def _qwen3_config(i: int):
    """Random Qwen3 config `i` (seeded): head_dim free of hidden / heads, GQA ratios 1-4,
    kv heads 1, 2, 4 in turn (each tied and untied: tied on even i), attention_bias (q/k/v
    and o) on every third."""
    rng = np.random.default_rng(3200 + i)
    kv = (1, 2, 4)[(i // 2) % 3]
    return transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=int(rng.choice([32, 48, 64])),
        intermediate_size=int(rng.choice([40, 64, 96])),
        num_hidden_layers=int(rng.choice([1, 2, 3])),
        num_attention_heads=kv * int(rng.choice([1, 2, 4])),
        num_key_value_heads=kv,
        head_dim=int(rng.choice([8, 12, 16, 24, 32])),
        max_position_embeddings=256,
        rms_norm_eps=float(rng.choice([1e-6, 1e-5])),
        rope_theta=float(rng.choice([1e4, 1e6])),
        tie_word_embeddings=i % 2 == 0,
        attention_bias=i % 3 == 0,
    )


QWEN3_CONFIGS = [_qwen3_config(i) for i in range(10)]


def test_qwen3_configs_cover_the_variants():
    ratios = {c.num_attention_heads // c.num_key_value_heads for c in QWEN3_CONFIGS}
    assert ratios == {1, 2, 4}
    assert {c.tie_word_embeddings for c in QWEN3_CONFIGS} == {True, False}
    assert {c.attention_bias for c in QWEN3_CONFIGS} == {True, False}
    assert {c.num_key_value_heads for c in QWEN3_CONFIGS} == {1, 2, 4}
    free = [c.head_dim * c.num_attention_heads != c.hidden_size for c in QWEN3_CONFIGS]
    assert sum(free) >= 8


@pytest.mark.parametrize("i", range(len(QWEN3_CONFIGS)))
def test_qwen3_parity_and_export_round_trip(tmp_path, i):
    """transformers' Qwen3ForCausalLM -> gjax: logits within TOL on padded rows; gjax's export
    -> transformers: every tensor bit for bit; and gjax reads its export back exactly."""
    torch.manual_seed(i)
    model = transformers.AutoModelForCausalLM.from_config(QWEN3_CONFIGS[i]).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    _randomize(model, 100 + i)
    src = str(tmp_path / "hf")
    model.save_pretrained(src)
    cfg, params = hf_import.load_pretrained(src)
    assert cfg.model_type == "qwen3" and cfg.head_dim == QWEN3_CONFIGS[i].head_dim
    assert cfg.attention_bias == cfg.o_bias == QWEN3_CONFIGS[i].attention_bias
    attn = params["layers"]["attn"]
    assert attn["q_norm"]["scale"].shape == (cfg.num_layers, cfg.head_dim)
    assert attn["k_norm"]["scale"].shape == (cfg.num_layers, cfg.head_dim)
    axes = sharding.param_logical_axes(params)["layers"]["attn"]["q_norm"]["scale"]
    assert tuple(axes) == ("layers", None)
    abstract = T.abstract_params(cfg)
    assert jax.tree.structure(abstract) == jax.tree.structure(params)

    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(model, tokens, mask, positions)
    got = _gjax_logits(params, cfg, tokens, mask, positions)
    assert _max_diff_valid(got, ref, mask) <= TOL

    out = str(tmp_path / "export")
    hf_export.save_pretrained(params, cfg, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref_state, back_state = model.state_dict(), back.state_dict()
    assert set(back_state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(back_state[key], value, rtol=0, atol=0, msg=key)
    cfg2, params2 = hf_import.load_pretrained(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_export_single_file_and_bf16(hf_models, tmp_path):
    _, single, _ = hf_models["qwen2_tied"]
    cfg, params = hf_import.load_pretrained(single)
    out = str(tmp_path / "bf16")
    hf_export.save_pretrained(params, cfg, out, dtype="bfloat16")
    assert not os.path.exists(os.path.join(out, hf_format.INDEX_FILE))
    assert os.path.exists(os.path.join(out, hf_format.SINGLE_FILE))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    # Written over an earlier sharded export: its shards and index are removed.
    hf_export.save_pretrained(params, cfg, out, max_shard_size="16KB")
    assert os.path.exists(os.path.join(out, hf_format.INDEX_FILE))
    hf_export.save_pretrained(params, cfg, out, dtype="bfloat16")
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == [hf_format.SINGLE_FILE]
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    cfg_bf16, params_bf16 = hf_import.load_pretrained(out, param_dtype=jnp.bfloat16)
    assert cfg_bf16.param_dtype == "bfloat16"
    emb = params_bf16["embed"]["embedding"]
    assert emb.dtype == jnp.bfloat16
    expected = np.asarray(params["embed"]["embedding"]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(emb), expected)


def test_bf16_checkpoint_loads_as_f32(hf_models, tmp_path):
    model, _, _ = hf_models["llama3"]
    out = str(tmp_path / "bf16_hf")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)
    cfg, params = hf_import.load_pretrained(out)
    assert params["layers"]["mlp"]["down"]["kernel"].dtype == jnp.float32
    weight = model.model.layers[1].mlp.down_proj.weight.detach()
    want = weight.to(torch.bfloat16).float().numpy().T
    np.testing.assert_array_equal(np.asarray(params["layers"]["mlp"]["down"]["kernel"][1]), want)


def test_sharded_load_streams_device_slices(hf_models, monkeypatch, tmp_path):
    """On a 2x2x2 mesh every leaf is sharded by the rules, each read covers one device's
    slice only (never a whole stacked tensor), replicas are not re-read, and the values equal
    a plain load."""
    _, _, sharded_dir = hf_models["qwen2_untied"]
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    reads = []
    real = hf_import._read_slice

    def spy(ckpt, entries, index, dtype):
        out = real(ckpt, entries, index, dtype)
        reads.append((entries[0].path, out.shape))
        return out

    monkeypatch.setattr(hf_import, "_read_slice", spy)
    cfg, params = hf_import.load_pretrained(sharded_dir, mesh=mesh)
    monkeypatch.undo()
    _, plain = hf_import.load_pretrained(sharded_dir)

    expected = sharding.param_shardings(params, mesh)
    for (path, leaf), want, ref in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(expected),
        jax.tree.leaves(plain),
    ):
        assert leaf.sharding.spec == want.spec, sharding.path_str(path)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))
    # e.g. q kernel [L, D, H*Dh] = [2, 32, 32] is P(None, fsdp, tensor): each read [2, 16, 16].
    q_reads = [shape for path, shape in reads if path == ("layers", "attn", "q", "kernel")]
    assert q_reads == [(2, 16, 16)] * 4  # 4 distinct slices, each read once for 8 devices
    emb_reads = {shape for path, shape in reads if path == ("embed", "embedding")}
    assert emb_reads == {(48, 16)}  # [V, D] = [96, 32] on (tensor, fsdp)

    # Exporting the sharded params gathers them back to the same checkpoint.
    hf_export.save_pretrained(params, cfg, str(tmp_path / "from_mesh"), max_shard_size="20KB")
    _, again = hf_import.load_pretrained(str(tmp_path / "from_mesh"))
    jax.tree.map(np.testing.assert_array_equal, plain, again)


def test_tied_checkpoint_with_lm_head_present(hf_models, tmp_path):
    """Some tied checkpoints still store lm_head.weight: accepted and ignored."""
    _, single, _ = hf_models["qwen2_tied"]
    out = tmp_path / "tied_with_head"
    shutil.copytree(single, out)
    tensors = safetensors.numpy.load_file(str(out / hf_format.SINGLE_FILE))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    safetensors.numpy.save_file(
        tensors, str(out / hf_format.SINGLE_FILE), metadata={"format": "pt"}
    )
    cfg, params = hf_import.load_pretrained(str(out))
    assert cfg.tie_word_embeddings and "lm_head" not in params


def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    path = os.path.join(dst, hf_format.SINGLE_FILE)
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def test_bad_checkpoint_lists_every_problem(hf_models, tmp_path):
    _, single, _ = hf_models["qwen2_untied"]

    def edit(t):
        del t["model.layers.1.self_attn.k_proj.bias"]
        del t["lm_head.weight"]
        t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)

    path = _broken_copy(single, tmp_path / "broken", edit)
    with pytest.raises(ValueError) as err:
        hf_import.load_pretrained(path)
    msg = str(err.value)
    assert "nothing was loaded" in msg
    assert "missing tensors (2): ['lm_head.weight', 'model.layers.1.self_attn.k_proj.bias']" in msg
    assert "unexpected tensors (1): ['model.layers.0.mlp.extra_proj.weight']" in msg
    assert "model.layers.0.mlp.up_proj.weight: checkpoint (64, 31), config expects (64, 32)" in msg


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.norm.weight"), r"missing tensors \(1\): \['model.norm.weight'\]"),
        (
            lambda t: t.update(bonus=np.zeros(3, np.float32)),
            r"unexpected tensors \(1\): \['bonus'\]",
        ),
        (
            lambda t: t.update({"model.embed_tokens.weight": np.zeros((97, 32), np.float32)}),
            r"model.embed_tokens.weight: checkpoint \(97, 32\), config expects \(96, 32\)",
        ),
    ],
)
def test_bad_checkpoint_single_problem(hf_models, tmp_path, edit, match):
    _, single, _ = hf_models["llama3"]
    path = _broken_copy(single, tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=match):
        hf_import.load_pretrained(path)


def test_untied_config_without_head_is_missing(hf_models, tmp_path):
    _, single, _ = hf_models["qwen2_tied"]
    out = tmp_path / "untied"
    shutil.copytree(single, out)
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing tensors \(1\): \['lm_head.weight'\]"):
        hf_import.load_pretrained(str(out))


def test_bad_index_and_missing_weights(hf_models, tmp_path):
    _, _, sharded_dir = hf_models["qwen2_tied"]
    out = tmp_path / "index"
    shutil.copytree(sharded_dir, out)
    shard = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))[-1]
    os.remove(out / shard)
    with pytest.raises(FileNotFoundError, match=f"shard files that do not exist: \\['{shard}'\\]"):
        hf_import.load_pretrained(str(out))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(out / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        hf_import.load_pretrained(str(empty))


def test_unsupported_model_type(hf_models, tmp_path):
    _, single, _ = hf_models["llama3"]
    out = tmp_path / "mistral"
    shutil.copytree(single, out)
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = "mistral"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model_type 'mistral'.*'qwen2', 'llama'"):
        hf_import.load_pretrained(str(out))


def test_mesh_not_dividing_model_fails_before_reading(hf_models, tmp_path, monkeypatch):
    _, single, _ = hf_models["qwen2_untied"]  # K=2 kv heads
    mesh = sharding.make_mesh({"tensor": 4, "data": 2})

    def no_reading(*a, **k):
        raise AssertionError("weights were opened before the mesh was validated")

    monkeypatch.setattr(hf_import, "Checkpoint", no_reading)
    with pytest.raises(
        ValueError, match=r"ModelConfig.num_kv_heads=2 is not divisible by mesh axis"
    ):
        hf_import.load_pretrained(single, mesh=mesh)


def test_missing_path_and_offline_hub_id(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_import.load_pretrained(str(tmp_path / "nope" / "model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    with pytest.raises(FileNotFoundError, match="hub id failed \\(HF_HUB_OFFLINE is set\\)"):
        hf_import.load_pretrained("gjax-test-org/no-such-model")


def _tiny_tokenizer(directory):
    """A byte-level BPE tokenizer (the Qwen2/Llama-3 kind), trained on a few sentences."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    corpus = ["the answer is four", "two plus two is four", "five plus one is six"] * 5
    bpe.train_from_iterator(
        corpus, vocab_size=300, min_frequency=1, special_tokens=["<eos>"], show_progress=False
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<eos>", pad_token="<eos>"
    )
    fast.save_pretrained(directory)
    return fast


def test_tokenizer_and_gcs_round_trip(hf_models, gcs, tmp_path, monkeypatch):
    """Export to gs:// (a GCS emulator) with tokenizer files, load weights and tokenizer back."""
    fs, _ = gcs
    model, single, _ = hf_models["qwen2_tied"]
    tok_dir = str(tmp_path / "tok")
    fast = _tiny_tokenizer(tok_dir)
    tok = hf_import.load_tokenizer(tok_dir)
    assert tok("the answer is four")["input_ids"] == fast("the answer is four")["input_ids"]

    monkeypatch.setenv("GJAX_CACHE", str(tmp_path / "cache"))
    cfg, params = hf_import.load_pretrained(single)
    hf_export.save_pretrained(params, cfg, "gs://bucket/run/step_1", tokenizer=tok_dir)
    uploaded = {p.rsplit("/", 1)[1] for p in fs.ls("bucket/run/step_1", refresh=True)}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= uploaded

    cfg2, params2 = hf_import.load_pretrained("gs://bucket/run/step_1")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    cached = tmp_path / "cache" / "remote" / "gs" / "bucket" / "run" / "step_1"
    assert os.path.isdir(cached)
    # Re-exported as shards to the same URL: the cache follows (old single file dropped).
    hf_export.save_pretrained(params, cfg, "gs://bucket/run/step_1", max_shard_size="16KB")
    _, params3 = hf_import.load_pretrained("gs://bucket/run/step_1")
    jax.tree.map(np.testing.assert_array_equal, params, params3)
    assert hf_format.SINGLE_FILE not in os.listdir(cached)
    assert hf_format.INDEX_FILE in os.listdir(cached)
    tok2 = hf_import.load_tokenizer("gs://bucket/run/step_1")
    assert tok2("five plus one")["input_ids"] == fast("five plus one")["input_ids"]
    # A tokenizer object works too, and transformers reads the export's tokenizer.
    out = str(tmp_path / "with_tok_object")
    hf_export.save_pretrained(params, cfg, out, tokenizer=tok)
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "<eos>"


def test_save_rejects_params_not_matching_config(hf_models, tmp_path):
    _, single, _ = hf_models["qwen2_untied"]
    cfg, params = hf_import.load_pretrained(single)
    params = dict(params)
    del params["lm_head"]
    with pytest.raises(ValueError, match="missing lm_head/kernel"):
        hf_export.save_pretrained(params, cfg, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="bad max_shard_size"):
        hf_export.save_pretrained(
            params, cfg.replace(tie_word_embeddings=True), str(tmp_path), max_shard_size="lots"
        )


def test_param_shapes_match_model():
    for model_type, tie, bias in [
        ("qwen2", True, True),
        ("qwen2", False, True),
        ("llama", False, False),
        ("llama", True, True),
        ("qwen3", True, False),
        ("qwen3", False, True),
    ]:
        cfg = ModelConfig(
            model_type=model_type,
            vocab_size=40,
            hidden_size=16,
            intermediate_size=24,
            num_layers=3,
            num_heads=4,
            num_kv_heads=1,
            head_dim=6,
            tie_word_embeddings=tie,
            attention_bias=bias,
        )
        shapes = hf_format.param_shapes(cfg)
        assert ("bias" in shapes["layers"]["attn"]["o"]) == (model_type != "qwen2" and bias)
        assert ("q_norm" in shapes["layers"]["attn"]) == (model_type == "qwen3")
        abstract = jax.tree.map(lambda a: a.shape, T.abstract_params(cfg))
        assert shapes == abstract


def test_export_over_the_loaded_checkpoint(hf_models, tmp_path):
    """Loaded params do not alias the files: re-exporting into the source dir is safe."""
    _, single, _ = hf_models["llama3"]
    src = str(tmp_path / "inplace")
    shutil.copytree(single, src)
    cfg, params = hf_import.load_pretrained(src)
    snapshot = jax.tree.map(np.array, params)
    hf_export.save_pretrained(params, cfg, src, max_shard_size="16KB")
    jax.tree.map(np.testing.assert_array_equal, snapshot, params)
    _, again = hf_import.load_pretrained(src)
    jax.tree.map(np.testing.assert_array_equal, snapshot, again)
