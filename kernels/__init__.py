"""strata_lite.kernels: Backend implementations (cpu: Numba; cuda: CuPy + Numba CUDA).

Nothing here imports from the engine or the server."""
