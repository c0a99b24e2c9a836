"""python -m lighthouse.bench: the table and its files, the pass/fail logic (a kernel that
differs from torch is a FAIL row and exit status 1), KernelBench problem files, argument
errors, the torch.compile (inductor) columns, and the pieces (child processes, peak-memory
growth, the timing budget). Every run is on tiny kernels (inductor compiles a C++ file per
graph in seconds: two tiny kernels are timed against it)."""

import csv
import json
import re
import shlex
import sys
import time

import pytest
import torch

from lighthouse.bench import main
from tests.conftest import ROOT, run_cli, run_in_process

KERNELBENCH = ROOT / "tests" / "lighthouse" / "fixtures" / "kernelbench"
COLUMNS = ["kernel", "schedule", "compile s", "max err", "check", "ours ms", "torch ms", "speedup",
           "ours MB", "torch MB", "ours rate", "% limit", "torch % limit"]
INDUCTOR_COLUMNS = COLUMNS[:8] + ["inductor ms", "vs inductor"] + COLUMNS[8:]


def run_bench(*args):
    """`python -m lighthouse.bench ARGS`, run in this process (its cases run in children)."""
    return run_in_process(main, [str(a) for a in args])


def parse_table(stdout: str):
    """(column names, {kernel: {column: cell}}) of the printed table."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("kernel "))
    spans = [m.span() for m in re.finditer(r"-+", lines[at + 1])]
    names = [lines[at][a:b].strip() for a, b in spans]
    rows = {}
    for line in lines[at + 2:]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in spans]
        rows[cells[0]] = dict(zip(names, cells))
    return names, rows


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    files = {"csv": out / "b.csv", "json": out / "b.json", "png": out / "b.png"}
    r = run_bench("--quick", "--only", "softmax", "log_softmax", "--csv", files["csv"],
                  "--json", files["json"], "--plot", files["png"])
    return r, files


def test_quick_suite_table_columns_and_rows(suite_run):
    r, _ = suite_run
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"FMA peak \d+ GFLOP/s .* streaming read [\d.]+ GB/s", r.stdout)
    names, rows = parse_table(r.stdout)
    assert names == COLUMNS
    assert sorted(rows) == ["log_softmax", "softmax"]
    for row in rows.values():
        assert row["check"] == "PASS"
        ours, theirs = float(row["ours ms"]), float(row["torch ms"])
        assert ours > 0 and theirs > 0
        assert float(row["speedup"].rstrip("x")) == pytest.approx(theirs / ours, rel=0.02, abs=0.01)
        assert row["ours rate"].endswith("GB/s")  # no matmul: memory-bound
        assert float(row["max err"]) < 1e-4
    assert "2 kernels: 2 PASS" in r.stdout
    assert "[1/2] softmax" in r.stderr and "[2/2] log_softmax" in r.stderr  # progress


def test_quick_suite_files(suite_run):
    r, files = suite_run
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [row["name"] for row in rows] == ["softmax", "log_softmax"]
    doc = json.loads(files["json"].read_text())
    assert doc["settings"]["inductor"] is False  # off with --quick unless --inductor
    limits = doc["machine"]["limits"]
    assert limits["fma_gflops"] > 1 and limits["bandwidth_gbs"] > 0.1
    output_mb = 96 * 1000 * 4 / 2**20  # quick softmax: [96, 1000] f32 out
    for row in doc["rows"]:
        assert row["status"] == "PASS" and row["bound"] == "memory"
        assert row["gbyte"] == pytest.approx(2 * output_mb * 2**20 / 1e9)
        # each side's call allocates at least its output
        assert row["ours_peak_mb"] >= 0.9 * output_mb and row["torch_peak_mb"] >= 0.9 * output_mb
        assert row["ours_limit_pct"] == pytest.approx(
            100 * row["ours_rate"] / limits["bandwidth_gbs"])
        assert row["command"].endswith("softmax.py --set N=96 --set C=1000")
        assert row["import_s"] > 0 and row["compile_s"] > 0
        assert row["inductor_ms"] is None and row["inductor_compile_s"] is None
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inductor_columns_forward_and_backward(tmp_path):
    """--quick --inductor on a tiny forward and a tiny backward kernel: torch.compile of the
    reference is timed in rotation with ours and torch eager, its compile seconds apart."""
    out = tmp_path / "b.json"
    r = run_bench("--quick", "--inductor", "--only", "softmax", "attention_causal_bwd",
                  "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    names, rows = parse_table(r.stdout)
    assert names == INDUCTOR_COLUMNS
    assert sorted(rows) == ["attention_causal_bwd", "softmax"]
    for row in rows.values():
        assert row["check"] == "PASS"
        ours, inductor = float(row["ours ms"]), float(row["inductor ms"])
        assert inductor > 0
        assert float(row["vs inductor"].rstrip("x")) == pytest.approx(inductor / ours,
                                                                      rel=0.02, abs=0.01)
    doc = json.loads(out.read_text())
    assert doc["settings"]["inductor"] is True
    for row in doc["rows"]:
        assert row["inductor_compile_s"] > 0 and row["inductor_spread"] >= 0
        assert row["vs_inductor"] == pytest.approx(row["inductor_ms"] / row["ours_ms"])
        assert row["speedup"] == pytest.approx(row["torch_ms"] / row["ours_ms"])
        assert not row["notes"]  # inductor's results agree with torch eager's
    assert re.search(r"\[2/2\] attention_causal_bwd .*, inductor [\d.]+ ms, [\d.]+x", r.stderr)


def test_a_kernel_torch_compile_cannot_take_gets_a_note(kernel_file):
    """Without --quick inductor is on. It cannot compile one kernel (no C++ compiler, as on a
    machine without one) and crashes the process on the other: both rows are timed without
    it and say why; the bench passes."""
    source = """
        import os
        import torch
        import torch._inductor.config
        {setup}
        class Model(torch.nn.Module):
            def forward(self, x):
                {forward}
                return torch.softmax(x * 0.5, dim=-1)
        def get_inputs():
            return [torch.randn(8, 16)]
        def get_init_inputs():
            return []
    """
    no_cxx = kernel_file(source.format(setup='torch._inductor.config.cpp.cxx = (None, "/no/c++")',
                                       forward="pass"), name="no_cxx.py")
    crash = kernel_file(source.format(setup="", forward="if torch.compiler.is_dynamo_compiling(): "
                                                        "os.abort()"), name="crash.py")
    r = run_bench(no_cxx, crash)
    assert r.returncode == 0, r.stdout + r.stderr
    names, rows = parse_table(r.stdout)
    assert names == INDUCTOR_COLUMNS
    for name in ("no_cxx", "crash"):
        assert rows[name]["check"] == "PASS" and float(rows[name]["speedup"].rstrip("x")) > 0
        assert rows[name]["inductor ms"] == rows[name]["vs inductor"] == "-"
    assert re.search(r"^note no_cxx: torch.compile \(inductor\) not timed: InductorError: "
                     r"InvalidCxxCompiler: No working C\+\+ compiler", r.stdout, re.M)
    assert re.search(r"^note crash: torch.compile \(inductor\) not timed: the process crashed "
                     r"with it \(killed by SIGABRT", r.stdout, re.M)
    assert "2 kernels: 2 PASS" in r.stdout


def test_no_inductor_leaves_it_out(kernel_file, tmp_path):
    tiny = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return x * 2
        def get_inputs():
            return [torch.randn(64)]
        def get_init_inputs():
            return []
    """, name="tiny.py")
    out = tmp_path / "b.csv"
    r = run_bench("--no-inductor", tiny, "--csv", out)
    assert r.returncode == 0, r.stdout + r.stderr
    names, rows = parse_table(r.stdout)
    assert names == COLUMNS and rows["tiny"]["check"] == "PASS"
    with open(out) as f:
        row, = csv.DictReader(f)
    assert row["inductor_ms"] == row["vs_inductor"] == row["inductor_compile_s"] == ""
    assert float(row["speedup"]) > 0
    assert "torch.compile" not in r.stderr


