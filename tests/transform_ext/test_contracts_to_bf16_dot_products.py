"""contracts_to_bf16_dot_products: the IR (FileCheck) of the contractions it lowers (B stored
pair-innermost or row by row, A either way) and of those it leaves (masked, k = 1, f32, lanes
that are no multiple of 16); the LLVM IR holds vdpbf16ps; and the numerics of the lowered
tile against torch on a host with avx512_bf16."""

import ctypes

import numpy as np
import pytest
import torch
from torch_mlir import ir
from torch_mlir.runtime import get_ranked_memref_descriptor

from lighthouse.targets.cpu import lower_to_llvm
from lighthouse.targets.description import host_cpu_flags
from schedules.common import match
from transform_ext.contracts_to_bf16_dot_products import contracts_to_bf16_dot_products
from tests.transform_ext.helpers import apply, check, parse

# C[m, n] += sum_k A[m, k] B[k, n] over k = 2; A stored {a_layout}, B stored {b_layout}.
TILE = """
#a = affine_map<(m, n, k) -> ({a_dims})>
#b = affine_map<(m, n, k) -> ({b_dims})>
#c = affine_map<(m, n, k) -> (m, n)>
func.func @tile(%A: memref<{a_shape}xbf16>, %B: memref<{b_shape}xbf16>, %C: memref<{m}x{n}xf32>)
    attributes {{llvm.emit_c_interface}} {{
  %c0 = arith.constant 0 : index
  %pb = arith.constant 0.0 : bf16
  %pf = arith.constant 0.0 : f32
  %a = vector.transfer_read %A[%c0, %c0], %pb {{in_bounds = [true, true]}} : memref<{a_shape}xbf16>, vector<{a_shape}xbf16>
  %b = vector.transfer_read %B[%c0, %c0], %pb {{in_bounds = [true, true]}} : memref<{b_shape}xbf16>, vector<{b_shape}xbf16>
  %c = vector.transfer_read %C[%c0, %c0], %pf {{in_bounds = [true, true]}} : memref<{m}x{n}xf32>, vector<{m}x{n}xf32>
  %r = vector.contract {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"], kind = #vector.kind<add>}} %a, %b, %c : vector<{a_shape}xbf16>, vector<{b_shape}xbf16> into vector<{m}x{n}xf32>
  vector.transfer_write %r, %C[%c0, %c0] {{in_bounds = [true, true]}} : vector<{m}x{n}xf32>, memref<{m}x{n}xf32>
  return
}}
"""


def tile(m=4, n=32, *, a_pairs_inner=True, b_pairs_inner=True):
    return TILE.format(m=m, n=n,
                       a_dims="m, k" if a_pairs_inner else "k, m",
                       a_shape=f"{m}x2" if a_pairs_inner else f"2x{m}",
                       b_dims="n, k" if b_pairs_inner else "k, n",
                       b_shape=f"{n}x2" if b_pairs_inner else f"2x{n}")


def lowered(text: str) -> ir.Module:
    payload = parse(text)
    apply(payload, lambda root: contracts_to_bf16_dot_products(match(root, "func.func")))
    return payload


def test_pairs_inner_operands_become_a_broadcast_pair_and_slices_of_b():
    payload = lowered(tile(m=2, n=32))
    check(payload, """
        CHECK-NOT: vector.contract
        CHECK: vector.extract {{.*}}[0] : vector<2xbf16> from vector<2x2xbf16>
        CHECK: vector.bitcast {{.*}} : vector<2xbf16> to vector<1xi32>
        CHECK: vector.broadcast {{.*}} : i32 to vector<16xi32>
        CHECK: vector.shape_cast {{.*}} : vector<32x2xbf16> to vector<64xbf16>
        CHECK: vector.extract_strided_slice {{.*}} {offsets = [0], sizes = [32], strides = [1]}
        CHECK: vector.extract_strided_slice {{.*}} {offsets = [32], sizes = [32], strides = [1]}
        CHECK-COUNT-4: x86.avx512.dot {{.*}} : vector<32xbf16> -> vector<16xf32>
        CHECK-NOT: x86.avx512.dot
    """)


def test_rows_of_b_are_interleaved_by_a_shuffle():
    payload = lowered(tile(m=2, n=16, a_pairs_inner=False, b_pairs_inner=False))
    check(payload, """
        CHECK: vector.shuffle {{.*}} [0, 2, 1, 3] : vector<2xbf16>, vector<2xbf16>
        CHECK: vector.shuffle {{.*}} [0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31] : vector<16xbf16>, vector<16xbf16>
        CHECK: x86.avx512.dot
    """)


