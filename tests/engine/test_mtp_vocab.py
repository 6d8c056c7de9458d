"""Draft vocabularies of MTP blocks (loader/mtp.py nextn.draft_vocab, strata_lite/mtp_vocab.py): the choice
of tokens, the sidecar round trip, the cut head's logits equal the full head's columns bit for bit, drafts
map back to token ids and keep greedy output unchanged, the cost rule prices the cut head, bad tensors fail
with a line naming them, and the `mtp-vocab` / `train-mtp --draft-vocab` commands write what loads."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.cli import main
from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.model_config import config_from_metadata
from strata_lite.loader.mtp import (_copied, _write_sidecar, choose_draft_vocab, load_mtp_file, write_draft_vocab,
                                     write_mtp_file)
from strata_lite.models.mtp import MtpHead
from strata_lite.mtp_train_data import split_files
from strata_lite.mtp_vocab import coverage, draft_vocab_of
from strata_lite.spec.mtp_drafter import mtp_cost, mtp_weights
from test_mtp_drafting import PROMPTS, Mini, _engine, _run_all
from tiny_model import write_tiny_model

N_CTX = 256
KW = dict(arch="qwen2", qtype=QT.Q8_0, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtpv")
    embedded = write_tiny_model(d / "mtp.gguf", mtp=True, **KW)
    plain = write_tiny_model(d / "plain.gguf", **KW)
    llm = LLM(str(embedded), backend="cpu", n_ctx=N_CTX)
    side = d / "plain.mtp.gguf"
    write_mtp_file(GGUFFile(embedded), llm.config, str(side))
    # a vocabulary of every id the test prompts and their greedy continuations can reach is not needed:
    # drafts outside it are simply never proposed; take the even ids and the special tokens
    vocab = choose_draft_vocab(np.where(np.arange(llm.config.n_vocab) % 2 == 0, 10, 0), 140,
                               sorted(llm.tokenizer.special_ids | llm.tokenizer.eog_ids))
    cut = d / "plain.vocab.mtp.gguf"
    write_draft_vocab(str(side), llm.config, vocab, str(cut))
    return dict(embedded=str(embedded), plain=str(plain), sidecar=str(side), cut=str(cut), vocab=vocab)


def test_choose_draft_vocab_keeps_special_tokens_then_the_most_frequent():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    assert choose_draft_vocab(counts, 3, [6]).tolist() == [2, 3, 6]           # 6 kept; ties: lower id first
    assert choose_draft_vocab(counts, 4, []).tolist() == [0, 2, 3, 5]
    assert choose_draft_vocab(counts, 8, [1]).tolist() == list(range(8))
    for bad in (0, 9):
        with pytest.raises(ValueError, match="between 1 and the vocabulary's 8"):
            choose_draft_vocab(counts, bad, [])


def test_draft_vocab_of_text_and_its_coverage(files):
    llm = LLM(files["plain"], backend="cpu", n_ctx=N_CTX)
    tok = llm.tokenizer
    ids = np.asarray(tok.encode("hello hello world " * 20, add_special=False), np.int32)
    vocab = draft_vocab_of(tok, ids, 12)
    assert len(vocab) == 12 and set(tok.special_ids | tok.eog_ids) <= set(vocab.tolist())
    assert set(np.unique(ids).tolist()) <= set(vocab.tolist())     # few distinct ids: all of them fit
    assert coverage(vocab, ids) == 1.0 and coverage(vocab, np.array([0, 1, 999])) == pytest.approx(
        np.isin([0, 1, 999], vocab).mean())


def test_sidecar_round_trip_and_the_cut_head(files):
    llm = LLM(files["plain"], backend="cpu", n_ctx=N_CTX)
    full, cut = (load_mtp_file(files[k], llm.config) for k in ("sidecar", "cut"))
    assert full.draft_vocab is None and np.array_equal(cut.draft_vocab, files["vocab"])
    head_full, head_cut = MtpHead(llm.model, full), MtpHead(llm.model, cut)
    assert head_cut.n_head == len(files["vocab"]) and head_full.n_head == llm.config.n_vocab
    x = llm.backend.from_host(np.random.default_rng(1).standard_normal((5, llm.config.n_embd)).astype(np.float32))
    a = llm.backend.to_host(head_full.logits(x))
    b = llm.backend.to_host(head_cut.logits(x))
    np.testing.assert_array_equal(b, a[:, files["vocab"]])      # the same rows' bytes: the same bits
    assert head_cut.token_ids([0, 3]).tolist() == files["vocab"][[0, 3]].tolist()
    # the cost rule prices the head by the rows it reads
    c_full, c_cut = (mtp_cost(llm.model.weights, w) for w in (full, cut))
    assert c_cut.block == c_full.block
    assert c_cut.head == pytest.approx(c_full.head * len(files["vocab"]) / llm.config.n_vocab, rel=1e-12)
    # a second cut: copied again, the vocabulary replaced
    write_draft_vocab(files["cut"], llm.config, files["vocab"][:50], files["cut"] + ".2")
    assert load_mtp_file(files["cut"] + ".2", llm.config).draft_vocab.tolist() == files["vocab"][:50].tolist()


def test_drafts_come_from_the_vocabulary(files):
    mini = Mini(files["plain"], mtp_file=files["cut"], width=3)
    mini.add("x", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 20)
    mini.add("y", list(range(30, 75)), 14)
    mini.run()
    drafted = [t for _, _, toks, _ in mini.drafts for t in toks]
    assert len(drafted) > 10 and set(drafted) <= set(files["vocab"].tolist())


def test_greedy_output_with_the_cut_head_equals_spec_off(files):
    on, off = _engine(files["plain"], "mtp", mtp=files["cut"]), _engine(files["plain"], "off")
    try:
        on._spec.width = 3
        assert _run_all(on, PROMPTS, "m-") == _run_all(off, PROMPTS, "o-")
        assert on._spec.by_source["mtp"]["drafted"] > 20
    finally:
        on.stop()
        off.stop()


def _sidecar_with_vocab(src, dst, vocab, extra=()):
    """A copy of the sidecar src with a hand-made nextn.draft_vocab tensor (any dtype / order) and extra
    tensors [(name, raw rows, qtype)], through the loader's own sidecar writer."""
    gf = GGUFFile(src)
    cfg = config_from_metadata(gf.metadata, gf.path)
    tensors = [_copied(gf, name) for name in gf.tensors] + [("blk.2.nextn.draft_vocab", vocab, None), *extra]
    _write_sidecar(gf, cfg, cfg.n_layers, str(dst), tensors)


