"""``jit_call``: a function that a test would run eagerly, compiled as one program instead.

Run eagerly, every jnp operation is a program of its own, compiled for each new shape (~25-40
ms each on the CI's two cores): an interpret-mode kernel call (the XLA work around the
interpreted kernel: quantization pre-pass, operand layouts, epilogue) compiles some 300 of
them, a quantizer 100-200. Compiled whole, the same call is one compile of about a second: the
interpret-mode kernel tests take half the time. The values are what the function computes
(under ``jax.jit``, as in the model); tests of eager dispatch itself, and calls expected to
raise (refusals on concrete values, ``pytest.raises``), call the function directly.

Test modules import it as ``from compiled import jit_call``: pytest puts ``tests/`` (the
directory of ``tests/conftest.py``, not a package) on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def jit_call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under ``jax.jit``: the array leaves of the arguments (jax or
    NumPy) are the program's inputs; every other leaf (configs, flags, ints, strings, dtypes)
    and the pytree structure stay static, as Python values of the call. Each call traces
    afresh, so global settings (``kernel_backend.set_*``, ``layers.set_decode_attention``) are
    read when it is made, as an eager call reads them."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    traced = [isinstance(x, jax.Array | np.ndarray) for x in leaves]

    def call(arrays):
        it = iter(arrays)
        full = [next(it) if t else x for t, x in zip(traced, leaves, strict=True)]
        a, k = jax.tree.unflatten(tree, full)
        return fn(*a, **k)

    return jax.jit(call)([x for t, x in zip(traced, leaves, strict=True) if t])
