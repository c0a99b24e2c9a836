"""Rewrites of additive reductions over the classes, so they can join the fused class loop.

split_class_reduction: a sum over the rows and the classes at once (the mean of a loss with
probability targets) becomes a sum over the classes per row, then a sum over the rows:
    init + sum_{r, c} t_{r, c} = init + sum_r (sum_c t_{r, c}).

split_affine_reduction: a reduction over axis c of terms t_c that depend on values a_k constant along c (inputs
whose maps do not use c: per-row values such as m and log l of a log_softmax) as
    t_c = f_c + sum_k g_{k,c} * a_k          (f, g not reading any a_k)
is rewritten
    init + sum_c t_c  =  (init + sum_c f_c) + sum_k a_k * (sum_c g_{k,c}).
The new reductions read no a_k, so they can run in the same loop as the reductions that
produce the a_k (a label-smoothing sum of w_c * logp_c = w_c * (x_c - m - log l) becomes
sum_c w_c x_c and sum_c w_c). The decomposition is read off the body: a_k itself, values
free of every a_k, addf, subf, negf, mulf and divf by a free value, select on a free
condition; anything else applied to an a_k-dependent value is not affine and the reduction
is left alone. Mathematically exact; in floating point the sums are reassociated.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, tensor

from transform_ext.analysis.maps import Const, make_map, terms
from transform_ext.common import (body_of, build_generic, defining_op, iterator_kinds,
                                  terminator)


class NotAffine(Exception):
    pass


_ADDITIVE = ("arith.addf",)


def _combiner_term(op: ir.Operation):
    """(term, accumulator) when the body yields addf(term, acc), else None."""
    block = body_of(op)
    y = terminator(block).operands
    if len(y) != 1:
        return None
    add = defining_op(y[0])
    acc = block.arguments[len(block.arguments) - 1]
    if add is None or add.name not in _ADDITIVE or add.block != block:
        return None
    a, b = add.operands
    if b == acc and a != acc:
        return a, acc
    if a == acc and b != acc:
        return b, acc
    return None


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


def split_class_reduction(op: ir.Operation, class_loop: int) -> bool:
    """Rewrite an additive reduction over `class_loop` and other loops as described in the
    module docstring; False (and no change) when it is not one."""
    if op.name != "linalg.generic" or len(op.results) != 1 or _combiner_term(op) is None:
        return False
    kinds = iterator_kinds(op)
    red = [d for d, k in enumerate(kinds) if k == "reduction"]
    if class_loop not in red or len(red) < 2:
        return False
    ftype = op.results[0].type.element_type
    if not isinstance(ftype, ir.FloatType):
        return False
    view = op.opview
    maps = [terms(m.value) for m in view.indexing_maps]
    n_loops = len(kinds)
    kept = [d for d in range(n_loops) if d != class_loop]
    shape = []
    for d in kept:
        for v, t in zip(list(view.inputs) + list(view.outputs), maps):
            if isinstance(v.type, ir.RankedTensorType) and d in t:
                shape.append(v.type.shape[t.index(d)])
                break
        else:
            return False
    block = body_of(op)
    with op.context, op.location, ir.InsertionPoint(op):
        empty = tensor.EmptyOp(shape, ftype).result
        zero = arith.ConstantOp(ftype, ir.FloatAttr.get(ftype, 0.0)).result
        init = linalg.fill(zero, outs=[empty])
        row_map = make_map(n_loops, kept)

        def inner_body(args):
            mapping = {a: b for a, b in zip(block.arguments, args)}
            for inner in list(block.operations)[:-1]:
                clone = inner.operation.clone()
                for i, v in enumerate(clone.operands):
                    if v in mapping:
                        clone.operands[i] = mapping[v]
                for r_old, r_new in zip(inner.operation.results, clone.results):
                    mapping[r_old] = r_new
            return [mapping.get(v, v) for v in terminator(block).operands]

        in_maps = [m.value for m in view.indexing_maps][:len(view.inputs)]
        inner_kinds = ["reduction" if d == class_loop else "parallel" for d in range(n_loops)]
        inner = build_generic(list(view.inputs), [init], in_maps + [row_map], inner_kinds,
                              inner_body, name_from=op)
        position = {d: i for i, d in enumerate(kept)}
        out_map = make_map(len(kept), [t if isinstance(t, Const) else position[t] for t in maps[-1]])
        outer = build_generic([inner.results[0]], [view.outputs[0]],
                              [ir.AffineMap.get_identity(len(kept)), out_map],
                              [kinds[d] for d in kept], lambda a: [arith.addf(a[0], a[1])])
    op.results[0].replace_all_uses_with(outer.results[0])
    op.erase()
    return True


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


def split_affine_reduction(op: ir.Operation, is_atom_operand) -> bool:
    """Rewrite `op` as described in the module docstring; False (and no change) when it
    has no atoms, is not an additive reduction with one reduction dim, or is not affine."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        return False
    kinds = iterator_kinds(op)
    red = [d for d, k in enumerate(kinds) if k == "reduction"]
    if len(red) != 1:
        return False
    ct = _combiner_term(op)
    if ct is None:
        return False
    term, _ = ct
    atoms = affine_atoms(op, is_atom_operand)
    block = body_of(op)
    dec = _Decomposer(block, atoms)
    if not atoms or not dec.depends(term):
        return False
    ftype = term.type
    if not isinstance(ftype, ir.FloatType):
        return False
    try:
        dec.check(term)
    except NotAffine:
        return False
    with op.context, op.location, ir.InsertionPoint(op):
        sums = []
        for atom in [None] + atoms:
            s = _component_reduction(op, dec, term, atom, ftype)
            if s is not None:
                sums.append((atom, s))
        result = _combine(op, sums)
    op.results[0].replace_all_uses_with(result)
    op.erase()
    return True


def _component_reduction(op, dec, term, atom, ftype):
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
        new.operation.erase()
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
