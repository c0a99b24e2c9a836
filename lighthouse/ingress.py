"""torch -> linalg-on-tensors with torch-mlir.

Forward: `torch.export` + torch-mlir's import and lowering to linalg-on-tensors, SDPA forced
to the math backend (the only one torch-mlir decomposes) and recurrent layers (LSTM, GRU,
RNN) kept as one loop over the steps each (lighthouse.recurrences). Parameters and buffers
are frozen into the IR as constants; the function's arguments are the tensors of get_inputs().
Other inputs (a Python float, int or bool: KernelBench's `A * s`) are compile-time constants,
as torch.export specializes them: the model is traced with them bound, so the function
takes the tensors only (both directions), and another value needs another compile.

Backward (`import_joint`): the joint forward+backward graph
    (inputs..., params...) -> (outputs..., d inputs..., d params...)
with every floating-point output seeded by ones (for a scalar loss: d loss / d loss = 1),
traced by `make_fx` over `torch.func.vjp` under functionalization (float inputs torch cannot
differentiate through, such as the class weights of nll_loss, get no gradient), decomposed with
torch-mlir's table minus the backward ops torch-mlir lowers to linalg itself
(nll_loss_backward, the softmax backwards), plus a local decomposition of the one-hot
`scatter` into a select. Other scatters and sorts (tm_tensor.scatter / sort) are rewritten
as loops and linalg (lighthouse/tm_tensor_lowering.py), scans by lower_scans.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .causal_masks import index_causal_masks
from .errors import IngressError
from .conv_decompositions import (convolution_decompositions,
                                  transposed_convolution_decompositions)
from .recurrences import RolledRecurrences, calls_for_layers, lower_layer_calls
from .pool_decompositions import (adaptive_pool_decompositions, pool_decompositions,
                                  unbatched_pool_decompositions)
from .flash_decompositions import SdpaIn4d, SdpaMaskGradient, flash_decompositions
from .torch_semantics import (nan_as_torch, refuse_unsigned_bytes,
                              semantics_decompositions)
from .tm_tensor_lowering import (index_decompositions, lower_scatters, lower_sorts,
                                 masked_sums_as_where, prepare_index_puts, row_block, row_count,
                                 transpose_2d)

_DTYPES = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "i1": torch.bool,
}


@dataclass
class TensorSpec:
    """Static shape and dtype of one function argument or result."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), t.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass
class Imported:
    """The imported payload and what is needed to run it and check it against torch.

    `args` are the tensors to pass (in function-argument order); `reference()` recomputes the
    expected results with torch (eager, default backends), one tensor per function result.
    """

    module: object  # torch_mlir.ir.Module
    args: tuple
    reference: Callable[[], tuple]
    arg_specs: list[TensorSpec] = field(default_factory=list)
    result_specs: list[TensorSpec] = field(default_factory=list)
    result_names: list[str] = field(default_factory=list)


def import_forward(model: torch.nn.Module, inputs: tuple, *, name: str = "kernel",
                   weights_as_arguments: int | None = None) -> Imported:
    """Import `model(*inputs)` to linalg-on-tensors; tensors in `inputs` become arguments.
    `weights_as_arguments`: parameters of at least that many elements become trailing
    arguments too (their values appended to `args`) instead of constants, which the import
    would copy into the IR and every later stage again (a 2.7 GB MLP needed 17 GB and was
    killed).

    State the forward writes (a buffer, or a plain tensor attribute it assigns or copies
    into, which is traced as a buffer: `_StateAsBuffers`) is not a result: the
    kernel is a function of its inputs, and the state it was traced with is the state after
    the reference call."""
    inputs = _distinct(inputs)
    tensors = tuple(t for t in inputs if isinstance(t, torch.Tensor))

    def reference():
        with torch.no_grad():
            return _flatten(model(*inputs), name)

    expected = _run_reference(reference, name)  # the model's own errors first, in one line
    importer, diagnostics = _quiet_importer()
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), RolledRecurrences(), \
                _StateAsBuffers(model), warnings.catch_warnings():
            traced = model if len(tensors) == len(inputs) else _ConstantsBound(model, inputs)
            if weights_as_arguments is not None:
                traced, weights = _WeightsAsInputs.lift(traced, len(tensors),
                                                        weights_as_arguments)
                tensors = tensors + weights
            # nn.LSTM/GRU/RNN rebuild their list of parameter aliases in every forward
            warnings.filterwarnings("ignore", "The tensor attributes .*_flat_weights")
            with _QuietShapeLog():
                program = torch.export.export(traced, tensors, strict=False)
            program = program.run_decompositions(_forward_decompositions())
            refuse_unsigned_bytes(program.graph_module, name)
            _refuse_input_writes(program, name)
            index_causal_masks(program)
            empty_tensors_without_work(program.graph_module)
            contiguous_as_strided_as_views(program.graph_module)
            prepare_index_puts(program.graph_module)
            state_in_lists_as_copies(program)
            module = _program_to_linalg(program, importer)
            _drop_state_results(module, program)
    except Exception as exc:
        raise IngressError(_describe_import_failure(name, exc, diagnostics)) from exc
    names = [f"out{i}" for i in range(len(expected))]
    return _finish(module, tensors, reference, expected, names, name)


class _StateAsBuffers:
    """While torch.export traces: every plain tensor attribute of the model's modules (not
    a parameter or buffer, e.g. a recurrent state `self.hidden = torch.randn(...)` that the
    forward copies into and reassigns) is a buffer, which export lets the forward write
    (it refuses a mutated constant), and every buffer is persistent (torch-mlir's import
    looks buffers up in the state dict, which leaves the non-persistent ones out: "Could
    not find state mapping for buffer"); afterwards each is as it was, with the value it
    had before."""

    def __init__(self, model: torch.nn.Module):
        self.attributes = [(module, name, value) for module in model.modules()
                           for name, value in list(vars(module).items())
                           if isinstance(value, torch.Tensor)
                           and not isinstance(value, torch.nn.Parameter)]
        self.non_persistent = [(module, set(module._non_persistent_buffers_set))
                               for module in model.modules()
                               if module._non_persistent_buffers_set]

    def __enter__(self):
        for module, name, value in self.attributes:
            delattr(module, name)
            module.register_buffer(name, value)
        for module, _ in self.non_persistent:
            module._non_persistent_buffers_set.clear()
        return self

    def __exit__(self, *exc):
        for module, names in self.non_persistent:
            module._non_persistent_buffers_set.update(names)
        for module, name, value in self.attributes:
            module._buffers.pop(name, None)
            object.__setattr__(module, name, value)
        return False


def _refuse_input_writes(program, name: str) -> None:
    """A forward that writes an input tensor in place (x.add_(1)) is refused: the kernel is a
    function of its inputs and returns new tensors only."""
    written = sorted(set(program.graph_signature.user_inputs_to_mutate.values()))
    if written:
        raise IngressError(f"{name}: the forward writes its input {', '.join(written)} in place; "
                           f"the kernel cannot write its inputs: write to a copy "
                           f"(x = x.clone()) and return it")


