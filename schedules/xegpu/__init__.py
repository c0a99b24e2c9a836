"""The XeGPU schedules shared by the families: the tail every kernel goes through
(common.py: GPU preparation, vectorize, bufferize, outline, convert-vector-to-xegpu, loop
prefetches), contraction kernels (contraction.py) and row kernels (rows.py). A family's own
XeGPU variant lives with the family (attention/xegpu.py); the cross-entropy loss's is
cross_entropy/xegpu.py."""
