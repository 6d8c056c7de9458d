"""Shared inputs of the train-mtp tests: a tiny model with the data of its pass over a token stream, and
small Python files for the command line's --text."""
import numpy as np

from strata_lite import LLM
from strata_lite.mtp_train_data import collect, split_files
from tiny_model import write_tiny_model


def tiny_model_data(d, topk: int):
    """A tiny model without an MTP block (n_embd 64) in folder d and its data: the model over 24 windows of
    32 random tokens, top-k targets -> (llm, MtpData)."""
    llm = LLM(str(write_tiny_model(d / "m.gguf", n_embd=64, n_ff=128)), backend="cpu", n_ctx=64, n_batch=64)
    ids = np.random.default_rng(0).integers(0, 256, 32 * 24).astype(np.int32)
    return llm, collect(llm, ids, 32, topk, progress=False)


def write_texts(d) -> list:
    """12 or more small Python files in folder d -> their paths, at least one of them held out by
    mtp_train_data.split_files (which goes by the CRC32 of the absolute path, so by the folder's name: 12
    files alone have none held out for 28% of folder names)."""
    texts = []
    for i in range(200):
        t = d / f"t{i}.py"
        t.write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(12)))
        texts.append(str(t))
        if i >= 11 and split_files(texts)[1]:
            return texts
    raise AssertionError(f"no file name in {d} is held out")