def test_wrong_kernel_is_fail_and_exit_1(kernel_file):
    wrong = kernel_file("""
        import torch
        CALLS = [0]
        class Model(torch.nn.Module):
            def forward(self, x):
                CALLS[0] += 1          # the compiled graph freezes one value, torch moves on
                return x * CALLS[0]
        def get_inputs():
            return [torch.ones(64)]
        def get_init_inputs():
            return []
    """, name="wrong.py")
    r = run_bench("--quick", wrong)
    assert r.returncode == 1, r.stdout + r.stderr
    _, rows = parse_table(r.stdout)
    assert rows["wrong"]["check"] == "FAIL"
    assert float(rows["wrong"]["ours ms"]) > 0  # a failing kernel is still timed
    assert re.search(r"^FAIL wrong: out0: .*MISMATCH", r.stdout, re.M)
    assert "1 kernel: 1 FAIL" in r.stdout
    assert "failing: wrong" in r.stderr


def test_slow_kernel_is_a_timeout_row(kernel_file):
    from lighthouse.bench import bench_case
    from lighthouse.benchmarks.report import footnotes
    from lighthouse.benchmarks.suite import file_cases

    slow = kernel_file("""
        import time
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return x + 1
        def get_inputs():
            time.sleep(600)
            return [torch.ones(4)]
        def get_init_inputs():
            return []
    """, name="slow.py")
    settings = {"timeout_s": 2.0, "timing_budget_s": 1.0, "timing_rounds": 3, "inductor": True}
    row = bench_case(file_cases([slow])[0], settings, None)
    assert row.status == "TIMEOUT" and row.ours_ms is None
    assert footnotes([row]) == "TIMEOUT slow: compile, check and timing: no result after 2 s"


