"""``scripts/sass_stats.py``: the register rewrite and the parsers, on text of the shapes
ptxas 13 and cuobjdump print (from session 48's dumps); the ptxas round trip where ptxas is
installed."""

import pathlib
import shutil
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import sass_stats  # noqa: E402

PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry k()
.maxntid 384, 1, 1
{
\t.reg .pred %p<2>;
\t.reg .b32 %r<2>;
\tmov.u32 %r1, %tid.x;
\tsetp.lt.u32 %p1, %r1, 128;
\t@%p1 bra MEMORY;
\tsetmaxnreg.inc.sync.aligned.u32 232;
\tret;
MEMORY:
\tsetmaxnreg.dec.sync.aligned.u32 40;
\tret;
}
"""

PTXAS = """ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to insufficient register resources for the function 'kernel_mosaic_gpu_kernel'
ptxas warning : Registers are spilled to local memory in function 'kernel_mosaic_gpu_kernel', \
100 bytes spill stores, 220 bytes spill loads
ptxas info    : Compiling entry function 'kernel_mosaic_gpu_kernel' for 'sm_90a'
    80 bytes stack frame, 100 bytes spill stores, 220 bytes spill loads
ptxas info    : Used 96 registers, used 16 barriers, 80 bytes cumulative stack size
"""

SASS = """
        /*4a40*/                   WARPGROUP.ARRIVE ;                        /* 0x0000000000 */
        /*4a50*/                   HGMMA.64x32x16.F32 R24, R40, gdesc[UR8], R24 ;  /* 0x00 */
        /*4a60*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;           /* 0x0000000000 */
        /*4a70*/                   HGMMA.64x32x16.F32 R24, R44, gdesc[UR8], R24, gsb0 ; /* 0 */
        /*4a80*/                   QGMMA.64x16x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ; /* 0 */
        /*4c80*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;           /* 0x0000000000 */
        /*4cc0*/                   LDL R105, [R1+0x24] ;                     /* 0x0000000000 */
        /*4cd0*/               @P2 STL [R1], R2 ;                            /* 0x0000000000 */
        /*4ce0*/              @!P1 BRA 0x7c20 ;                              /* 0x0000000000 */
        /*4cf0*/                   BAR.SYNC.DEFER_BLOCKING R0, 0x80 ;        /* 0x0000000000 */
"""


def test_rewrite_sets_each_direction_and_refuses_bad_counts():
    out = sass_stats.rewrite_registers(PTX, 112, 24)
    assert "setmaxnreg.inc.sync.aligned.u32 112;" in out
    assert "setmaxnreg.dec.sync.aligned.u32 24;" in out
    assert sass_stats.rewrite_registers(PTX, None, None) == PTX
    only_inc = sass_stats.rewrite_registers(PTX, 240, None)
    assert "dec.sync.aligned.u32 40;" in only_inc and "inc.sync.aligned.u32 240;" in only_inc
    for bad in (20, 113, 264):
        with pytest.raises(ValueError, match="multiple of 8 in \\[24, 256\\]"):
            sass_stats.rewrite_registers(PTX, bad, None)
    with pytest.raises(ValueError, match="no setmaxnreg.inc"):
        sass_stats.rewrite_registers(PTX.replace("setmaxnreg.inc", "nop.inc"), 112, None)


def test_parsers_read_ptxas_and_sass_text():
    assert sass_stats.ptxas_notes(PTXAS) == {"registers": 96, "spill_stores": 100,
                                             "spill_loads": 220, "notes": ["C7512"]}
    assert sass_stats.ptxas_notes("ptxas info    : Used 255 registers")["spill_stores"] == 0
    c = sass_stats.sass_counts(SASS)
    assert c["hgmma"] == {"HGMMA.64x32x16": 2, "QGMMA.64x16x32": 1}
    assert (c["depbar"], c["arrive"], c["ldl"], c["stl"], c["bar_sync"]) == (2, 1, 1, 1, 1)
    assert c["instructions"] == 10  # predicated ones (@P2, @!P1) included


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_ptxas_round_trip(tmp_path):
    path = tmp_path / "k.ptx"
    path.write_text(PTX)
    r = sass_stats.analyse(str(path), 112, 24, shutil.which("ptxas"), cuobjdump=None)
    assert isinstance(r["registers"], int) and r["spill_stores"] == 0
    assert r["setmaxnreg"] == ["inc 112", "dec 24"]
