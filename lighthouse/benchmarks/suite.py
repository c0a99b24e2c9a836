"""What `python -m lighthouse.bench` runs: the default suite, the quick suite, kernel files
given on the command line, and KernelBench problem files.

A case is a kernel file plus `--set` overrides (module globals) and the direction (forward,
or the joint forward+backward graph). Causal attention declares the fraction of its
score matrix that is not masked (`useful_flops`): FLOPs are reported as useful work, the
convention of flash-attention benchmarks, so a schedule that skips masked blocks gets the
credit and one that computes them does not.
"""

from __future__ import annotations

import ast
import fnmatch
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KernelFileError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class Case:
    name: str
    path: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    backward: bool = False
    useful_flops: float = 1.0  # fraction of the graph's matmul FLOPs that is useful work
    notes: list[str] = field(default_factory=list)  # how the sizes were chosen, when it matters
    threads: int | None = None  # threads of ours and of torch (None: all cores)

    @property
    def sizes(self) -> str:
        return " ".join(shlex.quote(f"{k}={_literal(v)}") for k, v in self.overrides.items())

    def command(self) -> str:
        """The `lighthouse.compile` command line that compiles this case alone."""
        words = ["python -m lighthouse.compile", shlex.quote(str(self.path))]
        words += [f"--set {shlex.quote(f'{k}={_literal(v)}')}" for k, v in self.overrides.items()]
        words += ["--backward"] if self.backward else []
        words += [f"--threads {self.threads}"] if self.threads is not None else []
        return " ".join(words)


