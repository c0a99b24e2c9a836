"""The cross-entropy family against torch: every semantic item of F.cross_entropy (targets,
weights, ignore_index, reductions, label smoothing, unbatched inputs, dtypes, edge values;
N-D inputs go to the generic schedule), forward and forward+backward, on shapes that do not divide the tiles; and that the
driver picks it (strict) or falls back with a one-line reason."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import ScheduleMismatch
from tests.conftest import EXAMPLES
from tests.transform_ext.helpers import check as filecheck

KERNEL = """
import torch
import torch.nn.functional as F
N, C = {N}, {C}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        {init}

    def forward(self, {args}):
        return {expr}

def get_inputs():
    g = torch.Generator().manual_seed({seed})
    {inputs}

def get_init_inputs():
    return []
"""

LOGITS = "x = torch.randn(N, C, generator=g) * 3"
TARGETS = "y = torch.randint(0, C, (N,), generator=g); y[1] = -100"


def kernel(kernel_file, expr, inputs, *, args="x, y", init="pass", n=7, c=300, seed=0):
    return kernel_file(KERNEL.format(N=n, C=c, expr=expr, inputs=inputs, args=args, init=init,
                                     seed=seed))


def compiled(path, backward=False, **kw):
    c = compile_kernel(path, backward=backward, strict=True, **kw)
    assert c.family.name == "cross_entropy"
    return c


def assert_matches(c):
    for report in c.check():
        assert report.ok, str(report)


# (name, expr, inputs, args, init): forward and backward are both checked against torch.
CASES = [
    ("mean", "F.cross_entropy(x, y)", f"{LOGITS}; {TARGETS}; return [x, y]", "x, y", "pass"),
    ("sum_ignore_index_3", "F.cross_entropy(x, y, ignore_index=3, reduction='sum')",
     f"{LOGITS}; y = torch.randint(0, C, (N,), generator=g); y[0] = 3; return [x, y]", "x, y", "pass"),
    ("none_weight_input", "F.cross_entropy(x, y, weight=w, reduction='none')",
     f"{LOGITS}; {TARGETS}; w = torch.rand(C, generator=g); return [x, y, w]", "x, y, w", "pass"),
    ("weight_buffer_smoothing", "self.loss(x, y)", f"{LOGITS}; {TARGETS}; return [x, y]", "x, y",
     "self.loss = torch.nn.CrossEntropyLoss(weight=torch.linspace(0.1, 2, C), "
     "label_smoothing=0.15)"),
    ("probabilities", "F.cross_entropy(x, t, label_smoothing=0.1)",
     f"{LOGITS}; t = torch.softmax(torch.randn(N, C, generator=g), 1); return [x, t]", "x, t", "pass"),
    ("unbatched", "F.cross_entropy(x, y, label_smoothing=0.05)",
     "x = torch.randn(C, generator=g); y = torch.tensor(C - 1); return [x, y]", "x, y", "pass"),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch(kernel_file, case, backward):
    _, expr, inputs, args, init = case
    path = kernel(kernel_file, expr, inputs, args=args, init=init)
    c = compiled(path, backward)
    assert any(n.startswith("d_") for n in c.imported.result_names) == backward
    assert_matches(c)


# N-D inputs [N, C, d1, ..]: the classes are not the innermost dim
ND_CASES = [
    ("nd_weight_mean", "F.cross_entropy(x, y, weight=w)",
     "x = torch.randn(2, C, 3, 5, generator=g); y = torch.randint(0, C, (2, 3, 5), generator=g); "
     "y[0, 1, 2] = -100; w = torch.rand(C, generator=g); return [x, y, w]", "x, y, w"),
    ("nd_none", "F.cross_entropy(x, y, reduction='none', ignore_index=-1)",
     "x = torch.randn(3, C, 4, generator=g); y = torch.randint(0, C, (3, 4), generator=g); "
     "y[2, 0] = -1; return [x, y]", "x, y"),
    ("segmentation", "F.cross_entropy(x, y)",
     "x = torch.randn(2, C, 40, generator=g); y = torch.randint(0, C, (2, 40), generator=g); "
     "return [x, y]", "x, y"),
    ("log_softmax_dim_1", "torch.log_softmax(x, dim=1)", "return [torch.randn(4, C, 33, generator=g)]", "x"),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("case", ND_CASES, ids=[c[0] for c in ND_CASES])
def test_classes_that_are_not_the_innermost_dim_go_to_the_generic_schedule(kernel_file, case, backward):
    """The family runs its lanes along the classes; over [N, C, L] they would read one
    element per cache line (0.56x torch forward on [16, 512, 256], where the generic
    schedule's lanes along L run at 1.4x): it declines, naming the reason."""
    _, expr, inputs, args = case
    path = kernel(kernel_file, expr, inputs, args=args)
    c = compile_kernel(path, backward=backward)
    assert c.family.name == "generic"
    assert any("not the innermost dim of the logits" in note for note in c.notes), c.notes
    assert_matches(c)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_accumulates_in_f32(kernel_file, dtype):
    """bf16/f16 logits: loss and gradient in the logits' dtype, sums in f32 (C = 3008 terms
    of exp would lose ~1e-2 relative in bf16)."""
    path = kernel(kernel_file, "F.cross_entropy(x, y, label_smoothing=0.1)",
                  f"{LOGITS}; {TARGETS}; return [x.to(torch.{dtype}), y]", n=8, c=3008)
    c = compiled(path, backward=True)
    loss, grad = c.run()
    assert loss.dtype == getattr(torch, dtype) and grad.dtype == getattr(torch, dtype)
    assert_matches(c)


@pytest.mark.parametrize("expr, inputs, args", [
    ("F.cross_entropy(x, y, label_smoothing=0.1)", f"{LOGITS}; {TARGETS}; return [x{{cast}}, y]",
     "x, y"),
    ("F.cross_entropy(x, y, weight=w, label_smoothing=0.2, reduction='none')",
     f"{LOGITS}; {TARGETS}; w = torch.rand(C, generator=g); return [x{{cast}}, y, w{{cast}}]",
     "x, y, w"),
    ("F.cross_entropy(x, t)",
     f"{LOGITS}; t = torch.softmax(torch.randn(N, C, generator=g), 1); return [x{{cast}}, t{{cast}}]",
     "x, t"),
])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_class_sums_of_rounded_log_probabilities(kernel_file, expr, inputs, args, dtype):
    """16-bit logits with label smoothing or probability targets: torch rounds logp to the
    logits' type before its class sums, so sum_c round(x_c - m - log l) needs the final l
    (a late class sum): it is a sweep of its own over each row block after the fused loop
    (the family refused these forwards, and the generic schedule ran bf16 [2048, 32000]
    with label smoothing at 0.31x torch; 4.2x so). N = 13 (blocks of one row), C = 3008.
    Forward (the fused loop, then a loop over the classes that reads the logits again) and
    backward against torch."""
    path = kernel(kernel_file, expr, inputs.format(cast=f".to(torch.{dtype})"), args=args,
                  n=13, c=3008)
    fused = str(compiled(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall
        CHECK: scf.for
        CHECK: math.exp
        CHECK: scf.yield
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}}lh.class_sum
        CHECK: arith.truncf
    """)
    assert_matches(compiled(path))
    assert_matches(compiled(path, backward=True))


@pytest.mark.parametrize("shape", ["C", "N, C"])
def test_a_softmax_gradients_class_sum_is_a_late_sweep(kernel_file, shape):
    """The backward of a softmax s = exp(z - m) / l sums g_c s_c over the classes, which
    reads the final l: a late class sum, swept over the row block after the fused loop (the
    family refused this graph before). A 1-D softmax and rows of one; the seed makes the
    gradients nonzero. Against torch."""
    path = kernel(kernel_file, "(F.softmax(torch.log(x.abs() + 1.0) * w, dim=-1) * w).sum()",
                  f"x = torch.randn({shape}, generator=g); w = torch.randn({shape}, generator=g); "
                  "return [x, w]", args="x, w")
    c = compiled(path, backward=True)
    grads = c.run()[1:]
    assert all(g.abs().max() > 1e-3 for g in grads)
    assert_matches(c)


@pytest.mark.parametrize("expr, dtype, args, short", [
    ("F.cross_entropy(x, y)", "bfloat16", "x, y", True),
    ("F.cross_entropy(x, y, reduction='sum')", "float16", "x, y", True),
    ("torch.log_softmax(x, -1)", "bfloat16", "x", True),
    ("F.cross_entropy(x, y)", "float32", "x, y", False),
    # bf16 logits widened first: the loss is f32
    ("F.cross_entropy(x.float(), y)", "bfloat16", "x, y", False),
])
def test_16_bit_results_take_the_short_exp(kernel_file, expr, dtype, args, short):
    """A loss whose results are all f16 or bf16 takes expand_fast_exp's short exp (ln2 as one
    f32 constant, -0.693147182: within 6 f32 ulp, where the results round at 2^-11 or 2^-8;
    bf16 [2048, 32000] on one thread: forward 22.9 -> 21.5 ms, backward 54.0 -> 49.3 ms); an
    f32 result keeps the full one (ln2 in two parts, -0.693145751). Forward and backward
    against torch."""
    inputs = f"{LOGITS}; {TARGETS}; return [x.to(torch.{dtype})" + (", y]" if "y" in args else "]")
    path = kernel(kernel_file, expr, inputs, args=args, n=8, c=3008)
    for backward in (False, True):
        c = compiled(path, backward=backward)
        text = str(compiled(path, backward=backward, stop_after="vectorize").module)
        assert ("-0.693147182" in text, "-0.693145751" in text) == (short, not short)
        assert_matches(c)


def test_rows_and_classes_that_do_not_divide_the_tiles(kernel_file):
    """N = 13 (prime: row blocks of 1), C = 8192 + 77 (a class-tile remainder that is no
    multiple of the vector width), explicit tiles from the kernel file."""
    path = kernel_file(KERNEL.format(N=13, C=8192 + 77, expr="F.cross_entropy(x, y)",
                                     inputs=f"{LOGITS}; {TARGETS}; return [x, y]", args="x, y",
                                     init="pass", seed=1)
                       + "\nLIGHTHOUSE = dict(class_tile=1000, row_tile=4)\n")
    assert_matches(compiled(path, backward=True))


@pytest.mark.parametrize("c", [8192, 32000])
def test_vocabulary_sizes(kernel_file, c):
    path = kernel(kernel_file, "F.cross_entropy(x, y)", f"{LOGITS}; {TARGETS}; return [x, y]",
                  n=3, c=c)
    assert_matches(compiled(path, backward=True))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(kernel_file, reduction):
    """mean is NaN (0/0), sum 0, none zeros, and every gradient exactly 0."""
    path = kernel(kernel_file, f"F.cross_entropy(x, y, reduction='{reduction}')",
                  f"{LOGITS}; y = torch.full((N,), -100); return [x, y]", n=4, c=100)
    c = compiled(path, backward=True)
    loss, grad = c.run()
    if reduction == "mean":
        assert torch.isnan(loss).all()
    else:
        assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(grad, torch.zeros_like(grad))
    assert_matches(c)


@pytest.mark.parametrize("where", ["ignored", "live"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_logits_match_torch(kernel_file, where, value):
    """A non-finite logit in an ignored row (row 1) or a counted one (row 2): loss and
    gradients exactly as torch, NaN where torch has NaN (an ignored row's gradient is
    softmax * 0: NaN when the row holds NaN or inf, its finite rows' gradients unaffected)."""
    row = 1 if where == "ignored" else 2
    path = kernel(kernel_file, "F.cross_entropy(x, y)",
                  f"{LOGITS}; {TARGETS}; x[{row}, 3] = float('{value}'); return [x, y]", n=5, c=200)
    c = compiled(path, backward=True)
    assert_matches(c)
    _, grad = c.run()
    _, want = c.imported.reference()
    assert torch.equal(torch.isnan(grad), torch.isnan(want))
    if value == "nan" and where == "ignored":
        assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2, 3, 4]]).all()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weight", ["none", "input", "buffer"])
