"""Flash attention (see fuse.py for the schedule): recognition (recognize.py), the fuse
stage for every target (fuse.py) and the CPU vectorize stage (cpu.py); the XeGPU tail is
schedules/xegpu_attention.py."""

from transform_ext.analysis.attention import AttentionOps, NotAttention

from .cpu import vectorize_attention
from .fuse import AttentionParams, check, fuse_attention
from .recognize import causal_offset, find_attention, recognize

__all__ = ["AttentionOps", "AttentionParams", "NotAttention", "causal_offset", "check",
           "find_attention", "fuse_attention", "recognize", "vectorize_attention"]
