"""Imported once by the benchmark fork server (see `isolate`): the modules every child
needs, and the caches torch.export and torch-mlir fill on their first import of a graph
(pure-Python tables: no threads are started, so forking afterwards is safe). This saves each
child about a second and a half, and torch.compile's modules (dynamo, inductor) another
half second."""

import torch
import torch._dynamo
import torch._export.utils
import torch._inductor.compile_fx
import torch._functorch.aot_autograd
import torch.export
import torch.export._trace
import torch.fx.experimental.proxy_tensor
import torch.utils.flop_counter
import torch_mlir.execution_engine
import torch_mlir.extras.fx_decomp_util
import torch_mlir.fx

import lighthouse.compile
import lighthouse.runtime
import lighthouse.targets.cpu
from lighthouse.benchmarks import limits, measure

_collect_cia_ops = getattr(torch._export.utils, "_collect_all_valid_cia_ops", None)
if _collect_cia_ops is not None:
    _collect_cia_ops()
torch_mlir.extras.fx_decomp_util.get_decomposition_table()
torch._decomp.core_aten_decompositions()

__all__ = ["torch", "limits", "measure", "lighthouse"]
