"""Kernel files in KernelBench's convention.

A kernel file defines, at module level, `Model` (a torch.nn.Module class), `get_inputs()`
(the forward's tensors) and `get_init_inputs()` (Model's constructor arguments). Optional:
`LIGHTHOUSE = dict(schedule=..., **params)` names a schedule family and its parameters.
`--set NAME=VALUE` overrides an existing module global before the inputs are made.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .errors import KernelFileError

SEED = 0


@dataclass
class Kernel:
    """A loaded kernel file: the module, the model instance and its example inputs."""

    path: Path
    module: ModuleType
    model: torch.nn.Module
    inputs: tuple
    config: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.stem


def parse_override(text: str) -> tuple[str, Any]:
    """'N=1024' -> ('N', 1024); the value is a Python literal, or a string when it is not one."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise KernelFileError(f"--set expects NAME=VALUE, got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return name, value


def _dtype_named(name: str, where: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (for globals holding a dtype)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise KernelFileError(f"{where}: {name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return dtype


def load_kernel(path: str | Path, overrides: dict[str, Any] | None = None) -> Kernel:
    """Import a kernel file, apply --set overrides, build the model and its inputs (seeded)."""
    path = Path(path)
    if path.is_dir():
        raise KernelFileError(f"{path}: is a directory, not a kernel file")
    if not path.is_file():
        raise KernelFileError(f"{path}: no such kernel file")
    module = _import_file(path)
    for required in ("Model", "get_inputs"):
        if not hasattr(module, required):
            raise KernelFileError(
                f"{path}: kernel files must define Model, get_inputs() and get_init_inputs(); "
                f"{required} is missing"
            )
    for name, value in (overrides or {}).items():
        if not hasattr(module, name):
            known = sorted(k for k, v in vars(module).items() if not k.startswith("_") and
                           isinstance(v, (int, float, str, bool, tuple, torch.dtype)))
            raise KernelFileError(
                f"{path}: --set {name}: no such module global (overridable: {', '.join(known) or 'none'})"
            )
        setattr(module, name, _typed_override(path, name, getattr(module, name), value))

    torch.manual_seed(SEED)
    init = (_call(module.get_init_inputs, "get_init_inputs()", path)
            if hasattr(module, "get_init_inputs") else ())
    try:
        model = module.Model(*init)
    except Exception as exc:  # the user's constructor: report it in one line
        raise KernelFileError(f"{path}: Model(*get_init_inputs()) failed: {type(exc).__name__}: {exc}") from exc
    model.eval()
    torch.manual_seed(SEED)
    inputs = _call(module.get_inputs, "get_inputs()", path)
    config = dict(getattr(module, "LIGHTHOUSE", {}) or {})
    return Kernel(path=path, module=module, model=model, inputs=inputs, config=config)


def _typed_override(path: Path, name: str, current: Any, value: Any) -> Any:
    """--set NAME=VALUE, checked against the global's type: a dtype global takes a dtype
    name, a number takes a number (an int global takes only ints), a string any value
    (as its text)."""
    where = f"{path}: --set {name}={value!r}"
    if isinstance(current, torch.dtype):
        if not isinstance(value, str):
            raise KernelFileError(f"{where}: {name} holds a torch dtype; give a dtype name")
        return _dtype_named(value, where)
    if isinstance(current, str):
        return value if isinstance(value, str) else repr(value)
    kinds = [(bool, (bool,)), (int, (int,)), (float, (int, float))]
    for kind, accepted in kinds:
        if isinstance(current, kind):
            if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                raise KernelFileError(f"{where}: {name} is {type(current).__name__} "
                                      f"{current!r} in the file, the value is "
                                      f"{type(value).__name__}")
            return float(value) if kind is float else value
    return value


def _call(fn, what: str, path: Path) -> tuple:
    """get_inputs() / get_init_inputs() of the user's file: a failure is one line."""
    try:
        values = fn()
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise KernelFileError(f"{path}: {what} failed: {type(exc).__name__}: {reason}") from exc
    return _as_tuple(values, path)


def _import_file(path: Path) -> ModuleType:
    name = f"lighthouse_kernel_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise KernelFileError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise KernelFileError(f"{path}: importing failed: {type(exc).__name__}: {exc}") from exc
    return module


def _as_tuple(values, path: Path) -> tuple:
    if isinstance(values, torch.Tensor):
        return (values,)
    if isinstance(values, (list, tuple)):
        return tuple(values)
    raise KernelFileError(f"{path}: get_inputs()/get_init_inputs() must return a list or tuple, "
                          f"got {type(values).__name__}")
