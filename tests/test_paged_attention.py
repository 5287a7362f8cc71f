"""Paged attention through JAX's Pallas kernels (`rollout.paged_attention`, gjax.rollout.pages.
kernel_attention), run here in Pallas's interpret mode: each kernel equals the XLA gather path
on a pool whose rows end mid-page and whose stale columns hold junk; the decoder and the
JetStream engine on a kernel give the static sampler's greedy rows, freed pages filled with NaN
included (new pages are zeroed for a kernel). The TPU kernel reads K and V in bfloat16 (its
`_maybe_dequantize`): it equals the XLA path on bfloat16-rounded K and V to float32 rounding,
and the decoder's tokens on it equal the static sampler's."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax.errors import ConfigError
from gjax.rollout import pages as pg
from tests.test_decoder import CFG, GREEDY, MASK, PARAMS, TOKENS, G, assert_same, decode

jax.config.update("jax_default_matmul_precision", "highest")

K, R, DH, PAGE, POOL = 2, 2, 16, 4, 40


def _pool_and_rows():
    """A pool whose columns past each row's length hold junk (1e4) and whose pages in no
    row's table hold NaN (a kernel reads whole blocks of a row's table: the schedulers keep
    those finite, zeroing each new page); 3 rows of 6 pages ending mid-page, at a page's end,
    and at 1 column."""
    rng = np.random.default_rng(0)
    pk = rng.normal(size=(K, POOL, PAGE, DH)).astype(np.float32)
    pv = rng.normal(size=(K, POOL, PAGE, DH)).astype(np.float32)
    table = rng.permutation(np.arange(1, POOL))[:18].reshape(3, 6).astype(np.int32)
    length = np.asarray([7, 16, 1], np.int32)
    read = np.zeros((POOL,), bool)
    for row, n in zip(table, length):
        read[row] = True
        for c in range(n, 6 * PAGE):  # a row's own columns past its length: stale, finite
            pk[:, row[c // PAGE], c % PAGE] = pv[:, row[c // PAGE], c % PAGE] = 1e4
    pk[:, ~read & (np.arange(POOL) > 0)] = np.nan  # freed pages (the null page holds 0)
    pv[:, ~read & (np.arange(POOL) > 0)] = np.nan
    pk[:, 0] = pv[:, 0] = 0.0
    q = rng.normal(size=(3, K, R, DH)).astype(np.float32)
    return [jnp.asarray(x) for x in (q, pk, pv, table, length)]


def test_each_kernel_equals_the_gather_path():
    q, pk, pv, table, length = _pool_and_rows()
    xla = pg.paged_attention(q, pk, pv, table, length, jnp.float32)
    assert np.isfinite(np.asarray(xla)).all()
    gpu = pg.kernel_attention(q, pk, pv, table, length, jnp.float32, kernel="pallas_gpu")
    np.testing.assert_allclose(gpu, xla, atol=1e-6)
    # the TPU kernel reads K and V in bfloat16: the same softmax on rounded K and V
    r16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    xla16 = pg.paged_attention(q, r16(pk), r16(pv), table, length, jnp.float32)
    tpu = pg.kernel_attention(q, pk, pv, table, length, jnp.float32, kernel="pallas_tpu")
    np.testing.assert_allclose(tpu, xla16, atol=1e-6)
    # by hand, from row 0's first 7 columns only: the junk past its length weighs nothing
    ref = np.asarray(pg.gather_pages(pk, table[:1]))[:, 0, :7]  # row 0's first 7 columns
    scores = np.einsum("krd,kcd->krc", np.asarray(q[0]), ref) / math.sqrt(DH)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum("krc,kcd->krd", w, np.asarray(pg.gather_pages(pv, table[:1]))[:, 0, :7])
    np.testing.assert_allclose(xla[0], want, atol=1e-5)


def test_attention_for_resolves_auto_per_platform():
    assert pg.attention_for("auto", "cpu") == "xla"
    assert pg.attention_for("auto", "gpu") == "pallas_gpu"
    assert pg.attention_for("auto", "tpu") == "pallas_tpu"
    assert pg.attention_for("pallas_tpu", "cpu") == "pallas_tpu"  # interpret mode
    assert pg.attention_for("auto") == "xla"  # these tests' CPU
    with pytest.raises(ValueError, match="paged_attention must be one of"):
        pg.attention_for("flash")


def test_config_paged_attention():
    from configs import common
    from gjax.rollout.factory import check_config

    config = common.tiny(common.base())
    assert config.rollout.paged_attention == "auto"
    config.rollout.paged_attention = "pallas_tpu"  # a CPU runs either kernel interpreted
    check_config(config)
    config.rollout.paged_attention = "flash"
    with pytest.raises(ConfigError, match="paged_attention='flash': must be one of"):
        check_config(config)


@pytest.mark.slow  # the kernels' interpret mode in the decode loop: ~10-30 s each
def test_decoder_on_each_kernel_gives_the_static_samplers_rows():
    from gjax.rollout import generate

    static = generate(PARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY)
    static = jax.tree.map(np.asarray, static)
    # prompts of 5, 2 and 7 tokens in pages of 4: every row's first page is its prompt's
    # tail's copy; with NaN in every freed page (7 pages: rows preempted, pages reused), each
    # new page is zeroed before the kernel reads past the row's length in it
    for kv in ({}, {"kv_pages": 7, "poison_freed_pages": True}):
        out, stats = decode(steps=4, kv_page_size=4, paged_attention="pallas_gpu", **kv)
        assert_same(out, static, atol=1e-5)  # the XLA paged path's tolerance
    assert stats["pages_poisoned"] > 0 and stats["pages_allocated"] > 6
    tpu, _ = decode(steps=4, kv_page_size=4, paged_attention="pallas_tpu")
    np.testing.assert_array_equal(tpu.tokens_BxN, static.tokens_BxN)
    np.testing.assert_array_equal(tpu.lengths_B, static.lengths_B)
    # log-probs through K and V rounded to bfloat16 (relative error 2^-9 each): measured
    # 0.0097 at most here; the kernel itself is pinned exactly above
    assert np.abs(tpu.logps_BxN - static.logps_BxN).max() < 0.02


@pytest.mark.slow
def test_engine_on_the_gpu_kernel_gives_the_static_samplers_rows():
    pytest.importorskip("gjax.rollout.jetstream_backend")
    from gjax.rollout import generate
    from tests.test_engine_paged import LONG, PAGE
    from tests.test_engine_paged import serve as serve_engine
    from tests.test_sampler import CFG as SCFG
    from tests.test_sampler import PARAMS as SPARAMS

    static = generate(SPARAMS, SCFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=LONG)
    paged, stats, _ = serve_engine(
        LONG, kv_page_size=PAGE, paged_attention="pallas_gpu", poison_freed_pages=True
    )
    assert_same(paged, jax.tree.map(np.asarray, static), atol=1e-5)
    assert stats["pages_poisoned"] > 0
