"""The MTP (multi-token prediction) block of a GGUF model, in llama.cpp's layout.

`{arch}.nextn_predict_layers` = 1 and `block_count` counts it: the last block blk.N (N = block_count - 1)
holds an ordinary decoder block's tensors plus
    blk.N.nextn.eh_proj           (n_embd, 2 n_embd)  input columns: [enorm(embed(next token)); hnorm(hidden)]
    blk.N.nextn.enorm, .hnorm     (n_embd,)
    blk.N.nextn.embed_tokens      optional (n_vocab, n_embd); else the model's token_embd
    blk.N.nextn.shared_head_norm  optional (n_embd,); else the model's output_norm
    blk.N.nextn.shared_head_head  optional (n_vocab, n_embd); else the model's output matrix
    blk.N.nextn.draft_vocab       optional I32 (n_draft,): this project's addition, not llama.cpp's. The
                                  block drafts only these tokens (ascending ids): its head is those rows
                                  of shared_head_head or the output matrix (draft_head), so a drafted token
                                  reads n_draft / n_vocab of the head's bytes. A file with it and a
                                  shared_head_head holds only those (n_draft, n_embd) rows.
(DeepSeek-V3's form: h' = eh_proj([enorm(e); hnorm(h)]), one decoder block, the shared head). The main
forward never runs it (ModelConfig.n_layers excludes it).

eh_proj is kept as its two column halves (each an (n_embd, n_embd) matrix of whole blocks), so the
backends multiply them without concatenating activations: eh_proj @ [a; b] = E @ a + H @ b.

A sidecar file holds only that block: the model's architecture fields with block_count = main blocks + 1,
nextn_predict_layers = 1 and vocab_size, and the tensors blk.N.* (write_mtp_file, load_mtp_file). It
must match the model it is used with (architecture, sizes, vocabulary, block count); load_mtp_file says
which field does not.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType, GGUFValueType as VT, GGUFWriter
from gguf.quants import quantize

from strata_lite.kernels.qtypes import UnsupportedQuantType, row_nbytes

from .atomic_file import written_whole
from .errors import GGUFError
from .gguf_file import GGUFFile
from .model_config import ModelConfig, config_from_metadata
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
    draft_vocab: np.ndarray | None = None   # int32 (n_draft,) ascending token ids; None: every token


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
    vocab = _read_draft_vocab(gf, p + "draft_vocab", cfg.n_vocab)
    return MtpWeights(
        eh_proj_embed=embed,
        eh_proj_hidden=hidden,
        enorm=r.vector(p + "enorm.weight", n),
        hnorm=r.vector(p + "hnorm.weight", n),
        block=load_layer(r, cfg, i),
        embed_tokens=r.matrix(p + "embed_tokens.weight", cfg.n_vocab, n, optional=True),
        head_norm=r.vector(p + "shared_head_norm.weight", n, optional=True),
        head=r.matrix(p + "shared_head_head.weight", cfg.n_vocab if vocab is None else len(vocab), n,
                      optional=True),
        draft_vocab=vocab,
    )


def _read_draft_vocab(gf: GGUFFile, name: str, n_vocab: int) -> np.ndarray | None:
    """The optional draft vocabulary: I32, 1-D, ids ascending without repeats, each < n_vocab."""
    info = gf.tensors.get(name)
    if info is None:
        return None
    if info.qtype != QType.I32 or len(info.shape) != 1 or info.shape[0] < 1:
        raise GGUFError(gf.path, f"tensor {name!r} must be a non-empty 1-D I32 array of token ids, not "
                                 f"{info.qtype.name} {list(info.shape)}")
    vocab = np.array(gf.rows(name)).view(np.int32).ravel()
    if vocab[0] < 0 or vocab[-1] >= n_vocab or np.any(np.diff(vocab) <= 0):
        raise GGUFError(gf.path, f"tensor {name!r} must hold ascending token ids without repeats in "
                                 f"[0, {n_vocab})")
    return vocab


def draft_head(output: QuantTensor, mtp: MtpWeights) -> QuantTensor:
    """The matrix an MTP block's head multiplies by: its shared_head_head, else the model's output matrix
    (output), cut to the draft vocabulary's rows when it has one (row i of the result scores token
    draft_vocab[i]; the rows are the file's quantized bytes, unchanged)."""
    if mtp.head is not None:
        return mtp.head
    if mtp.draft_vocab is None:
        return output
    rows = np.ascontiguousarray(np.asarray(output.raw)[mtp.draft_vocab])
    return QuantTensor(output.name + "[draft_vocab]", output.qtype, len(mtp.draft_vocab), output.n_in, rows)


def choose_draft_vocab(counts: np.ndarray, size: int, keep) -> np.ndarray:
    """The draft vocabulary: the ids of keep (the tokenizer's special and end-of-generation tokens), then
    the most frequent tokens by counts (n_vocab,) (ties: lower id first) up to size ids in all; ascending."""
    n_vocab = len(counts)
    if not 1 <= size <= n_vocab:
        raise ValueError(f"the draft vocabulary size must be between 1 and the vocabulary's {n_vocab}, not {size}")
    chosen = np.zeros(n_vocab, bool)
    chosen[[i for i in keep if 0 <= i < n_vocab][:size]] = True
    by_count = np.argsort(-np.asarray(counts, np.int64), kind="stable")
    rest = by_count[~chosen[by_count]][:size - int(chosen.sum())]
    chosen[rest] = True
    return np.flatnonzero(chosen).astype(np.int32)


# the ModelConfig fields a sidecar must share with its model
_MATCH = ("arch", "n_layers", "n_embd", "n_ff", "n_heads", "n_kv_heads", "head_dim", "n_rot", "n_vocab")