def _drop_state_results(module, program) -> None:
    """Remove the results export adds for the buffers the forward writes (their new values,
    ahead of the model's own results): the kernel returns the model's results only."""
    from torch.export.graph_signature import OutputKind
    from torch_mlir import ir

    drop = {i for i, spec in enumerate(program.graph_signature.output_specs)
            if spec.kind == OutputKind.BUFFER_MUTATION}
    if not drop:
        return
    func = _main_func(module)
    with module.context:
        block = func.regions[0].blocks[0]
        ret = list(block.operations)[-1]
        kept = [v for i, v in enumerate(ret.operands) if i not in drop]
        with ir.InsertionPoint(ret), ret.location:
            ir.Operation.create("func.return", operands=kept)
        ret.erase()
        fn_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        func.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            fn_type.inputs, [v.type for v in kept]))


def _program_to_linalg(program, importer):
    """torch-mlir's import of `program` and its lowering to linalg-on-tensors, with the
    recurrent layers' ops (lighthouse.recurrences) carried through as calls and lowered to
    loops before the backend contract is checked."""
    from torch_mlir import fx, passmanager
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report

    module = fx.export_and_import(program, output_type="raw", func_name="main",
                                  fx_importer=importer, decomposition_table={})
    calls_for_layers(module)
    run_pipeline_with_repro_report(
        module, "builtin.module(func.func(torch-match-quantized-custom-ops),"
        "torchdynamo-export-to-torch-backend-pipeline{ extra-library=})",
        "Lowering TorchFX IR -> Torch Backend IR")
    verify = "torch-verify-linalg-on-tensors-backend-contract"
    with module.context:
        pipeline = str(passmanager.PassManager.parse(
            "builtin.module(torch-backend-to-linalg-on-tensors-backend-pipeline"
            "{allow-non-finites=True})"))
    lowering = pipeline.removesuffix(f",{verify})") + ")"
    assert lowering != pipeline + ")", f"the linalg pipeline no longer ends with {verify}"
    run_pipeline_with_repro_report(module, lowering,
                                   "Lowering Torch Backend IR -> Linalg-on-Tensors Backend IR")
    lower_layer_calls(module)
    run_pipeline_with_repro_report(module, f"builtin.module({verify})",
                                   "Lowering Torch Backend IR -> Linalg-on-Tensors Backend IR")
    return module


class _ConstantsBound(torch.nn.Module):
    """`model` with its non-tensor inputs bound: forward(*tensors) calls model(*inputs) with
    the tensors in their places (torch.export would keep an unused argument for each)."""

    def __init__(self, model: torch.nn.Module, inputs: tuple):
        super().__init__()
        self.model = model
        self.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
        self.constants = [None if t else x for t, x in zip(self.is_tensor, inputs)]

    def forward(self, *tensors):
        given = iter(tensors)
        return self.model(*(next(given) if t else c for t, c in zip(self.is_tensor, self.constants)))


class _WeightsAsInputs(torch.nn.Module):
    """`model` with its parameters `names` read from trailing inputs: forward(*tensors)
    calls model(*tensors[:n]) with those parameters set to tensors[n:]. The model is held
    outside the module's registry, so torch.export lifts none of its parameters; its
    buffers are this module's too (`buffer<i>`, the same tensors), passed to the call, so
    that export sees the forward write them as buffers, not as constants it refuses to see
    mutated."""

    def __init__(self, model: torch.nn.Module, inputs: int, names: list[str]):
        super().__init__()
        self.held = [model]
        self.inputs = inputs
        self.names = names
        self.buffer_names = []
        for i, (name, buffer) in enumerate(model.named_buffers()):
            self.register_buffer(f"buffer{i}", buffer)
            self.buffer_names.append(name)

    @staticmethod
    def lift(model: torch.nn.Module, inputs: int, min_elements: int):
        """(the module to trace, the lifted parameters' values); `model` itself when no
        floating-point parameter has `min_elements` elements."""
        big = [(n, p) for n, p in model.named_parameters()
               if p.is_floating_point() and p.numel() >= min_elements]
        if not big:
            return model, ()
        return (_WeightsAsInputs(model, inputs, [n for n, _ in big]),
                tuple(p.detach() for _, p in big))

    def forward(self, *tensors):
        state = dict(zip(self.names, tensors[self.inputs:]))
        state.update((name, getattr(self, f"buffer{i}"))
                     for i, name in enumerate(self.buffer_names))
        return torch.func.functional_call(self.held[0], state, tensors[:self.inputs])


