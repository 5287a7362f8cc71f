"""Mesh, logical-axis rules and sharded forward (8 fake CPU devices, see conftest.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gjax import sharding
from gjax.models import hf_format
from gjax.models import transformer as T
from tests.test_model import tiny_cfg

CFG = tiny_cfg(vocab_size=64, intermediate_size=64)

# Expected specs under DEFAULT_RULES for every leaf of the param tree.
EXPECTED_SPECS = {
    "embed/embedding": P("tensor", "fsdp"),
    "final_norm/scale": P("fsdp"),
    "lm_head/kernel": P("fsdp", "tensor"),
    "layers/input_norm/scale": P(None, "fsdp"),
    "layers/post_attn_norm/scale": P(None, "fsdp"),
    "layers/attn/q/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/k/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/v/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/q/bias": P(None, "tensor"),
    "layers/attn/k/bias": P(None, "tensor"),
    "layers/attn/v/bias": P(None, "tensor"),
    "layers/attn/o/kernel": P(None, "tensor", "fsdp"),
    "layers/mlp/gate/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/up/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/down/kernel": P(None, "tensor", "fsdp"),
}


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def _specs(tree):
    return {
        sharding.path_str(path): leaf.spec if hasattr(leaf, "spec") else leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _is(x, mesh, spec):
    """x is laid out as `spec` on `mesh` (specs compare loosely: P("a") == P("a", None))."""
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _random_params(cfg, seed=0):
    """Host-random params in the model's layout (no init compile; norms near 1)."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        base = 1.0 if "norm" in sharding.path_str(path) else 0.0
        return jnp.asarray(base + 0.15 * rng.standard_normal(shape), jnp.float32)

    shapes = hf_format.param_shapes(cfg)
    return jax.tree_util.tree_map_with_path(leaf, shapes, is_leaf=lambda x: isinstance(x, tuple))


def _padded_batch(b=8, t=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, size=(b, t))
    lengths = rng.integers(3, t + 1, size=b)
    left = rng.integers(0, 2, size=b).astype(bool)  # half left-, half right-padded
    seg = np.zeros((b, t), np.int32)
    for i, (n, lp) in enumerate(zip(lengths, left)):
        if lp:
            seg[i, t - n :] = 1
        else:
            seg[i, :n] = 1
    positions = np.maximum(np.cumsum(seg, axis=1) - 1, 0)
    return (
        jnp.asarray(np.where(seg == 1, tokens, 0), jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(seg),
    )


# --------------------------------------------------------------------------------------------
# Mesh


def test_make_mesh_axes_and_fill():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "seq", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "seq": 1, "tensor": 2}
    assert dict(sharding.make_mesh({"fsdp": -1, "tensor": 2}).shape) == {
        "data": 1,
        "fsdp": 4,
        "seq": 1,
        "tensor": 2,
    }
    sub = sharding.make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    assert dict(sub.shape) == {"data": 1, "fsdp": 1, "seq": 1, "tensor": 4}


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"data": 3}, r"has 3 devices but 8 are available"),
        ({"data": 2, "tensor": 2}, r"has 4 devices but 8 are available"),
        ({"pipeline": 2}, r"unknown mesh axes \['pipeline'\]; valid axes"),
        ({"data": -1, "fsdp": -1}, r"at most one mesh axis may be -1"),
        ({"data": -1, "tensor": 3}, r"do not divide the 8 devices"),
        ({"data": 0}, r"must be positive"),
    ],
)
def test_make_mesh_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(shape)


# --------------------------------------------------------------------------------------------
# Rules


def test_logical_to_spec():
    assert sharding.logical_to_spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    # params over fsdp x seq; param_shardings spells a size-1 seq axis out of the spec
    assert sharding.logical_to_spec(("embed", "mlp")) == P(("fsdp", "seq"), "tensor")
    seq = sharding.sequence_rules()
    assert sharding.logical_to_spec(("batch", "length", "embed"), seq) == P(
        ("data", "fsdp"), "seq", None
    )
    assert sharding.logical_to_spec(("layers", None, "vocab")) == P(None, None, "tensor")
    with pytest.raises(KeyError, match=r"no sharding rule for logical axis 'heads'; rules cover"):
        sharding.logical_to_spec(("batch", "heads"))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'model'"):
        sharding.check_rules({"mlp": "model"})


