"""DiskKV: a third KV tier, pages of computed prefixes in files that outlive the process.

Every full page a sequence commits to the prefix trie is also written to DIR/<model sha256[:16]>/ (one
file per page, written to a temporary name and renamed, so a crash leaves whole files or none). A page is
named by a hash of the tokens from position 0 to its end (and the page size): placement finds the pages
of a prompt's prefix by hashing the prompt, with no index to rebuild after a restart. At start-up the
directory is scanned; files of another model or layout, or of the wrong size (truncated), are skipped
with a log line. A file's checksum (BLAKE2b over header and KV) is checked when it is read; a corrupt
file is skipped (and deleted) and the prefix from there is read instead. Over the byte limit the least
recently used files are deleted.

File: b"SLKV1\\n", header length (u32 little-endian), header JSON (model sha256, page size, layout,
start position, the page's tokens), K pages, K scales, V pages, V scales of the page for every layer
(the host pool's layout), 32-byte BLAKE2b digest of everything before it.

Pages move between the device and the file through a one-page staging HostPool and its KVCopier (the
same copies as parking in host RAM), so the tier works for every backend.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger("strata_lite")
MAGIC = b"SLKV1\n"
DIGEST = 32
SHA_CACHE = "model-sha256.json"       # (path, size, mtime) -> sha256, so a restart does not hash again


def model_sha256(path: str, directory: Path) -> str:
    """sha256 of the model file, remembered in directory/SHA_CACHE by path, size and mtime."""
    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = directory / SHA_CACHE
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    if ident not in cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        cache[ident] = h.hexdigest()
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache), encoding="utf-8")
        os.replace(tmp, cache_file)
    return cache[ident]


class DiskKV:
    def __init__(self, directory: str, max_bytes: int, model_path: str, staging, copier):
        """staging: a HostPool of at least one page in the device cache's layout; copier: a KVCopier
        between the device cache and it."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self.sha = model_sha256(model_path, root)
        self.dir = root / self.sha[:16]
        self.dir.mkdir(exist_ok=True)
        self.max_bytes, self.staging, self.copier = int(max_bytes), staging, copier
        self.page_size = staging.page_size
        arrays = staging.arrays()
        self.layout = {"page_size": self.page_size, "shapes": [list(a[:, 0].shape) for a in arrays],
                       "dtypes": [str(a.dtype) for a in arrays]}
        self.body_bytes = sum(a[:, 0].nbytes for a in arrays)
        self.index: OrderedDict[str, int] = OrderedDict()     # key -> file bytes, least recently used first
        self.nbytes = 0
        self.stats = dict(pages_written=0, pages_read=0, pages_corrupt=0, files_deleted=0)
        self._scan()

    # names
    def keys(self, tokens, n_pages: int) -> list[str]:
        """The names of the first n_pages pages of this token sequence."""
        P = self.page_size
        a = np.asarray(tokens[:n_pages * P], dtype=np.int32)
        out = []
        h = hashlib.blake2b(digest_size=16)
        h.update(struct.pack("<I", P))
        for i in range(n_pages):
            h.update(a[i * P:(i + 1) * P].tobytes())
            out.append(h.copy().hexdigest())
        return out

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.kvp"

    def has(self, key: str) -> bool:
        return key in self.index

    # start-up
    def _scan(self) -> None:
        files = sorted(self.dir.glob("*.kvp"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            why = self._check_header(path)
            if why:
                log.warning("KV disk tier: skipping %s: %s", path, why)
                continue
            size = path.stat().st_size
            self.index[path.stem] = size
            self.nbytes += size
        for tmp in self.dir.glob("*.tmp"):          # a write the process did not finish
            tmp.unlink(missing_ok=True)
        if self.index:
            log.info("KV disk tier: %d pages (%.1f MiB) of this model in %s", len(self.index), self.nbytes / 2**20,
                     self.dir)
        self._enforce_quota()

    def _read_header(self, f) -> tuple[dict, bytes]:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a KV page file")
        raw_len = f.read(4)
        if len(raw_len) != 4:
            raise ValueError("truncated")
        (n,) = struct.unpack("<I", raw_len)
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("truncated")
        return json.loads(raw), MAGIC + raw_len + raw

    def _check_header(self, path: Path) -> str | None:
        try:
            with open(path, "rb") as f:
                header, raw = self._read_header(f)
        except (OSError, ValueError) as e:
            return str(e)
        if header.get("model_sha256") != self.sha:
            return "written for another model"
        if header.get("layout") != self.layout:
            return "another KV layout (page size, layers, heads)"
        if path.stat().st_size != len(raw) + self.body_bytes + DIGEST:
            return "truncated"
        return None

    # pages in and out
    def write(self, key: str, tokens, start: int, dev_page: int) -> None:
        """Write device page dev_page (positions start .. start + page_size of tokens) as `key`."""
        if key in self.index:
            self.index.move_to_end(key)
            return
        self.copier.copy_pages_to_host([dev_page], [0])
        header = json.dumps({"model_sha256": self.sha, "layout": self.layout, "start": int(start),
                             "tokens": [int(t) for t in tokens[start:start + self.page_size]]}).encode("utf-8")
        h = hashlib.blake2b(digest_size=DIGEST)
        path, tmp = self._path(key), self._path(key).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for part in [MAGIC, struct.pack("<I", len(header)), header] + [a[:, 0].tobytes() for a in self.staging.arrays()]:
                h.update(part)
                f.write(part)
            f.write(h.digest())
        os.replace(tmp, path)
        size = path.stat().st_size
        self.index[key] = size
        self.nbytes += size
        self.stats["pages_written"] += 1
        self._enforce_quota()

    def read(self, key: str, dev_page: int) -> bool:
        """Device page dev_page := the file `key`; False (the file logged and deleted) when it is missing,
        truncated or corrupt."""
        path = self._path(key)
        try:
            data = path.read_bytes()
            n = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])[0] if len(data) >= len(MAGIC) + 4 else 0
            head = len(MAGIC) + 4 + n
            ok = (data[:len(MAGIC)] == MAGIC and len(data) == head + self.body_bytes + DIGEST
                  and hashlib.blake2b(data[:-DIGEST], digest_size=DIGEST).digest() == data[-DIGEST:]
                  and json.loads(data[len(MAGIC) + 4:head]).get("model_sha256") == self.sha)
        except (OSError, ValueError) as e:
            log.warning("KV disk tier: cannot read %s: %s", path, e)
            ok = False
        if not ok:
            self.stats["pages_corrupt"] += 1
            log.warning("KV disk tier: %s is corrupt or truncated; skipped and deleted (its tokens are read)", path)
            self._delete(key)
            return False
        at = head
        for a in self.staging.arrays():
            page = a[:, 0]
            a[:, 0] = np.frombuffer(data, dtype=a.dtype, count=page.size, offset=at).reshape(page.shape)
            at += page.nbytes
        self.copier.copy_pages_to_device([0], [dev_page])
        self.index.move_to_end(key)
        self.stats["pages_read"] += 1
        return True

    def _delete(self, key: str) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.nbytes -= size
        self._path(key).unlink(missing_ok=True)
        self.stats["files_deleted"] += 1

    def _enforce_quota(self) -> None:
        while self.nbytes > self.max_bytes and self.index:
            self._delete(next(iter(self.index)))
