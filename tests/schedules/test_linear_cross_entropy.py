"""The linear cross-entropy family against torch: F.cross_entropy(F.linear(h, W[, b]), y),
nn.Linear with nn.CrossEntropyLoss, the view(-1, V) of 3-D hidden states, every semantic of
F.cross_entropy the cross-entropy family has (weights, ignore_index, label smoothing,
reductions, all rows ignored, large logits), f32/bf16/f16, rows and classes that do not
divide the tiles; loss, dh, dW and db. That the compiled IR holds no [N, V] buffer, that the
printed script replays, and that what the family cannot take falls back with the reason."""

import dataclasses

import pytest
import torch
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.targets.description import host_cpu, host_cpu_flags
from tests.conftest import EXAMPLES

KERNEL = """
import torch
import torch.nn.functional as F
N, D, V = {N}, {D}, {V}
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        {init}

    def forward(self, {args}):
        {body}

def get_inputs():
    g = torch.Generator().manual_seed({seed})
    h = (torch.randn({h_shape}, generator=g) * {scale}).to(DTYPE)
    w = (torch.randn(V, D, generator=g) / D ** 0.5).to(DTYPE)
    y = torch.randint(0, V, ({y_shape}), generator=g)
    {targets}
    return [{inputs}]

def get_init_inputs():
    return []
{options}
"""

LINEAR = "return F.cross_entropy(F.linear(h, w), y)"
IGNORED = "y.view(-1)[1::5] = -100"


def kernel(kernel_file, body=LINEAR, *, n=37, d=24, v=301, dtype="float32", init="pass",
           args="h, w, y", inputs="h, w, y", targets=IGNORED, h_shape="N, D", y_shape="N,",
           scale=1.0, seed=0, options="LIGHTHOUSE = dict(backward_rows=16)"):
    return kernel_file(KERNEL.format(N=n, D=d, V=v, dtype=dtype, init=init, args=args,
                                     body=body, inputs=inputs, targets=targets, h_shape=h_shape,
                                     y_shape=y_shape, scale=scale, seed=seed, options=options))


def compiled(path, backward=False, **kw):
    c = compile_kernel(path, backward=backward, **kw)
    assert c.family.name == "linear_cross_entropy", c.notes
    assert not c.notes, c.notes
    return c


def assert_matches(c):
    reports = c.check()
    assert reports
    for report in reports:
        assert report.ok, str(report)


MODULE = ("self.head = torch.nn.Linear(D, V, bias={bias}, dtype=DTYPE); "
          "self.loss = torch.nn.CrossEntropyLoss({loss})")

# (name, kernel keyword arguments): forward and backward are both checked against torch.
CASES = [
    ("linear_mean", {}),
    ("module_bias_weight_smoothing_sum", dict(
        init=MODULE.format(bias=True, loss="weight=torch.rand(V), label_smoothing=0.1, "
                                          "reduction='sum'"),
        body="return self.loss(self.head(h), y)", args="h, y", inputs="h, y")),
    ("none_ignore_index_3", dict(
        body="return F.cross_entropy(F.linear(h, w), y, ignore_index=3, reduction='none')",
        targets="y[0] = 3; y[4] = 3")),
    ("weight_input_smoothing_mean", dict(
        body="return F.cross_entropy(F.linear(h, w), y, weight=cw, label_smoothing=0.2)",
        args="h, w, y, cw", inputs="h, w, y, torch.rand(V, generator=g)")),
    ("hidden_states_3d_view", dict(
        init=MODULE.format(bias=True, loss=""), h_shape="2, 19, D", y_shape="2, 19",
        body="return self.loss(self.head(h).view(-1, V), y.view(-1))", args="h, y",
        inputs="h, y")),
]


RECOMPUTED = "LIGHTHOUSE = dict(backward_rows=16, stored_logits_bytes=0)"


