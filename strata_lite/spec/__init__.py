"""Speculative decoding: drafts from the conversation itself (suffix_index.py) or from the model's MTP block
(mtp_drafter.py), how many drafted tokens each sequence verifies per step and from which source
(controller.py); the scheduler verifies them (docs/speculative.md). generate.py runs it for the LLM API."""
from .controller import SpecController, parse_spec
from .suffix_index import SuffixDrafter

__all__ = ["SpecController", "SuffixDrafter", "parse_spec"]
