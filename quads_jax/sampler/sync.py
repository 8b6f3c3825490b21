"""Weight sync: the trainer's master tree -> the rollout's tree, and the identity check.

``sync(params, recipe, model_config=...)`` walks the parameter tree once (site names from
``quads_jax.models.param_sites``) and converts each leaf by the rollout recipe's mode of its
site, in one jitted program:

* NVFP4 modes (w4a4, w4a4 + RAC, w4a16): ``ops.quantize_weight``, i.e. the exact
  ``nvfp4.quantize`` with one global scale per 2-D matrix (scale_mode "expert"); stacked expert
  weights ``[n, E, 2I, H]`` get one per (layer, expert), shared by the fused gate and up rows;
* FP8 modes: ``fp8.quantize`` with the recipe's weight granularity;
* everything else is cast to the model's compute dtype, which the forward does to it anyway
  (``w.astype(x.dtype)``), so the cast is exact and decode reads half the bytes of an f32
  master. The router is the exception: it runs in float32 (as in HF) and keeps its dtype.
* bf16 q/k/v projections are then stacked into one ``qkv_proj`` per layer group
  (``models.fuse_qkv``; ``fuse_qkv=False`` keeps the three leaves).

Kernel layout: where a Pallas kernel serves an NVFP4 mode (on a GPU, ``recipe.backend`` not
"reference"), the packed leaf is converted once more, here, to the kernels' own layout
(``quads_jax.quant.kernel_backend.prepare_weights``: split-nibble codes, transposed scales),
so the jitted forward never converts a weight; ``kernel_layout=False`` keeps ``NVFP4Tensor``.

Layer groups whose layers get different modes (keep-first/last-n BF16) are split first
(``models.split_layer_groups``), so every stacked leaf has one type.

``check_sync`` proves identity: every rollout leaf dequantizes bit for bit to what the trainer
computes from the master leaf (its ``qdq`` for quantized sites, the cast otherwise). The default
check runs on the device (one mismatch count per leaf, a few reductions); ``full=True`` copies
both sides to the host and names the first differing element (tests).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax import models
from quads_jax.quant import fp8, nvfp4, ops
from quads_jax.quant.rac import CalibratedWeight
from quads_jax.quant.recipe import FP8_WEIGHT_MODES, NVFP4_WEIGHT_MODES, QuantRecipe
from quads_jax.sampler.calibration import calibrate, calibrated_sites, needs_calibration

KEEP, CAST = "keep", "cast"
# Sites that run in float32 whatever the compute dtype (the forward casts their input to f32).
F32_SITES = ("layers.*.mlp.router",)


class SyncMismatchError(ValueError):
    """A rollout leaf does not dequantize to the trainer's view of the master leaf."""


# The Pallas kernels' weight layouts (by name: pallas_kernels is imported only where used).
KERNEL_LAYOUTS = ("W4A4Weights", "FP8Weights")


def _is_packed(x) -> bool:
    packed = isinstance(x, nvfp4.NVFP4Tensor | fp8.FP8Tensor | CalibratedWeight)
    return packed or type(x).__name__ in KERNEL_LAYOUTS


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def leaf_actions(params: dict, recipe: QuantRecipe, *, model_config) -> dict:
    """A tree like ``params`` (already split by the recipe) whose leaves say what sync does:
    a mode from ``NVFP4_WEIGHT_MODES`` / ``FP8_WEIGHT_MODES``, ``"cast"`` or ``"keep"``."""
    sites = models.param_sites(model_config, params)
    matmul_sites = {"lm_head"}
    for i in range(model_config.num_hidden_layers):
        matmul_sites.update(models.layer_matmul_sites(model_config, i))

    def action(site_or_sites) -> str:
        site = site_or_sites if isinstance(site_or_sites, str) else site_or_sites[0]
        if site in matmul_sites:
            mode = recipe.mode_for(site)
            if mode in NVFP4_WEIGHT_MODES or mode in FP8_WEIGHT_MODES:
                return mode
        if any(fnmatch.fnmatchcase(site, p) for p in F32_SITES):
            return KEEP
        return CAST

    return jax.tree.map(action, sites, is_leaf=lambda x: isinstance(x, str | tuple))


def _kernel_backend():
    from quads_jax.quant import kernel_backend  # registers the Pallas kernels; GPU code

    return kernel_backend


def _uses_kernel_layout(action: str, recipe: QuantRecipe, kernel_layout: bool | None) -> bool:
    if action not in NVFP4_WEIGHT_MODES and action != "w8a8_fp8":
        return False
    if kernel_layout is None:
        kernel_layout = recipe.backend != "reference" and jax.default_backend() == "gpu"
    if not kernel_layout:
        return False
    _kernel_backend()
    return (action, "grouped") in ops.registered_kernels()


