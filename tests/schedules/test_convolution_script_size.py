"""The convolution schedule's script stays linear in the size of the payload: a whole CNN's
ops are taken by place with one match and one split per op name."""

from lighthouse.compile import compile_kernel
from tests.schedules.test_convolution import assert_matches


DEEP = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.f = nn.Sequential(*[m for _ in range({layers}) for m in
                                 (nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())])

    def forward(self, x):
        return self.f(x)

def get_inputs():
    return [torch.rand(1, 8, 9, 20, generator=torch.Generator().manual_seed(1))]

def get_init_inputs():
    return []
"""


def test_the_vectorize_script_of_a_deep_network_splits_each_op_name_once(kernel_file, tmp_path):
    """A whole CNN's @vectorize takes its thousands of ops by place: one match and one split
    per op name, not a split of every op of the name per op (quadratic: ResNet-101's
    vectorize stage took 183 s). The network still matches torch."""
    path = kernel_file(DEEP.format(layers=6))
    compile_kernel(path, stop_after="vectorize", dump_dir=tmp_path)
    script = (tmp_path / "04-vectorize.transform.mlir").read_text()
    splits = [line for line in script.splitlines() if "transform.split_handle" in line]
    names = {line.split('ops{["')[1].split('"')[0] for line in script.splitlines()
             if "transform.structured.match ops" in line and "func.func" not in line
             and "scf.for" not in line}
    assert 0 < len(splits) <= len(names)
    assert_matches(compile_kernel(path))