@pytest.mark.parametrize("vocab,why", [(np.array([3, 2, 9], np.int32), "ascending"),
                                       (np.array([1, 1, 4], np.int32), "ascending"),
                                       (np.array([1, 5000], np.int32), "ascending token ids without repeats in"),
                                       (np.array([1.0, 2.0], np.float32), "1-D I32")])
def test_bad_draft_vocab_is_one_clear_error(files, tmp_path, vocab, why):
    llm = LLM(files["plain"], backend="cpu", n_ctx=N_CTX)
    bad = tmp_path / "bad.gguf"
    _sidecar_with_vocab(files["sidecar"], bad, vocab)
    with pytest.raises(GGUFError, match="draft_vocab") as e:
        load_mtp_file(str(bad), llm.config)
    assert why in str(e.value) and str(bad) in str(e.value)


def test_cli_mtp_vocab_and_train_mtp_draft_vocab(files, tmp_path, capsys):
    text = []
    while len(text) < 12 or not split_files(list(map(str, text)))[1]:     # a held-out file (CRC32 of its path)
        t = tmp_path / f"t{len(text)}.py"
        t.write_text("".join(f"def f{j}(x):\n    return x * {j + len(text)}\n" for j in range(30)))
        text.append(t)
    out = tmp_path / "v.gguf"
    assert main(["mtp-vocab", "--model", files["plain"], "--mtp", files["sidecar"], "--size", "100",
                 "--text", *map(str, text), "-o", str(out)]) == 0
    lines = capsys.readouterr().out
    assert "draft vocabulary: 100 tokens" in lines and "held-out tokens" in lines
    cfg = LLM(files["plain"], backend="cpu", n_ctx=N_CTX).config
    assert len(load_mtp_file(str(out), cfg).draft_vocab) == 100
    assert main(["mtp-vocab", "--model", files["plain"], "--mtp", files["sidecar"], "--size", "999",
                 "--text", *map(str, text), "-o", str(out)]) == 2
    assert "--size must be between 1 and 261" in capsys.readouterr().err
    side = tmp_path / "t.gguf"
    assert main(["train-mtp", "--model", files["plain"], "--text", *map(str, text), "--steps", "2", "--ctx", "32",
                 "--train-tokens", "2000", "--eval-tokens", "64", "--draft-vocab", "80", "-o", str(side)]) == 0
    lines = capsys.readouterr().out
    assert "draft vocabulary: 80 tokens" in lines and "drafting from the draft vocabulary" in lines, lines
    assert len(load_mtp_file(str(side), cfg).draft_vocab) == 80
    assert main(["train-mtp", "--model", files["plain"], "--text", *map(str, text), "--steps", "1", "--ctx", "32",
                 "--train-tokens", "200", "--eval-tokens", "0", "-o", str(side)]) == 0
    assert load_mtp_file(str(side), cfg).draft_vocab is None       # the default is larger than 262 tokens


