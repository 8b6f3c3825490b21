"""BF16 grouped (ragged) matmul with its gradient on Hopper: the trainer's expert matmuls.

``grouped_matmul(x, w, group_sizes)``: ``y[m] = x[m] @ w[e(m)]^T`` for rows sorted by expert,
``x [M, K]`` and ``w [E, N, K]`` bfloat16, differentiable in ``x`` and ``w``
(``jax.custom_vjp``). ``grouped_matmul_reference`` is the same product in jnp (XLA
``ragged_dot``).

Why: on the H200, XLA lowers ``jax.lax.ragged_dot`` to a dense product over all E experts
(E-times redundant): 35.6 ms against 1.34 ms for jax's Pallas ``ragged_dot_mgpu`` at 32 768
rows of Qwen3-30B-A3B's gate_up (2026-12-02, docs/BENCHMARKS.md), and its gradient is the same
expansion. The trainer (bf16 and QAT recipes) runs every expert matmul through ``ops``' grouped
product, forward and backward.

The three products:
- forward ``y = x W_e^T`` and ``dx = dy W_e``: jax's ``ragged_dot_mgpu`` (rows ragged, K dense);
- ``dW_e = dy_e^T x_e`` (a contraction over each group's rows): ``ragged_contract`` below. Each
  group's rows are first gathered into whole blocks of ``dw_block_rows`` rows, zero-padded
  (``padded_group_rows``), so the kernel's steps never straddle two groups and need no masks;
  one persistent grid walks (expert, N tile, K tile) items and accumulates the group's blocks
  with wgmma (A: the dy block transposed in SMEM). jax's ``transposed_ragged_dot_mgpu`` does
  the same contraction with in-kernel masks, but reads the SM count from ``jax.devices()``,
  so it can neither lower for cuda on a CPU (CI) nor run in the interpreter. The default since
  its GPU check (session 27, H100: the same error as XLA's ``ragged_dot_general`` against an
  f32 product, 10x faster); ``BF16GroupedConfig(dw_kernel=False)`` takes XLA's path
  (``ragged_contract_xla``).

Rows past ``sum(group_sizes)`` (the expert-parallel local groups) give zero rows of ``y`` and
``dx`` and add nothing to ``dW``, as ``ragged_dot`` does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

from pallas_kernels.nvfp4_tiles_mgpu import _num_sms
from pallas_kernels.vma import cotangent_like, vary_like
from pallas_kernels.w4a4_grouped import aligned_group_rows
from quads_jax.quant import ops

# Every operand dimension the kernels tile must be a multiple of this (the smallest block).
DIM_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class BF16GroupedConfig:
    """Tuning of the BF16 grouped matmuls.

    Attributes:
      block_m, block_n, block_k: ``ragged_dot_mgpu``'s tile (rows, output columns,
        contraction) for the forward and dx products; a dimension not divisible by
        ``block_n`` falls back to 64. jax's bench arm used 64 / 128 / 64 (session 8).
      max_concurrent_steps, grid_block_n: ``ragged_dot_mgpu``'s pipeline depth and snake width.
      dw_block_rows: rows per contraction step of dW (each group padded to a multiple).
      dw_block_n, dw_block_k: dW's output tile ``[dw_block_n, dw_block_k]`` (64 fallback).
      dw_concurrent_steps: dW's pipeline depth (>= 2: a step's buffers are released one step
        late, which is what lets the wgmma run asynchronously).
      num_sms: dW's persistent CTAs; None: the device's (4 in the interpreter).
      dw_kernel: dW through ``ragged_contract`` (True, the default) or XLA's
        ``ragged_dot_general`` (False). On the H100 (session 27, ``bench_kernels --part
        train-grouped``) ``ragged_contract``'s dW has the same error as XLA's against an f32
        product and the forward + backward takes 1.3 ms instead of 13.1 ms at the 30B model's
        gate_up shape. The forward and dx kernel is jax's ``ragged_dot_mgpu``.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1
    dw_block_rows: int = 64
    dw_block_n: int = 128
    dw_block_k: int = 128
    dw_concurrent_steps: int = 3
    num_sms: int | None = None
    dw_kernel: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "dw_block_rows", "dw_block_n",
                     "dw_block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v % DIM_MULTIPLE or not DIM_MULTIPLE <= v <= 256:
                raise ValueError(f"BF16GroupedConfig.{name}={v!r}: a multiple of "
                                 f"{DIM_MULTIPLE} in [{DIM_MULTIPLE}, 256]")
        for name, low in (("max_concurrent_steps", 1), ("grid_block_n", 1),
                          ("dw_concurrent_steps", 2)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise ValueError(f"BF16GroupedConfig.{name}={v!r}: an int >= {low}")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or self.num_sms < 1):
            raise ValueError(f"BF16GroupedConfig.num_sms={self.num_sms!r}: None or an int >= 1")
        if not isinstance(self.dw_kernel, bool):
            raise ValueError(f"BF16GroupedConfig.dw_kernel={self.dw_kernel!r}: True or False")


