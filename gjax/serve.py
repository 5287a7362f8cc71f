"""JetStream's gRPC server over the gjax Engine, for rollouts on their own slice.

    python -m gjax.serve --config=configs/a_grae.py:tiny [--config.x.y=v ...] [--workdir=DIR]

Serves the run's policy (config.model.path) with the run's sampling settings on
config.rollout.server_address (default 127.0.0.1:9000) through JetStream's own Driver and
`Orchestrator.Decode` gRPC service (`gjax.rollout.grpc_server`: requests are checked first, a
bad one gets INVALID_ARGUMENT). A port already in use is refused first, in seconds, before the
model loads, and such a server writes nothing in the push directory. Prefill (every bucket),
insert and generate are compiled before the ready line, so a client is served at once. A trainer
started with `--config.rollout.backend=jetstream_grpc` and the same --config/--workdir sends
its rollouts here and pushes new weights after every update through the directory
config.rollout.push_dir (default WORKDIR/push; see gjax.rollout.weight_push): this server
loads each new version between decode steps, and a restarted server starts from the newest.
With config.rollout.weight_transfer=grpc they are streamed to this port instead
(gjax.rollout.weight_stream), the directory being the fallback. With config.model.lora.rank
> 0 (the trainer's LoRA settings) it serves its own load of the base with the pushed adapters:
a push carries the adapters only, and one made for another base or other adapter settings is
refused by name (gjax.rollout.handoff).
SIGTERM/SIGINT stop it cleanly.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import socket
import threading

import jax
from absl import flags
from ml_collections import config_flags

from gjax import cli, sharding
from gjax.config import check_model, validate
from gjax.data import builders as data_builders
from gjax.embedded import resolve_model_path
from gjax.errors import ConfigError
from gjax.evaluation import heldout as eval_lib
from gjax.models import hf_import, lora
from gjax.rewards import pipeline as rewards_pipeline
from gjax.rollout import factory as rollout_factory
from gjax.rollout.backend import rollout_sampling
from gjax.rollout.handoff import Handoff, adapter_record

# The subsystems' config hooks `validate` asks: the run's config is the trainer's.
CONFIG_CHECKS = (data_builders.check_config, rewards_pipeline.check_config, eval_lib.check_config)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/<algo>.py[:arg]).", lock_config=True
)
_SAMPLING = flags.DEFINE_enum(
    "sampling",
    "rollout",
    ["rollout", "eval"],
    "Sample with the run's rollout settings (for a jetstream_grpc trainer) or with "
    "eval.greedy_temperature (a held-out evaluation server; greedy by default).",
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The trainer's --workdir (for the default push dir WORKDIR/push)."
)

log = logging.getLogger("gjax")


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"config.rollout.server_address={address!r} must be HOST:PORT (e.g. 127.0.0.1:9000)"
        )
    return host.strip("[]"), int(port)


def _port_taken(config, host: str, port: int, why) -> ConfigError:
    return ConfigError(
        f"config.rollout.server_address={config.rollout.server_address!r}: cannot bind "
        f"{host}:{port} ({why}): another process (another gjax.serve?) is using that port. "
        "Stop it, or pass a free port with --config.rollout.server_address=HOST:PORT (and "
        "the same to the trainer)."
    )


def check_port_free(config, host: str, port: int) -> None:
    """Refuses an address another process listens on, before anything loads: a probe socket
    bound as gRPC binds (SO_REUSEADDR, no SO_REUSEPORT) to each address `host` resolves to,
    then closed. Other bind errors (an address this machine lacks) are left to gRPC's bind."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(
            f"config.rollout.server_address={config.rollout.server_address!r}: cannot resolve "
            f"{host!r} ({e.strerror}); use an IP address or a name this machine resolves"
        ) from e
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise _port_taken(config, host, port, e.strerror) from e


