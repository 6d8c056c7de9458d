"""How the prompt GEMMs (q8_0_gemm.py, nibble_gemm.py) split their work over threads: items of (a panel of
rows, a range of token groups), each unpacking its panel and multiplying it with its tokens."""
from __future__ import annotations

from numba import njit

ITEMS_PER_THREAD = 4     # several items a thread, so a thread slowed by other work on a shared machine
                         # hands the rest to the others (prange splits the items evenly)


@njit(cache=True, inline="always")
def token_chunks(n_panels, n_groups, n_threads):
    """Token-group ranges per panel: 1 when the panels alone give each of n_threads (numba.get_num_threads(),
    passed in: read inside a kernel it keeps Numba from caching the kernel) ITEMS_PER_THREAD items (the 0.5B
    model's 4864- and 9728-row matrices), more for matrices of few rows (896 -> 128), at most one group
    each. Every extra range unpacks its panel again."""
    want = ITEMS_PER_THREAD * n_threads
    return min(n_groups, max(1, (want + n_panels - 1) // n_panels))