def load_mtp_file(path: str, cfg: ModelConfig) -> MtpWeights:
    """The MTP block of a sidecar file, for the model whose config is cfg."""
    gf = GGUFFile(path)
    side = config_from_metadata(gf.metadata, gf.path)
    for name in _MATCH:
        if getattr(side, name) != getattr(cfg, name):
            raise GGUFError(gf.path, f"this MTP file is for a model with {name} = {getattr(side, name)}, "
                                     f"the model has {getattr(cfg, name)}")
    return load_mtp(gf, side)


def write_mtp_file(model: GGUFFile, cfg: ModelConfig, path: str) -> None:
    """Copy the MTP block of a model file (cfg.n_mtp_layers == 1) into a sidecar file at path."""
    if cfg.n_mtp_layers != 1:
        raise GGUFError(model.path, f"no MTP block: '{cfg.arch}.nextn_predict_layers' is {cfg.n_mtp_layers}")
    prefix = f"blk.{cfg.n_layers}."
    tensors = [_copied(model, name) for name in model.tensors if name.startswith(prefix)]
    _write_sidecar(model, cfg, cfg.n_layers, path, tensors)


def _copied(gf: GGUFFile, name: str):
    """A tensor of gf as _write_sidecar takes it: matrices as their raw block rows, float vectors as
    float32, the I32 draft vocabulary as int32."""
    info = gf.tensors[name]
    if info.qtype == QType.I32:
        return name, np.array(gf.rows(name)).view(np.int32).ravel(), None
    if len(info.shape) == 1:
        return name, gf.array(name), None
    return name, np.asarray(gf.rows(name)), info.qtype


def write_mtp_arrays(model: GGUFFile, cfg: ModelConfig, path: str, arrays: dict, qtype: QType,
                     draft_vocab: np.ndarray | None = None) -> None:
    """Write a sidecar for the model of cfg (blk.N, N = cfg.n_layers) from float arrays by name
    (eh_proj (n_embd, 2 n_embd), enorm, hnorm, and a block's attn_norm, attn_q, ... as LayerWeights
    names): matrices quantized to qtype (F16 or Q8_0, with gguf.quants), vectors kept as F32; with
    draft_vocab (ascending ids), its nextn.draft_vocab tensor."""
    if qtype not in (QType.F16, QType.Q8_0):
        raise ValueError(f"MTP sidecar type must be F16 or Q8_0, not {qtype.name}")
    i, tensors = cfg.n_layers, []
    for key, a in arrays.items():
        name = (f"blk.{i}.nextn.{key}.weight" if key in ("eh_proj", "enorm", "hnorm") else
                f"blk.{i}.{key[:-5]}.bias" if key.endswith("_bias") else f"blk.{i}.{key}.weight")
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1:
            tensors.append((name, a, None))
        elif qtype == QType.F16:
            tensors.append((name, a.astype(np.float16), None))
        else:
            tensors.append((name, quantize(a, qtype), qtype))
    if draft_vocab is not None:
        tensors.append((f"blk.{i}.nextn.draft_vocab", np.asarray(draft_vocab, np.int32), None))
    _write_sidecar(model, cfg, i, path, tensors)


def write_draft_vocab(sidecar: str, cfg: ModelConfig, draft_vocab: np.ndarray, path: str) -> None:
    """Copy a sidecar (for the model of cfg: load_mtp_file checks it) to path with draft_vocab as its
    nextn.draft_vocab tensor, replacing one it had; a shared_head_head it has is cut to those rows."""
    old = load_mtp_file(sidecar, cfg)
    gf = GGUFFile(sidecar)
    i = cfg.n_layers
    vocab_name, head_name = f"blk.{i}.nextn.draft_vocab", f"blk.{i}.nextn.shared_head_head.weight"
    keep = old.draft_vocab if old.draft_vocab is not None else np.arange(cfg.n_vocab)
    if old.head is not None and not np.isin(draft_vocab, keep).all():
        raise GGUFError(sidecar, "its shared_head_head lacks rows of the new draft vocabulary")
    tensors = [_copied(gf, name) for name in gf.tensors if name not in (vocab_name, head_name)]
    if old.head is not None:
        rows = np.asarray(old.head.raw)[np.searchsorted(keep, draft_vocab)]
        tensors.append((head_name, np.ascontiguousarray(rows), old.head.qtype))
    tensors.append((vocab_name, np.asarray(draft_vocab, np.int32), None))
    _write_sidecar(gf, config_from_metadata(gf.metadata, gf.path), i, path, tensors,
                   title=gf.metadata.get("general.name"))


def _write_sidecar(model: GGUFFile, cfg: ModelConfig, n_main: int, path: str, tensors,
                   title: str | None = None) -> None:
    """The model's architecture fields, block_count = n_main + 1, nextn_predict_layers = 1, vocab_size,
    and tensors [(name, data, raw qtype or None)], written whole; general.name `title` (default: the
    model's name and " MTP block")."""
    arch = cfg.arch
    skip = (f"{arch}.block_count", f"{arch}.vocab_size", f"{arch}.nextn_predict_layers")
    with written_whole(path) as tmp:
        w = GGUFWriter(tmp, arch)
        w.add_name(title or f"{cfg.name} MTP block")
        for key, value in model.metadata.items():
            if key.startswith(arch + ".") and key not in skip:
                vtype, etype = model.field_types[key]
                if vtype == VT.ARRAY:
                    w.add_key_value(key, list(value), VT.ARRAY, sub_type=VT(etype))
                else:
                    w.add_key_value(key, value, VT(vtype))
        w.add_block_count(n_main + 1)
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
        w.add_vocab_size(cfg.n_vocab)
        for name, data, raw_dtype in tensors:
            w.add_tensor(name, data, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
