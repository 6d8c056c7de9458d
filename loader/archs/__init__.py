"""Per-architecture facts read from `general.architecture`; one small module each."""
from .llama import SPEC as _llama
from .qwen2 import SPEC as _qwen2
from .qwen3 import SPEC as _qwen3
from .spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in (_qwen2, _qwen3, _llama)}
