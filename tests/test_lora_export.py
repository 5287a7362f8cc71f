"""`python -m gjax.export` of a LoRA run: merged weights for transformers, or a PEFT adapter
directory for `peft.PeftModel.from_pretrained(base, dir)`, each with gjax's logits.

The workdir is built as `gjax.train` leaves a LoRA run (run `config.json`, the `model/`
record, checkpoints of adapters + Adam state whose meta fingerprint records the LoRA
settings and the base's digest), the base loaded and the digest taken on the suite's 8 CPU
devices as the trainer does, the adapters random (A and B both nonzero, so the exported
models differ from the base). The export loads that base again from `model.path`.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from configs import grpo  # noqa: E402
from gjax import cli, export, model_record, sharding  # noqa: E402
from gjax.checkpoint import Checkpointer  # noqa: E402
from gjax.learner import TrainState, make_optimizer  # noqa: E402
from gjax.models import hf_export, hf_import, lora  # noqa: E402
from gjax.models import transformer as T  # noqa: E402
from gjax.train import fingerprint  # noqa: E402
from tests.test_export import EMBEDDED, TOL, make_workdir, run_export  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.path.join(ROOT, "tests", "data", "tiny_qwen3")
BASES = {"qwen2": EMBEDDED, "qwen3": QWEN3}

pytestmark = pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built")

_forward = jax.jit(T.forward, static_argnums=1, static_argnames="return_logits")


def make_lora_workdir(
    tmp_path, base_src, *, rank=4, alpha=8.0, targets="q,k,v,o,gate,up,down", model_path=None
):
    """A LoRA run's workdir (checkpoint at step 3) over a copy of `base_src` (its
    `model.path`, unless `model_path` names another copy); returns (workdir, base dir, lora
    cfg, the policy's whole tree on the host)."""
    base_dir = tmp_path / "base"
    shutil.copytree(base_src, base_dir)
    config = grpo.get_config("tiny")
    with config.unlocked():
        config.model.path = model_path or str(base_dir)
        config.model.lora.rank = rank
        config.model.lora.alpha = alpha
        config.model.lora.targets = targets
    workdir = tmp_path / "run"
    os.makedirs(workdir)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    mesh = sharding.make_mesh({"fsdp": -1})  # the base sharded as a run holds it
    cfg, params, _ = hf_import.load_policy(str(base_dir), config.model, mesh)
    model_record.save(str(workdir), cfg, str(base_dir))
    lora_cfg, frozen, adapters = lora.attach(
        cfg, params, config.model.lora, mesh, jax.random.key(0)
    )
    # Trained adapters: B moved off zero (and A off its init) as a few updates would.
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = jax.tree.unflatten(
        treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )
    tx, _ = make_optimizer(config.optim, config.train.steps)
    state = TrainState(step=jnp.asarray(3, jnp.int32), params=adapters, opt_state=tx.init(adapters))
    meta = {
        "data": None,
        "history": [],
        "fingerprint": fingerprint(config, lora.base_digest(frozen)),
    }
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    ckpt.save(3, state, meta, force=True)
    ckpt.close()
    return workdir, base_dir, lora_cfg, jax.device_get(lora.merge(frozen, adapters))


def _batch(vocab):
    """Two rows of token ids, the second left-padded: tokens, mask, positions ([2, 12])."""
    tokens = np.random.default_rng(0).integers(2, vocab, (2, 12))
    mask = np.ones_like(tokens)
    mask[1, :5] = 0
    tokens[1, :5] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, mask, positions


def _torch_logits(model, batch):
    tokens, mask, positions = batch
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()


def _gjax_logits(params, cfg, batch):
    tokens, mask, positions = (jnp.asarray(x, jnp.int32) for x in batch)
    return np.asarray(_forward(params, cfg, tokens, positions, mask, return_logits=True)[1])


def _max_diff(a, b, batch):
    return float(np.abs(a - b)[batch[1].astype(bool)].max())


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", sorted(BASES))
def test_merged_and_peft_exports_give_the_lora_policys_logits(tmp_path, arch):
    wd, base_dir, cfg, policy = make_lora_workdir(tmp_path, BASES[arch])
    batch = _batch(cfg.vocab_size)
    ours = _gjax_logits(policy, cfg, batch)  # the low-rank form, as training computes it
    base_model = _load(base_dir)
    base_logits = _torch_logits(base_model, batch)
    # The adapters matter: a test that would pass on the base alone cannot pass here.
    assert _max_diff(base_logits, ours, batch) > 100 * TOL

    # (a) merged: a plain checkpoint of the base architecture.
    assert export.export(str(wd), str(tmp_path / "merged")) == 3
    hf_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert (
        hf_config["architectures"]
        == json.loads((base_dir / "config.json").read_text())["architectures"]
    )
    assert _max_diff(_torch_logits(_load(tmp_path / "merged"), batch), ours, batch) <= TOL

    # (b) PEFT: the adapters alone, on the base transformers loads.
    peft_dir = tmp_path / "adapter"
    if arch == "qwen2":  # the CLI flag once
        proc = run_export(tmp_path, f"--workdir={wd}", f"--out={peft_dir}", "--format=peft")
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert export.export(str(wd), str(peft_dir), format="peft") == 3
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
        os.listdir(peft_dir)
    )
    adapter_config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir)
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.k_proj.lora_{}.weight"
    kv_out = cfg.num_kv_heads * cfg.head_dim
    assert tensors[name.format("A")].shape == (4, cfg.hidden_size)  # [r, in]
    assert tensors[name.format("B")].shape == (kv_out, 4)  # [out, r]
    np.testing.assert_array_equal(
        tensors[name.format("B")], np.asarray(policy["layers"]["attn"]["k"]["lora_b"][1]).T
    )
    model = peft.PeftModel.from_pretrained(base_model, str(peft_dir)).eval()
    assert _max_diff(_torch_logits(model, batch), ours, batch) <= TOL