def test_param_shardings_follow_rules(mesh):
    abstract = T.abstract_params(CFG)
    assert _specs(sharding.param_shardings(abstract, mesh)) == EXPECTED_SPECS
    # flax's boxed logical metadata gives the same answer as the path table.
    boxed = jax.eval_shape(lambda: T._boxed_init(CFG, jax.random.key(0)))
    assert _specs(sharding.param_shardings(boxed, mesh)) == EXPECTED_SPECS
    # Rules are data: change them, the layout follows.
    rules = {**sharding.DEFAULT_RULES, "embed": None, "mlp": ("fsdp", "tensor")}
    specs = _specs(sharding.param_shardings(abstract, mesh, rules))
    assert specs["layers/mlp/up/kernel"] == P(None, None, ("fsdp", "tensor"))
    assert specs["embed/embedding"] == P("tensor", None)


def test_unknown_param_path_is_an_error(mesh):
    with pytest.raises(KeyError, match=r"parameter 'layers/attn/qkv/kernel' is not in the gjax"):
        sharding.param_shardings(
            {"layers": {"attn": {"qkv": {"kernel": jnp.zeros((2, 4, 4))}}}}, mesh
        )


def test_mesh_not_dividing_model_names_field_and_axis():
    mesh = sharding.make_mesh({"data": 4, "tensor": 2})
    bad = CFG.replace(num_heads=3, num_kv_heads=1, vocab_size=65)
    with pytest.raises(ValueError) as err:
        sharding.validate_model_sharding(bad, mesh)
    msg = str(err.value)
    assert "ModelConfig.num_heads=3 is not divisible by mesh axis 'tensor' (size 2)" in msg
    assert "logical axis 'q_heads'" in msg
    assert "ModelConfig.num_kv_heads=1" in msg and "ModelConfig.vocab_size=65" in msg
    assert "intermediate_size" not in msg
    sharding.validate_model_sharding(CFG, mesh)  # fine
    # A rule mapping kv_heads to no mesh axis (replicated kv heads) accepts K=1.
    rules = {**sharding.DEFAULT_RULES, "kv_heads": None}
    sharding.validate_model_sharding(CFG.replace(num_kv_heads=1), mesh, rules)


def test_param_shardings_name_the_tensor(mesh):
    abstract = T.abstract_params(CFG.replace(vocab_size=65))
    with pytest.raises(ValueError) as err:
        sharding.param_shardings(abstract, mesh)
    msg = str(err.value)
    assert (
        "embed/embedding: dim 0 (size 65, logical axis 'vocab') is not divisible by mesh "
        "axis 'tensor' (size 2)" in msg
    )
    assert "lm_head/kernel: dim 1 (size 65" in msg


# --------------------------------------------------------------------------------------------
# Placement and forward


def test_sharded_init_places_shards(mesh):
    def init(rng):
        return T.init_params(CFG, rng)

    params = sharding.sharded_init(init, jax.random.key(3), mesh)
    assert _specs(params) == EXPECTED_SPECS
    q = params["layers"]["attn"]["q"]["kernel"]  # [2, 32, 32] on (None, fsdp, tensor)
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 16)}
    emb = params["embed"]["embedding"]  # [64, 32] on (tensor, fsdp)
    assert {s.data.shape for s in emb.addressable_shards} == {(32, 16)}


