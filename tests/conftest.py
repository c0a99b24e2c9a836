import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT))
# The CPU the schedules plan for in the tests (lighthouse.targets.description; children
# inherit it): the IR the tests check is chosen from vector registers and cache sizes, so
# it is pinned to one machine's (AVX-512, 48 KiB L1d, 2 MiB L2, no bf16 dot products: the
# tests that use them say so); the code still runs on the
# host. Small kernels stay on all threads (parallel_cycles=0): the tests' shapes are small,
# and their parallel tiles are what they test. Set LIGHTHOUSE_CPU to run the suite for
# another description.
os.environ.setdefault(
    "LIGHTHOUSE_CPU",
    "vector_bits=512,vector_registers=32,l1d=48K,l2=2M,l3=480M,parallel_cycles=0,bf16_dot=0,amx=0")
# Compiled kernels go to a cache of this session's own (lighthouse.kernel_cache; children
# inherit it), never the user's.
if "LIGHTHOUSE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["LIGHTHOUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="lighthouse-test-kernels-")


@pytest.fixture
def kernel_file(tmp_path):
    """Write a kernel file from source text; returns its path."""
    counter = {"n": 0}

    def write(source: str, name: str | None = None) -> Path:
        counter["n"] += 1
        path = tmp_path / (name or f"kernel{counter['n']}.py")
        path.write_text(textwrap.dedent(source))
        return path

    return write


def run_cli(*args, env=None):
    """`python -m lighthouse.compile ARGS`: its exit code and what it wrote to stdout and
    stderr (file descriptors 1 and 2, so MLIR's native diagnostics are caught too). It runs
    in this process (an interpreter start and the torch import cost seconds a call), or in a
    child when `env` sets environment variables."""
    import subprocess

    argv = [str(a) for a in args]
    if env:
        return subprocess.run([sys.executable, "-m", "lighthouse.compile", *argv], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, **env},
                              timeout=600)
    from lighthouse.compile import main

    return run_in_process(main, argv)


def run_in_process(main, argv: list[str]):
    """A command-line `main(argv) -> exit code` run here, as a CompletedProcess."""
    import subprocess

    captured = _CapturedFds()
    with captured:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(argv, code, captured.stdout, captured.stderr)


class _CapturedFds:
    """File descriptors 1 and 2 (and sys.stdout/stderr) written to files while inside; their
    text in `stdout` and `stderr` after."""

    def __enter__(self):
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.paths = [Path(self.dir.name) / "stdout", Path(self.dir.name) / "stderr"]
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        self.streams = (sys.stdout, sys.stderr)
        self.files = [open(p, "w") for p in self.paths]
        for fd, f in zip((1, 2), self.files):
            os.dup2(f.fileno(), fd)
        sys.stdout, sys.stderr = self.files
        return self

    def __exit__(self, *exc):
        for f in self.files:
            f.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        sys.stdout, sys.stderr = self.streams
        for f in self.files:
            f.close()
        self.stdout, self.stderr = (p.read_text() for p in self.paths)
        self.dir.cleanup()
        return False
