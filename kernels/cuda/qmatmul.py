"""Quantized mat-mul on the GPU: weights stay raw GGUF blocks on the device (uploaded once), activations are
rounded to int8 the way ggml does (Q8_0 / Q8_K, bit-exact with kernels/cpu/act_quant.py) and dotted with
the weights' int8 values: on the tensor cores (int8 mma.sync, qmatmul_mma.cu) where the launch fills the
card, else by __dp4a (qmatmul.cu); see tensor_core_variant(). Both give the same bits for every output.

Host/device placement: DeviceWeight.raw, x, xq, xd, ids and out are cupy arrays (device); sizes are Python
ints read from shapes. Launchers allocate nothing and never sync, so they can be captured in a CUDA graph.

Batch invariance: each output is computed in one fixed order (lane-strided units, a superblock's integer
sums scaled once (IQ3_XXS and Q6_K: per 256-weight block), then the lane groups' sums added left to right;
the tensor-core kernel replays that order), whatever the number of tokens in the launch, the token tile size
or the kernel chosen for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..cpu.act_quant import Q8_0_ACT, Q8_K_ACT
from ..qtypes import check_supported, row_nbytes
from .layouts import device_row_bytes, to_device
from .runtime import cdiv, cupy, launch, sm_count

CU = "qmatmul.cu"
CU_MMA = "qmatmul_mma.cu"
# The tensor-core kernel's variants (warps per CTA, n8 token tiles per warp): kernels mmq[glu]_<type>_w<W>_n<NB>
# of qmatmul_mma.cu; a CTA takes 32 rows (GLU: 16 gate + 16 up) by W * 8 * NB tokens. A launch takes the
# first of MMA_CHOICES (variant, least CTAs, least tokens) that its grid and token count reach, else the dp4a
# kernel (see tensor_core_variant).
MMA_WIDEST, MMA_MIDDLE, MMA_NARROW = (4, 4), (2, 4), (4, 1)
MMA_CHOICES = ((MMA_WIDEST, 256, 256), (MMA_MIDDLE, 192, 64), (MMA_NARROW, 192, 64))
MMA_VARIANTS = tuple(v for v, _, _ in MMA_CHOICES)
MMA_MIN_TOKENS = 64         # tensor_core_variant from this many tokens (below: small_variant, else dp4a)
# 64-token launches (a step of 33-64 decoding sequences replays the 64-token graph): per type, the variant
# tensor_core_variant takes -> a candidate of qmatmul_mma.cu's MMQ_64 kernels, (warps, n8 tiles, CTAs an SM asked
# for: kernel suffix _m<MB>, 0 none), taken while MMA_64 is on (mma_64_variant). H200 (2026-12-06, bench_gpu.py
# --gemm-explore, dense, us, taken / candidate): IQ3_XXS 4096x14336 87.7 / 78.6 (H100 83.0 / 75.9), Q4_K
# 14336x4096 144.2 / 119.5. End to end (H100, 2026-12-06, ab_builds.py --arm "--mma-64 off" --arm "--mma-64 on",
# 8B-layer shape, 512 context, four processes an arm): the 64-sequence step 2-4% faster (Q4_K_M mix 1.024 /
# 1.042, IQ3_XXS mix 1.041 / 1.022 of off), 1-32 sequences untouched; so on. bench_gpu.py --mma-64 off for A/B runs.
MMA_64_CANDIDATES = {QType.IQ3_XXS: {MMA_MIDDLE: (2, 4, 6)}, QType.Q4_K: {MMA_NARROW: (4, 2, 0)},
                     QType.Q5_K: {MMA_NARROW: (4, 2, 0)}}
MMA_64_MAX_TOKENS = 64
MMA_64_MIN_CTAS = 128       # the 4 x 2 candidate: 64 tokens over >= 4,096 rows (measured at 4,096)
MMA_64 = True
# Warps per CTA of the dp4a and float mat-muls (each warp keeps its rows' sums to itself: the same bits at any
# count). H100 (2026-12-07, ab_builds.py --arm "" --arm "--warps-per-cta 4", 512 context, 2 rounds), decode tok/s
# with 4 against 8: 0.5B shape 1.013 / 1.057 / 1.040 / 1.076 / 1.008 at 1 / 8 / 16 / 32 / 64 sequences, 8B-layer
# Q4_K_M 1.001 / 1.068 / 1.005 / 1.005 / 0.999 (at 4K context 1.003 / 1.044 / 1.004 / 1.005 / 1.000), IQ3_XXS 0.971
# / 0.998 / 1.041 / 1.023 / 1.003 with its group-loop choice counted in CTAs of 4 warps, 0.975 / 1.007 / 1.041 / 1.021 /
# 0.999 counted in 8 (IQ3_GROUPS_CTA_WARPS). So IQ3_XXS one-token launches keep 8 warps (GRID_TABLE_TILE1_WARPS):
# every CTA of its kernels fills the 1 KB grid table in shared memory (qmatmul_types.cuh GRID_SMEM) and waits on it,
# which 4-warp CTAs do twice as often for a one-token tile's little work per CTA.
WARPS_PER_CTA = 4
GRID_TABLE_TILE1_WARPS = 8
SPLIT_K_WARPS = 8           # warps per CTA (and per row) of the split-K kernel; at least SPLIT_K_MAX_TOKENS
TOKEN_TILES = (1, 2, 4, 8)  # token tiles compiled (kernels mm_<type>_t<tile>...); a launch takes the smallest >= n
ACT_WARPS = 8               # quantization blocks (warps) per CTA
ACT_TILE_THREADS = 256      # threads (16-byte chunks) per CTA of act_tiles
DQ_THREADS = 128            # units per CTA of dequant_rows
MAX_GRID_Y = 65535
# The dp4a kernel's work split per token tile: (rows per warp RW, units in flight per lane G); kernels
# mm_<type>_t<tile>_r<RW>_g<G> (GLU kernels mmglu_<type>_t<tile>_r<RW>_g1: DP4A_GLU_ROWS). From
# perf/bench_gpu.py --explore on an H200 (2026-12-02, kernel_notes.md): at 1 token two rows per warp
# (each activation load serves both) take 4096x14336 Q4_K from 15.7 to 11.3 us and IQ3_XXS from 19.9 to
# 17.0; the 34/18/22-byte blocks (Q8_0, Q4_0, Q5_0, IQ4_NL) stay fastest at one row (Q8_0 17.9 vs
# 18.9-20.9), and so does Q6_K in its device layout (2026-12-04: 16.6 vs 17.4 / 18.7 us with two rows, one
# or two units in flight); 8 tokens take four rows (IQ3_XXS 53.6 -> 37.6 us). The one-row kernel asks for a
# full SM of CTAs (qmatmul.cu FULL_SM_CTAS: 8 on an H200, 32 registers; 6 on sm_86 / sm_89 / sm_120;
# 2026-12-04: Q8_0 4096x14336 19.3 -> 17.5 us, Q5_0 896x4864 3.8 -> 3.4, Q6_K 16.7 / 5.6 either way; the
# two-row kernels lost under the same bound: IQ3_XXS 17.4 -> 18.5, Q4_K 12.3 -> 20.6). The two-row kernel asks
# for a minimum of one CTA an SM instead, which lets ptxas take more registers (2026-12-04, one run, 4096x14336
# unless said, us without / with): Q4_K 12.3 / 11.2, IQ3_XXS 17.5 / 17.3 (14336x4096 19.0 / 18.9), Q8_0 19.9 /
# 16.7, against 17.3 for Q8_0's one-row kernel, which it now takes; Q6_K keeps one row (16.7 against 16.4 on
# 4096-weight rows, but 5.7 against 6.3 on 896x4864).
DP4A_TILE1 = {QType.Q6_K: (1, 1), QType.Q4_0: (1, 1), QType.Q5_0: (1, 1), QType.IQ4_NL: (1, 1)}
DP4A_VARIANTS = {1: (2, 1), 2: (2, 1), 4: (2, 1), 8: (4, 1)}
# GLU kernels mmglu_<type>_t<tile>_r<RW>_g1: RW / 2 gate rows and their up rows per warp, so each activation load
# serves RW rows. H200 (2026-12-04, kernel_notes.md), gate+up 4096x2x14336 at 1 / 2 / 4 / 8 tokens, one pair
# against two: Q4_K 20.6 / 31.0 / 47.0 / 80.4 against 23.7 / 27.6 / 38.3 / 69.1 us, IQ3_XXS 34.3 / 37.5 / 43.9 /
# 60.0 against 33.5 / 36.7 / 41.5 / 57.8 (16 tokens 115.2 -> 108.2)
# (the one-pair kernel under a minimum of one CTA an SM, as the dense one: Q4_K 20.1 -> 19.2 us, 2026-12-04)
DP4A_GLU_ROWS = {1: 2, 2: 4, 4: 4, 8: 4}
# ... except IQ3_XXS at one token in its grouped device layout: two pairs (2026-12-04: 31.0 -> 28.4 us; one pair
# under the bound of one CTA: 30.6), on mm_q1's loop under a minimum of one CTA an SM (H100 2026-12-05: 29.6 ->
# 26.9 us)
DP4A_GLU_TILE1 = {QType.IQ3_XXS: 4}
# One token over few, long rows: the split-K kernel mmsk_<type> (SPLIT_K_WARPS warps per row, the same
# bits as the dp4a kernel; qmatmul.cu mm_q_sk) where the matrix has at most SPLIT_K_MAX_ROWS rows and its
# rows at least SPLIT_K_MIN_ROUNDS rounds of 32 units. H200 (2026-12-02, kernel_notes.md), 896x4864: Q6_K
# 7.8 -> 3.7 us, Q5_0 4.6 -> 2.9; 4096x14336 (2,048 warps already): IQ3_XXS 18.8 -> 21.4, Q4_K 12.1 -> 16.4,
# Q6_K 24.6 -> 21.4, Q8_0 18.5 -> 17.5; every one-token launch through it (GLU over 4096-weight rows: two
# rounds for 8 warps) made the 8B-layer decode 30% slower. 5 rounds: the fewest measured to gain (896x4864
# Q5_0 / Q6_K). Partial terms take SPLIT_K_SMEM bytes of shared memory at most. The kernel takes up to
# SPLIT_K_MAX_TOKENS tokens (a verify step's pending token and drafts: each decoded unit serves them all);
# the launcher sends it SPLIT_K_AUTO_TOKENS at most. H200, 2026-12-03 (perf/bench_gpu.py --verify-cost),
# 896x4864 at 1 / 2 / 3 / 4 tokens, split-K against dp4a: Q5_0 4.4 / 4.9 / 5.4 / 6.1 against 4.6 / 7.1 / 11.2 /
# 13.0 us, Q6_K 4.9 / 5.6 / 6.7 / 7.7 against 7.8 / 9.2 / 11.8 / 12.9; the 0.5B shape's step graph at 2 / 4
# tokens 1,026-1,029 -> 991-994 / 1,330 -> 1,260-1,266 us (1 token unchanged, 852-860).
SPLIT_K_MAX_TOKENS = 4
SPLIT_K_AUTO_TOKENS = 4
SPLIT_K_MAX_ROWS = 2048
SPLIT_K_MIN_ROUNDS = 5
SPLIT_K_SMEM = 48 * 1024
# Small token counts on the tensor cores: kernels mmqs[glu]_<type>_w<NK> of qmatmul_mma.cu, built for SMALL_TYPES (a
# CTA takes 32 rows by SMALL_TILE tokens; its NK warps split the rows' unit groups, so the weights are read once per
# 16 tokens with several units in flight per warp). H200 (2026-12-04, kernel_notes.md), µs at 16 tokens, dp4a / mmq
# narrow / small 4 warps / 8 warps (row length x rows): Q4_K 14336x4096 85.2 / 110.2 / 92.1 / 51.7, 4096x4096 22.6 /
# 32.0 / 24.9 / 18.2, gate+up 4096x2x14336 156.1 / 130.0 / 110.9 / 104.0; at 24 tokens (two tiles) gate+up 230.8 /
# 123.4 / 152.5 / 168.5. The other types measured slower than dp4a there (IQ3_XXS gate+up 114.3 dp4a / 128.8, Q6_K
# 14336x4096 104.1 / 184.8, Q8_0 82.4 / 119.6). So small_variant: SMALL_TYPES from SMALL_MIN_TOKENS tokens, 8 warps up
# to 32 tokens, 4 beyond; and from NARROW_MIN_TOKENS tokens (every type) mmq's narrow variant where its grid has at
# least NARROW_MIN_CTAS CTAs (the wide matrices: gate+up 4096 x 2 x 14336 at 24 tokens 123.4 against dp4a 230.8, Q6_K
# 4096x32000 252.5 / 278.3, Q8_0 896x151936 167.8 / 237.6; smaller grids lose: IQ3_XXS 4096x6144 (192 CTAs) 54.8 /
# 38.5, 14336x4096 (128) 171.5 / 85.1).
SMALL_TILE = 16
# Q8_0 joined with its aligned device layout (layouts.py; H200 2026-12-04, 4096x14336 at 16 tokens: 8 warps 53.2
# / 4 warps 59.6 against dp4a's 94.3 us, where the file's 34-byte blocks had measured 112.5 / 120.3 against 82.1)
SMALL_TYPES = frozenset({QType.Q4_K, QType.Q5_K, QType.Q8_0})
SMALL_WARPS = (4, 8)
SMALL_MIN_TOKENS = 9
# row tiles the small-token kernel needs: 128 (4096 rows) measured faster than dp4a; the 0.5B shape's Q4_K down
# projection (896 rows: 28 CTAs of 8 warps, the only launch of that model it took at 16 tokens) made its
# 16-sequence decode 3-5% slower (7,535-7,568 -> 7,185-7,339 tok/s), so such grids stay on dp4a
SMALL_MIN_CTAS = 128
SMALL_WIDE_MAX_TOKENS = 32
# the small-token kernel's other types, built only with -DMMQ_EXPLORE (MMA_BUILDS["explore"]) for bench_gpu.py
# --explore: warps each may take (the 256-weight superblock types have 4 unit groups)
SMALL_EXPLORE_WARPS = {QType.Q6_K: (4,), QType.IQ3_XXS: (4,)}
NARROW_MIN_TOKENS = 24
NARROW_MIN_CTAS = 896

# perf/bench_gpu.py --explore: a build of qmatmul.cu with more (tile, RW, G) candidates; G = PIPE: one token with
# the next round's weight loads in flight (qmatmul.cu mm_q1, kernels ..._t1_r<RW>_gp), G = ONE_LOOP: the same
# loop without them (..._gs); G = PER_TOKEN: the superblock types' integer parts reduce-scattered token by token
# (qmatmul.cu mm_q_tok, kernels ..._gt, built in every build for Q4_K, Q5_K, Q6_K and IQ3_XXS)
PIPE, ONE_LOOP, PER_TOKEN = "p", "s", "t"
# (token tile, GLU) of launches that take mm_q_tok's kernel (the same RW as DP4A_VARIANTS / DP4A_GLU_ROWS, the same
# bits as mm_q's). H100 (2026-12-05, kernel_notes.md, "Block sums as the default"), Q4_K, mm_q / mm_q_tok, us:
# 8 tokens 4096x14336 42.9 / 33.4, 14336x4096 56.4 / 46.4, gate+up 4096x2x14336 76.1 / 59.3, Q5_K 45.5 / 36.8; 4
# tokens gate+up 43.1 / 38.0, dense 29.9 / 30.8 (so dense 4-token tiles keep mm_q). Q5_K's 4-token GLU tile
# follows Q4_K's (the same loop and unit; not timed alone).
PER_TOKEN_TILES = {QType.Q4_K: {(8, False), (8, True), (4, True)}, QType.Q5_K: {(8, False), (8, True), (4, True)}}
# the types built with mm_q_tok's kernels (4-token tiles: RW 2 dense, 4 GLU; 8-token tiles: RW 4) in every build
PER_TOKEN_TYPES = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ3_XXS})
PER_TOKEN_VARIANTS = ((4, 2, PER_TOKEN), (8, 4, PER_TOKEN))
PER_TOKEN_GLU_VARIANTS = ((4, 4, PER_TOKEN), (8, 4, PER_TOKEN))
# One token over at most ONE_ROW_MAX_ROWS rows (dense): the types whose superblocks span lanes (Q4_K, Q5_K, Q6_K,
# IQ3_XXS) take one row a warp (mm_q1's loop), twice the warps of two rows, ahead of split-K. H100 (2026-12-05),
# 896 rows of 4864 weights (the 0.5B shape's down projection), what they took before / one row a warp: IQ3_XXS
# 8.3 / 4.6 us, Q6_K (split-K) 4.7 / 3.8, Q4_K 4.2 / 3.6; at 4,096 and 6,144 rows two rows stay faster (Q4_K
# 4096x4096 4.9 / 5.3, IQ3_XXS 4096x6144 8.7 / 10.3).
ONE_ROW_MAX_ROWS = 2048
# Two tokens (a decode token and its one-token draft, verified together) over at most TWO_TOKEN_ONE_ROW_MAX_ROWS rows
# (dense) of the types whose superblocks span lanes (PER_TOKEN_TYPES, as ONE_ROW_MAX_ROWS) take one row a warp
# (kernels mm_<type>_t2_r1_g1), twice the warps of the two-row kernel: the 0.5B shape's 896-row launches otherwise
# fill 56 CTAs on 132 SMs. H200 (2026-12-06, bench_gpu.py --verify-cost, four processes), 2 tokens, one row / two
# rows a warp, us: Q4_K 896x4864 4.5 / 5.6; Q5_0 1152x896 2.7 / 2.7, 896x896 2.7 / 2.6, 896x4864 7.5 / 7.5-7.6 and
# Q8_0 128x896 2.2 / 2.2 (level: those keep two rows); the 0.5B shape's 2-token step graph 884-905 / 892-901
# (medians ~891 / ~895; perf/kernel_notes.md, "What a verified draft token costs").
TWO_TOKEN_ONE_ROW_MAX_ROWS = 2048
# IQ3_XXS launches of one tile of tokens (dense ones over more rows than take one row a warp) may take the loop over
# the device layout's whole groups of 8 blocks (qmatmul.cu mm_q_iq3, kernels ..._gw[_m<MB>]; the same bits): fewer
# instructions a weight but more registers (sm_90, against mm_q1's / mm_q's loop: one token 78 against 56, two GLU
# pairs 109 against 63, 2-token tiles 52 against 48, 4-token tiles 64 against 56, 4-token GLU 80 either way,
# 8-token tiles 138 against 100, 8-token GLU 128 against 99; under a minimum of 4 CTAs an SM the one-token kernels
# take 64 without spilling). IQ3_GROUPS_CHOICES[(tile, glu)]: the group-loop kernels to try in turn, (MB, CTAS):
# the kernel under a minimum of MB CTAs an SM (None: unbounded), for grids that fit one wave at CTAS CTAs an SM
# (None: any grid); where none fits, mm_q1's / mm_q's loop. Measured, µs, that loop against the group loop (row
# length x rows; kernel_notes.md, "IQ3_XXS group loop under launch bounds"): H200 (2026-12-06) one token 4096x14336
# (896 CTAs) 17.0 / 16.8 unbounded / 15.3 under 4 CTAs, 14336x4096 (256 CTAs: one wave) 17.5 / 13.8 / 14.3,
# 4096x6144 8.4 / 7.3 / 7.4, gate+up 4096x2x14336 26.2 / 28.9 / 22.6; 2 tokens 4096x14336 19.6 / 18.2; 4 tokens
# 4096x14336 23.3 / 22.5, 14336x4096 29.5 / 24.2, gate+up 35.6 / 34.2; 8 tokens 4096x14336 (448 CTAs) 29.2 / 37.2
# (29.9 under 2 CTAs), 14336x4096 31.5 / 30.2, gate+up 49.9 / 48.3. H100 (2026-12-05): one token 14336x4096 17.8
# / 14.5, 4 tokens 4096x14336 24.8 / 21.9, 8 tokens 14336x4096 32.5 / 30.3, 4096x14336 28.9 / 36.9, gate+up
# 50.4 / 48.3. 2-token GLU launches (76 against 64 registers, not timed) keep mm_q.
IQ3_GROUPS = "w"
IQ3_GROUPS_CTA_WARPS = 8   # the CTAs CTAS counts (measured with 8 warps; smaller CTAs fill the same waves)
IQ3_GROUPS_CHOICES = {(1, False): ((None, 3), (4, None)), (1, True): ((4, None),), (2, False): ((None, None),),
                      (4, False): ((None, None),), (4, True): ((None, None),), (8, False): ((None, 1),),
                      (8, True): ((None, None),)}


def iq3_groups_variant(tile: int, glu: bool = False) -> tuple[int, int, str]:
    """(tile, RW, IQ3_GROUPS) of the group-loop kernel of a token tile (qmatmul.cu MM_IQ3_KERNEL: dense launches
    the rows of DP4A_VARIANTS, GLU launches two row pairs)."""
    return tile, (4 if glu else DP4A_VARIANTS[tile][0]), IQ3_GROUPS


# group-loop kernels under a minimum of MB CTAs an SM, (tile, RW, IQ3_GROUPS, MB) by GLU, for perf/bench_gpu.py
# --explore: one token under 4 (every build; sm_90: 64 registers), 8 tokens under 2 (the explore build: 128)
EXPLORE_IQ3_GROUPS_MB = {glu: tuple((*iq3_groups_variant(tile, glu), mb) for tile, mb in ((1, 4), (8, 2)))
                         for glu in (False, True)}
# builds of qmatmul.cu / qmatmul_mma.cu (nvcc / NVRTC defines). "default": Q4_K / Q5_K summed as integers over
# their 256-weight blocks before one float tail (qmatmul_types.cuh K4_S = 4, as ggml's own dot); "unit_tails":
# each 64-weight unit its own float tail (K4_S = 1: other bits, the same in all of its kernels; the default until
# 2026-12-05, kept for A/B runs: one-token kernels level, 8-token ones 14-19% and 16-token ones 20-25% slower, 64
# sequences end to end 4-6% faster; kernel_notes.md, "Block sums as the default"). "explore": the default's bits
# with more kernel variants (perf/bench_gpu.py --explore); "mmq_one_token": one-token kernels of the superblock
# types through mm_q's own loop instead of mm_q1's (qmatmul.cu; the same bits)
BUILDS = {"default": (), "explore": ("-DQMM_EXPLORE",), "unit_tails": ("-DK4_S=1",),
          "mmq_one_token": ("-DQMM_MMQ_ONE_TOKEN",)}
MMA_BUILDS = {"default": (), "explore": ("-DMMQ_EXPLORE",), "unit_tails": ("-DK4_S=1",),   # the same, qmatmul_mma.cu
              "mmq_one_token": ()}
EXPLORE_VARIANTS = [(1, 1, 1), (1, 1, 4), (1, 2, 1), (1, 2, 2), (1, 2, 4), (1, 4, 1), (2, 1, 1), (2, 2, 1),
                    (2, 2, 2), (4, 1, 1), (4, 2, 1), (4, 4, 1), (8, 1, 1), (8, 2, 1), (8, 4, 1), (8, 2, 2),
                    (16, 1, 1), (16, 2, 1), (1, 1, PIPE), (1, 2, PIPE), (1, 1, ONE_LOOP), (1, 2, ONE_LOOP),
                    (4, 2, PER_TOKEN), (8, 4, PER_TOKEN)]
EXPLORE_GLU_VARIANTS = [(1, 4, 1), (2, 2, 1), (4, 2, 1), (8, 2, 1), (1, 2, PIPE), (1, 4, PIPE), (1, 2, ONE_LOOP),
                        (1, 4, ONE_LOOP), (8, 4, PER_TOKEN), (4, 4, PER_TOKEN)]   # (tile, RW, G) of GLU kernels there
# (tile, RW, G, MB): kernels of the explore build (dense and GLU) under __launch_bounds__(256, MB); a minimum of
# 1 changes ptxas's register targets as well (Q4_K 4096x14336: 62 registers). The 8-token four-row kernels under a
# minimum of 2 (sm_90: Q4_K 159 -> 128 registers, 48-72 bytes spilled, so two CTAs an SM instead of one;
# IQ3_XXS / Q6_K 100 -> 127-128 at the two CTAs they have anyway): not yet timed on a GPU
EXPLORE_MB_VARIANTS = [(1, 2, 1, 1), (1, 2, 1, 6), (1, 2, 1, 8), (8, 4, 1, 2)]
# float weights: dense 8-token tiles over 4 rows a warp (each activation load serves 4 rows; H200 2026-12-04, F16
# 4096x14336, same bits: 512 tokens 8,452 -> 6,995 us, 64 tokens 1,151 -> 875; 8 rows 7,432 / 954), other tiles
# and GLU one row (pair) a warp
FLOAT_TILE8_ROWS = 4
# the explore build's float kernels of 8-token tiles over this many rows a warp (dense; GLU: half of them gate rows)
EXPLORE_FLOAT_ROWS = (4, 8)
_KNAME = {QType.Q8_0: "q8_0", QType.Q4_0: "q4_0", QType.Q5_0: "q5_0", QType.IQ4_NL: "iq4_nl",
          QType.Q4_K: "q4_k", QType.Q5_K: "q5_k", QType.Q6_K: "q6_k", QType.IQ3_XXS: "iq3_xxs",
          QType.F32: "f32", QType.F16: "f16", QType.BF16: "bf16"}
_FLOAT = frozenset({QType.F32, QType.F16, QType.BF16})
_UNIT = {QType.Q4_K: 64, QType.Q5_K: 64, QType.F32: 8, QType.F16: 8, QType.BF16: 8}   # weights per kernel unit; else 32
XBLOCK = {"q8_0": 32, "q8_k": 256}   # activations per scale


def _one_row(qtype, glu: bool, n_out: int | None, max_rows: int) -> bool:
    """Whether a dense launch over n_out rows (None: many) of a superblock type takes one row a warp: at most
    max_rows rows (ONE_ROW_MAX_ROWS at one token, TWO_TOKEN_ONE_ROW_MAX_ROWS at two)."""
    return not glu and n_out is not None and n_out <= max_rows and QType(int(qtype)) in PER_TOKEN_TYPES


def _launch_warps(n_out: int, rw: int, glu: bool) -> int:
    """Warps of a mat-vec launch (dp4a or float) over n_out rows at RW rows a warp (GLU: n_out / 2 gate rows, RW / 2
    pairs a warp)."""
    return cdiv(n_out // 2, rw // 2) if glu else cdiv(n_out, rw)


def cta_warps(qtype, tile: int) -> int:
    """Warps per CTA of a dp4a or float launch of token tile `tile`: WARPS_PER_CTA, but GRID_TABLE_TILE1_WARPS for
    IQ3_XXS one-token tiles (their CTAs fill a grid table first)."""
    return GRID_TABLE_TILE1_WARPS if (QType(int(qtype)) == QType.IQ3_XXS and tile == 1) else WARPS_PER_CTA


def dp4a_variant(qtype, tile: int, glu: bool = False, n_out: int | None = None, n_tok: int | None = None,
                 n_sm: int | None = None) -> tuple:
    """(tile, RW, G) of the dp4a kernel for a launch of n_tok tokens (None: several tiles) whose token tile is
    `tile` (GLU: RW gate and up rows) over n_out rows (None: many) on a device of n_sm SMs (None: unknown); (tile,
    RW, G, MB) for a kernel under a minimum of MB CTAs an SM (kernel name suffix _m<MB>)."""
    qtype = QType(int(qtype))
    if (tile, glu) in PER_TOKEN_TILES.get(qtype, ()):
        return tile, (DP4A_GLU_ROWS[tile] if glu else DP4A_VARIANTS[tile][0]), PER_TOKEN
    if tile in (1, 2) and _one_row(qtype, glu, n_out, ONE_ROW_MAX_ROWS if tile == 1 else TWO_TOKEN_ONE_ROW_MAX_ROWS):
        return tile, 1, 1
    if qtype == QType.IQ3_XXS and None not in (n_out, n_tok, n_sm) and n_tok <= tile:
        groups = iq3_groups_variant(tile, glu)
        n_ctas = cdiv(_launch_warps(n_out, groups[1], glu), IQ3_GROUPS_CTA_WARPS)
        for mb, ctas in IQ3_GROUPS_CHOICES.get((tile, glu), ()):
            if ctas is None or n_ctas <= n_sm * ctas:
                return groups if mb is None else (*groups, mb)
    if glu:
        rows = DP4A_GLU_TILE1.get(qtype, DP4A_GLU_ROWS[1]) if tile == 1 else DP4A_GLU_ROWS[tile]
        return tile, rows, 1
    rw, g = DP4A_TILE1.get(qtype, DP4A_VARIANTS[1]) if tile == 1 else DP4A_VARIANTS[tile]
    return tile, rw, g


def _split_k_smem(qtype, n_in: int, n_tok: int = 1) -> int:
    """Shared-memory bytes of the split-K kernel's partial terms: a float2 per token and unit, in rounds of 32
    units."""
    return n_tok * cdiv(n_in // _UNIT.get(QType(int(qtype)), 32), 32) * 32 * 8


def split_k(qtype, n_out: int, n_in: int, n_tok: int, glu: bool) -> bool:
    """Whether a launch takes the split-K kernel (1..SPLIT_K_AUTO_TOKENS tokens, few long rows; never GLU; one
    token of a type that takes one row a warp there instead, dp4a_variant)."""
    rounds = _split_k_smem(qtype, n_in) // (32 * 8)
    if n_tok == 1 and _one_row(qtype, glu, n_out, ONE_ROW_MAX_ROWS):
        return False
    return (1 <= n_tok <= min(SPLIT_K_AUTO_TOKENS, SPLIT_K_MAX_TOKENS) and not glu and n_out <= SPLIT_K_MAX_ROWS
            and rounds >= SPLIT_K_MIN_ROUNDS and _split_k_smem(qtype, n_in, n_tok) <= SPLIT_K_SMEM)


@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """A weight matrix on the device: raw (n_out, device_row_bytes) cupy uint8, the file's rows in the type's
    device layout (layouts.py: the GGUF blocks, or the same bytes as aligned field planes)."""
    name: str
    qtype: QType
    n_out: int
    n_in: int
    raw: object


def _check_geometry(qtype, n_out: int, n_in: int) -> int:
    """The file's bytes per row (raises for a shape the kernels do not take)."""
    qtype = check_supported(qtype)
    nbytes = row_nbytes(qtype, n_in)           # raises for n_in not a whole number of blocks
    if n_out < 1 or n_in < 1 or (qtype in _FLOAT and n_in % 8):
        raise ValueError(f"{qtype.name} weight of shape ({n_out}, {n_in}): needs n_out, n_in >= 1 "
                         "(and n_in % 8 == 0 for float types)")
    return nbytes


