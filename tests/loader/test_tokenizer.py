"""Tokenizer tests: the golden llama.cpp cases on the default model (Qwen2.5-Coder-0.5B, "gpt2" BPE,
pre "qwen2") and small synthetic vocabularies (BPE and SentencePiece).

Where llama.cpp and transformers disagree (tests/data/README of the golden set: 3 cases, all from
llama.cpp re-typing tokens), the expected answer is transformers'; see loader/tokenizer.py."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import read_metadata
from strata_lite.loader.tokenizer import Tokenizer
from strata_lite.loader.tokenizer_bpe import _bytes_to_unicode

DATA = Path(__file__).resolve().parent.parent / "data"
TOKENIZE = json.loads((DATA / "tokenize.json").read_text(encoding="utf-8"))["cases"]
DETOKENIZE = json.loads((DATA / "detokenize.json").read_text(encoding="utf-8"))["cases"]

# The documented llama.cpp / transformers disagreements (golden README, "llama.cpp vs transformers").
HF_TOKENIZE_CASES = {"eos_s_parsed"}
HF_DETOKENIZE_CASES = {("eos_s_token_128247", False), ("unused_pad_tokens", False),
                       ("unused_pad_tokens", True)}

_cache: dict[str, Tokenizer] = {}


@pytest.fixture
def tok(default_model_path) -> Tokenizer:
    path = str(default_model_path)
    if path not in _cache:
        _cache[path] = Tokenizer.from_gguf_metadata(read_metadata(path), Path(path).name)
    return _cache[path]


# ----------------------------------------------------------------------------- golden data

def test_golden_disagreements_are_the_documented_ones():
    assert {c["name"] for c in TOKENIZE if not c["hf_transformers_ids_agree"]} == HF_TOKENIZE_CASES
    found = {(c["name"], sp) for c in DETOKENIZE for sp, key in ((False, "special_false"), (True, "special_true"))
             if not c[key]["hf_transformers_decode_agrees"]}
    assert found == HF_DETOKENIZE_CASES


@pytest.mark.parametrize("case", TOKENIZE, ids=[c["name"] for c in TOKENIZE])
def test_tokenize_golden(tok, case):
    ids = tok.encode(case["text"], add_special=case["add_special"], parse_special=case["parse_special"])
    if case["name"] in HF_TOKENIZE_CASES:
        # llama.cpp re-types the normal token 128247 "</s>" as control; transformers (and we) don't.
        assert ids == case["hf_transformers_ids"]
        assert ids != case["ids"]
    else:
        assert ids == case["ids"]


@pytest.mark.parametrize("special", [False, True], ids=["special_false", "special_true"])
@pytest.mark.parametrize("case", DETOKENIZE, ids=[c["name"] for c in DETOKENIZE])
def test_detokenize_golden(tok, case, special):
    ref = case["special_true" if special else "special_false"]
    got = tok.decode_bytes(case["ids"], special=special)
    if (case["name"], special) in HF_DETOKENIZE_CASES:
        assert got == ref["hf_transformers_decode"].encode("utf-8")
        assert tok.decode(case["ids"], special=special) == ref["hf_transformers_decode"]
    else:
        assert got == bytes.fromhex(ref["bytes_hex"])
        assert tok.decode(case["ids"], special=special) == ref["text"]


def test_vocabulary_facts(tok):
    assert tok.n_vocab == 151936
    assert (tok.bos_id, tok.eos_id) == (151643, 151645)
    assert (tok.add_bos, tok.add_eos) == (False, False)
    # llama.cpp's EOG list minus 128247 "</s>", a normal token in this vocabulary (transformers view).
    assert tok.eog_ids == frozenset({151643, 151645, 151662, 151663, 151664})
    assert tok.is_eog(151645) and not tok.is_eog(128247)


def test_token_text(tok):
    assert tok.token_text(151645) == "<|im_end|>"
    assert tok.token_text(1879) == " world"
    assert tok.token_text(151657) == "<tool_call>"
    assert tok.token_bytes(82912) == "龘".encode()[:2]  # first byte-token of 龘 (a partial character)
    assert tok.token_text(82912) == "\ufffd"


def test_heapq_roundtrip_and_speed(tok):
    src = (DATA / "heapq.py").read_text(encoding="utf-8")
    tok.encode("warm up")
    t0 = time.perf_counter()
    ids = tok.encode(src, add_special=False)
    elapsed = time.perf_counter() - t0
    assert len(ids) == 6143  # golden README (perplexity method)
    assert tok.decode(ids) == src
    assert elapsed < 1.0, f"encoding 23 KB took {elapsed:.2f} s"


def test_bad_input(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])
    with pytest.raises(ValueError):
        tok.decode([-1])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    assert tok.decode(np.array([9707, 11], dtype=np.int32)) == "Hello,"


# ----------------------------------------------------------------------------- synthetic BPE

def _bpe_meta(pre="default", extra_merges=(), **extra):
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []

    def add(left, right):
        merges.append(f"{left} {right}")
        tokens.append(left + right)

    sp = b2u[ord(" ")]
    add("h", "e"); add("l", "l"); add("he", "ll"); add("hell", "o"); add(sp, "w"); add("o", "r")
    add(sp + "w", "or"); add(sp + "wor", "l"); add(sp + "worl", "d")
    for m in extra_merges:
        add(*m.split(" "))
    types = [1] * len(tokens)
    tokens += ["<s>", "</s>", "<tool>", "[PAD1]"]
    types += [3, 3, 4, 5]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": len(tokens) - 4, "tokenizer.ggml.eos_token_id": len(tokens) - 3}
    meta.update(extra)
    return meta


def test_synthetic_bpe():
    tk = Tokenizer.from_gguf_metadata(_bpe_meta(), "tiny.gguf")
    ids = {t: i for i, t in enumerate(_bpe_meta()["tokenizer.ggml.tokens"])}
    bos, eos, tool, pad = ids["<s>"], ids["</s>"], ids["<tool>"], ids["[PAD1]"]
    hello, world = ids["hello"], ids["Ġworld"]
    assert tk.encode("hello world") == [hello, world]  # add_bos defaults to False for "gpt2"
    # byte tokens have id = byte value here; the user-defined <tool> is matched without parse_special
    got = tk.encode("hello<s><tool>é", parse_special=False)
    assert got == [hello, ord("<"), ord("s"), ord(">"), tool, 0xC3, 0xA9]
    assert tk.decode(got) == "hello<s><tool>é"
    got = tk.encode("<s>hello</s>", parse_special=True)
    assert got == [bos, hello, eos]
    assert tk.decode(got) == "hello" and tk.decode(got, special=True) == "<s>hello</s>"
    assert tk.decode([pad]) == "[PAD1]"
    assert tk.eog_ids == {eos}

    tk2 = Tokenizer.from_gguf_metadata(_bpe_meta(**{"tokenizer.ggml.add_bos_token": True,
                                                   "tokenizer.ggml.add_eos_token": True}))
    assert tk2.encode("hello") == [bos, hello, eos]
    assert tk2.encode("hello", add_special=False) == [hello]
    assert tk2.encode("") == [bos, eos]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "llama3", "gpt2"])
def test_synthetic_bpe_pre_tokenizers(pre):
    tk = Tokenizer.from_gguf_metadata(_bpe_meta(pre))
    text = "hello world 12345  \n\n x's"
    assert tk.decode(tk.encode(text)) == text


def test_digit_splitting_differs_by_pre():
    extra = ["1 2", "12 3"]  # tokens "12", "123"
    for pre, want in (("qwen2", [ord("1"), ord("2"), ord("3")]), ("llama3", ["123"]), ("default", ["123"])):
        meta = _bpe_meta(pre, extra_merges=extra)
        ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
        tk = Tokenizer.from_gguf_metadata(meta)
        assert tk.encode("123") == [ids[w] if isinstance(w, str) else w for w in want], pre


def test_unknown_pre_names_file_and_field():
    with pytest.raises(GGUFError, match=r"tiny\.gguf.*tokenizer\.ggml\.pre.*'bogus'"):
        Tokenizer.from_gguf_metadata(_bpe_meta("bogus"), "tiny.gguf")


def test_missing_or_bad_fields():
    meta = _bpe_meta()
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(GGUFError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")
    with pytest.raises(GGUFError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    with pytest.raises(GGUFError, match="tokenizer.ggml.model is missing"):
        Tokenizer.from_gguf_metadata({}, "x.gguf")
    with pytest.raises(GGUFError, match="bos_token_id"):
        Tokenizer.from_gguf_metadata(_bpe_meta(**{"tokenizer.ggml.bos_token_id": 10**6}), "x.gguf")


# ----------------------------------------------------------------------------- synthetic SentencePiece

def _spm_meta(**extra):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = {  # piece: score (higher merges first)
        "▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
        "a": -2.0, "b": -2.0, "c": -2.0,
        "he": -3.0, "ll": -3.5, "hell": -4.0, "hello": -4.5, "▁hello": -5.0,
        "or": -3.0, "▁w": -3.2, "▁wor": -4.0, "▁worl": -4.2, "▁world": -4.4,
        "ab": -6.0, "bc": -5.5,  # "abc" -> "a" + "bc": the higher-scored pair merges first
    }
    tokens += list(pieces)
    types += [1] * len(pieces)
    scores = np.array([0.0] * 259 + list(pieces.values()), dtype=np.float32)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32), "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    meta.update(extra)
    return meta


def test_synthetic_spm():
    meta = _spm_meta()
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tk = Tokenizer.from_gguf_metadata(meta, "spm.gguf")
    assert tk.add_bos and not tk.add_eos  # SentencePiece default: BOS
    assert tk.encode("hello world") == [1, ids["▁hello"], ids["▁world"]]
    assert tk.encode("hello world", add_special=False) == [ids["▁hello"], ids["▁world"]]
    assert tk.decode(tk.encode("hello world")) == "hello world"
    assert tk.decode(tk.encode("hello world"), special=True) == "<s> hello world"
    # byte fallback for characters no piece covers
    got = tk.encode("hé", add_special=False)
    assert got == [ids["▁"], ids["h"], ids["<0xC3>"], ids["<0xA9>"]]
    assert tk.decode(got) == "hé"
    assert tk.decode(got[:-1]) == "h\ufffd" and tk.decode_bytes(got[:-1]) == b"h\xc3"
    # score order, not left-to-right
    assert tk.encode("abc", add_special=False) == [ids["▁"], ids["a"], ids["bc"]]
    # special tokens; a space prefix after each special token, as at the start
    assert tk.encode("</s>hello", add_special=False, parse_special=True) == [2, ids["▁hello"]]
    assert tk.encode("</s>", add_special=False, parse_special=False) == [
        ids["▁"], ids["<0x3C>"], ids["<0x2F>"], ids["<0x73>"], ids["<0x3E>"]]
    assert tk.eog_ids == {2}
    assert tk.decode([ids["▁hello"]], strip_space_prefix=False) == " hello"


def test_synthetic_spm_without_space_prefix():
    tk = Tokenizer.from_gguf_metadata(_spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    ids = {t: i for i, t in enumerate(_spm_meta()["tokenizer.ggml.tokens"])}
    assert tk.encode("hello world", add_special=False) == [ids["hello"], ids["▁world"]]
    assert tk.decode(tk.encode(" hello", add_special=False)) == " hello"


def test_spm_needs_scores():
    meta = _spm_meta()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(GGUFError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(meta, "spm.gguf")
