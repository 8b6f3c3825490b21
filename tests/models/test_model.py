"""The functional model: MoE dispatch vs the dense reference, KV cache vs full forward, padding,
scan groups and recipes, bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax.models import (
    KVCache,
    forward,
    init_params,
    moe,
    param_sites,
    split_layer_groups,
)
from quads_jax.models.moe import moe_block, moe_dense_reference
from quads_jax.quant import nvfp4
from quads_jax.quant.recipe import QuantRecipe, get_recipe
from quads_jax.testing import jit_forward, padded_batch, tiny_config

CFG32 = tiny_config(dtype="float32")
FWD = jit_forward()


@pytest.fixture(scope="module")
def params():
    return init_params(CFG32, jax.random.key(0))


def _moe_params(params, layer_group=0):
    return jax.tree.map(lambda x: x[0], params["layers"][layer_group]["mlp"])


def test_init_shapes_and_groups(params):
    c = CFG32
    assert c.layer_kinds == ("moe", "dense", "moe", "moe")
    assert c.layer_groups == (("moe", 0, 1), ("dense", 1, 2), ("moe", 2, 4))
    g = params["layers"][2]
    assert g["mlp"]["experts"]["gate_up"].shape == (2, 8, 64, 64)
    assert g["mlp"]["experts"]["down"].shape == (2, 8, 64, 32)
    assert params["layers"][1]["mlp"]["gate_up"].shape == (1, 192, 64)
    assert g["attn"]["q_proj"].shape == (2, 64, 64) and g["attn"]["k_proj"].shape == (2, 32, 64)
    assert params["lm_head"].shape == (c.vocab_size, 64)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tied = init_params(c.replace(tie_word_embeddings=True), jax.random.key(0))
    assert "lm_head" not in tied


def test_param_sites(params):
    sites = param_sites(CFG32, params)
    assert sites["lm_head"] == "lm_head" and sites["embed"] == "embed"
    assert sites["layers"][2]["mlp"]["experts"]["gate_up"] == (
        "layers.2.mlp.experts.gate_up", "layers.3.mlp.experts.gate_up")
    assert sites["layers"][1]["mlp"]["down"] == ("layers.1.mlp.down",)
    assert sites["layers"][0]["attn"]["q_proj"] == ("layers.0.attn.q_proj",)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_sparse_moe_equals_dense_reference(params, norm_topk):
    c = CFG32.replace(norm_topk_prob=norm_topk)
    p = _moe_params(params)
    # A router that never picks experts 5..7: they receive zero tokens (empty groups).
    p = dict(p, router=p["router"].at[5:].set(-1.0))
    x = jnp.abs(jax.random.normal(jax.random.key(1), (13, 64), jnp.float32))
    y, routing = moe_block(c, p, x, "layers.0.mlp", QuantRecipe())
    assert int(jnp.max(routing.expert_ids)) < 5
    y_ref = moe_dense_reference(c, p, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5, rtol=1e-5)
    assert float(jnp.abs(y).max()) > 1e-2


@pytest.mark.parametrize("slots,limit", [(96, None), (96, 0), (1, None)])
def test_sort_slots_is_the_stable_argsort(slots, limit, monkeypatch):
    """Counting (decode) and sorting (above the pair limit) give jnp's stable argsort."""
    if limit is not None:
        monkeypatch.setattr(moe, "PAIRWISE_SORT_LIMIT", limit)
    ids = jax.random.randint(jax.random.key(slots), (slots,), 0, 7).astype(jnp.int32)
    order, inverse, counts = moe.sort_slots(ids, 7)
    want = np.argsort(np.asarray(ids), kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(slots))
    np.testing.assert_array_equal(counts, np.bincount(np.asarray(ids), minlength=7))


def test_moe_block_gradients_match_dense_reference(params):
    p = _moe_params(params)
    x = jax.random.normal(jax.random.key(2), (7, 64), jnp.float32)
    loss = lambda p: jnp.sum(jnp.sin(moe_block(CFG32, p, x, "l.mlp", QuantRecipe())[0]))
    loss_ref = lambda p: jnp.sum(jnp.sin(moe_dense_reference(CFG32, p, x)))
    g, g_ref = jax.grad(loss)(p), jax.grad(loss_ref)(p)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), g, g_ref)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_swiglu_gradient_equals_autodiff(dtype, tol):
    """``layers.swiglu``'s own backward (it keeps only its input) against autodiff of the same
    f32 formula; bf16 within one bf16 rounding of the result."""
    from quads_jax.models.layers import swiglu

    def plain(gu):
        gate, up = jnp.split(gu.astype(jnp.float32), 2, axis=-1)
        return (jax.nn.silu(gate) * up).astype(gu.dtype)

    gu = (jax.random.normal(jax.random.key(4), (6, 2, 16)) * 3).astype(dtype)
    dy = jax.random.normal(jax.random.key(5), (6, 2, 8)).astype(dtype)
    np.testing.assert_array_equal(swiglu(gu), plain(gu))
    got, want = (jax.vjp(f, gu)[1](dy)[0].astype(jnp.float32) for f in (swiglu, plain))
    assert got.dtype == want.dtype and float(jnp.abs(want).max()) > 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(jnp.abs(want).max()))