def upload(w) -> DeviceWeight:
    """w: .name .qtype .n_out .n_in .raw (numpy uint8 (n_out, row_bytes), a memmap is fine) -> DeviceWeight."""
    qtype = check_supported(w.qtype)
    n_out, n_in = int(w.n_out), int(w.n_in)
    nbytes = _check_geometry(qtype, n_out, n_in)
    raw = np.asarray(w.raw)
    if raw.dtype != np.uint8 or raw.shape != (n_out, nbytes):
        raise ValueError(f"{w.name}: raw must be uint8 ({n_out}, {nbytes}), got {raw.dtype} {raw.shape}")
    return DeviceWeight(str(w.name), qtype, n_out, n_in, to_device(qtype, raw, cupy()))


def concat_rows(ws) -> DeviceWeight | None:
    """One weight holding the rows of ws in order (a new device copy), or None unless all share qtype and n_in."""
    ws = list(ws)
    if not ws or any(w.qtype != ws[0].qtype or w.n_in != ws[0].n_in for w in ws):
        return None
    raw = cupy().concatenate([w.raw for w in ws], axis=0)
    return DeviceWeight("+".join(w.name for w in ws), ws[0].qtype, int(raw.shape[0]), ws[0].n_in, raw)


def act_format(qtype) -> str | None:
    """How activations are rounded for this weight type: "q8_0", "q8_k", or None (float activations)."""
    qtype = QType(int(qtype))
    return "q8_0" if qtype in Q8_0_ACT else "q8_k" if qtype in Q8_K_ACT else None


