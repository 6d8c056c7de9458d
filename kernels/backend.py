"""The one interface the model code computes through; CpuBackend and (later) CudaBackend implement it.

Weight matrices are passed as objects with `qtype`, `raw` (uint8 block rows), `n_out`, `n_in`
(the loader's QuantTensor), so kernels never import the loader. Arrays are the backend's own
(numpy here, cupy for CUDA); the model never touches them with anything but these methods.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class Backend(ABC):
    name: str

    # memory
    @abstractmethod
    def empty(self, shape, dtype="float32"): ...
    @abstractmethod
    def to_host(self, arr): ...
    @abstractmethod
    def from_host(self, arr): ...
    @abstractmethod
    def upload_weight(self, w):
        """Make a weight matrix (QuantTensor) usable by this backend; returns what `qmatmul` takes."""

    @abstractmethod
    def fuse_rows(self, weights):
        """One weight holding the rows of `weights` in order (for matrices that read the same input),
        or None when they cannot share one kernel."""

    # compute (outputs are returned newly allocated unless `out` is given)
    @abstractmethod
    def embed(self, w, token_ids):
        """(n,) int32 ids -> (n, n_in) float32 rows of the embedding matrix."""
    @abstractmethod
    def qmatmul(self, w, x, out=None):
        """x (n, w.n_in) float32 -> (n, w.n_out) = x @ W.T."""
    @abstractmethod
    def rmsnorm(self, x, weight, eps: float, out=None): ...
    @abstractmethod
    def rope(self, x, positions, freq_base: float, n_rot: int, neox: bool) -> None:
        """In place on x (n, n_heads, head_dim)."""
    @abstractmethod
    def silu_mul(self, gate, up, out=None): ...
    @abstractmethod
    def add(self, a, b, out=None):
        """a + b; b may be a bias vector broadcast over rows."""
    @abstractmethod
    def mul(self, a, b, out=None):
        """a * b with numpy broadcasting (per-channel factors over rows)."""
    @abstractmethod
    def take_rows(self, x, rows): ...
    @abstractmethod
    def split_cols(self, x, widths):
        """(n, sum(widths)) -> contiguous (n, w) pieces, in order."""

    # KV cache: arrays per layer, layout kv_layout.py (int8 pages + per-group float32 scales)
    @abstractmethod
    def kv_arrays(self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int):
        """-> (k_pages, k_scales, v_pages, v_scales) with a leading layer axis."""
    @abstractmethod
    def kv_store(self, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales) -> None: ...
    @abstractmethod
    def attention(self, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                  scale: float, out=None): ...