UNIT_DIMS = """
#a = affine_map<(m, p, n, k) -> (m, k)>
#b = affine_map<(m, p, n, k) -> (p, k, n)>
#c = affine_map<(m, p, n, k) -> (m, p, n)>
func.func @tile(%a: vector<8x2xbf16>, %b: vector<1x2x32xbf16>, %c: vector<8x1x32xf32>) -> vector<8x1x32xf32> {
  %r = vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "parallel", "reduction"], kind = #vector.kind<add>} %a, %b, %c : vector<8x2xbf16>, vector<1x2x32xbf16> into vector<8x1x32xf32>
  return %r : vector<8x1x32xf32>
}
"""


def test_unit_dims_are_cast_away_around_the_dot_products():
    """A register tile over column panels (the linear cross-entropy backward's products):
    the panel dim of extent 1 sits between the rows and the lanes."""
    payload = lowered(UNIT_DIMS)
    check(payload, """
        CHECK: vector.shape_cast %arg1 : vector<1x2x32xbf16> to vector<2x32xbf16>
        CHECK: vector.shape_cast %arg2 : vector<8x1x32xf32> to vector<8x32xf32>
        CHECK-COUNT-16: x86.avx512.dot
        CHECK: vector.shape_cast {{.*}} : vector<8x32xf32> to vector<8x1x32xf32>
    """)


@pytest.mark.parametrize("text", [
    tile(n=24),                                                      # lanes not a multiple of 16
    tile().replace("2xbf16", "2xf32").replace(", %pb {", ", %pf {")  # f32 operands
          .replace("memref<4x2xbf16>", "memref<4x2xf32>").replace("memref<32x2xbf16>", "memref<32x2xf32>"),
    tile().replace("<4x2xbf16>", "<4x1xbf16>").replace("<32x2xbf16>", "<32x1xbf16>"),  # k = 1
], ids=["lanes24", "f32", "k1"])
def test_other_contractions_are_left_alone(text):
    payload = parse(text)
    before = str(payload)
    apply(payload, lambda root: contracts_to_bf16_dot_products(match(root, "func.func")))
    assert str(payload) == before


def test_masked_contraction_is_left_alone():
    text = tile().replace(
        "%r = vector.contract", "%mask = vector.constant_mask [4, 32, 1] : vector<4x32x2xi1>\n"
        "  %r = vector.mask %mask { vector.contract").replace(
        "into vector<4x32xf32>\n", "into vector<4x32xf32> } : vector<4x32x2xi1> -> vector<4x32xf32>\n")
    payload = parse(text)
    before = str(payload)
    apply(payload, lambda root: contracts_to_bf16_dot_products(match(root, "func.func")))
    assert str(payload) == before


def test_a_target_that_is_not_a_function_fails():
    from tests.transform_ext.helpers import apply_expect_failure

    payload = parse(tile())
    message = apply_expect_failure(payload, lambda root: contracts_to_bf16_dot_products(
        match(root, "vector.contract")))
    assert "not a func.func" in message


def test_llvm_ir_calls_the_bf16_dot_intrinsic():
    payload = lowered(tile())
    lower_to_llvm(payload, threads=1)
    check(payload, """
        CHECK-COUNT-8: llvm.call_intrinsic "llvm.x86.avx512bf16.dpbf16ps.512"
        CHECK-NOT: llvm.x86.avx512bf16.dpbf16ps.512
    """)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.skipif("avx512_bf16" not in host_cpu_flags(),
                    reason="vdpbf16ps needs a host with avx512_bf16")
@pytest.mark.parametrize("a_inner,b_inner", [(True, True), (False, False), (True, False)])
def test_lowered_tile_matches_torch(a_inner, b_inner):
    from torch_mlir.execution_engine import ExecutionEngine

    m, n = 3, 48
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, 2, generator=g).bfloat16()
    b = torch.randn(2, n, generator=g).bfloat16()
    c = torch.randn(m, n, generator=g)
    want = c + a.float() @ b.float()
    payload = lowered(tile(m=m, n=n, a_pairs_inner=a_inner, b_pairs_inner=b_inner))
    with payload.context, ir.Location.unknown():
        lower_to_llvm(payload, threads=1)
    engine = ExecutionEngine(payload, opt_level=2)
    args = [a if a_inner else a.t(), b.t() if b_inner else b, c]
    arrays = [_bits(x) for x in args]
    engine.invoke("tile", *[ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(x)))
                            for x in arrays])
    got = torch.from_numpy(arrays[2])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
