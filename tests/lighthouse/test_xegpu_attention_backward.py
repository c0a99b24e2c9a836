"""The attention backward on the XeGPU target: SDPA's joint forward+backward graph as three
kernels, the forward (test_xegpu_attention.py) and the two passes of
transform_ext.fuse_attention_backward_two_pass, checked through the IR of every stage and
the validated SPIR-V (the machine code: test_xegpu_native.py; the numerics of the same
fused schedule on the CPU target: tests/schedules/test_attention_backward_two_pass.py).

For f16 [1, 2, 256, 64] and bf16 causal [2, 2, 256, 64]: pass 1 (dQ) is a workgroup per
query block of 64 rows, pass 2 (dK, dV) one per key block of 64 keys, 8 subgroups of 8
rows each; every contraction is an xegpu.dpas on 16-bit operands with f32 accumulation,
issuing the FLOPs of the recomputation form (pass 1: S in the lse loop, then S, dP, dQ;
pass 2: S^T, dV, dP^T, dK; causal: the tiles up to the diagonal); every tile moves by 2-D
block loads and stores (Q, K and dO tiles read both transposed and as stored, by two loads),
the loops prefetch; the rows' lse and D cross between the passes in lane form; no buffer
but theirs; the SPIR-V of each kernel validates; the printed script replays.
"""

import json
import math

import pytest
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError
from lighthouse.targets import spirv
from tests.lighthouse import test_xegpu_attention as attention
from tests.lighthouse.test_schedule_scripts import _stage_files, _without_counters
from tests.lighthouse.xegpu_helpers import Lowered, dpas_flops, tile_descriptor, walk
from tests.transform_ext.helpers import check

# name: (B, H, S, D, dtype, causal)
CASES = {
    "f16": (1, 2, 256, 64, "float16", False),
    "bf16_causal": (2, 2, 256, 64, "bfloat16", True),
}
KINDS = ["attention", "attention_dq", "attention_dkv"]
NARROW = {"float16": "f16", "bfloat16": "bf16"}


_LOWERED = {}


