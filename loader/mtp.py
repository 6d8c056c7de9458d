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
    return MtpWeights(
        eh_proj_embed=embed,
        eh_proj_hidden=hidden,
        enorm=r.vector(p + "enorm.weight", n),
        hnorm=r.vector(p + "hnorm.weight", n),
        block=load_layer(r, cfg, i),
        embed_tokens=r.matrix(p + "embed_tokens.weight", cfg.n_vocab, n, optional=True),
        head_norm=r.vector(p + "shared_head_norm.weight", n, optional=True),
        head=r.matrix(p + "shared_head_head.weight", cfg.n_vocab, n, optional=True),
    )


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
    tensors = []
    for name in (n for n in model.tensors if n.startswith(prefix)):
        info = model.tensors[name]
        data = model.array(name) if len(info.shape) == 1 else np.asarray(model.rows(name))
        tensors.append((name, data, info.qtype if len(info.shape) > 1 else None))
    _write_sidecar(model, cfg, cfg.n_layers, path, tensors)


def write_mtp_arrays(model: GGUFFile, cfg: ModelConfig, path: str, arrays: dict, qtype: QType) -> None:
    """Write a sidecar for the model of cfg (blk.N, N = cfg.n_layers) from float arrays by name
    (eh_proj (n_embd, 2 n_embd), enorm, hnorm, and a block's attn_norm, attn_q, ... as LayerWeights
    names): matrices quantized to qtype (F16 or Q8_0, with gguf.quants), vectors kept as F32."""
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
    _write_sidecar(model, cfg, i, path, tensors)


def _write_sidecar(model: GGUFFile, cfg: ModelConfig, n_main: int, path: str, tensors) -> None:
    """The model's architecture fields, block_count = n_main + 1, nextn_predict_layers = 1, vocab_size,
    and tensors [(name, data, raw qtype or None)], written whole."""
    arch = cfg.arch
    skip = (f"{arch}.block_count", f"{arch}.vocab_size", f"{arch}.nextn_predict_layers")
    with written_whole(path) as tmp:
        w = GGUFWriter(tmp, arch)
        w.add_name(f"{cfg.name} MTP block")
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
