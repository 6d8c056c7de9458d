"""Importance-matrix files: read and write.

Two layouts (docs/quantize.md):

* **GGUF** (llama.cpp's llama-imatrix format, the default): `general.type` = "imatrix",
  `imatrix.datasets` (string array), `imatrix.chunk_count`, `imatrix.chunk_size` (uint32); per weight
  matrix NAME two F32 tensors: `NAME.in_sum2` (ne = [n_cols, n_mat]: Σ over tokens of x_j²) and
  `NAME.counts` (ne = [1, n_mat]: the number of tokens). Importance = in_sum2 / counts.
* **npz** (the golden sets' `imatrix_argparse20.npz`): one float32 array per matrix NAME holding the
  mean of x_j² (= in_sum2 / counts) and `__count__NAME` = the number of tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .errors import GGUFError

COUNT_PREFIX = "__count__"


@dataclass
class ImatrixData:
    sums: dict[str, np.ndarray] = field(default_factory=dict)     # name -> float64 (n_mat, n_cols): Σ x²
    counts: dict[str, np.ndarray] = field(default_factory=dict)   # name -> float64 (n_mat,): tokens seen
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def weights(self) -> dict[str, np.ndarray]:
        """name -> float32 importance (mean of x² per input column, experts concatenated)."""
        out = {}
        for name, s in self.sums.items():
            c = np.maximum(self.counts[name], 1.0)
            out[name] = (s / c[:, None]).reshape(-1).astype(np.float32)
        return out

    def add(self, name: str, x: np.ndarray) -> None:
        """Accumulate activations x (n_tok, n_cols) entering matrix `name`."""
        x = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
        s = np.einsum("ij,ij->j", x, x)
        if name in self.sums:
            if self.sums[name].shape[1] != s.shape[0]:
                raise ValueError(f"imatrix entry {name!r}: {s.shape[0]} columns, had {self.sums[name].shape[1]}")
            self.sums[name][0] += s
            self.counts[name][0] += x.shape[0]
        else:
            self.sums[name] = s[None, :].copy()
            self.counts[name] = np.array([float(x.shape[0])])


def save_imatrix(path: str | os.PathLike, data: ImatrixData) -> None:
    """GGUF unless the name ends in .npz (then the golden npz layout)."""
    path = os.fspath(path)
    if path.endswith(".npz"):
        arrays = {}
        for name, w in sorted(data.weights().items()):
            arrays[name] = w
            arrays[COUNT_PREFIX + name] = np.array(int(round(float(data.counts[name].max()))))
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return
    from gguf import GGUFValueType as VT, GGUFWriter
    w = GGUFWriter(path, arch="imatrix")
    w.kv_data[0].clear()                  # an imatrix file has no general.architecture
    w.add_key_value("general.type", "imatrix", VT.STRING)
    if data.datasets:
        w.add_key_value("imatrix.datasets", list(data.datasets), VT.ARRAY, sub_type=VT.STRING)
    w.add_key_value("imatrix.chunk_count", int(data.chunk_count), VT.UINT32)
    w.add_key_value("imatrix.chunk_size", int(data.chunk_size), VT.UINT32)
    for name in sorted(data.sums):
        w.add_tensor(name + ".in_sum2", np.ascontiguousarray(data.sums[name], dtype=np.float32))
        w.add_tensor(name + ".counts", np.asarray(data.counts[name], dtype=np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_imatrix(path: str | os.PathLike) -> ImatrixData:
    """Read either layout (told apart by the file's first bytes)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(path, "no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path)
    if magic[:2] == b"PK":
        return _load_npz(path)
    raise GGUFError(path, f"not an imatrix file (GGUF or npz expected, starts with {magic!r})")


def _load_gguf(path: str) -> ImatrixData:
    from .gguf_file import GGUFFile
    gf = GGUFFile(path)
    kind = gf.metadata.get("general.type")
    if kind != "imatrix":
        raise GGUFError(path, f"not an imatrix file (general.type is {kind!r}, expected 'imatrix')")
    data = ImatrixData(datasets=list(gf.metadata.get("imatrix.datasets", [])),
                       chunk_count=int(gf.metadata.get("imatrix.chunk_count", 0)),
                       chunk_size=int(gf.metadata.get("imatrix.chunk_size", 0)))
    for tname in gf.tensors:
        if not tname.endswith(".in_sum2"):
            continue
        name = tname[:-len(".in_sum2")]
        if name + ".counts" not in gf.tensors:
            raise GGUFError(path, f"tensor {tname!r} has no matching {name + '.counts'!r}")
        sums = gf.array(tname).astype(np.float64)
        counts = gf.array(name + ".counts").astype(np.float64).reshape(-1)
        sums = sums.reshape(len(counts), -1)
        data.sums[name], data.counts[name] = sums, counts
    if not data.sums:
        raise GGUFError(path, "imatrix file has no '<name>.in_sum2' tensors")
    return data


def _load_npz(path: str) -> ImatrixData:
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise GGUFError(path, f"cannot read the npz imatrix: {e}") from None
    data = ImatrixData()
    with z:
        for key in z.files:
            if key.startswith(COUNT_PREFIX):
                continue
            mean = np.asarray(z[key], dtype=np.float64).reshape(1, -1)
            ckey = COUNT_PREFIX + key
            count = float(z[ckey]) if ckey in z.files else 1.0
            data.sums[key], data.counts[key] = mean * count, np.array([count])
    if not data.sums:
        raise GGUFError(path, "npz imatrix has no entries")
    n = max(float(c.max()) for c in data.counts.values())
    data.chunk_size = 512
    data.chunk_count = int(n // 512)
    return data