def _per_layer(fn, stacked: bool):
    """``fn`` of one layer's weight, mapped over the layer axis of a stacked leaf.

    ``lax.map`` runs one layer at a time: every quantity is per matrix (or per row), so the
    result is the same as on the whole stack, and the temporaries are one layer's, not the 30B
    model's.
    """
    return (lambda *xs: jax.lax.map(lambda x: fn(*x), xs)) if stacked else fn


def _convert(leaf, action: str, recipe: QuantRecipe, dtype, layout: bool, stacked: bool):
    if action == KEEP:
        return leaf
    if action == CAST:
        return leaf.astype(dtype)

    def one(w):
        q = ops.quantize_weight(w, action, recipe)
        return _kernel_backend().prepare_weights(q, action, recipe) if layout else q

    return _per_layer(one, stacked)(leaf)


@functools.partial(jax.jit, static_argnames=("plan", "recipe", "dtype", "layout_settings"))
def _convert_all(leaves, *, plan, recipe, dtype, layout_settings):
    # layout_settings (``kernel_backend.layout_settings()``, read by ``prepare_weights`` at
    # trace time) keys the jit cache: a setting changed between two syncs must be traced anew.
    del layout_settings
    return [_convert(x, a, recipe, dtype, layout, stacked)
            for x, (a, layout, stacked) in zip(leaves, plan, strict=True)]


def _flat_actions(params, recipe, model_config):
    actions = leaf_actions(params, recipe, model_config=model_config)
    return jax.tree.leaves(actions)


def _plan(params, recipe, model_config, kernel_layout):
    """Per leaf (in flatten order): (action, kernel layout?, stacked on a layer axis?)."""
    stacked = jax.tree.leaves(models.param_sites(model_config, params),
                              is_leaf=lambda x: isinstance(x, str | tuple))
    return tuple(
        (a, _uses_kernel_layout(a, recipe, kernel_layout), isinstance(site, tuple))
        for a, site in zip(_flat_actions(params, recipe, model_config), stacked, strict=True)
    )


def sync(params: dict, recipe: QuantRecipe, *, model_config,
         kernel_layout: bool | None = None, calibration_tokens=None,
         calibration: dict | None = None, fuse_qkv: bool = True) -> dict:
    """The rollout tree for ``recipe`` from master ``params`` (see the module docstring).

    Args:
      params: the master tree of ``init_params`` / ``load_hf`` (any float dtype).
      recipe: the rollout ``QuantRecipe``.
      model_config: the ``ModelConfig``.
      kernel_layout: store NVFP4 leaves in the Pallas kernels' layout; None: where a kernel
        will run them (GPU, backend not "reference").
      calibration_tokens: int ``[B, T]`` unpadded token ids; required when the recipe has a
        static RAC selection or activation scale (``calibration.calibrate``): the W4A4 leaves
        are then ``CalibratedWeight`` wrappers holding the calibrated blocks / scales.
      calibration: instead of ``calibration_tokens``, a calibration already made, as
        ``calibration.calibrate`` returns it (``{site: (rac_blocks, act_global_scale)}``, every
        W4A4 site of the recipe): e.g. one calibration reused over several syncs.
      fuse_qkv: store each layer group's bf16 q/k/v projections as one ``qkv_proj`` weight
        (``models.fuse_qkv``: one decode GEMM instead of three, the same dot products).

    Returns:
      a tree of the same structure (layer groups split where the recipe's modes change; with
      ``fuse_qkv``, ``qkv_proj`` in place of bf16 q/k/v) whose quantized leaves are
      ``NVFP4Tensor`` / ``FP8Tensor`` (or the kernels' layouts).
    """
    if not isinstance(recipe, QuantRecipe):
        raise ValueError(f"recipe: expected a QuantRecipe, got {type(recipe).__name__}")
    if calibration is not None:
        if not needs_calibration(recipe):
            raise ValueError(f"calibration: given, but recipe {recipe.name!r} has no static "
                             "RAC selection or activation scale to use it")
        if missing := [s for s in calibrated_sites(recipe, model_config) if s not in calibration]:
            raise ValueError(f"calibration: no entry for {len(missing)} W4A4 site(s) of recipe "
                             f"{recipe.name!r}, e.g. {missing[:3]}")
    elif needs_calibration(recipe):
        if calibration_tokens is None:
            raise ValueError(
                f"calibration_tokens: None, but recipe {recipe.name!r} has rac_selection="
                f"{recipe.rac_selection!r}, act_scale_mode={recipe.act_scale_mode!r}; static "
                "calibration needs a calibration batch of token ids [batch, length]")
        calibration = calibrate(params, recipe, model_config=model_config,
                                tokens=calibration_tokens)
    params = models.split_layer_groups(model_config, params, recipe)
    leaves, treedef = jax.tree.flatten(params)
    plan = _plan(params, recipe, model_config, kernel_layout)
    settings = _kernel_backend().layout_settings() if any(p[1] for p in plan) else None
    out = _convert_all(leaves, plan=plan, recipe=recipe, dtype=jnp.dtype(model_config.dtype),
                       layout_settings=settings)
    if calibration is not None:
        sites = jax.tree.leaves(models.param_sites(model_config, params),
                                is_leaf=lambda x: isinstance(x, str | tuple))
        out = [_with_calibration(q, site, calibration) for q, site in zip(out, sites, strict=True)]
    out = jax.tree.unflatten(treedef, out)
    return models.fuse_qkv(model_config, out, recipe) if fuse_qkv else out