def import_joint(model: torch.nn.Module, inputs: tuple, *, name: str = "kernel") -> Imported:
    """Import the joint forward+backward graph (see the module docstring for its signature)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_mlir import fx

    inputs = _distinct(inputs)
    tensor_pos = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
    grad_pos = _differentiable(model, inputs, [i for i in tensor_pos if inputs[i].is_floating_point()])
    params = {k: v.detach() for k, v in model.named_parameters() if v.is_floating_point()}
    param_names = list(params)
    if not grad_pos and not params:
        raise IngressError(f"{name}: --backward needs a floating-point input or parameter")

    def forward(diff_inputs, diff_params):
        full = list(inputs)
        for i, t in zip(grad_pos, diff_inputs):
            full[i] = t
        return torch.func.functional_call(model, diff_params, tuple(full))

    def joint(*flat):
        n = len(tensor_pos)
        given = dict(zip(tensor_pos, flat[:n]))
        fixed = list(inputs)
        for i, t in given.items():
            fixed[i] = t
        diff_inputs = tuple(given[i] for i in grad_pos)
        diff_params = dict(zip(param_names, flat[n:]))

        def f(di, dp):
            full = list(fixed)
            for i, t in zip(grad_pos, di):
                full[i] = t
            with _GroupNormInF32():
                outs = _flatten(torch.func.functional_call(model, dp, tuple(full)), name)
            # the floating results are differentiated; integer ones (indices) ride along
            return tuple(o for o in outs if o.is_floating_point()), outs

        floats, vjp, outs = torch.func.vjp(f, diff_inputs, diff_params, has_aux=True)
        d_inputs, d_params = vjp(tuple(torch.ones_like(o) for o in floats))
        return (*outs, *d_inputs, *(d_params[k] for k in param_names))

    def reference():
        di = tuple(inputs[i].detach().clone().requires_grad_(True) for i in grad_pos)
        dp = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        with torch.enable_grad():
            out = forward(di, dp)
            outs = _flatten(out, name)
            wrt = list(di) + list(dp.values())
            seeds = _seed_like(out)
            seeds = [seeds] if isinstance(seeds, torch.Tensor) or seeds is None else list(seeds)
            # results without a gradient (integer indices, constants) seed nothing
            pairs = [(o, s) for o, s in zip(outs, seeds) if s is not None and o.requires_grad]
            grads = (torch.autograd.grad([o for o, _ in pairs], wrt, [s for _, s in pairs],
                                         allow_unused=True) if pairs else [None] * len(wrt))
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
        return tuple(o.detach() for o in outs) + tuple(g.detach() for g in grads)

    expected = _run_reference(reference, name)  # the model's own errors first, in one line

    flat_args = tuple(inputs[i] for i in tensor_pos) + tuple(params.values())
    importer, diagnostics = _quiet_importer()
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]), SdpaMaskGradient(), \
                SdpaIn4d():
            gm = _trace_joint(joint, flat_args)
        refuse_unsigned_bytes(gm, name)
        empty_tensors_without_work(gm)
        contiguous_as_strided_as_views(gm)
        masked_sums_as_where(gm)
        prepare_index_puts(gm)
        module = fx.stateless_fx_import(gm, output_type="linalg-on-tensors", model_name="main",
                                        fx_importer=importer)
    except Exception as exc:
        raise IngressError(_describe_import_failure(name, exc, diagnostics)) from exc

    n_out = len(expected) - len(grad_pos) - len(param_names)
    names = ([f"out{i}" for i in range(n_out)] + [f"d_input{i}" for i in grad_pos]
             + [f"d_{k}" for k in param_names])
    return _finish(module, flat_args, reference, expected, names, name)


def import_graph(gm: torch.fx.GraphModule, *, name: str = "graph") -> Imported:
    """Import an ATen-level FX graph (AOTAutograd's forward, backward or inference graph, or
    a part of one: lighthouse.partition) whose placeholders and nodes carry their example
    values in `meta["val"]` and whose output is a tuple of tensors. The graph is copied,
    never rewritten. The function's arguments are the placeholders, its results the
    outputs; there is no torch reference (`Imported.reference` raises)."""
    from torch_mlir import fx

    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    specs = [node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"]
    for i, val in enumerate(specs):
        if not isinstance(val, torch.Tensor):
            raise IngressError(f"{name}: input {i} is {type(val).__name__}, not a tensor")
    importer, diagnostics = _quiet_importer()
    try:
        refuse_unsigned_bytes(gm, name)
        empty_tensors_without_work(gm)
        contiguous_as_strided_as_views(gm)
        masked_sums_as_where(gm)
        prepare_index_puts(gm)
        module = fx.stateless_fx_import(gm, output_type="linalg-on-tensors", model_name="main",
                                        fx_importer=importer)
    except Exception as exc:
        raise IngressError(_describe_import_failure(name, exc, diagnostics)) from exc
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)

    def reference():
        raise IngressError(f"{name}: a graph has no torch reference")

    names = [f"out{i}" for i in range(len(outputs))]
    return _finish(module, tuple(specs), reference, outputs, names, name)


def _trace_joint(joint, flat_args) -> torch.fx.GraphModule:
    """`joint` traced functionalized with the joint decompositions. torch.func.functionalize
    has no rule for an autograd.Function under vjp (the attention with a mask gradient,
    flash_decompositions.AttentionMasked): such a joint is traced first as it is, then that
    graph functionalized and decomposed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        return make_fx(torch.func.functionalize(joint, remove="mutations"),
                       decomposition_table=_joint_decompositions())(*flat_args)
    except RuntimeError as exc:
        if "Functionalize rule for custom_function_call" not in str(exc):
            raise
    plain = make_fx(joint)(*flat_args)
    return make_fx(torch.func.functionalize(plain, remove="mutations"),
                   decomposition_table=_joint_decompositions())(*flat_args)


def empty_tensors_without_work(gm: torch.fx.GraphModule) -> int:
    """Every op of the FX graph whose result holds no elements becomes `aten.empty` of that
    shape and dtype: there is nothing to compute, and torch-mlir's lowering of some ops on
    empty tensors divides by a zero extent (a `view` to [0, 1] stops the process with
    SIGFPE). Exact; returns the number of ops replaced."""
    graph = gm.graph
    empty = torch.ops.aten.empty.memory_format
    replaced = 0
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or node.target is empty \
                or not isinstance(value, torch.Tensor) or value.numel() != 0:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(empty, (list(value.shape),),
                                      {"dtype": value.dtype, "device": torch.device("cpu")})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        name = node.name
        graph.erase_node(node)
        new._rename(name)  # the exported program's signature names its outputs
        replaced += 1
    if replaced:
        graph.eliminate_dead_code()
        gm.recompile()
    return replaced


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for n in reversed(list(shape)):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def contiguous_as_strided_as_views(gm: torch.fx.GraphModule) -> int:
    """Every `aten.as_strided(x, size, stride, 0)` that reads all of a contiguous x in its
    order (stride the contiguous strides of size, dims of extent 1 aside; as many elements
    as x) becomes `aten.view(x, size)`. torch's group norm of an [N, C] input ends in two
    of them; torch-mlir imports an as_strided as a gather through one constant index tensor
    per dim of x (four [N, C] int64 tensors each), which a view does without. Exact;
    returns the number of ops replaced."""
    graph = gm.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.as_strided.default:
            continue
        source, size, stride = node.args[:3]
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        x = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(x, torch.Tensor) or not x.is_contiguous() or x.storage_offset() != 0 \
                or offset not in (None, 0) or not all(isinstance(n, int) for n in list(size) + list(stride)):
            continue
        if math.prod(size) != x.numel() or any(
                n != 1 and s != c for n, s, c in zip(size, stride, _contiguous_strides(size))):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.aten.view.default, (source, list(size)))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        name = node.name
        graph.erase_node(node)
        new._rename(name)
        replaced += 1
    if replaced:
        graph.eliminate_dead_code()
        gm.recompile()
    return replaced


def state_in_lists_as_copies(program) -> int:
    """A parameter, buffer or tensor constant read inside a list argument (the indices of
    `w[self.index]`, an `aten.index` of a buffer) is read through an `aten.clone` of it:
    torch-mlir's import freezes state by putting the tensor itself in the argument, and a
    tensor among a list's nodes fails its import ("Heterogeneous lists are not supported").
    Exact; returns the number of reads replaced."""
    sig = program.graph_signature
    state = {*sig.inputs_to_parameters, *sig.inputs_to_buffers,
             *sig.inputs_to_lifted_tensor_constants}
    graph = program.graph_module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        args = list(node.args)
        for i, arg in enumerate(args):
            if not isinstance(arg, (list, tuple)) or not any(
                    isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in state
                    for a in arg):
                continue
            items = []
            for a in arg:
                if isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in state:
                    with graph.inserting_before(node):
                        copy = graph.call_function(torch.ops.aten.clone.default, (a,))
                    copy.meta = dict(a.meta)
                    a, replaced = copy, replaced + 1
                items.append(a)
            args[i] = type(arg)(items)
        node.args = tuple(args)
    if replaced:
        program.graph_module.recompile()
    return replaced


def _run_reference(reference, name: str) -> tuple:
    """torch on the example inputs; a forward that raises (inputs torch rejects such as a
    target out of range, or the user's own error) is one line naming the kernel and the
    reason."""
    try:
        return reference()
    except IngressError:
        raise
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise IngressError(f"{name}: Model.forward fails on the example inputs: "
                           f"{type(exc).__name__}: {reason}") from exc


