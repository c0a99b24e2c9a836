"""The generic schedule on ops that read a tensor transposed (y[j, i] = f(x[i, j])): forall
tiles in square blocks, vector tiles of lanes x lanes read in rows and transposed in
registers (transform_ext.analysis.tiles.transposed_dim), partial tiles peeled, any element
type; numerics against torch."""

import pytest
import torch

from tests.schedules.test_generic import _assert_matches, _compile as _compile_args
from tests.transform_ext.helpers import check as filecheck


def _compile(kernel_file, expr, inputs, args="x", **kw):
    return _compile_args(kernel_file, expr, inputs, args, **kw)


def test_a_transpose_is_read_in_rows_and_transposed_in_registers(kernel_file):
    """x.t().contiguous() of [256, 192] f32 (tests: 16 lanes, 2 threads): the rows' tiles
    for the threads (8 of 24 rows, 6144 elements) become square forall blocks of as many
    elements at most, 64 x 64 (multiples of 16 at most sqrt(6144) = 78 dividing 192 and
    256); each 16 x 16 vector tile one transfer_read of rows and one vector.transpose; after
    the lowering, shuffles."""
    source = "[torch.randn(256, 192, generator=g)]"
    fused = str(_compile(kernel_file, "x.t().contiguous()", source, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall (%{{.*}}, %{{.*}}) = (0, 0) to (192, 256) step (64, 64)
    """)
    vectorized = str(_compile(kernel_file, "x.t().contiguous()", source,
                              stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: vector.transfer_read %{{.*}} : tensor<256x192xf32>, vector<16x16xf32>
        CHECK: vector.transpose %{{.*}}, [1, 0] : vector<16x16xf32> to vector<16x16xf32>
        CHECK-NOT: vector<{{[0-9]+}}x1xf32>
    """)
    lowered = str(_compile(kernel_file, "x.t().contiguous()", source,
                           stop_after="bufferize").module)
    filecheck(lowered, """
        CHECK: vector.shuffle %{{.*}}, %{{.*}} [0, 16, 1, 17, 4, 20, 5, 21
        CHECK-NOT: vector.transpose
    """)


def test_partial_tiles_along_both_dims_are_peeled(kernel_file):
    """[40, 24] (neither a multiple of 16): 16 x 16 tiles, the partial last tile of each dim
    peeled into a static tile of its own (innermost first: peeling the outer loop first
    invalidated the inner one's handle, and the whole kernel fell back to scalar loops)."""
    source = "[torch.randn(40, 24, generator=g)]"
    c = _compile(kernel_file, "x.t().contiguous()", source, stop_after="vectorize")
    assert c.family.name == "generic" and not c.notes, c.notes
    filecheck(str(c.module), """
        CHECK-DAG: vector.transpose %{{.*}}, [1, 0] : vector<16x16xf32> to vector<16x16xf32>
        CHECK-DAG: vector.transpose %{{.*}}, [1, 0] : vector<8x16xf32> to vector<16x8xf32>
        CHECK-DAG: vector.transpose %{{.*}}, [1, 0] : vector<16x8xf32> to vector<8x16xf32>
        CHECK-DAG: vector.transpose %{{.*}}, [1, 0] : vector<8x8xf32> to vector<8x8xf32>
    """)
    _assert_matches(_compile(kernel_file, "x.t().contiguous()", source))


@pytest.mark.parametrize("dtype", ["bfloat16", "float64", "int8", "bool"])
def test_other_element_types_take_the_tiles_too(kernel_file, dtype):
    """16 x 16 tiles whatever the element type (a 2048^2 bf16 transpose: 0.15x -> 2.85x
    torch; f64 0.84x -> 3.5x; int8 0.16x -> 5.05x)."""
    make = "torch.randn(48, 32, generator=g) > 0" if dtype == "bool" else \
        f"(torch.randn(48, 32, generator=g) * 50).to(torch.{dtype})"
    c = _compile(kernel_file, "x.t().contiguous()", f"[{make}]", stop_after="vectorize")
    assert c.family.name == "generic" and not c.notes, c.notes
    filecheck(str(c.module), """
        CHECK: vector.transpose %{{.*}}, [1, 0] : vector<16x16x{{.*}}> to vector<16x16x
    """)
    _assert_matches(_compile(kernel_file, "x.t().contiguous()", f"[{make}]"))


@pytest.mark.parametrize("expr, inputs, args", [
    ("x.t().contiguous()", "[torch.randn(256, 192, generator=g)]", "x"),
    # an elementwise op after the transpose (the forall tiles of its chain), a second input
    # read in place, and a second use of the transposed result
    ("(x.t() * 0.5 + y).contiguous()",
     "[torch.randn(96, 160, generator=g), torch.randn(160, 96, generator=g)]", "x, y"),
    ("(x.t() * 2, x.t().exp())", "[torch.randn(48, 64, generator=g)]", "x"),
    # a batched transpose of the last two dims, and of the first two with a row inside
    ("x.transpose(1, 2).contiguous()", "[torch.randn(3, 80, 48, generator=g)]", "x"),
    ("x.permute(2, 1, 0).contiguous()", "[torch.randn(32, 5, 48, generator=g)]", "x"),
    # integers of 32 bits, and a transposed view as the input of a product's neighbour
    ("x.t().contiguous() + 1", "[torch.randint(-9, 9, (64, 32), generator=g, dtype=torch.int32)]", "x"),
    ("torch.relu(x.t()) @ y", "[torch.randn(64, 48, generator=g), torch.randn(64, 32, generator=g)]",
     "x, y"),
    # a row reduction on the transposed input: its rows are not split
    ("torch.softmax(x.t(), dim=-1)", "[torch.randn(96, 64, generator=g)]", "x"),
    # sizes that are not multiples of the lanes (peeled tiles; blocks of a divisor), fewer
    # rows than the lanes (lanes along the output), a mixed chain
    ("x.t().contiguous()", "[torch.randn(37, 24, generator=g)]", "x"),
    ("x.t().contiguous()", "[torch.randn(125, 250, generator=g)]", "x"),
    ("x.t().contiguous()", "[torch.randn(1, 64, generator=g)]", "x"),
    ("x.t().contiguous()", "[torch.randn(7, 64, generator=g)]", "x"),
    ("x.t().float() * 2", "[torch.randn(64, 48, generator=g).to(torch.float16)]", "x"),
])
def test_transposes_match_torch(kernel_file, expr, inputs, args):
    _assert_matches(_compile(kernel_file, expr, inputs, args))


@pytest.mark.parametrize("threads, step", [(1, 64), (2, 32)])
def test_blocks_hold_as_many_elements_as_the_row_tiles(kernel_file, threads, step):
    """[128, 128]: threads x 4 row tiles (4096 or 2048 elements) become square blocks of as
    many elements at most: 64 x 64 on one thread, 32 x 32 on two."""
    source = "[torch.randn(128, 128, generator=g)]"
    fused = str(_compile(kernel_file, "x.t().contiguous()", source, threads=threads,
                         stop_after="fuse").module)
    filecheck(fused, f"CHECK: scf.forall (%{{{{.*}}}}, %{{{{.*}}}}) = (0, 0) to (128, 128) "
                     f"step ({step}, {step})")
    _assert_matches(_compile(kernel_file, "x.t().contiguous()", source, threads=threads))


def test_a_pooling_layout_change_keeps_its_row_tiles(kernel_file):
    """A 3-D average pooling goes through a channels-last copy and back: the root (the copy
    back, [N, C, D, H, W] reading [N, D, H, W, C]) keeps the tiles sized for the cache (one
    batch, half of the channels) where 16 x 16 blocks of channels and columns under whole
    depths and rows held twice as many elements (its intermediate past L2: KernelBench 46
    2x slower)."""
    expr = "torch.nn.functional.avg_pool3d(x, 3, 2, 1)"
    source = "[torch.randn(4, 16, 32, 32, 32, generator=g)]"
    fused = str(_compile(kernel_file, expr, source, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall (%{{.*}}, %{{.*}}) = (0, 0) to (4, 16) step (1, 8)
    """)
    _assert_matches(_compile(kernel_file, expr, source))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pairs_move_as_words(kernel_file, dtype):
    """A copy transposing 16-bit pairs, as an AMX operand's pack (transform_ext.analysis.
    tiles.pair_lane_sizes): [R, K/2, 2] -> [K/2, R, 2] in 16 x 16 tiles of pairs transposed
    as 32-bit words (transform_ext.transpose_pairs_as_words), not one pair per step; two
    rows interleaved, [K/2, 2, N] -> [K/2, N, 2], keep the tiles they had. Against torch."""
    source = f"[torch.randn(64, 96, generator=g).to(torch.{dtype})]"
    words = "x.view(64, 48, 2).transpose(0, 1).contiguous()"
    vectorized = str(_compile(kernel_file, words, source, stop_after="vectorize").module)
    filecheck(vectorized, f"""
        CHECK: vector.transfer_read {{{{.*}}}} vector<16x16x2x{'bf16' if dtype == 'bfloat16' else 'f16'}>
        CHECK: vector.bitcast {{{{.*}}}} to vector<16x16xi32>
        CHECK: vector.transpose %{{{{.*}}}}, [1, 0] : vector<16x16xi32> to vector<16x16xi32>
    """)
    _assert_matches(_compile(kernel_file, words, source))
    rows = "x.view(32, 2, 96).transpose(1, 2).contiguous()"
    vectorized = str(_compile(kernel_file, rows, source, stop_after="vectorize").module)
    assert "i32>" not in vectorized
    _assert_matches(_compile(kernel_file, rows, source))


@pytest.mark.parametrize("expr", [
    "torch.softmax(x.t(), dim=-1)",
    "torch.nn.functional.layer_norm(x.t(), (1024,))",
    "torch.log_softmax(x.t() * 2.0, dim=-1)",
])
def test_rows_of_a_transposed_input_are_tiled_in_whole_cache_lines(kernel_file, expr):
    """A row-wise chain over x.t() (x [1024, 64]: 64 rows of 1024, each row a column of x)
    reduces each row whole, so its lanes cannot be split; its forall tiles take 16 rows
    (x's contiguous dim: one 64-byte line of each of x's rows), where the L1 budget of a
    row chain gave 4 (softmax(x.t()) of 2048 x 2048: 0.36x torch, 1.9x in 16 rows)."""
    source = "[torch.randn(1024, 64, generator=g)]"
    fused = str(_compile(kernel_file, expr, source, stop_after="fuse").module)
    filecheck(fused, """
        CHECK: scf.forall (%{{.*}}) = (0) to (64) step (16)
        CHECK: linalg.transpose ins(%{{.*}} : tensor<1024x16xf32>) outs(%{{.*}} : tensor<16x1024xf32>)
    """)
    _assert_matches(_compile(kernel_file, expr, source))


def _assert_equal(compiled):
    """Every result bit for bit equal to torch's (a transpose only moves elements)."""
    for got, want in zip(compiled.run(), compiled.expected()):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int16"])
def test_16_bit_transposes_move_whole_lines_as_word_pairs(kernel_file, dtype):
    """[512, 1024] of 16-bit elements (forall blocks of 256 x 256): 32 x 32 vector tiles,
    each row one 64-byte line, stepped along the input's rows innermost (the write's row
    index is the inner loop's); lowered to unpacks of row pairs by 128-bit lanes and 16 x 16
    word transposes in shuffles, no vector.transpose left. Bit for bit against torch, on
    distinct values for int16 (any misplaced element shows)."""
    make = "torch.arange(512 * 1024).view(512, 1024).to(torch.int16)" if dtype == "int16" \
        else f"(torch.randn(512, 1024, generator=g) * 50).to(torch.{dtype})"
    source = f"[{make}]"
    vectorized = str(_compile(kernel_file, "x.t().contiguous()", source,
                              stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.for %[[OUTER:.*]] = %{{.*}} to %{{.*}} step %c32
        CHECK: scf.for %[[INNER:.*]] = %{{.*}} to %{{.*}} step %c32
        CHECK: vector.transfer_read {{.*}} vector<32x32x
        CHECK: vector.transpose %{{.*}}, [1, 0] : vector<32x32x
        CHECK: vector.transfer_write %{{.*}}, %{{.*}}[%[[INNER]], %[[OUTER]]] {{.*}} : vector<32x32x
    """)
    lowered = str(_compile(kernel_file, "x.t().contiguous()", source,
                           stop_after="bufferize").module)
    filecheck(lowered, """
        CHECK: vector.shuffle %{{.*}}, %{{.*}} [0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41
        CHECK: vector.shuffle %{{.*}}, %{{.*}} [4, 36, 5, 37, 6, 38, 7, 39, 12, 44
        CHECK-NOT: vector.transpose
    """)
    _assert_equal(_compile(kernel_file, "x.t().contiguous()", source))


@pytest.mark.parametrize("expr, inputs, args", [
    # a second input read in place: the transpose is a copy of its own in the tile, then
    # the elementwise op reads both in rows
    ("(x.t() * 0.5 + y).contiguous()",
     "[torch.randn(512, 256, generator=g).bfloat16(), torch.randn(256, 512, generator=g).bfloat16()]",
     "x, y"),
    # a batched transpose of 16-bit elements, a second use, and extents that are not
    # multiples of 32 (16 x 16 tiles, peeled) or of 16
    ("x.transpose(1, 2).contiguous()", "[torch.randn(3, 64, 96, generator=g).half()]", "x"),
    ("(x.t().contiguous(), x.t() * 2)", "[torch.randn(96, 64, generator=g).bfloat16()]", "x"),
    ("x.t().contiguous()", "[torch.randn(48, 96, generator=g).bfloat16()]", "x"),
    ("x.t().contiguous()", "[torch.randn(70, 45, generator=g).bfloat16()]", "x"),
    # a transposed bf16 input widened on the way
    ("x.t().float()", "[torch.randn(64, 128, generator=g).bfloat16()]", "x"),
])
def test_16_bit_transposes_match_torch(kernel_file, expr, inputs, args):
    _assert_matches(_compile(kernel_file, expr, inputs, args))
