"""Checks and sizes shared by the Triton-backend kernels' tuning dataclasses, and their
masked scatter stores' indices.

Triton's arrays have power-of-two shapes and a program runs 1, 2, 4 or 8 warps: each config's
``__post_init__`` raises a ``ValueError`` naming the field, its value and what it must be.
"""

from __future__ import annotations

import jax.numpy as jnp

WARPS = (1, 2, 4, 8)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def check_pow2_fields(config, *names: str, minimum: int = 1) -> None:
    """Each field of ``config`` in ``names`` must be an int power of two >= ``minimum``."""
    cls = type(config).__name__
    for name in names:
        v = getattr(config, name)
        if not isinstance(v, int) or v < minimum or v & (v - 1):
            raise ValueError(f"{cls}.{name}={v!r}: a power of two >= {minimum}")


def check_num_warps(config) -> None:
    """``config.num_warps`` must be one of ``WARPS``."""
    if config.num_warps not in WARPS:
        raise ValueError(f"{type(config).__name__}.num_warps={config.num_warps}: one of "
                         f"{', '.join(map(str, WARPS))}")


def masked_index(ok, index, past_end: int):
    """A masked scatter store's indices: the masked-off lanes' at ``past_end`` (past the
    array's end). The GPU never writes masked lanes; the interpreter runs the store as a
    scatter that writes their old values back, which drops indices past the end, where an
    in-range index could land on a live lane's and overwrite its value (two lanes, one
    index)."""
    return jnp.where(ok, index, past_end)
