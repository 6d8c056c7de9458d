"""Model forward functions, registered by GGUF `general.architecture`."""
from . import transformer

FORWARD = {"qwen2": transformer.forward, "qwen3": transformer.forward, "llama": transformer.forward}
