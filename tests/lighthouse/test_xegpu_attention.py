"""Flash attention on the XeGPU target: the attention family's fused forall as one kernel,
checked through the IR of every stage and the validated SPIR-V.

For [B, H, S, 64] attention (f16 and bf16; causal and not): every stage runs; both
contractions of every key loop are xegpu.dpas on 16-bit operands with f32 accumulation,
and their FLOPs (loop trips evaluated per workgroup from the kernel's own bound
computations) equal the payload's contraction FLOPs, or for causal attention those of
the key tiles up to the diagonal (tiles wholly above it are skipped by the loop bound, not
computed and masked); Q, K, V and O move by 2-D block loads/stores (K read transposed);
the key loops prefetch their K and V tiles; one gpu.func; no buffer at all besides the
inputs and the output (no S x S scores); the SPIR-V passes spirv-val.
(No Intel GPU here: the numerics of the fused schedule are checked on the CPU target.)
"""

import json
import math

import pytest
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError
from lighthouse.targets import spirv
from tests.lighthouse.xegpu_helpers import (Lowered, dpas_flops, dumped_stages, enclosing,
                                            kernel_plans, payload_contraction_flops,
                                            tile_descriptor, walk)

STAGES = ["import", "cleanup", "fuse", "workgroups", "subgroups", "vectorize", "bufferize",
          "gpu-outline", "xegpu", "xegpu-layouts", "xevm", "binary", "native"]
KERNEL = """
import torch
import torch.nn.functional as F
B, H, S, D = {B}, {H}, {S}, {D}
LIGHTHOUSE = dict({config})
class Model(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal={causal})
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(B, H, S, D, dtype=torch.{dtype}) for _ in range(3)]
def get_init_inputs():
    return []
"""
# name: (B, H, S, D, dtype, causal)
CASES = {
    "f16": (1, 2, 256, 64, "float16", False),
    "bf16_causal": (2, 2, 256, 64, "bfloat16", True),
}
MAD = {"float16": "f16_f16_matrix_mad_k16", "bfloat16": "bf16_bf16_matrix_mad_k16"}


