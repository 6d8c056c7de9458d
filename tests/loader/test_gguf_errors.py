"""Bad GGUF files give a GGUFError naming the file and the field or tensor, never a deep traceback."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.model_config import config_from_metadata
from strata_lite.loader.weights import load_weights
from tiny_model import write_tiny_model


def _load(path):
    gf = GGUFFile(path)
    return load_weights(gf, config_from_metadata(gf.metadata, gf.path))


def test_tiny_model_loads_with_metadata_and_views(tmp_path):
    path = write_tiny_model(tmp_path / "ok.gguf")
    gf = GGUFFile(path)
    cfg = config_from_metadata(gf.metadata, gf.path)
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("qwen2", 2, 64, 4, 2, 16)
    w = load_weights(gf, cfg)
    assert w.layers[0].attn_q.qtype == QT.Q8_0 and w.layers[0].attn_q.raw.shape == (64, 64 // 32 * 34)
    assert isinstance(w.layers[0].attn_q.raw.base, np.memmap) or isinstance(w.layers[0].attn_q.raw, np.memmap)
    assert w.output is not w.token_embd


def test_tied_output_uses_the_embedding(tmp_path):
    gf = GGUFFile(write_tiny_model(tmp_path / "tied.gguf", tied_output=True))
    assert load_weights(gf, config_from_metadata(gf.metadata, gf.path)).output.name == "token_embd.weight"


def test_wrong_magic(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError, match=r"bad\.gguf: not a GGUF file"):
        GGUFFile(p)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("cut", [10, 300, -100])
def test_truncated(tmp_path, cut):
    path = write_tiny_model(tmp_path / "full.gguf")
    data = path.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(GGUFError, match=r"short\.gguf: file is truncated"):
        GGUFFile(short)


def test_unsupported_quant_type(tmp_path):
    path = write_tiny_model(tmp_path / "q41.gguf", qtype=QT.Q4_1)
    with pytest.raises(GGUFError, match=r"q41\.gguf: tensor 'blk\.0\.attn_q\.weight'.*Q4_1 is not supported"):
        _load(path)


def test_unknown_type_id(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'output_norm\.weight' has unknown GGML type id 250"):
        GGUFFile(path)


def test_missing_tensor(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", skip_tensor="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError, match=r"m\.gguf: missing tensor 'blk\.1\.ffn_up\.weight'"):
        _load(path)


def test_unsupported_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", arch="mamba")
    gf = GGUFFile(path)
    with pytest.raises(GGUFError, match=r"unsupported architecture 'mamba' in 'general\.architecture'"):
        config_from_metadata(gf.metadata, gf.path)


def test_missing_metadata_field(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    key = b"qwen2.block_count"
    at = data.index(key)
    data[at:at + len(key)] = b"qwen2.block_cnt__"   # same length: the file stays well-formed
    path.write_bytes(bytes(data))
    gf = GGUFFile(path)
    with pytest.raises(GGUFError, match=r"missing metadata field 'qwen2\.block_count'"):
        config_from_metadata(gf.metadata, gf.path)
