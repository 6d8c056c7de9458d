"""Which CUDA mat-mul kernel a launch takes (kernels/cuda/qmatmul.tensor_core_variant, small_variant, split_k): pure
host logic,
so it is checked without a GPU. Every kernel gives the same bits (tests/kernels/cuda/test_qmatmul_cuda.py);
the choice is about speed, from the H200 measurements in tensor_core_variant's docstring."""
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.cuda.qmatmul import (GRID_TABLE_TILE1_WARPS, IQ3_GROUPS, WARPS_PER_CTA, cta_warps, MMA_MIDDLE, MMA_MIN_TOKENS, MMA_NARROW, MMA_VARIANTS,
                                              MMA_WIDEST, ONE_ROW_MAX_ROWS, PER_TOKEN, TOKEN_TILES, dp4a_variant,
                                              matmul, mma_smem, small_variant, split_k, tensor_core_variant)


def test_the_prompt_kernel_choice_starts_at_mma_min_tokens():
    for n_tok in (1, 4, 16, 2 * 9, MMA_MIN_TOKENS - 1):
        for n_out in (151936, 32000, 14336, 4864):
            assert tensor_core_variant(n_out, n_tok) is None


def test_decode_steps_of_many_sequences():
    """9-63 tokens (decode steps of several sequences, verify steps): the small-token kernel for Q4_K / Q5_K / Q8_0
    matrices of at least 128 row tiles (8 warps up to 32 tokens), mmq's narrow variant from 24 tokens where its
    grid is wide, else dp4a; none of them below 9 tokens or from MMA_MIN_TOKENS (tensor_core_variant's)."""
    assert small_variant(QType.Q4_K, 14336, 16) == ("small", 8)
    assert small_variant(QType.Q5_K, 4096, 9) == ("small", 8)
    assert small_variant(QType.Q8_0, 14336, 12) == ("small", 8)
    assert small_variant(QType.Q4_K, 14336, 48) == ("small", 4)          # narrow: 448 CTAs
    assert small_variant(QType.Q4_K, 28672, 16, glu=True) == ("small", 8)
    assert small_variant(QType.Q4_K, 28672, 24, glu=True) == ("mma", MMA_NARROW)   # 14336 gate rows: 896 CTAs
    assert small_variant(QType.IQ3_XXS, 28672, 24, glu=True) == ("mma", MMA_NARROW)
    assert small_variant(QType.Q6_K, 32000, 24) == ("mma", MMA_NARROW)
    for qtype, n_out, n_tok in ((QType.IQ3_XXS, 28672, 16), (QType.Q6_K, 32000, 16), (QType.IQ3_XXS, 4096, 32),
                                (QType.Q8_0, 896, 12), (QType.Q4_K, 14336, 8), (QType.Q4_K, 14336, MMA_MIN_TOKENS),
                                (QType.Q4_K, 896, 16)):          # 28 CTAs: slower than dp4a in the 0.5B decode
        assert small_variant(qtype, n_out, n_tok) is None


def test_prompt_chunks_take_the_tensor_cores_in_the_widest_tile_that_fills_the_card():
    assert tensor_core_variant(14336, 512) == MMA_WIDEST      # 4 x 448 CTAs
    assert tensor_core_variant(14336, 128) == MMA_MIDDLE      # the widest would pad half of its 128 tokens
    assert tensor_core_variant(14336, 64) == MMA_MIDDLE       # 448
    assert tensor_core_variant(4864, 512) == MMA_WIDEST       # 4 x 152
    assert tensor_core_variant(4864, 64) == MMA_NARROW        # middle: 152 CTAs, narrow: 304
    assert tensor_core_variant(896, 512) == MMA_MIDDLE        # widest: 4 x 28 CTAs, middle: 8 x 28
    assert tensor_core_variant(9728, 64, glu=True) == MMA_MIDDLE   # 4864 gate rows, 16 per CTA: 304 CTAs
    assert tensor_core_variant(4096, 64, glu=True) == MMA_NARROW   # middle: 128 CTAs, narrow: 256
    assert tensor_core_variant(9728, 512, glu=True) == MMA_WIDEST


