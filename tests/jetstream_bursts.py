"""Many short bursts of requests through a JetStream Driver over the gjax Engine (CPU, the
embedded policy): a burst ends when its last busy slot finishes, the window in which JetStream
0.2.2's own generate thread can fail its "At this point we must have some requests inserted
into the slots" assertion and SIGKILL the process (see `gjax.rollout.jetstream_compat.Driver`).

Run as a script (the race kills the whole process, so tests run it in a subprocess):

    python tests/jetstream_bursts.py --bursts 3000 [--stock] [--seconds 60]

prints `burst ends: N` every 500 (`--every`) and `survived N burst ends in S s` at the end, exit 0. With
`--stock` it drives JetStream's unmodified `Driver` (the race is then reachable). The GIL's
switch interval is set to 10 us (Python's default is 5 ms) so that threads interleave at many
more points: the same race, reached sooner.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bursts", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: never)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--stock", action="store_true", help="JetStream's own Driver")
    ap.add_argument("--switch-interval", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=500, help="print the count every N burst ends")
    args = ap.parse_args(argv)

    from gjax.embedded import resolve_model_path
    from gjax.models import hf_import
    from gjax.rollout import jetstream_compat
    from gjax.rollout.engine import Engine, ParamsHolder
    from gjax.rollout.sampler import SamplingParams

    cfg, params = hf_import.load_pretrained(
        resolve_model_path("embedded:tiny_qwen2"), param_dtype="float32", dtype="float32"
    )
    eos = tuple(cfg.eos_token_id)
    sampling = SamplingParams(
        max_new_tokens=4, temperature=1.0, stop_token_ids=eos, pad_token_id=eos[0]
    )
    holder = ParamsHolder(params)
    engine = Engine(
        cfg,
        holder,
        sampling=sampling,
        max_concurrent_decodes=args.slots,
        max_prefill_length=16,
        record=False,
    )
    jetstream = jetstream_compat.jetstream
    driver_cls = jetstream.orchestrator.Driver if args.stock else jetstream_compat.Driver
    driver = driver_cls(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[holder],
        generate_params=[holder],
        interleaved_mode=True,
    )
    orchestrator = jetstream.orchestrator.LLMOrchestrator(driver=driver)
    pb = jetstream.jetstream_pb2
    rng = random.Random(args.seed)

    async def one(prompt, max_tokens):
        content = pb.DecodeRequest.TokenContent(token_ids=prompt)
        request = pb.DecodeRequest(token_content=content, max_tokens=max_tokens)
        n = 0
        async for response in orchestrator.Decode(request):
            n += sum(len(s.token_ids) for s in response.stream_content.samples)
        return n

    async def burst():
        # 1 to slots + 2 requests (more than the slots: some wait in the backlogs), of 1 to 3
        # tokens, shared prompts (the engine's prefix sharing) and distinct ones.
        k = rng.randint(1, args.slots + 2)
        prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(1, 8))] for _ in range(2)]
        jobs = [one(prompts[rng.randrange(2)], rng.randint(1, 3)) for _ in range(k)]
        return await asyncio.gather(*jobs)

    async def run():
        await burst()  # compiles prefill, insert and generate
        sys.setswitchinterval(args.switch_interval)
        start = time.monotonic()
        ends = 0
        while ends < args.bursts:
            if args.seconds and time.monotonic() - start > args.seconds:
                break
            tokens = await burst()
            if not all(tokens):
                raise RuntimeError(f"a request got no tokens: {tokens}")
            ends += 1
            if ends % args.every == 0:
                print(f"burst ends: {ends}", flush=True)
        seconds = time.monotonic() - start
        sys.setswitchinterval(0.005)
        # Stop the Driver while this loop is open: its detokenize thread may still be
        # closing the last request's channel (a call_soon_threadsafe on this loop).
        await asyncio.get_running_loop().run_in_executor(None, driver.stop)
        return ends, seconds

    ends, seconds = asyncio.run(run())
    print(f"survived {ends} burst ends in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
