"""The logits of a linear layer that a loss reads: S[n, v] = sum_d h[n, d] W[v, d].

`logits_contraction(op)` reads a contraction (linalg.matmul or an equivalent generic) as a
LogitsContraction, or raises NotLogits with the reason: one row dim n, one class dim v, one
depth dim d, no batch dim; S written [n, v] into a zero fill (f32: f16/bf16 operands
accumulate in f32 after promote_reductions_to_f32); h read [n, d]; the weight read [v, d]
in place, or [d, v] from a linalg.transpose of a [V, D] tensor W (what F.linear and
nn.Linear import as). `row_max_contraction(block)` is the contraction that the block's one
row max over the classes reads, through elementwise ops (a bias, a rounding to bf16);
`row_max_logits(block)` that contraction as a LogitsContraction.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir

from ..common import defining_op, is_zero
from .classify import is_contraction, reduction_combiner
from .structure import dim_positions, is_linalg_op, loop_structure


class NotLogits(Exception):
    """Not the logits contraction of a linear layer; the message is the reason."""


@dataclass
class LogitsContraction:
    op: ir.Operation          # the contraction computing S [N, V]
    rows: ir.Value            # h [N, D], the operand read [n, d]
    weight: ir.Value          # W [V, D]: the operand read [v, d], or the transposed source
    weight_operand: int       # the operand index of the weight in `op`
    transpose: ir.Operation | None  # the linalg.transpose making W^T, when the op reads it

    @property
    def result(self) -> ir.Value:
        return self.op.results[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(N, V, D)."""
        n, d = ir.RankedTensorType(self.rows.type).shape
        v = ir.RankedTensorType(self.weight.type).shape[0]
        return n, v, d


def transposed_source(value: ir.Value) -> tuple[ir.Value, ir.Operation] | None:
    """(X, the transpose) when `value` is a 2-D linalg.transpose of X, else None."""
    producer = defining_op(value)
    if producer is None or producer.name != "linalg.transpose":
        return None
    perm = list(ir.DenseI64ArrayAttr(producer.attributes["permutation"]))
    if perm != [1, 0]:
        return None
    return producer.operands[0], producer


def logits_contraction(op: ir.Operation) -> LogitsContraction:
    """`op` as the logits contraction (see the module docstring), or NotLogits."""
    if not is_linalg_op(op) or not is_contraction(op):
        raise NotLogits(f"{op.name} is not a contraction")
    ls = loop_structure(op)
    if ls.num_inputs != 2 or ls.num_outputs != 1 or not ls.is_static:
        raise NotLogits(f"{op.name} is not a static contraction of two inputs")
    dims = ls.contraction_dims()
    if dims["batch"] or len(dims["m"]) != 1 or len(dims["n"]) != 1 or len(dims["k"]) != 1:
        raise NotLogits(f"{op.name} is not a 2-D matrix product (rows x depth times depth x "
                        f"classes)")
    m, n, k = dims["m"][0], dims["n"][0], dims["k"][0]
    if dim_positions(ls.output_map(0)) != [m, n]:
        raise NotLogits(f"{op.name} does not write its result [rows, classes]")
    result_type = ir.RankedTensorType(op.results[0].type)
    if str(result_type.element_type) != "f32":
        raise NotLogits(f"{op.name} accumulates in {result_type.element_type}, not f32")
    if not is_zero(op.operands[ls.num_inputs]):
        raise NotLogits(f"{op.name} does not accumulate into zeros")
    positions = [dim_positions(ls.maps[i]) for i in range(2)]
    rows_index = next((i for i in range(2) if positions[i] == [m, k]), None)
    if rows_index is None:
        raise NotLogits(f"{op.name} does not read its rows operand [rows, depth]")
    w_index = 1 - rows_index
    weight, transpose = op.operands[w_index], None
    if positions[w_index] == [k, n]:
        traced = transposed_source(weight)
        if traced is None:
            raise NotLogits(f"{op.name} reads its weight [depth, classes], not as a transpose "
                            f"of a [classes, depth] tensor")
        weight, transpose = traced
    elif positions[w_index] != [n, k]:
        raise NotLogits(f"{op.name} does not read its weight as [classes, depth]")
    return LogitsContraction(op, op.operands[rows_index], weight, w_index, transpose)


def row_max(block: ir.Block) -> ir.Operation:
    """The block's one max reduction over one dim (the log-softmax's row max); of several,
    the one reading a contraction through elementwise ops (a max over the lanes of a
    lane-form gather, transform_ext/load_rows_in_lane_form.py, reads none)."""
    maxes = [op.operation for op in block.operations if is_linalg_op(op.operation)
             and reduction_combiner(op.operation) == "max"
             and len(loop_structure(op.operation).reduction_dims) == 1]
    if len(maxes) > 1:
        maxes = [op for op in maxes if _contraction_through_elementwise(op.operands[0])]
    if len(maxes) != 1:
        raise NotLogits(f"expected one row max over the classes (a log_softmax), found "
                        f"{len(maxes)}")
    return maxes[0]


def _contraction_through_elementwise(value: ir.Value) -> bool:
    for _ in range(64):
        producer = defining_op(value)
        if producer is None or not is_linalg_op(producer):
            return False
        if is_contraction(producer):
            return True
        if not loop_structure(producer).is_elementwise:
            return False
        value = producer.operands[0]
    return False


def row_max_contraction(block: ir.Block) -> ir.Operation:
    """The contraction the block's row max reads through elementwise linalg ops (first
    operands), in whatever layout it writes, or NotLogits."""
    value = row_max(block).operands[0]
    while True:
        producer = defining_op(value)
        if producer is None or not is_linalg_op(producer):
            raise NotLogits("the row max does not read a contraction (the logits of a linear "
                            "layer)")
        if is_contraction(producer):
            return producer
        if not loop_structure(producer).is_elementwise:
            raise NotLogits(f"the row max reads the logits through {producer.name}, which is "
                            f"not elementwise")
        value = producer.operands[0]


def row_max_logits(block: ir.Block) -> LogitsContraction:
    """The logits contraction the block's row max reads (row_max_contraction), or NotLogits."""
    return logits_contraction(row_max_contraction(block))
