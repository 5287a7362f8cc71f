"""Attention implementations (gjax.models.attention) against the dense XLA reference.

The Pallas kernels run here with `interpret=True` (their GPU / TPU lowering is the same
kernel); cuDNN cannot run on CPU, so its call (layout, mask, GQA) is checked through
`jax.nn.dot_product_attention`'s XLA backend, and its selection is checked on its own.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.errors import ConfigError
from gjax.models import attention
from gjax.models.config import ModelConfig
from gjax.models.transformer import abstract_params, forward, prefill

B, T, H, K, DH = 2, 40, 4, 2, 16
# Row 0: three packed segments then padding; row 1: left and right padding around one.
SEG_BxT = np.array(
    [[1] * 10 + [2] * 17 + [3] * 5 + [0] * 8, [0] * 3 + [1] * 30 + [0] * 7], np.int32
)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, DH), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, K, DH), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, K, DH), jnp.float32)
    w = jax.random.normal(keys[3], (B, T, H, DH), jnp.float32)
    return q, k, v, w


def _reference(q, k, v, seg):
    return attention.xla(q, k, v, attention.dense_mask(seg))


def _assert_matches_reference(got, grads, q, k, v, w, seg):
    """`got` (output) and `grads` (d(q, k, v) of sum(out * w) at the real positions) equal the
    XLA reference's, f32; padding queries' outputs are unspecified and carry no weight."""
    real = (seg != 0)[:, :, None, None]
    want = _reference(q, k, v, seg)
    assert got.shape == want.shape
    np.testing.assert_allclose(
        np.where(real, got, 0.0), np.where(real, want, 0.0), atol=2e-6, rtol=2e-6
    )

    def loss(q, k, v):
        return jnp.sum(jnp.where(real, _reference(q, k, v, seg) * w, 0.0))

    for g, gw in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(g, gw, atol=1e-5, rtol=1e-5)


IMPLS = {
    "pallas_gpu": lambda q, k, v, s: attention.pallas_gpu(q, k, v, s, block=16, interpret=True),
    "splash": lambda q, k, v, s: attention.splash(q, k, v, s, interpret=True),
    "cudnn_call": lambda q, k, v, s: attention.cudnn(q, k, v, s, backend="xla"),
    # Causal query chunks: 4 of 10 (the default), 3 uneven ones (13, 13, 14).
    "xla_blocked": lambda q, k, v, s: attention.xla_blocked(q, k, v, attention.dense_mask(s)),
    "xla_blocked_3": lambda q, k, v, s: attention.xla_blocked(
        q, k, v, attention.dense_mask(s), blocks=3
    ),
}


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_kernel_equals_xla_reference_forward_and_grad(name):
    """Packed segments, padding, GQA; f32; outputs and d(q, k, v) at the real positions."""
    q, k, v, w = _inputs()
    seg = jnp.asarray(SEG_BxT)
    real = (seg != 0)[:, :, None, None]

    def loss(q, k, v):
        return jnp.sum(jnp.where(real, IMPLS[name](q, k, v, seg) * w, 0.0))

    got = jax.jit(IMPLS[name])(q, k, v, seg)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    _assert_matches_reference(got, grads, q, k, v, w, seg)


def test_resolve_chooses_per_platform_and_refuses_the_wrong_one():
    assert [attention.resolve("auto", p) for p in ("cpu", "gpu", "tpu")] == [
        "xla",
        "pallas_gpu",
        "splash",
    ]
    for name in ("xla", "cudnn", "pallas_gpu"):
        assert attention.resolve(name, "gpu") == name
    assert attention.resolve("splash", "tpu") == "splash"
    assert attention.resolve("xla", "tpu") == "xla"
    assert [attention.resolve("xla_blocked", p) for p in ("cpu", "gpu")] == ["xla_blocked"] * 2
    assert attention.resolve("cudnn", "gpu", "bfloat16") == "cudnn"
    with pytest.raises(ConfigError, match="model.dtype='bfloat16'"):  # was: a traceback
        attention.resolve("cudnn", "gpu", "float32")  # at the first forward
    for name, platform in (("splash", "cpu"), ("splash", "gpu"), ("pallas_gpu", "tpu")):
        with pytest.raises(ConfigError, match="runs only on"):
            attention.resolve(name, platform)
    with pytest.raises(ConfigError, match="not an attention implementation"):
        attention.resolve("flash", "gpu")
    with pytest.raises(ValueError, match="unknown attention"):
        ModelConfig(
            model_type="qwen2",
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
            attention="flash",
        )


def test_transformer_reads_the_config():
    """The forward resolves `cfg.attention` when traced: a GPU kernel is refused on CPU."""
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
    )
    params = abstract_params(cfg)
    tokens = jnp.ones((1, 6), jnp.int32)
    seg = jnp.array([[1, 1, 1, 2, 2, 0]], jnp.int32)

    def run(name):
        c = cfg.replace(attention=name)
        return jax.eval_shape(lambda p: forward(p, c, tokens, tokens, seg), params)

    assert run("auto").shape == run("xla").shape == run("xla_blocked").shape == (1, 6, 16)
    for name in ("pallas_gpu", "splash", "cudnn"):
        with pytest.raises(ConfigError, match="runs only on"):
            run(name)


def test_prefill_runs_the_forward_implementation(monkeypatch):
    """`transformer.prefill` (the samplers' and the engine's) attends through `attend` with the
    implementation the forward resolves and its layer input (here cudnn's: segment ids; its
    call runs on jax's XLA backend, as `cudnn_call` above)."""
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=1,
        num_heads=H, num_kv_heads=K, head_dim=8, attention="xla",
    )  # fmt: skip
    params = jax.tree.map(
        lambda x: 0.2 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), abstract_params(cfg)
    )
    cfg = cfg.replace(attention="cudnn")
    seg = jnp.asarray(SEG_BxT)
    tokens = jax.random.randint(jax.random.key(2), seg.shape, 0, 32)
    positions = jnp.maximum(jnp.cumsum(seg != 0, axis=1) - 1, 0)
    seen, attend = [], attention.attend

    def spy(impl, q, k, v, layer_in):
        seen.append((impl, layer_in.shape))
        if impl == "cudnn":
            return attention.cudnn(q, k, v, layer_in, backend="xla")
        return attend(impl, q, k, v, layer_in)

    monkeypatch.setattr(attention, "platform_impl", lambda name: name)
    monkeypatch.setattr(attention, "attend", spy)
    want = jax.jit(forward, static_argnums=1)(params, cfg, tokens, positions, seg)
    assert set(seen) == {("cudnn", (B, T))}  # the forward's: the kernel, segment ids
    del seen[:]
    got, _, _ = jax.jit(prefill, static_argnums=1)(params, cfg, tokens, positions, seg)
    assert seen and set(seen) == {("cudnn", (B, T))}  # the prefill's: the same
    real = (seg != 0)[:, :, None]
    np.testing.assert_allclose(np.where(real, got, 0.0), np.where(real, want, 0.0), atol=1e-6)


