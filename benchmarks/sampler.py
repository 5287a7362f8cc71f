"""Generation throughput: gjax's jit group sampler vs `transformers` `generate` (PyTorch CPU).

Both engines run the SAME tiny random Qwen2 checkpoint (built with transformers, saved with
`save_pretrained`, loaded into gjax with `gjax.models.hf_import.load_pretrained`), the same
left-padded prompts of mixed lengths, G samples per prompt, plain temperature sampling
(T = 1, no top-k/top-p) and exactly `max_new_tokens` new tokens (EOS disabled on both sides).
Compile time is excluded (reported separately); each engine gets one warm-up and a few timed
runs; the median counts. The machine is shared, so compare the ratio within one run.

    python benchmarks/sampler.py                 # ~14M-param Qwen2, P=4, G=8, 128 new tokens

Prints one JSON line per measurement; the LAST line is a JSON summary with
`gjax_tokens_per_s`, `hf_tokens_per_s` and `speedup` (gjax over HF). HF runs with torch's
default thread count and with 1 thread; `hf_tokens_per_s`/`speedup` use the faster of the two.
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

from gjax.models import hf_import
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
    """Wall and process-CPU seconds per run (CPU time is the steadier figure on a busy box)."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


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
    parser.add_argument("--hf-repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="only time gjax")
    args = parser.parse_args()

    tokens_np, mask_np = make_prompts(args)
    g, n = args.samples, args.new_tokens
    generated = args.prompts * g * n  # every row generates exactly n tokens (no EOS)

    with tempfile.TemporaryDirectory() as ckpt_dir:
        hf_model = build_checkpoint(ckpt_dir, args)
        cfg, params = hf_import.load_pretrained(ckpt_dir)
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
    walls, cpus = timed(run_gjax, args.repeats)
    gjax_tps = generated / statistics.median(walls)
    gjax_cpu = statistics.median(cpus)
    emit({"what": "gjax", "times_s": walls, "cpu_s": cpus, "tokens_per_s": gjax_tps})

    # HF with torch's default thread count and with one thread: on a shared, oversubscribed
    # machine torch's 2-thread OpenMP runs can be several times slower than 1 thread, so the
    # headline `speedup` is against the FASTER of the two (the conservative comparison).
    hf = {}
    if not args.skip_hf:
        input_ids, attention_mask = torch.tensor(tokens_np), torch.tensor(mask_np)

        def run_hf(new_tokens=n):
            with torch.inference_mode():
                return hf_model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=g,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        default_threads = torch.get_num_threads()
        for threads in sorted({default_threads, 1}, reverse=True):
            torch.set_num_threads(threads)
            out_hf = run_hf(8)  # warm-up
            assert out_hf.shape == (args.prompts * g, tokens_np.shape[1] + 8), out_hf.shape
            walls, cpus = timed(run_hf, args.hf_repeats)
            hf[threads] = (generated / statistics.median(walls), statistics.median(cpus))
            emit(
                {
                    "what": f"hf_threads_{threads}",
                    "times_s": walls,
                    "cpu_s": cpus,
                    "tokens_per_s": hf[threads][0],
                }
            )
        torch.set_num_threads(default_threads)

    best = max(hf, key=lambda t: hf[t][0]) if hf else None
    hf_tps = hf[best][0] if hf else float("nan")
    emit(
        {
            "gjax_tokens_per_s": round(gjax_tps, 1),
            "hf_tokens_per_s": round(hf_tps, 1),
            "speedup": round(gjax_tps / hf_tps, 2),
            "hf_best_threads": best,
            "hf_tokens_per_s_by_threads": {t: round(v[0], 1) for t, v in hf.items()},
            "speedup_vs_hf_default_threads": (
                round(gjax_tps / hf[torch.get_num_threads()][0], 2) if hf else None
            ),
            "cpu_time_ratio_hf_over_gjax": round(hf[best][1] / gjax_cpu, 2) if hf else None,
            "params": n_params,
            "prompts": args.prompts,
            "samples_per_prompt": g,
            "new_tokens": n,
        }
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
