"""The fuzz harness itself: how outcomes are judged (what fails, what is an honest refusal),
the failure files it writes, and one real case end to end. The strategies' programs are
valid torch programs (run eagerly, forward and backward, without lighthouse)."""

import inspect
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lighthouse.benchmarks.isolate import Outcome
from lighthouse.kernel import _import_file

from . import harness
from .programs.attention import attention_kernels
from .programs.cross_entropy import cross_entropy_kernels
from .programs.matmul import matmul_kernels
from .programs.pooling import pooling_kernels
from .programs.rows import row_kernels

KERNEL = "/tmp/lighthouse-fuzz-abc/matmul_0123.py"


def ok_result(**extra):
    return {"status": "ok", "family": "matmul", "notes": [], "reports": ["out0: ok"],
            "mismatches": [], **extra}


def judge(outcome, log="", backward=False):
    return harness.judge(outcome, log, KERNEL, backward)


def test_a_passing_case_is_ok():
    assert judge(Outcome("ok", ok_result())).ok


def test_a_mismatch_fails_with_the_family_direction_and_kind():
    result = ok_result(status="mismatch", reports=["out0: MISMATCH"],
                       mismatches=[{"name": "out0", "kind": "value"}])
    verdict = judge(Outcome("ok", result), backward=True)
    assert not verdict.ok and verdict.signature == "mismatch/matmul/backward/value"
    verdict = judge(Outcome("ok", {**result, "offset_only": True}))
    assert verdict.signature == "mismatch/matmul/forward/input-storage-offset"


def test_crashes_timeouts_and_runtime_checks_fail_naming_the_phase():
    log = "@@ phase compile\n@@ family attention\n@@ phase run\nFatal Python error: Segmentation fault\n"
    verdict = judge(Outcome("crashed", error="killed by SIGSEGV"), log)
    assert not verdict.ok and verdict.signature == "crash/attention/run/SIGSEGV"
    log += '  File "/x/lighthouse/runtime.py", line 92 in call\n  File "/x/lighthouse/runtime.py", line 99 in __call__\n'
    verdict = judge(Outcome("crashed", error="killed by SIGSEGV"), log)
    assert verdict.signature == "crash/attention/run/SIGSEGV in runtime.call < runtime.__call__"
    llvm = ("@@ phase compile\n@@ family generic\nLLVM ERROR: Do not know how to soft promote this "
            "operator's operand!\nFatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
            "first):\n  File \"/x/lighthouse/targets/cpu.py\", line 102 in jit\n")
    verdict = judge(Outcome("crashed", error="killed by SIGABRT"), llvm)
    assert verdict.signature == ("crash/generic/compile/SIGABRT/LLVM ERROR: Do not know how to "
                                 "soft promote this operator's operand! in cpu.jit")
    assert verdict.detail.splitlines()[1:] == [
        "LLVM ERROR: Do not know how to soft promote this operator's operand!",
        'File "/x/lighthouse/targets/cpu.py", line 102 in jit']
    verdict = judge(Outcome("timeout", error="no result after 90 s"), "@@ phase compile\n")
    assert not verdict.ok and verdict.signature == "timeout/?/compile"
    log += ("ERROR: Runtime op verification failed\n"
            "%7 = vector.load %arg0[%3, %c0] : memref<4x8xf32>, vector<16xf32>\n"
            "^ out-of-bounds access\nLocation: loc(\"k.py\":3:4)\n")
    verdict = judge(Outcome("crashed", error="killed by SIGABRT"), log)
    assert verdict.signature == "runtime-check/attention/vector.load: out-of-bounds access"


def test_compiler_errors_fail_unless_honest_refusals():
    stage = {"status": "error", "phase": "compile", "type": "StageError", "honest": False,
             "message": f"{KERNEL}: stage 'vectorize' failed: 'NoneType' object is not iterable"}
    verdict = judge(Outcome("ok", stage))
    assert not verdict.ok
    assert verdict.signature == "StageError/compile/KERNEL: stage 'vectorize' failed: 'NoneType' object is not iterable"
    refusal = {**stage, "type": "IngressError", "honest": True,
               "message": f"{KERNEL}: torch-mlir cannot lower aten.foo to linalg"}
    assert judge(Outcome("ok", refusal)).ok
    rejected = {**refusal, "honest": False,
                "message": f"{KERNEL}: torch rejects the example inputs: IndexError: out of range"}
    assert judge(Outcome("ok", rejected)).signature.startswith("invalid-case/")
    exception = {"status": "exception", "phase": "compile", "type": "TypeError", "message": "x",
                 "where": "schedules/attention/cpu.py:key_major_scores", "traceback": ""}
    assert judge(Outcome("ok", exception)).signature == \
        "exception/compile/TypeError/schedules/attention/cpu.py:key_major_scores"


def test_a_note_that_a_schedule_crashed_and_fell_back_fails():
    note = "the matmul schedule failed on this payload (stage 'fuse': x); using the generic schedule"
    verdict = judge(Outcome("ok", ok_result(notes=[note])))
    assert not verdict.ok and verdict.signature.startswith("fallback/")
    harmless = "the matmul schedule does not apply (no contraction); using the generic schedule"
    assert judge(Outcome("ok", ok_result(notes=[harmless]))).ok


