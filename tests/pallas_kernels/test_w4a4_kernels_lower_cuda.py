"""Every Mosaic GPU kernel variant lowers for cuda (jax.export under an abstract H200), so
GPU-lowering errors (8-bit shifts, Blackwell-only casts, pallas_call + MGPU) fail CI."""

import jax
import jax.numpy as jnp
import pytest
from compiled import jit_call
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import nvfp4_quantize as aq
from pallas_kernels.layout import prepare_w4a4_weights
from pallas_kernels.w4a4_grouped import w4a4_grouped_matmul
from pallas_kernels.w4a4_matmul import W4A4MatmulConfig, w4a4_matmul
from quads_jax.quant import nvfp4

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", platform="gpu", num_cores=132))


# The kernels' custom calls: Mosaic GPU, and Triton for the RAC selection kernel
# (pallas_kernels.rac_select) of the grouped RAC calls.
KERNEL_CALLS = [export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),
                export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def _export(fn, *args):
    with jax.sharding.use_abstract_mesh(H200):
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=KERNEL_CALLS)(*args)
    text = exp.mlir_module()
    assert "mosaic_gpu" in text
    return text


def _weights(key, shape, scale_mode="tensor"):
    """Random NVFP4 weights, quantized in one compiled program (``tests/compiled.py``)."""
    return jit_call(nvfp4.quantize, jax.random.normal(key, shape), scale_mode=scale_mode)


@pytest.mark.parametrize(
    "mma,decode,a_via_smem,rac,block_m",
    [
        ("float16", "normal", False, False, 16),
        ("float16", "normal", False, True, 64),
        ("bfloat16", "subnormal", False, False, 8),
        ("float16", "normal", True, True, 16),
    ],
)
def test_dense_lowers_for_cuda(mma, decode, a_via_smem, rac, block_m):
    wq = _weights(jax.random.key(0), (256, 512))
    w = jit_call(prepare_w4a4_weights, wq, mma_dtype=mma, decode=decode)
    cfg = W4A4MatmulConfig(block_m=block_m, a_via_smem=a_via_smem, mma_dtype=mma, k_splits=2)
    racc = aq.RACConfig() if rac else None
    x = jnp.ones((block_m, 512), jnp.bfloat16)
    _export(lambda x, w: w4a4_matmul(x, w, rac=racc, config=cfg), x, w)


@pytest.mark.parametrize("n,n_group,stack,mma_k,bits,scales,buffers", [
    (128, 1, False, 64, "nibbles", None, 0), (512, 4, False, 64, "nibbles", None, 0),
    (256, 1, True, 64, "nibbles", None, 0), (128, 1, False, 256, "nibbles", None, 0),
    (256, 1, True, 128, "nibbles", None, 0), (256, 1, True, 256, "signs_high", None, 0),
    (256, 1, True, 256, "signs_high", "float8_e4m3fn", 0),
    # the rollout's defaults with 2 weight-row tiles per work item (h200_next.sh ng2) and
    # the epilogue's copies through two staging buffers (store_buffers, its dynamic slot)
    (512, 2, True, 256, "signs_high", "float8_e4m3fn", 2)])
def test_grouped_lowers_for_cuda(n, n_group, stack, mma_k, bits, scales, buffers):
    wq = _weights(jax.random.key(1), (4, n, 256), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits=bits, scale_dtype=scales)
    x = jnp.ones((24, 256), jnp.bfloat16)
    gs = jnp.asarray([8, 0, 10, 6], jnp.int32)
    cfg = W4A4MatmulConfig(n_group=n_group, stack_operands=stack, mma_k=mma_k,
                           store_buffers=buffers)
    _export(lambda x, w, gs: w4a4_grouped_matmul(x, w, gs, rac=aq.RACConfig(), config=cfg),
            x, w, gs)


