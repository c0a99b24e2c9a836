"""checks_to_error_code: assertion checks become an error code the function returns.

The kernel-reported error. In each function of the target module, the generics at the top
level of its body that hold `cf.assert` and compute results are split first (the
split_assertions rewrite, where it applies); then every assertion check (a result-less
generic whose body holds cf.assert, see match_assertion_checks)

    linalg.generic ins(%x...) { cf.assert(p_1, msg_1) ... cf.assert(p_j, msg_j) }

becomes a reduction over all its loops into a rank-0 i32 tensor,

    code = max over the iteration space of max_i (p_i ? 0 : k(msg_i))      (init 0)

where k(msg) is the 1-based position of msg in the module attribute `lh.kernel_errors`
(an array of strings: the messages already listed are kept and new ones appended in the
order met). The codes of a function's checks are combined with maxsi and returned as one
more function result, the last; the function type follows. So the code is 0 when every
assertion holds, else the k of a failing message (the largest k when several fail).
Nothing aborts: the caller reads the code after the call (lighthouse.runtime.JitFunction
raises the message as a KernelError). A function without checks is unchanged; the module
attribute is only written when some check was replaced.

Targets: builtin.module ops. Illegal (a silenceable failure, nothing rewritten): a target
that is not a module, a `lh.kernel_errors` attribute that is not an array of strings, a
function with checks whose body does not end in func.return. The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform
from torch_mlir.dialects import func as func_dialect

from .common import (Illegal, RewritesTargets, Success, block_ops, build_generic, fail,
                     iterator_kinds, payload_ops, terminator)
from .dialect import TransformExt
from .match_assertion_checks import assertion_checks
from .refresh_function_type import refresh_function_type_of
from .split_assertions import holds_assertions, split, unsplittable_reason

NAME = "transform_ext.checks_to_error_code"
KERNEL_ERRORS_ATTR = "lh.kernel_errors"


def kernel_error_messages(module: ir.Operation) -> list[str]:
    """The messages of the error codes of `module` (`lh.kernel_errors`), [] when none."""
    attrs = module.attributes
    if KERNEL_ERRORS_ATTR not in attrs:
        return []
    return [ir.StringAttr(a).value for a in ir.ArrayAttr(attrs[KERNEL_ERRORS_ATTR])]


def _functions(module: ir.Operation) -> list[ir.Operation]:
    return [op for op in block_ops(module.regions[0].blocks[0])
            if op.name == "func.func" and len(op.regions[0].blocks)]


def _splittable(op: ir.Operation) -> bool:
    return holds_assertions(op) and unsplittable_reason(op) is None


def _check_legal(module: ir.Operation) -> None:
    if module.name != "builtin.module":
        raise Illegal(module, "not a builtin.module")
    if KERNEL_ERRORS_ATTR in module.attributes:
        attr = module.attributes[KERNEL_ERRORS_ATTR]
        if not isinstance(attr, ir.ArrayAttr) or not all(isinstance(a, ir.StringAttr) for a in attr):
            raise Illegal(module, f"its {KERNEL_ERRORS_ATTR} attribute is not an array of strings")
    for func in _functions(module):
        ops = block_ops(func)
        if any(_splittable(op) for op in ops) or assertion_checks(func):
            if terminator(func.regions[0].blocks[0]).name != "func.return":
                raise Illegal(func, "has assertion checks but its body does not end in "
                                    "func.return")


def _code_of(check: ir.Operation, messages: list[str], i32) -> ir.Value:
    """The error code reduction replacing `check` (built in front of it)."""
    view = check.opview
    inputs = list(view.inputs)
    maps = [m.value for m in view.indexing_maps]
    n_loops = maps[0].n_dims if maps else len(iterator_kinds(check))
    body = check.regions[0].blocks[0]

    def code_body(args):
        mapping = {body.arguments[i]: args[i] for i in range(len(inputs))}
        code = args[len(inputs)]
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            if inner.name != "cf.assert":
                clone = inner.clone()
                for i, v in enumerate(clone.operands):
                    if v in mapping:
                        clone.operands[i] = mapping[v]
                for old, new in zip(inner.results, clone.results):
                    mapping[old] = new
                continue
            message = ir.StringAttr(inner.attributes["msg"]).value
            if message not in messages:
                messages.append(message)
            ok = mapping.get(inner.operands[0], inner.operands[0])
            zero = arith.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result
            k = arith.ConstantOp(i32, ir.IntegerAttr.get(i32, messages.index(message) + 1)).result
            code = arith.maxsi(code, arith.select(ok, zero, k))
        return [code]

    with ir.InsertionPoint(check), check.location:
        init = linalg.fill(arith.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result,
                           outs=[tensor.EmptyOp([], i32).result])
        scalar = ir.AffineMap.get(n_loops, 0, [])
        return build_generic(inputs, [init], maps + [scalar], ["reduction"] * n_loops,
                             code_body).results[0]


def _rewrite(module: ir.Operation, rewriter) -> None:
    messages = kernel_error_messages(module)
    count = 0
    i32 = ir.IntegerType.get_signless(32)
    for func in _functions(module):
        for op in block_ops(func):
            if _splittable(op):
                split(op, rewriter.erase_op)  # the op's own checks, first split out
        checks = assertion_checks(func)
        if not checks:
            continue
        ret = terminator(func.regions[0].blocks[0])
        codes = []
        for check in checks:
            codes.append(_code_of(check, messages, i32))
            rewriter.erase_op(check)
            count += 1
        with ir.InsertionPoint(ret), ret.location:
            code = codes[0]
            for other in codes[1:]:
                scalar = ir.AffineMap.get(0, 0, [])
                code = build_generic([code, other], [tensor.EmptyOp([], i32).result],
                                     [scalar] * 3, [], lambda a: [arith.maxsi(a[0], a[1])]).results[0]
            func_dialect.ReturnOp(list(ret.operands) + [code])
        rewriter.erase_op(ret)
        refresh_function_type_of(func)
    if count:
        module.attributes[KERNEL_ERRORS_ATTR] = ir.ArrayAttr.get(
            [ir.StringAttr.get(m) for m in messages])


class ChecksToErrorCodeOp(TransformExt.Operation, name="checks_to_error_code"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        _check_legal(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    _rewrite(target, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def checks_to_error_code(target: ir.Value) -> ChecksToErrorCodeOp:
    """Replace the assertion checks of the modules in `target` by error-code results."""
    return ChecksToErrorCodeOp(target)


__all__ = ["ChecksToErrorCodeOp", "checks_to_error_code", "kernel_error_messages",
           "KERNEL_ERRORS_ATTR"]