def supported(x_shape, w_shape, dtype) -> bool:
    """Whether the kernels take ``x [M, K]``, ``w [E, N, K]`` of ``dtype``: bfloat16 and N, K
    multiples of ``DIM_MULTIPLE`` (else use the reference)."""
    n, k = w_shape[-2], w_shape[-1]
    return (jnp.dtype(dtype) == jnp.bfloat16 and len(x_shape) == 2 and len(w_shape) == 3
            and x_shape[1] == k and n % DIM_MULTIPLE == 0 and k % DIM_MULTIPLE == 0)


def _fit(dim: int, block: int) -> int:
    return block if dim % block == 0 else DIM_MULTIPLE


def _check(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if not supported(x.shape, w.shape, x.dtype) or w.dtype != x.dtype:
        raise ValueError(
            f"grouped_matmul: x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}; need "
            f"bfloat16 x [M, K] and w [E, N, K] with N and K multiples of {DIM_MULTIPLE}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes {group_sizes.dtype}"
                         f"{list(group_sizes.shape)} must be int [{w.shape[0]}]")


def _rows_in_groups(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Zero the rows past the groups (``ragged_dot_mgpu`` leaves them unwritten)."""
    live = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))


def _ragged(lhs, rhs, group_sizes, transpose_rhs: bool, config: BF16GroupedConfig,
            interpret: bool) -> jax.Array:
    """``ragged_dot_mgpu`` of ``lhs [M, C]`` with ``rhs [E, N, C]`` (``transpose_rhs``) or
    ``[E, C, N]``: bf16 ``[M, N]``, rows past the groups zero."""
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    call = functools.partial(
        ragged_dot_mgpu.ragged_dot, lhs, rhs, group_sizes=group_sizes,
        block_m=config.block_m, block_n=_fit(n, config.block_n),
        block_k=_fit(lhs.shape[1], config.block_k),
        max_concurrent_steps=config.max_concurrent_steps, grid_block_n=config.grid_block_n,
        transpose_rhs=transpose_rhs)
    if interpret:
        with plgpu.force_gpu_interpret_mode():
            y = call()
    else:
        y = call()
    return _rows_in_groups(vary_like(y, lhs, rhs), group_sizes)


def padded_group_rows(group_sizes: jax.Array, num_rows: int, block_rows: int):
    """Each group's rows gathered into whole blocks of ``block_rows``: ``(index, first_block,
    num_blocks)``.

    ``index`` int32 ``[P]``: the source row of each padded row, -1 for padding, with
    ``P = block_rows * ceil((num_rows + E (block_rows - 1)) / block_rows)`` (room for every
    group's last partial block); ``first_block`` / ``num_blocks`` int32 ``[E]``: each group's
    blocks in the padded rows. Rows past ``sum(group_sizes)`` appear in no group. The layout of
    the tile kernels' windowed operands (``w4a4_grouped.aligned_group_rows``), aligned to
    ``block_rows`` instead of 8.
    """
    e = group_sizes.shape[0]
    p = block_rows * (-(-(num_rows + e * (block_rows - 1)) // block_rows))
    rows, starts, ends = aligned_group_rows(group_sizes.astype(jnp.int32), num_rows,
                                            block_rows, p)
    return (jnp.where(rows < num_rows, rows, -1), starts // block_rows,
            (ends - starts) // block_rows)


def _gather_rows(a: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.where((index >= 0)[:, None], a[jnp.maximum(index, 0)], jnp.zeros((), a.dtype))


def _swizzle_transforms(minor: int, dtype) -> tuple:
    """SMEM transforms of a ``[rows, minor]`` wgmma operand: (8, swizzle) tiles, swizzled."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def ragged_contract(dy: jax.Array, x: jax.Array, group_sizes: jax.Array, *,
                    config: BF16GroupedConfig | None = None, interpret: bool = False,
                    out_dtype=jnp.bfloat16) -> jax.Array:
    """``out[e] = dy_e^T @ x_e`` over each group's rows: ``dy [M, N]``, ``x [M, K]`` bfloat16
    -> ``[E, N, K]`` (f32 accumulation, then ``out_dtype``); empty groups give zeros."""
    config = config or BF16GroupedConfig()
    (m, n), k, e = dy.shape, x.shape[1], group_sizes.shape[0]
    if (x.shape[0] != m or dy.dtype != jnp.bfloat16 or x.dtype != jnp.bfloat16
            or n % DIM_MULTIPLE or k % DIM_MULTIPLE):
        raise ValueError(f"ragged_contract: dy {dy.dtype}{list(dy.shape)}, x {x.dtype}"
                         f"{list(x.shape)}; need bfloat16 [M, N] and [M, K] with N, K "
                         f"multiples of {DIM_MULTIPLE}")
    br = config.dw_block_rows
    bn, bk = _fit(n, config.dw_block_n), _fit(k, config.dw_block_k)
    index, first_block, num_blocks = padded_group_rows(group_sizes, m, br)
    dy_p, x_p = _gather_rows(dy, index), _gather_rows(x, index)
    grid_n, grid_k = n // bn, k // bk
    dy_transforms = _swizzle_transforms(bn, dy.dtype)
    x_transforms = _swizzle_transforms(bk, x.dtype)
    o_transforms = _swizzle_transforms(bk, out_dtype)

    def body(first_gmem, count_gmem, dy_gmem, x_gmem, o_gmem):
        @plgpu.nd_loop((e, grid_n * grid_k), collective_axes="sm")
        def item(info: plgpu.NDLoopInfo):
            g = info.index[0]
            ni = jax.lax.div(info.index[1], grid_k)
            ki = jax.lax.rem(info.index[1], grid_k)
            first, count = first_gmem[g], count_gmem[g]

            def acc_scope(acc_ref):
                def step(_, dy_smem, x_smem):
                    # acc [bn, bk] += dy_block^T [bn, br] @ x_block [br, bk]
                    plgpu.wgmma(acc_ref, dy_smem.transpose((1, 0)), x_smem)

                @pl.when(count > 0)  # an empty group stores zeros
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(count,),
                        in_specs=[
                            plgpu.BlockSpec((br, bn), lambda t: (first + t, ni),
                                            delay_release=1, transforms=dy_transforms),
                            plgpu.BlockSpec((br, bk), lambda t: (first + t, ki),
                                            delay_release=1, transforms=x_transforms),
                        ],
                        max_concurrent_steps=config.dw_concurrent_steps,
                    )(dy_gmem, x_gmem)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bn, bk)))

            @functools.partial(pl.run_scoped,
                               o_smem=plgpu.SMEM((bn, bk), o_gmem.dtype, transforms=o_transforms))
            def _(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_gmem.at[g, pl.ds(ni * bn, bn), pl.ds(ki * bk, bk)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((e, n, k), out_dtype),
        grid=(config.num_sms or _num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return vary_like(call(first_block, num_blocks, dy_p, x_p), dy, x)


def ragged_contract_xla(dy: jax.Array, x: jax.Array, group_sizes: jax.Array,
                        out_dtype=jnp.bfloat16) -> jax.Array:
    """``ragged_contract`` through XLA's ``ragged_dot_general`` (rows the ragged contracting
    dimension; f32 accumulation): ``[E, N, K]``. The backward's default dW, and the kernel's
    reference."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    out = jax.lax.ragged_dot_general(dy, x, group_sizes, dims,
                                     preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``ops``' product (XLA ``ragged_dot``, f32 accumulation), rounded to ``x.dtype``:
    ``[M, N]``."""
    return ops.matmul_f32(x, w, group_sizes).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, config, interpret):
    return _ragged(x, w, group_sizes, True, config, interpret)


def _grouped_fwd(x, w, group_sizes, config, interpret):
    return _grouped(x, w, group_sizes, config, interpret), (x, w, group_sizes)


def _grouped_bwd(config, interpret, res, dy):
    x, w, group_sizes = res
    dy = _rows_in_groups(dy.astype(x.dtype), group_sizes)
    dx = _ragged(dy, w, group_sizes, False, config, interpret)
    if config.dw_kernel:
        dw = ragged_contract(dy, x, group_sizes, config=config, interpret=interpret,
                             out_dtype=w.dtype)
    else:
        dw = ragged_contract_xla(dy, x, group_sizes, out_dtype=w.dtype)
    return cotangent_like(dx, x), cotangent_like(dw, w), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   config: BF16GroupedConfig | None = None,
                   interpret: bool = False) -> jax.Array:
    """``y[m] = x[m] @ w[e(m)]^T``: ``x [M, K]``, ``w [E, N, K]`` bfloat16, ``group_sizes``
    int ``[E]`` (rows of expert 0 first; rows past the sum give zeros) -> bfloat16 ``[M, N]``
    (f32 accumulation). Differentiable in ``x`` and ``w``: dx through ``ragged_dot_mgpu``, dW
    through ``ragged_contract`` (``config.dw_kernel``, the default) or ``ragged_contract_xla``.
    N and K must be multiples of ``DIM_MULTIPLE``
    (``supported``); anything else raises ``ValueError``."""
    _check(x, w, group_sizes)
    return _grouped(x, w, group_sizes.astype(jnp.int32), config or BF16GroupedConfig(),
                    interpret)
