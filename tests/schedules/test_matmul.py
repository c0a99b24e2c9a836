"""The matmul family: numerics against torch (shapes that do not divide the tiles, batch,
transposed operands, epilogues, f16/bf16), the IR it produces, its parameters, and that the
driver picks it for contraction payloads."""

import re

import pytest
import torch
from torch_mlir import ir

from lighthouse.compile import compile_kernel
from lighthouse.errors import ScheduleMismatch
from lighthouse.families import MATMUL, choose_family
from schedules.matmul import MatmulParams, check, recognize
from tests.conftest import EXAMPLES
from tests.transform_ext.helpers import check as filecheck

BINARY = """
import torch
M, N, K, B = {m}, {n}, {k}, {b}
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def forward(self, a, b):
        return {expr}

def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({a_shape}, generator=g).to(DTYPE), torch.randn({b_shape}, generator=g).to(DTYPE)]

def get_init_inputs():
    return []
"""


def binary_kernel(kernel_file, m, n, k, *, b=1, dtype="float32", expr="a @ b", a_shape="M, K",
                  b_shape="K, N"):
    return kernel_file(BINARY.format(m=m, n=n, k=k, b=b, dtype=dtype, expr=expr,
                                     a_shape=a_shape, b_shape=b_shape))


def assert_matches(compiled):
    assert compiled.family.name == "matmul", compiled.notes
    reports = compiled.check()
    assert reports
    for r in reports:
        assert r.ok, str(r)


@pytest.mark.parametrize("m,n,k", [
    (96, 96, 96),        # divides the register tile
    (127, 255, 63),      # nothing divides: padded panels, masked edge tiles
    (300, 200, 600),     # several k blocks (the last one partial) and row blocks
    (9, 33, 17),         # one register tile plus a sliver in each direction
])
def test_matmul_f32(kernel_file, m, n, k):
    assert_matches(compile_kernel(binary_kernel(kernel_file, m, n, k)))


def test_matmul_1000(kernel_file):
    """The issue's non-dividing size: 1000 is no multiple of the 32-wide register tile."""
    assert_matches(compile_kernel(binary_kernel(kernel_file, 1000, 1000, 1000)))


def test_skinny_matmul_reads_operands_in_place(kernel_file):
    """Fewer rows than the register tile: no packing (pack=False), masked register tiles."""
    assert not MatmulParams.for_shape(1, 3, 50, 20).pack
    assert_matches(compile_kernel(binary_kernel(kernel_file, 3, 50, 20)))


@pytest.mark.parametrize("m", [2, 4, 7])
def test_a_small_batch_through_a_transposed_weight_is_packed(kernel_file, m):
    """x @ W^T with fewer rows than the register tile and a k too short to split into
    lanes (transform_ext.split_matvec_lanes wants k >= 2 x 16; longer ones are split, see
    tests/schedules/test_short_products.py): B is packed (folding W's transpose, so W is
    read in place and repacked per tile) instead of read in place through a transposed
    copy of the whole of W (a 4 x 4096 @ 4096 x 4096 product spent most of its time
    writing that copy: 0.20x torch eager); odd n and k, against torch."""
    path = binary_kernel(kernel_file, m, 70, 29, expr="a @ b.T", a_shape="M, K", b_shape="N, K")
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert "linalg.transpose" not in fused
    assert "linalg.pack" in fused
    assert_matches(compile_kernel(path, runtime_checks=True))