def test_sharded_forward_matches_single_device(mesh):
    params = _random_params(CFG)
    tokens, positions, seg = _padded_batch()
    forward = jax.jit(T.forward, static_argnums=1, static_argnames="return_logits")
    hidden_ref, logits_ref = forward(params, CFG, tokens, positions, seg, return_logits=True)

    sharded = sharding.shard_params(params, mesh)
    assert _specs(sharded) == EXPECTED_SPECS
    batch = sharding.activation_sharding(mesh, ("batch", "length"))
    tokens_s, positions_s, seg_s = (jax.device_put(x, batch) for x in (tokens, positions, seg))
    with jax.set_mesh(mesh), sharding.use_rules():
        hidden, logits = forward(sharded, CFG, tokens_s, positions_s, seg_s, return_logits=True)
    # The model's logical activation constraints took effect on the mesh.
    assert _is(logits, mesh, P(("data", "fsdp"), None, "tensor"))
    assert _is(hidden, mesh, P(("data", "fsdp"), None, None))
    valid = np.asarray(seg, bool)
    np.testing.assert_array_less(np.abs(np.asarray(logits) - np.asarray(logits_ref))[valid], 1e-5)
    np.testing.assert_array_less(np.abs(np.asarray(hidden) - np.asarray(hidden_ref))[valid], 1e-5)


def test_qwen3_sharded_forward_matches_single_device(mesh):
    """Qwen3's per-head q/k norms are replicated ([L, Dh]: (layers, None)) while the heads they
    normalize are split over `tensor`; the sharded forward equals the single-device one."""
    cfg = CFG.replace(model_type="qwen3", head_dim=12)
    params = _random_params(cfg, seed=1)
    tokens, positions, seg = _padded_batch()
    forward = jax.jit(T.forward, static_argnums=1, static_argnames="return_logits")
    _, logits_ref = forward(params, cfg, tokens, positions, seg, return_logits=True)
    sharded = sharding.shard_params(params, mesh)
    specs = _specs(sharded)
    assert specs["layers/attn/q_norm/scale"] == specs["layers/attn/k_norm/scale"] == P(None, None)
    assert specs["layers/attn/o/bias"] == P(None, "fsdp")
    batch = sharding.activation_sharding(mesh, ("batch", "length"))
    tokens_s, positions_s, seg_s = (jax.device_put(x, batch) for x in (tokens, positions, seg))
    with jax.set_mesh(mesh), sharding.use_rules():
        _, logits = forward(sharded, cfg, tokens_s, positions_s, seg_s, return_logits=True)
    valid = np.asarray(seg, bool)
    np.testing.assert_array_less(np.abs(np.asarray(logits) - np.asarray(logits_ref))[valid], 1e-5)


def test_constrain_inside_jit(mesh):
    x = jnp.ones((8, 4, 6))
    f = lambda v: sharding.constrain(v * 2, ("batch", "length", "embed"))
    assert f(x) is not None and sharding.constrain(x, ("batch", "length", "embed")) is x
    with jax.set_mesh(mesh):
        y = jax.jit(f)(x)
        # A batch of 2 does not divide data*fsdp = 4: replicated instead of failing.
        z = jax.jit(f)(jnp.ones((2, 4, 6)))
        w = jax.jit(lambda v: sharding.constrain(v, ("batch", "vocab")))(jnp.ones((4, 6)))
    assert _is(y, mesh, P(("data", "fsdp"), None, None))
    assert _is(z, mesh, P(None, None, None))
    assert _is(w, mesh, P(("data", "fsdp"), "tensor"))
    with pytest.raises(ValueError, match="do not match shape"), jax.set_mesh(mesh):
        sharding.constrain(x, ("batch", "length"))


def test_activation_sharding_drops_indivisible(mesh):
    s = sharding.activation_sharding(mesh, ("batch", "length"), shape=(6, 10))
    assert s.spec == P(None, None)
    s = sharding.activation_sharding(mesh, ("batch", "length"), shape=(8, 10))
    assert s.spec == P(("data", "fsdp"), None)


# --------------------------------------------------------------------------------------------
# Device order on a pod (fake TPU devices: mesh_utils reads only these attributes)


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    id: int
    coords: tuple[int, int, int]
    process_index: int
    slice_index: int = 0
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


