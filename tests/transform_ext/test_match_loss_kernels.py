"""match_loss_kernels: the ops of a small loss by kernel (FileCheck on the annotated
payload): the check on the host, the count and its shared fill before the row kernel (the
gradient reads the count), the loss sum and the mean after it; a target that is not a
function is refused."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_loss_kernels import match_loss_kernels
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.loss_payloads import LOSS


def test_the_ops_of_each_kernel():
    payload = parse(LOSS)

    def body(root):
        kernels = match_loss_kernels(match(root, "func.func"))
        for name in ("host", "before", "rows", "after", "row_sums"):
            transform.AnnotateOp(getattr(kernels, name), name)

    apply(payload, body)
    check(str(payload), """
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<4xi8>) attrs =  {rows}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<4xi64>) attrs =  {rows}
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<4xi64>) attrs =  {host}
        CHECK: cf.assert
        CHECK: linalg.fill {rows}
        CHECK: arith.maximumf
        CHECK: linalg.fill {rows}
        CHECK: math.exp
        CHECK: tensor.extract
        CHECK: math.log
        CHECK: linalg.fill {before} {{.*}} -> tensor<f32>
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<f32>) attrs =  {before, row_sums}
        CHECK: arith.uitofp
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<f32>) attrs =  {after, row_sums}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<f32>) attrs =  {after}
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<4x16xf32>) attrs =  {rows}
    """)


def test_a_fill_read_by_one_kernel_belongs_to_it():
    """Once the shared zero has a copy per kernel, each copy goes with its readers."""
    from transform_ext.split_shared_fills import split_shared_fills

    payload = parse(LOSS)

    def body(root):
        func = match(root, "func.func")
        split_shared_fills(func)
        kernels = match_loss_kernels(func)
        transform.AnnotateOp(kernels.before, "before")
        transform.AnnotateOp(kernels.after, "after")

    apply(payload, body)
    check(str(payload), """
        CHECK: %[[BEFORE:.*]] = linalg.fill {before} {{.*}} -> tensor<f32>
        CHECK-NEXT: %[[AFTER:.*]] = linalg.fill {after} {{.*}} -> tensor<f32>
        CHECK: outs(%[[BEFORE]] : tensor<f32>) attrs =  {before}
        CHECK: outs(%[[AFTER]] : tensor<f32>) attrs =  {after}
    """)


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(LOSS)
    message = apply_expect_failure(
        payload, lambda root: match_loss_kernels(match(root, "linalg.fill")))
    assert "transform_ext.match_loss_kernels: linalg.fill" in message
    assert "not a func.func" in message
