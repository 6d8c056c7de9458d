"""CudaKVCopier: KV pages between the device cache (cupy) and the host pool (numpy): the KVCopier protocol of
strata_lite/host_pool.py, with ArrayKVCopier's semantics.

Arrays come in the order (k_pages, k_scales, v_pages, v_scales), each (n_layers, n_pages, page_size,
n_kv_heads, head_dim | n_groups) (kernels/kv_layout.py); device and host have their own page counts. The
layer axis is outermost, so a run of r pages (consecutive on both sides) of one array is one 2-D copy:
n_layers rows of r * page bytes, with a pitch of n_pages * page bytes on each side.

The host pool is pageable numpy and is never pinned: copies go through a bounded pinned staging buffer, a
ring of slots, so the CPU fills or drains one slot while the copy engine moves another. The CPU side is the
bottleneck (numpy moves ~8 GB/s per thread, the copy engine ~53 GB/s on an H200), so it is shared over a
few threads (numpy releases the GIL while copying): ~15 GB/s with 4. The copies run on the copier's own
stream, ordered against the compute stream (CuPy's current stream at call time) by events:
- to host: the copier stream first waits for the work queued on the compute stream (the kernels that wrote
  the pages); the call returns when the host pool holds the data, so the device pages may be reused at once.
- to device: the copier stream also waits for the compute stream first (a queued kernel may still read the
  pages being overwritten); the compute stream then waits for the copies, so the next forward reads the
  restored pages. The call returns once the last piece is queued: the host pages are free at once.
copy_page_prefix is a device-to-device copy on the compute stream itself.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .runtime import cupy

H2D, D2H, D2D = 1, 2, 3      # cudaMemcpyKind
ALIGN = 256                  # staging offset of each piece: DMA-friendly, and aligned for any dtype view
SLOT_MAX = 8 << 20           # staging slot size: small enough that the first / last slot's DMA is short
PARALLEL_MIN = 2 << 20       # batches of fewer bytes are copied by the calling thread alone


class CudaKVCopier:
    def __init__(self, dev_arrays, host_arrays, staging_bytes: int = 64 << 20, threads: int = 4):
        cp = self.cp = cupy()
        self.dev, self.host = tuple(dev_arrays), tuple(host_arrays)
        if len(self.dev) != 4 or len(self.host) != 4:
            raise ValueError("expected (k_pages, k_scales, v_pages, v_scales) on each side")
        for d, h in zip(self.dev, self.host):
            if (d.ndim != 5 or h.ndim != 5 or d.dtype != h.dtype or d.shape[0] != h.shape[0]
                    or d.shape[2:] != h.shape[2:] or d.shape[:3] != self.dev[0].shape[:3]
                    or h.shape[:2] != self.host[0].shape[:2]
                    or not d.flags.c_contiguous or not h.flags.c_contiguous):
                raise ValueError(f"device {d.shape} {d.dtype} and host {h.shape} {h.dtype} KV arrays "
                                 "do not share one C-contiguous page layout")
        self.n_layers, self.n_dev, self.page_size = self.dev[0].shape[:3]
        self.n_host = self.host[0].shape[1]
        self.page_bytes = [int(np.prod(h.shape[2:])) * h.dtype.itemsize for h in self.host]   # one layer's
        self.slot = min(int(staging_bytes) // 2, SLOT_MAX) // ALIGN * ALIGN
        if self.slot < max(self.page_bytes):
            raise ValueError(f"staging_bytes={staging_bytes} is too small: half of it must hold one page "
                             f"of one layer ({max(self.page_bytes)} bytes)")
        self.n_slots = int(staging_bytes) // self.slot                            # >= 2
        self._pinned = cp.cuda.alloc_pinned_memory(self.n_slots * self.slot)
        self._stage = np.ndarray(self.n_slots * self.slot, np.uint8, buffer=self._pinned)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ready = cp.cuda.Event(disable_timing=True)                          # compute stream marker
        self._slot_done = [cp.cuda.Event(disable_timing=True) for _ in range(self.n_slots)]  # last DMA
        self.threads = max(1, int(threads))
        self._pool = ThreadPoolExecutor(self.threads - 1, "kv-copy") if self.threads > 1 else None
        self._pending = []           # (start, end) events of host -> device copies not yet timed
        self.to_host_s, self._to_device_s = 0.0, 0.0
        self.to_host_bytes = self.to_device_bytes = 0

    # ------------------------------------------------------------------ protocol
    def copy_pages_to_host(self, dev_pages, host_pages) -> None:
        """host page host_pages[i] := device page dev_pages[i], every layer and array; synchronous."""
        batches = self._batches(self._pieces(dev_pages, host_pages, self.n_dev, self.n_host))
        if not batches:
            return
        start, end = self._begin()
        for i, batch in enumerate(batches):         # slot i % n_slots was drained at iteration i - n_slots + 1
            for piece, off in batch:
                self._dma(piece, off, i % self.n_slots, D2H)
            self._slot_done[i % self.n_slots].record(self.stream)
            if i:                                   # the CPU drains batch i-1 while the DMA runs batch i
                self._drain(batches[i - 1], (i - 1) % self.n_slots)
        end.record(self.stream)
        self._drain(batches[-1], (len(batches) - 1) % self.n_slots)
        end.synchronize()
        self.to_host_s += self.cp.cuda.get_elapsed_time(start, end) / 1e3
        self.to_host_bytes += self._nbytes(batches)

    def copy_pages_to_device(self, host_pages, dev_pages) -> None:
        """device page dev_pages[i] := host page host_pages[i]; later work on the compute stream sees it."""
        batches = self._batches(self._pieces(host_pages, dev_pages, self.n_host, self.n_dev))
        if not batches:
            return
        self._settle(wait=False)
        start, end = self._begin()
        for i, batch in enumerate(batches):
            slot = i % self.n_slots
            self._slot_done[slot].synchronize()     # the DMA out of this slot (an earlier batch or call) is over
            self._host_copy([(self._staged(p, off, slot), self._pool_rows(p, p[3])) for p, off in batch])
            for piece, off in batch:
                self._dma(piece, off, slot, H2D)
            self._slot_done[slot].record(self.stream)
        end.record(self.stream)
        self.cp.cuda.get_current_stream().wait_event(end)
        self._pending.append((start, end))
        self.to_device_bytes += self._nbytes(batches)

    def copy_page_prefix(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        """The first n_tokens slots of device page dst_page := those of src_page, on the compute stream."""
        src_page, dst_page, n_tokens = int(src_page), int(dst_page), int(n_tokens)
        if not (0 <= src_page < self.n_dev and 0 <= dst_page < self.n_dev and 0 <= n_tokens <= self.page_size):
            raise ValueError(f"copy_page_prefix({src_page}, {dst_page}, {n_tokens}) out of range "
                             f"({self.n_dev} pages of {self.page_size} tokens)")
        if n_tokens == 0 or src_page == dst_page:
            return
        stream = self.cp.cuda.get_current_stream().ptr
        for d, pb in zip(self.dev, self.page_bytes):
            pitch, base = self.n_dev * pb, d.data.ptr
            self.cp.cuda.runtime.memcpy2DAsync(base + dst_page * pb, pitch, base + src_page * pb, pitch,
                                               n_tokens * (pb // self.page_size), self.n_layers, D2D, stream)

    # ------------------------------------------------------------------ timings
    @property
    def to_device_s(self) -> float:
        """Seconds of host -> device copies so far (waits for those still in flight: a few slots at most)."""
        self._settle(wait=True)
        return self._to_device_s

    restore_s = to_device_s      # the name the engine's "restored ... in s" log line reads

    def _settle(self, wait: bool) -> None:
        """Add the times of the finished host -> device copies (of all, waiting, when wait)."""
        pending, self._pending = self._pending, []
        for start, end in pending:
            if wait or end.done:
                end.synchronize()
                self._to_device_s += self.cp.cuda.get_elapsed_time(start, end) / 1e3
            else:
                self._pending.append((start, end))

    # ------------------------------------------------------------------ pieces
    def _pieces(self, src, dst, n_src: int, n_dst: int):
        """[(array, layer0, n_layers, src page0, dst page0, n_pages)]: one per run of pages consecutive on
        both sides and per array, cut so that each fits in a staging slot."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
        pairs = sorted(zip(map(int, src), map(int, dst)))
        if pairs and not (0 <= pairs[0][0] and pairs[-1][0] < n_src
                          and 0 <= min(d for _, d in pairs) and max(d for _, d in pairs) < n_dst):
            raise ValueError(f"page ids out of range ({n_src} source, {n_dst} destination pages)")
        runs = []                                   # [src page0, dst page0, n_pages]
        for s, d in pairs:
            if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        L, out = self.n_layers, []
        for a, pb in enumerate(self.page_bytes):
            per = max(1, self.slot // (L * pb))     # pages per piece over all layers
            for s, d, r in runs:
                for p in range(0, r, per):
                    n = min(per, r - p)
                    nl = min(L, self.slot // (n * pb))  # all layers, unless one page of all is too big
                    out.extend((a, l0, min(nl, L - l0), s + p, d + p, n) for l0 in range(0, L, nl))
        return out

    def _batches(self, pieces):
        """Pieces packed into batches that each fit in a staging slot: [[(piece, offset)]]."""
        out, off = [], self.slot
        for piece in pieces:
            nb = piece[2] * piece[5] * self.page_bytes[piece[0]]
            if off + nb > self.slot:
                out.append([])
                off = 0
            out[-1].append((piece, off))
            off += -(-nb // ALIGN) * ALIGN
        return out

    def _nbytes(self, batches) -> int:
        return sum(p[2] * p[5] * self.page_bytes[p[0]] for b in batches for p, _ in b)

    def _begin(self):
        """Order the copier stream after the work queued on the compute stream; -> (start, end) events."""
        self._ready.record(self.cp.cuda.get_current_stream())
        self.stream.wait_event(self._ready)
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record(self.stream)
        return start, end

    def _dma(self, piece, off: int, slot: int, kind: int) -> None:
        """One 2-D copy between a piece's device pages and its staging bytes, on the copier stream."""
        a, l0, nl, s, d, n = piece
        pb = self.page_bytes[a]
        dev = self.dev[a].data.ptr + (l0 * self.n_dev + (s if kind == D2H else d)) * pb
        stage = self._pinned.ptr + slot * self.slot + off
        dst, dpitch, src, spitch = ((stage, n * pb, dev, self.n_dev * pb) if kind == D2H
                                    else (dev, self.n_dev * pb, stage, n * pb))
        self.cp.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, n * pb, nl, kind, self.stream.ptr)

    def _staged(self, piece, off: int, slot: int):
        """A piece's staging bytes as (n_layers, n_pages, page_size, n_kv_heads, X) of its array's dtype."""
        a, _, nl, _, _, n = piece
        h, at = self.host[a], slot * self.slot + off
        return self._stage[at:at + nl * n * self.page_bytes[a]].view(h.dtype).reshape((nl, n) + h.shape[2:])

    def _pool_rows(self, piece, page: int):
        """A piece's pages in the host pool, from page `page`: (n_layers, n_pages, ...) numpy view."""
        a, l0, nl, _, _, n = piece
        return self.host[a][l0:l0 + nl, page:page + n]

    def _drain(self, batch, slot: int) -> None:
        """Host pool := a batch's staged pages, once its DMA is over."""
        self._slot_done[slot].synchronize()
        self._host_copy([(self._pool_rows(p, p[4]), self._staged(p, off, slot)) for p, off in batch])

    def _host_copy(self, pairs) -> None:
        """np.copyto(dst, src) for (n_layers, n_pages, ...) pairs. A large batch is cut along the layer axis
        into one share of about equal bytes per thread (the calling thread takes the first); few, large
        np.copyto calls, since each takes the GIL to start."""
        total = sum(src.nbytes for _, src in pairs)
        if self._pool is None or total < PARALLEL_MIN:
            _copy_all(pairs)
            return
        share = total / self.threads
        shares, budget = [[]], share                    # budget: bytes still to give the last share
        for dst, src in pairs:
            row, l = src.nbytes // src.shape[0], 0
            while l < src.shape[0]:
                if budget <= 0:
                    shares.append([])
                    budget += share
                k = min(src.shape[0] - l, max(1, -(-int(budget) // row)))
                shares[-1].append((dst[l:l + k], src[l:l + k]))
                budget -= k * row
                l += k
        futures = [self._pool.submit(_copy_all, sh) for sh in shares[1:]]
        _copy_all(shares[0])
        for f in futures:
            f.result()


def _copy_all(pairs) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)
