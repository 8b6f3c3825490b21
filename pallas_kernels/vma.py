"""Pallas calls inside ``shard_map`` with ``check_vma``: operands and outputs that vary alike.

A ``pl.pallas_call`` traced inside ``shard_map`` (the expert-parallel MoE block) must declare
outputs as varying over the mesh axes its inputs vary over, and every input must vary over all
of them (``jax.lax.pcast``). Outside ``shard_map`` both are no-ops.
"""

from __future__ import annotations

import jax


def _varying(*xs) -> frozenset:
    """The mesh axes any of ``xs`` varies over (empty outside ``shard_map``)."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in xs))


def varying_like(*xs) -> dict:
    """``ShapeDtypeStruct`` keywords for outputs that vary over the mesh axes any of ``xs``
    varies over (empty outside ``shard_map``)."""
    varying = _varying(*xs)
    if not varying:
        return {}
    from jax._src import core  # ManualAxisType has no public constructor in jax 0.11.2

    return dict(manual_axis_type=core.ManualAxisType(varying=varying))


def _vary_over(a: jax.Array, axes) -> jax.Array:
    """``a`` cast to vary over ``axes`` too (the ones it does not vary over yet)."""
    missing = tuple(sorted(frozenset(axes) - _varying(a)))
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
    return _vary_over(y, _varying(*xs))


def cotangent_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent typed like its primal inside ``shard_map`` (a ``custom_vjp`` backward of a
    Mosaic GPU kernel): summed over the mesh axes it varies over and the primal does not (a
    weight replicated over ``data`` while each device held its own tokens: the devices' partial
    dW add up), cast to vary over those the primal varies over. No-op outside ``shard_map``."""
    extra = _varying(ct) - _varying(primal)
    if extra:
        ct = jax.lax.psum(ct, tuple(sorted(extra)))
    return vary_like(ct, primal)
