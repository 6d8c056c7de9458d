"""ModelConfig: the frozen architecture numbers of a GGUF model, read from its metadata."""
from __future__ import annotations

from dataclasses import dataclass

from .archs import ARCHITECTURES
from .errors import GGUFError


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int              # decoder blocks of the main forward (block_count less the MTP blocks)
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float
    rope_neox: bool
    rms_eps: float
    qkv_bias: bool
    qk_norm: bool
    n_mtp_layers: int = 0      # `{arch}.nextn_predict_layers`: MTP blocks after the main ones (loader/mtp.py)


def config_from_metadata(meta: dict, path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFError(path, "missing metadata field 'general.architecture'")
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise GGUFError(path, f"unsupported architecture {arch!r} in 'general.architecture' "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")

    def field(key: str, default=None):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise GGUFError(path, f"missing metadata field {full!r}")
        return default

    n_embd, n_heads = int(field("embedding_length")), int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", n_embd // n_heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(field("vocab_size", len(tokens) if tokens is not None else -1))
    if n_vocab <= 0:
        raise GGUFError(path, "missing metadata fields 'tokenizer.ggml.tokens' and "
                              f"'{arch}.vocab_size': cannot tell the vocabulary size")
    n_blocks, n_mtp = int(field("block_count")), int(field("nextn_predict_layers", 0))
    if not 0 <= n_mtp <= 1 or n_mtp >= n_blocks:
        raise GGUFError(path, f"'{arch}.nextn_predict_layers' = {n_mtp}: one MTP block at most is supported, "
                              f"after at least one main block (block_count {n_blocks})")
    return ModelConfig(
        arch=arch,
        name=str(meta.get("general.name", arch)),
        n_layers=n_blocks - n_mtp,
        n_embd=n_embd,
        n_ff=int(field("feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        n_rot=int(field("rope.dimension_count", head_dim)),
        n_vocab=n_vocab,
        n_ctx_train=int(field("context_length")),
        rope_freq_base=float(field("rope.freq_base", spec.default_rope_base)),
        rope_neox=spec.rope_neox,
        rms_eps=float(field("attention.layer_norm_rms_epsilon")),
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        n_mtp_layers=n_mtp,
    )
