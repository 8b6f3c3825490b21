"""Activation quantization for the W4A4 kernels, with the RAC residual, in one XLA pass.

``nvfp4_quantize`` calls ``quads_jax.quant.nvfp4.quantize_codes`` itself, so its codes, block scales
and global scales are bit-identical to the trainer's and the reference's by construction (same
explicit reciprocal; no second implementation to drift). It runs as an XLA fusion in the same
jitted program as the GEMM kernel, not inside the Mosaic GPU kernel: a per-token global scale
needs the amax of the whole row before the first block can be coded, and every CTA along N would
redo the work (PALLAS_NOTES section 6.3). Plain per-token decode GEMMs (no RAC) skip this
pre-pass: ``act_operands`` quantizes their windowed operand in one Triton kernel from the same
functions (``W4A4MatmulConfig.act_operand_kernel``).

The kernels take the quantized operand as ``e2m1 * s_b`` in the MMA dtype (exact in float16
and bfloat16: at most 6 significant bits, magnitudes in [2^-10, 2688]) and apply the global
scales ``g`` in the epilogue.

XLA:GPU's ``SimplifyFPConversions`` (on by default) folds ``f32 -> e4m3 -> f32`` convert chains
inside one jitted program. ``nvfp4.quantize`` rounds its block scales onto the E4M3 grid with
exact arithmetic before the cast (``quads_jax.quant.arith``), so a folded chain changes nothing
and the quantizer, the trainer's fake-quant and this pre-pass fuse freely (checked on the H200
under XLA's default flags: jitted == eager, bit for bit; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from quads_jax.quant import nvfp4, rac

ACT_SCALE_MODES = nvfp4.ACT_SCALE_MODES


@dataclasses.dataclass(frozen=True)
class RACConfig:
    """Residual Activation Compensation options (QUADS_SPEC section 4; names as in QuantRecipe).

    Attributes:
      rac_ratio: fraction of the K/16 blocks compensated, (0, 1].
      rac_selection: online_batch | online_token | static (static needs ``static_blocks``).
      rac_score: residual_l2 | residual_l1 | act_amax.
      rac_residual_scale: separate (own global scale) | shared (the activation's).
      rac_residual_format: nvfp4 | bf16 (residual kept unquantized, rounded to bf16).
      rac_energy_target: adaptive variant, None or (0, 1].
    """

    rac_ratio: float = 0.5
    rac_selection: str = "online_batch"
    rac_score: str = "residual_l2"
    rac_residual_scale: str = "separate"
    rac_residual_format: str = "nvfp4"
    rac_energy_target: float | None = None

    def __post_init__(self):
        if not 0.0 < self.rac_ratio <= 1.0:
            raise ValueError(f"RACConfig.rac_ratio={self.rac_ratio}: must be in (0, 1]")
        choices = {
            "rac_selection": ("online_batch", "online_token", "static"),
            "rac_score": ("residual_l2", "residual_l1", "act_amax"),
            "rac_residual_scale": ("separate", "shared"),
            "rac_residual_format": ("nvfp4", "bf16"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"RACConfig.{name}={getattr(self, name)!r}: one of {allowed}")
        t = self.rac_energy_target
        if t is not None and not 0.0 < t <= 1.0:
            raise ValueError(f"RACConfig.rac_energy_target={t}: must be None or in (0, 1]")

    @classmethod
    def from_recipe(cls, recipe) -> RACConfig:
        """The RAC fields of a ``quads_jax.quant.recipe.QuantRecipe``."""
        return cls(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(cls)})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedActivations:
    """What the W4A4 kernels consume.

    Attributes:
      q: NVFP4 activations ``[M, K]``, unpacked codes (global scale ``[M, 1]`` per token or
        ``[]`` per batch): the kernels build their operands from the codes, and a pack would be
        a wasted pass (``nvfp4.NVFP4Codes.pack`` gives the interchange format).
      residual: the RAC residual of the selected blocks: a ``rac.SelectedResidual`` (its NVFP4
        codes ``[M, K]``, zero blocks outside the selection, made on demand for any rows: the
        kernels' token tiles), bf16 ``[M, K]`` for ``rac_residual_format="bf16"``, or None.
      mask: bool ``[M, K/16]`` selected blocks, or None without RAC.
      q_rows: None, or int32 ``[M]``: ``q`` holds the distinct rows ``[R, K]`` and GEMM row
        ``i`` is ``q``'s row ``q_rows[i]`` (``nvfp4_quantize``'s ``source_rows``).
      operand: None, or ``(values [R, K], g float32 [R], x [R, K])``: ``q``'s ``mma_operand``
        as a kernel wrote it (``pallas_kernels.rac_rows``) and the activations it quantized
        (``rac_operands`` recomputes the residual from both): then nothing computes them from
        the codes, and XLA drops the codes' pass where nothing else reads them. ``values``
        None: the row pass placed them (``placed``).
      placed: None, or the stacked ``[2, P, K]`` buffer into whose operand 0 the row pass
        wrote each row's values at its window row (``row_pass``' placement), for
        ``rac_operands(placed=...)`` to complete in place.
      selection_stats: None, or the row pass's ``(scores float32, amax float32, finite int8)``
        ``[R, K/16]`` of the distinct rows and ``row_valid`` (None or ``[R]``): what
        ``rac_operands`` selects blocks from when it does the selection itself
        (``rac_operands.OperandSelection``).
    """

    q: nvfp4.NVFP4Codes
    residual: rac.SelectedResidual | jax.Array | None = None
    mask: jax.Array | None = None
    q_rows: jax.Array | None = None
    operand: tuple[jax.Array | None, jax.Array, jax.Array] | None = None
    placed: jax.Array | None = None
    selection_stats: tuple | None = None


def _check_x(x: jax.Array, act_scale_mode: str, static_scale) -> None:
    if act_scale_mode not in ACT_SCALE_MODES:
        raise ValueError(f"act_scale_mode={act_scale_mode!r}: must be one of {ACT_SCALE_MODES}")
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x: shape {getattr(x, 'shape', None)} must be [M, K]")
    if (act_scale_mode == "static") != (static_scale is not None):
        raise ValueError(
            f"static_scale: {'missing' if static_scale is None else 'given'} with "
            f"act_scale_mode={act_scale_mode!r}; a calibrated scale goes with 'static' only"
        )


def nvfp4_quantize(
    x: jax.Array,
    *,
    act_scale_mode: str = "per_token",
    rac_config: RACConfig | None = None,
    row_expert: jax.Array | None = None,
    num_experts: int | None = None,
    static_blocks: jax.Array | None = None,
    static_scale: jax.Array | None = None,
    source_rows: jax.Array | None = None,
    rac_selector=None,
    row_valid: jax.Array | None = None,
    row_pass=None,
) -> QuantizedActivations:
    """Quantize activations ``x: [M, K]`` (bf16/f16/f32, K % 16 == 0) and their RAC residual.

    Args:
      act_scale_mode: per_token (one global scale per row) | per_batch (one for all rows) |
        static (``static_scale``: float32 ``[]`` or per row ``[M]``, calibrated).
      rac_config: None for plain W4A4.
      row_expert: int32 ``[M]`` expert of each row (grouped GEMMs: online_batch then selects
        blocks per expert); num_experts: E, with row_expert.
      static_blocks: bool ``[K/16]`` or ``[E, K/16]`` for ``rac_selection="static"``.
      source_rows: None, or int32 ``[M]`` with ``x`` the distinct rows ``[R, K]``: the GEMM's
        rows are ``x[source_rows]``. Per-token quantization is row by row, so ``q`` is computed
        once per distinct row (``q_rows`` = ``source_rows``), bit-identical to quantizing the
        gathered rows; the RAC residual is selected and quantized per GEMM row. Other scale
        modes quantize the gathered rows.
      rac_selector: None, or the selection kernel's call (``rac.select_residual``'s
        ``selector``; ``pallas_kernels.w4a4_grouped`` makes it).
      row_valid: None, or bool per row of ``x``: the rows that are tokens (RAC's
        ``online_batch`` selection scores only those; ``rac.selection_mask``).
      row_pass: None, or ``(rac_rows.RACRowsConfig, interpret, MMA dtype[, placement])``
        (``W4A4MatmulConfig.rac_row_pass``): with RAC, per-token scales and a residual score,
        the operand values and the residual's block statistics come from one kernel
        (``pallas_kernels.rac_rows``), not from the codes' XLA passes
        (``QuantizedActivations.operand``; ``rac_operands`` recomputes the residual itself).
        ``placement``: None, or ``(window_of_row [R] int32, P)`` (no ``source_rows``): the
        values are written straight into the windowed operand (``QuantizedActivations.
        placed``).
    """
    _check_x(x, act_scale_mode, static_scale)
    if source_rows is not None and act_scale_mode != "per_token":
        if row_valid is not None:
            row_valid = row_valid[source_rows]
        x, source_rows = x[source_rows], None  # a per-batch or per-expert scale spans GEMM rows
    q = nvfp4.quantize_activations(x, act_scale_mode, static_scale)
    if rac_config is None:
        return QuantizedActivations(q=q, q_rows=source_rows)
    operand = row_stats = placed = selection_stats = None
    if row_pass is not None and row_pass_applies(rac_config, act_scale_mode):
        from pallas_kernels import rac_rows

        config, interpret, dtype, *placement = row_pass
        placement = placement[0] if placement and source_rows is None else None
        window_of_row, windows = placement if placement is not None else (None, None)
        # No float32 residual written: rac_operands recomputes it from x and the values (and
        # any other consumer gets select_residual's XLA expression, bit-identical).
        rp = rac_rows.rac_row_pass(x, None if config.row_scales else q.global_scale[:, 0],
                                   score=rac_config.rac_score, dtype=dtype, config=config,
                                   interpret=interpret, with_residual=False,
                                   window_of_row=window_of_row, windows=windows)
        if rp.g is not None:  # the kernel's decode scales, the same bits: XLA drops its own
            q = dataclasses.replace(q, global_scale=rp.g[:, None])
        g = q.global_scale[:, 0]  # per token: [R, 1]
        if placement is not None:  # the values live in the windowed buffer, not per row
            placed = rp.values
        operand = (None if placement is not None else rp.values, g, x)
        row_stats = (None, rp.amax, rp.finite, rp.scores, rp.finite_i8)
        selection_stats = (rp.scores, rp.amax[..., 0], rp.finite_i8, row_valid)
    sel = rac.select_residual(
        x, q, rac_config, act_scale_mode=act_scale_mode, rows=source_rows,
        row_expert=row_expert, num_experts=num_experts, static_blocks=static_blocks,
        selector=rac_selector, row_valid=row_valid, row_stats=row_stats,
    )
    residual = sel.masked().astype(jnp.bfloat16) if rac_config.rac_residual_format == "bf16" else sel
    return QuantizedActivations(q=q, residual=residual, mask=sel.mask, q_rows=source_rows,
                                operand=operand, placed=placed,
                                selection_stats=selection_stats)


def row_pass_applies(rac_config: RACConfig, act_scale_mode: str) -> bool:
    """Whether ``rac_rows``' kernel computes this configuration's row pass: per-token scales
    and a residual score (``act_amax`` scores the activations: the jnp path)."""
    from pallas_kernels.rac_rows import SCORES

    return act_scale_mode == "per_token" and rac_config.rac_score in SCORES


def acts_operand(acts: QuantizedActivations, dtype) -> tuple[jax.Array, jax.Array]:
    """``mma_operand(acts.q, dtype)``, the kernel-written copy where ``acts`` has one in
    ``dtype``."""
    if (acts.operand is not None and acts.operand[0] is not None
            and acts.operand[0].dtype == jnp.dtype(dtype)):
        return acts.operand[:2]
    return mma_operand(acts.q, dtype)


def mma_operand(q: nvfp4.NVFP4Codes | nvfp4.NVFP4Tensor, dtype) -> tuple[jax.Array, jax.Array]:
    """``(e2m1 * s_b)`` ``[M, K]`` in ``dtype`` (exact) and the float32 global scale per row ``[M]``."""
    vals = nvfp4.unscaled_values(q).astype(dtype)
    g = jnp.broadcast_to(jnp.asarray(q.global_scale, jnp.float32).reshape(-1), (q.shape[0],))
    return vals, g


def kernel_operands(
    acts: QuantizedActivations, dtype
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The kernel's B operands (1 or 2 arrays ``[M, K]`` in ``dtype``; the first ``[R, K]``
    with ``acts.q_rows``) and their per-row scales."""
    b0, g0 = acts_operand(acts, dtype)
    if acts.residual is None:
        return (b0,), (g0,)
    if isinstance(acts.residual, rac.SelectedResidual):  # values without the codes' pass
        b1, g1 = acts.residual.unscaled().astype(dtype), acts.residual.global_scale
    else:
        b1, g1 = acts.residual.astype(dtype), jnp.ones((b0.shape[0],), jnp.float32)
    return (b0, b1), (g0, g1)


def dequantized_sum(acts: QuantizedActivations) -> tuple[jax.Array, ...]:
    """float32 ``dq(Q(x))`` and, with RAC, ``dq(Q(R_S))``: the references' activation operands
    (``[M, K]``: ``q_rows`` applied)."""
    q = nvfp4.dequantize(acts.q, jnp.float32)
    out = [q if acts.q_rows is None else q[acts.q_rows]]
    if isinstance(acts.residual, rac.SelectedResidual):
        out.append(nvfp4.dequantize(acts.residual.codes(), jnp.float32))
    elif acts.residual is not None:
        out.append(acts.residual.astype(jnp.float32))
    return tuple(out)
