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


def test_bench_rollout_runs_with_kernel_overrides(tmp_path):
    """``scripts/bench_rollout.py`` on the tiny model with an ablation flag that goes through
    ``kernel_backend.set_w4a4_overrides`` (session 19 passed it fields the config does not
    have, so every such flag raised): a row comes out, the flag is recorded."""
    import json
    import pathlib
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_rollout

    from quads_jax.models import layers
    from quads_jax.quant import kernel_backend

    argv = ["--tiny", "--batches", "2", "--prompts", "8", "--new-tokens", "8",
            "--decode-steps", "2", "--reps", "1", "--prefill-reps", "1", "--precisions",
            "nvfp4_rac", "--no-split", "--no-ragged", "--no-materialize-operands",
            "--no-rac-operand-kernel", "--rac-operand-padding", "skip", "--tile-plan-kernel",
            "--act-operand-kernel", "--tile-plan-block", "8", "--n-samples", "2",
            "--rac-placed-values",
            "--share-prompt-cache", "--attention-prefix-mode", "per_group",
            "--attention-prefix-rows", "2", "--layers", "1", "--prng-impl", "rbg",
            "--sampler", "gumbel", "--w4a4-set", "rac_operand_block_rows=4",
            "--w4a4-set", "operand_warps=2", "--w4a4-scales", "float8_e4m3fn",
            "--w4a4-set", "mma_k=128",  # also a dedicated flag's field (--w4a4-mma-k): wins
            "--pack-layer-vectors", "--fp8-set", "store_buffers=2",
            "--fp8-set", "windowed_operands=false", "--cb-schedule", "LHS",
            "--out", str(tmp_path)]
    try:
        assert bench_rollout.main(argv) == 0
        w4a4_seen = dict(kernel_backend._W4A4_OVERRIDES)
        fp8_seen = dict(kernel_backend._FP8_OVERRIDES)
    finally:
        kernel_backend.set_w4a4_overrides()
        kernel_backend.set_fp8_overrides()
        kernel_backend.set_grouped_barrier()
        kernel_backend.set_w4a4_bits()
        kernel_backend.set_w4a4_scale_dtype()
        layers.set_decode_attention("kernel")
    rows = [json.loads(line) for line in open(tmp_path / "rollout.jsonl")]
    assert [r["w4a4_scales"] for r in rows if r["kind"] == "device"] == ["float8_e4m3fn"]
    assert [r["pack_layer_vectors"] for r in rows if r["kind"] == "device"] == [True]
    assert [r["materialize_operands"] for r in rows if r["kind"] == "device"] == [False]
    assert [r["layers"] for r in rows if r["kind"] == "device"] == [1]  # --layers
    assert [r["rac_operand_kernel"] for r in rows if r["kind"] == "device"] == [False]
    assert [r["rac_operand_padding"] for r in rows if r["kind"] == "device"] == ["skip"]
    assert [(r["tile_plan_kernel"], r["act_operand_kernel"], r["tile_plan_block"])
            for r in rows if r["kind"] == "device"] == [(True, True, 8)]
    assert [r["rac_placed_values"] for r in rows if r["kind"] == "device"] == [True]
    assert [(r["sampler"], r["w4a4_set"], r["fp8_set"]) for r in rows
            if r["kind"] == "device"] == [
        ("gumbel", ["rac_operand_block_rows=4", "operand_warps=2", "mma_k=128"],
         ["store_buffers=2", "windowed_operands=false"])]
    assert (w4a4_seen["mma_k"], w4a4_seen["operand_warps"]) == (128, 2)
    assert (fp8_seen["windowed_operands"], fp8_seen["store_buffers"]) == (False, 2)
    assert [r["prng_impl"] for r in rows if r["kind"] == "device"] == ["rbg"]  # the engine
    # samples with an RngBitGenerator key as with a threefry one
    assert [(r["attention_prefix_mode"], r["attention_prefix_rows"], r["attention_prefix_splits"])
            for r in rows if r["kind"] == "device"] == [("per_group", 2, 4)]
    assert [(r["precision"], r["n_samples"], r["share_prompt_cache"])
            for r in rows if r["kind"] == "rollout"] == [("nvfp4_rac", 2, True)]
    # The decode program's command-buffer schedule (ignored on the CPU) and the digests that
    # show two schedules computed the same bits.
    (row,) = [r for r in rows if r["kind"] == "rollout"]
    assert row["cb_schedule"] == "LHS"
    assert all(len(row[k]) == 16 and int(row[k], 16) >= 0
               for k in ("tokens_digest", "logprobs_digest"))
    assert len(row["prefill_digest"]) == 8 and int(row["prefill_digest"], 16) >= 0
    assert bench_rollout.digest(np.arange(3)) != bench_rollout.digest(np.arange(1, 4))
    # The device-side checksum sees one changed bit and a swap of two values.
    tree = {"a": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3), "k": jax.random.key(0),
            "b": jnp.array([True, False]), "f": jnp.zeros((2, 2), jnp.float8_e4m3fn)}
    base = int(bench_rollout.state_checksum(tree))
    assert base == int(bench_rollout.state_checksum(jax.tree.map(lambda x: x, tree)))
    for changed in ({**tree, "a": tree["a"].at[1, 2].set(6)},
                    {**tree, "a": tree["a"][:, ::-1]},
                    {**tree, "b": ~tree["b"]},
                    {**tree, "k": jax.random.key(1)}):
        assert int(bench_rollout.state_checksum(changed)) != base


