"""Quantized rollouts (`rollout.quantize`): the sampler decodes int8 codes with per-output-
channel scales, consumed by its matmuls directly; the learner keeps float params.

The int8 decoder's greedy tokens equal the static sampler's on the same quantized weights;
the int8 logits stay within a stated bound of the float ones; the compiled decode step takes
s8 kernels; the sampler quantizes once per version; the config resolves TIS on by default and
refuses bad settings in one paragraph; the tiny GRPO config trains on int8 rollouts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gjax import config as config_lib
from gjax import schema
from gjax.errors import ConfigError
from gjax.models import lora, quant
from gjax.models import transformer as tr
from gjax.rollout import SamplingParams, generate
from gjax.rollout.backend import LocalSampler
from gjax.rollout.decoder import ContinuousDecoder
from tests.test_sampler import CFG, PARAMS, PROMPTS, S, left_pad

jax.config.update("jax_default_matmul_precision", "highest")

G, N = 2, 8
GREEDY = SamplingParams(
    max_new_tokens=N, temperature=0.0, stop_token_ids=(3, 7, 11), pad_token_id=63
)
TOKENS, MASK = left_pad(PROMPTS, S)
FUSED = ("qkv", "o", "gate_up", "down")  # the decode layers' fused kernels
QPARAMS = jax.jit(quant.quantize_policy, static_argnums=1)(PARAMS, "int8")


def test_quantized_policy_stores_int8_codes_with_per_channel_scales():
    for group, name in quant.PROJECTIONS:
        w = PARAMS["layers"][group][name]["kernel"]  # [L, in, out]
        p = QPARAMS["layers"][group][name]
        assert p["kernel"].dtype == jnp.int8 and p["kernel"].shape == w.shape
        assert p["kernel_scale"].shape == (w.shape[0], 1, w.shape[2])
        back = quant.dequantize(p["kernel"], p["kernel_scale"], "int8", jnp.float32)
        # absmax / 127 per output column: round to nearest is within half a step, plus the
        # f32 rounding of codes * scale (an ulp of |W| <= 127 steps: 127 * 2^-23 steps)
        assert float(jnp.max(jnp.abs(back - w) / p["kernel_scale"])) <= 0.5 + 127 * 2**-23
    # the embedding / head / norms stay float; the learner's own tree is untouched
    assert QPARAMS["embed"]["embedding"].dtype == PARAMS["embed"]["embedding"].dtype
    assert "kernel_scale" not in PARAMS["layers"]["attn"]["q"]


def test_codes_dot_is_the_dequantized_matmul():
    """(x @ codes) * scale equals x @ (codes * scale) for per-output-channel scales."""
    p = jax.tree.map(lambda a: a[0], QPARAMS["layers"]["mlp"]["up"])
    x = jax.random.normal(jax.random.key(1), (5, p["kernel"].shape[0]))
    got = quant.codes_dot(x, p["kernel"], p["kernel_scale"], jnp.float32)
    want = x @ quant.dequantize(p["kernel"], p["kernel_scale"], "int8", jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_decode_layers_keep_the_codes_and_lora_stays_float_on_top():
    layers = tr.decode_layers(QPARAMS, CFG)
    for key in ("qkv", "o", "gate_up", "down"):
        assert layers[0][key].dtype == jnp.int8, key
        assert layers[0][f"{key}_scale"].shape == (1, layers[0][key].shape[1])
    cfg = CFG.replace(lora_rank=2, lora_alpha=4.0, lora_targets=("q", "down"))
    adapters = lora.init_adapters(cfg, jax.random.key(3))
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # B != 0: the adapters act
    served = LocalSampler(cfg, quantize="int8")._served(lora.merge(PARAMS, adapters))
    lp = tr.decode_layers(served, cfg)[0]
    assert lp["qkv"].dtype == jnp.int8 and lp["lora"]["q"][0].dtype == jnp.float32
    assert lp["lora"]["q"][0].shape == (CFG.hidden_size, 2)  # low rank, not merged


def test_int8_decoder_greedy_equals_the_static_sampler_on_the_same_int8_weights():
    static = jax.tree.map(
        np.asarray,
        generate(QPARAMS, CFG, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY),
    )
    assert 0 < (static.lengths_B < N).sum() < len(static.lengths_B), "want stopped and full"
    for kw in (dict(slots=3, tokens_per_dispatch=4), dict(slots=6, tokens_per_dispatch=1)):
        dec = ContinuousDecoder(CFG, **kw)
        got = jax.tree.map(
            np.asarray,
            dec.generate(QPARAMS, TOKENS, MASK, jax.random.key(0), num_samples=G, sampling=GREEDY),
        )
        np.testing.assert_array_equal(got.tokens_BxN, static.tokens_BxN)
        np.testing.assert_array_equal(got.lengths_B, static.lengths_B)
        np.testing.assert_allclose(got.logps_BxN, static.logps_BxN, atol=1e-5)


def test_int8_logits_are_within_the_stated_bound_of_the_float_ones():
    """Prefill logits of the tiny fixture on int8 weights against the float ones, L = the
    largest |float logit| (~5.8 here): the largest gap is under 0.1 L and the mean under
    0.01 L (measured 0.34 and 0.034: an int8 step is 1/127 of a column's largest weight, and
    the fixture's weights are wide, std 0.3). The float kernels dequantized from the codes
    give the int8 path's logits to f32 rounding: the gap is the codes' rounding, not the
    (x @ codes) * scale arithmetic."""
    positions = jnp.maximum(jnp.cumsum(MASK, -1) - 1, 0)

    def logits(params):
        hidden, _, _ = tr.prefill(params, CFG, TOKENS, positions, MASK)
        return np.asarray(tr.logits_from_hidden(params, CFG, hidden))[MASK.astype(bool)]

    f32, int8 = logits(PARAMS), logits(QPARAMS)
    deq = jax.tree.map(lambda x: x, QPARAMS)
    for group, name in quant.PROJECTIONS:
        p = deq["layers"][group][name]
        deq["layers"][group][name] = {
            **{k: v for k, v in p.items() if k not in ("kernel", "kernel_scale")},
            "kernel": quant.dequantize(p["kernel"], p["kernel_scale"], "int8", jnp.float32),
        }
    np.testing.assert_allclose(int8, logits(deq), atol=1e-5)
    big = float(np.abs(f32).max())
    gap = np.abs(int8 - f32)
    assert big > 1.0  # O(1) logits, not all ~0
    assert 0 < gap.max() < 0.1 * big and gap.mean() < 0.01 * big, (gap.max(), gap.mean(), big)


def test_the_compiled_decode_step_takes_s8_kernels():
    """The continuous decoder's step program has each fused kernel as an s8 parameter (no f32
    kernel parameter): what the step reads is the codes. On the CPU, XLA converts each s8
    kernel to an f32 copy in its own fusion before the dot (XLA:CPU does not fuse a convert
    into a dot; GPU/TPU do), so the CPU program does materialise those copies."""
    from gjax.rollout import decoder as dec

    layers = jax.eval_shape(lambda p: tr.decode_layers(p, CFG), QPARAMS)
    state = jax.eval_shape(lambda: dec.init_state(CFG, 4, 2, S, N))
    sp = SamplingParams(max_new_tokens=N, temperature=1.0)
    text = dec._dispatch_jit.lower(QPARAMS, CFG, layers, state, sp=sp, steps=1).compile().as_text()
    entry = text[text.index("\nENTRY") + 1 :].split("\n", 1)[0]
    params = dict(re.findall(r"(layers_\d+___[a-z_]+__)\.\d+: (\w+)\[", entry))
    kernels = [f"layers_{i}___{k}__" for i in range(CFG.num_layers) for k in FUSED]
    assert {params[k] for k in kernels} == {"s8"}, params  # the codes, no float kernel
    assert {params[k[:-2] + "_scale__"] for k in kernels} == {"f32"}  # per-channel scales
    converts = re.findall(r"\(param_[\d.]+: s8\[[\d,]+\]\) -> f32\[", text)
    assert len(converts) >= len(kernels)  # the CPU's per-kernel converts


def test_local_sampler_quantizes_once_per_version():
    sampler = LocalSampler(CFG, quantize="int8")
    sampler.push(PARAMS)
    first = sampler._served(PARAMS)
    assert first["layers"]["attn"]["q"]["kernel"].dtype == jnp.int8
    assert (
        sampler._served(PARAMS)["layers"]["attn"]["q"]["kernel"]
        is (first["layers"]["attn"]["q"]["kernel"])
    )
    newer = jax.tree.map(lambda x: x * 1.0, PARAMS)  # a new version: new arrays
    assert (
        sampler._served(newer)["layers"]["attn"]["q"]["kernel"]
        is not (first["layers"]["attn"]["q"]["kernel"])
    )
    assert LocalSampler(CFG)._served(PARAMS) is PARAMS


def test_episodes_decode_the_quantized_copy_as_single_completions_do():
    """A multi-turn rollout's decoder gets the same int8 copy `generate` would decode."""
    seen = []

    class Decoder:
        def generate_episodes(self, params, *args, **kwargs):
            seen.append(params)

    sampler = LocalSampler(CFG, decoder=Decoder(), quantize="int8")
    ids = np.zeros((1, 4), np.int32)
    sampler.generate_episodes(PARAMS, ids, ids > -1, None, num_samples=1, sampling=None, turns=None)
    q = seen[0]["layers"]["attn"]["q"]["kernel"]
    assert q.dtype == jnp.int8 and q is sampler._served(PARAMS)["layers"]["attn"]["q"]["kernel"]


