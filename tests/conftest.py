"""Test-wide setup: 8 fake CPU devices so sharding tests can build meshes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# gcsfs reads this when imported: with it on, gcsfs asks the Storage Control gRPC API (which the
# GCS emulator of tests/gcs_emulator.py does not serve) for each bucket's type, 60 s per bucket.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from tests.gcs_emulator import gcs  # noqa: E402, F401 - fixture: a GCS emulator on 127.0.0.1
