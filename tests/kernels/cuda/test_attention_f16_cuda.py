"""The f16 flash-attention prompt path (kernels/cuda/attention_f16.py) against the float64 reference on the same
int8 cache, within reference.f16_flash_bound (q', K, V and the weights rounded to f16) plus the float32 terms of
test_attention_cuda.py (1e-5 of each output and of the largest); and a token's output the same bits whichever
launch (other tokens, CTA, row slot) it is read in.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # tests/kernels: reference.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as ref  # noqa: E402
from test_attention_cuda import Cache, RTOL  # noqa: E402

pytestmark = pytest.mark.gpu

# (n_heads, n_kv, head_dim): the 8B layer shape's heads and the 0.5B model's (7 query heads a kv head: 64-pair
# CTAs then hold parts of tokens)
SHAPES = [(32, 8, 128), (14, 2, 64)]


def run_f16(c, q, seq, pos, n_keys):
    from strata_lite.kernels.cuda.attention_f16 import prompt_attention_f16
    cp = c.cp
    out = cp.full(q.shape, np.nan, cp.float32)
    prompt_attention_f16(cp.asarray(q), seq, cp.asarray(np.asarray(pos, np.int32)), c.dpt, *c.dev,
                         q.shape[-1] ** -0.5, out, n_keys)
    return out.get()


@pytest.mark.parametrize("n_heads,n_kv,hd", SHAPES)
@pytest.mark.parametrize("amp", [1.0, 4.0])
def test_against_float64(n_heads, n_kv, hd, amp):
    """A 100-token chunk of sequence 1 at positions 600..699 (pages out of order, another sequence in the cache;
    keys crossing 64-key tiles, a chunk not a multiple of the CTA's 64 pairs); amp 4: K x 4, a sharp softmax."""
    import cupy as cp
    rng = np.random.default_rng(hd + n_heads + int(amp))
    c = Cache(cp, rng, [300, 700], n_kv, hd, amp=amp)
    pos = np.arange(600, 700, dtype=np.int32)
    seq = np.ones_like(pos)
    q = rng.standard_normal((len(pos), n_heads, hd)).astype(np.float32) * np.float32(amp)
    got = run_f16(c, q, 1, pos, 700)
    assert np.all(np.isfinite(got))
    scale = hd ** -0.5
    want = ref.attention(q, seq, pos, c.pt, *c.host, scale)
    bound = ref.f16_flash_bound(q, seq, pos, c.pt, *c.host, scale)
    ref.assert_within(got, want, RTOL, RTOL * np.abs(want).max() + bound)


@pytest.mark.parametrize("n_heads,n_kv,hd", SHAPES)
def test_each_token_its_own_bits(n_heads, n_kv, hd):
    """A chunk read in one launch, and split in two launches at a point that moves every later token to another
    CTA and row slot, and a short prefix alone: the same bits for every token."""
    import cupy as cp
    rng = np.random.default_rng(7 * hd + n_heads)
    c = Cache(cp, rng, [500], n_kv, hd)
    pos = np.arange(400, 500, dtype=np.int32)
    q = rng.standard_normal((len(pos), n_heads, hd)).astype(np.float32)
    whole = run_f16(c, q, 0, pos, 500)
    first = run_f16(c, q[:37], 0, pos[:37], 437)
    rest = run_f16(c, q[37:], 0, pos[37:], 500)
    np.testing.assert_array_equal(np.concatenate([first, rest]).view(np.uint32), whole.view(np.uint32))