def test_small_grids_stay_on_dp4a():
    assert tensor_core_variant(128, 512) is None              # narrow: 16 x 4 CTAs
    assert tensor_core_variant(896, 64) is None               # 2 x 28


def test_staged_activations_fit_shared_memory():
    """Two buffers of every warp's unit for the CTA's tokens, padded rows, plus scales: within the 227 KiB an
    sm_90 CTA may opt in to (with the decoded units' static shared memory, at most 23 KiB)."""
    for qtype in (QType.IQ3_XXS, QType.Q4_K, QType.Q6_K, QType.Q8_0):
        for warps, nb in MMA_VARIANTS:
            assert mma_smem(qtype, warps, nb) + 23 * 1024 <= 227 * 1024
    assert mma_smem(QType.Q4_K, 4, 4) == 2 * 4 * 128 * (16 + 4 + 1) * 4


def test_split_k_only_for_few_tokens_over_few_long_rows(monkeypatch):
    """Few long rows take the split-K kernel at up to SPLIT_K_AUTO_TOKENS tokens (4 by default, at most the
    kernel's 4); many rows, short rows, GLU or more tokens do not."""
    from gguf import GGMLQuantizationType as QType
    from strata_lite.kernels.cuda import qmatmul
    for n in (1, 2, 4):                                          # decode and verify steps of up to 4 tokens
        assert split_k(QType.Q5_0, 896, 4864, n, False)
        assert split_k(QType.Q6_K, 896, 4864, n, False) == (n > 1)   # one token: one row a warp instead
    monkeypatch.setattr(qmatmul, "SPLIT_K_AUTO_TOKENS", 1)
    assert not split_k(QType.Q6_K, 896, 4864, 2, False)          # the launcher's limit is honoured
    monkeypatch.setattr(qmatmul, "SPLIT_K_AUTO_TOKENS", 8)
    assert not split_k(QType.Q6_K, 896, 4864, 5, False)          # the kernel takes 4 tokens at most
    assert not split_k(QType.Q6_K, 896, 4864, 0, False)
    assert not split_k(QType.IQ3_XXS, 4096, 14336, 1, False)     # 2,048 warps without it
    assert not split_k(QType.IQ3_XXS, 1024, 4096, 1, False)      # 4 rounds: not measured to gain
    assert not split_k(QType.Q8_0, 896, 896, 1, False)           # one round of units
    assert not split_k(QType.Q6_K, 1792, 4864, 1, True)          # GLU


def test_64_token_candidates(monkeypatch):
    """MMA_64 (on by default; off: tensor_core_variant's choice stands): at up to 64 tokens IQ3_XXS's middle
    variant becomes its _m6 kernel and Q4_K / Q5_K's narrow one the 4 x 2 variant where that grid keeps >= MMA_64_MIN_CTAS CTAs; other types, token counts and
    variants keep tensor_core_variant's choice."""
    from strata_lite.kernels.cuda import qmatmul as qm
    assert qm.MMA_64 is True
    monkeypatch.setattr(qm, "MMA_64", False)
    assert qm.mma_64_variant(QType.IQ3_XXS, MMA_MIDDLE, 14336, 64) == MMA_MIDDLE
    monkeypatch.setattr(qm, "MMA_64", True)
    pick = qm.mma_64_variant
    assert pick(QType.IQ3_XXS, tensor_core_variant(14336, 64), 14336, 64) == (2, 4, 6)
    assert pick(QType.IQ3_XXS, tensor_core_variant(28672, 64, True), 28672, 64, True) == (2, 4, 6)   # gate+up
    assert pick(QType.IQ3_XXS, tensor_core_variant(14336, 128), 14336, 128) == MMA_MIDDLE             # 128 tokens
    assert pick(QType.Q4_K, tensor_core_variant(4096, 64), 4096, 64) == (4, 2, 0)      # 128 CTAs of 64 tokens
    assert pick(QType.Q5_K, tensor_core_variant(4096, 64), 4096, 64) == (4, 2, 0)
    assert pick(QType.Q4_K, tensor_core_variant(3072, 64), 3072, 64) == MMA_NARROW    # 96 CTAs: keeps narrow
    assert pick(QType.Q4_K, tensor_core_variant(14336, 64), 14336, 64) == MMA_MIDDLE  # not narrow: unchanged
    assert pick(QType.Q6_K, tensor_core_variant(4096, 64), 4096, 64) == MMA_NARROW    # no candidate
    assert pick(QType.Q4_K, None, 896, 64) is None
    assert qm._mma_name(QType.IQ3_XXS, True, (2, 4, 6)) == "mmqglu_iq3_xxs_w2_n4_m6"
    assert qm._mma_name(QType.Q4_K, False, (4, 2, 0)) == qm._mma_name(QType.Q4_K, False, (4, 2)) == "mmq_q4_k_w4_n2"