def test_nan_in_an_ignored_row_gives_torchs_nan_gradient(kernel_file, weight, smoothing):
    """The repro of the reversed decision (ce_nan.py): the backward of a NaN logit in an
    ignored row is NaN in that row, as torch, with weights and label smoothing too."""
    args, expr, init, extra = "x, y", "F.cross_entropy(x, y, label_smoothing={ls})", "pass", ""
    if weight == "input":
        args, expr, extra = "x, y, w", "F.cross_entropy(x, y, weight=w, label_smoothing={ls})", \
            "w = torch.rand(C, generator=g); "
    elif weight == "buffer":
        expr = "self.loss(x, y)"
        init = f"self.loss = torch.nn.CrossEntropyLoss(weight=torch.rand(C), label_smoothing={smoothing})"
    inputs = f"{LOGITS}; {TARGETS}; x[1, 5] = float('nan'); {extra}return [{args}]"
    path = kernel(kernel_file, expr.format(ls=smoothing), inputs, args=args, init=init, n=8, c=19)
    c = compiled(path, backward=True)
    assert_matches(c)
    assert torch.isnan(c.run()[1][1]).all()


def test_masked_classes_and_rows(kernel_file):
    """-inf logits: every 64th class (a whole SIMD lane of the running max and sum is -inf)
    and all of row 3 (ignored). The loss per row and the gradients are torch's, row 3's
    gradient NaN as in torch (softmax of a row of -inf)."""
    path = kernel(kernel_file, "F.cross_entropy(x, y, reduction='none')",
                  f"{LOGITS}; {TARGETS}; y[3] = -100; x[:, 5::64] = -float('inf'); "
                  "x[3] = -float('inf'); return [x, y]", n=6, c=1024)
    c = compiled(path, backward=True)
    assert_matches(c)
    assert torch.isnan(c.run()[1][3]).all()


