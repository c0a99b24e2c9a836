"""The flash-attention schedule: numerics against torch for every case it must handle, and
the IR it produces (one key loop per query block, stable correction, no S x S buffer)."""

import re

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import ScheduleMismatch

KERNEL = """
import torch
import torch.nn.functional as F
LIGHTHOUSE = dict({config})
class Model(torch.nn.Module):
    def forward(self, {args}):
        return F.scaled_dot_product_attention({call})
def get_inputs():
    torch.manual_seed(0)
    return {inputs}
def get_init_inputs():
    return []
"""


def _kernel(kernel_file, call, inputs, args="q, k, v", config=""):
    return kernel_file(KERNEL.format(call=call, inputs=inputs, args=args, config=config))


def _check(compiled):
    assert compiled.family.name == "attention", compiled.notes
    reports = compiled.check()
    for r in reports:
        assert r.ok, str(r)
    return compiled


CASES = {
    # name: (call, inputs, args)
    "4d": ("q, k, v", "[torch.randn(2, 3, 70, 16) for _ in range(3)]", "q, k, v"),
    "3d_collapsed_batch": ("q, k, v", "[torch.randn(3, 50, 16) for _ in range(3)]", "q, k, v"),
    "2d": ("q, k, v", "[torch.randn(45, 32) for _ in range(3)]", "q, k, v"),
    "explicit_scale": ("q, k, v, scale=0.3", "[torch.randn(1, 2, 40, 16) for _ in range(3)]", "q, k, v"),
    "q_shorter_than_kv": ("q, k, v", "[torch.randn(1, 2, 30, 16), torch.randn(1, 2, 90, 16), "
                          "torch.randn(1, 2, 90, 24)]", "q, k, v"),
    "q_longer_than_kv": ("q, k, v", "[torch.randn(1, 2, 90, 16), torch.randn(1, 2, 33, 16), "
                         "torch.randn(1, 2, 33, 16)]", "q, k, v"),
    "causal": ("q, k, v, is_causal=True", "[torch.randn(1, 2, 70, 16) for _ in range(3)]", "q, k, v"),
    "causal_rectangular": ("q, k, v, is_causal=True", "[torch.randn(1, 2, 30, 16), "
                           "torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)]", "q, k, v"),
    "bool_mask_broadcast": ("q, k, v, attn_mask=m", "[torch.randn(2, 2, 40, 16), torch.randn(2, 2, 50, 16), "
                            "torch.randn(2, 2, 50, 16), torch.rand(2, 1, 40, 50) > 0.3]", "q, k, v, m"),
    "float_mask_broadcast": ("q, k, v, attn_mask=m", "[torch.randn(2, 2, 40, 16), torch.randn(2, 2, 50, 16), "
                             "torch.randn(2, 2, 50, 16), torch.randn(40, 50) * 3]", "q, k, v, m"),
    "fully_masked_rows": ("q, k, v, attn_mask=m", "[torch.randn(1, 2, 40, 16), torch.randn(1, 2, 50, 16), "
                          "torch.randn(1, 2, 50, 16), (torch.arange(40)[:, None] < 33) & "
                          "(torch.rand(40, 50) > 0.5)]", "q, k, v, m"),
    "float_mask_with_inf_rows": ("q, k, v, attn_mask=m", "[torch.randn(1, 1, 20, 8), torch.randn(1, 1, 40, 8), "
                                 "torch.randn(1, 1, 40, 8), torch.where(torch.arange(20)[:, None] % 5 == 0, "
                                 "float('-inf'), torch.zeros(20, 40))]", "q, k, v, m"),
    "f16": ("q, k, v", "[torch.randn(1, 2, 40, 16).half() for _ in range(3)]", "q, k, v"),
    "bf16": ("q, k, v", "[torch.randn(1, 2, 40, 16).bfloat16() for _ in range(3)]", "q, k, v"),
    "bf16_causal": ("q, k, v, is_causal=True", "[torch.randn(1, 2, 40, 16).bfloat16() for _ in range(3)]",
                    "q, k, v"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch(kernel_file, name):
    call, inputs, args = CASES[name]
    compiled = _check(compile_kernel(_kernel(kernel_file, call, inputs, args,
                                             config="query_tile=16, key_tile=16")))
    out = compiled.run()[0]
    assert not torch.isnan(out).any()
    if name == "fully_masked_rows":
        assert torch.equal(out[:, :, 33:], torch.zeros_like(out[:, :, 33:]))  # torch gives 0 there


def test_tiles_that_do_not_divide_the_sequences(kernel_file):
    path = _kernel(kernel_file, "q, k, v", "[torch.randn(1, 2, 37, 16), torch.randn(1, 2, 101, 16), "
                   "torch.randn(1, 2, 101, 16)]", config="query_tile=64, key_tile=24")
    _check(compile_kernel(path))


@pytest.fixture
def fused_ir(kernel_file):
    path = _kernel(kernel_file, "q, k, v, attn_mask=m", "[torch.randn(1, 2, 64, 16), torch.randn(1, 2, 96, 16), "
                   "torch.randn(1, 2, 96, 16), torch.rand(64, 96) > 0.2]", args="q, k, v, m",
                   config="query_tile=16, key_tile=32")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    return fused, bufferized


def test_one_key_loop_per_query_block_with_the_stable_correction(fused_ir):
    from tests.transform_ext.helpers import check

    fused, _ = fused_ir
    check(fused, """
        CHECK: scf.forall
        CHECK:   scf.for %[[J:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args
        CHECK:     tensor.extract_slice {{.*}}[0, %[[J]], 0] [1, 32, 16]
        CHECK:     arith.maximumf
        CHECK:     math.exp
        CHECK:     scf.yield
        CHECK-NOT: scf.for
        CHECK:   arith.divf
        CHECK:   scf.forall.in_parallel
    """)
    # the correction factor, in the stable form: m_old == -inf ? 0 : exp(m_old - m_new)
    stable = re.compile(r"\^bb0\(%(\w+): f32, %(\w+): f32, %\w+: f32\):\s*"
                        r"%(\w+) = arith\.maximumf %\1, %\2 : f32\s*"
                        r"%(\w+) = arith\.cmpf oeq, %\1, %\w+ : f32\s*"
                        r"%(\w+) = arith\.subf %\1, %\3 : f32\s*"
                        r"%(\w+) = math\.exp %\5 : f32\s*"
                        r"%\w+ = arith\.select %\4, %\w+, %\6 : f32")
    loop = fused.split("scf.for ", 1)[1].split("scf.yield", 1)[0]
    assert len(stable.findall(loop)) >= 1, "the correction of the sum and of P V (CSE may share it)"
    assert "arith.divf" not in loop, "no exp(-m_new) / exp(-m_old) form"
    forall = fused.split("scf.forall", 1)[1]
    assert forall.count("scf.for ") == 1, "exactly one loop over key tiles per query block"
    assert "arith.andi" not in fused, "the masked-row AND-reduction is gone"


def test_no_sq_by_skv_buffer_after_bufferization(fused_ir):
    _, bufferized = fused_ir
    allocs = re.findall(r"memref\.alloc\(\)[^:]*: memref<([0-9x]+)x\w+>", bufferized)
    for shape in allocs:
        dims = [int(d) for d in shape.split("x")]
        assert not (64 in dims and 96 in dims), f"an S_q x S_kv buffer: {shape}"


def test_gqa_reads_one_copy_of_k_and_v_per_kv_head(kernel_file):
    path = _kernel(kernel_file, "q, k, v, enable_gqa=True",
                   "[torch.randn(2, 6, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)]",
                   config="query_tile=16, key_tile=16")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    # K^T (scaled) is materialized per kv head only: [B * Hkv, D, S], never per query head
    shapes = re.findall(r"tensor<([0-9x]+)xf32>", fused)
    assert "2x2x16x40" in shapes, shapes                 # K^T once per (batch, kv head)
    # K^T and its per-(batch, kv head) slices only; no copy per query head (6) or group (3)
    assert {s for s in shapes if s.endswith("x16x40")} <= {"2x2x16x40", "1x1x16x40"}, shapes
    _check(compile_kernel(path))


def test_a_softmax_variant_it_cannot_fuse_falls_back_with_a_note(kernel_file):
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, q, k, v):
                p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
                return torch.sin(p) @ v
        def get_inputs():
            torch.manual_seed(0)
            return [torch.randn(2, 20, 8) for _ in range(3)]
        def get_init_inputs():
            return []
    """)
    compiled = compile_kernel(path)
    assert compiled.family.name == "matmul"  # the next family that recognizes the two products
    assert compiled.notes and compiled.notes[0].startswith("the attention schedule does not apply (")
    assert "linalg" in compiled.notes[0]  # names the op the schedule could not take
    assert all(r.ok for r in compiled.check())
    with pytest.raises(ScheduleMismatch, match="attention schedule does not apply"):
        compile_kernel(path, strict=True)


def test_attention_is_chosen_for_the_example():
    from tests.conftest import EXAMPLES

    compiled = compile_kernel(EXAMPLES / "attention.py", overrides={"B": 1, "H": 2, "S": 48, "D": 16})
    _check(compiled)


def test_causal_key_tiles_above_the_diagonal_are_skipped(kernel_file):
    from tests.transform_ext.helpers import check

    path = _kernel(kernel_file, "q, k, v, is_causal=True", "[torch.randn(1, 2, 64, 16) for _ in range(3)]",
                   config="query_tile=16, key_tile=16")
    compiled = compile_kernel(path, stop_after="fuse")
    fused = str(compiled.module)
    # rows [16 i, 16 i + 16) only need key tiles j0 < 16 i + 16: the loop bound says so, and the
    # tiles wholly below the diagonal run in a first loop without the mask
    check(fused, """
        CHECK: scf.forall (%{{.*}}, %[[QB:.*]]) in
        CHECK:   %[[I0:.*]] = arith.muli %[[QB]], %c16 : index
        CHECK:   %[[B:.*]] = arith.addi %[[I0]], %c16 : index
        CHECK:   %[[B0:.*]] = arith.maxsi %[[B]], %c0 : index
        CHECK:   %[[UB:.*]] = arith.minsi %[[B0]], %c64 : index
        CHECK:   %[[SPLIT:.*]] = arith.minsi %{{.*}}, %[[UB]] : index
        CHECK:   %[[A:.*]]:3 = scf.for %{{.*}} = %c0 to %[[SPLIT]] step %c16
        CHECK-NOT: arith.cmpi
        CHECK:   scf.yield
        CHECK:   scf.for %{{.*}} = %[[SPLIT]] to %[[UB]] step %c16 iter_args(%{{.*}} = %[[A]]#0
        CHECK:     arith.cmpi sle
        CHECK:   scf.yield
    """)
    _check(compile_kernel(path))


def test_key_major_scores_on_the_cpu(kernel_file):
    from tests.transform_ext.helpers import check

    # S^T = K Q^T: K read in place as broadcast scalars (no K^T anywhere), Q^T rows as the
    # vector operand, the max and sum over keys as elementwise ops on rows of queries
    path = _kernel(kernel_file, "q, k, v", "[torch.randn(1, 2, 96, 16), torch.randn(1, 2, 64, 16), "
                   "torch.randn(1, 2, 64, 16)]", config="query_tile=32, key_tile=32")
    _check(compile_kernel(path))
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    check(vectorized, """
        CHECK-NOT: tensor<2x16x64xf32>
        CHECK: scf.forall
        CHECK:   scf.for %[[J:.*]] = %c0 to %c64 step %c32
        CHECK:     scf.for {{.*}} -> (vector<1x8x32xf32>)
        CHECK-DAG:   vector.transfer_read {{.*}} : tensor<1x16x32xf32>, vector<1x1x32xf32>
        CHECK-DAG:   vector.transfer_read {{.*}} : tensor<2x64x16xf32>, vector<1x8x1xf32>
        CHECK:     scf.for {{.*}} iter_args(%[[M:.*]] = %{{.*}}) -> (vector<1x32xf32>)
        CHECK:       arith.maximumf %[[M]], %{{.*}} : vector<1x32xf32>
    """)
    loop = vectorized.split("scf.for %arg6", 1)[1].split("scf.forall.in_parallel", 1)[0]
    assert "vector.multi_reduction" not in loop and "vector.reduction" not in loop


def test_query_blocks_take_the_short_exp_and_the_rest_keeps_the_general_one(kernel_file):
    """The weights exp(s - m) and corrections exp(m_old - m_new) of the key loops are
    expanded by the short flushing form (one f32 ln2 constant, 2^(k - 1) from shifted
    bits), the annotation that found them removed; an exp of the output, fused into the
    query blocks after the key loop, keeps the general expansion of the CPU lowering
    (math.exp until then)."""
    from tests.transform_ext.helpers import check

    path = kernel_file(KERNEL.format(
        config="query_tile=16, key_tile=16", args="q, k, v",
        call="q, k, v).exp() + F.scaled_dot_product_attention(q, k, v",
        inputs="[torch.randn(1, 2, 32, 16) * 4 for _ in range(3)]"))
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    assert "lh.query_blocks" not in vectorized
    check(vectorized, """
        CHECK: arith.constant dense<-0.693147182>
        CHECK: scf.forall
        CHECK:   scf.for {{.*}} -> (tensor<{{.*}}>, tensor<{{.*}}>, vector<{{.*}}>)
        CHECK-NOT: math.exp
        CHECK:     arith.shli
        CHECK-NOT: math.exp
        CHECK:     scf.yield %{{.*}}, %{{.*}}, %{{.*}} : tensor<
        CHECK:   math.exp %{{.*}} : vector<
        CHECK: scf.forall.in_parallel
    """)
    _check(compile_kernel(path))


def test_key_tiles_read_packed_and_register_tiles_start_in_registers(kernel_file):
    from tests.transform_ext.helpers import check

    # queries-major scores (the layout when key_major=False): 100 keys in tiles of 32: three packed tiles and a peeled remainder of 4; causal, so
    # both the mask-free loop (from 0) and the masked loop (from a tile boundary) read them
    path = _kernel(kernel_file, "q, k, v, is_causal=True", "[torch.randn(1, 2, 100, 16) for _ in range(3)]",
                   config="query_tile=32, key_tile=32, key_major=False")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    check(vectorized, """
        CHECK: %[[P:.*]] = scf.for {{.*}} -> (tensor<2x3x16x32xf32>)
        CHECK: scf.forall
        CHECK:   scf.for %[[J:.*]] = %c0 to %{{.*}} step %c32
        CHECK:     %[[T:.*]] = arith.divui %[[J]], %c32
        CHECK:     scf.for {{.*}} iter_args(%{{.*}} = %cst{{.*}}) -> (vector<1x{{[0-9]+}}x32xf32>)
        CHECK:       vector.transfer_read %[[P]][%{{.*}}, %[[T]], %{{.*}}, %c0]
        CHECK:   scf.for %[[J2:.*]] = %{{.*}} to %{{.*}} step %c32
        CHECK:     %[[T2:.*]] = arith.divui %[[J2]], %c32
        CHECK:       vector.transfer_read %[[P]][%{{.*}}, %[[T2]], %{{.*}}, %c0]
    """)
    # the acc rescale exp(m_old - m_new) is applied to each P V register tile as it is loaded
    assert re.search(r"(%\w+) = arith\.mulf %\w+, %\w+ : vector<1x\d+x16xf32>\s*"
                     r"(%\w+ = arith.constant 4 : index\s*)?%\w+ = scf\.for .* iter_args\(%\w+ = \1\)",
                     vectorized)
    _check(compile_kernel(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optional_log_sum_exp_output(kernel_file, dtype):
    path = _kernel(kernel_file, "q, k, v, attn_mask=m",
                   f"[torch.randn(2, 3, 40, 16).to(torch.{dtype}), torch.randn(2, 3, 50, 16).to(torch.{dtype}), "
                   f"torch.randn(2, 3, 50, 16).to(torch.{dtype}), "
                   "(torch.arange(40)[:, None] < 35) & (torch.rand(40, 50) > 0.3)]",
                   args="q, k, v, m", config="return_lse=True, query_tile=16, key_tile=16")
    compiled = _check(compile_kernel(path))
    assert compiled.result_names == ["out0", "lse"]
    q, k, v, m = compiled.imported.args
    out, lse = compiled.run()
    scores = (q.float() @ k.float().transpose(-1, -2)) / 4.0
    ref = torch.logsumexp(scores.masked_fill(~m, float("-inf")), -1)
    assert lse.shape == (2, 3, 40) and lse.dtype == q.dtype
    assert torch.equal(torch.isinf(lse), torch.isinf(ref))        # fully masked rows: -inf
    finite = torch.isfinite(ref)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(lse[finite].float(), ref[finite], rtol=tol, atol=tol)
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert fused.split("scf.forall", 1)[1].count("scf.for ") == 1


@pytest.mark.parametrize("shape", [(1, 2, 24, 8), (2, 1, 24, 8), (1, 1, 24, 8)])
def test_log_sum_exp_with_unit_batch_or_heads(kernel_file, shape):
    path = _kernel(kernel_file, "q, k, v", f"[torch.randn{shape} for _ in range(3)]",
                   config="return_lse=True, query_tile=8, key_tile=8")
    compiled = _check(compile_kernel(path))
    q, k, _ = compiled.imported.args
    _, lse = compiled.run()
    ref = torch.logsumexp((q @ k.transpose(-1, -2)) / 8 ** 0.5, -1)
    torch.testing.assert_close(lse, ref, rtol=1e-5, atol=1e-5)


def test_a_single_query_block_still_gets_a_key_loop(kernel_file):
    # B = H = 1 and all 64 query rows fit one block: the block is split so the forall (and the
    # key loop inside it) survives canonicalization; no 64 x 256 scores buffer
    path = _kernel(kernel_file, "q, k, v", "[torch.randn(1, 1, 64, 16), torch.randn(1, 1, 256, 16), "
                   "torch.randn(1, 1, 256, 16)]", config="query_tile=64, key_tile=32")
    compiled = _check(compile_kernel(path))
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert fused.split("scf.forall", 1)[1].count("scf.for ") == 1
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert "64x256" not in bufferized
    del compiled


HAND = """
import math
import torch
LIGHTHOUSE = dict({config})
class Model(torch.nn.Module):
    def forward(self, {args}):
        s = {scores}
        {mask}
        return torch.softmax(s, dim=-1) @ v
def get_inputs():
    torch.manual_seed(0)
    return {inputs}
def get_init_inputs():
    return []
"""

HAND_SCORES = {
    "scores_div": "q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])",
    "scores_mul": "(q @ k.transpose(-1, -2)) * 0.125",
    "q_mul": "(q * 0.3) @ k.transpose(-1, -2)",
    "q_div": "(q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)",
    "k_mul": "q @ (k.transpose(-1, -2) * 0.25)",
    "unscaled": "q @ k.transpose(-1, -2)",
    "tensor_scale": "(q @ k.transpose(-1, -2)) / torch.tensor(3.0)",
}


def _hand(kernel_file, scores, mask="", inputs="[torch.randn(1, 2, 40, 16), torch.randn(1, 2, 50, 16), "
          "torch.randn(1, 2, 50, 24)]", args="q, k, v", config="query_tile=16, key_tile=16"):
    return kernel_file(HAND.format(scores=scores, mask=mask, inputs=inputs, args=args, config=config))


@pytest.mark.parametrize("scale", ["one", "half"])
def test_sdpa_with_an_explicit_scale_of_one(kernel_file, scale):
    # scale=1.0 imports with no scale op at all: Q^T is then made by a linalg.transpose (the
    # key-major relayout used to hand the op, not its result, to the scores' operand list)
    value = {"one": "1.0", "half": "0.5"}[scale]
    path = _kernel(kernel_file, f"q, k, v, scale={value}", "[torch.randn(1, 2, 64, 32) for _ in range(3)]")
    _check(compile_kernel(path))


@pytest.mark.parametrize("form", sorted(HAND_SCORES))
def test_hand_written_attention_runs_the_fused_schedule(kernel_file, form):
    path = _hand(kernel_file, HAND_SCORES[form])
    _check(compile_kernel(path))
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert fused.split("scf.forall", 1)[1].count("scf.for ") == 1, "one key loop per query block"
    if form != "tensor_scale":
        # K read in place and every constant scale moved to Q^T: no K^T, no scale per score
        assert "tensor<1x2x16x50xf32>" not in fused and "tensor<2x16x50xf32>" not in fused
        loop = fused.split("scf.for ", 1)[1].split("scf.yield", 1)[0]
        assert "arith.divf" not in loop


def test_hand_written_attention_with_a_remainder_key_tile(kernel_file):
    # no fully-masked-row guard (torch.softmax has none): the running max's update, which
    # reads its init, is fused into its single reader in the peeled last key tile
    path = _hand(kernel_file, HAND_SCORES["scores_div"],
                 inputs="[torch.randn(1, 2, 2, 128), torch.randn(1, 2, 100, 128), torch.randn(1, 2, 100, 24)]",
                 config="")
    _check(compile_kernel(path))


def test_hand_written_causal_mask_skips_key_tiles(kernel_file):
    from tests.transform_ext.helpers import check

    path = _hand(kernel_file, HAND_SCORES["scores_div"],
                 mask="s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float('-inf'))",
                 inputs="[torch.randn(1, 2, 64, 16) for _ in range(3)]")
    _check(compile_kernel(path))
    fused = str(compile_kernel(path, stop_after="fuse").module)
    # the bound of the key loop follows the diagonal, and the tiles below it run unmasked
    check(fused, """
        CHECK: scf.forall (%{{.*}}, %[[QB:.*]]) in
        CHECK:   %[[I0:.*]] = arith.muli %[[QB]], %c16 : index
        CHECK:   %[[UB:.*]] = arith.minsi %{{.*}}, %c64 : index
        CHECK:   %[[SPLIT:.*]] = arith.minsi %{{.*}}, %[[UB]] : index
        CHECK:   scf.for %{{.*}} = %c0 to %[[SPLIT]] step %c16
        CHECK-NOT: arith.cmpi
        CHECK:   scf.yield
        CHECK:   scf.for %{{.*}} = %[[SPLIT]] to %[[UB]] step %c16
        CHECK:     arith.cmpi sge
    """)


@pytest.mark.parametrize("mask", ["bool", "bool_fully_masked_rows", "float", "float_broadcast"])
def test_hand_written_masks(kernel_file, mask):
    fill = {"bool": "s = s.masked_fill(~m, float('-inf'))",
            "bool_fully_masked_rows": "s = s.masked_fill(~m, float('-inf'))",
            "float": "s = s + m", "float_broadcast": "s = s + m"}[mask]
    m = {"bool": "torch.rand(1, 2, 40, 50) > 0.3",
         # rows 5, 12, ...: all masked (torch: NaN), rows 3, 10, ...: the first key tile masked
         "bool_fully_masked_rows": "(torch.arange(40)[:, None] % 7 != 5) & ((torch.arange(40)[:, None] "
                                   "% 7 != 3) | (torch.arange(50) >= 16)) & (torch.rand(40, 50) > 0.2)",
         "float": "torch.randn(1, 2, 40, 50) * 3",
         "float_broadcast": "torch.randn(1, 1, 1, 50) * 3"}[mask]
    path = _hand(kernel_file, HAND_SCORES["scores_div"], mask=fill, args="q, k, v, m",
                 inputs=f"[torch.randn(1, 2, 40, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 24), {m}]")
    compiled = _check(compile_kernel(path))
    if mask == "bool_fully_masked_rows":
        out = compiled.run()[0]
        assert torch.isnan(out[:, :, 5::7]).all() and not torch.isnan(out[:, :, 3::7]).any()


@pytest.mark.parametrize("mask", ["none", "float", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hand_written_low_precision_softmax_is_computed_in_f32(kernel_file, dtype, mask):
    """torch rounds each op of a hand-written bf16 softmax to bf16 (S, S / sqrt(d), S + M,
    P). The key loop computes the scores' roundings per tile, as torch, and keeps the
    probabilities in f32 (torch rounds P, which the online softmax never forms): nothing is
    rounded after the exp; the result within the dtype's tolerance of torch's; a causal mask
    still bounds the key loop."""
    fill = {"none": "", "float": "s = s + m",
            "causal": "s = s.masked_fill(torch.ones(40, 64, dtype=torch.bool).triu(1), float('-inf'))"}[mask]
    args = "q, k, v, m" if mask == "float" else "q, k, v"
    extra = f", (torch.randn(1, 2, 40, 64) * 2).to(torch.{dtype})" if mask == "float" else ""
    path = _hand(kernel_file, HAND_SCORES["scores_div"], mask=fill, args=args,
                 inputs=f"[torch.randn(1, 2, 40, 16).to(torch.{dtype}), torch.randn(1, 2, 64, 16).to(torch.{dtype}), "
                        f"torch.randn(1, 2, 64, 24).to(torch.{dtype}){extra}]")
    _check(compile_kernel(path))
    fused = str(compile_kernel(path, stop_after="fuse").module)
    loops = [loop.split("scf.yield", 1)[0] for loop in fused.split("scf.for ")[1:]]
    assert loops and all("arith.truncf" not in loop.split("math.exp", 1)[-1] for loop in loops)
    if mask == "causal":
        assert fused.count("arith.minsi") >= 2  # the key loop's bound and the unmasked split


def test_a_softmax_over_one_key_falls_back_with_the_reason(kernel_file):
    path = _kernel(kernel_file, "q, k, v", "[torch.randn(1, 2, 8, 16), torch.randn(1, 2, 1, 16), "
                   "torch.randn(1, 2, 1, 16)]")
    compiled = compile_kernel(path)
    assert compiled.family.name == "generic"
    assert "one key" in compiled.notes[0]
    assert all(r.ok for r in compiled.check())


def test_hand_written_bf16_scores_keep_torchs_rounding(kernel_file):
    """Unscaled bf16 scores of D = 64 reach |S| ~ 30, where torch's rounding of S to bf16
    moves the exponents by up to 0.06: computing S in f32 instead (more accurate) lands
    0.09 away from torch's result, past the bf16 tolerance. The key loop rounds S as torch
    does (found by the local fuzzer)."""
    path = _hand(kernel_file, HAND_SCORES["unscaled"], mask="s = s.masked_fill(~m, float('-inf'))",
                 args="q, k, v, m", config="",
                 inputs="[torch.randn(2, 3, 2, 64).to(torch.bfloat16), torch.randn(2, 3, 64, 64).to(torch.bfloat16), "
                        "torch.randn(2, 3, 64, 16).to(torch.bfloat16), torch.rand(2, 3, 2, 64) > 0.3]")
    _check(compile_kernel(path))


@pytest.mark.parametrize("order", ["window_then_causal", "causal_then_window"])
def test_causal_mask_with_a_sliding_window(kernel_file, order):
    """Two masks computed from indices: the causal one bounds the key loop, but the tiles
    below the diagonal must keep the window mask (only a lone causal mask is dropped there)."""
    causal = "s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float('-inf'))"
    window = "s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool).tril(-20), float('-inf'))"
    masks = [window, causal] if order == "window_then_causal" else [causal, window]
    path = _hand(kernel_file, HAND_SCORES["scores_div"], mask="\n        ".join(masks),
                 inputs="[torch.randn(1, 2, 64, 16) for _ in range(3)]")
    _check(compile_kernel(path))


HEAD_MERGE = """
import torch
import torch.nn.functional as F
B, H, S, D = {B}, {H}, {S}, 16
class Model(torch.nn.Module):
    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal={causal})
        return {result}
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(B, H, S, D, dtype=torch.{dtype}) for _ in range(3)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("shape,causal,dtype,result", [
    ((1, 1, 2), False, "float32", "o.transpose(1, 2).reshape(B, S, H * D)"),
    ((2, 1, 17), True, "float32", "o.transpose(1, 2).reshape(B, S, H * D)"),
    ((2, 4, 37), False, "bfloat16", "o.transpose(1, 2).reshape(B, S, H * D)"),
    ((2, 4, 37), True, "float32", "(o.transpose(1, 2).reshape(B, S, H * D), o)"),
    ((1, 3, 70), False, "float32", "o.permute(2, 0, 1, 3).reshape(S, B * H * D).relu()"),
])
def test_the_head_merge_after_attention_keeps_the_fused_schedule(kernel_file, shape, causal,
                                                                  dtype, result):
    """o.transpose(1, 2).reshape(B, S, H * D) permutes the output's dims: the query blocks
    follow P V's rows, not the result's second-to-last dim (the fuse stage failed, 'the
    query block does not hold exactly one row max'); with H = 1 the merge is a reshape."""
    b, h, s = shape
    path = kernel_file(HEAD_MERGE.format(B=b, H=h, S=s, causal=causal, dtype=dtype,
                                         result=result))
    _check(compile_kernel(path))
