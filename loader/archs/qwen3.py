"""Qwen3: no q/k/v biases; per-head RMSNorm on q and k before rope; NEOX rope."""
from .spec import ArchSpec

SPEC = ArchSpec(name="qwen3", rope_neox=True, qkv_bias=False, qk_norm=True, default_rope_base=1_000_000.0)