def test_mtp_weights_reads_the_vocabulary_of_a_sidecar(files):
    llm = LLM(files["plain"], backend="cpu", n_ctx=N_CTX)
    w = mtp_weights(files["plain"], llm.config, files["cut"])
    assert np.array_equal(w.draft_vocab, files["vocab"])


def test_a_shared_head_of_the_vocabularys_rows(files, tmp_path):
    """A sidecar with its own shared_head_head holds only the draft vocabulary's rows; write_draft_vocab
    cuts those rows again for a smaller vocabulary. Rows copied from the output matrix give its logits."""
    llm = LLM(files["plain"], backend="cpu", n_ctx=N_CTX)
    out = GGUFFile(files["plain"])
    info = out.tensors["output.weight"]
    vocab = files["vocab"]
    rows = np.ascontiguousarray(np.asarray(out.rows("output.weight"))[vocab])
    own = tmp_path / "own.gguf"
    _sidecar_with_vocab(files["sidecar"], own, vocab, [("blk.2.nextn.shared_head_head.weight", rows, info.qtype)])
    w = load_mtp_file(str(own), llm.config)
    assert w.head is not None and w.head.n_out == len(vocab)
    x = llm.backend.from_host(np.random.default_rng(2).standard_normal((3, llm.config.n_embd)).astype(np.float32))
    want = llm.backend.to_host(MtpHead(llm.model, load_mtp_file(files["cut"], llm.config)).logits(x))
    np.testing.assert_array_equal(llm.backend.to_host(MtpHead(llm.model, w).logits(x)), want)
    smaller = vocab[::3]
    write_draft_vocab(str(own), llm.config, smaller, str(tmp_path / "smaller.gguf"))
    w2 = load_mtp_file(str(tmp_path / "smaller.gguf"), llm.config)
    assert w2.head.n_out == len(smaller) and np.array_equal(w2.draft_vocab, smaller)
    np.testing.assert_array_equal(llm.backend.to_host(MtpHead(llm.model, w2).logits(x)), want[:, ::3])
    with pytest.raises(GGUFError, match="lacks rows"):
        write_draft_vocab(str(own), llm.config, np.array([2, 255], np.int32), str(tmp_path / "x.gguf"))
    bad = tmp_path / "bad.gguf"                                  # a head of the whole vocabulary's rows
    _sidecar_with_vocab(files["sidecar"], bad, vocab, [("blk.2.nextn.shared_head_head.weight",
                                                        np.asarray(out.rows("output.weight")), info.qtype)])
    with pytest.raises(GGUFError, match="shared_head_head"):
        load_mtp_file(str(bad), llm.config)