def _batch():
    rows = [[5, 9, 13, 22, 31, 40, 7], [11, 12, 13], [60, 61, 62, 63, 64]]
    return rows, *padded_batch(rows, left=True)


def test_left_and_right_padding_agree(params):
    rows, left_tok, left_mask = _batch()
    right_tok, right_mask = padded_batch(rows, left=False)
    left = FWD(CFG32, params, jnp.asarray(left_tok), attention_mask=jnp.asarray(left_mask))
    right = FWD(CFG32, params, jnp.asarray(right_tok), attention_mask=jnp.asarray(right_mask))
    for i, r in enumerate(rows):
        a = left.logits[i, left_tok.shape[1] - len(r):]
        b = right.logits[i, : len(r)]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    single = FWD(CFG32, params, jnp.asarray([rows[1]], jnp.int32))  # no padding at all
    np.testing.assert_allclose(np.asarray(single.logits[0]), np.asarray(right.logits[1, :3]),
                               atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_prefill_and_decode_equal_full_forward(params, dtype):
    c = CFG32.replace(dtype=dtype)
    rows, tok, mask = _batch()
    b, t = tok.shape
    steps = 4
    extra = np.random.default_rng(0).integers(3, c.vocab_size, (b, steps)).astype(np.int32)
    full_tok = np.concatenate([tok, extra], 1)
    full_mask = np.concatenate([mask, np.ones((b, steps), bool)], 1)
    full = FWD(c, params, jnp.asarray(full_tok), attention_mask=jnp.asarray(full_mask),
               return_router=True)

    cache = KVCache.init(c, b, t + steps + 3, dtype=c.dtype)
    out = FWD(c, params, jnp.asarray(tok), attention_mask=jnp.asarray(mask), cache=cache,
              return_router=True)
    logits, ids = [out.logits], [out.expert_ids]
    cache = out.cache
    pos = mask.sum(1)
    for s in range(steps):
        out = FWD(c, params, jnp.asarray(extra[:, s:s + 1]), cache=cache,
                  positions=jnp.asarray(pos[:, None] + s, jnp.int32), return_router=True)
        logits.append(out.logits)
        ids.append(out.expert_ids)
        cache = out.cache
    assert int(cache.length) == t + steps
    assert np.array_equal(np.asarray(cache.mask[:, : t + steps]), full_mask)
    got = np.concatenate([np.asarray(x) for x in logits], 1)
    tol = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got * full_mask[..., None],
                               np.asarray(full.logits) * full_mask[..., None], atol=tol)
    if dtype == "float32":
        got_ids = np.concatenate([np.asarray(x) for x in ids], 2)
        np.testing.assert_array_equal(got_ids * full_mask[None, ..., None],
                                      np.asarray(full.expert_ids) * full_mask[None, ..., None])


def test_cache_default_positions_continue_after_prompt(params):
    _, tok, mask = _batch()
    cache = KVCache.init(CFG32, 3, tok.shape[1] + 4 + 3, dtype=jnp.float32)  # as above
    out = FWD(CFG32, params, jnp.asarray(tok), attention_mask=jnp.asarray(mask), cache=cache)
    nxt = jnp.asarray([[3], [4], [5]], jnp.int32)
    a = FWD(CFG32, params, nxt, cache=out.cache).logits
    b = FWD(CFG32, params, nxt, cache=out.cache,
            positions=jnp.asarray(mask.sum(1)[:, None], jnp.int32)).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_expert_ids_and_aux_loss(params):
    _, tok, mask = _batch()
    out = FWD(CFG32, params, jnp.asarray(tok), attention_mask=jnp.asarray(mask),
              return_router=True)
    assert out.expert_ids.shape == (3, 3, tok.shape[1], 2) and out.expert_ids.dtype == jnp.int32
    assert out.cache is None
    # Switch loss: E * sum f_e P_e with sum f_e = top_k: at least top_k / 1 for any routing
    assert float(out.aux_loss) > 0.5
    dense = CFG32.replace(num_experts=0, mlp_only_layers=())
    p_dense = init_params(dense, jax.random.key(0))
    o = FWD(dense, p_dense, jnp.asarray(tok), return_router=True)
    assert float(o.aux_loss) == 0.0 and o.expert_ids.shape[0] == 0
    z = FWD(CFG32.replace(router_z_loss_coef=1.0), params, jnp.asarray(tok),
            attention_mask=jnp.asarray(mask))
    assert float(z.aux_loss) > float(out.aux_loss)


