"""Hypothesis strategies of kernel programs, one module per family; each draws a complete
kernel file (its source text) through `writer.KernelWriter`."""
