"""quads_jax.profiling on a real CPU trace (GPU planes have the same structure)."""

import jax
import jax.numpy as jnp
import pytest

from quads_jax import profiling


def test_summary_counts_events_of_the_selected_lines(tmp_path, monkeypatch):
    import os

    used, real_trace = [], jax.profiler.trace
    monkeypatch.setattr(jax.profiler, "trace", lambda d, *a, **k: (used.append(d),
                                                                   real_trace(d, *a, **k))[1])
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((128, 128))
    f(x).block_until_ready()
    def run():
        for _ in range(3):
            f(x).block_until_ready()

    s = profiling.trace(run, f"test_{tmp_path.name}", plane_prefix="/host:CPU",
                            line_prefix="python", steps=3)
    (plane,) = s.values()
    assert plane["kernels"] > 0 and 0 < plane["busy_ms"]
    assert plane["span_ms"] > 0
    names = [k["name"] for k in plane["top"]]
    assert any("PjitFunction" in n for n in names), names
    pjit = next(k for k in plane["top"] if "PjitFunction" in k["name"])
    assert pjit["count"] >= 1.0  # >= 3 events (one per call, some nested) over 3 steps
    assert "kernels, busy" in profiling.format_summary(s)
    assert len(used) == 1 and not os.path.exists(used[0])  # the temporary trace is removed
    kept = tmp_path / "kept"
    s2 = profiling.trace(run, "kept", logdir=str(kept), plane_prefix="/host:CPU",
                         line_prefix="python", steps=3)
    assert s2.keys() == s.keys() and list(kept.rglob("*.xplane.pb"))  # a given logdir stays
    # No GPU plane on the CPU: nothing is reported rather than something made up.
    with jax.profiler.trace(str(tmp_path)):
        f(x).block_until_ready()
    assert profiling.summarize(str(tmp_path)) == {}


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.xplane.pb"):
        profiling.summarize(str(tmp_path))
    with pytest.raises(ValueError, match="steps=0"):
        profiling.summarize(str(tmp_path), steps=0)