def test_batch_matmul(kernel_file):
    path = binary_kernel(kernel_file, 37, 45, 29, b=3, expr="torch.bmm(a, b)", a_shape="B, M, K",
                         b_shape="B, K, N")
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("expr,a_shape,b_shape", [
    ("a @ b.T", "M, K", "N, K"),       # nn.Linear's x @ w.T
    ("a.T @ b.T", "K, M", "N, K"),     # both operands transposed
])
def test_transposed_operands(kernel_file, expr, a_shape, b_shape):
    path = binary_kernel(kernel_file, 50, 70, 90, expr=expr, a_shape=a_shape, b_shape=b_shape)
    compiled = compile_kernel(path, stop_after="fuse")
    assert "linalg.transpose" not in str(compiled.module)  # folded into the packing
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("m,n,k", [(64, 96, 256), (37, 75, 300)])
def test_a_transposed_weights_pack_shuffles_16_x_16_blocks(kernel_file, m, n, k):
    """x @ W^T packs W's rows (k contiguous) into B's [k, NR] panels: each packing step
    transposes [NR, pack_k] = [32, 16]. The vectorize stage leaves it a vector.transpose,
    which the CPU target lowers in 16 x 16 blocks of register shuffles; lowered as one
    512-lane shuffle, it took 32 registers in and 32 out, spilled, and made the pack a third
    of a 128 x 8192 @ 8192 x 8192 product's time (KernelBench level 2's 56: 0.80x -> 0.89x
    torch). Odd sizes against torch, with run-time checks."""
    path = binary_kernel(kernel_file, m, n, k, expr="a @ b.T", a_shape="M, K", b_shape="N, K")
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    assert "vector<1x32x16xf32> to vector<1x16x32xf32>" in vectorized  # B's step, unlowered
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    assert "vector.transpose" not in bufferized
    assert "vector<512xf32>, vector<512xf32>" not in bufferized
    filecheck(bufferized, """
        CHECK: vector.shuffle {{.*}} : vector<16xf32>, vector<16xf32>
    """)
    assert_matches(compile_kernel(path, runtime_checks=True))


@pytest.mark.parametrize("m,n,k,expr,b_shape,per_panel", [
    (128, 200, 520, "a @ b.T", "N, K", True),     # W^T from W's rows, partial last k block
    (37, 33, 300, "a @ b.T + 1", "N, K", True),   # an epilogue: C_p, unpacked at the end
    (100, 75, 600, "a @ b", "K, N", False),       # n-contiguous B: packed a k block at a time
])
def test_one_block_of_rows_packs_b_a_panel_at_a_time(kernel_file, m, n, k, expr, b_shape,
                                                     per_panel):
    """An output tile of at most PANEL_ROWS rows over several k blocks: A's k block packed
    whole; a k-contiguous B's micro-panels packed inside the loop over them, each right
    before its register tiles (an n-contiguous B keeps its whole-tile pack, which reads
    each of B's rows across the panels). Against torch with run-time checks (the panel
    slices' bounds)."""
    path = binary_kernel(kernel_file, m, n, k, expr=expr, a_shape="M, K", b_shape=b_shape)
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    panel_loop = re.search(r"scf\.for .* -> \(tensor<1x(\d+|\?)x32xf32>\)", vectorized)
    assert bool(panel_loop) == per_panel, vectorized
    assert_matches(compile_kernel(path, runtime_checks=True))


def test_mlp_example_with_bias_and_gelu_epilogue():
    sizes = {"BATCH": 40, "IN_FEATURES": 72, "HIDDEN": 136, "OUT_FEATURES": 50}
    assert_matches(compile_kernel(EXAMPLES / "mlp.py", overrides=sizes))


def test_a_linear_layer_after_a_flatten(kernel_file):
    """x.flatten(1) @ W^T: the flatten the elementwise fusion folds into the contraction
    (three reduction loops) is collapsed back (transform_ext.collapse_reduction_dims), so
    the layer is packed with its weight's transpose folded in."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.fc = torch.nn.Linear(6 * 5 * 3, 41)
            def forward(self, x):
                return torch.relu(self.fc(torch.flatten(x, 1)))
        def get_inputs():
            g = torch.Generator().manual_seed(1)
            return [torch.randn(37, 6, 5, 3, generator=g)]
        def get_init_inputs():
            return []
        """)
    assert_matches(compile_kernel(path))
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert 'lh.mm_role = "pack_b"' in fused and "linalg.transpose" not in fused


def test_a_bf16_contraction_left_to_the_vector_tiles(kernel_file):
    """The fuzzer: the backward of a bf16 x.t() @ y broadcast over a batch of y holds a
    contraction the schedule leaves to the generic vector tiles (its reduction loops
    collapsed into one by transform_ext.collapse_reduction_dims); their k step is 1 there
    (the family's parameters were read as the tiles' policy and had none)."""
    path = kernel_file("""
        import torch
        DTYPE = torch.bfloat16
        class Model(torch.nn.Module):
            def forward(self, x0, x1):
                return torch.tanh(torch.relu(x0.t() @ x1))
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            x0 = torch.randn(63, 33, generator=g).to(DTYPE).t()
            x1 = (torch.randn(3, 33, 63, generator=g) * 0.174).to(DTYPE)
            return [x0, x1]
        def get_init_inputs():
            return []
        """)
    compiled = compile_kernel(path, backward=True)
    assert not compiled.notes, compiled.notes
    assert_matches(compiled)


