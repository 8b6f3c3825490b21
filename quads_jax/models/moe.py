"""The sparse MoE block: route, sort token-slots by expert, grouped matmuls, weighted combine.

Dropless: every token's top-k slots are computed. The expert matmuls go through
``ops.grouped_linear`` (``jax.lax.ragged_dot`` in the reference path, the Pallas grouped kernel
on GPU). ``moe_dense_reference`` (all experts on all tokens) exists only to test this one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from quads_jax.models.config import ModelConfig
from quads_jax.models.layers import swiglu
from quads_jax.quant import ops
from quads_jax.quant.recipe import QuantRecipe
from quads_jax.train.mesh import batch_axes_dividing


class Routing(NamedTuple):
    """weights: ``[N, k]`` f32 combine weights; expert_ids: int32 ``[N, k]``;
    logits: ``[N, E]`` f32 router logits; probs: ``[N, E]`` f32 softmax."""

    weights: jax.Array
    expert_ids: jax.Array
    logits: jax.Array
    probs: jax.Array


class RouterStats(NamedTuple):
    """Per-layer sums over real tokens for the load-balancing and z losses."""

    slot_counts: jax.Array  # [E] f32, top-k slots routed to each expert
    prob_sums: jax.Array  # [E] f32, summed router probabilities
    z_sum: jax.Array  # [] f32, summed logsumexp(logits)^2
    tokens: jax.Array  # [] f32, number of real tokens


# Dtypes whose products are exact in float32 (8- and 11-bit significands).
EXACT_PRODUCT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def route(config: ModelConfig, router_w, x: jax.Array, site: str, recipe: QuantRecipe) -> Routing:
    """Softmax router with top-k (and ``norm_topk_prob`` renormalisation), in float32.

    x: ``[N, H]``; router_w: ``[E, H]``.
    """
    if x.dtype == router_w.dtype and x.dtype in EXACT_PRODUCT_DTYPES:
        # Products of two bf16 (or f16) values are exact in float32, so a bf16 GEMM with float32
        # accumulation gives the float32 logits up to summation order, on tensor cores (the
        # rollout's synced tree): the float32 GEMM runs on CUDA cores (6.8 us per layer of
        # the 30B decode step on the H200, 2026-12-03).
        logits = ops.linear(x, router_w, site, recipe, out_dtype=jnp.float32)
    else:
        logits = ops.linear(x.astype(jnp.float32), router_w, site, recipe).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, config.num_experts_per_tok)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, ids.astype(jnp.int32), logits, probs)


def router_stats(routing: Routing, token_mask: jax.Array) -> RouterStats:
    """Sums over tokens with ``token_mask [N]`` True (padding excluded, as HF does)."""
    m = token_mask.astype(jnp.float32)
    e = routing.probs.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(routing.expert_ids, e, dtype=jnp.float32), axis=1)
    z = jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))
    return RouterStats(
        slot_counts=m @ counts,
        prob_sums=m @ routing.probs,
        z_sum=jnp.sum(z * m),
        tokens=jnp.sum(m),
    )


# The mesh axis that the stacked expert dimension is sharded over; tokens may be sharded over
# the mesh's batch axes (both from the one axis table, ``quads_jax.train.mesh``).
EXPERT_AXIS = "expert"


def moe_block(
    config: ModelConfig, p: dict, x: jax.Array, site: str, recipe: QuantRecipe,
    token_valid: jax.Array | None = None,
) -> tuple[jax.Array, Routing]:
    """Sparse MoE of tokens ``x [N, H]`` (compute dtype) -> ``([N, H], Routing)``.

    ``p``: ``router [E, H]``, ``experts.gate_up [E, 2I, H]`` (gate rows first),
    ``experts.down [E, H, I]``. ``site`` is the layer prefix, e.g. ``layers.3.mlp``.
    ``token_valid``: None or bool ``[N]``, the rows that are tokens (``ops.linear``'s
    ``row_valid``: RAC's selection ignores the others).

    Under a mesh (``jax.set_mesh``) whose ``expert`` axis has more than one device and divides
    E, the expert matmuls run expert-parallel (``expert_parallel``): each device multiplies
    only its own experts' weights, so the weights are never gathered, whatever kernel runs.
    Where a grouped kernel runs (a GPU) and the tokens are split over the mesh's batch axes,
    the same ``shard_map`` keeps each device on its own tokens: XLA's partitioner cannot split
    a kernel's custom call, and would gather every token onto every device instead.
    """
    routing = route(config, p["router"], x, f"{site}.router", recipe)
    ep = expert_parallel_size(config.num_experts)
    mesh = jax.sharding.get_abstract_mesh()
    local_tokens = (bool(batch_axes_dividing(mesh, x.shape[0]))
                    and ops.grouped_kernel_runs(f"{site}.experts.gate_up", recipe))
    # While the sites' inputs are recorded (calibration, the layer-wise analysis) the block
    # runs unsplit: records from inside the shard_map would be its local tracers, and those
    # callers want every token's rows sorted over all E experts anyway.
    if (ep > 1 or local_tokens) and not ops.recording():
        y = expert_parallel(config, p["experts"], x, routing, site, recipe, token_valid)
    else:
        y = _experts(config, p["experts"], x, routing.expert_ids, routing.weights, site, recipe,
                     token_valid=token_valid)
    return y.astype(x.dtype), routing


# Up to this many (slot, slot) pairs ``sort_slots`` ranks the slots by counting (one fused
# comparison); above it (prefill) it sorts.
PAIRWISE_SORT_LIMIT = 1 << 22
# Whether ``_experts`` sorts a decode step's slots with the Pallas kernel where the expert
# matmuls are kernels (``set_slot_sort_kernel``; bench_rollout's --slot-sort-kernel). On by
# default since session 38: on an H100 (398e556, ``h200_next.sh ssort``) its order, inverse and
# counts equal the jnp path's (128 / 256 tokens x top-8, uniform and skewed routing) in
# 2.5-3.7 us against the jnp path's five kernels' 5.7-7.6 us; the nvfp4_rac decode step at
# batch 128 ran 72 kernels fewer, busy -0.08 ms (8.80 against 8.82 ms).
DEFAULT_SLOT_SORT_KERNEL = True
_SLOT_SORT_KERNEL = [DEFAULT_SLOT_SORT_KERNEL]


def set_slot_sort_kernel(on: bool = DEFAULT_SLOT_SORT_KERNEL) -> None:
    """Use (the default) or not the slot-sort kernel in ``_experts`` (traced after the call)."""
    _SLOT_SORT_KERNEL[0] = bool(on)


def slot_sorts_before(id_j, slot_j, id_i, slot_i) -> jax.Array:
    """Whether slot ``j`` comes before slot ``i`` in the stable sort by expert, elementwise over
    broadcast operands: what ``sort_slots`` counts (the slot-sort kernel too)."""
    return (id_j < id_i) | ((id_j == id_i) & (slot_j < slot_i))


def sort_slots(flat_ids: jax.Array, num_experts: int, kernel: str | None = None):
    """Stable sort of token slots by expert: ``(order, inverse, counts)``.

    ``flat_ids``: int32 ``[S]`` expert of each slot. ``order[i]``: the slot at sorted row ``i``;
    ``inverse[s]``: the sorted row of slot ``s``; ``counts``: int32 ``[E]`` slots per expert.
    For a decode step's few slots the sorted row is counted (the slots of lower experts plus
    the earlier slots of the same expert: one fused comparison) rather than sorted: XLA's sort
    of 1 024 keys took 8 us per layer on the H200 (2026-12-03 trace). Same permutation either
    way. The count needs no cumulative sum of ``counts``: XLA runs a cumsum of E values as a
    ``reduce_window`` kernel of its own (4.4 us per layer on the H200, 2026-12-04 trace).

    ``kernel``: None, "gpu" or "interpret": where the grouped matmuls run kernels, a decode
    step's count runs as one Pallas kernel (``pallas_kernels.slot_sort``; the jnp path was
    five XLA kernels per layer), the same permutation.
    """
    s = flat_ids.shape[0]
    if kernel is not None and s * s <= PAIRWISE_SORT_LIMIT:
        from pallas_kernels import slot_sort  # here: the trainer's CPU path never needs Pallas

        if slot_sort.supports(s, num_experts):
            return slot_sort.slot_sort(flat_ids, num_experts, interpret=kernel == "interpret")
    counts = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    slot = jnp.arange(s, dtype=jnp.int32)
    if s * s <= PAIRWISE_SORT_LIMIT:
        before = slot_sorts_before(flat_ids[None, :], slot[None, :], flat_ids[:, None],
                                   slot[:, None])
        inverse = jnp.sum(before, axis=1, dtype=jnp.int32)
        order = jnp.zeros_like(inverse).at[inverse].set(slot)
    else:
        order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)
        inverse = jnp.zeros_like(order).at[order].set(slot)
    return order, inverse, counts


def _experts(config, experts, x, expert_ids, weights, site, recipe, first=None,
             token_valid=None):
    """The top-k expert outputs of tokens ``x [N, H]``, combined: float32 ``[N, H]``.

    ``experts`` hold experts ``[first, first + E_local)`` (``first`` None: all of them); slots
    routed to other experts contribute zero.
    """
    n, h = x.shape
    k = config.num_experts_per_tok
    flat_ids = expert_ids.reshape(-1)  # slot s = token s // k, choice s % k
    # The slot sort as a kernel where the expert matmuls are kernels (a GPU, or interpret), and
    # not inside the expert-parallel shard_map: its ids vary over the mesh there, and the
    # kernel's interpret mode cannot type its index arithmetic as varying (check_vma).
    kernel = (("interpret" if recipe.backend == "interpret" else "gpu")
              if _SLOT_SORT_KERNEL[0] and not jax.typeof(flat_ids).mat.varying
              and ops.grouped_kernel_runs(f"{site}.experts.gate_up", recipe) else None)
    order, inverse, counts = sort_slots(flat_ids, config.num_experts, kernel)
    token_of_row = order // k  # sorted row -> token: gate_up's rows are the tokens' rows
    offset, row_slot = None, order  # row_slot: the slot at each (rotated) sorted row
    if first is None:
        group_sizes = counts
    else:
        # The local experts' rows are one contiguous range of the sorted rows: rotate it to the
        # front, where the grouped matmul expects it (rows past the local groups come out 0).
        e_local = experts["gate_up"].shape[0]
        group_sizes = jax.lax.dynamic_slice_in_dim(counts, first, e_local)
        expert = jnp.arange(config.num_experts, dtype=jnp.int32)
        offset = jnp.sum(jnp.where(expert < first, counts, 0))
        token_of_row = jnp.roll(token_of_row, -offset, axis=0)
        row_slot = jnp.roll(order, -offset, axis=0)
    # The sorted row of each slot, after the rotation: the inverse of both gathers below
    # (a token's k slots are rows unsort[t*k : (t+1)*k]), so that where ops gathers the rows
    # itself (the trainer's plain modes) their gradients are gathers, not scatter-adds.
    unsort = inverse if offset is None else (inverse - offset) % inverse.shape[0]
    gate_up = ops.grouped_linear(
        x, experts["gate_up"], group_sizes, f"{site}.experts.gate_up", recipe,
        source_rows=token_of_row, row_valid=token_valid, source_rows_inverse=unsort,
    )
    # Unsorted by the down GEMM's read-back itself (``output_rows``: slot s is sorted row
    # inverse[s], before the expert-parallel rotation): one gather of the kernel's tiles that
    # XLA can fuse into the weighted sum below, where sorting back after the read-back took a
    # second gather (and a scatter of the [N*k, H] rows would be a pass of its own).
    out = ops.grouped_linear(
        swiglu(gate_up), experts["down"], group_sizes, f"{site}.experts.down", recipe,
        row_valid=None if token_valid is None else jnp.asarray(token_valid)[token_of_row],
        output_rows=unsort, output_rows_inverse=row_slot,
    )
    slots = out.reshape(n, k, h)
    w = weights.astype(x.dtype).astype(jnp.float32)  # HF casts to the model dtype
    return jnp.sum(slots.astype(jnp.float32) * w[..., None], axis=1)


def expert_parallel_size(num_experts: int) -> int:
    """Devices along the current mesh's ``expert`` axis, or 1 (no mesh, no such axis, one
    device, or an axis that does not divide ``num_experts``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    ep = mesh.shape[EXPERT_AXIS]
    return ep if ep > 1 and num_experts % ep == 0 else 1


