"""read_checks_on_host: a target check placed after a kernel moves before it and reads a host
copy of y, freed before the return (FileCheck); the result handle holds the check (it is
converted to loops); a check on tensors (not bufferized) is refused."""

from schedules.common import match
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

from transform_ext.read_checks_on_host import read_checks_on_host
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

BUFFERS = """
#r = affine_map<(d0) -> (d0)>
func.func @main(%y: memref<4xi64>, %out: memref<f32>) {
  %c16 = arith.constant 16 : index
  scf.forall (%i) in (1) {
  }
  linalg.generic {indexing_maps = [#r], iterator_types = ["parallel"]} ins(%y : memref<4xi64>) {
  ^bb0(%a: i64):
    %i = arith.index_cast %a : i64 to index
    %lt = arith.cmpi slt, %i, %c16 : index
    cf.assert %lt, "out of range"
    linalg.yield
  }
  return
}
"""


def test_the_check_reads_a_host_copy_before_the_kernel():
    payload = parse(BUFFERS)

    def body(root):
        checks = read_checks_on_host(match(root, "func.func"))
        structured.ConvertToLoopsOp(transform.AnyOpType.get(), checks)

    apply(payload, body)
    check(str(payload), """
        CHECK: func.func @main(%[[Y:.*]]: memref<4xi64>, %{{.*}}: memref<f32>)
        CHECK: %[[HOST:.*]] = memref.alloc() : memref<4xi64>
        CHECK-NEXT: gpu.memcpy  %[[HOST]], %[[Y]] : memref<4xi64>, memref<4xi64>
        CHECK: scf.for
        CHECK: memref.load %[[HOST]]
        CHECK: cf.assert
        CHECK: scf.forall
        CHECK: memref.dealloc %[[HOST]] : memref<4xi64>
        CHECK-NEXT: return
    """)
    assert "linalg.generic" not in str(payload)


def test_rejects_a_check_on_tensors():
    payload = parse(BUFFERS.replace("memref<4xi64>", "tensor<4xi64>"))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: read_checks_on_host(match(root, "func.func")))
    assert "transform_ext.read_checks_on_host: linalg.generic" in message
    assert "reads a tensor<4xi64>, not a buffer" in message
    assert str(payload) == before
