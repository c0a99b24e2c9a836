"""Fused cross-entropy and log-softmax (see fuse.py for the schedule): recognition
(recognize.py), the parameters and the plan's dataclasses (params.py), the plan the check
and the script share (plan.py), the fuse stage for every target (fuse.py), the CPU
vectorize stage (cpu.py), both as one transform script (script.py); the XeGPU lowering of
the loss is xegpu.py."""

from .fuse import name_target_checks
from .params import CrossEntropyParams, CrossEntropyPlan
from .plan import check, plan_cross_entropy
from .recognize import CrossEntropyOps, NotCrossEntropy, find_cross_entropy, recognize
from .script import cross_entropy_script

__all__ = ["CrossEntropyOps", "CrossEntropyParams", "CrossEntropyPlan", "NotCrossEntropy",
           "check", "cross_entropy_script", "find_cross_entropy", "name_target_checks",
           "plan_cross_entropy", "recognize"]
