"""The Qwen3-MoE decoder as pure functions over one parameter pytree.

Parameter tree (weights like HF, ``[out, in]``, ``y = x @ W.T``)::

    {"embed": [V, H],
     "layers": [group, ...],          # runs of consecutive layers of one kind, stacked on axis 0
     "final_norm": [H],
     "lm_head": [V, H]}               # absent when tie_word_embeddings

    group = {"input_norm": [n, H], "post_attn_norm": [n, H],
             "attn": {"q_proj": [n, Hq*D, H], "k_proj": [n, KVH*D, H], "v_proj": [n, KVH*D, H],
                      "o_proj": [n, H, Hq*D], "q_norm": [n, D], "k_norm": [n, D]},
                      # a rollout tree may hold "qkv_proj" [n, (Hq+2KVH)*D, H] instead of q/k/v
                      # (``fuse_qkv``, made by the weight sync)
             "mlp": {"router": [n, E, H],                                   # MoE group
                     "experts": {"gate_up": [n, E, 2I, H], "down": [n, E, H, I]}}
                  | {"gate_up": [n, 2I_dense, H], "down": [n, H, I_dense]}}  # dense group

Each group runs as one ``jax.lax.scan``. A recipe that gives different modes to layers of one
group (keep-first/last-n BF16) splits it at trace time into sub-scans (static slices), so the
same master tree serves every recipe; ``split_layer_groups`` does the same split on the tree
itself (for a weight sync that stores different leaf types per layer).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from quads_jax.models import layers as L
from quads_jax.models.config import ModelConfig
from quads_jax.models.kv_cache import KVCache, to_cache_dtype
from quads_jax.models.kv_cache import fake_quant as kv_fake_quant
from quads_jax.models.moe import RouterStats, dense_mlp, moe_block, router_stats
from quads_jax.quant import ops
from quads_jax.quant.recipe import QuantRecipe

_BF16 = QuantRecipe(name="bf16")


class ForwardOutput(NamedTuple):
    """logits: ``[B, T, V]`` f32. cache: the updated KVCache or None.
    expert_ids: int32 ``[num_moe_layers, B, T, top_k]`` (return_router=True) or None.
    aux_loss: f32 scalar, the Switch load-balancing loss over the MoE layers (HF's
    ``aux_loss``, not yet multiplied by ``router_aux_loss_coef``) plus
    ``router_z_loss_coef * z_loss``; 0 without MoE layers."""

    logits: jax.Array
    cache: KVCache | None
    expert_ids: jax.Array | None
    aux_loss: jax.Array


# ---------------------------------------------------------------------------- sites
def layer_matmul_sites(config: ModelConfig, i: int) -> tuple[str, ...]:
    """The matmul sites of layer ``i`` (what a recipe can give a mode)."""
    attn = tuple(f"layers.{i}.attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if config.is_moe_layer(i):
        mlp = (f"layers.{i}.mlp.router", f"layers.{i}.mlp.experts.gate_up",
               f"layers.{i}.mlp.experts.down")
    else:
        mlp = (f"layers.{i}.mlp.gate_up", f"layers.{i}.mlp.down")
    return attn + mlp


def _leaf_site(path: tuple[str, ...], i: int) -> str:
    """Site of a group leaf at key path ``path`` for layer ``i``."""
    name = ".".join(path)
    return f"layers.{i}.{name}"


def param_sites(config: ModelConfig, params: dict) -> dict:
    """A tree like ``params`` whose leaves are site names: a str for ``embed``, ``lm_head``,
    ``final_norm``; for stacked layer leaves a tuple with one site per stacked layer, e.g.
    ``("layers.2.mlp.experts.gate_up", "layers.3.mlp.experts.gate_up")``."""
    out = {k: k for k in params if k != "layers"}
    groups = []
    for _, start, stop, group in _param_groups(config, params):
        def name(path, _leaf, start=start, stop=stop):
            keys = tuple(getattr(p, "key", getattr(p, "name", str(p))) for p in path)
            return tuple(_leaf_site(keys, i) for i in range(start, stop))

        groups.append(jax.tree_util.tree_map_with_path(name, group, is_leaf=_is_weight_leaf))
    out["layers"] = groups
    return out


def _is_weight_leaf(x) -> bool:
    """Packed weights (NVFP4Tensor, FP8Tensor, CalibratedWeight) count as one leaf."""
    return hasattr(x, "shape") and not isinstance(x, dict | list | tuple)


# ---------------------------------------------------------------------------- init
def init_params(config: ModelConfig, rng: jax.Array) -> dict:
    """Random master weights (normal, std ``initializer_range``; norms 1) in ``param_dtype``.

    ``rng`` is a PRNG key. With a concrete key the numbers come from numpy seeded by the key's
    data (XLA:CPU compiles each threefry ``normal`` for about a second, which dominated test
    time); under a trace (init inside jit, e.g. for sharded init) from ``jax.random``.
    """
    if isinstance(rng, jax.core.Tracer):
        keys = iter(jax.random.split(rng, 64 * len(config.layer_groups) + 8))
        draw = lambda shape: jax.random.normal(next(keys), shape, jnp.float32)
    else:
        seed = np.asarray(jax.random.key_data(rng)).ravel().tolist()
        gen = np.random.default_rng(seed)
        draw = lambda shape: gen.standard_normal(shape, np.float32)
    return _build_params(config, draw)


def _build_params(config: ModelConfig, draw) -> dict:
    c = config
    d, pd, std = c.head_dim, c.param_dtype, c.initializer_range

    def normal(shape):
        return jnp.asarray(draw(shape) * np.float32(std), pd)

    def ones(shape):
        return jnp.ones(shape, pd)

    groups = []
    for kind, start, stop in c.layer_groups:
        n = stop - start
        attn = {
            "q_proj": normal((n, c.num_attention_heads * d, c.hidden_size)),
            "k_proj": normal((n, c.num_key_value_heads * d, c.hidden_size)),
            "v_proj": normal((n, c.num_key_value_heads * d, c.hidden_size)),
            "o_proj": normal((n, c.hidden_size, c.num_attention_heads * d)),
            "q_norm": ones((n, d)),
            "k_norm": ones((n, d)),
        }
        if kind == "moe":
            e, i = c.num_experts, c.moe_intermediate_size
            mlp = {
                "router": normal((n, e, c.hidden_size)),
                "experts": {
                    "gate_up": normal((n, e, 2 * i, c.hidden_size)),
                    "down": normal((n, e, c.hidden_size, i)),
                },
            }
        else:
            i = c.intermediate_size
            mlp = {"gate_up": normal((n, 2 * i, c.hidden_size)), "down": normal((n, c.hidden_size, i))}
        groups.append({
            "input_norm": ones((n, c.hidden_size)),
            "post_attn_norm": ones((n, c.hidden_size)),
            "attn": attn,
            "mlp": mlp,
        })
    params = {"embed": normal((c.vocab_size, c.hidden_size)), "layers": groups,
              "final_norm": ones((c.hidden_size,))}
    if not c.tie_word_embeddings:
        params["lm_head"] = normal((c.vocab_size, c.hidden_size))
    return params


# ---------------------------------------------------------------------------- grouping
def _param_groups(config: ModelConfig, params: dict):
    """Yield ``(kind, start, stop, group)`` for the stacked groups of ``params``, checked
    against the config (static shapes only, so this works under jit)."""
    if not isinstance(params, dict) or "layers" not in params or "embed" not in params:
        raise ValueError("params: expected the dict tree of init_params/load_hf with "
                         "'embed', 'layers', 'final_norm'")
    start = 0
    for gi, group in enumerate(params["layers"]):
        n = group["input_norm"].shape[0]
        kind = "moe" if "router" in group["mlp"] else "dense"
        want = config.layer_kinds[start:start + n]
        if len(want) != n or any(k != kind for k in want):
            raise ValueError(
                f"params['layers'][{gi}]: a {kind} group of {n} layers starting at layer {start} "
                f"does not match the config's layer kinds {config.layer_kinds}"
            )
        yield kind, start, start + n, group
        start += n
    if start != config.num_hidden_layers:
        raise ValueError(f"params['layers'] hold {start} layers; config.num_hidden_layers="
                         f"{config.num_hidden_layers}")


def _segments(config: ModelConfig, params: dict, recipe: QuantRecipe) -> list[tuple]:
    """``[(kind, start, stop, group_slice)]``: param groups split where the recipe's modes
    change between consecutive layers (one scan per segment, modes static inside)."""
    return list(_iter_segments(config, params, recipe))


def _iter_segments(config: ModelConfig, params: dict, recipe: QuantRecipe):
    def sig(i):
        return tuple(recipe.mode_for(s) for s in layer_matmul_sites(config, i))

    for kind, start, stop, group in list(_param_groups(config, params)):
        a = start
        for i in range(start + 1, stop + 1):
            if i == stop or sig(i) != sig(a):
                if (a, i) == (start, stop):
                    yield kind, a, i, group
                else:
                    lo, hi = a - start, i - start
                    yield kind, a, i, jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], group)
                a = i


def split_layer_groups(config: ModelConfig, params: dict, recipe: QuantRecipe) -> dict:
    """``params`` with ``layers`` re-split so each group has one mode per site (see module doc)."""
    out = dict(params)
    out["layers"] = [g for _, _, _, g in _segments(config, params, recipe)]
    return out


# ---------------------------------------------------------------------------- fused q/k/v
QKV_SITES = ("q_proj", "k_proj", "v_proj")
FUSED_QKV = "qkv_proj"


def _rows_split(leaf) -> bool:
    """Whether a weight's output-feature axis (-2) is split over devices (tensor parallelism)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return False
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    axes = spec[-2] if leaf.ndim >= 2 else None
    names = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([sharding.mesh.shape[a] for a in names])) > 1