# --------------------------------------------------------------------------------- config


def tiny_config(**rollout):
    from configs import grpo

    c = grpo.get_config("tiny")
    for k, v in rollout.items():
        c.rollout[k] = v
    return c


def test_quantized_rollouts_turn_tis_on_unless_the_user_chose():
    c = tiny_config(quantize="int8")
    assert c.objective.behaviour_correction == schema.AUTO_CORRECTION
    config_lib.validate(c, 1)
    assert c.objective.behaviour_correction == "tis" and c.rollout.recompute_old_logps
    c = tiny_config(quantize="int8")
    c.objective.behaviour_correction = "none"  # the user's choice is kept
    config_lib.validate(c, 1)
    assert c.objective.behaviour_correction == "none" and not c.rollout.recompute_old_logps
    c = tiny_config()  # float rollouts: auto is none
    config_lib.validate(c, 1)
    assert c.objective.behaviour_correction == "none" and not c.rollout.recompute_old_logps


@pytest.mark.parametrize(
    "rollout, message",
    [
        (dict(quantize="int4"), "'int4' is not a rollout quantization: use one of"),
        (dict(quantize="fp8"), "'fp8' is refused here: the cpu platform has no fp8 matmul"),
        (dict(quantize="int8", no_qwix=True), "needs the qwix package"),
        (dict(quantize="int8", backend="jetstream"), "quantizes the local sampler's weights"),
        (dict(quantize="int8", lora_quantize="int8"), "already stores the base quantized"),
    ],
)
def test_bad_rollout_quantize_is_one_paragraph(rollout, message, monkeypatch):
    if rollout.pop("no_qwix", False):
        monkeypatch.setattr(quant, "available", lambda: False)
    base = rollout.pop("lora_quantize", None)
    c = tiny_config(**rollout)
    if base:
        c.model.lora.rank, c.model.lora.quantize = 4, base
    with pytest.raises(ConfigError, match=message) as e:
        config_lib.validate(c, 1)
    msg = str(e.value)
    assert msg.startswith("config.rollout.quantize") and "\n" not in msg


