"""Known models (loader/known_models.py): a file is recognised by size and sha256 (its cache marker, or the
bytes hashed), and the MTP sidecar this package ships for the default model loads against it."""
import hashlib
import os

import numpy as np
import pytest

from strata_lite.loader import known_models as km
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.model_config import config_from_metadata
from strata_lite.loader.mtp import load_mtp_file


@pytest.fixture
def fake_known(tmp_path, monkeypatch):
    """A 4 KiB file registered as a known model with the shipped head of the default model."""
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    head = km.KNOWN_MODELS[km.DEFAULT_MODEL].mtp_head
    model = km.KnownModel("fake", "m.gguf", "model", "nopkg", 1, len(data), hashlib.sha256(data).hexdigest(),
                          mtp_head=head)
    monkeypatch.setattr(km, "KNOWN_MODELS", {"fake": model})
    return path, model, data


def test_a_file_is_known_by_size_and_hash(fake_known, tmp_path):
    path, model, data = fake_known
    assert km.known_model_of(path) == model
    assert km.shipped_mtp_head(path).endswith(os.path.join("heads", model.mtp_head))
    other = tmp_path / "other.gguf"                  # same size, other bytes
    other.write_bytes(bytes(255 - b for b in data))
    assert km.known_model_of(other) is None and km.shipped_mtp_head(other) is None
    shorter = tmp_path / "short.gguf"
    shorter.write_bytes(data[:-1])
    assert km.known_model_of(shorter) is None
    assert km.known_model_of(tmp_path / "missing.gguf") is None


def test_the_cache_marker_spares_the_hash(fake_known, monkeypatch):
    path, model, _ = fake_known
    (path.parent / "m.gguf.sha256").write_text(model.sha256 + "\n")
    monkeypatch.setattr(km.hashlib, "sha256", lambda: pytest.fail("hashed although the marker says"))
    assert km.known_model_of(path) == model


def test_a_model_without_a_shipped_head(fake_known, monkeypatch):
    path, model, _ = fake_known
    monkeypatch.setattr(km, "KNOWN_MODELS", {"fake": model.__class__(**{**model.__dict__, "mtp_head": None})})
    assert km.known_model_of(path) is not None and km.shipped_mtp_head(path) is None


def test_the_shipped_head_fits_the_default_model(default_model_path):
    """The sidecar in loader/heads/ (at most 20 MB, with its 32768-token draft vocabulary) loads against the
    default model's config, and the default model's file resolves to it."""
    head = km.shipped_mtp_head(default_model_path)
    assert head is not None and os.path.getsize(head) <= 20_000_000
    cfg = config_from_metadata(GGUFFile(default_model_path).metadata, default_model_path)
    mtp = load_mtp_file(head, cfg)
    assert mtp.draft_vocab is not None and len(mtp.draft_vocab) == 32768 and mtp.head is None
