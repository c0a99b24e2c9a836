"""split_affine_reductions: a class sum affine in per-row values is split into sums that do
not read them, so it can join the fused class loop with the reductions producing them.

A reduction over axis c of terms t_c that depend on values a_k constant along c (inputs
whose maps do not use c: per-row values such as m and log l of a log_softmax) as
    t_c = f_c + sum_k g_{k,c} * a_k          (f, g not reading any a_k)
is rewritten
    init + sum_c t_c  =  (init + sum_c f_c) + sum_k a_k * (sum_c g_{k,c}).
(a label-smoothing sum of w_c * logp_c = w_c * (x_c - m - log l) becomes sum_c w_c x_c and
sum_c w_c). The decomposition is read off the body: a_k itself, values free of every a_k,
addf, subf, negf, mulf and divf by a free value, select on a free condition; anything else
applied to an a_k-dependent value is not affine and the reduction is left alone.
Mathematically exact; in floating point the sums are reassociated.

Target: the axis op, a reduction with one reduction dim (the row max m of a log_softmax).
Rewritten: every additive float reduction of its block with one reduction dim that runs
with the axis's (transform_ext/analysis/dims.py), the axis excluded, whose term is affine
in its atoms: the inputs constant along that dim that are m or are computed from m in the
block. Legality first: the target holds one op with one reduction dim; else a silenceable
failure (nothing rewritten). The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.maps import Const, make_map, terms
from .analysis.structure import loop_structure
from .common import (Illegal, RewritesTargets, Success, body_of, build_generic, defining_op,
                     depends_on, fail, iterator_kinds, payload_ops)
from .dialect import TransformExt
from .split_class_reductions import axis_of, combiner_term

NAME = "transform_ext.split_affine_reductions"


class NotAffine(Exception):
    pass


class _Decomposer:
    def __init__(self, block: ir.Block, atoms: list[int]):
        self.block = block
        self.atoms = atoms
        self.dep_cache: dict = {}

    def depends(self, value: ir.Value) -> bool:
        if value in self.dep_cache:
            return self.dep_cache[value]
        if isinstance(value, ir.BlockArgument):
            result = value.owner == self.block and value.arg_number in self.atoms
        else:
            op = defining_op(value)
            result = op is not None and op.block == self.block and any(
                self.depends(v) for v in op.operands)
        self.dep_cache[value] = result
        return result

    def check(self, value: ir.Value) -> None:
        """Raise NotAffine unless `value` is affine in the atoms."""
        if not self.depends(value) or isinstance(value, ir.BlockArgument):
            return
        op = defining_op(value)
        name = op.name
        ops = list(op.operands)
        if name in ("arith.addf", "arith.subf", "arith.negf"):
            for v in ops:
                self.check(v)
        elif name in ("arith.mulf", "arith.divf"):
            deps = [self.depends(v) for v in ops]
            if deps[0] and deps[1] or name == "arith.divf" and deps[1]:
                raise NotAffine(f"{name} of two values that read the row values")
            self.check(ops[0] if deps[0] else ops[1])
        elif name == "arith.select":
            if self.depends(ops[0]):
                raise NotAffine("select on a condition that reads the row values")
            self.check(ops[1])
            self.check(ops[2])
        else:
            raise NotAffine(f"{name} of a value that reads the row values")


class _Emitter:
    """Emits, in a new body, one component of an affine value: the free part (atom None)
    or the coefficient of atom k. None stands for a zero component."""

    def __init__(self, dec: _Decomposer, args: dict, ftype):
        self.dec = dec
        self.args = args          # old block argument -> new block argument
        self.ftype = ftype
        self.cache: dict = {}

    def clone(self, value: ir.Value) -> ir.Value:
        if value in self.args:
            return self.args[value]
        if ("clone", value) in self.cache:
            return self.cache[("clone", value)]
        op = defining_op(value)
        if op is None or op.block != self.dec.block:
            return value
        operands = [self.clone(v) for v in op.operands]  # before the op that reads them
        new = op.clone()
        for i, v in enumerate(operands):
            new.operands[i] = v
        for r_old, r_new in zip(op.results, new.results):
            self.cache[("clone", r_old)] = r_new
        return self.cache[("clone", value)]

    def emit(self, value: ir.Value, atom):
        key = (atom, value)
        if key in self.cache:
            return self.cache[key]
        result = self._emit(value, atom)
        self.cache[key] = result
        return result

    def _emit(self, value: ir.Value, atom):
        dec = self.dec
        if not dec.depends(value):
            return self.clone(value) if atom is None else None
        if isinstance(value, ir.BlockArgument):
            if atom is not None and value.arg_number == atom:
                return arith.ConstantOp(self.ftype, ir.FloatAttr.get(self.ftype, 1.0)).result
            return None
        op = defining_op(value)
        name = op.name
        ops = list(op.operands)
        if name == "arith.addf":
            return self._add(self.emit(ops[0], atom), self.emit(ops[1], atom))
        if name == "arith.subf":
            a, b = self.emit(ops[0], atom), self.emit(ops[1], atom)
            if b is None:
                return a
            return arith.negf(b) if a is None else arith.subf(a, b)
        if name == "arith.negf":
            a = self.emit(ops[0], atom)
            return None if a is None else arith.negf(a)
        if name in ("arith.mulf", "arith.divf"):
            dep, free = (0, 1) if dec.depends(ops[0]) else (1, 0)
            a = self.emit(ops[dep], atom)
            if a is None:
                return None
            f = self.clone(ops[free])
            if name == "arith.divf":
                return arith.divf(a, f)
            return arith.mulf(a, f) if dep == 0 else arith.mulf(f, a)
        if name == "arith.select":
            a, b = self.emit(ops[1], atom), self.emit(ops[2], atom)
            if a is None and b is None:
                return None
            zero = arith.ConstantOp(self.ftype, ir.FloatAttr.get(self.ftype, 0.0)).result
            return arith.select(self.clone(ops[0]), zero if a is None else a,
                                zero if b is None else b)
        raise NotAffine(name)

    @staticmethod
    def _add(a, b):
        if a is None:
            return b
        if b is None:
            return a
        return arith.addf(a, b)


def affine_atoms(op: ir.Operation, is_atom_operand) -> list[int]:
    """Inputs of reduction `op` constant along its reduction dim that are atoms."""
    maps = [terms(m) for m in linalg.get_indexing_maps(op)]
    kinds = iterator_kinds(op)
    red = [d for d, k in enumerate(kinds) if k == "reduction"]
    n_in = len(op.operands) - len(op.results)
    out = []
    for i in range(n_in):
        t = maps[i]
        if t is None or any(d in t for d in red):
            continue
        if isinstance(op.operands[i].type, ir.RankedTensorType) and is_atom_operand(op.operands[i]):
            out.append(i)
    return out


def affine_split(op: ir.Operation, is_atom_operand):
    """(decomposer, term, atoms) when `op` is an additive float reduction with one reduction
    dim whose term is affine in its atoms, else None."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        return None
    kinds = iterator_kinds(op)
    red = [d for d, k in enumerate(kinds) if k == "reduction"]
    if len(red) != 1:
        return None
    ct = combiner_term(op)
    if ct is None:
        return None
    term, _ = ct
    atoms = affine_atoms(op, is_atom_operand)
    block = body_of(op)
    dec = _Decomposer(block, atoms)
    if not atoms or not dec.depends(term):
        return None
    if not isinstance(term.type, ir.FloatType):
        return None
    try:
        dec.check(term)
    except NotAffine:
        return None
    return dec, term, atoms


