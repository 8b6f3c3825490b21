"""The one matmul dispatch: every projection and expert matmul of the model calls ``linear`` or
``grouped_linear``; the recipe's mode for the site decides what runs.

Weights are stored like HF, ``w: [N, K]`` (experts ``[E, N, K]``), and ``y = x @ w.T``. A weight
leaf may be a master array (quantized here on the fly), a packed ``NVFP4Tensor`` / ``FP8Tensor``
from the weight sync, or a ``rac.CalibratedWeight`` wrapping one of those.

The jnp code of each mode below is the ground truth for the Pallas kernels. Exact arithmetic:

* NVFP4 weights carry one global decode scale per 2-D matrix (``quantize_weight``; for stacked
  experts one per expert, shared by the fused gate and up rows).
* W4A4: both operands as ``e2m1(code) * s_b`` (exact in bf16, QUADS_SPEC section 2), a bf16
  product with f32 accumulation, then ``acc * (g_x * g_w)`` (row's activation scale times the
  matrix's weight scale, multiplied first). Grouped: ``jax.lax.ragged_dot`` on the same operands.
* RAC adds the same product for the re-quantized masked residual (``rac.py``), ``y0 + y1`` in f32.
* W8A8 FP8: e4m3 operands as bf16 (exact), f32 accumulation, ``acc * x_scale * w_scale``.
* Results are returned in ``x.dtype``.

Kernel hook: ``register_kernel(mode, "dense"|"grouped", fn)``. With ``recipe.backend == "auto"``
on a GPU, or ``"interpret"`` anywhere, a registered kernel replaces the jnp path; it is called as
``fn(x, w, *, recipe, site, interpret)`` / ``fn(x, w, group_sizes, *, recipe, site, interpret)``
with ``x`` 2-D ``[M, K]`` (a grouped kernel registered with ``source_rows=True`` is also given
``source_rows=`` and then gets the distinct rows, see ``grouped_linear``); its result (any float
dtype) is cast to ``x.dtype`` (or ``linear``'s ``out_dtype``) here.
``quads_jax.quant.kernel_backend`` (the kernels' module) is imported lazily the first time a
kernel could run.

RAC details the kernels must match (QUADS_SPEC section 4, ``rac.py``): residual
``R = x - dq(Q(x))`` in f32; online_batch scores per 16-block summed over the GEMM's rows (per
expert for grouped GEMMs); the residual is re-quantized with its own per-row global scale
("separate"; per-tensor under ``act_scale_mode="per_batch"``) or with ``Q(x)``'s ("shared");
``y = y0 + y1`` in f32. float32 operands run at HIGHEST precision (no TF32).

``record_inputs()`` lets ``models.collect_site_inputs`` see every site's matmul input.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from quads_jax.quant import fp8, nvfp4, rac
from quads_jax.quant.rac import CalibratedWeight
from quads_jax.quant.recipe import FP8_WEIGHT_MODES, MODES, NVFP4_WEIGHT_MODES, QuantRecipe

KERNEL_KINDS = ("dense", "grouped")
_KERNELS: dict[tuple[str, str], Callable] = {}
_TAKES_SOURCE_ROWS: set[tuple[str, str]] = set()  # grouped kernels that gather rows themselves
_TAKES_OUTPUT_ROWS: set[tuple[str, str]] = set()  # grouped kernels that reorder their result
_KERNEL_MODULE = "quads_jax.quant.kernel_backend"
_kernel_module_loaded = False
_recorders: list[list] = []  # active ``record_inputs`` contexts
_BF16_RECIPE = QuantRecipe(name="bf16")


# ------------------------------------------------------------------------------ kernel registry
def register_kernel(mode: str, kind: str, fn: Callable, *, source_rows: bool = False,
                    output_rows: bool = False) -> None:
    """Register a kernel for ``mode`` (one of recipe.MODES) and ``kind`` (dense | grouped).

    ``source_rows``: a grouped kernel that takes ``source_rows=`` (``grouped_linear``'s distinct
    rows plus their index); others get the gathered rows. ``output_rows``: a grouped kernel
    that takes ``output_rows=`` and returns those rows of its result, in that order; others'
    results are gathered after."""
    if mode not in MODES:
        raise ValueError(f"register_kernel: mode={mode!r} must be one of {MODES}")
    if kind not in KERNEL_KINDS:
        raise ValueError(f"register_kernel: kind={kind!r} must be one of {KERNEL_KINDS}")
    for flag, on in (("source_rows", source_rows), ("output_rows", output_rows)):
        if on and kind != "grouped":
            raise ValueError(f"register_kernel: {flag}=True is for grouped kernels only")
    _KERNELS[(mode, kind)] = fn
    for registry, on in ((_TAKES_SOURCE_ROWS, source_rows), (_TAKES_OUTPUT_ROWS, output_rows)):
        registry.discard((mode, kind))
        if on:
            registry.add((mode, kind))


def registered_kernels() -> tuple[tuple[str, str], ...]:
    return tuple(_KERNELS)


def _load_kernel_module() -> None:
    global _kernel_module_loaded
    if _kernel_module_loaded:
        return
    try:
        importlib.import_module(_KERNEL_MODULE)
    except ModuleNotFoundError as e:
        if e.name != _KERNEL_MODULE:  # a missing dependency *inside* the module is a real error
            raise
    _kernel_module_loaded = True  # after success or "no such module": a real error repeats


def _kernel_for(mode: str, kind: str, recipe: QuantRecipe) -> Callable | None:
    if recipe.backend == "reference":
        return None
    if recipe.backend == "auto" and jax.default_backend() != "gpu":
        return None
    _load_kernel_module()
    return _KERNELS.get((mode, kind))


def grouped_kernel_runs(site: str, recipe: QuantRecipe | None = None) -> bool:
    """Whether ``grouped_linear`` at ``site`` runs a registered kernel: a custom call, which
    XLA's partitioner cannot split (the MoE block then shards its tokens itself)."""
    recipe = recipe or _BF16_RECIPE
    return _kernel_for(recipe.mode_for(site), "grouped", recipe) is not None