def _qkv_fusable(attn: dict, start: int, stop: int, recipe: QuantRecipe) -> bool:
    """One ``[q | k | v]`` weight serves a group when its three projections are plain arrays of
    one dtype whose sites run bf16 in every layer of the group (a quantized site has its own
    per-matrix scales, so its three matrices cannot share one GEMM's weight), and whose heads
    are not split over devices (the q / k / v boundaries of a concatenation would not fall on
    the shards' boundaries: slicing q, k and v out of the product would move data)."""
    leaves = [attn.get(n) for n in QKV_SITES]
    if not all(isinstance(w, jax.Array | np.ndarray) for w in leaves):
        return False
    if len({w.dtype for w in leaves}) != 1 or any(_rows_split(w) for w in leaves):
        return False
    return all(recipe.mode_for(f"layers.{i}.attn.{n}") == "bf16"
               for i in range(start, stop) for n in QKV_SITES)


def fuse_qkv(config: ModelConfig, params: dict, recipe: QuantRecipe | None = None) -> dict:
    """``params`` with each layer group's ``q_proj``, ``k_proj``, ``v_proj`` replaced by one
    ``qkv_proj [n, (Hq + 2 KVH) * D, H]`` (rows: q, then k, then v) where ``_qkv_fusable``.

    Decode multiplies a few tokens by each projection, so a GEMM's time is its weight read plus
    a fixed cost: on the H200 the k and v GEMMs of the 30B shape took 5.7 us each for 2 MB of
    weight (2026-12-03 trace). One GEMM on the stacked rows pays the fixed cost once. Every
    output element is the same dot product, but XLA may add its terms in another order for
    the wider GEMM: bit-identical logits in bf16 on the CPU, ~1e-6 apart in float32 (tested),
    the same class of difference as any change of GEMM shape. The weight sync builds it
    (``sync(fuse_qkv=True)``); a master tree keeps the three leaves (the trainer's gradients
    and the HF layout are per projection).
    """
    recipe = recipe or _BF16
    out, groups = dict(params), []
    for _, start, stop, group in _param_groups(config, params):
        attn = group["attn"]
        if FUSED_QKV not in attn and _qkv_fusable(attn, start, stop, recipe):
            fused = {k: v for k, v in attn.items() if k not in QKV_SITES}
            fused[FUSED_QKV] = jnp.concatenate([attn[n] for n in QKV_SITES], axis=-2)
            group = {**group, "attn": fused}
        groups.append(group)
    out["layers"] = groups
    return out