def test_kernelbench_problem_files():
    r = run_bench("--quick", "--kernelbench", KERNELBENCH, "--level", "1", "--problems", "97,89,101",
                  "--set", "batch_size=2", "--set", "num_heads=2", "--set", "sequence_length=256",
                  "--set", "embedding_dimension=16", "--set", "input_shape=(300,)")
    assert r.returncode == 0, r.stdout + r.stderr
    names, rows = parse_table(r.stdout)
    assert names == COLUMNS  # the sizes column comes with --max-elements only
    assert list(rows) == ["97_ScaledDotProductAttention", "89_cumsum", "101_cummax"]
    assert rows["97_ScaledDotProductAttention"]["check"] == "PASS"
    assert rows["97_ScaledDotProductAttention"]["ours rate"].endswith("GFLOP/s")
    assert rows["89_cumsum"]["check"] == "PASS"  # tm_tensor.scan, lowered at the import
    assert rows["101_cummax"]["check"] == "UNSUPPORTED"
    assert rows["101_cummax"]["ours ms"] == "-"
    assert re.search(r"^UNSUPPORTED 101_cummax: .*101_cummax.py: torch-mlir cannot lower "
                     r"torch.aten.cummax", r.stdout, re.M)
    assert "'input_shape=(300,)'" in r.stderr  # progress lines show the sizes, shell-quoted
    # KernelBench's summary: 2 of the 3 problems are correct (fast_0); --quick: no inductor
    assert re.search(r"^against torch eager: fast_0 0\.67, fast_1 0\.\d\d, fast_1\.5 0\.\d\d "
                     r"\(median \d+\.\d\dx over 2 passing, slowest \d+\.\d\dx\)$", r.stdout, re.M)
    assert "against torch.compile" not in r.stdout


def test_fast_p_counts_correct_and_faster_problems():
    from lighthouse.benchmarks.report import Row, fast_p, fast_p_values

    def row(status, speedup, vs_inductor=None):
        return Row("k", "k.py", "", False, status, speedup=speedup, vs_inductor=vs_inductor)

    rows = [row("PASS", 2.0, 0.9), row("PASS", 1.2, None), row("FAIL", 3.0, 3.0),
            row("UNSUPPORTED", None), row("PASS", 0.5, 1.6)]
    assert fast_p_values(rows, "speedup") == {0.0: 0.6, 1.0: 0.4, 1.5: 0.2}
    assert fast_p_values(rows, "vs_inductor") == {0.0: 0.4, 1.0: 0.2, 1.5: 0.2}
    assert fast_p(rows, inductor=True).splitlines() == [
        "against torch eager: fast_0 0.60, fast_1 0.40, fast_1.5 0.20 (median 1.20x over 3 "
        "passing, slowest 0.50x)",
        "against torch.compile: fast_0 0.40, fast_1 0.20, fast_1.5 0.20 (median 1.25x over 2 "
        "passing, slowest 0.90x)"]