def expert_parallel(config: ModelConfig, experts: dict, x: jax.Array, routing: Routing,
                    site: str, recipe: QuantRecipe,
                    token_valid: jax.Array | None = None) -> jax.Array:
    """The expert matmuls with experts sharded over the mesh's ``expert`` axis (where
    ``expert_parallel_size`` > 1; else replicated): float32 ``[N, H]``.

    In a ``shard_map`` over the whole mesh: every leaf of ``experts`` whose first dimension is E
    (weights, their scales, calibration) is split over ``expert``, everything else replicated;
    tokens stay sharded over the batch axes that divide them. Where tokens are split over
    ``expert`` too, each device all-gathers its expert group's tokens, computes the slots
    routed to its own experts, and a reduce-scatter returns each device its tokens' float32
    sums; otherwise a psum over ``expert`` does. The result equals the unsharded block up to
    the order of the float32 additions of a token's k slots. Other axes (``tensor``) replicate
    the expert matmuls.
    """
    mesh = jax.sharding.get_abstract_mesh()
    e = config.num_experts
    split = expert_parallel_size(e) > 1
    tok = batch_axes_dividing(mesh, x.shape[0])
    tok_spec = P(tok or None)
    w_specs = jax.tree.map(
        lambda a: P(EXPERT_AXIS) if split and a.ndim and a.shape[0] == e else P(), experts)
    gathered = split and EXPERT_AXIS in tok

    def body(experts, x, ids, weights, valid):
        if gathered:
            x, ids, weights, valid = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True)
                                      for a in (x, ids, weights, valid))
        first = None
        if split:
            first = jax.lax.axis_index(EXPERT_AXIS) * (e // jax.lax.axis_size(EXPERT_AXIS))
        y = _experts(config, experts, x, ids, weights, site, recipe, first=first,
                     token_valid=None if token_valid is None else valid)
        if gathered:
            y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        elif split:
            y = jax.lax.psum(y, EXPERT_AXIS)
        return y

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(w_specs, tok_spec, tok_spec, tok_spec, tok_spec),
                       out_specs=tok_spec)
    valid = jnp.ones(x.shape[:1], bool) if token_valid is None else token_valid
    return fn(experts, x, routing.expert_ids, routing.weights, valid)