def has_fused_qkv(params: dict) -> bool:
    """Whether any layer group of ``params`` holds a fused ``qkv_proj``."""
    return any(FUSED_QKV in g.get("attn", {}) for g in params.get("layers", ()))


def _qkv(config: ModelConfig, p: dict, x: jax.Array, site: str, recipe: QuantRecipe,
         row_valid: jax.Array | None = None):
    """The q, k, v projections of ``x [..., H]``: three GEMMs, or one on a fused weight."""
    if FUSED_QKV not in p:
        return tuple(ops.linear(x, p[n], f"{site}.{n}", recipe, row_valid=row_valid)
                     for n in QKV_SITES)
    modes = {n: recipe.mode_for(f"{site}.{n}") for n in QKV_SITES}
    if set(modes.values()) != {"bf16"}:
        raise ValueError(f"{site}.{FUSED_QKV}: a fused q/k/v weight runs bf16 only, but the recipe "
                         f"{recipe.name!r} gives {modes}; sync the weights with this recipe")
    d = config.head_dim
    nq, nkv = config.num_attention_heads * d, config.num_key_value_heads * d
    if p[FUSED_QKV].shape[-2] != nq + 2 * nkv:
        raise ValueError(f"{site}.{FUSED_QKV}: {p[FUSED_QKV].shape[-2]} rows; the config needs "
                         f"{nq} + 2 * {nkv} (q, k, v)")
    # Recorded (record_inputs) and dispatched as q_proj: the three sites share x and run bf16.
    qkv = ops.linear(x, p[FUSED_QKV], f"{site}.q_proj", recipe, row_valid=row_valid)
    return qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]


