"""Fused cross-entropy and log-softmax (see fuse.py for the schedule): recognition, the
plan, the fuse stage and the CPU vectorize stage as one transform script (fuse.py); the
XeGPU lowering of the loss is xegpu.py."""

from .fuse import (CrossEntropyOps, CrossEntropyParams, CrossEntropyPlan, NotCrossEntropy,
                   check, cross_entropy_script, find_cross_entropy, name_target_checks,
                   plan_cross_entropy, recognize)

__all__ = ["CrossEntropyOps", "CrossEntropyParams", "CrossEntropyPlan", "NotCrossEntropy",
           "check", "cross_entropy_script", "find_cross_entropy", "name_target_checks",
           "plan_cross_entropy", "recognize"]
