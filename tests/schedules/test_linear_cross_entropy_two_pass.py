"""The linear cross-entropy's GPU form with its backward in two passes
(transform_ext.fuse_linear_cross_entropy_backward_two_pass: dh per block of 64 rows over
class tiles of 32, dW and db per block of 64 classes over row tiles of 32), the family's
@fuse built with the XeGPU target's parameters and run on the CPU target against torch's
autograd: the numerics of the GPU's fused schedule, as the project checks every XeGPU
schedule (no Intel GPU here). bf16 and f16 h and W (the XeGPU target's types; f32 with
label smoothing, which the GPU form takes in f32 only), bias, class weights, mean and sum,
ignored targets, all rows ignored, logits in the hundreds, targets at the first and last
class."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch_mlir import ir

from lighthouse.compile import cleanup, compare, make_target
from lighthouse.families import family_params
from lighthouse.ingress import import_joint
from lighthouse.kernel import load_kernel
from lighthouse.pipeline import Pipeline
from lighthouse.targets.cpu import CpuTarget
from schedules.linear_cross_entropy import linear_cross_entropy_script, plan_linear_cross_entropy
from schedules.script import apply_stage
from tests.lighthouse.test_xegpu_linear_cross_entropy import _inputs, _write
from tests.transform_ext.helpers import check

# name: (dtype, N, D, V, bias, class weights, reduction, label smoothing)
CASES = {
    "bf16_mean": ("bfloat16", 128, 64, 256, False, False, "mean", 0.0),
    "f16_bias_weight_sum": ("float16", 128, 64, 256, True, True, "sum", 0.0),
    "bf16_bias_weight_mean": ("bfloat16", 192, 96, 320, True, True, "mean", 0.0),
    "f32_smoothing_mean": ("float32", 128, 32, 256, True, False, "mean", 0.1),
}


def gpu_form_joint(path: Path):
    """(the kernel, the joint graph after the family's @fuse in the XeGPU target's form)."""
    kernel = load_kernel(path, {})
    imported = import_joint(kernel.model, kernel.inputs)
    payload = imported.module
    with payload.context, ir.Location.unknown():
        cleanup(payload)
        params = family_params("linear_cross_entropy", make_target("xegpu")).schedule
        plan = plan_linear_cross_entropy(payload, params)
        apply_stage(payload, linear_cross_entropy_script(plan, None), "fuse")
    return kernel, imported


_COMPILED = {}


def _compiled(name, tmp_path_factory):
    if name not in _COMPILED:
        path = _write(tmp_path_factory.mktemp(name) / "head.py", *CASES[name])
        kernel, imported = gpu_form_joint(path)
        text = str(imported.module)
        cpu = CpuTarget(threads=2)
        with imported.module.context, ir.Location.unknown():
            Pipeline(cpu.stages()).run(imported.module)
        _COMPILED[name] = (kernel, text, cpu.jit(imported.module, imported.arg_specs,
                                                 imported.result_specs))
    return _COMPILED[name]


def _reference(kernel, args, weighted, reduction, smoothing):
    leaves = [a.detach().clone().requires_grad_() for a in args[:-1]]
    w = kernel.model.w if weighted else None
    loss = F.cross_entropy(F.linear(*leaves), args[-1], weight=w, reduction=reduction,
                           label_smoothing=smoothing)
    loss.backward()
    return [loss.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("kind", ["mixed", "all_ignored", "huge", "edge_targets"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradients_match_torch(tmp_path_factory, name, kind):
    dtype_name, n, d, v, bias, weighted, reduction, smoothing = CASES[name]
    kernel, _, run = _compiled(name, tmp_path_factory)
    args = _inputs(getattr(torch, dtype_name), n, d, v, bias, kind)
    got = run(*args)
    want = _reference(kernel, args, weighted, reduction, smoothing)
    assert len(got) == len(want) == 3 + bias
    for i, (g, w) in enumerate(zip(got, want)):
        report = compare(f"result {i}", g, w)
        assert report.ok, (kind, str(report))


def test_the_backward_is_two_passes_with_no_logits_buffer(tmp_path_factory):
    """After @fuse: the forward's row blocks, then dh per block of 64 rows (class loop in
    steps of 32: the logits tile [64, 32] and its gradient by products reading bf16 h and W
    as they are), then dW and db per block of 64 classes (row loop in steps of 32: the tile
    transposed [64, 32]); each gradient written in bf16 block by block (the cast fused into
    its pass); no tensor of N x V elements anywhere, no op left between the passes and the
    return."""
    _, text, _ = _compiled("bf16_bias_weight_mean", tmp_path_factory)
    check(text, """
        CHECK: scf.forall {{.*}} in (3)
        CHECK: } {lh.row_blocks}
        CHECK: scf.forall {{.*}} in (3) shared_outs({{.*}}) -> (tensor<192x96xbf16>)
        CHECK:   scf.for {{.*}} step %c32{{.*}} -> (tensor<64x96xf32>)
        CHECK:     linalg.generic {{.*}} ins({{.*}} : tensor<64x96xbf16>, tensor<32x96xbf16>) outs({{.*}} : tensor<64x32xf32>)
        CHECK:     math.exp
        CHECK:     linalg.generic {{.*}} ins({{.*}} : tensor<64x32xbf16>, tensor<32x96xbf16>) outs({{.*}} : tensor<64x96xf32>)
        CHECK: } {lh.linear_ce_backward_pass = 1 : i64}
        CHECK: scf.forall {{.*}} in (5) shared_outs({{.*}}) -> (tensor<320x96xbf16>, tensor<320xbf16>)
        CHECK:   scf.for {{.*}} step %c32{{.*}} -> (tensor<64x96xf32>, tensor<64xf32>)
        CHECK:     linalg.generic {{.*}} ins({{.*}} : tensor<64x96xbf16>, tensor<32x96xbf16>) outs({{.*}} : tensor<64x32xf32>)
        CHECK:     linalg.generic {{.*}} ins({{.*}} : tensor<64x32xbf16>, tensor<32x96xbf16>) outs({{.*}} : tensor<64x96xf32>)
        CHECK: } {lh.linear_ce_backward_pass = 2 : i64}
        CHECK-NEXT: return
    """)
    assert "192x320" not in text and "320x192" not in text
