"""match_attention_kernel_ops: the layout anchors of an attention gpu.func (each result
tagged with transform.annotate and FileChecked): Q, K (through its transpose) and V loads,
both DPAS ops of every key loop, the store; a Q load read by two key loops (a causal
kernel) is matched once; kernels without that structure are rejected naming the reason."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_attention_kernel_ops import match_attention_kernel_ops
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

LOOP = """
      %acc{n} = scf.for %j = %c0 to %c64 step %c16 iter_args(%a = %init) -> (vector<8x16xf32>) {{
        %kt = xegpu.load_nd %kd[%j, 0] {{k{n}}} : !xegpu.tensor_desc<16x16xf16> -> vector<16x16xf16>
        %ktt = vector.transpose %kt, [1, 0] : vector<16x16xf16> to vector<16x16xf16>
        %s = xegpu.dpas {q}, %ktt, %zero {{qk{n}}} : vector<8x16xf16>, vector<16x16xf16>, vector<8x16xf32> -> vector<8x16xf32>
        %p = arith.truncf %s : vector<8x16xf32> to vector<8x16xf16>
        %vt = xegpu.load_nd %vd[%j, 0] {{v{n}}} : !xegpu.tensor_desc<16x16xf16> -> vector<16x16xf16>
        %next = xegpu.dpas %p, %vt, %a {{pv{n}}} : vector<8x16xf16>, vector<16x16xf16>, vector<8x16xf32> -> vector<8x16xf32>
        {extra}
        scf.yield %next : vector<8x16xf32>
      }}
"""

KERNEL = """
module attributes {{gpu.container_module}} {{
  gpu.module @kernels {{
    gpu.func @attention(%q: i64, %k: i64, %v: i64, %o: i64) kernel {{
      %c0 = arith.constant 0 : index
      %c16 = arith.constant 16 : index
      %c64 = arith.constant 64 : index
      %zero = arith.constant dense<0.0> : vector<8x16xf32>
      %init = arith.constant dense<0.0> : vector<8x16xf32>
      %qd = xegpu.create_nd_tdesc %q, shape : [8, 16], strides : [16, 1] : i64 -> !xegpu.tensor_desc<8x16xf16>
      %qt = xegpu.load_nd %qd[0, 0] {{q}} : !xegpu.tensor_desc<8x16xf16> -> vector<8x16xf16>
      %kd = xegpu.create_nd_tdesc %k, shape : [64, 16], strides : [16, 1] : i64 -> !xegpu.tensor_desc<16x16xf16>
      %vd = xegpu.create_nd_tdesc %v, shape : [64, 16], strides : [16, 1] : i64 -> !xegpu.tensor_desc<16x16xf16>
      {loops}
      %out = arith.truncf %acc{last} : vector<8x16xf32> to vector<8x16xf16>
      %od = xegpu.create_nd_tdesc %o, shape : [8, 16], strides : [16, 1] : i64 -> !xegpu.tensor_desc<8x16xf16>
      xegpu.store_nd %out, %od[0, 0] {{o}} : vector<8x16xf16>, !xegpu.tensor_desc<8x16xf16>
      gpu.return
    }}
  }}
}}
"""

ROLES = ("q_load", "k_load", "v_load", "qk_dpas", "pv_dpas", "store")


def kernel(loops: int = 1, q: str = "%qt", extra: str = "") -> str:
    body = "".join(LOOP.format(n=n, q=q, extra=extra) for n in range(loops))
    return KERNEL.format(loops=body, last=loops - 1)


def _tag(root):
    for handle, role in zip(match_attention_kernel_ops(match(root, "gpu.func")), ROLES):
        transform.AnnotateOp(handle, role)


def test_matches_the_loads_dpas_ops_and_store_of_a_key_loop():
    payload = parse(kernel())
    apply(payload, _tag)
    check(payload, """
        CHECK: xegpu.load_nd {{.*}} {q, q_load}
        CHECK: scf.for
        CHECK: xegpu.load_nd {{.*}} {k0, k_load}
        CHECK: xegpu.dpas {{.*}} {qk0, qk_dpas}
        CHECK: xegpu.load_nd {{.*}} {v0, v_load}
        CHECK: xegpu.dpas {{.*}} {pv0, pv_dpas}
        CHECK: xegpu.store_nd {{.*}} {o, store}
    """)


def test_a_q_load_shared_by_two_key_loops_is_matched_once():
    payload = parse(kernel(loops=2))
    apply(payload, lambda root: transform.AnnotateOp(
        match_attention_kernel_ops(match(root, "gpu.func"))[0], "q_load"))
    check(payload, """
        CHECK: xegpu.load_nd {{.*}} {q, q_load}
        CHECK: xegpu.load_nd {{.*}} {k0}
        CHECK: xegpu.load_nd {{.*}} {k1}
    """)
    apply(payload, _tag)
    check(payload, """
        CHECK: {k0, k_load}
        CHECK: {qk0, qk_dpas}
        CHECK: {v0, v_load}
        CHECK: {pv0, pv_dpas}
        CHECK: {k1, k_load}
        CHECK: {qk1, qk_dpas}
        CHECK: {v1, v_load}
        CHECK: {pv1, pv_dpas}
        CHECK: {o, store}
    """)


def test_rejects_a_key_loop_without_two_dpas_ops():
    extra = ("%third = xegpu.dpas %p, %vt, %a : vector<8x16xf16>, vector<16x16xf16>, "
             "vector<8x16xf32> -> vector<8x16xf32>")
    payload = parse(kernel(extra=extra))
    before = str(payload)
    message = apply_expect_failure(payload, _tag)
    assert "transform_ext.match_attention_kernel_ops: gpu.func" in message
    assert "a key loop holds 3 xegpu.dpas ops, expected 2" in message
    assert str(payload) == before


def test_rejects_a_dpas_operand_not_read_by_a_block_load():
    q = "%qc"
    text = kernel(q=q).replace(
        "%kd = ", "%qc = arith.constant dense<1.0> : vector<8x16xf16>\n      %kd = ")
    message = apply_expect_failure(parse(text), _tag)
    assert "an attention DPAS operand is not read by a 2-D block load" in message


def test_rejects_a_kernel_without_key_loops():
    text = KERNEL.format(loops="%acc0 = arith.addf %init, %init : vector<8x16xf32>", last=0)
    message = apply_expect_failure(parse(text), _tag)
    assert "an attention kernel with 0 key loops and 1 stores" in message
