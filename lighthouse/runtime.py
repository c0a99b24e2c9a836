"""Calling JIT-compiled kernels with torch tensors, and timing them against torch.

The compiled function takes its results as out-parameters (`buffer-results-to-out-params`),
so results are torch tensors allocated here, owned by Python and freed once by torch.
Arguments and results are passed as MLIR memref descriptors
    {allocated ptr, aligned ptr, offset, sizes[rank], strides[rank]}
built from the tensors' storage; f32, f16, bf16, f64, i64, i32, i16, i8 and i1 (torch.bool,
one byte per element, as LLVM stores i1) are supported.

Kernel-reported errors: a kernel may check its inputs at run time (the cross-entropy targets
must lie in [0, C) or equal ignore_index) without stopping the process. Its function then
has one more result after the model's: an error code, a rank-0 i32 that the kernel sets to 0
when every check holds and to k when check message k - 1 fails. The messages are the module
attribute `lh.kernel_errors` (schedules/prepare.py: checks_to_error_code turns a schedule's
`cf.assert` checks into the code). JitFunction, given those `error_messages`, passes a
buffer for the code after the results and, when the call sets it, raises KernelError with
the message instead of returning the results (a failing kernel never reads or writes out of
bounds: the indices it checks are also clamped where they are used).
"""

from __future__ import annotations

import ctypes
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from .errors import KernelError, UnsupportedError
from .ingress import TensorSpec

SUPPORTED_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                    torch.int32, torch.int16, torch.int8, torch.bool}

_DESCRIPTOR_TYPES: dict[int, type] = {}
_ENTRY_LOCKS: dict[int, threading.Lock] = {}


def descriptor_type(rank: int) -> type:
    if rank not in _DESCRIPTOR_TYPES:
        fields = [("allocated", ctypes.c_void_p), ("aligned", ctypes.c_void_p),
                  ("offset", ctypes.c_int64)]
        if rank:
            fields += [("sizes", ctypes.c_int64 * rank), ("strides", ctypes.c_int64 * rank)]
        _DESCRIPTOR_TYPES[rank] = type(f"MemRef{rank}D", (ctypes.Structure,), {"_fields_": fields})
    return _DESCRIPTOR_TYPES[rank]


# Result buffers start on a cache line: the kernels write large results with streaming
# stores that need 64-byte alignment (lighthouse.targets.streaming_stores).
RESULT_ALIGNMENT = 64


def line_aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) starting at a multiple of RESULT_ALIGNMENT bytes (torch's
    CPU allocator aligns to 64; should another not, the tensor is a view into a larger one)."""
    t = torch.empty(shape, dtype=dtype)
    if t.data_ptr() % RESULT_ALIGNMENT == 0:
        return t
    size = t.element_size()
    flat = torch.empty(t.numel() + RESULT_ALIGNMENT // size, dtype=dtype)
    skip = (-flat.data_ptr() % RESULT_ALIGNMENT) // size
    return flat[skip:skip + t.numel()].view(shape)


def descriptor(t: torch.Tensor):
    """A memref descriptor viewing `t`'s storage (t must stay alive while it is used)."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedError(f"tensor dtype {t.dtype} is not supported by the CPU runtime")
    desc = descriptor_type(t.dim())()
    # the kernels' memref types have a static offset of 0 (identity layouts): the tensor's
    # own first element is the aligned pointer, whatever its offset in its storage
    desc.allocated = t.data_ptr()
    desc.aligned = t.data_ptr()
    desc.offset = 0
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        desc.sizes[i] = size
        desc.strides[i] = stride
    return desc


# Linux grants a process the AMX tile data state only on request (arch_prctl; without it the
# first tile instruction faults): x86-64's syscall number and the request for XTILEDATA.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@lru_cache(maxsize=1)
def allow_amx_tiles() -> bool:
    """Ask Linux for the AMX tile registers for this process (all its threads), once; True
    when granted. False on a host without AMX (or a kernel that refuses): the CPU target
    then emits no tile instructions."""
    from .targets.description import has_amx, host_cpu_flags

    if platform.machine() != "x86_64" or not has_amx(host_cpu_flags()):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


@dataclass
class JitFunction:
    """A compiled `main(args..., outs...)`; call it with torch tensors, get torch tensors."""

    engine: object
    arg_specs: list[TensorSpec]
    result_specs: list[TensorSpec]
    name: str = "main"
    error_messages: tuple = ()  # the kernel's error code k > 0 means error_messages[k - 1]
    workspace_bytes: int = 0  # its static workspace (lighthouse.targets.workspace)

    def __post_init__(self):
        allow_amx_tiles()  # a stored kernel may use tiles: ask before the first call
        self._fn = self.engine.lookup(self.name)
        # calls share the kernel's static workspace (lighthouse.targets.workspace): one lock
        # per entry point, also when two JitFunctions load the same stored library
        address = ctypes.cast(self._fn, ctypes.c_void_p).value
        self._lock = _ENTRY_LOCKS.setdefault(address, threading.Lock())

    def check_args(self, args) -> list[torch.Tensor]:
        if len(args) != len(self.arg_specs):
            raise UnsupportedError(f"the kernel takes {len(self.arg_specs)} tensors, got {len(args)}")
        out = []
        for i, (t, spec) in enumerate(zip(args, self.arg_specs)):
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise UnsupportedError(f"argument {i}: expected {spec}, got {TensorSpec.of(t)}")
            out.append(t.contiguous())
        return out

    def bind(self, args) -> Callable[[], tuple]:
        """Prepare a call on fixed arguments; the returned thunk runs the kernel and returns
        its (freshly written) result tensors. Use it to time without per-call overhead."""
        args = self.check_args(args)
        outs = [line_aligned_empty(spec.shape, spec.dtype) for spec in self.result_specs]
        code = [torch.zeros((), dtype=torch.int32)] if self.error_messages else []
        tensors = args + outs + code
        descs = [descriptor(t) for t in tensors]
        ptrs = [ctypes.pointer(d) for d in descs]
        packed = (ctypes.c_void_p * len(ptrs))()
        for i, p in enumerate(ptrs):
            packed[i] = ctypes.cast(ctypes.pointer(p), ctypes.c_void_p)
        fn = self._fn
        # the engine too: a thunk may outlive this JitFunction, and the code is the engine's
        keepalive = (tensors, descs, ptrs, self)
        messages = self.error_messages

        lock = self._lock

        def call():
            with lock:
                fn(packed)
            _ = keepalive
            if code and int(code[0]):
                k = int(code[0])
                raise KernelError(messages[k - 1] if 0 < k <= len(messages)
                                  else f"the kernel reported error code {k}")
            return tuple(outs)

        return call

    def __call__(self, *args) -> tuple:
        return self.bind(args)()


