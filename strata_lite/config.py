"""EngineConfig: how the engine thread serves many requests (slots, KV capacity, step budget, queue)."""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

from .spec.controller import parse_spec

log = logging.getLogger("strata_lite")

HOST_KV_FRACTION = 0.25      # default host pool: this share of the RAM available when the engine starts


PROMPT_ATTENTION = ("exact", "f16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None          # path or known model key; None = default model
    backend: str = "auto"
    n_ctx: int = 8192                 # max tokens per sequence (prompt + generated)
    parallel: int = 2                 # slots: max concurrently running sequences
    kv_tokens: int | None = None      # device KV capacity in tokens; default n_ctx * parallel
    step_tokens: int = 256            # prompt-token budget per engine step (decodes always run)
    decode_share: float | None = 0.8  # while prompts are read, decoding sequences keep this share of their
                                      # decode-only speed (a time budget on reads); None/0 = token budget only
    host_kv_gib: float | None = None  # host pool limit; default: 25% of available RAM at start
    max_queue: int = 64               # waiting requests beyond this -> QueueFull
    threads: int | None = None
    vram_reserve_mib: int = 1024      # CUDA: GPU memory left free when planning weights, KV and workspaces
    page_size: int = 64
    stuck_step_s: float = 60.0        # /health: a step running longer than max(this, 100x the median step) is stuck
    spec: str | int = "auto"          # speculative decoding: "auto" | "off" | "suffix" | "mtp" | N | "mtp:N"
                                      # (docs/speculative.md)
    mtp: str | None = None            # sidecar GGUF with the model's MTP block; None: the model file's own, or
                                      # the default model's shipped one (spec/mtp_drafter.py mtp_source)
    kv_disk: str | None = None        # directory of the disk KV tier (kv_disk.py); None = no disk tier
    kv_disk_gib: float = 20.0         # its size limit
    prompt_attention: str = "exact"   # CUDA: "exact" (prompt tokens get the decode kernels' bits) or "f16" (prompt
                                      # chunks through a flash attention over an f16 copy of the keys: docs/cuda.md)

    def __post_init__(self):
        for name in ("n_ctx", "parallel", "step_tokens", "page_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.n_ctx < 2:
            raise ValueError("n_ctx must be >= 2 (a prompt token and a generated one)")
        if self.decode_share is not None and not 0.0 <= self.decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {self.decode_share!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue!r}")
        if self.kv_tokens is not None and self.kv_tokens < self.n_ctx:
            raise ValueError(f"kv_tokens ({self.kv_tokens}) must hold one full sequence (n_ctx = {self.n_ctx})")
        if self.host_kv_gib is not None and self.host_kv_gib < 0:
            raise ValueError(f"host_kv_gib must be >= 0, got {self.host_kv_gib!r}")
        if self.vram_reserve_mib < 0:
            raise ValueError(f"vram_reserve_mib must be >= 0, got {self.vram_reserve_mib!r}")
        if not self.stuck_step_s > 0:
            raise ValueError(f"stuck_step_s must be > 0, got {self.stuck_step_s!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        object.__setattr__(self, "spec", parse_spec(self.spec))
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, got {self.prompt_attention!r}")
        if not self.kv_disk_gib > 0:
            raise ValueError(f"kv_disk_gib must be > 0, got {self.kv_disk_gib!r}")

    @property
    def device_kv_tokens(self) -> int:
        """Device KV capacity in tokens, rounded up to whole pages."""
        n = self.kv_tokens if self.kv_tokens is not None else self.n_ctx * self.parallel
        return -(-n // self.page_size) * self.page_size

    def host_kv_bytes(self) -> int:
        """The host pool limit: host_kv_gib, or HOST_KV_FRACTION of the RAM available now. The pool's
        memory is only touched as pages are parked, so the limit costs nothing until it is used."""
        if self.host_kv_gib is not None:
            return int(self.host_kv_gib * 2**30)
        available = available_ram_bytes()
        if available == 0:
            log.warning("the available RAM could not be read on this platform (%s), so the host KV pool gets "
                        "0 bytes and KV evicted from the device is dropped instead of parked; set its size with "
                        "--host-kv-gib", sys.platform)
        return int(HOST_KV_FRACTION * available)


def available_ram_bytes() -> int:
    """RAM a new allocation can get now, in bytes: ullAvailPhys of GlobalMemoryStatusEx (Windows),
    MemAvailable from /proc/meminfo (Linux), else free physical pages (sysconf); 0 if unknown."""
    if sys.platform == "win32":
        return _windows_available_ram()
    return _meminfo_available() or _sysconf_available()


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _sysconf_available() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class MemoryStatusEx(ctypes.Structure):
    """Win32 MEMORYSTATUSEX: two DWORDs then seven DWORDLONGs, 64 bytes; dwLength must be set before the call."""
    _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32),
                ("ullTotalPhys", ctypes.c_uint64), ("ullAvailPhys", ctypes.c_uint64),
                ("ullTotalPageFile", ctypes.c_uint64), ("ullAvailPageFile", ctypes.c_uint64),
                ("ullTotalVirtual", ctypes.c_uint64), ("ullAvailVirtual", ctypes.c_uint64),
                ("ullAvailExtendedVirtual", ctypes.c_uint64)]


def _windows_available_ram() -> int:
    """kernel32.GlobalMemoryStatusEx's ullAvailPhys (the physical memory free or reclaimable now); 0 if the
    call fails or ctypes has no windll."""
    status = MemoryStatusEx()
    status.dwLength = ctypes.sizeof(MemoryStatusEx)
    try:
        ok = ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))
    except (AttributeError, OSError):
        return 0
    return int(status.ullAvailPhys) if ok else 0