@contextlib.contextmanager
def record_inputs():
    """While active, every ``linear`` / ``grouped_linear`` call appends ``(site, x [M, K],
    group_sizes or None)`` to the yielded list (values, or tracers when called under a trace:
    return them from the traced function)."""
    records: list = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def recording() -> bool:
    """Whether a ``record_inputs`` context is active (callers that would trace a site's matmul
    inside a ``shard_map`` must not while it is: the records would be its local tracers)."""
    return bool(_recorders)


def _record(site: str, x: jax.Array, group_sizes: jax.Array | None) -> None:
    for records in _recorders:
        records.append((site, x, group_sizes))


# ------------------------------------------------------------------------------ weights
def _unwrap(w) -> tuple[object, CalibratedWeight | None]:
    return (w.weight, w) if isinstance(w, CalibratedWeight) else (w, None)


def quantize_weight(w: jax.Array, mode: str, recipe: QuantRecipe | None = None):
    """The packed leaf the weight sync stores for a site of ``mode``: an ``NVFP4Tensor`` (one
    global scale per 2-D matrix, scale_mode "expert"), an ``FP8Tensor``, or ``w`` unchanged for
    bf16. Bit-identical to what the fake-quant modes compute from the same master ``w``."""
    recipe = recipe or _BF16_RECIPE
    if mode in NVFP4_WEIGHT_MODES:
        return nvfp4.quantize(w, scale_mode="expert")
    if mode in FP8_WEIGHT_MODES:
        return fp8.quantize(w, granularity=recipe.fp8_weight_granularity)
    return w


def _nvfp4_weight(w, site: str) -> nvfp4.NVFP4Tensor:
    if isinstance(w, nvfp4.NVFP4Tensor):
        return w
    if isinstance(w, fp8.FP8Tensor):
        raise ValueError(f"site {site!r}: an FP8Tensor weight cannot run an NVFP4 mode")
    return nvfp4.quantize(w, scale_mode="expert")


def _fp8_weight(w, site: str, recipe: QuantRecipe) -> fp8.FP8Tensor:
    if isinstance(w, fp8.FP8Tensor):
        return w
    if isinstance(w, nvfp4.NVFP4Tensor):
        raise ValueError(f"site {site!r}: an NVFP4Tensor weight cannot run an FP8 mode")
    return fp8.quantize(w, granularity=recipe.fp8_weight_granularity)


