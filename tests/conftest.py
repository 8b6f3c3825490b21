"""Test-wide setup: CPU only, 8 fake devices for sharding tests, quiet JAX."""

import os

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None)
settings.load_profile("ci")