def test_config_names_the_valid_implementations():
    from gjax import config as config_lib
    from gjax import schema

    c = schema.base()
    config_lib.check_names(c)  # the default, auto, passes
    c.model.attention = "flash"
    with pytest.raises(ConfigError, match="model.attention"):
        config_lib.check_names(c)


def _mesh_run(mesh, impl, q, k, v, w, seg):
    """(out, grads, compiled HLO texts) of the kernel under `mesh` and the default rules, its
    inputs placed as the forward's activations are."""
    from gjax import sharding

    real = (seg != 0)[:, :, None, None]

    def fn(q, k, v, seg):
        return attention.attend(impl, q, k, v, seg, interpret=True)

    def loss(q, k, v, seg):
        return jnp.sum(jnp.where(real, fn(q, k, v, seg) * w, 0.0))

    with jax.set_mesh(mesh), sharding.use_rules():
        axes = (("batch", "length", "q_heads", None),) + (
            ("batch", "length", "kv_heads", None),
        ) * 2
        args = [
            jax.device_put(x, sharding.activation_sharding(mesh, a, shape=x.shape))
            for x, a in zip((q, k, v, seg), (*axes, ("batch", "length")), strict=True)
        ]
        fwd, bwd = (
            jax.jit(f).lower(*args).compile() for f in (fn, jax.grad(loss, argnums=(0, 1, 2)))
        )
        return fwd(*args), bwd(*args), [fwd.as_text(), bwd.as_text()]