def fake_quant_weight(w, mode: str, site: str, recipe: QuantRecipe) -> jax.Array:
    """The trainer's view of a weight for an NVFP4 / FP8 ``mode``: ``qdq(W)`` forward with a
    straight-through gradient for a master weight, the dequantized value for a packed leaf.
    The weight sync's identity check compares against exactly this function."""
    if isinstance(w, nvfp4.NVFP4Tensor):
        return nvfp4.dequantize(w, jnp.float32)
    if isinstance(w, fp8.FP8Tensor):
        return fp8.dequantize(w, jnp.float32)
    if mode in FP8_WEIGHT_MODES:
        return fp8.fake_quant(w, granularity=recipe.fp8_weight_granularity)
    return nvfp4.fake_quant(w, scale_mode="expert")


def nvfp4_unscaled(q: nvfp4.NVFP4Tensor | nvfp4.NVFP4Codes) -> jax.Array:
    """``e2m1(code) * s_b`` without the global scale, bf16 (exact) ``[..., K]``."""
    return nvfp4.unscaled_values(q).astype(jnp.bfloat16)


# ------------------------------------------------------------------------------ matmul cores
def count_le(ends: jax.Array, values: jax.Array) -> jax.Array:
    """int32 ``searchsorted(ends, values, side="right")`` for sorted ``ends [E]``: how many ends
    are <= each value, as one fused comparison. jnp's default searchsorted is a ``fori_loop`` of
    log2(E) steps, and on the GPU every step of an XLA while loop copies its predicate to the
    host and waits: a few such loops cost ~190 us per grouped matmul on the H200."""
    return jnp.sum(values[..., None] >= ends, axis=-1, dtype=jnp.int32)


