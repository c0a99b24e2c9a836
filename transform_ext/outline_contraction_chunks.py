"""outline_contraction_chunks: a long function's ops split into private functions of at most
N contractions each, called in order.

    func.func @f(%x) {                     func.func private @f_chunk0(%x) -> (%h) { c1 .. cN }
      c1 .. cN  cN+1 .. c2N  ...     ->    func.func private @f_chunk1(%h) -> (..) { cN+1 .. }
      return %y                            func.func @f(%x) { %h = call @f_chunk0(%x)
    }                                                          .. = call @f_chunk1(%h) ..
                                                               return %y }

The same computation, in the same order: chunk i's function takes the values its ops read
from before it (the function's arguments, earlier chunks' results) and returns those read
after it. A constant or an operand-free tensor.empty read across chunks is cloned into each
chunk that reads it (a packed constant must stay a constant). A new chunk starts right
before a contraction (a linalg op whose loop structure is a contraction) when the current
one holds N, with the fills, transposes and broadcasts before it that only it reads (its
init, a transposed operand): a contraction keeps the ops after it (its epilogue, a
reduction of it) until the next cut. The inliner (the upstream `inline` pass) puts the chunks back.

Why: upstream transforms that build a diagnostic on every call (fuse_into_containing_op
prints its producer and container, verifying and numbering their whole function) cost the
size of the function per call; a schedule taking every contraction of a recurrent model
unrolled over time (hundreds of them) was quadratic. In chunks it is linear.

Targets: func.func ops; a declaration, or a function with at most N contractions, is left
as it is. Legality first: a body of more than one block is a silenceable failure naming the
function (nothing rewritten). The handle is only read; the new functions go before their
function.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, func, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, RewritesTargets, Success, block_ops, defining_op, fail,
                     is_nested_in, payload_ops, user_op)
from .dialect import TransformExt

NAME = "transform_ext.outline_contraction_chunks"
_CLONED = ("arith.constant", "tensor.empty")
_FEEDING = ("linalg.fill", "linalg.transpose", "linalg.broadcast")


def _is_contraction(op: ir.Operation) -> bool:
    return is_linalg_op(op) and loop_structure(op).is_contraction


def _cloned(op: ir.Operation | None) -> bool:
    """A constant or an operand-free tensor.empty: each chunk reading it gets a copy."""
    return op is not None and op.name in _CLONED and not len(op.operands)


def chunks_of(function: ir.Operation, contractions: int) -> list[list[ir.Operation]]:
    """The body's ops (the terminator and the cloned ones aside) in chunks: a chunk ends
    before a contraction when it holds `contractions` of them. One chunk: nothing to
    outline."""
    chunks, current, count = [], [], 0
    for op in block_ops(function)[:-1]:
        if _cloned(op):
            continue
        if _is_contraction(op):
            if count == contractions:
                moved = _only_feeding(current, op)
                chunks.append(current[:len(current) - len(moved)])
                current, count = moved, 0
            count += 1
        current.append(op)
    return chunks + [current] if current else chunks


def _only_feeding(chunk: list[ir.Operation], contraction: ir.Operation) -> list[ir.Operation]:
    """The fills, transposes and broadcasts at the end of `chunk` that only the contraction
    (or one another of them) reads (its init, a transposed operand): they go with it."""
    taken = {contraction}
    start = len(chunk)
    while start > 0 and chunk[start - 1].name in _FEEDING:
        readers = [user_op(u) for r in chunk[start - 1].results for u in r.uses]
        if not readers or any(r not in taken for r in readers):
            break
        start -= 1
        taken.add(chunk[start])
    return chunk[start:]


def _top_level(op: ir.Operation, body: ir.Block) -> ir.Operation:
    """The op of `body` that is `op` or holds it."""
    while op.block != body:
        op = op.parent.operation
    return op


def _reads_from_outside(chunk: list[ir.Operation], body: ir.Block) -> list[ir.Value]:
    """The values the chunk's ops (nested ones too) read that no op of the chunk defines,
    in order of first read."""
    inside = set(chunk)
    found, seen = [], set()

    def visit(op):
        for value in op.operands:
            if value in seen:
                continue
            producer = defining_op(value)
            if producer is None:
                outside = ir.BlockArgument(value).owner == body
            else:
                outside = _top_level(producer, body) not in inside
            if outside:
                seen.add(value)
                found.append(value)
        return ir.WalkResult.ADVANCE

    for op in chunk:
        op.walk(visit)
    return found


def _read_after(chunk: list[ir.Operation], body: ir.Block) -> list[ir.Value]:
    """The chunk's results read by ops outside it."""
    inside = set(chunk)
    return [r for op in chunk for r in op.results
            if any(_top_level(user_op(u), body) not in inside for u in r.uses)]


