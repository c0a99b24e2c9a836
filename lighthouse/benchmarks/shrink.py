"""Shrinking a kernel file's problem to a size budget: `lighthouse.bench --max-elements N`.

KernelBench problems state their sizes as module globals (`batch_size`, `in_channels`,
`length`, `input_shape = (32768,)`, ...) and many are far too large for a quick run.
`fit_to_elements(path, N)` returns `--set` overrides under which the tensors of
`get_inputs()` hold at most N elements together, and so do the forward's results (a
[M, 64] x [64, N] matmul with 3M input elements has M N outputs: 2 GiB at M = 16384,
N = 32768, twice over with torch's reference). Everything is evaluated on torch's meta
device: shapes are computed, no data is allocated and no kernel runs.

- A **size** is a module global holding an integer > 1 (or a tuple of integers) whose
  halving changes the element count of the inputs or of the outputs. Convolution and
  pooling parameters (`kernel_size`, `stride`, `padding`, `output_padding`, `dilation`,
  `groups`, `num_groups`) are never sizes, whatever they do to the counts; a reduction
  `dim` changes neither count, so it is not one either.
- A global **defined from others** by arithmetic (`input_shape = (num_classes,)`,
  `groups = in_channels`) is not a size of its own: it is re-derived from its definition
  when a global it reads changes (a problem's relations stay true: targets stay below the
  class count, a depthwise convolution stays depthwise) and appears in the overrides.
- A **step** halves the largest size (a tuple by its largest entry; the first defined on a
  tie). The step is kept when `Model(*get_init_inputs())` can be built and its forward runs
  on the new meta inputs; otherwise it is retried halving every size of the same value at
  once (sizes that must stay equal: predictions [B, C] times targets [B] broadcast only
  while B == C), and if that fails too it is undone and the size is frozen (channels no
  longer divisible by the groups, a kernel larger than its input, ...).
- Steps repeat until both counts fit or no size is left; then the result says how far it
  got. When the forward does not run on meta tensors at the file's own sizes, only the
  inputs are counted and steps are not checked (a note says so).
Globals fixed by the user (`--set`) are kept as given.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import KernelFileError

# Names of module globals that are layer parameters, never problem sizes.
NOT_A_SIZE = re.compile(r"kernel|stride|padding|dilation|groups", re.IGNORECASE)

# Expression nodes a derived global's definition may use: arithmetic on names and literals.
_PURE = (ast.Expression, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.List, ast.BinOp,
         ast.UnaryOp, ast.operator, ast.unaryop, ast.Starred)


@dataclass
class Fit:
    """The overrides chosen and what they give."""

    overrides: dict[str, Any]
    elements: int  # max(elements of the inputs, of the outputs) under the overrides
    original: int  # ... under the file's own sizes (and `start`)
    reached: bool  # elements <= the budget
    notes: list[str] = field(default_factory=list)


class _Problem:
    """A kernel module whose globals can be set and whose inputs can be counted on meta."""

    def __init__(self, path: Path, keep: set[str]):
        from ..kernel import _import_file

        self.path = path
        self.module = _import_file(path)
        for required in ("Model", "get_inputs"):
            if not hasattr(self.module, required):
                raise KernelFileError(f"{path}: {required} is missing")
        self.definitions = _module_definitions(path)
        self.derived = {name: expr for name, expr in self.definitions.items()
                        if _reads_globals(expr, self.definitions, name)}
        self.keep = keep  # set by the user: never re-derived

    def values(self) -> dict[str, Any]:
        return {name: getattr(self.module, name) for name in self.definitions
                if hasattr(self.module, name)}

    def assign(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Set globals, re-derive those defined from them; returns every global that moved."""
        before = self.values()
        for name, value in changes.items():
            setattr(self.module, name, value)
        self._rederive(set(changes))
        return {k: v for k, v in self.values().items() if before.get(k) != v}

    def _rederive(self, changed: set[str]) -> None:
        namespace = vars(self.module)
        for name, expr in self.derived.items():  # source order: chains follow
            if name in self.keep or not (_names(expr) & changed):
                continue
            try:
                value = eval(compile(expr, str(self.path), "eval"), dict(namespace))
            except Exception:  # a definition that no longer evaluates: leave it
                continue
            setattr(self.module, name, value)
            changed.add(name)

    def inputs(self) -> list[torch.Tensor]:
        """The tensors of get_inputs(), made on the meta device."""
        with torch.device("meta"):
            inputs = self.module.get_inputs()
        return [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)

    def input_elements(self) -> int | None:
        try:
            return _numel_of(self.inputs())
        except Exception:
            return None

    def elements(self, forward: bool) -> _Count | None:
        """Elements of the inputs and (when `forward`) of the outputs on meta tensors, which
        also checks that the model accepts its inputs; None when get_inputs(),
        Model(*get_init_inputs()) or the forward fails."""
        try:
            inputs = self.inputs()
            if not forward:
                return _Count.of(_numel_of(inputs), 0)
            with torch.device("meta"), torch.no_grad():
                init = self.module.get_init_inputs() if hasattr(self.module, "get_init_inputs") else []
                outputs = self.module.Model(*init)(*inputs)
        except Exception:
            return None
        return _Count.of(_numel_of(inputs), _numel_of(outputs))