def _lowered(name, tmp_path_factory) -> Lowered:
    """The compile of CASES[name] to the binary stage with its dump (once per session)."""
    if name not in _LOWERED:
        tmp = tmp_path_factory.mktemp(name)
        kernel = attention._write(tmp / "attention.py", *CASES[name])
        dump = tmp / "dump"
        compiled = compile_kernel(kernel, target="xegpu", backward=True, stop_after="binary",
                                  dump_dir=dump)
        low = Lowered(compiled, dump)
        low.name, low.shape, low.kernel = name, CASES[name], kernel
        _LOWERED[name] = low
    return _LOWERED[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def lowered(request, tmp_path_factory):
    return _lowered(request.param, tmp_path_factory)


def _funcs(low) -> dict:
    """The gpu.func of each kernel kind at the xegpu-layouts stage (the parsed module is kept
    on `low`)."""
    low.layouts = low.ir("xegpu-layouts")
    funcs = walk(low.layouts, "gpu.func")
    assert len(funcs) == len(low.plans)
    return {plan.kind: func for plan, func in zip(low.plans, funcs)}


def test_three_kernels_each_pass_a_grid_of_blocks(lowered):
    B, H, S, D, _, _ = lowered.shape
    assert [p.kind for p in lowered.plans] == KINDS
    dq, dkv = (p.tiles for p in lowered.plans[1:])
    assert (dq.rows, dq.step, dq.sg_rows, dq.threads) == (64, 32, 8, 128)
    assert (dkv.rows, dkv.step, dkv.sg_rows, dkv.threads) == (64, 16, 8, 128)
    assert dq.grid == dkv.grid == (B * H, S // 64)
    assert dq.position_mask == dkv.position_mask == lowered.shape[5]


def test_every_contraction_is_dpas_issuing_the_recomputation_flops(lowered):
    B, H, S, D, dtype, causal = lowered.shape
    funcs = _funcs(lowered)
    assert not walk(lowered.layouts, "vector.contract")
    for func in funcs.values():
        for op in walk(func, "xegpu.dpas"):
            assert [str(ir.VectorType(v.type).element_type) for v in list(op.operands)[:2]] \
                == [NARROW[dtype]] * 2
            assert str(ir.VectorType(op.results[0].type).element_type) == "f32"
    # causal: each loop twice, the tiles the diagonal crosses apart (masked)
    copies = 2 if causal else 1
    assert [len(walk(funcs[k], "xegpu.dpas")) for k in KINDS[1:]] == [4 * copies, 4 * copies]
    per_product = 2 * B * H * D
    if causal:
        # pass 1: query block [i0, i0 + 64) against the keys < i0 + 64 (tiles of 32); pass 2:
        # key block [j0, j0 + 64) against the queries >= j0 (tiles of 16)
        pairs_dq = sum(64 * (i0 + 64) for i0 in range(0, S, 64))
        pairs_dkv = sum(64 * (S - j0) for j0 in range(0, S, 64))
        assert pairs_dq == pairs_dkv < S * S
    else:
        pairs_dq = pairs_dkv = S * S
    assert dpas_flops(funcs["attention_dq"]) == 4 * per_product * pairs_dq
    assert dpas_flops(funcs["attention_dkv"]) == 4 * per_product * pairs_dkv
    device = lowered.device_llvm_ir()
    assert device.count(f"intel_sub_group_{attention.MAD[dtype]}") > 8


def test_tiles_move_by_2d_block_ops_and_rows_cross_in_lane_form(lowered):
    """Every load, store and prefetch a 2-D block op; Q^T, K^T, V^T and dO^T read by
    transposed loads, a tile read both ways by two loads of one descriptor; pass 1 stores
    its rows' D and lse as [64, 16] f32 lane-form tiles, pass 2 reads them as [16, 8] f32
    tiles transposed; the loops prefetch their operand tiles."""
    B, H, S, D, dtype, causal = lowered.shape
    funcs = _funcs(lowered)
    for func in funcs.values():
        assert not walk(func, "vector.transfer_read") and not walk(func, "vector.transfer_write")
        for op in walk(func, "xegpu.load_nd") + walk(func, "xegpu.store_nd"):
            assert tile_descriptor(op).startswith("!xegpu.tensor_desc<")
    narrow = NARROW[dtype]
    lane_stores = [op for op in walk(funcs["attention_dq"], "xegpu.store_nd")
                   if "64x16xf32" in tile_descriptor(op)]
    assert len(lane_stores) == 2
    lane_loads = [op for op in walk(funcs["attention_dkv"], "xegpu.load_nd")
                  if "16x8xf32" in tile_descriptor(op)]
    copies = 2 if causal else 1   # causal: the masked loop, then the one below the diagonal
    assert len(lane_loads) == 2 * copies and all(
        "order = [0, 1]" in str(op.attributes["layout"]) for op in lane_loads)
    for kind, step in (("attention_dq", 32), ("attention_dkv", 16)):
        loads = [op for op in walk(funcs[kind], "xegpu.load_nd")
                 if f"x{narrow}" in tile_descriptor(op) and "scf.for" in str(op.parent.name)]
        by_descriptor = {}
        for op in loads:   # per loop and descriptor
            by_descriptor.setdefault((str(op.parent), str(op.operands[0])), []).append(op)
        twins = [ops for ops in by_descriptor.values() if len(ops) == 2]
        assert twins, kind
        for first, second in twins:
            orders = {"order = [0, 1]" in str(op.attributes["layout"]) for op in (first, second)}
            assert orders == {True, False}
        prefetched = {str(p.operands[0]) for p in walk(funcs[kind], "xegpu.prefetch_nd")}
        assert prefetched and prefetched <= {str(op.operands[0]) for op in loads}
    device = lowered.device_llvm_ir()
    for builtin in ("2d_block_read", "2d_block_read_transpose", "2d_block_write",
                    "2d_block_prefetch"):
        assert f"intel_sub_group_{builtin}" in device, builtin


def test_the_key_block_kernel_reads_its_step_as_the_anchors_say(lowered):
    """Pass 2 per query step: the lane-form lse and D reduced over their copies and converted
    to the rows' layout (no shared memory), then S^T = K Q^T, dV += P^T dO, dP^T = V dO^T,
    dK += dS^T Q, rows split over 8 subgroups, Q / dO tiles whole (causal: the loop over
    the tiles the diagonal crosses, masked by position, then the one over those below it)."""
    func = _funcs(lowered)["attention_dkv"]
    check(str(func), """
        CHECK: scf.for
        CHECK:   vector.multi_reduction <maximumf>, %{{.*}} [0] : vector<8x16xf32> to vector<16xf32>
        CHECK:   xegpu.convert_layout %{{.*}} <{input_layout = #xegpu.slice<#xegpu.layout<sg_layout = [1, 1], sg_data = [8, 16], inst_data = [8, 16]>, dims = [0]>, target_layout = #xegpu.slice<#xegpu.layout<sg_layout = [8, 1], sg_data = [8, 16], inst_data = [8, 16]>, dims = [0]>}>
        CHECK:   xegpu.dpas {{.*}}layout_a = #xegpu.layout<sg_layout = [8, 1], sg_data = [8, 64], inst_data = [8, 16]>, layout_b = #xegpu.layout<sg_layout = [1, 1], sg_data = [64, 16], inst_data = [16, 16], order = [1, 0]>{{.*}} : vector<64x64x{{.*}}>, vector<64x16x{{.*}}>, vector<64x16xf32> -> vector<64x16xf32>
        CHECK:   math.exp
        CHECK:   xegpu.dpas {{.*}} : vector<64x16x{{.*}}>, vector<16x64x{{.*}}>, vector<64x64xf32> -> vector<64x64xf32>
        CHECK:   xegpu.dpas {{.*}} : vector<64x64x{{.*}}>, vector<64x16x{{.*}}>, vector<64x16xf32> -> vector<64x16xf32>
        CHECK:   xegpu.dpas {{.*}} : vector<64x16x{{.*}}>, vector<16x64x{{.*}}>, vector<64x64xf32> -> vector<64x64xf32>
        CHECK:   scf.yield
        CHECK: xegpu.store_nd
        CHECK: xegpu.store_nd
    """)
    if lowered.shape[5]:
        masked, unmasked = walk(func, "scf.for")
        # the position test key <= query + delta
        assert "arith.cmpi ule" in str(masked) and "arith.cmpi ule" not in str(unmasked)


def test_no_buffer_but_the_rows_in_lane_form(lowered):
    """The host allocates only the lane-form lse and D ([B H, S, 16] f32) that pass 1 writes
    and pass 2 reads: no S x S buffer, no copy of an input."""
    B, H, S, D, _, _ = lowered.shape
    final = lowered.ir("xegpu")
    shapes = sorted(str(op.results[0].type) for op in walk(final, "gpu.alloc"))
    assert shapes == [f"memref<{B * H}x{S}x16xf32>"] * 2
    for name in ("memref.alloc", "memref.copy"):
        assert not walk(final, name), name


def test_spirv_validates_for_each_kernel_with_its_launch(lowered, tmp_path):
    out = tmp_path / "attention.spv"
    lowered.target.write_artifact(lowered.compiled, out)
    manifest = json.loads(out.with_suffix(".json").read_text())
    assert [k["kind"] for k in manifest["kernels"]] == KINDS
    for kernel, plan in zip(manifest["kernels"], lowered.plans):
        path = out.with_name(f"attention.{kernel['module']}.spv")
        spirv.validate(path)
        (ep,) = spirv.read_spirv(path.read_bytes())["entry_points"]
        assert list(ep.local_size) == kernel["local_size"] == [plan.threads, 1, 1]
        assert math.prod(kernel["grid"]) == math.prod(plan.tiles.grid)


def test_the_printed_script_replays_to_identical_ir(tmp_path_factory, tmp_path):
    lowered = _lowered("bf16_causal", tmp_path_factory)
    script = tmp_path / "schedule.mlir"
    script.write_text(lowered.compiled.schedule_text())
    assert "transform_ext.fuse_attention_backward_two_pass" in script.read_text()
    compile_kernel(lowered.kernel, target="xegpu", backward=True, stop_after="binary",
                   dump_dir=tmp_path / "replayed", schedule_file=script)
    built, replayed = _stage_files(lowered.dump), _stage_files(tmp_path / "replayed")
    assert built.keys() == replayed.keys()
    for stage in built:
        assert _without_counters(built[stage]) == _without_counters(replayed[stage]), stage


MASKED = attention.MASKED
GIVEN_LSE_F32 = """
import torch
import torch.nn.functional as F
from lighthouse.extras import sdpa_log_sum_exp
from lighthouse.flash_decompositions import flash_backward_given_lse
class Model(torch.nn.Module):
    def forward(self, do, q, k, v, o, lse):
        return flash_backward_given_lse(do, q, k, v, o, lse, 0.0, False)
def get_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64) for _ in range(3))
    o = F.scaled_dot_product_attention(q, k, v)
    return [torch.randn_like(o), q, k, v, o, sdpa_log_sum_exp(q, k)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("source, backward, message", [
    (MASKED, True, r"attention backward pass 2 .*: a mask of i8 is read in \[keys, queries\] "
                   r"tiles, transposed, .* no XeGPU backward for a boolean attention mask"),
    (GIVEN_LSE_F32, False, r"attention backward pass 1 .*: inputs of type f32: DPAS "
                           r"multiplies f16 or bf16"),
    (attention.KERNEL.format(B=1, H=2, S=192, D=64, dtype="float16", causal=False,
                             config="backward_tiles=(64, 24, 64, 16)"), True,
     r"attention backward pass 1 .*: loop step \(24\) is not a multiple of the DPAS depth \(16\)"),
])
def test_refusals_name_the_reason(kernel_file, source, backward, message):
    with pytest.raises(UnsupportedError, match=message):
        compile_kernel(kernel_file(source), target="xegpu", backward=backward,
                       stop_after="workgroups")
