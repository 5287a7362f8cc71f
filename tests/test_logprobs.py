"""Tests for the chunked LM-head kernels in gjax.objective.logprobs (naive path = oracle)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Pspec
from jax.test_util import check_grads

from gjax.objective import logprobs as lp

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seed, n, d, v, dtype=jnp.float32, target_max=None):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    hidden = jax.random.normal(k[0], (n, d), jnp.float32)
    head = jax.random.normal(k[1], (d, v), jnp.float32) * (2.0 / np.sqrt(d))
    targets = jax.random.randint(k[2], (n,), 0, v if target_max is None else target_max)
    return hidden.astype(dtype), head.astype(dtype), targets


def naive_logps(hidden, head, targets, temperature=1.0):
    logits = jnp.dot(hidden, head, preferred_element_type=jnp.float32) / temperature
    logp_NxV = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_NxV, targets[:, None], axis=1)[:, 0]
    ent = -jnp.sum(jnp.exp(logp_NxV) * logp_NxV, axis=-1)
    return logp, ent


def ppo_token_loss(logp, ent, args):
    """PPO-clip (clip-higher) + entropy bonus + k3 KL, weighted per token (like "loss")."""
    ratio = jnp.exp(logp - args["old"])
    adv = args["adv"]
    pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.28) * adv)
    log_r = args["ref"] - logp
    kl = jnp.exp(log_r) - log_r - 1.0
    loss = (pg + 0.05 * kl - 0.01 * ent) * args["w"] * args["mask"]
    aux = {"clipped": ((ratio > 1.28) | (ratio < 0.8)) * args["mask"], "kl": kl * args["mask"]}
    return loss, aux


def _ppo_args(seed, hidden, head, targets, temperature=1.0):
    n = hidden.shape[0]
    k = jax.random.split(jax.random.PRNGKey(seed + 100), 4)
    logp, _ = naive_logps(hidden.astype(jnp.float32), head.astype(jnp.float32), targets)
    mask = (jax.random.uniform(k[0], (n,)) > 0.2).astype(jnp.float32)
    return {
        "old": logp + 0.2 * jax.random.normal(k[1], (n,)),
        "ref": logp + 0.1 * jax.random.normal(k[2], (n,)),
        "adv": jax.random.normal(k[3], (n,)),
        "w": jnp.full((n,), 1.0 / jnp.maximum(mask.sum(), 1.0)),
        "mask": mask,
    }


def naive_loss(hidden, head, targets, args, temperature=1.0):
    logp, ent = naive_logps(hidden, head, targets, temperature)
    loss_t, aux_t = ppo_token_loss(logp, ent, args)
    return jnp.sum(loss_t), jax.tree.map(jnp.sum, aux_t)


SHAPES = [  # (N, D, V, token_chunk, vocab_tile, temperature): ragged N and V included
    (37, 16, 101, 8, 16, 1.0),
    (64, 8, 50, 64, 50, 0.7),
    (5, 12, 33, 16, 7, 1.0),
    (33, 24, 257, 10, 64, 0.6),
]


@pytest.mark.parametrize("n,d,v,chunk,tile,temperature", SHAPES)
def test_token_logps_values_and_grads_match_naive(n, d, v, chunk, tile, temperature):
    hidden, head, targets = _inputs(n + v, n, d, v)
    kw = dict(temperature=temperature, token_chunk=chunk, vocab_tile=tile)
    logp, ent = jax.jit(lambda h, w, t: lp.token_logps(h, w, t, **kw))(hidden, head, targets)
    ref_logp, ref_ent = naive_logps(hidden, head, targets, temperature)
    np.testing.assert_allclose(logp, ref_logp, **TOL)
    np.testing.assert_allclose(ent, ref_ent, **TOL)

    ct = jax.random.normal(jax.random.PRNGKey(1), (2, n))

    def scalar(fn):
        return lambda h, w: jnp.sum(fn(h, w)[0] * ct[0]) + jnp.sum(fn(h, w)[1] * ct[1])

    got = jax.jit(jax.grad(scalar(lambda h, w: lp.token_logps(h, w, targets, **kw)), (0, 1)))(
        hidden, head
    )
    want = jax.grad(scalar(lambda h, w: naive_logps(h, w, targets, temperature)), (0, 1))(
        hidden, head
    )
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


def test_entropy_only_gradient_and_no_entropy_mode():
    hidden, head, targets = _inputs(3, 19, 8, 45)
    kw = dict(token_chunk=4, vocab_tile=10)
    got = jax.grad(lambda h, w: lp.token_logps(h, w, targets, **kw)[1].sum(), (0, 1))(hidden, head)
    want = jax.grad(lambda h, w: naive_logps(h, w, targets)[1].sum(), (0, 1))(hidden, head)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)
    logp, ent = lp.token_logps(hidden, head, targets, with_entropy=False, **kw)
    assert ent is None
    np.testing.assert_allclose(logp, naive_logps(hidden, head, targets)[0], **TOL)
    got = jax.grad(lambda h: lp.token_logps(h, head, targets, with_entropy=False, **kw)[0].sum())(
        hidden
    )
    want = jax.grad(lambda h: naive_logps(h, head, targets)[0].sum())(hidden)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.slow
def test_check_grads_tiny():
    hidden, head, targets = _inputs(4, 5, 3, 7)
    with jax.enable_x64(True):
        hidden, head = np.asarray(hidden, np.float64), np.asarray(head, np.float64)

        def f(h, w):
            logp, ent = lp.token_logps(h, w, targets, token_chunk=2, vocab_tile=3, temperature=0.9)
            return logp * 1.3 + ent

        check_grads(f, (hidden, head), order=1, modes=("rev",))

        args = {"a": jnp.linspace(-1.0, 1.0, 5)}
        g = lambda h, w: lp.fused_token_loss(
            h, w, targets, lambda l, e, a: (l * a["a"] + 0.1 * e, {}), args, token_chunk=2
        )[0]
        check_grads(g, (hidden, head), order=1, modes=("rev",))


@pytest.mark.parametrize(
    "n,d,v,chunk,tile,temperature,store_logits",
    [shape + (store,) for shape, store in zip(SHAPES, (True, False, False, True))],
)
def test_fused_loss_matches_grad_of_naive(n, d, v, chunk, tile, temperature, store_logits):
    hidden, head, targets = _inputs(n * v, n, d, v)
    args = _ppo_args(n, hidden, head, targets, temperature)

    def fused(h, w):
        return lp.fused_token_loss(
            h,
            w,
            targets,
            ppo_token_loss,
            args,
            temperature=temperature,
            token_chunk=chunk,
            vocab_tile=tile,
            store_logits=store_logits,
        )

    (loss, aux), grads = jax.jit(jax.value_and_grad(fused, (0, 1), has_aux=True))(hidden, head)
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(
        lambda h, w: naive_loss(h, w, targets, args, temperature), (0, 1), has_aux=True
    )(hidden, head)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for key in ("clipped", "kl"):
        np.testing.assert_allclose(aux[key], ref_aux[key], **TOL)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, **TOL)
    # Forward-only (primal) path gives the same value; cotangent scaling is applied.
    np.testing.assert_allclose(jax.jit(fused)(hidden, head)[0], ref_loss, **TOL)
    g3 = jax.jit(jax.grad(lambda h, w: 3.0 * fused(h, w)[0], (0, 1)))(hidden, head)
    for g, r in zip(g3, ref_grads):
        np.testing.assert_allclose(g, 3.0 * r, **TOL)


def test_padding_targets_masked_never_nan():
    hidden, head, targets = _inputs(7, 12, 8, 30)
    targets = targets.at[-4:].set(-1).at[0].set(10_000)  # pad ids out of range
    mask = jnp.ones(12).at[-4:].set(0.0).at[0].set(0.0)
    logp, ent = lp.token_logps(hidden, head, targets, token_chunk=5, vocab_tile=7)
    assert bool(jnp.all(jnp.isfinite(logp)) and jnp.all(jnp.isfinite(ent)))

    def fused(h, w):
        fn = lambda l, e, a: (-l * a["m"], {"n": a["m"]})
        return lp.fused_token_loss(h, w, targets, fn, {"m": mask}, token_chunk=5)

    (loss, aux), grads = jax.value_and_grad(fused, (0, 1), has_aux=True)(hidden, head)
    safe = jnp.where(mask > 0, targets, 0)
    ref, ref_grads = jax.value_and_grad(
        lambda h, w: -jnp.sum(naive_logps(h, w, safe)[0] * mask), (0, 1)
    )(hidden, head)
    np.testing.assert_allclose(loss, ref, **TOL)
    assert float(aux["n"]) == 7.0
    for g, r in zip(grads, ref_grads):
        assert bool(jnp.all(jnp.isfinite(g)))
        np.testing.assert_allclose(g, r, **TOL)


def test_bf16_inputs_accumulate_in_f32():
    hidden, head, targets = _inputs(11, 40, 32, 300, dtype=jnp.bfloat16)
    logp, ent = lp.token_logps(hidden, head, targets, token_chunk=16, vocab_tile=64)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    ref_logp, ref_ent = naive_logps(hidden, head, targets)  # f32 math on bf16 inputs
    np.testing.assert_allclose(logp, ref_logp, **TOL)  # measured max error 9.5e-7
    np.testing.assert_allclose(ent, ref_ent, **TOL)
    args = _ppo_args(0, hidden, head, targets)
    fused = lambda h, w: lp.fused_token_loss(h, w, targets, ppo_token_loss, args, token_chunk=16)
    (loss, _), (gh, gw) = jax.value_and_grad(fused, (0, 1), has_aux=True)(hidden, head)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    (ref_loss, _), (rh, rw) = jax.value_and_grad(
        lambda h, w: naive_loss(h.astype(jnp.float32), w.astype(jnp.float32), targets, args),
        (0, 1),
        has_aux=True,
    )(hidden, head)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    # dlogits go through bf16 for the two gradient matmuls: bf16-level agreement.
    for g, r in zip((gh, gw), (rh, rw)):
        g = np.asarray(g, np.float32)
        assert np.max(np.abs(g - r)) <= 2e-2 * np.max(np.abs(r))


def _shapes_in_jaxpr(jaxpr):
    for eqn in jaxpr.eqns:
        for var in list(eqn.invars) + list(eqn.outvars):
            aval = getattr(var, "aval", None)
            if aval is not None and hasattr(aval, "shape"):
                yield tuple(aval.shape)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _shapes_in_jaxpr(sub)


def test_no_NxV_array_in_fused_or_tiled_paths():
    n, d, v = 96, 8, 5000
    hidden, head, targets = _inputs(0, n, d, v)
    args = _ppo_args(0, hidden, head, targets)

    def fused(h, w, store_logits):
        return lp.fused_token_loss(
            h, w, targets, ppo_token_loss, args, token_chunk=16, store_logits=store_logits
        )[0]

    tiled = lambda h, w: lp.token_logps(h, w, targets, token_chunk=16, vocab_tile=512)[0].sum()
    for fn in (lambda h, w: fused(h, w, True), lambda h, w: fused(h, w, False), tiled):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(fn, (0, 1)))(hidden, head).jaxpr
        shapes = list(_shapes_in_jaxpr(jaxpr))
        assert shapes, "empty jaxpr?"
        big = [s for s in shapes if int(np.prod(s)) >= n * v or (n in s and v in s)]
        assert not big, f"[N x V]-sized arrays in the kernel jaxpr: {big}"
        hlo = jax.jit(jax.value_and_grad(fn, (0, 1))).lower(hidden, head).as_text()
        assert f"{n},{v}]" not in hlo and f"{v},{n}]" not in hlo
    # ... while the naive path does have one (the check can fail).
    jaxpr = jax.make_jaxpr(jax.grad(lambda h, w: naive_loss(h, w, targets, args)[0]))(hidden, head)
    assert (n, v) in list(_shapes_in_jaxpr(jaxpr.jaxpr))


def test_BxT_conveniences():
    hidden, head, targets = _inputs(5, 12, 8, 40)
    h3, t2 = hidden.reshape(3, 4, 8), targets.reshape(3, 4)
    logp, ent = lp.token_logps_BxT(h3, head, t2, token_chunk=5, vocab_tile=16)
    ref_logp, ref_ent = naive_logps(hidden, head, targets)
    np.testing.assert_allclose(logp, ref_logp.reshape(3, 4), **TOL)
    np.testing.assert_allclose(ent, ref_ent.reshape(3, 4), **TOL)
    args = _ppo_args(2, hidden, head, targets)
    loss, aux = lp.fused_token_loss_BxT(
        h3, head, t2, ppo_token_loss, jax.tree.map(lambda a: a.reshape(3, 4), args), token_chunk=5
    )
    ref_loss, ref_aux = naive_loss(hidden, head, targets, args)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    np.testing.assert_allclose(aux["kl"], ref_aux["kl"], **TOL)


@pytest.mark.slow
def test_micro_batches_add_up_to_full_batch():
    hidden, head, targets = _inputs(8, 24, 8, 60)
    args = _ppo_args(8, hidden, head, targets)
    f = lambda h, w, t, a: lp.fused_token_loss(h, w, t, ppo_token_loss, a, token_chunk=7)[0]
    full, (gh, gw) = jax.value_and_grad(f, (0, 1))(hidden, head, targets, args)
    parts = [
        jax.value_and_grad(f, (0, 1))(
            hidden[s], head, targets[s], jax.tree.map(lambda a, s=s: a[s], args)
        )
        for s in (slice(0, 10), slice(10, 24))
    ]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], full, **TOL)
    np.testing.assert_allclose(parts[0][1][1] + parts[1][1][1], gw, **TOL)
    np.testing.assert_allclose(jnp.concatenate([parts[0][1][0], parts[1][1][0]]), gh, **TOL)


def test_bad_inputs_raise():
    hidden, head, targets = _inputs(0, 6, 4, 10)
    with pytest.raises(ValueError, match="hidden dim"):
        lp.token_logps(hidden, head[:3], targets)
    with pytest.raises(ValueError, match="integer"):
        lp.token_logps(hidden, head, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match="temperature"):
        lp.token_logps(hidden, head, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets_N"):
        lp.token_logps(hidden, head, targets[:5])
    with pytest.raises(ValueError, match="leading dim"):
        lp.fused_token_loss(hidden, head, targets, ppo_token_loss, {"adv": jnp.ones(5)})
    with pytest.raises(ValueError, match="elementwise"):
        lp.fused_token_loss(
            hidden, head, targets, lambda l, e, a: (jnp.sum(l), {}), {"a": jnp.ones(6)}
        )


@pytest.mark.slow
def test_sharded_inputs_under_jit_match_unsharded():
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "tensor"))
    n, d, v = 64, 8, 96
    hidden, head, targets = _inputs(1, n, d, v)
    args = _ppo_args(1, hidden, head, targets)
    tok = NamedSharding(mesh, Pspec("data"))
    hs = jax.device_put(hidden, NamedSharding(mesh, Pspec("data", None)))
    ws = jax.device_put(head, NamedSharding(mesh, Pspec(None, "tensor")))
    ts, args_s = jax.device_put(targets, tok), jax.device_put(args, tok)

    def both(h, w, t, a):
        logp, ent = lp.token_logps(h, w, t, token_chunk=16, vocab_tile=32)
        fused = lambda h, w: lp.fused_token_loss(h, w, t, ppo_token_loss, a, token_chunk=16)[0]
        return logp, ent, jax.value_and_grad(fused, (0, 1))(h, w)

    got = jax.jit(both)(hs, ws, ts, args_s)
    want = both(hidden, head, targets, args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, **TOL)


def test_fused_schedule_per_platform_and_reference():
    # cpu: the stored-logits (3-matmul) schedule only when 512+ rows of [C x V] f32 fit 64 MiB.
    assert lp.fused_schedule(32000, platform="cpu") == (True, 512, 4096)
    assert lp.fused_schedule(151936, platform="cpu") == (False, 1024, 4096)
    assert lp.fused_schedule(151936, platform="cpu", token_chunk=64) == (False, 64, 4096)
    assert lp.fused_schedule(151936, platform="cpu", store_logits=True)[:2] == (True, 96)
    for v in (33, 32000, 151936):  # the first fixed schedule, whatever the platform
        assert lp.fused_schedule(v, kernel="reference", platform="gpu") == (False, 1024, 4096)
    with pytest.raises(ValueError, match="reference"):
        lp.fused_schedule(100, kernel="nope")


def test_auto_kernel_matches_reference_kernel():
    """The default ('auto': stored logits at this small V) against the reference schedule."""
    n, d, v = 40, 16, 300
    assert lp.fused_schedule(v)[0] and not lp.fused_schedule(v, kernel="reference")[0]
    hidden, head, targets = _inputs(21, n, d, v)
    args = _ppo_args(21, hidden, head, targets, 0.8)

    def run(kernel):
        fn = lambda h, w: lp.fused_token_loss(
            h, w, targets, ppo_token_loss, args, temperature=0.8, kernel=kernel
        )
        return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(hidden, head)

    got, want = run("auto"), run("reference")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, **TOL)