class _Count(NamedTuple):
    """Compared by the larger count, then by the total (a step that shrinks the smaller side
    only is still progress)."""

    largest: int
    total: int

    @staticmethod
    def of(inputs: int, outputs: int) -> "_Count":
        return _Count(max(inputs, outputs), inputs + outputs)

    def fits(self, budget: int) -> bool:
        return self.largest <= budget


def _numel_of(values) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel()
    if isinstance(values, (list, tuple)):
        return sum(_numel_of(v) for v in values)
    if isinstance(values, dict):
        return sum(_numel_of(v) for v in values.values())
    return 0


def fit_to_elements(path: str | Path, max_elements: int, start: dict[str, Any] | None = None,
                    keep: set[str] | frozenset = frozenset()) -> Fit:
    """Overrides under which get_inputs() of the kernel file holds <= max_elements elements
    (see the module docstring), starting from the file's sizes with `start` applied; the
    globals named in `keep` (the user's --set) are never changed."""
    path = Path(path)
    start = dict(start or {})
    problem = _Problem(path, set(keep))
    overrides: dict[str, Any] = problem.assign(start) | start
    checked = True
    original = problem.elements(forward=True)
    notes: list[str] = []
    if original is None:
        checked = False
        original = problem.elements(forward=False)
        if original is None:
            raise KernelFileError(f"{path}: --max-elements: get_inputs() fails on the meta device")
        notes.append("the forward does not run on meta tensors at the file's sizes: only the "
                     "inputs were counted, without checking that the model accepts them")
    elements = original
    if elements.fits(max_elements):
        return Fit(overrides, elements.largest, original.largest, True, notes)
    sizes = _size_globals(problem, keep, checked)
    frozen: set[str] = set()
    while not elements.fits(max_elements):
        current = problem.values()
        live = [n for n in sizes if n not in frozen and _largest(current[n]) > 1]
        if not live:
            break
        name = max(live, key=lambda n: _largest(current[n]))  # first defined on a tie
        twins = [n for n in live if _largest(current[n]) == _largest(current[name])]
        for group in ([name], twins) if len(twins) > 1 else ([name],):
            moved = problem.assign({n: _halved(current[n]) for n in group})
            count = problem.elements(checked)
            if count is not None and count < elements:
                elements = count
                overrides.update(moved)
                break
            problem.assign({n: current[n] for n in group})  # re-derives the others back
            if count is not None:
                break  # valid but no smaller: halving its twins too is no reason
        else:
            frozen.add(name)
        if name not in frozen and problem.values()[name] == current[name]:
            frozen.add(name)
    reached = elements.fits(max_elements)
    if not reached:
        notes.append(f"--max-elements {max_elements}: the inputs or outputs hold "
                     f"{elements.largest} elements at the smallest sizes found")
    final = problem.values()
    overrides = {k: final[k] for k in problem.definitions if k in overrides}  # source order
    return Fit(overrides, elements.largest, original.largest, reached, notes)


def _size_globals(problem: _Problem, keep, checked: bool) -> list[str]:
    """The globals that are sizes (module docstring), in source order: halving one changes
    the inputs' element count, or (when the forward runs on meta) the outputs'."""
    sizes = []
    values = problem.values()
    inputs, counts = problem.input_elements(), problem.elements(checked)
    for name in problem.definitions:
        value = values.get(name)
        if name in keep or name in problem.derived or NOT_A_SIZE.search(name):
            continue
        if not _is_size_value(value) or _largest(value) <= 1:
            continue
        problem.assign({name: _halved(value)})
        halved_inputs, halved = problem.input_elements(), problem.elements(checked)
        problem.assign({name: value})
        if (halved_inputs is not None and halved_inputs != inputs) or (
                halved is not None and halved != counts):
            sizes.append(name)
    return sizes


def _is_size_value(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, tuple) and len(value) > 0 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _largest(value) -> int:
    return max(value) if isinstance(value, tuple) else value


def _halved(value):
    if isinstance(value, tuple):
        i = value.index(max(value))
        return value[:i] + (max(1, value[i] // 2),) + value[i + 1:]
    return max(1, value // 2)


def _module_definitions(path: Path) -> dict[str, ast.Expression]:
    """Module-level `NAME = expr` assignments, in source order (the last one of a name)."""
    tree = ast.parse(path.read_text(), str(path))
    found: dict[str, ast.Expression] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            name, value = node.target.id, node.value
        else:
            continue
        found.pop(name, None)
        found[name] = ast.fix_missing_locations(ast.Expression(value))
    return found


def _names(expr: ast.Expression) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def _reads_globals(expr: ast.Expression, definitions: dict, name: str) -> bool:
    """An arithmetic definition reading other module globals (re-derivable)."""
    if not all(isinstance(n, _PURE) for n in ast.walk(expr)):
        return False
    return bool((_names(expr) - {name}) & set(definitions))