# ---------------------------------------------------------------------------------- train


@pytest.mark.slow
def test_tiny_grpo_trains_on_int8_rollouts_with_the_mismatch_metric_and_tis(tmp_path):
    from gjax.train import train
    from tests.test_train_e2e import rows, small_config

    c = small_config("grpo")
    c.rollout.quantize = "int8"
    c.train.steps = 2
    c.eval.num_samples = 0
    assert train(c, str(tmp_path / "q")) is None
    got = rows(tmp_path / "q")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        # the quantized sampler is a behaviour policy apart from the learner's float one
        assert 0.0 < r["mismatch/abs_logp_diff_mean"] <= r["mismatch/abs_logp_diff_max"] < 1.0
        assert np.isfinite(r["mismatch/kl_k3"]) and "correction/capped_frac" in r
        assert np.isfinite(r["loss/total"])


def test_decode_step_bytes_on_int8_weights():
    """`efficiency.decode_step_bytes(quantize='int8')`: the ideal counts the codes (1 byte a
    weight) and f32 scales; on the CPU the converts of the codes to f32 copies show up as
    bytes (a GPU/TPU fuses them into the dots)."""
    from gjax import efficiency

    kw = dict(slots=4, regions=2, prompt_len=S, max_new=N, tokens_per_dispatch=4)
    f32 = efficiency.decode_step_bytes(CFG, **kw)
    int8 = efficiency.decode_step_bytes(CFG, quantize="int8", **kw)
    assert int8["shape"]["quantize"] == "int8" and int8["kv_bytes"] == f32["kv_bytes"]
    kernels = sum(PARAMS["layers"][g][n]["kernel"].size for g, n in quant.PROJECTIONS)
    scales = sum(QPARAMS["layers"][g][n]["kernel_scale"].size for g, n in quant.PROJECTIONS)
    assert f32["weight_bytes"] - int8["weight_bytes"] == 3 * kernels - 4 * scales
    assert int8["convert_touched_bytes"] >= 5 * kernels  # s8 read + f32 written, each kernel


def test_quantized_rollouts_evaluate_the_float_policy():
    from gjax.rollout import factory

    c = tiny_config(quantize="int8")
    config_lib.validate(c, 1)
    backend = factory.make_backend(c, CFG, PARAMS)
    assert isinstance(backend, LocalSampler) and backend.quantize == "int8"
    evaluator = factory.evaluation_backend(c, backend, CFG)
    assert evaluator is not backend and evaluator.quantize == "none"
