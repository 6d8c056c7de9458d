"""Speculative decoding: drafts from the conversation itself (suffix_index.py) and how many drafted tokens
each sequence verifies per step (controller.py); the scheduler verifies them (docs/speculative.md)."""
from .controller import SpecController, parse_spec
from .suffix_index import SuffixDrafter

__all__ = ["SpecController", "SuffixDrafter", "parse_spec"]
