"""Compiled CPU kernels kept on disk, so another process skips the compile.

A graph part's kernel (lighthouse.graphs) is stored under a key naming everything its code
depends on: the part's decomposed graph (partition.graph_key), the options it was compiled
with, the source of lighthouse, schedules and transform_ext, the torch and torch-mlir
versions, the CPU description the schedules planned for, and the host CPU's features (the
JIT compiles for them). The entry is the kernel's object file, as MLIR's ExecutionEngine
wrote it (position-independent code), linked by the system C compiler into a shared library
with the OpenMP runtime, and a JSON file with its signature, error messages, family and
notes. A hit loads the library with ctypes and calls its packed entry point
(`_mlir__mlir_ciface_main`) as the ExecutionEngine does: no import, schedule, lowering or
code generation.

The bindings cannot load an object file themselves, so without a C compiler (`$CC`, else
`cc`) nothing is stored. Directory: $LIGHTHOUSE_CACHE_DIR, else ~/.cache/lighthouse/kernels;
LIGHTHOUSE_CACHE=0 turns the cache off. Entries are written to a temporary directory and
renamed into place, so concurrent processes never read a partial one.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from .ingress import TensorSpec
from .runtime import JitFunction

_SOURCES = ("lighthouse", "schedules", "transform_ext")


def enabled() -> bool:
    return os.environ.get("LIGHTHOUSE_CACHE", "1") != "0"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "lighthouse" / "kernels"
    return Path(os.environ.get("LIGHTHOUSE_CACHE_DIR") or default)


def fingerprint() -> str:
    """What every kernel's code depends on besides its graph and options (module docstring).
    The CPU description is read on every call: LIGHTHOUSE_CPU may change within a process."""
    from .targets.description import host_cpu

    digest = hashlib.sha256(_fixed_fingerprint().encode())
    digest.update(repr(host_cpu()).encode())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _fixed_fingerprint() -> str:
    """The part of `fingerprint` that cannot change within a process: the sources, the
    torch and torch-mlir versions, the host's CPU features and whether Linux granted the
    process AMX's tile registers (the CPU target emits tile code only then)."""
    import torch
    import torch_mlir

    from .runtime import allow_amx_tiles

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in _SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(getattr(torch_mlir, "__version__", "").encode())
    digest.update(_host_cpu_features().encode())
    digest.update(b"amx tiles granted" if allow_amx_tiles() else b"")
    return digest.hexdigest()


def _host_cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def key_of(*parts: str) -> str:
    digest = hashlib.sha256(fingerprint().encode())
    for part in parts:
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:40]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def store(key: str, function: JitFunction, meta: dict) -> bool:
    """Write `function`'s kernel under `key` (False: not stored, no compiler or no cache)."""
    from .targets.cpu import openmp_runtime

    compiler = _compiler()
    if not enabled() or compiler is None:
        return False
    root = cache_dir()
    final = root / key
    if final.exists():
        return True
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        obj = work / "kernel.o"
        function.engine.dump_to_object_file(str(obj))
        runtime = Path(openmp_runtime())
        linked = subprocess.run([compiler, "-shared", "-o", str(work / "kernel.so"), str(obj),
                                 f"-L{runtime.parent}", "-l:" + runtime.name,
                                 f"-Wl,-rpath,{runtime.parent}"],
                                capture_output=True, text=True, timeout=120)
        if linked.returncode != 0:
            return False
        obj.unlink()
        record = dict(meta, arg_specs=[_spec_json(s) for s in function.arg_specs],
                      result_specs=[_spec_json(s) for s in function.result_specs],
                      error_messages=list(function.error_messages), name=function.name,
                      workspace_bytes=function.workspace_bytes)
        (work / "kernel.json").write_text(json.dumps(record))
        try:
            work.rename(final)
        except OSError:  # another process stored it first
            pass
        return True
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load(key: str) -> tuple[JitFunction, dict] | None:
    """The kernel stored under `key` and its meta data, or None."""
    if not enabled():
        return None
    entry = cache_dir() / key
    try:
        record = json.loads((entry / "kernel.json").read_text())
        engine = SharedLibraryEngine(entry / "kernel.so")
    except (OSError, ValueError):
        return None
    function = JitFunction(engine, [_spec_of_json(s) for s in record["arg_specs"]],
                           [_spec_of_json(s) for s in record["result_specs"]],
                           name=record["name"], error_messages=tuple(record["error_messages"]),
                           workspace_bytes=record.get("workspace_bytes", 0))
    return function, record


class SharedLibraryEngine:
    """A stored kernel's library, looked up as ExecutionEngine looks up a compiled module."""

    def __init__(self, path: Path):
        from .targets.cpu import configure_openmp_runtime, openmp_runtime

        configure_openmp_runtime()
        ctypes.CDLL(openmp_runtime(), mode=ctypes.RTLD_GLOBAL)
        self.path = path
        self.library = ctypes.CDLL(str(path))

    def lookup(self, name: str):
        address = ctypes.cast(getattr(self.library, f"_mlir__mlir_ciface_{name}"), ctypes.c_void_p).value
        return ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)


def _spec_json(spec: TensorSpec) -> list:
    return [list(spec.shape), str(spec.dtype).removeprefix("torch.")]


def _spec_of_json(value) -> TensorSpec:
    import torch

    shape, dtype = value
    return TensorSpec(tuple(shape), getattr(torch, dtype))