def test_max_elements_shrinks_kernelbench_problems(tmp_path):
    """--max-elements 20000 on the fixtures, one thread each side: each row shows the --set
    values it ran with, and the row's command compiles the same problem alone (on one
    thread) and passes --check."""
    out = tmp_path / "kb.json"
    r = run_bench("--quick", "--kernelbench", KERNELBENCH, "--problems", "40,89,95",
                  "--max-elements", "20000", "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    names, rows = parse_table(r.stdout)
    assert names == COLUMNS + ["sizes (--set)"]
    assert {name: (row["check"], row["sizes (--set)"]) for name, row in rows.items()} == {
        "40_LayerNorm": ("PASS", "batch_size=8 features=8 dim1=16 dim2=16"),
        "89_cumsum": ("PASS", "'input_shape=(125,)'"),
        "95_CrossEntropyLoss": ("PASS", "batch_size=1024")}
    doc = json.loads(out.read_text())
    assert doc["settings"]["max_elements"] == 20000 and doc["settings"]["threads"] == 1
    command = next(row["command"] for row in doc["rows"] if row["name"] == "89_cumsum")
    assert command.endswith("89_cumsum.py --set 'input_shape=(125,)' --threads 1")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "lighthouse.compile"]
    rerun = run_cli(*argv[3:], "--check")
    assert rerun.returncode == 0 and "check passed" in rerun.stdout, rerun.stdout + rerun.stderr


SHRINK = """
import torch
{globals}
class Model(torch.nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.layer = {layer}
    def forward(self, {args}):
        return {expr}
def get_inputs():
    return {inputs}
def get_init_inputs():
    return [{init}]
"""


def _shrink(kernel_file, budget, keep=(), start=None, *, layer="torch.nn.Identity()",
            init="", args="x", **parts):
    from lighthouse.benchmarks.shrink import fit_to_elements

    path = kernel_file(SHRINK.format(layer=layer, init=init, args=args, **parts))
    return path, fit_to_elements(path, budget, start, set(keep))


def _runs_for_real(path, overrides):
    """The chosen sizes make a kernel that loads and runs on real tensors."""
    from lighthouse.kernel import load_kernel

    kernel = load_kernel(path, overrides)
    with torch.no_grad():
        return kernel.model(*kernel.inputs)


def test_shrink_halves_the_largest_size_until_the_inputs_fit(kernel_file):
    path, fit = _shrink(kernel_file, 10_000, globals="B = 64\nN = 1000\ndim = 1\nFLAG = True",
                        expr="torch.softmax(x, dim=dim) if FLAG else x",
                        inputs="[torch.randn(B, N)]")
    assert fit.overrides == {"N": 125}  # N is the largest three times; never dim or FLAG
    assert fit.elements == 8000 and fit.original == 64_000 and fit.reached and not fit.notes
    _runs_for_real(path, fit.overrides)


def test_shrink_counts_the_outputs_too(kernel_file):
    """KernelBench 7: a [M, 64] x [64, N] matmul's inputs are small, its output is not."""
    _, fit = _shrink(kernel_file, 100_000, globals="M = 4096\nN = 4096\nK = 16",
                     expr="a @ b", args="a, b", inputs="[torch.randn(M, K), torch.randn(K, N)]")
    assert fit.overrides == {"M": 256, "N": 256}
    assert fit.elements == 65_536


def test_shrink_rederives_globals_defined_from_sizes(kernel_file):
    """KernelBench 95: input_shape = (num_classes,) follows num_classes, so the targets of
    randint(0, num_classes) stay valid classes."""
    path, fit = _shrink(kernel_file, 20_000,
                        globals="batch_size = 512\nnum_classes = 1000\ninput_shape = (num_classes,)",
                        expr="torch.nn.functional.cross_entropy(x, t)", args="x, t",
                        inputs="[torch.randn(batch_size, *input_shape), "
                               "torch.randint(0, num_classes, (batch_size,))]")
    assert fit.overrides == {"batch_size": 128, "num_classes": 125, "input_shape": (125,)}
    _runs_for_real(path, fit.overrides)


