"""contraction_loops_to_amx_tiles: the IR (FileCheck) of the register-tile loops it runs on
AMX tiles (2 x 2 and 1 x 1 accumulator tiles, 32 pairs per step, C's view made inside the
loop), of a step whose C moves with k and of a lone step (rewritten in place), and of the
contractions it leaves (f32 operands, too many accumulator tiles, half a tile row per step,
rows that are no multiple of 16); the LLVM IR holds the tile intrinsics; and, on a host
with AMX, the numerics of the lowered code against torch."""

import ctypes

import numpy as np
import pytest
import torch
from torch_mlir import ir
from torch_mlir.runtime import get_ranked_memref_descriptor

from lighthouse.runtime import allow_amx_tiles
from lighthouse.targets.cpu import lower_to_llvm
from schedules.common import match
from transform_ext.contraction_loops_to_amx_tiles import contraction_loops_to_amx_tiles
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# C[M, N] (packed [M, N/NR, 1, NR]) += A[M, K] (packed [M, K/2, 1, 2]) B (packed
# [N/NR, K/2, NR, 2]) by register tiles of rows x NR, a loop over k in steps of `step` pairs,
# C's tile a view made {c_where} the loop.
KERNEL = """
#a = affine_map<(m1, n1, k2, m0, n0, kv) -> (m1, k2, m0, kv)>
#b = affine_map<(m1, n1, k2, m0, n0, kv) -> (n1, k2, n0, kv)>
#c = affine_map<(m1, n1, k2, m0, n0, kv) -> (m1, n1, m0, n0)>
func.func @mm(%A: memref<{m}x{k2}x1x2x{t}>, %B: memref<{n1}x{k2}x{nr}x2x{t}>,
              %C: memref<{m}x{n1}x1x{nr}xf32>) attributes {{llvm.emit_c_interface}} {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %rows = arith.constant {rows} : index
  %step = arith.constant {step} : index
  %cm = arith.constant {m} : index
  %cn = arith.constant {n1} : index
  %ck = arith.constant {k2} : index
  scf.for %i = %c0 to %cm step %rows {{
    scf.for %j = %c0 to %cn step %c1 {{
      {c_outside}
      scf.for %k = %c0 to %ck step %step {{
        {c_inside}
        %as = memref.subview %A[%i, %k, 0, 0] [{rows}, {step}, 1, 2] [1, 1, 1, 1] : memref<{m}x{k2}x1x2x{t}> to memref<{rows}x{step}x1x2x{t}, strided<[{k}, 2, 2, 1], offset: ?>>
        %bs = memref.subview %B[%j, %k, 0, 0] [1, {step}, {nr}, 2] [1, 1, 1, 1] : memref<{n1}x{k2}x{nr}x2x{t}> to memref<1x{step}x{nr}x2x{t}, strided<[{bstride}, {brow}, 2, 1], offset: ?>>
        linalg.generic {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "parallel", "parallel", "reduction"]}}
            ins(%as, %bs : memref<{rows}x{step}x1x2x{t}, strided<[{k}, 2, 2, 1], offset: ?>>, memref<1x{step}x{nr}x2x{t}, strided<[{bstride}, {brow}, 2, 1], offset: ?>>)
            outs(%cs : memref<{rows}x1x1x{nr}xf32, strided<[{cstride}, {nr}, {nr}, 1], offset: ?>>) {{
        ^bb0(%a: {t}, %b: {t}, %c: f32):
          {body}
          %p = arith.mulf %ae, %be : f32
          %s = arith.addf %c, %p : f32
          linalg.yield %s : f32
        }}
      }}
    }}
  }}
  return
}}
"""
C_VIEW = ("%cs = memref.subview %C[%i, %j, 0, 0] [{rows}, 1, 1, {nr}] [1, 1, 1, 1] : "
          "memref<{m}x{n1}x1x{nr}xf32> to memref<{rows}x1x1x{nr}xf32, strided<[{cstride}, {nr}, {nr}, 1], offset: ?>>")
C_VIEW_OF_K = C_VIEW.replace("%C[%i, %j,", "%C[%k, %j,")


