"""Fuzzing the tokenizer: random Unicode, special-token soup, lone surrogates, huge repeated strings and
random token ids through encode/decode (parse_special on and off), on the tiny model's byte-level BPE,
the default model's (Qwen2.5, 152K tokens) and a synthetic SentencePiece vocabulary; and corrupt
tokenizer metadata. Only the documented errors: ValueError for a lone surrogate or an id outside the
vocabulary, GGUFError for metadata.

hypothesis rather than atheris (see test_fuzz_gguf.py's docstring), seeded (derandomize=True).
Encoding is linear in the text (checked once by hand: 200K spaces, newlines, digits or emoji take
0.2-0.8 s on Qwen's vocabulary); the huge-string cases here use 100K characters.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import read_metadata
from strata_lite.loader.tokenizer import Tokenizer
from test_tokenizer import _bpe_meta, _spm_meta
from tiny_model import write_tiny_model

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</s>", "<s>", "<tool>", "<|", "|>",
          "hello", " world", "\u2581", "Ġ", " ", "\n", "\r\n", "\t", "é", "\u00a0", "中文", "😀", "\u200d",
          "\x00", "\ufffd", "\U0010ffff", "'s", "123"]
TEXT = st.one_of(st.text(max_size=80), st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
                 st.binary(max_size=60).map(lambda b: b.decode("utf-8", errors="replace")))


@pytest.fixture(scope="module", params=["tiny-bpe", "qwen", "spm"])
def tok(request, tmp_path_factory):
    if request.param == "tiny-bpe":
        meta = read_metadata(write_tiny_model(tmp_path_factory.mktemp("tok") / "t.gguf", n_layers=1))
    elif request.param == "qwen":
        meta = read_metadata(request.getfixturevalue("default_model_path"))
    else:
        meta = _spm_meta()
    return Tokenizer.from_gguf_metadata(meta, request.param)


@FUZZ
@given(text=TEXT, add_special=st.booleans(), parse_special=st.booleans())
def test_encode_decode(tok, text, add_special, parse_special):
    ids = tok.encode(text, add_special=add_special, parse_special=parse_special)
    assert all(type(i) is int and 0 <= i < tok.n_vocab for i in ids)
    if tok.kind == "bpe" and not add_special:      # byte-level BPE is lossless
        assert tok.decode(ids, special=True) == text
    elif tok.kind == "spm" and not add_special and not parse_special and "\u2581" not in text:
        # the first piece's space prefix is stripped, and with it a space the text began with
        assert tok.decode(ids) == text.lstrip(" ") or tok.decode(ids) == text
    assert isinstance(tok.decode(ids), str)


@FUZZ
@given(st.data())
def test_decode_random_ids(tok, data):
    """Any ids in the vocabulary decode (invalid UTF-8 from byte tokens becomes U+FFFD)."""
    ids = data.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=40))
    special = data.draw(st.booleans())
    raw = tok.decode_bytes(ids, special)
    assert tok.decode(ids, special) == raw.decode("utf-8", errors="replace")
    for i in ids[:5]:
        assert isinstance(tok.token_text(i), str)


@FUZZ
@given(bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=10**6)), at=st.integers(0, 3))
def test_ids_outside_the_vocabulary(tok, bad, at):
    ids = [0, 1, 2]
    ids.insert(at, bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode(ids)


@FUZZ
@given(head=st.text(max_size=10), surrogate=st.integers(0xD800, 0xDFFF), tail=st.text(max_size=10),
       parse_special=st.booleans())
def test_lone_surrogates(tok, head, surrogate, tail, parse_special):
    """A lone surrogate (a command line's undecodable bytes) used to raise tokenizers'
    "TypeError: TextInputSequence must be str"."""
    with pytest.raises(ValueError, match=f"lone surrogate U\\+{surrogate:04X} at character {len(head)}"):
        tok.encode(head + chr(surrogate) + tail, parse_special=parse_special)


@settings(FUZZ, max_examples=6)
@given(unit=st.sampled_from(["a", " ", "\n", " \n", "1", "😀", "<|im_start|>", "ab ", "\u2581"]),
       parse_special=st.booleans())
def test_huge_repeated_strings(tok, unit, parse_special):
    text = unit * (100_000 // len(unit))
    ids = tok.encode(text, add_special=False, parse_special=parse_special)
    assert 0 < len(ids) <= len(text.encode("utf-8")) + 1
    assert len(tok.decode(ids, special=True)) >= len(text) // 2


# ------------------------------------------------------------------------------ corrupt metadata

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                 st.lists(st.one_of(st.integers(-5, 300), st.text(max_size=4)), max_size=6),
                 st.builds(np.array, st.lists(st.integers(-3, 300), max_size=6)),
                 st.builds(lambda x: np.array(x, dtype=np.float32), st.lists(st.floats(-1, 1), max_size=6)))
KEYS = ["model", "pre", "tokens", "merges", "token_type", "scores", "bos_token_id", "eos_token_id",
        "eot_token_id", "add_bos_token", "add_eos_token", "add_space_prefix"]


@settings(FUZZ, max_examples=100)
@given(kind=st.sampled_from(["bpe", "spm"]),
       changes=st.dictionaries(st.sampled_from(KEYS), JUNK, min_size=1, max_size=3))
def test_corrupt_metadata(kind, changes):
    """Fields of the wrong type or shape give a GGUFError naming the field (a string bos_token_id used to
    raise int()'s ValueError; an array add_bos_token numpy's "truth value is ambiguous")."""
    meta = _bpe_meta() if kind == "bpe" else _spm_meta()
    meta.update({f"tokenizer.ggml.{k}": v for k, v in changes.items()})
    try:
        tok = Tokenizer.from_gguf_metadata(meta, "junk.gguf")
    except GGUFError as e:
        assert str(e).startswith("junk.gguf: ")
        return
    ids = tok.encode("hello world <s></s>", parse_special=True)      # a tokenizer that builds must work
    assert all(0 <= i < tok.n_vocab for i in ids)
    tok.decode(ids, special=True)


@pytest.mark.parametrize("key, value", [("bos_token_id", "1"), ("add_bos_token", np.array([1, 2])),
                                        ("tokens", np.array([1, 2])), ("token_type", ["1"])])
def test_regression_field_types(key, value):
    with pytest.raises(GGUFError, match=f"tokenizer.ggml.{key} must be"):
        Tokenizer.from_gguf_metadata(_bpe_meta(**{f"tokenizer.ggml.{key}": value}), "x.gguf")