@pytest.mark.parametrize("mma_k,memory", [(128, 40), (256, 24)])
def test_grouped_four_compute_warpgroups_lower_for_cuda(mma_k, memory):
    """Two warpgroup pairs, one per weight-row tile of the item (``compute_wgs=4``: a dynamic
    tile index into the step's SMEM tiles, 5 warpgroups), at the rollout's defaults; the
    copy warpgroup at 40 or 24 registers (``wide_memory_registers``)."""
    wq = _weights(jax.random.key(2), (4, 512, 256), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    x = jnp.ones((24, 256), jnp.bfloat16)
    gs = jnp.asarray([8, 0, 10, 6], jnp.int32)
    cfg = W4A4MatmulConfig(n_group=2, mma_k=mma_k, compute_wgs=4, wide_memory_registers=memory)
    _export(lambda x, w, gs: w4a4_grouped_matmul(x, w, gs, rac=aq.RACConfig(), config=cfg),
            x, w, gs)


@pytest.mark.parametrize("wgs", [2, 4])
def test_tile_kernel_ablation_no_second_mma_lowers_for_cuda(wgs):
    """kernel_probe's ``no_second_mma`` ablation (RAC's second wgmmas left out; its untouched
    accumulator gets its layout by a cast) on one and two warpgroup pairs."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    wq = _weights(jax.random.key(3), (2, 256, 256), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b = tuple(jnp.ones((2, 16, 256), jnp.float16) for _ in range(2))
    te, nt = jnp.array([1, 0], jnp.int32), jnp.array([2], jnp.int32)
    cfg = TileGemmConfig(ablation="no_second_mma", n_group=2, compute_wgs=wgs, mma_k=128)
    _export(lambda b, w, cs: nvfp4_tile_gemm(b, w, te, nt, config=cfg, col_scales=cs,
                                             out_dtype=jnp.bfloat16),
            b, w, jnp.ones((2, 2, 16), jnp.float32))


@pytest.mark.parametrize("operands", [1, 2])
def test_tile_kernel_32_row_tiles_on_two_pairs_lower_for_cuda(operands):
    """kernel_probe's ``rows32`` variants: 32 token rows per tile on two warpgroup pairs with
    the copy warpgroup at 24 registers (wgmma N = 32, or 64 with RAC's stacked operand)."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    wq = _weights(jax.random.key(5), (2, 256, 256), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b = tuple(jnp.ones((2, 32, 256), jnp.float16) for _ in range(operands))
    te, nt = jnp.array([1, 0], jnp.int32), jnp.array([2], jnp.int32)
    cfg = TileGemmConfig(n_group=2, compute_wgs=4, stack_operands=True, memory_registers=24)
    _export(lambda b, w, cs: nvfp4_tile_gemm(b, w, te, nt, config=cfg, col_scales=cs,
                                             out_dtype=jnp.bfloat16),
            b, w, jnp.ones((2, operands, 32), jnp.float32))


@pytest.mark.parametrize("operands,stack,wgs", [(1, False, 4), (2, True, 4), (2, True, 2),
                                                (2, False, 2)])
def test_tile_kernel_narrow_tiles_lower_for_cuda(operands, stack, wgs):
    """``narrow_tiles``: both accumulator sets' pipelines, the narrow one's wgmmas on the first
    8 rows of each B tile (stacked: sliced from the folded tile)."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm
    from pallas_kernels.token_tiles import TokenTiles

    wq = _weights(jax.random.key(6), (2, 256, 256), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    rows = tuple(jnp.ones((32, 256), jnp.float16) for _ in range(operands))
    te, nt = jnp.array([1, 0], jnp.int32), jnp.array([2], jnp.int32)
    cfg = TileGemmConfig(n_group=2, compute_wgs=wgs, stack_operands=stack,
                         memory_registers=24 if wgs == 4 else 40, narrow_tiles=True)
    _export(lambda rows, row0, w, cs: nvfp4_tile_gemm(
        TokenTiles(rows, row0, 16), w, te, nt, config=cfg, col_scales=cs,
        out_dtype=jnp.bfloat16), rows, jnp.array([0, 8], jnp.int32), w,
        jnp.ones((2, operands, 16), jnp.float32))


@pytest.mark.parametrize("wgs,mma_k", [(2, 256), (4, 128)])
def test_tile_kernel_residual_blocks_lower_for_cuda(wgs, mma_k):
    """The second operand's wgmmas per selected 16-column block (``residual_blocks``: A
    sliced from registers, B from 32-byte-swizzled tiles, each under a branch)."""
    from pallas_kernels.nvfp4_tiles_mgpu import TileGemmConfig, nvfp4_tile_gemm

    wq = _weights(jax.random.key(4), (2, 256, 512), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    b = tuple(jnp.ones((2, 16, 512), jnp.float16) for _ in range(2))
    te, nt = jnp.array([1, 0], jnp.int32), jnp.array([2], jnp.int32)
    cfg = TileGemmConfig(n_group=2, compute_wgs=wgs, mma_k=mma_k)
    _export(lambda b, w, cs, rb: nvfp4_tile_gemm(b, w, te, nt, config=cfg, col_scales=cs,
                                                 out_dtype=jnp.bfloat16, residual_blocks=rb),
            b, w, jnp.ones((2, 2, 16), jnp.float32), jnp.full((2, 1), 0x5555AAAA - 2**32,
                                                              jnp.int32))


def test_grouped_rac_slot_scales_from_the_selection_lower_for_cuda():
    """The grouped RAC matmul at the rollout's defaults with the selection kernel writing the
    token-slot scales and the tile kernel applying the experts' global scales
    (``rac_select_slot_scales``: its third output, ``nvfp4_tile_gemm(expert_scales=)``)."""
    wq = _weights(jax.random.key(6), (4, 256, 256), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    x = jnp.ones((24, 256), jnp.bfloat16)
    gs = jnp.asarray([8, 0, 10, 6], jnp.int32)
    cfg = W4A4MatmulConfig(rac_select_slot_scales=True)
    _export(lambda x, w, gs: w4a4_grouped_matmul(x, w, gs, rac=aq.RACConfig(), config=cfg),
            x, w, gs)


def test_grouped_rac_selected_wgmmas_lower_for_cuda():
    """The grouped RAC matmul passing its selection to the kernel (``rac_selected_wgmmas``)."""
    wq = _weights(jax.random.key(5), (4, 256, 512), "expert")
    w = jit_call(prepare_w4a4_weights, wq, bits="signs_high", scale_dtype="float8_e4m3fn")
    x = jnp.ones((24, 512), jnp.bfloat16)
    gs = jnp.asarray([8, 0, 10, 6], jnp.int32)
    cfg = W4A4MatmulConfig(stack_operands=False, rac_selected_wgmmas=True)
    _export(lambda x, w, gs: w4a4_grouped_matmul(x, w, gs, rac=aq.RACConfig(), config=cfg),
            x, w, gs)


def test_expert_parallel_moe_block_lowers_for_cuda(monkeypatch):
    """The MoE block's expert-parallel shard_map around the W4A4 + RAC grouped kernels, for 4
    H200s along ``expert``: the kernels lower with the local experts' shapes (2 of 8)."""
    from quads_jax.models import init_params
    from quads_jax.models.moe import moe_block
    from quads_jax.quant import kernel_backend, ops
    from quads_jax.quant.recipe import get_recipe
    from quads_jax.testing import tiny_config

    cfg = tiny_config(dtype="bfloat16")
    recipe = get_recipe("rollout_quads")
    params = jit_call(init_params, cfg, jax.random.key(0))
    p = jax.tree.map(lambda a: a[0], params["layers"][0]["mlp"])
    p = dict(p, experts={k: jit_call(kernel_backend.prepare_weights, v, "w4a4_nvfp4_rac", recipe)
                         for k, v in p["experts"].items()})
    mesh = AbstractMesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,),
                        abstract_device=H200.abstract_device)
    monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")  # "auto" picks the kernels
    kernel_backend.set_w4a4_overrides(rac_select_kernel=True)  # the selection kernel too
    with jax.sharding.use_abstract_mesh(mesh):
        try:
            exp = export.export(
                jax.jit(lambda p, x: moe_block(cfg, p, x, "layers.0.mlp", recipe)[0]),
                platforms=["cuda"], disabled_checks=KERNEL_CALLS,
            )(p, jnp.ones((16, 64), jnp.bfloat16))
        finally:
            kernel_backend.set_w4a4_overrides()  # the defaults again
    text = exp.mlir_module()
    assert "mosaic_gpu" in text
    assert "tensor<2x1x128x64xui16>" in text  # the local experts' codes inside the shard_map
    assert "reduce_scatter" in text
    assert "rac_select" in text  # the RAC selection kernel runs inside the shard_map too
    assert "rac_operands" in text  # and RAC's operand kernel (the default)
    assert "tile_plan" in text  # and the token-tile plan kernel (the default)