# ---------------------------------------------------------------------------- forward
def _check_inputs(config, tokens, attention_mask, positions, cache):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens: shape {tuple(tokens.shape)} dtype {tokens.dtype}; expected "
                         "integer [B, T]")
    for name, a in (("attention_mask", attention_mask), ("positions", positions)):
        if a is not None and tuple(a.shape) != tuple(tokens.shape):
            raise ValueError(f"{name}: shape {tuple(a.shape)} must equal tokens' shape "
                             f"{tuple(tokens.shape)}")
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: expected a KVCache, got {type(cache).__name__}")
        want = (config.num_hidden_layers, tokens.shape[0])
        if (cache.num_layers, cache.batch) != want:
            raise ValueError(f"cache: (layers, batch)=({cache.num_layers}, {cache.batch}) must be "
                             f"{want}")
        if tokens.shape[1] > cache.max_len:
            raise ValueError(f"tokens: T={tokens.shape[1]} exceeds cache.max_len={cache.max_len}")
        if not isinstance(cache.length, jax.core.Tracer):
            if int(cache.length) + tokens.shape[1] > cache.max_len:
                raise ValueError(f"cache: length {int(cache.length)} + T={tokens.shape[1]} "
                                 f"exceeds max_len={cache.max_len}")


class _Masks(NamedTuple):
    """What a layer's attention may see. allowed: bool ``[B, T, S]``. For a decode step (T = 1
    with a cache) also the decode kernel's inputs, made once per step and not per layer
    (inside the layer scan XLA ran each as a kernel of its own, ~3.5 us per layer on the
    H200): valid int32 ``[B, S]`` and kv_len, the int32 slots written; else None."""

    allowed: jax.Array
    decode_valid: jax.Array | None = None
    decode_len: jax.Array | None = None
    # A cache's shared prefix: (k, v [L, G, KVH, P, D], valid int32 [G, P], row_group [B],
    # the kernel's group tiles or None) and, for the jnp path, what each query may see of it,
    # bool [B, T, P].
    prefix: tuple | None = None
    prefix_allowed: jax.Array | None = None


