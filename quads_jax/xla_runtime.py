"""Process-level XLA settings, made before JAX starts its backends.

XLA:GPU autotunes GEMMs and fusions when it compiles: it times candidate kernels and keeps
the fastest, so two processes compiling the same program may pick different kernels, which sum
in different orders. On an H100 (2026-12-07, 24-layer 30B-shaped rollout, nvfp4, same seed;
docs/BENCHMARKS.md "Session 46") two processes gave the same tokens but different prefill
states and log-probs; with autotuning off (``--xla_gpu_autotune_level=0``) three processes
repeated bit for bit, at a 4.7x slower prefill; with one autotune cache shared by two
processes both repeated at full speed. Within one process a compiled program repeats.
``use_autotune_cache`` is that shared cache: every process given the same directory (a run
and its resume, a rollout and its re-run) uses the kernels the first one measured.
"""

from __future__ import annotations

import os
import shlex

AUTOTUNE_CACHE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public query in jax 0.11

    return xla_bridge.backends_are_initialized()


def add_autotune_cache_argument(parser) -> None:
    """``--autotune-cache DIR`` on an entry point's argparse parser (train, sample,
    bench_rollout); the entry point passes its value to ``use_autotune_cache`` first thing."""
    parser.add_argument("--autotune-cache", metavar="DIR",
                        help="keep XLA:GPU's autotuning results in DIR, shared by every process "
                        "given it: their compiled GEMMs then sum in one order, so a re-run "
                        "repeats bit for bit (quads_jax.xla_runtime)")


def use_autotune_cache(directory: str | os.PathLike) -> str:
    """Keep XLA:GPU's autotuning results in ``directory`` (created if missing), read by every
    later compile in this and other processes. Appends ``AUTOTUNE_CACHE_FLAG`` to ``XLA_FLAGS``;
    returns the absolute directory. No effect on the CPU backend.

    Raises RuntimeError once JAX has started its backends (XLA reads ``XLA_FLAGS`` then, so
    the flag would be silently ignored), ValueError when ``XLA_FLAGS`` already names another
    autotune cache directory or ``directory`` is empty, a file or has whitespace."""
    if not str(directory):
        raise ValueError("use_autotune_cache: directory is empty; give a path to a directory")
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"use_autotune_cache: {path!r} is a file; give a directory")
    if any(c.isspace() for c in path):  # XLA_FLAGS splits on whitespace
        raise ValueError(f"use_autotune_cache: {path!r} has whitespace, which XLA_FLAGS "
                         "cannot carry; give a path without spaces")
    current = os.environ.get("XLA_FLAGS", "")
    flags = shlex.split(current)
    for flag in flags:
        name, _, value = flag.partition("=")
        if name == AUTOTUNE_CACHE_FLAG:
            if os.path.abspath(value) != path:
                raise ValueError(f"use_autotune_cache: XLA_FLAGS already sets {flag!r}; "
                                 f"asked for {path!r} (one cache per process)")
            return path
    if _backends_started():
        raise RuntimeError("use_autotune_cache: JAX has already started its backends, so XLA "
                           "would ignore the flag; call it before the first computation or "
                           f"set XLA_FLAGS={AUTOTUNE_CACHE_FLAG}={path} in the environment")
    os.makedirs(path, exist_ok=True)
    os.environ["XLA_FLAGS"] = f"{current} {AUTOTUNE_CACHE_FLAG}={path}".strip()
    return path
