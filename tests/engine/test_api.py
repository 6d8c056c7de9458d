"""The public API on tiny models written with GGUFWriter, against a float64 numpy forward pass."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM, InvalidRequest
from reference_model import reference_logits
from tiny_model import write_tiny_model

# Bounds as fractions of the logit range; measured values, margins and reasons: docs/bounds.md.
# The reference rounds activations and K/V to int8 as the engine does and computes the rest in float64;
# the engine computes in float32, so the logits agree to 1.8e-7 .. 4.0e-7 here (6.4e-7 at most over 8
# weight seeds). 1e-4 also admits the smallest measured rounding flip (4.4e-5), while a wrong rope,
# mask, bias or GQA mapping moves logits by several percent.
REL_TOL = 1e-4
# With the int8 kernels (an AVX2 CPU) every token's logits are independent of what shares its forward
# (docs/bounds.md, "Batch invariance"): a cached prefix, another chunking and decoding beside other
# sequences give bit-identical logits. Without them (STRATA_LITE_INT8=0, or no AVX2) prompt chunks of
# more than 8 tokens take dequantize + BLAS, whose summation order follows the chunk's size; that can
# flip an int8 rounding (activation or KV) by one step = 1/127 of its block's largest value, which the
# random tiny models amplify to ~1-2% of the logit range (measured up to 1.44e-2).
FLIP_TOL = 0.03


def _same_as(tiny, got, want):
    """Bit-identical where the backend is batch-invariant, else within FLIP_TOL of the logit range."""
    if tiny.backend.int8:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=FLIP_TOL * np.abs(want).max())


# "qwen2-Q5_0-v8": q, k and the rest Q5_0, v Q8_0, as the default model's Q4_K_M file has some blocks (the
# engine then fuses q and k only)
@pytest.fixture(scope="module", params=[("qwen2", QT.Q8_0), ("qwen3", QT.Q4_K), ("llama", QT.Q5_0),
                                        ("qwen2", QT.IQ3_XXS), ("llama", QT.Q5_K),   # IQ3_XXS, Q5_K: repacked
                                        ("qwen2", QT.Q5_0, "v8")],                   # for the int8 kernel (AVX2)
                ids=lambda p: "-".join([p[0], p[1].name, *p[2:]]))
def tiny(request, tmp_path_factory):
    arch, qtype = request.param[:2]
    n_embd = 256 if qtype in (QT.Q4_K, QT.IQ3_XXS, QT.Q5_K) else 64
    path = write_tiny_model(tmp_path_factory.mktemp(arch) / "m.gguf", arch=arch, qtype=qtype, n_embd=n_embd,
                            n_ff=256, n_heads=4, n_kv_heads=2,
                            qtype_of={"attn_v": QT.Q8_0} if request.param[2:] == ("v8",) else None)
    return LLM(str(path), backend="cpu", n_ctx=256)


def _close(ours, ref):
    spread = np.abs(ref).max()
    return np.abs(ours - ref).max() <= REL_TOL * spread


def test_logits_match_float64_reference(tiny):
    ids = [5, 17, 200, 3, 99, 42, 7, 7, 120, 64, 33]
    ours = tiny.logits(ids)
    assert ours.shape == (len(ids), tiny.config.n_vocab) and ours.dtype == np.float32
    assert _close(ours, reference_logits(tiny.config, tiny.weights, ids, k_scales=tiny.model.k_scales))


def test_matrices_that_read_the_same_input_are_fused(tiny):
    layer = tiny.model.layers[0]
    # a Q8_0 v beside Q5_0 q and k: other blocks with the int8 kernels; without them all three are Q8_0 blocks
    v8 = tiny.weights.layers[0].attn_v.qtype != tiny.weights.layers[0].attn_q.qtype and tiny.backend.int8
    assert (layer.qkv is None) == v8 and (layer.qk is not None) == v8     # q+k+v, else q+k beside v
    assert layer.gate_up is not None


def test_cached_prefix_gives_the_same_logits(tiny):
    ids = list(range(30, 90))
    full = tiny.logits(ids)
    tiny.eval(ids[:23], 0, [])                      # fill the cache with a prefix
    rest = tiny.eval(ids[23:], 23, np.arange(len(ids) - 23))
    _same_as(tiny, rest, full[23:])


def test_chunked_prompt_equals_one_pass(tiny):
    ids = list(range(1, 140))
    one = tiny.logits(ids)
    tiny.n_batch = 32
    try:
        chunked = tiny.logits(ids)
    finally:
        tiny.n_batch = 512
    _same_as(tiny, chunked, one)


def test_generate_greedy_is_the_argmax_chain(tiny):
    prompt = [10, 20, 30]
    out = tiny.generate(prompt, max_tokens=6, temperature=0.0)
    seq = list(prompt)
    for t in out.token_ids:
        assert t == int(np.argmax(tiny.logits(seq)[-1]))
        seq.append(t)
    assert out.finish_reason in ("length", "stop") and out.n_prompt_tokens == 3


def test_sampling_seed_reproducible(tiny):
    a = tiny.generate([1, 2, 3], max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = tiny.generate([1, 2, 3], max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids


def test_bad_input_raises_invalid_request(tiny):
    with pytest.raises(InvalidRequest, match="empty"):
        tiny.logits([])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        tiny.logits([10 ** 7])
    with pytest.raises(InvalidRequest, match="more than n_ctx"):
        tiny.logits([1] * 257)
    with pytest.raises(InvalidRequest, match="top_p"):
        tiny.generate([1], temperature=1.0, top_p=0.0)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        tiny.generate([1], max_tokens=0)


def test_text_prompt_and_chat_template(tiny):
    prompt = tiny.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny.tokenize(prompt, parse_special=True)
    assert ids[0] == tiny.tokenizer.encode("<|im_start|>", parse_special=True)[0]
    assert tiny.detokenize(tiny.tokenize("hello world")) == "hello world"
    out = tiny.generate(prompt, max_tokens=4)
    assert len(out.token_ids) <= 4 and out.n_prompt_tokens == len(ids)
