"""What the 4-bit format costs: NVFP4 vs FP8 vs a power-of-two-scale FP4 (MXFP4-like).

Quantizes gaussian, heavy-tailed (Student-t, 3 dof) and outlier-channel matrices and prints the
relative Frobenius error, SQNR and flush-to-zero rate of each format, for weights (per-tensor /
per-channel scales) and activations (per-token scales). Also the error of a W4A4 product with and
without residual activation compensation of all channels (RAC at ratio 1.0 = two-pass FP4
activations), the upper bound of what RAC buys.

    python scripts/nvfp4_report.py [--rows 512] [--cols 2048] [--seed 0]
"""

from __future__ import annotations

import argparse

import jax

from quads_jax.quant import fp8, mxfp4, nvfp4
from quads_jax.quant.metrics import flush_to_zero_rate, rel_fro_error, sqnr_db


def make_matrices(key: jax.Array, rows: int, cols: int) -> dict[str, jax.Array]:
    """Three test distributions, float32 ``[rows, cols]``."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    gauss = jax.random.normal(k1, (rows, cols))
    student = jax.random.t(k2, 3.0, (rows, cols))
    outlier = jax.random.normal(k3, (rows, cols))
    channels = jax.random.choice(k4, cols, (max(1, cols // 64),), replace=False)
    outlier = outlier.at[:, channels].multiply(50.0)  # a few hot channels, as in LLM activations
    return {"gaussian": gauss, "student_t3": student, "outlier_channels": outlier}


FORMATS = {
    "nvfp4 (tensor)": lambda x: nvfp4.qdq(x),
    "nvfp4 (row)": lambda x: nvfp4.qdq(x, scale_mode="row"),
    "mxfp4-like": mxfp4.qdq,
    "fp8 e4m3 (row)": lambda x: fp8.qdq(x, granularity="token"),
    "fp8 e4m3 (1x128)": lambda x: fp8.qdq(x, granularity="block1x128"),
}


def format_table(x: jax.Array) -> list[tuple[str, float, float, float]]:
    rows = []
    for name, fn in FORMATS.items():
        xh = fn(x)
        rows.append(
            (
                name,
                float(rel_fro_error(x, xh)),
                float(sqnr_db(x, xh)),
                float(flush_to_zero_rate(x, xh)),
            )
        )
    return rows


def rac_gain(x: jax.Array, w: jax.Array) -> tuple[float, float, float]:
    """Relative error of ``X W^T`` for W4A16, W4A4, and W4A4 with the full residual re-quantized."""
    ref = x @ w.T
    wq = nvfp4.qdq(w)
    qx = nvfp4.quantize(x, scale_mode="row")
    xq = nvfp4.dequantize(qx)
    r = nvfp4.residual(x, qx)
    rq = nvfp4.qdq(r, scale_mode="row")
    w4a16 = float(rel_fro_error(ref, x @ wq.T))
    w4a4 = float(rel_fro_error(ref, xq @ wq.T))
    rac = float(rel_fro_error(ref, (xq + rq) @ wq.T))
    return w4a16, w4a4, rac


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.cols % 128:
        p.error(f"--cols={a.cols} must be a multiple of 128 (FP8 1x128 blocks)")
    mats = make_matrices(jax.random.PRNGKey(a.seed), a.rows, a.cols)
    print(f"NVFP4 numerics report: matrices [{a.rows}, {a.cols}], seed {a.seed}\n")
    print(f"{'distribution':<18} {'format':<18} {'rel. Frob. err':>14} {'SQNR dB':>8} {'flush-to-0':>10}")
    for dist, x in mats.items():
        for name, err, sq, ftz in format_table(x):
            print(f"{dist:<18} {name:<18} {err:>14.4%} {sq:>8.2f} {ftz:>10.4%}")
        print()
    w = jax.random.normal(jax.random.PRNGKey(a.seed + 1), (a.cols // 2, a.cols)) * 0.02
    print("GEMM X W^T error (W: gaussian, NVFP4 per tensor; X: NVFP4 per token)")
    print(f"{'X distribution':<18} {'W4A16':>9} {'W4A4':>9} {'W4A4+RAC(all)':>14}")
    for dist, x in mats.items():
        e16, e4, erac = rac_gain(x, w)
        print(f"{dist:<18} {e16:>9.4%} {e4:>9.4%} {erac:>14.4%}")


if __name__ == "__main__":
    main()
