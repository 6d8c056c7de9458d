"""Makes q5_0_imatrix_fixture.npz: 24 rows x 512 (gaussian rows of assorted scales, an all-zero row and
block, values on a coarse grid, one-signed rows, heavy-tailed columns), an importance vector, and
llama.cpp's Q5_0 bytes of them with and without it (ggml_quantize_chunk of the libggml-base bundled with
llama-cpp-python 0.3.36, ggml 0.25.3). Not run by the tests; needs llama-cpp-python.

    python tests/data/make_q5_0_fixture.py
"""
import ctypes, os, numpy as np, llama_cpp
d = os.path.join(os.path.dirname(llama_cpp.__file__), 'lib')
lib = ctypes.CDLL(os.path.join(d, 'libggml-base.so'))
lib.ggml_quantize_chunk.restype = ctypes.c_size_t
lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lib.ggml_quantize_init.argtypes = [ctypes.c_int]
Q5_0 = 6
lib.ggml_quantize_init(Q5_0)
rng = np.random.default_rng(2026)
n_rows, n_cols = 24, 512
x = (rng.standard_normal((n_rows, n_cols)) * rng.uniform(0.01, 2, (n_rows, 1))).astype(np.float32)
x[1] = 0; x[2, :32] = 0
x[3] = np.round(x[3] * 8) / 8
x[4] = np.abs(x[4]); x[5] = -np.abs(x[5])
x[6] *= np.exp(rng.standard_normal(n_cols)).astype(np.float32)
im = np.exp(rng.standard_normal(n_cols) * 1.5).astype(np.float32)
out = np.zeros((n_rows, n_cols // 32 * 22), np.uint8)
n = lib.ggml_quantize_chunk(Q5_0, x.ctypes.data, out.ctypes.data, 0, n_rows, n_cols, im.ctypes.data)
assert n == out.nbytes
ref = np.zeros_like(out)
lib.ggml_quantize_chunk(Q5_0, x.ctypes.data, ref.ctypes.data, 0, n_rows, n_cols, None)
np.savez_compressed(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'q5_0_imatrix_fixture.npz'), rows=x, imatrix=im, q5_0_imatrix=out, q5_0_ref=ref)