def test_addmm_and_a_softmax_consumer(kernel_file):
    """A non-zero accumulator init and a reduction after the contraction (tiled like the
    generic schedule does)."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, c, a, b):
                return torch.softmax(torch.addmm(c, torch.relu(a), b, beta=0.5, alpha=2.0), dim=-1)
        def get_inputs():
            g = torch.Generator().manual_seed(1)
            return [torch.randn(61, 93, generator=g), torch.randn(61, 45, generator=g),
                    torch.randn(45, 93, generator=g)]
        def get_init_inputs():
            return []
        """)
    assert_matches(compile_kernel(path))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,b", [(40, 72, 1024, 1), (37, 45, 300, 3)])
def test_half_inputs_accumulate_in_f32(kernel_file, dtype, m, n, k, b):
    """torch rounds an f32 accumulation once; a 16-bit accumulator over k = 1024 would be
    off by many ulps. Ours must be within one ulp of torch's result (edges, k blocks and
    a batch included: the operands are widened to f32 while they are packed)."""
    expr, a_shape, b_shape = ("torch.bmm(a, b)", "B, M, K", "B, K, N") if b > 1 else ("a @ b", "M, K", "K, N")
    compiled = compile_kernel(binary_kernel(kernel_file, m, n, k, b=b, dtype=dtype, expr=expr,
                                            a_shape=a_shape, b_shape=b_shape))
    assert compiled.family.name == "matmul"
    (got,) = compiled.run()
    (want,) = compiled.imported.reference()
    assert got.dtype == want.dtype == getattr(torch, dtype)
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(1.0)
    assert ((got.float() - want.float()).abs() <= ulp).all()


def test_half_operands_are_widened_while_packing(kernel_file):
    text = str(compile_kernel(binary_kernel(kernel_file, 64, 64, 64, dtype="bfloat16"),
                              stop_after="vectorize").module)
    filecheck(text, """
        CHECK-DAG: vector.transfer_read {{.*}} : tensor<16x32xbf16>, vector<16x32xbf16>
        CHECK-DAG: arith.shli {{.*}} : vector<16x32xi32>
        CHECK-DAG: vector.transfer_write {{.*}} : vector<16x32xf32>, tensor<1x16x32xf32>
        CHECK-DAG: vector.transfer_read {{.*}} : tensor<8x16xbf16>, vector<8x16xbf16>
        CHECK-DAG: vector.transfer_write {{.*}} : vector<16x8xf32>, tensor<1x16x8xf32>
        CHECK: vector.contract {{.*}} : vector<1x8xf32>, vector<1x32xf32> into vector<8x32xf32>
        CHECK: arith.truncf {{.*}} : vector<8x32xf32> to vector<8x32xbf16>
        """)


def test_ir_after_vectorize_and_bufferize(kernel_file):
    """Two k blocks: C's tile starts from zeros written per register tile, then each k block
    packs A's block (its 128 rows whole, PANEL_ROWS; the transposing step left a
    vector.transpose for the target) and B's panels (n-contiguous: the whole tile's, a
    k block at a time), and every register tile accumulates in C itself, four k steps per
    iteration of its loop; no packed C buffer, no unpack."""
    path = binary_kernel(kernel_file, 256, 256, 512)
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    filecheck(vectorized, """
        CHECK: scf.forall
        CHECK: vector.transfer_write {{.*}} : vector<8x32xf32>, tensor<8x32xf32>
        CHECK: scf.for
        CHECK: vector.transfer_read {{.*}} : tensor<8x16xf32>, vector<8x16xf32>
        CHECK: vector.transpose {{.*}} to vector<1x16x8xf32>
        CHECK: vector.transfer_write {{.*}} : vector<16x8xf32>, tensor<1x16x8xf32>
        CHECK: scf.for {{.*}} -> (tensor<8x256x32xf32>)
        CHECK: vector.transfer_read {{.*}} : tensor<16x32xf32>, vector<16x32xf32>
        CHECK: vector.transfer_write {{.*}} : vector<16x32xf32>, tensor<1x16x32xf32>
        CHECK: %[[ACC:.*]] = vector.transfer_read {{.*}} : tensor<8x32xf32>, vector<8x32xf32>
        CHECK: scf.for {{.*}} iter_args(%{{.*}} = %[[ACC]]) -> (vector<8x32xf32>)
        CHECK-COUNT-4: vector.contract {{.*}} : vector<1x8xf32>, vector<1x32xf32> into vector<8x32xf32>
        CHECK: vector.transfer_write {{.*}} : vector<8x32xf32>, tensor<8x32xf32>
        CHECK: scf.forall.in_parallel
        """)
    assert "linalg." not in vectorized
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    filecheck(bufferized, """
        CHECK-NOT: memref<{{.*}}x8x32xf32>
        CHECK: scf.parallel
        CHECK: %[[ACC:.*]] = vector.transfer_read {{.*}} : memref<8x32xf32, strided<[256, 1], offset: ?>>, vector<8x32xf32>
        CHECK: scf.for {{.*}} iter_args(%{{.*}} = %[[ACC]]) -> (vector<8x32xf32>)
        CHECK-COUNT-32: vector.fma {{.*}} : vector<32xf32>
        CHECK: scf.yield
        CHECK: vector.transfer_write {{.*}} : vector<8x32xf32>, memref<8x32xf32, strided<[256, 1], offset: ?>>
        """)


