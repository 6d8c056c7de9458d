"""The MTP (multi-token prediction) block of a GGUF model, in llama.cpp's layout.

`{arch}.nextn_predict_layers` = 1 and `block_count` counts it: the last block blk.N (N = block_count - 1)
holds an ordinary decoder block's tensors plus
    blk.N.nextn.eh_proj           (n_embd, 2 n_embd)  input columns: [enorm(embed(next token)); hnorm(hidden)]
    blk.N.nextn.enorm, .hnorm     (n_embd,)
    blk.N.nextn.embed_tokens      optional (n_vocab, n_embd); else the model's token_embd
    blk.N.nextn.shared_head_norm  optional (n_embd,); else the model's output_norm
    blk.N.nextn.shared_head_head  optional (n_vocab, n_embd); else the model's output matrix
(DeepSeek-V3's form: h' = eh_proj([enorm(e); hnorm(h)]), one decoder block, the shared head). The main
forward never runs it (ModelConfig.n_layers excludes it).

eh_proj is kept as its two column halves (each an (n_embd, n_embd) matrix of whole blocks), so the
backends multiply them without concatenating activations: eh_proj @ [a; b] = E @ a + H @ b.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata_lite.kernels.qtypes import UnsupportedQuantType, row_nbytes

from .errors import GGUFError
from .gguf_file import GGUFFile
from .model_config import ModelConfig
from .weights import LayerWeights, QuantTensor, _Reader, load_layer


@dataclass(frozen=True)
class MtpWeights:
    eh_proj_embed: QuantTensor        # (n_embd, n_embd): eh_proj's columns for enorm(embed(next token))
    eh_proj_hidden: QuantTensor       # (n_embd, n_embd): its columns for hnorm(hidden)
    enorm: np.ndarray                 # (n_embd,) float32
    hnorm: np.ndarray
    block: LayerWeights
    embed_tokens: QuantTensor | None  # None: the model's token_embd
    head_norm: np.ndarray | None      # None: the model's output_norm
    head: QuantTensor | None          # None: the model's output matrix


def _split_columns(w: QuantTensor, n_first: int, path: str) -> tuple[QuantTensor, QuantTensor]:
    """W (n_out, n_first + rest) -> its first n_first columns and the rest, as contiguous block rows."""
    try:
        cut = row_nbytes(w.qtype, n_first)
    except UnsupportedQuantType:
        raise GGUFError(path, f"tensor {w.name!r}: {n_first} columns are not whole {w.qtype.name} blocks, so "
                              "it cannot be split into its embedding and hidden halves") from None
    raw = np.asarray(w.raw)
    return (QuantTensor(w.name + "[embed]", w.qtype, w.n_out, n_first, np.ascontiguousarray(raw[:, :cut])),
            QuantTensor(w.name + "[hidden]", w.qtype, w.n_out, w.n_in - n_first, np.ascontiguousarray(raw[:, cut:])))


def load_mtp(gf: GGUFFile, cfg: ModelConfig) -> MtpWeights:
    """The MTP block of a model whose config says it has one (cfg.n_mtp_layers == 1)."""
    if cfg.n_mtp_layers != 1:
        raise GGUFError(gf.path, f"no MTP block: '{cfg.arch}.nextn_predict_layers' is {cfg.n_mtp_layers}")
    r, i, n = _Reader(gf), cfg.n_layers, cfg.n_embd
    p = f"blk.{i}.nextn."
    embed, hidden = _split_columns(r.matrix(p + "eh_proj.weight", n, 2 * n), n, gf.path)
    optional = lambda name: name in gf.tensors   # noqa: E731
    return MtpWeights(
        eh_proj_embed=embed,
        eh_proj_hidden=hidden,
        enorm=r.vector(p + "enorm.weight", n),
        hnorm=r.vector(p + "hnorm.weight", n),
        block=load_layer(r, cfg, i),
        embed_tokens=r.matrix(p + "embed_tokens.weight", cfg.n_vocab, n) if optional(p + "embed_tokens.weight") else None,
        head_norm=r.vector(p + "shared_head_norm.weight", n, optional=True),
        head=r.matrix(p + "shared_head_head.weight", cfg.n_vocab, n) if optional(p + "shared_head_head.weight") else None,
    )
