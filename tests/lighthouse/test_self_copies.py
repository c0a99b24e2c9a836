"""drop_self_copies: a bufferized copy of a region onto itself (a transfer_read of
subview(B, o) written back into B at o) is erased (FileCheck); copies to another place, with
a write between, or whose vector is read again stay; the linear cross-entropy backward, whose
dW class tile was such a copy, and the attention backward still match torch."""

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.targets.self_copies import drop_self_copies
from tests.transform_ext.helpers import check as filecheck
from tests.transform_ext.helpers import rewritten

COPY = """
func.func @tile(%b: memref<256x64xf32>, %c: index, %x: vector<16xf32>) -> vector<8x64xf32> {
  %c0 = arith.constant 0 : index
  %pad = arith.constant 0.0 : f32
  %view = memref.subview %b[%c, 0] [8, 64] [1, 1] : memref<256x64xf32> to memref<8x64xf32, strided<[64, 1], offset: ?>>
  %v = vector.transfer_read %view[%c0, %c0], %pad {in_bounds = [true, true]} : memref<8x64xf32, strided<[64, 1], offset: ?>>, vector<8x64xf32>
  BETWEEN
  vector.transfer_write %v, %b[WHERE, %c0] {in_bounds = [true, true]} : vector<8x64xf32>, memref<256x64xf32>
  return RESULT : vector<8x64xf32>
}
"""


def _copy(between="", where="%c", result="%r"):
    source = COPY.replace("BETWEEN", between).replace("WHERE", where)
    if result == "%r":
        source = source.replace("RESULT", "%r").replace(
            "  return", "  %r = arith.constant dense<1.0> : vector<8x64xf32>\n  return")
    return source.replace("RESULT", result)


def test_a_copy_onto_itself_is_erased():
    dropped, text = rewritten(_copy(), drop_self_copies)
    assert dropped == 1
    filecheck(text, """
        CHECK-LABEL: func.func @tile
        CHECK-NOT: vector.transfer_read
        CHECK-NOT: vector.transfer_write
        CHECK: return
    """)


@pytest.mark.parametrize("between, where, result", [
    ("", "%c0", "%r"),   # written elsewhere: a real copy
    ("vector.transfer_write %x, %b[%c0, %c0] {in_bounds = [true]} : vector<16xf32>, memref<256x64xf32>",
     "%c", "%r"),        # a write between the read and the write
    ("", "%c", "%v"),    # the vector has another reader
    ("%m = vector.constant_mask [4, 64] : vector<8x64xi1>", "%c", "%r"),  # masked below
], ids=["another_place", "a_write_between", "read_again", "masked"])
def test_other_copies_stay(between, where, result):
    source = _copy(between, where, result)
    if "constant_mask" in between:  # the write of the read's vector under a mask
        source = source.replace("vector.transfer_write %v, %b[%c, %c0] {",
                                "vector.transfer_write %v, %b[%c, %c0], %m {")
    dropped, text = rewritten(source, drop_self_copies)
    assert dropped == 0
    filecheck(text, """
        CHECK: vector.transfer_read %{{.*}}[%{{.*}}, %{{.*}}]
        CHECK: vector.transfer_write
    """)


@pytest.mark.parametrize("path, overrides", [
    ("linear_cross_entropy.py", dict(N=96, D=64, V=200)),
    ("attention.py", dict(B=1, H=2, S=96, D=32)),
])
def test_backwards_with_self_copies_match_torch(path, overrides, monkeypatch):
    """The kernels that held such copies: some are dropped, and the results (compiled with
    run-time bounds checks) match torch."""
    import lighthouse.targets.cpu as cpu
    from tests.conftest import EXAMPLES

    dropped = []
    monkeypatch.setattr(cpu, "drop_self_copies",
                        lambda payload: dropped.append(drop_self_copies(payload)) or dropped[-1])
    c = compile_kernel(EXAMPLES / path, overrides=overrides, backward=True, runtime_checks=True)
    assert sum(dropped) > 0
    for report in c.check():
        assert report.ok, str(report)
