"""strata_lite: an LLM inference engine for quantized GGUF models with its own kernels."""
from .api import LLM, GenerationOutput
from .sampling import InvalidRequest, SamplingParams

__all__ = ["LLM", "GenerationOutput", "InvalidRequest", "SamplingParams"]
__version__ = "0.1.0"