def _attention(config, p, x, rope, masks: _Masks, kv, layer, site, recipe, row_valid=None):
    """Self-attention of ``x [B, T, H]``; ``kv`` = (k_all, v_all, length) or None;
    ``row_valid`` bool ``[B, T]`` (the projections' ``ops.linear`` ``row_valid``)."""
    b, t, _ = x.shape
    d = config.head_dim
    q, k, v = (y.reshape(b, t, -1, d) for y in _qkv(config, p, x, site, recipe, row_valid))
    cos, sin = rope
    q = L.apply_rope(L.rms_norm(q, p["q_norm"], config.rms_norm_eps), cos, sin)
    k = L.apply_rope(L.rms_norm(k, p["k_norm"], config.rms_norm_eps), cos, sin)
    k = k.transpose(0, 2, 1, 3)  # [B, KVH, T, D]: the cache layout
    v = v.transpose(0, 2, 1, 3)
    if kv is None:
        if recipe.kv_quant != "none":  # the trainer attends to what an FP8 cache holds
            k, v = (kv_fake_quant(a, recipe.kv_quant) for a in (k, v))
        out = L.attend(q, k, v, masks.allowed)
    else:
        k_all, v_all, length = kv
        start = (layer, jnp.int32(0), jnp.int32(0), length, jnp.int32(0))
        k_all = jax.lax.dynamic_update_slice(k_all, to_cache_dtype(k[None], k_all.dtype), start)
        v_all = jax.lax.dynamic_update_slice(v_all, to_cache_dtype(v[None], v_all.dtype), start)
        kv = (k_all, v_all, length)
        out = None
        if masks.decode_valid is not None:
            out = L.decode_attend(q, k_all, v_all, layer, masks.decode_valid, masks.decode_len,
                                  recipe.backend, prefix=masks.prefix)
        if out is None:
            at_layer = lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)  # noqa: E731
            k, v, allowed = at_layer(k_all), at_layer(v_all), masks.allowed
            if masks.prefix is not None:  # the group's prefix slots in front of the row's
                pk, pv, _, groups = masks.prefix[:4]
                k = jnp.concatenate([at_layer(pk)[groups], k], axis=2)
                v = jnp.concatenate([at_layer(pv)[groups], v], axis=2)
                allowed = jnp.concatenate([masks.prefix_allowed, allowed], axis=-1)
            out = L.attend(q, k, v, allowed)
    return ops.linear(out, p["o_proj"], f"{site}.o_proj", recipe, row_valid=row_valid), kv


def _layer_body(config, kind, site_layer, rope, masks, token_mask, recipe):
    """The scan body of one layer; ``site_layer`` names its matmul sites (static)."""

    def body(carry, xs):
        h, kv = carry
        p, layer = xs
        b, t, hidden = h.shape
        x = L.rms_norm(h, p["input_norm"], config.rms_norm_eps)
        attn_out, kv = _attention(config, p["attn"], x, rope, masks, kv, layer,
                                  f"layers.{site_layer}.attn", recipe,
                                  token_mask.reshape(b, t))
        h = h + attn_out
        x = L.rms_norm(h, p["post_attn_norm"], config.rms_norm_eps).reshape(b * t, hidden)
        if kind == "moe":
            y, routing = moe_block(config, p["mlp"], x, f"layers.{site_layer}.mlp", recipe,
                                   token_valid=token_mask)
            ys = (routing.expert_ids.reshape(b, t, -1), router_stats(routing, token_mask))
        else:
            y, ys = dense_mlp(p["mlp"], x, f"layers.{site_layer}.mlp", recipe,
                              row_valid=token_mask), None
        return (h + y.reshape(b, t, hidden), kv), ys

    return body


# The per-layer vectors ``pack_layer_vectors`` packs (paths in a layer's params).
LAYER_VECTORS = (("input_norm",), ("post_attn_norm",), ("attn", "q_norm"), ("attn", "k_norm"))


def pack_layer_vectors(group: dict, layer_ids: jax.Array):
    """A layer group's stacked per-layer vectors (``LAYER_VECTORS`` present as ``[L, d]``
    arrays) and its layer ids as one float32 ``[L, 1 + sum d]`` array (the ids first; exact:
    ids < 2^24, and the vectors' bf16 / f32 values are f32 values), the group with those
    leaves set to None, and the static unpacking spec ``((path, d, dtype), ...)``.

    Why: a ``lax.scan`` over layers slices each stacked leaf at the loop index; XLA:GPU copies
    each small vector slice whose consumer (a Triton-emitted fusion) takes no dynamic slice,
    one ``memcpy32_post`` kernel per vector and layer (five per layer in the decode step,
    ~1.6 us each plus a launch gap). Packed, one slice serves them all."""
    group = _copy_dicts(group)
    cols, specs = [layer_ids.astype(jnp.float32)[:, None]], []
    for path in LAYER_VECTORS:
        parent = _parent(group, path)
        leaf = None if parent is None else parent.get(path[-1])
        if not isinstance(leaf, jax.Array) or leaf.ndim != 2:
            continue
        specs.append((path, int(leaf.shape[1]), leaf.dtype))
        cols.append(leaf.astype(jnp.float32))
        parent[path[-1]] = None
    return group, jnp.concatenate(cols, axis=1), tuple(specs)


