"""NVFP4: the one implementation of the 4-bit format that every part of quads-jax calls.

Format (QUADS_SPEC section 2, NVIDIA Transformer Engine convention):

* element: E2M1, values {0, .5, 1, 1.5, 2, 3, 4, 6} with a sign bit; code bit 3 is the sign;
* block: 16 consecutive elements along the last (reduction, K) axis share one E4M3 decode scale;
* above the blocks, one float32 *decode* scale ``g`` per tensor ("tensor"), per row ("row") or
  per 2-D matrix of a stacked weight ("expert": one per expert of ``[E, N, K]``, one per
  (layer, expert) of ``[L, E, N, K]``).

Arithmetic, written out once here and copied operation for operation by the Pallas kernels::

    g      = amax / 2688                  (g = 1 when amax == 0; 2688 = 6 * 448)
    enc    = 1 / g                        the encode scale S_enc, always recomputed from g
    s_b    = e4m3(clamp(amax_b * enc / 6, 0, 448))    (true divisions, never x * (1/c))
    r_b    = 1 / (s_b * g)                (0 where s_b == 0)   explicit float32 reciprocal
    code   = rne_e2m1(x * r_b)            round half to even, saturating at +-6
    x_hat  = (e2m1(code) * s_b) * g

Everything depends on ``g`` only, so ``quantize(x, global_scale=q.global_scale)`` reproduces
``q`` exactly. The reciprocal is explicit because XLA rewrites ``x / broadcast(s)`` into
``x * broadcast(1 / s)``, and a different operation order flips E2M1 rounding ties.

Non-finite inputs: a 16-element block that holds a NaN or an Inf gets a NaN block scale, so all
16 of its outputs dequantize to NaN (a NaN never silently becomes a finite value); the global
scale is computed from the finite values only, so other blocks are unaffected.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.quant import arith
from quads_jax.quant.arith import divide_by_constant, round_to_e4m3, straight_through

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_AMAX_TARGET = E2M1_MAX * E4M3_MAX  # 2688
SCALE_MODES = ("tensor", "row", "expert")
ScaleMode = Literal["tensor", "row", "expert"]
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# Magnitudes of the 8 non-negative E2M1 codes; codes 8..15 are their negatives.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
# Round-half-to-even decision points in the scaled domain, in order: a magnitude moves up one
# code (and up by ``step`` in value, to the next of E2M1_VALUES) when it is above a "strict"
# point (the tie goes down to the even code) or at/above an inclusive one.
_E2M1_STEPS = (  # (decision point, inclusive, step)
    (0.25, False, 0.5), (0.75, True, 0.5), (1.25, False, 0.5), (1.75, True, 0.5),
    (2.5, False, 1.0), (3.5, True, 1.0), (5.0, False, 2.0),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor of logical shape ``[..., K]``.

    Attributes:
      packed: uint8 ``[..., K // 2]``; element ``2i`` in the low nibble, ``2i + 1`` in the high.
      scales: float8_e4m3fn ``[..., K // 16]``; per-block decode scales.
      global_scale: float32 decode scale ``g``: ``[]`` ("tensor"), ``[..., 1]`` ("row") or
        ``[..., 1, 1]`` ("expert": one per matrix of a stacked ``[..., N, K]``).
      dtype: the logical dtype that ``dequantize`` returns by default (static).
    """

    packed: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``[..., K]`` (derived, so it stays right under vmap)."""
        return tuple(self.packed.shape[:-1]) + (self.packed.shape[-1] * 2,)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the quantized tensor occupies (codes + block scales + global scales)."""
        return int(self.packed.size + self.scales.size + 4 * np.prod(self.global_scale.shape))


def _check_input(x: jax.Array, name: str = "x") -> None:
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}: dtype {getattr(x, 'dtype', type(x))} is not supported; "
            "NVFP4 quantization accepts bfloat16, float16 or float32 arrays"
        )
    if x.ndim == 0:
        raise ValueError(
            f"{name}: a scalar cannot be quantized; need shape [..., K] with K % 16 == 0"
        )
    if x.size == 0:
        raise ValueError(f"{name}: shape {tuple(x.shape)} is empty; need at least one block of 16")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"{name}: last axis K={x.shape[-1]} (shape {tuple(x.shape)}) is not a multiple of "
            f"{BLOCK_SIZE}; NVFP4 blocks are 16 elements along the last axis"
        )


