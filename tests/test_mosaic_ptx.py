"""``scripts/mosaic_ptx.py``: the kernels it compiles lower on the CPU (one Mosaic module per
call, the variant's fields in it), bad names are refused, and a missing tool set is named with
the command that makes it. The compile itself needs the CUDA plugin's wheels (``--setup``)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import mosaic_ptx  # noqa: E402


@pytest.mark.parametrize("variant,shape,operands,registers,other", [
    ("default", "down", 2, b"232", b"112"), ("default wg4 mem24", "down", 1, b"112", b"232"),
    ("default", "dense", 1, b"232", b"112")])  # dense: split K, float32 partial sums
def test_kernel_modules_lower_the_variant(variant, shape, operands, registers, other):
    (module,) = mosaic_ptx.kernel_modules(variant, shape, operands)
    assert isinstance(module, bytes) and len(module) > 1000
    # the compute warpgroups' register count (setmaxnreg) is written into the module as text:
    # one pair asks for 232, two pairs with the copy warpgroup at 24 for 112
    assert registers in module and other not in module


def test_bad_names_and_missing_tools_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown variant 'wide'"):
        mosaic_ptx.kernel_modules("wide", "down", 1)
    with pytest.raises(ValueError, match="residual_blocks variants"):
        mosaic_ptx.kernel_modules("default unstacked keep50", "down", 2)
    with pytest.raises(FileNotFoundError, match="--setup --tools"):
        mosaic_ptx.child_env(str(tmp_path / "none"), str(tmp_path))
    with pytest.raises(SystemExit, match="--shapes"):
        mosaic_ptx.main(["--shapes", "up"])
