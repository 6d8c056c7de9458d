"""Transformer.forward runs the last decoder block's attention, output projection and FFN on the logit rows only
(the other rows store their K and V: models/transformer.py block_at_rows). The logits and every layer
of the KV cache must be the bits of the whole block on every row (the path all_hidden still takes), for a prompt
chunk ending at its last row, one ending mid-prompt (no logit rows), and a mixed step of a decode token beside a
chunk, on the int8 (batch-invariant) kernels of both architectures' tiny models."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite import LLM
from strata_lite.batch import Batch
from tiny_model import write_tiny_model


@pytest.fixture(scope="module", params=[("qwen2", QT.Q8_0), ("llama", QT.Q5_0)], ids=lambda p: f"{p[0]}-{p[1].name}")
def llm(request, tmp_path_factory):
    arch, qtype = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch) / "m.gguf", arch=arch, qtype=qtype, n_layers=3, n_embd=64,
                            n_ff=256, n_heads=4, n_kv_heads=2)
    return LLM(str(path), backend="cpu", n_ctx=256)


def _batches(rng, n_vocab):
    """(name, [Batch, ...]) run in order on one cache: pages 0-1 hold sequence 0, pages 2-3 sequence 1."""
    a = [int(t) for t in rng.integers(0, n_vocab, 60)]
    b = [int(t) for t in rng.integers(0, n_vocab, 30)]
    tables = np.array([[0, 1], [2, 3]], np.int32)

    def rows(seq_pos_ids, logit_rows):
        seq, pos, ids = (np.array(c, np.int32) for c in zip(*seq_pos_ids))
        return Batch(ids, pos, seq, tables, np.array(logit_rows, np.int32))

    return [
        ("chunk ending at its last row", [rows([(0, p, a[p]) for p in range(40)], [39])]),
        ("chunk ending mid-prompt, then the rest", [rows([(0, p, a[p]) for p in range(25)], []),
                                                    rows([(0, p, a[p]) for p in range(25, 40)], [14])]),
        ("a decode token beside a chunk", [rows([(1, p, b[p]) for p in range(20)], [19]),
                                          rows([(1, 20, b[20])] + [(0, p, a[p]) for p in range(30)], [0, 30])]),
    ]


@pytest.mark.parametrize("case", range(3))
def test_last_block_on_the_logit_rows_gives_the_whole_blocks_bits(llm, case):
    if not llm.backend.int8:
        pytest.skip("the float kernels are not batch-invariant")
    be, kv = llm.backend, llm.kv
    name, batches = _batches(np.random.default_rng(case), llm.config.n_vocab)[case]
    results = []
    for whole in (True, False):      # all_hidden: the whole block on every row; else the logit rows' path
        for i in range(llm.config.n_layers):
            for arr in kv.layer(i):
                arr[...] = 0
        got = []
        for batch in batches:
            batch.validate(kv.n_pages, kv.page_size, llm.config.n_vocab)
            out = llm.model.forward(batch, kv, all_hidden=whole)
            got.append(be.to_host(out[0] if whole else out).copy())
        got += [be.to_host(arr).copy() for i in range(llm.config.n_layers) for arr in kv.layer(i)]
        results.append(got)
    for w, g in zip(*results, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)