def _keeps_tiles(max_tokens: int, tiles: bool | None) -> bool:
    """Whether ActBuffers keep the tensor-core kernels' chunk-major copy: as `tiles` says, else from
    SMALL_MIN_TOKENS tokens (below it no launch takes mmq or mmqs; small_variant)."""
    return int(max_tokens) >= SMALL_MIN_TOKENS if tiles is None else bool(tiles)


def act_buffers_nbytes(max_tokens: int, max_n_in: int, tiles: bool | None = None) -> int:
    """Device bytes ActBuffers(max_tokens, max_n_in, tiles) allocates (the VRAM plan checks them first)."""
    n = int(max_tokens) * int(max_n_in)
    rows = sum(n + 4 * (int(max_tokens) * (int(max_n_in) // b)) for b in XBLOCK.values())
    return rows + (n + 4 * (n // min(XBLOCK.values())) if _keeps_tiles(max_tokens, tiles) else 0)


class ActBuffers:
    """Preallocated int8 activations and their scales, one set per format (both can be live for one x):
    views(fmt, n, k) -> xq (n, k) int8, xd (n, k / XBLOCK[fmt]) float32, slices of the same buffers each call;
    tiles(fmt, n, k) -> the tensor-core kernel's chunk-major copy of them (act_tiles; see _keeps_tiles)."""

    def __init__(self, max_tokens: int, max_n_in: int, tiles: bool | None = None):
        cp = cupy()
        self.max_tokens, self.max_n_in = int(max_tokens), int(max_n_in)
        n = self.max_tokens * self.max_n_in
        self._xq = {f: cp.empty(n, dtype=cp.int8) for f in XBLOCK}
        self._xd = {f: cp.empty(self.max_tokens * (self.max_n_in // b), dtype=cp.float32) for f, b in XBLOCK.items()}
        # one pair for both formats: a copy lives from act_tiles to the mat-mul launched after it
        self._tiles = ((cp.empty(n, dtype=cp.int8), cp.empty(n // min(XBLOCK.values()), dtype=cp.float32))
                       if _keeps_tiles(self.max_tokens, tiles) else None)

    def _fits(self, fmt: str, n: int, k: int) -> int:
        xb = XBLOCK[fmt]
        if not (0 <= n <= self.max_tokens and 0 < k <= self.max_n_in and k % xb == 0):
            raise ValueError(f"{fmt} activations ({n}, {k}) do not fit ActBuffers({self.max_tokens}, "
                             f"{self.max_n_in}) or k is not a multiple of {xb}")
        return xb

    def views(self, fmt: str, n: int, k: int):
        xb = self._fits(fmt, n, k)
        return self._xq[fmt][:n * k].reshape(n, k), self._xd[fmt][:n * k // xb].reshape(n, k // xb)

    def tiles(self, fmt: str, n: int, k: int):
        """xt (k / 16, n, 16) int8 and xdt (k / XBLOCK[fmt], n) float32."""
        xb = self._fits(fmt, n, k)
        if self._tiles is None:
            raise ValueError(f"ActBuffers({self.max_tokens}, {self.max_n_in}) keeps no tensor-core copy")
        xt, xdt = self._tiles
        return xt[:n * k].reshape(k // 16, n, 16), xdt[:n * k // xb].reshape(k // xb, n)


def _check(name: str, a, shape, dtype, align: int = 1) -> None:
    cp = cupy()
    if not isinstance(a, cp.ndarray) or a.dtype != dtype or a.shape != tuple(shape) or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous cupy {np.dtype(dtype).name} array of shape {tuple(shape)}, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', None)} {getattr(a, 'shape', None)}")
    if a.data.ptr % align:
        raise ValueError(f"{name} must be {align}-byte aligned")


def _x_shape(x) -> tuple[int, int]:
    if getattr(x, "ndim", 0) != 2:
        raise ValueError(f"activations must be 2-D (n, k), got shape {getattr(x, 'shape', None)}")
    return int(x.shape[0]), int(x.shape[1])


def quantize_activations(fmt: str, x, xq, xd) -> None:
    """x (n, k) float32 -> xq (n, k) int8, xd (n, k / XBLOCK[fmt]) float32: ggml's quantize_row_q8_0 / q8_K."""
    if fmt not in XBLOCK:
        raise ValueError(f"unknown activation format {fmt!r}")
    n, k = _x_shape(x)
    xb = XBLOCK[fmt]
    if k % xb:
        raise ValueError(f"{fmt} needs k % {xb} == 0, got k = {k}")
    _check("x", x, (n, k), np.float32)
    _check("xq", xq, (n, k), np.int8)
    _check("xd", xd, (n, k // xb), np.float32)
    n_blocks = n * k // xb
    if n_blocks:
        launch(CU, f"quant_{fmt}", (cdiv(n_blocks, ACT_WARPS),), (32, ACT_WARPS),
               (x, xq, xd, np.int32(n_blocks)))


def chunk_major(fmt: str, xq, xd, tiles: ActBuffers):
    """The tensor-core kernel's copy of rounded activations xq (n, k), xd (n, k / XBLOCK[fmt]) in tiles'
    buffers: xt (k / 16, n, 16) int8, xdt (k / XBLOCK[fmt], n) float32 (qmatmul.cu act_tiles)."""
    n, k = _x_shape(xq)
    xt, xdt = tiles.tiles(fmt, n, k)
    if n:
        launch(CU, "act_tiles", (cdiv(n * (k // 16), ACT_TILE_THREADS),), (ACT_TILE_THREADS,),
               (xq, xd, xt, xdt, np.int32(n), np.int32(k), np.int32(XBLOCK[fmt])))
    return xt, xdt


def _tile(n: int) -> int:
    tile = next((t for t in TOKEN_TILES if t >= n), TOKEN_TILES[-1])
    if cdiv(n, tile) > MAX_GRID_Y:
        raise ValueError(f"{n} tokens exceed one launch ({MAX_GRID_Y * tile} at most)")
    return tile


def _check_weight(w: DeviceWeight) -> int:
    """The weight's row pitch on the device (layouts.device_row_bytes), after checking its array."""
    _check_geometry(w.qtype, w.n_out, w.n_in)
    pitch = device_row_bytes(w.qtype, w.n_in)
    _check("w.raw", w.raw, (w.n_out, pitch), np.uint8, align=16)
    return pitch


def mma_rows(glu: bool) -> int:
    """Output rows per CTA of the tensor-core kernel (GLU: gate rows, each with its up row)."""
    return 16 if glu else 32


def mma_smem(qtype, warps: int, nb: int) -> int:
    """Dynamic shared memory of the tensor-core kernel: two buffers of each warp's staged unit of activations
    (the CTA's tokens x (unit / 4 + 4 padding) words, qmatmul_mma.cu Staged) and their scales."""
    tok = warps * 8 * nb
    words = _UNIT.get(QType(int(qtype)), 32) // 4 + 4
    return 2 * warps * tok * (words + 1) * 4


def tensor_core_variant(n_out: int, n_tok: int, glu: bool = False):
    """(warps per CTA, n8 token tiles per warp) of the tensor-core kernel for this launch, or None where the
    dp4a kernel is faster. Measured on an H200 (perf/bench_gpu.py --gemm, 2026-12-03, kernel_notes.md), µs,
    MMA_WIDEST / MMA_MIDDLE / MMA_NARROW / dp4a: 4096x14336 at 512 tokens IQ3_XXS 631 / 679 / 1,333 / 1,654,
    Q4_K 571 / 608 / 902 / 1,862 (2026-12-04: 492 / 508 / 761 / 1,880), and in their device layouts (layouts.py,
    2026-12-04) Q8_0 412 / 476 / 995 / 2,349, Q6_K 421 / 515 / 1,090 / 1,274; at 128
    tokens IQ3_XXS 199 / 189 / 358 / 425 (half of MMA_WIDEST's tokens padding); at 64 tokens IQ3_XXS 200 / 116
    / 192 / 221, Q4_K 172 / 116 / 126 / 244; 896x4864 Q5_0 at 64 tokens 25.8 / 19.2 (152 CTAs) / 16.2 (304) /
    25.3; 896x896 Q5_0 at 512 tokens 20.0 (112 CTAs) / 19.2 (224) / 20.8 / 35.6, at 64 tokens 19.6 / 18.3 / 9.6
    (56 CTAs) / 6.6. The row length does not enter: rows of 896 and of 4096 weights chose alike."""
    if n_tok < MMA_MIN_TOKENS:
        return None
    row_tiles = cdiv(n_out // 2 if glu else n_out, mma_rows(glu))
    for (warps, nb), least_ctas, least_tokens in MMA_CHOICES:
        if n_tok >= least_tokens and cdiv(n_tok, 8 * nb * warps) * row_tiles >= least_ctas:
            return warps, nb
    return None


def mma_64_variant(qtype, chosen, n_out: int, n_tok: int, glu: bool = False):
    """The tensor-core variant of a launch that tensor_core_variant gave `chosen`: with MMA_64 on and at most
    MMA_64_MAX_TOKENS tokens, the type's candidate for it (MMA_64_CANDIDATES; a 3-tuple (warps, nb, MB)) where
    its grid has at least MMA_64_MIN_CTAS CTAs, else chosen."""
    if not MMA_64 or chosen is None or n_tok > MMA_64_MAX_TOKENS:
        return chosen
    cand = MMA_64_CANDIDATES.get(QType(int(qtype)), {}).get(tuple(chosen))
    if cand is None:
        return chosen
    row_tiles = cdiv(n_out // 2 if glu else n_out, mma_rows(glu))
    return cand if cdiv(n_tok, 8 * cand[1] * cand[0]) * row_tiles >= MMA_64_MIN_CTAS else chosen


def _mma_name(qtype, glu: bool, variant) -> str:
    """Kernel name of a tensor-core variant (warps, nb) or (warps, nb, MB): mmq[glu]_<type>_w<W>_n<NB>[_m<MB>]."""
    warps, nb, *mb = variant
    suffix = f"_m{mb[0]}" if mb and mb[0] else ""
    return f"{'mmqglu' if glu else 'mmq'}_{_KNAME[QType(int(qtype))]}_w{warps}_n{nb}{suffix}"


def _out_args(w: DeviceWeight, n: int, out, bias, accumulate: bool, glu: bool) -> tuple:
    """The kernels' output arguments (y0, y1, y2, c1, c2, bias, acc) from out: one array (n, n_out) or
    (GLU) (n, n_out / 2), or a list of up to 3 arrays (n, width) whose widths add up to n_out (split)."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if glu:
        if w.n_out % 2 or len(outs) != 1 or bias is not None or accumulate:
            raise ValueError("a GLU mat-mul needs an even n_out, one output and no bias or accumulation")
        widths = [w.n_out // 2]
    else:
        if not 1 <= len(outs) <= 3:
            raise ValueError(f"1 to 3 outputs, got {len(outs)}")
        widths = [int(getattr(o, "shape", (0, 0))[-1]) for o in outs]
        if sum(widths) != w.n_out:
            raise ValueError(f"output widths {widths} do not add up to {w.n_out} rows of {w.name}")
    for i, (o, width) in enumerate(zip(outs, widths)):
        _check(f"out[{i}]", o, (n, width), np.float32)
    if bias is not None:
        _check("bias", bias, (w.n_out,), np.float32)
    ends = np.cumsum(widths)
    c1 = int(ends[0]) if len(outs) > 1 else w.n_out
    c2 = int(ends[1]) if len(outs) > 2 else w.n_out
    ys = outs + [outs[0]] * (3 - len(outs))        # unused pointers: never written (c1 = c2 = n_out)
    return (*ys, np.int32(c1), np.int32(c2), np.uint64(0) if bias is None else bias, np.int32(bool(accumulate)))


def small_variant(qtype, n_out: int, n_tok: int, glu: bool = False):
    """Below MMA_MIN_TOKENS: ("small", NK) for the small-token tensor-core kernel, ("mma", MMA_NARROW) for
    mmq's narrow variant, or None (the dp4a kernel), as measured (SMALL_TYPES' and SMALL_MIN_CTAS' comments)."""
    if not SMALL_MIN_TOKENS <= n_tok < MMA_MIN_TOKENS:
        return None
    row_tiles = cdiv(n_out // 2 if glu else n_out, mma_rows(glu))
    if n_tok >= NARROW_MIN_TOKENS and row_tiles >= NARROW_MIN_CTAS:
        return "mma", MMA_NARROW
    if QType(int(qtype)) in SMALL_TYPES and row_tiles >= SMALL_MIN_CTAS:
        return "small", SMALL_WARPS[1] if n_tok <= SMALL_WIDE_MAX_TOKENS else SMALL_WARPS[0]
    return None


def matmul_prequantized(w: DeviceWeight, xq, xd, out, kernel: str = "auto", mma=None, bias=None,
                        accumulate: bool = False, glu: bool = False, variant=None, build: str = "default",
                        tiles: ActBuffers | None = None, small: int | None = None) -> None:
    """out = x @ W.T from x already quantized to act_format(w.qtype): xq (n, w.n_in) int8 (16-byte
    aligned), xd (n, w.n_in / XBLOCK) float32. out: (n, w.n_out) float32, or a list of arrays splitting
    the rows (see _out_args); bias (n_out,) is added, accumulate adds to what out holds (residual); glu:
    W holds gate rows then up rows and out (n, n_out / 2) gets silu(gate) * up.
    kernel: "auto" (tensor_core_variant decides), "dp4a", "mma" or "small" (tests and benchmarks compare them:
    the results are the same bits); small: the small-token tensor-core kernel's warps (SMALL_WARPS; None: the
    first); mma: the tensor-core kernel's variant, one of MMA_VARIANTS (None: as
    tensor_core_variant says, else MMA_NARROW); variant (benchmarks): the dp4a kernel's (tile, RW, G), from the kernels of
    `build` (BUILDS; the small-token kernel's from MMA_BUILDS[build], whose "explore" build adds the types of
    SMALL_EXPLORE_WARPS), or "sk" for the split-K kernel (up to SPLIT_K_MAX_TOKENS tokens; split_k says when
    "auto" takes it). tiles: the ActBuffers whose tiles() take the tensor-core kernel's chunk-major copy of
    xq and xd (None: a new one, allocated here; the engine passes its workspace)."""
    fmt = act_format(w.qtype)
    if fmt is None:
        raise ValueError(f"{w.qtype.name} weights take float activations: use matmul")
    pitch = _check_weight(w)
    n, _ = _x_shape(xq)
    _check("xq", xq, (n, w.n_in), np.int8, align=16)
    _check("xd", xd, (n, w.n_in // XBLOCK[fmt]), np.float32)
    outs = _out_args(w, n, out, bias, accumulate, glu)
    qtype = QType(int(w.qtype))
    mma_ok = () if mma is None else MMA_VARIANTS + tuple(MMA_64_CANDIDATES.get(qtype, {}).values())
    if kernel not in ("auto", "dp4a", "mma", "small") or (mma is not None and tuple(mma) not in mma_ok):
        raise ValueError(f"kernel must be auto, dp4a, mma or small and mma one of {mma_ok or MMA_VARIANTS}, got "
                         f"{kernel!r}, {mma!r}")
    nk = small or SMALL_WARPS[0]
    if kernel == "small" and not ((qtype in SMALL_TYPES and nk in SMALL_WARPS)
                                  or (build == "explore" and nk in SMALL_EXPLORE_WARPS.get(qtype, ()))):
        raise ValueError(f"the small-token kernel takes {sorted(t.name for t in SMALL_TYPES)} and small in "
                         f"{SMALL_WARPS} (build='explore' also {sorted(t.name for t in SMALL_EXPLORE_WARPS)}), "
                         f"got {w.qtype.name}, {small!r} and build={build!r}")
    if n == 0:
        return
    weight = (w.raw, np.int32(pitch), np.int32(w.n_out), np.int32(w.n_in))
    args = (*weight, xq, xd, np.int32(n), *outs)
    chosen = mma_64_variant(w.qtype, tensor_core_variant(w.n_out, n, glu), w.n_out, n, glu)
    if kernel == "auto" and variant is None and chosen is None:
        picked = small_variant(w.qtype, w.n_out, n, glu)
        if picked is not None:
            kernel = picked[0]
            nk, mma = (picked[1], None) if kernel == "small" else (nk, picked[1])
    if kernel == "small":
        n_rows = w.n_out // 2 if glu else w.n_out
        xt, xdt = chunk_major(fmt, xq, xd, tiles or ActBuffers(n, w.n_in, tiles=True))
        launch(CU_MMA, f"{'mmqsglu' if glu else 'mmqs'}_{_KNAME[w.qtype]}_w{nk}",
               (cdiv(n, SMALL_TILE), cdiv(n_rows, mma_rows(glu))), (32, nk), (*weight, xt, xdt, np.int32(n), *outs),
               options=MMA_BUILDS[build])
        return
    name = _KNAME[w.qtype]
    if kernel == "mma" or (kernel == "auto" and chosen and variant is None):
        picked = tuple(mma or chosen or MMA_NARROW)
        warps, nb = picked[:2]
        rows = mma_rows(glu)
        n_rows = w.n_out // 2 if glu else w.n_out
        if cdiv(n_rows, rows) > MAX_GRID_Y:
            raise ValueError(f"{w.n_out} output rows exceed one launch ({MAX_GRID_Y * rows} at most)")
        xt, xdt = chunk_major(fmt, xq, xd, tiles or ActBuffers(n, w.n_in, tiles=True))
        launch(CU_MMA, _mma_name(w.qtype, glu, picked),
               (cdiv(n, 8 * nb * warps), cdiv(n_rows, rows)), (32, warps), (*weight, xt, xdt, np.int32(n), *outs),
               shared_mem=mma_smem(w.qtype, warps, nb), options=MMA_BUILDS[build])
        return
    if variant == "sk" or (variant is None and split_k(w.qtype, w.n_out, w.n_in, n, glu)):
        smem = _split_k_smem(w.qtype, w.n_in, n)
        if n > SPLIT_K_MAX_TOKENS or glu or smem > SPLIT_K_SMEM:
            raise ValueError(f"the split-K kernel takes at most {SPLIT_K_MAX_TOKENS} tokens, no GLU, and at most "
                             f"{SPLIT_K_SMEM // 8} (token, unit) pairs")
        launch(CU, f"mmsk_{name}", (w.n_out,), (32, SPLIT_K_WARPS), args, shared_mem=smem, options=BUILDS[build])
        return
    tile, rw, g, *mb = variant if variant is not None else dp4a_variant(w.qtype, _tile(n), glu, w.n_out, n,
                                                                       sm_count(w.raw.device.id))
    kname = f"{'mmglu' if glu else 'mm'}_{name}_t{tile}_r{rw}_g{g}" + "".join(f"_m{b}" for b in mb)
    warps, cta = _launch_warps(w.n_out, rw, glu), cta_warps(w.qtype, tile)
    launch(CU, kname, (cdiv(warps, cta), cdiv(n, tile)), (32, cta), args,
           options=BUILDS[build])


def matmul(w: DeviceWeight, x, out, act: ActBuffers, bias=None, accumulate: bool = False, glu: bool = False,
           rows: int | None = None, build: str = "default") -> None:
    """out = x @ W.T, x (n, w.n_in) float32 (16-byte aligned); out, bias, accumulate, glu as
    matmul_prequantized. Quantized weights first round x into act's buffers (ggml's activation
    rounding), float weights use x as it is. rows (float weights, build="explore"): a kernel of 8-token tiles
    over that many rows a warp (EXPLORE_FLOAT_ROWS), the default kernel's bits."""
    fmt = act_format(w.qtype)
    n, _ = _x_shape(x)
    if rows is not None and (fmt is not None or build != "explore" or rows not in EXPLORE_FLOAT_ROWS):
        raise ValueError(f"rows takes float weights, build='explore' and one of {EXPLORE_FLOAT_ROWS}, got "
                         f"{w.qtype.name}, build={build!r}, rows={rows!r}")
    if fmt is not None:
        xq, xd = act.views(fmt, n, w.n_in)
        quantize_activations(fmt, x, xq, xd)
        matmul_prequantized(w, xq, xd, out, bias=bias, accumulate=accumulate, glu=glu, tiles=act)
        return
    pitch = _check_weight(w)
    _check("x", x, (n, w.n_in), np.float32, align=16)
    outs = _out_args(w, n, out, bias, accumulate, glu)
    if n == 0:
        return
    tile = TOKEN_TILES[-1] if rows else _tile(n)
    rw = rows or (2 if glu else FLOAT_TILE8_ROWS if tile == TOKEN_TILES[-1] else 1)
    warps, cta = _launch_warps(w.n_out, rw, glu), cta_warps(w.qtype, tile)
    launch(CU, f"{'mmglu' if glu else 'mm'}_{_KNAME[w.qtype]}_t{tile}" + (f"_r{rows}" if rows else ""),
           (cdiv(warps, cta), cdiv(n, tile)), (32, cta),
           (w.raw, np.int32(pitch), np.int32(w.n_out), np.int32(w.n_in), x, np.int32(n), *outs), options=BUILDS[build])


def dequant_rows(w: DeviceWeight, ids, out) -> None:
    """out (m, w.n_in) float32 = rows ids (m,) int32 of W as floats (embedding lookup), bit-exact with
    gguf.quants.dequantize; an id outside [0, n_out) gives a row of NaN (ids stay on the device: not checked here)."""
    pitch = _check_weight(w)
    if getattr(ids, "ndim", 0) != 1:
        raise ValueError("ids must be 1-D")
    m = int(ids.shape[0])
    _check("ids", ids, (m,), np.int32)
    _check("out", out, (m, w.n_in), np.float32, align=16)
    if m == 0:
        return
    units = w.n_in // _UNIT.get(w.qtype, 32)
    launch(CU, f"dq_{_KNAME[w.qtype]}", (m, cdiv(units, DQ_THREADS)), (DQ_THREADS,),
           (w.raw, np.int32(pitch), np.int32(w.n_out), np.int32(w.n_in), ids, out))