@pytest.mark.parametrize("logits, expr", [
    ("torch.randn(N, C, generator=g) * 1e4", "F.cross_entropy(x, y)"),
    ("1e4 + torch.randn(N, C, generator=g)", "F.cross_entropy(x, y, label_smoothing=0.2)"),
], ids=["spread", "offset_smoothing"])
def test_large_logits_stay_finite(kernel_file, logits, expr):
    """|x| up to 1e4: a logit gap far past exp's range, and an offset of 1e4 under label
    smoothing (whose class sum is split into sum_c x_c and sum_c 1, which cancel)."""
    path = kernel(kernel_file, expr, f"x = {logits}; {TARGETS}; return [x, y]")
    c = compiled(path, backward=True)
    loss, grad = c.run()
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert_matches(c)


def test_example_is_chosen_and_falls_back_with_a_reason(kernel_file):
    c = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 9, "C": 257})
    assert c.family.name == "cross_entropy" and not c.notes
    # probability targets with a float weight input: d weight reduces over the rows
    path = kernel(kernel_file, "F.cross_entropy(x, t, weight=w)",
                  f"{LOGITS}; t = torch.softmax(torch.randn(N, C, generator=g), 1); "
                  "w = torch.rand(C, generator=g); return [x, t, w]", args="x, t, w")
    c = compile_kernel(path, backward=True)
    assert c.family.name == "generic"
    assert "cross_entropy" in c.notes[0] and "rows" in c.notes[0]
    assert all(note.endswith("using the generic schedule") for note in c.notes)
    assert_matches(c)
    with pytest.raises(ScheduleMismatch, match="cross_entropy"):
        compile_kernel(path, backward=True, strict=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_softmax_of_a_broadcast_vector(kernel_file, dtype):
    """log_softmax over a 1-D vector made of a broadcast [1] input: the row max reads a 0-d
    value, which the plan's lane count indexed past (an IndexError, found by the rows
    fuzzer) instead of declining the split."""
    assert_matches(compile_kernel(kernel(
        kernel_file, "torch.log_softmax((x * 1.5 + y) * 1.5, dim=0), x * 2.0",
        f"return [(torch.randn(3, generator=g) * 3).to(torch.{dtype}), "
        f"torch.randn(1, generator=g).to(torch.{dtype})]")))


# --------------------------------------------------------------------------- the IR


def _alloc_sizes(text: str) -> list[int]:
    """Element counts of the static memref.allocs in bufferized IR."""
    import re

    sizes = []
    for shape in re.findall(r"memref\.alloc\(\)(?: \{[^}]*\})? : memref<([0-9x]+)x[a-z]", text):
        n = 1
        for d in shape.split("x"):
            n *= int(d)
        sizes.append(n)
    return sizes


def test_forward_ir_one_class_loop_and_no_logits_sized_buffer():
    """Per row block, one loop over the classes (plus the static remainder tile); after
    bufferization nothing but the per-row statistics is allocated."""
    c = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 6, "C": 9000},
                       stop_after="fuse", strict=True)
    filecheck(str(c.module), """
        CHECK: scf.forall
        CHECK: scf.for %{{.*}} = %c0 to %c8192 step %c4096
        CHECK-NOT: scf.for %
        CHECK: scf.forall.in_parallel
        CHECK-NOT: scf.for %
        CHECK: return
    """)
    c = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 6, "C": 9000},
                       stop_after="bufferize", strict=True)
    text = str(c.module)
    filecheck(text, """
        CHECK: func.func @main(%{{.*}}: memref<6x9000xf32>, %{{.*}}: memref<6xi64>, %{{.*}}: memref<f32>, %{{.*}}: memref<i32>)
        CHECK-NOT: memref.alloc() {{.*}}9000
    """)
    sizes = _alloc_sizes(text)
    assert sizes and max(sizes) <= 6


