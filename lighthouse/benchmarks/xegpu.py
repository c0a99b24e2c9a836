"""`python -m lighthouse.bench --target xegpu`: no Intel GPU runs here, so the XeGPU kernels
are measured statically: each case compiled through the native stage (ocloc) for each chip,
and per kernel the machine code's GRF mode, spills, DPAS and 2-D block IO with the static
estimate against the chip's peak (lighthouse/targets/estimate.py), beside the anchor: upstream
lighthouse's fused attention at 101.9 TFLOP/s on a Max 1100 for f16 [2, 8, 4096, 64], the
`attention_f16_anchor` case on pvc.

Sizes: the torch reference that the import runs on this CPU bounds them (an f16 matmul of
2048^3 takes a minute on the host).
"""

from __future__ import annotations

from ..targets.estimate import REPORT_COLUMNS
from .suite import EXAMPLES, Case, _attention

COLUMNS = ("case", "chip") + REPORT_COLUMNS


def xegpu_suite() -> list[Case]:
    """The XeGPU kernels at realistic sizes: 16-bit contractions and attention forward and
    forward+backward (DPAS), the row kernels and the losses (the LM head's fused linear
    cross-entropy forward, and forward+backward, by DPAS)."""
    def attention(name, causal, dtype, backward=False):
        case = _attention(name, 4096, causal, backward=backward)
        case.overrides.update(B=2, DTYPE=dtype)
        return case

    mlp = dict(BATCH=512, IN_FEATURES=1024, HIDDEN=4096, OUT_FEATURES=1024)
    return [
        Case("matmul_f16_1024", EXAMPLES / "matmul_f16.py", dict(M=1024, N=1024, K=1024)),
        Case("mlp_f16", EXAMPLES / "mlp_f16.py", mlp),
        Case("softmax", EXAMPLES / "softmax.py", dict(N=4096, C=4096)),
        Case("log_softmax", EXAMPLES / "log_softmax.py", dict(N=4096, C=4096)),
        attention("attention_f16_anchor", False, "float16"),
        attention("attention_f16_causal", True, "float16"),
        attention("attention_bf16", False, "bfloat16"),
        attention("attention_bf16_causal", True, "bfloat16"),
        attention("attention_f16_bwd", False, "float16", backward=True),
        attention("attention_bf16_causal_bwd", True, "bfloat16", backward=True),
        Case("cross_entropy_bf16", EXAMPLES / "cross_entropy.py",
             dict(N=4096, C=32000, DTYPE="bfloat16")),
        Case("cross_entropy_bf16_bwd", EXAMPLES / "cross_entropy.py",
             dict(N=4096, C=32000, DTYPE="bfloat16"), backward=True),
        Case("linear_cross_entropy_bf16", EXAMPLES / "linear_cross_entropy.py",
             dict(N=2048, D=1024, V=32000, DTYPE="bfloat16")),
        Case("linear_cross_entropy_f16", EXAMPLES / "linear_cross_entropy.py",
             dict(N=2048, D=1024, V=32000, DTYPE="float16")),
        # the backward's passes: a subgroup's f32 accumulator over the whole depth in
        # registers (D 64), or in memory updated per D slice (D 1024, 4096)
        Case("linear_cross_entropy_bf16_d64_bwd", EXAMPLES / "linear_cross_entropy.py",
             dict(N=2048, D=64, V=32000, DTYPE="bfloat16"), backward=True),
        Case("linear_cross_entropy_bf16_d1024_bwd", EXAMPLES / "linear_cross_entropy.py",
             dict(N=2048, D=1024, V=32000, DTYPE="bfloat16"), backward=True),
        Case("linear_cross_entropy_bf16_d4096_bwd", EXAMPLES / "linear_cross_entropy.py",
             dict(N=2048, D=4096, V=32000, DTYPE="bfloat16"), backward=True),
        Case("linear_cross_entropy_bf16_d64_bias_weights_bwd",
             EXAMPLES / "linear_cross_entropy.py",
             dict(N=2048, D=64, V=32000, DTYPE="bfloat16", BIAS=True, CLASS_WEIGHTS=True),
             backward=True),
    ]


def quick_xegpu_suite() -> list[Case]:
    def attention(name, causal, backward=False):
        case = _attention(name, 256, causal, h=2, backward=backward)
        case.overrides["DTYPE"] = "float16"
        return case

    return [
        Case("matmul_f16", EXAMPLES / "matmul_f16.py", dict(M=128, N=256, K=128)),
        Case("softmax", EXAMPLES / "softmax.py", dict(N=64, C=1024)),
        attention("attention_f16", False),
        attention("attention_f16_causal", True),
        attention("attention_f16_bwd", False, backward=True),
        Case("cross_entropy", EXAMPLES / "cross_entropy.py", dict(N=64, C=4000)),
        Case("linear_cross_entropy", EXAMPLES / "linear_cross_entropy.py",
             dict(N=128, D=64, V=256, DTYPE="bfloat16")),
        Case("linear_cross_entropy_bwd", EXAMPLES / "linear_cross_entropy.py",
             dict(N=128, D=64, V=256, DTYPE="bfloat16"), backward=True),
    ]


def native_rows(case: Case, chip: str) -> list[tuple]:
    """Compile `case` for `chip` through the native stage: a row per kernel (COLUMNS).
    Runs in a child process (benchmarks.isolate)."""
    from ..compile import compile_kernel
    from ..targets.estimate import report_rows

    compiled = compile_kernel(case.path, overrides=case.overrides, backward=case.backward,
                              target="xegpu", target_options={"chip": chip})
    return [(case.name, chip) + row for row in report_rows(compiled.target.kernels,
                                                            compiled.target.chip)]


def table(rows: list[tuple]) -> str:
    """The rows under COLUMNS, then the anchor."""
    from ..targets.estimate import format_table

    return format_table(COLUMNS, rows, left=4)