def split_affine_reduction(op: ir.Operation, dec, term, atoms, rewriter) -> None:
    """Rewrite `op` as described in the module docstring."""
    ftype = term.type
    with op.location, ir.InsertionPoint(op):
        sums = []
        for atom in [None] + atoms:
            s = _component_reduction(op, dec, term, atom, ftype, rewriter)
            if s is not None:
                sums.append((atom, s))
        result = _combine(op, sums)
    rewriter.replace_op(op, [result])


def _component_reduction(op, dec, term, atom, ftype, rewriter):
    """sum_c (component `atom` of term) into op's init (free part) or a zero init; None for
    a zero coefficient (the init itself for a zero free part)."""
    view = op.opview
    keep = [i for i in range(len(view.inputs)) if i not in dec.atoms]  # atoms are not read
    inputs = [view.inputs[i] for i in keep]
    init = view.outputs[0]
    all_maps = [m.value for m in view.indexing_maps]
    maps = [all_maps[i] for i in keep] + all_maps[len(view.inputs):]
    block = body_of(op)
    if atom is not None:
        t = init.type
        empty = tensor.EmptyOp(list(t.shape), t.element_type).result
        zero = arith.ConstantOp(ftype, ir.FloatAttr.get(ftype, 0.0)).result
        init = linalg.fill(zero, outs=[empty])
    state = {"zero": False}

    def body(args):
        mapping = {block.arguments[i]: args[j] for j, i in enumerate(keep)}
        e = _Emitter(dec, mapping, ftype)
        value = e.emit(term, atom)
        if value is None:
            state["zero"] = True
            return [args[-1]]
        return [arith.addf(value, args[-1])]

    new = build_generic(inputs, [init], maps, iterator_kinds(op), body, name_from=op)
    if state["zero"]:
        rewriter.erase_op(new.operation)
        return view.outputs[0] if atom is None else None
    return new.results[0]