def test_lane_split_ir():
    """Classes a multiple of 64: the fused loop steps over chunks of 64 lanes, 8 chunks a
    step, with 64 running maxima and sums (one vector each per 16 lanes)."""
    c = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 6, "C": 8192},
                       stop_after="fuse", strict=True)
    filecheck(str(c.module), """
        CHECK: scf.forall
        CHECK: tensor.expand_shape {{.*}} into tensor<1x128x64xf32>
        CHECK: scf.for %{{.*}} = %c0 to %c128 step %c8 iter_args({{.*}}) -> (tensor<1x64xf32>, tensor<1x64xf32>)
        CHECK-NOT: scf.for %
        CHECK: iterator_types = ["parallel", "reduction"]
        CHECK: scf.forall.in_parallel
    """)


def test_backward_ir_allocates_only_the_gradient():
    """The gradient is the function's out-parameter, written in the row blocks' second sweep;
    no other buffer of the logits' size exists."""
    c = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 6, "C": 9000},
                       backward=True, stop_after="bufferize", strict=True)
    text = str(c.module)
    filecheck(text, """
        CHECK: func.func @main(%{{.*}}: memref<6x9000xf32>, %{{.*}}: memref<6xi64>, %{{.*}}: memref<f32>, %[[GRAD:.*]]: memref<6x9000xf32>, %{{.*}}: memref<i32>)
        CHECK: scf.parallel
        CHECK: %[[BLOCK:.*]] = memref.subview %[[GRAD]]
        CHECK: scf.for
        CHECK: vector.transfer_write {{.*}}, %[[BLOCK]]
    """)
    sizes = _alloc_sizes(text)
    assert sizes and max(sizes) <= 6


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_out_of_range_target_in_the_inputs_is_a_clear_error(kernel_file, backward):
    """A target outside [0, C) that is not ignore_index: known at compile time when the kernel
    file's inputs hold it (one line, no traceback). At run time (other inputs): see
    test_out_of_range_target_at_run_time_raises_a_kernel_error."""
    from lighthouse.errors import IngressError

    path = kernel(kernel_file, "F.cross_entropy(x, y)",
                  f"{LOGITS}; {TARGETS}; y[2] = C; return [x, y]", n=4, c=10)
    with pytest.raises(IngressError, match="out of bounds") as info:
        compile_kernel(path, backward=backward)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("weight", [False, True], ids=["unweighted", "weighted"])
