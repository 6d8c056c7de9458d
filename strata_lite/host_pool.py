"""HostPool: KV pages parked in host RAM, same per-page layout as the device KVCache, under a byte limit.

The scheduler never touches KV arrays: it moves pages through a KVCopier, which the model runner
implements (ArrayKVCopier below does it with the backend's to_host/from_host). Copies are ordered
before the next forward pass (the runner issues them on the compute stream or synchronously), so a
device page freed after copy_pages_to_host may be overwritten by the very next step.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from .kernels.kv_layout import kv_bytes_per_token, kv_shapes


class KVCopier(Protocol):
    def copy_pages_to_host(self, dev_pages: list[int], host_pages: list[int]) -> None:
        """host page host_pages[i] := device page dev_pages[i], every layer, K, V and scales."""

    def copy_pages_to_device(self, host_pages: list[int], dev_pages: list[int]) -> None:
        """device page dev_pages[i] := host page host_pages[i]."""

    def copy_page_prefix(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        """The first n_tokens slots of device page dst_page := those of src_page (copy-on-write)."""


class HostPool:
    """Page ids 0..n_pages-1 over numpy arrays in the device cache's layout (kernels/kv_layout.py: int8
    pages + per-group float32 scales); n_pages = max_bytes // bytes per page. np.zeros leaves the
    memory untouched until pages are written, so a large limit costs nothing until used."""

    def __init__(self, n_layers: int, page_size: int, n_kv_heads: int, head_dim: int, max_bytes: int):
        self.page_size = page_size
        self.page_bytes = page_size * kv_bytes_per_token(n_layers, n_kv_heads, head_dim)
        self.n_pages = max(0, int(max_bytes) // self.page_bytes)
        pages, scales = kv_shapes(n_layers, self.n_pages, page_size, n_kv_heads, head_dim)
        self.k_pages, self.v_pages = np.zeros(pages, np.int8), np.zeros(pages, np.int8)
        self.k_scales, self.v_scales = np.zeros(scales, np.float32), np.zeros(scales, np.float32)
        self._free = list(range(self.n_pages - 1, -1, -1))

    @classmethod
    def like(cls, kv, max_bytes: int) -> "HostPool":
        """A pool with the page layout of KVCache `kv`."""
        n_layers, _, page_size, n_kv_heads, head_dim = kv.k_pages.shape
        return cls(n_layers, page_size, n_kv_heads, head_dim, max_bytes)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n page ids, or None when fewer than n are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages) -> None:
        self._free.extend(reversed(list(pages)))

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.page_bytes

    def arrays(self):
        return self.k_pages, self.k_scales, self.v_pages, self.v_scales


class ArrayKVCopier:
    """KVCopier over a KVCache and a HostPool through backend.to_host / from_host (numpy or cupy)."""

    def __init__(self, kv, host: HostPool, backend=None):
        self.kv, self.host = kv, host
        self.backend = backend if backend is not None else kv.backend

    def _dev(self):
        return self.kv.k_pages, self.kv.k_scales, self.kv.v_pages, self.kv.v_scales

    def copy_pages_to_host(self, dev_pages, host_pages) -> None:
        if not len(dev_pages):
            return
        src_idx = self.backend.from_host(np.asarray(dev_pages, np.int64))
        dst_idx = np.asarray(host_pages, np.int64)
        for dev, host in zip(self._dev(), self.host.arrays()):
            host[:, dst_idx] = self.backend.to_host(dev[:, src_idx])

    def copy_pages_to_device(self, host_pages, dev_pages) -> None:
        if not len(dev_pages):
            return
        src_idx = np.asarray(host_pages, np.int64)
        dst_idx = self.backend.from_host(np.asarray(dev_pages, np.int64))
        for dev, host in zip(self._dev(), self.host.arrays()):
            dev[:, dst_idx] = self.backend.from_host(host[:, src_idx])

    def copy_page_prefix(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        for dev in self._dev():
            dev[:, dst_page, :n_tokens] = dev[:, src_page, :n_tokens]