def kernel(m=64, n=64, k=64, rows=32, nr=32, step=16, *, dtype="bf16", c_where="inside",
           c_view=C_VIEW) -> str:
    n1, k2 = n // nr, k // 2
    fields = dict(m=m, n1=n1, k2=k2, k=k, rows=rows, nr=nr, step=step, t=dtype,
                  bstride=k2 * nr * 2, brow=nr * 2, cstride=n1 * nr)
    view = c_view.format(**fields)
    body = ("%ae = arith.extf %a : bf16 to f32\n          %be = arith.extf %b : bf16 to f32"
            if dtype == "bf16" else "%ae = arith.addf %a, %a : f32\n          %be = arith.addf %b, %b : f32")
    return KERNEL.format(**fields, body=body, c_outside=view if c_where == "outside" else "",
                         c_inside=view if c_where == "inside" else "")


def lowered(text: str) -> ir.Module:
    payload = parse(text)
    apply(payload, lambda root: contraction_loops_to_amx_tiles(match(root, "func.func")))
    return payload


def test_two_by_two_tiles_accumulate_across_the_loop():
    """C's view leaves the loop; its 4 tiles are loaded before it, carried, stored after it;
    each step loads 2 tiles of A's rows and 2 of B's pairs and multiplies 4 times."""
    payload = lowered(kernel())
    check(payload, """
        CHECK: %[[C:.*]] = memref.subview %arg2
        CHECK: %[[C2:.*]] = memref.collapse_shape %[[C]] {{\\[}}[0], [1, 2, 3]] {{.*}} into memref<32x32xf32, strided<[64, 1], offset: ?>>
        CHECK-COUNT-4: x86.amx.tile_load %[[C2]]{{.*}} into !x86.amx.tile<16x16xf32>
        CHECK: scf.for {{.*}} iter_args({{.*}}) -> (!x86.amx.tile<16x16xf32>, !x86.amx.tile<16x16xf32>, !x86.amx.tile<16x16xf32>, !x86.amx.tile<16x16xf32>)
        CHECK: memref.collapse_shape {{.*}} {{\\[}}[0], [1, 2, 3]] {{.*}} into memref<32x32xbf16, strided<[64, 1], offset: ?>>
        CHECK: memref.collapse_shape {{.*}} {{\\[}}[0, 1], [2, 3]] {{.*}} into memref<16x64xbf16, strided<[64, 1], offset: ?>>
        CHECK-COUNT-4: x86.amx.tile_load {{.*}} into !x86.amx.tile<16x32xbf16>
        CHECK-COUNT-4: x86.amx.tile_mulf
        CHECK-NOT: x86.amx.tile_mulf
        CHECK: scf.yield
        CHECK-COUNT-4: x86.amx.tile_store %[[C2]]
        CHECK-NOT: linalg.generic
    """)


def test_one_tile_and_two_steps_per_iteration():
    """A 16 x 16 register tile (one accumulator) over 32 pairs per iteration: two steps, each
    loading A's 16 pairs at their offset in the row and B's 16 rows of pairs."""
    payload = lowered(kernel(m=32, n=32, k=128, rows=16, nr=16, step=32, c_where="outside"))
    check(payload, """
        CHECK: scf.for {{.*}} -> (!x86.amx.tile<16x16xf32>)
        CHECK: %[[A:.*]] = memref.collapse_shape {{.*}} into memref<16x64xbf16
        CHECK: %[[B:.*]] = memref.collapse_shape {{.*}} into memref<32x32xbf16
        CHECK: x86.amx.tile_load %[[A]][%c0{{(_[0-9]+)?}}, %c0{{(_[0-9]+)?}}]
        CHECK: x86.amx.tile_load %[[B]][%c0{{(_[0-9]+)?}}, %c0{{(_[0-9]+)?}}]
        CHECK: x86.amx.tile_mulf
        CHECK: x86.amx.tile_load %[[A]][%c0{{(_[0-9]+)?}}, %c32{{(_[0-9]+)?}}]
        CHECK: x86.amx.tile_load %[[B]][%c16{{(_[0-9]+)?}}, %c0{{(_[0-9]+)?}}]
        CHECK: x86.amx.tile_mulf
        CHECK-NOT: x86.amx.tile_mulf
    """)


