"""Model classes, registered by GGUF `general.architecture`."""
from .transformer import Transformer

MODELS = {"qwen2": Transformer, "qwen3": Transformer, "llama": Transformer}