def _literal(value) -> str:
    """A --set value as `parse_override` reads it back (a dtype by its name)."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value) if isinstance(value, (tuple, list)) else str(value)


def _example(name: str, file: str, backward: bool = False, **overrides) -> Case:
    useful = 1.0
    if overrides.get("IS_CAUSAL"):
        s = overrides["S"]
        useful = (s + 1) / (2 * s)  # unmasked entries of an S x S lower triangle
    return Case(name, EXAMPLES / f"{file}.py", dict(overrides), backward, useful)


def _attention(name: str, s: int, causal: bool, h: int = 8, backward: bool = False) -> Case:
    overrides = dict(B=1, H=h, S=s, D=64)
    if causal:
        overrides["IS_CAUSAL"] = True
    return _example(name, "attention", backward, **overrides)


def default_suite() -> list[Case]:
    """Realistic sizes for a 2-core host: f32 unless named, forward unless `_bwd`."""
    mlp = dict(BATCH=512, IN_FEATURES=1024, HIDDEN=4096, OUT_FEATURES=1024)
    return [
        _example("matmul_1024", "matmul", N=1024),
        _example("matmul_2048", "matmul", N=2048),
        _example("matmul_bf16_1024", "matmul_f16", M=1024, N=1024, K=1024, DTYPE="bfloat16"),
        _example("matmul_bf16_2048", "matmul_f16", M=2048, N=2048, K=2048, DTYPE="bfloat16"),
        _example("mlp", "mlp", **mlp),
        # a decode-style batch: each weight read once per call (the short products)
        _example("mlp_batch_4", "mlp", BATCH=4, IN_FEATURES=4096, HIDDEN=4096,
                 OUT_FEATURES=4096),
        _example("softmax", "softmax", N=4096, C=4096),
        _example("log_softmax", "log_softmax", N=4096, C=4096),
        _example("layer_norm", "layer_norm", N=4096, D=4096),
        _example("transpose", "transpose", B=1, N=4096, M=4096),
        _example("transpose_bf16", "transpose", B=1, N=4096, M=4096, DTYPE="bfloat16"),
        _attention("attention_1024", 1024, False),
        _attention("attention_1024_causal", 1024, True),
        _attention("attention_4096", 4096, False),
        _attention("attention_4096_causal", 4096, True),
        _attention("attention_1024_bwd", 1024, False, backward=True),
        _attention("attention_1024_causal_bwd", 1024, True, backward=True),
        _attention("attention_4096_bwd", 4096, False, backward=True),
        _attention("attention_4096_causal_bwd", 4096, True, backward=True),
        _example("cross_entropy", "cross_entropy", N=1023, C=128256),
        _example("cross_entropy_bwd", "cross_entropy", backward=True, N=1023, C=128256),
        _example("cross_entropy_bf16", "cross_entropy", N=4096, C=32000, DTYPE="bfloat16"),
        _example("cross_entropy_bf16_bwd", "cross_entropy", backward=True, N=4096, C=32000,
                 DTYPE="bfloat16"),
        _example("linear_cross_entropy", "linear_cross_entropy", N=4096, D=1024, V=32000),
        _example("linear_cross_entropy_bwd", "linear_cross_entropy", backward=True, N=4096,
                 D=1024, V=32000),
        _example("linear_cross_entropy_bf16", "linear_cross_entropy", N=4096, D=1024, V=32000,
                 DTYPE="bfloat16"),
        _example("linear_cross_entropy_bf16_bwd", "linear_cross_entropy", backward=True,
                 N=4096, D=1024, V=32000, DTYPE="bfloat16"),
        _example("linear_cross_entropy_128k", "linear_cross_entropy", N=1024, D=1024,
                 V=128256),
        _example("linear_cross_entropy_128k_bwd", "linear_cross_entropy", backward=True,
                 N=1024, D=1024, V=128256),
        *_convolutions(),
    ]


def _convolutions() -> list[Case]:
    """2-D convolutions of a ResNet-like stage ([8, 64, 56, 56]): 3 x 3 (forward and
    backward), strided, depthwise, pointwise, and a transposed one of stride 2."""
    image = dict(N=8, C=64, H=56, W=56, F=64)
    return [
        _example("conv2d", "convolution", **image),
        _example("conv2d_bwd", "convolution", backward=True, **image),
        _example("conv2d_strided", "convolution", **{**image, "F": 128, "STRIDE": 2}),
        _example("conv2d_depthwise", "convolution", **{**image, "GROUPS": 64}),
        _example("conv2d_pointwise", "convolution", **{**image, "KH": 1, "KW": 1, "PADDING": 0}),
        _example("conv_transpose2d", "convolution", N=8, C=64, H=28, W=28, F=32, KH=4, KW=4,
                 STRIDE=2, PADDING=1, TRANSPOSED=True),
    ]


def quick_suite() -> list[Case]:
    """The same kinds at small sizes (sizes that do not divide typical tiles on purpose)."""
    mlp = dict(BATCH=64, IN_FEATURES=128, HIDDEN=384, OUT_FEATURES=96)
    return [
        _example("matmul", "matmul", N=192),
        _example("mlp", "mlp", **mlp),
        _example("mlp_batch_3", "mlp", BATCH=3, IN_FEATURES=200, HIDDEN=300, OUT_FEATURES=70),
        _example("softmax", "softmax", N=96, C=1000),
        _example("log_softmax", "log_softmax", N=96, C=1000),
        _example("layer_norm", "layer_norm", N=96, D=768),
        _example("transpose", "transpose", B=3, N=100, M=250),
        _attention("attention", 128, False, h=2),
        _attention("attention_causal", 128, True, h=2),
        _attention("attention_causal_bwd", 128, True, h=2, backward=True),
        _example("cross_entropy", "cross_entropy", N=63, C=4000),
        _example("cross_entropy_bwd", "cross_entropy", backward=True, N=63, C=4000),
        _example("cross_entropy_bf16", "cross_entropy", N=64, C=3200, DTYPE="bfloat16"),
        _example("conv2d", "convolution", N=2, C=8, H=20, W=37, F=16),
        _example("conv_transpose2d", "convolution", N=2, C=8, H=10, W=13, F=8, STRIDE=2,
                 TRANSPOSED=True),
        _example("linear_cross_entropy", "linear_cross_entropy", N=96, D=64, V=1000),
        _example("linear_cross_entropy_bwd", "linear_cross_entropy", backward=True, N=96, D=64,
                 V=1000),
    ]


def file_cases(paths: list[str | Path]) -> list[Case]:
    """Kernel files named on the command line, at their own sizes; names are file stems."""
    cases = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise KernelFileError(f"{path}: no such kernel file")
        cases.append(Case(path.stem, path))
    _check_unique(cases)
    return cases


def kernelbench_cases(root: str | Path, level: int, problems: list[int] | None) -> list[Case]:
    """KernelBench problem files `<root>/level<L>/<n>_<Name>.py` (or under
    `<root>/KernelBench/`); all problems of the level when `problems` is None."""
    root = Path(root)
    candidates = [root / f"level{level}", root / "KernelBench" / f"level{level}"]
    folder = next((d for d in candidates if d.is_dir()), None)
    if folder is None:
        raise KernelFileError(f"{root}: no level{level}/ folder of KernelBench problems")
    by_number: dict[int, Path] = {}
    for f in folder.glob("*_*.py"):
        number = f.name.split("_", 1)[0]
        if number.isdigit():
            by_number[int(number)] = f
    wanted = sorted(by_number) if problems is None else problems
    missing = [n for n in wanted if n not in by_number]
    if missing:
        raise KernelFileError(f"{folder}: no problem file for {', '.join(map(str, missing))} "
                              f"(expected <n>_<Name>.py)")
    return [Case(by_number[n].stem, by_number[n]) for n in wanted]


def select(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    """Cases whose name matches one of the patterns (exact names or shell globs)."""
    if not patterns:
        return cases
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(c.name, p) for c in cases)]
    if unknown:
        raise KernelFileError(f"--only {' '.join(unknown)}: no such kernel "
                              f"(kernels: {', '.join(c.name for c in cases)})")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def apply_threads(cases: list[Case], threads: int | None) -> list[Case]:
    """Every case run with `threads` threads on each side (None: all cores)."""
    if threads is not None and threads < 1:
        raise KernelFileError(f"--threads must be at least 1, got {threads}")
    for case in cases:
        case.threads = threads
    return cases


def apply_overrides(cases: list[Case], overrides: dict[str, Any]) -> list[Case]:
    """Apply `--set` overrides to every case whose file defines that module global; a name
    that no selected file defines is an error."""
    unused = set(overrides)
    for case in cases:
        names = module_globals(case.path)
        for name, value in overrides.items():
            if name in names:
                case.overrides[name] = value
                unused.discard(name)
    if unused:
        raise KernelFileError(f"--set {', '.join(sorted(unused))}: no selected kernel file defines "
                              f"{'this global' if len(unused) == 1 else 'these globals'}")
    return cases


def fit_to_elements(cases: list[Case], max_elements: int, keep: set[str]) -> list[Case]:
    """Shrink every case's size globals until its inputs hold at most `max_elements`
    elements (`shrink.fit_to_elements`); the globals in `keep` (the user's --set) stay."""
    from .shrink import fit_to_elements as fit

    if max_elements < 1:
        raise KernelFileError(f"--max-elements must be at least 1, got {max_elements}")
    for case in cases:
        try:
            found = fit(case.path, max_elements, case.overrides, keep & set(case.overrides))
        except KernelFileError as exc:  # the row's own run reports the file's problem
            case.notes.append(f"--max-elements not applied: {exc}")
            continue
        case.overrides = found.overrides
        case.notes += found.notes
    return cases


def module_globals(path: Path) -> set[str]:
    """Names assigned at module level in a kernel file (read without importing it)."""
    try:
        tree = ast.parse(Path(path).read_text(), str(path))
    except SyntaxError as exc:
        raise KernelFileError(f"{path}: not valid Python: {exc.msg} (line {exc.lineno})") from exc
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.add(n.id)
    return names


def _check_unique(cases: list[Case]) -> None:
    seen: set[str] = set()
    for c in cases:
        if c.name in seen:
            raise KernelFileError(f"two kernels are named {c.name!r}; rename one of the files")
        seen.add(c.name)
