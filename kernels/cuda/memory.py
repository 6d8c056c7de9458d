"""VRAM planning: every large allocation is checked against the free device memory less a reserve
(`--vram-reserve-mib`, for the CUDA context, the graphs' private pools and other processes) before it is
made, so a configuration that does not fit fails at start-up with the numbers, never mid-request."""
from __future__ import annotations

from .. import BackendUnavailable


class OutOfDeviceMemory(BackendUnavailable):
    """The model, KV cache or workspaces do not fit in the GPU's free memory."""


class VramPlan:
    def __init__(self, device, reserve_mib: int):
        if reserve_mib < 0:
            raise ValueError(f"vram_reserve_mib must be >= 0, got {reserve_mib}")
        self.device, self.reserve = device, int(reserve_mib) * 2**20

    def free_bytes(self) -> int:
        from .runtime import cupy
        cp = cupy()
        cp.get_default_memory_pool().free_all_blocks()     # cached blocks count as free for planning
        return int(cp.cuda.runtime.memGetInfo()[0])

    def check_fits(self, nbytes: int, what: str) -> None:
        """Raise OutOfDeviceMemory if nbytes more would eat into the reserve."""
        free = self.free_bytes()
        if nbytes + self.reserve > free:
            raise OutOfDeviceMemory(
                f"not enough GPU memory for {what}: needs {nbytes / 2**20:,.0f} MiB, "
                f"{free / 2**20:,.0f} MiB free on cuda:{self.device.id} with {self.reserve / 2**20:,.0f} MiB "
                "kept in reserve (--vram-reserve-mib); lower --ctx-size / --parallel / --kv-tokens or use a "
                "smaller model")
