"""Fuzzing the GGUF reader: corrupt and truncated copies of a real tiny GGUF (tests/tiny_model.py) and
random bytes. Opening a file, viewing every tensor and building its tokenizer and chat template either
work or raise the loader's typed errors (GGUFError, ChatTemplateError), with bounded memory.

Why hypothesis and not atheris: atheris 3.0 installs here (a manylinux wheel for CPython 3.11), but it
has no Windows wheels (the project supports Windows), its libFuzzer driver ends the process on the
first finding instead of reporting a pytest failure, and coverage-guided runs are not reproducible in
a fixed CI budget. The tests below are hypothesis with a fixed seed (derandomize=True); a ten-minute
atheris run over the same entry point (open + tokenizer + every tensor view) was used once while
writing them: it found the int64 shape overflow (rows() reshaping to (576460752303423552, 0)), which
test_hostile_header_fields finds too, besides general.alignment = 0; all are regression cases below.

No hang: every loop of the reader consumes bytes of the header (a count larger than the remaining
bytes can hold fails at once), so a run is bounded by the file size; pytest's overall timeout catches a
regression rather than a timed assertion here.
"""
from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from strata_lite.loader.chat_template import ChatTemplate, ChatTemplateError
from strata_lite.loader.errors import GGUFError
from strata_lite.loader.gguf_file import GGUFFile
from strata_lite.loader.tokenizer import Tokenizer
from tiny_model import write_tiny_model

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PEAK_BYTES = 16 * 2**20          # Python + numpy allocations while opening a ~40 KB file
HOSTILE_U64 = [0, 1, 2**31, 2**32 - 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
HOSTILE_U32 = [0, 1, 4, 7, 8, 9, 12, 13, 31, 2**31, 2**32 - 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(bytes of a 1-layer tiny model, [(offset, width) of every count/length/type/shape/offset field
    of its header], path to write fuzzed copies to)."""
    d = tmp_path_factory.mktemp("fuzz_gguf")
    data = write_tiny_model(d / "tiny.gguf", n_layers=1).read_bytes()
    return data, header_fields(data), d / "fuzzed.gguf"


def header_fields(data: bytes) -> list[tuple[int, int]]:
    """Walk a well-formed GGUF v3 header; list where each length, count, type id, dimension and tensor
    offset sits (these are what a corrupt file gets wrong)."""
    u32 = lambda at: struct.unpack_from("<I", data, at)[0]          # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", data, at)[0]          # noqa: E731
    fields, n_tensors, n_kv, pos = [(8, 8), (16, 8)], u64(8), u64(16), 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(at):
        fields.append((at, 8))
        return at + 8 + u64(at)

    for _ in range(n_kv):
        pos = string(pos)
        vtype = u32(pos)
        fields.append((pos, 4))
        pos += 4
        if vtype == 8:
            pos = string(pos)
        elif vtype == 9:
            etype, count = u32(pos), u64(pos + 4)
            fields += [(pos, 4), (pos + 4, 8)]
            pos += 12
            for _ in range(count if etype == 8 else 0):
                pos = string(pos)
            pos += 0 if etype == 8 else count * sizes[etype]
        else:
            pos += sizes[vtype]
    for _ in range(n_tensors):
        pos = string(pos)
        n_dims = u32(pos)
        fields += [(pos, 4)] + [(pos + 4 + 8 * k, 8) for k in range(n_dims)]
        pos += 4 + 8 * n_dims
        fields += [(pos, 4), (pos + 4, 8)]          # GGML type id, offset in the data section
        pos += 12
    return fields


def open_everything(path) -> None:
    """What loading a model does with a file's header: tensor views, tokenizer, chat template."""
    try:
        gf = GGUFFile(path)
        for name, info in gf.tensors.items():
            rows = gf.rows(name)
            assert rows.size == info.nbytes
            if info.qtype.name in ("F32", "F16", "BF16"):
                gf.array(name)
        if "tokenizer.ggml.model" in gf.metadata:
            tok = Tokenizer.from_gguf_metadata(gf.metadata, str(path))
            ChatTemplate.from_gguf_metadata(gf.metadata, tok, str(path))
    except (GGUFError, ChatTemplateError):
        pass


def check(path, data: bytes) -> None:
    path.write_bytes(data)
    tracemalloc.start()
    try:
        open_everything(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"opening a {len(data)}-byte file allocated {peak:,} bytes"


def test_header_walk_sees_every_field(tiny):
    data, fields, _ = tiny
    gf = GGUFFile(write_tiny_model(tiny[2].with_name("again.gguf"), n_layers=1))
    assert len(fields) > 3 * len(gf.metadata) + 4 * len(gf.tensors)


@FUZZ
@given(st.data())
def test_truncated(tiny, data):
    raw, _, path = tiny
    cut = data.draw(st.integers(0, len(raw) - 1))
    check(path, raw[:cut])


@FUZZ
@given(st.data())
def test_hostile_header_fields(tiny, data):
    """Up to three header fields (lengths, counts, value/element/GGML types, dimensions, tensor offsets)
    set to extreme or random values."""
    raw, fields, path = tiny
    buf = bytearray(raw)
    for at, width in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3)):
        pool = HOSTILE_U64 if width == 8 else HOSTILE_U32
        value = data.draw(st.one_of(st.sampled_from(pool), st.integers(0, 2 ** (8 * width) - 1)))
        buf[at:at + width] = value.to_bytes(width, "little")
    check(path, bytes(buf))


@FUZZ
@given(st.data())
def test_byte_flips(tiny, data):
    """Random bytes overwritten, mostly in the header (the tensor data is opaque to the reader)."""
    raw, fields, path = tiny
    header_end = fields[-1][0] + 8
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, header_end - 1) | st.integers(0, len(raw) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    check(path, bytes(buf))


@FUZZ
@given(version=st.sampled_from([1, 2, 3, 4, 2**32 - 1]), tail=st.binary(max_size=512))
def test_random_bytes_after_the_magic(tiny, version, tail):
    check(tiny[2], b"GGUF" + struct.pack("<I", version) + tail)


@settings(FUZZ, max_examples=50)
@given(st.binary(max_size=256))
def test_random_bytes(tiny, raw):
    check(tiny[2], raw)


# Regression cases (each raised something other than GGUFError before the fix in gguf_file.py).

def patched(raw: bytes, fields, which: int, value: int) -> bytes:
    at, width = fields[which]
    return raw[:at] + value.to_bytes(width, "little") + raw[at + width:]


def tensor_fields(data: bytes, fields, name: bytes) -> list[int]:
    """Indices in `fields` of tensor `name`: [name length, n_dims, dims..., type, offset]."""
    at = data.index(struct.pack("<Q", len(name)) + name)
    k = next(i for i, (pos, _) in enumerate(fields) if pos == at)
    n_dims = struct.unpack_from("<I", data, fields[k + 1][0])[0]
    return list(range(k, k + 4 + n_dims))


@pytest.mark.parametrize("dims, problem", [
    ([2**63, 2**63], "elements"),                 # int64 product wrapped to 0: accepted as an empty tensor
    ([2**64 - 64, 3], "elements"),                # numpy: "Maximum allowed dimension exceeded"
])
def test_regression_shapes_that_overflow_int64(tiny, dims, problem):
    raw, fields, path = tiny
    idx = tensor_fields(raw, fields, b"output_norm.weight")
    at = fields[idx[1]][0]
    rest = at + 4 + 8 * (len(idx) - 4)
    path.write_bytes(raw[:at] + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                     + raw[rest:])
    with pytest.raises(GGUFError, match=problem):
        GGUFFile(path)


def test_regression_empty_dimension_gives_empty_rows(tiny):
    """A dimension of 0 used to divide by zero in rows(); it is an empty (0, row bytes) view now."""
    raw, fields, path = tiny
    idx = tensor_fields(raw, fields, b"token_embd.weight")
    path.write_bytes(patched(raw, fields, idx[3], 0))          # (64, n_vocab) -> (64, 0)
    gf = GGUFFile(path)
    assert gf.rows("token_embd.weight").shape == (0, 64 // 32 * 34)


def test_regression_too_many_dimensions(tiny):
    raw, fields, path = tiny
    idx = tensor_fields(raw, fields, b"output_norm.weight")
    path.write_bytes(patched(raw, fields, idx[1], 2**32 - 1))
    with pytest.raises(GGUFError, match="4294967295 dimensions"):
        GGUFFile(path)


@pytest.mark.parametrize("value", [0, 3, 96, "32", 1.5])
def test_regression_bad_alignment(tmp_path, value):
    """general.alignment 0 divided by zero, a string raised int()'s ValueError."""
    path = write_tiny_model(tmp_path / "a.gguf", n_layers=1)
    raw = path.read_bytes()
    key = b"general.alignment"
    kind, payload = ((8, struct.pack("<Q", len(value)) + value.encode()) if isinstance(value, str) else
                     (6, struct.pack("<f", value)) if isinstance(value, float) else (4, struct.pack("<I", value)))
    field = struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + payload
    n_kv = struct.unpack_from("<Q", raw, 16)[0]
    path.write_bytes(raw[:16] + struct.pack("<Q", n_kv + 1) + field + raw[24:])
    with pytest.raises(GGUFError, match="general.alignment = .* is not a power of two"):
        GGUFFile(path)


def test_regression_string_array_count_beyond_the_file(tiny):
    """A string array declaring 2**62 entries fails at once instead of reading strings until the end."""
    raw, fields, path = tiny
    at = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4
    path.write_bytes(raw[:at] + struct.pack("<Q", 2**62) + raw[at + 8:])
    with pytest.raises(GGUFError, match="tokenizer.ggml.tokens: 4,611,686,018,427,387,904 strings declared"):
        GGUFFile(path)