@pytest.mark.parametrize("m, n, k, b, expr, a_shape, b_shape, in_c", [
    (64, 96, 600, 1, "a @ b", "M, K", "K, N", True),                  # three k blocks, the last short
    (64, 48, 513, 1, "(a @ b).t()", "M, K", "K, N", True),            # C transposed: C^T [48, 64]
    (32, 64, 300, 2, "torch.bmm(a, b)", "B, M, K", "B, K, N", True),  # batched
    (64, 32, 640, 1, "a.t() @ b.t()", "K, M", "N, K", True),          # transposed operands
    (64, 96, 600, 1, "(a @ b)[:, :50]", "M, K", "K, N", True),        # a slice of C after
    (40, 64, 520, 1, "torch.relu(a @ b) * 2", "M, K", "K, N", False), # an epilogue: C_p kept
    (61, 70, 530, 1, "a @ b", "M, K", "K, N", False),                 # padded tiles: C_p kept
])
def test_k_blocks_accumulate_in_c(kernel_file, m, n, k, b, expr, a_shape, b_shape, in_c):
    """Several k blocks of an unpadded product with nothing after it accumulate in C itself
    (transform_ext.accumulate_in_unpacked_output); its neighbours: C transposed, a batch,
    transposed operands, a slice of C, and an epilogue or tiles that need padding (which
    keep the packed C and its unpack)."""
    path = binary_kernel(kernel_file, m, n, k, b=b, expr=expr, a_shape=a_shape, b_shape=b_shape)
    assert_matches(compile_kernel(path))
    fused = str(compile_kernel(path, stop_after="fuse").module)
    assert ("linalg.unpack" not in fused) == in_c


def test_one_k_block_accumulates_in_registers_only(kernel_file):
    """k within one k block: each register tile starts from zeros in registers and is
    written straight into C (edge tiles too): no packed C buffer, no fill pass over it."""
    path = binary_kernel(kernel_file, 127, 255, 63)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    filecheck(bufferized, """
        CHECK: %[[ZERO:.*]] = arith.constant dense<0.000000e+00> : vector<8x32xf32>
        CHECK-NOT: memref.alloc() {{.*}} : memref<{{.*}}x8x32xf32>
        CHECK: scf.parallel
        CHECK: %[[STEPS:.*]] = scf.for {{.*}} iter_args(%{{.*}} = %[[ZERO]]) -> (vector<8x32xf32>)
        CHECK-COUNT-32: vector.fma {{.*}} : vector<32xf32>
        CHECK: %[[ACC:.*]] = scf.for {{.*}} iter_args(%{{.*}} = %[[STEPS]]) -> (vector<8x32xf32>)
        CHECK: vector.transfer_write %[[ACC]], %{{.*}} : vector<8x32xf32>, memref<8x32xf32, strided<[255, 1], offset: ?>>
        CHECK: vector.transfer_write %[[ACC]], %{{.*}} : vector<8x32xf32>, memref<?x?xf32, strided<[255, 1], offset: ?>>
        """)


