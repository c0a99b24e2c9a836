"""A CPU kernel's large intermediate buffers in one static workspace, reused by every call.

A buffer allocated in a kernel function's body (a top-level `memref.alloc`: an
intermediate tensor, a padded copy of an input) was malloc'ed and freed on every call.
Above glibc's mmap threshold each was a fresh mapping whose pages faulted in zeroed on
first touch and were unmapped at its free: a depthwise-separable block (EfficientNet-B0's
first, [10, 32, 112, 112]) spent two thirds of its time in the kernel's page-fault path.
Here each such buffer of at least `min_bytes` becomes a `memref.view` of one module global
(zero-filled memory of the loaded code, its pages kept across calls), at an offset packed by
liveness: the buffer is live from its allocation to the last top-level op of the function
that uses it or a view of it, and two buffers share bytes only when their live ranges are
disjoint (first fit, offsets 64-byte aligned).

A buffer stays a malloc when it could outlive the ranges this sees: used by a terminator
or a call, or by an op other than a view that returns a memref (an alias not followed).
Calls of one compiled function then share the workspace: the runtime serializes them
(lighthouse.runtime.JitFunction).

Preconditions: bufferized, before the deallocation pipeline (no dealloc of these buffers
yet); functions of one block.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, memref

# ops whose memref result aliases their memref operand (followed for liveness)
VIEW_OPS = frozenset({"memref.subview", "memref.expand_shape", "memref.collapse_shape",
                      "memref.cast", "memref.reinterpret_cast", "memref.transpose",
                      "memref.view"})
# ops through which a buffer could leave the ranges (results of regions, calls)
ESCAPES = frozenset({"func.return", "func.call", "scf.yield", "scf.condition", "scf.reduce",
                     "scf.reduce.return", "cf.br", "cf.cond_br", "memref.extract_strided_metadata"})
ALIGNMENT = 64
MIN_BYTES = 128 * 1024  # glibc's default mmap threshold
STACK_BYTES = 2 * 1024 * 1024  # the most a function's body keeps on the stack (8 MB threads)
WORKSPACE_BYTES = "lh.workspace_bytes"


@dataclass
class _Buffer:
    alloc: ir.Operation
    start: int
    end: int
    size: int
    offset: int = -1


def _byte_size(t: ir.MemRefType) -> int | None:
    """Bytes of a static, identity-layout buffer of whole-byte elements; None otherwise."""
    layout = ir.AffineMapAttr(t.layout).value
    if not t.has_static_shape or t.memory_space is not None or \
            layout != ir.AffineMap.get_identity(t.rank):
        return None
    element = t.element_type
    if isinstance(element, (ir.F32Type, ir.F16Type, ir.BF16Type, ir.F64Type)):
        width = element.width
    elif isinstance(element, ir.IntegerType) and element.width % 8 == 0:
        width = element.width
    else:
        return None
    n = 1
    for s in t.shape:
        n *= s
    return n * width // 8


def _live_end(alloc: ir.Operation, index: dict, body: ir.Block) -> int | None:
    """The index of the last top-level op using the buffer or a view of it; None when it
    could escape (ESCAPES, or an unfollowed memref result)."""
    end = index[alloc]
    pending = [alloc.results[0]]
    while pending:
        value = pending.pop()
        for use in value.uses:
            owner = use.owner
            owner = getattr(owner, "operation", owner)
            if owner.name in VIEW_OPS:
                pending.extend(owner.results)
            elif owner.name in ESCAPES or any(isinstance(r.type, ir.MemRefType)
                                              for r in owner.results):
                return None
            top = owner
            while top.parent is not None and top.block != body:
                top = getattr(top.parent, "operation", top.parent)
            if top not in index:
                return None
            end = max(end, index[top])
    return end


def _pack(buffers: list[_Buffer]) -> int:
    """First-fit offsets (set in place) such that buffers with overlapping live ranges
    never overlap in bytes; returns the workspace's size."""
    placed: list[_Buffer] = []
    top = 0
    for b in sorted(buffers, key=lambda b: (b.start, -b.size)):
        live = sorted((p for p in placed if p.start <= b.end and b.start <= p.end),
                      key=lambda p: p.offset)
        offset = 0
        for p in live:
            if offset + b.size <= p.offset:
                break
            offset = max(offset, -(-(p.offset + p.size) // ALIGNMENT) * ALIGNMENT)
        b.offset = offset
        placed.append(b)
        top = max(top, offset + b.size)
    return -(-top // ALIGNMENT) * ALIGNMENT


def _top_level_allocs(func: ir.Operation) -> list[ir.Operation]:
    """The static memref.alloc ops of a function's body (alignment at most ALIGNMENT)."""
    return [op.operation for op in func.regions[0].blocks[0].operations
            if op.operation.name == "memref.alloc" and not len(op.operation.operands)
            and not ("alignment" in op.operation.attributes
                     and ir.IntegerAttr(op.operation.attributes["alignment"]).value > ALIGNMENT)]


def crowded_functions(payload: ir.Module, stack_bytes: int = STACK_BYTES) -> set[str]:
    """The functions whose top-level buffers below MIN_BYTES (those promote-buffers-to-stack
    would make allocas, all live for the whole call) add up to more than `stack_bytes`: a
    recurrent model unrolled over 256 steps held 15 MB of them, past the thread's stack."""
    crowded = set()
    for func in payload.body.operations:
        func = func.operation
        if func.name != "func.func" or len(func.regions[0].blocks) != 1:
            continue
        sizes = [_byte_size(op.results[0].type) for op in _top_level_allocs(func)]
        if sum(s for s in sizes if s is not None and s < MIN_BYTES) > stack_bytes:
            crowded.add(ir.StringAttr(func.attributes["sym_name"]).value)
    return crowded


def allocations_into_workspace(payload: ir.Module, min_bytes: int = MIN_BYTES) -> int:
    """Rewrite each function's top-level allocations of at least `min_bytes` into views of
    a workspace global of its own; returns the number rewritten. The module's
    WORKSPACE_BYTES attribute gets the workspaces' total size (memory the loaded kernel
    holds for its life: the bench adds it to the kernel's peak)."""
    rewritten = 0
    held = 0
    with payload.context:
        for func in list(payload.body.operations):
            func = func.operation
            if func.name != "func.func" or len(func.regions[0].blocks) != 1:
                continue
            body = func.regions[0].blocks[0]
            ops = [op.operation for op in body.operations]
            index = {op: i for i, op in enumerate(ops)}
            buffers = []
            for op in _top_level_allocs(func):
                size = _byte_size(op.results[0].type)
                if size is None or size < min_bytes:
                    continue
                end = _live_end(op, index, body)
                if end is not None:
                    buffers.append(_Buffer(op, index[op], end, size))
            if not buffers:
                continue
            total = _pack(buffers)
            held += total
            name = f"__lh_workspace_{ir.StringAttr(func.attributes['sym_name']).value}"
            space = ir.MemRefType.get([total], ir.IntegerType.get_signless(8))
            with ir.InsertionPoint.at_block_begin(payload.body), func.location:
                memref.GlobalOp(name, ir.TypeAttr.get(space), sym_visibility="private",
                                initial_value=ir.UnitAttr.get(),
                                alignment=ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                             ALIGNMENT))
            with ir.InsertionPoint.at_block_begin(body), func.location:
                base = memref.get_global(space, name)
            for b in buffers:
                with ir.InsertionPoint(b.alloc), b.alloc.location:
                    offset = arith.constant(ir.IndexType.get(), b.offset)
                    view = memref.view(b.alloc.results[0].type, base, offset, [])
                b.alloc.results[0].replace_all_uses_with(view)
                b.alloc.erase()
                rewritten += 1
        if held:
            payload.operation.attributes[WORKSPACE_BYTES] = ir.IntegerAttr.get(
                ir.IntegerType.get_signless(64), held)
    return rewritten


def workspace_bytes(module: ir.Module) -> int:
    """The WORKSPACE_BYTES of a lowered module (0 when it has none)."""
    attrs = module.operation.attributes
    return ir.IntegerAttr(attrs[WORKSPACE_BYTES]).value if WORKSPACE_BYTES in attrs else 0
