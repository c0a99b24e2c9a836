"""Every measurement in its own process, with a timeout.

Processes come from a `multiprocessing` fork server that imported torch, torch-mlir and
lighthouse once and warmed torch.export's caches (`preload`: module imports and pure-Python
tables, no threads started). A child is still a fresh process (its own heap, peak RSS,
thread pools, JIT) but starts in milliseconds instead of the seconds those imports take.
A child's stdout and stderr go to a log file whose last line explains a crash; a child
still running after `timeout` seconds is killed.

Both OpenMP runtimes in a child spin about 200 us after a parallel region, then sleep
(`CHILD_ENV`, unless the caller set these variables): ours (libiomp5) by KMP_BLOCKTIME, as
lighthouse.targets.cpu sets it anyway; torch's libgomp by GOMP_SPINCOUNT (20000 spins took
200-400 us here). Calls back to back find either side's workers awake, as they would in a
program; a worker that sleeps costs 50-100 us to wake on this project's VMs. libgomp's
default (300000 spins, milliseconds) made a small torch softmax jump from 0.05 to 7 ms with
a busy neighbour process; fully passive threads, as the bench had before, charged every
small kernel of either side a wake-up per parallel region.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

PRELOAD = "lighthouse.benchmarks.preload"

_context = None


@dataclass
class Outcome:
    status: str  # "ok", "timeout", "crashed" (died without a result), "raised" (an exception)
    value: Any = None
    error: str = ""
    seconds: float = 0.0


CHILD_ENV = {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "200us"}


def _get_context():
    global _context
    if _context is None:
        for name, value in CHILD_ENV.items():  # inherited by the fork server, read at load
            os.environ.setdefault(name, value)
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([PRELOAD])
    return _context


def run_isolated(fn: Callable, *args, timeout: float, **kwargs) -> Outcome:
    """fn(*args, **kwargs) in a fresh child process; its return value must pickle."""
    ctx = _get_context()
    receiver, sender = ctx.Pipe(duplex=False)
    fd, log_path = tempfile.mkstemp(prefix="lighthouse-bench-", suffix=".log")
    os.close(fd)
    proc = ctx.Process(target=_child, args=(fn, args, kwargs, sender, log_path), daemon=True)
    start = time.perf_counter()
    try:
        proc.start()
        sender.close()
        if not receiver.poll(timeout):
            proc.kill()
            proc.join()
            return Outcome("timeout", error=f"no result after {timeout:.0f} s",
                           seconds=time.perf_counter() - start)
        try:
            kind, payload = receiver.recv()
        except EOFError:
            proc.join(10)
            return Outcome("crashed", error=_death(proc.exitcode, log_path),
                           seconds=time.perf_counter() - start)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        seconds = time.perf_counter() - start
        if kind == "ok":
            return Outcome("ok", value=payload, seconds=seconds)
        return Outcome("raised", error=payload, seconds=seconds)
    finally:
        receiver.close()
        os.unlink(log_path)


def _child(fn, args, kwargs, sender, log_path) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # reported to the parent, which decides what it means
        where = traceback.extract_tb(exc.__traceback__)[-1]
        result = ("raised", f"{type(exc).__name__}: {exc} "
                            f"({os.path.basename(where.filename)}:{where.lineno})")
    sender.send(result)
    sender.close()


def _death(exitcode, log_path: str) -> str:
    if exitcode is not None and exitcode < 0:
        how = f"killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with status {exitcode} without a result"
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return f"{how}: {lines[-1][:300]}" if lines else how
