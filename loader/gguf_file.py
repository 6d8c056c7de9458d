"""Read a GGUF file: metadata as plain Python values, tensors as memory-mapped uint8 block rows.

`gguf.GGUFReader` builds a Python object per array element; on a 152K-token vocabulary that takes
~12 s, so the header is parsed here directly (well under a second). Tensor data is never copied:
each tensor is a read-only view into one `np.memmap` of the file.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from .errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                  # GGML_MAX_DIMS
MAX_ELEMENTS = 2**63 - 1      # ggml counts elements in int64

# GGUF value type id -> numpy dtype for scalars and numeric arrays (8 = string, 9 = array)
_NUMERIC = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: QType
    shape: tuple[int, ...]   # GGML order: shape[0] is the row length (ne0)
    offset: int              # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.pos, self.path = buf, 0, path
        self.mv = memoryview(buf)
        self.last_etype = None   # element type of the last array read (for GGUFFile.field_types)

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(self.path, f"file is truncated while reading {what} (needs byte {self.pos + n:,}, file has {len(self.buf):,})")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str):
        if vtype == _STRING:
            return self.string(key)
        if vtype == _ARRAY:
            etype, count = self.scalar("<I", key), self.scalar("<Q", key)
            self.last_etype = etype
            if etype == _STRING:
                room = (len(self.buf) - self.pos) // 8     # every string needs at least its 8-byte length
                if count > room:
                    raise GGUFError(self.path, f"file is truncated while reading {key}: {count:,} strings "
                                               f"declared, the {room * 8:,} bytes left hold at most {room:,}")
                return [self.string(key) for _ in range(count)]
            if etype not in _NUMERIC:
                raise GGUFError(self.path, f"field {key!r}: unsupported array element type {etype}")
            dtype = np.dtype(_NUMERIC[etype])
            raw = self.take(count * dtype.itemsize, key)
            return np.frombuffer(raw, dtype=dtype).copy()
        if vtype not in _NUMERIC:
            raise GGUFError(self.path, f"field {key!r}: unknown value type {vtype}")
        dtype = np.dtype(_NUMERIC[vtype])
        v = np.frombuffer(self.take(dtype.itemsize, key), dtype=dtype)[0]
        return bool(v) if vtype == 7 else v.item()


class GGUFFile:
    """An opened GGUF file. `metadata` maps keys to str/int/float/bool/list[str]/np.ndarray;
    `field_types` maps each key to its GGUF value type id and, for arrays, the element type id
    (else None), so that a writer can reproduce the field exactly."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GGUFError(self.path, "no such file")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GGUFError(self.path, f"cannot map the file: {e}") from None
        cur = _Cursor(self._map, self.path)
        magic = bytes(cur.take(4, "the magic number")) if len(self._map) >= 4 else bytes(self._map)
        if magic != GGUF_MAGIC:
            raise GGUFError(self.path, f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        self.version = cur.scalar("<I", "the version")
        if self.version not in (2, 3):
            raise GGUFError(self.path, f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = cur.scalar("<Q", "the tensor count"), cur.scalar("<Q", "the metadata count")
        self.metadata: dict = {}
        self.field_types: dict[str, tuple[int, int | None]] = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key")
            vtype = cur.scalar("<I", key)
            self.metadata[key] = cur.value(vtype, key)
            self.field_types[key] = (vtype, cur.last_etype if vtype == _ARRAY else None)
        infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        align = self._alignment()
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, rel in infos:
            info = TensorInfo(name, qtype, shape, data_start + rel, _tensor_nbytes(self.path, name, qtype, shape))
            if info.offset + info.nbytes > len(self._map):
                raise GGUFError(self.path, f"file is truncated: tensor {name!r} needs bytes up to "
                                           f"{info.offset + info.nbytes:,}, file has {len(self._map):,}")
            self.tensors[name] = info
        self._release_header(data_start)

    def _release_header(self, end: int) -> None:
        """Drop the mapped pages of the header (metadata and tensor infos, parsed into copies above) from the
        process: ~6 MiB of vocabulary and merge strings on a 152K-token vocabulary (docs/cpu.md). Reading
        them again just faults them back in from the page cache."""
        mm, hi = getattr(self._map, "_mmap", None), end // mmap.PAGESIZE * mmap.PAGESIZE
        if mm is None or not hasattr(mm, "madvise") or hi <= 0:
            return
        try:
            mm.madvise(mmap.MADV_DONTNEED, 0, hi)
        except (OSError, ValueError):
            pass

    def _alignment(self) -> int:
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise GGUFError(self.path, f"general.alignment = {align!r} is not a power of two")
        return align

    def _read_tensor_info(self, cur: _Cursor):
        name = cur.string("a tensor name")
        n_dims = cur.scalar("<I", name)
        if n_dims > MAX_DIMS:
            raise GGUFError(self.path, f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        shape = tuple(cur.scalar("<Q", name) for _ in range(n_dims))
        type_id = cur.scalar("<I", name)
        try:
            qtype = QType(type_id)
        except ValueError:
            raise GGUFError(self.path, f"tensor {name!r} has unknown GGML type id {type_id}") from None
        return name, qtype, shape, cur.scalar("<Q", name)

    def rows(self, name: str) -> np.ndarray:
        """uint8 (n_rows, row_nbytes) view of a tensor's blocks (1-D tensors: one row)."""
        info = self.tensors[name]
        elems, block_nbytes = GGML_QUANT_SIZES[info.qtype]
        view = self._map[info.offset:info.offset + info.nbytes]
        return view.reshape(math.prod(info.shape[1:]), info.shape[0] // elems * block_nbytes)

    def array(self, name: str) -> np.ndarray:
        """A float tensor (F32/F16/BF16) as float32 in numpy order (reversed GGML shape)."""
        info = self.tensors[name]
        raw = self._map[info.offset:info.offset + info.nbytes]
        if info.qtype == QType.F32:
            arr = raw.view(np.float32)
        elif info.qtype == QType.F16:
            arr = raw.view(np.float16).astype(np.float32)
        elif info.qtype == QType.BF16:
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise GGUFError(self.path, f"tensor {name!r} is {info.qtype.name}; expected a float type")
        return arr.reshape(tuple(reversed(info.shape)))


def _tensor_nbytes(path: str, name: str, qtype: QType, shape: tuple[int, ...]) -> int:
    if qtype not in GGML_QUANT_SIZES:
        raise GGUFError(path, f"tensor {name!r} has GGML type {qtype.name} with unknown block size")
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if not shape or shape[0] % elems:
        raise GGUFError(path, f"tensor {name!r}: row length {shape[0] if shape else 0} is not a multiple of "
                              f"the {qtype.name} block ({elems})")
    n = math.prod(shape)      # Python ints: a corrupt shape must not wrap around in int64
    if n > MAX_ELEMENTS:
        raise GGUFError(path, f"tensor {name!r}: shape {list(shape)} has {n:,} elements (at most {MAX_ELEMENTS:,})")
    return n // elems * nbytes


def read_metadata(path: str | os.PathLike) -> dict:
    return GGUFFile(path).metadata