def _check_mode(scale_mode: str, ndim: int) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r} is not one of {SCALE_MODES}")
    if scale_mode == "expert" and ndim < 2:
        raise ValueError(f"scale_mode='expert' needs matrices [..., N, K]; got ndim={ndim}")


def global_scale_shape(shape: tuple[int, ...], scale_mode: ScaleMode) -> tuple[int, ...]:
    """Shape of the float32 global decode scale for a tensor of ``shape``."""
    _check_mode(scale_mode, len(shape))
    if scale_mode == "tensor":
        return ()
    if scale_mode == "row":
        return tuple(shape[:-1]) + (1,)
    return tuple(shape[:-2]) + (1, 1)


def finite_amax(x: jax.Array, scale_mode: ScaleMode) -> jax.Array:
    """float32 amax of ``|x|`` over its finite elements (0 if none), per ``scale_mode``:
    ``[]`` (tensor), ``[..., 1]`` (row) or ``[..., 1, 1]`` (expert). Also traced inside
    Pallas kernels (``rac_rows``' own row scales)."""
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(jnp.isfinite(a), a, 0.0)
    if scale_mode == "tensor":
        return jnp.max(a)
    if scale_mode == "row":
        return jnp.max(a, axis=-1, keepdims=True)
    return jnp.max(a, axis=(-2, -1), keepdims=True)


def decode_scale_from_amax(amax: jax.Array) -> jax.Array:
    """``g = amax / 2688``, and 1 where amax is 0. float32, same shape as ``amax``.

    One correctly rounded division (TE writes ``1 / (2688 / amax)``, which can differ by an ulp).
    """
    return arith.decode_scale_from_amax(amax, GLOBAL_AMAX_TARGET)


def compute_global_scale(x: jax.Array, scale_mode: ScaleMode = "tensor") -> jax.Array:
    """The float32 global decode scale that ``quantize(x, scale_mode=...)`` would use."""
    _check_input(x)
    _check_mode(scale_mode, x.ndim)
    return decode_scale_from_amax(finite_amax(x, scale_mode))


def shared_global_scale(*xs: jax.Array, scale_mode: ScaleMode = "tensor") -> jax.Array:
    """One global decode scale for several tensors (fused gate and up projections of one expert).

    The tensors must have equal leading shapes for "row" and "expert" modes.
    """
    if not xs:
        raise ValueError("shared_global_scale needs at least one array")
    amaxes = []
    for i, x in enumerate(xs):
        _check_input(x, f"xs[{i}]")
        _check_mode(scale_mode, x.ndim)
        amaxes.append(finite_amax(x, scale_mode))
    shapes = {a.shape for a in amaxes}
    if len(shapes) != 1:
        raise ValueError(
            f"shared_global_scale: per-{scale_mode} amax shapes differ: {sorted(shapes)}"
        )
    return decode_scale_from_amax(jnp.max(jnp.stack(amaxes), axis=0))


def round_to_e2m1_code(y: jax.Array) -> jax.Array:
    """Round float32 ``y`` (already in the scaled domain) to E2M1 codes, uint8 in [0, 16).

    Round half to even, saturating at +-6. Negative values that round to zero get code 0 (+0,
    one canonical zero, so re-quantizing a dequantized tensor reproduces its codes); NaN maps to
    code 0 (callers mark NaN blocks by their scale).
    """
    mag = jnp.abs(y)
    idx = jnp.zeros(y.shape, jnp.uint8)
    for t, inclusive, _ in _E2M1_STEPS:
        idx = idx + ((mag >= t) if inclusive else (mag > t)).astype(jnp.uint8)
    return idx | jnp.where((y < 0) & (idx > 0), jnp.uint8(8), jnp.uint8(0))


