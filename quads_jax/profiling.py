"""Where a traced program's device time goes: kernel totals from a ``jax.profiler`` trace.

``summarize(logdir)`` reads the newest ``*.xplane.pb`` under ``logdir`` (written by
``jax.profiler.trace``) with ``jax.profiler.ProfileData`` and returns, per device plane
(``/device:GPU:0``, ...): the kernels' summed duration (``busy_ms``), the span from the first
kernel's start to the last one's end (``span_ms``), the kernel count and the top kernels by
summed duration. ``busy_ms / span_ms`` well below 1 means the device waits on the host
(launches, host syncs of while loops), not on its kernels.

  python -m quads_jax.profiling LOGDIR [--top 20] [--plane-prefix /device:GPU]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys


def newest_xplane(logdir: str) -> str:
    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir!r}: was jax.profiler.trace run "
                                "with this log directory?")
    return max(files, key=os.path.getmtime)


def short_name(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def summarize(logdir: str, *, top: int = 20, plane_prefix: str = "/device:GPU",
              line_prefix: str = "Stream", steps: int = 1) -> dict:
    """Kernel totals per device plane; times per step when ``steps`` steps were traced.

    Returns ``{plane name: {"kernels", "busy_ms", "span_ms", "busy_fraction",
    "top": [{"name", "count", "total_ms", "mean_us"}]}}`` (ms and counts divided by ``steps``).
    """
    from jax.profiler import ProfileData  # a jax import only where it is needed

    if steps < 1:
        raise ValueError(f"steps={steps}: the number of traced steps must be >= 1")
    data = ProfileData.from_file(newest_xplane(logdir))
    out = {}
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        starts, ends, busy, count = [], [], 0.0, 0
        for line in plane.lines:
            # Device planes hold one line per stream plus derived lines ("XLA Ops", "XLA
            # Modules", "Steps"), which repeat the kernels' time: count stream lines only.
            if not line.name.startswith(line_prefix):
                continue
            for ev in line.events:
                dur = float(ev.duration_ns)
                totals[ev.name][0] += 1
                totals[ev.name][1] += dur
                starts.append(float(ev.start_ns))
                ends.append(float(ev.start_ns) + dur)
                busy += dur
                count += 1
        if not count:
            continue
        span = max(ends) - min(starts)
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
        out[plane.name] = dict(
            kernels=count / steps, busy_ms=busy / 1e6 / steps, span_ms=span / 1e6 / steps,
            busy_fraction=busy / span if span else 0.0,
            top=[dict(name=short_name(n), count=c / steps, total_ms=t / 1e6 / steps,
                      mean_us=t / c / 1e3) for n, (c, t) in ranked])
    return out


def trace(run, tag: str, logdir: str | None = None, **summarize_kwargs) -> dict:
    """Call ``run()`` (it must block until the device is done) under ``jax.profiler`` and
    return ``summarize`` of the trace. ``logdir``: where the trace stays (for TensorBoard or
    Perfetto); None: a temporary directory named by ``tag``, removed afterwards (a benchmark
    traces every row: their traces filled ``/tmp``)."""
    import contextlib
    import tempfile

    import jax

    where = (contextlib.nullcontext(logdir) if logdir is not None
             else tempfile.TemporaryDirectory(prefix=f"quads_trace_{tag}_"))
    with where as d:
        with jax.profiler.trace(d):
            run()
        return summarize(d, **summarize_kwargs)


def format_summary(summary: dict) -> str:
    lines = []
    for plane, s in summary.items():
        lines.append(f"{plane}: {s['kernels']:.0f} kernels, busy {s['busy_ms']:.3f} ms of a "
                     f"{s['span_ms']:.3f} ms span ({100 * s['busy_fraction']:.0f}%) per step")
        for k in s["top"]:
            lines.append(f"  {k['total_ms']:8.3f} ms {k['count']:6.0f}x {k['mean_us']:8.1f} us  "
                         f"{k['name']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logdir")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--steps", type=int, default=1, help="steps traced (per-step numbers)")
    p.add_argument("--plane-prefix", default="/device:GPU")
    p.add_argument("--line-prefix", default="Stream")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    s = summarize(args.logdir, top=args.top, plane_prefix=args.plane_prefix,
                  line_prefix=args.line_prefix, steps=args.steps)
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