@pytest.mark.parametrize("backward, options", [
    (False, None), (True, None), (True, RECOMPUTED)],
    ids=["forward", "backward", "backward_recomputed"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch(kernel_file, case, backward, options):
    """The backward reads the logits its forward stored, or recomputes them per tile (a
    budget of 0 for the stored logits)."""
    extra = {"options": options} if options else {}
    c = compiled(kernel(kernel_file, **{**case[1], **extra}), backward)
    assert any(n.startswith("d_") for n in c.imported.result_names) == backward
    assert_matches(c)


@pytest.mark.parametrize("dtype, loss, options", [
    ("bfloat16", "ignore_index=-100", None), ("float16", "ignore_index=-100", None),
    ("bfloat16", "label_smoothing=0.1", None), ("bfloat16", "label_smoothing=0.1", RECOMPUTED)],
    ids=["bf16", "f16", "bf16_smoothing", "bf16_smoothing_recomputed"])
def test_half_precision_accumulates_in_f32(kernel_file, dtype, loss, options):
    """bf16/f16 h and W (and a bias): the logits rounded to the dtype as torch rounds them,
    every sum and product accumulated in f32, loss and gradients in the dtype. With label
    smoothing each rounded log-probability is summed (a second loop over the class tiles,
    after the final log-sum-exp, reading the stored logits or recomputing them)."""
    extra = {"options": options} if options else {}
    path = kernel(kernel_file, init=MODULE.format(bias=True, loss=loss),
                  body="return self.loss(self.head(h), y)", args="h, y", inputs="h, y",
                  dtype=dtype, v=515, **extra)
    c = compiled(path, backward=True)
    results = c.run()
    assert all(r.dtype == getattr(torch, dtype) for r in results)
    assert_matches(c)


@pytest.mark.parametrize("d", [40, 64], ids=["d40", "d64_panels"])
@pytest.mark.parametrize("budget", ["", ", stored_logits_bytes=0"], ids=["stored", "recomputed"])
def test_rows_and_classes_that_do_not_divide_the_tiles(kernel_file, budget, d):
    """N = 53 (prime: forward row blocks of 1; backward blocks of 16 and a remainder of 5),
    V = 4 * 64 + 37 (a class-tile remainder), the threads' shares of 4 tiles uneven with 3
    threads; the logits stored by the forward or recomputed; D = 64 in column panels of 32
    (h, and W's class tiles for dh, read as panels)."""
    path = kernel(kernel_file, n=53, v=4 * 64 + 37, d=d,
                  options=f"LIGHTHOUSE = dict(backward_rows=16, class_tile=64{budget})")
    assert_matches(compiled(path, backward=True, threads=3))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(kernel_file, reduction):
    """mean is NaN (0/0), sum 0, none zeros, and every gradient exactly 0."""
    path = kernel(kernel_file, f"return F.cross_entropy(F.linear(h, w), y, reduction='{reduction}')",
                  targets="y[:] = -100", n=6, v=100)
    c = compiled(path, backward=True)
    loss, dh, dw = c.run()
    if reduction == "mean":
        assert torch.isnan(loss).all()
    else:
        assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))
    assert_matches(c)


def test_large_logits_stay_finite(kernel_file):
    """Logits of a few thousand: a gap far past exp's range, with label smoothing (whose
    class sums of the logits cancel against each other)."""
    path = kernel(kernel_file, "return F.cross_entropy(F.linear(h, w), y, label_smoothing=0.2)",
                  scale=1000.0)
    c = compiled(path, backward=True)
    assert all(torch.isfinite(r).all() for r in c.run())
    assert_matches(c)


def test_transposed_view_of_the_hidden_states(kernel_file):
    """h passed as the transposed view of a [D, N] tensor (read through a transposed copy:
    [N, D], not logits-sized)."""
    path = kernel(kernel_file, "return F.cross_entropy(F.linear(ht.t(), w), y)",
                  args="ht, w, y", inputs="h.t().contiguous(), w, y")
    assert_matches(compiled(path, backward=True))


def _allocations(payload) -> list[list[int]]:
    shapes = []

    def visit(op):
        if op.name == "memref.alloc":
            shapes.append(list(ir.MemRefType(op.results[0].type).shape))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    return shapes