def test_keep_first_layers_bf16_splits_scans_and_matches():
    two = CFG32.replace(num_hidden_layers=2, mlp_only_layers=())  # one group of 2 MoE layers
    params = init_params(two, jax.random.key(4))
    _, tok, mask = _batch()
    rec = get_recipe("trainer_qat", keep_first_n_bf16=1)  # layer 0 bf16, layer 1 QAT
    a = FWD(two, params, jnp.asarray(tok), attention_mask=jnp.asarray(mask), recipe=rec)
    split = split_layer_groups(two, params, rec)
    assert [g["input_norm"].shape[0] for g in split["layers"]] == [1, 1]
    b = FWD(two, split, jnp.asarray(tok), attention_mask=jnp.asarray(mask), recipe=rec)
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
    # Manually fake-quantize layer 1's experts: the bf16 recipe must give the same logits.
    ex = split["layers"][1]["mlp"]["experts"]
    qdq = jax.jit(nvfp4.qdq, static_argnames="scale_mode")  # eagerly, every small op compiled
    ex["gate_up"] = qdq(ex["gate_up"], scale_mode="expert")
    ex["down"] = qdq(ex["down"], scale_mode="expert")
    c = FWD(two, split, jnp.asarray(tok), attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(c.logits), atol=1e-5)
    plain = FWD(two, params, jnp.asarray(tok), attention_mask=jnp.asarray(mask))
    assert float(jnp.abs(plain.logits - a.logits).max()) > 1e-3


def test_bad_inputs(params):
    tok = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="tokens"):
        forward(CFG32, params, jnp.zeros((2, 5), jnp.float32))
    with pytest.raises(ValueError, match="attention_mask"):
        forward(CFG32, params, tok, attention_mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="positions"):
        forward(CFG32, params, tok, positions=jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="batch"):
        forward(CFG32, params, tok, cache=KVCache.init(CFG32, 3, 8))
    with pytest.raises(ValueError, match="max_len"):
        forward(CFG32, params, tok, cache=KVCache.init(CFG32, 2, 4))
    with pytest.raises(ValueError, match="layer kinds"):
        forward(CFG32.replace(mlp_only_layers=(2,)), params, tok)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        forward(CFG32.replace(num_hidden_layers=5, mlp_only_layers=(1,)), params, tok)


def test_unrolled_and_remat_match_scan(params):
    _, tok, mask = _batch()
    args = (CFG32, params, jnp.asarray(tok))
    a = FWD(*args, attention_mask=jnp.asarray(mask), return_router=True)
    b = FWD(*args, attention_mask=jnp.asarray(mask), return_router=True, unroll_layers=True)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.expert_ids), np.asarray(b.expert_ids))
    one = CFG32.replace(num_hidden_layers=1, mlp_only_layers=())  # small compile
    p1 = init_params(one, jax.random.key(1))
    loss = lambda p, remat: jnp.mean(FWD(one, p, jnp.asarray(tok), remat=remat).logits ** 2)
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5),
                 grad(p1, False), grad(p1, True))


def test_collect_site_inputs_and_static_rac_calibration():
    from quads_jax.models import collect_site_inputs
    from quads_jax.models.transformer import layer_matmul_sites
    from quads_jax.quant import ops, rac

    cfg = CFG32.replace(num_hidden_layers=3, mlp_only_layers=(1,))  # moe, dense, moe
    params = init_params(cfg, jax.random.key(5))
    # No padding: online_batch scores real tokens only (ops.linear's row_valid), while the
    # collected inputs hold every row; on an all-token batch both see the same rows.
    rows, _, _ = _batch()
    tok, mask = padded_batch([r[:3] for r in rows], left=True)
    assert mask.all()
    online = get_recipe("rollout_quads", backend="reference")
    run = jax.jit(collect_site_inputs, static_argnums=0, static_argnames="recipe")
    out, inputs = run(cfg, params, jnp.asarray(tok), attention_mask=jnp.asarray(mask),
                      recipe=online)
    want = {s for i in range(3) for s in layer_matmul_sites(cfg, i)} | {"lm_head"}
    assert set(inputs) == want
    x, gs = inputs["layers.2.mlp.experts.down"]
    assert x.shape == (tok.size * 2, 32) and int(gs.sum()) == tok.size * 2
    assert inputs["layers.1.mlp.gate_up"][1] is None
    # Static calibration on this very batch must reproduce online_batch selection exactly.
    static = online.replace(rac_selection="static")
    calibrated = split_layer_groups(cfg, params, static)
    # Jitted, as the weight sync runs it (sampler.calibration): one compile per shape instead
    # of a dispatch of every small op (12 of this test's 20 s on 2 cores).
    calibrate = jax.jit(lambda x, gs: rac.calibrate_blocks(
        x, online, row_expert=ops.expert_of_rows(gs, x.shape[0]), num_experts=8))
    for g, (_, start, stop) in zip(calibrated["layers"], cfg.layer_groups, strict=True):
        if "experts" not in g["mlp"]:
            continue
        for name in ("gate_up", "down"):
            blocks = []
            for i in range(start, stop):
                blocks.append(calibrate(*inputs[f"layers.{i}.mlp.experts.{name}"]))
            g["mlp"]["experts"][name] = rac.CalibratedWeight(
                g["mlp"]["experts"][name], rac_blocks=jnp.stack(blocks))
    got = FWD(cfg, calibrated, jnp.asarray(tok), attention_mask=jnp.asarray(mask),
              recipe=static)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(out.logits), atol=1e-5)


