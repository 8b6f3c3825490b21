"""Pallas calls inside ``shard_map`` with ``check_vma``: operands and outputs that vary alike.

A ``pl.pallas_call`` traced inside ``shard_map`` (the expert-parallel MoE block) must declare
outputs as varying over the mesh axes its inputs vary over, and every input must vary over all
of them (``jax.lax.pcast``). Outside ``shard_map`` both are no-ops.
"""

from __future__ import annotations

import jax


def varying_like(*xs) -> dict:
    """``ShapeDtypeStruct`` keywords for outputs that vary over the mesh axes any of ``xs``
    varies over (empty outside ``shard_map``)."""
    varying = frozenset().union(*(jax.typeof(x).mat.varying for x in xs))
    if not varying:
        return {}
    from jax._src import core  # ManualAxisType has no public constructor in jax 0.11.2

    return dict(manual_axis_type=core.ManualAxisType(varying=varying))


def _vary_over(a: jax.Array, axes) -> jax.Array:
    """``a`` cast to vary over ``axes`` too (the ones it does not vary over yet)."""
    missing = tuple(sorted(frozenset(axes) - jax.typeof(a).mat.varying))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def varying_operands(*xs) -> tuple[dict, tuple[jax.Array, ...]]:
    """``(varying_like(*xs), xs)`` with every ``x`` cast to vary over all those axes."""
    vary = varying_like(*xs)
    if not vary:
        return vary, xs
    axes = vary["manual_axis_type"].varying
    return vary, tuple(_vary_over(a, axes) for a in xs)


def vary_like(y: jax.Array, *xs) -> jax.Array:
    """``y`` cast to vary over every mesh axis any of ``xs`` varies over (no-op outside
    ``shard_map``). For the outputs of Mosaic GPU kernels (``plgpu.kernel``, jax's
    ``ragged_dot_mgpu``): they come out typed invariant whatever their inputs, and a per-device
    result typed invariant would have its cotangent summed over the devices by autodiff."""
    return _vary_over(y, frozenset().union(*(jax.typeof(x).mat.varying for x in xs)))
