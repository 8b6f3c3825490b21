"""The kernels' weight layout (split-nibble uint16 codes, transposed block scales)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import jit_call

from pallas_kernels.layout import (
    BITS,
    W4A4Weights,
    dequantize_w4a4_weights,
    prepare_w4a4_weights,
    split_nibble_pack,
    split_nibble_unpack,
    tile_rows,
    untile_rows,
    word_code,
)
from quads_jax.quant import nvfp4


def test_split_nibble_round_trip_and_block_property():
    codes = jax.random.randint(jax.random.key(0), (3, 128), 0, 16).astype(jnp.uint8)
    words = split_nibble_pack(codes)
    assert words.dtype == jnp.uint16 and words.shape == (3, 32)
    np.testing.assert_array_equal(split_nibble_unpack(words), codes)
    # Nibble i of the 16 words of a 64-column group is exactly the scale block 4g + i.
    w = np.asarray(words)
    for g in range(2):
        for i in range(4):
            got = (w[:, 16 * g : 16 * g + 16] >> (4 * i)) & 0xF
            np.testing.assert_array_equal(got, np.asarray(codes)[:, 64 * g + 16 * i :][:, :16])


@pytest.mark.parametrize("bits", BITS)
def test_word_bit_layouts_round_trip(bits):
    """Both bit layouts: pack / unpack round trip, and code ``i`` of the 16 words of a
    64-column group is the scale block ``4g + i``."""
    codes = jax.random.randint(jax.random.key(3), (3, 128), 0, 16).astype(jnp.uint8)
    words = split_nibble_pack(codes, bits)
    np.testing.assert_array_equal(split_nibble_unpack(words, bits), codes)
    for g in range(2):
        for i in range(4):
            got = word_code(words[:, 16 * g: 16 * g + 16], i, bits)
            np.testing.assert_array_equal(got, np.asarray(codes)[:, 64 * g + 16 * i:][:, :16])


def _f16_bits(words: np.ndarray, i: int) -> np.ndarray:
    """uint32 f16 "subnormal" bits of code ``i`` of "signs_high" ``words``."""
    c = np.asarray(word_code(jnp.asarray(words, jnp.uint16), i, "signs_high"), np.uint32)
    return ((c >> 3) << 15) | ((c & 7) << 9)


def test_signs_high_device_decode_ops_on_every_word():
    """The "signs_high" decode's 32-bit ops (the PTX's, emulated in numpy) give the f16
    "subnormal" bits ``sign << 15 | magnitude << 9`` of both words of a register, for every
    low word with random high words: the multiply's two shifted copies never carry."""
    from pallas_kernels.nvfp4_tiles_mgpu import _decode_asm, signs_high_decode_numpy

    lo = np.arange(1 << 16, dtype=np.uint32)
    for seed in range(3):
        hi = np.random.default_rng(seed).integers(0, 1 << 16, lo.shape, dtype=np.uint32)
        if seed == 0:
            hi = lo[::-1].copy()
        for i in range(4):
            got = signs_high_decode_numpy(lo | (hi << 16), i)
            np.testing.assert_array_equal(got, _f16_bits(lo, i) | (_f16_bits(hi, i) << 16))
    # Fewer operations than "nibbles" (two shifts, two masks, an or per code).
    assert [_decode_asm(i, "signs_high").count(";") - 1 for i in range(4)] == [3, 3, 2, 1]
    assert all(_decode_asm(i, "nibbles").count(";") - 1 == 5 for i in range(4))


@pytest.mark.parametrize("mma_dtype,decode,bits,scales", [
    ("float16", "normal", "nibbles", None), ("bfloat16", "subnormal", "nibbles", None),
    ("float16", "subnormal", "signs_high", None),
    ("float16", "subnormal", "signs_high", "float8_e4m3fn")])
