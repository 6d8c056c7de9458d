"""TextStream: incremental UTF-8 decoding and stop strings, against a whole-text reference; the work per
token does not grow with the output."""
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from strata_lite.loader.gguf_file import read_metadata
from strata_lite.loader.tokenizer import Tokenizer
from strata_lite.text_stream import TextStream, _StopMatcher

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_model import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return Tokenizer.from_gguf_metadata(read_metadata(str(path)), "tiny.gguf")


def reference(tok, ids, stops) -> tuple[str, bool]:
    """The whole output decoded at once, cut before the stop string that is completed first (the
    longest of those completed by the same character)."""
    text = tok.decode(ids)
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text, False) if not found else (text[:min(found)[1]], True)


def run(tok, ids, stops):
    stream = TextStream(tok, tuple(stops))
    pieces = []
    for t in ids:
        pieces.append(stream.push(t))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


TEXTS = ["hello world", "héllo wörld ✓ 日本語", "aaab abab ab", "llo hello he lo"]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_matches_the_whole_text_reference(tok, data):
    text = data.draw(st.sampled_from(TEXTS)) * data.draw(st.integers(1, 3))
    ids = tok.encode(text, add_special=False)
    # byte-level tokens split multi-byte characters: cut anywhere, even mid-character
    ids = ids + data.draw(st.lists(st.integers(0, 255), max_size=3))
    stops = data.draw(st.lists(st.one_of(
        st.integers(0, len(text) - 1).flatmap(lambda a: st.integers(a + 1, min(len(text), a + 6)).map(
            lambda b: text[a:b])),
        st.text(alphabet="abhlo ✓", min_size=1, max_size=4)), max_size=4))
    pieces, stream = run(tok, ids, stops)
    want, stopped = reference(tok, ids, stops)
    assert "".join(pieces) == want == stream.text
    assert stream.stopped == stopped
    shown = ""
    for p in pieces:                     # nothing shown is later taken back: every piece is a prefix of the answer
        shown += p
        assert want.startswith(shown)


def test_holds_a_possible_stop_start(tok):
    stream = TextStream(tok, ("lo!",))
    assert "".join(stream.push(t) for t in tok.encode("hello", add_special=False)) == "hel"
    assert stream.push(tok.encode("!", add_special=False)[0]) == "" and stream.stopped
    assert stream.text == "hel" and stream.finish() == ""
    stream = TextStream(tok, ("xyz",))
    out = [stream.push(t) for t in tok.encode("abxy", add_special=False)]
    assert "".join(out) == "ab"                   # "xy" is held: it may start "xyz"
    assert stream.finish() == "xy" and not stream.stopped


def test_split_utf8_character_is_held(tok):
    ids = tok.encode("é", add_special=False)      # two byte-level tokens
    assert len(ids) == 2
    stream = TextStream(tok)
    assert stream.push(ids[0]) == "" and stream.push(ids[1]) == "é"
    stream = TextStream(tok)
    stream.push(ids[0])
    assert stream.finish() == "\ufffd"           # cut off mid-character


def test_work_per_token_does_not_grow(tok, monkeypatch):
    """Each token's text is fed to each matcher once (no re-scan of the output) and decoded alone (no
    re-decode of the output), also with a long stop string that keeps almost matching."""
    fed, decoded = [], []
    feed, decode_bytes = _StopMatcher.feed, tok.decode_bytes

    def counting_feed(self, text):
        fed.append(len(text))
        return feed(self, text)

    def counting_decode(ids, *a, **k):
        decoded.append(len(ids))
        return decode_bytes(ids, *a, **k)

    monkeypatch.setattr(_StopMatcher, "feed", counting_feed)
    monkeypatch.setattr(tok, "decode_bytes", counting_decode)
    stops = ("a" * 255 + "b", "zz")
    stream = TextStream(tok, stops)
    ids = tok.encode("a" * 3000, add_special=False)
    emitted = "".join(stream.push(t) for t in ids)
    assert decoded == [1] * len(ids)
    assert sum(fed) == 3000 * len(stops)
    assert len(emitted) == 3000 - 255 and stream.finish() == "a" * 255


def test_kmp_matcher():
    m = _StopMatcher("abab")
    assert m.feed("xaba") == -1 and m.state == 3
    assert m.feed("bab") == 1                   # "abab" ends after the first character fed
    m = _StopMatcher("aab")
    assert m.feed("aaaab") == 5


def test_sentencepiece_spaces_between_tokens():
    """Only the first piece loses SentencePiece's space prefix, as in a whole decode."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "loader"))
    from test_tokenizer import _spm_meta
    spm = Tokenizer.from_gguf_metadata(_spm_meta(), "spm.gguf")
    ids = spm.encode("hello world hello", add_special=False)
    stream = TextStream(spm, ("wor",))
    out = "".join(stream.push(t) for t in ids) + stream.finish()
    assert spm.decode(ids) == "hello world hello" and out == "hello "
    stream = TextStream(spm)
    assert "".join(stream.push(t) for t in ids) + stream.finish() == "hello world hello"
