"""match_column_sweep_ops: the root and elementwise chain after the online row-max loop of a
row forall (tagged with transform.annotate and FileChecked), passing over a forall whose loop
holds no max (a contraction's k loop) and one whose tail already runs in a loop; the
rejection of a payload without such a forall."""

from torch_mlir.dialects import transform

from transform_ext.match_column_sweep_ops import match_column_sweep_ops
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

MAX_LOOP = """
    %m = scf.for %j = %c0 to %c8 step %c4 iter_args(%acc = %fm) -> (tensor<2xf32>) {{
      %piece = tensor.extract_slice %t[0, %j] [2, 4] [1, 1] : tensor<2x8xf32> to tensor<2x4xf32>
      %next = linalg.generic {{indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}}
          ins(%piece : tensor<2x4xf32>) outs(%acc : tensor<2xf32>) {{
      ^bb0(%v: f32, %a: f32):
        %0 = arith.{combine} %v, %a : f32
        linalg.yield %0 : f32
      }} -> tensor<2xf32>
      scf.yield %next : tensor<2xf32>
    }} {{online{n}}}
"""
TAIL = """
    %sub{n} = linalg.generic {{indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}}
        ins(%t, %m : tensor<2x8xf32>, tensor<2xf32>) outs(%ot : tensor<2x8xf32>) attrs = {{sub{n}}} {{
    ^bb0(%v: f32, %mx: f32, %out: f32):
      %0 = arith.subf %v, %mx : f32
      linalg.yield %0 : f32
    }} -> tensor<2x8xf32>
    %y{n} = linalg.generic {{indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}}
        ins(%sub{n} : tensor<2x8xf32>) outs(%ot : tensor<2x8xf32>) attrs = {{exp{n}}} {{
    ^bb0(%v: f32, %out: f32):
      %0 = math.exp %v : f32
      linalg.yield %0 : f32
    }} -> tensor<2x8xf32>
"""
SWEPT = """
    %y{n} = scf.for %j = %c0 to %c8 step %c4 iter_args(%acc = %ot) -> (tensor<2x8xf32>) {{
      scf.yield %acc : tensor<2x8xf32>
    }} {{sweep{n}}}
"""
FORALL = """
  %r{n} = scf.forall (%i) in (2) shared_outs(%o = %e) -> (tensor<4x8xf32>) {{
    %t = tensor.extract_slice %x[0, 0] [2, 8] [1, 1] : tensor<4x8xf32> to tensor<2x8xf32>
    %ot = tensor.extract_slice %o[0, 0] [2, 8] [1, 1] : tensor<4x8xf32> to tensor<2x8xf32>
    %fm = linalg.fill {{fill{n}}} ins(%ninf : f32) outs(%er : tensor<2xf32>) -> tensor<2xf32>
    {loop}
    {tail}
    scf.forall.in_parallel {{
      tensor.parallel_insert_slice %y{n} into %o[0, 0] [2, 8] [1, 1] : tensor<2x8xf32> into tensor<4x8xf32>
    }}
  }}
"""


def forall(n: int, combine: str, tail: str) -> str:
    return FORALL.format(n=n, loop=MAX_LOOP.format(n=n, combine=combine), tail=tail.format(n=n))


def payload(*foralls: str) -> str:
    results = ", ".join(f"%r{n}" for n in range(len(foralls)))
    types = ", ".join(["tensor<4x8xf32>"] * len(foralls))
    return f"""
#id = affine_map<(i, j) -> (i, j)>
#row = affine_map<(i, j) -> (i)>
func.func @main(%x: tensor<4x8xf32>) -> ({types}) {{
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c8 = arith.constant 8 : index
  %ninf = arith.constant 0xFF800000 : f32
  %e = tensor.empty() : tensor<4x8xf32>
  %er = tensor.empty() : tensor<2xf32>
  {"".join(foralls)}
  return {results} : {types}
}}
"""


def _tag(root):
    sweep_root, chain = match_column_sweep_ops(root)
    transform.AnnotateOp(sweep_root, "sweep_root")
    transform.AnnotateOp(chain, "chain")


def test_matches_the_tail_after_the_online_loop_of_the_first_unswept_forall():
    module = parse(payload(forall(0, "addf", TAIL), forall(1, "maximumf", SWEPT),
                           forall(2, "maximumf", TAIL), forall(3, "maximumf", TAIL)))
    apply(module, _tag)
    check(module, """
        CHECK: attrs =  {sub0} {
        CHECK: attrs =  {exp0} {
        CHECK: } {sweep1}
        CHECK: linalg.fill {fill2} ins
        CHECK: } {online2}
        CHECK: attrs =  {chain, sub2}
        CHECK: attrs =  {exp2, sweep_root}
        CHECK: attrs =  {sub3} {
        CHECK: attrs =  {exp3} {
    """)


def test_rejects_a_payload_without_an_online_loop_and_tail():
    module = parse(payload(forall(0, "addf", TAIL), forall(1, "maximumf", SWEPT)))
    message = apply_expect_failure(module, _tag)
    assert "transform_ext.match_column_sweep_ops: builtin.module" in message
    assert "no scf.forall with an online row-max loop followed by its elementwise tail" in message