def test_attention_groups_and_split_stride():
    """Splits folded per group (kernels/cuda/attention.py group_splits: by the token's own split count) and
    the CTAs per (token, kv head, tile) of a split-parallel launch: one per group while the work items fit the
    kernel's CTAs per SM (split_min_ctas, as attention.cu ATTN_MIN_CTAS), else fewer CTAs walking several groups
    each."""
    from strata_lite.kernels.cuda.attention import group_splits, split_min_ctas, split_stride
    # 8B shape (8 kv heads, one tile): 4K, 8K, 16K, 32K, 64K keys; 0.5B shape (2 kv heads) at 32K, 64K, 128K
    assert [group_splits(n, 8) for n in (32, 64, 127, 128, 256, 512, 4096)] == [1, 1, 1, 2, 4, 8, 8]
    assert [group_splits(n, 2) for n in (256, 512, 1024)] == [1, 2, 4]
    # head_dim 64 at head tiles <= 4 at five CTAs an SM, head tile 8, head_dim 128 and 256 at four; the A/B builds
    # change only their own kernels
    assert [split_min_ctas(128, t) for t in (1, 2, 4, 8)] == [4, 4, 4, 4]
    assert [split_min_ctas(64, t) for t in (1, 4, 8)] == [5, 5, 4] and split_min_ctas(256, 4) == 4
    assert split_min_ctas(128, 4, "d128_min5") == 5 and split_min_ctas(64, 8, "d128_min5") == 4
    assert split_min_ctas(64, 8, "h8_min5") == 5 and split_min_ctas(128, 4, "h8_min5") == 4
    assert split_stride(8 * 32, 32, 132, 4) == 32        # 8B shape at 4K keys: 32 groups of 1 split, 256 items
    assert split_stride(8 * 64, 64, 132, 4) == 64        # at 32K: 256 splits in 64 groups of 4, 512 items fit
    assert split_stride(2 * 64, 64, 132, 4) == 64        # 0.5B shape at 32K
    assert split_stride(4 * 8 * 64, 64, 132, 4) == 16    # 4 tokens at 32K: 2048 items -> 4 groups a CTA
    assert split_stride(16 * 8 * 32, 32, 132, 4) == 4    # 16 tokens at 4K: 4096 items -> 8 groups a CTA
    assert split_stride(16 * 8 * 32, 32, 132, 5) == 5    # (7 at five CTAs an SM)
    assert split_stride(1, 1, 132, 5) == 1


class _DeviceArray(np.ndarray):
    """A host array that says it lives on device 0 (attention() reads q.device.id for the SM count)."""
    device = SimpleNamespace(id=0)