def dense_mlp(p: dict, x: jax.Array, site: str, recipe: QuantRecipe,
              row_valid: jax.Array | None = None) -> jax.Array:
    """SwiGLU MLP of a dense layer: ``gate_up [2I, H]`` (gate first), ``down [H, I]``."""
    hidden = swiglu(ops.linear(x, p["gate_up"], f"{site}.gate_up", recipe, row_valid=row_valid))
    return ops.linear(hidden, p["down"], f"{site}.down", recipe, row_valid=row_valid)


def moe_dense_reference(config: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """Test reference: every expert on every token, combined with the dense top-k weights.

    Same routing as ``moe_block``; bf16 recipe semantics (plain matmuls). ``[N, H]`` out.
    """
    routing = route(config, p["router"], x, "reference.router", QuantRecipe())
    e = config.num_experts
    weights = routing.weights.astype(x.dtype).astype(jnp.float32)
    combine = jnp.sum(
        jax.nn.one_hot(routing.expert_ids, e, dtype=jnp.float32) * weights[..., None], axis=1
    )  # [N, E]
    w_gu = p["experts"]["gate_up"].astype(x.dtype)
    w_d = p["experts"]["down"].astype(x.dtype)
    hi = jax.lax.Precision.HIGHEST
    gu = jnp.einsum("nh,eih->eni", x, w_gu, precision=hi, preferred_element_type=jnp.float32)
    hidden = swiglu(gu.astype(x.dtype))
    out = jnp.einsum("eni,ehi->enh", hidden, w_d, precision=hi,
                     preferred_element_type=jnp.float32)
    y = jnp.einsum("enh,ne->nh", out.astype(x.dtype).astype(jnp.float32), combine, precision=hi)
    return y.astype(x.dtype)