def test_a_step_whose_c_moves_with_k_loads_and_stores_c_per_step():
    """C's view depends on the loop's k: no tiles are carried; each step loads C's tiles,
    multiplies and stores them back, inside the loop."""
    payload = lowered(kernel(c_view=C_VIEW_OF_K))
    check(payload, """
        CHECK: scf.for
        CHECK: scf.for
        CHECK: scf.for %[[K:.*]] = {{.*}} {
        CHECK: memref.subview %arg2[%[[K]],
        CHECK-COUNT-4: x86.amx.tile_load {{.*}} into !x86.amx.tile<16x16xf32>
        CHECK-COUNT-4: x86.amx.tile_mulf
        CHECK-COUNT-4: x86.amx.tile_store
        CHECK-NEXT: }
    """)
    assert "iter_args" not in str(payload)


def lone_step_kernel() -> str:
    """`kernel` with k = 16 pairs and its loop over k folded away (the step at k = 0)."""
    text = kernel(k=32, step=16)
    loop = text[text.index("      scf.for %k"):text.index("      }\n    }\n  }")]
    body = loop[loop.index("{\n") + 2:loop.rindex("}")]
    lone = text.replace(loop, body.replace("%k", "%c0"))
    assert "scf.for %k" not in lone
    return lone


def test_a_lone_step_is_rewritten_where_it_is():
    """A loop of one step (folded away): the generic alone becomes C's loads, 2 x 2 products
    per 16 pairs, C's stores."""
    payload = lowered(lone_step_kernel())
    check(payload, """
        CHECK-NOT: iter_args
        CHECK-COUNT-4: x86.amx.tile_load {{.*}} into !x86.amx.tile<16x16xf32>
        CHECK-COUNT-4: x86.amx.tile_load {{.*}} into !x86.amx.tile<16x32xbf16>
        CHECK-COUNT-4: x86.amx.tile_mulf
        CHECK-COUNT-4: x86.amx.tile_store
        CHECK-NOT: linalg.generic
    """)


@pytest.mark.parametrize("text", [
    kernel(dtype="f32"),                                  # f32 operands
    kernel(m=96, rows=48),                                # 3 x 2 accumulators: 11 tiles
    kernel(m=48, rows=24),                                # rows no multiple of 16
    kernel(step=8),                                       # 8 pairs per step: half a row
], ids=["f32", "too_many_tiles", "rows", "half_row"])
def test_other_loops_are_left_alone(text):
    payload = lowered(text)
    assert "x86.amx" not in str(payload)
    assert "linalg.generic" in str(payload)


def test_a_target_that_is_not_a_function_fails():
    payload = parse(kernel())
    message = apply_expect_failure(
        payload, lambda root: contraction_loops_to_amx_tiles(match(root, "scf.for")))
    assert "not a func.func" in message
    assert "x86.amx" not in str(payload)


def test_llvm_ir_holds_the_tile_intrinsics():
    """The tiles carried by the loop lower to LLVM (cf's conversion knows the tile type)."""
    payload = lowered(kernel())
    with payload.context:
        lower_to_llvm(payload, threads=1)
    check(payload, """
        CHECK: llvm.x86.tileloadd64.internal
        CHECK: llvm.x86.tdpbf16ps.internal
        CHECK: llvm.x86.tilestored64.internal
    """)


@pytest.mark.skipif(not allow_amx_tiles(), reason="tdpbf16ps needs a host with AMX (and Linux's grant)")
@pytest.mark.parametrize("shape", [dict(), dict(m=32, n=32, k=128, rows=16, nr=16, step=32),
                                   dict(k=32, lone=True)], ids=["2x2", "1x1", "lone"])
def test_lowered_loops_match_torch(shape):
    from torch_mlir.execution_engine import ExecutionEngine

    m, n, k = shape.get("m", 64), shape.get("n", 64), shape.get("k", 64)
    nr = shape.get("nr", 32)
    payload = lowered(lone_step_kernel() if shape.pop("lone", False) else kernel(**shape))
    with payload.context:
        lower_to_llvm(payload, threads=1)
    engine = ExecutionEngine(payload, opt_level=2)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    c0 = torch.randn(m, n, generator=g)
    a_p = a.view(m, k // 2, 1, 2).contiguous()
    b_p = b.view(k // 2, 2, n // nr, nr).permute(2, 0, 3, 1).contiguous()
    c_p = c0.view(m, n // nr, 1, nr).numpy().copy()
    args = [a_p.view(torch.int16).numpy(), b_p.view(torch.int16).numpy(), c_p]
    engine.invoke("mm", *[ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(x))) for x in args])
    want = (c0 + a.float() @ b.float()).numpy()
    np.testing.assert_allclose(c_p.reshape(m, n), want, rtol=1e-5, atol=1e-4)
