"""match_attention_forall: the forall whose key loops each hold two contractions and those
loops (tagged with transform.annotate and FileChecked; a forall with a one-contraction loop
before it is passed over), and the rejection of a function without one."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_attention_forall import match_attention_forall
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

LOOP = """
    %l{n} = scf.for %j = %c0 to %c8 step %c4 iter_args(%acc = %init) -> (tensor<8x8xf32>) {{
      %s = linalg.matmul ins(%a, %b : tensor<8x8xf32>, tensor<8x8xf32>) outs(%acc : tensor<8x8xf32>) -> tensor<8x8xf32>
      {second}
      scf.yield %p : tensor<8x8xf32>
    }} {{loop{n}}}
"""
PV = ("%p = linalg.matmul ins(%s, %b : tensor<8x8xf32>, tensor<8x8xf32>) "
      "outs(%acc : tensor<8x8xf32>) -> tensor<8x8xf32>")
FORALL = """
  %r{n} = scf.forall (%i) in (2) shared_outs(%o = %e) -> (tensor<16x8xf32>) {{
    {loops}
    scf.forall.in_parallel {{
      tensor.parallel_insert_slice %l{last} into %o[0, 0] [8, 8] [1, 1] : tensor<8x8xf32> into tensor<16x8xf32>
    }}
  }} {{forall{n}}}
"""


def payload(*foralls: list[str]) -> str:
    """One forall per entry, each with one key loop per `second` op in it."""
    body = ""
    loop_id = 0
    for n, seconds in enumerate(foralls):
        loops = ""
        for second in seconds:
            loops += LOOP.format(n=loop_id, second=second)
            loop_id += 1
        body += FORALL.format(n=n, loops=loops, last=loop_id - 1)
    return f"""
func.func @main(%a: tensor<8x8xf32>, %b: tensor<8x8xf32>, %init: tensor<8x8xf32>) -> tensor<16x8xf32> {{
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c8 = arith.constant 8 : index
  %e = tensor.empty() : tensor<16x8xf32>
  {body}
  return %r{len(foralls) - 1} : tensor<16x8xf32>
}}
"""


def _tag(root):
    forall, loops = match_attention_forall(match(root, "func.func"))
    transform.AnnotateOp(forall, "attention")
    transform.AnnotateOp(loops, "key_loop")


def test_matches_the_forall_whose_loops_hold_two_contractions_and_its_loops():
    one = "%p = arith.addf %acc, %acc : tensor<8x8xf32>"
    module = parse(payload([one], [PV, PV]))
    apply(module, _tag)
    check(module, """
        CHECK: } {loop0}
        CHECK: } {forall0}
        CHECK: } {key_loop, loop1}
        CHECK: } {key_loop, loop2}
        CHECK: } {attention, forall1}
    """)


def test_rejects_a_function_without_such_a_forall():
    one = "%p = arith.addf %acc, %acc : tensor<8x8xf32>"
    message = apply_expect_failure(parse(payload([PV, one])), _tag)
    assert "transform_ext.match_attention_forall: func.func" in message
    assert "no scf.forall whose key loops each hold two contractions" in message