def test_shrink_keeps_channels_divisible_by_groups_and_kernels_inside_inputs(kernel_file):
    path, fit = _shrink(kernel_file, 50, globals="in_channels = 64\nlength = 4096\n"
                                                  "kernel_size = 7\ngroups = 8",
                        layer="torch.nn.Conv1d(args[0], 16, args[1], groups=args[2])",
                        init="in_channels, kernel_size, groups", expr="self.layer(x)",
                        inputs="[torch.randn(1, in_channels, length)]")
    assert fit.overrides["in_channels"] == 8  # 4 channels in 8 groups cannot be built
    assert fit.overrides["length"] == 8  # nor a 7-wide kernel on 4 samples
    assert "kernel_size" not in fit.overrides and "groups" not in fit.overrides
    assert not fit.reached and fit.elements == 64
    assert fit.notes == ["--max-elements 50: the inputs or outputs hold 64 elements at the "
                         "smallest sizes found"]
    _runs_for_real(path, fit.overrides)


def test_shrink_halves_equal_sizes_together_when_one_alone_fails(kernel_file):
    """KernelBench 100: predictions [B, C] * targets [B] broadcasts only while B == C."""
    path, fit = _shrink(kernel_file, 5_000, globals="batch_size = 1024\ninput_shape = (1024,)",
                        expr="torch.clamp(1 - p * t, min=0).mean()", args="p, t",
                        inputs="[torch.randn(batch_size, *input_shape), torch.randn(batch_size)]")
    assert fit.overrides == {"batch_size": 64, "input_shape": (64,)}
    _runs_for_real(path, fit.overrides)


def test_shrink_keeps_the_users_sizes(kernel_file):
    _, fit = _shrink(kernel_file, 1_000, keep={"B"}, start={"B": 5},
                     globals="B = 64\nN = 1000", expr="x * 2", inputs="[torch.randn(B, N)]")
    assert fit.overrides == {"B": 5, "N": 125}


def test_shrink_without_a_meta_forward_counts_the_inputs(kernel_file):
    _, fit = _shrink(kernel_file, 1_000, globals="N = 4096", expr="x * x.sum().item()",
                     inputs="[torch.randn(N)]")
    assert fit.overrides == {"N": 512}
    assert "does not run on meta tensors" in fit.notes[0]


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--only", "nonesuch"], "--only nonesuch: no such kernel"),
    (["--quick", "--set", "NONESUCH=1"], "--set NONESUCH: no selected kernel file defines"),
    (["--kernelbench", str(KERNELBENCH), "--problems", "23,999"], "no problem file for 999"),
    (["--kernelbench", str(KERNELBENCH), "--level", "7"], "no level7/ folder"),
    (["--problems", "23"], "--problems needs --kernelbench"),
    (["no/such/kernel.py"], "no/such/kernel.py: no such kernel file"),
    (["--kernelbench", str(KERNELBENCH), "--max-elements", "0"], "--max-elements must be at least 1"),
])
def test_argument_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def _sleep_forever():
    time.sleep(3600)


def _abort():
    import os

    os.abort()


def _exit_early():
    import os

    print("about to exit", flush=True)
    os._exit(3)


def _raise():
    raise ValueError("bad value")


def test_isolated_children_timeout_crash_and_exception():
    from lighthouse.benchmarks.isolate import run_isolated

    assert run_isolated(pow, 2, 10, timeout=60).value == 1024
    out = run_isolated(_sleep_forever, timeout=1)
    assert out.status == "timeout" and "after 1 s" in out.error
    out = run_isolated(_abort, timeout=60)
    assert out.status == "crashed" and out.error.startswith("killed by SIGABRT")
    out = run_isolated(_exit_early, timeout=60)
    assert out.status == "crashed"
    assert out.error == "exited with status 3 without a result: about to exit"  # the log's tail
    out = run_isolated(_raise, timeout=60)
    assert out.status == "raised" and out.error.startswith("ValueError: bad value (test_bench.py:")


