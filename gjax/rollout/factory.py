"""`make_backend`: the rollout backend `config.rollout.backend` names, chosen once at set-up.

Above `backend.py` and the backends themselves (it imports them; they import the seam).
"""

from __future__ import annotations

import jax

from gjax.errors import ConfigError
from gjax.models.config import ModelConfig
from gjax.rollout.backend import LocalSampler, RolloutBackend


def make_backend(
    config, model_cfg: ModelConfig, params, *, mesh=None, workdir=None, tokenizer=None
) -> RolloutBackend:
    """The backend `config.rollout.backend` names: local | jetstream | jetstream_grpc."""
    if config.rollout.backend == "local":
        return LocalSampler(model_cfg)
    if jax.process_count() > 1:
        raise ConfigError(
            f"config.rollout.backend={config.rollout.backend!r} serves one process's rollouts; "
            "a multi-process run samples with 'local' (each host its own rows)"
        )
    try:  # optional dependency: google-jetstream (the jetstream extra)
        from gjax.rollout import jetstream_backend
    except ImportError as e:
        raise ConfigError(
            f"config.rollout.backend={config.rollout.backend!r} needs JetStream ({e}); install "
            "it with `pip install --no-deps google-jetstream==0.2.2` on top of the test extra "
            "(or `pip install -e '.[jetstream]'`, which also pulls TensorFlow), or use 'local'"
        ) from e
    return jetstream_backend.from_config(
        config, model_cfg, params, mesh=mesh, workdir=workdir, tokenizer=tokenizer
    )
