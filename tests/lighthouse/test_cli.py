"""The CLI: the demo path, --emit/--dump-dir/-v, and every error path (one line, exit 2)."""

from tests.conftest import EXAMPLES, run_cli


def _one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_run_check_prints_results_and_passes():
    r = run_cli(EXAMPLES / "softmax.py", "--set", "N=8", "--set", "C=40", "--run", "--check")
    assert r.returncode == 0, r.stderr
    assert "out0: [8, 40] float32" in r.stdout
    assert "check passed" in r.stdout


def test_bench_prints_both_medians_and_ratio():
    r = run_cli(EXAMPLES / "matmul.py", "--set", "N=64", "--bench")
    assert r.returncode == 0, r.stderr
    assert "ours" in r.stdout and "torch" in r.stdout and "speedup" in r.stdout


def test_bench_runs_torch_on_the_threads_of_ours():
    """--bench --threads N: torch eager on N threads during the measurement (it would take
    every core otherwise), its setting restored after."""
    import torch

    from lighthouse.compile import bench, compile_kernel

    compiled = compile_kernel(EXAMPLES / "matmul.py", overrides={"N": 32}, threads=1)
    seen = []
    reference = compiled.imported.reference

    def recording():
        seen.append(torch.get_num_threads())
        return reference()

    compiled.imported.reference = recording
    before = torch.get_num_threads()
    bench(compiled, rounds=2, threads=1)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before


def test_emit_prints_stage_ir_and_stops():
    r = run_cli(EXAMPLES / "matmul.py", "--set", "N=32", "--emit", "import")
    assert r.returncode == 0, r.stderr
    assert "linalg.matmul" in r.stdout and "func.func @main" in r.stdout
    r = run_cli(EXAMPLES / "matmul.py", "--set", "N=32", "--emit", "vectorize")
    assert "vector.contract" in r.stdout or "vector.fma" in r.stdout


def test_dump_dir_and_verbose_timings(tmp_path):
    r = run_cli(EXAMPLES / "matmul.py", "--set", "N=32", "--dump-dir", tmp_path, "-v", "--run")
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-input.mlir", "01-import.mlir", "02-cleanup.mlir", "03-fuse.mlir",
                     "03-fuse.transform.mlir", "04-vectorize.mlir", "04-vectorize.transform.mlir",
                     "05-bufferize.mlir", "06-llvm.mlir"]
    assert "llvm.func" in (tmp_path / "06-llvm.mlir").read_text()
    for stage in ("import", "cleanup", "fuse", "vectorize", "bufferize", "llvm", "jit"):
        assert f"  {stage}" in r.stderr


def test_missing_file():
    _one_line_error(run_cli("no/such/kernel.py"), "no/such/kernel.py", "no such kernel file")


def test_file_without_model(kernel_file):
    path = kernel_file("import torch\ndef get_inputs():\n    return [torch.ones(2)]\n")
    _one_line_error(run_cli(path, "--run"), str(path), "Model is missing")


def test_unknown_stage():
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--emit", "nonsense"), "unknown stage 'nonsense'",
                    "vectorize")


def test_bad_override():
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--set", "Q=3"), "--set Q", "N")
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--set", "oops"), "NAME=VALUE")


def test_dtype_globals_take_dtype_names():
    r = run_cli(EXAMPLES / "matmul.py", "--set", "N=16", "--set", "DTYPE=bfloat16", "--run", "--check")
    assert r.returncode == 0, r.stderr
    assert "out0: [16, 16] bfloat16" in r.stdout
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--set", "DTYPE=bfloat61"),
                    "--set DTYPE", "'bfloat61' is not a torch dtype")


def test_unknown_schedule_option(kernel_file):
    path = kernel_file("""
        import torch
        LIGHTHOUSE = dict(query_tyle=32)
        class Model(torch.nn.Module):
            def forward(self, x):
                return x + 1
        def get_inputs():
            return [torch.randn(4)]
        def get_init_inputs():
            return []
    """)
    _one_line_error(run_cli(path, "--run"), "LIGHTHOUSE option 'query_tyle'", "query_tile")


