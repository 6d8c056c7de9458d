"""Fixtures of the HTTP server tests. The fake engine is loaded as `strata_server_fake_engine`, a name
that cannot clash with tests/engine/fake_engine.py when both folders run in one pytest session."""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("strata_server_fake_engine", Path(__file__).with_name("fake_engine.py"))
fake_engine = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fake_engine
_spec.loader.exec_module(fake_engine)
