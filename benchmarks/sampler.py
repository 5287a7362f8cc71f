"""Generation throughput: gjax's jit group sampler vs `transformers` `generate` (PyTorch CPU).

Both engines run the SAME tiny random Qwen2 checkpoint (built with transformers, saved with
`save_pretrained`, loaded into gjax with `gjax.models.hf_io.load_pretrained`), the same
left-padded prompts of mixed lengths, G samples per prompt, plain temperature sampling
(T = 1, no top-k/top-p) and exactly `max_new_tokens` new tokens (EOS disabled on both sides).
Compile time is excluded (reported separately); each engine gets one warm-up and `--repeats`
timed runs; the median counts. The machine is shared, so compare the ratio within one run.

    python benchmarks/sampler.py                 # ~14M-param Qwen2, P=4, G=8, 128 new tokens

Prints one JSON line per measurement; the LAST line is a JSON summary with
`gjax_tokens_per_s`, `hf_tokens_per_s` and `speedup` (gjax over HF).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
import transformers

from gjax.models import hf_io
from gjax.rollout import SamplingParams, generate


def build_checkpoint(path: str, args) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    model.save_pretrained(path)
    return model


def make_prompts(args):
    rng = np.random.RandomState(0)
    lengths = np.linspace(args.min_prompt, args.max_prompt, args.prompts).astype(int)
    width = int(lengths.max())
    tokens = np.zeros((args.prompts, width), np.int64)
    mask = np.zeros((args.prompts, width), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, width - n :] = rng.randint(3, args.vocab, n)
        mask[i, width - n :] = 1
    return tokens, mask


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def emit(record):
    print(json.dumps(record), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="only time gjax")
    args = parser.parse_args()

    tokens_np, mask_np = make_prompts(args)
    g, n = args.samples, args.new_tokens
    generated = args.prompts * g * n  # every row generates exactly n tokens (no EOS)

    with tempfile.TemporaryDirectory() as ckpt_dir:
        hf_model = build_checkpoint(ckpt_dir, args)
        cfg, params = hf_io.load_pretrained(ckpt_dir)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    emit(
        {
            "what": "setup",
            "params": n_params,
            "B": args.prompts * g,
            "new_tokens": n,
            "prompt_lengths": mask_np.sum(1).tolist(),
            "jax_devices": jax.device_count(),
            "torch_threads": torch.get_num_threads(),
        }
    )

    # gjax: plain temperature sampling, no stop tokens -> exactly n tokens per row.
    sp = SamplingParams(max_new_tokens=n, temperature=1.0)
    tokens, mask = jax.numpy.asarray(tokens_np, "int32"), jax.numpy.asarray(mask_np, "int32")
    run_gjax = lambda seed=0: jax.block_until_ready(
        generate(params, cfg, tokens, mask, jax.random.key(seed), num_samples=g, sampling=sp)
    )
    start = time.perf_counter()
    out = run_gjax()
    emit({"what": "gjax_compile_and_first_run_s", "value": time.perf_counter() - start})
    assert int(out.mask_BxN.sum()) == generated, "gjax stopped early"
    run_gjax()  # warm-up
    gjax_times = timed(run_gjax, args.repeats)
    gjax_tps = generated / statistics.median(gjax_times)
    emit({"what": "gjax", "times_s": gjax_times, "tokens_per_s": gjax_tps})

    hf_tps = float("nan")
    if not args.skip_hf:
        input_ids, attention_mask = torch.tensor(tokens_np), torch.tensor(mask_np)

        def run_hf():
            with torch.inference_mode():
                return hf_model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=g,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        out_hf = run_hf()  # warm-up
        assert out_hf.shape == (args.prompts * g, tokens_np.shape[1] + n), out_hf.shape
        hf_times = timed(run_hf, args.repeats)
        hf_tps = generated / statistics.median(hf_times)
        emit({"what": "hf", "times_s": hf_times, "tokens_per_s": hf_tps})

    emit(
        {
            "gjax_tokens_per_s": round(gjax_tps, 1),
            "hf_tokens_per_s": round(hf_tps, 1),
            "speedup": round(gjax_tps / hf_tps, 2),
            "params": n_params,
            "prompts": args.prompts,
            "samples_per_prompt": g,
            "new_tokens": n,
        }
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