def time_alternately(ours: Callable[[], object], theirs: Callable[[], object], *,
                     warmup: int = 2, rounds: int = 10, min_block_seconds: float = 0.05,
                     budget_seconds: float | None = None, min_rounds: int = 3):
    """Median seconds per call of `ours` and `theirs`, measured in alternating blocks
    (see `measure_alternately`)."""
    times = measure_alternately(ours, theirs, warmup=warmup, rounds=rounds,
                                min_block_seconds=min_block_seconds,
                                budget_seconds=budget_seconds, min_rounds=min_rounds)
    return times.ours, times.theirs


@dataclass
class AlternatingTimes:
    """Per-round seconds per call of both sides; `ours`/`theirs` are their medians."""

    ours_rounds: list[float]
    theirs_rounds: list[float]
    reps: int

    @property
    def ours(self) -> float:
        return statistics.median(self.ours_rounds)

    @property
    def theirs(self) -> float:
        return statistics.median(self.theirs_rounds)

    @staticmethod
    def spread(rounds: list[float]) -> float:
        """(max - min) / median of the rounds: how noisy the measurement was."""
        return (max(rounds) - min(rounds)) / statistics.median(rounds)


def measure_alternately(ours: Callable[[], object], theirs: Callable[[], object], *,
                        warmup: int = 2, rounds: int = 10, min_block_seconds: float = 0.05,
                        budget_seconds: float | None = None, min_rounds: int = 3) -> AlternatingTimes:
    """Time `ours` and `theirs` in alternating blocks after warm-up (`measure_rotating` of
    the two)."""
    times, reps = measure_rotating({"ours": ours, "theirs": theirs}, warmup=warmup,
                                   rounds=rounds, min_block_seconds=min_block_seconds,
                                   budget_seconds=budget_seconds, min_rounds=min_rounds)
    return AlternatingTimes(times["ours"], times["theirs"], reps)


# glibc's malloc moves its mmap threshold up to the size of the last large block freed
# (and its trim threshold to twice that), so whether a call's large buffers are fresh
# zero-filled pages every time depended on what the process had freed before: torch's
# 11 x 11 convolution of KernelBench 50 took 27 ms before the first --check and 16 ms after.
# Timing fixes both at glibc's dynamic maximum (32 MiB on 64-bit), the state a long-running
# process settles in.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY_MMAP_THRESHOLD = 32 << 20


def steady_heap() -> None:
    """Reuse heap blocks below 32 MiB across calls, whatever the process freed before
    (see above); a no-op where libc has no mallopt."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * _STEADY_MMAP_THRESHOLD)


def measure_rotating(sides: dict[str, Callable[[], object]], *, warmup: int = 2,
                     rounds: int = 10, min_block_seconds: float = 0.05,
                     budget_seconds: float | None = None, min_rounds: int = 3
                     ) -> tuple[dict[str, list[float]], int]:
    """Per-round seconds per call of each side, and the calls per block.

    Each round times a block of calls of every side in turn, so all see the same machine
    state; a block repeats the call until it lasts `min_block_seconds` (so thread pools of
    the side just measured are not timed as the next side's noise; the same length for all,
    set by the slowest side) and records the median call. With `budget_seconds`, slow
    kernels get fewer warm-up calls (one when a call alone exceeds the budget's share) and
    fewer rounds (not below `min_rounds`), so a multi-second kernel is measured in bounded
    time. The heap is held steady first (`steady_heap`)."""
    steady_heap()
    calls = list(sides.values())
    n = len(calls)
    first = max(max(_once(f) for f in calls), 1e-6)  # the first warm-up call of each side
    extra_warmup = max(0, warmup - 1)
    if budget_seconds is not None and n * first * (extra_warmup + min_rounds) > budget_seconds:
        extra_warmup = 0
    for _ in range(extra_warmup):
        for f in calls:
            f()
    once = max(max(_once(f) for f in calls), 1e-6) if extra_warmup else first
    reps = max(1, int(min_block_seconds / once))
    if budget_seconds is not None:
        rounds = max(min_rounds, min(rounds, int(budget_seconds / (n * reps * once))))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, f in sides.items():
            times[name].append(_block(f, reps))
    return times, reps


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _block(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
