"""Qwen2 / Qwen2.5: llama-style blocks with q/k/v biases and NEOX rope."""
from .spec import ArchSpec

SPEC = ArchSpec(name="qwen2", rope_neox=True, qkv_bias=True, qk_norm=False, default_rope_base=1_000_000.0)
