"""KVCache: int8 K/V pages with float32 scales per group of channels (kernels/kv_layout.py), and a free-page list.

Layout per array: (n_layers, n_pages, page_size, n_kv_heads, head_dim) int8 and
(n_layers, n_pages, page_size, n_kv_heads, n_groups) float32 scales. A sequence owns a list of pages;
position p of it lives in page pages[p // page_size], slot p % page_size.
"""
from __future__ import annotations


class KVCacheFull(RuntimeError):
    """No free pages left."""


class KVCache:
    def __init__(self, backend, n_layers: int, n_kv_heads: int, head_dim: int, n_pages: int, page_size: int = 64):
        self.backend, self.n_pages, self.page_size = backend, n_pages, page_size
        self.k_pages, self.k_scales, self.v_pages, self.v_scales = backend.kv_arrays(
            n_layers, n_pages, page_size, n_kv_heads, head_dim)
        self._free = list(range(n_pages - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"need {n} KV pages, {len(self._free)} free of {self.n_pages}")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages) -> None:
        self._free.extend(reversed(list(pages)))

    def layer(self, i: int):
        """(k_pages, k_scales, v_pages, v_scales) of layer i."""
        return self.k_pages[i], self.k_scales[i], self.v_pages[i], self.v_scales[i]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.k_pages, self.k_scales, self.v_pages, self.v_scales))
