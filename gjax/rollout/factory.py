"""`make_backend`: the rollout backend `config.rollout.backend` names, chosen once at set-up.

Above `backend.py` and the backends themselves (it imports them; they import the seam).
"""

from __future__ import annotations

import math

import jax

from gjax import schema
from gjax.errors import ConfigError
from gjax.models.config import ModelConfig
from gjax.rollout.backend import LocalSampler, RolloutBackend
from gjax.rollout.decoder import ContinuousDecoder

# JetStream 0.2.2 without seqio/TensorFlow (its metadata's), plus what it imports at load.
JETSTREAM_INSTALL = (
    "pip install --no-deps google-jetstream==0.2.2 && "
    "pip install grpcio prometheus-client shortuuid tiktoken"
)


def require_jetstream(what: str, otherwise: str = "") -> None:
    """Imports JetStream (gjax.rollout.jetstream_compat); if it is missing, raises ConfigError
    saying that `what` needs it and how to install it (`otherwise`: an alternative)."""
    try:  # optional dependency: google-jetstream (the jetstream extra)
        import gjax.rollout.jetstream_compat  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"{what} needs JetStream, which is not importable here ({e}). Install it with "
            f"`{JETSTREAM_INSTALL}`{otherwise}."
        ) from None


def check_config(config) -> None:
    """A JetStream backend is importable, and paged KV (`rollout.kv_page_size`) is asked of
    a decoder that has it: a hook of `gjax.config.validate`, before the model loads."""
    check_paged(config)
    if config.rollout.backend != "local":
        require_jetstream(
            f"config.rollout.backend={config.rollout.backend!r}",
            ", or use --config.rollout.backend=local",
        )
    if config.rollout.backend == "jetstream_grpc":
        schema.server_addresses(config.rollout)  # HOST:PORT each, once each


def check_paged(config) -> None:
    """`rollout.kv_page_size` > 0: the local continuous decoder (whole prefill) or a JetStream
    engine (in-process, or gjax.serve's, which read the same config), a page size dividing
    max_new_tokens, a pool holding one row; else one ConfigError paragraph."""
    r, page = config.rollout, config.rollout.kv_page_size
    if r.kv_pages and not page:
        raise ConfigError(
            f"config.rollout.kv_pages={r.kv_pages} sizes the paged KV pool, but "
            "rollout.kv_page_size=0 (contiguous slots). Set kv_page_size too, or leave "
            "kv_pages=0."
        )
    from gjax.rollout.pages import PAGED_ATTENTION

    if r.paged_attention not in PAGED_ATTENTION:
        raise ConfigError(
            f"config.rollout.paged_attention={r.paged_attention!r}: must be one of "
            f"{PAGED_ATTENTION} (auto: the platform's Pallas kernel on a GPU or TPU, XLA's "
            "gather on a CPU)."
        )
    kernel_platform = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(r.paged_attention)
    platform = jax.default_backend()
    if kernel_platform and platform not in ("cpu", kernel_platform):
        raise ConfigError(
            f"config.rollout.paged_attention={r.paged_attention!r} is the {kernel_platform} "
            f"kernel, but this run's devices are {platform}. Use 'auto' (the platform's "
            "kernel) or 'xla'."
        )
    if not page:
        return
    where = f"config.rollout.kv_page_size={page} (paged KV)"
    if r.backend == "local" and local_decoder(r.decoder) != "continuous":
        raise ConfigError(
            f"{where} pages the continuous decoder's KV, but this run samples with the "
            f"static sampler (rollout.decoder={r.decoder!r}). Use decoder auto or continuous, "
            "or leave kv_page_size=0."
        )
    if r.max_new_tokens % page:
        raise ConfigError(
            f"{where} must divide config.rollout.max_new_tokens={r.max_new_tokens}: a row's "
            f"own tokens fill whole pages. Choose a page size that divides it (e.g. "
            f"{math.gcd(page, r.max_new_tokens)}), or leave kv_page_size=0."
        )
    if r.kv_pages:
        from gjax.rollout.buckets import prefill_bucket, served_prompt_len

        engine = r.backend != "local"  # a region: the prefill bucket (a turn's history)
        width = prefill_bucket(served_prompt_len(config)) if engine else config.data.max_prompt_len
        from gjax.rollout.pages import min_pages

        need = min_pages(width, r.max_new_tokens, page)
        tail = ", 1 for a row's copy of its prompt's partial last page" if page > 1 else ""
        if r.kv_pages < need:
            raise ConfigError(
                f"config.rollout.kv_pages={r.kv_pages} cannot hold one row: {need - 1} pages of "
                f"{page} tokens ({-(-width // page)} for a {width}-token prompt, "
                f"{r.max_new_tokens // page} for max_new_tokens{tail}) and the null page. Give at "
                f"least {need}, or 0 for the contiguous layout's bytes."
            )
    if r.backend == "local" and r.prefill_chunk:
        raise ConfigError(
            f"{where} prefills each prompt whole; config.rollout.prefill_chunk="
            f"{r.prefill_chunk} (chunked prefill) is for the contiguous slots. Set one of "
            "them to 0."
        )


