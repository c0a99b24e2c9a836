"""The fuzz families' kernels through torch.compile(backend="lighthouse") (FUZZ_ROUTE=
torch.compile: tests/fuzz/child.py `_run_case_compiled`): graphs split into parts, each
compiled by its family, against eager torch, forward and backward. A few cases per family
here; `FUZZ_ROUTE=torch.compile make fuzz` runs every family's campaign this way."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.attention import attention_kernels
from .programs.cross_entropy import cross_entropy_kernels
from .programs.linear_cross_entropy import linear_cross_entropy_kernels
from .programs.matmul import matmul_kernels
from .programs.rows import row_kernels

CASES = {"ci": 4, "fuzz": 100}


@pytest.fixture(autouse=True)
def route(monkeypatch):
    monkeypatch.setenv("FUZZ_ROUTE", "torch.compile")


def _routed(family, strategy):
    @fuzz_test(f"{family}_route", examples=CASES)
    @given(source=strategy, backward=st.booleans())
    def test(source, backward):
        check_kernel(f"{family}_route", source, backward)

    return test


test_attention_through_torch_compile = _routed("attention", attention_kernels())
test_cross_entropy_through_torch_compile = _routed("cross_entropy", cross_entropy_kernels())
test_linear_cross_entropy_through_torch_compile = _routed(
    "linear_cross_entropy", linear_cross_entropy_kernels())
test_matmul_through_torch_compile = _routed("matmul", matmul_kernels())
test_rows_through_torch_compile = _routed("rows", row_kernels())
