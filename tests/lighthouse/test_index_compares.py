"""narrow_iota_compares: a compare of a broadcast scalar with broadcast(j) + c on index or
i64 lanes as one on i32 lanes (FileCheck), the cases it leaves alone, its exactness on
differences that do not fit in 32 bits (run), and one-hot gradients against torch."""

import pytest
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.targets.index_compares import narrow_iota_compares
from tests.transform_ext.helpers import check as filecheck
from tests.transform_ext.helpers import parse, rewritten

ONE_HOT = """
func.func @mask(%y: index, %j: index) -> vector<1x16xi1> {
  %iota = arith.constant dense<[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]> : vector<16xindex>
  %t = vector.broadcast %y : index to vector<1x16xindex>
  %b = vector.broadcast %j : index to vector<16xindex>
  %c = arith.addi %b, %iota : vector<16xindex>
  %s = vector.shape_cast %c : vector<16xindex> to vector<1x16xindex>
  %m = arith.cmpi PRED, %t, %s : vector<1x16xindex>
  return %m : vector<1x16xi1>
}
"""


@pytest.mark.parametrize("predicate, merge", [("ne", "arith.ori"), ("eq", "arith.andi")])
def test_a_one_hot_compare_runs_on_32_bit_lanes(predicate, merge):
    """y == j + c as trunc32(y - j) == c32, on 16 i32 lanes, and-ed with (ne: or-ed with the
    negation of) whether y - j fits in 32 bits."""
    served, text = rewritten(ONE_HOT.replace("PRED", predicate), narrow_iota_compares)
    assert served == 1
    filecheck(text, f"""
        CHECK: %[[D:.*]] = arith.subi %arg0, %arg1 : index
        CHECK: %[[D32:.*]] = arith.index_cast %[[D]] : index to i32
        CHECK: %[[BACK:.*]] = arith.index_cast %[[D32]] : i32 to index
        CHECK: %[[FITS:.*]] = arith.cmpi eq, %[[BACK]], %[[D]] : index
        CHECK: %[[C:.*]] = arith.constant dense<{{{{\\[\\[}}}}0, 1, 2, {{{{.*}}}}, 15]]> : vector<1x16xi32>
        CHECK: %[[T:.*]] = vector.broadcast %[[D32]] : i32 to vector<1x16xi32>
        CHECK: %[[L:.*]] = arith.cmpi {predicate}, %[[T]], %[[C]] : vector<1x16xi32>
        CHECK: {merge} %[[L]], %{{{{.*}}}} : vector<1x16xi1>
        CHECK-NOT: xindex>
    """)


def test_a_remainder_tiles_constant_lane_indices_run_on_32_bit_lanes():
    """The lane indices as a constant alone (j = 0): y itself is truncated and checked."""
    source = ONE_HOT.replace("%s = vector.shape_cast %c", "%s = vector.shape_cast %iota")
    served, text = rewritten(source.replace("PRED", "ne"), narrow_iota_compares)
    assert served == 1
    filecheck(text, """
        CHECK-NOT: arith.subi
        CHECK: %[[D32:.*]] = arith.index_cast %arg0 : index to i32
        CHECK: arith.cmpi ne, %{{.*}}, %{{.*}} : vector<1x16xi32>
    """)


@pytest.mark.parametrize("change, reason", [
    (("arith.cmpi PRED", "arith.cmpi slt"), "an ordering, not an equality"),
    (("dense<[0, 1, 2, 3,", "dense<[4294967296, 1, 2, 3,"), "a constant past 32 bits"),
    (("%t = vector.broadcast %y : index to vector<1x16xindex>",
      "%t = arith.constant dense<3> : vector<1x16xindex>"), "no broadcast scalar"),
    (("%c = arith.addi %b, %iota", "%c = arith.muli %b, %iota"), "not a shifted constant"),
])
def test_other_compares_are_left_alone(change, reason):
    served, text = rewritten(ONE_HOT.replace(*change).replace("PRED", "ne"), narrow_iota_compares)
    assert served == 0, reason
    assert "xi32>" not in text, reason


LOWERED = """
func.func @f(%Y: memref<2xi64>, %O: memref<16xi8>) attributes {llvm.emit_c_interface} {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %iota = arith.constant dense<[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]> : vector<16xi64>
  %y = memref.load %Y[%c0] : memref<2xi64>
  %j = memref.load %Y[%c1] : memref<2xi64>
  %t = vector.broadcast %y : i64 to vector<16xi64>
  %b = vector.broadcast %j : i64 to vector<16xi64>
  %c = arith.addi %b, %iota : vector<16xi64>
  %m = arith.cmpi PRED, %t, %c : vector<16xi64>
  %w = arith.extui %m : vector<16xi1> to vector<16xi8>
  vector.store %w, %O[%c0] : memref<16xi8>, vector<16xi8>
  return
}
"""


@pytest.mark.parametrize("predicate", ["eq", "ne"])
def test_differences_past_32_bits_stay_exact(predicate):
    """Lowered by the CPU target (which narrows the compare) and run: y - j of 2^32 + 3
    truncates to 3, a lane of the constant, and the fit test keeps that lane's answer; so
    for -1, 2^31 + 2 and 2^31 - 1, and differences that do match (3, 15)."""
    import ctypes

    import numpy as np
    from torch_mlir.execution_engine import ExecutionEngine
    from torch_mlir.runtime import get_ranked_memref_descriptor

    from lighthouse.targets.cpu import lower_to_llvm

    payload = parse(LOWERED.replace("PRED", predicate))
    with payload.context, ir.Location.unknown():
        lower_to_llvm(payload, threads=1)
    assert "vector<16xi64>" not in str(payload)
    engine = ExecutionEngine(payload, opt_level=2)
    for y, j in ((2**32 + 3, 0), (5, 6), (2**31 + 2, 0), (2**31 - 1, 0), (7, 4), (2**40, 2**40 - 15),
                 (-100, 96)):
        ys = np.array([y, j], dtype=np.int64)
        out = np.zeros(16, np.int8)
        args = [ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(a))) for a in (ys, out)]
        engine.invoke("f", *args)
        want = [int((y == j + c) == (predicate == "eq")) for c in range(16)]
        assert out.tolist() == want, (y, j)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_hot_gradients_match_torch(monkeypatch, dtype):
    """The cross-entropy backward's one-hot, in its tiles of 64 classes and its remainder
    tile of 8 (C = 200), compares 32-bit lanes (targets at a tile's first and last lane,
    an ignored row) and matches torch."""
    from lighthouse.targets import cpu
    from tests.conftest import EXAMPLES

    served = []
    monkeypatch.setattr(cpu, "narrow_iota_compares",
                        lambda payload: served.append(narrow_iota_compares(payload)))
    compiled = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 9, "C": 200,
                                                                        "DTYPE": dtype},
                              backward=True, threads=2)
    assert served and served[0] >= 2
    for r in compiled.check():
        assert r.ok, str(r)
