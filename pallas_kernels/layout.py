"""NVFP4Tensor -> the Mosaic GPU kernels' private weight layout (done once, at weight sync).

Kernel layout of a weight ``[..., N, K]`` (``...`` = nothing for dense, ``E`` for experts):

* ``codes`` uint16 ``[E, Np // 128, (Kp // 256) * 128, 64]``: the words of the row-major
  ``[E, Np, Kp // 4]`` matrix, "split-nibble" (within each group of 64 K-columns, word ``j``
  (0..15) of a row holds the E2M1 codes of ``k = 16 * i + j`` in nibble ``i``), cut into the
  kernel's ``128 x 256`` tiles and stored tile after tile: one pipeline step reads one
  contiguous 16 KB block (row-major, a step would read 128-byte pieces 2 KB apart). One nibble
  extraction over 16 consecutive words yields one whole 16-element scale block, and the 16-bit
  container keeps Mosaic GPU away from 8-bit shifts (which it rejects).
* ``scales`` ``[E, Np // 128, Kp // 16, 128]`` in the MMA dtype, or (float16 MMA only) as the
  NVFP4 tensor's own E4M3 bytes (``scale_dtype="float8_e4m3fn"``; the kernel converts them to
  f16 with ``cvt.rn.f16x2.e4m3x2``, exact): for each 128-row tile, the block scales with the
  scale axis first, so that one step's ``16 x 128`` scales are one contiguous 4 KB (2 KB as
  E4M3) block and one SMEM row holds the scales of 128 consecutive weight rows. The stored
  value is ``s * stored_scale_factor``. E4M3 scales make the streamed bytes the format's own
  0.5625 per weight instead of 0.625: in decode the kernels are bound by those bytes on the
  H100 (session 38: the pipeline alone, no decode nor MMA, took 94 % of the kernel's time;
  session 39, E4M3 against float16 scales: the decode step's grouped kernels 3-4 % faster).
  The rollout's default (``kernel_backend.DEFAULT_W4A4_SCALE_DTYPE``).
* ``decode`` (static): how the kernel turns a 4-bit code into an f16 value.
  "normal" builds the exact f16 of ``e2m1(c)`` with integer ops (a select for the E2M1
  subnormal 0.5), so no f16 subnormal ever occurs. "subnormal" places the code bits straight into
  an f16 (``e2m1 * 2^-14``; code 1 lands on an f16 subnormal): fewer integer ops, no select,
  and exact: ``e2m1 * s * 2^-14`` is a multiple of 2^-24 below 0.17 with at most 6 significant
  bits, so the f16 product with the scale is exact, and f16 arithmetic and the tensor cores keep
  subnormals (verified on the H200, 2026-12-02: rel. err 1e-6 against float64, as "normal").
  The default for float16 MMA.
* ``global_scale`` float32 ``[E]``: the NVFP4 decode scale ``g`` of each matrix.
* ``bits`` (static): where a word keeps its four codes' bits. "nibbles": code ``i`` in bits
  ``[4i, 4i + 4)`` (sign on top). "signs_high": code ``i``'s three magnitude bits at
  ``[3i, 3i + 3)`` and its sign at bit ``SIGNS_HIGH_SIGN_BIT[i]`` (14, 13, 12, 15), chosen
  (by a search over bit layouts) so that the device decode of code ``i`` into the "subnormal"
  f16 bits ``sign << 15 | magnitude << 9`` of both words of a 32-bit register takes 1
  (code 3: a mask), 2 (code 2: a shift and a mask) or 3 operations (codes 0 and 1: a mask, a
  multiply by ``2^a + 2^b`` whose two shifted copies never overlap, so it adds without
  carries, and a mask; the multiply runs on the FMA pipe, not the integer one), against 3-4
  integer operations per code for "nibbles" (two shifts, two masks and an or). Same bytes.

``Np`` and ``Kp`` are N and K padded with zero codes and zero scales to the kernel tiles
(``N_TILE`` rows, ``K_TILE`` columns), so the padding contributes exact zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.quant import nvfp4

K_TILE = 256  # K columns per pipeline step: 64 uint16 words = one 128-byte swizzle row.
N_TILE = 128  # weight rows per CTA tile: two compute warpgroups x 64 wgmma rows.
MMA_DTYPES = ("float16", "bfloat16")
E4M3 = "float8_e4m3fn"  # the scale dtype that keeps the format's bytes (float16 MMA only)
DECODES = ("normal", "subnormal")
BITS = ("nibbles", "signs_high")
SIGNS_HIGH_SIGN_BIT = (14, 13, 12, 15)  # "signs_high": the sign bit of code i of a word
# "subnormal" decode: the f16 bit pattern ((c & 8) << 12) | ((c & 7) << 9) is e2m1(c) * 2^-14.
CODE_EXPONENT = -14


def stored_scale_factor(mma_dtype: str, decode: str) -> float:
    """Factor folded into the stored block scales (bf16 "subnormal": undo the code's 2^-14)."""
    return float(2.0**-CODE_EXPONENT) if (decode, mma_dtype) == ("subnormal", "bfloat16") else 1.0


def code_factor(mma_dtype: str, decode: str) -> float:
    """What the kernel's MMA result must be multiplied by to give ``sum(e2m1*s_w * x_hat)``."""
    return float(2.0**-CODE_EXPONENT) if (decode, mma_dtype) == ("subnormal", "float16") else 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class W4A4Weights:
    """NVFP4 weights in the kernel layout (module docstring).

    Attributes:
      codes: uint16 ``[E, Np // 128, (Kp // 256) * 128, 64]`` (tile after tile).
      scales: ``[E, Np // 128, Kp // 16, 128]`` float16 (``s``), bfloat16 (``s * 2^14``) or
        float8_e4m3fn (``s``, for float16 MMA).
      global_scale: float32 ``[E]``.
      n: logical N (static); k: logical K (static); stacked: False for a dense ``[N, K]`` weight.
      decode: "normal" | "subnormal" (static; module docstring).
      bits: "nibbles" | "signs_high" (static; module docstring).
    """

    CODES_NDIM = 4  # codes' rank for one weight; leading axes beyond it are stacked layers

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    n: int = dataclasses.field(metadata={"static": True})
    k: int = dataclasses.field(metadata={"static": True})
    stacked: bool = dataclasses.field(metadata={"static": True})
    decode: str = dataclasses.field(default="normal", metadata={"static": True})
    bits: str = dataclasses.field(default="nibbles", metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical weight shape ``[N, K]`` or ``[E, N, K]`` (what ``ops`` checks against x)."""
        return ((self.num_experts,) if self.stacked else ()) + (self.n, self.k)

    @property
    def mma_dtype(self) -> str:
        """The MMA dtype: the scales' dtype, float16 for E4M3 scales."""
        name = jnp.dtype(self.scales.dtype).name
        return "float16" if name == E4M3 else name

    @property
    def code_factor(self) -> float:
        return code_factor(self.mma_dtype, self.decode)

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def n_pad(self) -> int:
        """N padded to ``N_TILE``."""
        return int(self.codes.shape[1]) * N_TILE

    @property
    def k_pad(self) -> int:
        """K padded to ``K_TILE``."""
        return int(self.codes.shape[2]) // N_TILE * K_TILE

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams for all experts (codes + scales; padding included)."""
        return int(self.codes.size * 2 + self.scales.size * self.scales.dtype.itemsize)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _check_mma_dtype(mma_dtype: str) -> None:
    if mma_dtype not in MMA_DTYPES:
        raise ValueError(f"mma_dtype={mma_dtype!r} is not one of {MMA_DTYPES}")


def check_bits(bits: str) -> None:
    """A ``ValueError`` naming the accepted layouts unless ``bits`` is one of ``BITS``."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not one of {BITS}")


def code_bits(i: int, bits: str) -> tuple[int, int]:
    """(magnitude shift, sign bit) of code ``i`` (0..3) in a word of the ``bits`` layout."""
    check_bits(bits)
    return (4 * i, 4 * i + 3) if bits == "nibbles" else (3 * i, SIGNS_HIGH_SIGN_BIT[i])


def word_code(words: jax.Array, i: int, bits: str) -> jax.Array:
    """The E2M1 codes (sign << 3 | magnitude, uint16 0..15) of code ``i`` of uint16 ``words``."""
    u16 = jnp.uint16
    mag_shift, sign_bit = code_bits(i, bits)
    if bits == "nibbles":  # one shift and one mask (the device's jnp decode path runs this)
        return (words >> u16(mag_shift)) & u16(0xF) if mag_shift else words & u16(0xF)
    mag = (words >> u16(mag_shift)) & u16(7) if mag_shift else words & u16(7)
    return mag | (((words >> u16(sign_bit)) & u16(1)) << u16(3))


def split_nibble_pack(codes: jax.Array, bits: str = "nibbles") -> jax.Array:
    """uint8 E2M1 codes ``[..., K]`` (K % 64 == 0) -> uint16 split-nibble words ``[..., K // 4]``
    (word ``j`` of each 64-column group holds ``k = 16 i + j`` as its code ``i``, placed by
    ``bits``)."""
    k = codes.shape[-1]
    c = codes.astype(jnp.uint16).reshape(codes.shape[:-1] + (k // 64, 4, 16))
    words = jnp.zeros(c.shape[:-2] + (16,), jnp.uint16)
    for i in range(4):
        mag_shift, sign_bit = code_bits(i, bits)
        ci = c[..., i, :]
        words = words | ((ci & 7) << mag_shift) | ((ci >> 3) << sign_bit)
    return words.reshape(codes.shape[:-1] + (k // 4,))


def split_nibble_unpack(words: jax.Array, bits: str = "nibbles") -> jax.Array:
    """Inverse of ``split_nibble_pack``: uint16 ``[..., K // 4]`` -> uint8 codes ``[..., K]``."""
    kw = words.shape[-1]
    w = words.reshape(words.shape[:-1] + (kw // 16, 16))
    c = jnp.stack([word_code(w, i, bits) for i in range(4)], axis=-2)
    return c.astype(jnp.uint8).reshape(words.shape[:-1] + (kw * 4,))


def tile_rows(a: jax.Array, cols: int) -> jax.Array:
    """``[E, Np, C]`` -> ``[E, Np // 128, (C // cols) * 128, cols]``: 128-row x ``cols`` tiles,
    stored tile after tile (tile ``(n, k)`` at rows ``[128 k, 128 k + 128)`` of ``[:, n]``)."""
    e, n, c = a.shape
    a = a.reshape(e, n // N_TILE, N_TILE, c // cols, cols)
    return jnp.swapaxes(a, 2, 3).reshape(e, n // N_TILE, (c // cols) * N_TILE, cols)


def untile_rows(a: jax.Array) -> jax.Array:
    """Inverse of ``tile_rows``: ``[E, Np // 128, T * 128, cols]`` -> ``[E, Np, T * cols]``."""
    e, nt, rows, cols = a.shape
    a = a.reshape(e, nt, rows // N_TILE, N_TILE, cols)
    return jnp.swapaxes(a, 2, 3).reshape(e, nt * N_TILE, (rows // N_TILE) * cols)


def check_scale_dtype(scale_dtype: str | None, mma_dtype: str) -> None:
    """E4M3 scales only where the stored value is the scale itself (float16 MMA: no factor)."""
    if scale_dtype not in (None, mma_dtype, E4M3):
        raise ValueError(f"scale_dtype={scale_dtype!r}: None, {mma_dtype!r} or {E4M3!r}")
    if scale_dtype == E4M3 and mma_dtype != "float16":
        raise ValueError(f"scale_dtype={E4M3!r} needs mma_dtype='float16' (got {mma_dtype!r}): "
                         "the kernel converts E4M3 scales to f16 only")


def prepare_w4a4_weights(
    w_q: nvfp4.NVFP4Tensor, *, mma_dtype: str = "float16", decode: str | None = None,
    bits: str = "nibbles", scale_dtype: str | None = None,
) -> W4A4Weights:
    """Convert an ``NVFP4Tensor`` weight ``[N, K]`` or ``[E, N, K]`` to the kernel layout.

    The global scale must be per tensor (dense) or per matrix ("expert" mode, or one scalar for
    all experts). Call this once at weight sync; inside a jitted forward it costs a full pass
    over the weight. ``decode`` None: "subnormal" for float16 MMA (where the kernel's fast PTX
    decode applies), "normal" for bfloat16. ``bits``: the words' bit layout (module docstring).
    ``scale_dtype``: None (the MMA dtype) or "float8_e4m3fn" (float16 MMA only: the block
    scales' own bytes).
    """
    _check_mma_dtype(mma_dtype)
    check_bits(bits)
    if decode is None:
        decode = "subnormal" if mma_dtype == "float16" else "normal"
    if decode not in DECODES:
        raise ValueError(f"decode={decode!r} is not one of {DECODES}")
    check_scale_dtype(scale_dtype, mma_dtype)
    if not isinstance(w_q, nvfp4.NVFP4Tensor):
        raise ValueError(f"w_q: expected an NVFP4Tensor, got {type(w_q).__name__}")
    if w_q.ndim not in (2, 3):
        raise ValueError(f"w_q: shape {w_q.shape} must be [N, K] or [E, N, K]")
    stacked = w_q.ndim == 3
    packed = w_q.packed if stacked else w_q.packed[None]
    scales = w_q.scales if stacked else w_q.scales[None]
    e, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    g = jnp.asarray(w_q.global_scale, jnp.float32)
    if g.size == 1:
        g = jnp.broadcast_to(g.reshape(()), (e,))
    elif g.size == e and stacked and g.shape in ((e, 1, 1), (e,)):
        g = g.reshape(e)
    else:
        raise ValueError(
            f"w_q.global_scale: shape {tuple(g.shape)} is not supported for weight {w_q.shape}; "
            "the kernels take one decode scale per matrix ([] or [E, 1, 1]), not per row"
        )
    n_pad, k_pad = _round_up(n, N_TILE), _round_up(k, K_TILE)
    codes = nvfp4.unpack_codes(packed)
    codes = jnp.pad(codes, ((0, 0), (0, n_pad - n), (0, k_pad - k)))
    s = scales.astype(jnp.float32)
    s = s * np.float32(stored_scale_factor(mma_dtype, decode))
    s = jnp.pad(s, ((0, 0), (0, n_pad - n), (0, (k_pad - k) // nvfp4.BLOCK_SIZE)))
    return W4A4Weights(
        codes=tile_rows(split_nibble_pack(codes, bits), K_TILE // 4),
        scales=jnp.swapaxes(s.reshape(e, n_pad // N_TILE, N_TILE, -1), 2, 3).astype(
            scale_dtype or mma_dtype),
        global_scale=g,
        n=n,
        k=k,
        stacked=stacked,
        decode=decode,
        bits=bits,
    )


def dequantize_w4a4_weights(w: W4A4Weights) -> jax.Array:
    """float32 ``[E, N, K]`` values ``e2m1 * s`` (no global scale): the layout's jnp reference."""
    codes = split_nibble_unpack(untile_rows(w.codes), w.bits)
    vals = nvfp4.e2m1_code_to_float(codes)
    e, n_pad, k_pad = vals.shape
    s = jnp.swapaxes(w.scales.astype(jnp.float32), 2, 3).reshape(e, n_pad, k_pad // 16)
    s = s / np.float32(stored_scale_factor(w.mma_dtype, w.decode))
    vals = vals.reshape(e, n_pad, k_pad // 16, 16) * s[..., None]
    return vals.reshape(e, n_pad, k_pad)[:, : w.n, : w.k]