def _finish(module, args, reference, expected, names, name) -> Imported:
    from torch_mlir import ir

    func = _main_func(module)
    fn_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    arg_specs = [_spec_of_type(t, name, f"argument {i}") for i, t in enumerate(fn_type.inputs)]
    result_specs = [_spec_of_type(t, name, f"result {i}") for i, t in enumerate(fn_type.results)]
    if len(arg_specs) != len(args):
        raise IngressError(f"{name}: the imported function takes {len(arg_specs)} tensors but "
                           f"{len(args)} were given (unused or non-tensor inputs?)")
    if len(result_specs) != len(expected):
        raise IngressError(f"{name}: the imported function returns {len(result_specs)} tensors, "
                           f"torch returns {len(expected)}")
    for i, (spec, t) in enumerate(zip(arg_specs, args)):
        if spec.shape != tuple(t.shape) or spec.dtype != t.dtype:
            raise IngressError(f"{name}: argument {i} imported as {spec}, input is {TensorSpec.of(t)}")
    nan_as_torch(module)
    lower_scans(module)
    lower_scatters(module)
    lower_sorts(module)
    _check_pure_linalg(module, name)
    return Imported(module=module, args=tuple(args), reference=reference, arg_specs=arg_specs,
                    result_specs=result_specs, result_names=names)


def _main_func(module):
    for op in module.body.operations:
        if op.operation.name == "func.func":
            return op
    raise IngressError("the imported module has no function")


def _spec_of_type(t, name: str, what: str) -> TensorSpec:
    from torch_mlir import ir

    if not isinstance(t, ir.RankedTensorType):
        raise IngressError(f"{name}: {what} has type {t}; only ranked tensors are supported")
    rt = t
    if not rt.has_static_shape:
        raise IngressError(f"{name}: {what} has dynamic shape {t}; dynamic shapes are not supported")
    key = str(rt.element_type)
    if key not in _DTYPES:
        raise IngressError(f"{name}: {what} has element type {key}, which is not supported")
    return TensorSpec(tuple(rt.shape), _DTYPES[key])


def lower_scans(module) -> int:
    """Rewrite torch-mlir's `tm_tensor.scan` (cumsum, cumprod, logcumsumexp) as an scf.for
    over the scan dim carrying the output and the running value; returns the number
    rewritten.

    TMTensor's semantics, with f its region (arg 0 the running value, arg 1 the element):
    inclusive: out[0] = in[0], out[i] = f(out[i-1], in[i]); exclusive: out[0] = acc,
    out[i] = f(out[i-1], in[i-1]); the accumulator result is out[n-1] (acc itself when the
    inclusive scan has one element). Each step is an elementwise linalg.generic over the
    other dims (slices without the scan dim), updating the running value in place, so
    the schedules tile and vectorize it like any elementwise op; the loop itself stays
    sequential. A scan over the innermost dim of a tensor of rank 2 or more runs per block
    of rows one 64-byte vector wide (the other dims collapsed; the blocks in an
    scf.forall), on chunks of their columns transposed so that each step reads and writes
    one contiguous vector (`_scan_rows_in_chunks`). An
    inclusive scan of flip(x) along its dim whose output only a flip along it reads is the
    scan of x from its last element down (no flip is left). As torch does,
    an f16/bf16 scan carries its running value in f32 (f is recomputed in f32) and rounds
    each output once. Left for the pure-linalg check to report: dynamic shapes, and narrow
    scans whose f has ops other than arith and math ones."""
    from transform_ext.common import ops_named

    with module.context:
        return sum(_lower_scan(op) for op in ops_named(module.operation, "tm_tensor.scan"))


_NARROW_FLOATS = ("bf16", "f16")


# An innermost-dim scan runs on blocks of rows one vector of this many bytes wide (16 f32
# rows), on chunks of about _SCAN_CHUNK_BYTES of their columns: each chunk is transposed in
# L1 (columns become rows) and scanned one contiguous vector per step. The blocks' rows
# before, a vector gathered across 4 rows per step, ran KernelBench 89 (cumsum of
# [2048, 2048]) at 1.0x torch; blocks of 8 or 4 rows transposed ran slower than 16 rows.
_SCAN_BLOCK_BYTES = 64
_SCAN_CHUNK_BYTES = 8192