def build_server(config, workdir: str, *, sampling: str = "rollout"):
    """Starts the server; returns (server, watcher). A taken port is refused before the
    model loads; the push directory is written (SERVED) only once the port is bound."""
    rollout_factory.require_jetstream("gjax.serve")  # before anything loads
    host, port = parse_address(config.rollout.server_address)
    check_port_free(config, host, port)
    # These import JetStream, an optional dependency (the jetstream extra).
    from gjax.rollout.buckets import prefill_bucket, served_prompt_len
    from gjax.rollout.engine import Engine, ParamsHolder
    from gjax.rollout.weight_push import WeightWatcher

    mesh_shape = validate(config, jax.device_count(), checks=CONFIG_CHECKS)
    mesh = sharding.make_mesh(mesh_shape)
    # The policy's config.json checked (found, supported, long enough) before weights load.
    model_path = check_model(config, resolve_model_path(config.model.path))
    model_cfg, params, tok = hf_import.load_policy(model_path, config.model, mesh)
    # LoRA (config.model.lora, the trainer's): the loaded weights are the base, served with
    # the trainer's initial adapters (B = 0: the base's outputs) until a push brings new ones;
    # pushes carry the adapters only (gjax.rollout.handoff).
    model_cfg, base, adapters = lora.attach(
        model_cfg, params, config.model.lora, mesh, jax.random.key(config.seed)
    )
    handoff = Handoff(adapter_record(model_cfg, base), base)
    holder = ParamsHolder(lora.merge(base, adapters), version=0)
    run = rollout_sampling(config, model_cfg, tok)
    if sampling == "eval":
        run = dataclasses.replace(
            run, temperature=config.eval.greedy_temperature, top_k=0, top_p=1.0
        )
    engine = Engine(
        model_cfg,
        holder,
        sampling=run,
        max_concurrent_decodes=config.rollout.decode_slots,
        max_prefill_length=prefill_bucket(served_prompt_len(config)),
        mesh=mesh,
        tokenizer=tok,
        seed=config.seed,
        record=False,  # log-probs travel only in-process; gRPC clients recompute them
        tokens_per_dispatch=config.rollout.tokens_per_dispatch,
        weight_change=config.rollout.weight_change,
        kv_page_size=config.rollout.kv_page_size,
        kv_pages=config.rollout.kv_pages or None,
        paged_attention=config.rollout.paged_attention,
    )
    push_dir = config.rollout.push_dir or os.path.join(workdir, "push")
    watcher = WeightWatcher(push_dir, holder, handoff=handoff)
    watcher.load_latest(announce=False)  # a restarted server starts from LATEST; no write yet
    try:
        server = start_server(engine, host, port, handoff)
    except RuntimeError as e:  # taken since the probe: still nothing written
        raise _port_taken(config, host, port, e) from e
    try:
        watcher.start()  # the port is this server's: SERVED is its to write
        server.warm_up()
    except BaseException:
        server.stop()
        watcher.stop()
        raise
    log.info(
        "gjax.serve: JetStream on %s:%d, %d slots, policy version %d, weights from %s",
        host,
        port,
        config.rollout.decode_slots,
        holder.version,
        push_dir,
    )
    return server, watcher


def start_server(engine, host: str, port: int, handoff=None):
    """JetStream's Driver and gRPC service over `engine` (interleaved: one engine prefills and
    generates) on host:port; returns the `grpc_server.Server` (`.stop()` shuts it down);
    `handoff`: what weight pushes hold (`gjax.rollout.handoff`)."""
    from gjax.rollout import grpc_server  # optional dependency: JetStream

    return grpc_server.Server(engine, host, port, handoff)


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    config = _CONFIG.value
    workdir = os.path.abspath(_WORKDIR.value or os.path.join("workdirs", config.algo))
    server, watcher = build_server(config, workdir, sampling=_SAMPLING.value)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: done.set())
    print(f"gjax.serve: ready on {config.rollout.server_address}", flush=True)
    done.wait()
    watcher.stop()
    server.stop()


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    cli.run(main)