def round_to_e2m1_value(y: jax.Array) -> jax.Array:
    """``e2m1_code_to_float(round_to_e2m1_code(y))`` without the codes: float32, bit for bit
    (round half to even, saturating at +-6, +0 for values that round to zero, 0 for NaN).
    Elementwise arithmetic only, so XLA fuses it with its producer and consumer, and the
    Triton kernels that quantize activations trace it."""
    y = jnp.asarray(y, jnp.float32)
    yc = jnp.clip(y, -E2M1_MAX, E2M1_MAX)
    mag = jnp.abs(yc)
    # Round half to even onto the grid's spacing (0.5 below 2, 1 below 4, 2 up to 6) by adding
    # and subtracting 1.5 * 2^22 / 2^23 / 2^24: the sum stays in the binade whose float32 ulp is
    # that spacing for either sign, so float32's own rounding does it, and an exact 0 comes back
    # as +0. Below 6 the E2M1 values are that spacing's multiples, so this is the seven
    # decision points' ladder (_E2M1_STEPS; the tests check every float32 exponent) in about
    # half its operations: the activation kernels run it on every element, and on the H100 it
    # is most of their arithmetic (kernel_probe --act-ablations, 2026-12-05). The added value
    # is a select, not a constant: XLA folds ``(v + c) - c`` for a constant ``c``
    # (arith.round_half_even_small), not this (jitted on the CPU in the tests; on the GPU, XLA
    # and Triton: kernel_probe --act-operands).
    magic = jnp.where(mag < 2.0, jnp.float32(1.5 * 2.0**22),
                      jnp.where(mag < 4.0, jnp.float32(1.5 * 2.0**23),
                                jnp.float32(1.5 * 2.0**24)))
    val = (yc + magic) - magic
    # NaN compares false: 0, as its code (a kernel's clip may have turned it into a number).
    return jnp.where(y == y, val, jnp.float32(0.0))