def test_epilogue_is_fused_into_the_output_tiles():
    sizes = {"BATCH": 64, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 64}
    text = str(compile_kernel(EXAMPLES / "mlp.py", overrides=sizes, stop_after="fuse").module)
    filecheck(text, """
        CHECK: scf.forall
        CHECK: linalg.generic {{.*}}lh.mm_role = "kernel"
        CHECK: linalg.unpack {{.*}}lh.mm_role = "unpack"
        CHECK: linalg.generic {{.*}}lh.mm_role = "epilogue"
        CHECK: math.erf
        CHECK: scf.forall.in_parallel
        CHECK: scf.forall
        CHECK: linalg.unpack {{.*}}lh.mm_role = "unpack"
        CHECK: linalg.generic {{.*}}lh.mm_role = "epilogue"
        CHECK: scf.forall.in_parallel
        """)


def test_family_is_chosen_for_contraction_payloads():
    for name, sizes in [("matmul", {"N": 64}), ("mlp", {"BATCH": 16})]:
        compiled = compile_kernel(EXAMPLES / f"{name}.py", overrides=sizes, stop_after="cleanup")
        assert compiled.family is MATMUL, name
    compiled = compile_kernel(EXAMPLES / "softmax.py", overrides={"N": 8, "C": 40}, stop_after="cleanup")
    assert compiled.family.name == "generic"


def _parse(text):
    return ir.Module.parse(text, ir.Context())


def test_check_names_the_reason():
    dynamic = _parse("""
        func.func @main(%a: tensor<?x8xf32>, %b: tensor<8x16xf32>, %c: tensor<?x16xf32>) -> tensor<?x16xf32> {
          %r = linalg.matmul ins(%a, %b : tensor<?x8xf32>, tensor<8x16xf32>) outs(%c : tensor<?x16xf32>) -> tensor<?x16xf32>
          return %r : tensor<?x16xf32>
        }""")
    assert recognize(dynamic)
    assert "dynamic shapes" in check(dynamic)
    integer = _parse("""
        func.func @main(%a: tensor<16x8xi32>, %b: tensor<8x16xi32>, %c: tensor<16x16xi32>) -> tensor<16x16xi32> {
          %r = linalg.matmul ins(%a, %b : tensor<16x8xi32>, tensor<8x16xi32>) outs(%c : tensor<16x16xi32>) -> tensor<16x16xi32>
          return %r : tensor<16x16xi32>
        }""")
    assert "element type i32" in check(integer)
    notes = []
    assert choose_family(integer, notes=notes).name == "generic"
    assert "the matmul schedule does not apply" in notes[0]
    with pytest.raises(ScheduleMismatch, match="element type i32"):
        choose_family(integer, strict=True)


def test_requested_on_a_payload_without_contraction_falls_back_with_a_note():
    elementwise = _parse("""
        func.func @main(%a: tensor<16xf32>, %c: tensor<16xf32>) -> tensor<16xf32> {
          %r = linalg.add ins(%a, %a : tensor<16xf32>, tensor<16xf32>) outs(%c : tensor<16xf32>) -> tensor<16xf32>
          return %r : tensor<16xf32>
        }""")
    assert not recognize(elementwise)
    notes = []
    assert choose_family(elementwise, requested="matmul", notes=notes).name == "generic"
    assert "no contraction" in notes[0]
    with pytest.raises(ScheduleMismatch, match="no contraction"):
        choose_family(elementwise, requested="matmul", strict=True)


