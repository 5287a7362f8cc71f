"""LoRA end to end on the embedded policy: the reference is the base (no copy), checkpoints
hold adapters only, a resume is bit-identical, a changed rank or base is refused by name.

In this process (`gjax.train.train`), on the suite's 8 CPU devices; slow (each run compiles
the sampler, the log-prob passes and the update), so marked `slow`; CI still runs them.
"""

import json
import os
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gjax import learner as learner_lib
from gjax import model_record, sharding
from gjax.checkpoint import CheckpointError
from gjax.errors import ConfigError
from gjax.models import lora
from tests.test_train_e2e import EMBEDDED, rows, small_config, stable
from tests.user_env import PYTHONPATH as USER_PATH

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built"),
]


def lora_config(model_path, steps=2, rank=4):
    c = small_config("grpo")
    c.model.path = str(model_path)
    c.model.lora.rank = rank
    c.model.lora.alpha = 8.0
    c.train.steps = steps
    c.checkpoint.every = 1
    c.objective.kl_beta = 0.04  # the reference pass runs
    c.eval.num_samples = 0  # greedy held-out only: fewer compiles
    return c


def saved_state(step_dir):
    """A checkpoint's saved train state, as numpy arrays (orbax reads it without a target)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as reader:
        return reader.restore(os.path.abspath(step_dir / "state"))


def test_lora_run_reference_checkpoint_resume_and_refusals(tmp_path, monkeypatch, capsys):
    from gjax.train import train

    base_dir = tmp_path / "base"
    shutil.copytree(EMBEDDED, base_dir)
    seen = []  # (reference leaves' buffers, the policy's base leaves' buffers) per step
    original = learner_lib.Learner.batch

    def buffers(tree):
        return [
            [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
            for x in jax.tree.leaves(tree)
        ]

    def spy(self, groups, params, ref_params):
        extra = len(jax.tree.leaves(params)) - len(jax.tree.leaves(self.frozen))
        seen.append((buffers(ref_params), buffers(self.frozen), extra))
        return original(self, groups, params, ref_params)

    monkeypatch.setattr(learner_lib.Learner, "batch", spy)
    wd = tmp_path / "run"
    assert train(lora_config(base_dir), str(wd)) is None
    got = rows(wd)
    assert [r["step"] for r in got] == [1, 2]
    # The reference is the frozen base itself: the same buffers, no second copy; the policy
    # it scores against is that base plus 2 adapters on each of 7 projections.
    assert len(seen) == 2 and all(ref == base for ref, base, _ in seen)
    assert all(extra == 14 for _, _, extra in seen)
    assert got[0]["policy/ref_kl"] == 0.0  # B = 0: the first policy is the base
    assert got[1]["policy/ref_kl"] > 0.0  # the trained adapters moved it away

    # Checkpoints hold the adapters and their optimizer state, not the base (~1.8 MB of f32
    # weights in the embedded policy vs a few hundred KB of rank-4 adapters and Adam moments).
    state_bytes = sum(
        f.stat().st_size for f in (wd / "checkpoints" / "2" / "state").rglob("*") if f.is_file()
    )
    base_bytes = (base_dir / "model.safetensors").stat().st_size
    assert state_bytes < base_bytes / 2, (state_bytes, base_bytes)

    # Resume from step 1: step 2 again, bit for bit (metrics and saved adapters).
    final = tmp_path / "final"
    shutil.copytree(wd / "checkpoints" / "2", final)
    shutil.rmtree(wd / "checkpoints" / "2")
    assert train(lora_config(base_dir), str(wd)) is None
    assert [stable(r) for r in rows(wd)] == [stable(r) for r in got]
    want, again = (saved_state(p) for p in (final, wd / "checkpoints" / "2"))
    assert jax.tree.structure(want) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adapters = want["params"]["layers"]
    assert set(adapters["attn"]) == {"q", "k", "v", "o"} and set(adapters["mlp"]) == {
        "gate",
        "up",
        "down",
    }
    assert all(set(p) == {"lora_a", "lora_b"} for g in adapters.values() for p in g.values())

    # The export (gjax.export) reads this run's own checkpoint: its base digest matches the
    # base it loads again, and the PEFT tensors are the saved adapters, transposed.
    from gjax import export

    export.export(str(wd), str(tmp_path / "adapter"), format="peft")
    peft_b = load_file(tmp_path / "adapter" / "adapter_model.safetensors")[
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    ]
    np.testing.assert_array_equal(peft_b, np.asarray(adapters["mlp"]["up"]["lora_b"][1]).T)

    # gjax.eval on the LoRA run: the base from its model.path plus the saved adapters.
    from gjax import eval as ev

    F = SimpleNamespace(checkpoint=str(wd), step=None, model=None, dtype=None)
    mesh_for = lambda run: sharding.make_mesh({"data": -1})  # all 8 devices, as a user's
    policy = ev._load_policy(F, mesh_for)
    assert (policy.step, policy.cfg.lora_rank) == (2, 4)
    for a, b in zip(jax.tree.leaves(lora.split(policy.params)[1]), jax.tree.leaves(want["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # The studies' pass@k of a LoRA run: the base and the saved adapters, not the base alone.
    from experiments import passk

    got_passk = passk.evaluate(
        lora_config(base_dir), str(wd), num_samples=2, cache_dir=str(tmp_path / "passk")
    )
    assert got_passk["step"] == 2 and got_passk["problems"] == 16

    # Another rank on resume, or none: refused by name, before anything loads.
    for rank in (8, 0):
        with pytest.raises(ConfigError, match=f"model.lora.rank: 4 -> {rank}"):
            train(lora_config(base_dir, steps=3, rank=rank), str(wd))
    # The same path with other weights in it: refused by the base's digest.
    weights = load_file(base_dir / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = (weights[name] + np.float32(1e-3)).astype(weights[name].dtype)
    save_file(weights, base_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.base_digest"):
        train(lora_config(base_dir, steps=3), str(wd))
    with pytest.raises(model_record.RecordError, match="is not the one the LoRA adapters"):
        export.export(str(wd), str(tmp_path / "merged"))
    assert [r["step"] for r in rows(wd)] == [1, 2]  # nothing written by the refused runs
    capsys.readouterr()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rank", -1, "model.lora.rank=-1 is out of range"),
        ("targets", "q,qkv", "names no module: \\['qkv'\\]"),
        ("targets", "", "is empty, so rank 4 adapts nothing"),
        ("dtype", "int8", "model.lora.dtype: must be one of"),
    ],
)
def test_bad_lora_settings_are_one_paragraph_before_anything_loads(field, value, message, tmp_path):
    from gjax.train import train

    c = lora_config(EMBEDDED)
    c.model.lora[field] = value
    with pytest.raises(ConfigError, match=message):
        train(c, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()  # nothing written


@pytest.mark.parametrize("transfer", ["directory", "grpc"])
def test_lora_run_pushes_only_adapters_to_a_gjax_serve_replica(tmp_path, transfer):
    """rollout.backend=jetstream_grpc with LoRA: a real `gjax.serve` on 127.0.0.1 (its own
    load of the base, the run's model.lora) is pushed only the adapters each step (through
    the push directory or streamed), and serves each version before the step's rollouts (the
    trainer waits for it)."""
    import subprocess
    import sys

    import orbax.checkpoint as ocp

    from gjax.rollout import handoff, weight_push
    from gjax.train import train
    from tests.test_jetstream_grpc import _ENV, _free_port, _stop

    wd, port = tmp_path / "run", _free_port()
    c = lora_config(EMBEDDED)
    c.rollout.backend = "jetstream_grpc"
    c.rollout.server_address = f"127.0.0.1:{port}"
    c.rollout.weight_transfer = transfer
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gjax.serve",
            "--config=configs/grpo.py:tiny",
            f"--config.model.path={EMBEDDED}",
            "--config.model.lora.rank=4",
            "--config.model.lora.alpha=8.0",
            f"--config.rollout.server_address=127.0.0.1:{port}",
            f"--workdir={wd}",
        ],
        env={**os.environ, "PYTHONPATH": USER_PATH, **_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "gjax.serve: ready" in line or len(lines) > 400:
                break
        assert "gjax.serve: ready" in lines[-1], "".join(lines[-30:])
        assert train(c, str(wd)) is None
    finally:
        _stop(proc)
        lines.extend(proc.stdout)
    got = rows(wd)
    assert [r["rollout/policy_version"] for r in got] == [1, 2]
    # The trained adapters (f32, as the server holds them): what each push carries.
    trained = saved_state(wd / "checkpoints" / "2")["params"]
    adapter_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(trained))
    push = wd / "push"
    if transfer == "directory":
        assert weight_push.latest_version(push) == weight_push.served_version(push) == 2
        version = weight_push.version_dir(push, 2)
        record = json.loads((version / handoff.ADAPTER_META).read_text())
        assert {k: record[k] for k in ("rank", "alpha")} == {"rank": 4, "alpha": 8.0}
        with ocp.StandardCheckpointer() as reader:
            saved = reader.restore(os.path.abspath(version))
        leaves = jax.tree_util.tree_leaves_with_path(saved)
        assert len(leaves) == 14 and all(p[-1].key in ("lora_a", "lora_b") for p, _ in leaves)
        assert sum(np.asarray(x).nbytes for _, x in leaves) == adapter_bytes
    else:
        assert weight_push.latest_version(push) is None  # streamed: no fallback was needed
    assert all(r["rollout/push_bytes"] == adapter_bytes for r in got), got
    base_bytes = os.path.getsize(os.path.join(EMBEDDED, "model.safetensors"))
    assert adapter_bytes < base_bytes / 4, (adapter_bytes, base_bytes)
    log = "".join(lines)
    assert "serving policy version 2" in log and "refused" not in log, log[-3000:]


def test_qlora_run_reports_the_sampler_learner_mismatch_and_corrects_it(tmp_path):
    """An int8 base: the learner recomputes old log-probs (its low-rank forward over the
    dequantized codes), the sampler's go along as behaviour log-probs, and the mismatch
    metrics and the TIS correction act on their difference."""
    from gjax.train import train

    c = lora_config(EMBEDDED)
    c.model.lora.quantize = "int8"
    c.rollout.recompute_old_logps = True
    c.objective.behaviour_correction = "tis"
    assert train(c, str(tmp_path / "qlora")) is None
    got = rows(tmp_path / "qlora")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert 0.0 <= r["mismatch/abs_logp_diff_mean"] <= r["mismatch/abs_logp_diff_max"] < 0.1
        assert "correction/capped_frac" in r
        assert np.isfinite(r["loss/total"])


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(rank=0, quantize="int8"), "without LoRA nothing would train"),
        (dict(quantize="fp8"), "model.lora.quantize: must be one of"),
        (dict(quantize="nf4", no_qwix=True), "needs the qwix package"),
    ],
)
def test_bad_qlora_settings_are_one_paragraph(settings, message, tmp_path, monkeypatch):
    from gjax.models import quant
    from gjax.train import train

    if settings.pop("no_qwix", False):
        monkeypatch.setattr(quant, "available", lambda: False)
    c = lora_config(EMBEDDED)
    for k, v in settings.items():
        c.model.lora[k] = v
    with pytest.raises(ConfigError, match=message):
        train(c, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