def e2m1_code_to_float(codes: jax.Array) -> jax.Array:
    """Decode uint8 E2M1 codes in [0, 16) to float32 values: ``E2M1_TABLE[codes]`` bit for bit
    (-0.0 for code 8 included), by arithmetic on the code's exponent and mantissa bits rather
    than a table lookup: XLA lowers the lookup to a gather, which kept the codes as a uint8 pass
    of their own on the H200; elementwise, the decode fuses with the quantizer that made the
    codes and with the scale that follows (``dequantize``, ``mma_operand``, the weights'
    prefill decode)."""
    c = codes.astype(jnp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    pow2 = jnp.left_shift(1, jnp.maximum(e - 1, 0)).astype(jnp.float32)  # 2^(e - 1), e >= 1
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)  # exact: 0, 0.5, 1, 1.5, ..., 6
    return jnp.where(c >= 8, -mag, mag)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes ``[..., K]`` -> packed bytes ``[..., K // 2]`` (element 2i in the low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """Packed bytes ``[..., K // 2]`` -> uint8 codes ``[..., K]``."""
    lo = packed & jnp.uint8(0xF)
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def block_amax(x_blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Finite amax and finiteness of each block of ``x_blocks [..., K/16, 16]``: float32 and
    bool ``[..., K/16, 1]`` (non-finite elements count as 0 in the amax)."""
    xf = x_blocks.astype(jnp.float32)
    absx = jnp.abs(xf)
    # "All finite" as a min over int32 rather than jnp.all: the same bool, and Pallas' Triton
    # lowering (pallas_kernels.act_operands traces this function) has no reduce_and.
    finite = jnp.min(jnp.isfinite(xf).astype(jnp.int32), axis=-1, keepdims=True) > 0
    amax_b = jnp.max(jnp.where(jnp.isfinite(absx), absx, 0.0), axis=-1, keepdims=True)
    return amax_b, finite


def block_scales_from_amax(
    amax_b: jax.Array, finite: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """E4M3 block scales and float32 code reciprocals from ``block_amax``'s ``[..., K/16, 1]``
    results and the decode scale ``g`` (broadcastable): ``(s_b [..., K/16], r_b [..., K/16,
    1])``. Split from ``block_scales_and_reciprocals`` so that a caller holding the block amax
    of rows (RAC's residual, ``rac.SelectedResidual``) codes them without a second pass."""
    s_f32, r = block_scales_f32_from_amax(amax_b, finite, g)
    return s_f32.astype(jnp.float8_e4m3fn)[..., 0], r


def block_scales_f32_from_amax(
    amax_b: jax.Array, finite: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``block_scales_from_amax`` before the cast: the block scales as float32 values already on
    the E4M3 grid (NaN for non-finite blocks), same shape as ``amax_b``, and the reciprocals.
    Elementwise float32 and uint32 arithmetic only, so Pallas kernels call it as it is
    (``pallas_kernels.rac_select``)."""
    enc = arith.divide(jnp.float32(1.0), g)
    # A true division by 6: ties such as amax_b * enc / 6 == 2^-10 must round half to even.
    s = jnp.clip(divide_by_constant(amax_b * enc, E2M1_MAX), 0.0, E4M3_MAX)
    s = jnp.where(finite, s, jnp.nan)
    # Round with exact arithmetic rather than through the cast: XLA:GPU folds the cast chain
    # f32 -> e4m3 -> f32 inside a jitted program (see quant/arith.py).
    s_f32 = round_to_e4m3(s)
    denom = s_f32 * g
    # `denom > 0` is False for NaN scales too, so non-finite blocks get r_b = 0.
    r = jnp.where(denom > 0, arith.divide(jnp.float32(1.0), jnp.where(denom > 0, denom, 1.0)),
                  0.0)
    return s_f32, r


def unscaled_block_values(x_blocks: jax.Array, g: jax.Array) -> jax.Array:
    """float32 ``e2m1 * s_b`` ``[..., K/16, 16]`` of float32 ``x_blocks`` quantized with the
    decode scale ``g`` (broadcastable to ``[..., K/16, 1]``): ``unscaled_values`` of the codes
    ``quantize_codes`` would give, computed without the codes (elementwise arithmetic and
    block reductions only: the Triton kernels that quantize activations trace it)."""
    amax_b, finite = block_amax(x_blocks)
    s_f32, r = block_scales_f32_from_amax(amax_b, finite, g)
    return round_to_e2m1_value(x_blocks * r) * s_f32


def block_scales_and_reciprocals(x_blocks: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E4M3 block scales and the float32 code reciprocals for ``x_blocks [..., K/16, 16]``.

    ``g`` is the float32 decode scale broadcastable to ``[..., K/16, 1]``. Returns ``(s_b,
    r_b)`` with ``s_b`` float8_e4m3fn ``[..., K/16]`` and ``r_b`` float32 ``[..., K/16, 1]``.
    """
    return block_scales_from_amax(*block_amax(x_blocks), g)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Codes:
    """An ``NVFP4Tensor`` before its codes are packed two per byte: what ``quantize_codes``
    computes, ``dequantize`` reads and the W4A4 kernels' activation operands are built from.
    A jitted program that never asks for the packed bytes never computes them (XLA cannot fold
    a pack followed by an unpack: both are bit operations of their own fusions).

    Attributes:
      codes: uint8 ``[..., K]`` E2M1 codes in [0, 16).
      scales, global_scale, dtype: as ``NVFP4Tensor``.
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def pack(self) -> NVFP4Tensor:
        """The packed tensor (the interchange format), bit for bit what ``quantize`` returns."""
        return NVFP4Tensor(pack_codes(self.codes), self.scales, self.global_scale, self.dtype)


def quantize_codes(
    x: jax.Array,
    *,
    global_scale: jax.Array | None = None,
    scale_mode: ScaleMode = "tensor",
) -> NVFP4Codes:
    """``quantize`` without the packing step: same codes, block scales and global scale."""
    x, g = _input_and_global_scale(x, global_scale, scale_mode)
    k = x.shape[-1]
    blocks = x.reshape(x.shape[:-1] + (k // BLOCK_SIZE, BLOCK_SIZE))
    g_b = g[..., None]  # broadcast against [..., K/16, 1]
    s_e4m3, r = block_scales_and_reciprocals(blocks, g_b)
    codes = round_to_e2m1_code(blocks.astype(jnp.float32) * r).reshape(x.shape)
    return NVFP4Codes(codes=codes, scales=s_e4m3, global_scale=g, dtype=jnp.dtype(x.dtype))


def _input_and_global_scale(x, global_scale, scale_mode: ScaleMode) -> tuple[jax.Array, jax.Array]:
    """``x`` checked and its float32 decode scale ``g`` of ``global_scale_shape`` (computed
    from ``x`` when ``global_scale`` is None, else checked and reshaped)."""
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    _check_input(x)
    _check_mode(scale_mode, x.ndim)
    want = global_scale_shape(x.shape, scale_mode)
    if global_scale is None:
        g = compute_global_scale(x, scale_mode)
    else:
        g = jnp.asarray(global_scale)
        if g.shape != want and not (scale_mode == "tensor" and g.size == 1):
            raise ValueError(
                f"global_scale: shape {tuple(g.shape)} does not fit x of shape {tuple(x.shape)} "
                f"with scale_mode={scale_mode!r}; expected {want}"
            )
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise ValueError(f"global_scale: dtype {g.dtype} is not floating; pass float32")
        g = g.astype(jnp.float32).reshape(want)
    return x, g


def quantize(
    x: jax.Array,
    *,
    global_scale: jax.Array | None = None,
    scale_mode: ScaleMode = "tensor",
) -> NVFP4Tensor:
    """Quantize ``x [..., K]`` (bf16, f16 or f32; K % 16 == 0) to NVFP4.

    Args:
      x: the array; blocks of 16 along the last axis.
      global_scale: optional float32 decode scale ``g`` of ``global_scale_shape(x.shape,
        scale_mode)`` (e.g. from ``shared_global_scale``); computed from ``x`` when None.
      scale_mode: "tensor" (one scale), "row" (one per ``[..., :]`` row) or "expert" (one per
        2-D matrix of a stacked ``[..., N, K]``, e.g. per expert of ``[E, N, K]``).
    """
    return quantize_codes(x, global_scale=global_scale, scale_mode=scale_mode).pack()


ACT_SCALE_MODES = ("per_token", "per_batch", "static")


def quantize_activations(x: jax.Array, act_scale_mode: str,
                         static_scale: jax.Array | None = None) -> NVFP4Codes:
    """NVFP4 activations ``[M, K]`` with an activation global-scale mode (QUADS_SPEC section 5):
    ``per_token`` (``g [M, 1]``), ``per_batch`` (``g []``) or ``static`` (``static_scale``, a
    calibrated float32 ``[]`` or per-row ``[M]`` decode scale, stored as ``[M, 1]``).

    The one activation quantizer: the trainer-side reference (``ops.act_quantize``) and the
    kernels' pre-pass (``pallas_kernels.nvfp4_quantize``) both call it."""
    if act_scale_mode == "per_token":
        return quantize_codes(x, scale_mode="row")
    if act_scale_mode == "per_batch":
        return quantize_codes(x, scale_mode="tensor")
    if act_scale_mode != "static":
        raise ValueError(f"act_scale_mode={act_scale_mode!r}: must be one of {ACT_SCALE_MODES}")
    if static_scale is None:
        raise ValueError(
            "act_scale_mode='static' needs a calibrated scale: pass the weight as a "
            "rac.CalibratedWeight with act_global_scale (see rac.calibrate_act_scale)"
        )
    g = jnp.broadcast_to(jnp.asarray(static_scale, jnp.float32).reshape(-1, 1), (x.shape[0], 1))
    return quantize_codes(x, global_scale=g, scale_mode="row")


def codes_of(q: NVFP4Tensor | NVFP4Codes) -> jax.Array:
    """uint8 codes ``[..., K]`` of a packed or unpacked NVFP4 tensor."""
    if isinstance(q, NVFP4Codes):
        return q.codes
    if isinstance(q, NVFP4Tensor):
        return unpack_codes(q.packed)
    raise ValueError(f"expected an NVFP4Tensor or NVFP4Codes, got {type(q).__name__}")


def unscaled_values(q: NVFP4Tensor | NVFP4Codes) -> jax.Array:
    """float32 ``e2m1(code) * s_b`` ``[..., K]``, without the global scale (exact in bf16/f16)."""
    vals = e2m1_code_to_float(codes_of(q))
    k = vals.shape[-1]
    vals = vals.reshape(vals.shape[:-1] + (k // BLOCK_SIZE, BLOCK_SIZE))
    return (vals * q.scales.astype(jnp.float32)[..., None]).reshape(q.shape)


def dequantize(q: NVFP4Tensor | NVFP4Codes, dtype: jnp.dtype | None = jnp.float32) -> jax.Array:
    """``(e2m1(code) * s_b) * g`` in float32, cast to ``dtype`` (None: the logical dtype)."""
    if not isinstance(q, NVFP4Tensor | NVFP4Codes):
        raise ValueError(f"dequantize expects an NVFP4Tensor or NVFP4Codes, got {type(q).__name__}")
    out = unscaled_values(q) * q.global_scale  # [], [..., 1] or [..., 1, 1]: broadcasts
    return out.astype(q.dtype if dtype is None else dtype)


def qdq(x: jax.Array, *, global_scale=None, scale_mode: ScaleMode = "tensor") -> jax.Array:
    """Quantize then dequantize, returned in ``x.dtype``: ``dequantize(quantize(x))`` bit for
    bit (tested), computed as ``unscaled_block_values`` (the E2M1 values by arithmetic, the
    block scales as float32 on the E4M3 grid) times ``g``: one elementwise pass with its block
    reductions, no uint8 codes and no table gather between (the trainer's weight fake-quant
    runs it on every weight every step)."""
    x, g = _input_and_global_scale(x, global_scale, scale_mode)
    k = x.shape[-1]
    blocks = x.reshape(x.shape[:-1] + (k // BLOCK_SIZE, BLOCK_SIZE)).astype(jnp.float32)
    vals = unscaled_block_values(blocks, g[..., None]).reshape(x.shape)
    return (vals * g).astype(x.dtype)


def fake_quant(x: jax.Array, *, global_scale=None, scale_mode: ScaleMode = "tensor") -> jax.Array:
    """``qdq(x)`` in the forward pass, identity (straight-through) gradient to ``x``.

    The forward value is exactly ``qdq(x)`` (not ``x + (qdq(x) - x)``, which can round).
    """
    y = qdq(jax.lax.stop_gradient(x), global_scale=global_scale, scale_mode=scale_mode)
    return straight_through(x, y)


def residual(x: jax.Array, q: NVFP4Tensor | NVFP4Codes) -> jax.Array:
    """``x - dequantize(q)`` in float32: the activation residual that RAC compensates
    (``residual_from_values``' arithmetic)."""
    return residual_from_values(x.astype(jnp.float32), unscaled_values(q), q.global_scale)


# The low significand bits of a decode scale that ``residual_from_values`` splits off: the
# values ``e2m1 * s_b`` have at most 6 significant bits (2 + E4M3's 4), so their products with
# the remaining 18 bits, and with the 6 split-off bits, are exact in float32.
_SCALE_LOW_BITS = 6


def residual_from_values(x: jax.Array, vals: jax.Array, g: jax.Array) -> jax.Array:
    """float32 ``x - vals * g`` for the unscaled values ``vals = e2m1 * s_b`` of ``x``'s codes
    and their decode scale ``g`` (broadcastable, positive and finite), computed as ``(x - vals
    * g_hi) - vals * g_lo`` with ``g = g_hi + g_lo`` split so that both products are exact.

    Why: written as ``x - vals * g`` the result depends on whether the compiler contracts the
    product and the subtraction into one fused multiply-add (one rounding instead of two).
    XLA on the CPU, XLA on the GPU and Triton each decide that for themselves, and the RAC
    row-pass kernel (``pallas_kernels.rac_rows``) and the jnp path must give the same
    residual bit for bit (its block scales and codes follow from it). With exact products a
    contraction changes nothing.
    """
    g = jnp.asarray(g, jnp.float32)
    mask = jnp.int32(-(1 << _SCALE_LOW_BITS))
    g_hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(g, jnp.int32) & mask,
                                        jnp.float32)
    g_lo = g - g_hi
    return (x - vals * g_hi) - vals * g_lo
