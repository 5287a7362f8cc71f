"""The one place gjax imports JetStream (google-jetstream 0.2.2, archived upstream).

Four things in 0.2.2 do not fit a current JAX process; each is worked around here, once:

1. `jetstream.engine.token_utils` imports `seqio.vocabularies` at module load, only for its
   SentencePiece tokenizer; seqio imports TensorFlow (seconds of start-up and a second
   runtime in the trainer's process). gjax never uses that tokenizer, so while JetStream is
   imported a stand-in `seqio.vocabularies` is placed in `sys.modules` (and removed after),
   unless the real seqio is already imported. Using the SentencePiece tokenizer then raises.
2. `jetstream.core.orchestrator.delete_pytree` calls `jax.tree_map`, which JAX removed. The
   orchestrator module (only it) gets a `jax` whose `tree_map` is `jax.tree.map`.
3. Importing the orchestrator sets the root logger to DEBUG and adds a stdout handler, and
   its threads log several root-logger INFO lines per generate step. The root logger is
   restored after the import, and JetStream's modules log to the `jetstream` logger instead
   (WARNING and above shown by default, less the per-request "offline test mode" warning
   that calling `LLMOrchestrator.Decode` in-process, as gjax does on purpose, triggers).
4. `Driver._generate_thread` asserts "At this point we must have some requests inserted into
   the slots" on a stale count: it reads the free-slot queue's size, takes and puts back a
   slot, and asserts that the queue is not full, while the detokenize thread puts finished
   slots back on that queue concurrently. When the last busy slot finishes inside that window
   (the end of every burst of requests) the assertion fails and JetStream's thread wrapper
   SIGKILLs the whole process (the server, or the trainer with the in-process backend). The
   state itself is harmless (nothing is live, so there is nothing to decode) and no engine
   method can prevent it (the count is the Driver's own queue), so gjax's `Driver` below runs
   its own generate thread: the same protocol, where "every slot free" means wait for work.
   `tests/test_jetstream_bursts.py` hammers burst ends (JetStream's thread dies within a few
   hundred of them there; gjax's survives thousands).

`jetstream` below is a namespace with the modules gjax uses.
"""

from __future__ import annotations

import logging
import queue
import sys
import types

import jax
import numpy as np


class _SentencePieceUnavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "JetStream's SentencePiece tokenizer needs seqio/TensorFlow, which gjax does not "
            "load; gjax engines use their own tokenizer (gjax.rollout.engine)"
        )


class _JaxWithTreeMap(types.ModuleType):
    """`jax` plus the removed `jax.tree_map` alias, for JetStream's orchestrator only."""

    tree_map = staticmethod(jax.tree.map)

    def __getattr__(self, name):
        return getattr(jax, name)


class _NamedLogging(types.ModuleType):
    """`logging` whose module-level log calls go to the `jetstream` logger."""

    _CALLS = ("debug", "info", "warning", "error", "exception", "critical", "log")

    def __getattr__(self, name):
        if name in self._CALLS:
            return getattr(logging.getLogger("jetstream"), name)
        return getattr(logging, name)


def _drop_offline_mode_warning(record: logging.LogRecord) -> bool:
    # `LLMOrchestrator.Decode` called directly (gjax's in-process backend) warns per request.
    return "offline test mode" not in str(record.msg)


