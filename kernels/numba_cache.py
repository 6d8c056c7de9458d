"""Numba's on-disk cache keyed on a whole folder of kernels, not on one file.

Numba stamps a cached function with its own source file (mtime and size) and its closure's values, not with the
files of the jitted functions it calls and compiles in: after a kernel file changes, a cached caller in another
file of the folder loads the old callee with no warning. `stamp_folder(path)` makes every cached function defined
in that folder carry one stamp, a digest of all the folder's `*.py` sources, so an edit to any of them compiles
them all again. The locators are Numba's own three (NUMBA_CACHE_DIR, the source's __pycache__, the user-wide
folder, in Numba's order) with only the stamp replaced; functions outside the stamped folders, and a process that
sets NUMBA_CACHE_LOCATOR_CLASSES, keep Numba's behaviour. Installed packages never change under a running
install, so there the stamp only costs one digest of the folder per import (~1 ms)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core import caching

_FOLDERS: dict[Path, str] = {}     # stamped folder -> digest of its *.py sources


def folder_digest(folder: Path) -> str:
    """sha256 (16 hex digits) of every *.py in `folder`, by name then content, in name order."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def stamp_folder(module_file: str) -> None:
    """Stamp every cached Numba function defined in the folder of `module_file` (a package's __init__.py) with the
    folder's digest. Call it before the folder's modules are imported: Numba picks a function's locator when its
    decorator runs."""
    folder = Path(module_file).resolve().parent
    _FOLDERS[folder] = folder_digest(folder)


def _stamp_of(py_file: str) -> str | None:
    return _FOLDERS.get(Path(py_file).resolve().parent)


def _stamped(base):
    """`base` (one of Numba's locator classes) for files in a stamped folder, with the folder's digest as stamp."""

    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            if _stamp_of(py_file) is None:
                return None
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return ("strata_lite folder digest", _stamp_of(self._py_file))

    Locator.__name__ = Locator.__qualname__ = f"FolderStamped{base.__name__}"
    return Locator


def _numba_locator(name: str):
    """Numba's locator class `name` (numba 0.60 spells them with a leading underscore)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


_NUMBA_LOCATORS = tuple(_numba_locator(name) for name in
                        ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"))
if not any(getattr(cls, "__name__", "").startswith("FolderStamped") for cls in caching.CacheImpl._locator_classes):
    caching.CacheImpl._locator_classes = [_stamped(base) for base in _NUMBA_LOCATORS] + \
        list(caching.CacheImpl._locator_classes)
