"""Llama 2/3 family: no biases, "normal" (interleaved-pair) rope."""
from .spec import ArchSpec

SPEC = ArchSpec(name="llama", rope_neox=False, qkv_bias=False, qk_norm=False)