def test_failure_files_name_the_command_and_the_error(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "FAILURES", tmp_path)
    verdict = harness.Verdict(False, "mismatch/matmul/backward/value", "out0: MISMATCH", "matmul")
    path = harness.record_failure("matmul", "import torch\n", True, verdict, ["--schedule loops: check passed"])
    assert re.fullmatch(r"matmul_[0-9a-f]{10}\.py", path.name)
    text = path.read_text()
    assert re.search(rf"# reproduce: PYTHONPATH=\. python -m lighthouse\.compile \S*{path.name} "
                     r"--check --backward( --runtime-checks)?\n", text)
    assert "# signature: mismatch/matmul/backward/value\n# out0: MISMATCH\n# --schedule loops" in text
    assert text.endswith("import torch\n")


SOFTMAX = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)
def get_inputs():
    return [torch.randn(9, 5, 33).transpose(1, 2)]
def get_init_inputs():
    return []
"""


# torch 2.13's bf16 CPU matmul at this size puts NaN into row 120 too, whose inputs are finite
TORCH_BF16_NAN_LEAK = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a @ b
def get_inputs():
    a = torch.rand(129, 129, dtype=torch.bfloat16)
    a[121] = float("nan")
    return [a, torch.rand(129, 16, dtype=torch.bfloat16)]
def get_init_inputs():
    return []
"""


def test_a_mismatch_with_torch_that_matches_the_exact_result_is_not_a_failure():
    result = ok_result(status="mismatch", reports=["out0: MISMATCH"],
                       mismatches=[{"name": "out0", "kind": "nan"}], exact_agrees=True)
    verdict = judge(Outcome("ok", result))
    assert verdict.ok and "as close to the exact (float64) one" in verdict.events[-1]
    verdict, _ = harness.run(TORCH_BF16_NAN_LEAK, False, "harness_bf16_nan_leak")
    assert verdict.ok, verdict
    if _torch_leaks_the_nan():  # torch's bf16 matmul kernel depends on the CPU
        assert any("close to the exact" in e for e in verdict.events)


TORCH_F32_ONE_ELEMENT_LAYER_NORM = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm((1,), eps=1e-06)
    def forward(self, x):
        return self.norm(x * 2.25)
def get_inputs():
    return [torch.tensor([10.401723861694336])]
def get_init_inputs():
    return []
"""


def test_an_f32_result_that_torch_gets_wrong_is_judged_against_the_exact_one():
    """A layer norm over one element: x - mean(x) is 0, so the weight's gradient is exactly
    0; torch's eager backward gives -4e-4 (its rounding, times 1 / sqrt(eps)). Ours is the
    exact 0: not a failure."""
    torch_grad = _one_element_layer_norm_weight_grad()
    verdict, _ = harness.run(TORCH_F32_ONE_ELEMENT_LAYER_NORM, True, "harness_f32_layer_norm_1")
    assert verdict.ok, verdict
    if torch_grad != 0:
        assert any("close to the exact" in e for e in verdict.events)


def _one_element_layer_norm_weight_grad() -> float:
    norm = torch.nn.LayerNorm((1,), eps=1e-06)
    norm(torch.tensor([10.401723861694336]) * 2.25).sum().backward()
    return norm.weight.grad.item()


def _torch_leaks_the_nan() -> bool:
    """Does torch's bf16 a @ b here put NaN in rows other than the NaN row of a?"""
    a = torch.rand(129, 129, dtype=torch.bfloat16)
    a[121] = float("nan")
    out = a @ torch.rand(129, 16, dtype=torch.bfloat16)
    return bool(torch.isnan(torch.cat([out[:121], out[122:]])).any())


def test_a_real_case_runs_in_a_child_and_passes():
    verdict, log = harness.run(SOFTMAX, True, "harness_softmax")
    assert verdict.ok, verdict
    assert "@@ phase check" in log and "@@ family generic" in log


def _run_eagerly(source: str, tmp_path) -> None:
    path = tmp_path / "k.py"
    path.write_text(source)
    module = _import_file(path)
    torch.manual_seed(0)
    model = module.Model().eval()
    inputs = [t.detach() for t in module.get_inputs()]
    names = list(inspect.signature(model.forward).parameters)
    for name, t in zip(names, inputs):  # class weights cannot have a gradient in nll_loss
        t.requires_grad_(t.is_floating_point() and not name.startswith("weight"))
    out = model(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    if any(t.requires_grad for t in inputs) or any(p.requires_grad for p in model.parameters()):
        sum(o.float().sum() for o in outs).backward()


@pytest.mark.parametrize("strategy", [matmul_kernels, attention_kernels, cross_entropy_kernels,
                                      row_kernels, pooling_kernels], ids=lambda s: s.__name__)
def test_drawn_programs_are_valid_torch_programs(strategy, tmp_path):
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(source=strategy())
    def run(source):
        _run_eagerly(source, tmp_path)

    run()


def test_a_survey_runs_on_after_failures_and_keeps_the_smallest_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "FAILURES", tmp_path)
    monkeypatch.setattr(harness, "SURVEY", True)
    monkeypatch.setattr(harness, "_SURVEYED", {})
    seen = []

    monkeypatch.setattr(harness, "LOG", None)

    def failing_run(source, backward, name, schedule=None):
        seen.append(source)
        return harness.Verdict(False, "StageError/compile/stage 'fuse' failed", "x", "generic"), ""

    monkeypatch.setattr(harness, "run", failing_run)

    @harness.fuzz_test("fake")
    @given(source=st.sampled_from(["a longer kernel", "short", "a kernel"]), backward=st.just(False))
    def test_fake(source, backward):
        harness.check_kernel("fake", source, backward)

    with pytest.raises(harness.FuzzFailure, match=r"(?s)3 failing fake cases, 1 signatures:.*stage 'fuse'"):
        test_fake()
    assert sorted(set(seen)) == ["a kernel", "a longer kernel", "short"]
    (written,) = tmp_path.iterdir()
    assert written.read_text().endswith("\nshort")