def unpack_layer_vectors(p: dict, row: jax.Array, specs) -> tuple[dict, jax.Array]:
    """One layer's params with its ``pack_layer_vectors`` leaves restored from ``row``
    ``[1 + sum d]`` (static slices), and its int32 layer id."""
    p = _copy_dicts(p)
    offset = 1
    for path, d, dtype in specs:
        _parent(p, path)[path[-1]] = row[offset:offset + d].astype(dtype)
        offset += d
    return p, row[0].astype(jnp.int32)


def _copy_dicts(tree: dict) -> dict:
    """``tree`` with every nested dict copied (the leaves shared), so leaves can be swapped."""
    return jax.tree.map(lambda x: x, tree, is_leaf=lambda x: not isinstance(x, dict))


def _parent(tree: dict, path: tuple[str, ...]) -> dict | None:
    """The dict holding ``path``'s last key, or None where the path leaves the dicts."""
    for key in path[:-1]:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree if isinstance(tree, dict) else None


def _run_segment(config, kind, start, stop, group, h, kv, ctx, unroll, remat, pack=False):
    """Layers ``[start, stop)``: one ``lax.scan`` (or, with ``unroll``, a Python loop whose
    layers carry their own site names); returns (h, kv, stacked per-layer router outputs).
    ``pack``: the scan slices one packed array of the per-layer vectors and layer ids
    (``pack_layer_vectors``) instead of one per vector; same numbers."""
    wrap = jax.checkpoint if remat else (lambda f: f)
    if not unroll:
        body = wrap(_layer_body(config, kind, start, *ctx))
        per_layer = jnp.arange(start, stop, dtype=jnp.int32)  # the layer ids
        if pack:
            group, per_layer, specs = pack_layer_vectors(group, per_layer)
            inner = body

            def body(carry, xs):
                return inner(carry, unpack_layer_vectors(*xs, specs))

        (h, kv), ys = jax.lax.scan(body, (h, kv), (group, per_layer))
        return h, kv, ys
    outs = []
    for j in range(stop - start):
        body = wrap(_layer_body(config, kind, start + j, *ctx))
        layer_params = jax.tree.map(lambda x, j=j: x[j], group)
        (h, kv), ys = body((h, kv), (layer_params, jnp.int32(start + j)))
        outs.append(ys)
    ys = None if kind != "moe" else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return h, kv, ys