def _write(path, B, H, S, D, dtype, causal, config=""):
    path.write_text(KERNEL.format(B=B, H=H, S=S, D=D, dtype=dtype, causal=causal, config=config))
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def lowered(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    kernel = _write(tmp / "attention.py", *CASES[request.param])
    dump = tmp / "dump"
    compiled = compile_kernel(kernel, target="xegpu", dump_dir=dump)
    low = Lowered(compiled, dump)
    low.name = request.param
    low.shape = CASES[request.param]
    return low


def test_every_stage_runs_and_the_attention_schedule_is_used(lowered):
    assert lowered.compiled.family.name == "attention"
    assert lowered.compiled.pipeline.names() == STAGES
    assert list(lowered.stage_files) == dumped_stages(STAGES)
    (plan,) = lowered.plans
    B, H, S, D, _, _ = lowered.shape
    assert plan.kind == "attention"
    assert (plan.tiles.query_tile, plan.tiles.key_tile) == lowered.target.attention_tiles
    assert math.prod(plan.tiles.grid) == B * H * S // plan.tiles.query_tile


def test_every_contraction_is_dpas_with_the_payload_flops(lowered):
    B, H, S, D, dtype, causal = lowered.shape
    xe = lowered.ir("xegpu-layouts")
    assert not walk(xe, "vector.contract")
    dpas = walk(xe, "xegpu.dpas")
    loops = walk(xe, "scf.for")
    assert len(dpas) == 2 * len(loops) == (4 if causal else 2)   # causal: unmasked + diagonal loop
    narrow = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for op in dpas:
        assert str(ir.VectorType(op.operands[0].type).element_type) == narrow
        assert str(ir.VectorType(op.operands[1].type).element_type) == narrow
        assert str(ir.VectorType(op.results[0].type).element_type) == "f32"
    payload = payload_contraction_flops(lowered.ir("cleanup"))
    assert payload == 2 * (2 * B * H * S * S * D)
    got = dpas_flops(xe)
    if not causal:
        assert got == payload
    else:
        # Key tiles [j0, j0 + kt) up to the diagonal of query block [i0, i0 + qt) are
        # computed (the diagonal band's masked scores included); tiles wholly above it
        # are not. With kt dividing qt that is min(S, i0 + qt) keys per query row.
        tiles = lowered.plans[0].tiles
        qt = tiles.query_tile
        keys = sum(qt * min(S, i0 + qt) for i0 in range(0, S, qt))
        assert got == 2 * (2 * B * H * D * keys)
        assert 2 * (2 * B * H * D * S * (S + 1) // 2) <= got < payload
    device = lowered.device_llvm_ir()
    assert device.count(f"intel_sub_group_{MAD[dtype]}") > len(dpas)


def test_dpas_operands_come_straight_from_block_loads_and_the_scale_is_applied_in_f32(lowered):
    """S = (Q c)(K c)^T is computed as (Q K^T) c^2: DPAS reads Q and K as loaded (exact),
    the scale multiplies the f32 product; P is rounded to the input type for P V."""
    B, H, S, D, dtype, causal = lowered.shape
    xe = lowered.ir("xegpu-layouts")
    for loop in walk(xe, "scf.for"):
        qk, pv = [op for op in walk(loop, "xegpu.dpas")]
        q_load = qk.operands[0].owner
        assert q_load.name == "xegpu.load_nd" and enclosing(q_load, "scf.for") is None
        transpose = qk.operands[1].owner
        assert transpose.name == "vector.transpose"
        k_load = transpose.operands[0].owner
        assert k_load.name == "xegpu.load_nd" and "order = [0, 1]" in str(k_load.attributes["layout"])
        assert pv.operands[1].owner.name == "xegpu.load_nd"
        assert pv.operands[0].owner.name == "arith.truncf"
        scale = [u.owner for u in qk.results[0].uses]
        assert [op.name for op in scale] == ["arith.mulf"]
        splat = ir.DenseElementsAttr(scale[0].operands[1].owner.attributes["value"])
        assert ir.FloatAttr(splat.get_splat_value()).value == pytest.approx(1 / math.sqrt(D), rel=1e-6)


def test_tiles_move_by_2d_block_ops_and_the_key_loops_prefetch(lowered):
    B, H, S, D, dtype, causal = lowered.shape
    xe = lowered.ir("xegpu-layouts")
    for func in walk(xe, "gpu.func"):
        assert not walk(func, "vector.transfer_read") and not walk(func, "vector.transfer_write")
    narrow = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    tiles = walk(xe, "xegpu.load_nd") + walk(xe, "xegpu.store_nd") + walk(xe, "xegpu.prefetch_nd")
    for op in tiles:
        assert tile_descriptor(op).startswith(f"!xegpu.tensor_desc<") and f"x{narrow}" in tile_descriptor(op)
    assert len(walk(xe, "xegpu.store_nd")) == 1
    for loop in walk(xe, "scf.for"):
        loads = [op for op in walk(loop, "xegpu.load_nd")]
        prefetched = {str(p.operands[0]) for p in walk(loop, "xegpu.prefetch_nd")}
        assert len(loads) == 2 and {str(op.operands[0]) for op in loads} == prefetched
    device = lowered.device_llvm_ir()
    for builtin in ("2d_block_read", "2d_block_read_transpose", "2d_block_write", "2d_block_prefetch"):
        assert f"intel_sub_group_{builtin}" in device, builtin


def test_one_kernel_and_no_scratch_buffer(lowered):
    """No buffer but the inputs and the output: no S x S scores, no K^T / V copies, no
    loop state in memory (running max, sum and O are registers)."""
    final = lowered.ir("xegpu")
    assert len(walk(final, "gpu.func")) == 1 and len(walk(final, "gpu.launch_func")) == 1
    for name in ("memref.alloc", "memref.alloca", "gpu.alloc", "memref.copy"):
        assert not walk(final, name), name
    assert not walk(lowered.ir("bufferize"), "memref.alloc")


def test_spirv_validates_with_the_recorded_launch(lowered, tmp_path):
    target = lowered.target
    path = tmp_path / "attention.spv"
    target.write_artifact(lowered.compiled, path)
    spirv.validate(path)
    info = spirv.read_spirv(path.read_bytes())
    (ep,) = info["entry_points"]
    (kernel,) = json.loads(path.with_suffix(".json").read_text())["kernels"]
    tiles = lowered.plans[0].tiles
    assert ep.local_size == (tiles.threads, 1, 1) and list(ep.local_size) == kernel["local_size"]
    assert ep.subgroup_size == 16 == kernel["subgroup_size"]
    assert kernel["kind"] == "attention"
    assert math.prod(kernel["grid"]) == math.prod(tiles.grid)


def test_schedule_options_set_the_tiles(tmp_path):
    kernel = _write(tmp_path / "k.py", 1, 1, 128, 64, "float16", False,
                    config="query_tile=64, key_tile=16")
    compiled = compile_kernel(kernel, target="xegpu", stop_after="vectorize")
    tiles = kernel_plans(compiled)[0].tiles
    assert (tiles.query_tile, tiles.key_tile, tiles.threads) == (64, 16, 64)
    contracts = walk(compiled.module, "vector.contract")
    assert [list(ir.VectorType(op.results[0].type).shape) for op in contracts] == [[64, 16], [64, 64]]


@pytest.mark.parametrize("D, causal, rows", [(64, False, 8), (32, False, 16),
                                              (32, True, 8)])
def test_rows_per_subgroup_are_the_most_whose_tiles_fit_the_registers(tmp_path, D, causal, rows):
    """Keys per step 32: a subgroup's 16 rows of D = 64 (Q, the f32 O, K or V, S, exp(S - m)
    and P) pass 7/8 of the 16 KiB register file (the build spills), 8 rows fit; with D = 32
    16 rows fit, unless a causal mask's position tiles (i64 [rows, keys]) take their place
    (register_bytes)."""
    from schedules.attention.xegpu import REGISTER_SHARE

    kernel = _write(tmp_path / "k.py", 1, 2, 256, D, "float16", causal)
    compiled = compile_kernel(kernel, target="xegpu", stop_after="workgroups")
    tiles = kernel_plans(compiled)[0].tiles
    budget = compiled.target.chip.grf_bytes * REGISTER_SHARE
    assert (tiles.sg_rows, tiles.key_tile, tiles.position_mask) == (rows, 32, causal)
    assert tiles.register_bytes() <= budget
    if rows == 8:
        import dataclasses

        assert dataclasses.replace(tiles, sg_rows=16).register_bytes() > budget


def test_rows_per_subgroup_beyond_the_registers_are_refused(tmp_path):
    from lighthouse.targets.xegpu import XeGpuParams

    kernel = _write(tmp_path / "k.py", 1, 2, 256, 64, "float16", False)
    with pytest.raises(UnsupportedError, match=r"exceed 14336 B of the register file \(16384 B\); "
                                               r"lower key_tile or attention_sg_rows"):
        compile_kernel(kernel, target="xegpu", stop_after="workgroups",
                       target_options={"params": XeGpuParams(attention_sg_rows=16)})


def test_a_single_query_block_is_split_in_two(tmp_path):
    # B = H = 1 and S = the query tile: the attention schedule halves the block so the
    # query-block forall (one workgroup each) survives canonicalization
    kernel = _write(tmp_path / "k.py", 1, 1, 128, 64, "float16", False)
    compiled = compile_kernel(kernel, target="xegpu", stop_after="workgroups")
    tiles = kernel_plans(compiled)[0].tiles
    assert tiles.query_tile == 64 and math.prod(tiles.grid) == 2


@pytest.mark.parametrize("BH,S,config,dtype,message", [
    (1, 256, "", "float32", r"inputs of type f32: DPAS multiplies f16 or bf16"),
    (1, 256, "key_tile=128", "float16", r"of the register file"),
    (1, 192, "query_tile=96, key_tile=24", "float16",
     r"key tile \(24\) is not a multiple of the DPAS depth \(16\)"),
    (1, 144, "query_tile=48, key_tile=32", "float16",
     r"key length is not a multiple of the key tile \(32\)"),
    (2, 256, "return_lse=True", "float16", r"2 results per query block"),
])
def test_refusals_name_the_reason(tmp_path, BH, S, config, dtype, message):
    kernel = _write(tmp_path / "k.py", BH, BH, S, 64, dtype, False, config=config)
    with pytest.raises(UnsupportedError, match=message):
        compile_kernel(kernel, target="xegpu", stop_after="workgroups")


MASKED = """
import torch
import torch.nn.functional as F
B, H, S, D = 1, 2, 256, 64
class Model(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(S, S, generator=g) > 0.3
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float16) for _ in range(3)] + [mask]
def get_init_inputs():
    return []
"""


def test_a_boolean_mask_is_read_per_key_tile_in_the_one_kernel(tmp_path):
    """A broadcast [S, S] boolean mask: still one kernel whose two contractions are DPAS with
    the payload's FLOPs; the key loop reads the mask's [query_tile, key_tile] tile by a 2-D
    block load (no S x S buffer is made from it); the SPIR-V validates. (Numerics of masked
    rows, fully masked ones included: the CPU target's attention tests.)"""
    path = tmp_path / "masked.py"
    path.write_text(MASKED)
    compiled = compile_kernel(path, target="xegpu", dump_dir=tmp_path / "dump")
    low = Lowered(compiled, tmp_path / "dump")
    (plan,) = low.plans
    assert plan.kind == "attention"
    xe = low.ir("xegpu-layouts")
    assert len(walk(xe, "gpu.func")) == 1
    assert dpas_flops(xe) == payload_contraction_flops(low.ir("cleanup")) == 2 * (2 * 2 * 256 * 256 * 64)
    (loop,) = walk(xe, "scf.for")
    tiles = plan.tiles
    masks = [op for op in walk(loop, "xegpu.load_nd")
             if str(ir.VectorType(op.results[0].type).element_type) == "i8"]
    assert [list(ir.VectorType(op.results[0].type).shape) for op in masks] == \
        [[tiles.query_tile, tiles.key_tile]]
    assert not walk(low.ir("bufferize"), "memref.alloc")
    out = tmp_path / "masked.spv"
    low.target.write_artifact(compiled, out)
    spirv.validate(out)


def test_grouped_query_attention_is_refused_by_name(tmp_path):
    path = tmp_path / "gqa.py"
    path.write_text(MASKED.replace("attn_mask=mask", "enable_gqa=True").replace(
        "for _ in range(3)] + [mask]", "for _ in range(1)] + [torch.randn(B, 1, S, D, "
        "generator=g, dtype=torch.float16) for _ in range(2)]").replace(", mask)", ")"))
    with pytest.raises(UnsupportedError, match=r"S = Q K\^T is not a plain \[rows, keys\] contraction"):
        compile_kernel(path, target="xegpu", stop_after="workgroups")