def test_params_are_validated_and_fit_the_shapes():
    with pytest.raises(ValueError, match="tile_m"):
        MatmulParams(tile_m=60)
    with pytest.raises(ValueError, match="block_m"):
        MatmulParams(block_m=4)
    with pytest.raises(ValueError, match="register"):
        MatmulParams(register=(0, 32))
    p = MatmulParams.for_shape(1, 1024, 1024, 1024, threads=2)
    assert p.pack and p.register == (8, 32) and p.tile_k == 256
    tiles = -(-1024 // p.tile_m) * -(-1024 // p.tile_n)
    assert tiles % 2 == 0  # both threads get the same number of tiles
    # a square product on 2 threads splits its rows (B's copying pack repeats, not A's
    # transposing one); a wide one its columns
    square = MatmulParams.for_shape(1, 1024, 1024, 1024, threads=2, max_tile=1024)
    assert (square.tile_m, square.tile_n) == (512, 1024)
    wide = MatmulParams.for_shape(1, 512, 1024, 256, threads=2, max_tile=1024)
    assert (wide.tile_m, wide.tile_n) == (512, 512)
    p = MatmulParams.for_shape(1, 127, 255, 63, threads=2)
    assert p.tile_m % 8 == 0 and p.tile_n % 32 == 0 and p.tile_k == 63
    assert MatmulParams.for_shape(8, 64, 64, 64, threads=2).tile_m == 64  # batch feeds threads


def test_output_tiles_grow_to_what_l3_holds():
    """The output tile side is bounded by a quarter of the thread's L3 share (up to 1024),
    not by L2: A and B are repacked once per column / row of tiles."""
    from lighthouse.targets.description import CpuDescription
    from schedules.matmul import MAX_OUTPUT_TILE, max_output_tile

    def cpu(l2, l3, registers=16, bits=256):
        return CpuDescription(vector_bits=bits, vector_registers=registers, l1d_bytes=32 << 10,
                              l2_bytes=l2, l3_bytes=l3, threads=2, bf16_dot=False)

    avx2 = cpu(512 << 10, 32 << 20)
    assert max_output_tile(avx2, 1) == max_output_tile(avx2, 2) == MAX_OUTPUT_TILE == 1024
    # 2 MiB of L3 per thread: a quarter holds 256 x 256 f32; L2 alone allows the same
    assert max_output_tile(cpu(512 << 10, 4 << 20), 2) == 256
    # no L3 to speak of: half of L2 bounds it, as before
    assert max_output_tile(cpu(2 << 20, 1 << 20), 2) == 512
    one = MatmulParams.for_cpu(1, 1024, 1024, 1024, avx2, threads=1)
    assert (one.register, one.tile_m, one.tile_n, one.tile_k) == ((4, 16), 1024, 1024, 512)
    two = MatmulParams.for_cpu(1, 2048, 2048, 2048, avx2, threads=2)
    assert (two.tile_m, two.tile_n) == (1024, 1024)


# A consumer of C that is a transpose (or a zero-offset slice) folds into C's unpack: the
# unpack then writes C^T, and its output tiles, register tiles and epilogue follow the
# permuted destination dims. (Tiled as if it wrote C, the 8 x 32 tiles of C^T straddled
# packed tiles that vectorization read only in part: uninitialized results.)
TERNARY = """
import torch
M, K, N, B = {m}, {k}, {n}, 3

class Model(torch.nn.Module):
    def forward(self, a, b, c):
        return {expr}

def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [{a}, {b}, {c}]

def get_init_inputs():
    return []
"""
RANDN = "torch.randn({}, generator=g)"


def ternary_kernel(kernel_file, expr, a, b, c="1", m=40, k=24, n=72):
    return kernel_file(TERNARY.format(m=m, k=k, n=n, expr=expr, a=RANDN.format(a),
                                      b=RANDN.format(b), c=RANDN.format(c)))


@pytest.mark.parametrize("expr,a,b,c", [
    ("(a @ b).t()", "M, K", "K, N", "1"),
    ("(a @ b).t() + c", "M, K", "K, N", "N, M"),                  # epilogue after the transpose
    ("torch.nn.functional.linear(a, b).t()", "M, K", "N, K", "1"),  # a linear layer's output
    ("torch.bmm(a, b).transpose(0, 1).reshape(M, -1)", "B, M, K", "B, K, N", "1"),
    ("torch.bmm(a, b).permute(2, 0, 1) * 2.0", "B, M, K", "B, K, N", "1"),
])
@pytest.mark.parametrize("m,k,n", [(40, 24, 72), (64, 48, 80), (37, 53, 300)])
def test_transposed_result(kernel_file, expr, a, b, c, m, k, n):
    assert_matches(compile_kernel(ternary_kernel(kernel_file, expr, a, b, c, m=m, k=k, n=n)))


def test_a_transposed_result_is_a_product_of_its_own_and_the_epilogue_follows(kernel_file):
    """(a @ b).t() + c: C^T = b^T a^T is the product (transform_ext.
    fold_result_transposes_into_contractions), unpacked as it is into [8, 32] tiles that the
    epilogue reads along its rows (tests/schedules/test_matmul_transposed_results.py)."""
    path = ternary_kernel(kernel_file, "(a @ b).t() + c", "M, K", "K, N", "N, M", m=64, k=48, n=96)
    text = str(compile_kernel(path, stop_after="fuse").module)
    assert "linalg.transpose" not in text
    filecheck(text, """
        CHECK: scf.forall
        CHECK: linalg.generic {{.*}}lh.mm_role = "kernel"
        CHECK: linalg.unpack {{.*}} inner_dims_pos = [0, 1] inner_tiles = [8, 32] {{.*}}lh.mm_role = "unpack", lh.mm_vector = array<i64: 1, 1, 8, 32>{{.*}} : tensor<1x1x8x32xf32> -> tensor<8x32xf32>
        CHECK: linalg.generic {{.*}}lh.mm_role = "epilogue", lh.mm_vector = array<i64: 8, 32>
        CHECK: scf.forall.in_parallel
        """)


def test_backward_of_transposed_view_inputs(kernel_file):
    """The gradients of a @ b for transposed views a, b are matmuls followed by transposes."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, a, b):
                return a @ b
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(48, 64, generator=g).t(), torch.randn(80, 48, generator=g).t()]
        def get_init_inputs():
            return []
        """)
    assert_matches(compile_kernel(path, backward=True))