def local_decoder(decoder: str) -> str:
    """What `rollout.decoder` decodes with: 'auto' is continuous, on any number of processes
    (several: each decodes its own rows; two processes' rollouts equal one process's bit for
    bit, tests/test_multihost.py)."""
    return "static" if decoder == "static" else "continuous"


def make_backend(
    config, model_cfg: ModelConfig, params, *, mesh=None, workdir=None, tokenizer=None
) -> RolloutBackend:
    """The backend `config.rollout.backend` names: local (its `rollout.decoder`) | jetstream |
    jetstream_grpc."""
    r = config.rollout
    if r.backend == "local" and local_decoder(r.decoder) == "continuous":
        return LocalSampler(
            model_cfg, decoder=continuous_decoder(r, model_cfg), quantize=r.quantize
        )
    if r.backend == "local":
        return LocalSampler(model_cfg, quantize=r.quantize)
    if config.rollout.backend == "jetstream" and jax.process_count() > 1:
        raise ConfigError(
            "config.rollout.backend='jetstream' serves one process's rollouts in that process; "
            "a multi-process run samples with 'local' (each host its own rows) or with "
            "'jetstream_grpc' (gjax.serve replicas, config.rollout.server_addresses)"
        )
    require_jetstream(f"config.rollout.backend={config.rollout.backend!r}")
    from gjax.rollout import jetstream_backend  # optional dependency: JetStream

    return jetstream_backend.from_config(
        config, model_cfg, params, mesh=mesh, workdir=workdir, tokenizer=tokenizer
    )


def continuous_decoder(r, model_cfg: ModelConfig) -> ContinuousDecoder:
    """The continuous decoder `config.rollout` describes."""
    return ContinuousDecoder(
        model_cfg,
        slots=r.decode_slots,
        tokens_per_dispatch=r.tokens_per_dispatch,
        prefill_chunk=r.prefill_chunk,
        kv_page_size=r.kv_page_size,
        kv_pages=r.kv_pages or None,
        paged_attention=r.paged_attention,
    )


def evaluation_backend(config, backend: RolloutBackend, model_cfg: ModelConfig) -> RolloutBackend:
    """What held-out evaluations sample with: `backend`, except where a mid-run evaluation
    (`log.eval_every`, on the loop's thread) would push the learner's newest params to a
    backend that serves its own weights while the async producer's requests (rollout.
    max_staleness > 0) are in flight on it: their completions would come from a version they
    are not tagged with. Such runs evaluate with the in-process static sampler (greedy tokens
    equal to the servers', tests/test_jetstream.py), before, during and after training alike.
    Quantized rollouts (`rollout.quantize`) evaluate the learner's float policy, with the
    static sampler (the quantized sampler's copy stays the producer's alone); a multi-turn
    run's (env.name set) with a float continuous decoder of its own, as its held-out
    episodes need one (gjax.evaluation.episodes), a JetStream run's too (its greedy turns
    equal the server's; the server's sampling is the rollout's alone)."""
    if config.env.name and not isinstance(backend, LocalSampler):
        return LocalSampler(model_cfg, decoder=continuous_decoder(config.rollout, model_cfg))
    if config.rollout.max_staleness > 0 and not isinstance(backend, LocalSampler):
        return LocalSampler(model_cfg)
    if isinstance(backend, LocalSampler) and backend.quantize != "none":
        decoder = continuous_decoder(config.rollout, model_cfg) if config.env.name else None
        return LocalSampler(model_cfg, decoder=decoder)
    return backend