def plan(function: ir.Operation, contractions: int) -> list[list[ir.Operation]]:
    """The chunks to outline (none when one chunk holds everything); Illegal naming a
    function that is not one block."""
    if function.name != "func.func":
        raise Illegal(function, "not a func.func")
    if not function.regions[0].blocks:
        return []
    if len(function.regions[0].blocks) != 1:
        raise Illegal(function, "its body has more than one block")
    chunks = chunks_of(function, contractions)
    return chunks if len(chunks) > 1 else []


def _replace_uses(value: ir.Value, new: ir.Value, keep) -> None:
    """Uses of `value` whose op passes `keep` read `new` instead."""
    for use in list(value.uses):
        owner = user_op(use)
        if keep(owner):
            owner.operands[use.operand_number] = new


def outline(function: ir.Operation, chunks: list[list[ir.Operation]]) -> None:
    """Each chunk into a private function before `function`, called where it was."""
    body = function.regions[0].blocks[0]
    name = ir.StringAttr(function.attributes["sym_name"]).value
    for index, chunk in enumerate(chunks):
        inside = set(chunk)

        def in_chunk(op, inside=inside):
            return _top_level(op, body) in inside

        reads = _reads_from_outside(chunk, body)
        cloned = [v for v in reads if _cloned(defining_op(v))]
        arguments = [v for v in reads if v not in cloned]
        results = _read_after(chunk, body)
        callee = f"{name}_chunk{index}"
        with ir.InsertionPoint(function), function.location:
            outlined = func.FuncOp(callee, ([v.type for v in arguments], [r.type for r in results]),
                                   visibility="private")
        entry = outlined.add_entry_block()
        with ir.InsertionPoint(chunk[0]), chunk[0].location:
            call = func.CallOp([r.type for r in results], ir.FlatSymbolRefAttr.get(callee),
                               arguments)
        for result, replacement in zip(results, call.results):
            _replace_uses(result, replacement, lambda op: not in_chunk(op) and op != call.operation)
        with ir.InsertionPoint(entry), function.location:
            ret = func.ReturnOp(results)
        for op in chunk:
            op.move_before(ret)
        for value, argument in zip(arguments, entry.arguments):
            _replace_uses(value, argument, lambda op: is_nested_in(op, outlined.operation))
        for value in cloned:
            with ir.InsertionPoint(chunk[0]):
                copy = defining_op(value).clone()
            _replace_uses(value, copy.results[0], lambda op: is_nested_in(op, outlined.operation))


class OutlineContractionChunksOp(TransformExt.Operation, name="outline_contraction_chunks"):
    target: ext.Operand[transform.AnyOpType]
    contractions: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                limit = ir.IntegerAttr(op.contractions).value
                targets = payload_ops(state, op.target)
                try:
                    plans = [(f, plan(f, limit)) for f in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for function, chunks in plans:
                    if chunks:
                        outline(function, chunks)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def outline_contraction_chunks(target: ir.Value, contractions: int) -> OutlineContractionChunksOp:
    """Split each function of `target` into private functions of at most `contractions`
    contractions each, called in order."""
    attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), contractions)
    return OutlineContractionChunksOp(target, contractions=attr)


__all__ = ["OutlineContractionChunksOp", "outline_contraction_chunks"]