def test_out_of_range_target_at_run_time_raises_a_kernel_error(kernel_file, backward, weight):
    """The compiled kernel, given a target outside [0, C) that is not ignore_index (inputs
    the import never saw), reports it: the call raises KernelError naming the valid range,
    the process and the function live on; an ignored target (-100) runs."""
    from lighthouse.errors import KernelError

    args = "x, y, w" if weight else "x, y"
    expr = "F.cross_entropy(x, y, weight=w)" if weight else "F.cross_entropy(x, y)"
    extra = "w = torch.rand(C, generator=g); " if weight else ""
    path = kernel(kernel_file, expr, f"{LOGITS}; {TARGETS}; {extra}return [{args}]", args=args,
                  n=4, c=10)
    c = compiled(path, backward)
    inputs = list(c.imported.args)
    for bad in (10, -1, 1 << 40, -101):
        y = inputs[1].clone()
        y[2] = bad
        with pytest.raises(KernelError, match=r"cross_entropy: a target is out of range: class "
                           r"indices must be in \[0, 10\) or equal ignore_index"):
            c.run(inputs[0], y, *inputs[2:])
    assert_matches(c)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_frozen_weight_with_ignored_targets_is_read_in_bounds(kernel_file, reduction, smoothing):
    """nn.CrossEntropyLoss(weight=...) freezes w into the graph; torch-mlir's backward reads
    w[y] for every target before selecting the ignored ones away, so w[-100] was read out of
    bounds (a crash, or garbage, depending on the memory before w). Every gather at a target
    is clamped into [0, C) at cleanup; the values of counted rows are unchanged."""
    init = (f"self.loss = torch.nn.CrossEntropyLoss(weight=torch.rand(C), reduction='{reduction}', "
            f"label_smoothing={smoothing})")
    path = kernel(kernel_file, "self.loss(x, y)",
                  f"{LOGITS}; y = torch.randint(0, C, (N,), generator=g); y[::3] = -100; return [x, y]",
                  init=init, n=37, c=19)
    cleaned = compile_kernel(path, backward=True, stop_after="cleanup").module
    indices = []

    def visit(op):
        if op.name == "tensor.extract":
            indices.extend(v.owner.name for v in list(op.operands)[1:])
        return ir.WalkResult.ADVANCE

    from torch_mlir import ir

    cleaned.operation.walk(visit)
    # the gathers at the targets (x[i, y], w[y] of the loss and of the backward's one-hot):
    # each index is min(max(y, 0), C - 1); the others are loop indices or constants
    assert indices.count("arith.minsi") >= 2, indices
    assert set(indices) <= {"arith.minsi", "linalg.index", "arith.constant"}, indices
    assert_matches(compiled(path, backward=True))


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("form", ["plain", "weight_smoothing", "probabilities"])
def test_one_row(kernel_file, backward, form):
    """N = 1: the unit row dim folds away ([1, C] read as [C], the gradient returned through
    a reshape); the family takes it like an unbatched loss."""
    expr, inputs, args = {
        "plain": ("F.cross_entropy(x, y)", f"{LOGITS}; {TARGETS.replace('y[1]', 'y[0]')}; return [x, y]",
                  "x, y"),
        "weight_smoothing": ("F.cross_entropy(x, y, weight=w, label_smoothing=0.1)",
                             f"{LOGITS}; y = torch.randint(0, C, (N,), generator=g); "
                             "w = torch.rand(C, generator=g); return [x, y, w]", "x, y, w"),
        "probabilities": ("F.cross_entropy(x, t)", f"{LOGITS}; t = torch.softmax(torch.randn(N, C, "
                          "generator=g), 1); return [x, t]", "x, t"),
    }[form]
    path = kernel(kernel_file, expr, inputs, args=args, n=1, c=19)
    if form == "probabilities":
        c = compile_kernel(path, backward=backward)  # may fall back; must compute right
    else:
        c = compiled(path, backward)
    assert_matches(c)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_no_rows_and_one_class_are_refused_with_a_reason(kernel_file, backward):
    """N = 0 (an empty input) and C = 1 (the class max folds away): the family's check says
    why, without crashing; C = 1 then computes right on the generic schedule."""
    from schedules.cross_entropy import check

    path = kernel(kernel_file, "F.cross_entropy(x, y)",
                  f"{LOGITS}; y = torch.randint(0, C, (N,), generator=g); return [x, y]", n=0, c=19)
    imported = compile_kernel(path, backward=backward, stop_after="import", schedule="loops")
    assert check(imported.module) == "an input is empty (tensor<0x19xf32>)"
    path = kernel(kernel_file, "F.cross_entropy(x, y)",
                  f"{LOGITS}; y = torch.zeros(N, dtype=torch.long); y[1] = -100; return [x, y]",
                  n=7, c=1)
    c = compile_kernel(path, backward=backward)
    assert c.family.name == "generic" and "row max" in c.notes[0]
    assert_matches(c)


@pytest.mark.parametrize("example, blocks", [
    ("log_softmax.py", 16),  # swept again by its result: blocks of 4 rows (16 KiB, in L1)
    ("cross_entropy.py", 8),  # a loss alone: 8 blocks for 2 threads (L2 would hold 256 rows)
])
def test_row_blocks_of_a_swept_result_stay_in_l1(example, blocks):
    """Rows of 4 KiB, 64 of them on 2 threads, the tests' CPU (48 KiB of L1): a kernel whose
    result sweeps each row block again after its class loop takes blocks of half of L1
    (log-softmax [16384, 1024]: 8.6 ms in blocks of 256 rows, 6.0 in blocks of 8); a loss
    alone takes blocks of half of L2, as few as the threads allow."""
    c = compiled(EXAMPLES / example, overrides={"N": 64, "C": 1024}, threads=2, stop_after="fuse")
    filecheck(str(c.module), f"CHECK: scf.forall (%{{{{.*}}}}) in ({blocks})")