def test_peft_export_of_some_targets_in_bfloat16(tmp_path):
    """Only the adapted projections are listed; --dtype applies to the adapter tensors."""
    wd, base_dir, cfg, _ = make_lora_workdir(
        tmp_path, EMBEDDED, rank=2, alpha=16.0, targets="v,down"
    )
    export.export(str(wd), str(tmp_path / "adapter"), format="peft", dtype="bfloat16")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == ["self_attn.v_proj", "mlp.down_proj"]
    assert adapter_config["peft_type"] == "LORA" and adapter_config["task_type"] == "CAUSAL_LM"
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * cfg.num_layers
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    assert list(tensors) == [n for n, *_ in hf_export.peft_tensor_names(cfg)]
    model = peft.PeftModel.from_pretrained(_load(base_dir), str(tmp_path / "adapter"))
    assert model.base_model.model.model.layers[0].mlp.down_proj.scaling == {"default": 8.0}


def test_export_refuses_a_changed_base_and_peft_of_a_full_run(tmp_path):
    wd, base_dir, _, _ = make_lora_workdir(tmp_path, EMBEDDED)
    ckpt = Checkpointer(os.path.join(wd, "checkpoints"), async_save=False)
    recorded = ckpt.restore_meta()[1]["fingerprint"]["model.base_digest"]
    ckpt.close()
    weights = load_file(base_dir / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = (weights[name] + np.float32(1e-3)).astype(weights[name].dtype)
    save_file(weights, base_dir / "model.safetensors", metadata={"format": "pt"})
    for fmt in ("hf", "peft"):
        with pytest.raises(model_record.RecordError) as err:
            export.export(str(wd), str(tmp_path / fmt), format=fmt)
        text = " ".join(cli.format_user_error(err.value).split())
        assert f"the base model at model.path={base_dir} is not the one" in text
        assert "its content digest is " in text and "the checkpoint recorded " in text
        assert f"the checkpoint recorded {recorded}" in text
        assert not (tmp_path / fmt).exists()  # nothing written
    # The base gone: one paragraph naming the path.
    shutil.rmtree(base_dir)
    with pytest.raises(model_record.RecordError, match=f"model.path={base_dir}"):
        export.export(str(wd), str(tmp_path / "hf"))

    make_workdir(tmp_path / "full")  # full fine-tuning: nothing to write as an adapter
    with pytest.raises(model_record.RecordError, match="model.lora.rank=0"):
        export.export(str(tmp_path / "full"), str(tmp_path / "x"), format="peft")
    with pytest.raises(model_record.RecordError, match="not an export format"):
        export.export(str(tmp_path / "full"), str(tmp_path / "x"), format="gguf")


def test_peft_export_with_the_base_and_the_output_on_gcs(gcs, tmp_path):
    fs, _ = gcs
    fs.put(EMBEDDED, "bucket/base", recursive=True)
    wd, base_dir, cfg, policy = make_lora_workdir(tmp_path, EMBEDDED, model_path="gs://bucket/base")
    assert export.export(str(wd), "gs://bucket/adapter", format="peft") == 3
    fs.invalidate_cache()
    fs.get("bucket/adapter", str(tmp_path / "adapter"), recursive=True)
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "gs://bucket/base"
    batch = _batch(cfg.vocab_size)
    model = peft.PeftModel.from_pretrained(_load(base_dir), str(tmp_path / "adapter")).eval()
    assert _max_diff(_torch_logits(model, batch), _gjax_logits(policy, cfg, batch), batch) <= TOL
