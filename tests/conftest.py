import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT))


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
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "lighthouse.compile", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=600)
