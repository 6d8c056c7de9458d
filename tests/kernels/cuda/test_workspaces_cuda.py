"""The CUDA backend's step workspaces: the byte counts the VRAM plan checks equal what is allocated, and a
reserve() that would eat into --vram-reserve-mib stops with the plan's message instead of allocating."""
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("max_tokens,max_n_in,tiles", [(8, 896, None), (64, 4096, None), (5, 256, True),
                                                       (512, 14336, False)])
def test_act_buffers_nbytes_is_what_they_allocate(cp, max_tokens, max_n_in, tiles):
    from strata_lite.kernels.cuda import qmatmul as qm
    bufs = qm.ActBuffers(max_tokens, max_n_in, tiles)
    arrays = [*bufs._xq.values(), *bufs._xd.values(), *(bufs._tiles or ())]
    assert sum(a.nbytes for a in arrays) == qm.act_buffers_nbytes(max_tokens, max_n_in, tiles)
    assert (bufs._tiles is not None) == (max_tokens >= qm.SMALL_MIN_TOKENS if tiles is None else tiles)
    if bufs._tiles is not None:                     # the chunk-major views lie in them, from their start
        xt, xdt = bufs.tiles("q8_0", max_tokens, max_n_in)
        assert xt.shape == (max_n_in // 16, max_tokens, 16) and xdt.shape == (max_n_in // 32, max_tokens)


@pytest.mark.parametrize("sizes", [(1, 14, 64, 4096), (70, 32, 128, 5000), (512, 8, 256, 32768)])
def test_attention_workspace_nbytes_is_what_it_allocates(cp, sizes):
    from strata_lite.kernels.cuda import attention as ak
    ws = ak.attention_workspace(*sizes)
    assert ws.acc.nbytes + ws.ml.nbytes == ak.attention_workspace_nbytes(*sizes)


def test_reserve_checks_the_workspaces_against_the_plan(cp):
    from strata_lite.kernels.cuda.backend import CudaBackend
    from strata_lite.kernels.cuda.memory import OutOfDeviceMemory
    be = CudaBackend()
    free_mib = be.plan.free_bytes() // 2**20
    be.plan.reserve = (free_mib - 1) * 2**20      # 1 MiB left: 512 tokens x 14336 need ~20 MiB
    with pytest.raises(OutOfDeviceMemory, match="step workspaces"):
        be.reserve(512, 14336, 32, 128, 4096, 32000, 4)
    assert be._act is None
