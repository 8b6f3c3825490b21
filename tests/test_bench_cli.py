"""The ``python -m quads_jax.bench`` front door and the numerics report it runs."""

from quads_jax import bench


def test_unknown_benchmark_is_refused(capsys):
    assert bench.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_numerics_report_runs_and_ranks_formats(capsys):
    assert bench.main(["numerics", "--rows", "32", "--cols", "256"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if line.startswith("gaussian") and "%" in line:
            fmt = " ".join(parts[1:-3])
            rows[fmt] = float(parts[-3].rstrip("%"))
    # FP8 has 3 mantissa bits against E2M1's 1: a real report shows it ~4x more accurate.
    assert rows["fp8 e4m3 (row)"] * 2 < rows["nvfp4 (tensor)"] < 20.0, rows
    assert "W4A4+RAC(all)" in out