@pytest.mark.parametrize("shape", [(200, 304), (2, 130, 256)])
def test_prepare_dequantizes_to_the_nvfp4_values(shape, mma_dtype, decode, bits, scales):
    x = jax.random.normal(jax.random.key(1), shape) * 3
    q = jit_call(nvfp4.quantize, x, scale_mode="expert" if len(shape) == 3 else "tensor")
    w = jit_call(prepare_w4a4_weights, q, mma_dtype=mma_dtype, decode=decode, bits=bits,
                 scale_dtype=scales)
    assert w.bits == bits and w.mma_dtype == mma_dtype
    assert w.scales.dtype == jnp.dtype(scales or mma_dtype)
    # Streamed bytes per weight: the format's 0.5625 with E4M3 scales, 0.625 with 16-bit ones.
    assert w.nbytes == w.codes.size * 2 + w.scales.size * (1 if scales else 2)
    assert isinstance(w, W4A4Weights) and w.shape == shape and w.stacked == (len(shape) == 3)
    assert w.n_pad % 128 == 0 and w.k_pad % 256 == 0 and w.n_pad >= shape[-2]  # padded to tiles
    assert w.codes.shape == w.codes.shape[:1] + (w.n_pad // 128, w.k_pad // 256 * 128, 64)
    unit = nvfp4.NVFP4Tensor(q.packed, q.scales, jnp.ones_like(q.global_scale))
    want = jit_call(nvfp4.dequantize, unit, jnp.float32).reshape((-1,) + shape[-2:])
    np.testing.assert_array_equal(jit_call(dequantize_w4a4_weights, w), want)
    np.testing.assert_array_equal(w.global_scale, jnp.reshape(q.global_scale, -1) * jnp.ones(
        w.num_experts))


def test_prepare_rejects_bad_weights():
    x = jax.random.normal(jax.random.key(2), (4, 128, 64))
    # jitted, each once (eagerly, every small op compiled): the weights only need to be valid
    quantize = jax.jit(nvfp4.quantize, static_argnames="scale_mode")
    with pytest.raises(ValueError, match="global_scale"):
        prepare_w4a4_weights(quantize(x, scale_mode="row"))
    with pytest.raises(ValueError, match="NVFP4Tensor"):
        prepare_w4a4_weights(x)
    wq = quantize(x[0])
    with pytest.raises(ValueError, match="mma_dtype"):
        prepare_w4a4_weights(wq, mma_dtype="float32")
    with pytest.raises(ValueError, match="decode"):
        prepare_w4a4_weights(wq, decode="fast")
    with pytest.raises(ValueError, match=r"bits='bytes' is not one of \('nibbles', 'signs_high'\)"):
        prepare_w4a4_weights(wq, bits="bytes")
    with pytest.raises(ValueError, match=r"scale_dtype='float8_e4m3fn' needs mma_dtype='float16'"):
        prepare_w4a4_weights(wq, mma_dtype="bfloat16", scale_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"scale_dtype='float32': None, 'float16' or"):
        prepare_w4a4_weights(wq, scale_dtype="float32")


def test_tile_rows_stores_each_kernel_tile_contiguously():
    a = jnp.arange(2 * 256 * 128, dtype=jnp.int32).reshape(1, 256, 256)  # [E, Np, C]
    t = tile_rows(a, 64)
    assert t.shape == (1, 2, 4 * 128, 64)
    for n in range(2):
        for k in range(4):  # tile (n, k): rows 128k.. of [:, n] == the row-major block
            np.testing.assert_array_equal(t[0, n, 128 * k : 128 * k + 128],
                                          a[0, 128 * n : 128 * n + 128, 64 * k : 64 * k + 64])
    np.testing.assert_array_equal(untile_rows(t), a)


def test_auto_k_splits():
    """The split-K choice of both tile kernels (``w4a4_matmul.auto_k_splits``), at the dense
    decode shapes it was measured on (K steps of 256 columns, 128 weight rows per item, 132
    SMs)."""
    from pallas_kernels.w4a4_matmul import auto_k_splits
    from pallas_kernels.w8a8_matmul import FP8_GOOD_WAVE_EFFICIENCY

    assert auto_k_splits(112, 16, 132) == 1  # 4096 x 14336: one wave at 0.848, unsplit
    assert auto_k_splits(448, 16, 132) == 2  # 4096 x 57344: 3.4 waves at 0.848 -> 0.97
    assert auto_k_splits(448, 32, 132, good_efficiency=FP8_GOOD_WAVE_EFFICIENCY) == 1
    assert auto_k_splits(24, 8, 132) == 4  # 2048 x 3072: the most efficient of 1 / 2 / 4
    assert auto_k_splits(6, 8, 132) == 4  # 2048 x 768: at most 2 K steps per split
    assert auto_k_splits(100, 16, 132) == 8  # one wave at 0.76: split until 0.85 (0.87)