def test_nnx_module_holds_the_same_tree():
    from flax import nnx

    from quads_jax.models import Qwen3MoeForCausalLM

    one = CFG32.replace(num_hidden_layers=1, mlp_only_layers=())
    p1 = init_params(one, jax.random.key(1))
    model = Qwen3MoeForCausalLM(one, params=p1)
    assert jax.tree.structure(model.pure_params()) == jax.tree.structure(p1)
    assert len(nnx.to_flat_state(nnx.state(model, nnx.Param))) == len(jax.tree.leaves(p1))
    tok = jnp.asarray([[5, 6, 7]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(tok).logits),
                                  np.asarray(forward(one, p1, tok).logits))
    fresh = Qwen3MoeForCausalLM(one, rngs=nnx.Rngs(0))
    assert jax.tree.structure(fresh.pure_params()) == jax.tree.structure(p1)
    with pytest.raises(ValueError, match="rngs"):
        Qwen3MoeForCausalLM(one)


def test_packed_layer_vectors_match_the_scan(params):
    """``pack_layer_vectors``: the scan slices one packed array of the per-layer norm vectors
    and layer ids instead of one per vector: the same logits and routing bit for bit, with a
    KV cache (the layer id indexes it) and without; the scan's inputs lose the four vectors."""
    from quads_jax.models.transformer import pack_layer_vectors, unpack_layer_vectors

    _, tok, mask = _batch()
    args = (CFG32, params, jnp.asarray(tok))
    a = FWD(*args, attention_mask=jnp.asarray(mask), return_router=True)
    b = FWD(*args, attention_mask=jnp.asarray(mask), return_router=True,
            pack_layer_vectors=True)
    # The scan of layers 2-3 really slices one packed float32 [2, 1 + 2H + 2D] input.
    width = 1 + 2 * CFG32.hidden_size + 2 * CFG32.head_dim
    jaxprs = [str(jax.make_jaxpr(lambda p, t, pack=pack: forward(
        CFG32, p, t, pack_layer_vectors=pack).logits)(params, jnp.asarray(tok)))
        for pack in (False, True)]
    assert f"f32[2,{width}]" in jaxprs[1] and f"f32[2,{width}]" not in jaxprs[0]
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
    np.testing.assert_array_equal(np.asarray(a.expert_ids), np.asarray(b.expert_ids))
    cache = KVCache.init(CFG32, tok.shape[0], tok.shape[1] + 2)
    a = FWD(*args, attention_mask=jnp.asarray(mask), cache=cache)
    b = FWD(*args, attention_mask=jnp.asarray(mask), cache=cache, pack_layer_vectors=True)
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
    np.testing.assert_array_equal(np.asarray(a.cache.k), np.asarray(b.cache.k))

    group = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["layers"][-1])
    n = group["input_norm"].shape[0]
    assert n == 2  # layers 2 and 3
    packed_group, packed, specs = pack_layer_vectors(group, jnp.arange(3, 3 + n))
    d, dq = CFG32.hidden_size, CFG32.head_dim
    assert packed.shape == (n, 1 + 2 * d + 2 * dq) and packed.dtype == jnp.float32
    assert [s[0] for s in specs] == [("input_norm",), ("post_attn_norm",), ("attn", "q_norm"),
                                     ("attn", "k_norm")]
    assert packed_group["input_norm"] is None and packed_group["attn"]["q_norm"] is None
    assert group["input_norm"] is not None  # the caller's tree is not changed
    layer = jax.tree.map(lambda x: x[1], packed_group)
    restored, layer_id = unpack_layer_vectors(layer, packed[1], specs)
    assert int(layer_id) == 4
    want = jax.tree.map(lambda x: x[1], group)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 restored, want)
    assert restored["attn"]["k_norm"].dtype == jnp.bfloat16
