"""The MoE slots' stable sort by expert in one kernel (Pallas, Triton backend).

``quads_jax.models.moe.sort_slots`` gives the grouped matmuls their row order: for the token
slots' experts ``ids [S]``, ``counts [E]`` (slots per expert), ``inverse [S]`` (each slot's
sorted row: the slots of lower experts plus the earlier slots of the same expert) and ``order
[S]`` (the slot at each sorted row, ``inverse``'s inverse). For a decode step's few slots the
jnp path counts instead of sorting, and XLA runs it as five kernels per layer: a zero-fill and
a scatter-add (``counts``), the pairwise count (``inverse``), a copy and a scatter
(``order``); on an H100 (2026-12-06, 04546c3, batch-128 decode step, traced) 0.9 + 1.2 + 2.2
+ 1.6 + 1.0 us per layer, each with its launch gap. Here they are one kernel.

Program ``p`` (``grid = (S / block,)``) owns slots ``[p * block, (p + 1) * block)`` and a
slice of the experts. It loads all S ids and counts, for each of its slots, the slots that
sort before it (``moe.slot_sorts_before``, the jnp path's own comparison) and, for each of its
experts, the slots routed there; it then writes its slots' ``inverse``, scatters their slot
numbers to ``order[inverse]`` (a permutation: no two programs write the same row) and writes
its experts' counts. Integer arithmetic only: equal to the jnp path (tests, and on the GPU
``kernel_probe --slot-sort``).

Measured on an H100 (2026-12-06, 398e556, ``h200_next.sh ssort``): equal to the jnp path at
128 / 256 tokens x top-8, uniform and skewed routing, in 2.5-3.7 us against the jnp path's
5.7-7.6 us; the batch-128 decode step ran 72 kernels fewer. ``moe`` uses it by default where
the grouped matmuls are kernels (``moe.set_slot_sort_kernel``, ``bench_rollout.py
--[no-]slot-sort-kernel``).

Shapes: ids int32 ``[S]`` in ``[0, E)``, S a power of two up to ``MAX_SLOTS`` (Triton's
arrays are powers of two; padding would be an XLA pass of its own, and ``moe.sort_slots``
keeps the jnp path for other S, ``supports``); outputs int32 ``order [S]``, ``inverse [S]``,
``counts [E]``. ``block`` shrinks with S so that ``[block, S]`` stays at 16 384 entries.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_grid import check_num_warps, check_pow2_fields, pow2_at_least
from pallas_kernels.vma import varying_operands


@dataclasses.dataclass(frozen=True)
class SlotSortConfig:
    """block: slots per program (at most; a power of two: each program compares its slots
    with all S, ``[block, S]`` in registers); num_warps: Triton warps per program."""

    block: int = 16
    num_warps: int = 4

    def __post_init__(self):
        check_pow2_fields(self, "block")
        check_num_warps(self)


MAX_SLOTS = 8192
_ENTRIES = 16384  # [block, S] compared per program


def _block(s: int, config: SlotSortConfig) -> int:
    return max(1, min(config.block, _ENTRIES // s, s))


def _experts_per_program(s: int, e: int, config: SlotSortConfig) -> int:
    """Each program counts one slice of the experts: the smallest power of two that, over the
    ``S / block`` programs, covers ``[0, E)`` and divides ``E`` (so no slice's window crosses
    E's end; programs past the last slice write nothing)."""
    programs = s // _block(s, config)
    return min(pow2_at_least(-(-e // programs)), e & -e)


def supports(s: int, e: int, config: SlotSortConfig = SlotSortConfig()) -> bool:
    """Whether the kernel sorts ``s`` slots over ``e`` experts (else ``moe.sort_slots``' jnp
    path): S a power of two up to ``MAX_SLOTS``, and the programs' expert slices must cover E
    (every power-of-two E does)."""
    return (1 <= s <= MAX_SLOTS and s & (s - 1) == 0 and e >= 1
            and _experts_per_program(s, e, config) * (s // _block(s, config)) >= e)


def _kernel(ids_ref, order_ref, inverse_ref, counts_ref, *, s: int, e: int, block: int,
            experts_per: int):
    from quads_jax.models.moe import slot_sorts_before  # the jnp path's comparison

    # Every program loads all S ids (a few KB, from L2; its slots' rank needs them all) and
    # picks its own by comparison, in the same [block, S] shape as the rank.
    every = ids_ref[...]  # [S]
    every_slot = jnp.arange(s, dtype=jnp.int32)
    p = pl.program_id(0)
    slot = p * block + jnp.arange(block, dtype=jnp.int32)
    here = every_slot[None, :] == slot[:, None]  # [block, S]
    ids = jnp.sum(jnp.where(here, every[None, :], 0), axis=1)
    inverse = jnp.sum(slot_sorts_before(every[None, :], every_slot[None, :], ids[:, None],
                                        slot[:, None]).astype(jnp.int32), axis=1)
    expert = p * experts_per + jnp.arange(experts_per, dtype=jnp.int32)
    counts = jnp.sum((every[:, None] == expert[None, :]).astype(jnp.int32), axis=0)
    pltriton.store(inverse_ref.at[pl.ds(p * block, block)], inverse)
    pltriton.store(order_ref.at[inverse], slot)
    pltriton.store(counts_ref.at[pl.ds(jnp.minimum(p * experts_per, e - experts_per),
                                       experts_per)],
                   counts, mask=expert < e)


@functools.partial(jax.jit, static_argnames=("num_experts", "config", "interpret"))
def slot_sort(ids: jax.Array, num_experts: int, *, config: SlotSortConfig = SlotSortConfig(),
              interpret: bool = False):
    """``(order, inverse, counts)`` of ``moe.sort_slots`` (module docstring)."""
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[0] < 1:
        raise ValueError(f"slot_sort: ids {ids.dtype}{list(ids.shape)}; need int32 [S], S >= 1")
    if num_experts < 1:
        raise ValueError(f"slot_sort: num_experts={num_experts} must be >= 1")
    if not supports(ids.shape[0], num_experts, config):
        raise ValueError(f"slot_sort: {ids.shape[0]} slots over {num_experts} experts: S must "
                         f"be a power of two up to {MAX_SLOTS} and the programs' power-of-two "
                         "expert slices must cover E (slot_sort.supports; moe.sort_slots then "
                         "counts in jnp)")
    s, e = ids.shape[0], num_experts
    block = _block(s, config)
    programs = s // block
    experts_per = _experts_per_program(s, e, config)
    vary, (ids32,) = varying_operands(ids.astype(jnp.int32))
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, s=s, e=e, block=block, experts_per=experts_per)
    return tuple(pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[whole((s,))],
        out_specs=[whole((s,)), whole((s,)), whole((e,))],
        out_shape=[jax.ShapeDtypeStruct((s,), jnp.int32, **vary),
                   jax.ShapeDtypeStruct((s,), jnp.int32, **vary),
                   jax.ShapeDtypeStruct((e,), jnp.int32, **vary)],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="slot_sort",
    )(ids32))