def test_bench_rollout_refuses_a_bad_w4a4_field():
    import pathlib
    import sys

    import pytest

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_rollout

    assert bench_rollout.set_fields(["mma_k=128", "rac_placed_values=false"]) == {
        "mma_k": 128, "rac_placed_values": False}
    with pytest.raises(ValueError, match="dotted"):
        bench_rollout.set_fields(["a.b=1"])
    with pytest.raises(ValueError, match="dotted.key=value"):
        bench_rollout.set_fields(["mma_k"])
    from quads_jax.quant import kernel_backend

    with pytest.raises(ValueError, match="unknown field"):
        kernel_backend.set_w4a4_overrides(**bench_rollout.set_fields(["no_such=1"]))
    with pytest.raises(ValueError, match="store_buffers=3"):
        kernel_backend.set_fp8_overrides(**bench_rollout.set_fields(["store_buffers=3"]))


def test_bench_kernels_w4a4_set_reaches_every_timed_config():
    """``bench_kernels.py --w4a4-set``: the fields go into every ``kcfg`` config (after the
    chosen variant's, before a row's own) and into the JSON; bad fields or values are refused
    before anything runs."""
    import pathlib
    import sys

    import pytest

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_kernels as bk

    from quads_jax import config as cfglib

    try:
        bk.set_overrides(cfglib.field_overrides(["compute_wgs=4", "n_group=2"], "--w4a4-set"))
        cfg = bk.kcfg(k_splits=2)
        assert (cfg.compute_wgs, cfg.n_group, cfg.k_splits) == (4, 2, 2)
        assert bk.kcfg(n_group=4).n_group == 4
        assert bk.RESULTS["w4a4_set"] == {"compute_wgs": 4, "n_group": 2}
        with pytest.raises(ValueError, match="--w4a4-set W4A4MatmulConfig: unknown field"):
            bk.set_overrides({"no_such": 1})
        with pytest.raises(ValueError, match="compute_wgs=4"):  # n_group 1 cannot pair
            bk.set_overrides({"compute_wgs": 4})
        assert bk.kcfg().compute_wgs == 4  # a refused set leaves the last one
    finally:
        bk.set_overrides({})
    assert bk.kcfg().compute_wgs == 2


def test_kernel_probe_residual_block_bits_and_kernel_only_variants():
    """``kernel_probe``'s random ``residual_blocks``: one bit per real 16-column block (none
    past K), about the asked fraction; the kernel-only variants cannot be GPU-checked."""
    import pathlib
    import sys

    import numpy as np
    import pytest

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import kernel_probe

    full = np.asarray(kernel_probe.residual_block_bits(2, 768, 1.0, seed=0))  # 48 blocks
    assert full.shape == (2, 2) and full.dtype == np.int32
    assert (full[:, 0] == -1).all() and (full[:, 1] == 0xFFFF).all()
    half = np.asarray(kernel_probe.residual_block_bits(128, 2048, 0.5, seed=1)).view(np.uint32)
    ones = sum(bin(int(v)).count("1") for v in half.ravel())
    assert 0.45 < ones / (128 * 128) < 0.55
    with pytest.raises(ValueError, match="the kernel alone"):
        kernel_probe.run_grouped_ablations(variants=(), checks=("default unstacked keep50",))
    with pytest.raises(ValueError, match="the kernel alone"):
        kernel_probe.run_grouped_ablations(variants=(), checks=("default wg4 rows32",))
    with pytest.raises(ValueError, match="check only"):
        kernel_probe.run_grouped_ablations(variants=("default unstacked selected",))


