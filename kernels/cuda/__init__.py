"""CUDA backend: CuPy RawKernels (CUDA C in the .cu files here, compiled at run time by NVRTC and cached)
and Numba CUDA kernels. Importing this package imports neither cupy nor numba.cuda; `backend.py` does,
and only when the CUDA backend is asked for."""
