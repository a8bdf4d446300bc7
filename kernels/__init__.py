"""JIT-compiled kernels shipped inside cupool (installed as ``cupool.kernels``)."""
