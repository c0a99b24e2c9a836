"""Flash attention (see fuse.py for the schedule): recognition (recognize.py), the fuse
stage for every target (fuse.py), the CPU vectorize stage (cpu.py), both as one transform
script (script.py); the XeGPU tail is xegpu.py."""

from transform_ext.analysis.attention import AttentionOps, NotAttention

from .fuse import AttentionParams, AttentionPlan, check, plan_attention
from .recognize import causal_offset, find_attention, recognize
from .script import attention_script

__all__ = ["AttentionOps", "AttentionParams", "AttentionPlan", "NotAttention", "attention_script",
           "causal_offset", "check", "find_attention", "plan_attention", "recognize"]
