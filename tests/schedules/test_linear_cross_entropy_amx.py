"""The linear cross-entropy's bf16 logits tiles on AMX tiles (LinearCrossEntropyParams.amx,
LinearCrossEntropyPlan.amx): forward and forward+backward against torch (a bias, class
weights and label smoothing with its second sweep over the class tiles, reduction='none'
with an ignore_index, 3-D hidden states, large logits, all rows ignored, a depth of three
16-pair steps, class counts with a remainder tile); the neighbours the tiles do not take
(a depth or a row count that is no multiple of 32, f32) still match torch on the AVX512
path; the IR of the
fuse and vectorize stages (W read in pairs in place, h packed in pairs per row block, the
32 x 32 steps left to the target) and, on a host with AMX, the tile products after
bufferization. The numerics need a host with AMX; the IR tests run anywhere."""

import dataclasses

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.runtime import allow_amx_tiles
from lighthouse.targets.description import host_cpu
from tests.schedules.test_linear_cross_entropy import MODULE, assert_matches, kernel
from tests.transform_ext.helpers import check as filecheck

needs_amx = pytest.mark.skipif(not allow_amx_tiles(), reason="tdpbf16ps needs a host with AMX")
SMALL = dict(n=256, d=64, v=512, dtype="bfloat16", options="")  # row blocks of 32, class tiles of 256


def compile_amx(path, **kw):
    cpu = dataclasses.replace(host_cpu(), bf16_dot=True, amx=True)
    c = compile_kernel(path, target_options={"cpu": cpu}, **kw)
    assert c.family.name == "linear_cross_entropy", c.notes
    assert not c.notes, c.notes
    return c


def on_tiles(c) -> bool:
    """Did the vectorize stage leave 32 x 32 x 16-pair steps to the target?"""
    return "lh.target_kernel" in str(compile_amx(c, stop_after="vectorize").module)


ON_TILES = [
    ("linear_mean", {}),
    ("module_bias_weight_smoothing_sum", dict(
        init=MODULE.format(bias=True, loss="weight=torch.rand(V).to(DTYPE), label_smoothing=0.1, "
                                          "reduction='sum'"),
        body="return self.loss(self.head(h), y)", args="h, y", inputs="h, y")),
    ("none_ignore_index_3", dict(
        body="return F.cross_entropy(F.linear(h, w), y, ignore_index=3, reduction='none')",
        targets="y[0] = 3; y[4] = 3")),
    ("hidden_states_3d_view", dict(
        init=MODULE.format(bias=True, loss=""), h_shape="2, 128, D", y_shape="2, 128",
        body="return self.loss(self.head(h).view(-1, V), y.view(-1))", args="h, y",
        inputs="h, y")),
    ("large_logits_smoothing", dict(
        body="return F.cross_entropy(F.linear(h, w), y, label_smoothing=0.2)", scale=1000.0)),
    ("all_rows_ignored", dict(targets="y[:] = -100")),
    ("depth_96", dict(d=96)),
    ("classes_480", dict(v=480)),  # class tiles of 160
    ("classes_515", dict(v=515)),  # tiles of 256 and a remainder of 3 on the old path
    ("classes_100_smoothing", dict(   # a tile of 96 and 4 more; the second sweep peeled
        v=100, body="return F.cross_entropy(F.linear(h, w), y, label_smoothing=0.1)")),
]
OFF_TILES = [
    ("depth_40", dict(d=40)),
    ("rows_200", dict(n=200)),
    ("f32", dict(dtype="float32")),
]


@needs_amx
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("case", ON_TILES + OFF_TILES, ids=[c[0] for c in ON_TILES + OFF_TILES])
def test_matches_torch(kernel_file, case, backward):
    path = kernel(kernel_file, **{**SMALL, **case[1]})
    assert_matches(compile_amx(path, backward=backward))


@pytest.mark.parametrize("case, on", [(c, True) for c in ON_TILES] + [(c, False) for c in OFF_TILES],
                         ids=[c[0] for c in ON_TILES + OFF_TILES])
def test_only_fitting_logits_use_the_tiles(kernel_file, case, on):
    """bf16 h and W with D, the row block and the class tile multiples of 32 take the tiles
    (a remainder tile of classes does not); the others keep the AVX512 register tiles."""
    path = kernel(kernel_file, **{**SMALL, **case[1]})
    assert on_tiles(path) == on


def test_fuse_and_vectorize_ir(kernel_file):
    """@fuse: h's row block packed in pairs once, before the class loop, and W's class tile
    (256 classes: amx_class_tile) read in pairs in place by the 4-loop contraction; @vectorize: that contraction cut into
    32 x 32 tiles stepping over 16 pairs, left a linalg.generic marked for the target."""
    path = kernel(kernel_file, **SMALL)
    fused = str(compile_amx(path, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall
        CHECK: tensor.expand_shape {{.*}} into tensor<32x32x2xbf16>
        CHECK: linalg.transpose ins(%{{.*}} : tensor<32x32x2xbf16>) outs(%{{.*}} : tensor<32x32x2xbf16>) permutation = [1, 0, 2]
        CHECK: scf.for
        CHECK: tensor.expand_shape {{.*}} into tensor<256x32x2xbf16>
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction", "reduction"]
        CHECK-SAME: tensor<32x32x2xbf16>, tensor<256x32x2xbf16>
        CHECK-SAME: outs(%{{.*}} : tensor<256x32xf32>)
        CHECK-SAME: lh.amx_logits
    """)
    vectorized = str(compile_amx(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.for
        CHECK: scf.for
        CHECK: scf.for
        CHECK: linalg.generic
        CHECK-SAME: ins(%{{.*}}, %{{.*}} : tensor<16x32x2xbf16>, tensor<32x16x2xbf16>)
        CHECK-SAME: outs(%{{.*}} : tensor<32x32xf32>)
        CHECK-SAME: lh.target_kernel
    """)


@needs_amx
def test_the_steps_run_on_tiles_after_bufferization(kernel_file):
    """On a host that grants the tile registers, each 32 x 32 output tile's loop over the
    depth becomes 2 x 2 accumulator tiles carried by the loop, 4 tdpbf16ps per step."""
    bufferized = str(compile_amx(kernel(kernel_file, **SMALL), stop_after="bufferize").module)
    filecheck(bufferized, """
        CHECK: scf.parallel
        CHECK: x86.amx.tile_load {{.*}} into !x86.amx.tile<16x16xf32>
        CHECK: scf.for {{.*}} iter_args
        CHECK-COUNT-4: x86.amx.tile_mulf
        CHECK: x86.amx.tile_store
    """)
    assert "lh.target_kernel" not in bufferized


def test_backward_products_are_left_to_the_target(kernel_file):
    """The joint graph: the forward's logits tile and the fused backward's S^T, dW and dh
    (extents multiples of 32) are each cut into 32 x 32 steps marked for the target (on AMX
    tiles the backward recomputes S^T: no stored logits, though they fit the budget); W is
    packed in pairs of classes once, outside the loop over the row blocks."""
    vectorized = str(compile_amx(kernel(kernel_file, **{**SMALL, "n": 768}), backward=True,
                                 stop_after="vectorize").module)  # three blocks of 256 rows
    assert vectorized.count("lh.target_kernel") == 4
    assert "tensor<512x768xf32>" not in vectorized
    filecheck(vectorized, """
        CHECK: tensor<256x64x2xbf16>
        CHECK: scf.for {{.*}} {
        CHECK: lh.target_kernel
        CHECK: } {lh.fused_kernel}
    """)