def fake_slice(x, y, z, *, slice_index=0, first_id=0, first_process=0, one_process=False):
    """An x*y*z torus of chips, hosts of 2x2x1 chips (as on v4/v5p), in jax.devices() order:
    process-major, then z, y, x within the host."""
    chips = [(i, j, k) for i in range(x) for j in range(y) for k in range(z)]
    host = lambda c: (c[2], c[1] // 2, c[0] // 2)
    hosts = sorted({host(c) for c in chips})
    chips.sort(key=lambda c: (hosts.index(host(c)), c[2], c[1], c[0]))
    return [
        FakeTpu(
            first_id + n,
            c,
            first_process + (0 if one_process else hosts.index(host(c))),
            slice_index,
        )
        for n, c in enumerate(chips)
    ]


def neighbours(a, b):
    return sum(abs(p - q) for p, q in zip(a.coords, b.coords)) == 1


def test_cpu_mesh_keeps_the_device_order():
    """Fake CPU devices: exactly today's layout (other tests compare against it)."""
    for shape, sizes in [
        ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 2, 1, 2)),
        ({"fsdp": -1}, (1, 8, 1, 1)),
    ]:
        mesh = sharding.make_mesh(shape)
        assert mesh.devices.tolist() == np.asarray(jax.devices(), object).reshape(sizes).tolist()
    sub = jax.devices()[4:]
    assert sharding.make_mesh({"tensor": 4}, sub).devices.ravel().tolist() == sub


def test_one_process_follows_the_torus(monkeypatch):
    devices = fake_slice(4, 4, 1, one_process=True)  # 16 chips, all addressed by one process
    calls = []
    real = sharding.mesh_utils.create_device_mesh
    monkeypatch.setattr(
        sharding.mesh_utils,
        "create_device_mesh",
        lambda *a, **k: calls.append((list(a[0]), k)) or real(*a, **k),
    )
    grid = sharding.device_grid([1, 4, 4], devices)
    assert calls == [([1, 4, 4], {"allow_split_physical_axes": True})]
    # Each tensor group is a line of ICI links; in device order it would be a 2x2 host tile
    # whose second and third chips are not linked.
    for row in grid.reshape(-1, 4):
        assert all(neighbours(a, b) for a, b in zip(row, row[1:]))
    assert not all(neighbours(a, b) for a, b in zip(devices[:4], devices[1:4]))


def test_one_slice_many_hosts_keeps_each_host_one_block_of_rows():
    devices = fake_slice(4, 4, 1)  # 16 chips, 4 hosts of 2x2
    for sizes in ([1, 8, 2], [4, 2, 2], [1, 16, 1], [2, 2, 4]):
        grid = sharding.device_grid(sizes, devices)
        assert sorted(d.id for d in grid.ravel()) == list(range(16))
        assert sharding._rows_per_process_contiguous(grid), sizes  # multihost.RowLayout's need
        if sizes[-1] == 2:  # each tensor pair is one ICI link
            assert all(neighbours(*pair) for pair in grid.reshape(-1, 2)), sizes


def test_slices_split_the_outer_axes_over_dcn(monkeypatch):
    a, b = fake_slice(2, 2, 1), fake_slice(2, 2, 1, slice_index=1, first_id=4, first_process=1)
    calls = []
    real = sharding.mesh_utils.create_hybrid_device_mesh
    monkeypatch.setattr(
        sharding.mesh_utils,
        "create_hybrid_device_mesh",
        lambda *a, **k: calls.append((list(a[0]), list(a[1]))) or real(*a, **k),
    )
    grid = sharding.device_grid([2, 2, 2], a + b)
    assert calls == [([1, 2, 2], [2, 1, 1])]
    assert [{d.slice_index for d in grid[i].ravel()} for i in range(2)] == [{0}, {1}]
    calls.clear()
    grid = sharding.device_grid([1, 4, 2], b + a)  # order given does not matter
    assert calls == [([1, 2, 2], [1, 2, 1])]
    assert [{d.slice_index for d in grid[0, 2 * i : 2 * i + 2].ravel()} for i in range(2)] == [
        {0},
        {1},
    ]
    with pytest.raises(ValueError, match=r"cannot be split over 2 slices: make mesh.data"):
        sharding.device_grid([1, 1, 8], a + b)


def test_a_subset_off_the_torus_falls_back_to_device_order():
    devices = fake_slice(2, 2, 1)[:3]  # three chips of a 2x2: a hole
    grid = sharding.device_grid([1, 3, 1], devices)
    assert grid.ravel().tolist() == devices
