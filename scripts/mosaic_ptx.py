"""The grouped W4A4 tile kernel compiled to PTX and SASS on a machine without a GPU.

jax's CUDA plugin compiles a Mosaic GPU kernel (MLIR -> PTX -> ptxas) in ``MosaicGpuCompile``,
which asks the driver only for the device's compute capability first. With the plugin's wheels
unpacked and a stand-in ``libcuda.so.1`` (``scripts/cpu_cuda/fake_libcuda.c``: sm_90, every
module load refused) the kernel compiles here, and ``MOSAIC_GPU_DUMP_PTX`` / ``_PTXAS`` write
what the device would: in session 48 the two-pair RAC kernel's PTX and ptxas notes came out
identical to the H100's dump. So register, spill and wgmma-issue questions about a config cost
no device time:

    python scripts/mosaic_ptx.py --setup              # once: wheels + fake libcuda (~140 MB)
    PYTHONPATH=. python scripts/mosaic_ptx.py --variants "default,default wg4" --shapes gate_up

Per kernel (``kernel_probe``'s ``GROUPED_VARIANTS`` names at the decode step's shapes: 128
experts, 192 token tiles of 16 rows, gate_up 1536 x 2048 / down 2048 x 768, or issue 4's
dense decode, 16 tokens through 4096 -> 14336; with and without RAC's second operand) it
prints ``sass_stats``'s line: registers a thread, spill bytes, ptxas's C75xx notes (C7512: wgmmas serialized for want of registers), HGMMA shapes and counts, wgmma
waits, local loads / stores. The numbers are compile-time facts, not timings.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TOOLS = os.path.expanduser("~/.cache/quads_jax/cpu_cuda")
WHEELS = ("jax-cuda13-plugin", "jax-cuda13-pjrt")
# (experts, token tiles, N, K): Qwen3-30B-A3B's experts at the decode step (128 sequences,
# top-8: 192 tiles of 16 rows at most), and issue 4's dense decode (16 tokens, 4096 -> 14336).
SHAPES = {"gate_up": (128, 192, 1536, 2048), "down": (128, 192, 2048, 768),
          "dense": (1, 1, 14336, 4096)}
TILE_ROWS = 16
ENV_MARK = "QUADS_MOSAIC_PTX_CHILD"


def tool_paths(tools: str) -> dict:
    """Where ``--setup`` puts the plugin library, the Mosaic runtime and the fake libcuda."""
    return {"plugin": os.path.join(tools, "pjrt", "jax_plugins", "xla_cuda13",
                                   "xla_cuda_plugin.so"),
            "runtime": os.path.join(tools, "plugin", "jax_cuda13_plugin",
                                    "libmosaic_gpu_runtime.so"),
            "libcuda_dir": os.path.join(tools, "libcuda")}


def setup(tools: str) -> None:
    """Download the CUDA plugin wheels of the installed jax version, unpack them, and build the
    fake libcuda with the system C compiler. Idempotent."""
    import zipfile

    import jax

    paths = tool_paths(tools)
    for name, sub in zip(WHEELS, ("plugin", "pjrt"), strict=True):
        target = os.path.join(tools, sub)
        if os.path.isdir(target):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "--only-binary=:all:", f"{name}=={jax.__version__}", "-d", tmp],
                           check=True)
            (wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
            zipfile.ZipFile(wheel).extractall(target)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc / gcc) to build the fake libcuda")
    os.makedirs(paths["libcuda_dir"], exist_ok=True)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o",
                    os.path.join(paths["libcuda_dir"], "libcuda.so.1"),
                    os.path.join(HERE, "cpu_cuda", "fake_libcuda.c")], check=True)
    for p in paths.values():
        if not os.path.exists(p):
            raise FileNotFoundError(f"setup did not produce {p}")
    print(f"CPU CUDA tools in {tools}")


def child_env(tools: str, dump_dir: str) -> dict:
    """The environment the compiling process needs from its start (the dynamic loader reads
    LD_LIBRARY_PATH once): the fake libcuda first, the Mosaic runtime, and the dumps."""
    paths = tool_paths(tools)
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"missing {missing}: run `python scripts/mosaic_ptx.py "
                                f"--setup --tools {tools}` first")
    if shutil.which("ptxas") is None:
        raise FileNotFoundError("ptxas not on PATH (a CUDA 13 toolkit's bin)")
    env = dict(os.environ)
    env.update({
        ENV_MARK: "1",
        "LD_LIBRARY_PATH": ":".join(filter(None, [paths["libcuda_dir"],
                                                  env.get("LD_LIBRARY_PATH")])),
        "MOSAIC_GPU_RUNTIME_LIB_PATH": paths["runtime"],
        "MOSAIC_GPU_CUDA_ROOT": os.path.dirname(os.path.dirname(shutil.which("ptxas"))),
        "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
        "MOSAIC_GPU_DUMP_TO": dump_dir,
        "JAX_PLATFORMS": "cpu",
    })
    return env


def kernel_modules(variant: str, shape: str, operands: int) -> list[bytes]:
    """The Mosaic GPU modules of ``nvfp4_tile_gemm`` at the decode step's ``shape`` with
    ``operands`` B operands (2: RAC) under ``variant``'s ``TileGemmConfig`` fields, lowered
    for cuda under an abstract H200 (jax.export; nothing runs)."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax.experimental.mosaic.gpu import core as mgpu_core
    from jax.sharding import AbstractDevice, AbstractMesh

    sys.path.insert(0, HERE)
    import kernel_probe

    from pallas_kernels.layout import prepare_w4a4_weights
    from pallas_kernels.nvfp4_tiles_mgpu import K_TILE, N_TILE, TileGemmConfig, nvfp4_tile_gemm
    from pallas_kernels.w4a4_matmul import auto_k_splits
    from quads_jax.quant import nvfp4

    known = dict(kernel_probe.GROUPED_VARIANTS)
    if variant not in known:
        raise ValueError(f"unknown variant {variant!r}; one of {sorted(known)}")
    # (narrow_frac lays out the probe's windows: the kernel compiled is the same)
    (bits, scales), rows, keep, _, kw = kernel_probe.variant_fields(known[variant], TILE_ROWS)
    if keep is not None:
        raise ValueError(f"variant {variant!r}: residual_blocks variants are not compiled here")
    experts, tiles, n, k = SHAPES[shape]
    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", platform="gpu", num_cores=132))
    wq = jax.eval_shape(lambda: nvfp4.quantize(jnp.zeros((experts, n, k)), scale_mode="expert"))
    w = jax.eval_shape(lambda q: prepare_w4a4_weights(q, mma_dtype="float16", decode="subnormal",
                                                      bits=bits, scale_dtype=scales), wq)
    b = tuple(jax.ShapeDtypeStruct((tiles, rows, k), jnp.float16) for _ in range(operands))
    te = jax.ShapeDtypeStruct((tiles,), jnp.int32)
    nt = jax.ShapeDtypeStruct((1,), jnp.int32)
    cs = jax.ShapeDtypeStruct((tiles, operands, rows), jnp.float32)
    # split-K as the grouped / dense matmuls choose it for this many work items on 132 SMs
    ks = auto_k_splits(tiles * (n // N_TILE // kw.get("n_group", 1)), k // K_TILE, 132)
    cfg = TileGemmConfig(decode_impl="ptx", num_sms=132, k_splits=ks, **kw)
    out_dtype = jnp.bfloat16 if ks == 1 else jnp.float32
    mgpu_core.KNOWN_KERNELS.clear()
    with jax.sharding.use_abstract_mesh(mesh):
        export.export(jax.jit(lambda b, w, te, nt, cs: nvfp4_tile_gemm(
            b, w, te, nt, config=cfg, col_scales=cs, out_dtype=out_dtype)),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(
                b, w, te, nt, cs)
    return list(mgpu_core.KNOWN_KERNELS.values())


def compile_and_report(variants: list[str], shapes: list[str], rac: list[int], tools: str,
                       dump_dir: str) -> list[tuple[str, dict]]:
    """In the child process: compile each kernel with the plugin (the fake libcuda refuses the
    load after the dumps) and read its PTX with ``sass_stats``."""
    import sass_stats

    lib = ctypes.CDLL(tool_paths(tools)["plugin"])
    compile_fn = lib.MosaicGpuCompile
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    cuobjdump = _cuobjdump()
    rows = []
    for variant in variants:
        for shape in shapes:
            for operands in rac:
                before = set(glob.glob(os.path.join(dump_dir, "*.ptx")))
                for module in kernel_modules(variant, shape, operands):
                    compile_fn(ctypes.c_char_p(module), ctypes.c_int(len(module)))
                new = sorted(set(glob.glob(os.path.join(dump_dir, "*.ptx"))) - before)
                label = f"{shape} {variant}{' +RAC' if operands == 2 else ''}"
                if len(new) != 1:
                    raise RuntimeError(f"{label}: expected one new PTX dump in {dump_dir}, "
                                       f"got {new}")
                rows.append((label, sass_stats.analyse(new[0], None, None, "ptxas", cuobjdump)))
    return rows


def _cuobjdump() -> str | None:
    """cuobjdump's path, or None (ptxas's notes only, no SASS counts)."""
    import sass_stats

    try:
        return sass_stats.find_cuobjdump()
    except FileNotFoundError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="download and build the tools, then exit")
    p.add_argument("--tools", default=DEFAULT_TOOLS, help="where --setup puts them")
    p.add_argument("--variants", default="default,default wg4",
                   help="comma-separated kernel_probe GROUPED_VARIANTS names")
    p.add_argument("--shapes", default="gate_up,down", help=f"comma-separated of {list(SHAPES)}")
    p.add_argument("--rac", default="both", choices=("both", "on", "off"))
    p.add_argument("--dump-dir", default=None, help="keep the dumps here (default: a temp dir)")
    args = p.parse_args(argv)
    if args.setup:
        setup(args.tools)
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in shapes if s not in SHAPES]:
        raise SystemExit(f"--shapes {bad}: one of {list(SHAPES)}")
    variants = [v for v in args.variants.split(",") if v]
    rac = {"both": [1, 2], "on": [2], "off": [1]}[args.rac]
    if os.environ.get(ENV_MARK) != "1":  # re-run with the loader and dump environment set
        dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="mosaic_ptx_")
        os.makedirs(dump_dir, exist_ok=True)
        env = child_env(args.tools, dump_dir)
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        if args.dump_dir is None:
            cmd += ["--dump-dir", dump_dir]
        return subprocess.run(cmd, env=env).returncode
    sys.path.insert(0, HERE)
    for label, r in compile_and_report(variants, shapes, rac, args.tools, args.dump_dir):
        print(f"{label:48s} " + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    print(f"dumps: {args.dump_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