def _record_attention_launches(monkeypatch, n_heads, n_kv, hd, n_tok, split_rows=0, max_keys=256):
    """(kernel name, grid, dynamic shared memory, tokens of the launch: q's rows, the merge's grid) of each
    launch of one attention call."""
    from strata_lite.kernels.cuda import attention as ak
    from strata_lite.kernels.kv_layout import kv_scale_groups
    calls = []
    monkeypatch.setattr(ak.runtime, "launch", lambda cu, name, grid, block, args, shared_mem=0, options=():
                        calls.append((name, tuple(grid), shared_mem,
                                      grid[0] if name == "attn_merge" else args[0].shape[0])))
    monkeypatch.setattr(ak.runtime, "sm_count", lambda device_id: 132)
    q = np.zeros((n_tok, n_heads, hd), np.float32).view(_DeviceArray)
    ints = np.zeros(n_tok, np.int32)
    pages = np.zeros((4, 64, n_kv, hd), np.int8)
    scales = np.zeros((4, 64, n_kv, kv_scale_groups(hd)), np.float32)
    ws = SimpleNamespace(n_heads=n_heads, head_dim=hd, max_tokens=n_tok, split_tokens=64, max_keys=max_keys,
                         n_splits=-(-max_keys // ak.keys_per_split), acc=np.zeros(1), ml=np.zeros(1))
    ak.attention(q, ints, ints, np.zeros((1, 4), np.int32), pages, scales, pages, scales, 0.1, q, ws, max_keys,
                 split_rows=split_rows)
    return calls


@pytest.mark.parametrize("n_heads,n_kv,hd,n_tok,want", [
    (32, 8, 128, 512, ("attn_d128_h4_tiled", (128, 8))),     # a prompt chunk of the 8B shape: 4 tokens a CTA
    (14, 2, 64, 100, ("attn_d64_h8_tiled", (50, 2))),        # the 0.5B shape: 2 tokens a CTA
    (16, 1, 256, 100, ("attn_d256_h4_looped", (100, 4, 1))),  # head_dim 256: no tiled kernel
    (32, 8, 128, 64, ("attn_d128_h4", None)),                # decode / verify sizes: split-parallel
])
def test_attention_launch_modes(monkeypatch, n_heads, n_kv, hd, n_tok, want):
    """Launches of more tokens than the workspace's split_tokens take the tiled kernels at head_dim <= 128 (with
    the dynamic shared memory of tiled_smem_bytes), the looped ones at 256 or with attention.TILED off."""
    from strata_lite.kernels.cuda import attention as ak
    name, grid, smem, _ = _record_attention_launches(monkeypatch, n_heads, n_kv, hd, n_tok)[0]
    assert name == want[0]
    if want[1] is not None:
        assert grid == want[1]
    if name.endswith("_tiled"):
        assert smem == ak.tiled_smem_bytes(hd, int(name.split("_h")[1].split("_")[0]), 2)
        monkeypatch.setattr(ak, "TILED", False)
        assert _record_attention_launches(monkeypatch, n_heads, n_kv, hd, n_tok)[0][0] == name.replace("_tiled",
                                                                                                          "_looped")


def test_mixed_steps_split_their_short_runs(monkeypatch):
    """A mixed step's leading short runs (split_rows: decode / verify tokens) go split-parallel (kernel and
    merge over those tokens only), the prompt chunk after them tiled; at most split_tokens of them; nothing
    changes where the launch is split-parallel anyway or has one split of keys."""
    launches = _record_attention_launches(monkeypatch, 32, 8, 128, 100, split_rows=3)
    assert [(n, t) for n, _, _, t in launches] == [("attn_d128_h4", 3), ("attn_merge", 3), ("attn_d128_h4_tiled", 97)]
    assert launches[2][1] == (25, 8)
    launches = _record_attention_launches(monkeypatch, 32, 8, 128, 200, split_rows=90)
    assert [(n, t) for n, _, _, t in launches] == [("attn_d128_h4", 64), ("attn_merge", 64),
                                                    ("attn_d128_h4_tiled", 136)]
    launches = _record_attention_launches(monkeypatch, 32, 8, 128, 70, split_rows=20)   # 50 left: split-parallel
    assert [(n, t) for n, _, _, t in launches] == [("attn_d128_h4", 20), ("attn_merge", 20), ("attn_d128_h4", 50),
                                                    ("attn_merge", 50)]
    assert [n for n, *_ in _record_attention_launches(monkeypatch, 32, 8, 128, 40, split_rows=3)] == \
        ["attn_d128_h4", "attn_merge"]
    assert [n for n, *_ in _record_attention_launches(monkeypatch, 32, 8, 128, 100, split_rows=3, max_keys=128)] == \
        ["attn_d128_h4_tiled"]


def test_step_graph_buckets_follow_the_engine_size():
    """Decode steps of up to 64 sequences replay graphs (kernels/cuda/graphs.step_buckets): 32 and 64 are
    captured only where that many sequences run, and never above the workspaces' step tokens."""
    from strata_lite.kernels.cuda.graphs import step_buckets
    assert step_buckets(1, 512) == step_buckets(16, 512) == (1, 2, 4, 8, 16)
    assert step_buckets(17, 512) == step_buckets(32, 512) == (1, 2, 4, 8, 16, 32)
    assert step_buckets(33, 512) == step_buckets(500, 512) == (1, 2, 4, 8, 16, 32, 64)
    assert step_buckets(64, 48) == (1, 2, 4, 8, 16, 32)


def test_glu_warps_take_gate_up_pairs_by_tokens_and_type():
    """The dp4a GLU kernels: one gate row and its up row per warp at one token, two pairs from 2 tokens (each
    activation load then serves four rows; measured faster there, slower at one token for Q4_K), and two pairs
    at one token for IQ3_XXS (measured faster in its grouped layout)."""
    assert [dp4a_variant(QType.Q5_0, tile, glu=True) for tile in TOKEN_TILES] == \
        [(1, 2, 1), (2, 4, 1), (4, 4, 1), (8, 4, 1)]
    for qtype in (QType.Q4_K, QType.Q5_K):                     # 4- and 8-token tiles: token by token (mm_q_tok)
        assert [dp4a_variant(qtype, tile, glu=True) for tile in TOKEN_TILES] == \
            [(1, 2, 1), (2, 4, 1), (4, 4, PER_TOKEN), (8, 4, PER_TOKEN)]
    assert [dp4a_variant(QType.IQ3_XXS, tile, glu=True) for tile in TOKEN_TILES] == \
        [(1, 4, 1), (2, 4, 1), (4, 4, 1), (8, 4, 1)]


def test_dense_dp4a_kernels_by_tokens_rows_and_type():
    """Dense launches: Q4_K / Q5_K 8-token tiles token by token (4-token ones measured faster on mm_q's loop);
    one token over at most ONE_ROW_MAX_ROWS rows one row a warp for the types whose superblocks span lanes, two
    over more rows; the 32-weight types as before."""
    for qtype in (QType.Q4_K, QType.Q5_K):
        assert [dp4a_variant(qtype, tile) for tile in TOKEN_TILES] == \
            [(1, 2, 1), (2, 2, 1), (4, 2, 1), (8, 4, PER_TOKEN)]
    for qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ3_XXS):
        assert dp4a_variant(qtype, 1, n_out=896) == dp4a_variant(qtype, 1, n_out=ONE_ROW_MAX_ROWS) == (1, 1, 1)
    assert dp4a_variant(QType.IQ3_XXS, 1, n_out=ONE_ROW_MAX_ROWS + 1) == (1, 2, 1)
    assert dp4a_variant(QType.Q6_K, 1, n_out=4096) == (1, 1, 1)     # DP4A_TILE1: one row at any size
    assert dp4a_variant(QType.Q8_0, 1, n_out=896) == (1, 2, 1)
    assert dp4a_variant(QType.Q5_0, 1, n_out=896) == (1, 1, 1)
    assert dp4a_variant(QType.Q4_K, 1, glu=True, n_out=896) == (1, 2, 1)


def test_cta_warps_by_type_and_tile():
    """dp4a launches take WARPS_PER_CTA warps a CTA, IQ3_XXS one-token tiles (whose CTAs fill a grid table first)
    GRID_TABLE_TILE1_WARPS (H100 measurements in qmatmul.py)."""
    assert (WARPS_PER_CTA, GRID_TABLE_TILE1_WARPS) == (4, 8)
    assert cta_warps(QType.IQ3_XXS, 1) == 8
    assert [cta_warps(QType.IQ3_XXS, t) for t in TOKEN_TILES[1:]] == [4] * (len(TOKEN_TILES) - 1)
    for qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.Q5_0, QType.IQ4_NL, QType.F16):
        assert [cta_warps(qtype, t) for t in TOKEN_TILES] == [4] * len(TOKEN_TILES)


