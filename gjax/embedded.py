"""The embedded default policy shipped inside the package (see scripts/make_tiny_policy.py)."""

from __future__ import annotations

import os

from gjax.errors import ConfigError

PREFIX = "embedded:"
ASSETS = os.path.join(os.path.dirname(__file__), "assets")


def resolve_model_path(path: str) -> str:
    """`embedded:NAME` -> the packaged checkpoint dir; any other path is returned unchanged."""
    if not path.startswith(PREFIX):
        return path
    local = os.path.join(ASSETS, path[len(PREFIX) :])
    if not os.path.isdir(local):
        raise ConfigError(
            f"config.model.path: embedded policy {path!r} not found at {local}; "
            "regenerate it with `python scripts/make_tiny_policy.py`"
        )
    return local