def test_op_torch_mlir_cannot_lower(kernel_file):
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return torch.linalg.eigvalsh(x)
        def get_inputs():
            return [torch.eye(4)]
        def get_init_inputs():
            return []
    """)
    r = run_cli(path, "--run")
    _one_line_error(r, str(path))
    assert "eigh" in r.stderr or "linalg" in r.stderr


def test_dynamic_shapes_are_rejected(kernel_file):
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return x[x > 0]
        def get_inputs():
            return [torch.randn(8)]
        def get_init_inputs():
            return []
    """)
    r = run_cli(path, "--run")
    _one_line_error(r, str(path))
    assert "dynamic" in r.stderr or "import failed" in r.stderr


def test_check_mismatch_exits_1(kernel_file):
    path = kernel_file("""
        import torch
        STATE = [0]
        class Model(torch.nn.Module):
            def forward(self, x):
                STATE[0] += 1
                return x * STATE[0]
        def get_inputs():
            return [torch.ones(64)]
        def get_init_inputs():
            return []
    """)
    r = run_cli(path, "--check")
    assert r.returncode == 1, r.stderr + r.stdout
    assert "MISMATCH" in r.stdout
    assert "result differs from torch" in r.stderr


def test_a_directory_is_not_a_kernel_file(tmp_path):
    _one_line_error(run_cli(tmp_path), str(tmp_path), "is a directory, not a kernel file")


def test_override_of_the_wrong_type():
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--set", "N=abc"),
                    "--set N='abc'", "N is int", "the value is str")
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--set", "N=2.5"), "N is int", "float")


RAISING = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        {forward}
def get_inputs():
    {inputs}
def get_init_inputs():
    return []
"""


def test_get_inputs_that_raises(kernel_file):
    path = kernel_file(RAISING.format(forward="return x", inputs="raise ValueError('no inputs')"))
    _one_line_error(run_cli(path, "--run"), str(path), "get_inputs() failed: ValueError: no inputs")


def test_forward_that_raises(kernel_file):
    path = kernel_file(RAISING.format(forward="raise ValueError('bad forward')",
                                      inputs="return [torch.randn(3)]"))
    for extra in ([], ["--backward"]):
        r = run_cli(path, "--run", *extra)
        _one_line_error(r, str(path), "Model.forward fails on the example inputs",
                        "ValueError: bad forward")


def test_forward_returning_none(kernel_file):
    path = kernel_file(RAISING.format(forward="return x + 1, None", inputs="return [torch.randn(3)]"))
    _one_line_error(run_cli(path, "--run"), str(path), "returns None as result 1",
                    "every result must be a tensor")


def test_running_a_partial_compile_is_an_error():
    """--check (or --run, --bench) with --stop-after or --emit: nothing was JIT-compiled to
    run; said so, instead of blaming the target."""
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--check", "--stop-after", "cleanup"),
                    "--stop-after cleanup leaves nothing to run")
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--run", "--emit", "fuse"),
                    "--emit fuse leaves nothing to run")


def test_zero_threads_is_an_error():
    _one_line_error(run_cli(EXAMPLES / "matmul.py", "--set", "N=8", "--threads", "0"),
                    "--threads must be >= 1, got 0")


def test_a_forced_schedule_that_does_not_apply_falls_back_with_a_note():
    r = run_cli(EXAMPLES / "softmax.py", "--set", "N=8", "--set", "C=40", "--schedule", "matmul",
                "--check")
    assert r.returncode == 0, r.stderr
    assert "note: the matmul schedule does not apply (the payload has no contraction); " \
           "using the generic schedule" in r.stderr
    strict = run_cli(EXAMPLES / "softmax.py", "--set", "N=8", "--set", "C=40", "--schedule",
                     "matmul", "--strict", "--check")
    _one_line_error(strict, "the matmul schedule does not apply (the payload has no contraction)")
    assert "using the generic schedule" not in strict.stderr
