"""quads_jax.xla_runtime: the shared XLA autotune cache (reproducible compiles across processes)."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from quads_jax import xla_runtime

FLAG = xla_runtime.AUTOTUNE_CACHE_FLAG
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_refuses_bad_directories_and_a_started_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        xla_runtime.use_autotune_cache(tmp_path / "f")
    with pytest.raises(ValueError, match="whitespace"):
        xla_runtime.use_autotune_cache(tmp_path / "a b")
    with pytest.raises(ValueError, match="empty"):
        xla_runtime.use_autotune_cache("")
    jnp.zeros(1).block_until_ready()  # the backends are started (as in every test)
    with pytest.raises(RuntimeError, match="already started its backends"):
        xla_runtime.use_autotune_cache(tmp_path / "cache")
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"  # left as it was
    assert not (tmp_path / "cache").exists()
    # the flag already in XLA_FLAGS: the same directory is accepted, another refused
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}={tmp_path}/cache")
    assert xla_runtime.use_autotune_cache(tmp_path / "cache") == str(tmp_path / "cache")
    with pytest.raises(ValueError, match="already sets"):
        xla_runtime.use_autotune_cache(tmp_path / "other")


def test_sets_the_flag_before_the_backends_start(tmp_path):
    """In a fresh process, after the entry points' imports (none may start a backend): the flag
    is appended to XLA_FLAGS, the directory made, and XLA takes the flag (a computation runs)."""
    code = f"""
import os, sys
sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r})
import bench_rollout, quads_jax.sample, quads_jax.train.__main__
from quads_jax import xla_runtime
path = xla_runtime.use_autotune_cache({str(tmp_path / 'cache')!r})
import jax.numpy as jnp
print(os.environ["XLA_FLAGS"], os.path.isdir(path), float(jnp.arange(4.0).sum()))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_enable_fast_math=false", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["--xla_cpu_enable_fast_math=false",
                                  f"{FLAG}={tmp_path / 'cache'}", "True", "6.0"]


def test_entry_points_report_a_bad_cache_directory(tmp_path, capsys):
    from quads_jax import sample
    from quads_jax.train.__main__ import main as train_main

    bad = tmp_path / "file"
    bad.write_text("")
    assert train_main(["--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                       "--autotune-cache", str(bad)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert sample.main(["--checkpoint", str(tmp_path), "--prompt", "a",
                        "--autotune-cache", str(bad)]) != 0
    assert "is a file" in capsys.readouterr().err
