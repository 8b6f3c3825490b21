"""Register and wgmma facts of Mosaic GPU kernels from their dumped PTX, without a GPU.

Mosaic GPU writes each kernel's PTX with ``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR``
(``h200_next.sh pair2`` keeps them in ``dump2.tgz``). ptxas (CUDA 13, ``/usr/local/bin/ptxas``
on this machine) recompiles that PTX for sm_90a here to the same notes the device printed, and
cuobjdump (the ``nvidia-cuda-cuobjdump`` wheel, or a CUDA toolkit) disassembles the result, so
questions about registers and wgmma issue can be answered on the CPU:

    python scripts/sass_stats.py DIR/kernel_1.ptx DIR/kernel_2.ptx
    python scripts/sass_stats.py DIR/kernel_2.ptx --compute-registers 112 --memory-registers 24

``--compute-registers`` / ``--memory-registers`` rewrite the kernel's ``setmaxnreg.inc`` /
``setmaxnreg.dec`` counts first (what ``TileGemmConfig.memory_registers`` changes): ptxas
allocates each region to its count. Per kernel it prints ptxas's notes (registers, spill
bytes, C75xx performance notes such as C7512, wgmmas serialized for want of registers) and SASS
counts: HGMMA / QGMMA (FP8) by shape, ``WARPGROUP.DEPBAR`` waits (one per HGMMA when ptxas
serialized them), ``WARPGROUP.ARRIVE``, local-memory loads / stores (spills), instructions.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+);")


def rewrite_registers(ptx: str, compute: int | None, memory: int | None) -> str:
    """``ptx`` with every ``setmaxnreg.inc`` count set to ``compute`` and every
    ``setmaxnreg.dec`` count to ``memory`` (None: kept). Raises ``ValueError`` for a count
    outside setmaxnreg's range (a multiple of 8 in [24, 256]) or a PTX without the
    instruction to rewrite."""
    for name, v in (("compute", compute), ("memory", memory)):
        if v is not None and (v % 8 or not 24 <= v <= 256):
            raise ValueError(f"--{name}-registers={v}: a multiple of 8 in [24, 256]")
    found = {m.group(1) for m in SETMAXNREG.finditer(ptx)}
    for action, v in (("inc", compute), ("dec", memory)):
        if v is not None and action not in found:
            raise ValueError(f"no setmaxnreg.{action} in this PTX: nothing to set to {v} (a "
                             "kernel without a warp-specialized pipeline)")

    def sub(m: re.Match) -> str:
        v = compute if m.group(1) == "inc" else memory
        return m.group(0) if v is None else f"setmaxnreg.{m.group(1)}.sync.aligned.u32 {v};"

    return SETMAXNREG.sub(sub, ptx)


def ptxas_notes(text: str) -> dict:
    """ptxas ``-v`` output -> registers, spill store / load bytes and the C75xx note codes
    (in order of appearance, each once)."""
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    codes = list(dict.fromkeys(re.findall(r"\((C75\d\d)\)", text)))
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0,
            "notes": codes}


def sass_counts(sass: str) -> dict:
    """cuobjdump ``-sass`` text -> instruction counts that matter for the tile kernels."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    # HGMMA: 16-bit operands; QGMMA: FP8 (E4M3 / E5M2)
    gmma = re.compile(r"\b([HQ]GMMA\.\d+x\d+x\d+)")
    hgmma = collections.Counter(m.group(1) for line in sass.splitlines()
                                if (m := gmma.search(line)))
    count = lambda prefix: sum(op.startswith(prefix) for op in ops)  # noqa: E731
    return {"instructions": len(ops), "hgmma": dict(hgmma),
            "depbar": count("WARPGROUP.DEPBAR"), "arrive": count("WARPGROUP.ARRIVE"),
            "ldl": count("LDL"), "stl": count("STL"), "bar_sync": count("BAR.SYNC")}


def find_cuobjdump() -> str:
    """cuobjdump on PATH, else the one in the ``nvidia-cuda-cuobjdump`` wheel."""
    if path := shutil.which("cuobjdump"):
        return path
    try:
        import nvidia  # the wheels' namespace package
        for root in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_cuobjdump/bin"):
                cand = os.path.join(root, sub, "cuobjdump")
                if os.path.exists(cand):
                    return cand
    except ImportError:
        pass
    raise FileNotFoundError("cuobjdump not found: put a CUDA toolkit's bin on PATH or "
                            "`pip install nvidia-cuda-cuobjdump` (the PTX notes alone need "
                            "only ptxas: --no-sass)")


def analyse(ptx_path: str, compute: int | None, memory: int | None, ptxas: str,
            cuobjdump: str | None) -> dict:
    """ptxas's notes on ``ptx_path`` (its setmaxnreg counts rewritten first), and the SASS
    counts where ``cuobjdump`` (its path; None: ptxas notes only) disassembles the result."""
    with open(ptx_path) as f:
        ptx = rewrite_registers(f.read(), compute, memory)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", src, "-o", cubin],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"ptxas failed on {ptx_path}: {run.stderr.strip()[:500]}")
        out = ptxas_notes(run.stdout + run.stderr)
        if cuobjdump is not None:
            dis = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True,
                                 text=True, check=True)
            out.update(sass_counts(dis.stdout))
    out["setmaxnreg"] = [f"{a} {n}" for a, n in SETMAXNREG.findall(ptx)][:4]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ptx", nargs="+", help="dumped kernel PTX files (kernel_N.ptx)")
    p.add_argument("--compute-registers", type=int, default=None,
                   help="set every setmaxnreg.inc to this count first")
    p.add_argument("--memory-registers", type=int, default=None,
                   help="set every setmaxnreg.dec to this count first")
    p.add_argument("--ptxas", default=shutil.which("ptxas") or "ptxas")
    p.add_argument("--no-sass", action="store_true", help="ptxas notes only (no cuobjdump)")
    args = p.parse_args(argv)
    cuobjdump = None if args.no_sass else find_cuobjdump()
    for path in args.ptx:
        r = analyse(path, args.compute_registers, args.memory_registers, args.ptxas, cuobjdump)
        print(f"{path}: " + " ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
