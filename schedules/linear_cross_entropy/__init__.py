"""Fused linear cross-entropy (see fuse.py for the schedule): recognition (recognize.py), the
parameters and the plan's dataclasses (params.py), the plan the check and the script share
(plan.py), the fuse stage (fuse.py), the CPU vectorize stage (cpu.py), both as one
transform script (script.py); the XeGPU kernels of the forward (xegpu.py)."""

from .params import LinearCrossEntropyParams, LinearCrossEntropyPlan
from .plan import check, plan_linear_cross_entropy
from .recognize import NotLinearCrossEntropy, recognize
from .script import linear_cross_entropy_script

__all__ = ["LinearCrossEntropyParams", "LinearCrossEntropyPlan", "NotLinearCrossEntropy",
           "check", "linear_cross_entropy_script", "plan_linear_cross_entropy", "recognize"]