@pytest.mark.parametrize("expr", [
    "(a @ b, (a @ b).t())",                           # returned and transposed
    "(torch.relu(a @ b), (a @ b).t())",
    "(a @ b).t() * torch.sigmoid(a @ b).t()",
    "(a @ b) * torch.sigmoid(a @ b)",                 # read twice by one epilogue
    "(a @ b, torch.relu(a @ b))",                     # returned twice
    "(a @ b) + (a @ b).t()",
    "((a @ b)[:, 1:] * 2.0, (a @ b)[:, :5] + 1.0, (a @ b)[2:, ::2])",  # a slice at offset 0
    "(lambda x, y: x * torch.sigmoid(y))(*(a @ b).chunk(2, dim=1))",  # SwiGLU's halves
])
@pytest.mark.parametrize("m,k,n", [(40, 24, 40), (256, 64, 256)])
def test_product_used_twice(kernel_file, expr, m, k, n):
    """Two uses of C of which one folds into an unpack would unpack the packed C twice:
    nothing folds into the packs of such a contraction (one unpack for all uses)."""
    assert_matches(compile_kernel(ternary_kernel(kernel_file, expr, "M, K", "K, N", m=m, k=k, n=n)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_product_used_twice_with_transposed_operands(kernel_file, dtype):
    """Nothing folds into the packs: the transposes of A and B stay separate ops (and the
    16-bit widening still fuses into the packing), C is packed and unpacked once (one
    packed tile read by the full and the partial version of the unpack's tile)."""
    path = binary_kernel(kernel_file, 64, 96, 48, dtype=dtype, expr="(lambda c: (c, c.t() * 2))(a.t() @ b.t())",
                         a_shape="K, M", b_shape="N, K")
    text = str(compile_kernel(path, stop_after="fuse").module)
    sources = {line.split("linalg.unpack ")[1].split()[0] for line in text.splitlines()
               if "linalg.unpack " in line}
    assert len(sources) == 1, sources
    assert_matches(compile_kernel(path))


def test_slices_off_the_origin_keep_the_packed_schedule(kernel_file):
    """Only a slice at offset 0 folds into an unpack of its own: others leave C's unpack."""
    path = ternary_kernel(kernel_file, "((a @ b)[:, 1:] * 2.0, (a @ b)[3:7, 2:50])", "M, K", "K, N",
                          m=64, k=48, n=96)
    text = str(compile_kernel(path, stop_after="fuse").module)
    filecheck(text, """
        CHECK: linalg.generic {{.*}}lh.mm_role = "kernel"
        CHECK: linalg.unpack {{.*}}lh.mm_role = "unpack"
        """)
    assert_matches(compile_kernel(path))


def test_fill_shared_with_a_contraction_scheduled_elsewhere(kernel_file):
    """CSE merges the zero fills of two contractions of one shape; when only one of them
    is scheduled here (the other has k = 1), the fill stays whole for the other."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, a, b, c, d):
                return a @ b, c @ d
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(3, 20, generator=g), torch.randn(20, 50, generator=g),
                    torch.randn(3, 1, generator=g), torch.randn(1, 50, generator=g)]
        def get_init_inputs():
            return []
        """)
    assert_matches(compile_kernel(path))


def test_contraction_of_one_tile_before_another(kernel_file):
    """The last contraction is one 8 x 32 tile: its forall folds away and its packs and
    unpack stay at the top level, where the search for the next contraction must skip
    them."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, a, b, c):
                return torch.relu(a @ b) @ c
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(8, 16, generator=g), torch.randn(16, 20, generator=g),
                    torch.randn(20, 32, generator=g)]
        def get_init_inputs():
            return []
        """)
    assert_matches(compile_kernel(path, strict=True))