def _lower_scan(op) -> bool:
    from torch_mlir import ir
    from torch_mlir.dialects import scf, tensor

    from transform_ext.common import largest_divisor_at_most, reassociation_attr

    source, out_init, acc_init = list(op.operands)
    source_type, out_type = ir.RankedTensorType(source.type), ir.RankedTensorType(out_init.type)
    body = op.regions[0].blocks[0]
    element = out_type.element_type
    if not source_type.has_static_shape or source_type.element_type != element \
            or [a.type for a in body.arguments] != [element, element]:
        return False
    narrow = str(element) in _NARROW_FLOATS
    ops = [o.operation for o in body.operations][:-1]
    if narrow and not all(o.name.startswith(("arith.", "math.")) for o in ops):
        return False
    dim = ir.IntegerAttr(op.attributes["dimension"]).value
    inclusive = ir.BoolAttr(op.attributes["inclusive"]).value
    # flip(scan(flip(x))) along the scan dim (a reverse cumsum): the scan of x run backwards
    flipped_source = _flipped(source, dim)
    flip_back = _sole_flip_reader(op.results[0], dim)
    reverse = inclusive and flipped_source is not None and flip_back is not None \
        and not any(True for _ in op.results[1].uses)
    if reverse:
        source = flipped_source
    scan = _Scan(body, element, narrow, inclusive, reverse)
    shape = list(source_type.shape)
    rank, n = len(shape), shape[dim]
    rows = row_count(shape)
    width = _element_bytes(element)
    block = largest_divisor_at_most(rows, max(1, _SCAN_BLOCK_BYTES // width))
    chunk = max(1, _SCAN_CHUNK_BYTES // (block * width))
    with ir.InsertionPoint(op), op.location:
        if n == 0:
            results = [out_init, acc_init]
        elif dim != rank - 1 or rank < 2:
            results = scan.lower(source, tensor.EmptyOp(shape, element).result, acc_init, dim)[:2]
        else:
            # an innermost-dim scan: its rows (the other dims collapsed) in blocks, in parallel
            flat = [list(range(rank - 1)), [rank - 1]]
            x = source if rank == 2 else tensor.CollapseShapeOp(
                ir.RankedTensorType.get([rows, n], element), source, reassociation_attr(flat)).result
            acc = acc_init if rank == 2 else tensor.CollapseShapeOp(
                ir.RankedTensorType.get([rows], element), acc_init,
                reassociation_attr([list(range(rank - 1))])).result
            if rows == block:
                out, acc = _scan_rows_in_chunks(scan, x, tensor.EmptyOp([rows, n], element).result,
                                                acc, chunk)
            else:
                forall = scf.ForallOp([0], [rows], [block], shared_outs=[
                    tensor.EmptyOp([rows, n], element).result, acc])
                with ir.InsertionPoint(forall.body):
                    r = forall.induction_variables[0]
                    out_rows, acc_rows = forall.inner_iter_args
                    parts = _scan_rows_in_chunks(scan, row_block(x, r, block), row_block(out_rows, r, block),
                                                 row_block(acc_rows, r, block), chunk)
                    parallel = scf.InParallelOp()
                    with ir.InsertionPoint(parallel.block):
                        for part, dest in zip(parts, (out_rows, acc_rows)):
                            row_block(dest, r, block, part)
                out, acc = forall.results
            results = [out if rank == 2 else tensor.ExpandShapeOp(
                out_type, out, reassociation_attr(flat), [], shape).result,
                       acc if rank == 2 else tensor.ExpandShapeOp(
                           acc_init.type, acc, reassociation_attr([list(range(rank - 1))]), [],
                           shape[:-1]).result]
    if reverse:  # the flip back reads the reverse scan as it is
        flip_back.results[0].replace_all_uses_with(results[0])
        flip_back.erase()
    for old, new in zip(op.results, results):
        old.replace_all_uses_with(new)
    op.erase()
    return True


def _flip_index(op, dim: int):
    """For a linalg.generic that only reads T[i_0, .., n - 1 - i_dim, ..] (torch-mlir's
    aten.flip along `dim`, T of its own shape): T; else None."""
    from torch_mlir import ir

    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return None
    block = op.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    extract = ops[-2] if len(ops) >= 2 else None
    if extract is None or extract.name != "tensor.extract" \
            or ops[-1].operands[0] != extract.results[0]:
        return None
    source = extract.operands[0]
    shape = list(ir.RankedTensorType(source.type).shape)
    if shape != list(ir.RankedTensorType(op.results[0].type).shape):
        return None
    indices = list(extract.operands)[1:]
    for d, index in enumerate(indices):
        owner = _defining(index)
        if d != dim:
            if owner is None or owner.name != "linalg.index" \
                    or ir.IntegerAttr(owner.attributes["dim"]).value != d:
                return None
            continue
        if owner is None or owner.name != "arith.subi":
            return None
        top, inner = owner.operands
        top_op, inner_op = _defining(top), _defining(inner)
        if top_op is None or top_op.name != "arith.constant" \
                or ir.IntegerAttr(top_op.attributes["value"]).value != shape[dim] - 1 \
                or inner_op is None or inner_op.name != "linalg.index" \
                or ir.IntegerAttr(inner_op.attributes["dim"]).value != dim:
            return None
    if any(o.name not in ("linalg.index", "arith.subi", "arith.constant")
           for o in ops[:-2]):
        return None
    return source


def _flipped(value, dim: int):
    """x when `value` is flip(x) along `dim` (see _flip_index); else None."""
    return _flip_index(_defining(value), dim)


def _defining(value):
    """The op defining `value` (None for a block argument)."""
    from torch_mlir import ir

    owner = value.owner
    return None if isinstance(owner, ir.Block) else getattr(owner, "operation", owner)


def _sole_flip_reader(value, dim: int):
    """The flip along `dim` that is `value`'s only reader, if it is one; else None."""
    users = []
    for use in value.uses:  # the flip reads it as an operand and in its body
        user = getattr(use.owner, "operation", use.owner)
        while user.name != "linalg.generic" and user.parent is not None \
                and user.parent.name != "func.func":
            user = user.parent.operation
        if user not in users:
            users.append(user)
    if len(users) != 1:
        return None
    user = users[0]
    return user if _flip_index(user, dim) is not None and _flip_index(user, dim) == value \
        else None


def _element_bytes(element) -> int:
    """Bytes of one element of the int or float type `element`."""
    from torch_mlir import ir

    if isinstance(element, ir.IntegerType):
        return max(1, element.width // 8)
    return max(1, ir.FloatType(element).width // 8)


def _scan_rows_in_chunks(scan: "_Scan", x, dest, acc, chunk: int) -> list:
    """(out, acc) of `scan` along the rows of x [R, n] (acc [R] its accumulator), out
    written into `dest`. The scan runs on x's transpose, one contiguous R-vector per step:
    chunk columns of x at a time are transposed to [chunk, R] and scanned along their dim
    0 (each chunk continuing the one before: `_Scan.lower`'s carry) into one [n, R]
    tensor, which is transposed into `dest` at the end. A reverse scan takes the chunks
    from the last one down; the last chunk taken is n mod chunk columns wide when chunk
    does not divide n."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith, scf, tensor

    rows, n = ir.RankedTensorType(x.type).shape
    element = ir.RankedTensorType(x.type).element_type
    chunk = min(chunk, n)
    full, tail = divmod(n, chunk)

    def one(offset, width, scanned, carry):
        part = transpose_2d(_columns(x, offset, width))
        return scan.lower(part, scanned, acc, 0, carry=carry, carry_out=True, offset=offset)

    def offset_of(index):  # the index-th chunk taken (Value or int)
        if not scan.reverse:
            return arith.MulIOp(index, _index_constant(chunk)).result \
                if isinstance(index, ir.Value) else index * chunk
        if isinstance(index, ir.Value):
            taken = arith.MulIOp(arith.AddIOp(index, _index_constant(1)).result,
                                 _index_constant(chunk)).result
            return arith.SubIOp(_index_constant(n), taken).result
        return n - (index + 1) * chunk

    scanned, last, state = one(offset_of(0), chunk, tensor.EmptyOp([n, rows], element).result, None)
    if full > 1:
        loop = scf.ForOp(_index_constant(1), _index_constant(full), _index_constant(1),
                         [scanned, last, state])
        with ir.InsertionPoint(loop.body):
            scf.YieldOp(list(one(offset_of(loop.induction_variable), chunk,
                                 *[loop.inner_iter_args[i] for i in (0, 2)])))
        scanned, last, state = loop.results
    if tail:
        scanned, last, _ = one(0 if scan.reverse else full * chunk, tail, scanned, state)
    return [transpose_2d(scanned, dest), last]


def _columns(t, offset, count: int):
    """Columns [offset, offset + count) of the 2-D `t` (offset an int or an index Value)."""
    from torch_mlir import ir
    from torch_mlir.dialects import tensor

    rows = ir.RankedTensorType(t.type).shape[0]
    dynamic = isinstance(offset, ir.Value)
    offsets = [0, ir.ShapedType.get_dynamic_stride_or_offset() if dynamic else offset]
    return tensor.ExtractSliceOp(ir.RankedTensorType.get(
        [rows, count], ir.RankedTensorType(t.type).element_type), t,
        [offset] if dynamic else [], [], [], offsets, [rows, count], [1, 1]).result


class _Scan:
    """The scan of `body` (a tm_tensor.scan region) as an scf.for over the scan dim."""

    def __init__(self, body, element, narrow: bool, inclusive: bool, reverse: bool = False):
        from torch_mlir import ir

        self.body, self.element, self.narrow, self.inclusive = body, element, narrow, inclusive
        self.reverse = reverse  # out[i] = f(out[i+1], in[i]) from the last row down
        self.wide = ir.F32Type.get() if narrow else element

    def lower(self, source, dest, acc_init, dim: int, carry=None, carry_out=False,
              offset=0) -> list:
        """(out, acc, state) of the scan of `source` along `dim`, out written into `dest`
        from `offset` along `dim` on (an int or an index Value).

        `carry` (a step-shaped tensor of the wide type): the scan continues one whose state
        it is, so a scan runs in chunks along `dim`. The state after a chunk (with
        `carry_out`, else None): the last output (inclusive) or the next one, f(last output,
        last input) (exclusive), wide."""
        from torch_mlir import ir
        from torch_mlir.dialects import arith, scf, tensor

        from transform_ext.common import build_generic

        element, wide, narrow, body = self.element, self.wide, self.narrow, self.body
        shape = list(ir.RankedTensorType(source.type).shape)
        rank, n = len(shape), shape[dim]
        step_shape = shape[:dim] + shape[dim + 1:]  # one step: the scan dim dropped
        identity = ir.AffineMap.get_identity(rank - 1)
        parallel = ["parallel"] * (rank - 1)
        dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
        idx = ir.IndexType.get()
        sizes = shape[:dim] + [1] + shape[dim + 1:]

        def at(i):
            return [(dynamic if isinstance(i, ir.Value) else i) if d == dim else 0
                    for d in range(rank)]

        def row(t, i):
            return tensor.ExtractSliceOp(ir.RankedTensorType.get(step_shape, element), t,
                                         [i] if isinstance(i, ir.Value) else [], [], [], at(i),
                                         sizes, [1] * rank).result

        def put(value, t, i):
            return tensor.InsertSliceOp(value, t, [i] if isinstance(i, ir.Value) else [], [], [],
                                        at(i), sizes, [1] * rank).result

        def shifted(i):  # source row i's row in dest
            if isinstance(offset, int) and isinstance(i, int):
                return offset + i
            if isinstance(offset, int) and offset == 0:
                return i
            if isinstance(i, int) and i == 0:
                return offset
            return arith.AddIOp(*[v if isinstance(v, ir.Value) else _index_constant(v)
                                  for v in (offset, i)]).result

        def empty(elem):
            return tensor.EmptyOp(step_shape, elem).result

        def apply(running, x):  # f(running, x), wide; and rounded to the element type
            def fn(args):
                value = args[1] if not narrow else arith.extf(wide, args[1])
                result = _clone_scan_body(body, {body.arguments[0]: args[0],
                                                 body.arguments[1]: value}, wide)
                return [result, arith.truncf(element, result)] if narrow else [result]

            outs = [empty(wide)] + ([empty(element)] if narrow else [])
            return build_generic([running, x], outs, [identity] * (2 + len(outs)), parallel,
                                 fn).results

        def widened(value):
            return build_generic([value], [empty(wide)], [identity] * 2, parallel,
                                 lambda args: [arith.extf(wide, args[0])]).result

        def rounded(value):
            return build_generic([value], [empty(element)], [identity] * 2, parallel,
                                 lambda args: [arith.truncf(element, args[0])]).result

        start, end = (n - 1, 0) if self.reverse else (0, n - 1)
        if carry is None:
            first = row(source, start) if self.inclusive else acc_init
            first_wide = widened(first) if narrow else first
        elif self.inclusive:
            steps = apply(carry, row(source, start))
            first, first_wide = steps[-1], steps[0]
        else:
            first, first_wide = (rounded(carry) if narrow else carry), carry
        lb, ub, one = (arith.ConstantOp(idx, ir.IntegerAttr.get(idx, v)).result
                       for v in (1, n, 1))
        # every row of the output is written: row 0 here, the others by the steps; the
        # running value is the output's row before (kept apart in f32 for f16/bf16)
        carried = [put(first, dest, shifted(start))] + ([first_wide] if narrow else [])
        loop = scf.ForOp(lb, ub, one, carried)
        with ir.InsertionPoint(loop.body):
            i = loop.induction_variable
            before = arith.SubIOp(i, one).result
            if self.reverse:  # step k writes row n - 1 - k after row n - k
                i, before = (arith.SubIOp(_index_constant(n - 1), i).result,
                             arith.SubIOp(_index_constant(n), i).result)
            out = loop.inner_iter_args[0]
            running = loop.inner_iter_args[1] if narrow else row(out, shifted(before))
            step = apply(running, row(source, i if self.inclusive else before))
            scf.YieldOp([put(step[-1], out, shifted(i))] + ([step[0]] if narrow else []))
        last_wide = loop.results[1] if narrow else row(loop.results[0], shifted(end))
        last = rounded(last_wide) if narrow else last_wide
        state = None
        if carry_out:
            state = last_wide if self.inclusive else apply(last_wide, row(source, end))[0]
        acc = acc_init if self.inclusive and n == 1 and carry is None else last
        return [loop.results[0], acc, state]


def _index_constant(value: int):
    from torch_mlir import ir
    from torch_mlir.dialects import arith

    idx = ir.IndexType.get()
    return arith.ConstantOp(idx, ir.IntegerAttr.get(idx, value)).result


def _clone_scan_body(body, mapping: dict, wide):
    """Clone a scan region's ops at the insertion point with `mapping` for its arguments;
    returns the yielded value. When `wide` is wider than the region's float type, every
    float result is computed in `wide` instead (constants widened, extf/truncf between the
    two dropped)."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith

    from transform_ext.common import clone_op

    ops = [o.operation for o in body.operations]
    for o in ops[:-1]:
        results = list(o.results)
        narrow = [r for r in results if str(r.type) in _NARROW_FLOATS]
        if narrow and str(wide) not in _NARROW_FLOATS:
            if o.name == "arith.constant":
                value = ir.FloatAttr(o.attributes["value"]).value
                mapping[results[0]] = arith.ConstantOp(wide, ir.FloatAttr.get(wide, value)).result
                continue
            if o.name == "arith.truncf" and mapping.get(o.operands[0], o.operands[0]).type == wide:
                mapping[results[0]] = mapping.get(o.operands[0], o.operands[0])
                continue
        if o.name == "arith.extf" and mapping.get(o.operands[0], o.operands[0]).type == results[0].type:
            mapping[results[0]] = mapping.get(o.operands[0], o.operands[0])
            continue
        clone = clone_op(o, mapping)
        if str(wide) not in _NARROW_FLOATS:
            for r in clone.results:
                if str(r.type) in _NARROW_FLOATS:
                    r.set_type(wide)
    yielded = ops[-1].operands[0]
    return mapping.get(yielded, yielded)


def _check_pure_linalg(module, name: str) -> None:
    text = str(module)
    leftovers = sorted(set(re.findall(r"\b(tm_tensor\.\w+|torch\.\w+(?:\.\w+)*)\s*[({%\"]", text)))
    if leftovers:
        raise IngressError(f"{name}: the import left non-linalg ops: {', '.join(leftovers)}")


def _tensor_literal(gni, literal):
    """The torch.vtensor.literal of a frozen parameter or buffer, its data read through
    numpy's view of the tensor's memory (torch-mlir's default path builds a Python list of
    every element: 15 s of a ResNet-18 import); None (the default path) for one element (a
    splat) or a dtype numpy cannot view."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch_mlir import ir
    from torch_mlir.extras.fx_importer import TORCH_DTYPE_TO_NPY_TYPE, create_mlir_tensor_type

    npy_dtype = TORCH_DTYPE_TO_NPY_TYPE.get(literal.dtype)
    if literal.numel() <= 1 or npy_dtype is None or literal.dtype.is_complex:
        return None
    cache = gni._cc
    mapping = cache._py_attr_tracker.track(literal)
    if mapping.is_empty:
        with unset_fake_temporarily():
            data = literal.detach().contiguous()
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            array = data.view(bits[data.element_size()]).numpy().view(npy_dtype).copy()
        name = f"torch_tensor_{'_'.join(str(d) for d in literal.shape)}_{literal.dtype}"
        mapping.value = ir.DenseResourceElementsAttr.get_from_buffer(
            array, name, create_mlir_tensor_type(literal))
    return ir.Operation.create("torch.vtensor.literal",
                               results=[cache.tensor_to_vtensor_type(literal)],
                               attributes={"value": mapping.value}).result


class _QuietShapeLog:
    """While torch.export traces: torch's symbolic-shape log is quiet, and what it writes to
    stderr is held back, then passed on unless the trace failed (on a data-dependent branch
    torch printed the whole partial graph before the error, which _describe_import_failure
    puts in one line)."""

    def __enter__(self):
        self.log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
        self.level = self.log.level
        self.log.setLevel(logging.ERROR)
        self.held = io.StringIO()
        self.redirect = contextlib.redirect_stderr(self.held)
        self.redirect.__enter__()

    def __exit__(self, kind, *exc):
        self.redirect.__exit__(kind, *exc)
        self.log.setLevel(self.level)
        if kind is None and self.held.getvalue():
            sys.stderr.write(self.held.getvalue())


def _quiet_importer():
    """An FxImporter on a fresh context whose diagnostics are collected, not printed, and
    whose tensor literals are read fast (`_tensor_literal`)."""
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter, FxImporterHooks

    class Hooks(FxImporterHooks):
        def resolve_literal(self, gni, literal, info):
            return _tensor_literal(gni, literal) if isinstance(literal, torch.Tensor) else None

    context = ir.Context()
    torch_d.register_dialect(context)
    diagnostics: list[str] = []

    def collect(diag):
        diagnostics.append(str(diag.message))
        return True

    context.attach_diagnostic_handler(collect)
    return FxImporter(context=context, hooks=Hooks()), diagnostics


def _describe_import_failure(name: str, exc: Exception, diagnostics=()) -> str:
    if isinstance(exc, IngressError):
        return str(exc)
    if type(exc).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException"):
        return (f"{name}: the graph depends on the tensors' values (a shape, as of nonzero or "
                f"masked_select, or a Python branch on a tensor): kernels are static")
    text = "\n".join(list(diagnostics) + [str(exc)])
    m = re.search(r"failed to legalize operation 'torch.operator'.*?name = \"([^\"]+)\"", text)
    if m:
        return f"{name}: torch-mlir cannot lower {m.group(1)} to linalg"
    m = re.search(r"failed to legalize operation '([^']+)'", text)
    if m and m.group(1).startswith("torch.constant"):
        m = re.search(r"'(torch\.aten\.[\w.]+)'", text) or m
    if m:
        return f"{name}: torch-mlir cannot lower {m.group(1)} to linalg"
    m = re.search(r"(torch\.aten\.[\w.]+)", text)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    if m:
        return f"{name}: torch-mlir failed on {m.group(1)}: {first[:200]}"
    return f"{name}: import failed: {type(exc).__name__}: {first[:300]}"


def _distinct(inputs: tuple) -> tuple:
    """Clone tensors that appear more than once: the importer merges identical objects."""
    seen: set[int] = set()
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            if id(t) in seen:
                t = t.clone()
            seen.add(id(t))
        out.append(t)
    return tuple(out)


def _flatten(out, name: str) -> tuple:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (list, tuple)):
        for i, t in enumerate(out):
            if not isinstance(t, torch.Tensor):
                kind = "None" if t is None else type(t).__name__
                raise IngressError(f"{name}: Model.forward returns {kind} as "
                                   f"result {i}; every result must be a tensor")
        return tuple(out)
    raise IngressError(f"{name}: Model.forward must return a tensor or a tuple of tensors, "
                       f"got {type(out).__name__}")


def _seed_like(out):
    if isinstance(out, torch.Tensor):
        return torch.ones_like(out) if out.is_floating_point() else None
    return type(out)(torch.ones_like(t) if t.is_floating_point() else None for t in out)


def _differentiable(model, inputs: tuple, positions: list[int]) -> list[int]:
    """The float inputs torch can differentiate through: some cannot (the class weights of
    nll_loss raise "not differentiable with respect to argument"). Each is probed by calling
    the model on meta tensors (its parameters and buffers too) with only that input
    requiring grad; an input whose probe fails any other way is kept (the real trace reports
    the problem)."""
    state = {k: v.detach().to("meta") for k, v in
             list(model.named_parameters()) + list(model.named_buffers())}
    keep = []
    for i in positions:
        probe = [t.detach().to("meta") if isinstance(t, torch.Tensor) else t for t in inputs]
        probe[i].requires_grad_(True)
        try:
            with torch.enable_grad():
                torch.func.functional_call(model, state, tuple(probe))
        except RuntimeError as exc:
            if "not differentiable with respect to argument" in str(exc):
                continue
        except Exception:
            pass
        keep.append(i)
    return keep


def _scatter_value_onehot(self, dim, index, value):
    """scatter(self, dim, index, value) with one index per row along `dim` == a select; other
    scatters along a non-negative dim (torch_semantics)."""
    if index.shape[dim] != 1 or any(index.shape[d] != self.shape[d]
                                    for d in range(self.dim()) if d != dim):
        if dim < 0:
            return torch.ops.aten.scatter.value(self, dim + max(self.dim(), 1), index, value)
        return NotImplemented
    shape = [1] * self.dim()
    shape[dim] = self.shape[dim]
    iota = torch.arange(self.shape[dim], device=self.device).view(shape)
    return torch.where(iota == index, torch.full((), value, dtype=self.dtype), self)


def _batch_norm_with_running_stats(input, weight, bias, running_mean, running_var, eps):
    """Eval-mode batch norm in its affine form (x - mean) * rsqrt(var + eps) * w + b, over
    the channels (dim 1), computed in f32 for f16/bf16 input as torch does; the saved
    statistics are empty, as torch's eval kernel returns them. torch's own backward of the
    eval op reads them with the channels' shape (an import failure)."""
    shape = [1] * input.dim()
    shape[1] = input.shape[1]
    wide = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    out = (input.to(wide) - running_mean.to(wide).view(shape)) * \
        torch.rsqrt(running_var.to(wide) + eps).view(shape)
    if weight is not None:
        out = out * weight.to(wide).view(shape)
    if bias is not None:
        out = out + bias.to(wide).view(shape)
    empty = input.new_empty((0,), dtype=wide)
    return out.to(input.dtype), empty, empty


def _native_batch_norm_eval(input, weight, bias, running_mean, running_var, training,
                            momentum, eps):
    if training or running_mean is None or running_var is None:
        return NotImplemented
    return _batch_norm_with_running_stats(input, weight, bias, running_mean, running_var, eps)


def _native_batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum,
                                   eps):
    return _batch_norm_with_running_stats(input, weight, bias, running_mean, running_var, eps)


def _softmax_backward_widened(grad_output, output, dim, input_dtype):
    """dx = y (dy - sum(dy y)) over `dim`, for f16/bf16 computed in f32 and rounded once,
    as torch's own kernel does (rounding each product and the sum in bf16 doubles the error
    of an attention's d_q)."""
    if output.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented
    dy, y = grad_output.float(), output.float()
    dx = y * (dy - (dy * y).sum(dim, keepdim=True))
    return dx.to(input_dtype)


def _log_softmax_backward_widened(grad_output, output, dim, input_dtype):
    """dx = dy - exp(y) sum(dy) over `dim` (y = log_softmax), for f16/bf16 computed in f32
    and rounded once."""
    if output.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented
    dy, y = grad_output.float(), output.float()
    dx = dy - torch.exp(y) * dy.sum(dim, keepdim=True)
    return dx.to(input_dtype)


_NARROW = (torch.float16, torch.bfloat16)


def _rms_norm_widened(input, normalized_shape, weight=None, eps=None):
    """x rsqrt(mean(x^2) + eps) w over the trailing `normalized_shape` dims, for f16/bf16
    computed in f32 and rounded once, as torch's kernel does (a bf16/f16 sum of squares
    overflows at |x| ~ 30 over 64 elements); eps defaults to f32's epsilon."""
    if input.dtype not in _NARROW:
        return NotImplemented
    x = input.float()
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    out = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(input.dtype)


def _gelu_tanh(input, approximate="none"):
    """GELU's tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) as torch's kernel
    computes it (f16/bf16 in f32, rounded once): torch-mlir's lowering takes sqrt(2/pi) as
    0.797724 (it is 0.7978846), 2e-4 off, which x^6 after it turned into 0.15."""
    if approximate != "tanh":
        return NotImplemented
    x = input.float() if input.dtype in _NARROW else input
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))
    return (0.5 * x * (1.0 + torch.tanh(inner))).to(input.dtype)


def _mean_widened(input, dim=None, keepdim=False, *, dtype=None):
    """The mean of an f16/bf16 tensor summed and divided in f32, rounded once, as torch's
    CPU kernel does (torch-mlir divides the rounded sum in the narrow type: an f16 sum past
    65504 is inf, and 1001 is 1000 in bf16)."""
    if input.dtype not in _NARROW or dtype is not None:
        return NotImplemented
    return torch.mean(input.float(), dim, keepdim).to(input.dtype)


def _vector_norm_widened(input, ord=2, dim=None, keepdim=False, *, dtype=None):
    """||x||_ord of an f16/bf16 tensor computed in f32 and rounded once, as torch does."""
    if input.dtype not in _NARROW or dtype is not None:
        return NotImplemented
    return torch.linalg.vector_norm(input.float(), ord, dim, keepdim).to(input.dtype)


def _var_mean_one_pass(input, dim=None, *, correction=None, keepdim=False):
    """var_mean of an f32/f16/bf16 tensor from one pass over it: the sums s1 = sum x and
    s2 = sum x^2 in f64 (siblings, which the generic schedule reduces in one loop), then
    mean = s1 / n and var = max(s2 - s1 mean, 0) / (n - correction), rounded once (NaN
    where x holds an inf or NaN, as torch). The f64 sums keep the cancellation in
    s2 - s1 mean at |mean| / std ~ 1e5 below 1e-6 of var (torch-mlir's lowering reads x
    three times: a mean and a two-pass variance, the mean summed in x's type, whose error
    over a 512 x 512 group norm put it 14x further from the f64 truth than torch)."""
    if input.dtype not in (torch.float32, *_NARROW):
        return NotImplemented
    dims = list(range(input.dim())) if dim is None else \
        [d % max(input.dim(), 1) for d in ([dim] if isinstance(dim, int) else dim)]
    n = 1
    for d in dims:
        n *= input.shape[d]
    x = input.double()
    s1 = x.sum(dims, keepdim=keepdim)
    s2 = (x * x).sum(dims, keepdim=keepdim)
    mean = s1 / n
    spread = s2 - s1 * mean  # NaN stays NaN (an inf in x): where, not clamp
    var = torch.where(spread < 0, 0.0, spread) / (n - (1 if correction is None else correction))
    return var.to(input.dtype), mean.to(input.dtype)


def _narrow_float_decompositions() -> dict:
    """Ops torch computes in f32 for f16/bf16 inputs, rounding only the result, that
    torch-mlir would lower in the narrow type (and var_mean, in one pass for f32 too)."""
    aten = torch.ops.aten
    return {aten.gelu.default: _gelu_tanh,
            aten.mean.dim: _mean_widened,
            aten.mean.default: _mean_widened,
            aten.rms_norm.default: _rms_norm_widened,
            aten.var_mean.correction: _var_mean_one_pass,
            aten.linalg_vector_norm.default: _vector_norm_widened,
            aten._softmax_backward_data.default: _softmax_backward_widened,
            aten._log_softmax_backward_data.default: _log_softmax_backward_widened}


class _GroupNormInF32(torch.overrides.TorchFunctionMode):
    """`F.group_norm` of an f16/bf16 tensor traced as the f32 group norm rounded once. Under
    torch.func.vjp autograd differentiates group norm with its own composite formula in the
    input's type, whose f16 sums of dy x overflow (a finite group's gradient became NaN);
    torch's eager kernel computes them in f32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.functional.group_norm, torch.group_norm) and args[0].dtype in _NARROW:
            def wide(a):
                return a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a

            out = func(*map(wide, args), **{k: wide(v) for k, v in kwargs.items()})
            return out.to(args[0].dtype)
        return func(*args, **kwargs)


def _reciprocal_as_division(x):
    """1 / x as a division: torch-mlir lowers aten.reciprocal with an assertion that x is
    not 0, an ordered compare that a NaN fails too, so a kernel reported "unimplemented:
    tensor with zero element" where torch gives inf or NaN (also for a reciprocal the joint
    graph computes and never reads)."""
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    return torch.ops.aten.div.Tensor(torch.ops.aten.full_like.default(x, 1, dtype=dtype), x)


def _joint_decompositions() -> dict:
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    aten = torch.ops.aten
    # nll_loss2d_backward (the N-D loss) is decomposed: torch-mlir has no lowering for it.
    keep = {aten.nll_loss_backward, aten._log_softmax_backward_data, aten._softmax_backward_data}
    table = {op: fn for op, fn in get_decomposition_table().items()
             if getattr(op, "overloadpacket", op) not in keep}
    table.update(semantics_decompositions())  # the more specific forms below win
    table[aten.scatter.value] = _scatter_value_onehot
    table[aten.native_batch_norm.default] = _native_batch_norm_eval
    table[aten._native_batch_norm_legit_no_training.default] = _native_batch_norm_no_training
    table.update(_narrow_float_decompositions())
    table.update(index_decompositions())
    table.update(flash_decompositions())
    table.update(convolution_decompositions())
    table.update(pool_decompositions())
    table[aten.reciprocal.default] = _reciprocal_as_division
    return table


def _forward_decompositions() -> dict:
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    return {**get_decomposition_table(), **_narrow_float_decompositions(),
            **index_decompositions(), **transposed_convolution_decompositions(),
            **unbatched_pool_decompositions(), **adaptive_pool_decompositions(),
            **semantics_decompositions(),
            torch.ops.aten.reciprocal.default: _reciprocal_as_division}
