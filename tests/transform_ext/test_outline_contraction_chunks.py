"""outline_contraction_chunks: IR (FileCheck) of the chunks and of their inlining back,
a function left whole, rejections. The numerics: tests/schedules/test_matmul_chunks.py
compiles recurrent models through the chunks and compares them with torch."""

from schedules.common import apply_passes, match
from transform_ext.outline_contraction_chunks import outline_contraction_chunks
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse


def chain(steps: int) -> str:
    """`steps` times h = tanh(h @ W) (a zero fill per product), h returned."""
    lines = ["#id = affine_map<(d0, d1) -> (d0, d1)>",
             "func.func @main(%h0: tensor<5x16xf32>, %w: tensor<16x16xf32>) -> tensor<5x16xf32> {",
             "  %zero = arith.constant 0.0 : f32"]
    h = "%h0"
    for i in range(steps):
        lines += [f"  %e{i} = tensor.empty() : tensor<5x16xf32>",
                  f"  %f{i} = linalg.fill ins(%zero : f32) outs(%e{i} : tensor<5x16xf32>) -> tensor<5x16xf32>",
                  f"  %m{i} = linalg.matmul ins({h}, %w : tensor<5x16xf32>, tensor<16x16xf32>) "
                  f"outs(%f{i} : tensor<5x16xf32>) -> tensor<5x16xf32>",
                  f"  %h{i + 1} = linalg.generic {{indexing_maps = [#id, #id], iterator_types = "
                  f"[\"parallel\", \"parallel\"]}} ins(%m{i} : tensor<5x16xf32>) outs(%e{i} : tensor<5x16xf32>) {{",
                  "  ^bb0(%x: f32, %o: f32):", "    %t = math.tanh %x : f32", "    linalg.yield %t : f32",
                  "  } -> tensor<5x16xf32>"]
        h = f"%h{i + 1}"
    return "\n".join(lines + [f"  return {h} : tensor<5x16xf32>", "}"])


def test_five_products_in_chunks_of_two_and_back():
    payload = parse(chain(5))
    apply(payload, lambda root: outline_contraction_chunks(match(root, "func.func"), 2))
    # each chunk: its own zero and empties (copies), the fill of each product with it, the
    # last tanh returned to the next chunk; @main calls them in order
    check(payload, """
        CHECK:      func.func private @main_chunk0(%[[X:.*]]: tensor<5x16xf32>, %[[W:.*]]: tensor<16x16xf32>) -> tensor<5x16xf32>
        CHECK:        arith.constant 0.000000e+00 : f32
        CHECK:        linalg.fill
        CHECK-NEXT:   linalg.matmul ins(%[[X]], %[[W]]
        CHECK:        math.tanh
        CHECK:        linalg.fill
        CHECK-NEXT:   linalg.matmul
        CHECK:        math.tanh
        CHECK-NOT:    linalg.matmul
        CHECK:        return
        CHECK:      func.func private @main_chunk1(%{{.*}}: tensor<5x16xf32>, %{{.*}}: tensor<16x16xf32>) -> tensor<5x16xf32>
        CHECK-COUNT-2: linalg.matmul
        CHECK:      func.func private @main_chunk2(
        CHECK-COUNT-1: linalg.matmul
        CHECK-NOT:    linalg.matmul
        CHECK:      func.func @main(%[[H0:.*]]: tensor<5x16xf32>, %[[W0:.*]]: tensor<16x16xf32>)
        CHECK:        %[[A:.*]] = call @main_chunk0(%[[H0]], %[[W0]])
        CHECK:        %[[B:.*]] = call @main_chunk1(%[[A]], %[[W0]])
        CHECK:        %[[C:.*]] = call @main_chunk2(%[[B]], %[[W0]])
        CHECK:        return %[[C]]
    """)
    apply(payload, lambda root: apply_passes(root, "inline", "canonicalize", "cse"))
    check(payload, """
        CHECK-NOT:  chunk
        CHECK:      func.func @main
        CHECK-COUNT-5: linalg.matmul
        CHECK-NOT:  call
    """)


def test_a_value_read_in_its_chunk_and_returned_is_passed_on():
    """h1 is read by the second product (chunk 0) and returned by @main."""
    text = chain(5).replace("return %h5 : tensor<5x16xf32>",
                            "return %h5, %h1 : tensor<5x16xf32>, tensor<5x16xf32>")
    text = text.replace("-> tensor<5x16xf32> {\n  %zero", "-> (tensor<5x16xf32>, tensor<5x16xf32>) {\n  %zero")
    payload = parse(text)
    apply(payload, lambda root: outline_contraction_chunks(match(root, "func.func"), 2))
    check(payload, """
        CHECK:      func.func private @main_chunk0({{.*}}) -> (tensor<5x16xf32>, tensor<5x16xf32>)
        CHECK:        %[[H1:.*]] = linalg.generic
        CHECK:        %[[H2:.*]] = linalg.generic
        CHECK:        return %[[H1]], %[[H2]]
        CHECK:      func.func @main
        CHECK:        %[[A:.*]]:2 = call @main_chunk0
        CHECK:        %[[B:.*]] = call @main_chunk1(%[[A]]#1,
        CHECK:        %[[C:.*]] = call @main_chunk2(%[[B]],
        CHECK:        return %[[C]], %[[A]]#0
    """)


def test_a_function_with_few_products_is_left_whole():
    payload = parse(chain(4))
    before = str(payload)
    apply(payload, lambda root: outline_contraction_chunks(match(root, "func.func"), 4))
    assert str(payload) == before


def test_rejects_what_is_not_a_function():
    payload = parse(chain(3))
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: outline_contraction_chunks(match(root, "linalg.matmul"), 1))
    assert "transform_ext.outline_contraction_chunks: linalg.matmul" in message
    assert "not a func.func" in message
    assert str(payload) == before