def _import():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    stubs = {}
    if "seqio" not in sys.modules:
        seqio = types.ModuleType("seqio")
        vocabularies = types.ModuleType("seqio.vocabularies")
        vocabularies.SentencePieceVocabulary = _SentencePieceUnavailable
        vocabularies.Vocabulary = _SentencePieceUnavailable
        seqio.vocabularies = vocabularies
        stubs = {"seqio": seqio, "seqio.vocabularies": vocabularies}
        sys.modules.update(stubs)
    try:
        from jetstream.core import orchestrator, server_lib
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
        from jetstream.core.utils import async_multifuture
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2
    finally:
        for name, module in stubs.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        root.setLevel(level)
        root.handlers[:] = handlers
    orchestrator.jax = _JaxWithTreeMap("jax")
    for module in (orchestrator, server_lib, token_utils):
        module.logging = _NamedLogging("logging")
    logger = logging.getLogger("jetstream")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    logger.addFilter(_drop_offline_mode_warning)
    return types.SimpleNamespace(
        orchestrator=orchestrator,
        server_lib=server_lib,
        jetstream_pb2=jetstream_pb2,
        jetstream_pb2_grpc=jetstream_pb2_grpc,
        async_multifuture=async_multifuture,
        engine_api=engine_api,
        token_utils=token_utils,
        tokenizer_api=tokenizer_api,
        tokenizer_pb2=tokenizer_pb2,
    )


# Without JetStream this raises ImportError; gjax.rollout.factory.require_jetstream turns
# it into the user's paragraph with the install command.
jetstream = _import()


class Driver(jetstream.orchestrator.Driver):
    """JetStream's `Driver` (its prefill, transfer and detokenize threads, queues and `stop`)
    with gjax's generate thread (item 4 of the module docstring). Same arguments."""

    def _generate_thread(self, idx: int):
        # The contract with the other threads is JetStream's: take a free slot from
        # `_generate_slots[idx]` (only this thread takes; the detokenize thread puts back a
        # slot whose request completed), insert a request from `_generate_backlogs[idx]`
        # into it, announce (slot, request) and then each step's (step, ResultTokens) on the
        # detokenize backlog, end on the None sentinel of `stop`.
        engine = self._generate_engines[idx]
        params = self._generate_params[idx]
        free_slots = self._generate_slots[idx]
        backlog = self._generate_backlogs[idx]
        detokenize = self._detokenize_backlogs[idx]
        capacity = engine.max_concurrent_decodes
        if self._metrics_collector:
            metric = self._metrics_collector.get_slots_available_percentage_metric(idx)
            metric.set_function(lambda: float(free_slots.qsize() / capacity))
        state = engine.init_decode_state()
        step = 0
        while self.live:
            while True:  # fill free slots while requests are waiting
                try:
                    slot = free_slots.get_nowait()
                except queue.Empty:
                    break  # every slot is live
                # The free count only grows behind this thread's back, so "all the other
                # slots are free" read here is true; "not all" may be stale, and is settled
                # below, after the loop, not by an assertion.
                wait = free_slots.qsize() == capacity - 1  # nothing live: wait for a request
                if self._interleaved_mode:  # JetStream's rule: prefills in flight go first
                    wait = (
                        wait
                        or not self._prefill_backlog.empty()
                        or not self._transfer_backlogs[idx].empty()
                    )
                try:
                    request = backlog.get(block=wait, timeout=1.0)
                except queue.Empty:
                    free_slots.put_nowait(slot)
                    if wait:
                        continue  # look again (JetStream's loop does the same)
                    break
                if request is None:  # stop()
                    return
                if hasattr(request.prefill_result, "limit"):  # gjax's engine: stop at it
                    request.prefill_result.limit = request.max_tokens
                state = engine.insert(request.prefill_result, state, slot=slot)
                jetstream.orchestrator.delete_pytree(request.prefill_result)
                request.generate_timestep_added = step
                request.complete = np.zeros((engine.samples_per_slot,), dtype=np.bool_)
                detokenize.put((slot, request), block=True)
            if free_slots.qsize() == capacity:
                # Where JetStream's assertion failed: the last live slot finished since it
                # was counted. Nothing to decode; go back to waiting for requests.
                continue
            # A slot freed from here on only makes this step decode a finished slot, which
            # is harmless (the detokenize thread frees slots steps behind the decode anyway).
            state, tokens = engine.generate(params, state)
            tokens.copy_to_host_async()
            detokenize.put((step, tokens), block=True)
            step += 1
