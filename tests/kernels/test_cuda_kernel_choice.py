"""Which CUDA mat-mul kernel a launch takes (kernels/cuda/qmatmul.tensor_core_tiles, split_k): pure host logic, so
it is checked without a GPU. Both kernels give the same bits (tests/kernels/cuda/test_qmatmul_cuda.py);
the choice is about speed, from the H200 measurements in its docstring."""
from strata_lite.kernels.cuda.qmatmul import MMA_MIN_TOKENS, split_k, tensor_core_tiles


def test_decode_and_draft_checks_stay_on_dp4a():
    for n_tok in (1, 4, 16, 2 * 9, MMA_MIN_TOKENS - 1):
        for n_out, n_in in ((151936, 896), (32000, 4096), (14336, 4096), (4864, 896)):
            assert tensor_core_tiles(n_out, n_in, n_tok) == 0


def test_prompt_chunks_of_wide_matrices_take_the_tensor_cores():
    assert tensor_core_tiles(14336, 4096, 512) == 2      # long rows: 2 token tiles per warp
    assert tensor_core_tiles(14336, 4096, 64) == 2
    assert tensor_core_tiles(896, 896, 512) == 1         # short rows: 1
    assert tensor_core_tiles(9728, 896, 64) == 1


def test_small_grids_stay_on_dp4a():
    assert tensor_core_tiles(128, 896, 512) == 0         # 64 CTAs
    assert tensor_core_tiles(896, 896, 64) == 0          # 56 CTAs


def test_q8_0_stays_on_dp4a():
    from gguf import GGMLQuantizationType as QType
    assert tensor_core_tiles(14336, 4096, 512, QType.Q8_0) == 0
    assert tensor_core_tiles(14336, 4096, 512, QType.Q4_K) == 2


def test_split_k_for_one_token_over_few_long_rows():
    """Few long rows take the split-K kernel at one token; many rows, short rows, GLU or several tokens do not."""
    from gguf import GGMLQuantizationType as QType
    assert split_k(QType.Q6_K, 896, 4864, 1, False) and split_k(QType.Q5_0, 896, 4864, 1, False)
    assert not split_k(QType.Q6_K, 896, 4864, 2, False)          # one token only
    assert not split_k(QType.IQ3_XXS, 4096, 14336, 1, False)     # 2,048 warps without it
    assert not split_k(QType.IQ3_XXS, 1024, 4096, 1, False)      # 4 rounds: not measured to gain
    assert not split_k(QType.Q8_0, 896, 896, 1, False)           # one round of units
    assert not split_k(QType.Q6_K, 1792, 4864, 1, True)          # GLU


def test_attention_split_stride():
    """CTAs per (token, kv head, tile) of a split-parallel attention launch (kernels/cuda/attention.py): one per
    split while the work items fit CTAS_PER_SM CTAs per SM, else fewer CTAs walking several splits each."""
    from strata_lite.kernels.cuda.attention import CTAS_PER_SM, split_stride
    assert CTAS_PER_SM == 4
    assert split_stride(8 * 32, 32, 132) == 32           # 8B shape at 4K keys: 256 items, one CTA per split
    assert split_stride(8 * 256, 256, 132) == 64         # at 32K: 2048 items -> 4 splits a CTA
    assert split_stride(2 * 256, 256, 132) == 256        # 0.5B shape at 32K: 512 items fit
    assert split_stride(4 * 8 * 256, 256, 132) == 16     # 4 tokens at 32K: 16 splits a CTA
    assert split_stride(1, 1, 132) == 1