def forward(
    config: ModelConfig,
    params: dict,
    tokens: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    recipe: QuantRecipe | None = None,
    cache: KVCache | None = None,
    return_router: bool = False,
    remat: bool = False,
    unroll_layers: bool = False,
    pack_layer_vectors: bool = False,
) -> ForwardOutput:
    """Logits of ``tokens`` (see ``ForwardOutput``).

    Args:
      tokens: int32 ``[B, T]``.
      attention_mask: bool/int ``[B, T]``, 1 = real token (left or right padding); None = all.
      positions: int32 ``[B, T]``; default ``cumsum(mask) - 1`` clipped at 0, offset by the
        real tokens already in ``cache``.
      recipe: the QuantRecipe (None: bf16 everywhere).
      cache: a KVCache: the T new tokens go to slots ``[length, length + T)`` and attend to
        every earlier real slot; the returned cache has ``length + T``. Callers must keep
        ``length + T <= max_len`` (checked when ``length`` is concrete).
      return_router: also return the routed expert ids of every MoE layer.
      remat: rematerialise each layer in the backward pass (``jax.checkpoint``), for training.
      unroll_layers: a Python loop over layers instead of ``lax.scan`` (each layer's matmuls
        then carry their own site names, e.g. for ``collect_site_inputs``); same numbers.
      pack_layer_vectors: the layer scan slices the per-layer norm vectors and layer ids as
        one packed array (module function ``pack_layer_vectors``); same numbers.
    """
    recipe = recipe or _BF16
    _check_inputs(config, tokens, attention_mask, positions, cache)
    segments = _segments(config, params, recipe)  # validates the tree before any compute
    b, t = tokens.shape
    mask = jnp.ones((b, t), bool) if attention_mask is None else jnp.asarray(
        attention_mask).astype(bool)
    if positions is None:
        positions = jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1
        if cache is not None:
            positions = positions + jnp.sum(cache.mask, axis=1, dtype=jnp.int32)[:, None]
            if cache.has_prefix:
                positions = positions + jnp.sum(cache.prefix_mask, axis=1,
                                                dtype=jnp.int32)[cache.row_group][:, None]
        positions = jnp.maximum(positions, 0)
    rope = L.rope_tables(positions, config.head_dim, config.rope_theta)

    q_slot = jnp.arange(t, dtype=jnp.int32)
    if cache is None:
        key_mask, key_slot, kv = mask, q_slot, None
    else:
        q_slot = q_slot + cache.length
        key_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (jnp.int32(0), cache.length))
        key_slot = jnp.arange(cache.max_len, dtype=jnp.int32)
        kv = (cache.k, cache.v, cache.length)
    allowed = key_mask[:, None, :] & (key_slot[None, None, :] <= q_slot[None, :, None])
    masks = _Masks(allowed)
    if cache is not None and t == 1:
        masks = _Masks(allowed, allowed[:, 0].astype(jnp.int32), cache.length + 1)
    if cache is not None and cache.has_prefix:  # every prefix slot comes before every query
        prefix_rows = cache.prefix_mask[cache.row_group]  # [B, P]
        masks = masks._replace(
            # The decode attention kernel's group tiles (a prefix read per group), built
            # once here for every layer of the step rather than in each layer's call.
            prefix=(cache.prefix_k, cache.prefix_v, cache.prefix_mask.astype(jnp.int32),
                    cache.row_group, L.decode_prefix_tiles(
                        cache.row_group, cache.prefix_k.shape[1], cache.prefix_k.shape[3])
                    if t == 1 else None),
            prefix_allowed=jnp.broadcast_to(prefix_rows[:, None, :],
                                            (b, t, prefix_rows.shape[1])))

    h = params["embed"].astype(config.dtype)[tokens]
    token_mask = mask.reshape(-1)
    expert_ids, stats = [], []
    for kind, start, stop, group in segments:
        ctx = (rope, masks, token_mask, recipe)
        h, kv, ys = _run_segment(config, kind, start, stop, group, h, kv, ctx, unroll_layers,
                                 remat, pack_layer_vectors)
        if ys is not None:
            expert_ids.append(ys[0])
            stats.append(ys[1])

    h = L.rms_norm(h, params["final_norm"], config.rms_norm_eps)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    logits = ops.linear(h, head, "lm_head", recipe, out_dtype=jnp.float32)

    new_cache = None
    if cache is not None:
        new_cache = dataclasses.replace(cache, k=kv[0], v=kv[1], mask=key_mask,
                                        length=cache.length + t)
    ids = jnp.concatenate(expert_ids, axis=0) if (return_router and expert_ids) else None
    if return_router and not expert_ids:
        ids = jnp.zeros((0, b, t, config.num_experts_per_tok), jnp.int32)
    return ForwardOutput(logits, new_cache, ids, _aux_loss(config, stats))


def _aux_loss(config: ModelConfig, stats: list[RouterStats]) -> jax.Array:
    """HF's Switch load-balancing loss ``E * sum_e f_e P_e`` over all MoE layers' real tokens
    (``f_e``: top-k slots per token routed to e), plus ``router_z_loss_coef * z_loss``."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    counts = sum(jnp.sum(s.slot_counts, axis=0) for s in stats)
    probs = sum(jnp.sum(s.prob_sums, axis=0) for s in stats)
    rows = jnp.maximum(sum(jnp.sum(s.tokens) for s in stats), 1.0)
    balance = config.num_experts * jnp.sum((counts / rows) * (probs / rows))
    z = sum(jnp.sum(s.z_sum) for s in stats) / rows
    return balance + config.router_z_loss_coef * z


def collect_site_inputs(
    config: ModelConfig,
    params: dict,
    tokens: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    recipe: QuantRecipe | None = None,
) -> tuple[ForwardOutput, dict[str, tuple[jax.Array, jax.Array | None]]]:
    """Run ``forward`` (layers unrolled) and return the input of every matmul site.

    Returns ``(output, {site: (x, group_sizes)})`` with ``x [M, K]`` as the site's matmul saw
    it (expert sites: rows sorted by expert, ``group_sizes`` int32 ``[E]``; else None). For
    static RAC / activation-scale calibration and the layer-wise error analysis. Jittable
    (config and recipe static); padding tokens are included (select rows with the mask).
    """
    with ops.record_inputs() as records:
        out = forward(config, params, tokens, attention_mask=attention_mask,
                      positions=positions, recipe=recipe, unroll_layers=True)
    return out, {site: (x, gs) for site, x, gs in records}