def _with_calibration(leaf, site, calibration: dict):
    """Wrap a packed leaf with its calibrated blocks / scales (stacked over its layers)."""
    layer_sites = (site,) if isinstance(site, str) else site
    if layer_sites[0] not in calibration:
        return leaf
    blocks, scales = zip(*(calibration[s] for s in layer_sites), strict=True)
    stack = (lambda xs: jnp.stack(xs)) if isinstance(site, tuple) else (lambda xs: xs[0])
    return CalibratedWeight(
        leaf,
        rac_blocks=None if blocks[0] is None else stack(blocks),
        act_global_scale=None if scales[0] is None else stack(scales),
    )


# ------------------------------------------------------------------------------ identity check
def _trainer_view(master, action: str, recipe: QuantRecipe, dtype) -> jax.Array:
    """What the trainer's forward computes from the master leaf for this site."""
    if action == KEEP:
        return master
    if action == CAST:
        return master.astype(dtype)
    # The trainer's own fake-quant (forward value == qdq), not a re-implementation.
    return ops.fake_quant_weight(master, action, "sync", recipe)


def _kernel_layout_values(w, like: jax.Array) -> jax.Array:
    """f32 values of a kernel-layout weight: ``(e2m1 * s_b) * g`` as ``nvfp4.dequantize`` for
    ``W4A4Weights``, ``data * scale`` as ``fp8.dequantize`` for ``FP8Weights``."""
    from pallas_kernels.fp8_tiles_mgpu import FP8Weights, dequantize_fp8_weights
    from pallas_kernels.layout import dequantize_w4a4_weights

    is_fp8 = isinstance(w, FP8Weights)

    def one(w):
        if is_fp8:
            vals = dequantize_fp8_weights(w)
        else:
            vals = dequantize_w4a4_weights(w) * w.global_scale[:, None, None]
        return vals if w.stacked else vals[0]

    tiles = w.data if is_fp8 else w.codes
    for _ in range(tiles.ndim - w.CODES_NDIM):  # leading layer axes
        one = jax.vmap(one)
    return one(w).astype(like.dtype)


def _rollout_view(leaf, like: jax.Array) -> jax.Array:
    if isinstance(leaf, CalibratedWeight):
        leaf = leaf.weight
    if type(leaf).__name__ in KERNEL_LAYOUTS:
        return _kernel_layout_values(leaf, like)
    if isinstance(leaf, nvfp4.NVFP4Tensor):
        return nvfp4.dequantize(leaf, like.dtype)
    if isinstance(leaf, fp8.FP8Tensor):
        return fp8.dequantize(leaf, like.dtype)
    return leaf


def _bits(x: jax.Array) -> jax.Array:
    """Bit pattern of a float array as unsigned ints of the same width (NaN-safe equality)."""
    width = jnp.dtype(x.dtype).itemsize
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width])


def _views(master_leaves, rollout_leaves, actions, recipe, dtype):
    for m, r, a in zip(master_leaves, rollout_leaves, actions, strict=True):
        want = _trainer_view(m, a, recipe, dtype)
        yield want, _rollout_view(r, want)


@functools.partial(jax.jit, static_argnames=("actions", "recipe", "dtype"))
def _view_bits(master_leaves, rollout_leaves, *, actions, recipe, dtype):
    return [(_bits(want), _bits(got.astype(want.dtype)))
            for want, got in _views(master_leaves, rollout_leaves, actions, recipe, dtype)]


