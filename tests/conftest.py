"""Test-wide setup: CPU only, 8 fake devices for sharding tests, quiet JAX."""

import os

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# XLA's CPU code generation without LLVM's optimizations: the suite's programs are tiny, so
# compiling them is most of its time (engine + sync + loop + the W4A4 interpret tests: 278
# against 411 s on 2 cores). What the tests check does not depend on the level, but the
# bit-identity tests (marker `numerics`) are where a level could show, so `make test` runs
# them again at XLA's default level, the one `make demo` and the GPU runs use.
# QUADS_TEST_XLA_OPT=default keeps XLA's default level for the whole run.
if os.environ.get("QUADS_TEST_XLA_OPT", "0") != "default" and (
        "xla_backend_optimization_level" not in _flags):
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None)
settings.load_profile("ci")

# One persistent compilation cache for the whole run, shared by the xdist workers (the
# controller makes the directory before it starts them, and removes it at exit): many tests
# compile the same tiny model's programs, and a hit skips XLA's compile (tests/sampler: 172 ->
# 155 s). Every compile is written, however short: the interpret-mode kernel tests run their
# kernels op by op, and each op's first call compiles a tiny program (~20 ms, some 700 in
# test_grouped_plain_decode_runs_wide_with_the_same_bits alone) that every worker would compile
# again (that test from a warm cache: 29 -> 12 s). QUADS_TEST_COMPILE_CACHE=0 turns it off.
if os.environ.get("QUADS_TEST_COMPILE_CACHE", "1") != "0":
    if "QUADS_TEST_COMPILE_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        _cache_dir = tempfile.mkdtemp(prefix="quads_xla_cache_")
        os.environ["QUADS_TEST_COMPILE_CACHE_DIR"] = _cache_dir
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    import jax  # noqa: E402

    jax.config.update("jax_compilation_cache_dir", os.environ["QUADS_TEST_COMPILE_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