def _combine(op, sums) -> ir.Value:
    """free + sum_k atom_k * coef_k, elementwise over op's output."""
    maps = [terms(m) for m in linalg.get_indexing_maps(op)]
    out_terms = maps[-1]
    rank = len(out_terms)
    to_out = {d: p for p, d in enumerate(out_terms) if not isinstance(d, Const)}
    identity = ir.AffineMap.get_identity(rank)
    free = next(s for a, s in sums if a is None)
    coef = [(a, s) for a, s in sums if a is not None]
    inputs, in_maps = [free], [identity]
    for a, s in coef:
        inputs.append(s)
        in_maps.append(identity)
        inputs.append(op.operands[a])
        in_maps.append(make_map(rank, [t if isinstance(t, Const) else to_out[t] for t in maps[a]]))
    init = op.opview.outputs[0]

    def body(args):
        acc, pos = args[0], 1
        for _ in coef:
            acc = arith.addf(acc, arith.mulf(args[pos + 1], args[pos]))
            pos += 2
        return [acc]

    new = build_generic(inputs, [init], in_maps + [identity], ["parallel"] * rank, body)
    return new.results[0]


def plan(target_ops: list) -> list:
    """(op, decomposer, term, atoms) of every reduction to split; raises Illegal."""
    axis, k, ops, classes = axis_of(target_ops)
    m = axis.results[0]

    def is_atom(v):
        if v == m:
            return True
        p = defining_op(v)
        return p is not None and depends_on(p, m)

    found = []
    for op in ops:
        ls = loop_structure(op)
        if op == axis or len(ls.reduction_dims) != 1 or \
                not classes.same((op, ls.reduction_dims[0]), (axis, k)):
            continue
        split = affine_split(op, is_atom)
        if split is not None:
            found.append((op, *split))
    return found


class SplitAffineReductionsOp(TransformExt.Operation, name="split_affine_reductions"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    todo = plan(targets)
                except Illegal as illegal:
                    if illegal.payload is None:
                        illegal.payload = op.operation
                    return fail(NAME, illegal)
                for reduction, dec, term, atoms in todo:
                    split_affine_reduction(reduction, dec, term, atoms, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_affine_reductions(target: ir.Value) -> SplitAffineReductionsOp:
    """Split the class sums of `target`'s block that are affine in values computed from
    `target`'s result (see the module docstring); `target`: the row max."""
    return SplitAffineReductionsOp(target)


__all__ = ["SplitAffineReductionsOp", "split_affine_reductions"]