@pytest.mark.parametrize("expr", [
    "torch.sigmoid(a @ b) * (a @ b).sum(dim=1, keepdim=True)",
    "(lambda y: torch.tanh(y) / (1 + y.abs().sum(dim=1, keepdim=True)))(torch.nn.functional.gelu(a @ b))",
    "(lambda y: (y - y.mean(dim=1, keepdim=True)) * 2)(a @ b)",
    # row maxima: torch-mlir's max.dim also computes an argmax nothing reads (dropped)
    "(lambda y: torch.exp(y - y.amax(dim=1, keepdim=True)))(torch.nn.functional.gelu(a @ b))",
    "torch.logsumexp(a @ b, dim=1)",
])
def test_ops_after_a_product_of_rows_no_vector_divides_are_vectorized(kernel_file, expr):
    """Rows of 139 outputs (prime: no vector tile divides them) through elementwise ops and
    row reductions after the product (KernelBench level 2's Gemm chains at odd sizes): the
    ops outside the contraction's tiles are tiled as the generic schedule tiles them, the
    last partial tile of a row peeled into a static tile of its own, and all vectorized (a
    dynamic tile stayed a scalar loop); the results match torch."""
    path = binary_kernel(kernel_file, 40, 139, 64, expr=expr)
    compiled = compile_kernel(path)
    assert compiled.family.name == "matmul", compiled.notes
    vectorized = str(compile_kernel(path, stop_after="vectorize").module)
    assert "linalg." not in vectorized
    for r in compiled.check():
        assert r.ok, str(r)


@pytest.mark.parametrize("m, expr, b_shape", [
    # a transposed-view B, a transpose after the row max, and the product read twice
    (40, "(lambda y: (torch.exp(y - y.amax(dim=1, keepdim=True)).t(), y.sum(dim=1)))(a @ b.t())",
     "N, K"),
    # 17 rows, the row maxima read by a second reduction
    (17, "(lambda y: y / y.amax(dim=1, keepdim=True).abs().sum())(a @ b)", "K, N"),
])
def test_neighbours_of_ops_after_a_product_of_rows_no_vector_divides(kernel_file, m, expr,
                                                                   b_shape):
    """Neighbours of the rows of 139 above: B read through a transposed view, the row max's
    result transposed and the product summed beside it; the row maxima summed again. The
    matmul family takes both and the results match torch."""
    assert_matches(compile_kernel(binary_kernel(kernel_file, m, 139, 64, expr=expr,
                                                b_shape=b_shape)))


def test_a_row_reduction_after_a_product_of_no_rows(kernel_file):
    """A product of no rows under a logsumexp: every op's iteration space is empty, so the
    cleanup leaves no linalg op, and the empty result matches torch's."""
    path = binary_kernel(kernel_file, 0, 139, 64, expr="torch.logsumexp(a @ b, dim=1)")
    assert "linalg." not in str(compile_kernel(path, stop_after="cleanup").module)
    reports = compile_kernel(path).check()
    assert reports and all(r.ok for r in reports), reports


def test_a_pooling_backward_beside_a_packed_product_takes_the_matmul_schedule(kernel_file):
    """A fuzz case: a product, a linear layer and an avg_pool1d, forward and backward. The
    pooling's backward is a convolution the matmul schedule hands to the convolution
    family's, which looked for convolutions among ops that included the product's unpack
    (a linalg op without indexing maps: the schedule failed and the generic one took the
    payload). Now the matmul schedule takes it, and the results match torch."""
    path = kernel_file("""
        import torch
        import torch.nn.functional as F
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc0 = torch.nn.Linear(16, 7, bias=False)
            def forward(self, x0, x1, x2):
                y = self.fc0(torch.mm(x0, x1.t()).t()) + x2
                return F.avg_pool1d(y.unsqueeze(-2), 4, 4).squeeze(-2)
        def get_inputs():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(16, 31, generator=g), torch.randn(7, 31, generator=g) * 0.18,
                    torch.randn(1, 7, generator=g).expand(7, 7)]
        def get_init_inputs():
            return []
        """)
    compiled = compile_kernel(path, backward=True)
    assert compiled.family.name == "matmul" and not any("failed" in n for n in compiled.notes), \
        compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
