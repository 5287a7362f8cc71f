"""JetStream's gRPC service (`Orchestrator.Decode`) over one gjax `Engine`, for `gjax.serve`.

JetStream's `Driver` (its prefill and detokenize threads; the generate thread is gjax's, without
JetStream's burst-end race: `gjax.rollout.jetstream_compat.Driver`) and `LLMOrchestrator`
servicer, with these additions a shared server needs:
* every request is checked before it reaches the Driver (`check_request`); a bad one is
  answered INVALID_ARGUMENT with what was wrong, and never touches a decode slot;
* a request whose decode slot produced non-finite logits (the engine's `ERROR_TOKEN`) ends
  with INTERNAL instead of returning garbage with status OK; one ended because new weights
  landed (`rollout.weight_change='restart'`, `RESTART_TOKEN`) ends with ABORTED, and the
  client sends it again;
* a request gets at most its `max_tokens` tokens (the engine emits `tokens_per_dispatch` per
  generate call and JetStream checks max_tokens once per call; see `gjax.rollout.engine`).
The same port serves `gjax.Weights` (`gjax.rollout.weight_stream`): new params streamed by the
trainer, swapped into the engine's ParamsHolder between decode steps.
The port is bound without SO_REUSEPORT, so a second server on a taken port fails to start
instead of sharing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc

from gjax.rollout.engine import PREFILL_BUCKETS, RESTART_TOKEN, Engine
from gjax.rollout.jetstream_compat import Driver, jetstream
from gjax.rollout.weight_stream import SERVER_OPTIONS, WeightReceiver

pb = jetstream.jetstream_pb2


def check_request(request, *, vocab_size: int, max_prefill_length: int, max_tokens: int, hf=None):
    """What is wrong with a `DecodeRequest` for this server, or None if nothing is."""
    which = request.WhichOneof("content")
    if which is None:
        return "the request has no content: set token_content.token_ids (or text_content.text)"
    if request.session_cache:
        return "session_cache is not supported: send the whole prompt"
    if which == "text_content":
        if hf is None:
            return "this server has no tokenizer: send token_content.token_ids"
        ids = hf(request.text_content.text, add_special_tokens=False)["input_ids"]
    else:
        ids = list(request.token_content.token_ids)
    if not ids:
        return f"the prompt is empty: {which} has no tokens"
    if len(ids) + 1 > max_prefill_length:
        return (
            f"the prompt has {len(ids)} tokens; this server takes at most "
            f"{max_prefill_length - 1} (max_prefill_length={max_prefill_length}, one position "
            "is JetStream's BOS)"
        )
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        return f"token ids must lie in [0, {vocab_size}) (the model's vocabulary); got {bad[:8]}"
    if not 1 <= request.max_tokens <= max_tokens:
        return f"max_tokens={request.max_tokens} must be in [1, {max_tokens}] (the server's limit)"
    return None


class Servicer(jetstream.orchestrator.LLMOrchestrator):
    """`LLMOrchestrator` that checks requests and fails requests whose slot failed."""

    def __init__(self, driver, engine: Engine):
        super().__init__(driver=driver)
        self._check = dict(
            vocab_size=engine.cfg.vocab_size,
            max_prefill_length=engine.max_prefill_length,
            max_tokens=engine.max_new_tokens,
            hf=engine._hf_tokenizer,
        )
        self._tokenizer = engine.build_tokenizer(None)

    async def Decode(self, request, context=None):  # noqa: N802 - the gRPC method's name
        problem = check_request(request, **self._check)
        if problem is not None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        left = request.max_tokens
        async for response in super().Decode(request, context):
            # Cut first: the tokens past max_tokens (a call emits several) are not served,
            # so a failure among them does not fail the request.
            response, left = _cut(response, left, self._tokenizer)
            if response is None:
                continue
            if any(RESTART_TOKEN in s.token_ids for s in response.stream_content.samples):
                await _abort(
                    context,
                    grpc.StatusCode.ABORTED,
                    "the engine restarted this request (new weights landed with "
                    "rollout.weight_change='restart', or its paged KV pool was short): send "
                    "it again",
                )
            if any(t < 0 for s in response.stream_content.samples for t in s.token_ids):
                await _abort(
                    context,
                    grpc.StatusCode.INTERNAL,
                    "the model produced non-finite logits for this request; it was ended "
                    "(other requests are unaffected). Check the served weights.",
                )
            yield response


def _cut(response, left: int, tokenizer):
    """`response` with at most `left` tokens per sample (None when none is left), and what
    is left after it."""
    samples = response.stream_content.samples
    if all(len(s.token_ids) <= left for s in samples):
        return response, left - max((len(s.token_ids) for s in samples), default=0)
    if left <= 0:
        return None, 0
    cut = []
    for s in samples:
        ids = list(s.token_ids)[:left]
        text = jetstream.token_utils.text_tokens_to_str([tokenizer.decode([t]) for t in ids])
        cut.append(
            pb.DecodeResponse.StreamContent.Sample(text=text if s.text else "", token_ids=ids)
        )
    return pb.DecodeResponse(stream_content=pb.DecodeResponse.StreamContent(samples=cut)), 0


async def _abort(context, code, details: str):
    if context is None:  # called in-process
        raise ValueError(f"{code.name}: {details}")
    await context.abort(code, details)


class Server:
    """JetStream's Driver and the `Servicer` on host:port. Raises RuntimeError if the port
    cannot be bound; `stop()` shuts it down. `handoff`: what a weight push holds
    (`gjax.rollout.handoff`; LoRA: adapters over the base)."""

    def __init__(self, engine: Engine, host: str, port: int, handoff=None):
        self.engine = engine
        self.driver = Driver(
            prefill_engines=[engine],
            generate_engines=[engine],
            prefill_params=[engine.holder],
            generate_params=[engine.holder],
            interleaved_mode=True,
        )
        threads = max(self.driver.get_total_concurrent_requests(), 64)
        self._executor = concurrent.futures.ThreadPoolExecutor(threads)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="gjax-serve")
        self._thread.start()
        self.servicer = Servicer(self.driver, engine)
        self.weights = WeightReceiver(engine.holder, handoff)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

        async def start():
            options = [("grpc.so_reuseport", 0), *SERVER_OPTIONS]
            server = grpc.aio.server(self._executor, options=options)
            jetstream.jetstream_pb2_grpc.add_OrchestratorServicer_to_server(self.servicer, server)
            server.add_generic_rpc_handlers((self.weights.handler(),))
            server.add_insecure_port(address)  # RuntimeError if taken
            await server.start()
            return server

        try:
            self._grpc = self._run(start())
        except BaseException:
            self._grpc = None
            self.stop()
            raise

    def _run(self, coro, timeout=None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def decode(self, request, timeout: float | None = None) -> list[int]:
        """One request through the servicer, in-process (the server's warm-up)."""

        async def collect():
            out = []
            async for r in self.servicer.Decode(request):
                for s in r.stream_content.samples:
                    out.extend(s.token_ids)
            return out

        return self._run(collect(), timeout)

    def warm_up(self) -> None:
        """Compiles prefill (every bucket), insert and generate before the first client."""
        for bucket in PREFILL_BUCKETS[: PREFILL_BUCKETS.index(self.engine.max_prefill_length) + 1]:
            content = pb.DecodeRequest.TokenContent(token_ids=[0] * (bucket - 1))
            self.decode(pb.DecodeRequest(token_content=content, max_tokens=1))

    def stop(self) -> None:
        # gRPC first: it stops taking requests and ends those in flight while the driver
        # still runs (the other way round they would wait out the grace period).
        if self._grpc is not None:
            self._run(self._grpc.stop(grace=5))
        self.driver.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._executor.shutdown(wait=False, cancel_futures=True)