@pytest.mark.parametrize("impl", ["pallas_gpu", "splash"])
def test_kernels_run_per_shard_on_the_mesh(impl):
    """data=2, fsdp=2, tensor=2 (batch over data x fsdp, heads over tensor, GQA 4:2): packed
    rows equal the unsharded reference, forward and gradient, and the compiled forward and
    backward gather no q / k / v (without the shard_map XLA all-gathers the kernel's inputs)."""
    from gjax import sharding

    q, k, v, w = (jnp.concatenate([x, x[::-1] * 0.5]) for x in _inputs())  # B = 4 rows
    seg = jnp.asarray(np.concatenate([SEG_BxT, SEG_BxT[::-1]]))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    got, grads, texts = _mesh_run(mesh, impl, q, k, v, w, seg)
    for text in texts:
        assert "all-gather" not in text
    assert got.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
    _assert_matches_reference(got, grads, q, k, v, w, seg)


def test_kv_heads_the_tensor_axis_does_not_divide_are_repeated_to_the_query_heads():
    """tensor=4 over 4 query heads but 2 KV heads: k / v are repeated before the split (the
    fallback), still equal to the reference; the spec choice follows the rules."""
    from gjax import sharding

    abstract = jax.sharding.AbstractMesh((2, 1, 1, 4), sharding.MESH_AXES)
    spec, seg_spec, repeat = attention.shard_specs(abstract, (B, T, H, DH), K)
    assert (spec, seg_spec, repeat) == (
        jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None),
        jax.sharding.PartitionSpec(("data", "fsdp"), None),
        True,
    )
    abstract2 = jax.sharding.AbstractMesh((2, 2, 1, 2), sharding.MESH_AXES)
    assert not attention.shard_specs(abstract2, (4, T, H, DH), K)[2]
    with sharding.use_rules({**sharding.DEFAULT_RULES, "kv_heads": None}):
        assert attention.shard_specs(abstract2, (4, T, H, DH), K)[2]  # kv replicated: repeat
    with sharding.use_rules({**sharding.DEFAULT_RULES, "q_heads": None, "kv_heads": None}):
        spec, _, repeat = attention.shard_specs(abstract2, (3, T, H, DH), K)
        assert spec == jax.sharding.PartitionSpec(None, None, None, None) and not repeat

    q, k, v, w = _inputs()
    seg = jnp.asarray(SEG_BxT)
    mesh = sharding.make_mesh({"data": 2, "tensor": 4})
    got, grads, _ = _mesh_run(mesh, "pallas_gpu", q, k, v, w, seg)
    _assert_matches_reference(got, grads, q, k, v, w, seg)


def test_model_forward_runs_the_kernel_alone_and_per_shard(monkeypatch):
    """The whole forward (a scanned layer) with splash (interpret mode: the platform is faked,
    CPU has no TPU), on one device and on a data=2, fsdp=2, tensor=2 mesh, equals the XLA
    forward, hidden states and every parameter gradient, on packed rows; on the mesh no
    rank-4 array (q / k / v, scores) is all-gathered. One device: the kernel's mask tables are
    built outside the trace (they leaked out of flax's scan before)."""
    from gjax import sharding

    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_layers=1,
        num_heads=H,
        num_kv_heads=K,
        head_dim=DH,
    )
    params = jax.tree.map(
        lambda x: 0.2 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), abstract_params(cfg)
    )
    seg = jnp.asarray(np.concatenate([SEG_BxT, SEG_BxT[::-1]]))
    tokens = jax.random.randint(jax.random.key(2), seg.shape, 0, 32)
    positions = jnp.tile(jnp.arange(T), (4, 1))
    w = jax.random.normal(jax.random.key(3), (*seg.shape, 32))
    real = (seg != 0)[:, :, None]

    def loss(p, c):
        hidden = forward(p, c, tokens, positions, seg)
        return jnp.sum(jnp.where(real, hidden * w, 0.0)), hidden

    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, want), grads_want = run(params, cfg)
    attend = attention.attend
    monkeypatch.setattr(attention, "platform_impl", lambda name: "splash")
    monkeypatch.setattr(attention, "attend", lambda *a: attend(*a, interpret=True))
    kernel_cfg = cfg.replace(attention="splash")
    outs = [run(params, kernel_cfg)]
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh), sharding.use_rules():
        compiled = run.lower(sharding.shard_params(params, mesh), kernel_cfg).compile()
        outs.append(compiled(sharding.shard_params(params, mesh)))
    gathered = re.findall(r"= (\S+) all-gather", compiled.as_text())
    assert gathered and not [x for x in gathered if x.split("{")[0].count(",") >= 3], gathered
    for (_, got), grads in outs:
        np.testing.assert_allclose(np.where(real, got, 0.0), np.where(real, want, 0.0), atol=1e-5)
        for g, gw in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want), strict=True):
            np.testing.assert_allclose(g, gw, atol=1e-5, rtol=1e-5)
