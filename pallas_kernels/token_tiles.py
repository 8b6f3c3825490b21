"""The tile kernels' token operands: windows of ``block_m`` rows into compact row arrays.

A tile kernel (``nvfp4_tiles_mgpu``, ``fp8_tiles_mgpu``) multiplies, for every token tile
``t``, a weight matrix with ``block_m`` activation rows: rows ``[row0[t], row0[t] + block_m)``
of each operand array ``[R, Kp]``. For a MoE GEMM the operand holds the rows sorted by expert,
each group starting at a multiple of ``ROW_ALIGN`` rows (``w4a4_grouped.tile_plan``), and tile
``t`` starts at its group's first (or next) row. A window's slots past its group's end read
padding or the next group's rows; their products are never read back (their slot scales are
0 and no GEMM row maps to them).

Why windows and not gathered tiles ``[T, block_m, Kp]``: a decode step's grouped GEMM has
``T = M / block_m + E`` tiles for M rows (192 tiles of 16 for 1 024 rows over 128 experts:
3 072 slots, two thirds of them empty), and gathering them wrote three times the operand's
bytes in an XLA fusion before every grouped kernel (8.4 us of gate_up's operand, 18.3 us with
RAC's residual, per layer on the H200, 2026-12-03). The aligned operand has at most
``M + 7 min(E, M) + block_m`` rows (1 936 there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Windows start at multiples of this many rows: Mosaic GPU copies a window into the (8, x)
# tiled SMEM operand as whole 8-row tiles of the source, and must be able to prove it
# (``pl.multiple_of``); the grouped tile plan starts every group at such a row.
ROW_ALIGN = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenTiles:
    """Token tiles as row windows.

    Attributes:
      rows: the operands, each ``[R, Kp]`` (one, or two with RAC: activations and residual),
        same shape and dtype. Every window must lie inside: ``row0[t] + block_m <= R``. Or,
        with ``stacked``, one array ``[A, R, Kp]`` holding the A operands (what the tile
        kernels with ``stack_operands`` read; ``pallas_kernels.rac_operands`` writes it).
      row0: int32 ``[T]``, the first row of each tile, a multiple of ``ROW_ALIGN`` (tiles past
        the live count: any valid start, e.g. 0).
      block_m: rows per tile (static).
    """

    rows: tuple[jax.Array, ...]
    row0: jax.Array
    block_m: int = dataclasses.field(metadata={"static": True})
    stacked: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def num_tiles(self) -> int:
        return self.row0.shape[0]

    @property
    def num_operands(self) -> int:
        return self.rows[0].shape[0] if self.stacked else len(self.rows)

    def operands(self) -> tuple[jax.Array, ...]:
        """The operands as arrays ``[R, Kp]``."""
        if not self.stacked:
            return tuple(self.rows)
        (s,) = self.rows
        return tuple(s[a] for a in range(s.shape[0]))

    def stack(self) -> jax.Array:
        """The operands as one array ``[A, R, Kp]`` (a copy unless ``stacked``)."""
        return self.rows[0] if self.stacked else jnp.stack(self.rows)

    @classmethod
    def of(cls, b_tiles) -> TokenTiles:
        """``TokenTiles`` as they are, or gathered tiles ``[T, block_m, Kp]`` (a tuple of them)
        as windows of their rows (a reshape: tile ``t`` starts at row ``t * block_m``)."""
        if isinstance(b_tiles, TokenTiles):
            return b_tiles
        b_tiles = tuple(b_tiles)
        if not b_tiles or any(b.ndim != 3 or b.shape != b_tiles[0].shape for b in b_tiles):
            raise ValueError(f"b_tiles: {[tuple(b.shape) for b in b_tiles]}; need TokenTiles or "
                             "1-2 arrays [T, block_m, Kp] of one shape")
        t, bm, k = b_tiles[0].shape
        return cls(tuple(b.reshape(t * bm, k) for b in b_tiles),
                   jnp.arange(t, dtype=jnp.int32) * bm, bm)

    def check(self, k_pad: int, dtypes: tuple) -> None:
        """Shapes and dtypes a kernel accepts (``dtypes``: the operand dtypes allowed)."""
        bm = self.block_m
        if not isinstance(bm, int) or bm % 8 or not 8 <= bm <= 256:
            raise ValueError(f"block_m={bm!r}: the wgmma N side needs a multiple of 8 in [8, 256]")
        if self.stacked and (len(self.rows) != 1 or self.rows[0].ndim != 3):
            raise ValueError(f"rows: {[tuple(r.shape) for r in self.rows]}; stacked operands "
                             "are one array [A, R, Kp]")
        shapes = {(tuple(r.shape[self.stacked:]), jnp.dtype(r.dtype)) for r in self.rows}
        if len(shapes) != 1 or not 1 <= self.num_operands <= 2:
            raise ValueError(f"rows: {[(tuple(r.shape), str(r.dtype)) for r in self.rows]}; need "
                             "1 or 2 arrays [R, Kp] of one shape and dtype")
        (shape, dtype), = shapes
        if len(shape) != 2 or shape[1] != k_pad or shape[0] < bm or shape[0] % ROW_ALIGN:
            raise ValueError(f"rows: shape {shape}; need [R, Kp={k_pad}], R >= block_m={bm} "
                             f"and a multiple of {ROW_ALIGN}")
        if dtype not in tuple(jnp.dtype(d) for d in dtypes):
            raise ValueError(f"rows: dtype {dtype}; need one of {[str(d) for d in dtypes]}")
        if self.row0.ndim != 1 or self.row0.dtype != jnp.int32:
            raise ValueError(f"row0: {self.row0.dtype}{list(self.row0.shape)}; need int32 [T]")
        if not isinstance(self.row0, jax.core.Tracer):  # concrete: check the windows now
            r0 = np.asarray(self.row0)
            if r0.size and ((r0 % ROW_ALIGN).any() or r0.min() < 0 or r0.max() + bm > shape[0]):
                raise ValueError(f"row0: starts {r0.tolist()[:8]}...; need multiples of "
                                 f"{ROW_ALIGN} with row0 + block_m <= R={shape[0]}")

    def gathered(self) -> tuple[jax.Array, ...]:
        """The tiles as arrays ``[T, block_m, Kp]`` (for references and tests)."""
        idx = self.row0[:, None] + jnp.arange(self.block_m, dtype=jnp.int32)[None, :]
        return tuple(r[idx] for r in self.operands())
