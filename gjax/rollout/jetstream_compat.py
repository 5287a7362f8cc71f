"""The one place gjax imports JetStream (google-jetstream 0.2.2, archived upstream).

Three things in 0.2.2 do not fit a current JAX process; each is worked around here, once:

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

`jetstream` below is a namespace with the modules gjax uses.
"""

from __future__ import annotations

import logging
import sys
import types

import jax


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