@pytest.mark.parametrize("data,dw_kernel", [(1, True), (4, True), (4, False)])
def test_trainer_moe_gradient_lowers_for_cuda(monkeypatch, data, dw_kernel):
    """The QAT trainer's MoE block, forward and backward, with ``bf16_grouped`` for every
    expert matmul (forward, dx: ``ragged_dot_mgpu``; dW: ``ragged_contract`` with
    ``dw_kernel``, else XLA's ``ragged_dot_general``, the only XLA ragged product left). On 4
    H200s along ``data`` each device's kernels take its own 4 tokens' 8 slots (the MoE
    block's shard_map), not all 32."""
    from quads_jax.models import init_params
    from quads_jax.models.moe import moe_block
    from quads_jax.quant import kernel_backend, ops
    from quads_jax.quant.recipe import get_recipe
    from quads_jax.testing import tiny_config

    cfg = tiny_config(dtype="bfloat16", moe_intermediate_size=64)
    recipe = get_recipe("trainer_qat")
    params = jit_call(init_params, cfg, jax.random.key(0))
    p = jax.tree.map(lambda a: a[0], params["layers"][0]["mlp"])
    monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")  # "auto" picks the kernels

    def loss(p, x):
        return jnp.sum(moe_block(cfg, p, x, "layers.0.mlp", recipe)[0].astype(jnp.float32))

    mesh = AbstractMesh((data,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                        abstract_device=H200.abstract_device)
    kernel_backend.set_bf16_grouped(True, dw_kernel=dw_kernel)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            exp = export.export(jax.jit(jax.grad(loss, (0, 1))), platforms=["cuda"],
                                disabled_checks=KERNEL_CALLS)(p, jnp.ones((16, 64), jnp.bfloat16))
    finally:
        kernel_backend.set_bf16_grouped()
    text = exp.mlir_module()
    assert ("chlo.ragged_dot" in text) == (not dw_kernel)
    # Each device's dW of the replicated weights is a partial sum over its own tokens: one
    # all-reduce per expert matmul (Mosaic kernels' outputs come typed invariant: without
    # ``vma.vary_like`` the kernel's dW was never summed).
    assert text.count("all_reduce") == (2 if data > 1 else 0)
    assert text.count("mosaic_gpu") >= (6 if dw_kernel else 4)  # 2 matmuls x (fwd, dx[, dW])
    slots = 16 // data * cfg.num_experts_per_tok
    assert f"tensor<{slots}x64xbf16>" in text and ("shard_map" in text) == (data > 1)