def test_bench_rollout_multiples_pair_each_case_with_its_baselines():
    """The summary's multiples: step and floor ratios against bf16 and fp8 of the same case
    only (batch, prompt, samples, shared cache); a case without a baseline gets no line."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_rollout

    def row(precision, batch, step, floor, prompt=256):
        return {"kind": "rollout", "precision": precision, "batch": batch, "prompt": prompt,
                "n_samples": 1, "share_prompt_cache": False, "decode_step_ms": step,
                "decode_floor_ms": floor}

    rows = [{"kind": "device"}, row("bf16", 128, 16.0, 12.0), row("fp8", 128, 10.0, 8.0),
            row("nvfp4_rac", 128, 8.0, 5.0), row("nvfp4_rac", 32, 6.0, 4.0),
            row("bf16", 128, 20.0, 15.0, prompt=1024)]
    assert bench_rollout.multiples(rows) == [
        "fp8 vs bf16 (batch 128, prompt 256): 1.60x the decode step, 1.50x by the floors",
        "nvfp4_rac vs bf16 (batch 128, prompt 256): 2.00x the decode step, 2.40x by the floors",
        "nvfp4_rac vs fp8 (batch 128, prompt 256): 1.25x the decode step, 1.60x by the floors",
    ]


def test_bench_continuous_runs_every_schedule_on_one_workload(tmp_path):
    """``scripts/bench_continuous.py`` on the tiny model: one row per schedule, each with the
    responses it made and a batch utilisation in (0, 1]."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_continuous

    argv = ["--tiny", "--sequences", "8", "--n-samples", "2", "--batch-rows", "4", "--prompt",
            "6", "--new-tokens", "6", "--stop-fraction", "0.1", "--segment-steps", "2",
            "--share-prompt-cache", "--attention-prefix-mode", "per_group", "--layers", "1",
            "--out", str(tmp_path)]
    assert bench_continuous.main(argv) == 0
    rows = [json.loads(line) for line in open(tmp_path / "continuous.jsonl")]
    assert [r["attention_prefix_mode"] for r in rows if r["kind"] == "device"] == ["per_group"]
    assert [r["layers"] for r in rows if r["kind"] == "device"] == [1]
    runs = {r["schedule"]: r for r in rows if r["kind"] == "schedule"}
    assert sorted(runs) == ["compacting", "continuous", "static"]
    for r in runs.values():
        assert 8 <= r["response_tokens"] <= 8 * 6 and 0 < r["utilisation"] <= 1, r
    assert runs["continuous"]["segments"] >= 2


def test_kernel_probe_shared_prefix_attention_dry_run():
    """``kernel_probe.py --attention-prefix`` (the next GPU call's probe) on tiny shapes in
    interpret mode: the checks pass (per_group against per_row included) and both layouts
    are timed, the shared one in both prefix modes."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_kernels as bk
    import kernel_probe

    checks, timings = len(bk.RESULTS["checks"]), len(bk.RESULTS["timings"])
    kernel_probe.run_attention_prefix(shape=(4, 2, 2, 4, 32, 31, 32, 2), interpret=True)
    assert [c["ok"] for c in bk.RESULTS["checks"][checks:]] == [True, True, True]
    names = [r["name"] for r in bk.RESULTS["timings"][timings:]]
    assert len(names) == 3 and "copied prompt" in names[2]
    assert "shared prefix per_row" in names[0] and "shared prefix per_group" in names[1]


def test_bench_kernels_smoke_dense_rows_run_on_the_cpu(monkeypatch):
    """``bench_kernels.py --smoke``'s dense table (the tile GEMM and the Triton kernels around
    it replaced by their jnp paths) on one tiny shape: every row is timed. It broke unseen when
    the operand and tile-plan kernels became defaults (Triton cannot run on the CPU)."""
    import pathlib
    import sys

    from pallas_kernels import w4a4_matmul as wm
    from pallas_kernels import w8a8_matmul as w8

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    import bench_kernels as bk

    # enable_smoke swaps the tile GEMMs for jnp stand-ins in their modules: put them back after
    # the test (the cuda-lowering tests in the same worker would lower the stand-ins)
    monkeypatch.setattr(wm, "nvfp4_tile_gemm", wm.nvfp4_tile_gemm)
    monkeypatch.setattr(w8, "fp8_tile_gemm", w8.fp8_tile_gemm)
    saved = dict(bk.BEST)
    rows = len(bk.RESULTS["timings"])
    try:
        bk.enable_smoke()
        bk.bench_dense(shapes=((256, 128),), extra=False)
    finally:
        bk.BEST.update(saved)
        bk.SMOKE = False
    names = [r["name"] for r in bk.RESULTS["timings"][rows:]]
    assert len(names) == 5 and names[0].startswith("w4a4 [auto] M=16 K=256 N=128"), names
    # the rollout's weight layout (E4M3 block scales: 0.5625 streamed bytes per weight), not
    # float16 scales (0.625), which the tables measured until session 42
    note = bk.RESULTS["timings"][rows]["note"]
    assert note.endswith("(float8_e4m3fn scales)"), note


def test_trainer_bench_reports_each_arm(capsys):
    """``python -m quads_jax.train.bench`` on a one-layer model: both recipes, both grouped
    arms (on the CPU both are XLA's: ``grouped_ran``), first losses compared, and
    ``--profile-top`` adds a profile (empty: no GPU plane on the CPU)."""
    import json
    import pathlib

    from quads_jax.train import bench as train_bench

    tiny = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    args = ["--config", str(tiny), "--batch", "2", "--seq", "16", "--repeats",
            "1", "--grouped", "both", "--dw", "xla", "--profile-top", "3",
            "model.config.num_hidden_layers=1"]
    assert train_bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["results"]
    assert [(r["recipe"], r["grouped"]) for r in rows] == [
        ("bf16", "kernel"), ("bf16", "xla"), ("trainer_qat", "kernel"), ("trainer_qat", "xla")]
    assert all(r["grouped_ran"] == "xla" and r["median_s"] > 0 and r["profile"] == {}
               for r in rows)
    assert rows[1]["first_loss_rel_diff_to_kernel"] < 1e-5  # the same path on the CPU
    assert rows[0]["first_loss"] > 0 and out["params"] > 0
