"""Registers the Pallas (Mosaic GPU) NVFP4 kernels into ``quads_jax.quant.ops``' dispatch.

``ops`` imports this module lazily the first time a kernel could run (``recipe.backend`` "auto"
on a GPU, or "interpret"). Registered, dense and grouped: ``w4a4_nvfp4``, ``w4a4_nvfp4_rac`` and
``w4a16_nvfp4`` (the NVFP4 tile kernel) and ``w8a8_fp8`` (the FP8 tensor-core tile kernel);
grouped only: ``bf16``, ``w_fakequant_nvfp4``, ``w_fakequant_fp8`` and
``a_fakequant_nvfp4_w_fakequant_nvfp4`` (the trainer's modes:
``pallas_kernels.bf16_grouped``, differentiable, in place of XLA's E-times redundant
``ragged_dot``).

Weights: a leaf may be the kernel layout ``layout.W4A4Weights`` (made once at weight sync with
``prepare_weights``: the fast path), an ``NVFP4Tensor`` or a master array; the last two are
converted on every call, which costs a full pass over the weight inside the jitted forward.
A ``rac.CalibratedWeight`` wrapper supplies static RAC blocks and static activation scales.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import bf16_grouped
from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels.fp8_tiles_mgpu import FP8Weights
from pallas_kernels.layout import (
    W4A4Weights,
    check_bits,
    check_scale_dtype,
    prepare_w4a4_weights,
)
from pallas_kernels.w4a4_grouped import w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, w4a4_matmul
from pallas_kernels.w4a16_matmul import w4a16_grouped_matmul, w4a16_matmul
from pallas_kernels.w8a8_matmul import (
    W8A8MatmulConfig,
    as_fp8_weights,
    w8a8_grouped_matmul,
    w8a8_matmul,
)
from quads_jax.quant import fp8, nvfp4, ops
from quads_jax.quant.rac import CalibratedWeight

INTERPRET_NUM_SMS = 4
# W4A4MatmulConfig / W8A8MatmulConfig fields every registered NVFP4 / FP8 kernel call uses
# (``set_w4a4_overrides`` / ``set_fp8_overrides``; benchmarks and ablations); empty = the
# configs' defaults.
_W4A4_OVERRIDES: dict = {}
_FP8_OVERRIDES: dict = {}
# The code words' bit layout ``prepare_weights`` gives float16 NVFP4 weights (``layout.BITS``;
# ``set_w4a4_bits``). "signs_high" by default: it decodes in 9 integer operations per 8 codes
# instead of 20 ("nibbles"); on the H200 (session 20, 6cd428a) the grouped decode kernel took
# 66.4 instead of 73.7 us per call and the nvfp4_rac decode step 17.05 instead of 17.79 ms.
DEFAULT_W4A4_BITS = "signs_high"
_W4A4_BITS = [DEFAULT_W4A4_BITS]


def set_w4a4_bits(bits: str = DEFAULT_W4A4_BITS) -> None:
    """The word bit layout of the float16 NVFP4 weights made from now on (at the next weight
    sync): "signs_high" (the default) or "nibbles" (``pallas_kernels.layout``). bfloat16
    layouts (W4A16, RAC with a bf16 residual) keep "nibbles": their decode runs the jnp path on
    the device, which would only get slower. A bad value raises ``ValueError`` and changes
    nothing."""
    check_bits(bits)
    _W4A4_BITS[0] = bits


# The block scales' dtype of the float16 NVFP4 weights ``prepare_weights`` makes
# (``set_w4a4_scale_dtype``): None keeps them float16 (0.625 streamed bytes per weight),
# "float8_e4m3fn" keeps the format's own E4M3 bytes (0.5625), converted to f16 in the kernel
# (bit-identical results). The default since its first GPU run (H100, 2026-12-06, ca9aabb,
# ``h200_next.sh s38``: GPU checks pass; the decode step's grouped kernels alone gate_up 95.7
# -> 91.6 us, down 55.6 -> 53.9 us; nvfp4_rac at batch 128 8.67 -> 8.48 ms per step).
DEFAULT_W4A4_SCALE_DTYPE = "float8_e4m3fn"
_W4A4_SCALE_DTYPE = [DEFAULT_W4A4_SCALE_DTYPE]


def set_w4a4_scale_dtype(scale_dtype: str | None = DEFAULT_W4A4_SCALE_DTYPE) -> None:
    """The block scales' dtype of the float16 NVFP4 weights made from now on (at the next
    weight sync): "float8_e4m3fn" (the default) or None (float16); ``pallas_kernels.layout``.
    bfloat16 layouts keep bfloat16 scales. A bad value raises ``ValueError`` and changes
    nothing."""
    check_scale_dtype(scale_dtype, "float16")
    _W4A4_SCALE_DTYPE[0] = scale_dtype


def layout_settings() -> tuple:
    """The settings ``prepare_weights`` reads (``set_w4a4_bits``, ``set_w4a4_scale_dtype``),
    hashable: a jitted caller that prepares weights keys its cache on them."""
    return (_W4A4_BITS[0], _W4A4_SCALE_DTYPE[0])


def store_overrides(store: dict, cls, fields: dict, fixed: set, name: str) -> None:
    """Check ``fields`` as overrides of the config dataclass ``cls`` (not its ``fixed``
    fields; errors start with ``name``), then make ``store`` hold exactly them."""
    names = {f.name for f in dataclasses.fields(cls)} - fixed
    if unknown := sorted(set(fields) - names):
        raise ValueError(f"{name}: unknown field(s) {unknown}; one of {sorted(names)}")
    cls(**fields)  # validates the values
    store.clear()
    store.update(fields)


def set_w4a4_overrides(**fields) -> None:
    """Ablations: ``W4A4MatmulConfig`` fields that every registered NVFP4 kernel call then
    uses (e.g. ``n_group=2``; not ``mma_dtype``, which follows the weights' layout); no
    arguments restores the defaults. Checked at once: an unknown field or a bad value raises
    ``ValueError`` and changes nothing. Like ``models.layers.set_decode_attention``, it takes
    effect at the next trace."""
    store_overrides(_W4A4_OVERRIDES, W4A4MatmulConfig, fields, {"mma_dtype"},
                    "set_w4a4_overrides")


def set_fp8_overrides(**fields) -> None:
    """``set_w4a4_overrides`` for the FP8 kernels' ``W8A8MatmulConfig`` (not ``num_sms``)."""
    store_overrides(_FP8_OVERRIDES, W8A8MatmulConfig, fields, {"num_sms"}, "set_fp8_overrides")


def _mma_dtype(mode: str, recipe) -> str:
    """bf16 where the B operand is bf16 (W4A16, RAC with a bf16 residual), else f16 (fewer
    decode instructions: no f16 -> bf16 conversion)."""
    if mode == "w4a16_nvfp4" or (mode == "w4a4_nvfp4_rac" and recipe.rac_residual_format == "bf16"):
        return "bfloat16"
    return "float16"


def prepare_weights(w, mode: str, recipe=None):
    """Weight-sync hook: the kernel layout of a packed (or master) leaf for ``mode``.

    Keeps a ``CalibratedWeight`` wrapper around the converted weight.
    """
    if mode == "w8a8_fp8":
        return _fp8_weights(w, recipe)
    if isinstance(w, CalibratedWeight):
        return CalibratedWeight(prepare_weights(w.weight, mode, recipe), w.rac_blocks,
                                w.act_global_scale)
    if isinstance(w, W4A4Weights):
        return w
    if not isinstance(w, nvfp4.NVFP4Tensor):
        w = nvfp4.quantize(w, scale_mode="expert")
    mma_dtype = _mma_dtype(mode, recipe) if recipe else "float16"
    f16 = mma_dtype == "float16"
    return prepare_w4a4_weights(w, mma_dtype=mma_dtype, bits=_W4A4_BITS[0] if f16 else "nibbles",
                                scale_dtype=_W4A4_SCALE_DTYPE[0] if f16 else None)


def _unpack(w, mode: str, recipe):
    calib = w if isinstance(w, CalibratedWeight) else None
    w = calib.weight if calib else w
    if not isinstance(w, W4A4Weights):
        w = prepare_weights(w, mode, recipe)
    blocks = None if calib is None else calib.rac_blocks
    scale = None if calib is None else calib.act_global_scale
    return w, blocks, scale


def _config(interpret: bool, mma_dtype: str) -> W4A4MatmulConfig:
    base = dict(a_via_smem=True, num_sms=INTERPRET_NUM_SMS) if interpret else {}
    return W4A4MatmulConfig(mma_dtype=mma_dtype, **{**base, **_W4A4_OVERRIDES})


def _w4a4_kwargs(mode: str, recipe, blocks, scale) -> dict:
    rac = aq.RACConfig.from_recipe(recipe) if mode == "w4a4_nvfp4_rac" else None
    return dict(
        act_scale_mode=recipe.act_scale_mode, rac=rac, rac_blocks=blocks,
        act_global_scale=scale,
    )


def _dense(mode: str):
    def fn(x: jax.Array, w, *, recipe, site: str, interpret: bool,
           row_valid: jax.Array | None = None) -> jax.Array:
        del site
        w, blocks, scale = _unpack(w, mode, recipe)
        config = _config(interpret, w.mma_dtype)
        if mode == "w4a16_nvfp4":
            return w4a16_matmul(x, w, config=config, interpret=interpret)
        return w4a4_matmul(x, w, config=config, interpret=interpret, row_valid=row_valid,
                           **_w4a4_kwargs(mode, recipe, blocks, scale))

    return fn


# Off since 2026-12-06: on the H100 (24 layers, batch 128, `h200_next.sh nobar`, e76925f) the
# decode step without the barrier ran 8.80 against 9.03 ms (nvfp4_rac; traced busy 8.75 against
# 8.86 ms, 1 261 against 1 285 kernels) and 8.21 against 8.31 ms (nvfp4; busy 8.08 against
# 8.20), prefill 43.8k / 52.6k against 41.6k / 49.4k tok/s.
DEFAULT_GROUPED_BARRIER = False
_GROUPED_BARRIER = {"on": DEFAULT_GROUPED_BARRIER}


def set_grouped_barrier(on: bool = DEFAULT_GROUPED_BARRIER) -> None:
    """Ablation: add (True) or leave out (False, the default) the optimization barrier after
    the grouped kernels (``_materialized``); takes effect at the next trace."""
    if not isinstance(on, bool):
        raise ValueError(f"set_grouped_barrier: on={on!r}; need True or False")
    _GROUPED_BARRIER["on"] = on


def _materialized(y: jax.Array) -> jax.Array:
    """The grouped result, optionally behind an optimization barrier (an ablation, off by
    default). In 2026-12-03's layout the barrier paid: without it XLA fused the kernel's
    row-slot gather and scaling into the MoE block's unsort-and-combine, recomputing them per
    element (53 us per layer on the H200 against 4 us for a materialized result,
    docs/bench/rollout.md). Since the kernels store token-major tiles the read-back is a plain
    row gather; with the barrier it was a buffer of its own (4.8 us per layer for down, 3.6 for
    gate_up, the down rows then gathered again by the MoE block's unsort), without it XLA fuses
    the down read-back into the weighted sum and the gate_up read-back into swiglu: one kernel
    per layer fewer and ~5 us less per layer (DEFAULT_GROUPED_BARRIER's note;
    ``bench_rollout --grouped-barrier``, h200_next ``nobar``)."""
    return jax.lax.optimization_barrier(y) if _GROUPED_BARRIER["on"] else y


def _grouped(mode: str):
    def fn(x: jax.Array, w, group_sizes: jax.Array, *, recipe, site: str, interpret: bool,
           source_rows: jax.Array | None = None, row_valid: jax.Array | None = None,
           output_rows: jax.Array | None = None):
        del site
        w, blocks, scale = _unpack(w, mode, recipe)
        config = _config(interpret, w.mma_dtype)
        gs = jnp.asarray(group_sizes, jnp.int32)
        if mode == "w4a16_nvfp4":  # registered without source_rows / output_rows
            y = w4a16_grouped_matmul(x, w, gs, config=config, interpret=interpret)
        else:
            y = w4a4_grouped_matmul(x, w, gs, config=config, interpret=interpret,
                                    source_rows=source_rows, row_valid=row_valid,
                                    output_rows=output_rows,
                                    **_w4a4_kwargs(mode, recipe, blocks, scale))
        return _materialized(y)

    return fn


_BF16_GROUPED = {"on": True, "dw_kernel": True}


def set_bf16_grouped(on: bool = True, *, dw_kernel: bool = True) -> None:
    """Run the plain-matmul modes' grouped matmuls with ``bf16_grouped`` (``on``, the default)
    or XLA's ``ragged_dot``; ``dw_kernel``: its backward's dW through our ``ragged_contract``
    kernel (the default) or XLA's (``BF16GroupedConfig.dw_kernel``). Takes effect
    at the next trace; a non-bool raises ``ValueError`` and changes nothing."""
    for name, v in (("on", on), ("dw_kernel", dw_kernel)):
        if not isinstance(v, bool):
            raise ValueError(f"set_bf16_grouped: {name}={v!r}; need True or False")
    _BF16_GROUPED.update(on=on, dw_kernel=dw_kernel)


def plain_grouped_kernel(mode: str):
    """The grouped matmul of a plain-matmul mode (``ops.plain_operands``): ``bf16_grouped``
    where its shapes fit (bf16, N and K multiples of 64), else ``ops``' XLA product."""

    def fn(x: jax.Array, w, group_sizes: jax.Array, *, recipe, site: str, interpret: bool):
        x, w = ops.plain_operands(x, w, mode, site, recipe)
        gs = jnp.asarray(group_sizes, jnp.int32)
        if _BF16_GROUPED["on"] and bf16_grouped.supported(x.shape, w.shape, x.dtype):
            config = bf16_grouped.BF16GroupedConfig(
                num_sms=INTERPRET_NUM_SMS if interpret else None,
                dw_kernel=_BF16_GROUPED["dw_kernel"])
            return bf16_grouped.grouped_matmul(x, w, gs, config=config, interpret=interpret)
        return ops.matmul_f32(x, w, gs)

    return fn


def _fp8_weights(w, recipe) -> FP8Weights:
    """The FP8 kernel layout of a leaf: as is, from an ``FP8Tensor``, or from a master array."""
    if not isinstance(w, FP8Weights | fp8.FP8Tensor):
        w = fp8.quantize(w, granularity=recipe.fp8_weight_granularity)
    return as_fp8_weights(w)


def _fp8_config(interpret: bool) -> W8A8MatmulConfig:
    return W8A8MatmulConfig(num_sms=INTERPRET_NUM_SMS if interpret else None, **_FP8_OVERRIDES)


def _fp8_dense(x: jax.Array, w, *, recipe, site: str, interpret: bool) -> jax.Array:
    del site
    return w8a8_matmul(x, _fp8_weights(w, recipe), act_granularity=recipe.fp8_act_granularity,
                       config=_fp8_config(interpret), interpret=interpret)


def _fp8_grouped(x: jax.Array, w, group_sizes: jax.Array, *, recipe, site: str,
                 interpret: bool, source_rows: jax.Array | None = None,
                 output_rows: jax.Array | None = None) -> jax.Array:
    del site
    return _materialized(w8a8_grouped_matmul(
        x, _fp8_weights(w, recipe), jnp.asarray(group_sizes, jnp.int32),
        act_granularity=recipe.fp8_act_granularity, config=_fp8_config(interpret),
        interpret=interpret, source_rows=source_rows, output_rows=output_rows))


ops.register_kernel("w8a8_fp8", "dense", _fp8_dense)
ops.register_kernel("w8a8_fp8", "grouped", _fp8_grouped, source_rows=True,
                    output_rows=True)
for _mode in ("w4a4_nvfp4", "w4a4_nvfp4_rac", "w4a16_nvfp4"):
    ops.register_kernel(_mode, "dense", _dense(_mode))
    ops.register_kernel(_mode, "grouped", _grouped(_mode), source_rows=_mode != "w4a16_nvfp4",
                        output_rows=_mode != "w4a16_nvfp4")
for _mode in ("bf16", "w_fakequant_nvfp4", "w_fakequant_fp8",
              "a_fakequant_nvfp4_w_fakequant_nvfp4"):
    ops.register_kernel(_mode, "grouped", plain_grouped_kernel(_mode))