def test_iq3_xxs_group_loop_by_tile_and_grid():
    """IQ3_XXS launches of one token tile take the loop over whole groups (IQ3_GROUPS_CHOICES, an H100's / H200's
    132 SMs): one token dense unbounded where its CTAs fit one wave at 3 an SM, else under a minimum of 4 CTAs, GLU
    under 4 on any grid; 2- and 4-token dense tiles, 4- and 8-token GLU ones on any grid; 8-token dense tiles on one
    wave at one CTA an SM. Not: several tiles of tokens, 2-token GLU, an unknown device, other types, and rows that
    take one row a warp."""
    def pick(tile, n_out, n_tok, glu=False, n_sm=132, qtype=QType.IQ3_XXS):
        return dp4a_variant(qtype, tile, glu=glu, n_out=n_out, n_tok=n_tok, n_sm=n_sm)
    g = IQ3_GROUPS
    assert pick(1, 4096, 1) == pick(1, 6144, 1) == (1, 2, g)
    assert pick(1, 14336, 1) == (1, 2, g, 4) and pick(1, 2 * 14336, 1, glu=True) == (1, 4, g, 4)
    assert pick(1, 2 * 1024, 1, glu=True) == (1, 4, g, 4)
    assert pick(2, 14336, 2) == (2, 2, g) and pick(2, 2 * 14336, 2, glu=True) == (2, 4, 1)
    assert pick(4, 4096, 3) == pick(4, 14336, 4) == (4, 2, g) and pick(4, 2 * 14336, 4, glu=True) == (4, 4, g)
    assert pick(8, 4096, 8) == (8, 4, g) and pick(8, 14336, 8) == (8, 4, 1)
    assert pick(8, 2 * 14336, 8, glu=True) == (8, 4, g)
    assert pick(4, 14336, 5) == (4, 2, 1) and pick(8, 4096, 16) == (8, 4, 1)     # two tiles of tokens
    assert pick(1, ONE_ROW_MAX_ROWS, 1) == (1, 1, 1)                 # one row a warp first
    assert pick(1, 6144, 1, n_sm=None) == (1, 2, 1) and pick(1, 6144, 1, n_sm=28) == (1, 2, g, 4)
    assert pick(1, 4096, 1, qtype=QType.Q4_K) == (1, 2, 1) and pick(8, 2 * 14336, 8, glu=True, qtype=QType.Q6_K) == \
        (8, 4, 1)
    # the boundary: a wave of 132 SMs x 3 CTAs of 8 warps x 2 rows holds 6,336 rows
    assert pick(1, 132 * 3 * 16, 1) == (1, 2, g) and pick(1, 132 * 3 * 16 + 1, 1) == (1, 2, g, 4)


