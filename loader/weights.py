"""Weights: every matrix stays in its quantized GGUF blocks (memory-mapped, never copied)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata_lite.kernels.qtypes import UnsupportedQuantType, check_supported

from .errors import GGUFError
from .gguf_file import GGUFFile
from .model_config import ModelConfig


@dataclass(frozen=True)
class QuantTensor:
    """A weight matrix W (n_out, n_in) as GGML block rows: raw is uint8 (n_out, row_nbytes)."""
    name: str
    qtype: QType
    n_out: int
    n_in: int
    raw: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray            # (n_embd,) float32
    attn_q: QuantTensor
    attn_k: QuantTensor
    attn_v: QuantTensor
    attn_output: QuantTensor
    ffn_norm: np.ndarray
    ffn_gate: QuantTensor
    ffn_up: QuantTensor
    ffn_down: QuantTensor
    attn_q_bias: np.ndarray | None = None
    attn_k_bias: np.ndarray | None = None
    attn_v_bias: np.ndarray | None = None
    attn_q_norm: np.ndarray | None = None   # (head_dim,) float32, qwen3
    attn_k_norm: np.ndarray | None = None


@dataclass(frozen=True)
class Weights:
    token_embd: QuantTensor
    output_norm: np.ndarray
    output: QuantTensor                      # token_embd itself when the file ties them
    layers: tuple[LayerWeights, ...]

    @property
    def nbytes(self) -> int:
        mats = [self.token_embd, self.output] if self.output is not self.token_embd else [self.token_embd]
        for lw in self.layers:
            mats += [lw.attn_q, lw.attn_k, lw.attn_v, lw.attn_output, lw.ffn_gate, lw.ffn_up, lw.ffn_down]
        return sum(m.nbytes for m in mats)


class _Reader:
    def __init__(self, gf: GGUFFile):
        self.gf = gf

    def matrix(self, name: str, n_out: int, n_in: int, optional: bool = False) -> QuantTensor | None:
        if optional and name not in self.gf.tensors:
            return None
        info = self._info(name)
        if info.shape != (n_in, n_out):
            raise GGUFError(self.gf.path, f"tensor {name!r} has shape {list(info.shape)}, expected {[n_in, n_out]}")
        try:
            qtype = check_supported(info.qtype)
        except UnsupportedQuantType as e:
            raise GGUFError(self.gf.path, f"tensor {name!r}: {e}") from None
        return QuantTensor(name, qtype, n_out, n_in, self.gf.rows(name))

    def vector(self, name: str, n: int, optional: bool = False) -> np.ndarray | None:
        if optional and name not in self.gf.tensors:
            return None
        info = self._info(name)
        if info.shape != (n,):
            raise GGUFError(self.gf.path, f"tensor {name!r} has shape {list(info.shape)}, expected [{n}]")
        return np.ascontiguousarray(self.gf.array(name), dtype=np.float32)

    def _info(self, name: str):
        info = self.gf.tensors.get(name)
        if info is None:
            raise GGUFError(self.gf.path, f"missing tensor {name!r}")
        return info


def load_layer(r: _Reader, cfg: ModelConfig, i: int) -> LayerWeights:
    """The decoder block blk.{i} (a main block, or the MTP block's own attention and FFN)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    p = f"blk.{i}."
    return LayerWeights(
        attn_norm=r.vector(p + "attn_norm.weight", cfg.n_embd),
        attn_q=r.matrix(p + "attn_q.weight", q_dim, cfg.n_embd),
        attn_k=r.matrix(p + "attn_k.weight", kv_dim, cfg.n_embd),
        attn_v=r.matrix(p + "attn_v.weight", kv_dim, cfg.n_embd),
        attn_output=r.matrix(p + "attn_output.weight", cfg.n_embd, q_dim),
        ffn_norm=r.vector(p + "ffn_norm.weight", cfg.n_embd),
        ffn_gate=r.matrix(p + "ffn_gate.weight", cfg.n_ff, cfg.n_embd),
        ffn_up=r.matrix(p + "ffn_up.weight", cfg.n_ff, cfg.n_embd),
        ffn_down=r.matrix(p + "ffn_down.weight", cfg.n_embd, cfg.n_ff),
        attn_q_bias=r.vector(p + "attn_q.bias", q_dim, optional=not cfg.qkv_bias),
        attn_k_bias=r.vector(p + "attn_k.bias", kv_dim, optional=not cfg.qkv_bias),
        attn_v_bias=r.vector(p + "attn_v.bias", kv_dim, optional=not cfg.qkv_bias),
        attn_q_norm=r.vector(p + "attn_q_norm.weight", cfg.head_dim, optional=not cfg.qk_norm),
        attn_k_norm=r.vector(p + "attn_k_norm.weight", cfg.head_dim, optional=not cfg.qk_norm),
    )


def load_weights(gf: GGUFFile, cfg: ModelConfig) -> Weights:
    """The main model (cfg.n_layers blocks; an MTP block after them is loader/mtp.py's)."""
    r = _Reader(gf)
    layers = tuple(load_layer(r, cfg, i) for i in range(cfg.n_layers))
    token_embd = r.matrix("token_embd.weight", cfg.n_vocab, cfg.n_embd)
    output = r.matrix("output.weight", cfg.n_vocab, cfg.n_embd, optional=True) or token_embd
    return Weights(token_embd, r.vector("output_norm.weight", cfg.n_embd), output, layers)