def _count_mismatches(master, rollout, action, recipe, dtype) -> jax.Array:
    want = _trainer_view(master, action, recipe, dtype)
    got = _rollout_view(rollout, want)
    if want.shape != got.shape or want.dtype != got.dtype:
        return jnp.int32(-1)
    return jnp.sum(_bits(want) != _bits(got), dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("plan", "recipe", "dtype"))
def _mismatch_counts(master_leaves, rollout_leaves, *, plan, recipe, dtype):
    out = []
    for m, r, (action, _, stacked) in zip(master_leaves, rollout_leaves, plan, strict=True):
        count = functools.partial(_count_mismatches, action=action, recipe=recipe, dtype=dtype)
        per_layer = _per_layer(count, stacked and action not in (KEEP, CAST))(m, r)
        # Summed in float32: a 30B leaf has more elements than int32 counts (exact up to 2^24,
        # and 0 is exact); -1 (a shape or dtype mismatch) in any layer stays visible.
        total = jnp.sum(per_layer.astype(jnp.float32))
        out.append(jnp.where(jnp.any(per_layer < 0), -1.0, total))
    return out


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What ``check_sync`` compared: leaf paths, their actions, elements and mismatches."""

    paths: tuple[str, ...]
    actions: tuple[str, ...]
    elements: int
    mismatches: tuple[int, ...]


def check_sync(
    params: dict, rollout_params: dict, recipe: QuantRecipe, *, model_config, full: bool = False
) -> SyncReport:
    """Check that ``rollout_params == sync(params, recipe)`` as the trainer sees it.

    Every rollout leaf, dequantized, must equal bit for bit the trainer's view of its master
    leaf (``qdq`` for quantized sites, the compute-dtype cast or the leaf itself otherwise).

    Args:
      full: compare on the host element by element and name the first difference (slow, for
        tests); otherwise one mismatch count per leaf is reduced on the device.

    Raises:
      SyncMismatchError naming the leaf path, its action and the differing count or index.
    """
    split = models.split_layer_groups(model_config, params, recipe)
    if models.has_fused_qkv(rollout_params):  # the trainer's view of a fused leaf: the same
        split = models.fuse_qkv(model_config, split, recipe)  # concatenation of its masters
    master_leaves, master_def = jax.tree.flatten_with_path(split)
    rollout_flat, rollout_def = jax.tree.flatten_with_path(rollout_params, is_leaf=_is_packed)
    paths = tuple(_path_name(p) for p, _ in master_leaves)
    got_paths = tuple(_path_name(p) for p, _ in rollout_flat)
    if paths != got_paths:
        missing = sorted(set(paths) ^ set(got_paths))
        raise SyncMismatchError(f"rollout_params: tree structure differs from sync(params) at "
                                f"{missing[:4]} (expected {len(paths)} leaves)")
    plan = _plan(split, recipe, model_config, kernel_layout=False)
    actions = tuple(a for a, _, _ in plan)
    masters = [x for _, x in master_leaves]
    rollouts = [x for _, x in rollout_flat]
    dtype = jnp.dtype(model_config.dtype)
    if full:
        counts = []
        bits = _view_bits(masters, rollouts, actions=actions, recipe=recipe, dtype=dtype)
        for path, action, (want, got) in zip(paths, actions, bits, strict=True):
            want, got = np.asarray(want), np.asarray(got)
            if want.shape != got.shape:
                raise SyncMismatchError(f"rollout leaf {path} ({action}): shape {got.shape} != "
                                        f"{want.shape}")
            bad = np.argwhere(want != got)
            if bad.size:
                idx = tuple(int(i) for i in bad[0])
                raise SyncMismatchError(
                    f"rollout leaf {path} ({action}): {len(bad)} of {want.size} elements differ "
                    f"from the trainer's view; first at index {idx}: bits {got[idx]:#x} != "
                    f"{want[idx]:#x}")
            counts.append(0)
    else:
        counts = [int(c) for c in _mismatch_counts(masters, rollouts, plan=plan,
                                                   recipe=recipe, dtype=dtype)]
        for path, action, c in zip(paths, actions, counts, strict=True):
            if c:
                what = "shape or dtype differs" if c < 0 else f"{c} elements differ"
                raise SyncMismatchError(f"rollout leaf {path} ({action}): {what} from the "
                                        "trainer's view of the master leaf")
    return SyncReport(paths, actions, int(sum(np.size(m) for m in masters)), tuple(counts))


def weight_bytes(tree) -> int:
    """Bytes the leaves of a (rollout) tree occupy on the device (packed leaves at their size)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