def test_two_tokens_over_few_rows_take_one_row_a_warp(monkeypatch):
    """TWO_TOKEN_ONE_ROW_MAX_ROWS (0: never; 2048 by default): dense 2-token launches of the superblock types over at
    most that many rows take one row a warp; the block types measured level (Q5_0, Q8_0), GLU launches, larger grids
    and other tiles keep their kernels."""
    from strata_lite.kernels.cuda import qmatmul as qm
    assert qm.TWO_TOKEN_ONE_ROW_MAX_ROWS == 2048
    for qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ3_XXS):
        assert dp4a_variant(qtype, 2, n_out=896) == dp4a_variant(qtype, 2, n_out=2048) == (2, 1, 1)
        assert dp4a_variant(qtype, 2, n_out=2049) != (2, 1, 1) and dp4a_variant(qtype, 2) == (2, 2, 1)
        assert dp4a_variant(qtype, 2, glu=True, n_out=896) == (2, 4, 1)
        assert dp4a_variant(qtype, 4, n_out=896)[:2] == (4, 2)
    for qtype in (QType.Q5_0, QType.Q8_0):
        assert dp4a_variant(qtype, 2, n_out=896) == (2, 2, 1)
    monkeypatch.setattr(qm, "TWO_TOKEN_ONE_ROW_MAX_ROWS", 0)
    assert dp4a_variant(QType.Q4_K, 2, n_out=896) == (2, 2, 1)


def test_float_row_tiles_are_refused_outside_the_explore_build():
    """matmul's rows (the explore build's float kernels over 4 or 8 rows a warp) is checked before any launch:
    a quantized weight, the default build or another row count get one clear error."""
    x = np.zeros((3, 64), np.float32)
    for qtype, build, rows in ((QType.Q4_K, "explore", 4), (QType.F16, "default", 4), (QType.F16, "explore", 3)):
        with pytest.raises(ValueError, match="rows takes float weights"):
            matmul(SimpleNamespace(qtype=qtype, n_out=8, n_in=64), x, None, None, rows=rows, build=build)