def expert_of_rows(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """int32 ``[M]``: the group of each row of a grouped (ragged) operand; rows past the last
    group are given the last group."""
    idx = count_le(jnp.cumsum(group_sizes), jnp.arange(num_rows, dtype=jnp.int32))
    return jnp.minimum(idx, group_sizes.shape[0] - 1)


def precision_for(dtype) -> jax.lax.Precision:
    """HIGHEST for float32 operands (a GPU would otherwise run them as TF32 / bf16 passes, and
    "float32 router logits" would not be float32); DEFAULT for bf16, which is exact anyway."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def matmul_f32(a: jax.Array, b: jax.Array, group_sizes: jax.Array | None) -> jax.Array:
    """``a [M, K] @ b.T`` with f32 accumulation; ``b [N, K]`` or grouped ``[E, N, K]`` (XLA
    ``ragged_dot``: on a GPU a dense product over all E experts, which is why grouped kernels
    are registered there)."""
    precision = precision_for(a.dtype)
    if group_sizes is None:
        return jax.lax.dot_general(
            a, b, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32,
        )
    return jax.lax.ragged_dot(
        a, jnp.swapaxes(b, -1, -2), group_sizes, precision=precision,
        preferred_element_type=jnp.float32,
    )


def _per_row(scale: jax.Array, row_expert: jax.Array | None) -> jax.Array:
    """A weight's global scale as a per-row factor: scalar (dense) or ``[M, 1]`` (grouped)."""
    if row_expert is None:
        return scale.reshape(())
    return scale.reshape(-1)[row_expert][:, None]


def _nvfp4_product(qa, qw, group_sizes, row_expert) -> jax.Array:
    acc = matmul_f32(nvfp4_unscaled(qa), nvfp4_unscaled(qw), group_sizes)
    return acc * (qa.global_scale * _per_row(qw.global_scale, row_expert))


def act_quantize(
    x: jax.Array,
    recipe: QuantRecipe,
    *,
    static_scale: jax.Array | None = None,
    row_expert: jax.Array | None = None,
) -> nvfp4.NVFP4Codes:
    """NVFP4 activations (unpacked codes) ``[M, K]`` with the recipe's global scale mode
    (``nvfp4.quantize_activations``); a static scale per expert ``[E]`` is taken per row
    through ``row_expert``."""
    if static_scale is not None and static_scale.ndim:
        static_scale = _per_row(static_scale, row_expert)
    return nvfp4.quantize_activations(x, recipe.act_scale_mode, static_scale)


def _rac_residual_product(x, qx, qw, recipe, group_sizes, row_expert, calib,
                          row_valid=None) -> jax.Array:
    sel = rac.select_residual(
        x,
        qx,
        recipe,
        act_scale_mode=recipe.act_scale_mode,
        row_expert=row_expert,
        num_experts=None if row_expert is None else qw.shape[0],
        static_blocks=None if calib is None else calib.rac_blocks,
        row_valid=row_valid,
    )
    if recipe.rac_residual_format == "bf16":
        acc = matmul_f32(sel.masked().astype(jnp.bfloat16), nvfp4_unscaled(qw), group_sizes)
        return acc * _per_row(qw.global_scale, row_expert)
    return _nvfp4_product(sel.codes(), qw, group_sizes, row_expert)


# Modes whose product is a plain matmul of ``plain_operands``: the trainer's (master or
# fake-quantized operands) and W4A16 (dequantized weights).
PLAIN_MATMUL_MODES = ("bf16", "w_fakequant_nvfp4", "w_fakequant_fp8", "w4a16_nvfp4",
                      "a_fakequant_nvfp4_w_fakequant_nvfp4")


def plain_operands(x: jax.Array, w, mode: str, site: str,
                   recipe: QuantRecipe) -> tuple[jax.Array, jax.Array]:
    """``(x, W)`` that a ``PLAIN_MATMUL_MODES`` mode multiplies, both in ``x.dtype``: the master
    weight (bf16) or its fake-quantized / dequantized value (straight-through gradient for a
    master weight), and ``x`` itself or, for the symmetric arm, its per-row NVFP4 fake-quant. A
    ``CalibratedWeight`` is unwrapped."""
    w, _ = _unwrap(w)
    if mode == "bf16":
        if isinstance(w, nvfp4.NVFP4Tensor | fp8.FP8Tensor):
            raise ValueError(
                f"site {site!r}: the recipe says bf16 but the weight is a packed "
                f"{type(w).__name__}; sync the weights with the same recipe"
            )
        return x, w.astype(x.dtype)
    if mode not in PLAIN_MATMUL_MODES:
        raise ValueError(f"site {site!r}: mode={mode!r} is not a plain matmul; "
                         f"plain_operands is for {PLAIN_MATMUL_MODES}")
    if mode == "a_fakequant_nvfp4_w_fakequant_nvfp4":
        x = nvfp4.fake_quant(x, scale_mode="row")
    return x, fake_quant_weight(w, mode, site, recipe).astype(x.dtype)


def _reference(x, w, mode, site, recipe, group_sizes, row_valid=None) -> jax.Array:
    """The jnp implementation of every mode; ``x [M, K]``, returns f32 ``[M, N]``;
    ``row_valid`` (bool ``[M]`` or None) as ``linear``'s."""
    w, calib = _unwrap(w)
    row_expert = None if group_sizes is None else expert_of_rows(group_sizes, x.shape[0])
    if mode in PLAIN_MATMUL_MODES:
        return matmul_f32(*plain_operands(x, w, mode, site, recipe), group_sizes)
    if mode in ("w4a4_nvfp4", "w4a4_nvfp4_rac"):
        qw = _nvfp4_weight(w, site)
        static = None if calib is None else calib.act_global_scale
        qx = act_quantize(x, recipe, static_scale=static, row_expert=row_expert)
        y = _nvfp4_product(qx, qw, group_sizes, row_expert)
        if mode == "w4a4_nvfp4_rac":
            y = y + _rac_residual_product(x, qx, qw, recipe, group_sizes, row_expert, calib,
                                          row_valid)
        return y
    if mode == "w8a8_fp8":
        qw = _fp8_weight(w, site, recipe)
        qx = fp8.quantize(x, granularity=recipe.fp8_act_granularity)
        acc = matmul_f32(qx.data.astype(jnp.bfloat16), qw.data.astype(jnp.bfloat16), group_sizes)
        if qw.scale.ndim == 0:  # "tensor": one scale for the whole (stacked) weight
            w_rows = qw.scale
        elif group_sizes is None:
            w_rows = qw.scale.reshape(1, -1)  # "channel" [N, 1] -> [1, N]
        else:
            w_rows = qw.scale.reshape(qw.shape[0], -1)[row_expert]  # [E, N, 1] -> [M, N]
        return acc * qx.scale * w_rows
    raise ValueError(f"site {site!r}: mode={mode!r} must be one of {MODES}")


def _check(x, w, site: str, grouped: bool) -> None:
    want = 3 if grouped else 2
    wshape = tuple(w.shape)
    if len(wshape) != want:
        raise ValueError(
            f"site {site!r}: weight shape {wshape} must be {'[E, N, K]' if grouped else '[N, K]'}"
        )
    if x.shape[-1] != wshape[-1]:
        raise ValueError(
            f"site {site!r}: x last axis K={x.shape[-1]} does not match weight K={wshape[-1]} "
            f"(weight shape {wshape})"
        )


def _valid_kwargs(mode: str, row_valid) -> dict:
    """``row_valid`` for the kernels of the one mode that reads it (RAC's selection)."""
    return {} if row_valid is None or mode != "w4a4_nvfp4_rac" else {"row_valid": row_valid}


def linear(
    x: jax.Array, w, site: str, recipe: QuantRecipe | None = None, *, out_dtype=None,
    row_valid: jax.Array | None = None,
) -> jax.Array:
    """``y = x @ W^T`` per the recipe's mode for ``site``.

    Args:
      x: ``[..., K]`` activations (compute dtype).
      w: ``[N, K]`` master array, ``NVFP4Tensor``, ``FP8Tensor`` or ``CalibratedWeight``.
      out_dtype: dtype of the result (None: ``x.dtype``); the f32 accumulator is cast to it
        (``lm_head`` asks for f32 logits from bf16 activations).
      row_valid: None, or bool ``x.shape[:-1]``: the rows that are tokens (not left padding,
        not a sequence that finished decoding). RAC's ``online_batch`` selection scores only
        those, so a token's compensation does not depend on padding garbage; every other
        mode ignores it (each row's result depends on that row alone).
    Returns ``[..., N]``.
    """
    recipe = recipe or _BF16_RECIPE
    _check(x, w, site, grouped=False)
    mode = recipe.mode_for(site)
    x2 = x.reshape(-1, x.shape[-1])
    valid = None if row_valid is None else jnp.asarray(row_valid, bool).reshape(-1)
    if valid is not None and valid.shape[0] != x2.shape[0]:
        raise ValueError(f"site {site!r}: row_valid shape {tuple(jnp.shape(row_valid))} must "
                         f"be x's rows {tuple(x.shape[:-1])}")
    _record(site, x2, None)
    kernel = _kernel_for(mode, "dense", recipe)
    if kernel is not None:
        y = kernel(x2, w, recipe=recipe, site=site, interpret=recipe.backend == "interpret",
                   **_valid_kwargs(mode, valid))
    else:
        y = _reference(x2, w, mode, site, recipe, None, valid)
    y = y.astype(x.dtype if out_dtype is None else out_dtype)
    return y.reshape(x.shape[:-1] + (y.shape[-1],))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _take_rows(x: jax.Array, rows: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    return x[rows]


def _take_rows_fwd(x, rows, inverse, k):
    return x[rows], inverse


def _take_rows_bwd(k, inverse, dy):
    # Each row of x went to the k rows inverse[r*k : (r+1)*k]: gather those and sum, in f32.
    g = dy[inverse].astype(jnp.float32)
    dx = g.reshape(inverse.shape[0] // k, k, *dy.shape[1:]).sum(axis=1)
    return dx.astype(dy.dtype), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def take_rows(x: jax.Array, rows: jax.Array, inverse: jax.Array | None = None) -> jax.Array:
    """``x[rows]``: ``x [R, ...]``, ``rows`` int ``[M]`` -> ``[M, ...]``.

    ``inverse``: None, or int32 ``[M]`` when every row of ``x`` is taken exactly ``k = M / R``
    times: ``inverse[r * k + j]`` (j < k) are the positions ``i`` with ``rows[i] == r`` (a MoE
    block's slot -> sorted row map; ``k = 1``: a permutation and its inverse). The gradient is
    then a gather and a sum over ``k`` instead of XLA's scatter-add of ``[M, ...]`` rows
    (0.29-0.32 ms per layer and mini-batch in the H100 trainer profile of session 27). The
    caller vouches for the inverse; a wrong one gives wrong gradients (the forward is the same).
    """
    if inverse is None:
        return x[rows]
    m = rows.shape[0]
    if inverse.shape != rows.shape or rows.ndim != 1 or x.shape[0] == 0 \
            or m % x.shape[0]:
        raise ValueError(f"take_rows: rows {tuple(rows.shape)} and inverse "
                         f"{tuple(inverse.shape)} must be equal vectors whose length is a "
                         f"multiple of x's {x.shape[0]} rows")
    return _take_rows(x, rows, inverse.astype(jnp.int32), m // x.shape[0])


def grouped_linear(
    x_sorted: jax.Array,
    w,
    group_sizes: jax.Array,
    site: str,
    recipe: QuantRecipe | None = None,
    *,
    source_rows: jax.Array | None = None,
    row_valid: jax.Array | None = None,
    output_rows: jax.Array | None = None,
    source_rows_inverse: jax.Array | None = None,
    output_rows_inverse: jax.Array | None = None,
) -> jax.Array:
    """Grouped ``y[m] = x[m] @ W[e(m)]^T`` for rows sorted by expert.

    Args:
      x_sorted: ``[M, K]``, rows of expert 0 first, then expert 1, ...; with ``source_rows``
        the distinct rows ``[R, K]`` that the sorted rows are taken from.
      w: ``[E, N, K]`` master array / ``NVFP4Tensor`` / ``FP8Tensor`` / ``CalibratedWeight``.
      group_sizes: int32 ``[E]``, rows per expert (zeros allowed; sum <= M, rows past the sum
        get zeros).
      source_rows: None, or int32 ``[M]``: sorted row ``i`` is ``x_sorted[source_rows[i]]``
        (a MoE token's k slots share one row). Same result as passing the gathered rows; a
        kernel registered with ``source_rows=True`` quantizes each distinct row once.
      row_valid: None, or bool per row of ``x_sorted`` (the distinct rows with
        ``source_rows``): as ``linear``'s; RAC then selects each expert's blocks from the
        expert's token rows only.
      output_rows: None, or int ``[M']`` in ``[0, M)``: return ``y[output_rows]`` (a MoE
        block's unsort); a kernel registered with ``output_rows=True`` reads its result back
        in that order, one gather instead of two.
      source_rows_inverse, output_rows_inverse: None, or the inverse maps of ``source_rows``
        / ``output_rows`` (``take_rows``' ``inverse``): where this function gathers the rows
        itself, their gradient is then a gather instead of a scatter-add (the trainer).
    Returns ``[M, N]`` (``[M', N]`` with ``output_rows``) in ``x_sorted.dtype``.
    """
    recipe = recipe or _BF16_RECIPE
    _check(x_sorted, w, site, grouped=True)
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"site {site!r}: group_sizes shape {tuple(group_sizes.shape)} must be "
            f"({w.shape[0]},), one per expert of the weight"
        )
    for name, index in (("source_rows", source_rows), ("output_rows", output_rows)):
        if index is not None and (index.ndim != 1
                                  or not jnp.issubdtype(index.dtype, jnp.integer)):
            raise ValueError(f"site {site!r}: {name} {index.dtype}{list(index.shape)} must be "
                             "an int vector")
    mode = recipe.mode_for(site)
    group_sizes = group_sizes.astype(jnp.int32)
    kernel = _kernel_for(mode, "grouped", recipe)
    gathers = kernel is not None and (mode, "grouped") in _TAKES_SOURCE_ROWS
    valid = None if row_valid is None else jnp.asarray(row_valid, bool)
    if valid is not None and valid.shape != x_sorted.shape[:1]:
        raise ValueError(f"site {site!r}: row_valid shape {tuple(valid.shape)} must be "
                         f"({x_sorted.shape[0]},), one per row of x_sorted")
    if source_rows is not None and not gathers:
        valid = None if valid is None else valid[source_rows]
        x_sorted, source_rows = take_rows(x_sorted, source_rows, source_rows_inverse), None
    if _recorders:
        _record(site, x_sorted if source_rows is None else x_sorted[source_rows], group_sizes)
    reorders = kernel is not None and (mode, "grouped") in _TAKES_OUTPUT_ROWS
    if kernel is None:
        y = _reference(x_sorted, w, mode, site, recipe, group_sizes, valid)
    else:
        rows = {} if source_rows is None else {"source_rows": source_rows.astype(jnp.int32)}
        if output_rows is not None and reorders:
            rows["output_rows"] = output_rows.astype(jnp.int32)
        y = kernel(x_sorted, w, group_sizes, recipe=recipe, site=site,
                   interpret=recipe.backend == "interpret", **rows,
                   **_valid_kwargs(mode, valid))
    if output_rows is not None and not reorders:
        y = take_rows(y, output_rows, output_rows_inverse)
    return y.astype(x_sorted.dtype)