def test_peak_memory_growth_counts_a_calls_allocations():
    from lighthouse.benchmarks.measure import growth_during

    x = torch.randn(1 << 20)
    x * 2  # warm-up
    grown = growth_during(lambda: x * 2)  # a 4 MiB result (a few pages may be reused ones)
    assert 4 * 2**20 - 2**16 <= grown < 5 * 2**20
    assert growth_during(lambda: None) < 2**20


@pytest.fixture
def simulated_clock(monkeypatch):
    """A clock that only the timed calls advance (`tick(seconds)`), so the timing loops'
    rounds do not depend on how loaded the machine running the test is."""
    from types import SimpleNamespace

    from lighthouse import runtime

    now = [0.0]
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def tick(seconds):
        now[0] += seconds
    return tick


def test_timing_budget_limits_warmup_and_rounds(simulated_clock):
    from lighthouse.runtime import measure_alternately

    calls = {"ours": 0, "theirs": 0}

    def side(name, seconds):
        def call():
            calls[name] += 1
            simulated_clock(seconds)
        return call

    times = measure_alternately(side("ours", 0.02), side("theirs", 0.04), budget_seconds=0.3,
                                rounds=10, min_rounds=3)
    # one warm-up call each (a second would not fit the budget), then 3 rounds of 1 call
    assert calls == {"ours": 4, "theirs": 4}
    assert len(times.ours_rounds) == len(times.theirs_rounds) == 3
    assert times.ours == pytest.approx(0.02) and times.theirs == pytest.approx(0.04)


def test_timing_rotates_through_every_side_within_the_budget(simulated_clock):
    from lighthouse.runtime import measure_rotating

    calls = []

    def side(name, seconds):
        def call():
            calls.append(name)
            simulated_clock(seconds)
        return call

    times, reps = measure_rotating({"ours": side("ours", 0.01), "torch": side("torch", 0.02),
                                    "inductor": side("inductor", 0.03)}, warmup=1,
                                   budget_seconds=0.5, rounds=10, min_rounds=2)
    assert reps == 1
    # one warm-up call each, then rounds of one call (the slowest side's 0.03 s fills the
    # 0.05 s block) per side in turn: 0.5 s / (3 x 0.03 s) = 5 rounds
    assert calls == ["ours", "torch", "inductor"] * 6
    assert times == {"ours": pytest.approx([0.01] * 5), "torch": pytest.approx([0.02] * 5),
                     "inductor": pytest.approx([0.03] * 5)}


def test_xegpu_mode_prints_the_machine_code_table_beside_the_anchor(tmp_path):
    """--target xegpu: each kernel file compiled through the native stage (ocloc) for the
    chip, a row per kernel with its GRF mode, spills, DPAS, block IO and the estimate; a
    kernel that does not lower (f32 matmul: DPAS takes f16/bf16) is an error row, exit 1."""
    from tests.lighthouse.test_xegpu_attention import _write

    attention = _write(tmp_path / "attention.py", 1, 2, 256, 64, "float16", False)
    out = tmp_path / "x.json"
    r = run_bench("--target", "xegpu", "--chip", "pvc", attention, ROOT / "examples" / "matmul.py",
                  "--set", "N=64", "--json", out)
    assert r.returncode == 1 and "error: matmul on pvc: raised" in r.stderr
    (row,) = [ln for ln in r.stdout.splitlines() if ln.startswith("attention ")]
    cells = row.split()
    assert cells[1:4] == ["pvc", "main_kernel", "attention"] and cells[4] in ("128", "256")
    (failed,) = [ln for ln in r.stdout.splitlines() if ln.startswith("matmul ")]
    assert failed.split()[1:4] == ["pvc", "-", "RAISED"]
    assert "anchor: upstream lighthouse fused attention" in r.stdout
    saved = json.loads(out.read_text())
    assert saved["columns"][:3] == ["case", "chip", "kernel"] and len(saved["rows"]) == 2