@pytest.mark.parametrize("stored", [False, True], ids=["recomputed", "stored"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("variant", ["linear", "bias_weight_smoothing", "bf16_smoothing"])
def test_no_logits_sized_buffer_after_bufferization(kernel_file, backward, variant, stored):
    """After bufferization no buffer holds the logits or their gradient, not even a row
    block's: a buffer with V in its shape is [V, D] or [V] (dW, db), and none has a quarter
    of the logits' elements; the largest others are the tiles and the backward's dh
    partials [threads, rows, D]. With a bias, class weights and label smoothing too (db,
    read from the logits once the loss is restructured, and the smoothing's class sums),
    and bf16 label smoothing (its second loop over the class tiles). Within the
    `stored_logits_bytes` budget the backward keeps one buffer more, the f32 logits S^T
    [V, N] its forward computed; with a budget of 0 (`recomputed`), and in a forward
    alone, there is none."""
    n, d, v = 600, 32, 1000
    options = "" if stored else "LIGHTHOUSE = dict(stored_logits_bytes=0)"
    if variant == "linear":
        path = kernel(kernel_file, n=n, d=d, v=v, options=options)
    else:
        loss = "weight=torch.rand(V), label_smoothing=0.1" if variant == "bias_weight_smoothing" \
            else "label_smoothing=0.1"
        path = kernel(kernel_file, n=n, d=d, v=v, args="h, y", inputs="h, y", options=options,
                      init=MODULE.format(bias=True, loss=loss), body="return self.loss(self.head(h), y)",
                      dtype="bfloat16" if variant == "bf16_smoothing" else "float32")
    c = compile_kernel(path, backward=backward, stop_after="bufferize")
    assert c.family.name == "linear_cross_entropy", c.notes
    shapes = _allocations(c.module)
    assert shapes
    if stored and backward:
        assert shapes.count([v, n]) == 1, shapes
        shapes.remove([v, n])
    for shape in shapes:
        count = 1
        for s in shape:
            count *= s
        assert count < n * v // 4, shape
        assert v not in shape or set(shape) <= {v, d, 1}, shape


def test_fused_loops_in_the_ir():
    """The fuse stage's payload: the forward's row forall with one loop over class tiles
    of 64 computing the logits tile (a contraction over D) and the online max and sum; the
    backward's loop over row blocks of 256 (a fused kernel) around a forall over the
    threads, the remainder block of 88 rows after it."""
    from tests.transform_ext.helpers import check

    c = compile_kernel(EXAMPLES / "linear_cross_entropy.py", overrides=dict(N=600, D=32, V=1000),
                       backward=True, stop_after="fuse")
    check(str(c.module), """
        CHECK: scf.forall
        CHECK:   scf.for %{{.*}} = %{{.*}} to %{{.*}} step %c64
        CHECK:     linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]
        CHECK:     arith.maximumf
        CHECK:     math.exp
        CHECK: } {lh.row_blocks}
        CHECK: scf.for
        CHECK:   scf.forall (%{{.*}}) in (2)
        CHECK:     scf.for
        CHECK:       math.exp
        CHECK: } {lh.fused_kernel}
    """)


def test_printed_script_replays_and_an_edit_takes_effect(tmp_path):
    path, sizes = EXAMPLES / "linear_cross_entropy.py", dict(N=96, D=32, V=500)
    first = compile_kernel(path, overrides=sizes, backward=True, dump_dir=tmp_path / "built")
    script = first.schedule_text()
    assert "transform_ext.fuse_linear_cross_entropy_backward" in script
    assert "class_tile = 64" in script
    (tmp_path / "schedule.mlir").write_text(script)
    second = compile_kernel(path, overrides=sizes, backward=True, dump_dir=tmp_path / "replayed",
                            schedule_file=tmp_path / "schedule.mlir")
    for name in sorted(p.name for p in (tmp_path / "built").iterdir()):
        assert (tmp_path / "built" / name).read_text() == \
            (tmp_path / "replayed" / name).read_text(), name
    (tmp_path / "edited.mlir").write_text(script.replace("class_tile = 64", "class_tile = 32"))
    edited = compile_kernel(path, overrides=sizes, backward=True, stop_after="fuse",
                            schedule_file=tmp_path / "edited.mlir")
    assert "step %c32" in str(edited.module)
    assert_matches(compile_kernel(path, overrides=sizes, backward=True,
                                  schedule_file=tmp_path / "edited.mlir"))


def test_falls_back_with_a_reason(kernel_file):
    """The logits returned beside the loss must exist: the family refuses (they are read
    by the function's return) and the next family that recognizes the payload, the
    matmul's, compiles it, with the note."""
    path = kernel(kernel_file, "s = F.linear(h, w); return F.cross_entropy(s, y), s")
    c = compile_kernel(path)
    assert c.family.name == "matmul"
    assert c.notes and "the linear_cross_entropy schedule does not apply" in c.notes[0]
    assert c.notes[0].endswith("; using the matmul schedule")
    assert_matches(c)


@pytest.mark.parametrize("bf16_dot", [False, True], ids=["pinned", "bf16_dot"])
def test_a_joint_graph_with_as_many_rows_as_classes_falls_back(kernel_file, bf16_dot):
    """Found by the fuzzer: bf16 logits with a bias and label smoothing 1.0, N = V = 96.
    db [V] and the per-row values [N] share a shape, and the plan took db's conversion for
    the forward's last per-row op: with bf16 dot products a StopIteration traceback (no row
    max in the row blocks), without them IR that failed to verify. The family now refuses
    the joint graph with the reason; the matmul family compiles it."""
    if bf16_dot and "avx512_bf16" not in host_cpu_flags():
        pytest.skip("vdpbf16ps needs a host with avx512_bf16")
    path = kernel(kernel_file, init=MODULE.format(bias=True, loss="label_smoothing=1.0"),
                  body="return self.loss(self.head(h), y)", args="h, y", inputs="h, y",
                  n=96, d=40, v=96, dtype="bfloat16", options="")
    options = {"cpu": dataclasses.replace(host_cpu(), bf16_dot=True)} if bf16_dot else None
    c = compile_kernel(path, backward=True, target_options=options)
    assert c.family.name == "matmul"
    assert "the rows equal the classes (96) in the joint graph" in c.notes[0]
    assert_matches(c)


@pytest.mark.parametrize("body", [
    "l = F.cross_entropy(F.linear(h, w), y, reduction='none'); return l.sum() / 7, l",
    "s = F.linear(h, w); return F.cross_entropy(s, y) + F.cross_entropy(s, y, label_smoothing=0.1)",
], ids=["loss_read_twice", "two_losses_on_one_head"])
def test_neighbours(kernel_file, body):
    """A per-row loss returned beside its own sum; two losses over one head's logits."""
    assert_matches(compiled(kernel(kernel_file, body), backward=True))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_gpu_target_takes_the_forward_and_the_backward(dtype):
    """On the XeGPU target the family takes the forward and the joint graph (the backward's
    two passes: tests/lighthouse/test_xegpu_linear_cross_entropy.py), with no note."""
    from lighthouse.compile import make_target
    from lighthouse.families import choose_family
    from lighthouse.ingress import import_forward, import_joint
    from lighthouse.kernel import load_kernel

    k = load_kernel(EXAMPLES / "linear_cross_entropy.py", dict(N=16, D=8, V=64, DTYPE=dtype))
    for module in (import_forward(k.model, k.inputs).module, import_joint(k.model, k.inputs).module):
        notes = []
        assert choose_family(module, target=make_target("xegpu"), notes=notes).name == \
            "linear_cross_entropy"
        assert notes == []


def test_the_backward_on_the_gpu_compiles_on_the_command_line(tmp_path):
    """On the command line the joint graph compiles for the GPU: four kernels (the forward,
    the mean's reduction, the backward's two passes) in the manifest, each with its device
    binary's machine code."""
    import json
    import subprocess
    import sys

    out = tmp_path / "head.bin"
    command = [sys.executable, "-m", "lighthouse.compile", str(EXAMPLES / "linear_cross_entropy.py"),
               "--target", "xegpu", "--set", "N=128", "--set", "D=64", "--set", "V=256",
               "--set", "DTYPE=bfloat16", "--backward", "-o", str(out)]
    r = subprocess.run(command, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(out.with_suffix(".json").read_text())
    kernels = manifest["kernels"]
    assert [k["kind"] for k in kernels] == ["linear_cross_entropy", "row_sum",
                                            "linear_cross_entropy_dh", "linear_cross_entropy_dw"]
    assert all(k["machine_code"]["spill_bytes"] == 0 for k in kernels)
